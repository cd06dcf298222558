# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""Per-request records, and the bounded table that keeps the finished ones.

A record joins what the events say about one request — arrival, where its tokens came from,
each transfer it waited for, the parts of its TTFT — so the API, the dashboard's waterfall, the
OTLP exporter and the store all read one shape. Records are compiled (Cython): the pipeline
fills their C fields without making a Python object per number, which once cost the agent's
ingest most of its time (bench/ingest.py). Their data form, for encoding, is
:class:`~kvscope.agent.record_data.RecordData`.
"""

import os
import threading
from heapq import heappush, heappushpop

cimport cython
from cpython.dict cimport PyDict_Next
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.math cimport INFINITY, NAN, fabs, isnan
from libc.stdint cimport int64_t, uint64_t


cdef extern from "Python.h":
    PyObject *PyList_GET_ITEM(object, Py_ssize_t) noexcept

from kvscope.agent.record_data import RecordData, TransferRecord
from kvscope.agent.slots cimport index_of
from kvscope.vocabulary import TIERS, TOKEN_SOURCES

# Transfers kept per record: a request seldom waits for more than a few loads, and a sender
# attaching 100,000 to one id made each append slower and one API answer 15 MB.
MAX_TRANSFERS = 64
# Seconds a request may finish ahead of the agent's clock (clocks step); further ahead it is a
# corrupt time that would sort first in the table and never age out of the store.
FUTURE = 3600.0
# A late report names its request by its arrival (vLLM's span starts at the very arrival time
# the tap sends, and arrival_of gives it to within float rounding when the start went missing).
ARRIVAL_TOLERANCE = 0.001  # seconds
# A span's ends and the tap's record of the same request are stamped apart, by different
# code; a record within its span give or take this is the span's (see within).
FINISH_TOLERANCE = 0.01  # seconds
SORT_KEYS = ("finished", "arrival", "ttft", "prompt_tokens", "promotion_wait")

cdef double _ARRIVAL_TOLERANCE = ARRIVAL_TOLERANCE
cdef double _FINISH_TOLERANCE = FINISH_TOLERANCE
# the names events use (msgspec hands out these very objects for Literal fields), so that a
# record's transfers point to them instead of keeping the event's strings
cdef tuple _TIERS = TIERS
cdef tuple _TOKEN_SOURCES = TOKEN_SOURCES


cdef object tier_name(object name):
    """The shared str of tier ``name`` (or ``name`` itself when it is none of the tiers)."""
    cdef int i = index_of(_TIERS, name)
    return name if i < 0 else _TIERS[i]


# Trace ids: xoshiro256** (Blackman and Vigna, "Scrambled linear pseudorandom number
# generators", 2021), seeded from the OS and again in a forked child, so that two agents or a
# parent and its child never share a sequence. W3C asks for unique, random trace ids; this is
# not for secrets.
cdef uint64_t _rng[4]


cdef inline uint64_t _rotl(uint64_t x, int k):
    return (x << k) | (x >> (64 - k))


cdef uint64_t _next64():
    cdef uint64_t result = _rotl(_rng[1] * 5, 7) * 9
    cdef uint64_t t = _rng[1] << 17
    _rng[2] ^= _rng[0]
    _rng[3] ^= _rng[1]
    _rng[1] ^= _rng[2]
    _rng[0] ^= _rng[3]
    _rng[2] ^= t
    _rng[3] = _rotl(_rng[3], 45)
    return result


def _seed():
    seed = os.urandom(32)
    for i in range(4):
        _rng[i] = int.from_bytes(seed[8 * i:8 * i + 8], "little") | 1


_seed()
os.register_at_fork(after_in_child=_seed)

cdef char *_HEX = b"0123456789abcdef"


cdef str _hex128(uint64_t hi, uint64_t lo):
    cdef char out[32]
    cdef int i
    for i in range(16):
        out[15 - i] = _HEX[hi & 15]
        out[31 - i] = _HEX[lo & 15]
        hi >>= 4
        lo >>= 4
    return out[:32].decode("ascii")


@cython.final
@cython.no_gc
@cython.freelist(256)
cdef class RequestRecord:
    """One request. Times are Unix seconds (``arrival``, ``finished``) or seconds (the TTFT
    parts: ``queueing``, ``lookup``, ``promotion_wait``, ``prefill``, and ``ttft`` itself;
    ``lookup`` and ``promotion_wait`` None when the source did not measure them; ``itl``, the
    mean inter-token latency, 0 when unknown). ``tokens``: dict[source, prompt
    tokens]. ``transfers``: tuple of :class:`~kvscope.agent.record_data.TransferRecord`, the
    first :data:`MAX_TRANSFERS` of its transfers in arrival order (the pipeline keeps no more);
    ``transfers_omitted``: how many more it had (each still counts in the transfer metrics).
    ``trace_id``: 32 hex chars (W3C). ``ttft`` and ``finished`` are None until known.

    Counts are 64-bit: an int outside raises OverflowError. Records are never tracked by the
    garbage collector (their fields cannot form a cycle): the table holds 100,000 of them.
    Compare with ``==`` (field by field); :meth:`data` gives the msgspec form for encoding.
    """

    def __init__(self, str request_id, str trace_id, str source, double arrival,
                 int64_t prompt_tokens=0, int64_t output_tokens=0, tokens=None,
                 transfers=(), int64_t transfers_omitted=0, ttft=None, double queueing=0.0,
                 lookup=None, promotion_wait=None, double prefill=0.0,
                 finished=None, double itl=0.0):
        self.request_id, self._trace_id, self.source = request_id, trace_id, source
        self._id_hash = hash(request_id)
        self.arrival, self.prompt_tokens, self.output_tokens = arrival, prompt_tokens, output_tokens
        self.tokens = tokens or {}
        self.transfers = transfers
        self.transfers_omitted = transfers_omitted
        self.ttft, self.finished = ttft, finished
        self.queueing, self.prefill, self.itl = queueing, prefill, itl
        self.lookup, self.promotion_wait = lookup, promotion_wait

    def __dealloc__(self):
        self._clear_transfers()

    cdef void _clear_transfers(self):
        cdef Transfer *transfers = self._transfers if self._transfers != NULL else &self._first
        cdef Py_ssize_t i
        for i in range(self._ntransfers):
            Py_DECREF(<object>transfers[i].src)
            Py_DECREF(<object>transfers[i].dst)
        PyMem_Free(self._transfers)
        self._transfers, self._ntransfers, self._capacity = NULL, 0, 0

    cdef int add_transfer(self, object src, object dst, int64_t blocks, int64_t nbytes,
                          double start, double duration, bint ok) except -1:
        """Append one transfer (the caller keeps to MAX_TRANSFERS)."""
        cdef Transfer *grown
        cdef Py_ssize_t capacity
        if self._ntransfers == 1 and self._transfers == NULL:  # the second: leave _first
            self._transfers = <Transfer *>PyMem_Malloc(4 * sizeof(Transfer))
            if self._transfers == NULL:
                raise MemoryError()
            self._transfers[0] = self._first
            self._capacity = 4
        elif self._transfers != NULL and self._ntransfers == self._capacity:
            capacity = 2 * self._capacity
            grown = <Transfer *>PyMem_Realloc(self._transfers, capacity * sizeof(Transfer))
            if grown == NULL:
                raise MemoryError()
            self._transfers, self._capacity = grown, capacity
        src, dst = tier_name(src), tier_name(dst)
        Py_INCREF(src)
        Py_INCREF(dst)
        cdef Transfer *slot = (&self._first if self._transfers == NULL
                               else &self._transfers[self._ntransfers])
        slot.src, slot.dst = <PyObject *>src, <PyObject *>dst
        slot.blocks, slot.bytes, slot.start, slot.duration, slot.ok = (
            blocks, nbytes, start, duration, ok)
        self._ntransfers += 1
        return 0

    @property
    def transfers(self):
        cdef Transfer *transfer
        cdef Py_ssize_t i = 0
        cdef list out = []
        while i < self._ntransfers:  # the array is found again each time: making a
            # TransferRecord may run other threads, and one may have added a transfer
            transfer = (self._transfers if self._transfers != NULL else &self._first) + i
            out.append(TransferRecord(<object>transfer.src, <object>transfer.dst,
                                      transfer.blocks, transfer.bytes, transfer.start,
                                      transfer.duration, transfer.ok))
            i += 1
        return tuple(out)

    @transfers.setter
    def transfers(self, transfers):
        self._clear_transfers()
        for t in transfers:
            self.add_transfer(t.src, t.dst, t.blocks, t.bytes, t.start, t.duration, t.ok)

    cdef int set_tokens(self, object tokens) except -1:
        """Take ``tokens`` (dict[source, tokens]) as the record's."""
        cdef int i
        cdef dict items = tokens if type(tokens) is dict else dict(tokens)
        cdef Py_ssize_t position = 0
        cdef PyObject *key
        cdef PyObject *value
        self._tokens_set, self._tokens_other = 0, None
        while PyDict_Next(items, &position, &key, &value):
            i = index_of(_TOKEN_SOURCES, <object>key)
            if i >= 0:
                self._tokens[i] = <object>value
                self._tokens_set |= 1 << i
            else:  # a source outside TOKEN_SOURCES
                if self._tokens_other is None:
                    self._tokens_other = {}
                self._tokens_other[<object>key] = <object>value
        return 0

    @property
    def tokens(self):
        cdef int i
        out = {_TOKEN_SOURCES[i]: self._tokens[i] for i in range(4) if self._tokens_set & (1 << i)}
        if self._tokens_other is not None:
            out.update(self._tokens_other)
        return out

    @tokens.setter
    def tokens(self, tokens):
        self.set_tokens(tokens)

    cdef void new_trace_id(self):
        self._trace_id = None
        self._tid_hi, self._tid_lo = _next64(), _next64() | 1  # never all zeros

    @property
    def trace_id(self):
        if self._trace_id is None:
            self._trace_id = _hex128(self._tid_hi, self._tid_lo)
        return self._trace_id

    @trace_id.setter
    def trace_id(self, str trace_id):
        self._trace_id = trace_id

    cdef void set_ttft(self, double ttft):
        self._ttft, self._has_ttft = ttft, True

    @property
    def ttft(self):
        return self._ttft if self._has_ttft else None

    @ttft.setter
    def ttft(self, ttft):
        self._has_ttft = ttft is not None
        self._ttft = ttft if self._has_ttft else 0.0

    @property
    def lookup(self):
        return None if isnan(self._lookup) else self._lookup

    @lookup.setter
    def lookup(self, lookup):
        self._lookup = NAN if lookup is None else lookup

    @property
    def promotion_wait(self):
        return None if isnan(self._promotion_wait) else self._promotion_wait

    @promotion_wait.setter
    def promotion_wait(self, promotion_wait):
        self._promotion_wait = NAN if promotion_wait is None else promotion_wait

    cdef void set_finished(self, double finished):
        self._finished, self._has_finished = finished, True

    @property
    def finished(self):
        return self._finished if self._has_finished else None

    @finished.setter
    def finished(self, finished):
        self._has_finished = finished is not None
        self._finished = finished if self._has_finished else 0.0

    def data(self):
        """This record as :class:`~kvscope.agent.record_data.RecordData`."""
        return RecordData(self.request_id, self.trace_id, self.source, self.arrival,
                          self.prompt_tokens, self.output_tokens, self.tokens, self.transfers,
                          self.transfers_omitted, self.ttft, self.queueing, self.lookup,
                          self.promotion_wait, self.prefill, self.finished, self.itl)

    @staticmethod
    def from_data(data):
        """A record of :class:`~kvscope.agent.record_data.RecordData` ``data``."""
        return RequestRecord(data.request_id, data.trace_id, data.source, data.arrival,
                             data.prompt_tokens, data.output_tokens, data.tokens, data.transfers,
                             data.transfers_omitted, data.ttft, data.queueing, data.lookup,
                             data.promotion_wait, data.prefill, data.finished, data.itl)

    def __eq__(self, other):
        if not isinstance(other, RequestRecord):
            return NotImplemented
        return self.data() == other.data()

    def __repr__(self):
        return "RequestRecord" + repr(self.data()).removeprefix("RecordData")


