"""TensorRT-LLM's KV cache events, as ``trtllm-serve``'s ``POST /kv_cache_events`` returns
them, folded into kvscope events. Pure: decoding and folding do no I/O (the drain that fetches
them is :mod:`kvscope.agent.sources.trtllm`).

The body (TensorRT-LLM ``tensorrt_llm/_utils.py`` ``KVCacheEventSerializer``, the 1.2 line and
main as of 2026) is a JSON array of ``{"event_id": int, "data": {...}, "window_size": int}``
(plus ``"attention_dp_rank": int`` with attention data parallelism); ``data`` is tagged by
``type``:

- ``created``: ``num_blocks_per_cache_level``, blocks per cache level (0 the GPU's primary
  pool, 1 the host's secondary pool of ``host_cache_size``);
- ``stored``: ``parent_hash`` and ``blocks``, each ``{"type": "stored_block", "block_hash",
  "tokens": [{"type": "unique_token", "token_id", "token_extra_id"}, ...], "cache_level",
  "priority"}`` (the tokens are skipped unread: the decoder builds no object for them);
- ``removed``: ``block_hashes``, blocks that left the reuse tree from whichever level held them
  (TensorRT-LLM batches consecutive removals into one event);
- ``updated``: ``block_hash`` with ``cache_level`` and ``priority`` diffs, each ``{"type":
  "event_diff", "new_value", "old_value"}`` or null (a priority-only update has a null level,
  a level-only one a null priority: TensorRT-LLM#4666 crashed the serializer on the latter
  before it was fixed). A level change is a copy between the GPU and the host
  (``kvCacheManager.cpp``: ``offloadBlock`` 0->1 when it repurposes a GPU block, with the
  block's hash kept, ``onboardBlock`` 1->0 when a request reuses a host block).

Mapping (:class:`TrtllmResidency`), each level to the tier ``levels`` names (default level 0
gpu, 1 cpu), blocks tracked by (attention DP rank, window size, hash):

- a level change to a tier further from the GPU is an offload: an untimed ``Transfer``, the
  block's ``Eviction`` from the tier it left (``offloaded``), and an ``Admission`` ``stored``
  into the tier below; toward the GPU a promotion (untimed ``Transfer``; the block moves, so
  the tier below loses it, which is no eviction);
- a removal is an ``Eviction`` (``offloaded`` False: a kept copy would have been a level
  change), and, from a tier with one below it, an ``Admission`` ``skipped`` there: the block
  left without a copy, because its priority is under ``secondary_offload_min_priority``, the
  host had no block to give, or its parent went first. This is the answer to "are low
  priority blocks bypassing host offload": ``skipped`` against ``stored`` of the cpu tier;
- age: a block's seconds in its tier, from the drain that brought its store or its move to the
  drain that brought its removal or move (events carry no time: the resolution is the drain
  interval). Hits are seen only below the GPU: a hit on a host block onboards it, so a block
  evicted from any tier but the first had none there (``hits`` 0, ``idle`` its age,
  ``measured``); a GPU block's reuse sends no event, so its evictions are ``measured`` False
  (age and hits stay out of the histograms rather than read as 0);
- after each drain, a ``TierSnapshot`` of every tier it changed: capacity from ``created``
  (all windows and ranks added up) and the tracked blocks resident (bytes from
  ``block_bytes``; 0 when unknown).

What cannot be known: blocks stored before the agent listened (their removals and moves are
ignored, as they are not resident in what the agent counts), and, past ``max_tracked`` blocks,
new ones (counted as dropped, ``untracked``). An ``event_id`` that skips ahead per rank lost
events (TensorRT-LLM drops the oldest past ``event_buffer_max_size``): counted as ``gap``, up to
:data:`~kvscope.agent.sources.base.MAX_GAP` ids (a larger jump is a confused engine: followed
from there and logged once); one that goes back means the engine restarted, and residency
starts over.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence

import msgspec

from kvscope import events as ev
from kvscope.agent.sources.base import MAX_GAP
from kvscope.vocabulary import TIERS

log = logging.getLogger(__name__)

BlockHash = int | str  # 64-bit integers as TensorRT-LLM's V1 hashes them; any other as given
# Measured evictions one drain sends one by one (their ages apart); past it the rest of that
# tier's go as one event of their mean age (a drain of a busy server's backlog stays bounded).
MAX_MEASURED = 4096


class Diff(msgspec.Struct):
    new_value: int | None = None
    old_value: int | None = None


class StoredBlock(msgspec.Struct):
    block_hash: BlockHash
    cache_level: int = 0
    priority: int | None = None


class Created(msgspec.Struct, tag_field="type", tag="created"):
    num_blocks_per_cache_level: list[int]


class Stored(msgspec.Struct, tag_field="type", tag="stored"):
    blocks: list[StoredBlock]
    parent_hash: BlockHash | None = None


class Removed(msgspec.Struct, tag_field="type", tag="removed"):
    block_hashes: list[BlockHash]


class Updated(msgspec.Struct, tag_field="type", tag="updated"):
    block_hash: BlockHash
    cache_level: Diff | None = None
    priority: Diff | None = None


class Envelope(msgspec.Struct):
    event_id: int
    data: msgspec.Raw
    window_size: int = 0
    attention_dp_rank: int | None = None


Data = Created | Stored | Removed | Updated
_body = msgspec.json.Decoder(list[msgspec.Raw])
_envelope = msgspec.json.Decoder(Envelope)
_data = msgspec.json.Decoder(Data)
_type = msgspec.json.Decoder(dict[str, msgspec.Raw])


class Decoded(msgspec.Struct):
    """One drain's events: ``events``, ``(rank, window, event_id, data)`` in order (``data``
    None for one counted in ``drops``, its id kept so that it reads as no gap); ``drops``:
    events that could not be read, by reason (``unknown_kind``: a ``type`` this module does
    not know; ``invalid``: a known one, or an envelope, of the wrong shape)."""

    events: list[tuple[int, int, int, Data | None]]
    drops: Counter


def decode(body: bytes) -> Decoded:
    """The events of one ``/kv_cache_events`` body. Raises msgspec.DecodeError (or
    ValidationError) when the body is no JSON array: then nothing in it can be read."""
    out, drops = [], Counter()
    for raw in _body.decode(body):
        try:
            envelope = _envelope.decode(raw)
        except msgspec.ValidationError:
            drops["invalid"] += 1
            continue
        try:
            data = _data.decode(envelope.data)
        except msgspec.ValidationError:
            drops[_why(envelope.data)] += 1
            data = None  # its id still counts: no gap where it was
        out.append((envelope.attention_dp_rank or 0, envelope.window_size, envelope.event_id,
                    data))
    return Decoded(out, drops)


def _why(data: msgspec.Raw) -> str:
    """Why ``data`` did not decode: a ``type`` unknown here, or a known one misshapen."""
    try:
        kind = _type.decode(data).get("type")
    except msgspec.ValidationError:
        return "invalid"
    known = {b'"created"', b'"stored"', b'"removed"', b'"updated"'}
    return "invalid" if kind is None or bytes(kind) in known else "unknown_kind"


def check_levels(levels: Sequence[str]) -> tuple[str, ...]:
    """``levels`` (the tier of each cache level) if they are distinct tiers, nearest the GPU
    first; else ValueError saying why."""
    unknown = [t for t in levels if t not in TIERS]
    if unknown:
        raise ValueError(f"unknown tier {unknown[0]!r}: the tiers are {', '.join(TIERS)}")
    order = [TIERS.index(t) for t in levels]
    if not order or order != sorted(set(order)):
        raise ValueError('must name distinct tiers, the GPU\'s level first, e.g. ["gpu", "cpu"]')
    return tuple(levels)


class TrtllmResidency:
    """Folds decoded TensorRT-LLM KV cache events into kvscope events (see the module).

    ``levels``: the tier of each cache level, first the GPU's (tiers of kvscope's vocabulary,
    nearest the GPU first). ``block_bytes``: KV bytes of one block (0: unknown).
    ``max_tracked``: blocks remembered in all (each about 170 bytes: tracemalloc over 200,000
    tracked 64-bit hashes). Not thread-safe."""

    def __init__(self, levels: Sequence[str] = ("gpu", "cpu"), block_bytes: int = 0,
                 max_tracked: int = 1_000_000) -> None:
        self.levels = check_levels(levels)
        self.block_bytes = block_bytes
        self.max_tracked = max_tracked
        self.capacity: dict[tuple[int, int], list[int]] = {}  # (rank, window) -> per level
        self.blocks: dict[tuple[int, int, BlockHash], tuple[int, float]] = {}  # -> level, since
        self.resident = [0] * len(self.levels)  # blocks tracked per level
        self.last_id: dict[int, int] = {}  # per rank
        self._jump_logged = False

    def apply(self, ts: float, decoded: Decoded) -> tuple[list, Counter]:
        """The kvscope events of one drain at ``ts`` (Unix seconds) and what it lost, by
        reason (added to ``decoded.drops``)."""
        drops = Counter(decoded.drops)
        fold = _Fold(self, ts)
        for rank, window, event_id, data in decoded.events:
            last = self.last_id.get(rank)
            if last is not None and event_id <= last:
                if event_id == last:
                    continue  # the same event again
                fold.changed.update(range(len(self.levels)))  # restarted: empty again
                self.reset()
            elif last is not None and event_id - last - 1 > MAX_GAP:
                if not self._jump_logged:  # no loss but a confused engine: followed from here
                    self._jump_logged = True
                    log.warning("TensorRT-LLM KV cache events: event_id jumped %d ahead; "
                                "following it from there, not counted as a gap (logged once)",
                                event_id - last - 1)
            elif last is not None and event_id > last + 1:
                drops["gap"] += event_id - last - 1
            self.last_id[rank] = event_id
            if data is not None:
                fold.apply(rank, window, data)
        drops["untracked"] += fold.untracked
        return fold.events(), +drops

    def reset(self) -> None:
        """Forget every block and capacity: the engine restarted."""
        self.capacity.clear()
        self.blocks.clear()
        self.resident = [0] * len(self.levels)
        self.last_id.clear()

    def snapshots(self, ts: float, levels: Iterable[int]) -> list[ev.TierSnapshot]:
        """A ``TierSnapshot`` of the tier of each of ``levels``."""
        bpb = self.block_bytes
        out = []
        for level in sorted(set(levels)):
            cap = sum(c[level] for c in self.capacity.values() if level < len(c))
            held = self.resident[level]
            out.append(ev.TierSnapshot(ts=ts, tier=self.levels[level], capacity_bytes=cap * bpb,
                                       resident_bytes=ev.bytes_of(held, bpb),
                                       capacity_blocks=cap,
                                       resident_blocks=held))
        return out


class _Fold:
    """One drain's changes, added up per direction and tier before they become events."""

    def __init__(self, state: TrtllmResidency, ts: float) -> None:
        self.state, self.ts = state, ts
        self.moved: Counter[tuple[int, int]] = Counter()  # (from level, to level) -> blocks
        self.gone: Counter[tuple[int, bool]] = Counter()  # (level, offloaded) -> blocks
        # (level, offloaded) -> ages of measured evictions, seconds
        self.ages: dict[tuple[int, bool], list[float]] = {}
        self.admitted: dict[int, list[int]] = {}  # level -> [stored, skipped] into it
        self.changed: set[int] = set()
        self.untracked = 0

    def apply(self, rank: int, window: int, data: Data) -> None:
        state = self.state
        if isinstance(data, Created):
            state.capacity[(rank, window)] = list(data.num_blocks_per_cache_level)
            self.changed.update(range(len(state.levels)))
        elif isinstance(data, Stored):
            for block in data.blocks:
                self._store((rank, window, block.block_hash), block.cache_level)
        elif isinstance(data, Removed):
            for block_hash in data.block_hashes:
                self._remove((rank, window, block_hash))
        elif data.cache_level is not None and data.cache_level.new_value is not None:
            self._move((rank, window, data.block_hash), data.cache_level.new_value)
        # a priority change alone moves nothing

    def _store(self, key: tuple, level: int) -> None:
        state = self.state
        if not 0 <= level < len(state.levels):
            return  # a level no tier is configured for
        held = state.blocks.get(key)
        if held is not None:
            if held[0] == level:
                return  # announced again
            state.resident[held[0]] -= 1
            self.changed.add(held[0])
        elif len(state.blocks) >= state.max_tracked:
            self.untracked += 1
            return
        state.blocks[key] = (level, self.ts)
        state.resident[level] += 1
        self.changed.add(level)

    def _remove(self, key: tuple) -> None:
        held = self.state.blocks.pop(key, None)
        if held is None:
            return  # stored before the agent listened, or not remembered
        level, since = held
        self.state.resident[level] -= 1
        self.changed.add(level)
        self._left(level, since, offloaded=False)

    def _move(self, key: tuple, level: int) -> None:
        state = self.state
        held = state.blocks.get(key)
        if held is None or held[0] == level or not 0 <= level < len(state.levels):
            return
        before, since = held
        state.blocks[key] = (level, self.ts)
        state.resident[before] -= 1
        state.resident[level] += 1
        self.changed.update((before, level))
        self.moved[(before, level)] += 1
        if level > before:  # away from the GPU: the block left its tier, with a copy below
            self._left(before, since, offloaded=True)

    def _left(self, level: int, since: float, offloaded: bool) -> None:
        """A block left ``level`` (resident there since ``since``): evicted, and offered to the
        tier below (stored when ``offloaded``, else skipped)."""
        if level + 1 < len(self.state.levels):
            self.admitted.setdefault(level + 1, [0, 0])[0 if offloaded else 1] += 1
        if level == 0:  # the GPU's hits send no event: age and hits unmeasured
            self.gone[(level, offloaded)] += 1
        else:
            self.ages.setdefault((level, offloaded), []).append(max(0.0, self.ts - since))

    def events(self) -> list:
        state, ts, bpb = self.state, self.ts, self.state.block_bytes
        tier = state.levels
        out: list = [ev.Transfer(ts=ts, src=tier[a], dst=tier[b], blocks=n, bytes=n * bpb,
                                 duration=0.0, timed=False, sees_failures=False)
                     for (a, b), n in sorted(self.moved.items())]
        out += [ev.Eviction(ts=ts, tier=tier[level], blocks=n, bytes=n * bpb, age=0.0, hits=0,
                            offloaded=offloaded, measured=False)
                for (level, offloaded), n in sorted(self.gone.items())]
        for (level, offloaded), ages in sorted(self.ages.items()):
            rest = ages[MAX_MEASURED:]
            groups = [(1, age) for age in ages[:MAX_MEASURED]]
            if rest:
                groups.append((len(rest), sum(rest) / len(rest)))
            out += [ev.Eviction(ts=ts, tier=tier[level], blocks=n, bytes=n * bpb, age=age,
                                hits=0, offloaded=offloaded, idle=age) for n, age in groups]
        out += [ev.Admission(ts=ts, tier=tier[level], stored=stored, skipped=skipped)
                for level, (stored, skipped) in sorted(self.admitted.items())]
        return out + state.snapshots(ts, self.changed)
