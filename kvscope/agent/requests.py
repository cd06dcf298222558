"""Per-request records: assembled from events, kept in a bounded table.

A record joins what the events say about one request — arrival, where its tokens came from,
each transfer it waited for, the parts of its TTFT — so the API, the dashboard's waterfall, the
OTLP exporter and the store all read one shape.
"""

from __future__ import annotations

import logging
import operator
import random
import threading
from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Sequence

import msgspec

from kvscope import events as ev

log = logging.getLogger(__name__)


# Transfers kept per record: a request seldom waits for more than a few loads, and a sender
# attaching 100,000 to one id made each append slower and one API answer 15 MB. At 64, a full
# record takes about 7 KB (0.6 KB with one transfer), so a table of 100,000 at most about 0.7 GB.
MAX_TRANSFERS = 64
# Seconds a request may finish ahead of the agent's clock (clocks step); further ahead it is a
# corrupt time that would sort first in the table and never age out of the store.
FUTURE = 3600.0


class TransferRecord(msgspec.Struct, frozen=True, gc=False):
    """One transfer of a request: ``start`` Unix seconds, ``duration`` seconds, sizes in bytes."""

    src: str
    dst: str
    blocks: int
    bytes: int
    start: float
    duration: float
    ok: bool = True


class RequestRecord(msgspec.Struct, gc=False):
    """One request. Times are Unix seconds (``arrival``, ``finished``) or seconds (the TTFT
    parts: ``queueing``, ``lookup``, ``promotion_wait``, ``prefill``, and ``ttft`` itself;
    ``itl``, the mean inter-token latency, 0 when unknown). ``tokens``: dict[source, prompt
    tokens]. ``transfers``: the first :data:`MAX_TRANSFERS` of its transfers, in arrival order;
    ``transfers_omitted``: how many more it had (each still counts in the transfer metrics).
    ``trace_id``: 32 hex chars (W3C). Records, like transfer records, are never tracked
    by the garbage collector (their fields cannot form a cycle): the table holds 100,000 of
    them, and full collections walking them cost ingest about a fifth of its time."""

    request_id: str
    trace_id: str
    source: str
    arrival: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens: dict[str, int] = {}
    transfers: tuple[TransferRecord, ...] = ()
    transfers_omitted: int = 0
    ttft: float | None = None
    queueing: float = 0.0
    lookup: float = 0.0
    promotion_wait: float = 0.0
    prefill: float = 0.0
    finished: float | None = None
    itl: float = 0.0


def new_trace_id() -> str:
    """A random, non-zero W3C trace id: 16 bytes as 32 lowercase hex characters."""
    return (random.getrandbits(128) | 1).to_bytes(16, "big").hex()


# Records kept per request id among the recent ones: a client may reuse an id (X-Request-Id),
# and a late report must join the request it is about, not the newest of that id. vLLM sends a
# batch of spans every 5 s: 64 covers a client reusing one id up to 10 times a second (at 4,
# five requests of one id in a batch pushed one another out and all counted twice).
MAX_REUSES = 64
# A late report names its request by its arrival (vLLM's span starts at the very arrival time
# the tap sends, and arrival_of gives it to within float rounding when the start went missing).
ARRIVAL_TOLERANCE = 0.001  # seconds
# A span's ends and the tap's record of the same request are stamped apart, by different
# code; a record within its span give or take this is the span's (see within).
FINISH_TOLERANCE = 0.01  # seconds

_REQUEST_ID = operator.attrgetter("request_id")
# what a second finish of one request may fill in (see RequestAssembler.finished)
_FINISH_PARTS = ("output_tokens", "queueing", "lookup", "promotion_wait", "prefill", "itl")


