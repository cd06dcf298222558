"""GPU check (needs CUDA; under a minute on one GPU, at most a few).

1. Bandwidth: the reference engine's CUDA-event-timed ``cpu->gpu`` and ``gpu->cpu`` copies
   (``kvscope.engine.transfers.Copier``) against torch's own pinned-memory copy of the same bytes,
   timed the same way; prints GB/s and the ratio per direction (goal >= 0.8). Then scattered
   slots on both copy paths (per run, and one kernel through the pinned pool's CUDA view): the
   bytes must land in the right rows; GB/s printed.
2. The tap on vLLM's real CUDA worker (when vLLM is importable): ``CPUOffloadingWorker`` on a
   synthetic KV cache, wrapped in kvscope's ``TapWorker`` with a real emitter; stores blocks to
   the CPU pool and loads them back into other GPU blocks, then checks the bytes arrived intact,
   that every job became a ``Transfer`` event with vLLM's ``transfer_size`` (blocks x page bytes)
   and CUDA-event ``transfer_time``, and prints vLLM's measured bandwidth next to torch's.
3. kvscope's GPU collector on the real driver: NVML's PCIe byte counters move by at least the
   bytes torch copied in each direction (host->device is the GPU's ``rx``), the link's maximum
   from its generation and width is above the copy bandwidth torch measured, and NVML's memory
   total and used bytes agree with CUDA's.

Run: python bench/gpu_check.py [--mib 512] [--block-kib 2048] [--repeat 5]
Exit status: 0 all checks passed (or no CUDA: nothing to check), 1 a check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
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


def pools(torch, rows: int, block_bytes: int):
    """A pinned host pool and a device pool of the reference engine, float16 as the engine's
    presets, random values in both."""
    from kvscope.engine.tier import BlockPool

    elems = block_bytes // 2
    host, dev = (BlockPool(rows, elems, "float16", device) for device in ("cpu", "cuda"))
    for pool in (host, dev):
        pool.data.copy_(torch.randint(-2048, 2048, (rows, elems)).to(torch.float16))
    return host, dev


def engine_timed(copier, src, src_slots, dst, dst_slots, repeat: int) -> float:
    """Best seconds of the reference engine's copy, read from the CUDA events it records."""
    best = float("inf")
    for _ in range(repeat):
        _, (begin, end) = copier.copy(src, src_slots, dst, dst_slots)
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    return best


def bandwidth(torch, blocks: int, block_bytes: int, repeat: int) -> list[str]:
    """Reference engine vs torch, both directions, contiguous slots; returns failures."""
    from kvscope.engine.transfers import Copier

    host, dev = pools(torch, blocks, block_bytes)
    nbytes = blocks * block_bytes
    copier = Copier(cuda=True)
    slots = list(range(blocks))
    failures = []
    for name, src, dst in (("cpu->gpu", host, dev), ("gpu->cpu", dev, host)):
        torch_s = cuda_timed(torch, lambda: dst.data.copy_(src.data, non_blocking=True), repeat)
        engine_s = engine_timed(copier, src, slots, dst, slots, repeat)
        ratio = torch_s / engine_s
        print(f"{name}: torch pinned copy {nbytes / torch_s / 1e9:6.1f} GB/s, reference engine "
              f"{nbytes / engine_s / 1e9:6.1f} GB/s, ratio {ratio:.2f} (goal >= 0.8)")
        if ratio < 0.8:
            failures.append(f"{name} engine/torch bandwidth ratio {ratio:.2f} < 0.8")
    return failures


