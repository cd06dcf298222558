"""GPU check: kvscope's CUDA copies, its GPU collector on the real NVML, and the tap's worker path.

The one command (the device tool's run; nothing else to install there):

    here, once:  bash bench/gpu_wheels.sh     # 4 cp312 wheels, 1.3 MiB, into .gpu-wheels/ (ignored)
    there:       run(command="timeout -k 10 330 python3 bench/gpu_check.py",
                     carry=[".gpu-wheels"], timeout_s=360)

Target: one CUDA GPU (an H200), Python 3.12, torch 2.11 (CUDA 13) and nvidia-ml-py installed, no
network. Before importing kvscope the script installs every wheel in ``.gpu-wheels/`` (msgspec,
pyzmq, psutil, nvidia-ml-py) into a temporary directory with ``pip --no-index`` and puts it first
on ``sys.path``. It imports no compiled kvscope module (the Cython ones are built for the local
Python, and ``*.so`` does not travel), nothing of the agent's pipeline and nothing of vLLM.
Time: about a minute on an H200; a watchdog stops it at ``--budget`` seconds (300) with a FAIL
line and exit status 3, and ``timeout`` kills it at 330 s + 10 s whatever hangs: under 6 minutes.

vLLM is NOT run: vLLM's GPU build (a 336 MB wheel that needs torch 2.14) cannot be brought to
that machine (64 MiB at most travels, and its torch is 2.11). Check 3 therefore drives a worker
written here that copies and times blocks the way vLLM 0.33's CUDA worker does, not vLLM's worker.

One line per check, ``PASS``/``FAIL``/``SKIP`` and its figures, then a summary line. Exit status 0
when every check that ran passed (or when there is no CUDA device: one SKIP line says so and
nothing runs), 1 when one failed, 3 when the watchdog fired.

1. Bandwidth: the reference engine's CUDA-event-timed ``cpu->gpu`` and ``gpu->cpu`` copies
   (``kvscope.engine.transfers.Copier``) against torch's own pinned-memory copy of the same bytes,
   timed the same way (best of ``--repeat``); ratio >= 0.8 passes. Then scattered slots on both of
   the engine's copy paths (a copy per run, one kernel through the pinned pool's CUDA view): the
   bytes must land in the right rows.
2. The GPU collector (``kvscope.agent.collectors.gpu``) on the real NVML, no stand-in:
   - memory: NVML's total within 2% of CUDA's; NVML's used grows by a 1 GiB allocation.
   - memory budget: a 256 MiB "KV cache" in two views, reported as vLLM's worker tap reports
     it, names this GPU by NVML's PCI address, counts 256 MiB once, and its parts add up to
     NVML's total.
   - PCIe bytes, per direction: the reference engine copies a known number of bytes (about
     ``--pcie-seconds`` of back-to-back copies) while a thread reads the collector continuously;
     ``kvscope_pcie_bytes_total`` (the exported samples, ``kvscope.agent.collectors.metrics``) must grow by
     that many bytes within the counters' granularity. Host->device is the GPU's ``rx``.
     With NVML's cumulative byte counters (``NVML_FI_DEV_PCIE_COUNT_{TX,RX}_BYTES``) nothing is
     sampled: 0.99 to 1.5 x the payload. Below 1 only a count missing bytes can fall (1% for a
     driver that updates the count lazily; reads continue 0.5 s after the copies end). Above:
     the counters count bytes on the link, and each TLP adds about 20-26 bytes of header and
     framing to at most 256 bytes of payload, and host-memory reads come back as completions
     of 64-128 bytes (up to 1.34 x at 64), besides flow-control and other traffic.
     With the throughput fallback (``nvmlDeviceGetPcieThroughput``: a rate measured over 20 ms
     at each read, which the collector multiplies by the time since its previous read) the
     estimate is off by up to one read interval of copying at each end of the copy window, so
     the bounds widen by 2 x the longest interval between reads / the copy window, and 2% more
     below for the rate's fluctuation within an interval.
   - link: generation and width read from the device during the copies, kvscope's one-direction
     maximum from them; the generation must be one kvscope knows and the copy bandwidth measured
     in that window at most 1.05 x that maximum. NVML's maximum generation and width and its
     own link speed are printed beside it. SKIP when NVML reports no link.
3. The tap's worker path: kvscope's ``WorkerObserver`` (``kvscope.agent.taps.worker_events``,
   the job bookkeeping and result-to-event mapping of ``kvscope.agent.taps.vllm.TapWorker``)
   turns a worker's ``TransferResult(transfer_size, transfer_time)`` into ``Transfer`` events.
   The worker here (``EventTimedWorker``) times its jobs as vLLM 0.33's CUDA worker does
   (``vllm/v1/kv_offload/cpu/gpu_worker.py``, ``SingleDirectionOffloadingHandler``): a stream
   per job that waits for the current stream and the previous job, a start event, the blocks'
   copies, an end event; ``transfer_time`` = start.elapsed_time(end) / 1e3, ``transfer_size`` =
   bytes copied. It stores blocks to pinned host memory and loads them back into other GPU
   blocks; events go through kvscope's real ``Emitter`` over ZMQ and are decoded as the agent
   decodes them. Checked: the bytes arrive intact; one ``Transfer`` per job whose bytes, blocks
   and duration are the worker's; the duration within the wall time around the job and not
   faster than 1.1 x torch's pinned copy; no tap error counted. Not exercised there: only
   ``TapWorker``'s thin vLLM-subclass shell (its module imports vLLM, absent there), which
   calls the worker and then the observer; ``ObservedWorker`` stands in for it, calling the
   observer the same way. Where vLLM imports (this script's tests in the vLLM environments)
   the check wraps the worker in ``TapWorker`` itself.

Options: ``--mib`` bytes per copy (512), ``--block-kib`` block size (2048), ``--repeat`` (5),
``--pcie-seconds`` copy window per direction (2), ``--budget`` watchdog seconds (300),
``--wheels DIR`` (default ``.gpu-wheels`` at the repository root; ``''`` installs none),
``--imports-only``: install the wheels, import what the checks import, check that nothing else
outside the standard library and torch came with it, and exit; ``--tap-on-cpu``: check 3 alone,
on the CPU with the host clock, and exit (both run without CUDA: tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GB = 1e9
MiB = 2**20
# What the checks import, and the only modules outside the standard library (besides torch and
# what torch brings) that may come with them: the wheels of bench/gpu_wheels.sh.
CHECK_MODULES = ("kvscope.events", "kvscope.agent.taps.emitter",
                 "kvscope.agent.taps.worker_events", "kvscope.engine.tier",
                 "kvscope.engine.transfers", "kvscope.agent.collectors.gpu",
                 "kvscope.agent.collectors.metrics", "kvscope.agent.memory_budget",
                 "kvscope.agent.taps.memory_report", "pynvml")
WHEEL_MODULES = {"msgspec": "msgspec", "zmq": "pyzmq", "psutil": "psutil", "pynvml": "nvidia-ml-py"}
# pyzmq is built with Cython; __mp_main__: multiprocessing's alias of __main__ (the emitter's
# exit hook is multiprocessing's)
ALLOWED_EXTRA = {"kvscope", "typing_extensions", "cython_runtime", "__mp_main__"}


# ---- reporting and set-up -----------------------------------------------------------------------

class Report:
    """Prints one line per check and counts the verdicts."""

    def __init__(self) -> None:
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}

    def __call__(self, status: str, check: str, text: str) -> None:
        self.counts[status] += 1
        print(f"{status} {check}: {text}", flush=True)

    def guard(self, check: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``; an exception becomes a FAIL line (the other checks run on)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self("FAIL", check, f"raised {type(exc).__name__}: {exc} "
                 f"({Path(where.filename).name}:{where.lineno})")
            return None

    def summary(self) -> str:
        c = self.counts
        return f"gpu_check: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped"


def start_watchdog(seconds: float) -> None:
    """Ends the process with a FAIL line after ``seconds``, whatever is running (status 3)."""
    def fire():
        print(f"FAIL gpu_check: still running after {seconds:.0f} s (--budget): stopped",
              flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def install_wheels(folder: Path) -> str:
    """Install every wheel in ``folder`` into a new temporary directory, put it first on
    ``sys.path``; returns what was done. pip with ``--no-index``; where pip cannot run, the
    wheels are unpacked (a wheel is a zip archive laid out as installed)."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return f"no wheels in {folder}: using the installed packages"
    target = Path(tempfile.mkdtemp(prefix="kvscope-gpu-check-"))
    atexit.register(shutil.rmtree, target, True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--disable-pip-version-check", "--target", str(target),
           *map(str, wheels)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        how = "pip --no-index"
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", None) or "").strip().splitlines()[-1:] or [
            f"{type(exc).__name__}, exit status {getattr(exc, 'returncode', '?')}"]
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        how = f"unpacked: pip failed ({detail[0]})"
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    return f"{len(wheels)} wheels from {folder} into {target} ({how})"


