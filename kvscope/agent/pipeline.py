"""The pipeline: the one owner of aggregated state.

Sources hand it :mod:`kvscope.events` events; it folds them into counters, gauges and
histograms and keeps a ring of one-second samples for the dashboard. Sinks (the exporter, the
HTTP API) read consistent copies through :meth:`Pipeline.snapshot` and :meth:`Pipeline.samples`.
Thread-safe: sources and sinks run on different threads.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvscope import events as ev
from kvscope.exporter.catalog import TRANSFER_SECONDS_BUCKETS, TTFT_SECONDS_BUCKETS


@dataclass
class Histogram:
    """Observations counted per bucket. ``counts[i]``: observations <= ``buckets[i]`` and above
    the previous bound; the last entry counts those above every bound."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum)


@dataclass
class Snapshot:
    """A consistent copy of the pipeline's state. Keys: ``source`` names, ``"src->dst"`` for
    transfers, tier names; bytes and seconds in base units; ``tiers``: dict[tier, TierSnapshot].
    """

    prompt_tokens: dict[str, int]
    transfer_bytes: dict[str, int]
    transfer_blocks: dict[str, int]
    transfer_seconds: dict[str, Histogram]
    evicted_blocks: dict[str, int]
    tiers: dict[str, ev.TierSnapshot]
    requests: int
    ttft_seconds: Histogram
    recent_ttft: list[float]
    events_received: dict[str, int]


def transfer_key(src: str, dst: str) -> str:
    """The ``"src->dst"`` key transfers are aggregated under."""
    return f"{src}->{dst}"


class Pipeline:
    """Aggregates events. ``recent``: how many recent TTFTs to keep for percentiles;
    ``history``: how many one-second samples to keep (default one hour)."""

    def __init__(self, recent: int = 10_000, history: int = 3600) -> None:
        self._lock = threading.Lock()
        self._prompt_tokens: Counter[str] = Counter()
        self._transfer_bytes: Counter[str] = Counter()
        self._transfer_blocks: Counter[str] = Counter()
        self._transfer_seconds: dict[str, Histogram] = {}
        self._evicted_blocks: Counter[str] = Counter()
        self._tiers: dict[str, ev.TierSnapshot] = {}
        self._requests = 0
        self._ttft = Histogram(TTFT_SECONDS_BUCKETS)
        self._recent_ttft: deque[float] = deque(maxlen=recent)
        self._events_received: Counter[str] = Counter()
        self._samples: deque[dict] = deque(maxlen=history)

    def ingest(self, source: str, events: Iterable[object]) -> None:
        """Fold ``events`` from emitter ``source`` into the state."""
        with self._lock:
            n = 0
            for event in events:
                self._apply(event)
                n += 1
            self._events_received[source] += n

    def _apply(self, event: object) -> None:
        match event:
            case ev.Lookup(tokens=tokens):
                self._prompt_tokens.update(tokens)
            case ev.Transfer(ok=True):
                key = transfer_key(event.src, event.dst)
                self._transfer_bytes[key] += event.bytes
                self._transfer_blocks[key] += event.blocks
                hist = self._transfer_seconds.setdefault(key, Histogram(TRANSFER_SECONDS_BUCKETS))
                hist.observe(event.duration)
            case ev.Eviction():
                self._evicted_blocks[event.tier] += event.blocks
            case ev.TierSnapshot():
                self._tiers[event.tier] = event
            case ev.RequestFinished():
                self._requests += 1
                self._ttft.observe(event.ttft)
                self._recent_ttft.append(event.ttft)

    def snapshot(self) -> Snapshot:
        """A consistent copy of the aggregated state."""
        with self._lock:
            return Snapshot(
                prompt_tokens=dict(self._prompt_tokens),
                transfer_bytes=dict(self._transfer_bytes),
                transfer_blocks=dict(self._transfer_blocks),
                transfer_seconds={k: h.copy() for k, h in self._transfer_seconds.items()},
                evicted_blocks=dict(self._evicted_blocks),
                tiers=dict(self._tiers),
                requests=self._requests,
                ttft_seconds=self._ttft.copy(),
                recent_ttft=list(self._recent_ttft),
                events_received=dict(self._events_received),
            )

    def record_sample(self, ts: float, host_memory_available: float) -> None:
        """Append a one-second sample: cumulative counters and current gauges at ``ts``."""
        with self._lock:
            self._samples.append({
                "ts": ts,
                "prompt_tokens": dict(self._prompt_tokens),
                "transfer_bytes": dict(self._transfer_bytes),
                "tier_resident_bytes": {t: s.resident_bytes for t, s in self._tiers.items()},
                "tier_capacity_bytes": {t: s.capacity_bytes for t, s in self._tiers.items()},
                "host_memory_available_bytes": host_memory_available,
            })

    def samples(self, since: float | None = None) -> list[dict]:
        """Samples with ``ts > since`` (all when None), oldest first."""
        with self._lock:
            return [s for s in self._samples if since is None or s["ts"] > since]
