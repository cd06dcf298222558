# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""The fold: a batch of events into the pipeline's counters, histograms and records (compiled).

:class:`Fold` holds what the pipeline aggregates — the catalog's counters and histograms, kept
in C arrays over their bounded label sets, each sender's scheduler gauges and preemptions
(:class:`~kvscope.events.SchedulerStats`), and the :class:`~kvscope.agent.assembler.
RequestAssembler` — and folds one source's batch at a time, event by event, in order.
The pipeline owns the lock around it and everything else (tiers, subscribers, samples).
Compiled because the fold is the agent's ingest cost: interpreted, it took four times as
long as msgspec's decode of the same batch (bench/ingest.py).
"""

import time

cimport cython
from cpython.dict cimport PyDict_Next
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_XDECREF, Py_XINCREF
from libc.math cimport isnan
from libc.stdint cimport int64_t
from libc.string cimport memset

from kvscope import events as ev
from kvscope.agent.assembler cimport RequestAssembler, _Requests
from kvscope.agent.requests cimport RequestRecord
from kvscope.agent.requests import FUTURE
from kvscope.agent.slots cimport bool_field, field, float_field, index_of, int_field, offset_of
from kvscope.catalog import (EVICTED_HITS_BUCKETS, LATENCY_SECONDS_BUCKETS,
                             RESIDENCY_SECONDS_BUCKETS, TRANSFER_SECONDS_BUCKETS,
                             WAIT_SECONDS_BUCKETS)
# TIERS is also the top-down order lookups cascade in
from kvscope.vocabulary import (ADMISSION_RESULTS, DIRECTIONS, EVICTION_REASONS,
                                FAILURE_REASONS, TIERS, TOKEN_SOURCES)

cdef object _SNAPSHOT = ev.TierSnapshot, _STARTED = ev.RequestStarted, _LOOKUP = ev.Lookup
cdef object _TRANSFER = ev.Transfer, _EVICTION = ev.Eviction, _LATENCY = ev.LatencyHistogram
cdef object _FINISHED = ev.RequestFinished, _SCHEDULER = ev.SchedulerStats
cdef object _ABORTED = ev.RequestAborted
cdef object _IDLE = ev.IdleHistogram, _ADMISSION = ev.Admission
cdef object _IN_FLIGHT = ev.TransfersInFlight
cdef object _MEMORY = ev.EngineMemory
cdef tuple MEMORY_FIELDS = ("kv_offload_budget", "kv_cache", "allocated")
cdef int RECOMPUTE = TOKEN_SOURCES.index("recompute")  # in RequestRecord's tokens
# finished requests of a scope that measured prefill (recomputed tokens and their seconds)
# before their rate prices its lookups' seconds saved (Fold.prefill_rate)
MIN_PREFILL_REQUESTS = 10
cdef Py_ssize_t L_BLOCKS = offset_of(ev.Lookup, "blocks")
cdef Py_ssize_t L_TOKENS = offset_of(ev.Lookup, "tokens")
cdef Py_ssize_t L_HITS = offset_of(ev.Lookup, "block_hits")
cdef Py_ssize_t L_RATE = offset_of(ev.Lookup, "prefill_tokens_per_second")
cdef Py_ssize_t T_TS = offset_of(ev.Transfer, "ts")
cdef Py_ssize_t T_ID = offset_of(ev.Transfer, "request_id")
cdef Py_ssize_t T_SRC = offset_of(ev.Transfer, "src")
cdef Py_ssize_t T_DST = offset_of(ev.Transfer, "dst")
cdef Py_ssize_t T_BLOCKS = offset_of(ev.Transfer, "blocks")
cdef Py_ssize_t T_BYTES = offset_of(ev.Transfer, "bytes")
cdef Py_ssize_t T_DURATION = offset_of(ev.Transfer, "duration")
cdef Py_ssize_t T_OK = offset_of(ev.Transfer, "ok")
cdef Py_ssize_t T_REASON = offset_of(ev.Transfer, "reason")
cdef Py_ssize_t T_TIMED = offset_of(ev.Transfer, "timed")
cdef Py_ssize_t T_SEES_FAILURES = offset_of(ev.Transfer, "sees_failures")
cdef Py_ssize_t E_TIER = offset_of(ev.Eviction, "tier")
cdef Py_ssize_t E_BLOCKS = offset_of(ev.Eviction, "blocks")
cdef Py_ssize_t E_AGE = offset_of(ev.Eviction, "age")
cdef Py_ssize_t E_HITS = offset_of(ev.Eviction, "hits")
cdef Py_ssize_t E_OFFLOADED = offset_of(ev.Eviction, "offloaded")
cdef Py_ssize_t E_REASON = offset_of(ev.Eviction, "reason")
cdef Py_ssize_t E_MEASURED = offset_of(ev.Eviction, "measured")
cdef Py_ssize_t E_WEIGHT = offset_of(ev.Eviction, "weight")
cdef Py_ssize_t E_IDLE = offset_of(ev.Eviction, "idle")
cdef Py_ssize_t S_WAITING = offset_of(ev.SchedulerStats, "waiting")
cdef Py_ssize_t S_RUNNING = offset_of(ev.SchedulerStats, "running")
cdef Py_ssize_t S_PREEMPTIONS = offset_of(ev.SchedulerStats, "preemptions")
cdef Py_ssize_t S_USAGE = offset_of(ev.SchedulerStats, "gpu_kv_usage")

cdef enum:
    MAX_KEYS = 160  # the largest label set: 16 directions x 10 failure reasons
    MAX_BUCKETS = 32
cdef int _REASONS = len(FAILURE_REASONS)
if 16 * _REASONS > MAX_KEYS:
    raise ImportError(f"{len(FAILURE_REASONS)} failure reasons: MAX_KEYS in fold.pyx is too small")
cdef int _OTHER = FAILURE_REASONS.index("other")
cdef dict _REASON_INDEX = {reason: i for i, reason in enumerate(FAILURE_REASONS)}
cdef tuple _EVICTION_REASONS = EVICTION_REASONS


cdef struct _Totals:
    # a batch's lookups, added up before they are counted (see Fold._count_lookups)
    int64_t tokens[4]  # by TOKEN_SOURCES
    int sources  # bit mask, by TOKEN_SOURCES, of the sources the lookups measure
    double saved[4]
    int64_t hit[4]  # by TIERS
    int64_t miss[4]
    bint counted[4]


cdef struct Counts:
    # a counter family over a fixed label set: each key's value, whether it was ever added to
    # (a key exists from its first addition, 0 or not: Prometheus shows its series from then),
    # and the order the keys first came
    int64_t value[MAX_KEYS]
    bint seen[MAX_KEYS]
    int order[MAX_KEYS]
    int n


cdef extern from *:
    """
    /* a + b, or the nearest int64 when that overflows: a tap's absurd counts (events carry up
       to 2**53 each) stop a counter at its end, never wrap it negative */
    static int64_t kv_saturated(int64_t a, int64_t b) {
        int64_t sum;
        if (__builtin_add_overflow(a, b, &sum)) return b > 0 ? INT64_MAX : INT64_MIN;
        return sum;
    }
    static int64_t kv_saturated_product(int64_t a, int64_t b) {
        int64_t product;
        if (__builtin_mul_overflow(a, b, &product)) return (a > 0) == (b > 0) ? INT64_MAX : INT64_MIN;
        return product;
    }
    """
    int64_t kv_saturated(int64_t a, int64_t b) noexcept nogil
    int64_t kv_saturated_product(int64_t a, int64_t b) noexcept nogil


cdef inline void _add(Counts *counts, int key, int64_t value) noexcept:
    if not counts.seen[key]:
        counts.seen[key] = True
        counts.order[counts.n] = key
        counts.n += 1
    counts.value[key] = kv_saturated(counts.value[key], value)


cdef dict _as_dict(Counts *counts, tuple keys):
    return {keys[counts.order[i]]: counts.value[counts.order[i]] for i in range(counts.n)}


@cython.final
cdef class _Histogram:
    """Observations counted per bucket (``counts[i]``: those <= ``bounds[i]`` and above the
    bound before; the last, those above every bound), their sum, and per bucket the latest
    observation of a request as its exemplar (the record, so that the exemplar names the
    record's trace id as it is when read: a later report may change it)."""

    cdef tuple buckets
    cdef double bounds[MAX_BUCKETS]
    cdef int n
    cdef int64_t counts[MAX_BUCKETS]
    cdef double sum
    cdef PyObject *record[MAX_BUCKETS]  # owned references, NULL: no exemplar
    cdef double value[MAX_BUCKETS]
    cdef double time[MAX_BUCKETS]
    cdef int order[MAX_BUCKETS]  # the buckets in the order their first exemplar came
    cdef int exemplars

    def __init__(self, tuple buckets):
        if len(buckets) >= MAX_BUCKETS:
            raise ValueError(f"at most {MAX_BUCKETS - 1} buckets")
        self.buckets, self.n = buckets, len(buckets)
        for i, bound in enumerate(buckets):
            self.bounds[i] = bound

    def __dealloc__(self):
        for i in range(self.n + 1):
            Py_XDECREF(self.record[i])

    cdef inline int _bucket(self, double value) noexcept:
        # bisect_left: the first bound >= value (NaN lands in the first)
        cdef int low = 0, high = self.n, middle
        while low < high:
            middle = (low + high) >> 1
            if self.bounds[middle] < value:
                low = middle + 1
            else:
                high = middle
        return low

    cdef void observe(self, double value, int64_t weight, PyObject *record, double at) noexcept:
        cdef int i = self._bucket(value)
        self.counts[i] = kv_saturated(self.counts[i], weight)
        self.sum += value * weight
        if record != NULL:
            if self.record[i] == NULL:
                self.order[self.exemplars] = i
                self.exemplars += 1
            Py_XINCREF(record)
            Py_XDECREF(self.record[i])
            self.record[i], self.value[i], self.time[i] = record, value, at

    cdef add_buckets(self, bounds, counts, double total):
        """Fold in another histogram's per-bucket ``counts`` (``len(bounds) + 1`` entries, the
        last above every bound) and their sum ``total``. Each engine bucket lands in our bucket
        holding its upper bound, so quantiles err toward the slower side, never the faster."""
        cdef int j
        for i, n in enumerate(counts):
            j = self._bucket(bounds[i] if i < len(bounds) else float("inf"))
            self.counts[j] = kv_saturated(self.counts[j], n)
        self.sum += total

    cdef tuple state(self):
        """(buckets, per-bucket counts, sum, {bucket: (trace id, value, Unix seconds)})."""
        exemplars = {}
        for j in range(self.exemplars):
            i = self.order[j]
            trace_id = (<RequestRecord>self.record[i]).trace_id
            if trace_id:
                exemplars[i] = (trace_id, self.value[i], self.time[i])
        return (self.buckets, [self.counts[i] for i in range(self.n + 1)], self.sum, exemplars)


cdef tuple _DIRECTIONS = DIRECTIONS
cdef tuple _LOOKUP_KEYS = tuple((tier, result) for tier in TIERS for result in ("hit", "miss"))
cdef tuple _FAILURE_KEYS = tuple((src, dst, reason) for src, dst in _DIRECTIONS
                                 for reason in FAILURE_REASONS)
cdef tuple _EVICTION_KEYS = tuple((tier, reason) for tier in TIERS for reason in EVICTION_REASONS)
cdef tuple _TIER_KEYS = tuple(TIERS)
cdef tuple _ADMISSION_KEYS = tuple((tier, result) for tier in TIERS for result in ADMISSION_RESULTS)
cdef tuple _SOURCE_KEYS = TOKEN_SOURCES


@cython.final
cdef class Fold:
    """The pipeline's aggregated state and its fold (not thread-safe: the pipeline calls it
    under its lock).

    ``prefill_tokens_per_second``: the rate behind the seconds saved when a lookup gives none
    and its scope's finished requests have not measured one (:meth:`prefill_rate`);
    ``recent``: TTFTs kept for percentiles; ``assembler``: where request records are built.
    """

    cdef readonly RequestAssembler assembler
    cdef double _prefill_rate
    cdef dict _prefill_measured  # scope -> [requests, recomputed tokens, prefill seconds]
    cdef Counts _prompt, _lookups, _bytes, _blocks, _failures, _evicted, _dropped
    cdef int _failures_seen  # bit (src * 4 + dst): a source that sees its failures moved blocks
    cdef Counts _admissions  # by (tier, result): _ADMISSION_KEYS
    cdef double _saved[4]
    cdef Counts _saved_seen  # its values unused: which sources have seconds saved, in order
    cdef list _transfer_seconds  # by direction (src * 4 + dst): _Histogram or None
    cdef list _transfer_order, _hits, _residency, _measured_order
    cdef list _idle, _idle_order  # by tier: _Histogram or None; the tiers in order first seen
    cdef _Histogram _ttft, _wait, _itl
    cdef int64_t _requests
    cdef bint _records_seen  # a finished record came: requests are counted from records alone
    cdef double *_recent  # a ring of the last TTFTs, seconds
    cdef Py_ssize_t _recent_count, _recent_next, _recent_max
    # per sender: its scheduler's last gauges and its preemptions added up, each only once
    # reported (a dict per metric, keyed by source; see _scheduler_stats)
    cdef dict _waiting, _running, _preemptions, _gpu_kv_usage
    cdef dict _in_flight  # (source, src, dst) -> (transfers, blocks): each sender's last report
    cdef dict _memory  # (source, device) -> {field: bytes}: what each sender reported, merged

    def __init__(self, RequestAssembler assembler not None,
                 double prefill_tokens_per_second=10_000.0,
                 Py_ssize_t recent=10_000):
        if recent < 0:
            raise ValueError(f"the recent TTFTs kept are 0 or more, not {recent}")
        self.assembler = assembler
        self._prefill_rate = prefill_tokens_per_second
        self._prefill_measured = {}
        self._transfer_seconds, self._transfer_order = [None] * 16, []
        self._hits, self._residency, self._measured_order = [None] * 4, [None] * 4, []
        self._idle, self._idle_order = [None] * 4, []
        self._ttft = _Histogram(LATENCY_SECONDS_BUCKETS)
        self._wait = _Histogram(WAIT_SECONDS_BUCKETS)
        self._itl = _Histogram(LATENCY_SECONDS_BUCKETS)
        self._waiting, self._running, self._preemptions, self._gpu_kv_usage = {}, {}, {}, {}
        self._in_flight = {}
        self._memory = {}
        self._recent = <double *>PyMem_Malloc(max(recent, 1) * sizeof(double))
        if self._recent == NULL:
            raise MemoryError()
        self._recent_max = recent

    def __dealloc__(self):
        PyMem_Free(self._recent)

    def fold(self, str source, str scope, events, tiers, bint observe):
        """Fold one batch of sender ``source``'s ``events`` about ``scope``'s requests, in
        their order; anything not an event is left out. A tier snapshot goes through
        ``tiers(source, scope, snapshots)``, which returns the bit mask, by TIERS, of the
        tiers ``scope``'s lookups count misses in (also called, with [], before a batch's
        first lookup). ``observe``: count finished requests in the request metrics now (else
        :meth:`observe` does later).

        Returns (the records finished, in order; how many of them finished too far ahead of
        the clock to be true and were dropped; the batch's Lookup events).
        """
        cdef RequestAssembler assembler = self.assembler
        cdef _Requests tables = assembler._tables(scope)
        cdef bint joined = scope in assembler.joined
        cdef int known = -1  # the tiers scope's lookups count misses in, once asked
        cdef _Totals totals
        cdef list finished = [], lookups = []
        cdef RequestRecord record
        cdef int t
        cdef double rate = self.prefill_rate(scope)
        memset(&totals, 0, sizeof(totals))
        for event in (events if type(events) is list else list(events)):
            kind = type(event)
            if kind is _TRANSFER:
                self._transfer(scope, tables, event)
            elif kind is _LOOKUP:
                if known < 0:
                    known = tiers(source, scope, [])
                self._lookup(event, assembler.lookup(scope, tables, event), known, rate,
                             &totals)
                lookups.append(event)
            elif kind is _STARTED:
                assembler.start(scope, tables, joined, event)
            elif kind is _FINISHED:
                record = assembler.finish(scope, tables, joined, event)
                if record is not None:
                    finished.append(record)
                    self._prefill_seen(scope, record)
            elif kind is _ABORTED:
                assembler.abort(tables, event.request_id)
            elif kind is _EVICTION:
                self._eviction(event)
            elif kind is _SNAPSHOT:
                known = tiers(source, scope, [event])
            elif kind is _LATENCY:
                # TTFTs without records (zero-code mode): requests that finished prefill.
                # Beside a tap's or spans' records they are those requests again, in the
                # histogram as in the count: both take them, or neither (the count alone
                # skipped them, and requests_total fell behind the histogram's count)
                if not self._records_seen:
                    self._ttft.add_buckets(event.bounds, event.counts, event.sum)
                    self._requests = kv_saturated(self._requests, sum(event.counts))
            elif kind is _SCHEDULER:
                self._scheduler_stats(source, event)
            elif kind is _IDLE:
                t = index_of(_TIER_KEYS, event.tier)
                if t >= 0:
                    self._idle_of(t).add_buckets(event.bounds, event.counts, event.sum)
            elif kind is _ADMISSION:
                self._admission(event)
            elif kind is _IN_FLIGHT:
                self._in_flight[(source, event.src, event.dst)] = (event.transfers, event.blocks)
            elif kind is _MEMORY:
                self._engine_memory(source, event)
        self._count_lookups(&totals)
        cdef double ahead = time.time() + FUTURE
        cdef list kept = [record for record in finished
                          if record._finished <= ahead and record.arrival <= ahead]
        if observe:
            self.observe(kept)
        return kept, len(finished) - len(kept), lookups

    def prefill_rate(self, str scope) -> float:
        """Prefill tokens/s behind the seconds saved of ``scope``'s lookups that carry no rate
        of their own: its finished requests' recomputed tokens over their prefill seconds (as
        ``kvscope compare`` measures a capture's, kvscope.analysis.rates), once
        :data:`MIN_PREFILL_REQUESTS` of them measured both, else the agent's configured
        rate (vLLM's tap carries none: a tryout's card read 19.5x at 10,000 tokens/s where
        compare measured 4.8x at 73,505)."""
        cdef list seen = self._prefill_measured.get(scope)
        if seen is not None and seen[0] >= MIN_PREFILL_REQUESTS and seen[1] >= seen[2]:
            return seen[1] / seen[2]  # at least 1 token/s, as a lookup's own rate must be
        return self._prefill_rate

    cdef void _prefill_seen(self, str scope, RequestRecord record):
        cdef int64_t recomputed = record._tokens[RECOMPUTE]
        cdef list seen
        if record._tokens_set & (1 << RECOMPUTE) and recomputed > 0 and record.prefill > 0:
            seen = self._prefill_measured.get(scope)
            if seen is None:
                seen = self._prefill_measured[scope] = [0, 0, 0.0]
            seen[0] += 1
            seen[1] += recomputed
            seen[2] += record.prefill

    cdef int _lookup(self, object event, RequestRecord record, int known, double measured,
                     _Totals *totals) except -1:
        # Each block counts as a hit in the first tier, top down, that held it, and as a miss
        # in each tier the engine has above that one. A lookup's tiers are those its source
        # reported in snapshots and those its hits name (not another engine's on the node).
        cdef int64_t found[4]
        cdef int64_t remaining, n
        cdef double rate
        cdef int i, t, named = 0
        cdef dict tokens = <dict?>field(event, L_TOKENS), hits = <dict?>field(event, L_HITS)
        cdef Py_ssize_t position = 0
        cdef PyObject *key
        cdef PyObject *value
        # under 1 token/s is no prefill rate: a tiny one would make the seconds saved infinite
        rate = float_field(event, L_RATE)
        if not rate >= 1.0:
            rate = measured
        if record is not None:  # the lookup's tokens are the request's
            record.set_tokens(tokens)
        while PyDict_Next(tokens, &position, &key, &value):
            i = index_of(_SOURCE_KEYS, <object>key)
            if i >= 0:
                totals.sources |= 1 << i
                n = <object>value
                totals.tokens[i] = kv_saturated(totals.tokens[i], n)
                totals.saved[i] += n / rate
        position = 0
        while PyDict_Next(hits, &position, &key, &value):
            t = index_of(_TIER_KEYS, <object>key)
            if t >= 0:
                named |= 1 << t
                found[t] = <object>value
        if tokens:  # a source naming where tokens came from names recompute too (the rest),
            # and the local tiers it has (TIERS[:3] are the cached token sources, in order)
            totals.sources |= 1 << 3 | ((known | named) & 0b111)
        remaining = int_field(event, L_BLOCKS)
        for t in range(4):
            if remaining <= 0:
                break
            if not (known | named) & (1 << t):  # neither its engine's nor named: skipped
                continue
            totals.counted[t] = True
            if named & (1 << t):
                n = found[t] if found[t] < remaining else remaining
                remaining -= n
                totals.hit[t] = kv_saturated(totals.hit[t], n)
            totals.miss[t] = kv_saturated(totals.miss[t], remaining)
        return 0

    cdef void _count_lookups(self, _Totals *totals) noexcept:
        """Add a batch's lookups: tokens and the seconds they saved by source (those with
        tokens), blocks by tier and result (the tiers consulted)."""
        cdef int i
        for i in range(4):
            # A token source is exported from the first lookup that measures it, at 0 until it
            # has tokens (so rate() sees its first ones); one no lookup measures stays absent:
            # not measured, never 0 (LMCache's view of the GPU's hits, a tier the engine lacks,
            # prompt tokens of an agent whose sources report none, as KVBM's counters).
            if totals.sources & (1 << i):
                _add(&self._prompt, i, totals.tokens[i])
            if totals.tokens[i] and i != 3:  # recompute saves nothing
                _add(&self._saved_seen, i, 0)
                self._saved[i] += totals.saved[i]
            if totals.counted[i]:
                _add(&self._lookups, 2 * i, totals.hit[i])
                _add(&self._lookups, 2 * i + 1, totals.miss[i])

    cdef int _transfer(self, str scope, _Requests tables, object event) except -1:
        """Count the transfer, and give it to its request's record."""
        cdef object src = field(event, T_SRC), dst = field(event, T_DST)
        cdef int64_t blocks = int_field(event, T_BLOCKS), nbytes = int_field(event, T_BYTES)
        cdef double ts = float_field(event, T_TS), duration = float_field(event, T_DURATION)
        cdef bint ok = bool_field(event, T_OK)
        cdef RequestRecord record = self.assembler.transfer(
            scope, tables, field(event, T_ID), ts, src, dst, blocks, nbytes, duration, ok)
        cdef int s = index_of(_TIER_KEYS, src), d = index_of(_TIER_KEYS, dst), direction, i
        cdef _Histogram hist
        if s < 0 or d < 0:
            return 0  # not a tier: the decoder refuses it; an event made in Python may not
        direction = 4 * s + d
        if not (self._failures_seen >> direction) & 1 and (
                not ok or bool_field(event, T_SEES_FAILURES)):
            # every reason at 0 from then on, so the first failures show in rate() (Prometheus
            # advises initialising label sets known in advance); never for sources blind to them
            self._failures_seen |= 1 << direction
            for i in range(_REASONS):
                _add(&self._failures, direction * _REASONS + i, 0)
        if not ok:
            _add(&self._failures, direction * _REASONS
                 + _REASON_INDEX.get(field(event, T_REASON), _OTHER), 1)
            return 0
        # blocks of 0 bytes: a source without their size; bytes of 0 blocks: a source that
        # counts bytes alone (vLLM's /metrics without block_bytes): either not measured
        if nbytes or not blocks:
            _add(&self._bytes, direction, nbytes)
        if blocks or not nbytes:
            _add(&self._blocks, direction, blocks)
        if not bool_field(event, T_TIMED):  # seen, not timed: its duration is no measurement
            return 0
        hist = self._transfer_seconds[direction]
        if hist is None:
            hist = self._transfer_seconds[direction] = _Histogram(TRANSFER_SECONDS_BUCKETS)
            self._transfer_order.append(direction)
        hist.observe(duration, 1, NULL if record is None else <PyObject *>record, ts)
        return 0

    cdef int _eviction(self, object event) except -1:
        cdef int tier = index_of(_TIER_KEYS, field(event, E_TIER))
        cdef int64_t blocks, weight
        cdef _Histogram hits, residency
        if tier < 0:
            return 0
        blocks = int_field(event, E_BLOCKS)
        _add(&self._evicted,
             3 * tier + max(0, index_of(_EVICTION_REASONS, field(event, E_REASON))), blocks)
        # 0 for offloaded blocks: a tier whose evictions all kept a copy shows 0 dropped,
        # measured, not an absent series
        _add(&self._dropped, tier, 0 if bool_field(event, E_OFFLOADED) else blocks)
        idle = field(event, E_IDLE)
        weight = kv_saturated_product(blocks, int_field(event, E_WEIGHT))
        if idle is not None:  # None: the source does not see it (never a 0)
            self._idle_of(tier).observe(<double>idle, weight, NULL, 0.0)
        if not bool_field(event, E_MEASURED):  # the source cannot see age and hits
            return 0
        if self._hits[tier] is None:
            self._hits[tier] = _Histogram(EVICTED_HITS_BUCKETS)
            self._residency[tier] = _Histogram(RESIDENCY_SECONDS_BUCKETS)
            self._measured_order.append(tier)
        hits, residency = self._hits[tier], self._residency[tier]
        hits.observe(<double>int_field(event, E_HITS), weight, NULL, 0.0)
        residency.observe(float_field(event, E_AGE), weight, NULL, 0.0)
        return 0

    cdef int _admission(self, object event) except -1:
        """Add an Admission's blocks per result; a result it leaves None (not seen) stays
        absent, a 0 makes its series appear."""
        cdef int tier = index_of(_TIER_KEYS, event.tier)
        if tier < 0:
            return 0
        for i, n in enumerate((event.stored, event.skipped, event.failed)):
            if n is not None:
                _add(&self._admissions, 3 * tier + i, n)
        return 0

    cdef _Histogram _idle_of(self, int tier):
        """Tier ``tier``'s idle-before-eviction histogram, made at its first observation (a
        tier no source measures has none: absent, not 0)."""
        if self._idle[tier] is None:
            self._idle[tier] = _Histogram(RESIDENCY_SECONDS_BUCKETS)
            self._idle_order.append(tier)
        return self._idle[tier]

    cdef int _scheduler_stats(self, str source, object event) except -1:
        """Keep sender ``source``'s scheduler gauges and add its preemptions; a field the
        event leaves None (unknown) changes nothing, so its metric stays absent or as it was."""
        for offset, gauges in ((S_WAITING, self._waiting), (S_RUNNING, self._running),
                               (S_USAGE, self._gpu_kv_usage)):
            value = field(event, offset)
            if value is not None:
                gauges[source] = value
        value = field(event, S_PREEMPTIONS)
        if value is not None:  # a Python int: no bound to overflow
            self._preemptions[source] = self._preemptions.get(source, 0) + value
        return 0

    cdef int _engine_memory(self, str source, object event) except -1:
        # a field left None keeps what the sender said before (events.EngineMemory)
        known = self._memory.setdefault((source, event.device), {})
        for name in MEMORY_FIELDS:
            value = getattr(event, name)
            if value is not None:
                known[name] = value
        return 0

    def engine_memory(self):
        """dict[(source, device), dict[field, bytes]]: each sender's
        :class:`~kvscope.events.EngineMemory` reports, merged (only the fields it reported)."""
        return {key: dict(known) for key, known in self._memory.items()}

    def forget_gauges(self, str source):
        """Leave sender ``source``'s gauges (waiting, running, GPU KV usage, transfers in
        flight, engine memory) out from now on: its engine stopped. Its preemptions stay counted, as counters
        do."""
        for gauges in (self._waiting, self._running, self._gpu_kv_usage):
            gauges.pop(source, None)
        for key in [key for key in self._in_flight if key[0] == source]:
            del self._in_flight[key]
        for key in [key for key in self._memory if key[0] == source]:
            del self._memory[key]

    def observe(self, list records):
        """Count finished ``records`` in the request metrics (requests, TTFT, and for those
        that measured one promotion-wait and ITL histograms, the recent TTFTs), as they are now."""
        cdef RequestRecord record
        for record in records:
            self._records_seen = True
            self._requests += 1
            self._ttft.observe(record._ttft, 1, <PyObject *>record, record._finished)
            if not isnan(record._promotion_wait):  # NaN: not measured (vLLM's spans alone)
                self._wait.observe(record._promotion_wait, 1, NULL, 0.0)
            if record.itl > 0:  # 0: not reported (a single output token, or no decode time)
                self._itl.observe(record.itl, 1, NULL, 0.0)
            self._remember(record._ttft)

    cdef void _remember(self, double ttft) noexcept:
        if self._recent_max:
            self._recent[self._recent_next] = ttft
            self._recent_next = (self._recent_next + 1) % self._recent_max
            self._recent_count = min(self._recent_count + 1, self._recent_max)

    def remember_ttfts(self, ttfts):
        """Keep ``ttfts`` (seconds, oldest first; None: unknown, left out) among the recent
        ones behind the percentiles."""
        for ttft in ttfts:
            if ttft is not None:
                self._remember(ttft)

    def state(self):
        """The aggregated state, as plain data keyed by label values (as
        :class:`~kvscope.agent.pipeline.Snapshot` names them), a histogram as the tuple
        (buckets, per-bucket counts, sum, {bucket: (trace id, value, Unix seconds)})."""
        saved = {_SOURCE_KEYS[self._saved_seen.order[i]]: self._saved[self._saved_seen.order[i]]
                 for i in range(self._saved_seen.n)}
        return {
            "prompt_tokens": _as_dict(&self._prompt, _SOURCE_KEYS),
            "lookup_blocks": _as_dict(&self._lookups, _LOOKUP_KEYS),
            "prefill_seconds_saved": saved,
            "transfer_bytes": _as_dict(&self._bytes, _DIRECTIONS),
            "transfer_blocks": _as_dict(&self._blocks, _DIRECTIONS),
            "transfer_seconds": {_DIRECTIONS[d]: (<_Histogram>self._transfer_seconds[d]).state()
                                 for d in self._transfer_order},
            "transfer_failures": _as_dict(&self._failures, _FAILURE_KEYS),
            "evicted_blocks": _as_dict(&self._evicted, _EVICTION_KEYS),
            "dropped_blocks": _as_dict(&self._dropped, _TIER_KEYS),
            "store_admissions": _as_dict(&self._admissions, _ADMISSION_KEYS),
            "evicted_block_hits": {_TIER_KEYS[t]: (<_Histogram>self._hits[t]).state()
                                   for t in self._measured_order},
            "block_residency_seconds": {_TIER_KEYS[t]: (<_Histogram>self._residency[t]).state()
                                        for t in self._measured_order},
            "block_idle_seconds": {_TIER_KEYS[t]: (<_Histogram>self._idle[t]).state()
                                   for t in self._idle_order},
            "requests": self._requests,
            "ttft_seconds": self._ttft.state(),
            "promotion_wait_seconds": self._wait.state(),
            "itl_seconds": self._itl.state(),
            "requests_waiting": dict(self._waiting),
            "requests_running": dict(self._running),
            "preemptions": dict(self._preemptions),
            "gpu_kv_cache_usage": dict(self._gpu_kv_usage),
            "transfers_in_flight": {key: n for key, (n, _) in self._in_flight.items()},
            "transfer_blocks_in_flight": {key: n for key, (_, n) in self._in_flight.items()},
            "engine_memory": self.engine_memory(),
            "recent_ttft": [self._recent[(self._recent_next - self._recent_count + i)
                                         % self._recent_max] for i in range(self._recent_count)],
        }