def import_surface() -> tuple[dict[str, str], list[str]]:
    """Import what the checks import -> ({distribution: version and where from}, problems):
    a compiled kvscope module loaded, or a module outside the standard library, torch's and the
    wheels' set."""
    from importlib.metadata import PackageNotFoundError, version

    before = set(sys.modules)
    for name in CHECK_MODULES:
        importlib.import_module(name)
    problems = []
    for name in set(sys.modules) - before:
        top = name.split(".")[0]
        if (top in sys.stdlib_module_names or top in WHEEL_MODULES or top in ALLOWED_EXTRA
                or top.startswith("_cython_") or top.startswith("torch")):
            continue
        problems.append(f"{name} (not carried)")
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name.startswith("kvscope") and not path.endswith(".py"):
            problems.append(f"{name} is compiled ({Path(path).name}): not built there")
    found = {}
    for top, dist in WHEEL_MODULES.items():
        try:
            ver = version(dist)
        except PackageNotFoundError:
            ver = "?"
        path = Path(sys.modules[top].__file__) if top in sys.modules else None
        where = path.parent.parent if path and path.name == "__init__.py" else path and path.parent
        found[dist] = f"{ver} ({where})" if where else f"{ver} (not imported)"
    return found, sorted(set(problems))


# ---- 1. the reference engine's copies ------------------------------------------------------------

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
        pool.data.copy_(torch.randint(-2048, 2048, (rows, elems), dtype=torch.int16,
                                      device=pool.data.device))
    return host, dev


