# cython: language_level=3, embedsignature=True
"""The request assembler: builds request records from events, source by source (compiled).

One method per event kind takes one event of one source, in arrival order (the pipeline folds
a batch event by event, see :mod:`kvscope.agent.fold`).
"""

import logging
from collections import Counter

cimport cython
from cpython.dict cimport PyDict_SetDefault
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport int64_t


cdef extern from *:
    """
    #define _kv_prefetch(p) __builtin_prefetch((const void *)(p), 1, 3)
    """
    void _prefetch "_kv_prefetch" (const void *address) noexcept nogil

from kvscope import events as ev
from kvscope.agent.requests cimport (RequestRecord, Ring, new_record, prefill_within,
                                     queueing_without_wait, under_way, within)
from kvscope.agent.requests import MAX_TRANSFERS, arrival_of
from kvscope.agent.slots cimport (field, float_field, int_field, offset_of,
                                  optional_float_field)

log = logging.getLogger("kvscope.agent.requests")

# Records kept per request id among the recent ones: a client may reuse an id (X-Request-Id),
# and a late report must join the request it is about, not the newest of that id. vLLM sends a
# batch of spans every 5 s: 64 covers a client reusing one id up to 10 times a second (at 4,
# five requests of one id in a batch pushed one another out and all counted twice).
MAX_REUSES = 64
cdef Py_ssize_t _MAX_REUSES = MAX_REUSES
cdef Py_ssize_t _MAX_TRANSFERS = MAX_TRANSFERS
# Ids of requests that ended before their first token, kept per source for a worker's transfers
# of them that come after (its batches come up to a flush interval late): those join no record
# rather than open one nothing would finish.
MAX_ABORTED = 1024
cdef Py_ssize_t _MAX_ABORTED = MAX_ABORTED
# what a second finish of one request may fill in (see RequestAssembler.finished)
_FINISH_PARTS = ("output_tokens", "queueing", "lookup", "promotion_wait", "prefill", "itl")

cdef Py_ssize_t S_TS = offset_of(ev.RequestStarted, "ts")
cdef Py_ssize_t S_ID = offset_of(ev.RequestStarted, "request_id")
cdef Py_ssize_t S_PROMPT = offset_of(ev.RequestStarted, "prompt_tokens")
cdef Py_ssize_t S_TRACE = offset_of(ev.RequestStarted, "trace_id")
cdef Py_ssize_t L_TS = offset_of(ev.Lookup, "ts")
cdef Py_ssize_t L_ID = offset_of(ev.Lookup, "request_id")
cdef Py_ssize_t F_TS = offset_of(ev.RequestFinished, "ts")
cdef Py_ssize_t F_ID = offset_of(ev.RequestFinished, "request_id")
cdef Py_ssize_t F_TTFT = offset_of(ev.RequestFinished, "ttft")
cdef Py_ssize_t F_PROMPT = offset_of(ev.RequestFinished, "prompt_tokens")
cdef Py_ssize_t F_OUTPUT = offset_of(ev.RequestFinished, "output_tokens")
cdef Py_ssize_t F_QUEUEING = offset_of(ev.RequestFinished, "queueing")
cdef Py_ssize_t F_LOOKUP = offset_of(ev.RequestFinished, "lookup")
cdef Py_ssize_t F_WAIT = offset_of(ev.RequestFinished, "promotion_wait")
cdef Py_ssize_t F_PREFILL = offset_of(ev.RequestFinished, "prefill")
cdef Py_ssize_t F_ITL = offset_of(ev.RequestFinished, "itl")


