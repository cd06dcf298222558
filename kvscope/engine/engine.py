"""The reference offload engine: ``gpu`` over ``cpu`` over ``disk``, LRU or ARC in each.

For each request the engine walks the prompt's blocks first to last (one *block access* each):

- resident in ``gpu``: a hit; the ``gpu`` policy records it;
- otherwise a ``gpu`` slot is made: the ``gpu`` victim is offloaded ``gpu->cpu`` (if admitted
  and the ``cpu`` tier does not hold it already; else dropped); a ``cpu`` victim made to room
  for it spills ``cpu->disk`` the same way; a ``disk`` victim is dropped. Then the block is
  promoted ``cpu->gpu`` if the ``cpu`` tier holds it, staged ``disk->cpu->gpu`` (two timed
  hops) if the ``disk`` tier does, and otherwise recomputed by prefill.

The prompt's cached prefix (the leading blocks resident in some tier when the request comes)
is pinned in the ``cpu`` and ``disk`` tiers until its turn, while off the ``gpu`` tier: making
room passes over a pinned block to the next victim in the policy's order, as vLLM's offloading
managers never evict a block a request is loading. An offload or spill into a tier that holds
only pinned blocks is skipped (the victim dropped, counted in the tier's Admission
``skipped``); a block staged now takes a pinned block's ``cpu`` slot all the same (spilled to
disk where the disk tier can take it, it is staged in its turn; else recomputed), since
without it the rest of the prefix is recomputed.

Prefix semantics: only the leading contiguous run of cached blocks serves tokens. After the
first recomputed block, later blocks are recomputed too (resident ones just count as hits).
Lower tiers are inclusive: a promoted block keeps its ``cpu``/``disk`` copies.

Admission (who may be offloaded or spilled): a block must have been accessed at least
``store_threshold`` times (as vLLM's offloading ``store_threshold``) and have a priority of at
least ``min_priority`` (as TensorRT-LLM's ``secondary_offload_min_priority``; priorities run
0-100, default :data:`DEFAULT_PRIORITY` = 35 as TensorRT-LLM's ``KvCacheRetentionConfig``).
Both are remembered for the latest :data:`REMEMBERED_PER_BLOCK` blocks per block the tiers hold
(at least :data:`MIN_REMEMBERED`), so a long run's memory stays bounded.

With ``payload=False`` the engine is the simulator: the same code makes the same decisions with
no bytes, and transfer times come from the preset's cost model. TTFT = queueing + lookup (the
engine's own planning time, and with payload every copy before the prefill that is no
promotion: offloads and spills, which run then too; 0 when simulating, whose offloads are left
off the request's path) + promotion wait (``disk->cpu`` and ``cpu->gpu`` copies) + prefill of
the recomputed tokens (:mod:`kvscope.engine.presets`). Without CUDA a host copy's seconds are
the copying thread's CPU time (:mod:`kvscope.engine.transfers`) while its start is a wall-clock
stamp, so what the process's other threads held the GIL for between copies lands in lookup,
and after the last copy in none of the parts.
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path

import msgspec

from kvscope import events as ev
from kvscope.engine.outcome import RequestOutcome, prefill_value
from kvscope.engine.policy import make_policy
from kvscope.engine.presets import ModelPreset
from kvscope.engine.stats import EngineStats
from kvscope.engine.tier import Resident, Tier
from kvscope.engine.transfers import OFFLOAD, PROMOTE, SPILL, STAGE, CopyBatcher, Failure
from kvscope.vocabulary import LOCAL_TIERS, TOKEN_SOURCES

DEFAULT_PRIORITY = 35
_DIRECTION = {SPILL: "cpu->disk", OFFLOAD: "gpu->cpu", STAGE: "disk->cpu", PROMOTE: "cpu->gpu"}
# a store into a lower tier (offload, spill) -> its index in _report_admissions: cpu, disk
_STORES = {("gpu", "cpu"): 0, ("cpu", "disk"): 1}
MEMORY_REFRESH = 10.0  # seconds between the host KV budget's reports (an agent may restart)
# blocks whose access count and priority the admission checks keep, per block the tiers hold
# (at least MIN_REMEMBERED): beyond it those seen least recently are forgotten, so a long run's
# memory stays bounded (a block forgotten counts from 0 again, priority the default)
REMEMBERED_PER_BLOCK = 4
MIN_REMEMBERED = 1 << 16
_GPU, _CPU, _DISK, _RECOMPUTE = 0, 1, 2, 3
_SOURCE_NAMES = TOKEN_SOURCES  # by the indices above


def _block_sources(sources: list[int]) -> list[str]:
    """Each block's source name under prefix semantics: after the first recomputed block, every
    later one is recomputed too (as :meth:`OffloadEngine._account` counts tokens)."""
    names, cut = [], False
    for source in sources:
        cut = cut or source == _RECOMPUTE
        names.append("recompute" if cut else _SOURCE_NAMES[source])
    return names


class EngineConfigError(ValueError):
    """The engine cannot be built as asked (tier sizes, admission, host memory, disk space);
    the message says why."""


def _check_host_memory(needed: int) -> None:
    """Refuse pools that would not fit in the host memory available now (psutil), rather than
    fail deep inside an allocation or push the host into swap."""
    import psutil

    available = psutil.virtual_memory().available
    if needed > 0.9 * available:
        raise EngineConfigError(
            f"the tiers need {needed / 2**30:,.1f} GiB of host memory but only "
            f"{available / 2**30:,.1f} GiB is available; use fewer blocks or a smaller preset "
            "(to size tiers beyond this host, `kvscope replay --simulate` holds no KV bytes)")


def _check_disk_space(store, chunks: int) -> None:
    """Refuse a disk tier of ``chunks`` blocks larger than the free space where ``store`` (a
    ``DiskStore``) puts its chunk files (:meth:`~kvscope.engine.disk.DiskStore.bytes_for`),
    rather than fail with disk_full once it fills; the store is closed (its private directory
    removed)."""
    needed = store.bytes_for(chunks)
    free = shutil.disk_usage(store.directory).free
    if needed > free:
        store.close()
        raise EngineConfigError(
            f"the disk tier needs {needed / 2**30:,.1f} GiB but only {free / 2**30:,.1f} GiB is "
            f"free at {store.directory}; use fewer disk blocks or a disk directory with room")


class OffloadEngine:
    """A three-tier offload engine over real KV blocks (or, with ``payload=False``, none).

    ``gpu_blocks``, ``cpu_blocks``, ``disk_blocks``: tier capacities in blocks (0 disables a
    lower tier; ``disk`` needs ``cpu``). ``policy``: ``lru`` or ``arc`` for every tier, or a
    dict[tier, policy]. ``block_tokens``: tokens per block (default: the preset's). ``emit``:
    called with each :mod:`kvscope.events` event (None: no events, fastest). ``device``: where
    the ``gpu`` tier lives (default CUDA when available, else CPU memory standing in for it).
    ``disk_dir``: where chunk files go (default: a private temporary directory). ``clock``:
    Unix-seconds clock for event stamps. ``record_blocks``: put each block's hash and source
    into the :class:`~kvscope.events.Lookup` events (``block_hashes``, ``block_sources``) for
    the agent's capture; off by default (two lists per request). Call :meth:`close` to stop
    disk I/O threads.

    Each ``RequestFinished`` carries ``itl``, the mean inter-token latency from the preset's
    decode cost model (:meth:`~kvscope.engine.presets.ModelPreset.decode_seconds` of one token;
    0 for requests with fewer than two output tokens).

    Raises :class:`EngineConfigError` (a ValueError) for a bad size, a disk tier without a cpu
    tier, an unknown policy or tier in ``policy``, or tiers larger than the host memory
    available or the disk space free (with ``payload``), before it holds any resource.
    """

    def __init__(self, preset: ModelPreset, gpu_blocks: int, cpu_blocks: int,
                 disk_blocks: int = 0, *, block_tokens: int | None = None,
                 emit: Callable[[object], None] | None = None, device: str | None = None,
                 payload: bool = True, policy: str | dict[str, str] = "lru",
                 disk_dir: str | Path | None = None, store_threshold: int = 1,
                 min_priority: int = 0, io_threads: int = 4,
                 clock: Callable[[], float] = time.time, record_blocks: bool = False) -> None:
        if gpu_blocks < 1:
            raise EngineConfigError(f"gpu tier needs at least 1 block, got {gpu_blocks}")
        if disk_blocks > 0 and cpu_blocks < 1:
            raise EngineConfigError("a disk tier needs a cpu tier to stage through (cpu_blocks >= 1)")
        if cpu_blocks < 0 or disk_blocks < 0:
            raise EngineConfigError(f"tier sizes must be >= 0 blocks, got cpu {cpu_blocks}, "
                                    f"disk {disk_blocks}")
        if store_threshold < 1:
            raise EngineConfigError(f"store_threshold must be >= 1, got {store_threshold}")
        policies = policy if isinstance(policy, dict) else dict.fromkeys(LOCAL_TIERS, policy)
        # checked before a disk tier's store takes its directory and threads
        if unknown := set(policies) - set(LOCAL_TIERS):
            raise EngineConfigError(f"policy for unknown tier {sorted(unknown, key=str)[0]!r}; "
                                    f"tiers: {', '.join(LOCAL_TIERS)}")
        for name in policies.values():
            try:
                make_policy(name, 0)
            except ValueError as exc:
                raise EngineConfigError(str(exc)) from None
        self.preset = preset
        self.block_tokens = block_tokens or preset.block_tokens
        self.block_bytes = preset.bytes_per_block(self.block_tokens)
        self.payload = payload
        self.store_threshold = store_threshold
        self.min_priority = min_priority
        self.record_blocks = record_blocks
        self._emit = emit
        self._clock = clock
        self.stats = EngineStats()
        self._seen: dict[int, int] = {}
        self._priority: dict[int, int] = {}
        self._remembered = max(MIN_REMEMBERED,
                               REMEMBERED_PER_BLOCK * (gpu_blocks + cpu_blocks + disk_blocks))
        self._copier = None
        pools = {"gpu": None, "cpu": None, "disk": None}
        if payload:
            try:
                import torch
            except ImportError:  # the engine extra: the agent and the taps do without it
                raise EngineConfigError(
                    "the reference engine's tiers hold real tensors and need torch, which is not "
                    "installed: pip install 'kvscope[engine]' (the README's commands do; kvscope "
                    "replay --simulate runs without)") from None

            from kvscope.engine.disk import DiskStore
            from kvscope.engine.tier import BlockPool
            from kvscope.engine.transfers import Copier

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            _check_host_memory((cpu_blocks + (gpu_blocks if device == "cpu" else 0))
                               * self.block_bytes)
            elems = self.block_bytes // preset.dtype_bytes
            pools["gpu"] = BlockPool(gpu_blocks, elems, preset.dtype, device)
            pools["cpu"] = BlockPool(cpu_blocks, elems, preset.dtype, "cpu")
            if disk_blocks:
                pools["disk"] = DiskStore(disk_dir, self.block_bytes, io_threads)
            try:
                if disk_blocks:
                    _check_disk_space(pools["disk"], disk_blocks)
                self._copier = Copier(pools["gpu"].is_cuda)
            except BaseException:  # the store's chunks directory and its lock go with it
                if pools["disk"] is not None:
                    pools["disk"].close()
                raise
        self.gpu = Tier("gpu", gpu_blocks, self.block_bytes, policies.get("gpu", "lru"), pools["gpu"])
        self.cpu = Tier("cpu", cpu_blocks, self.block_bytes, policies.get("cpu", "lru"), pools["cpu"])
        self.disk = Tier("disk", disk_blocks, self.block_bytes, policies.get("disk", "lru"),
                         pools["disk"])
        self.tiers = (self.gpu, self.cpu, self.disk) if disk_blocks else (self.gpu, self.cpu)
        self._moved = [0, 0, 0, 0]  # blocks per phase SPILL, OFFLOAD, STAGE, PROMOTE
        self._batch: CopyBatcher | None = None
        self._evictions: list[ev.Eviction] = []
        self._failed: set[int] = set()  # blocks whose disk read failed (this request)
        # this request's cached prefix not on the gpu tier, whose turn has not come: never
        # evicted from the cpu or disk tier, unless a block staged now needs its cpu slot
        self._pinned: set[int] = set()
        self._spilled: dict[int, int] = {}  # spilled -> its Eviction's index (this request)
        # blocks the admission policy declined, cpu and disk, not yet reported (an Admission
        # event per tier at the next finished request, with that request's stored and failed)
        self._skipped = [0, 0]
        self._tiers_reported = False
        self._memory_due = float("-inf")  # when the cpu tier's budget is reported next
        self._inflight: deque[tuple[ev.RequestStarted, list, RequestOutcome]] = deque()
        # the copies in flight by direction as last reported: (copies, blocks)
        self._in_flight_reported: dict[str, tuple[int, int]] = {}

    @property
    def cache_config(self) -> tuple[bool, str]:
        """(GPU prefix caching on, KV cache dtype), as the agent's ``set_cache_config`` takes
        them: prefix caching is always on (a prompt's leading blocks resident on the gpu tier
        serve its tokens); the dtype is the preset's (``float16``, ``bfloat16``)."""
        return True, self.preset.dtype

    # -- the request path -------------------------------------------------------------------

    def process(self, request, queueing: float = 0.0) -> RequestOutcome:
        """Serve one request's prompt; emit its events; return what happened.

        ``request``: a :class:`~kvscope.engine.workload.Request`. ``queueing``: seconds it
        waited before the engine took it (part of TTFT).
        """
        now = self._clock()
        emit = self._emit
        # On one time axis with the measured copies: the request arrived ``queueing`` seconds
        # before the engine took it (now), and its first token comes at arrival + TTFT.
        started = ev.RequestStarted(ts=now - queueing, request_id=request.request_id,
                                    prompt_tokens=request.prompt_tokens)
        if emit is not None:
            if not self._tiers_reported:  # before the first lookup, which counts misses in
                self._tiers_reported = True  # the tiers its engine reported
                self._report_tiers(now)
            emit(started)
        t0 = time.perf_counter()
        batch = None
        if self._copier is not None or emit is not None:
            batch = CopyBatcher(self._copier, self._on_failure, self._clock)
        self._batch = batch
        self._failed, self._spilled = set(), {}
        gpu, cpu, disk = self.gpu, self.cpu, self.disk
        gpu_get, cpu_get, disk_get = gpu.get, cpu.get, disk.get
        # The prompt's cached prefix stays in the cpu and disk tiers until its turn, as vLLM's
        # managers never evict a block a request is loading: making room for one of its
        # blocks had pushed a later one, found cached at lookup, out to disk or away. Pinned:
        # those of them off the gpu tier (``ahead``: all of them whose turn has not come).
        ahead, pinned = set(), set()
        if cpu.capacity_blocks:
            for h in request.block_hashes:
                if gpu_get(h) is None:
                    if cpu_get(h) is None and disk_get(h) is None:
                        break
                    pinned.add(h)
                ahead.add(h)
        self._pinned = pinned
        gpu_hit, gpu_make_room, gpu_add = gpu.policy.hit, gpu.policy.make_room, gpu.policy.add
        gpu_free = gpu._free
        cascade = cpu.capacity_blocks > 0 or self._emit is not None
        dropped = 0  # gpu victims dropped without a cascade (no cpu tier, no events)
        track_seen = self.store_threshold > 1
        seen = self._seen
        priorities = request.block_priorities
        if priorities and self.min_priority > 0:  # read only then
            remembered = self._priority
            for h, priority in zip(request.block_hashes, priorities):
                remembered.pop(h, None)  # put back last: the latest seen are the last forgotten
                remembered[h] = priority
            _forget_first(remembered, self._remembered)
        hits = [0, 0, 0]
        sources: list[int] = []
        append = sources.append
        in_prefix = True
        for h in request.block_hashes:
            if track_seen:  # popped and put back: the latest seen are the last forgotten
                seen[h] = seen.pop(h, 0) + 1
            entry = gpu_get(h)
            if entry is not None:
                entry.hits += 1
                entry.last_hit = now
                gpu_hit(h)
                hits[0] += 1
                append(_GPU if in_prefix else _RECOMPUTE)
                ahead.discard(h)
                continue
            credited = 1 if cpu_get(h) is not None else 2 if disk_get(h) is not None else 0
            if credited:
                hits[credited] += 1
            victim = gpu_make_room(h)  # Tier.insert, inlined for the simulator's speed
            if victim is None:
                slot = gpu_free.pop() if gpu_free else gpu.new_slot()
            else:
                slot = victim[1].slot
                if victim[0] in ahead:  # off the gpu tier: needed from cpu at its turn
                    pinned.add(victim[0])
                if cascade:
                    self._offload(victim[0], victim[1], slot, now)
                else:
                    dropped += 1
            gpu_add(h, Resident(slot, now))
            source = _RECOMPUTE
            if in_prefix:
                centry = cpu_get(h)
                if centry is not None:
                    cpu.touch(h, now)
                    self._moved[PROMOTE] += 1
                    if batch is not None:
                        batch.copy(PROMOTE, cpu, centry.slot, gpu, slot, h, prefill_value(h))
                    source = _CPU
                elif disk_get(h) is not None:
                    source = self._stage(h, slot, now)
                    if source == _DISK and credited == 1:
                        # found on cpu, pushed off it by this turn's offload (a hash repeated
                        # in the prompt, whose pin went at its first turn): a disk hit, as a
                        # failed read takes it back from disk
                        hits[1] -= 1
                        hits[2] += 1
            ahead.discard(h)
            pinned.discard(h)
            if source == _RECOMPUTE:
                in_prefix = False
                if batch is not None:
                    batch.prefill(gpu, slot, prefill_value(h))
            append(source)
        self.stats.evictions["gpu"] += dropped
        if track_seen:
            _forget_first(seen, self._remembered)
        lookup = time.perf_counter() - t0 if self.payload else 0.0
        if batch is not None:
            batch.flush()
        return self._account(request, started, now, sources, hits, lookup, queueing)

    def _admitted(self, h: int) -> bool:
        if self.store_threshold > 1 and self._seen.get(h, 0) < self.store_threshold:
            return False
        return self.min_priority <= 0 or self._priority.get(h, DEFAULT_PRIORITY) >= self.min_priority

    def _offload(self, v: int, resident, gpu_slot: int, now: float) -> None:
        """The ``gpu`` victim ``v`` (its bytes still in ``gpu_slot``) goes to ``cpu`` or away."""
        stats = self.stats
        stats.evictions["gpu"] += 1
        cpu = self.cpu
        offloaded = v in cpu.policy
        if not offloaded and cpu.capacity_blocks:
            # spills the cpu victim first (reads its slot); None: the cpu tier is all pinned
            cpu_slot = self._cpu_slot(v, now, self._pinned) if self._admitted(v) else None
            if cpu_slot is not None:
                self._moved[OFFLOAD] += 1
                if self._batch is not None:
                    self._batch.copy(OFFLOAD, self.gpu, gpu_slot, cpu, cpu_slot, v,
                                     prefill_value(v))
                offloaded = True
            else:
                self._skipped[0] += 1
        if offloaded:
            stats.offloaded["gpu"] += 1
        if self._emit is not None:
            self._evictions.append(self._eviction(self.gpu, resident, now, offloaded))

    def _cpu_slot(self, h: int, now: float, pinned: Collection[int]) -> int | None:
        """Insert ``h`` into ``cpu``; spill or drop the victim; return the slot, or None when
        every block the cpu tier holds is ``pinned`` (nothing inserted)."""
        placed = self.cpu.insert(h, now, pinned)
        if placed is None:
            return None
        slot, victim = placed
        if victim is None:
            return slot
        v, resident = victim
        stats = self.stats
        stats.evictions["cpu"] += 1
        disk = self.disk
        offloaded = v in disk.policy
        spilled = False
        if not offloaded and disk.capacity_blocks:
            # None: not admitted, or the disk tier is all pinned
            placed = disk.insert(v, now, self._pinned) if self._admitted(v) else None
            if placed is not None:
                disk_slot, dropped = placed
                if dropped is not None:
                    stats.evictions["disk"] += 1
                    if self._emit is not None:
                        self._evictions.append(self._eviction(disk, dropped[1], now, False))
                self._moved[SPILL] += 1
                if self._batch is not None:
                    self._batch.copy(SPILL, self.cpu, slot, disk, disk_slot, v, prefill_value(v))
                offloaded = spilled = True
            else:
                self._skipped[1] += 1
        if offloaded:
            stats.offloaded["cpu"] += 1
        if self._emit is not None:
            if spilled:  # its eviction says dropped instead should the write fail
                self._spilled[v] = len(self._evictions)
            self._evictions.append(self._eviction(self.cpu, resident, now, offloaded))
        return slot

    def _stage(self, h: int, gpu_slot: int, now: float) -> int:
        """Promote ``h`` from ``disk`` through ``cpu`` into ``gpu_slot``; return its source."""
        disk_slot = self.disk.touch(h, now).slot
        cpu_slot = self._cpu_slot(h, now, self._pinned)
        if cpu_slot is None:  # every cpu block is a later one of the prompt: one goes
            cpu_slot = self._cpu_slot(h, now, ())
        if h not in self.disk.policy:  # pushed off the disk tier making room (a hash repeated
            self.cpu.remove(h)  # in the prompt: its pin went at its first turn)
            return _RECOMPUTE
        # the staged copy serves this promotion: a hit of the cpu tier's copy (vLLM's tiering
        # counts the cpu->gpu load of a promoted chunk so), though no second reference for the
        # policy (ARC would take it for one); without it every staged block was evicted "never
        # reused", and the cpu tier read as storing for nothing
        self.cpu.touch(h, now, reorder=False)
        self._moved[STAGE] += 1
        self._moved[PROMOTE] += 1
        if self._batch is not None:
            value = prefill_value(h)
            self._batch.copy(STAGE, self.disk, disk_slot, self.cpu, cpu_slot, h, value)
            self._batch.copy(PROMOTE, self.cpu, cpu_slot, self.gpu, gpu_slot, h, value)
        return _DISK

    def _on_failure(self, failure: Failure) -> None:
        """A disk copy failed: forget the bad copies; a failed promotion becomes a miss."""
        stats = self.stats
        stats.errors[failure.reason] = stats.errors.get(failure.reason, 0) + 1
        h = failure.block_hash
        if failure.src == "disk":  # STAGE: the chunk is bad, the cpu slot holds garbage
            self._moved[STAGE] -= 1
            self._moved[PROMOTE] -= 1
            self._failed.add(h)
            self._forget(self.disk, h, failure.src_slot)
            self._forget(self.cpu, h, failure.dst_slot)
        else:  # SPILL: the chunk was not written, so the cpu's eviction kept no copy
            self._moved[SPILL] -= 1
            stats.offloaded["cpu"] -= 1
            evicted = self._spilled.pop(h, None)
            if evicted is not None:
                self._evictions[evicted] = msgspec.structs.replace(
                    self._evictions[evicted], offloaded=False)
            self._forget(self.disk, h, failure.dst_slot)

    def _forget(self, tier: Tier, h: int, slot: int) -> None:
        """Drop ``h`` from ``tier`` if it still sits in ``slot`` (its bytes there are bad)."""
        entry = tier.get(h)
        if entry is not None and entry.slot == slot:
            tier.remove(h)
            self.stats.evictions[tier.name] += 1
            if self._emit is not None:
                now = self._clock()
                self._evictions.append(ev.Eviction(
                    ts=now, tier=tier.name, blocks=1, bytes=tier.block_bytes,
                    age=now - entry.stored_at, hits=entry.hits, reason="failed",
                    idle=entry.idle(now)))

    def _eviction(self, tier: Tier, resident, now: float, offloaded: bool) -> ev.Eviction:
        return ev.Eviction(ts=now, tier=tier.name, blocks=1, bytes=tier.block_bytes,
                           age=now - resident.stored_at, hits=resident.hits, offloaded=offloaded,
                           idle=resident.idle(now))

    # -- accounting and events --------------------------------------------------------------

    def _account(self, request, started, now, sources, hits, lookup, queueing) -> RequestOutcome:
        """Split the prompt's tokens by source (prefix semantics), update the stats, finish.
        ``now``: when the engine took the request (its lookup's time)."""
        failed = self._failed
        if failed:
            for i, h in enumerate(request.block_hashes):
                if sources[i] == _DISK and h in failed:
                    sources[i] = _RECOMPUTE
                    hits[2] -= 1  # served nothing: a miss of the disk tier
        tokens = [0, 0, 0, 0]
        bt, left, ok = self.block_tokens, request.prompt_tokens, True
        for source in sources:
            n = bt if left >= bt else max(left, 0)
            left -= bt
            if source == _RECOMPUTE or not ok:
                ok = False
                tokens[3] += n
            else:
                tokens[source] += n
        tokens[3] += max(left, 0)  # prompt tokens beyond the listed blocks
        stats = self.stats
        stats.requests += 1
        stats.block_accesses += len(sources)
        stats.prompt_tokens += request.prompt_tokens
        for name, n in zip(_SOURCE_NAMES, tokens):
            stats.tokens[name] += n
        stats.block_hits["gpu"] += hits[0]
        stats.block_hits["cpu"] += hits[1]
        stats.block_hits["disk"] += hits[2]
        outcome = RequestOutcome(dict(zip(_SOURCE_NAMES, tokens)), len(sources),
                                 {"gpu": hits[0], "cpu": hits[1], "disk": hits[2]}, lookup,
                                 self.preset.prefill_seconds(tokens[3]), queueing,
                                 request.output_tokens, failed_blocks=len(failed),
                                 moved=self._moved)
        self._moved = [0, 0, 0, 0]
        if self._batch is not None:
            outcome.results = self._batch.results
        self._batch = None
        if self._emit is not None:
            record = self.record_blocks
            names = _block_sources(sources) if record else ()
            # at the lookup's time, in the order served: a capture's block rows are read in
            # time order, and arrivals (less the model's queueing) need not come in that order
            self._emit(ev.Lookup(ts=now, request_id=request.request_id,
                                 tokens={s: n for s, n in outcome.tokens.items() if n},
                                 blocks=len(sources),
                                 block_hits={t: n for t, n in outcome.block_hits.items() if n},
                                 prefill_tokens_per_second=self.preset.prefill_tokens_per_second,
                                 block_hashes=request.block_hashes if record else (),
                                 block_sources=names,
                                 block_tokens=self.block_tokens))
        self._inflight.append((started, self._evictions, outcome))
        self._evictions = []
        self.poll()
        return outcome

    def poll(self, wait: bool = False) -> None:
        """Finish requests whose copies have been timed (in order): emit their transfers,
        evictions and RequestFinished, record TTFT. ``wait``: block on pending CUDA events.
        Nothing pending, nothing to do and no report (an engine closed before it served a
        request sends nothing)."""
        if not self._inflight:
            return
        while self._inflight:
            started, evictions, outcome = self._inflight[0]
            if not all(r.resolve(wait) for r in outcome.results):
                break
            self._inflight.popleft()
            self._finish(started, evictions, outcome)
        self._report_in_flight()

    def drain(self) -> None:
        """Wait for every pending copy and finish every request."""
        self.poll(wait=True)

    def _finish(self, started, evictions, outcome: RequestOutcome) -> None:
        stats, moved = self.stats, outcome.moved
        for phase, direction in _DIRECTION.items():
            stats.moved[direction] += moved[phase]
        wait = 0.0
        if self.payload:
            for r in outcome.results:
                if r.ok:
                    stats.seconds[f"{r.src}->{r.dst}"] += r.duration
                    if r.dst == "gpu" or r.src == "disk":
                        wait += r.duration
            if outcome.results:
                # The copies run before the prefill, one after another (on one CUDA stream,
                # each once issued): the offloads and spills delay the first token too. Lookup
                # takes them (and the gaps between copies), so that the wait ends where the
                # last copy ends. The planning time may hold copies already (a flush for a
                # slot conflict), so lookup is the later end, less the wait.
                took = started.ts + outcome.queueing  # when the engine took the request
                end = took
                for r in outcome.results:
                    end = max(end, r.start) + r.duration
                outcome.lookup = max(0.0, max(end - took, outcome.lookup) - wait)
        else:
            for phase, direction in _DIRECTION.items():
                if moved[phase]:
                    src, dst = direction.split("->")
                    seconds = self.preset.transfer_seconds(src, dst, moved[phase] * self.block_bytes)
                    stats.seconds[direction] += seconds
                    if phase in (STAGE, PROMOTE):
                        wait += seconds
        outcome.promotion_wait = wait
        outcome.ttft = outcome.queueing + outcome.lookup + wait + outcome.prefill
        stats.ttfts.append(outcome.ttft)
        emit = self._emit
        if emit is None:
            return
        request_id = started.request_id
        price = self.preset.transfer_seconds  # the simulator's copies take modelled time
        for r in outcome.results:
            seconds = r.duration if self.payload else price(r.src, r.dst, r.bytes)
            emit(ev.Transfer(ts=r.start, src=r.src, dst=r.dst, blocks=r.blocks, bytes=r.bytes,
                             duration=seconds, ok=r.ok, reason=r.reason, request_id=request_id))
        for eviction in evictions:
            emit(eviction)
        self._report_admissions(outcome.results)
        self._report_tiers(self._clock())
        itl = self.preset.decode_seconds(1) if outcome.output_tokens > 1 else 0.0
        emit(ev.RequestFinished(ts=started.ts + outcome.ttft, request_id=request_id,
                                ttft=outcome.ttft,
                                prompt_tokens=started.prompt_tokens,
                                output_tokens=outcome.output_tokens,
                                queueing=outcome.queueing, lookup=outcome.lookup,
                                promotion_wait=wait, prefill=outcome.prefill, itl=itl))

    def report_queue(self, waiting: int, serving=None) -> None:
        """Emit a :class:`~kvscope.events.SchedulerStats` of the queue the caller keeps for the
        engine (the replay's): ``waiting`` requests arrived and not yet taken; ``serving``, the
        :class:`~kvscope.engine.workload.Request` the engine takes now (running 1), or None
        when it is idle (running 0). ``gpu_kv_usage``: the share of the ``gpu`` tier that
        request's blocks hold while it is served (at most all of it; 0 when idle), as vLLM's
        ``kv_cache_usage_perc`` counts blocks held by running requests, not the cached ones a
        tier keeps between requests (a warm tier is always full; its fill is
        ``kvscope_tier_resident_blocks``). ``preemptions`` stay absent: the engine never
        preempts (it serves one prompt at a time, and its ``gpu`` tier makes room by evicting
        blocks, never a request), so it has no count to report, not even 0. Nothing without
        ``emit``."""
        if self._emit is None:
            return
        capacity = self.gpu.capacity_blocks
        held = 0 if serving is None else min(len(serving.block_hashes), capacity)
        self._emit(ev.SchedulerStats(ts=self._clock(), waiting=waiting,
                                     running=0 if serving is None else 1,
                                     gpu_kv_usage=held / capacity))

    def _report_in_flight(self) -> None:
        """Emit a :class:`~kvscope.events.TransfersInFlight` for each direction between the
        engine's tiers whose batched copies issued and not yet timed (CUDA events pending), or
        their blocks, changed since the last report (the first report: every direction, 0s
        included: on a CPU every copy ends before the next request, and 0 in flight is what the
        engine knows, not a value it lacks), between tiers that hold blocks (``cpu_blocks`` 0:
        no cpu tier, no copies to or from it). Nothing without ``emit``."""
        if self._emit is None:
            return
        names = {tier.name for tier in self.tiers if tier.capacity_blocks}
        counts = {d: [0, 0] for d in _DIRECTION.values() if set(d.split("->")) <= names}
        for _, _, outcome in self._inflight:
            for r in outcome.results:
                if r.duration is None:
                    count = counts[f"{r.src}->{r.dst}"]
                    count[0] += 1
                    count[1] += r.blocks
        for direction, (copies, blocks) in counts.items():
            if self._in_flight_reported.get(direction) != (copies, blocks):
                self._in_flight_reported[direction] = (copies, blocks)
                src, dst = direction.split("->")
                self._emit(ev.TransfersInFlight(ts=self._clock(), src=src, dst=dst,
                                                transfers=copies, blocks=blocks))

    def _report_admissions(self, results) -> None:
        """One :class:`~kvscope.events.Admission` per lower tier (``cpu``, ``disk``) that was
        offered blocks: a request's offloads (gpu->cpu) and spills (cpu->disk) as its timed
        copies ended, stored when the copy succeeded and failed when not (a disk write can
        fail), with the blocks the policy declined since the last report (``_skipped``)."""
        counts = [[0, self._skipped[0], 0], [0, self._skipped[1], 0]]  # stored, skipped, failed
        self._skipped = [0, 0]
        for r in results:
            i = _STORES.get((r.src, r.dst))  # promotions and stages are no admissions
            if i is not None:
                counts[i][0 if r.ok else 2] += r.blocks
        now = self._clock()
        for tier, (stored, skipped, failed) in zip((self.cpu, self.disk), counts):
            if tier.capacity_blocks and (stored or skipped or failed):
                self._emit(ev.Admission(ts=now, tier=tier.name, stored=stored, skipped=skipped,
                                        failed=failed))

    def report_tiers(self) -> None:
        """Emit every tier's size and residency (and the host KV budget) now. The engine
        reports them before its first request otherwise: a workload whose first request comes
        late showed no tier (and "no cpu tier configured") until then."""
        if self._emit is not None:
            self._tiers_reported = True
            self._report_tiers(self._clock())

    def _report_tiers(self, ts: float) -> None:
        if self.cpu.capacity_blocks and ts >= self._memory_due:
            # the cpu tier's size is the engine's host KV budget: the agent's breakdown shows it
            self._memory_due = ts + MEMORY_REFRESH
            self._emit(ev.EngineMemory(ts=ts, kv_offload_budget=self.cpu.capacity_bytes))
        for tier in self.tiers:
            if not tier.capacity_blocks:  # disabled (a cpu tier of 0 blocks): no tier at all
                continue
            self._emit(ev.TierSnapshot(ts=ts, tier=tier.name, capacity_bytes=tier.capacity_bytes,
                                       resident_bytes=tier.resident_bytes,
                                       capacity_blocks=tier.capacity_blocks,
                                       resident_blocks=len(tier)))

    def close(self) -> None:
        """Finish pending requests and stop disk I/O (removing a private disk directory), the
        latter even when finishing fails or is interrupted."""
        try:
            self.drain()
        finally:
            if self.disk.pool is not None:
                self.disk.pool.close()


def _forget_first(remembered: dict, limit: int) -> None:
    """Drop the entries of ``remembered`` first put in while it holds more than ``limit``
    (dicts keep insertion order)."""
    over = len(remembered) - limit
    if over > 0:
        for key in list(itertools.islice(remembered, over)):
            del remembered[key]