cdef RequestRecord new_record(str request_id, str source, double arrival):
    """A record of a request that arrived at ``arrival``, with a new trace id (its counts 0,
    its lookup and promotion wait not measured)."""
    cdef RequestRecord record = RequestRecord.__new__(RequestRecord)
    record.request_id, record.source = request_id, source
    record._lookup = record._promotion_wait = NAN
    record._id_hash = hash(request_id)
    record.arrival = arrival
    record.new_trace_id()
    return record


def arrival_of(finish):
    """Unix seconds a request arrived, from its finish alone (its start went missing): the
    finish less the decode (``itl`` between each two of the ``output_tokens``) and the TTFT;
    exact for vLLM's tap, which reports the ITL as exactly that. Never before 1970, where
    OTLP's unsigned times end."""
    decode = finish.itl * (finish.output_tokens - 1) if finish.output_tokens > 1 else 0.0
    return max(0.0, finish.ts - decode - finish.ttft)


cpdef bint under_way(RequestRecord record, double ts) except -1:
    """Whether finished ``record``'s request was under way at ``ts`` (Unix seconds): from its
    arrival, less :data:`ARRIVAL_TOLERANCE`, to its finish."""
    if record is None:
        raise TypeError("a record, not None")
    return record.arrival - _ARRIVAL_TOLERANCE <= ts <= record._finished


