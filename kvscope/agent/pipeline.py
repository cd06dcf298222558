"""The pipeline: the one owner of aggregated state.

Sources hand it :mod:`kvscope.events` events; it folds them into counters, gauges and
histograms, assembles per-request records into a bounded table, and keeps a ring of one-second
samples for the dashboard. Sinks (the exporter, the HTTP API, the store, OTLP) read consistent
copies through :meth:`Pipeline.snapshot`, :meth:`Pipeline.samples` and :attr:`Pipeline.requests`,
or subscribe to finished requests. Thread-safe: sources and sinks run on different threads.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvscope import events as ev
from kvscope.agent.requests import RequestAssembler, RequestRecord, RequestTable
from kvscope.exporter.catalog import (EVICTED_HITS_BUCKETS, LATENCY_SECONDS_BUCKETS,
                                      RESIDENCY_SECONDS_BUCKETS, TRANSFER_SECONDS_BUCKETS)

TIER_ORDER = ("gpu", "cpu", "disk", "remote")  # lookups cascade top down
# Transfer failure reasons become a label, so the set is fixed; anything else counts as "other".
FAILURE_REASONS = frozenset({"disk_full", "permission", "truncated", "checksum", "corrupt", "missing", "io",
                             "timeout", "unknown"})
QUANTILES = (0.5, 0.95, 0.99)  # the percentiles each sample carries, as "p50", "p95", "p99"
MAX_JOINED = 64  # sources whose finished requests wait for other sources' events (a bound)
MAX_SETTLING = 10_000  # finished requests waiting at most (the oldest go early beyond it)


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The ``q``-quantile (0-1) of observations counted per bucket, as PromQL's
    ``histogram_quantile`` computes it: linear interpolation inside the bucket holding the
    rank, the first bucket starting at 0 (or at its bound when that is <= 0), and a rank in the
    +Inf bucket answered with the highest finite bound.

    ``bounds``: upper bounds, ascending; ``counts``: per-bucket (not cumulative) counts, one
    more than ``bounds`` (the last is +Inf). None when there are no observations.
    Source: prometheus/promql/quantile.go (bucketQuantile).
    """
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts):
        if seen + n >= rank and n > 0:
            if i == len(bounds):
                return float(bounds[-1])
            upper = float(bounds[i])
            lower = float(bounds[i - 1]) if i > 0 else (0.0 if upper > 0 else upper)
            return lower + (upper - lower) * (rank - seen) / n
        seen += n
    return float(bounds[-1])


def _quantiles(bounds: Sequence[float], counts: Sequence[float]) -> dict[str, float | None]:
    return {f"p{round(q * 100)}": histogram_quantile(q, bounds, counts) for q in QUANTILES}


def _minus(now: Sequence[int], before: Sequence[int] | None) -> list[int]:
    return list(now) if before is None else [a - b for a, b in zip(now, before)]


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

    def observe(self, value: float, trace_id: str = "", ts: float = 0.0, n: int = 1) -> None:
        """Count ``n`` observations of ``value``; keep ``trace_id`` as the bucket's exemplar."""
        i = bisect.bisect_left(self.buckets, value)
        self.counts[i] += n
        self.sum += value * n
        if trace_id:
            self.exemplars[i] = (trace_id, value, ts)

    def add_buckets(self, bounds: list[float], counts: list[int], total: float) -> None:
        """Fold in another histogram's per-bucket ``counts`` (``len(bounds) + 1`` entries, the
        last above every bound) and their sum ``total``. Each engine bucket lands in our bucket
        holding its upper bound, so quantiles err toward the slower side, never the faster."""
        for i, n in enumerate(counts):
            upper = bounds[i] if i < len(bounds) else float("inf")
            self.counts[bisect.bisect_left(self.buckets, upper)] += n
        self.sum += total

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
    dropped_blocks: dict[str, int]
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
    source_info: dict[str, tuple[str, str]]


def _by_key(counter: Counter, sep: str = "->") -> dict[str, int]:
    return {sep.join(k): v for k, v in counter.items()}


