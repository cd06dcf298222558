"""KV events, vLLM's and SGLang's, folded into kvscope events: the wire format, each engine's
media (:class:`Flavour`) and the residency model (:class:`KvResidency`). Pure: decoding and
folding do no I/O (the source that subscribes is :mod:`kvscope.agent.sources.kv_events`).

A batch (vLLM 0.32 ``vllm/distributed/kv_events.py``) is the msgpack array ``[ts, events,
data_parallel_rank]`` and each event a map tagged ``type``: ``BlockStored``, ``BlockRemoved`` or
``AllBlocksCleared``; stores and removals carry ``medium`` ``GPU``/``CPU``/``STORAGE`` (None:
GPU). One batch holds one scheduler step's events: the GPU block pool's first, then the
offloading connector's (its primary CPU tier's, then each secondary tier's; vLLM 0.32
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

A hash whose last reference goes is an ``Eviction``. An offload tier's (cpu, disk, remote:
those reported) made for room carries its ``age``, the batch times of its store and its
removal, and its ``hits``, the times its copy came back while held, as KV events show them: a
GPU ``BlockStored`` of a hash the cpu tier holds (the prefix returned and its cpu copy was there
to load), a cpu ``BlockStored`` of a hash the disk tier holds (a disk->cpu promotion). So "stored
for nothing" (evicted with 0 hits) is seen in zero-code mode too. Misreadings: a prefix
recomputed although its cpu copy was held (a promotion that could not be made) counts as a
hit; with chunks of several blocks named by their last hash, the chunk's other GPU blocks
never match, so hits are undercounted there. The GPU tier's evictions, and those of
``AllBlocksCleared`` (a reset, no retention verdict), stay unmeasured (``measured=False``): KV
events show no GPU prefix-cache hit, and ``idle`` stays None everywhere (a hit's time is not
its block's last use). vLLM's own ``kv_block_idle_before_evict_seconds``, mapped by the vLLM
metrics source, measures the GPU tier's idle time; the tap the CPU tier's.
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

**SGLang** (0.5.23 ``srt/disaggregation/kv_events.py``, ``srt/mem_cache/events.py``) publishes
the same batches, its third item the ``attn_dp_rank``; its ``BlockStored`` carries more fields
(``token_ids``, ``lora_id``, ``cache_salt``, ``session_id``, ``lora_name``: not read). Its media
(:data:`SGLANG`, :data:`~kvscope.vocabulary.SGLANG_MEDIUM_TIER`) are ``GPU``, ``CPU_PINNED`` (the
HiCache host pool), ``DISK`` and ``EXTERNAL`` (-> remote; a new remote hash is a cpu->remote
offload, a cpu hash resident there a remote->cpu promotion, like disk). 0.5.23 publishes GPU and
CPU_PINNED only (every ``record_store``/``record_remove`` call of its radix trees names one of
those), so its default tiers are gpu and cpu. A CPU_PINNED store is a write-through backup of a
GPU block, or a block prefetched from the storage layer (L3) into the host pool: the events do
not tell them apart, and both count as gpu->cpu offloads (the SGLang metrics source counts the
prefetches). A flush (``AllBlocksCleared``) empties its device and host pools, as vLLM's reset
does. Blocks of several data-parallel ranks (each its own cache) are tracked as ``(rank,
hash)``: one hash in two ranks is two blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from kvscope import events as ev
from kvscope.vocabulary import LOCAL_TIERS, SGLANG_MEDIUM_TIER, TIERS, VLLM_MEDIUM_TIER

_OFFLOAD_FROM = {"cpu": "gpu", "disk": "cpu", "remote": "cpu"}
_BELOW_CPU = ("disk", "remote")  # the tiers a cpu block is offloaded to and promoted from


def vllm_binds(endpoint: str) -> bool:
    """Whether vLLM binds ``endpoint`` (0.32 ``ZmqEventPublisher._is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


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
        return tuple(t for t in TIERS if t in self.media.values())

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
    ts: ev.Timestamp  # a NaN or infinite one made every later residency sum NaN
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Rank(msgspec.Struct, array_like=True):
    ts: ev.Timestamp
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
        # per offload tier, per held hash: [the batch time it was stored, the times it came
        # back while held] (see _seen): an eviction's age and hits
        self.seen: dict[str, dict[bytes | int, list]] = {}
        # events of a medium the flavour does not name (another engine's), by medium: read and
        # cleared by the source, which counts them as dropped
        self.unknown_media: dict[str, int] = {}

    def apply(self, ts: float, events: list, rank: int | None = None) -> list:
        """kvscope events of one batch (``ts``: its time; ``events``: its decoded events).
        ``rank``: the data-parallel rank that sent it, when the source follows several (each
        rank's cache is its own: its hashes are tracked as ``(rank, hash)``), else None."""
        moved: Counter[tuple[str, str]] = Counter()             # (src, dst) -> blocks
        evicted: Counter[tuple[str, str, bool]] = Counter()     # (tier, reason, offloaded)
        # (tier, offloaded, hits) -> [blocks, their ages summed] of evictions whose age and
        # hits are known (an offload tier's, made for room)
        aged: dict[tuple[str, bool, int], list] = {}
        # (tier, hash) -> (age, hits) of the blocks in ``left`` whose age and hits are known
        known: dict[tuple[str, bytes | int], tuple[float, int]] = {}
        seen = self.seen
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
                            seen.get(tier, {}).pop(h, None)
                        changed.add(tier)
                continue
            medium = (event.medium or "GPU").upper()
            tier = self.media.get(medium)
            if tier is None:
                self.unknown_media[medium] = self.unknown_media.get(medium, 0) + 1
                continue
            if tier not in self.tracked:
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
                                _hit(seen, source, h)  # promoted: its disk copy was reused
                                break
                        else:
                            if tier != "gpu":
                                moved[(_OFFLOAD_FROM[tier], tier)] += 1
                        if tier == "gpu":  # the prefix came back while its cpu copy was held
                            _hit(seen, "cpu", h)
                        if len(held) >= self._max:
                            continue
                        if tier in self.tiers and tier != "gpu":
                            seen.setdefault(tier, {})[h] = [ts, 0]
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
                    born = seen.get(tier, {}).pop(h, None)
                    if born is not None:
                        known[(tier, h)] = (max(ts - born[0], 0.0), born[1])
                    if tier in _BELOW_CPU:  # the lowest tiers: nothing is kept below
                        _evict(evicted, aged, known.pop((tier, h), None), tier, "capacity",
                               False)
                    else:
                        left.append((tier, h, "capacity"))
        if left:
            cpu = resident.get("cpu", {})
            lower = [resident[t] for t in _BELOW_CPU if resident.get(t)]
            for tier, h, reason in left:
                kept = any(h in copies for copies in lower) or (tier == "gpu" and h in cpu)
                _evict(evicted, aged, known.get((tier, h)) if reason == "capacity" else None,
                       tier, reason, kept)
        out: list = []
        report = self.tiers
        bpb = self.block_bytes
        for (src, dst), blocks in sorted(moved.items()):
            if dst in report:
                out.append(ev.Transfer(ts=ts, src=src, dst=dst, blocks=blocks, bytes=blocks * bpb,
                                       duration=0.0, timed=False, sees_failures=False))
        for (tier, reason, offloaded), blocks in sorted(evicted.items()):
            if tier in report:
                out.append(ev.Eviction(ts=ts, tier=tier, blocks=blocks, bytes=blocks * bpb,
                                       age=0.0, hits=0, offloaded=offloaded, reason=reason,
                                       measured=False))
        for (tier, offloaded, hits), (blocks, ages) in sorted(aged.items()):
            if tier in report:
                out.append(ev.Eviction(ts=ts, tier=tier, blocks=blocks, bytes=blocks * bpb,
                                       age=ages / blocks, hits=hits, offloaded=offloaded))
        return out + self.snapshots(ts, changed)

    def snapshots(self, ts: float, tiers: Iterable[str] | None = None) -> list[ev.TierSnapshot]:
        """A ``TierSnapshot`` of each reported tier (of those in ``tiers``, when given)."""
        bpb = self.block_bytes
        out = []
        for tier in sorted(self.tiers if tiers is None else self.tiers & set(tiers)):
            blocks = len(self.resident.get(tier, ()))
            cap = self.capacity.get(tier, 0)
            out.append(ev.TierSnapshot(ts=ts, tier=tier, capacity_bytes=cap * bpb,
                                       resident_bytes=ev.bytes_of(blocks, bpb),
                                       capacity_blocks=cap, resident_blocks=blocks))
        return out

    def reset(self, rank: int | None = None) -> None:
        """Forget every block (of data-parallel rank ``rank`` only, when given)."""
        if rank is None:
            self.resident.clear()
            self.seen.clear()
            return
        for held in (*self.resident.values(), *self.seen.values()):
            for h in [k for k in held if k[0] == rank]:
                del held[h]


def _hit(seen: dict, tier: str, h) -> None:
    """Count a reuse of ``h``'s copy in ``tier``, when that copy is tracked."""
    born = seen.get(tier, {}).get(h)
    if born is not None:
        born[1] += 1


def _evict(evicted: Counter, aged: dict, known: tuple[float, int] | None, tier: str,
           reason: str, offloaded: bool) -> None:
    """Count one evicted block: with its ``known`` (age, hits) among the measured ones
    (grouped by hits, their ages summed), else among those whose age and hits are unknown."""
    if known is None:
        evicted[(tier, reason, offloaded)] += 1
        return
    group = aged.setdefault((tier, offloaded, known[1]), [0, 0.0])
    group[0] += 1
    group[1] += known[0]

