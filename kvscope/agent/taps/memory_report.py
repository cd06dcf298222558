"""What an engine's tap tells the agent about the engine's memory: the facts behind the memory
budget breakdown (docs/collectors.md, "Memory budgets"), as
:class:`~kvscope.events.EngineMemory` events.

- host: the KV offload budget as the engine's configuration gives it (vLLM's
  ``cpu_bytes_to_use``: :func:`offload_budget`), so the operator types it once, in vLLM;
- GPU: per device, the bytes of the KV cache tensors the engine hands over and what its
  allocator had in use then (:func:`gpu_reports`), matched to NVML's device by PCI address.

A fact the engine does not give is left out, never sent as 0. :class:`MemoryReporter` sends the
reports at once and again every :data:`REFRESH_SECONDS` from the emitter's thread, so an agent
restarted meanwhile learns them. Imports only the standard library, msgspec and (inside the
functions that read tensors) torch, as every tap module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

from kvscope import events as ev
from kvscope.errors import describe

REFRESH_SECONDS = 10.0  # as often as the tier snapshots (vllm_manager.SNAPSHOT_REFRESH)


def offload_budget(extra_config: Mapping[str, object]) -> int | None:
    """vLLM's ``cpu_bytes_to_use`` from an offloading spec's extra config, bytes, read as
    vLLM's ``CPUOffloadingSpec`` reads it (``int(value)``; ``--kv-offloading-size`` GiB arrive
    here multiplied out, possibly as a float); None when it is absent, 0, negative or no
    number (vLLM itself refuses a missing one)."""
    value = extra_config.get("cpu_bytes_to_use")
    if isinstance(value, bool):
        return None
    try:
        budget = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return budget if budget > 0 else None


def storage_bytes(tensors: Iterable) -> dict:
    """dict[torch.device, bytes]: the bytes of the storages under ``tensors``, each storage
    counted once (vLLM's KV cache tensors may be views of one allocation shared by layers)."""
    seen: set = set()
    out: dict = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        out[tensor.device] = out.get(tensor.device, 0) + int(storage.nbytes())
    return out


def pci_address(device) -> str | None:
    """A CUDA device's PCI address in sysfs form (``"0000:3b:00.0"``), from torch's device
    properties (``pci_domain_id``, ``pci_bus_id``, ``pci_device_id``; CUDA gives no PCI function,
    and a GPU is function 0); None when torch does not give them."""
    import torch

    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(not isinstance(i, int) for i in ids):
        return None
    domain, bus, dev = ids
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def _cuda_allocated(device) -> int:
    import torch

    return int(torch.cuda.memory_allocated(device))


def gpu_reports(tensors: Sequence, now: float, *,
                allocated: Callable[[object], int] = _cuda_allocated,
                address: Callable[[object], str | None] = pci_address) -> list[ev.EngineMemory]:
    """One report per CUDA device among ``tensors`` (the engine's KV cache tensors): their
    bytes (:func:`storage_bytes`) as ``kv_cache`` and ``allocated(device)`` (torch's
    ``memory_allocated``: weights, KV cache and persistent buffers, read now, when the engine
    hands the KV cache over before serving) as ``allocated``. Tensors elsewhere (vLLM's CPU
    build keeps its KV cache in host memory) and devices without a PCI address make none."""
    out = []
    for device, size in storage_bytes(tensors).items():
        if getattr(device, "type", None) != "cuda":
            continue
        bus = address(device)
        if bus is not None:
            out.append(ev.EngineMemory(ts=now, device=bus, kv_cache=size,
                                       allocated=allocated(device)))
    return out


class MemoryReporter:
    """Sends ``reports`` through ``emit`` now and again every ``refresh`` seconds, each with
    the time it is sent; :meth:`tick` is for the emitter's thread (its ``on_tick``), chained
    after whatever it called before (``then``). Never raises: a failure is logged once and
    counted in ``errors``."""

    def __init__(self, emit: Callable[[object], None], reports: Sequence[ev.EngineMemory], *,
                 logger: logging.Logger, then: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 refresh: float = REFRESH_SECONDS) -> None:
        self._emit = emit
        self._reports = list(reports)
        self._log = logger
        self._then = then
        self._clock = clock
        self._refresh = refresh
        self._next = float("-inf")
        self.errors = 0

    def tick(self) -> None:
        """Call the previous tick, then send the reports if they are due."""
        if self._then is not None:
            self._then()
        self.send_due()

    def send_due(self) -> None:
        """Send the reports if ``refresh`` seconds passed since they were last sent (or never
        were)."""
        try:
            now = self._clock()
            if now < self._next:
                return
            self._next = now + self._refresh
            for report in self._reports:
                self._emit(msgspec.structs.replace(report, ts=now))
        except Exception as exc:  # the tap boundary: never into the engine
            self.errors += 1
            if self.errors == 1:
                self._log.warning("kvscope tap: memory report failed (%s)",
                                  describe(exc))


def attach(emitter, reports: Sequence[ev.EngineMemory], logger: logging.Logger,
           clock: Callable[[], float] = time.time) -> MemoryReporter | None:
    """Send ``reports`` through ``emitter`` now and on its ticks from now on (chained after
    its ``on_tick``); None and nothing sent when there are none."""
    if not reports:
        return None
    reporter = MemoryReporter(emitter.emit, reports, logger=logger, then=emitter.on_tick,
                              clock=clock)
    reporter.send_due()  # now, not an interval later
    emitter.on_tick = reporter.tick
    return reporter
