"""Batched, timed block copies between tier pools.

The engine plans a request's copies block by block; this module runs them as few large copies
as correctness allows. Copies run in phases — offloads (``gpu->cpu``), then promotions
(``cpu->gpu``), then prefill writes of recomputed blocks — so a slot that is vacated by an
offload can be refilled by a promotion in the same batch. A planned copy that touches a slot
already touched by a pending copy of the same or a *later* phase (with at least one of them
writing) would run out of order, so the pending copies are flushed first.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from kvscope.engine.tier import Tier

OFFLOAD, PROMOTION, PREFILL = 0, 1, 2


@dataclass(frozen=True, slots=True)
class CopyResult:
    """One executed copy: ``blocks`` blocks, ``bytes`` bytes from ``src`` to ``dst``.

    ``start``: Unix seconds; ``duration``: seconds, measured around the copy.
    """

    src: str
    dst: str
    blocks: int
    bytes: int
    start: float
    duration: float


@dataclass
class _Pending:
    src: Tier | None
    dst: Tier
    src_slots: list[int] = field(default_factory=list)
    dst_slots: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


class CopyBatcher:
    """Collects planned copies for one request and executes them in phase order, timed.

    ``clock``: wall clock for start stamps (Unix seconds).
    """

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._pending: dict[tuple[int, str, str], _Pending] = {}
        self._touched: dict[tuple[str, int], list[tuple[int, bool]]] = defaultdict(list)
        self.results: list[CopyResult] = []

    def copy(self, phase: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> None:
        """Plan a copy of one block from ``src``'s slot to ``dst``'s slot in ``phase``."""
        self._plan(phase, src, src_slot, dst, dst_slot, 0.0)

    def prefill(self, dst: Tier, dst_slot: int, value: float) -> None:
        """Plan the prefill write of a recomputed block: every element set to ``value``."""
        self._plan(PREFILL, None, -1, dst, dst_slot, value)

    def _plan(self, phase, src, src_slot, dst, dst_slot, value) -> None:
        accesses = [((dst.name, dst_slot), True)]
        if src is not None:
            accesses.append(((src.name, src_slot), False))
        if any(p >= phase and (write or w)
               for key, write in accesses for p, w in self._touched.get(key, ())):
            self.flush()
        for key, write in accesses:
            self._touched[key].append((phase, write))
        pending = self._pending.setdefault(
            (phase, src.name if src else "", dst.name), _Pending(src, dst))
        pending.src_slots.append(src_slot)
        pending.dst_slots.append(dst_slot)
        pending.values.append(value)

    def flush(self) -> None:
        """Execute every pending copy, phase by phase; record a :class:`CopyResult` per copy
        (prefill writes are computation, not transfers, and are not recorded). Tiers without a
        pool only record the decision, with duration 0."""
        for (phase, _, _), p in sorted(self._pending.items(), key=lambda kv: kv[0][0]):
            start, t0 = self._clock(), time.perf_counter_ns()
            if p.dst.pool is not None:
                _execute(phase, p)
            if phase == PREFILL:
                continue
            duration = (time.perf_counter_ns() - t0) / 1e9 if p.dst.pool is not None else 0.0
            n = len(p.dst_slots)
            self.results.append(CopyResult(p.src.name, p.dst.name, n, n * p.dst.block_bytes,
                                           start, duration))
        self._pending.clear()
        self._touched.clear()


def _execute(phase: int, p: _Pending) -> None:
    """Run one batched copy (or prefill write) on the pools; wait for it on CUDA."""
    import torch  # the engine extra; only payload tiers get here

    pool = p.dst.pool
    dst_idx = torch.tensor(p.dst_slots, device=pool.device)
    if phase == PREFILL:
        values = torch.tensor(p.values, dtype=pool.data.dtype, device=pool.device)
        pool.data[dst_idx] = values.unsqueeze(1)
        return
    src_idx = torch.tensor(p.src_slots, device=p.src.pool.device)
    pool.data[dst_idx] = p.src.pool.data[src_idx].to(pool.device, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
