"""The KV events source: subscribes to vLLM's (or SGLang's) ``--kv-events-config`` ZMQ stream.

vLLM (0.32 ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) publishes multipart
messages ``(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)``; a batch is the array
``[ts, events, data_parallel_rank]`` and each event a map tagged ``type``: ``BlockStored``,
``BlockRemoved`` or ``AllBlocksCleared``; stores and removals carry ``medium`` ``GPU``/``CPU``/
``STORAGE`` (None: GPU). vLLM binds endpoints with ``*`` or ``::`` and ``ipc://``/``inproc://``
ones, and connects to the rest; this source does the opposite (connects to ``*`` as 127.0.0.1),
and ``kvscope agent`` says at start-up which it does (:func:`describe_endpoint`): with the same
endpoint string on both sides they pair, with a mix both connect (or bind) and nothing arrives.
One batch holds one scheduler step's events: the GPU block pool's first, then the offloading
connector's (its primary CPU tier's, then each secondary tier's; vLLM 0.32
``v1/core/sched/scheduler.py`` and ``v1/kv_offload/tiering/manager.py`` ``take_events``).

Mapping (:class:`KvResidency`, pure), for the tiers it is told to report (``tiers``, default
gpu, cpu and disk; events of other tiers are ignored): blocks are reference-counted per tier by
hash (vLLM may announce a hash more than once), so residency is the number of distinct hashes
held. A new hash on ``disk`` is an offload (``Transfer`` cpu->disk, untimed); a new hash on
``cpu`` is a disk->cpu promotion (untimed ``Transfer`` disk->cpu) when the hash is resident on
disk, else an offload (gpu->cpu). That rule holds because the connector names a block by the
same hash in every offload medium: CPU and STORAGE events are both translated from the block's
``OffloadKey`` (``offloading/events.py``: ``key[:-4]``, or the chunk's hashes with
``self_describing_kv_events``), and a promotion is the CPU tier's ``complete_write`` of that key
(``tiering/manager.py``). Known misreadings: a block recomputed because its promotion could not
be made (CPU tier full) and offloaded again counts as a promotion; with
``self_describing_kv_events`` and chunks of several blocks, a promotion announced before a
lookup hit carries only the chunk's last hash (one block); disk hashes beyond ``max_tracked``
are not remembered, so their promotions count as offloads. Promotions into the GPU tier
(cpu->gpu) stay invisible: a loaded GPU block's ``BlockStored`` looks like a computed one (the
in-process tap reports those).

A hash whose last reference goes is an ``Eviction`` (age and hits unknown: ``measured=False``;
idle time before eviction unknown too, ``idle`` None: KV events report no hits, neither a GPU
block's prefix-cache reuse nor a CPU block's load, so the idle time would be the age, which
makes every reused block look idle since it was stored; and residency keeps reference counts,
not store times. vLLM's own ``kv_block_idle_before_evict_seconds``, mapped by the vLLM metrics
source, measures the GPU tier's; the tap the CPU tier's).
The removal of a hash this source never saw stored is ignored: KV events carry no snapshot, so an
agent (re)started while vLLM runs cannot know where such a block's copy is (counting it as
dropped raised false alarms), and residency counts only the blocks stored since it listens.
A GPU or CPU one counts as ``offloaded`` when a copy is kept below: the hash is resident on disk
(GPU: in the cpu or disk tier) at the end of its batch (a lower tier's store of a block can come
after the upper tier's removal in one batch); dropped otherwise. For the GPU tier that holds
because the GPU block pool's events carry the same hash as the offload tiers' events for the
same block: the pool's ``maybe_convert_block_hash(block_hash)`` (``v1/core/block_pool.py``), the
connector's ``maybe_convert_block_hash(key[:-4])`` of ``make_offload_key(block_hash, group)``
(``offloading/scheduler.py``, ``v1/kv_offload/base.py``). Where an offloaded chunk spans several
GPU blocks, the connector names it by its last block's hash (without
``self_describing_kv_events``), so evictions of the chunk's other GPU blocks count as dropped.
The tiers below a reported one are therefore tracked (not reported) with it: cpu and disk
whenever gpu is reported (also with ``tiers = ["gpu"]``), disk whenever cpu is; each tier's
tracking is bounded by ``max_tracked`` (a hash not remembered in a lower tier makes its upper
tier's eviction count as dropped). ``AllBlocksCleared`` (only vLLM's GPU block pool sends it,
when the prefix cache is reset) evicts the gpu and cpu tiers (``cleared``; the CPU tier's own
reset, with ``reset_connector``, sends nothing); the disk tier keeps its blocks (vLLM's
secondary tiers persist across resets), so cleared blocks kept on disk count as offloaded.
After each batch, a ``TierSnapshot`` per changed reported tier (bytes from ``block_bytes``,
capacity from ``capacity_blocks``; 0 when unknown).

Another source reporting the same tiers (kvscope's vLLM tap reports cpu and disk) counts their
transfers and evictions twice: :meth:`KvEventsSource.check_overlap` compares the pipeline's
totals for the directions and tiers this source reports with what it sent itself, every
``overlap_check`` seconds, and logs one warning naming the config key (``[kv_events] tiers``)
when another source added to them.

Sequence gaps (a seq past the last one + 1) are fetched from vLLM's replay endpoint when one is
configured (a DEALER request with the first missing seq; replies end with seq -1); what cannot be
fetched is counted in ``kvscope_events_dropped_total{source="kv_events", reason="gap"}``
(one per lost batch). A gap over :data:`MAX_REPLAY` batches is not asked for, and after a
replay that brought nothing none is tried for :data:`REPLAY_BACKOFF` seconds (a replay endpoint
that never answers would otherwise hold the source ``replay_timeout`` per gap). A jump over
:data:`MAX_GAP` batches is followed and logged, not counted. Undecodable messages and negative
sequence numbers count as ``malformed``, unknown event kinds as ``unknown_kind``. A seq going
backwards means vLLM restarted: residency starts over, and every reported tier's gauges say so
at once. The stream is one publisher's: a second one on the same endpoint (its own sequence)
reads as duplicates and restarts.

**SGLang** (``engine = "sglang"``; 0.5.23 ``srt/disaggregation/kv_events.py``,
``srt/mem_cache/events.py``) publishes the same framing, replay included: the batch's third item
is its ``attn_dp_rank``, and ``BlockStored`` carries more fields (``token_ids``, ``lora_id``,
``cache_salt``, ``session_id``, ``lora_name``: not read). Its media (:class:`Flavour`,
:data:`~kvscope.vocabulary.SGLANG_MEDIUM_TIER`) are ``GPU``, ``CPU_PINNED`` (the HiCache host
pool), ``DISK`` and ``EXTERNAL`` (-> remote; a new remote hash is a cpu->remote offload, a cpu
hash resident there a remote->cpu promotion, like disk). 0.5.23 publishes GPU and CPU_PINNED
only (every ``record_store``/``record_remove`` call of its radix trees names one of those), so
its default ``tiers`` are gpu and cpu. A CPU_PINNED store is a write-through backup of a GPU
block, or a block prefetched from the storage layer (L3) into the host pool: the events do not
tell them apart, and both count as gpu->cpu offloads (the SGLang metrics source counts the
prefetches). SGLang also binds ``0.0.0.0``. With data parallelism each DP rank publishes on its
own port, the endpoint's plus the rank (``ZmqEventPublisher.offset_endpoint_port``; its replay
endpoint likewise), with its own sequence and its own KV cache: with ``dp_size`` N the source
subscribes to all N ports, keeps a sequence, gaps, replays and restarts per rank (the batch's
rank), and tracks each rank's blocks apart (one hash in two ranks is two blocks).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec
import zmq
from pydantic import Field, ValidationInfo, field_validator
from zmq.utils.monitor import recv_monitor_message

from kvscope import events as ev
from kvscope.agent.sections import Section, TierSize, tier_keys, zmq_endpoint
from kvscope.agent.sources.base import Consumer, SourceSpec, SourceWorker, register
from kvscope.vocabulary import LOCAL_TIERS, SGLANG_MEDIUM_TIER, VLLM_MEDIUM_TIER
from kvscope.vocabulary import TIERS as ALL_TIERS

log = logging.getLogger(__name__)
NAME = "kv_events"
_OFFLOAD_FROM = {"cpu": "gpu", "disk": "cpu", "remote": "cpu"}
_BELOW_CPU = ("disk", "remote")  # the tiers a cpu block is offloaded to and promoted from
# what this source sends
_MAPPED_TRANSFERS = (("gpu", "cpu"), ("disk", "cpu"), ("cpu", "disk"), ("remote", "cpu"),
                     ("cpu", "remote"))
END_SEQ = -1
# A sequence jump beyond this is no loss but a confused (or second) publisher; a gap beyond
# MAX_REPLAY batches is more than vLLM's replay buffer holds, so it is not asked for; after a
# replay that brought nothing, none is tried for REPLAY_BACKOFF seconds (each would hold the
# source for replay_timeout while batches queue up).
MAX_GAP = 1 << 20
MAX_REPLAY = 10_000
REPLAY_BACKOFF = 30.0
# Bytes a message may have where the agent binds (see KvEventsSource.prepare): vLLM's own are
# kilobytes a step, about 4 bytes per prompt token, so 16 MiB holds a step of 4M tokens.
MAX_BOUND_MESSAGE = 16 << 20


@dataclass(frozen=True)
class Flavour:
    """An engine's dialect of the KV events framing. ``engine``: its ``[kv_events] engine``;
    ``title``: its name in messages; ``media``: medium -> tier; ``default_tiers``: the tiers
    reported when ``[kv_events] tiers`` is not set; ``binds_any``: whether the engine binds a
    ``0.0.0.0`` endpoint too (besides ``*``, ``::``, ``ipc://`` and ``inproc://``)."""

    engine: str
    title: str
    media: Mapping[str, str]
    default_tiers: tuple[str, ...]
    binds_any: bool = False

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers its media name, nearest the GPU first."""
        return tuple(t for t in ALL_TIERS if t in self.media.values())

    def binds(self, endpoint: str) -> bool:
        """Whether the engine binds ``endpoint`` (else it connects to it)."""
        return vllm_binds(endpoint) or (self.binds_any and "tcp://0.0.0.0:" in endpoint)


VLLM = Flavour("vllm", "vLLM", VLLM_MEDIUM_TIER, LOCAL_TIERS)
# SGLang 0.5.23 publishes no DISK or EXTERNAL event (see the module)
SGLANG = Flavour("sglang", "SGLang", SGLANG_MEDIUM_TIER, ("gpu", "cpu"), binds_any=True)
FLAVOURS = {f.engine: f for f in (VLLM, SGLANG)}


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


class _Rank(msgspec.Struct, array_like=True):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(KvBatch)
_rank_decoder = msgspec.msgpack.Decoder(_Rank)
_event_decoder = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


def decode(payload: bytes) -> tuple[float, list, int]:
    """``(ts, events, unknown)`` of one KVEventBatch payload: the known events decoded, the
    count of events of kinds this version does not know. Raises msgspec.DecodeError /
    ValidationError for a payload that is not a KVEventBatch, RecursionError for one nested
    past msgspec's depth bound, UnicodeDecodeError for a string that is not UTF-8."""
    batch = _batch_decoder.decode(payload)
    events, unknown = [], 0
    for raw in batch.events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.ValidationError:
            unknown += 1
    return batch.ts, events, unknown


def batch_rank(payload: bytes) -> int | None:
    """The data-parallel rank a KVEventBatch payload names (its third item; None when it has
    none, or is no batch), read without decoding its events."""
    try:
        return _rank_decoder.decode(payload).data_parallel_rank
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return None


class KvResidency:
    """Folds KV events into kvscope events. ``block_bytes``: KV bytes per block (0:
    unknown). ``capacity_blocks``: dict[tier, blocks] (missing: 0, unknown). ``max_tracked``:
    hashes tracked per tier (beyond it new hashes are counted but not remembered). ``tiers``:
    the tiers to report (of those ``flavour``'s media name: vLLM's gpu, cpu, disk)."""

    def __init__(self, block_bytes: int = 0, capacity_blocks: dict[str, int] | None = None,
                 max_tracked: int = 4_000_000, tiers: Iterable[str] | None = None,
                 flavour: Flavour = VLLM) -> None:
        self.block_bytes = block_bytes
        self.capacity = dict(capacity_blocks or {})
        self._max = max_tracked
        self.media = flavour.media
        self.tiers = frozenset(flavour.tiers if tiers is None else tiers)
        unknown = self.tiers.difference(flavour.tiers)
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}: the tiers are "
                             f"{', '.join(flavour.tiers)}")
        # the tiers below a reported one are tracked (not reported): disk (remote) residency
        # tells cpu promotions from offloads, and cpu and disk (remote) residency tell an
        # evicted block's kept copy (offloaded) from a dropped one
        self.tracked = set(self.tiers)
        if "gpu" in self.tiers:
            self.tracked |= {"cpu", *_BELOW_CPU}
        if "cpu" in self.tiers:
            self.tracked.update(_BELOW_CPU)
        self.resident: dict[str, dict[bytes | int, int]] = {}

    def apply(self, ts: float, events: list, rank: int | None = None) -> list:
        """kvscope events of one batch (``ts``: its time; ``events``: its decoded events).
        ``rank``: the data-parallel rank that sent it, when the source follows several (each
        rank's cache is its own: its hashes are tracked as ``(rank, hash)``), else None."""
        moved: Counter[tuple[str, str]] = Counter()             # (src, dst) -> blocks
        evicted: Counter[tuple[str, str, bool]] = Counter()     # (tier, reason, offloaded)
        # (tier, hash, reason) of gpu and cpu hashes that left their tier: offloaded iff the
        # hash is resident in a tier below at the end of the batch (the lower tier's store of
        # a block can come after the upper tier's removal in one batch)
        left: list[tuple[str, bytes | int, str]] = []
        changed: set[str] = set()
        resident = self.resident
        for event in events:
            if isinstance(event, AllBlocksCleared):
                for tier in ("gpu", "cpu"):
                    held = resident.get(tier)
                    if held:
                        gone = list(held) if rank is None else [k for k in held if k[0] == rank]
                        left.extend((tier, h, "cleared") for h in gone)
                        for h in gone:
                            del held[h]
                        changed.add(tier)
                continue
            tier = self.media.get((event.medium or "GPU").upper())
            if tier is None or tier not in self.tracked:
                continue
            held = resident.setdefault(tier, {})
            changed.add(tier)
            hashes = (event.block_hashes if rank is None
                      else [(rank, h) for h in event.block_hashes])
            if isinstance(event, BlockStored):
                # the tiers a new cpu hash may be promoted from (those holding any block)
                below = ([(t, resident[t]) for t in _BELOW_CPU if resident.get(t)]
                         if tier == "cpu" else ())
                for h in hashes:
                    count = held.get(h, 0)
                    if count == 0:
                        for source, copies in below:
                            if h in copies:
                                moved[(source, "cpu")] += 1
                                break
                        else:
                            if tier != "gpu":
                                moved[(_OFFLOAD_FROM[tier], tier)] += 1
                        if len(held) >= self._max:
                            continue
                    held[h] = count + 1
            else:
                for h in hashes:
                    count = held.get(h, 0)
                    if count == 0:  # stored before this agent listened, or not remembered
                        continue
                    if count > 1:
                        held[h] = count - 1
                        continue
                    del held[h]
                    if tier in _BELOW_CPU:  # the lowest tiers: nothing is kept below
                        evicted[(tier, "capacity", False)] += 1
                    else:
                        left.append((tier, h, "capacity"))
        if left:
            cpu = resident.get("cpu", {})
            lower = [resident[t] for t in _BELOW_CPU if resident.get(t)]
            for tier, h, reason in left:
                kept = any(h in copies for copies in lower) or (tier == "gpu" and h in cpu)
                evicted[(tier, reason, kept)] += 1
        out: list = []
        report = self.tiers
        bpb = self.block_bytes
        for (src, dst), blocks in sorted(moved.items()):
            if dst in report:
                out.append(ev.Transfer(ts=ts, src=src, dst=dst, blocks=blocks, bytes=blocks * bpb,
                                       duration=0.0, timed=False))
        for (tier, reason, offloaded), blocks in sorted(evicted.items()):
            if tier in report:
                out.append(ev.Eviction(ts=ts, tier=tier, blocks=blocks, bytes=blocks * bpb,
                                       age=0.0, hits=0, offloaded=offloaded, reason=reason,
                                       measured=False))
        return out + self.snapshots(ts, changed)

    def snapshots(self, ts: float, tiers: Iterable[str] | None = None) -> list[ev.TierSnapshot]:
        """A ``TierSnapshot`` of each reported tier (of those in ``tiers``, when given)."""
        bpb = self.block_bytes
        out = []
        for tier in sorted(self.tiers if tiers is None else self.tiers & set(tiers)):
            blocks = len(self.resident.get(tier, ()))
            cap = self.capacity.get(tier, 0)
            out.append(ev.TierSnapshot(ts=ts, tier=tier, capacity_bytes=cap * bpb,
                                       resident_bytes=blocks * bpb,
                                       capacity_blocks=cap, resident_blocks=blocks))
        return out

    def reset(self, rank: int | None = None) -> None:
        """Forget every block (of data-parallel rank ``rank`` only, when given)."""
        if rank is None:
            self.resident.clear()
            return
        for held in self.resident.values():
            for h in [k for k in held if k[0] == rank]:
                del held[h]


