"""The reference offload engine: a ``gpu`` tier backed by a ``cpu`` tier, LRU in each.

For each request the engine walks the prompt's blocks first to last:

- resident in ``gpu``: a hit, the block becomes most recently used;
- otherwise a ``gpu`` slot is made (the LRU victim is offloaded ``gpu->cpu`` unless the ``cpu``
  tier already holds it; a block the ``cpu`` tier evicts to make room is dropped), then the block
  is promoted ``cpu->gpu`` if the ``cpu`` tier holds it, else recomputed by prefill.

Only the leading contiguous run of cached blocks serves tokens (prefix semantics): after the
first recomputed block every later token counts as ``recompute``. The ``cpu`` tier is
inclusive: a promoted block keeps its ``cpu`` copy. Every copy moves real bytes and is timed
(see :mod:`kvscope.engine.transfers`); TTFT follows the cost model in
:mod:`kvscope.engine.presets`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscope import events as ev
from kvscope.engine.presets import ModelPreset
from kvscope.engine.tier import BlockPool, Tier
from kvscope.engine.transfers import OFFLOAD, PROMOTION, CopyBatcher
from kvscope.engine.workload import Request, block_token_counts


def prefill_value(block_hash: int) -> float:
    """The value prefill writes into every element of a recomputed block.

    An integer below 2048, so float16 holds it exactly; a promoted block must carry its own.
    """
    return float(block_hash % 2039)


@dataclass
class RequestOutcome:
    """What one request did. ``tokens``: dict[source, tokens]; ``ttft``, ``promotion_wait``:
    seconds; ``block_hits``: dict[tier, block accesses that found the block there];
    ``block_accesses``: blocks looked up."""

    tokens: dict[str, int]
    ttft: float
    promotion_wait: float
    block_accesses: int
    block_hits: dict[str, int] = field(default_factory=dict)


class OffloadEngine:
    """A two-tier (``gpu`` over ``cpu``) offload engine over real KV block tensors.

    ``gpu_blocks``, ``cpu_blocks``: tier capacities in blocks (``cpu_blocks=0`` disables
    offload). ``block_tokens``: tokens per block (default: the preset's). ``emit``: called
    with each :mod:`kvscope.events` event. ``device``: where the ``gpu`` tier lives (default
    CUDA when available, else CPU memory standing in for device memory). ``payload=False``
    keeps only the decisions (no tensors). ``clock``: Unix-seconds clock for event stamps.
    """

    def __init__(self, preset: ModelPreset, gpu_blocks: int, cpu_blocks: int, *,
                 block_tokens: int | None = None, emit: Callable[[object], None] = lambda e: None,
                 device: str | None = None, payload: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        if gpu_blocks < 1:
            raise ValueError(f"gpu tier needs at least 1 block, got {gpu_blocks}")
        self.preset = preset
        self.block_tokens = block_tokens or preset.block_tokens
        self.block_bytes = preset.bytes_per_block(self.block_tokens)
        self._emit = emit
        self._clock = clock
        gpu_pool = cpu_pool = None
        if payload:
            import torch

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            elems = self.block_bytes // preset.dtype_bytes
            gpu_pool = BlockPool(gpu_blocks, elems, preset.dtype, device)
            cpu_pool = BlockPool(cpu_blocks, elems, preset.dtype, "cpu")
        self.gpu = Tier("gpu", gpu_blocks, self.block_bytes, gpu_pool)
        self.cpu = Tier("cpu", cpu_blocks, self.block_bytes, cpu_pool)

    def process(self, request: Request, queueing: float = 0.0) -> RequestOutcome:
        """Serve one request's prompt; emit its events; return what happened.

        ``queueing``: seconds the request waited before the engine took it (part of TTFT).
        """
        now = self._clock()
        self._emit(ev.RequestStarted(ts=now, request_id=request.request_id,
                                     prompt_tokens=request.prompt_tokens))
        t0 = time.perf_counter()
        tokens = dict.fromkeys(ev.TOKEN_SOURCES, 0)
        hits = {"gpu": 0, "cpu": 0}
        batch = CopyBatcher(self._clock)
        evictions: list[ev.Eviction] = []
        counts = block_token_counts(request.prompt_tokens, len(request.block_hashes),
                                    self.block_tokens)
        in_prefix = True
        for block_hash, n in zip(request.block_hashes, counts):
            if block_hash in self.gpu:
                hits["gpu"] += 1
                self.gpu.touch(block_hash)
                source = "gpu"
            else:
                if block_hash in self.cpu:
                    hits["cpu"] += 1
                slot = self._make_gpu_slot(block_hash, now, batch, evictions)
                if in_prefix and block_hash in self.cpu:
                    entry = self.cpu.touch(block_hash)
                    batch.copy(PROMOTION, self.cpu, entry.slot, self.gpu, slot)
                    source = "cpu"
                else:
                    batch.prefill(self.gpu, slot, prefill_value(block_hash))
                    source = "recompute"
            if source == "recompute" or not in_prefix:
                in_prefix, source = False, "recompute"
            tokens[source] += n
        tokens["recompute"] += request.prompt_tokens - sum(counts)
        lookup_seconds = time.perf_counter() - t0
        batch.flush()
        self._emit(ev.Lookup(ts=now, request_id=request.request_id,
                             tokens={s: n for s, n in tokens.items() if n}))
        promotion_wait = 0.0
        for copy in batch.results:
            self._emit(ev.Transfer(ts=copy.start, src=copy.src, dst=copy.dst, blocks=copy.blocks,
                                   bytes=copy.bytes, duration=copy.duration,
                                   request_id=request.request_id))
            if copy.dst == "gpu":
                promotion_wait += copy.duration
        for eviction in evictions:
            self._emit(eviction)
        end = self._clock()
        for tier in (self.gpu, self.cpu):
            self._emit(ev.TierSnapshot(ts=end, tier=tier.name, capacity_bytes=tier.capacity_bytes,
                                       resident_bytes=tier.resident_bytes,
                                       capacity_blocks=tier.capacity_blocks,
                                       resident_blocks=len(tier)))
        ttft = (queueing + lookup_seconds + promotion_wait
                + self.preset.prefill_seconds(tokens["recompute"]))
        self._emit(ev.RequestFinished(ts=end, request_id=request.request_id, ttft=ttft,
                                      prompt_tokens=request.prompt_tokens,
                                      output_tokens=request.output_tokens,
                                      promotion_wait=promotion_wait))
        return RequestOutcome(tokens, ttft, promotion_wait, len(request.block_hashes), hits)

    def _make_gpu_slot(self, block_hash: int, now: float, batch: CopyBatcher,
                       evictions: list[ev.Eviction]) -> int:
        """Insert ``block_hash`` into the ``gpu`` tier; offload or drop the LRU victim."""
        slot, victim = self.gpu.insert(block_hash, now)
        if victim is None:
            return slot
        victim_hash, resident = victim
        offloaded = victim_hash in self.cpu
        if not offloaded:
            placed = self.cpu.insert(victim_hash, now)
            if placed is not None:
                cpu_slot, dropped = placed
                batch.copy(OFFLOAD, self.gpu, slot, self.cpu, cpu_slot)
                offloaded = True
                if dropped is not None:
                    evictions.append(self._eviction(self.cpu, dropped[1], now, offloaded=False))
        evictions.append(self._eviction(self.gpu, resident, now, offloaded=offloaded))
        return slot

    def _eviction(self, tier: Tier, resident, now: float, offloaded: bool) -> ev.Eviction:
        return ev.Eviction(ts=now, tier=tier.name, blocks=1, bytes=tier.block_bytes,
                           age=now - resident.stored_at, hits=resident.hits, offloaded=offloaded)