class Pipeline:
    """Aggregates events.

    ``prefill_tokens_per_second``: the rate behind ``kvscope_prefill_seconds_saved_total`` when
    an engine does not report its own. ``recent``: TTFTs kept for percentiles. ``history``:
    one-second samples kept (default an hour). ``table``: where finished requests go.

    A source's requests may be joined by what other sources send later: vLLM's worker tap sends
    the transfers of the scheduler tap's requests on another connection (``scope`` in
    :meth:`ingest`), vLLM's request spans arrive seconds after the request (:meth:`join`). A
    finished record of such a source is in the table at once, and reaches the subscribers (the
    store, the OTLP exporter, the capture) only once it has waited for them: ``join_window``
    seconds for another source's events, or what :meth:`join` asked for. Waiting records are
    handed over at later ingests and by :meth:`publish_settled`.
    """

    def __init__(self, prefill_tokens_per_second: float = 10_000.0, recent: int = 10_000,
                 history: int = 3600, table: RequestTable | None = None,
                 quantile_window: int = 60, join_window: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._prefill_rate = prefill_tokens_per_second
        self.requests = table if table is not None else RequestTable()
        self._assembler = RequestAssembler()
        self._join_window = join_window
        self._joined: dict[str, float] = {}  # source -> seconds its records wait (see above)
        # a heap of (due: monotonic seconds, arrival order, record): windows differ by source
        self._settling: list[tuple[float, int, RequestRecord]] = []
        self._settle_order = itertools.count()
        self._listeners: list[Callable[[RequestRecord], None]] = []
        self._lookup_listeners: list[Callable[[str, ev.Lookup], None]] = []
        self._prompt_tokens: Counter[str] = Counter(dict.fromkeys(ev.TOKEN_SOURCES, 0))
        self._lookup_blocks: Counter[tuple[str, str]] = Counter()
        self._saved: Counter[str] = Counter()
        self._transfer_bytes: Counter[tuple[str, str]] = Counter()
        self._transfer_blocks: Counter[tuple[str, str]] = Counter()
        self._transfer_seconds: dict[tuple[str, str], Histogram] = {}
        self._transfer_failures: Counter[tuple[str, str, str]] = Counter()
        self._evicted_blocks: Counter[tuple[str, str]] = Counter()
        self._dropped_blocks: Counter[str] = Counter()
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
        self._source_info: dict[str, tuple[str, str]] = {}
        self._samples: deque[dict] = deque(maxlen=history)
        # Histogram counts at the last ``quantile_window`` samples, oldest first: the samples'
        # percentiles cover the observations since the oldest (like PromQL rate()[60s]).
        self._hist_ring: deque[dict] = deque(maxlen=max(quantile_window, 1))
        self._handlers = {ev.RequestStarted: self._on_started, ev.Lookup: self._on_lookup,
                          ev.Transfer: self._on_transfer, ev.Eviction: self._on_eviction,
                          ev.TierSnapshot: self._on_snapshot, ev.RequestFinished: self._on_finished,
                          ev.LatencyHistogram: self._on_latency_histogram}

    def subscribe(self, listener: Callable[[RequestRecord], None]) -> None:
        """Call ``listener`` with each finished request, on the ingesting or the sampling
        thread (keep it quick); for a joined source once it has waited (see the class)."""
        self._listeners.append(listener)

    def subscribe_lookups(self, listener: Callable[[str, ev.Lookup], None]) -> None:
        """Call ``listener(source, lookup)`` with each :class:`~kvscope.events.Lookup` event
        after it was folded in (on the ingesting thread, outside the lock; keep it quick).
        The capture sink records block accesses from these."""
        self._lookup_listeners.append(listener)

    def ingest(self, source: str, events: Iterable[object], scope: str | None = None) -> None:
        """Fold ``events`` from emitter ``source`` into the state. ``scope``: the source whose
        requests the events' request ids name, when that is another source (see the class)."""
        finished: list[RequestRecord] = []
        lookups: list[ev.Lookup] = []
        watch = bool(self._lookup_listeners)
        handlers = self._handlers
        scope = scope or source
        with self._lock:
            if scope != source:
                self._join(scope, self._join_window)
            n = 0
            for event in events:
                handler = handlers.get(type(event))
                if handler is not None:
                    handler(scope, event, finished)
                    if watch and type(event) is ev.Lookup:
                        lookups.append(event)
                n += 1
            self._received[source] += n
            ready = finished
            window = self._joined.get(scope)
            if finished and window is not None:
                due = time.monotonic() + window
                for record in finished:
                    heapq.heappush(self._settling, (due, next(self._settle_order), record))
                ready = []
            if self._settling:
                ready = ready + self._settled()
        for lookup in lookups:
            for on_lookup in self._lookup_listeners:
                on_lookup(source, lookup)
        for record in finished:
            self.requests.add(record)
        self._notify(ready)

    def join(self, source: str, window: float) -> None:
        """Have the finished records of ``source`` wait ``window`` seconds (at least) before the
        subscribers get them, for what another source sends about them later (see the class).
        At most :data:`MAX_JOINED` sources."""
        with self._lock:
            self._join(source, window)

    def _join(self, source: str, window: float) -> None:
        if source in self._joined or len(self._joined) < MAX_JOINED:
            self._joined[source] = max(window, self._joined.get(source, 0.0))

    def publish_settled(self, everything: bool = False) -> None:
        """Hand the subscribers the finished records whose wait is over (``everything``: all of
        them, e.g. once the sources have stopped)."""
        with self._lock:
            records = self._settled(everything)
        self._notify(records)

    def _settled(self, everything: bool = False) -> list[RequestRecord]:
        now, out = time.monotonic(), []
        settling = self._settling
        while settling and (everything or settling[0][0] <= now or len(settling) > MAX_SETTLING):
            out.append(heapq.heappop(settling)[2])
        return out

    def _notify(self, records: list[RequestRecord]) -> None:
        for record in records:
            for listener in self._listeners:
                listener(record)

    def events_received(self) -> dict[str, int]:
        """Events accepted so far, by source (a cheap read; :meth:`snapshot` copies everything)."""
        with self._lock:
            return dict(self._received)

    def drop(self, source: str, reason: str, events: int = 1) -> None:
        """Count ``events`` dropped from ``source`` for ``reason`` (a short fixed word)."""
        with self._lock:
            self._dropped[(source, reason)] += events

    def set_source_up(self, source: str, up: bool) -> None:
        with self._lock:
            self._source_up[source] = up

    def set_source_info(self, source: str, engine: str, model: str) -> None:
        """Record which engine and model ``source`` observes (each cut to 64 characters)."""
        with self._lock:
            self._source_info[source] = (engine[:64], model[:64])

    # One handler per event kind, called under the lock: (source whose request the event is
    # about, event, finished records).

    def _on_started(self, source: str, event: ev.RequestStarted, finished: list) -> None:
        self._assembler.started(source, event)

    def _on_lookup(self, source: str, event: ev.Lookup, finished: list) -> None:
        self._assembler.lookup(source, event)
        rate = event.prefill_tokens_per_second or self._prefill_rate
        for src, tokens in event.tokens.items():
            self._prompt_tokens[src] += tokens
            if src != "recompute":
                self._saved[src] += tokens / rate
        self._count_lookups(event)

    def _on_transfer(self, source: str, event: ev.Transfer, finished: list) -> None:
        trace_id = self._assembler.transfer(source, event)
        key = (event.src, event.dst)
        if not event.ok:
            reason = event.reason if event.reason in FAILURE_REASONS else "other"
            self._transfer_failures[(*key, reason)] += 1
            return
        self._transfer_bytes[key] += event.bytes
        self._transfer_blocks[key] += event.blocks
        if not event.timed:  # seen, not timed: its duration is no measurement
            return
        hist = self._transfer_seconds.get(key)
        if hist is None:
            hist = self._transfer_seconds[key] = Histogram(TRANSFER_SECONDS_BUCKETS)
        hist.observe(event.duration, trace_id, event.ts)

    def _on_eviction(self, source: str, event: ev.Eviction, finished: list) -> None:
        tier = event.tier
        self._evicted_blocks[(tier, event.reason)] += event.blocks
        if not event.offloaded:
            self._dropped_blocks[tier] += event.blocks
        if not event.measured:  # the source cannot see age and hits
            return
        hits = self._evicted_hits.get(tier)
        if hits is None:
            hits = self._evicted_hits[tier] = Histogram(EVICTED_HITS_BUCKETS)
            self._residency[tier] = Histogram(RESIDENCY_SECONDS_BUCKETS)
        n = event.blocks * event.weight
        hits.observe(event.hits, n=n)
        self._residency[tier].observe(event.age, n=n)

    def _on_snapshot(self, source: str, event: ev.TierSnapshot, finished: list) -> None:
        self._tiers[event.tier] = event

    def _on_latency_histogram(self, source: str, event: ev.LatencyHistogram,
                              finished: list) -> None:
        if len(event.counts) == len(event.bounds) + 1:  # else malformed: nothing to fold in
            self._ttft.add_buckets(event.bounds, event.counts, event.sum)

    def _on_finished(self, source: str, event: ev.RequestFinished, finished: list) -> None:
        record = self._assembler.finished(source, event, remember=source in self._joined)
        if record is None:  # the request had finished already: its record was completed
            return
        finished.append(record)
        self._requests += 1
        self._ttft.observe(event.ttft, record.trace_id, event.ts)
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
                dropped_blocks=dict(self._dropped_blocks),
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
                source_info=dict(self._source_info),
            )

    def record_sample(self, ts: float, host_memory_available: float | None, *,
                      host_memory_reserve: float | None = None,
                      host_memory_headroom: float | None = None,
                      offload_budgets: Mapping[str, int] | None = None,
                      pcie_link_max: Mapping[str, float] | None = None) -> None:
        """Append a one-second sample: cumulative counters and current gauges at ``ts``.

        ``host_memory_available``, ``host_memory_reserve``, ``host_memory_headroom``: bytes,
        None when unknown. ``offload_budgets``: dict[tier, bytes]. ``pcie_link_max``:
        dict[gpu, bytes/s] of each GPU's current link, one direction. Fields (units in names;
        dict keys are sources, tiers or "src->dst" directions):

        - counters (cumulative): ``prompt_tokens``, ``prefill_seconds_saved``,
          ``transfer_bytes``, ``transfer_blocks``, ``transfer_seconds_sum`` (seconds spent),
          ``evicted_blocks``, ``dropped_blocks`` (evicted with no copy kept below), ``requests``;
          ``evicted_block_hits`` and ``block_residency_seconds``: dict[tier, per-bucket counts]
          over the catalog's buckets plus +Inf (not cumulative across buckets);
        - percentiles ``{"p50", "p95", "p99"}`` (seconds, None without observations) of the
          observations in the last ``quantile_window`` samples: ``ttft_seconds``,
          ``promotion_wait_seconds``, and ``transfer_seconds`` per direction;
        - gauges: ``tier_resident_bytes``, ``tier_capacity_bytes``, ``tier_resident_blocks``,
          ``tier_capacity_blocks``, the host values and ``offload_budget_bytes``,
          ``pcie_link_max_bytes_per_second``.

        The percentile work happens here, once per sample, never per event.
        """
        with self._lock:
            evicted: Counter[str] = Counter()
            for (tier, _reason), n in self._evicted_blocks.items():
                evicted[tier] += n
            hists = {"ttft": list(self._ttft.counts), "wait": list(self._promotion_wait.counts),
                     **{"->".join(k): list(h.counts) for k, h in self._transfer_seconds.items()}}
            old = self._hist_ring[0] if self._hist_ring else {}
            self._hist_ring.append(hists)
            transfer_q = {}
            for key, counts in hists.items():
                if key in ("ttft", "wait"):
                    continue
                window = _minus(counts, old.get(key))
                if sum(window) > 0:
                    transfer_q[key] = _quantiles(TRANSFER_SECONDS_BUCKETS, window)
            self._samples.append({
                "ts": ts,
                "prompt_tokens": dict(self._prompt_tokens),
                "transfer_bytes": _by_key(self._transfer_bytes),
                "evicted_blocks": dict(evicted),
                "tier_resident_bytes": {t: s.resident_bytes for t, s in self._tiers.items()},
                "tier_capacity_bytes": {t: s.capacity_bytes for t, s in self._tiers.items()},
                "host_memory_available_bytes": host_memory_available,
                # added for the dashboard (issue 6)
                "requests": self._requests,
                "prefill_seconds_saved": dict(self._saved),
                "transfer_blocks": _by_key(self._transfer_blocks),
                "transfer_seconds_sum": {"->".join(k): h.sum
                                         for k, h in self._transfer_seconds.items()},
                "dropped_blocks": dict(self._dropped_blocks),
                "evicted_block_hits": {t: list(h.counts) for t, h in self._evicted_hits.items()},
                "block_residency_seconds": {t: list(h.counts)
                                            for t, h in self._residency.items()},
                "ttft_seconds": _quantiles(LATENCY_SECONDS_BUCKETS,
                                           _minus(hists["ttft"], old.get("ttft"))),
                "promotion_wait_seconds": _quantiles(LATENCY_SECONDS_BUCKETS,
                                                     _minus(hists["wait"], old.get("wait"))),
                "transfer_seconds": transfer_q,
                "tier_resident_blocks": {t: s.resident_blocks for t, s in self._tiers.items()},
                "tier_capacity_blocks": {t: s.capacity_blocks for t, s in self._tiers.items()},
                "host_memory_reserve_bytes": host_memory_reserve,
                "host_memory_headroom_bytes": host_memory_headroom,
                "offload_budget_bytes": dict(offload_budgets or {}),
                "pcie_link_max_bytes_per_second": dict(pcie_link_max or {}),
            })

    def samples(self, since: float | None = None, window: float | None = None) -> list[dict]:
        """Samples with ``ts > since`` (all when None), oldest first; ``window``: seconds, only
        those no older than that before the newest sample."""
        with self._lock:
            out = [s for s in self._samples if since is None or s["ts"] > since]
        if window is not None and out:
            newest = out[-1]["ts"]
            out = [s for s in out if s["ts"] >= newest - window]
        return out