class RequestAssembler:
    """Builds :class:`RequestRecord` s from events, one method per event kind, each taking one
    source's events of that kind in arrival order (the pipeline folds a batch kind by kind).

    Each source's requests are kept apart (engines number requests on their own), and each
    source has its own bounds, so a busy or broken engine cannot push out another's requests:
    ``max_inflight`` requests started but not finished (beyond it the oldest is abandoned and
    counted in ``abandoned`` by source: a bound against engines that never finish), and
    ``max_recent`` finished records kept for late transfers (see :meth:`finished`).
    ``amended``: the finished records changed since the pipeline last cleared it (by events
    here, or by the pipeline's :func:`amend`), by ``id()``, for the pipeline to store again. Not thread-safe: the pipeline calls it
    under its lock.
    """

    def __init__(self, max_inflight: int = 10_000, max_recent: int = 10_000,
                 joined: Container[str] = ()) -> None:
        # source -> request id -> record, oldest first
        self._inflight: dict[str, OrderedDict[str, RequestRecord]] = {}
        # source -> request id -> its last MAX_REUSES records (a client may reuse an id)
        self._recent: dict[str, OrderedDict[str, tuple[RequestRecord, ...]]] = {}
        self._recent_records: Counter[str] = Counter()  # source -> records in its _recent
        self._max = max_inflight
        self._max_recent = max_recent
        self.joined = joined  # sources whose requests another source finishes too (see finished)
        self.abandoned: Counter[str] = Counter()
        # source -> ids of its records in flight that another event than the request's start
        # opened: their arrival is that event's time until the start or the finish comes
        self._unstarted: dict[str, set[str]] = {}
        self.amended: dict[int, RequestRecord] = {}

    def _tables(self, source: str) -> tuple[OrderedDict, OrderedDict]:
        """``source``'s requests in flight and finished recently."""
        inflight = self._inflight.get(source)
        if inflight is None:
            inflight = self._inflight[source] = OrderedDict()
            self._recent[source] = OrderedDict()
            self._unstarted[source] = set()
        return inflight, self._recent[source]

    def _find(self, source: str, request_id: str, ts: float) -> RequestRecord | None:
        """``source``'s record of ``request_id`` in flight; for a joined source also one
        finished recently that ``ts`` falls in (another source finished it first: vLLM's span
        before the tap's events). An event after every such finish is a new request."""
        record = self._inflight[source].get(request_id)
        if record is None and source in self.joined:
            record = self.finished_recently(source, request_id, ts)
            if record is not None:
                self.amended[id(record)] = record
        return record

    def finished_recently(self, source: str, request_id: str, ts: float,
                          until: float | None = None) -> RequestRecord | None:
        """``source``'s record of ``request_id``, among the last ``max_recent`` it finished,
        of the request under way at ``ts`` (see :func:`under_way`), the newest such; with
        ``until`` (a report of the span ``ts``-``until``), else of those that ran within that
        span (see :func:`within`), the one finishing nearest its end. None when there is none
        (an id reused: another request)."""
        records = self._recent.get(source, {}).get(request_id, ())
        for record in reversed(records):
            if under_way(record, ts):
                return record
        if until is None:
            return None
        # of those within the span, the one finishing nearest its end (a reused id's next
        # request, arriving as this one finished, finishes after it)
        inside = [record for record in records if within(record, ts, until)]
        return min(inside, key=lambda record: abs(record.finished - until), default=None)

    def _open(self, source: str, inflight: OrderedDict, request_id: str,
              ts: float) -> RequestRecord:
        record = inflight.get(request_id) or self._find(source, request_id, ts)
        if record is None:
            record = inflight[request_id] = RequestRecord(request_id, new_trace_id(), source, ts)
            self._unstarted[source].add(request_id)
            self._bound(source, inflight)
        return record

    def _bound(self, source: str, inflight: OrderedDict) -> None:
        if len(inflight) > self._max and not self.abandoned[source]:
            log.warning("kvscope: source %r has %d requests started and not finished; the "
                        "oldest are abandoned (counted as dropped, reason abandoned; logged "
                        "once per source)", source, self._max)
        while len(inflight) > self._max:
            self._unstarted[source].discard(inflight.popitem(last=False)[0])
            self.abandoned[source] += 1

    def reuse_cuts(self, source: str, events: Sequence[object],
                   starts: Sequence[ev.RequestStarted]) -> list[int]:
        """Where a batch of ``source``'s ``events`` must be cut for folding kind by kind: before
        each start of an id whose request finished earlier in the batch (a client reusing an
        id back to back), else that start would land on the finishing request's record. []
        for most batches, told cheaply: no id is started twice here, nor known already (in
        flight, opened by any event, or finished recently: vLLM's span may finish a request
        before the tap's batch with its finish comes)."""
        ids = set(map(_REQUEST_ID, starts))
        if len(ids) == len(starts) and not (self._inflight.get(source, {}).keys() & ids
                                            or self._recent.get(source, {}).keys() & ids):
            return []
        cuts, finished = [], set()
        for i, event in enumerate(events):
            if type(event) is ev.RequestFinished:
                finished.add(event.request_id)
            elif type(event) is ev.RequestStarted and event.request_id in finished:
                cuts.append(i)
                finished = set()
        return cuts

    def started(self, source: str,
                events: Sequence[ev.RequestStarted]) -> list[tuple[str, str]]:
        """Open the requests' records; returns ``(before, after)`` for each record another
        event opened first whose trace id the start changed."""
        inflight, _recent = self._tables(source)
        unstarted, joined = self._unstarted[source], source in self.joined
        retraced = []
        for event in events:
            rid, trace_id = event.request_id, event.trace_id
            if trace_id and not ev.w3c_trace_id(trace_id):  # as absent, not as a label
                trace_id = ""
            record = inflight.get(rid)
            if record is None and joined:
                record = self._find(source, rid, event.ts)
            if record is None:
                inflight[rid] = RequestRecord(rid, trace_id or new_trace_id(), source, event.ts,
                                              event.prompt_tokens)
                continue
            # another emitter's event opened the record first: arrival and trace id are the
            # start's, and its prompt tokens unless it has none (a span without usage)
            unstarted.discard(rid)
            record.prompt_tokens = event.prompt_tokens or record.prompt_tokens
            record.arrival = event.ts
            if trace_id and trace_id != record.trace_id:
                retraced.append((record.trace_id, trace_id))
                record.trace_id = trace_id
        self._bound(source, inflight)
        return retraced

    def lookups(self, source: str, events: Sequence[ev.Lookup]) -> None:
        inflight, _recent = self._tables(source)
        for event in events:
            if event.request_id:
                self._open(source, inflight, event.request_id, event.ts).tokens = event.tokens

    def transfers(self, source: str, events: Sequence[ev.Transfer]) -> list[str]:
        """Attach transfers to their requests; return each one's trace id ("" for none)."""
        inflight, recent = self._tables(source)
        trace_ids = []
        for event in events:
            rid = event.request_id
            if not rid:
                trace_ids.append("")
                continue
            record = inflight.get(rid)
            if record is None or event.ts < record.arrival:
                # a late worker's load joins the request under way at its start (of a reused
                # id, an earlier one than the request in flight), else the one in flight,
                # else the newest
                earlier = self.finished_recently(source, rid, event.ts)
                if earlier is not None or record is None:
                    record = earlier or (recent.get(rid) or (None,))[-1]
                    if record is None:
                        record = self._open(source, inflight, rid, event.ts)
                    else:
                        self.amended[id(record)] = record
            if len(record.transfers) < MAX_TRANSFERS:
                record.transfers += (TransferRecord(event.src, event.dst, event.blocks,
                                                    event.bytes, event.ts, event.duration,
                                                    event.ok),)
            else:
                record.transfers_omitted += 1
            trace_ids.append(record.trace_id)
        return trace_ids

    def finished(self, source: str,
                 events: Sequence[ev.RequestFinished]) -> list[RequestRecord]:
        """Complete and return the requests' records, and keep the newest ``max_recent`` of them
        (at most :data:`MAX_REUSES` of one id) so that another source's transfers sent later
        still join them (a worker tap may send its first batch after the scheduler's requests
        finished). A joined source's requests
        may be finished by another source first (vLLM's span before any of the tap's events):
        a second finish of a kept record (of a request that arrived before that record
        finished) only fills the parts the first left at 0 and returns no record (it is not a
        new request)."""
        inflight, recent = self._tables(source)
        unstarted, joined = self._unstarted[source], source in self.joined
        records, count = [], self._recent_records[source]
        for event in events:
            rid = event.request_id
            record = inflight.pop(rid, None)
            if record is None:
                kept = self.finished_recently(source, rid, arrival_of(event)) if joined else None
                if kept is not None:
                    for part in _FINISH_PARTS:
                        if not getattr(kept, part):
                            setattr(kept, part, getattr(event, part))
                    kept.prefill = _prefill_within(kept)
                    self.amended[id(kept)] = kept
                    continue
                record = RequestRecord(rid, new_trace_id(), source, arrival_of(event))
            elif rid in unstarted:  # its start went missing: its arrival was another event's
                unstarted.discard(rid)
                record.arrival = min(record.arrival, arrival_of(event))
            record.prompt_tokens = event.prompt_tokens or record.prompt_tokens
            record.output_tokens = event.output_tokens
            record.ttft, record.finished = event.ttft, event.ts
            record.queueing, record.lookup = event.queueing, event.lookup
            record.promotion_wait, record.prefill = event.promotion_wait, event.prefill
            record.itl = event.itl
            records.append(record)
            # tuples, which the garbage collector stops tracking (records hold no cycles)
            kept = recent.get(rid)
            if kept is None:
                recent[rid] = (record,)
                count += 1
            else:  # a reused id: its newest records, moved to the newest end
                recent.move_to_end(rid)
                recent[rid] = (*kept, record)[-MAX_REUSES:]
                count += len(kept) < MAX_REUSES
        while count > self._max_recent:
            count -= len(recent.popitem(last=False)[1])
        self._recent_records[source] = count
        return records