def engine_timed(copier, src, src_slots, dst, dst_slots, repeat: int) -> float:
    """Best seconds of the reference engine's copy, read from the CUDA events it records."""
    best = float("inf")
    for _ in range(repeat):
        _, (begin, end) = copier.copy(src, src_slots, dst, dst_slots)
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    return best


def bandwidth(report, torch, host, dev, repeat: int) -> dict[str, float]:
    """Reference engine vs torch, both directions, contiguous slots -> torch's bytes/s per
    direction."""
    from kvscope.engine.transfers import Copier

    nbytes = host.data.numel() * host.data.element_size()
    copier = Copier(cuda=True)
    slots = list(range(host.data.shape[0]))
    measured = {}
    for name, src, dst in (("cpu->gpu", host, dev), ("gpu->cpu", dev, host)):
        torch_s = cuda_timed(torch, lambda: dst.data.copy_(src.data, non_blocking=True), repeat)
        engine_s = engine_timed(copier, src, slots, dst, slots, repeat)
        ratio = torch_s / engine_s
        measured[name] = nbytes / torch_s
        report("PASS" if ratio >= 0.8 else "FAIL", f"engine {name} bandwidth",
               f"reference engine {nbytes / engine_s / GB:.1f} GB/s (its CUDA events), torch "
               f"pinned copy {nbytes / torch_s / GB:.1f} GB/s, ratio {ratio:.2f} (goal >= 0.8); "
               f"{nbytes // MiB} MiB, best of {repeat}")
    return measured