@cython.final
cdef class _Index:
    """Records by request id: open addressing with linear probing, and deletion by backward
    shift, so that no deleted slot is left behind. A dict of the recent records, each finish
    adding one id and the oldest id leaving, rebuilt itself every few thousand changes,
    touching all of it (most of a finish's cache misses). A slot holds the record and the
    hash of its request id, so that adding and taking out a record read no string (its id
    cannot change: ``RequestRecord.request_id`` is read-only)."""

    def __cinit__(self, Py_ssize_t expected):
        cdef Py_ssize_t size = 8
        while 3 * size < 4 * expected:  # filled at most three quarters: the slots stay in cache
            size *= 2
        self._slots = <_Slot *>PyMem_Calloc(size, sizeof(_Slot))
        if self._slots == NULL:
            raise MemoryError()
        self._mask = size - 1

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._slots != NULL:
            for i in range(self._mask + 1):
                Py_XDECREF(self._slots[i].record)
            PyMem_Free(self._slots)

    cdef Py_ssize_t _find(self, object key, Py_hash_t hash) except? -2:
        """The slot of the record of request id ``key``, or -1 - the free slot where it would
        go."""
        cdef Py_ssize_t i = hash & self._mask
        cdef _Slot *slot
        cdef PyObject *id
        while True:
            slot = &self._slots[i]
            if slot.record == NULL:
                return -1 - i
            if slot.hash == hash:
                id = <PyObject *>(<RequestRecord>slot.record).request_id
                if id == <PyObject *>key or <object>id == key:
                    return i
            i = (i + 1) & self._mask

    cdef RequestRecord get(self, object key):
        cdef Py_ssize_t i = self._find(key, hash(key))
        return None if i < 0 else <RequestRecord>self._slots[i].record

    cdef RequestRecord put_new(self, RequestRecord record):
        """Add ``record`` and return None, or return the record its id has."""
        cdef Py_ssize_t i = self._find(record.request_id, record._id_hash)
        if i >= 0:
            return <RequestRecord>self._slots[i].record
        if 4 * (self._count + 1) > 3 * (self._mask + 1):
            self._grow()
            i = self._find(record.request_id, record._id_hash)
        i = -1 - i
        Py_INCREF(record)
        self._slots[i].hash, self._slots[i].record = record._id_hash, <PyObject *>record
        self._count += 1
        return None

    cdef void replace(self, RequestRecord record):
        """Put ``record`` in the place of its id's (which the index has)."""
        cdef Py_ssize_t i = self._find(record.request_id, record._id_hash)
        Py_INCREF(record)
        Py_XDECREF(self._slots[i].record)
        self._slots[i].record = <PyObject *>record

    cdef void remove(self, RequestRecord record):
        """Take out ``record`` (which the index has) and close the gap after it."""
        cdef Py_ssize_t i = record._id_hash & self._mask, j, home
        while self._slots[i].record != <PyObject *>record:  # by identity: no string read
            i = (i + 1) & self._mask
        Py_XDECREF(self._slots[i].record)
        self._slots[i].record = NULL
        j = i
        while True:
            j = (j + 1) & self._mask
            if self._slots[j].record == NULL:
                break
            home = self._slots[j].hash & self._mask
            # a slot stays unless its home lies cyclically outside (i, j]
            if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue
            self._slots[i] = self._slots[j]
            self._slots[j].record = NULL
            i = j
        self._count -= 1

    cdef void _grow(self):
        cdef _Slot *old = self._slots
        cdef Py_ssize_t size = self._mask + 1, i, j
        self._slots = <_Slot *>PyMem_Calloc(2 * size, sizeof(_Slot))
        if self._slots == NULL:
            self._slots = old
            raise MemoryError()
        self._mask = 2 * size - 1
        for i in range(size):
            if old[i].record != NULL:
                j = old[i].hash & self._mask
                while self._slots[j].record != NULL:
                    j = (j + 1) & self._mask
                self._slots[j] = old[i]
        PyMem_Free(old)


