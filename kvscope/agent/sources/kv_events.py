"""The vLLM KV events source: subscribes to vLLM's ``--kv-events-config`` ZMQ stream.

vLLM (0.32 ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) publishes multipart
messages ``(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)``; a batch is the array
``[ts, events, data_parallel_rank]`` and each event a map tagged ``type``: ``BlockStored``,
``BlockRemoved`` or ``AllBlocksCleared``; stores and removals carry ``medium`` ``GPU``/``CPU``/
``STORAGE`` (None: GPU). vLLM binds endpoints with ``*`` or ``::`` and ``ipc://``/``inproc://``
ones, and connects to the rest; this source does the opposite (connects to ``*`` as 127.0.0.1).

Mapping (:class:`KvResidency`, pure): blocks are reference-counted per tier by hash (vLLM may
announce a hash more than once), so residency is the number of distinct hashes held;
``BlockStored`` on ``cpu``/``disk`` is an offload (``Transfer`` gpu->cpu / cpu->disk, untimed);
a hash whose last reference goes is an ``Eviction`` (age and hits unknown: ``measured=False``);
``AllBlocksCleared`` evicts everything (``cleared``). After each batch, a ``TierSnapshot`` per
changed tier (bytes from ``block_bytes``, capacity from ``capacity_blocks``; 0 when unknown).
Promotions are invisible in KV events (a promoted GPU block looks like a computed one): the
in-process tap reports those.

Sequence gaps (a seq past the last one + 1) are fetched from vLLM's replay endpoint when one is
configured (a DEALER request with the first missing seq; replies end with seq -1); what cannot be
fetched is counted in ``kvscope_events_dropped_total{source="kv_events", reason="gap"}``
(one per lost batch). Undecodable messages count as ``malformed``, unknown event kinds as
``unknown_kind``. A seq going backwards means vLLM restarted: residency starts over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.worker import Worker

log = logging.getLogger(__name__)
NAME = "kv_events"
MEDIUM_TIER = {"GPU": "gpu", "CPU": "cpu", "STORAGE": "disk"}
_OFFLOAD_FROM = {"cpu": "gpu", "disk": "cpu"}
END_SEQ = -1


class BlockStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    block_size: int = 0
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class KvBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(KvBatch)
_event_decoder = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


def decode(payload: bytes) -> tuple[float, list, int]:
    """``(ts, events, unknown)`` of one KVEventBatch payload: the known events decoded, the
    count of events of kinds this version does not know. Raises msgspec.DecodeError /
    ValidationError for a payload that is not a KVEventBatch."""
    batch = _batch_decoder.decode(payload)
    events, unknown = [], 0
    for raw in batch.events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.ValidationError:
            unknown += 1
    return batch.ts, events, unknown


class KvResidency:
    """Folds vLLM KV events into kvscope events. ``block_bytes``: KV bytes per block (0:
    unknown). ``capacity_blocks``: dict[tier, blocks] (missing: 0, unknown). ``max_tracked``:
    hashes tracked per tier (beyond it new hashes are counted but not remembered)."""

    def __init__(self, block_bytes: int = 0, capacity_blocks: dict[str, int] | None = None,
                 max_tracked: int = 4_000_000) -> None:
        self.block_bytes = block_bytes
        self.capacity = dict(capacity_blocks or {})
        self._max = max_tracked
        self.resident: dict[str, dict[bytes | int, int]] = {}

    def apply(self, ts: float, events: list) -> list:
        out: list = []
        changed: set[str] = set()
        for event in events:
            if isinstance(event, AllBlocksCleared):
                for tier, held in self.resident.items():
                    if held:
                        out.append(self._eviction(ts, tier, len(held), "cleared"))
                        held.clear()
                        changed.add(tier)
                continue
            tier = MEDIUM_TIER.get((event.medium or "GPU").upper())
            if tier is None:
                continue
            held = self.resident.setdefault(tier, {})
            changed.add(tier)
            if isinstance(event, BlockStored):
                new = 0
                for h in event.block_hashes:
                    count = held.get(h, 0)
                    if count == 0:
                        new += 1
                        if len(held) >= self._max:
                            continue
                    held[h] = count + 1
                if new and tier in _OFFLOAD_FROM:
                    out.append(ev.Transfer(ts=ts, src=_OFFLOAD_FROM[tier], dst=tier, blocks=new,
                                           bytes=new * self.block_bytes, duration=0.0,
                                           timed=False))
            else:
                gone = 0
                for h in event.block_hashes:
                    count = held.get(h, 0)
                    if count > 1:
                        held[h] = count - 1
                    else:
                        held.pop(h, None)
                        gone += 1
                if gone:
                    out.append(self._eviction(ts, tier, gone, "capacity"))
        for tier in sorted(changed):
            blocks = len(self.resident.get(tier, ()))
            cap = self.capacity.get(tier, 0)
            out.append(ev.TierSnapshot(ts=ts, tier=tier, capacity_bytes=cap * self.block_bytes,
                                       resident_bytes=blocks * self.block_bytes,
                                       capacity_blocks=cap, resident_blocks=blocks))
        return out

    def reset(self) -> None:
        self.resident.clear()

    def _eviction(self, ts: float, tier: str, blocks: int, reason: str) -> ev.Eviction:
        return ev.Eviction(ts=ts, tier=tier, blocks=blocks, bytes=blocks * self.block_bytes,
                           age=0.0, hits=0, reason=reason, measured=False)


def vllm_binds(endpoint: str) -> bool:
    """Whether vLLM binds ``endpoint`` (0.32 ``ZmqEventPublisher._is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connect_address(endpoint: str) -> str:
    """Where to connect to an endpoint vLLM binds: the wildcard host becomes loopback."""
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")


class KvEventsSource(Worker):
    """Subscribes to ``endpoint`` and feeds ``pipeline``. ``replay_endpoint``: vLLM's replay
    ROUTER (None: gaps are only counted). ``topic``: vLLM's ``topic`` (prefix match).
    ``replay_timeout``: seconds one replay may take. ``clock``: unused by the mapping (vLLM's
    batch ``ts`` is used), kept for symmetry. ``start()`` raises ``zmq.ZMQError`` when the
    endpoint cannot be bound or connected; ``shutdown()`` is safe twice and without start."""

    def __init__(self, pipeline: Pipeline, endpoint: str = "tcp://127.0.0.1:5557", *,
                 replay_endpoint: str | None = None, topic: str = "",
                 residency: KvResidency | None = None, replay_timeout: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.residency = residency or KvResidency()
        self.replay_timeout = replay_timeout
        self.replayed = 0  # batches recovered from the replay endpoint
        self.last_seq: int | None = None
        self._socket = None

    thread_name = "kvscope-kv-events"

    def prepare(self) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            if vllm_binds(self.endpoint):
                sock.connect(connect_address(self.endpoint))
            else:
                sock.bind(self.endpoint)
        except zmq.ZMQError:
            sock.close()
            raise
        self._socket = sock
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
                        frames = self._socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(frames)
        finally:
            self._socket.close()

    def handle(self, frames: list[bytes]) -> None:
        """One published message: check its sequence, fetch gaps, fold its events in."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.pipeline.drop(NAME, "malformed")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self.last_seq
        if last is not None and seq <= last:
            if seq < last:  # vLLM restarted: its cache is empty again
                self.residency.reset()
            else:
                return  # a duplicate
        elif last is not None and seq > last + 1:
            recovered = self._replay(last + 1, seq)
            lost = seq - last - 1 - recovered
            if lost:
                self.pipeline.drop(NAME, "gap", lost)
        self.last_seq = seq
        self._apply(frames[2])

    def _apply(self, payload: bytes) -> None:
        try:
            ts, events, unknown = decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.pipeline.drop(NAME, "malformed")
            return
        if unknown:
            self.pipeline.drop(NAME, "unknown_kind", unknown)
        out = self.residency.apply(ts, events)
        if out:
            self.pipeline.ingest(NAME, out)

    def _replay(self, first: int, until: int) -> int:
        """Fetch batches ``first..until-1`` from the replay endpoint and apply them in order;
        returns how many arrived (0 without a replay endpoint or when it does not answer)."""
        if not self.replay_endpoint:
            return 0
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: dict[int, bytes] = {}
        try:
            sock.connect(connect_address(self.replay_endpoint))
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout
            while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if first <= seq < until:
                    got[seq] = frames[3]
        except zmq.ZMQError as exc:
            log.warning("kv events replay from %s failed: %s", self.replay_endpoint, exc)
        finally:
            sock.close()
        for seq in sorted(got):
            self._apply(got[seq])
        self.replayed += len(got)
        return len(got)
