"""Batched, timed block copies between tier payloads (tensor pools and chunk files).

The engine plans a request's copies block by block; this module runs them as few large copies
as correctness allows. Copies run in phases:

    SPILL    cpu -> disk    (a cpu victim's bytes leave before its slot is refilled)
    OFFLOAD  gpu -> cpu
    STAGE    disk -> cpu    (first hop of a disk promotion)
    PROMOTE  cpu -> gpu
    PREFILL  recomputed blocks written into gpu slots

so a slot vacated by an earlier phase can be refilled by a later one in the same batch. A
planned copy that touches a slot already touched by a pending copy of the same or a *later*
phase (with at least one of them writing) would run out of order, so the pending copies are
flushed first.

A failed disk write or read (see :mod:`kvscope.engine.disk`) is reported to ``on_failure``;
a failed STAGE turns the PROMOTE that would have forwarded its bytes into a PREFILL, so wrong
bytes never reach the ``gpu`` tier.

Timing: without CUDA, the copying thread's CPU time (``time.thread_time_ns``) around each batched
host copy, and wall time (``time.perf_counter_ns``) around each batch of disk I/O, whose waits
are the disk's. A host copy is its thread's own work (torch runs it on one thread, see
:class:`Copier`); wall time around it also counted the waits for the GIL while the process's
other threads ran: in ``kvscope demo`` (engine, agent and dashboard in one process) the copies
of its first 2 s took 187 ms of wall time for 15 ms of CPU time, so its offload verdict read
the dashboard's start-up as the copies' cost. With CUDA, copies run on a dedicated copy stream,
bracketed by CUDA events; :meth:`CopyResult.resolve` reads them back later without blocking
(``Event.query``), or waits when asked to.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

SPILL, OFFLOAD, STAGE, PROMOTE, PREFILL = range(5)

# Scattered host<->device rows move in one gather-scatter kernel that reads or writes the pinned
# host rows over PCIe (``BlockPool.cuda_view``); a run at least this long is copied on its own
# instead (one cudaMemcpyAsync, as vLLM's swap_blocks does per block). Measured on an H200 (PCIe 5
# x16, 128 scattered float16 blocks; torch's contiguous pinned copy 47-55 GB/s): the kernel moved
# 36.6 GB/s host->device and 35.0 device->host at 32 KiB, 43.9 and 46.1 at 256 KiB; a copy per
# block moved 9.3 GB/s at 64 KiB (about 8 us to issue each from Python), 42.7 at 512 KiB, 48.1 at
# 1 MiB and 51.2 at 2 MiB.
DIRECT_RUN_BYTES = 1 << 20


@dataclass(slots=True)
class CopyResult:
    """One executed batched copy: ``blocks`` blocks, ``bytes`` bytes from ``src`` to ``dst``.

    ``start``: Unix seconds. ``duration``: seconds, or None while CUDA events are pending
    (call :meth:`resolve`). ``ok``/``reason``: False and a :data:`~kvscope.engine.disk.REASONS`
    value for the blocks of a batch that failed.
    """

    src: str
    dst: str
    blocks: int
    bytes: int
    start: float
    duration: float | None
    ok: bool = True
    reason: str = ""
    events: tuple | None = None

    def resolve(self, wait: bool = False) -> bool:
        """Fill ``duration`` from the CUDA events if they completed (or wait when ``wait``)."""
        if self.duration is not None:
            return True
        begin, end = self.events
        if not wait and not end.query():
            return False
        end.synchronize()
        self.duration = begin.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
        self.events = None
        return True


@dataclass(frozen=True, slots=True)
class Failure:
    """A block whose copy failed: ``src``/``dst`` tier names, slots, hash, ``reason``."""

    src: str
    dst: str
    block_hash: int
    src_slot: int
    dst_slot: int
    reason: str


@dataclass
class _Pending:
    src: object  # Tier or None (prefill)
    dst: object
    src_slots: list[int] = field(default_factory=list)
    dst_slots: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def _runs(src_slots: list[int], dst_slots: list[int]) -> list[tuple[int, int, int]]:
    """Split paired slot lists into ``(src_start, dst_start, length)`` runs where both advance
    by one, so each run is one contiguous copy."""
    runs = []
    s0, d0, n = src_slots[0], dst_slots[0], 1
    for s, d in zip(src_slots[1:], dst_slots[1:]):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


class Copier:
    """Executes batched copies between :class:`~kvscope.engine.tier.BlockPool` tensors.

    ``cuda``: run on a dedicated CUDA copy stream with event timing; host pools must be pinned.
    Contiguous runs are copied with one ``copy_`` each. With CUDA, scattered slots in runs
    shorter than ``DIRECT_RUN_BYTES`` move in one kernel that gathers the source rows and
    scatters them into the destination's, reaching host rows through the host pool's
    :meth:`~kvscope.engine.tier.BlockPool.cuda_view` (copied run by run where there is none,
    or no device memory for the gathered rows). The events time the kernels, not the index
    upload before them. Between host pools, scattered rows are gathered straight into
    contiguous destination rows, or copied row by row (no call costs there).

    Without CUDA it sets torch to one intra-op thread (process-wide: the reference engine's
    process is kvscope's own). Host copies are memory-bound, and the OpenMP pool's threads
    spin-wait for work: on a busy 2-core host, six replays of 200 requests took 0.09 to 3.7 s
    (gpu->cpu copies 0.009 to 1.8 s) with torch's default threads, 0.045 to 0.075 s with one,
    so the transfer times and TTFTs the engine reports measured the pool, not the copies.
    """

    def __init__(self, cuda: bool) -> None:
        import torch

        if not cuda:
            torch.set_num_threads(1)
        self.torch = torch
        self.cuda = cuda
        self.stream = torch.cuda.Stream() if cuda else None
        self._tail = None  # last event recorded on the copy stream

    def begin(self) -> None:
        """Order the copy stream after work already queued on the compute stream."""
        if self.cuda:
            self.stream.wait_stream(self.torch.cuda.current_stream())

    def end(self) -> None:
        """Order later compute-stream work (prefill, the model) after the copies."""
        if self.cuda:
            self.torch.cuda.current_stream().wait_stream(self.stream)

    def host_fence(self) -> None:
        """Wait until queued copies stopped touching host pools (before host-side I/O)."""
        if self._tail is not None:
            self._tail.synchronize()
            self._tail = None

    def copy(self, src_pool, src_slots, dst_pool, dst_slots) -> tuple[float | None, tuple | None]:
        """Copy rows ``src_slots`` of ``src_pool`` to rows ``dst_slots`` of ``dst_pool``;
        return ``(seconds, None)`` (host pools: the thread's CPU seconds) or ``(None, (start,
        end) CUDA events)``."""
        torch = self.torch
        runs = _runs(src_slots, dst_slots)
        src, dst = src_pool.data, dst_pool.data
        if not self.cuda:  # host memory both sides: every path is a single pass over the bytes
            t0 = time.thread_time_ns()  # all of the copy: torch runs on this one thread
            few = max(1, len(src_slots) // 4)
            if len(runs) <= few:
                for s0, d0, n in runs:
                    dst[d0:d0 + n].copy_(src[s0:s0 + n])
            else:
                dst_runs = _runs(dst_slots, dst_slots)
                if len(dst_runs) <= few:  # gather straight into contiguous destination rows
                    i = 0
                    for d0, _, n in dst_runs:
                        torch.index_select(src, 0, torch.tensor(src_slots[i:i + n]),
                                           out=dst[d0:d0 + n])
                        i += n
                else:
                    for s, d in zip(src_slots, dst_slots):
                        dst[d].copy_(src[s])
            return (time.thread_time_ns() - t0) / 1e9, None
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        run_bytes = len(src_slots) * src.shape[1] * src.element_size() / len(runs)
        device = (dst_pool if dst_pool.is_cuda else src_pool).data.device
        views = [pool.data.view(torch.uint8) if pool.is_cuda else pool.cuda_view(device)
                 for pool in (src_pool, dst_pool)]
        per_run = len(runs) == 1 or run_bytes >= DIRECT_RUN_BYTES or None in views
        with torch.cuda.stream(self.stream):
            if not per_run:  # set up before the clock starts: the events time the bytes moving
                src_view, dst_view = views
                try:
                    index = torch.tensor([src_slots, dst_slots], pin_memory=True).to(
                        device, non_blocking=True)
                    rows = torch.empty((len(src_slots), src_view.shape[1]), dtype=torch.uint8,
                                       device=device)
                except torch.cuda.OutOfMemoryError:  # no room for the gathered rows
                    per_run = True
            begin.record(self.stream)
            if per_run:
                for s0, d0, n in runs:
                    dst[d0:d0 + n].copy_(src[s0:s0 + n], non_blocking=True)
            else:
                torch.index_select(src_view, 0, index[0], out=rows)
                dst_view.index_copy_(0, index[1], rows)
            end.record(self.stream)
        self._tail = end
        return None, (begin, end)

    def fill(self, dst_pool, dst_slots: list[int], values: list[float]) -> None:
        """Prefill: set every element of each row ``dst_slots[i]`` to ``values[i]``."""
        torch = self.torch
        data = dst_pool.data
        idx = torch.tensor(dst_slots, device=dst_pool.device)
        data[idx] = torch.tensor(values, dtype=data.dtype, device=dst_pool.device).unsqueeze(1)


class CopyBatcher:
    """Collects planned copies for one request and executes them in phase order, timed.

    ``copier``: a :class:`Copier`, or None when tiers hold no payload (nothing is executed).
    ``on_failure``: called with each :class:`Failure`, during :meth:`flush`, before any later
    phase runs. ``clock``: wall clock for start stamps (Unix seconds).
    """

    def __init__(self, copier: Copier | None, on_failure: Callable[[Failure], None] = lambda f: None,
                 clock: Callable[[], float] = time.time) -> None:
        self._copier = copier
        self._on_failure = on_failure
        self._clock = clock
        self._pending: dict[tuple[int, str, str], _Pending] = {}
        # cpu slots whose STAGE failed in a flush while copies were still being planned: a
        # promotion from one planned after it is a prefill (its bytes are not the block's)
        self._unread: set[int] = set()
        self._touched: dict[tuple[str, int], list[tuple[int, bool]]] = defaultdict(list)
        self.results: list[CopyResult] = []

    def copy(self, phase: int, src, src_slot: int, dst, dst_slot: int, block_hash: int = 0,
             value: float = 0.0) -> None:
        """Plan a copy of block ``block_hash`` from ``src``'s slot to ``dst``'s slot in
        ``phase``; ``value`` is what its prefill would write (used if the copy must be
        replaced by recomputation)."""
        self._plan(phase, src, src_slot, dst, dst_slot, block_hash, value)

    def prefill(self, dst, dst_slot: int, value: float) -> None:
        """Plan the prefill write of a recomputed block: every element set to ``value``."""
        self._plan(PREFILL, None, -1, dst, dst_slot, 0, value)

    def _plan(self, phase, src, src_slot, dst, dst_slot, block_hash, value) -> None:
        accesses = [((dst.name, dst_slot), True)]
        if src is not None:
            accesses.append(((src.name, src_slot), False))
        if any(p >= phase and (write or w)
               for key, write in accesses for p, w in self._touched.get(key, ())):
            self.flush()
        if self._unread and src is not None:
            if phase == PROMOTE and src.name == "cpu" and src_slot in self._unread:
                phase, src, src_slot, block_hash = PREFILL, None, -1, 0  # its STAGE failed
            elif dst.name == "cpu":  # the slot takes new bytes
                self._unread.discard(dst_slot)
        for key, write in accesses:
            self._touched[key].append((phase, write))
        pending = self._pending.get((phase, src.name if src else "", dst.name))
        if pending is None:
            pending = self._pending[(phase, src.name if src else "", dst.name)] = _Pending(src, dst)
        pending.src_slots.append(src_slot)
        pending.dst_slots.append(dst_slot)
        pending.hashes.append(block_hash)
        pending.values.append(value)

    def flush(self) -> None:
        """Execute every pending copy, phase by phase, and record a :class:`CopyResult` per
        batched copy (prefill writes are computation, not transfers, and are not recorded)."""
        copier = self._copier
        if copier is not None and self._pending:
            copier.begin()
        for phase in range(PREFILL + 1):
            for key in [k for k in self._pending if k[0] == phase]:
                p = self._pending[key]
                if phase == PREFILL:
                    if copier is not None:
                        copier.end()
                        copier.fill(p.dst.pool, p.dst_slots, p.values)
                    continue
                start = self._clock()
                n = len(p.dst_slots)
                if n == 0:  # every block of it was turned into a prefill
                    continue
                if copier is None:
                    self.results.append(CopyResult(p.src.name, p.dst.name, n, n * p.dst.block_bytes,
                                                   start, 0.0))
                    continue
                if phase in (SPILL, STAGE):
                    self._disk(phase, p, start)
                else:
                    seconds, events = copier.copy(p.src.pool, p.src_slots, p.dst.pool, p.dst_slots)
                    self.results.append(CopyResult(p.src.name, p.dst.name, n,
                                                   n * p.dst.block_bytes, start, seconds,
                                                   events=events))
        if copier is not None and self._pending:
            copier.end()
        self._pending.clear()
        self._touched.clear()

    def _disk(self, phase: int, p: _Pending, start: float) -> None:
        self._copier.host_fence()
        t0 = time.perf_counter_ns()
        if phase == SPILL:
            rows = p.src.pool.host_bytes
            reasons = p.dst.pool.write_many(
                [(d, h, rows[s]) for s, d, h in zip(p.src_slots, p.dst_slots, p.hashes)])
        else:
            rows = p.dst.pool.host_bytes
            reasons = p.src.pool.read_many(
                [(s, h, rows[d]) for s, d, h in zip(p.src_slots, p.dst_slots, p.hashes)])
        seconds = (time.perf_counter_ns() - t0) / 1e9
        ok = reasons.count(None)
        size = p.dst.block_bytes
        if ok:
            self.results.append(CopyResult(p.src.name, p.dst.name, ok, ok * size, start, seconds))
        failed: dict[str, int] = defaultdict(int)
        for i, reason in enumerate(reasons):
            if reason is None:
                continue
            failed[reason] += 1
            failure = Failure(p.src.name, p.dst.name, p.hashes[i], p.src_slots[i], p.dst_slots[i],
                              reason)
            if phase == STAGE:
                self._unread.add(failure.dst_slot)
                self._recompute_instead(failure.dst_slot, p.values[i])
            self._on_failure(failure)
        for reason, n in failed.items():
            self.results.append(CopyResult(p.src.name, p.dst.name, n, n * size, start, seconds,
                                           ok=False, reason=reason))

    def _recompute_instead(self, cpu_slot: int, value: float) -> None:
        """A STAGE into ``cpu_slot`` failed: pending promotions from that slot become prefills."""
        promote = next((v for k, v in self._pending.items()
                        if k[0] == PROMOTE and k[1] == "cpu"), None)
        if promote is None:
            return
        keep = [i for i, s in enumerate(promote.src_slots) if s != cpu_slot]
        moved = [promote.dst_slots[i] for i, s in enumerate(promote.src_slots) if s == cpu_slot]
        if not moved:  # none pending from it (yet: see copy())
            return
        for name in ("src_slots", "dst_slots", "hashes", "values"):
            column = getattr(promote, name)
            setattr(promote, name, [column[i] for i in keep])
        key = (PREFILL, "", promote.dst.name)
        fill = self._pending.get(key)
        if fill is None:
            fill = self._pending[key] = _Pending(None, promote.dst)
        for slot in moved:
            if slot not in fill.dst_slots:  # a later prefill into the slot supersedes this one
                fill.dst_slots.insert(0, slot)
                fill.src_slots.insert(0, -1)
                fill.hashes.insert(0, 0)
                fill.values.insert(0, value)