@cython.final
cdef class _Recent:
    """A source's recently finished records, by id, bounded in records: the ids whose last
    finish is oldest leave whole, first (a reused id moves to the newest end at each finish).

    ``by_id`` indexes an id's newest record, which links to the id's older ones (at most
    :data:`MAX_REUSES` in all, newest first). ``order`` lists every record added; a record a
    newer one of its id superseded keeps its place there, skipped when met at the front, and
    when such places outnumber the records ``order`` is rebuilt without them. A record
    finished costs one dict entry and, once it leaves, its deletion.
    """

    def __init__(self, Py_ssize_t capacity):
        self.by_id, self.order, self.count, self.capacity = _Index(capacity), Ring(), 0, capacity

    cdef RequestRecord newest(self, str request_id):
        return self.by_id.get(request_id)

    cdef void _prefetch(self) noexcept:
        """Ask the CPU for what the evictions to come read: the first cache line of the record
        16 places from the front, and the index slot of the one 8 places from it (its line
        came in since). Old records are far out of the caches (eviction missed them twice a
        record)."""
        cdef PyObject *far = self.order.peek(16)
        cdef PyObject *near = self.order.peek(8)
        if far != NULL:
            _prefetch(far)
        if near != NULL:
            _prefetch(&self.by_id._slots[(<RequestRecord>near)._id_hash & self.by_id._mask])

    cdef int add(self, RequestRecord record) except -1:
        cdef RequestRecord kept = self.by_id.put_new(record)
        cdef RequestRecord oldest
        cdef Py_ssize_t n
        self.count += 1
        if kept is not None:  # a reused id: its newest records, at most MAX_REUSES
            self.by_id.replace(record)
            record._previous, kept._superseded = kept, True
            n, kept = 1, record
            while kept._previous is not None and n < _MAX_REUSES:
                kept, n = kept._previous, n + 1
            if kept._previous is not None:  # one too many: the oldest leaves
                kept._previous = None
                self.count -= 1
        self.order.push(record)
        while self.count > self.capacity:
            self._prefetch()
            oldest = self.order.pop()
            if not oldest._superseded:  # the newest of its id: the id leaves, whole
                self.by_id.remove(oldest)
                while oldest is not None:
                    self.count -= 1
                    oldest._previous, oldest = None, oldest._previous
        if self.order.size() > 2 * self.capacity + 64:
            self.order.replace([r for r in self.order.values()
                                if not (<RequestRecord>r)._superseded])
        return 0


@cython.final
cdef class _Requests:
    """One source's requests: in flight, finished recently, the ids in flight that another
    event than the request's start opened (their arrival is that event's time until the start
    or the finish comes), and the ids of the last :data:`MAX_ABORTED` requests that ended
    before their first token (oldest first)."""

    def __init__(self, Py_ssize_t max_recent):
        self.inflight, self.recent, self.unstarted = {}, _Recent(max_recent), set()
        self.aborted = {}


