"""The ingest source: a ZMQ PULL socket receiving event batches from taps' emitters.

Every batch is checked before it reaches the pipeline; whatever fails is counted in
``kvscope_events_dropped_total{source, reason}`` and dropped, and the source keeps running:

- ``too_large``: a batch over ``max_batch_bytes`` (past four times the limit ZMQ itself
  refuses the message and resets that connection, so a runaway sender can never make the
  agent hold a huge message);
- ``malformed`` / ``invalid`` / ``version``: see :class:`kvscope.events.SchemaError`;
- ``bad_source``: a source name (or ``scope``) that is not a short lowercase word
  (:data:`kvscope.events.SOURCE_NAME`), or one more distinct source than ``max_sources``
  (labels stay bounded); logged once per name;
- ``emitter_buffer``: events an emitter reports it dropped (``Batch.dropped`` deltas);
- ``gap``: batches missing from an emitter's sequence after the first batch this agent received
  from that emitter (an agent restarted mid-stream joins it there).

Each counts the events lost, except ``gap``, which counts batches (their events are unknown),
and a ``malformed`` or ``too_large`` message whose header cannot be read, which counts one. A
refused batch whose header can be read still moves its emitter's sequence on, so it is not
counted again as a gap.

Counters stay correct across tap restarts: events carry deltas, not totals, so the agent adds
them up; a restarted emitter has a new ``session`` and its sequence starts again. Each emitter
(source and session) is followed on its own, so two taps that share a source name do not
count each other's batches as gaps or restarts; the agent warns once that they should not.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections import OrderedDict

import zmq

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.worker import Worker

log = logging.getLogger(__name__)
NAME = "ingest"
STREAMS_PER_SOURCE = 4  # emitters (sessions) followed per source: restarts leave old ones behind


def _live_ipc(endpoint: str) -> bool:
    """Whether ``endpoint`` is an ``ipc://`` path another process accepts connections on (an
    abstract ``@name`` is refused by ZMQ itself when taken)."""
    path = endpoint.removeprefix("ipc://")
    if path == endpoint or path.startswith("@"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:  # no file, or a stale one left by a crash: bind may replace it
            return False
    return True


class IngestSource(Worker):
    """Binds ``endpoint`` (``tcp://HOST:PORT`` or ``ipc://PATH``) and feeds ``pipeline``.

    ``max_batch_bytes``: largest batch accepted; ``receive_hwm``: batches ZMQ may queue (with
    the size bound, the memory bound); ``max_sources``: distinct source names accepted.
    ``start()`` raises ``zmq.ZMQError`` when the endpoint cannot be bound, or is an ``ipc://``
    path another agent listens on.
    """

    def __init__(self, pipeline: Pipeline, endpoint: str = "tcp://127.0.0.1:5560", *,
                 max_batch_bytes: int = 4 << 20, receive_hwm: int = 256,
                 max_sources: int = 16) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.endpoint = endpoint
        self._max_bytes = max_batch_bytes
        self._hwm = receive_hwm
        self._max_sources = max_sources
        # (source, session) -> (last seq, cumulative dropped) of each emitter, least recent first
        self._streams: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        self._latest: dict[str, str] = {}  # source -> session of its latest batch
        self._warned: set[str] = set()  # source names logged once (refused, or shared)
        self._socket = None

    thread_name = "kvscope-ingest"

    def prepare(self) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, self._hwm)
        # ZMQ itself refuses anything far over the limit, so a huge message never lands in memory
        self._socket.setsockopt(zmq.MAXMSGSIZE, 4 * self._max_bytes)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if _live_ipc(self.endpoint):  # ZMQ would replace the socket file under it
                raise zmq.ZMQError(errno.EADDRINUSE)
            self._socket.bind(self.endpoint)
        except zmq.ZMQError:
            self._socket.close()
            raise
        self.pipeline.set_source_up(NAME, True)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                if not poller.poll(100):
                    continue
                while True:
                    try:
                        data = self._socket.recv(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self.handle(data)
        finally:
            self._socket.close()

    def handle(self, data: bytes) -> None:
        """Check one received message and hand its events to the pipeline, or count the drop."""
        reason = "too_large" if len(data) > self._max_bytes else None
        if reason is None:
            try:
                batch = ev.decode_batch(data)
            except ev.SchemaError as exc:
                reason = exc.reason
        if reason is not None:
            header = ev.read_header(data)
            self.pipeline.drop(NAME, reason, len(header.events) if header else 1)
            if header and self._admit(header.source, ""):
                self._account(header)
            return
        if not self._admit(batch.source, batch.scope):
            self.pipeline.drop(NAME, "bad_source", len(batch.events))
            return
        self._account(batch)
        if batch.engine or batch.model:
            self.pipeline.set_source_info(batch.source, batch.engine, batch.model)
        self.pipeline.ingest(batch.source, batch.events, scope=batch.scope or None)

    def _admit(self, source: str, scope: str) -> bool:
        for name in (source, scope):
            if name and not ev.SOURCE_NAME.fullmatch(name):
                self._warn_once(name, "kvscope ingest: dropping batches from source %r: a source "
                                "(and scope) must be a lowercase word of up to 32 characters "
                                f"({ev.SOURCE_NAME.pattern})", name[:64])
                return False
        if source not in self._latest and len(self._latest) >= self._max_sources:
            self._warn_once(source, "kvscope ingest: dropping batches from source %r: %d "
                            "sources already send here; raise [ingest] max_sources",
                            source[:64], self._max_sources)
            return False
        return True

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned and len(self._warned) < 4 * self._max_sources:
            self._warned.add(key)
            log.warning(message, *args)

    def _account(self, batch: ev.Batch | ev.BatchHeader) -> None:
        source, key = batch.source, (batch.source, batch.session)
        latest = self._latest.get(source)
        if latest not in (None, batch.session) and key in self._streams:
            # an emitter sends again after another took the name: two live taps share it
            self._warn_once(f"shared:{source}", "kvscope ingest: two emitters send as source "
                            "%r; give each tap its own source name (their request ids and "
                            "series are merged)", source)
        self._latest[source] = batch.session
        # a new emitter, or an agent restarted mid-stream: batches before the first one seen
        # here went to an earlier agent
        seq, dropped = self._streams.pop(key, (batch.seq - 1, 0))
        if batch.seq > seq + 1:
            self.pipeline.drop(source, "gap", batch.seq - seq - 1)
        if batch.dropped > dropped:
            self.pipeline.drop(source, "emitter_buffer", batch.dropped - dropped)
        self._streams[key] = (max(seq, batch.seq), max(dropped, batch.dropped))
        if len(self._streams) > STREAMS_PER_SOURCE * self._max_sources:
            self._streams.popitem(last=False)
