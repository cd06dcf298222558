"""The pipeline: the one owner of aggregated state, and its lock and fan-out.

Sources hand it :mod:`kvscope.events` events; it folds them into counters, gauges and
histograms (:mod:`~kvscope.agent.fold`, compiled), assembles per-request records into a bounded
table (:mod:`~kvscope.agent.assembler`), lets a joined source's finished records wait for their
late parts (:mod:`~kvscope.agent.settling`), sums the tiers its senders report
(:mod:`~kvscope.agent.tier_totals`) and keeps the dashboard's one-second samples
(:mod:`~kvscope.agent.sample_history`). Sinks (the exporter, the HTTP API, the store, OTLP) read
consistent copies through :meth:`Pipeline.snapshot`, :meth:`Pipeline.samples` and
:attr:`Pipeline.requests`, or subscribe to finished requests. Thread-safe: sources and sinks
run on different threads.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvscope import events as ev
from kvscope import vocabulary
from kvscope.agent.assembler import RequestAssembler
from kvscope.agent.fold import Fold
from kvscope.agent.histograms import Histogram
from kvscope.agent.prefix_reuse import PrefixReuse
from kvscope.agent.requests import (FUTURE, RequestRecord, RequestTable, amend, under_way,
                                    within)
from kvscope.agent.sample_history import SampleHistory
from kvscope.agent.settling import Settling
from kvscope.agent.tier_totals import TierTotals

log = logging.getLogger(__name__)

# A report's samples (vLLM's n) looked for at most: n is the client's number, and each is
# looked for under the lock (a span claiming 10**15 had held it for good)
MAX_SAMPLES = 1024


@dataclass
class Snapshot:
    """A consistent copy of the pipeline's state, keyed by label values: ``source``;
    ``(tier, result)``; ``(src, dst)``; ``(src, dst, reason)``; ``(tier, reason)``; ``tier``.
    Bytes and seconds in base units; ``tiers``: dict[tier, TierSnapshot]. The scheduler's
    (:class:`~kvscope.events.SchedulerStats`), keyed by the sender's source and holding only
    the senders that reported each: ``requests_waiting``, ``requests_running`` (requests now),
    ``preemptions`` (added up since the agent started), ``gpu_kv_cache_usage`` (0 to 1).
    ``transfers_in_flight``, ``transfer_blocks_in_flight``: by (source, src, dst), each
    sender's last :class:`~kvscope.events.TransfersInFlight` (only directions it reported).
    ``block_idle_seconds``: per tier, only the tiers some source measured idle time of.
    ``transfer_failures``: every reason, 0 included, of the directions a source that sees
    failures moved blocks in (:attr:`~kvscope.events.Transfer.sees_failures`), and only those.
    ``store_admissions``: blocks offered for storing by (tier, result), added up since the agent
    started (:class:`~kvscope.events.Admission`), only the results some source reported.
    ``engine_memory``: by (source, device), what each sender's
    :class:`~kvscope.events.EngineMemory` reports said, merged: dict[field, bytes] with only
    the fields it reported (``kv_offload_budget``, ``kv_cache``, ``allocated``).
    ``cache_config``: by source, its engine's (prefix caching, KV cache dtype) label values
    (:meth:`Pipeline.set_cache_config`), only the sources whose engine reported them.
    ``prompt_prefix_blocks``: estimated prompt blocks by prefix seen before or new
    (:class:`~kvscope.agent.prefix_reuse.PrefixReuse`), empty until a lookup carried hashes."""

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
    itl_seconds: Histogram
    recent_ttft: list[float]
    events_received: dict[str, int]
    events_dropped: dict[tuple[str, str], int]
    source_up: dict[str, bool]
    source_info: dict[str, tuple[str, str]]
    expected_drops: frozenset[tuple[str, str]] = frozenset()  # (source, reason) exported at 0
    tap_errors: dict[tuple[str, str], int] = field(default_factory=dict)  # (source, reason)
    requests_waiting: dict[str, int] = field(default_factory=dict)
    requests_running: dict[str, int] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    gpu_kv_cache_usage: dict[str, float] = field(default_factory=dict)
    transfers_in_flight: dict[tuple[str, str, str], int] = field(default_factory=dict)
    transfer_blocks_in_flight: dict[tuple[str, str, str], int] = field(default_factory=dict)
    block_idle_seconds: dict[str, Histogram] = field(default_factory=dict)
    store_admissions: dict[tuple[str, str], int] = field(default_factory=dict)
    engine_memory: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    cache_config: dict[str, tuple[str, str]] = field(default_factory=dict)
    prompt_prefix_blocks: dict[str, float] = field(default_factory=dict)

    def senders_besides(self, source: str) -> list[str]:
        """The sources other than ``source`` whose events have arrived, sorted (["unknown"]
        when none has: a count shared with an unnamed sender)."""
        return sorted(s for s, n in self.events_received.items() if n and s != source) or [
            "unknown"]


def _histograms(states: Mapping) -> dict:
    """{key: Histogram} of the fold's histogram states (see :meth:`~kvscope.agent.fold.Fold.state`)."""
    return {key: Histogram(*state) for key, state in states.items()}


