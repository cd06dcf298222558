"""The tap-side emitter: ships kvscope events from inside an engine process to the agent.

It runs on the engine's hot path, so :meth:`Emitter.emit` only encodes the event (msgspec) and
appends the bytes to a bounded buffer (well under a microsecond) and never raises or blocks; a
background thread batches the buffer and sends it over a ZMQ PUSH socket without blocking.
Events are encoded where they are made, while they are in the engine thread's cache: encoded
by the sender thread a tick later, each cost 0.5 us against 0.1 to 0.2 here
(bench/tap_overhead.py), and the buffer holds bytes, not the events' objects. ZMQ queues at most
``send_hwm`` batches, only for a live connection, and reconnects by itself; the rest waits in
the buffer, and once that is full further events are dropped and counted (and reported to the
agent in the next batch, as ``Batch.dropped``). Imports only the standard library, msgspec and
pyzmq.
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing.util
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping

import msgspec
import zmq

from kvscope import events as ev
from kvscope.errors import describe

log = logging.getLogger(__name__)


# Emitters not yet collected: each starts again in a forked child (see Emitter._after_fork),
# and is closed when its process exits.
_LIVE: weakref.WeakSet[Emitter] = weakref.WeakSet()


MAX_LINGER_SECONDS = (2**31 - 1) / 1000  # ZMQ's linger: an int of milliseconds
# Seconds an idle sender thread sleeps at most: it backs off from flush_interval while nothing
# is emitted (each wake-up costs about 0.1 ms of CPU on a virtual machine: 20 a second were
# 2.5 ms/s from an idle engine), and the first event after it wakes it. on_tick runs at least
# this often.
IDLE_INTERVAL = 1.0
# Seconds each emitter still open when its process exits has to hand over what it holds (an
# engine whose shutdown never reaches the tap): the sender thread, a daemon, died with it,
# uncounted.
EXIT_TIMEOUT = 0.5


_encode_event = ev.encode_event  # one global read per emit(), not an attribute of ev


def _mark_forked() -> None:
    for emitter in list(_LIVE):
        emitter._after_fork()


os.register_at_fork(after_in_child=_mark_forked)


def _close_at_exit() -> None:
    """Close every emitter left open (see :data:`EXIT_TIMEOUT`): the agent gets what was
    buffered and the final batch (the engine's tiers leave its gauges), or the loss is logged
    and counted."""
    for emitter in list(_LIVE):
        emitter.close(EXIT_TIMEOUT)


_closing_at_exit_in = 0  # the process whose exit closes the emitters (see Emitter._start)


class Emitter:
    """Batches events to ``endpoint`` (e.g. ``tcp://127.0.0.1:5560`` or ``ipc:///run/kv.sock``).

    ``source``: a short name for this emitter's events, a lowercase word
    (:func:`kvscope.events.source_name_problem`, e.g. ``engine``, ``vllm-dp1``), its own for
    each tap on a node (it is a metric label, and request ids are told apart by it); ``engine``,
    ``model``: what it observes (shown as ``kvscope_engine_info``); ``scope``: the source whose
    requests this emitter's request ids name, when that is another emitter (see
    :class:`kvscope.events.Batch`). ``prefix_caching``, ``kv_cache_dtype``: the observed engine's
    KV cache settings (None, "": not known).
    ``max_buffer``: events held while the agent is slow or away, besides the one batch being
    sent. ``batch_size``: events per batch at most. ``max_batch_bytes``: encoded bytes per
    batch at most, the agent's ``[ingest] max_batch_bytes`` (a batch takes the events that fit;
    an event larger alone is dropped and counted). ``flush_interval``: seconds between sends
    (while idle the sender thread sleeps longer, up to :data:`IDLE_INTERVAL`, until an event
    comes); each wake-up costs the engine's process 0.1 to 0.2 ms of CPU, whatever it sends, so
    the default 0.25 s, against 0.05, halved the sender's share of a busy vLLM tap's cost
    (bench/tap_overhead.py: 2.7 to 1.4 us a request) and delays events by at most that much.
    ``send_hwm``: batches ZMQ may queue (kept small: what ZMQ holds when :meth:`close` gives up
    is lost uncounted, what the buffer holds is counted). ``warn_after``: seconds events may
    wait unsent (no agent at ``endpoint``, or one too slow) before one warning says so; sending
    again is logged too.
    Call :meth:`close` at exit (safe twice, from any thread); one left open is closed when its
    process exits, waiting at most :data:`EXIT_TIMEOUT` for the agent. In a child process
    forked from its maker it starts again at the child's first :meth:`emit`, as a new session,
    with an empty buffer and no ``on_tick``. ``on_tick``: set it to a function of no arguments
    to have it called on the sender thread before each send, at least every :data:`IDLE_INTERVAL`
    seconds (e.g. to emit a gauge while the caller is idle); if it raises it is logged and not
    called again. ``tap_errors``: set it to a function
    of no arguments returning the tap's own failures so far by reason (``Batch.errors``; e.g.
    ``{"internal": 2}``), read on the sender thread for each batch; if it raises it is logged
    and not called again.
    ``logger``: where it logs (default this module's); a tap inside an engine passes one under
    the engine's logger, so the lines come out in the engine's log format.
    Raises ValueError for a ``source`` or ``scope`` the agent would refuse, a bound below 1
    (``max_buffer``, ``batch_size``, ``max_batch_bytes``, ``send_hwm``), a ``flush_interval``
    that is not a positive number of seconds or a negative ``warn_after``, or an ``endpoint``
    that is not ``tcp://`` or ``ipc://`` or that ZMQ cannot connect to; nothing after
    construction raises.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5560", source: str = "engine", *,
                 engine: str = "", model: str = "", scope: str = "",
                 prefix_caching: bool | None = None, kv_cache_dtype: str = "",
                 max_buffer: int = 100_000,
                 batch_size: int = 1024, max_batch_bytes: int = 4 << 20,
                 flush_interval: float = 0.25, send_hwm: int = 4,
                 warn_after: float = 10.0, logger: logging.Logger = log) -> None:
        for name, value in (("source", source), ("scope", scope or source)):
            problem = ev.source_name_problem(value)
            if problem:
                raise ValueError(f"emitter {name} {value!r} {problem}; the agent would drop "
                                 "its events")
        # 0 would send nothing (batch_size), drop every event (max_buffer, max_batch_bytes),
        # leave ZMQ's queue unbounded (send_hwm) or spin the sender thread (flush_interval)
        for name, value in (("max_buffer", max_buffer), ("batch_size", batch_size),
                            ("max_batch_bytes", max_batch_bytes), ("send_hwm", send_hwm)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"emitter {name} must be a whole number >= 1, got {value!r}")
        if not 0 < flush_interval < math.inf:
            raise ValueError(f"emitter flush_interval must be a positive number of seconds, "
                             f"got {flush_interval!r}")
        if not warn_after >= 0:
            raise ValueError(f"emitter warn_after must be seconds >= 0, got {warn_after!r}")
        self.source = source
        self._log = logger
        self._engine, self._model, self._scope = engine, model, scope
        self._prefix_caching, self._kv_cache_dtype = prefix_caching, kv_cache_dtype
        self.dropped = 0  # events lost to a full buffer, a failed encode or close, since start
        self.sent_batches = 0
        self._buffer: collections.deque = collections.deque()
        self._max_buffer = self._capacity = max_buffer
        self._forked = False  # in a forked child, not started again yet (see _after_fork)
        self._fork_lock = threading.RLock()
        self._batch_size = batch_size
        self._max_batch_bytes = max_batch_bytes
        self._interval = flush_interval
        self._session = os.urandom(8).hex()
        self._seq = 0
        self._pending: bytes | None = None  # an encoded batch ZMQ would not take yet
        self._pending_events = 0
        self._warn_after = warn_after
        self._stuck_since: float | None = None  # monotonic: since when events wait unsent
        self._warned = False
        self._told_unencodable = False
        self.on_tick: Callable[[], None] | None = None  # called on the sender thread each interval
        self.tap_errors: Callable[[], Mapping[str, int]] | None = None  # read for each batch
        self._drain_until = 0.0  # monotonic deadline for the final flush, set by close()
        self._endpoint, self._send_hwm = endpoint, send_hwm
        self._start()
        _LIVE.add(self)

    def _start(self) -> None:
        """Connect a socket of a context of its own (so close() can wait for ZMQ to hand over
        what it queued: term()) and start the sender thread. Raises ValueError for an
        endpoint ZMQ cannot connect to."""
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the first emit() to an idle sender, and by close()
        self._idle = False  # the sender sleeps longer than flush_interval (see _run)
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, self._send_hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a live connection
        self._socket.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT too (ZMQ's default is IPv4 only)
        try:
            if not self._endpoint.startswith(("tcp://", "ipc://")):  # inproc:// never leaves
                raise zmq.ZMQError(msg="not a tcp:// or ipc:// endpoint")
            self._socket.connect(self._endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            self._context.term()
            raise ValueError(f"emitter endpoint {self._endpoint!r}: {exc}; use tcp://HOST:PORT "
                             "or ipc://PATH, as the agent's [ingest] endpoint") from None
        self._thread = threading.Thread(target=self._run, name="kvscope-emitter", daemon=True)
        self._thread.start()
        # multiprocessing's exit hook, not atexit's: it runs at the interpreter's exit and also
        # where a multiprocessing child ends (os._exit, which skips atexit), as vLLM's engine
        # core does; registered in each process that starts one (a child's starts empty)
        global _closing_at_exit_in
        if _closing_at_exit_in != os.getpid():
            _closing_at_exit_in = os.getpid()
            multiprocessing.util.Finalize(None, _close_at_exit, exitpriority=0)

    def _after_fork(self) -> None:
        """In a child forked from the process that made this emitter (at-fork hook): its
        sender thread did not survive the fork, and ZMQ's context must not be used across one.
        Only marked here (nothing may start in a child that execs at once: a subprocess whose
        preexec_fn runs these hooks aborted in libzmq); the child's first emit() starts it
        again (:meth:`_start_forked`). Before, every event a child emitted was kept until
        close() and lost without a count. A closed emitter stays closed."""
        if self._stop.is_set():
            return
        self._forked, self._max_buffer = True, 0  # emit() now takes its slow branch
        # the parent's locks may have been held at the fork, by threads the child lacks;
        # reentrant: an emit() from a signal handler may come while the first one starts it
        self._fork_lock, self._stop = threading.RLock(), threading.Event()
        self._wake, self._idle = threading.Event(), False
        self.on_tick = self.tap_errors = None  # the parent's hooks report the parent's state
        self._buffer.clear()  # the parent's events, the parent's to send
        self._pending, self._pending_events = None, 0
        self.dropped = self.sent_batches = 0
        self._told_unencodable = False  # the child's log is its own

    def _start_forked(self) -> bool:
        """Start a forked child's emitter (see :meth:`_after_fork`), once, as a new session
        that has sent nothing; True when it runs."""
        with self._fork_lock:
            if self._forked:
                self._forked = False
                self._session, self._seq = os.urandom(8).hex(), 0
                self._stuck_since, self._warned = None, False
                try:
                    self._start()
                except Exception as exc:  # never into the caller: it stays closed
                    self._log.warning("kvscope emitter: cannot start again after a fork: %s",
                                      exc)
                    return False
                self._max_buffer = self._capacity
            return self._max_buffer > 0

    def emit(self, event: object) -> None:
        """Encode one event and queue it; drops it (and counts) when the buffer is full, the
        emitter is closed or the event does not encode (a numpy or torch scalar in a field, a
        dict that holds itself: logged once). Never raises."""
        if len(self._buffer) >= self._max_buffer and not (self._forked and self._start_forked()):
            self.dropped += 1
            return
        try:
            data = _encode_event(event)
        except Exception as exc:  # the caller's event: it goes, the engine does not notice
            self._unencodable(exc)
            return
        self._buffer.append(data)
        if self._idle:
            self._idle = False
            self._wake.set()

    def _unencodable(self, exc: Exception) -> None:
        self.dropped += 1
        if not self._told_unencodable:
            self._told_unencodable = True
            self._log.warning("kvscope emitter: dropped an event that does not encode (counted "
                              "in dropped; logged once): %s", describe(exc))

    def buffered(self) -> int:
        """Events waiting to be sent (buffer plus a batch ZMQ has not taken yet)."""
        return len(self._buffer) + self._pending_events

    def _run(self) -> None:
        wait = self._interval
        while True:
            if self._wake.wait(wait):  # an event after idling, or close()
                self._wake.clear()
                if self._stop.is_set():
                    break
                wait = self._interval  # what comes with it goes one interval later, batched
                continue
            if self._stop.is_set():
                break
            if self.on_tick is not None:
                self._tick()
            idle = not self._buffer and self._pending is None
            self._watch(self._send_all())
            if not idle:
                wait, self._idle = self._interval, False
                continue
            # nothing came: sleep twice as long, up to IDLE_INTERVAL, until emit() wakes it
            wait, self._idle = min(2 * wait, max(IDLE_INTERVAL, self._interval)), True
            if self._buffer:  # emitted before emit() could see it idle
                wait, self._idle = self._interval, False
        self._max_buffer = 0  # closed: emit() now counts every event as dropped
        # keep sending while ZMQ takes batches, up to close()'s deadline
        while (not self._send_all() or self._buffer) and time.monotonic() < self._drain_until:
            time.sleep(0.001)
        left = self.buffered()
        if left:
            self.dropped += left
            self._buffer.clear()
            self._pending, self._pending_events = None, 0
            self._log.warning("kvscope emitter: closed with %d events unsent (the agent at %s "
                              "away or slow)", left, self._endpoint)
        # the last batch: the engine stopped (its tiers leave the agent's gauges), and the
        # drops counted at close reach the agent
        try:
            self._socket.send(ev.encode_batch(self._batch([], final=True)), zmq.NOBLOCK)
        except zmq.ZMQError:  # the agent away: nothing more to tell it
            pass
        # This thread owns the socket to the end (ZMQ sockets are not thread-safe); term()
        # waits, within the deadline, for ZMQ to hand its queued batches to the agent.
        linger = max(0.0, self._drain_until - time.monotonic())
        self._socket.close(linger=-1 if math.isinf(linger) else int(linger * 1000))
        self._context.term()

    def _watch(self, sent_all: bool) -> None:
        """Warn once when events have waited ``warn_after`` seconds unsent; say when they go
        again."""
        if sent_all:
            if self._warned:
                self._log.warning("kvscope emitter: sending to the agent at %s again",
                                  self._endpoint)
            self._stuck_since, self._warned = None, False
            return
        now = time.monotonic()
        if self._stuck_since is None:
            self._stuck_since = now
        elif not self._warned and now - self._stuck_since >= self._warn_after:
            self._warned = True
            self._log.warning("kvscope emitter: nothing reached the agent at %s for %.0f s (%d "
                              "events waiting; past %d they are dropped and counted). Is "
                              "`kvscope agent` running, with --ingest %s?", self._endpoint,
                              now - self._stuck_since, self.buffered(), self._max_buffer,
                              self._endpoint)

    def _tick(self) -> None:
        try:
            self.on_tick()
        except Exception as exc:  # the caller's hook must not stop the sends
            self._log.warning("kvscope emitter: on_tick failed (%s); not calling it again",
                              describe(exc))
            self.on_tick = None

    def _send_all(self) -> bool:
        """Send the events buffered when called, in batches, until they are sent (True) or ZMQ
        takes no more (False). Events emitted meanwhile wait for the next tick: a send releases
        the GIL, and when each send took what the engine had emitted since the last one, one
        tick sent several small batches (3.6 a tick under bench/tap_overhead.py's load), each
        waking ZMQ's I/O thread and handing the GIL back and forth."""
        left = len(self._buffer)
        while True:
            if self._pending is None:
                if not left:
                    return True
                self._pending, left = self._encode(left)
                if self._pending is None:
                    continue
            try:
                self._socket.send(self._pending, zmq.NOBLOCK)
            except zmq.Again:
                return False  # agent away or slow: keep the batch, try again next tick
            except zmq.ZMQError as exc:
                self._log.warning("kvscope emitter: send failed: %s", exc)
                return False
            self._pending, self._pending_events = None, 0
            self._seq += 1
            self.sent_batches += 1

    def _batch(self, events: list, final: bool = False) -> ev.Batch:
        return ev.Batch(version=ev.SCHEMA_VERSION, source=self.source, seq=self._seq,
                        events=events, session=self._session, dropped=self.dropped,
                        engine=self._engine, model=self._model, scope=self._scope, final=final,
                        prefix_caching=self._prefix_caching, kv_cache_dtype=self._kv_cache_dtype,
                        errors=self._errors(), pid=os.getpid())

    def _errors(self) -> dict[str, int]:
        if self.tap_errors is None:
            return {}
        try:
            # plain ints (a numpy count would not encode, and the batch would not go)
            return {str(reason): int(n) for reason, n in self.tap_errors().items()}
        except Exception as exc:  # the caller's hook must not stop the sends
            self._log.warning("kvscope emitter: tap_errors failed (%s); not calling it "
                              "again", describe(exc))
            self.tap_errors = None
            return {}

    def _encode(self, left: int) -> tuple[bytes | None, int]:
        """The next batch: up to ``batch_size`` of the first ``left`` buffered events, as many
        as fit in ``max_batch_bytes`` with the batch's own fields, and how many of the ``left``
        remain; None when none was left to send (an event over the limit alone is dropped and
        counted: the agent would refuse it, and ZMQ may drop it silently)."""
        buffer = self._buffer
        header = self._batch([])
        # the batch's own fields, and room for a larger dropped count
        room = self._max_batch_bytes - len(ev.encode_batch(header)) - 64
        events: list[msgspec.Raw] = []
        size = 0
        while left and len(events) < self._batch_size:
            n = len(buffer[0])
            if size + n > room and events:
                break
            data = buffer.popleft()
            left -= 1
            if n > room:
                self.dropped += 1
                self._log.warning("kvscope emitter: dropped an event of %d bytes encoded, over "
                                  "max_batch_bytes (%d)", n, self._max_batch_bytes)
                continue
            events.append(msgspec.Raw(data))
            size += n
        if not events:
            return None, left
        self._pending_events = len(events)
        return ev.encode_batch(msgspec.structs.replace(header, events=events,
                                                       dropped=self.dropped)), left

    def close(self, timeout: float | None = 1.0) -> None:
        """Send what is buffered, waiting at most ``timeout`` seconds for the agent to take it
        (None, or longer than ZMQ's linger can say, about 24 days: as long as it takes;
        negative or NaN: 0), and close; events still
        in the buffer then are counted in :attr:`dropped`. Returns within ``timeout`` + 1 s
        (unless the thread is stuck encoding a huge batch: it then finishes, and counts, on
        its own)."""
        with self._fork_lock:
            self._forked = False  # a forked child's that never emitted: nothing to start
        if not self._stop.is_set():
            wait = math.inf if timeout is None else timeout if timeout > 0 else 0.0
            if wait > MAX_LINGER_SECONDS:
                wait = math.inf
            self._drain_until = time.monotonic() + wait
            self._stop.set()
            self._wake.set()
        left = self._drain_until - time.monotonic()
        self._thread.join(None if math.isinf(left) else max(0.0, left) + 1.0)