def arrival_of(finish: ev.RequestFinished) -> float:
    """Unix seconds a request arrived, from its finish alone (its start went missing): the
    finish less the decode (``itl`` between each two of the ``output_tokens``) and the TTFT;
    exact for vLLM's tap, which reports the ITL as exactly that. Never before 1970, where
    OTLP's unsigned times end."""
    decode = finish.itl * (finish.output_tokens - 1) if finish.output_tokens > 1 else 0.0
    return max(0.0, finish.ts - decode - finish.ttft)


def under_way(record: RequestRecord, ts: float) -> bool:
    """Whether finished ``record``'s request was under way at ``ts`` (Unix seconds): from its
    arrival, less :data:`ARRIVAL_TOLERANCE`, to its finish."""
    return record.arrival - ARRIVAL_TOLERANCE <= ts <= record.finished


def within(record: RequestRecord, start: float, end: float) -> bool:
    """Whether finished ``record``'s request ran within ``start`` to ``end`` (Unix seconds,
    give or take :data:`FINISH_TOLERANCE`): the span of a report about it whose start comes
    before the record's arrival (a record whose start event went missing dates its arrival
    from its finish, an aborted one's is its finish). The next request of a reused id
    finishes after the span's end."""
    return (start - FINISH_TOLERANCE <= record.arrival
            and record.finished <= end + FINISH_TOLERANCE)