cpdef bint within(RequestRecord record, double start, double end) except -1:
    """Whether finished ``record``'s request ran within ``start`` to ``end`` (Unix seconds,
    give or take :data:`FINISH_TOLERANCE`): the span of a report about it whose start comes
    before the record's arrival (a record whose start event went missing dates its arrival
    from its finish, an aborted one's is its finish). The next request of a reused id
    finishes after the span's end."""
    if record is None:
        raise TypeError("a record, not None")
    return (start - _FINISH_TOLERANCE <= record.arrival
            and record._finished <= end + _FINISH_TOLERANCE)


def amend(RequestRecord record not None, str trace_id, finish):
    """Give a finished ``record`` what another report says of it (vLLM's span): ``trace_id``
    (unless "") and, when ``finish.ttft`` is not 0, that TTFT, queueing unless 0 (less the
    record's promotion wait where it holds it: :func:`queueing_without_wait`) and prefill
    unless 0 (cut so that the parts do not exceed the TTFT), and its inter-token latency
    unless 0 (vLLM's, from token times; the tap's sees tokens a scheduler step late) with the
    output tokens it is the mean over. A 0 is unknown (a span without the attribute): the
    record's own stands, as it does where the span came first."""
    record.trace_id = trace_id or record.trace_id
    if finish.itl:
        record.itl = finish.itl
        record.output_tokens = finish.output_tokens
    if finish.ttft:
        record.set_ttft(finish.ttft)
        if finish.queueing:
            record.queueing = queueing_without_wait(finish.queueing, record.queueing,
                                                    record._promotion_wait)
        if finish.prefill:
            record.prefill = finish.prefill
        record.prefill = prefill_within(record)