class Pipeline:
    """Aggregates events.

    ``prefill_tokens_per_second``: the rate behind ``kvscope_prefill_seconds_saved_total`` when
    an engine does not report its own and its finished requests have not measured one yet
    (:meth:`kvscope.agent.fold.Fold.prefill_rate`). ``recent``: TTFTs kept for percentiles.
    ``history``: one-second samples kept (default an hour). ``table``: where finished requests
    go. ``open_per_source``: requests started and not finished held per source, beyond which the
    oldest is abandoned (counted in ``events_dropped`` as ``(source, "abandoned")``);
    ``recent_per_source``: finished records each source keeps for late parts to join (both
    the agent's ``requests_*_per_source`` settings; ValueError when negative).

    A source's requests may be joined by what other sources send later: vLLM's worker tap sends
    the transfers of the scheduler tap's requests on another connection (``scope`` in
    :meth:`ingest`), vLLM's request spans arrive seconds after the request (:meth:`join`). A
    finished record of such a source is in the table at once, and reaches the subscribers (the
    OTLP exporter, the capture) only once it has waited for them: ``join_window`` seconds for
    another source's events, or what :meth:`join` asked for. Waiting records are handed over at
    later ingests and by :meth:`publish_settled`; they count in the request metrics (requests,
    TTFT and promotion-wait histograms) then, as joined. Early subscribers (the store, which a
    ``kill -9`` must not rob of the waiting records) get such a record at once, and again
    once it has waited.
    """

    def __init__(self, prefill_tokens_per_second: float = 10_000.0, recent: int = 10_000,
                 history: int = 3600, table: RequestTable | None = None,
                 quantile_window: int = 60, join_window: float = 1.0,
                 open_per_source: int = 10_000, recent_per_source: int = 10_000) -> None:
        self._lock = threading.Lock()
        self.requests = table if table is not None else RequestTable()
        self._settling = Settling(join_window)
        self._assembler = RequestAssembler(open_per_source, recent_per_source,
                                           joined=self._settling.joined)
        self._listeners: list[Callable[[RequestRecord], None]] = []
        self._early_listeners: list[Callable[[RequestRecord], None]] = []
        self._lookup_listeners: list[Callable[[str, ev.Lookup], None]] = []
        self._fold = Fold(self._assembler, prefill_tokens_per_second, recent)
        self._prefix_reuse = PrefixReuse()
        self._tiers = TierTotals()
        self._received: Counter[str] = Counter()
        self._dropped: Counter[tuple[str, str]] = Counter()
        self._expected_drops: set[tuple[str, str]] = set()
        self._tap_errors: Counter[tuple[str, str]] = Counter()
        self._source_up: dict[str, bool] = {}
        self._source_info: dict[str, tuple[str, str]] = {}
        self._cache_config: dict[str, tuple[str, str]] = {}
        self._history = SampleHistory(history, quantile_window)

    def subscribe(self, listener: Callable[[RequestRecord], None], early: bool = False) -> None:
        """Call ``listener`` with each finished request, on the ingesting or the sampling
        thread (keep it quick); for a joined source once it has waited (see the class), and
        with ``early`` also as soon as it finished (so twice: the second call's record, the
        same object, is the final one)."""
        self._listeners.append(listener)
        if early:
            self._early_listeners.append(listener)

    def subscribe_lookups(self, listener: Callable[[str, ev.Lookup], None]) -> None:
        """Call ``listener(source, lookup)`` with each :class:`~kvscope.events.Lookup` event
        after it was folded in (on the ingesting thread, outside the lock; keep it quick).
        The capture sink records block accesses from these."""
        self._lookup_listeners.append(listener)

    def ingest(self, source: str, events: Sequence[object], scope: str | None = None) -> None:
        """Fold ``events`` from emitter ``source`` into the state. ``scope``: the source whose
        requests the events' request ids name, when that is another source (see the class).
        The fold is compiled (:class:`~kvscope.agent.fold.Fold`): this is the agent's ingest
        path."""
        scope = scope or source
        with self._lock:
            handover = self._folded(source, events, scope)
        self._hand_over(source, *handover)

    def _folded(self, source: str, events: Sequence[object], scope: str,
                received: bool = True) -> tuple[list, list[RequestRecord], list[RequestRecord],
                                                list[RequestRecord]]:
        """Fold one batch of ``events``, under the lock; ``received``: count them in
        ``source``'s events received (not a report's: see :meth:`report`). Returns the batch's
        lookups, the records that finished, those for the early subscribers and those for all
        subscribers, for :meth:`_hand_over` (outside the lock)."""
        if scope != source:
            self._settling.join(scope)
        finished, invalid, lookups = self._fold.fold(source, scope, events, self._tiers.update,
                                                     scope not in self._settling.joined)
        if invalid:
            if not self._dropped[(scope, "invalid")]:
                log.warning("kvscope: dropped %d finished requests of source %r timestamped "
                            "more than %.0f s ahead of this host's clock (counted as invalid; "
                            "is the engine host's clock set?); logged once per source",
                            invalid, scope, FUTURE)
            self._dropped[(scope, "invalid")] += invalid
        for lookup in lookups:
            self._prefix_reuse.add(lookup)
        if received:  # dropped ones were not accepted
            self._received[source] += len(events) - invalid
        ready = self._settling.hold(scope, finished)
        early = [] if ready is finished else finished
        if self._settling:
            ready = ready + self._settled()
        if self._assembler.amended:
            early = early + self._amended(finished + ready)
        return lookups, finished, early, ready

    def _amended(self, handed: list[RequestRecord]) -> list[RequestRecord]:
        """The records handed over already that were changed since (by the tap's finish or a
        late transfer after vLLM's span finished them, or by a late span: :meth:`report`), for
        the early subscribers again: the store keeps the last version. Those still waiting, or
        ``handed`` over now, go out anyway."""
        fresh = set(map(id, handed)) | self._settling.ids
        out = [r for key, r in self._assembler.amended.items() if key not in fresh]
        self._assembler.amended.clear()
        return out

    def _hand_over(self, source: str, lookups: list, finished: list[RequestRecord],
                   early: list[RequestRecord], ready: list[RequestRecord]) -> None:
        """What :meth:`_folded` leaves to do outside the lock: the listeners and the table."""
        for lookup in lookups if self._lookup_listeners else ():
            for on_lookup in self._lookup_listeners:
                on_lookup(source, lookup)
        if finished:
            self.requests.add(finished)
        self._notify(early, self._early_listeners)
        self._notify(ready)

    def join(self, source: str, window: float) -> None:
        """Have the finished records of ``source`` wait ``window`` seconds (at least) before the
        subscribers get them, for what another source sends about them later (see the class).
        At most :data:`~kvscope.agent.settling.MAX_JOINED` sources."""
        with self._lock:
            self._settling.join(source, window)

    def publish_settled(self, everything: bool = False) -> None:
        """Hand the subscribers the finished records whose wait is over (``everything``: all of
        them, e.g. once the sources have stopped)."""
        with self._lock:
            records = self._settled(everything)
        self._notify(records)

    def _settled(self, everything: bool = False) -> list[RequestRecord]:
        """The waiting records whose wait is over, counted in the request metrics now that
        what joined them (the span's TTFT, the tap's promotion wait) is in."""
        out = self._settling.due(everything)
        if out:
            self._fold.observe(out)
        return out

    def _notify(self, records: list[RequestRecord],
                listeners: Sequence[Callable[[RequestRecord], None]] | None = None) -> None:
        listeners = self._listeners if listeners is None else listeners
        for record in records if listeners else ():
            for listener in listeners:
                listener(record)

    def report(self, source: str, trace_id: str, started: ev.RequestStarted,
               finished: ev.RequestFinished, new_request: bool = True,
               samples: int = 1) -> bool:
        """Fold a later report of one of ``source``'s requests (vLLM's span, as ``started``
        and ``finished`` events, counted as received elsewhere), in one step so that none of
        the source's own events comes in between. When ``source`` finished that request (one
        of the last it finished, or one in the table, under way at ``started.ts``, else run
        within the span to ``finished.ts``: a client may reuse an id, see
        :func:`~kvscope.agent.requests.within`), the report amends its
        record (:func:`~kvscope.agent.requests.amend`; exemplars name a record's trace id as it
        is when read, so the new one), and a record handed over already goes to the early subscribers
        again (the store keeps the last version). ``samples``: the request's parallel samples
        (vLLM's ``n``): a span of one of several is named after the request, while vLLM's
        scheduler, and so its tap, names each sample ``<i>_<id>``; not saying which it is, it
        gives the samples the source finished or has in flight its trace id only (the first
        :data:`MAX_SAMPLES`). Otherwise,
        with ``new_request``, the events are folded: they finish the request in flight, or make
        one. True when it amended a record or gave samples in flight the trace id."""
        handover = republish = None
        running = []  # samples in flight: the span came before the tap's finish
        with self._lock:
            record = self._finished_as(source, finished.request_id, started.ts, finished.ts)
            if record is not None:
                amended = [record]
                amend(record, trace_id, finished)
            else:
                amended = []
                for i in range(min(samples, MAX_SAMPLES) if samples > 1 else 0):
                    rid = f"{i}_{finished.request_id}"[:ev.MAX_REQUEST_ID]
                    if sample := self._finished_as(source, rid, started.ts, finished.ts):
                        amended.append(sample)
                    elif sample := self._assembler.in_flight(source, rid):
                        running.append(sample)
                for sample in amended + running:  # its trace; its latencies are its own
                    sample.trace_id = trace_id or sample.trace_id
            for each in amended:
                self._assembler.amended[id(each)] = each
            if amended:
                republish = self._amended([])  # when handed over already
            elif new_request and not running:
                handover = self._folded(source, (started, finished), source, received=False)
        if handover is not None:
            self._hand_over(source, *handover)
        if republish:  # the store keeps the last version
            self._notify(republish, self._early_listeners)
        return bool(amended or running)

    def _finished_as(self, source: str, request_id: str, start: float,
                     until: float) -> RequestRecord | None:
        """The record of ``source``'s request ``request_id`` that a report from ``start`` to
        ``until`` is of (see :meth:`report`), or None (under the lock)."""
        record = self._assembler.finished_recently(source, request_id, start, until=until)
        if record is None:  # restored after a restart, or past the recent ones
            record = self.requests.get(request_id, source)
            if record is not None and not (under_way(record, start)
                                           or within(record, start, until)):
                record = None
        return record

    def events_received(self) -> dict[str, int]:
        """Events accepted so far, by source (a cheap read; :meth:`snapshot` copies everything)."""
        with self._lock:
            return dict(self._received)

    def add_received(self, source: str, events: int) -> None:
        """Count ``events`` a source took in that reach the pipeline otherwise, or not at all
        (the OTLP receiver's spans: turned into events under the engine's source, not counted
        there, or joined to its records)."""
        with self._lock:
            self._received[source] += events

    def drop(self, source: str, reason: str, events: int = 1) -> None:
        """Count ``events`` dropped from ``source`` for ``reason`` (a short fixed word)."""
        with self._lock:
            self._dropped[(source, reason)] += events

    def count_tap_errors(self, source: str, reason: str, errors: int) -> None:
        """Count ``errors`` of ``source``'s tap for ``reason`` (of
        :data:`~kvscope.vocabulary.TAP_ERROR_REASONS`); 0 makes the series exist."""
        with self._lock:
            self._tap_errors[(source, reason)] += errors

    def restore(self, records: Sequence[RequestRecord]) -> None:
        """Take back ``records`` a store kept from before a restart (oldest first): into the
        request table, and their TTFTs into the recent window behind the summary's
        percentiles. Counters and histograms start again from 0, as Prometheus expects of a
        restarted process."""
        self.requests.add(records)
        with self._lock:
            self._fold.remember_ttfts([r.ttft for r in records if r.finished is not None])

    def expect_drops(self, source: str, reasons: Iterable[str]) -> None:
        """Export ``source``'s drops for each of ``reasons`` from now on, at 0 until one
        happens, so its first drops show in ``increase()`` and ``rate()`` (Prometheus's advice:
        initialise the label sets known in advance)."""
        with self._lock:
            self._expected_drops.update((source, reason) for reason in reasons)

    def set_source_up(self, source: str, up: bool) -> None:
        with self._lock:
            self._source_up[source] = up

    def set_source_info(self, source: str, engine: str, model: str) -> None:
        """Record which engine and model ``source`` observes (each cut to 64 characters)."""
        with self._lock:
            self._source_info[source] = (engine[:64], model[:64])

    def set_cache_config(self, source: str, prefix_caching: bool, kv_cache_dtype: str) -> None:
        """Record the KV cache settings of the engine ``source`` observes: whether its GPU
        prefix caching is on, and its KV cache dtype as the engine names it (kept as its
        width, :func:`kvscope.vocabulary.kv_cache_dtype`)."""
        with self._lock:
            on, off = vocabulary.PREFIX_CACHING
            self._cache_config[source] = (on if prefix_caching else off,
                                          vocabulary.kv_cache_dtype(kv_cache_dtype))

    def forget_tiers(self, source: str) -> None:
        """Leave sender ``source``'s tier snapshots out of the tier gauges, and its scheduler
        gauges (waiting, running, GPU KV usage) and memory reports out of the snapshot, from
        now on (its emitter closed: an engine that stopped holds no tier, no queue and no
        memory). Its counters stay."""
        with self._lock:
            self._tiers.forget(source)
            self._fold.forget_gauges(source)

    def abandon_requests(self, source: str) -> int:
        """Count ``source``'s requests in flight that started as abandoned (``events_dropped``,
        reason ``abandoned``) and close them: its engine stopped, and every emitter of it
        closed, without finishing them. A dead engine's record had stayed open, and a client's retry
        under the same id (a fixed X-Request-Id) joined it, with the dead request's arrival
        and transfers. Returns how many."""
        with self._lock:
            return self._assembler.abandon(source)

    def snapshot(self) -> Snapshot:
        """A consistent copy of the aggregated state."""
        with self._lock:
            state = self._fold.state()
            return Snapshot(
                prompt_tokens=state["prompt_tokens"],
                lookup_blocks=state["lookup_blocks"],
                prompt_prefix_blocks=self._prefix_reuse.counts(),
                prefill_seconds_saved=state["prefill_seconds_saved"],
                transfer_bytes=state["transfer_bytes"],
                transfer_blocks=state["transfer_blocks"],
                transfer_seconds=_histograms(state["transfer_seconds"]),
                transfer_failures=state["transfer_failures"],
                evicted_blocks=state["evicted_blocks"],
                dropped_blocks=state["dropped_blocks"],
                evicted_block_hits=_histograms(state["evicted_block_hits"]),
                block_residency_seconds=_histograms(state["block_residency_seconds"]),
                tiers=dict(self._tiers.totals),
                requests=state["requests"],
                ttft_seconds=Histogram(*state["ttft_seconds"]),
                promotion_wait_seconds=Histogram(*state["promotion_wait_seconds"]),
                itl_seconds=Histogram(*state["itl_seconds"]),
                recent_ttft=state["recent_ttft"],
                events_received=dict(self._received),
                events_dropped={**self._dropped, **{
                    (source, "abandoned"): n for source, n in self._assembler.abandoned.items()}},
                source_up=dict(self._source_up),
                source_info=dict(self._source_info),
                expected_drops=frozenset(self._expected_drops),
                tap_errors=dict(self._tap_errors),
                requests_waiting=state["requests_waiting"],
                requests_running=state["requests_running"],
                preemptions=state["preemptions"],
                gpu_kv_cache_usage=state["gpu_kv_cache_usage"],
                transfers_in_flight=state["transfers_in_flight"],
                transfer_blocks_in_flight=state["transfer_blocks_in_flight"],
                block_idle_seconds=_histograms(state["block_idle_seconds"]),
                store_admissions=state["store_admissions"],
                engine_memory=state["engine_memory"],
                cache_config=dict(self._cache_config),
            )

    def engine_memory(self) -> dict[tuple[str, str], dict[str, int]]:
        """:attr:`Snapshot.engine_memory` alone, without the cost of a whole snapshot (read at
        every scrape and sample for the memory budget breakdown)."""
        with self._lock:
            return self._fold.engine_memory()

    def record_sample(self, ts: float, host_memory_available: float | None,
                      **node: object) -> dict:
        """Append a one-second sample of the state now, and return it (see
        :meth:`~kvscope.agent.sample_history.SampleHistory.record`: the fields, host values
        and units). ``node``: the node's readings by keyword (``host_memory_reserve``,
        ``offload_budgets``, ``host_memory_parts``, ...), as that method takes them; one it
        does not know raises TypeError."""
        with self._lock:
            state = self._fold.state()
            state["prompt_prefix_blocks"] = self._prefix_reuse.counts()
            tiers = dict(self._tiers.totals)
            cache_config = dict(self._cache_config)
        return self._history.record(ts, state, tiers, host_memory_available,
                                    cache_config=cache_config, **node)

    def samples(self, since: float | None = None, window: float | None = None) -> list[dict]:
        """Samples with ``ts > since`` (all when None), oldest first; ``window``: seconds, only
        those no older than that before the newest sample."""
        return self._history.since(since, window)
