"""GPU check (needs CUDA; under a minute on one GPU, at most a few).

1. Bandwidth: the reference engine's CUDA-event-timed ``cpu->gpu`` and ``gpu->cpu`` copies
   (``kvscope.engine.transfers.Copier``) against torch's own pinned-memory copy of the same bytes,
   timed the same way; prints GB/s and the ratio per direction (goal >= 0.8).
2. The tap on vLLM's real CUDA worker (when vLLM is importable): ``CPUOffloadingWorker`` on a
   synthetic KV cache, wrapped in kvscope's ``TapWorker`` with a real emitter; stores blocks to
   the CPU pool and loads them back into other GPU blocks, then checks the bytes arrived intact,
   that every job became a ``Transfer`` event with vLLM's ``transfer_size`` (blocks x page bytes)
   and CUDA-event ``transfer_time``, and prints vLLM's measured bandwidth next to torch's.

Run: python bench/gpu_check.py [--mib 512] [--block-kib 2048] [--repeat 5]
Exit status: 0 all checks passed (or no CUDA: nothing to check), 1 a check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cuda_timed(torch, fn, repeat: int) -> float:
    """Best seconds of ``fn`` over ``repeat`` runs, CUDA events on the current stream."""
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def bandwidth(torch, blocks: int, block_bytes: int, repeat: int) -> list[str]:
    """Reference engine vs torch, both directions; returns failures."""
    from kvscope.engine.transfers import Copier

    host = torch.randint(-128, 127, (blocks, block_bytes), dtype=torch.int8).pin_memory()
    dev = torch.empty((blocks, block_bytes), dtype=torch.int8, device="cuda")
    nbytes = blocks * block_bytes
    pool = lambda t: types.SimpleNamespace(data=t, is_cuda=t.is_cuda,  # noqa: E731
                                           device=str(t.device))
    copier = Copier(cuda=True)
    slots = list(range(blocks))
    failures = []
    for name, src, dst in (("cpu->gpu", host, dev), ("gpu->cpu", dev, host)):
        torch_s = cuda_timed(torch, lambda: dst.copy_(src, non_blocking=True), repeat)
        engine_s = float("inf")
        for _ in range(repeat):
            _, (begin, end) = copier.copy(pool(src), slots, pool(dst), slots)
            end.synchronize()
            engine_s = min(engine_s, begin.elapsed_time(end) / 1e3)
        ratio = torch_s / engine_s
        print(f"{name}: torch pinned copy {nbytes / torch_s / 1e9:6.1f} GB/s, reference engine "
              f"{nbytes / engine_s / 1e9:6.1f} GB/s, ratio {ratio:.2f} (goal >= 0.8)")
        if ratio < 0.8:
            failures.append(f"{name} engine/torch bandwidth ratio {ratio:.2f} < 0.8")
    return failures


def tap_on_vllm_worker(torch, blocks: int, block_bytes: int) -> list[str]:
    """vLLM's CUDA worker under the tap: bytes intact, one Transfer per job, sizes and times."""
    try:
        from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,
                                             CanonicalKVCacheTensor, GPULoadStoreSpec)
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
    except ImportError as exc:
        print(f"vLLM not importable ({exc}); tap-on-vLLM check skipped")
        return []
    import zmq

    from kvscope import events as ev
    from kvscope.agent.taps.emitter import Emitter
    from kvscope.agent.taps.vllm import TapWorker

    endpoint = f"ipc://{tempfile.mkdtemp()}/gpu_check.sock"
    sink = zmq.Context.instance().socket(zmq.PULL)
    sink.bind(endpoint)
    received: list = []
    stop = threading.Event()

    def drain():
        while not stop.is_set():
            if sink.poll(50):
                received.extend(ev.decode_batch(sink.recv()).events)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    half = blocks // 2
    kv = torch.randint(-128, 127, (blocks, block_bytes), dtype=torch.int8, device="cuda")
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(kv, block_bytes)],
                               group_data_refs=[[CanonicalKVCacheRef(0, block_bytes)]])
    inner = CPUOffloadingWorker(caches, blocks_per_chunk=1, num_cpu_chunks=half)
    emitter = Emitter(endpoint, source="vllm-worker")
    worker = TapWorker(inner, emitter)
    src_ids, dst_ids, chunks = list(range(half)), list(range(half, 2 * half)), list(range(half))
    started = time.perf_counter()
    worker.submit_store(1, GPULoadStoreSpec(src_ids, [half], [0]), CPULoadStoreSpec(chunks))
    worker.wait({1})
    results = worker.get_finished()
    worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst_ids, [half], [0]))
    worker.wait({2})
    deadline = time.monotonic() + 10
    while len(results) < 2 and time.monotonic() < deadline:
        results += worker.get_finished()
        time.sleep(0.001)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    failures = []
    if not torch.equal(kv[:half], kv[half:2 * half]):
        failures.append("vLLM worker: loaded blocks differ from stored ones")
    emitter.close()
    time.sleep(0.5)
    stop.set()
    thread.join(2)
    sink.close(0)
    worker.shutdown()
    transfers = {(t.src, t.dst): t for t in received if isinstance(t, ev.Transfer)}
    for route in (("gpu", "cpu"), ("cpu", "gpu")):
        t = transfers.get(route)
        if t is None:
            failures.append(f"tap: no Transfer event for {route[0]}->{route[1]}")
            continue
        ok = t.blocks == half and t.bytes == half * block_bytes and t.duration > 0 and t.timed
        print(f"vLLM worker {route[0]}->{route[1]}: {t.blocks} blocks, {t.bytes} bytes in "
              f"{t.duration * 1e3:.2f} ms (CUDA events) = {t.bytes / t.duration / 1e9:.1f} GB/s"
              f"{'' if ok else '  MISMATCH'}")
        if not ok:
            failures.append(f"tap: {route} event {t}")
    print(f"tap-on-vLLM round trip {wall:.2f} s wall; tap errors {worker.errors}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes moved per copy, MiB")
    parser.add_argument("--block-kib", type=int, default=2048, help="block size, KiB")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (run this on a GPU machine)")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    block_bytes = args.block_kib << 10
    blocks = max(2, (args.mib << 20) // block_bytes)
    failures = bandwidth(torch, blocks, block_bytes, args.repeat)
    failures += tap_on_vllm_worker(torch, blocks, block_bytes)
    for failure in failures:
        print("FAIL:", failure)
    print("gpu_check:", "OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