cpdef double queueing_without_wait(double reported, double measured, double wait):
    """vLLM's queue time (``reported``, its span's) without the promotion wait the tap measured
    (``wait``, seconds; NaN: none) where it holds it. vLLM counts a request as scheduled once
    its KV is in place: an asynchronous load's wait falls in its queue time, a synchronous
    one's (vLLM 0.33's expedited loads) in its prefill (vllm/v1/core/sched/scheduler.py records
    SCHEDULED only after a WAITING_FOR_REMOTE_KVS request's load). The tap's own queue time
    (``measured``: arrival to the load's start) says which: the wait is taken out where that
    leaves ``reported`` nearer to it (the waterfall showed the load inside the queue and a
    promotion wait after it)."""
    if wait > 0.0 and reported >= wait and fabs(reported - wait - measured) < fabs(
            reported - measured):
        return reported - wait
    return reported


cpdef double prefill_within(RequestRecord record) except? -1.0:
    """``record``'s prefill, cut so that its TTFT parts, from two reports (the tap's and
    vLLM's span), do not add up to more than its TTFT (a part not measured counts as 0)."""
    if record is None:
        raise TypeError("a record, not None")
    cdef double lookup = 0.0 if isnan(record._lookup) else record._lookup
    cdef double wait = 0.0 if isnan(record._promotion_wait) else record._promotion_wait
    return min(record.prefill, max(0.0, record._ttft - record.queueing - lookup - wait))