def scattered_copies(report, torch, blocks: int, repeat: int) -> None:
    """The reference engine's scattered-slot copies, both directions, on both of its paths (a
    copy per run at or above ``DIRECT_RUN_BYTES``, one kernel through the host pool's
    ``cuda_view`` below it): the copied rows land in the right slots and no other row
    changes; GB/s printed against torch's contiguous copy of as many bytes."""
    from kvscope.engine.transfers import DIRECT_RUN_BYTES, Copier

    copier = Copier(cuda=True)
    src_slots = list(range(0, 2 * blocks, 2))  # every other row, written in reverse order
    dst_slots = list(range(2 * blocks - 1, 0, -2))
    for block_bytes in (DIRECT_RUN_BYTES // 32, DIRECT_RUN_BYTES // 4, 2 * DIRECT_RUN_BYTES):
        path = "kernel" if block_bytes < DIRECT_RUN_BYTES else "per run"
        check = f"engine scattered ({path}, {block_bytes >> 10} KiB blocks)"
        host, dev = pools(torch, 2 * blocks, block_bytes)
        if host.cuda_view(dev.data.device) is None:
            report("FAIL", check, "the pinned host pool has no cuda_view: CUDA will not address it")
            continue
        contiguous = cuda_timed(
            torch, lambda d=dev, h=host: d.data[:blocks].copy_(h.data[:blocks], non_blocking=True),
            repeat)
        lines = []
        intact_all = True
        for name, src, dst in (("cpu->gpu", host, dev), ("gpu->cpu", dev, host)):
            expected = dst.data.cpu().clone()  # .cpu() of a host tensor is itself
            expected[dst_slots] = src.data[src_slots].cpu()
            seconds = engine_timed(copier, src, src_slots, dst, dst_slots, repeat)
            intact = torch.equal(dst.data.cpu(), expected)
            intact_all &= intact
            lines.append(f"{name} {blocks * block_bytes / seconds / GB:.1f} GB/s (ratio "
                         f"{contiguous / seconds:.2f} to torch contiguous), bytes "
                         f"{'intact' if intact else 'WRONG'}")
        report("PASS" if intact_all else "FAIL", check, f"{blocks} blocks; " + "; ".join(lines))
        del host, dev


# ---- 2. the GPU collector on the real NVML -------------------------------------------------------

def nvml_index(pynvml, torch, readings) -> str:
    """The NVML index of CUDA device 0: by UUID, else the GPU whose memory total is CUDA's."""
    try:
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        for i in range(pynvml.nvmlDeviceGetCount()):
            nvml_uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            nvml_uuid = nvml_uuid.decode() if isinstance(nvml_uuid, bytes) else nvml_uuid
            if nvml_uuid.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
                return str(i)
    except Exception:  # an older torch without uuid, or NVML without it: fall back
        pass
    _, total = torch.cuda.mem_get_info()
    return min(readings.gpus, key=lambda g: abs(g.memory_total_bytes - total)).gpu


def pcie_total(reading, gpu: str, direction: str) -> float | None:
    """``kvscope_pcie_bytes_total{gpu, direction}`` as kvscope exports it from ``reading``."""
    from kvscope.agent.collectors.base import CollectorResult
    from kvscope.agent.collectors.metrics import collector_samples
    from kvscope.catalog import PCIE_BYTES

    samples = collector_samples({"gpu": CollectorResult(True, 0.0, reading)})
    for values, value in samples[PCIE_BYTES]:
        named = dict(zip(PCIE_BYTES.labels, values))
        if named["gpu"] == gpu and named["direction"] == direction:
            return value
    return None


class Sampler(threading.Thread):
    """Reads the collector again and again (``period`` apart) -> ``samples``: (monotonic time
    the read returned, reading)."""

    def __init__(self, collector, period: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.collector, self.period = collector, period
        self.samples: list = []
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                reading = self.collector.collect()
            except BaseException as exc:
                self.error = exc
                return
            self.samples.append((time.monotonic(), reading))
            self.halt.wait(self.period)

    def wait_for(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.samples) < count and self.error is None and time.monotonic() < deadline:
            time.sleep(0.002)
        if self.error is not None:
            raise self.error
        if len(self.samples) < count:
            raise TimeoutError(f"the collector answered {len(self.samples)} reads in {timeout} s")

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        if self.error is not None:
            raise self.error


def pcie_window(collector, gpu: str, copy_once, copies: int, settle: float = 0.5):
    """Read ``collector`` continuously while ``copy_once()`` runs ``copies`` times back to back
    (it returns a CUDA event recorded after its copy; the last one is waited on) -> dict of the
    totals before/after, the copy window, the longest gap between reads, the readings in it."""
    sampler = Sampler(collector)
    sampler.start()
    try:
        sampler.wait_for(3)
        first = len(sampler.samples)
        t0 = time.monotonic()
        end = None
        for _ in range(copies):
            end = copy_once()
        end.synchronize()
        t1 = time.monotonic()
        time.sleep(settle)
        sampler.wait_for(len(sampler.samples) + 2)
    finally:
        sampler.stop()
    samples = sampler.samples[first - 1:]  # from the last read completed before the copies
    times = [t for t, _ in samples]
    during = [r for t, r in samples if t0 <= t <= t1] or [samples[len(samples) // 2][1]]
    return {"before": samples[0][1], "after": samples[-1][1], "t0": t0, "t1": t1,
            "gap": max(b - a for a, b in zip(times, times[1:])), "reads": len(samples),
            "during": during[len(during) // 2]}


def pcie_tolerance(source_before, source_after, gap: float, window: float):
    """(low, high, why) for the ratio of counted bytes to copied bytes (see the docstring)."""
    if source_before == source_after == "counter":
        return 0.99, 1.5, "NVML byte counter"
    slack = 2 * gap / window
    return (1 - slack - 0.02, 1.5 + slack,
            f"throughput x interval estimate ({source_before}/{source_after}); longest gap "
            f"between reads {gap * 1e3:.0f} ms over a {window:.2f} s window")


def nvml_checks(report, torch, host, dev, measured: dict[str, float], seconds: float) -> None:
    """Memory, PCIe bytes per direction and the link, on the real NVML (see the docstring)."""
    import pynvml

    from kvscope.agent.collectors.base import CollectorError
    from kvscope.agent.collectors.gpu import PCIE_GENERATIONS, GpuCollector
    from kvscope.engine.transfers import Copier

    collector = GpuCollector()
    try:
        first = collector.collect()
    except CollectorError as exc:
        report("FAIL", "nvml", f"the GPU collector cannot read the real driver: {exc}")
        return
    try:
        gpu = nvml_index(pynvml, torch, first)
        report.guard("nvml memory", nvml_memory, report, torch, collector, gpu)
        report.guard("memory budget", memory_budget, report, torch, collector, gpu)
        nbytes = host.data.numel() * host.data.element_size()
        slots = list(range(host.data.shape[0]))
        copier = Copier(cuda=True)
        windows = {}
        for direction, name, src, dst in (("rx", "cpu->gpu", host, dev),
                                          ("tx", "gpu->cpu", dev, host)):
            rate = measured.get(name) or 20 * GB  # torch's, from check 1, or a guess
            copies = max(4, min(4000, math.ceil(seconds * rate / nbytes)))
            windows[direction] = report.guard(
                f"pcie {direction}", pcie_direction, report, collector, gpu, direction, name,
                lambda src=src, dst=dst: copier.copy(src, slots, dst, slots)[1][1],
                copies, nbytes)
        report.guard("pcie link", pcie_link, report, pynvml, PCIE_GENERATIONS, gpu, windows, nbytes)
    finally:
        collector.shutdown()


def nvml_memory(report, torch, collector, gpu: str) -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the allocation below must reach the driver, not torch's cache
    device = next(g for g in collector.collect().gpus if g.gpu == gpu)
    free, total = torch.cuda.mem_get_info()
    size = 1 << 30
    block = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    grown = next(g for g in collector.collect().gpus if g.gpu == gpu)
    growth = grown.memory_used_bytes - device.memory_used_bytes
    del block
    torch.cuda.empty_cache()
    ok = (abs(device.memory_total_bytes - total) <= 0.02 * total
          and 0.9 * size <= growth <= 1.5 * size + 2**29)
    report("PASS" if ok else "FAIL", "nvml memory",
           f"gpu {gpu}: NVML total {device.memory_total_bytes / 2**30:.1f} GiB, CUDA "
           f"{total / 2**30:.1f} GiB (within 2%); NVML used {device.memory_used_bytes / 2**30:.2f}"
           f" GiB (CUDA {(total - free) / 2**30:.2f}), grew {growth / MiB:.0f} MiB for a "
           f"{size // MiB} MiB allocation (0.9..1.5 x + 512 MiB)")


def memory_budget(report, torch, collector, gpu: str) -> None:
    """The GPU memory budget's path on the real device: a 256 MiB "KV cache" handed over as
    two views of one allocation, as vLLM's worker tap reports it
    (``kvscope.agent.taps.memory_report.gpu_reports``), must name this GPU by the PCI address
    the GPU collector reads from NVML, count the allocation once (kv_cache 256 MiB), carry
    torch's ``memory_allocated`` (at least the KV cache), and its parts
    (``kvscope.agent.memory_budget``) must add up to NVML's total."""
    from kvscope import catalog
    from kvscope.agent.memory_budget import memory_samples
    from kvscope.agent.taps.memory_report import gpu_reports

    size = 256 * MiB
    kv = torch.empty(size, dtype=torch.uint8, device="cuda")
    try:
        torch.cuda.synchronize()
        reports = gpu_reports([kv[: size // 2], kv[size // 2:]], time.time())
        reading = collector.collect()
        device = next(g for g in reading.gpus if g.gpu == gpu)
        mine = [r for r in reports if r.device == device.pci_bus_id]
        parts = {labels[1]: value for labels, value in memory_samples(None, reading, {
            ("gpu_check", r.device): {"kv_cache": r.kv_cache, "allocated": r.allocated}
            for r in reports})[catalog.GPU_MEMORY_PART_BYTES] if labels[0] == gpu}
    finally:
        del kv
        torch.cuda.empty_cache()
    ok = (len(reports) == 1 and len(mine) == 1 and mine[0].kv_cache == size
          and mine[0].allocated >= size and parts.get("kv_cache") == size
          and abs(sum(parts.values()) - device.memory_total_bytes) <= 1)
    report("PASS" if ok else "FAIL", "memory budget",
           f"gpu {gpu}: reports {[(r.device, r.kv_cache, r.allocated) for r in reports]}, NVML's "
           f"PCI address {device.pci_bus_id}; parts {{{', '.join(f'{k}: {v / MiB:.0f} MiB' for k, v in parts.items())}}} "
           f"add up to {sum(parts.values()) / MiB:.0f} of {device.memory_total_bytes / MiB:.0f} MiB")


def pcie_direction(report, collector, gpu: str, direction: str, name: str, copy_once,
                   copies: int, nbytes: int):
    check = f"pcie {direction} ({'host->device' if direction == 'rx' else 'device->host'})"
    w = pcie_window(collector, gpu, copy_once, copies)
    other = "tx" if direction == "rx" else "rx"
    before, after = (pcie_total(w[k], gpu, direction) for k in ("before", "after"))
    window = w["t1"] - w["t0"]
    payload = copies * nbytes
    head = (f"reference engine copied {copies} x {nbytes // MiB} MiB = {payload / 2**30:.1f} GiB "
            f"{name} in {window:.2f} s ({payload / window / GB:.1f} GB/s)")
    if before is None or after is None:
        report("SKIP", check, f"{head}; kvscope_pcie_bytes_total{{direction=\"{direction}\"}} "
               "absent: NVML answers neither its PCIe byte counters nor its throughput here")
        return w
    sources = [(next(g for g in w[k].gpus if g.gpu == gpu).pcie_source or {}).get(direction)
               for k in ("before", "after")]
    low, high, why = pcie_tolerance(*sources, w["gap"], window)
    if high - low > 1.0:  # reads too sparse for this window: the bounds would say nothing
        report("FAIL", check, f"{head}; {why}: too few reads to bound the estimate (raise "
               "--pcie-seconds)")
        return w
    ratio = (after - before) / payload
    o_before, o_after = (pcie_total(w[k], gpu, other) for k in ("before", "after"))
    crossed = ("" if o_before is None or o_after is None
               else f"; {other} grew {(o_after - o_before) / MiB:.0f} MiB meanwhile")
    report("PASS" if low <= ratio <= high else "FAIL", check,
           f"{head}; kvscope_pcie_bytes_total{{gpu=\"{gpu}\",direction=\"{direction}\"}} grew "
           f"{(after - before) / 2**30:.2f} GiB = {ratio:.3f} x the payload (allowed "
           f"{low:.3f}..{high:.3f}: {why}); {w['reads']} reads{crossed}")
    w["bandwidth"] = payload / window
    return w


def pcie_link(report, pynvml, generations, gpu: str, windows, nbytes: int) -> None:
    w = windows.get("rx") or windows.get("tx")
    if w is None:
        report("SKIP", "pcie link", "no copy window was read (see the pcie lines)")
        return
    device = next(g for g in w["during"].gpus if g.gpu == gpu)
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(gpu))
    extra = []
    for label, fn in (("NVML max gen", "nvmlDeviceGetMaxPcieLinkGeneration"),
                      ("max width", "nvmlDeviceGetMaxPcieLinkWidth"),
                      ("link max speed", "nvmlDeviceGetPcieLinkMaxSpeed"),
                      ("current speed", "nvmlDeviceGetPcieSpeed")):
        try:
            extra.append(f"{label} {getattr(pynvml, fn)(handle)}")
        except Exception as exc:  # absent from this binding or driver: print what it says
            extra.append(f"{label} n/a ({type(exc).__name__})")
    text = (f"gpu {gpu} during the copies: PCIe gen {device.link_generation} "
            f"x{device.link_width}, kvscope's link max "
            f"{(device.link_max_bytes_per_second or 0) / GB:.1f} GB/s per direction; "
            + ", ".join(extra))
    if device.link_generation is None or device.link_width is None:
        report("SKIP", "pcie link", f"{text}; NVML reports no link generation or width here")
        return
    fastest = max(x.get("bandwidth", 0.0) for x in windows.values() if x)
    ok = (device.link_generation in generations and device.link_width > 0
          and device.link_max_bytes_per_second is not None
          and fastest <= 1.05 * device.link_max_bytes_per_second)
    report("PASS" if ok else "FAIL", "pcie link",
           f"{text}; fastest copy window {fastest / GB:.1f} GB/s (at most 1.05 x the link max)")


# ---- 3. the tap's worker path --------------------------------------------------------------------

@dataclass(frozen=True)
class BlockSpec:
    """One side of a job: its block ids (vLLM's ``LoadStoreSpec``s carry ``block_ids`` too)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Result:
    """vLLM's ``TransferResult`` fields (``vllm/v1/kv_offload/base.py``)."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


@dataclass
class _Job:
    job_id: int
    nbytes: int
    start: object = None  # CUDA events, or None
    end: object = None
    seconds: float | None = None  # host timing, without CUDA


class EventTimedWorker:
    """vLLM's ``OffloadingWorker`` interface over a GPU KV tensor ``gpu`` and a pinned host
    tensor ``cpu`` (rows are blocks), timing each job as vLLM 0.33's CUDA worker does (see the
    docstring, check 3). Without CUDA (this script's own tests) the copies run synchronously,
    timed with ``perf_counter``."""

    def __init__(self, torch, gpu, cpu) -> None:
        self.torch, self.gpu, self.cpu = torch, gpu, cpu
        self.cuda = gpu.is_cuda
        self._jobs: deque[_Job] = deque()
        self._pending: dict[int, _Job] = {}

    def _transfer(self, job_id: int, src, src_spec, dst, dst_spec) -> bool:
        pairs = list(zip(src_spec.block_ids, dst_spec.block_ids))
        job = _Job(job_id, len(pairs) * src.shape[1] * src.element_size())
        torch = self.torch
        if not self.cuda:
            t0 = time.perf_counter()
            for s, d in pairs:
                dst[d].copy_(src[s])
            job.seconds = time.perf_counter() - t0
        else:
            stream = torch.cuda.Stream()
            job.start = torch.cuda.Event(enable_timing=True)
            job.end = torch.cuda.Event(enable_timing=True)
            stream.wait_stream(torch.cuda.current_stream())
            if self._jobs:
                stream.wait_event(self._jobs[-1].end)
            with torch.cuda.stream(stream):
                job.start.record(stream)
                for s, d in pairs:  # one async copy per block, as ops.swap_blocks_batch issues
                    dst[d].copy_(src[s], non_blocking=True)
                job.end.record(stream)
        self._jobs.append(job)
        self._pending[job_id] = job
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._transfer(job_id, self.gpu, src_spec, self.cpu, dst_spec)

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        return self._transfer(job_id, self.cpu, src_spec, self.gpu, dst_spec)

    def get_finished(self) -> list[Result]:
        results = []
        while self._jobs and (self._jobs[0].end is None or self._jobs[0].end.query()):
            job = self._jobs.popleft()
            self._pending.pop(job.job_id, None)
            seconds = (job.seconds if job.end is None
                       else job.start.elapsed_time(job.end) * 1e-3)  # elapsed_time: ms
            results.append(Result(job.job_id, True, job.nbytes, seconds))
        return results

    def wait(self, job_ids) -> None:
        for job_id in job_ids:
            job = self._pending.get(job_id)
            if job is not None and job.end is not None:
                job.end.synchronize()

    def shutdown(self) -> None:
        for job in self._jobs:
            if job.end is not None:
                job.end.synchronize()


class ObservedWorker:
    """Where ``kvscope.agent.taps.vllm`` does not import (no vLLM): ``inner`` observed by
    kvscope's own :class:`~kvscope.agent.taps.worker_events.WorkerObserver`, called as
    ``TapWorker``, its vLLM-subclass shell, calls it (a store's GPU side is its source, a load's
    its destination). Only that shell is this script's."""

    def __init__(self, inner, emitter) -> None:
        from kvscope.agent.taps.worker_events import WorkerObserver

        self.inner, self._emitter = inner, emitter
        self.observer = WorkerObserver(emitter.emit)

    @property
    def errors(self) -> int:
        return self.observer.errors

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        ok = self.inner.submit_store(job_id, src_spec, dst_spec)
        self.observer.submitted(job_id, "gpu", "cpu", src_spec)
        return ok

    def submit_load(self, job_id, src_spec, dst_spec, *args, **kwargs) -> bool:
        ok = self.inner.submit_load(job_id, src_spec, dst_spec, *args, **kwargs)
        self.observer.submitted(job_id, "cpu", "gpu", dst_spec)
        return ok

    def get_finished(self):
        results = self.inner.get_finished()
        self.observer.finished(results)
        return results

    def wait(self, job_ids) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            self._emitter.close()


def tap_wrapper():
    """(wrapper class, its description): kvscope's TapWorker where vLLM imports (this script's
    tests in the vLLM environments), else kvscope's WorkerObserver in this script's shell."""
    try:
        from kvscope.agent.taps.vllm import TapWorker
    except ImportError:
        return ObservedWorker, "kvscope's WorkerObserver (no vLLM: not TapWorker's shell)"
    return TapWorker, "kvscope's TapWorker"


def tap_worker(report, torch, device: str, blocks: int, block_bytes: int,
               torch_rate: dict[str, float]) -> None:
    """Check 3 (see the docstring). ``device``: "cuda", or "cpu" for this script's own test;
    ``torch_rate``: torch's bytes/s per direction from check 1 (bound on the measured time)."""
    import zmq

    from kvscope import events as ev
    from kvscope.agent.taps.emitter import Emitter

    wrapper, how = tap_wrapper()
    folder = tempfile.mkdtemp(prefix="kvscope-gpu-check-")
    atexit.register(shutil.rmtree, folder, True)
    endpoint = f"ipc://{folder}/tap.sock"
    sink = zmq.Context.instance().socket(zmq.PULL)
    sink.bind(endpoint)
    half = blocks // 2
    gpu = torch.randint(-128, 127, (2 * half, block_bytes), dtype=torch.int8, device=device)
    cpu = torch.zeros((half, block_bytes), dtype=torch.int8,
                      pin_memory=device == "cuda")
    inner = EventTimedWorker(torch, gpu, cpu)
    emitter = Emitter(endpoint, source="vllm-worker", scope="vllm")
    worker = wrapper(inner, emitter)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    jobs = {}
    chunks = BlockSpec(tuple(range(half)))
    for job_id, route, submit, src_spec, dst_spec in (
            (1, "gpu->cpu", worker.submit_store, BlockSpec(tuple(range(half))), chunks),
            (2, "cpu->gpu", worker.submit_load, chunks, BlockSpec(tuple(range(half, 2 * half))))):
        sync()
        w0 = time.perf_counter()
        submit(job_id, src_spec, dst_spec)
        worker.wait({job_id})
        wall = time.perf_counter() - w0
        results = []
        deadline = time.monotonic() + 10
        while not results and time.monotonic() < deadline:
            results = worker.get_finished()
            time.sleep(0.0005)
        jobs[route] = (wall, results)
        if route == "gpu->cpu":
            intact = {route: torch.equal(cpu, gpu[:half].cpu())}
    intact["cpu->gpu"] = torch.equal(gpu[:half], gpu[half:])
    worker.shutdown()  # closes the emitter: its last batch is marked final
    received, final = [], False
    deadline = time.monotonic() + 10
    while not final and time.monotonic() < deadline:
        if sink.poll(50):
            batch = ev.decode_batch(sink.recv())
            received += batch.events
            final = batch.final
    sink.close(0)
    transfers = [e for e in received if isinstance(e, ev.Transfer)]
    clock = "CUDA events" if device == "cuda" else "host clock"
    for route, (wall, results) in jobs.items():
        check = f"tap worker {route}"
        src, dst = route.split("->")
        events = [t for t in transfers if (t.src, t.dst) == (src, dst)]
        if len(results) != 1 or len(events) != 1:
            report("FAIL", check, f"{len(results)} results from the worker, {len(events)} "
                   f"Transfer events (want 1 and 1) via {how}")
            continue
        result, event = results[0], events[0]
        nbytes = half * block_bytes
        rate = torch_rate.get(route)
        problems = []
        if (event.bytes, event.blocks) != (result.transfer_size, half) or nbytes != event.bytes:
            problems.append(f"event bytes/blocks {event.bytes}/{event.blocks}, worker "
                            f"{result.transfer_size}, copied {nbytes}/{half}")
        if event.duration != result.transfer_time or not (event.timed and event.ok):
            problems.append(f"event duration {event.duration!r} timed={event.timed} "
                            f"ok={event.ok}, worker {result.transfer_time!r}")
        if not 0 < event.duration <= wall:
            problems.append(f"duration {event.duration * 1e3:.3f} ms outside (0, wall "
                            f"{wall * 1e3:.3f} ms]")
        if rate and nbytes / event.duration > 1.1 * rate:
            problems.append(f"faster than 1.1 x torch's pinned copy ({rate / GB:.1f} GB/s)")
        if not intact[route]:
            problems.append("copied bytes differ")
        report("FAIL" if problems else "PASS", check,
               f"{half} blocks of {block_bytes >> 10} KiB = {nbytes / MiB:.1f} MiB in "
               f"{event.duration * 1e3:.2f} ms ({clock}"
               f", {nbytes / event.duration / GB:.1f} GB/s"
               + (f"; torch {rate / GB:.1f}" if rate else "") + f"), wall {wall * 1e3:.2f} ms; "
               f"Transfer event via {how}, Emitter, ZMQ and decode_batch: bytes, blocks, duration "
               f"{'equal' if not problems else 'see'} the worker's; bytes "
               f"{'intact' if intact[route] else 'WRONG'}"
               + (f"; {'; '.join(problems)}" if problems else ""))
    if worker.errors:
        report("FAIL", "tap worker errors", f"{worker.errors} counted by {how}")


# ---- main ----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes moved per copy, MiB")
    parser.add_argument("--block-kib", type=int, default=2048, help="block size, KiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pcie-seconds", type=float, default=2.0,
                        help="seconds of copies per direction for the PCIe byte counters")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds before the watchdog stops everything (exit 3)")
    parser.add_argument("--wheels", default=str(ROOT / ".gpu-wheels"),
                        help="folder of wheels to install first ('' for none)")
    parser.add_argument("--imports-only", action="store_true",
                        help="install the wheels, import what the checks import, and exit")
    parser.add_argument("--tap-on-cpu", action="store_true",
                        help="this script's own test: check 3 on the CPU (host clock), then exit")
    args = parser.parse_args(argv)
    start_watchdog(args.budget)
    report = Report()
    started = time.monotonic()

    if not (args.imports_only or args.tap_on_cpu):
        try:
            import torch
        except ImportError as exc:
            print(f"SKIP gpu_check: torch does not import ({exc}): no CUDA here, nothing checked")
            return 0
        if not torch.cuda.is_available():
            print(f"SKIP gpu_check: no CUDA device (torch {torch.__version__} sees none; "
                  f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
                  "nothing checked; run it on a GPU machine")
            return 0
    done = install_wheels(Path(args.wheels)) if args.wheels else "no wheels asked for"
    if args.tap_on_cpu:
        import torch

        report.guard("tap worker", tap_worker, report, torch, "cpu", 16, 64 << 10, {})
        print(report.summary())
        return 1 if report.counts["FAIL"] else 0
    try:
        found, problems = import_surface()
    except Exception as exc:
        report("FAIL", "imports", f"{type(exc).__name__}: {exc}; wheels: {done}")
        print(report.summary())
        return 1
    report("FAIL" if problems else "PASS", "imports",
           f"python {sys.version.split()[0]}; " + ", ".join(f"{k} {v}" for k, v in found.items())
           + f"; {done}" + (f"; PROBLEMS: {', '.join(problems)}" if problems else
                            "; no compiled kvscope module, nothing uncarried"))
    if args.imports_only:
        print(report.summary())
        return 1 if report.counts["FAIL"] else 0

    import pynvml
    import torch

    try:
        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception as exc:
        driver = f"unknown ({type(exc).__name__}: {exc})"
    print(f"device: {torch.cuda.get_device_name(0)}, driver {driver}, torch {torch.__version__}"
          f" (CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPU(s)", flush=True)
    block_bytes = args.block_kib << 10
    blocks = max(2, (args.mib << 20) // block_bytes)
    made = report.guard("engine pools", pools, torch, blocks, block_bytes)
    if made is None:
        print(report.summary(), flush=True)
        return 1
    host, dev = made
    measured = report.guard("engine bandwidth", bandwidth, report, torch, host, dev,
                            args.repeat) or {}
    report.guard("engine scattered", scattered_copies, report, torch, 128, args.repeat)
    report.guard("nvml", nvml_checks, report, torch, host, dev, measured, args.pcie_seconds)
    del host, dev
    torch.cuda.empty_cache()
    report.guard("tap worker", tap_worker, report, torch, "cuda", blocks, block_bytes, measured)
    print(f"{report.summary()} in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if report.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
