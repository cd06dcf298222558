"""The pipeline: the one owner of aggregated state.

Sources hand it :mod:`kvscope.events` events; it folds them into counters, gauges and
histograms, assembles per-request records into a bounded table, and keeps a ring of one-second
samples for the dashboard. Sinks (the exporter, the HTTP API, the store, OTLP) read consistent
copies through :meth:`Pipeline.snapshot`, :meth:`Pipeline.samples` and :attr:`Pipeline.requests`,
or subscribe to finished requests. Thread-safe: sources and sinks run on different threads.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvscope import events as ev
from kvscope.agent.requests import RequestAssembler, RequestRecord, RequestTable
from kvscope.exporter.catalog import (EVICTED_HITS_BUCKETS, LATENCY_SECONDS_BUCKETS,
                                      RESIDENCY_SECONDS_BUCKETS, TRANSFER_SECONDS_BUCKETS)

TIER_ORDER = ("gpu", "cpu", "disk", "remote")  # lookups cascade top down
# Transfer failure reasons become a label, so the set is fixed; anything else counts as "other".
FAILURE_REASONS = frozenset({"disk_full", "permission", "truncated", "checksum", "missing", "io",
                             "timeout", "unknown"})


@dataclass
class Histogram:
    """Observations counted per bucket. ``counts[i]``: observations <= ``buckets[i]`` and above
    the previous bound; the last entry counts those above every bound. ``exemplars``: per bucket
    index, the latest ``(trace_id, value, unix_seconds)`` observed with a trace id."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    exemplars: dict[int, tuple[str, float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float, trace_id: str = "", ts: float = 0.0) -> None:
        i = bisect.bisect_left(self.buckets, value)
        self.counts[i] += 1
        self.sum += value
        if trace_id:
            self.exemplars[i] = (trace_id, value, ts)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum, dict(self.exemplars))


@dataclass
class Snapshot:
    """A consistent copy of the pipeline's state, keyed by label values: ``source``;
    ``(tier, result)``; ``(src, dst)``; ``(src, dst, reason)``; ``(tier, reason)``; ``tier``.
    Bytes and seconds in base units; ``tiers``: dict[tier, TierSnapshot]."""

    prompt_tokens: dict[str, int]
    lookup_blocks: dict[tuple[str, str], int]
    prefill_seconds_saved: dict[str, float]
    transfer_bytes: dict[tuple[str, str], int]
    transfer_blocks: dict[tuple[str, str], int]
    transfer_seconds: dict[tuple[str, str], Histogram]
    transfer_failures: dict[tuple[str, str, str], int]
    evicted_blocks: dict[tuple[str, str], int]
    evicted_block_hits: dict[str, Histogram]
    block_residency_seconds: dict[str, Histogram]
    tiers: dict[str, ev.TierSnapshot]
    requests: int
    ttft_seconds: Histogram
    promotion_wait_seconds: Histogram
    recent_ttft: list[float]
    events_received: dict[str, int]
    events_dropped: dict[tuple[str, str], int]
    source_up: dict[str, bool]


def _by_key(counter: Counter, sep: str = "->") -> dict[str, int]:
    return {sep.join(k): v for k, v in counter.items()}