def scattered_copies(torch, blocks: int, repeat: int) -> list[str]:
    """The reference engine's scattered-slot copies, both directions, on both of its paths (a
    copy per run at or above ``DIRECT_RUN_BYTES``, one kernel through the host pool's
    ``cuda_view`` below it): the copied rows land in the right slots and no other row
    changes; GB/s printed against torch's contiguous copy of as many bytes."""
    from kvscope.engine.transfers import DIRECT_RUN_BYTES, Copier

    copier = Copier(cuda=True)
    src_slots = list(range(0, 2 * blocks, 2))  # every other row, written in reverse order
    dst_slots = list(range(2 * blocks - 1, 0, -2))
    failures = []
    for block_bytes in (DIRECT_RUN_BYTES // 32, DIRECT_RUN_BYTES // 4, 2 * DIRECT_RUN_BYTES):
        host, dev = pools(torch, 2 * blocks, block_bytes)
        if host.cuda_view(dev.data.device) is None:
            return ["the pinned host pool has no cuda_view: CUDA will not address it"]
        path = "kernel" if block_bytes < DIRECT_RUN_BYTES else "per run"
        contiguous = cuda_timed(
            torch, lambda: dev.data[:blocks].copy_(host.data[:blocks], non_blocking=True), repeat)
        for name, src, dst in (("cpu->gpu", host, dev), ("gpu->cpu", dev, host)):
            expected = dst.data.cpu().clone()  # .cpu() of a host tensor is itself
            expected[dst_slots] = src.data[src_slots].cpu()
            seconds = engine_timed(copier, src, src_slots, dst, dst_slots, repeat)
            intact = torch.equal(dst.data.cpu(), expected)
            print(f"scattered {name} ({path}), {blocks} blocks of {block_bytes >> 10} KiB: "
                  f"{blocks * block_bytes / seconds / 1e9:5.1f} GB/s (torch contiguous "
                  f"{blocks * block_bytes / contiguous / 1e9:.1f}), ratio "
                  f"{contiguous / seconds:.2f}; bytes {'intact' if intact else 'WRONG'}")
            if not intact:
                failures.append(f"scattered {name} of {block_bytes}-byte blocks: rows differ")
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


def nvml_collector(torch, nbytes: int, repeat: int) -> list[str]:
    """kvscope's GpuCollector on the real NVML against copies of known size; returns failures.

    The counters count bytes on the link, so they move by at least the payload (TLP headers and
    other traffic add to it); a direction swapped or a unit misread shows as a ratio far from 1.
    The throughput fallback samples a 20 ms window at each read, so it cannot see copies made
    between reads: with it the counts are printed, not checked."""
    from kvscope.agent.collectors.base import CollectorError
    from kvscope.agent.collectors.gpu import GpuCollector

    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the allocation below must reach the driver, not torch's cache
    collector = GpuCollector()
    try:
        reading = collector.collect()
    except CollectorError as exc:
        return [f"GPU collector on the real driver: {exc}"]
    free, total = torch.cuda.mem_get_info()
    # With several GPUs, NVML's order may differ from CUDA's: take the one with CUDA's total.
    device = min(reading.gpus, key=lambda g: abs(g.memory_total_bytes - total))
    failures = []
    print(f"NVML gpu {device.gpu}: PCIe gen {device.link_generation} x{device.link_width}, link "
          f"max {(device.link_max_bytes_per_second or 0) / 1e9:.1f} GB/s per direction, counters "
          f"from {device.pcie_source}; memory total {device.memory_total_bytes / 2**30:.1f} GiB "
          f"(CUDA {total / 2**30:.1f}), used {device.memory_used_bytes / 2**30:.2f} GiB "
          f"(CUDA {(total - free) / 2**30:.2f})")
    if abs(device.memory_total_bytes - total) > 0.02 * total:
        failures.append(f"NVML memory total {device.memory_total_bytes} vs CUDA's {total}")

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    grown = next(g for g in collector.collect().gpus if g.gpu == device.gpu)
    if not 0.9 * nbytes <= grown.memory_used_bytes - device.memory_used_bytes <= 1.5 * nbytes + 2**29:
        failures.append(f"NVML memory used grew {grown.memory_used_bytes - device.memory_used_bytes}"
                        f" bytes for a {nbytes}-byte allocation")
    before = grown
    for direction, src, dst in (("rx", host, dev), ("tx", dev, host)):
        seconds = cuda_timed(torch, lambda: dst.copy_(src, non_blocking=True), repeat)
        after = next(g for g in collector.collect().gpus if g.gpu == device.gpu)
        field = f"pcie_{direction}_bytes"
        moved = (getattr(after, field) or 0) - (getattr(before, field) or 0)
        ratio = moved / (repeat * nbytes)
        line = (f"{'host->device' if direction == 'rx' else 'device->host'}: torch copied "
                f"{repeat} x {nbytes / 2**20:.0f} MiB at {nbytes / seconds / 1e9:.1f} GB/s; "
                f"kvscope_pcie_bytes_total{{direction=\"{direction}\"}} grew {moved / 2**20:.0f}"
                f" MiB = {ratio:.3f} x the payload")
        print(line)
        link = after.link_max_bytes_per_second
        if link and nbytes / seconds > 1.05 * link:
            failures.append(f"{direction}: torch moved {nbytes / seconds:.3g} B/s over a link "
                            f"whose maximum kvscope computes as {link:.3g} B/s")
        if (after.pcie_source or {}).get(direction) == "counter" and not 1.0 <= ratio <= 1.5:
            failures.append(f"{direction}: NVML counter moved {ratio:.3f} x the bytes copied")
        before = after
    collector.shutdown()
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
    failures += scattered_copies(torch, 128, args.repeat)
    failures += tap_on_vllm_worker(torch, blocks, block_bytes)
    failures += nvml_collector(torch, blocks * block_bytes, args.repeat)
    for failure in failures:
        print("FAIL:", failure)
    print("gpu_check:", "OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
