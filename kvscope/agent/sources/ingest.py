"""The ingest source: a ZMQ PULL socket receiving event batches from taps' emitters.

Every batch is checked before it reaches the pipeline; whatever fails is counted in
``kvscope_events_dropped_total{source, reason}`` and dropped, and the source keeps running:

- ``too_large``: a batch over ``max_batch_bytes`` (counted as one event: its content is unread;
  past four times the limit ZMQ itself refuses the message and resets that connection, so a
  runaway sender can never make the agent hold a huge message);
- ``malformed`` / ``invalid`` / ``version``: see :class:`kvscope.events.SchemaError` (one event);
- ``bad_source``: a source name (or ``scope``) that is not a short lowercase word, or one more
  distinct source than ``max_sources`` (labels stay bounded);
- ``emitter_buffer``: events an emitter reports it dropped (``Batch.dropped`` deltas);
- ``gap``: batches missing from an emitter's sequence (one per missing batch) after the first
  batch this agent received from that emitter (an agent restarted mid-stream joins it there).

Counters stay correct across tap restarts: events carry deltas, not totals, so the agent adds
them up; a restarted emitter has a new ``session`` and its sequence starts again.
"""

from __future__ import annotations

import logging
import re

import zmq

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.worker import Worker

log = logging.getLogger(__name__)
NAME = "ingest"
_SOURCE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


class IngestSource(Worker):
    """Binds ``endpoint`` (``tcp://HOST:PORT`` or ``ipc://PATH``) and feeds ``pipeline``.

    ``max_batch_bytes``: largest batch accepted; ``receive_hwm``: batches ZMQ may queue (with
    the size bound, the memory bound); ``max_sources``: distinct source names accepted.
    ``start()`` raises ``zmq.ZMQError`` when the endpoint cannot be bound.
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
        self._streams: dict[str, tuple[str, int, int]] = {}  # source -> (session, seq, dropped)
        self._socket = None

    thread_name = "kvscope-ingest"

    def prepare(self) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, self._hwm)
        # ZMQ itself refuses anything far over the limit, so a huge message never lands in memory
        self._socket.setsockopt(zmq.MAXMSGSIZE, 4 * self._max_bytes)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
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
        if len(data) > self._max_bytes:
            self.pipeline.drop(NAME, "too_large")
            return
        try:
            batch = ev.decode_batch(data)
        except ev.SchemaError as exc:
            self.pipeline.drop(NAME, exc.reason)
            return
        if not self._admit(batch.source, batch.scope):
            self.pipeline.drop(NAME, "bad_source", len(batch.events))
            return
        self._account(batch)
        if batch.engine or batch.model:
            self.pipeline.set_source_info(batch.source, batch.engine, batch.model)
        self.pipeline.ingest(batch.source, batch.events, scope=batch.scope or None)

    def _admit(self, source: str, scope: str) -> bool:
        if not _SOURCE_NAME.fullmatch(source) or (scope and not _SOURCE_NAME.fullmatch(scope)):
            return False
        return source in self._streams or len(self._streams) < self._max_sources

    def _account(self, batch: ev.Batch) -> None:
        session, seq, dropped = self._streams.get(batch.source, (None, -1, 0))
        if session != batch.session:  # a new or restarted emitter, or an agent restarted
            # mid-stream: batches before the first one seen here went to an earlier agent
            seq, dropped = batch.seq - 1, 0
        if batch.seq > seq + 1:
            self.pipeline.drop(batch.source, "gap", batch.seq - seq - 1)
        if batch.dropped > dropped:
            self.pipeline.drop(batch.source, "emitter_buffer", batch.dropped - dropped)
        self._streams[batch.source] = (batch.session, max(seq, batch.seq), max(dropped, batch.dropped))