class Pipeline:
    """Aggregates events.

    ``prefill_tokens_per_second``: the rate behind ``kvscope_prefill_seconds_saved_total`` when
    an engine does not report its own. ``recent``: TTFTs kept for percentiles. ``history``:
    one-second samples kept (default an hour). ``table``: where finished requests go.
    """

    def __init__(self, prefill_tokens_per_second: float = 10_000.0, recent: int = 10_000,
                 history: int = 3600, table: RequestTable | None = None) -> None:
        self._lock = threading.Lock()
        self._prefill_rate = prefill_tokens_per_second
        self.requests = table if table is not None else RequestTable()
        self._assembler = RequestAssembler()
        self._listeners: list[Callable[[RequestRecord], None]] = []
        self._prompt_tokens: Counter[str] = Counter(dict.fromkeys(ev.TOKEN_SOURCES, 0))
        self._lookup_blocks: Counter[tuple[str, str]] = Counter()
        self._saved: Counter[str] = Counter()
        self._transfer_bytes: Counter[tuple[str, str]] = Counter()
        self._transfer_blocks: Counter[tuple[str, str]] = Counter()
        self._transfer_seconds: dict[tuple[str, str], Histogram] = {}
        self._transfer_failures: Counter[tuple[str, str, str]] = Counter()
        self._evicted_blocks: Counter[tuple[str, str]] = Counter()
        self._evicted_hits: dict[str, Histogram] = {}
        self._residency: dict[str, Histogram] = {}
        self._tiers: dict[str, ev.TierSnapshot] = {}
        self._requests = 0
        self._ttft = Histogram(LATENCY_SECONDS_BUCKETS)
        self._promotion_wait = Histogram(LATENCY_SECONDS_BUCKETS)
        self._recent_ttft: deque[float] = deque(maxlen=recent)
        self._received: Counter[str] = Counter()
        self._dropped: Counter[tuple[str, str]] = Counter()
        self._source_up: dict[str, bool] = {}
        self._samples: deque[dict] = deque(maxlen=history)

    def subscribe(self, listener: Callable[[RequestRecord], None]) -> None:
        """Call ``listener`` with each finished request (on the ingesting thread; keep it quick)."""
        self._listeners.append(listener)

    def ingest(self, source: str, events: Iterable[object]) -> None:
        """Fold ``events`` from emitter ``source`` into the state."""
        finished = []
        with self._lock:
            n = 0
            for event in events:
                record = self._assembler.apply(source, event)
                if record is not None:
                    finished.append(record)
                self._apply(source, event, record)
                n += 1
            self._received[source] += n
        for record in finished:
            self.requests.add(record)
            for listener in self._listeners:
                listener(record)

    def drop(self, source: str, reason: str, events: int = 1) -> None:
        """Count ``events`` dropped from ``source`` for ``reason`` (a short fixed word)."""
        with self._lock:
            self._dropped[(source, reason)] += events

    def set_source_up(self, source: str, up: bool) -> None:
        with self._lock:
            self._source_up[source] = up

    def _apply(self, source: str, event: object, finished: RequestRecord | None) -> None:
        match event:
            case ev.Lookup():
                self._prompt_tokens.update(event.tokens)
                self._count_lookups(event)
                rate = event.prefill_tokens_per_second or self._prefill_rate
                for src, tokens in event.tokens.items():
                    if src != "recompute":
                        self._saved[src] += tokens / rate
            case ev.Transfer():
                key = (event.src, event.dst)
                if not event.ok:
                    reason = event.reason or "unknown"
                    self._transfer_failures[(*key, reason if reason in FAILURE_REASONS else "other")] += 1
                    return
                self._transfer_bytes[key] += event.bytes
                self._transfer_blocks[key] += event.blocks
                hist = self._transfer_seconds.setdefault(key, Histogram(TRANSFER_SECONDS_BUCKETS))
                trace_id = self._assembler.trace_id(source, event.request_id) if event.request_id else ""
                hist.observe(event.duration, trace_id, event.ts)
            case ev.Eviction():
                self._evicted_blocks[(event.tier, event.reason)] += event.blocks
                for hists, buckets, value in ((self._evicted_hits, EVICTED_HITS_BUCKETS, event.hits),
                                              (self._residency, RESIDENCY_SECONDS_BUCKETS, event.age)):
                    hist = hists.setdefault(event.tier, Histogram(buckets))
                    for _ in range(event.blocks):
                        hist.observe(value)
            case ev.TierSnapshot():
                self._tiers[event.tier] = event
            case ev.RequestFinished():
                self._requests += 1
                self._ttft.observe(event.ttft, finished.trace_id if finished else "", event.ts)
                self._promotion_wait.observe(event.promotion_wait)
                self._recent_ttft.append(event.ttft)

    def _count_lookups(self, event: ev.Lookup) -> None:
        remaining = event.blocks
        for tier in TIER_ORDER:
            if remaining <= 0 or (tier not in self._tiers and tier not in event.block_hits):
                continue
            hits = min(event.block_hits.get(tier, 0), remaining)
            self._lookup_blocks[(tier, "hit")] += hits
            self._lookup_blocks[(tier, "miss")] += remaining - hits
            remaining -= hits

    def snapshot(self) -> Snapshot:
        """A consistent copy of the aggregated state."""
        with self._lock:
            return Snapshot(
                prompt_tokens=dict(self._prompt_tokens),
                lookup_blocks=dict(self._lookup_blocks),
                prefill_seconds_saved=dict(self._saved),
                transfer_bytes=dict(self._transfer_bytes),
                transfer_blocks=dict(self._transfer_blocks),
                transfer_seconds={k: h.copy() for k, h in self._transfer_seconds.items()},
                transfer_failures=dict(self._transfer_failures),
                evicted_blocks=dict(self._evicted_blocks),
                evicted_block_hits={k: h.copy() for k, h in self._evicted_hits.items()},
                block_residency_seconds={k: h.copy() for k, h in self._residency.items()},
                tiers=dict(self._tiers),
                requests=self._requests,
                ttft_seconds=self._ttft.copy(),
                promotion_wait_seconds=self._promotion_wait.copy(),
                recent_ttft=list(self._recent_ttft),
                events_received=dict(self._received),
                events_dropped=dict(self._dropped),
                source_up=dict(self._source_up),
            )

    def record_sample(self, ts: float, host_memory_available: float | None) -> None:
        """Append a one-second sample: cumulative counters and current gauges at ``ts``
        (``host_memory_available``: bytes, None when unknown)."""
        with self._lock:
            evicted: Counter[str] = Counter()
            for (tier, _reason), n in self._evicted_blocks.items():
                evicted[tier] += n
            self._samples.append({
                "ts": ts,
                "prompt_tokens": dict(self._prompt_tokens),
                "transfer_bytes": _by_key(self._transfer_bytes),
                "evicted_blocks": dict(evicted),
                "tier_resident_bytes": {t: s.resident_bytes for t, s in self._tiers.items()},
                "tier_capacity_bytes": {t: s.capacity_bytes for t, s in self._tiers.items()},
                "host_memory_available_bytes": host_memory_available,
            })

    def samples(self, since: float | None = None) -> list[dict]:
        """Samples with ``ts > since`` (all when None), oldest first."""
        with self._lock:
            return [s for s in self._samples if since is None or s["ts"] > since]
