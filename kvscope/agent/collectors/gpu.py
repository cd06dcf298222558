"""GPU collector: per-GPU PCIe traffic, PCIe link capacity and memory, read through NVML
(nvidia-ml-py, imported as ``pynvml``).

PCIe bytes come from NVML's cumulative field counters ``NVML_FI_DEV_PCIE_COUNT_TX_BYTES`` /
``..._RX_BYTES`` (nvml.h: "Value can be wrapped"), kept monotonic here across wraps and resets.
Where a driver lacks them, ``nvmlDeviceGetPcieThroughput`` (KB/s over a 20 ms window, nvml.h) is
integrated over the time between reads instead — an estimate. Rates per PCIe generation:
``PCIE_GENERATIONS`` and docs/collectors.md.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kvscope.agent.collectors.base import CollectorError, NoDataError, register

# generation -> (GT/s per lane, payload bits, line bits). Sources: PCI Express Base Specification
# (PCI-SIG) rev 1.0a (2.5 GT/s, 8b/10b), 2.0 (5 GT/s, 8b/10b), 3.0 (8 GT/s, 128b/130b), 4.0
# (16 GT/s, 128b/130b), 5.0 (32 GT/s, 128b/130b), 6.0 (64 GT/s PAM4, Flit mode, 1b/1b: no line
# code), 7.0 (128 GT/s PAM4, Flit mode, 1b/1b).
PCIE_GENERATIONS: dict[int, tuple[float, int, int]] = {
    1: (2.5, 8, 10), 2: (5.0, 8, 10), 3: (8.0, 128, 130), 4: (16.0, 128, 130),
    5: (32.0, 128, 130), 6: (64.0, 1, 1), 7: (128.0, 1, 1),
}
THROUGHPUT_UNIT_BYTES = 1024  # nvmlDeviceGetPcieThroughput reports "KB/s"; read as KiB/s
RESET_SLACK = 2.0  # a decrease implying more than this x the link's maximum is a reset, not a wrap
DIRECTIONS = ("tx", "rx")
DEFAULT_PCI_DEVICES = Path("/sys/bus/pci/devices")
AFFINITY_WORDS = 16  # 64-bit words of the node mask asked of NVML: nodes 0 to 1023

log = logging.getLogger(__name__)


def link_max_bytes_per_second(generation: int, width: int) -> float | None:
    """One direction's maximum PCIe bytes/s of a link: GT/s x 1e9 x payload/line bits / 8 x
    lanes, after line coding and before link-layer framing (TLP/DLLP headers, Flit CRC/FEC).
    None for an unknown generation or a non-positive width (link down or unreported)."""
    rate = PCIE_GENERATIONS.get(generation)
    if rate is None or width <= 0:
        return None
    gts, payload, line = rate
    return gts * 1e9 * payload / line / 8 * width


def advance_counter(previous: int, raw: int, bits: int,
                    max_delta: float | None) -> tuple[int, bool]:
    """Bytes moved between two raw reads of a ``bits``-wide counter -> ``(delta, reset)``.

    A decrease is a wrap (``raw + 2**bits - previous``) unless that much could not have crossed
    the link: more than ``max_delta`` bytes, or, with no bound known, a 64-bit wrap (at 64 GB/s
    one takes 9 years). Then the counter was reset (driver reload, GPU reset) and counted from 0:
    ``delta = raw``. More than one wrap between two reads cannot be seen."""
    if raw >= previous:
        return raw - previous, False
    wrapped = raw + (1 << bits) - previous
    if (max_delta is not None and wrapped > max_delta) or (max_delta is None and bits >= 64):
        return raw, True
    return wrapped, False


def sysfs_bus_id(nvml_bus_id: str) -> str | None:
    """NVML's PCI bus id (``domain:bus:device.function`` in hex, the domain in 8 digits:
    ``"00000000:3B:00.0"``) as sysfs names the device under ``/sys/bus/pci/devices``
    (``"0000:3b:00.0"``: lower case, the domain in 4 digits); None when it is no bus id."""
    try:
        domain, bus, slot = nvml_bus_id.strip().split(":")
        device, function = slot.split(".")
        return (f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}."
                f"{int(function, 16):x}")
    except ValueError:
        return None


def parse_numa_node(text: str) -> int | None:
    """A PCI device's sysfs ``numa_node`` -> the node, or None for ``-1`` (the platform ties the
    device to no node) or anything that is no node number."""
    try:
        node = int(text.strip())
    except ValueError:
        return None
    return node if node >= 0 else None


def _text(value: bytes | str) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


@dataclass(frozen=True)
class GpuDevice:
    """One GPU. ``gpu``: NVML index as a string ("0", "1", ...).
    ``pcie_tx_bytes``/``pcie_rx_bytes``: cumulative bytes the GPU sent/received over PCIe since the
    collector's first read (counter source: starting at NVML's own count), monotonic across
    wraps and resets; None when NVML offers neither source. ``pcie_source``: dict[direction,
    "counter" | "throughput"] (throughput: integrated estimate). ``link_generation``,
    ``link_width``: the current link (GPUs drop to a lower generation when idle).
    ``link_max_bytes_per_second``: that link's one-direction maximum, bytes/s, or None.
    ``link_max_generation``, ``link_max_width``: the most the link can run at.
    ``numa_node``: the host NUMA node nearest to the GPU (:func:`gpu_numa_node`), or None when
    unknown or the platform has none.
    ``pci_bus_id``: the GPU's PCI address in sysfs form (``"0000:3b:00.0"``, from NVML's
    ``nvmlDeviceGetPciInfo().busId``), by which an engine's memory reports name it; None when
    NVML does not give it.
    ``memory_used_bytes``/``memory_total_bytes``: NVML memory info, bytes."""

    gpu: str
    memory_used_bytes: int
    memory_total_bytes: int
    pcie_tx_bytes: int | None = None
    pcie_rx_bytes: int | None = None
    pcie_source: dict[str, str] | None = None
    link_generation: int | None = None
    link_width: int | None = None
    link_max_bytes_per_second: float | None = None
    link_max_generation: int | None = None
    link_max_width: int | None = None
    numa_node: int | None = None
    pci_bus_id: str | None = None


@dataclass(frozen=True)
class GpuReading:
    """Every GPU NVML sees, in index order (empty when the driver sees none)."""

    gpus: tuple[GpuDevice, ...]


@dataclass
class _Counter:
    """Running state of one (gpu, direction): kvscope's total (bytes), the last raw read and its
    width, and when it was read (clock seconds)."""

    total: float = 0.0
    raw: int | None = None
    bits: int = 64
    source: str | None = None
    at: float | None = None


def _value_bits(nvml) -> dict[int, tuple[str, int]]:
    """valueType -> (c_nvmlValue_t member, bits) for the unsigned types a byte counter may use."""
    return {
        nvml.NVML_VALUE_TYPE_UNSIGNED_INT: ("uiVal", 32),
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: ("ulVal", 8 * ctypes.sizeof(ctypes.c_ulong)),
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: ("ullVal", 64),
    }


@register("gpu", default_enabled=True)
class GpuCollector:
    """Reads every GPU through NVML once per ``collect()``; keeps the PCIe counters' state.

    ``nvml``: a module with pynvml's interface (default: the real ``pynvml``, imported on first
    use). ``clock``: monotonic seconds, for the throughput fallback and the reset bound.
    ``pci_devices``: where sysfs lists PCI devices (``/sys/bus/pci/devices``), for a GPU's NUMA
    node when NVML does not give it.
    ``collect()`` raises NoDataError without a driver or without nvidia-ml-py, CollectorError when
    NVML fails otherwise. ``shutdown()`` calls ``nvmlShutdown`` once per successful init; safe
    twice and without a read."""

    name = "gpu"

    def __init__(self, nvml: ModuleType | object | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 pci_devices: Path | str = DEFAULT_PCI_DEVICES) -> None:
        self._nvml = nvml
        self._clock = clock
        self._pci_devices = Path(pci_devices)
        self._initialized = False
        self._counters: dict[tuple[str, str], _Counter] = {}

    def _load(self):
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NoDataError(f"nvidia-ml-py is not installed ({exc})") from None
            self._nvml = pynvml
        return self._nvml

    def _init(self, nvml) -> None:
        if self._initialized:
            return
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            absent = (nvml.NVML_ERROR_LIBRARY_NOT_FOUND, nvml.NVML_ERROR_DRIVER_NOT_LOADED)
            if getattr(exc, "value", None) in absent:
                raise NoDataError(f"no NVIDIA driver: NVML says {exc}") from None
            raise CollectorError(f"nvmlInit failed: {exc}") from None
        self._initialized = True

    def collect(self) -> GpuReading:
        nvml = self._load()
        self._init(nvml)
        try:
            now = self._clock()
            count = nvml.nvmlDeviceGetCount()
            return GpuReading(tuple(self._device(nvml, i, now) for i in range(count)))
        except nvml.NVMLError as exc:
            raise CollectorError(f"NVML: {exc}") from None

    def _device(self, nvml, index: int, now: float) -> GpuDevice:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        gpu = str(index)
        generation = self._optional(nvml, nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
        width = self._optional(nvml, nvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
        link_max = (link_max_bytes_per_second(generation, width)
                    if generation is not None and width is not None else None)
        max_generation, max_width = self._capability(nvml, handle)
        bus_id = self._bus_id(nvml, handle)
        capability = (link_max_bytes_per_second(max_generation, max_width)
                      if max_generation is not None and max_width is not None else None)
        bound = capability or link_max
        raw = self._field_counters(nvml, handle)
        totals, sources = {}, {}
        for direction in DIRECTIONS:
            counter = self._counters.setdefault((gpu, direction), _Counter())
            if direction in raw:
                value, bits = raw[direction]
                self._advance_raw(counter, value, bits, bound, now)
            else:
                self._advance_throughput(nvml, handle, counter, direction, now)
            if counter.source is not None:
                totals[direction] = int(round(counter.total))
                sources[direction] = counter.source
        return GpuDevice(gpu=gpu, memory_used_bytes=int(memory.used),
                         memory_total_bytes=int(memory.total), pcie_tx_bytes=totals.get("tx"),
                         pcie_rx_bytes=totals.get("rx"), pcie_source=sources or None,
                         link_generation=generation, link_width=width,
                         link_max_bytes_per_second=link_max,
                         link_max_generation=max_generation, link_max_width=max_width,
                         numa_node=self._numa_node(nvml, handle, bus_id), pci_bus_id=bus_id)

    @staticmethod
    def _optional(nvml, fn, *args):
        """``fn(*args)``, or None when this GPU or driver does not support it."""
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) in (nvml.NVML_ERROR_NOT_SUPPORTED,
                                               nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return None
            raise

    def _capability(self, nvml, handle) -> tuple[int | None, int | None]:
        """The most the link can run at: (max generation, max width), each None when NVML does
        not say. Their product bounds a wrap against a reset, since the current link drops a
        generation when idle."""
        get_gen = getattr(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", None)
        get_width = getattr(nvml, "nvmlDeviceGetMaxPcieLinkWidth", None)
        generation = self._optional(nvml, get_gen, handle) if get_gen else None
        width = self._optional(nvml, get_width, handle) if get_width else None
        return generation, width

    @staticmethod
    def _bus_id(nvml, handle) -> str | None:
        """The GPU's PCI address in sysfs form (:func:`sysfs_bus_id` of NVML's
        ``nvmlDeviceGetPciInfo().busId``), or None when NVML does not give it (a label's and a
        match key's input: an NVML error here leaves it unknown, the collector up)."""
        try:
            get_pci = getattr(nvml, "nvmlDeviceGetPciInfo", None)
            return sysfs_bus_id(_text(get_pci(handle).busId)) if get_pci else None
        except nvml.NVMLError:
            return None

    def _numa_node(self, nvml, handle, bus_id: str | None) -> int | None:
        """The host NUMA node nearest to the GPU, or None when neither source says.

        First NVML's memory affinity at node scope (``nvmlDeviceGetMemoryAffinity``: a mask of
        the nodes whose memory is nearest, nvml.h), when it names exactly one node; else the
        kernel's ``numa_node`` of the GPU's PCI device ``bus_id`` (sysfs form:
        ``<pci_devices>/<bus id>/numa_node``, -1: no node). ``nvmlDeviceGetNumaNodeId`` is not used: nvml.h says it "only applies to
        platforms where the GPUs are NUMA nodes", and there it names the GPU's own memory node,
        not the host memory beside it."""
        # a label: any NVML error here leaves it unknown rather than failing the collector
        try:
            get_affinity = getattr(nvml, "nvmlDeviceGetMemoryAffinity", None)
            mask = get_affinity(handle, AFFINITY_WORDS,
                                getattr(nvml, "NVML_AFFINITY_SCOPE_NODE", 0)) if get_affinity else ()
        except nvml.NVMLError:
            mask = ()
        nodes = [64 * i + bit for i, word in enumerate(mask) for bit in range(64)
                 if int(word) >> bit & 1]
        if len(nodes) == 1:
            return nodes[0]
        if bus_id is None:
            return None
        try:
            return parse_numa_node((self._pci_devices / bus_id / "numa_node").read_text())
        except OSError:  # no such device here (a container without /sys), or unreadable
            return None

    def _field_counters(self, nvml, handle) -> dict[str, tuple[int, int]]:
        """direction -> (raw value, bits) for each PCIe byte counter field NVML answers."""
        ids = (nvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES)
        values = self._optional(nvml, nvml.nvmlDeviceGetFieldValues, handle, list(ids))
        if values is None:
            return {}
        types = _value_bits(nvml)
        out = {}
        for direction, fv in zip(DIRECTIONS, values):
            if fv.nvmlReturn != nvml.NVML_SUCCESS or fv.valueType not in types:
                continue
            member, bits = types[fv.valueType]
            out[direction] = (int(getattr(fv.value, member)), bits)
        return out

    @staticmethod
    def _advance_raw(counter: _Counter, value: int, bits: int, bound: float | None,
                     now: float) -> None:
        if counter.source == "counter" and counter.raw is not None:
            elapsed = now - counter.at if counter.at is not None else None
            max_delta = bound * elapsed * RESET_SLACK if bound and elapsed else None
            delta, _reset = advance_counter(counter.raw, value, counter.bits, max_delta)
            counter.total += delta
        elif counter.source is None:
            counter.total = float(value)  # first read: start at NVML's own count
        # else: switching from the throughput estimate: keep the total, take a new baseline
        counter.raw, counter.bits, counter.source, counter.at = value, bits, "counter", now

    @staticmethod
    def _advance_throughput(nvml, handle, counter: _Counter, direction: str, now: float) -> None:
        which = nvml.NVML_PCIE_UTIL_TX_BYTES if direction == "tx" else nvml.NVML_PCIE_UTIL_RX_BYTES
        kbps = GpuCollector._optional(nvml, nvml.nvmlDeviceGetPcieThroughput, handle, which)
        if kbps is None:
            return
        if counter.source == "throughput" and counter.at is not None:
            counter.total += kbps * THROUGHPUT_UNIT_BYTES * max(now - counter.at, 0.0)
        counter.raw, counter.source, counter.at = None, "throughput", now

    def shutdown(self) -> None:
        if not self._initialized:
            return
        self._initialized = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:  # the driver went away: nothing left to release
            log.debug("nvmlShutdown: %s", exc)