@cython.final
cdef class RequestAssembler:
    """Builds :class:`~kvscope.agent.requests.RequestRecord` s from events, one method per
    event kind, each taking one of a source's events in arrival order.

    Each source's requests are kept apart (engines number requests on their own), and each
    source has its own bounds, so a busy or broken engine cannot push out another's requests:
    ``max_inflight`` requests started but not finished (beyond it the oldest is abandoned and
    counted in ``abandoned`` by source: a bound against engines that never finish), and
    ``max_recent`` finished records kept for late transfers (see :meth:`finished`).
    ``joined``: the sources whose requests another source finishes too (a container).
    ``amended``: the finished records changed since the pipeline last cleared it (by events
    here, or by the pipeline's :func:`~kvscope.agent.requests.amend`), by ``id()``, for the
    pipeline to store again. Not thread-safe: the pipeline calls it under its lock.
    """

    def __init__(self, Py_ssize_t max_inflight=10_000, Py_ssize_t max_recent=10_000,
                 joined=()):
        if max_inflight < 0 or max_recent < 0:
            raise ValueError(f"the assembler's bounds are 0 or more, not {max_inflight} "
                             f"requests in flight and {max_recent} recent")
        self._sources = {}
        self._max, self._max_recent = max_inflight, max_recent
        self.joined = joined
        self.abandoned = Counter()
        self._bound_logged = set()
        self.amended = {}

    def abandon(self, str source) -> int:
        """Close ``source``'s requests in flight that started, which will never finish (its
        engine stopped without finishing them), counting each in ``abandoned``; records that
        other events opened (a lookup alone: a sender that reports no starts) and its recent
        records stay. Returns how many it closed."""
        cdef _Requests tables = self._sources.get(source)
        if tables is None:
            return 0
        started = [rid for rid in tables.inflight if rid not in tables.unstarted]
        for rid in started:
            del tables.inflight[rid]
        if started:
            self.abandoned[source] += len(started)
        return len(started)

    cdef _Requests _tables(self, str source):
        cdef _Requests tables = self._sources.get(source)
        if tables is None:
            tables = self._sources[source] = _Requests(self._max_recent)
        return tables

    cdef RequestRecord _find(self, str source, _Requests tables, str request_id, double ts):
        """``source``'s record of ``request_id`` in flight; for a joined source also one
        finished recently that ``ts`` falls in (another source finished it first: vLLM's span
        before the tap's events). An event after every such finish is a new request."""
        cdef RequestRecord record = tables.inflight.get(request_id)
        if record is None and source in self.joined:
            record = self.finished_recently(source, request_id, ts)
            if record is not None:
                self.amended[id(record)] = record
        return record

    cpdef RequestRecord finished_recently(self, str source, str request_id, double ts,
                                          until=None):
        """``source``'s record of ``request_id``, among the last ``max_recent`` it finished,
        of the request under way at ``ts`` (see :func:`~kvscope.agent.requests.under_way`),
        the newest such; with ``until`` (a report of the span ``ts``-``until``), else of those
        that ran within that span (see :func:`~kvscope.agent.requests.within`), the one
        finishing nearest its end. None when there is none (an id reused: another request)."""
        cdef _Requests tables = self._sources.get(source)
        cdef RequestRecord record
        if tables is None:
            return None
        cdef RequestRecord newest = tables.recent.newest(request_id)
        record = newest
        while record is not None:
            if under_way(record, ts):
                return record
            record = record._previous
        if until is None:
            return None
        # of those within the span, the one finishing nearest its end (a reused id's next
        # request, arriving as this one finished, finishes after it); of two as near, the
        # older
        cdef RequestRecord nearest = None
        cdef double end = until
        record = newest
        while record is not None:
            if within(record, ts, end) and (
                    nearest is None or abs(record._finished - end) <= abs(nearest._finished - end)):
                nearest = record
            record = record._previous
        return nearest

    def in_flight(self, str source, str request_id):
        """``source``'s record of ``request_id`` started and not finished, or None."""
        cdef _Requests tables = self._sources.get(source)
        return None if tables is None else tables.inflight.get(request_id)

    cdef RequestRecord _open(self, str source, _Requests tables, str request_id, double ts):
        cdef RequestRecord record = self._find(source, tables, request_id, ts)
        if record is None:
            record = tables.inflight[request_id] = new_record(request_id, source, ts)
            tables.unstarted.add(request_id)
            self._bound(source, tables)
        return record

    cdef int _bound(self, str source, _Requests tables) except -1:
        cdef dict inflight = tables.inflight
        if len(inflight) > self._max and source not in self._bound_logged:
            self._bound_logged.add(source)
            log.warning("kvscope: source %r has %d requests started and not finished; the "
                        "oldest are abandoned (counted as dropped, reason abandoned; logged "
                        "once per source; the agent's requests_open_per_source raises the "
                        "bound, at about 4 KB a request)", source, self._max)
        while len(inflight) > self._max:
            oldest = next(iter(inflight))
            del inflight[oldest]
            tables.unstarted.discard(oldest)
            self.abandoned[source] += 1
        return 0

    cdef int start(self, str source, _Requests tables, bint joined, object event) except -1:
        """Open the request's record (a trace id that is not W3C's is taken as none)."""
        cdef RequestRecord record, opened = None
        rid, ts, trace_id = field(event, S_ID), float_field(event, S_TS), field(event, S_TRACE)
        if trace_id and not ev.w3c_trace_id(trace_id):  # as absent, not as a label
            trace_id = ""
        if tables.aborted:  # the id reused: a new request's transfers are its own
            tables.aborted.pop(rid, None)
        if joined:
            record = self._find(source, tables, rid, ts)
            if record is None:
                record = opened = tables.inflight[rid] = new_record(rid, source, ts)
        else:  # one lookup opens the request or finds it open
            opened = new_record(rid, source, ts)
            record = <RequestRecord>PyDict_SetDefault(tables.inflight, rid, opened)
        if record is opened:
            record.prompt_tokens = int_field(event, S_PROMPT)
            if trace_id:
                record.trace_id = trace_id
            return self._bound(source, tables)
        # another emitter's event opened the record first: arrival and trace id are the
        # start's, and its prompt tokens unless it has none (a span without usage)
        tables.unstarted.discard(rid)
        record.prompt_tokens = int_field(event, S_PROMPT) or record.prompt_tokens
        record.arrival = ts
        if trace_id:
            record.trace_id = trace_id
        return 0

    cdef RequestRecord lookup(self, str source, _Requests tables, object event):
        """The record the lookup is about (None when it names no request), opened when not in
        flight; the caller gives it the lookup's tokens."""
        rid = field(event, L_ID)
        if not rid:
            return None
        cdef RequestRecord record = tables.inflight.get(rid)
        return record if record is not None else self._open(source, tables, rid,
                                                            float_field(event, L_TS))

    cdef RequestRecord transfer(self, str source, _Requests tables, object rid, double ts,
                                object src, object dst, int64_t blocks, int64_t nbytes,
                                double duration, bint ok):
        """Attach a transfer (an event's fields, read by the caller) to request ``rid``;
        return that record (None when ``rid`` is "": background work, or names a request that
        ended before its first token and is not in flight)."""
        if not rid:
            return None
        cdef RequestRecord earlier, record = tables.inflight.get(rid)
        if record is None and tables.aborted and rid in tables.aborted:
            return None  # late, of a request that ended before its first token
        if record is None or ts < record.arrival:
            # a late worker's load joins the request under way at its start (of a reused id,
            # an earlier one than the request in flight), else the one in flight, else the
            # newest
            earlier = self.finished_recently(source, rid, ts)
            if earlier is not None or record is None:
                record = earlier or tables.recent.newest(rid)
                if record is None:
                    record = self._open(source, tables, rid, ts)
                else:
                    self.amended[id(record)] = record
        if record._ntransfers < _MAX_TRANSFERS:
            record.add_transfer(src, dst, blocks, nbytes, ts, duration, ok)
        else:
            record.transfers_omitted += 1
        return record

    cdef RequestRecord finish(self, str source, _Requests tables, bint joined, object event):
        """Complete the request's record and return it, and keep the newest ``max_recent``
        records (at most :data:`MAX_REUSES` of one id) so that another source's transfers sent
        later still join them (a worker tap may send its first batch after the scheduler's
        requests finished). A joined source's requests may be finished by another source
        first (vLLM's span before any of the tap's events): a second finish of a kept record
        (of a request that arrived before that record finished) only fills the parts the
        first left at 0 or did not measure, and returns None (it is not a new request)."""
        rid = field(event, F_ID)
        cdef RequestRecord kept, record = tables.inflight.pop(rid, None)
        if record is None:
            arrival = arrival_of(event)
            kept = self.finished_recently(source, rid, arrival) if joined else None
            if kept is not None:
                reported = kept.queueing  # vLLM's, its span's
                for part in _FINISH_PARTS:
                    if not getattr(kept, part):
                        setattr(kept, part, getattr(event, part))
                if reported:
                    kept.queueing = queueing_without_wait(reported, event.queueing,
                                                          kept._promotion_wait)
                kept.prefill = prefill_within(kept)
                self.amended[id(kept)] = kept
                return None
            record = new_record(rid, source, arrival)
        elif tables.unstarted and rid in tables.unstarted:  # its start went missing: its
            # arrival was another event's
            tables.unstarted.discard(rid)
            record.arrival = min(record.arrival, arrival_of(event))
        record.prompt_tokens = int_field(event, F_PROMPT) or record.prompt_tokens
        record.output_tokens = int_field(event, F_OUTPUT)
        record.set_ttft(float_field(event, F_TTFT))
        record.set_finished(float_field(event, F_TS))
        record.queueing = float_field(event, F_QUEUEING)
        record._lookup = optional_float_field(event, F_LOOKUP)
        record._promotion_wait = optional_float_field(event, F_WAIT)
        record.prefill = float_field(event, F_PREFILL)
        record.itl = float_field(event, F_ITL)
        tables.recent.add(record)
        return record

    cdef int abort(self, _Requests tables, object rid) except -1:
        """Close request ``rid``'s record in flight, if any, without finishing it: it ended
        before its first token (:class:`~kvscope.events.RequestAborted`); its id is kept
        among the source's aborted ones."""
        if tables.inflight.pop(rid, None) is not None:
            tables.unstarted.discard(rid)
        cdef dict aborted = tables.aborted
        aborted[rid] = None
        if len(aborted) > _MAX_ABORTED:
            del aborted[next(iter(aborted))]
        return 0

    def finished(self, str source, list events):
        """:meth:`finish` ``source``'s RequestFinished ``events`` in order; the records
        finished (the pipeline folds a batch through :class:`~kvscope.agent.fold.Fold`)."""
        cdef _Requests tables = self._tables(source)
        cdef bint joined = source in self.joined
        cdef list records = []
        for event in events:
            if type(event) is not ev.RequestFinished:  # its fields are read by their offsets
                raise TypeError(f"finished() takes RequestFinished events, not {event!r}")
            records.append(self.finish(source, tables, joined, event))
        return [record for record in records if record is not None]