def amend(record: RequestRecord, trace_id: str, finish: ev.RequestFinished) -> None:
    """Give a finished ``record`` what another report says of it (vLLM's span): ``trace_id``
    (unless "") and, when ``finish.ttft`` is not 0, that TTFT, queueing and prefill (the
    prefill cut so that the parts do not exceed the TTFT)."""
    record.trace_id = trace_id or record.trace_id
    if finish.ttft:
        record.ttft, record.queueing, record.prefill = (finish.ttft, finish.queueing,
                                                        finish.prefill)
        record.prefill = _prefill_within(record)


def _prefill_within(record: RequestRecord) -> float:
    """``record``'s prefill, cut so that its TTFT parts, from two reports (the tap's and
    vLLM's span), do not add up to more than its TTFT."""
    return min(record.prefill, max(0.0, record.ttft - record.queueing - record.lookup
                                   - record.promotion_wait))


SORT_KEYS = ("finished", "arrival", "ttft", "prompt_tokens", "promotion_wait")


class RequestTable:
    """The most recent ``capacity`` finished requests, by source and request id (two engines
    may use the same ids: each source's records stay apart). Thread-safe."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._records: OrderedDict[tuple[str, str], RequestRecord] = OrderedDict()
        self._sources: set[str] = set()  # sources with records now or before (a few names)
        self.capacity = capacity

    def add(self, records: Iterable[RequestRecord]) -> None:
        """Add finished ``records`` (the newest last); a known request's record moves to the
        end."""
        with self._lock:
            table = self._records
            for record in records:
                key = (record.source, record.request_id)
                table[key] = record
                table.move_to_end(key)
                self._sources.add(record.source)
            while len(table) > self.capacity:
                table.popitem(last=False)

    def __len__(self) -> int:
        return len(self._records)

    def get(self, request_id: str, source: str | None = None) -> RequestRecord | None:
        """The record of ``request_id`` from ``source``; without ``source``, the one finished
        last among the sources that have a request of that id."""
        with self._lock:
            if source is not None:
                return self._records.get((source, request_id))
            found = [self._records.get((s, request_id)) for s in self._sources]
        return max(filter(None, found), key=lambda r: r.finished or 0.0, default=None)

    def recent(self, limit: int = 100, sort: str = "finished", descending: bool = True,
               min_ttft: float | None = None, source: str | None = None) -> list[RequestRecord]:
        """Up to ``limit`` records ordered by ``sort`` (one of :data:`SORT_KEYS`), largest
        first unless ``descending`` is False; ``min_ttft`` (seconds) filters slow requests,
        ``source`` one source's.

        Raises ValueError for an unknown sort key.
        """
        if sort not in SORT_KEYS:
            raise ValueError(f"unknown sort key {sort!r}; use one of {', '.join(SORT_KEYS)}")
        with self._lock:
            records = list(self._records.values())
        if source is not None:
            records = [r for r in records if r.source == source]
        if min_ttft is not None:
            records = [r for r in records if (r.ttft or 0.0) >= min_ttft]
        records.sort(key=lambda r: getattr(r, sort) or 0.0, reverse=descending)
        return records[:limit]
