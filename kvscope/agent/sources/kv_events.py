"""The KV events source: subscribes to vLLM's (or SGLang's) ``--kv-events-config`` ZMQ stream and
folds it with :mod:`~kvscope.agent.sources.kv_residency` (the batches, the engines' media and the
residency model are described there).

vLLM (0.32 ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) publishes multipart
messages ``(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)``. vLLM binds endpoints
with ``*`` or ``::`` and ``ipc://``/``inproc://`` ones, and connects to the rest; this source
does the opposite (connects to ``*`` as 127.0.0.1), and ``kvscope agent`` says at start-up which
it does (:func:`describe_endpoint`): with the same endpoint string on both sides they pair, with
a mix both connect (or bind) and nothing arrives.

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
sequence numbers count as ``malformed``, unknown event kinds and events of a medium the
engine's dialect does not name (SGLang's read as vLLM's) as ``unknown_kind``. A seq going
backwards means vLLM restarted: residency starts over, and every reported tier's gauges say so
at once. The stream is one publisher's: a second one on the same endpoint (its own sequence)
reads as duplicates and restarts.

**SGLang** (``engine = "sglang"``; 0.5.23 ``srt/disaggregation/kv_events.py``) publishes the
same framing, replay included, and binds ``0.0.0.0`` too. With data parallelism each DP rank
publishes on its own port, the endpoint's plus the rank (``ZmqEventPublisher.
offset_endpoint_port``; its replay endpoint likewise), with its own sequence and its own KV
cache (vLLM's publisher likewise, ``distributed/kv_events.py``): with ``dp_size`` N the
source subscribes to all N ports, and keeps a sequence, gaps, replays and restarts per rank
(the batch's rank); the endpoint's and the replay endpoint's port ranges must not overlap.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

import msgspec
import zmq
from pydantic import Field, ValidationInfo, field_validator
from zmq.utils.monitor import recv_monitor_message

from kvscope import events as ev
from kvscope.agent.sections import EngineSection, TierSize, tier_keys, zmq_endpoint
from kvscope.agent.sources.base import (MAX_GAP, Consumer, SourceSpec, SourceWorker,
                                        register)
from kvscope.agent.sources.kv_residency import (FLAVOURS, SGLANG, VLLM, AllBlocksCleared,
                                                BlockRemoved, BlockStored, Flavour, KvResidency,
                                                batch_rank, decode, vllm_binds)
from kvscope.errors import describe
from kvscope.vocabulary import LOCAL_TIERS
from kvscope.vocabulary import TIERS as ALL_TIERS

# the source's, and the model's it folds with (their users import them from here)
__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "FLAVOURS", "Flavour",
           "KvEventsConfig", "KvEventsSource", "KvResidency", "SGLANG", "VLLM", "batch_rank",
           "connect_address", "decode", "describe_endpoint", "rank_endpoint", "vllm_binds"]

log = logging.getLogger(__name__)
NAME = "kv_events"
# what this source sends
_MAPPED_TRANSFERS = (("gpu", "cpu"), ("disk", "cpu"), ("cpu", "disk"), ("remote", "cpu"),
                     ("cpu", "remote"))
END_SEQ = -1
# A gap beyond MAX_REPLAY batches is more than vLLM's replay buffer holds, so it is not asked
# for; after a replay that brought nothing, none is tried for REPLAY_BACKOFF seconds (each would
# hold the source for replay_timeout while batches queue up).
MAX_REPLAY = 10_000
# seconds without a publisher before the source says so, once (a SUB socket hears nothing,
# silently, from an endpoint nobody publishes on or from a side that both bind or connect);
# an engine loading a large model publishes nothing for minutes, so it is a hint
NO_PUBLISHER_AFTER = 120.0
REPLAY_BACKOFF = 30.0
# Bytes a message may have where the agent binds (see KvEventsSource.prepare): vLLM's own are
# kilobytes a step, about 4 bytes per prompt token, so 16 MiB holds a step of 4M tokens.
MAX_BOUND_MESSAGE = 16 << 20


_PEER_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


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
        self._drops_logged: set[str] = set()  # reasons of drops logged (once each)
        self.last_seqs: dict[int, int] = {}  # by data-parallel rank (0 with one publisher)
        self.shared_tiers: set[str] = set()  # reported tiers another source reports too
        # what this source ingested, to tell its share of the pipeline's totals: blocks and
        # bytes per transfer direction, blocks per (evicted tier, reason)
        self._sent_transfers: dict[tuple[str, str], list[int]] = {}
        self._sent_evictions: Counter[tuple[str, str]] = Counter()
        self._socket = None
        self._monitor = None
        self._peers = 0  # publishers connected
        # ranks whose publisher was lost since their last batch: a PUB socket sends no batch
        # twice, so a next one numbered at or below the last is a restarted engine's
        self._lost: set[int] = set()
        self._heard = False  # a publisher connected since the start

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
        # Up while a publisher is connected: a SUB socket receives nothing, silently, from
        # an endpoint nobody publishes on, so the connection events are the only sign. The
        # monitor first: a publisher already bound is connected at once, in ZMQ's own thread
        # (a monitor begun after connect() missed that, and the source read down for good)
        monitor = sock.get_monitor_socket(_PEER_EVENTS)
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
            sock.disable_monitor()
            monitor.close()
            sock.close()
            raise
        self._socket, self._monitor = sock, monitor
        self.report_up(False)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_check = time.monotonic() + self.overlap_check
        quiet_until = time.monotonic() + NO_PUBLISHER_AFTER
        try:
            while not self.stopping.is_set():
                if quiet_until and time.monotonic() >= quiet_until:
                    quiet_until = 0.0
                    if not self._heard:
                        log.warning("kvscope kv_events: no %s publisher yet after %g s; this "
                                    "agent %s",
                                    self.flavour.title, NO_PUBLISHER_AFTER,
                                    describe_endpoint(self.endpoint, self.flavour))
                if (self.overlap_check > 0 and not self.shared_tiers
                        and time.monotonic() >= next_check):
                    next_check = time.monotonic() + self.overlap_check
                    self.check_overlap()
                ready = dict(poller.poll(100))
                # what a publisher sent before it went first (ZMQ queues it before it reports
                # the disconnect): its tiers leave after its last batch, not before it
                while self._socket in ready and not self.stopping.is_set():
                    try:
                        frames = self._socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.guarded(self.handle, frames)
                if self._monitor in ready:
                    self._peer_event(recv_monitor_message(self._monitor)["event"])
        finally:
            self._socket.disable_monitor()
            self._monitor.close()
            self._socket.close()

    def _peer_event(self, event: int) -> None:
        was_up = self._peers > 0
        self._peers = max(0, self._peers + (-1 if event == zmq.EVENT_DISCONNECTED else 1))
        self._heard = self._heard or self._peers > 0
        if (self._peers > 0) != was_up:
            # where the agent connects (loopback for a wildcard the engine binds), or binds
            where = (connect_address(self.endpoint) if self.flavour.binds(self.endpoint)
                     else self.endpoint)
            log.info("kvscope kv_events: %s %s's publisher at %s",
                     "lost" if was_up else "connected to", self.flavour.title, where)
            self.report_up(not was_up)
            if was_up:  # an engine gone holds no tier: its residency gauges leave until it
                # publishes again (they stayed at their last values for good)
                self.pipeline.forget_tiers(NAME)
                self._lost = set(self.last_seqs)

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
            self._drop("malformed", f"{len(frames)} frames, not topic, 8-byte sequence, payload")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:  # the engine counts from 0 up; not its batch
            self._drop("malformed", f"sequence number {seq}")
            return
        rank = 0
        if self.dp_size > 1:  # each rank's sequence and cache are its own
            rank = batch_rank(frames[2])
            if rank is None or not 0 <= rank < self.dp_size:
                self._drop("malformed", f"data-parallel rank {rank} of dp_size {self.dp_size}")
                return
        last = self.last_seqs.get(rank)
        resumed = rank in self._lost  # its tiers left the gauges when its publisher went
        if last is not None and seq <= last:
            if seq < last or rank in self._lost:  # the engine restarted: its cache is empty
                self._restarted(rank)
                resumed = False  # _restarted reported every tier again
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
                self._drop("gap", f"{lost} batches missing after {last}", lost)
        self.last_seqs[rank] = seq
        self._lost.discard(rank)
        self._apply(frames[2], rank, resumed)

    def _drop(self, reason: str, detail: str, batches: int = 1) -> None:
        """Count ``batches`` (events, for unknown_kind) dropped for ``reason``; the first of
        each reason is logged with ``detail``."""
        self.pipeline.drop(NAME, reason, batches)
        if reason not in self._drops_logged:
            self._drops_logged.add(reason)
            log.warning("kv_events: dropped %d (%s): %s; logged once per reason", batches,
                        reason, detail)

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

    def _apply(self, payload: bytes, rank: int, every_tier: bool = False) -> None:
        """Fold one batch in and send what it changed; with ``every_tier``, a snapshot of
        each tier seen so far as well (the first batch after a lost publisher came back: its
        tiers were forgotten, and one without events in this batch would stay absent)."""
        try:
            ts, events, unknown = decode(payload)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
            self._drop("malformed", f"payload does not decode ({describe(exc)})")
            return
        if unknown:
            self._drop("unknown_kind", "events of a kind kvscope does not know (a newer "
                       f"{self.flavour.title}?)", unknown)
        out = self.residency.apply(ts, events, self._key(rank))
        media = self.residency.unknown_media
        if media:
            others = [f.engine for f in FLAVOURS.values() if f is not self.flavour
                      and any(m in f.media for m in media)]
            hint = (f'; is [kv_events] engine = "{others[0]}" meant?' if others else "")
            self._drop("unknown_kind", f"events of medium {', '.join(sorted(media))}, which "
                       f"{self.flavour.title}'s KV events do not name{hint}",
                       sum(media.values()))
            media.clear()
        if every_tier:  # its snapshots of the changed tiers, and of the unchanged ones
            out = [e for e in out if type(e) is not ev.TierSnapshot]
            out += self.residency.snapshots(ts, list(self.residency.resident))
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
            others = snap.senders_besides(NAME)
            keep = [t for t in ALL_TIERS if t in report and t not in shared]
            log.warning(
                "kv_events: transfers into or evictions from tier %s are reported by another "
                "source as well (one of: %s), so they are counted twice. Let only one source "
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


class KvEventsConfig(EngineSection):
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
    dp_size: int = Field(1, ge=1, le=MAX_DP_SIZE, validate_default=True)  # checks the ports
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
        replay = info.data.get("replay_endpoint")
        endpoint = info.data.get("endpoint")
        for key, address in (("endpoint", endpoint), ("replay_endpoint", replay)):
            if address is None or value == 1:  # one rank: any endpoint, one port
                continue
            if not address.startswith("tcp://"):
                raise ValueError(f"with more than one rank the {key} must be tcp:// (each rank "
                                 "publishes on its port plus the rank)")
            if int(address.rpartition(":")[2]) + value - 1 > 65535:
                raise ValueError(f"{value} ranks from the {key}'s port run past port 65535")
        clash = replay is not None and replay == endpoint  # one ipc:// path, or one address
        if replay and endpoint and (replay + endpoint).count("tcp://") == 2:
            # rank r takes port + r of each; a port binds once per host (a wildcard: every host)
            (host, _, first), (other_host, _, other) = (
                e.removeprefix("tcp://").rpartition(":") for e in (endpoint, replay))
            first, other = int(first), int(other)
            clash = abs(first - other) < value and (
                host == other_host or not {host, other_host}.isdisjoint(("*", "0.0.0.0")))
        if clash and value == 1:
            raise ValueError(f"the endpoint ({endpoint}) and the replay_endpoint ({replay}) "
                             "are the same socket: the engine publishes on one and answers "
                             "replays on the other, so give them different ports (as in "
                             "the engine's --kv-events-config)")
        if clash:
            raise ValueError(
                f"with {value} ranks the endpoint's ports {first}-{first + value - 1} and the "
                f"replay_endpoint's {other}-{other + value - 1} overlap (each rank publishes on "
                f"the port plus its rank): give the replay endpoint a port {value} or more "
                f"away, e.g. {max(first, other) + value}, in the engine's --kv-events-config too")
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
            value = list(flavour.default_tiers)
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
        # a capacity is reported for a reported tier only: another one's would vanish
        unreported = [t for t in info.data.get("capacity_blocks", {}) if t not in value]
        if unreported:
            raise ValueError(f"capacity_blocks gives tier {unreported[0]!r}, which this source "
                             f"does not report (tiers: {', '.join(value)}): add it to tiers or "
                             "leave its capacity out")
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
    engine=lambda config: config.engine))