_PEER_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


def vllm_binds(endpoint: str) -> bool:
    """Whether vLLM binds ``endpoint`` (0.32 ``ZmqEventPublisher._is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connect_address(endpoint: str) -> str:
    """Where to connect to an endpoint the engine binds: the wildcard host becomes loopback."""
    return (endpoint.replace("tcp://*:", "tcp://127.0.0.1:")
            .replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:"))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` publishes on, given the engine ``endpoint``: the
    port plus the rank (SGLang 0.5.23 ``ZmqEventPublisher.offset_endpoint_port``; rank 0: the
    endpoint itself). ``endpoint``: ``tcp://HOST:PORT`` unless ``rank`` is 0."""
    if rank == 0:
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}"


def describe_endpoint(endpoint: str, flavour: Flavour = VLLM) -> str:
    """What the agent does with ``endpoint`` and which ``--kv-events-config`` endpoint the
    engine then takes (for the start-up banner: two sides that both connect get nothing,
    silently)."""
    name = flavour.title
    if flavour.binds(endpoint):
        text = (f"connects to {connect_address(endpoint)}: {name} must bind, so its "
                f"--kv-events-config endpoint must be \"{endpoint}\"")
        return text + (f" (with a host address {name} connects as well and nothing arrives)"
                       if endpoint.startswith("tcp://") else "")
    port = endpoint.rpartition(":")[2]
    engine = (f"tcp://<this host's address>:{port}" if endpoint.startswith("tcp://0.0.0.0:")
              else endpoint)
    wildcards = "*, :: or 0.0.0.0" if flavour.binds_any else "* or ::"
    return (f"binds {endpoint}: {name} must connect, so its --kv-events-config endpoint must be "
            f"\"{engine}\" (with {wildcards} {name} binds as well and nothing arrives)")