cdef inline double _finish_key(RequestRecord record, double unknown=0.0):
    return record._finished if record._has_finished else unknown


cdef inline double _ttft_key(RequestRecord record, double unknown=0.0):
    return record._ttft if record._has_ttft else unknown


cdef double _sort_key(RequestRecord record, int by, double unknown):
    """``record``'s value of ``SORT_KEYS[by]``, ``unknown`` where it has none (a count is exact
    to 2^53)."""
    if by == 0:
        return _finish_key(record, unknown)
    if by == 1:
        return record.arrival
    if by == 2:
        return _ttft_key(record, unknown)
    if by == 3:
        return <double>record.prompt_tokens
    return unknown if isnan(record._promotion_wait) else record._promotion_wait


@cython.final
cdef class _Best:
    """The ``limit`` best records offered (``limit`` > 0): the largest keys when ``descending``,
    else the smallest; of equal keys, those of the older places (as a stable sort leaves them).
    Only a record that beats the ones kept costs more than a comparison."""
    cdef Py_ssize_t limit
    cdef bint descending
    cdef list kept  # a min-heap of (value, -place) of the ``limit`` best offered so far
    cdef list found  # (value, -place, record) of each record that was among the best when offered
    cdef double least  # kept[0]'s value and place, once ``limit`` are kept
    cdef Py_ssize_t least_place

    def __cinit__(self, Py_ssize_t limit, bint descending):
        self.limit, self.descending, self.kept, self.found = limit, descending, [], []

    cdef inline bint full(self):
        return len(self.kept) == self.limit

    cdef int offer(self, double key, Py_ssize_t place, RequestRecord record) except -1:
        cdef double value = key if self.descending else -key  # the best: the largest value
        if not self.full():
            heappush(self.kept, (value, -place))
        elif value > self.least or (value == self.least and place < self.least_place):
            heappushpop(self.kept, (value, -place))
        else:
            return 0
        self.found.append((value, -place, record))
        if self.full():
            self.least, self.least_place = self.kept[0][0], -self.kept[0][1]
        return 0

    cdef list records(self):
        """The best, in order."""
        self.found.sort(reverse=True)  # places are distinct: records are never compared
        return [entry[2] for entry in self.found[:self.limit]]


@cython.final
cdef class Ring:
    """A first-in first-out list of objects: appends and takes from the front in constant time
    (amortised), without a method call (deque's, from compiled code, cost more than the rest
    of a record's keeping)."""

    def __init__(self):
        self._items, self._head = [], 0

    cdef void push(self, object item):
        self._items.append(item)

    cdef object pop(self):
        """The oldest item, taken out (the ring must not be empty)."""
        item = self._items[self._head]
        self._items[self._head] = None
        self._head += 1
        if self._head > 64 and 2 * self._head > len(self._items):
            del self._items[:self._head]
            self._head = 0
        return item

    cdef Py_ssize_t size(self):
        return len(self._items) - self._head

    cdef object at(self, Py_ssize_t i):
        """The ``i``-th oldest item."""
        return self._items[self._head + i]

    cdef PyObject *peek(self, Py_ssize_t ahead) noexcept:
        """The item ``ahead`` places from the front (borrowed), NULL past the end."""
        ahead += self._head
        return PyList_GET_ITEM(self._items, ahead) if ahead < len(self._items) else NULL

    cdef list values(self):
        """The items, oldest first (a copy)."""
        return self._items[self._head:]

    cdef void replace(self, list items):
        """Hold ``items`` (oldest first) instead."""
        self._items, self._head = items, 0


