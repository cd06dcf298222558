"""Host context of a rollout run: CPU load, steal and memory pressure while it ran, so that a
run disturbed by the host (a noisy neighbour, swapping) can be told from a slow arm.

A background thread samples every ``interval`` seconds with psutil: CPU busy % and steal %
(``psutil.cpu_times_percent``; steal is the time a hypervisor gave this machine's vCPUs to
others, Linux only, else not measured), available memory, swap in use, and Linux's pressure
stall information for memory (``/proc/pressure/memory``, "some" avg10: the share of the last 10
s in which some task waited for memory; kernel docs, Documentation/accounting/psi.rst), when
the kernel has it. :meth:`HostSampler.summary` gives each as mean and max over the run; what
the host does not report is None ("not measured").
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil

PSI_MEMORY = Path("/proc/pressure/memory")


def _psi_some_avg10(path: Path = PSI_MEMORY) -> float | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                fields = dict(kv.split("=") for kv in line.split()[1:])
                return float(fields["avg10"])
    except (OSError, ValueError, KeyError):
        return None
    return None


class HostSampler:
    """Samples the host while a run goes on; use as a context manager (started on enter,
    stopped on exit), then read :meth:`summary`."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self._samples: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-host", daemon=True)

    def __enter__(self) -> HostSampler:
        psutil.cpu_times_percent(interval=None)  # the first call only sets the reference
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _add(self, key: str, value: float | None) -> None:
        if value is not None:
            self._samples.setdefault(key, []).append(float(value))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            cpu = psutil.cpu_times_percent(interval=None)
            self._add("cpu_busy_percent", 100.0 - cpu.idle - getattr(cpu, "iowait", 0.0))
            self._add("cpu_steal_percent", getattr(cpu, "steal", None))
            memory = psutil.virtual_memory()
            self._add("memory_available_bytes", memory.available)
            self._add("swap_used_bytes", psutil.swap_memory().used)
            self._add("memory_pressure_some_avg10", _psi_some_avg10())

    def summary(self) -> dict[str, dict[str, float] | None]:
        """Each quantity's ``{"mean", "max", "min"}`` over the run, or None when it was not
        measured (no sample: the run was shorter than one interval, or the host lacks it)."""
        keys = ("cpu_busy_percent", "cpu_steal_percent", "memory_available_bytes",
                "swap_used_bytes", "memory_pressure_some_avg10")
        return {k: ({"mean": sum(v) / len(v), "max": max(v), "min": min(v)}
                    if (v := self._samples.get(k)) else None) for k in keys}