class KvEventsSource(SourceWorker):
    """Subscribes to ``endpoint`` and feeds ``pipeline``. ``replay_endpoint``: the engine's
    replay ROUTER (None: gaps are only counted). ``topic``: the engine's ``topic`` (prefix
    match). ``flavour``: the engine (:data:`VLLM`, :data:`SGLANG`). ``dp_size``: data-parallel
    ranks to follow, each on its own port (see the module; 1: one publisher, whatever rank its
    batches name). ``replay_timeout``: seconds one replay may take. ``overlap_check``: seconds
    between :meth:`check_overlap` calls on the source's thread (0: never). ``clock``: unused by
    the mapping (the engine's batch ``ts`` is used), kept for symmetry. ``start()`` raises
    ``zmq.ZMQError`` when an endpoint cannot be bound or connected; ``shutdown()`` is safe
    twice and without start."""

    def __init__(self, pipeline: Consumer, endpoint: str = "tcp://127.0.0.1:5557", *,
                 replay_endpoint: str | None = None, topic: str = "",
                 residency: KvResidency | None = None, replay_timeout: float = 2.0,
                 overlap_check: float = 5.0, flavour: Flavour = VLLM, dp_size: int = 1,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(pipeline)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.flavour = flavour
        self.dp_size = dp_size
        self.residency = residency or KvResidency(flavour=flavour)
        self.replay_timeout = replay_timeout
        self.overlap_check = overlap_check
        self.replayed = 0  # batches recovered from the replay endpoint
        self._replay_after = 0.0  # monotonic: no replay before (see REPLAY_BACKOFF)
        self._jump_logged = False
        self._topic_logged = False
        self.last_seqs: dict[int, int] = {}  # by data-parallel rank (0 with one publisher)
        self.shared_tiers: set[str] = set()  # reported tiers another source reports too
        # what this source ingested, to tell its share of the pipeline's totals: blocks and
        # bytes per transfer direction, blocks per (evicted tier, reason)
        self._sent_transfers: dict[tuple[str, str], list[int]] = {}
        self._sent_evictions: Counter[tuple[str, str]] = Counter()
        self._socket = None
        self._monitor = None
        self._peers = 0  # publishers connected

    name = NAME
    thread_name = "kvscope-kv-events"

    @property
    def last_seq(self) -> int | None:
        """The last sequence number taken (of rank 0, when following several ranks)."""
        return self.last_seqs.get(0)

    def describe(self) -> str:
        """The start-up banner's line for this source: bind or connect, and what the engine
        needs."""
        text = (f"{self.flavour.title}: {self.endpoint} -> "
                f"{describe_endpoint(self.endpoint, self.flavour)}")
        if self.dp_size > 1:
            text += (f"; {self.dp_size} data-parallel ranks, to "
                     f"{rank_endpoint(self.endpoint, self.dp_size - 1)}")
        if self.replay_endpoint:
            text += f"; replay: connects to {connect_address(self.replay_endpoint)}"
        return text + f"; reports tiers {', '.join(t for t in ALL_TIERS if t in self.residency.tiers)}"

    def prepare(self) -> None:
        self.pipeline.expect_drops(NAME, ("malformed", "gap", "unknown_kind"))
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1_000)  # messages at most, per connection (vLLM sends
        # one per scheduler step with changes: seconds of them; beyond, ZMQ drops: a gap)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT too (ZMQ's default is IPv4 only)
        # every topic, so that a topic other than the one configured is told (handle())
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            if self.flavour.binds(self.endpoint):
                # connecting to the engine named, whose messages are not bounded: a step with a
                # million prompt tokens publishes megabytes, and a connecting socket that met
                # one over MAXMSGSIZE heard nothing again (ZMQ ends that session for good)
                for rank in range(self.dp_size):
                    sock.connect(connect_address(rank_endpoint(self.endpoint, rank)))
            else:
                # anyone may connect to what the agent binds: at most RCVHWM messages of
                # MAXMSGSIZE each per connection; ZMQ refuses a larger one and resets that
                # connection, which then reconnects (a gap, replayed or counted)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_BOUND_MESSAGE)
                for rank in range(self.dp_size):
                    sock.bind(rank_endpoint(self.endpoint, rank))
        except zmq.ZMQError:
            sock.close()
            raise
        self._socket = sock
        # Up while a publisher is connected: a SUB socket receives nothing, silently, from
        # an endpoint nobody publishes on, so the connection events are the only sign.
        self._monitor = sock.get_monitor_socket(_PEER_EVENTS)
        self.report_up(False)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_check = time.monotonic() + self.overlap_check
        try:
            while not self.stopping.is_set():
                if (self.overlap_check > 0 and not self.shared_tiers
                        and time.monotonic() >= next_check):
                    next_check = time.monotonic() + self.overlap_check
                    self.check_overlap()
                ready = dict(poller.poll(100))
                if self._monitor in ready:
                    self._peer_event(recv_monitor_message(self._monitor)["event"])
                if self._socket not in ready:
                    continue
                while not self.stopping.is_set():
                    try:
                        frames = self._socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.guarded(self.handle, frames)
        finally:
            self._socket.disable_monitor()
            self._monitor.close()
            self._socket.close()

    def _peer_event(self, event: int) -> None:
        was_up = self._peers > 0
        self._peers = max(0, self._peers + (-1 if event == zmq.EVENT_DISCONNECTED else 1))
        if (self._peers > 0) != was_up:
            log.info("kvscope kv_events: %s %s's publisher at %s",
                     "lost" if was_up else "connected to", self.flavour.title, self.endpoint)
            self.report_up(not was_up)

    def handle(self, frames: list[bytes]) -> None:
        """One published message: check its sequence, fetch gaps, fold its events in."""
        if not frames[0].startswith(self.topic.encode()):
            # another topic, whatever its shape: not ours to count; said once, as a topic vLLM
            # does not use would otherwise keep the source up (connected) and silent
            if not self._topic_logged:
                self._topic_logged = True
                log.warning("kv_events: ignoring messages on topic %r, as [kv_events] topic is "
                            "%r; if %s publishes on that one, set topic to its "
                            "--kv-events-config topic (logged once)", frames[0][:64].decode(
                                errors="replace"), self.topic, self.flavour.title)
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            self.pipeline.drop(NAME, "malformed")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:  # the engine counts from 0 up; not its batch
            self.pipeline.drop(NAME, "malformed")
            return
        rank = 0
        if self.dp_size > 1:  # each rank's sequence and cache are its own
            rank = batch_rank(frames[2])
            if rank is None or not 0 <= rank < self.dp_size:
                self.pipeline.drop(NAME, "malformed")
                return
        last = self.last_seqs.get(rank)
        if last is not None and seq <= last:
            if seq < last:  # the engine restarted: its cache is empty again
                self._restarted(rank)
            else:
                return  # a duplicate
        elif last is not None and seq - last - 1 > MAX_GAP:
            # no loss but a confused publisher (or another one): followed from here
            if not self._jump_logged:
                self._jump_logged = True
                log.warning("kv_events: the sequence jumped %d batches ahead; following it from "
                            "there, not counted as a gap (logged once)", seq - last - 1)
        elif last is not None and seq > last + 1:
            recovered = self._replay(last + 1, seq, rank)
            lost = seq - last - 1 - recovered
            if lost:
                self.pipeline.drop(NAME, "gap", lost)
        self.last_seqs[rank] = seq
        self._apply(frames[2], rank)

    def _key(self, rank: int) -> int | None:
        """The rank the residency keys blocks by: None with one publisher."""
        return rank if self.dp_size > 1 else None

    def _restarted(self, rank: int) -> None:
        """The engine (its data-parallel rank ``rank``) restarted: every tier is empty of its
        blocks; say so at once for each tier reported so far (a tier without events in the
        next batch would otherwise keep its old gauges)."""
        seen = list(self.residency.resident)  # only tiers the engine has: others never reported
        self.residency.reset(self._key(rank))
        snapshots = self.residency.snapshots(time.time(), seen)
        if snapshots:
            self.pipeline.ingest(NAME, snapshots)

    def _apply(self, payload: bytes, rank: int) -> None:
        try:
            ts, events, unknown = decode(payload)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            self.pipeline.drop(NAME, "malformed")
            return
        if unknown:
            self.pipeline.drop(NAME, "unknown_kind", unknown)
        out = self.residency.apply(ts, events, self._key(rank))
        if out:
            for event in out:
                if type(event) is ev.Transfer:
                    sent = self._sent_transfers.setdefault((event.src, event.dst), [0, 0])
                    sent[0] += event.blocks
                    sent[1] += event.bytes
                elif type(event) is ev.Eviction:
                    self._sent_evictions[(event.tier, event.reason)] += event.blocks
            self.pipeline.ingest(NAME, out)

    def check_overlap(self) -> set[str]:
        """The tiers this source reports that another source reports as well: transfers in a
        direction this source maps (gpu->cpu, disk->cpu, cpu->disk) into a reported tier, or
        evictions from one, beyond what this source sent itself, so that the pipeline counts
        them twice. Logs one warning naming the config key the first time it finds any.
        Safe from any thread: the pipeline is read before this source's own counts, which
        grow before each ingest, so its own events in flight never look like another's."""
        snap = self.pipeline.snapshot()
        report = self.residency.tiers
        shared = set()
        for key in _MAPPED_TRANSFERS:
            if key[1] in report:
                blocks, nbytes = self._sent_transfers.get(key, (0, 0))
                if (snap.transfer_blocks.get(key, 0) > blocks
                        or snap.transfer_bytes.get(key, 0) > nbytes):
                    shared.add(key[1])
        for (tier, reason), blocks in snap.evicted_blocks.items():
            if tier in report and blocks > self._sent_evictions.get((tier, reason), 0):
                shared.add(tier)
        if shared and not self.shared_tiers:
            others = sorted(s for s in snap.events_received if s != NAME) or ["unknown"]
            keep = [t for t in ALL_TIERS if t in report and t not in shared]
            log.warning(
                "kv_events: transfers into or evictions from tier %s are reported by another "
                "source as well (sources: %s), so they are counted twice. Let only one source "
                "report a tier: set [kv_events] tiers = %s (environment: "
                "KVSCOPE_KV_EVENTS__TIERS=%s). With kvscope's vLLM tap (KvscopeOffloadingSpec), "
                "which reports the cpu and disk tiers itself, that is tiers = [\"gpu\"]; "
                "see docs/vllm.md.",
                ", ".join(sorted(shared)), ", ".join(others),
                "[" + ", ".join(f'"{t}"' for t in keep) + "]" if keep else "(none: "
                "enabled = false)", ",".join(keep) or "-")
        self.shared_tiers |= shared
        return shared

    def _replay(self, first: int, until: int, rank: int) -> int:
        """Fetch batches ``first..until-1`` of data-parallel rank ``rank`` from its replay
        endpoint and apply them in order; returns how many arrived (0 without a replay endpoint
        or when it does not answer)."""
        if (not self.replay_endpoint or until - first > MAX_REPLAY
                or time.monotonic() < self._replay_after):
            return 0
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: dict[int, bytes] = {}
        try:
            sock.connect(connect_address(rank_endpoint(self.replay_endpoint, rank)))
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
        if not got:
            self._replay_after = time.monotonic() + REPLAY_BACKOFF
        for seq in sorted(got):
            self._apply(got[seq], rank)
        self.replayed += len(got)
        return len(got)