@cython.final
cdef class RequestTable:
    """The most recent ``capacity`` finished requests, by source and request id (two engines
    may use the same ids: each source's records stay apart). Thread-safe.

    Kept as records in the order added, and an index by source and id built when the table is
    read, so that adding one costs no dict entry: the pipeline adds every finished request,
    and the table is read far less often (the API, a late report about an old request). A
    request added again supersedes its earlier record, which still holds its place until it
    leaves (so the table holds fewer requests than ``capacity`` when ids are reused).

    Records come in about the order they finished, so the newest end holds those that finished
    last: each record added notes the latest finish added up to it (``_bound``), and
    :meth:`page` reads back from the newest end only until no older record can finish later
    than those it has. A record's ``finished`` must not change while a table holds it.
    """

    cdef readonly Py_ssize_t capacity
    cdef object _lock
    cdef Ring _order  # records, oldest first
    cdef dict _index  # source -> request id -> record, of the oldest _indexed records of _order
    cdef Py_ssize_t _indexed, _live  # records of _order indexed; requests indexed
    cdef double _latest  # the largest finish added so far (as pages sort it: None as 0)

    def __init__(self, Py_ssize_t capacity=100_000):
        if capacity < 0:
            raise ValueError(f"a request table holds 0 records or more, not {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._order = Ring()
        self._index = {}
        self._indexed = self._live = 0
        self._latest = float("-inf")

    def add(self, records):
        """Add finished ``records`` (the newest last); a known request's record moves to the
        end."""
        cdef RequestRecord record
        with self._lock:
            for item in records:
                record = <RequestRecord?>item
                if record is None:
                    raise TypeError("a request table holds records, not None")
                record._in_table += 1
                self._latest = max(self._latest, _finish_key(record))
                record._bound = self._latest
                self._order.push(record)
            while self._order.size() > self.capacity:
                record = self._order.pop()
                record._in_table -= 1
                if self._indexed:  # the place leaving was indexed
                    self._indexed -= 1
                # the index may name a record from an older place even when this place was
                # not indexed yet (the record was added again since the last read)
                if not record._in_table and self._index:
                    self._unindex(record)

    cdef void _unindex(self, RequestRecord record):
        """Forget ``record``, which holds no place any more, where the index names it."""
        cdef dict ids = self._index.get(record.source)
        if ids is not None and ids.get(record.request_id) is record:
            del ids[record.request_id]
            self._live -= 1

    cdef void _sync(self):
        """Index the records added since the last read (under the lock)."""
        cdef RequestRecord record
        cdef dict ids
        while self._indexed < self._order.size():
            record = self._order.at(self._indexed)
            self._indexed += 1
            ids = self._index.get(record.source)
            if ids is None:
                ids = self._index[record.source] = {}
            self._live += ids.get(record.request_id) is None
            ids[record.request_id] = record

    cdef list _live_records(self):
        """The records the index names, oldest first, each once (at its last place)."""
        cdef RequestRecord record
        cdef list out = []
        cdef set seen = set()
        self._sync()
        for i in range(self._order.size() - 1, -1, -1):
            record = self._order.at(i)
            if (<dict>self._index[record.source]).get(record.request_id) is record:
                if record._in_table > 1:  # added more than once: only its last place
                    if id(record) in seen:
                        continue
                    seen.add(id(record))
                out.append(record)
        out.reverse()
        return out

    def __len__(self):
        with self._lock:
            self._sync()
            return self._live

    def get(self, str request_id, str source=None):
        """The record of ``request_id`` from ``source``; without ``source``, the one finished
        last among the sources that have a request of that id."""
        with self._lock:
            self._sync()
            if source is not None:
                return self._index.get(source, {}).get(request_id)
            found = [ids[request_id] for ids in self._index.values() if request_id in ids]
        return max(found, key=lambda r: r.finished or 0.0, default=None)

    def recent(self, Py_ssize_t limit=100, str sort="finished", bint descending=True,
               min_ttft=None, str source=None):
        """Up to ``limit`` records ordered by ``sort`` (one of :data:`SORT_KEYS`), largest
        first unless ``descending`` is False; ``min_ttft`` (seconds) filters slow requests,
        ``source`` one source's.

        Raises ValueError for an unknown sort key or a negative ``limit``.
        """
        return self.page(limit, sort, descending, min_ttft, source)[0]

    def page(self, Py_ssize_t limit=100, str sort="finished", bint descending=True,
             min_ttft=None, str source=None):
        """``(records, total)``: the first ``limit`` records in the order of :meth:`recent`
        (a key's None last, either way: "not measured" is not the shortest wait; records with
        equal keys in the order they were added, as a stable sort leaves them), and ``total``,
        how many records ``min_ttft`` (seconds) and ``source`` select.

        Without a full sort: the default order (``finished``, descending) without ``min_ttft``
        reads about ``limit`` records back from the newest end (more when records were added
        far out of finish order), and holds the lock only for that; any other copies the
        records out under the lock, as :meth:`recent` always did, then reads each once, keeping
        the best ``limit``.

        Raises ValueError for an unknown sort key or a negative ``limit``.
        """
        if sort not in SORT_KEYS:
            raise ValueError(f"unknown sort key {sort!r}; use one of {', '.join(SORT_KEYS)}")
        if limit < 0:
            raise ValueError(f"a page holds 0 records or more, not {limit}")
        cdef int by = SORT_KEYS.index(sort)
        cdef _Best best = _Best(max(limit, 1), descending)
        cdef Py_ssize_t total
        if by == 0 and descending and min_ttft is None:
            with self._lock:
                self._finished_last(best, source)
                total = self._live if source is None else len(self._index.get(source, ()))
        else:
            with self._lock:
                records = self._live_records()
            total = _choose(best, records, by, source, min_ttft)
        return (best.records() if limit else []), total

    cdef int _finished_last(self, _Best best, str source) except -1:
        """Offer ``best`` the live records of ``source`` (any, when None) from the newest place
        back, until no older one can be kept (under the lock)."""
        cdef set seen = None
        cdef RequestRecord record
        cdef Py_ssize_t i
        self._sync()
        for i in range(self._order.size() - 1, -1, -1):
            record = self._order.at(i)
            # nothing here or older can finish later than the least kept, nor tie it (a tie
            # would go to the older place)
            if best.full() and best.least > record._bound:
                return 0
            if source is not None and record.source != source:
                continue
            if (<dict>self._index[record.source]).get(record.request_id) is not record:
                continue  # superseded
            if record._in_table > 1:  # added more than once: only its last place
                if seen is None:
                    seen = set()
                if id(record) in seen:
                    continue
                seen.add(id(record))
            best.offer(_sort_key(record, 0, -INFINITY), i, record)
        return 0


cdef Py_ssize_t _choose(_Best best, list records, int by, str source, object min_ttft) except -1:
    """Offer ``best`` each of ``records`` (live, oldest first) that ``source`` and ``min_ttft``
    select, from the newest when it keeps the largest keys, else from the oldest (keys that grow
    with time, as finish and arrival do, then find the best first); how many they select."""
    cdef bint any_ttft = min_ttft is None
    cdef double least_ttft = 0.0 if any_ttft else min_ttft
    cdef Py_ssize_t n = len(records), selected = 0, k, i
    cdef double unknown = -INFINITY if best.descending else INFINITY  # last, either way
    cdef RequestRecord record
    for k in range(n):
        i = n - 1 - k if best.descending else k
        record = records[i]
        if source is not None and record.source != source:
            continue
        if not any_ttft and not _ttft_key(record) >= least_ttft:
            continue
        selected += 1
        best.offer(_sort_key(record, by, unknown), i, record)
    return selected
