"""The ingest source: a ZMQ PULL socket receiving event batches from taps' emitters.

Every batch is checked before it reaches the pipeline; whatever fails is counted in
``kvscope_events_dropped_total{source, reason}`` and dropped, and the source keeps running:

- ``too_large``: a batch over ``max_batch_bytes`` (past twice the limit ZMQ itself refuses the
  message and resets that connection, so a runaway sender can never make the agent hold a huge
  message);
- ``malformed`` / ``invalid`` / ``version``: see :class:`kvscope.events.SchemaError`; an
  ``invalid`` event costs only itself when the batch's own fields are valid (the batch's other
  events are kept);
- ``bad_source``: a source name (or ``scope``) that is not a short lowercase word, or is one of
  the agent's own (:func:`kvscope.events.source_name_problem`), or one more distinct source than
  ``max_sources`` (labels and per-source state stay bounded; a scope counts as a source);
  logged once per name;
- ``emitter_buffer``: events an emitter reports it dropped (``Batch.dropped`` deltas: a full
  buffer, events that did not encode, or left at close);
- ``gap``: batches missing from an emitter's sequence: after the first batch this agent
  received from that emitter, or, with the agent's store, after the last one an earlier agent
  folded (:attr:`IngestSource.state_path`: batches sent while the agent restarted and lost on
  the way count too). A jump of more than
  :data:`MAX_GAP` batches is no loss but a confused sender: the agent follows it from there and
  logs it;
- ``shutdown``: batches a stopping agent received and did not fold. It goes on folding until
  ZMQ has held nothing for :data:`QUIET` seconds and no tap heard from in the last
  :data:`HEARD` seconds is still open (has not sent its final batch), for up to
  ``drain_seconds``, then stops accepting (ZMQ closes the taps' connections and keeps what it
  holds to be received) and counts what is left, so that a graceful stop loses nothing that
  reached the socket. A tap still sending when the time runs out loses what was on the wire
  then, uncounted.

Each counts the events lost, except ``gap``, which counts batches (their events are unknown),
and a message whose header cannot be read, which counts one. A drop is counted under the source
the batch names when that source has sent a valid batch (one of the ``max_sources``), else under
``ingest``, so refused batches never take a source's place; the first of each source and reason
is logged with what was wrong. A refused batch whose header can be read still moves its
emitter's sequence on, so it is not counted again as a gap. Refusing a message costs a few KB
whatever it holds: its header is read with the events counted off the array, none decoded
(:class:`kvscope.events.BatchHeader`; a refused 8 MiB of one-byte events once cost 480 MB).

Memory: the thread that folds takes what ZMQ holds between batches, and another takes it
whenever that one is held up (:meth:`IngestSource._watch`), so that ZMQ's queue stays short: a
tap that disconnected while the agent's receive queue was full lost its last batch (ZMQ drops
the one message it holds for a full queue), uncounted, at every close. Batches received and not yet
folded are at most ``queue_bytes`` in all, and one message more (each counted with
:data:`MESSAGE_OVERHEAD` bytes more than its own); beyond it the agent stops receiving, and
ZMQ queues at most ``queue_bytes`` of messages per connection (the receive high-water mark is
that over the largest message ZMQ accepts).

A tap that counts its own failures sends their totals with each batch (``Batch.errors``, by
reason); their increases become ``kvscope_tap_errors_total{source, reason}``, each reason at 0
from the first batch that names it. A reason outside
:data:`~kvscope.vocabulary.TAP_ERROR_REASONS` is not counted (labels stay bounded) and is
logged once.

Counters stay correct across tap restarts: events carry deltas, not totals, so the agent adds
them up; a restarted emitter has a new ``session`` and its sequence starts again. Each emitter
(source and session, the latest 64 sessions of each source) is followed on its own, so two
taps that share a source name do not count each other's batches as gaps or restarts; the agent
warns once that they should not. An agent restarted while an emitter runs goes on from the
emitter's drop and error counts (``Batch.dropped``, ``Batch.errors``, cumulative) the earlier
agent saved (with a store); without one it takes them as new, so drops an earlier agent had
counted count again once, after the counter reset.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from pathlib import Path

import msgspec
import zmq
from pydantic import Field, field_validator

from kvscope import events as ev
from kvscope.files import write_atomic
from kvscope.agent.sections import Section, zmq_endpoint
from kvscope.agent.sources.base import (MAX_GAP, Consumer, SourceSpec, SourceWorker,
                                        register)
from kvscope.agent.sources.stalls import Progress
from kvscope.vocabulary import TAP_ERROR_REASONS

log = logging.getLogger(__name__)
NAME = "ingest"
# the drop reasons exported (at 0 until one happens) for the agent's own name, and for each tap
# from its first valid batch; "abandoned" and "invalid" come from the pipeline too
INGEST_DROPS = ("too_large", "malformed", "invalid", "version", "bad_source")
TAP_DROPS = ("emitter_buffer", "gap", "too_large", "malformed", "invalid", "version",
             "bad_source", "abandoned")
# Emitters (sessions) followed per source: restarts leave old ones behind, and taps sharing a
# name (a mistake, warned about) each keep their counts up to this many. 64 chars each at most.
STREAMS_PER_SOURCE = 64
MAX_WARNED = 1024  # distinct (source, reason) drops logged at most
MAX_EMITTERS = 256  # open emitters followed (engine_pids, the drain): a node's taps, with room
# Bytes a received message costs beyond its own (the bytes object and its place in the queue):
# what the queue bound counts for it, so that empty messages cannot fill memory uncounted
MESSAGE_OVERHEAD = 64
# Seconds the folding thread may wait (take no batch, use no CPU) while a message waits in ZMQ
# before another thread takes it: ZMQ's queue of 4 messages fills in about this long when a tap
# sends small batches as fast as it can
STALL = 0.0002
# A stopping agent goes on receiving and folding for up to this many seconds, until ZMQ has held
# nothing for QUIET seconds: what reached its socket is folded, and so are the last batches of
# taps that close as it stops (a node shutting down stops its engines and the agent together)
DRAIN_SECONDS = 1.0
QUIET = 0.1
# ... and while a tap heard from this recently has not closed (its final batch): quiet alone
# once ended the drain while a tap's sender thread was held up (a loaded machine), and its
# later batches were lost on the wire, uncounted
HEARD = 1.0
# Seconds between looks for taps whose process ended without closing them (IngestSource._reap)
REAP_INTERVAL = 2.0
# Seconds between saves of the emitters' sequence numbers (IngestSource.state_path): the store's
# flush interval, so a kill -9 loses as much of the one as of the other
SAVE_INTERVAL = 1.0
STATE_FILE = "ingest-streams.json"  # in the store's directory (kvscope.service.agent)


class _State(msgspec.Struct, forbid_unknown_fields=True):
    """The file :attr:`IngestSource.state_path`: per source, its emitters (sessions, oldest
    first) as ``[session, last folded seq, cumulative dropped, cumulative errors by reason]``."""

    version: int
    streams: dict[str, list[tuple[str, int, int, dict[str, int]]]]


STATE_VERSION = 1


def _live_ipc(endpoint: str, settle: float = 1.0) -> bool:
    """Whether ``endpoint`` is an ``ipc://`` path another process accepts connections on (an
    abstract ``@name`` is refused by ZMQ itself when taken). A listener that goes within
    ``settle`` seconds does not count: ZMQ closes a socket in its I/O thread after ``close()``
    returns, so an agent stopped just before (a restart) may still answer for a moment."""
    path = endpoint.removeprefix("ipc://")
    if path == endpoint or path.startswith("@"):
        return False
    deadline = time.monotonic() + settle
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:  # no file, or a stale one left by a crash: bind may replace it
                return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


class IngestSource(SourceWorker):
    """Binds ``endpoint`` (``tcp://HOST:PORT`` or ``ipc://PATH``) and feeds ``pipeline``.

    ``max_batch_bytes``: largest batch accepted; ``queue_bytes``: batches received and waiting
    to be folded, at most, and messages ZMQ may queue per connection beyond them (the memory
    bound, with the number of taps: see the module);
    ``max_sources``: distinct source names accepted. ``drain_seconds``: how long a stopping
    source goes on folding what arrives (:meth:`run`).
    ``start()`` raises ``zmq.ZMQError`` when the endpoint cannot be bound, or is an ``ipc://``
    path another agent listens on.

    ``state_path`` (set before ``start()``; None: not kept): a file where the emitters' last
    folded sequence numbers and cumulative drop and error counts are saved (every
    :data:`SAVE_INTERVAL` seconds while they change, and at stop) and read back at start, so
    that a restarted agent counts the batches lost while it was away as ``gap`` and an
    emitter's drops and errors that the earlier agent counted are not counted again. After a
    graceful stop the count is exact; after a kill -9, batches folded in the killed agent's
    last :data:`SAVE_INTERVAL` count as ``gap`` too (what they told it was lost with it). A
    file that cannot be read or written is logged and the source runs on without it.
    """

    def __init__(self, pipeline: Consumer, endpoint: str = "tcp://127.0.0.1:5560", *,
                 max_batch_bytes: int = 4 << 20, queue_bytes: int = 32 << 20,
                 max_sources: int = 16, drain_seconds: float = DRAIN_SECONDS) -> None:
        super().__init__(pipeline)
        self.endpoint = endpoint
        self._drain_seconds = drain_seconds
        self._max_bytes = max_batch_bytes
        # ZMQ refuses messages over twice the limit itself; between the two they are counted
        self._max_message = 2 * max_batch_bytes
        self._hwm = max(1, queue_bytes // self._max_message)
        self._queue_bytes = queue_bytes
        self._received: collections.deque[zmq.Frame] = collections.deque()  # oldest first
        self._received_bytes = 0
        # held to use the socket and the queue: ZMQ sockets are not thread-safe (the lock's
        # memory barrier lets two threads take turns)
        self._receiving = threading.Lock()
        self._progress = Progress()  # batches the folding thread took (see _watch)
        self._max_sources = max_sources
        # source -> {session: (last seq, cumulative dropped, cumulative errors by reason)} of
        # its emitters, latest last: the sources that sent to this agent (each takes a place)
        self._streams: dict[str, OrderedDict[str, tuple[int, int, dict[str, int]]]] = {}
        # the same, of the sources an earlier agent followed (state_path) that have not sent to
        # this one: they take no place until they do (a source gone for good held it forever)
        self._restored: dict[str, OrderedDict[str, tuple[int, int, dict[str, int]]]] = {}
        self._warned: set = set()  # what was logged once (see _warn_once)
        # (source, session) -> (its process, its scope (a worker tap's; "" for none),
        # monotonic time last heard, its process seen in /proc) of the emitters not closed,
        # latest last: see engine_pids, run and _reap
        self._open: OrderedDict[tuple[str, str], tuple[int, str, float, bool]] = OrderedDict()
        self._reap_at = 0.0  # monotonic: when to look for taps whose process ended (_reap)
        self._ending: set[tuple[str, str]] = set()  # open emitters found ended at the last look
        self._open_lock = threading.Lock()  # read from the scrape thread
        self._expected: set[str] = set()  # sources whose drop reasons are exported
        self._socket = None
        self.state_path: Path | None = None
        self._unsaved = False  # _streams changed since the last save
        self._save_at = 0.0  # monotonic: when the next save may come

    name = NAME
    thread_name = "kvscope-ingest"

    def prepare(self) -> None:
        self.pipeline.expect_drops(NAME, INGEST_DROPS)
        self._load_state()
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, self._hwm)
        self._socket.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT too (ZMQ's default is IPv4 only)
        # ZMQ itself refuses anything far over the limit, so a huge message never lands in memory
        self._socket.setsockopt(zmq.MAXMSGSIZE, self._max_message)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if _live_ipc(self.endpoint):  # ZMQ would replace the socket file under it
                raise zmq.ZMQError(errno.EADDRINUSE)
            self._socket.bind(self.endpoint)
            self._bound = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # a port 0 resolved
        except zmq.ZMQError:
            self._socket.close()
            raise
        self.report_up(True)

    def run(self) -> None:
        """Receive and fold, oldest first, until stopping; then go on for up to
        ``drain_seconds``, until ZMQ has held nothing for :data:`QUIET` seconds and every tap
        heard from in the last :data:`HEARD` seconds has closed; then stop accepting and count
        what is left (:meth:`_discard`).

        This thread takes what ZMQ holds before each batch it folds (one thread: handing each
        message over to another thread, and the GIL with it, cost the ingest a fifth of its
        time); :meth:`_watch`, on a thread of its own, takes it while this one is held up."""
        self._progress.attach()
        watcher = threading.Thread(target=self._watch, args=(self._socket.getsockopt(zmq.FD),),
                                   name="kvscope-ingest-watch", daemon=True)
        watcher.start()
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        received = self._received
        deadline = None  # monotonic, once stopping: when the drain gives up
        try:
            while True:
                # here, not after a fold: a save that failed is tried again with no traffic
                if self._unsaved and time.monotonic() >= self._save_at:
                    self._save_state()
                with self._receiving:
                    if deadline is None and self.stopping.is_set():
                        deadline = time.monotonic() + self._drain_seconds
                    left = 1.0 if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._drain()
                    # with every batch taken folded: none of an ended tap's is left behind
                    if deadline is None and not received and time.monotonic() >= self._reap_at:
                        self._reap()
                    if not received:
                        wait = 100 if deadline is None else min(QUIET, left) * 1000
                        if (not poller.poll(wait) and deadline is not None
                                and not self._taps_open()):
                            break  # stopping, and every tap has sent what it had
                        continue
                    data = received.popleft()
                    self._received_bytes -= len(data) + MESSAGE_OVERHEAD
                    self._progress.took()
                self.guarded(self.handle, data.buffer)
        finally:
            self._progress.stop()
            watcher.join()
            try:
                self._discard()
            finally:
                self._socket.close()
                if self._unsaved:
                    self._save_state()

    def _discard(self) -> None:
        """Count what is left unfolded as dropped (``shutdown``), under the source each batch
        names, and log it: what this source took from ZMQ, what ZMQ takes still (its queue per
        connection is short, and the rest waits in the OS until it is taken; for at most
        ``5 * QUIET`` seconds, until nothing comes for ``QUIET / 5``), then stop accepting (ZMQ
        closes the taps' connections, and keeps its queue to be received) and what its queue
        held. What a tap had on the wire when its connection closed is lost uncounted: that
        happens only to a tap still sending when ``drain_seconds`` ran out."""
        batches = events = 0

        def count(frame: zmq.Frame) -> None:
            nonlocal batches, events
            batches, events = batches + 1, events + self._count_left(frame.buffer)

        while self._received:
            count(self._received.popleft())
        self._received_bytes = 0
        for unbind in (True, False):
            until = time.monotonic() + QUIET * 5
            while time.monotonic() < until and self._socket.poll(QUIET * 1000 / 5):
                while True:
                    try:
                        count(self._socket.recv(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
            if unbind:
                try:
                    self._socket.unbind(self._bound)
                except zmq.ZMQError:  # gone already
                    pass
        if batches:
            log.warning("kvscope ingest: stopped with %d batches (%d events) received and not "
                        "folded: counted as dropped (reason shutdown)", batches, events)

    def _count_left(self, data: bytes) -> int:
        """Count a batch received and not folded as dropped (``shutdown``); its events. Its
        sequence number is not taken into the saved state (the last folded one stays there),
        so that an agent restarted on that state counts such batches as ``gap``: this count
        dies with the stopping agent, before a scrape reads it."""
        header = ev.read_header(data)
        if header is None:
            self.pipeline.drop(NAME, "shutdown")
            return 1
        source = header.source if header.source in self._streams else NAME
        self.pipeline.drop(source, "shutdown", header.count)
        return header.count

    def _drain(self) -> None:
        """Take every message ZMQ holds, holding at most ``queue_bytes`` unfolded (and one
        message more); the caller holds ``_receiving``."""
        while self._received_bytes < self._queue_bytes:
            try:
                frame = self._socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._received.append(frame)
            self._received_bytes += len(frame) + MESSAGE_OVERHEAD

    def _watch(self, descriptor: int) -> None:
        """Take what ZMQ holds while the folding thread is held up (a lock, a slow
        subscriber), so that ZMQ's queue stays short: a tap that disconnected while the
        agent's receive queue was full lost its last batches (ZMQ drops what it holds for a
        full queue), uncounted.

        :class:`~kvscope.agent.sources.stalls.Progress` waits, without the GIL, on the
        socket's notification ``descriptor`` (ZMQ_FD, an OS file the folding thread reads
        before this one starts: watching it touches no ZMQ state) until a message waits while
        the folding thread has taken no batch and used no CPU for :data:`STALL` seconds; then
        this thread takes everything ZMQ holds, and again at each message after, until that
        thread goes on."""
        progress = self._progress
        while progress.held_up(descriptor, STALL):
            taken = progress.taken
            while progress.taken == taken and not self.stopping.is_set():
                if not self._receiving.acquire(False):
                    break  # the folding thread is receiving
                try:
                    self._drain()
                finally:
                    self._receiving.release()
                if not progress.readable(descriptor, STALL):
                    break

    def handle(self, data: bytes) -> None:
        """Check one received message and hand its events to the pipeline, or count the drop."""
        batch, reason, detail, invalid = None, None, "", 0
        if len(data) > self._max_bytes:
            reason, detail = "too_large", f"{len(data)} bytes, over max_batch_bytes"
        else:
            try:
                batch = ev.decode_batch(data)
            except ev.SchemaError as exc:
                reason, detail = exc.reason, str(exc)
        # a refused batch's header is read once, its events counted, none decoded: refusing
        # costs the same whatever the batch holds (see ev.BatchHeader)
        header = batch or ev.read_header(data)
        # invalid events cost only themselves (one once cost its whole batch), unless the
        # batch's own fields are invalid too (outside the except: its traceback holds the
        # decoder's frame)
        salvaged = (ev.salvage_batch(data, header) if reason == "invalid" and header is not None
                    else None)
        if salvaged is not None:
            (batch, invalid), invalid_detail, reason = salvaged, detail, None
            header = batch
        if header is None:  # not even a batch's header: nobody to blame
            self.pipeline.drop(NAME, reason)
            self._warn_once((NAME, reason), "kvscope ingest: dropped a message (%s): %s; logged "
                            "once per reason", reason, detail or "no batch header")
            return
        if batch is not None and batch.scope and (problem := ev.source_name_problem(batch.scope)):
            reason, detail = "bad_source", f"scope {batch.scope[:64]!r} {problem}"
        # a refused batch never takes one of the max_sources places: junk cannot lock a tap out
        admitted = ((reason is None or header.source in self._streams)
                    and self._admit(header.source))
        reason = reason or (None if admitted else "bad_source")
        source = header.source if admitted else NAME
        if admitted:
            self._account(header)
        events = (len(batch.events) if batch is not None else header.count) + invalid
        if reason is not None:
            self.pipeline.drop(source, reason, events)
            named = header.source[:64]  # also a tap whose every batch is refused gets named
            if detail:
                self._warn_once((named, reason), "kvscope ingest: dropped a batch of %d events "
                                "from source %r (%s): %s; logged once per source and reason",
                                events, named, reason, detail)
            return
        if batch.scope:  # a scope is a source too: it takes a place (pipeline state per scope)
            if not self._admit(batch.scope):
                self.pipeline.drop(source, "bad_source", events)
                return
            self._streams.setdefault(batch.scope, OrderedDict())
        if invalid:
            self.pipeline.drop(source, "invalid", invalid)
            self._warn_once((source, "invalid events"), "kvscope ingest: dropped %d of %d "
                            "events from source %r (invalid): %s; logged once per source",
                            invalid, events, source, invalid_detail)
        if batch.engine or batch.model:
            self.pipeline.set_source_info(batch.source, batch.engine, batch.model)
        if batch.prefix_caching is not None:
            self.pipeline.set_cache_config(batch.source, batch.prefix_caching,
                                           batch.kv_cache_dtype)
        self.pipeline.ingest(batch.source, batch.events, scope=batch.scope or None)
        self._note_emitter(batch)
        if batch.final:
            self.pipeline.forget_tiers(batch.source)
            with self._open_lock:
                serving = self._serving()
            if (batch.scope or batch.source) not in serving:
                # its engine's taps all closed: what it left in flight will never finish
                self.pipeline.abandon_requests(batch.scope or batch.source)

    def _serving(self) -> set[str]:
        """The sources whose requests an open emitter may still report: each open emitter's
        own, and its scope (a worker tap's loads join its scheduler's requests). Under the
        lock."""
        return {name for (source, _session), (_pid, scope, _heard, _seen) in self._open.items()
                for name in (source, scope) if name}

    def _note_emitter(self, batch: ev.Batch) -> None:
        """Follow the batch's emitter while it is open (a final batch closes it): its process
        (``Batch.pid``) and when it was last heard from, at most :data:`MAX_EMITTERS`, the
        least recently heard from going first."""
        key = (batch.source, batch.session)
        with self._open_lock:
            known = self._open.pop(key, None)
            if not batch.final:
                # whether this agent sees the tap's process (not in another PID namespace):
                # looked up once per emitter, so only then can its end be noticed (_reap)
                seen = known[3] if known is not None else (
                    batch.pid > 0 and os.path.exists(f"/proc/{batch.pid}"))
                self._open[key] = (batch.pid, batch.scope, time.monotonic(), seen)
                while len(self._open) > MAX_EMITTERS:
                    self._open.popitem(last=False)

    def _reap(self) -> None:
        """Close the emitters whose process ended without their final batch (an engine killed,
        or vLLM's server stopped by a signal, which never calls the tap's ``shutdown``), as
        that batch would: their sources' tiers, gauges and memory reports are forgotten (see
        :meth:`~kvscope.agent.pipeline.Pipeline.forget_tiers`) once no emitter of the source
        is left, and its requests in flight abandoned once no emitter that reports them (its
        own or its workers') is. Only processes this agent saw in ``/proc``; every
        :data:`REAP_INTERVAL` s, and an emitter only when found ended at two looks running:
        what it sent before it ended (its final batch, when it closed) has been folded by
        then."""
        self._reap_at = time.monotonic() + REAP_INTERVAL
        with self._open_lock:
            dead = {key for key, (pid, _w, _h, seen) in self._open.items()
                    if seen and not os.path.exists(f"/proc/{pid}")}
            ended, self._ending = dead & self._ending, dead - self._ending
            owners = {self._open.pop(key)[1] or key[0] for key in ended}
            left = {source for source, _session in self._open}
            serving = self._serving()
        for source in sorted({source for source, _session in ended} - left):
            log.info("kvscope ingest: the process of source %r ended without closing its tap; "
                     "its tiers and gauges are no longer reported", source)
            self.pipeline.forget_tiers(source)
        for source in sorted(owners - serving):  # no emitter left to finish them
            self.pipeline.abandon_requests(source)

    def _taps_open(self) -> bool:
        """Whether a tap heard from in the last :data:`HEARD` seconds has not closed."""
        with self._open_lock:
            return bool(self._open) and (time.monotonic() - next(reversed(self._open.values()))[2]
                                         < HEARD)

    def engine_pids(self) -> tuple[int, ...]:
        """The engine processes the taps run in, as their batches name them (``Batch.pid``),
        sorted and distinct: those of worker taps (a ``scope``: vLLM's workers, which hold the
        host KV pool) when any, else every tap's; a tap that closed is left out. What the numa
        collector reads when no ``engine_pid`` is configured. Thread-safe."""
        with self._open_lock:
            taps = [(pid, worker) for pid, worker, _heard, _seen in self._open.values() if pid]
        workers = {pid for pid, worker in taps if worker}
        return tuple(sorted(workers or {pid for pid, _worker in taps}))

    def _admit(self, source: str) -> bool:
        """Whether ``source`` is a name the agent accepts, and room is left for it; logs each
        refused name once (see :meth:`_warn_once`)."""
        if source in self._streams:  # admitted before (the common case: no name check)
            return True
        problem = ev.source_name_problem(source)
        if problem:
            self._warn_once(("name", source[:64]), "kvscope ingest: dropping batches from "
                            "source %r: it %s", source[:64], problem)
            return False
        if source in self._streams or len(self._streams) < self._max_sources:
            return True
        self._warn_once(("max_sources", source[:64]), "kvscope ingest: dropping batches from "
                        "source %r: %d other sources sent here since the agent started (each "
                        "keeps its place, so that its series stay bounded); raise [ingest] "
                        "max_sources or restart the agent", source[:64], self._max_sources)
        return False

    def _warn_once(self, key: object, message: str, *args: object) -> None:
        """Log ``message`` the first time ``key`` comes up (of the first :data:`MAX_WARNED`
        keys: anyone may send names, so beyond them nothing more is logged); every other time
        at debug level (``log_level = "debug"``), to see each dropped batch."""
        if key not in self._warned and len(self._warned) < MAX_WARNED:
            self._warned.add(key)
            log.warning(message, *args)
        else:
            log.debug("again: " + message, *args)

    def _account(self, batch: ev.Batch | ev.BatchHeader) -> None:
        source, session = batch.source, batch.session
        if source not in self._expected:  # its first batch (a scope named it, or a restart)
            self._expected.add(source)
            self.pipeline.expect_drops(source, TAP_DROPS)
        self._unsaved = self.state_path is not None  # kept only where it is saved
        streams = self._streams.get(source)
        if streams is None:
            streams = self._streams[source] = self._restored.pop(source, OrderedDict())
        if session in streams and next(reversed(streams)) != session:
            # an emitter sends again after another took the name: two live taps share it
            self._warn_once(("shared", source), "kvscope ingest: two emitters send as source %r; "
                            "give each tap its own source name (their request ids and series "
                            "are merged)", source)
        # a new emitter, or an agent restarted mid-stream: batches before the first one seen
        # here went to an earlier agent
        seq, dropped, errors = streams.pop(session, (batch.seq - 1, 0, {}))
        missing = batch.seq - seq - 1
        if missing > MAX_GAP:
            self._warn_once((source, "seq"), "kvscope ingest: source %r jumped %d batches ahead "
                            "in its sequence; following it from there, not counted as a gap",
                            source, missing)
        elif missing > 0:
            self.pipeline.drop(source, "gap", missing)
            self._warn_once((source, "gap"), "kvscope ingest: %d batches from source %r went "
                            "missing (counted as gap); logged once per source", missing, source)
        if batch.dropped > dropped:
            self.pipeline.drop(source, "emitter_buffer", batch.dropped - dropped)
            self._warn_once((source, "emitter_buffer"), "kvscope ingest: the emitter of source "
                            "%r dropped %d events (its buffer was full: the agent was away or "
                            "slower than the engine; or they did not encode: the tap's log "
                            "says); logged once per source", source,
                            batch.dropped - dropped)
        streams[session] = (max(seq, batch.seq), max(dropped, batch.dropped),
                            self._count_errors(source, errors, batch.errors))
        if len(streams) > STREAMS_PER_SOURCE:  # a restarted tap's old sessions, oldest first
            streams.popitem(last=False)

    def _load_state(self) -> None:
        """Follow the emitters of :attr:`state_path` on from where an earlier agent left them
        (see the class); a missing file is a first start, an unreadable one is logged."""
        if self.state_path is None:
            return
        try:
            state = msgspec.json.decode(self.state_path.read_bytes(), type=_State)
            if state.version != STATE_VERSION:
                raise ValueError(f"version {state.version}, not {STATE_VERSION}")
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:  # msgspec's errors are ValueErrors
            log.warning("kvscope ingest: cannot read the emitters' sequence numbers from %s (%s);"
                        " batches lost while the agent was away are not counted this time",
                        self.state_path, exc)
            return
        for source, sessions in state.streams.items():
            if ev.source_name_problem(source) or len(self._restored) >= self._max_sources:
                continue  # a name this agent would refuse, or more than it takes
            self._restored[source] = OrderedDict(
                (session, (seq, dropped, {r: n for r, n in errors.items()
                                          if r in TAP_ERROR_REASONS}))
                for session, seq, dropped, errors in sessions[-STREAMS_PER_SOURCE:])

    def _save_state(self) -> None:
        """Write the emitters' sequence numbers and counts to :attr:`state_path` (atomically);
        a failure is logged once and tried again after :data:`SAVE_INTERVAL`."""
        self._save_at = time.monotonic() + SAVE_INTERVAL
        # the sources that sent first: a restarted agent restores max_sources at most
        state = _State(STATE_VERSION, {
            source: [(session, *counts) for session, counts in streams.items()]
            for source, streams in {**self._streams, **self._restored}.items() if streams})
        try:
            write_atomic(self.state_path, msgspec.json.encode(state).decode())
        except OSError as exc:
            self._warn_once("state", "kvscope ingest: cannot save the emitters' sequence numbers "
                            "to %s (%s): a restart would not count batches lost while the "
                            "agent is away; trying again every %g s", self.state_path, exc,
                            SAVE_INTERVAL)
            return
        self._unsaved = False

    def _count_errors(self, source: str, before: dict[str, int],
                      now: dict[str, int]) -> dict[str, int]:
        """Count the increase of a tap's error totals from ``before`` to ``now``; return the
        totals to compare the next batch with."""
        totals = dict(before)
        for reason, total in now.items():
            if reason not in TAP_ERROR_REASONS:
                self._warn_once((source, "tap_errors"), "kvscope ingest: source %r reports tap "
                                "errors for reason %r, not one of %s; not counted",
                                source, reason, ", ".join(TAP_ERROR_REASONS))
                continue
            self.pipeline.count_tap_errors(source, reason, max(0, total - before.get(reason, 0)))
            totals[reason] = max(total, before.get(reason, 0))
        return totals


class IngestConfig(Section):
    """ZMQ PULL endpoint for taps' emitters; sizes in bytes."""

    enabled: bool = True
    endpoint: str = "tcp://127.0.0.1:5560"
    max_batch_bytes: int = Field(4 << 20, gt=0, le=1 << 30)  # ZMQ's size limit is twice this
    max_sources: int = Field(16, gt=0)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        return zmq_endpoint(value)


register(SourceSpec(
    NAME, IngestConfig,
    lambda config, consumer, built: IngestSource(consumer, config.endpoint,
                                                 max_batch_bytes=config.max_batch_bytes,
                                                 max_sources=config.max_sources),
    describe=lambda config: f"ingest endpoint {config.endpoint}",
    banner=lambda config, part, base_url: f"ingest: {config.endpoint}"))