KV_EVENTS_TIERS = LOCAL_TIERS  # the tiers vLLM's KV events name (media GPU, CPU, STORAGE)
MAX_DP_SIZE = 1024  # data-parallel ranks one source follows (a socket and a sequence each)


def _flavour(info: ValidationInfo) -> Flavour:
    """The flavour of the table being validated (vLLM's while ``engine`` is itself invalid)."""
    return FLAVOURS.get(info.data.get("engine", "vllm"), VLLM)


class KvEventsConfig(Section):
    """An engine's ``--kv-events-config`` stream (source ``kv_events``): ``engine``: ``vllm`` or
    ``sglang`` (its media, see the module); ``endpoint`` as given to the engine (with ``*``, and
    for SGLang ``0.0.0.0``: the engine binds, the agent connects; else the agent binds),
    ``replay_endpoint`` (the engine's, to fetch gaps; None: gaps are only counted), ``topic``;
    ``dp_size``: the engine's data-parallel ranks, each publishing on the endpoint's port plus
    its rank (tcp endpoints only); ``block_bytes``: KV bytes per block (0: unknown);
    ``capacity_blocks``: blocks per tier for the capacity gauges; ``tiers``: the kvscope tiers
    this source reports (residency, transfers into them, evictions from them; unset: vLLM's
    gpu, cpu and disk, SGLang's gpu and cpu). With kvscope's vLLM tap, which reports the cpu and
    disk tiers itself, set it to ``["gpu"]``: otherwise those tiers' transfers and evictions are
    counted twice. In the environment either JSON or a comma-separated list:
    ``KVSCOPE_KV_EVENTS__TIERS=gpu``.
    """

    enabled: bool = False
    engine: Literal["vllm", "sglang"] = "vllm"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int = Field(1, ge=1, le=MAX_DP_SIZE)
    block_bytes: int = Field(0, ge=0)
    capacity_blocks: dict[str, TierSize] = {}
    # ``| str`` only so that pydantic-settings passes a plain (non-JSON) environment value on to
    # the validator below instead of refusing it; the value is always a list (None: the
    # engine's default tiers).
    tiers: list[str] | str | None = Field(None, validate_default=True)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, value: str | None) -> str | None:
        return value if value is None else zmq_endpoint(value)

    @field_validator("dp_size")
    @classmethod
    def _ranks(cls, value: int, info: ValidationInfo) -> int:
        if value == 1:
            return value
        for key in ("endpoint", "replay_endpoint"):
            endpoint = info.data.get(key)
            if endpoint is None:
                continue
            if not endpoint.startswith("tcp://"):
                raise ValueError(f"with more than one rank the {key} must be tcp:// (each rank "
                                 "publishes on its port plus the rank)")
            if int(endpoint.rpartition(":")[2]) + value - 1 > 65535:
                raise ValueError(f"{value} ranks from the {key}'s port run past port 65535")
        return value

    @field_validator("capacity_blocks")
    @classmethod
    def _capacity(cls, value: dict[str, int], info: ValidationInfo) -> dict[str, int]:
        return tier_keys(value, _flavour(info).tiers)

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers(cls, value: object, info: ValidationInfo) -> list[str]:
        flavour = _flavour(info)
        if value is None:
            return list(flavour.default_tiers)
        if isinstance(value, str):
            try:
                value = (json.loads(value) if value.lstrip().startswith("[")
                         else [t.strip() for t in value.split(",") if t.strip()])
            except json.JSONDecodeError:
                raise ValueError("must be a list of tiers, e.g. [\"gpu\"] or gpu,cpu") from None
        if not isinstance(value, list | tuple) or not all(isinstance(t, str) for t in value):
            raise ValueError("must be a list of tiers, e.g. [\"gpu\"]")
        unknown = [t for t in value if t not in flavour.tiers]
        if unknown:
            raise ValueError(f"unknown tier {unknown[0]!r}: {flavour.title}'s tiers are "
                             f"{', '.join(flavour.tiers)}")
        if not value:
            raise ValueError("must name at least one tier (to turn the source off: "
                             "enabled = false)")
        return list(dict.fromkeys(value))


register(SourceSpec(
    NAME, KvEventsConfig,
    lambda config, consumer, built: KvEventsSource(
        consumer, config.endpoint, replay_endpoint=config.replay_endpoint, topic=config.topic,
        flavour=FLAVOURS[config.engine], dp_size=config.dp_size,
        residency=KvResidency(config.block_bytes, config.capacity_blocks, tiers=config.tiers,
                              flavour=FLAVOURS[config.engine])),
    describe=lambda config: f"kv_events endpoint {config.endpoint}",
    banner=lambda config, part, base_url: f"kv_events: {part.describe()}",
    tiers=lambda config: config.tiers,
    # vLLM's is named by its tap or its metrics source; nothing else may name SGLang
    engine=lambda config: "sglang" if config.engine == "sglang" else ""))
