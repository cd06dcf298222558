"""GPU collector: the real pynvml on this driverless machine, and a stand-in NVML for the maths.

This machine has no GPU and no NVIDIA driver, so the real ``pynvml`` is exercised on its
driver-absent path only. Counter wraps and link maths run against ``StandInNvml``: the one
stand-in ARCHITECTURE.md allows (a hardware boundary), exposing pynvml's own function names,
arguments and return types, and reusing pynvml's own constants, ``NVMLError`` classes and ctypes
structures (``c_nvmlFieldValue_t``, ``c_nvmlMemory_t``), so the collector reads the very
structures the real library hands back.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import pynvml
import pytest

from kvscope.agent.collectors import CollectorSet, GpuCollector
from kvscope.agent.collectors.gpu import (advance_counter, link_max_bytes_per_second,
                                          parse_numa_node, sysfs_bus_id)
from kvscope.agent.collectors.metrics import collector_samples

GiB = 2**30
LOGGER = "kvscope.agent.collectors"
TX, RX = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
U32, U64 = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
_MEMBER = {U32: "uiVal", U64: "ullVal"}


# ---- the real pynvml: no driver here ---------------------------------------------------------

def _driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_real_pynvml_without_driver_is_down_with_one_log_line(caplog):
    """Real pynvml, real psutil, real cgroup: gpu up=0 on every scrape, one info line in all,
    host data still there, only collector_up/duration for gpu in the samples, shutdown twice."""
    if _driver_present():
        pytest.skip("an NVIDIA driver is present; this test covers the driver-absent path")
    collectors = CollectorSet(["host", "gpu"], {"host": {"reserve_bytes": GiB}})
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        results = [collectors.collect() for _ in range(3)]
    for r in results:
        assert not r["gpu"].up and r["gpu"].reading is None and r["gpu"].duration >= 0
        assert r["host"].up and r["host"].reading.total > 0
    lines = [rec for rec in caplog.records if rec.name.startswith(LOGGER)]
    assert len(lines) == 1, [rec.getMessage() for rec in lines]
    assert lines[0].levelno == logging.INFO and "gpu" in lines[0].getMessage()
    samples = {spec.name: v for spec, v in collector_samples(results[-1]).items()}
    assert samples["kvscope_collector_up"] == [(["gpu"], 0.0), (["host"], 1.0)]
    assert [labels for labels, _ in samples["kvscope_collector_duration_seconds"]] == [["gpu"],
                                                                                       ["host"]]
    for metric in ("kvscope_pcie_bytes_total", "kvscope_pcie_link_max_bytes_per_second",
                   "kvscope_gpu_memory_used_bytes", "kvscope_gpu_memory_total_bytes",
                   "kvscope_gpu_topology_info"):
        assert samples[metric] == []
    assert samples["kvscope_host_memory_reserve_bytes"] == [([], GiB)]
    collectors.shutdown()
    collectors.shutdown()


# ---- PCIe link maths ---------------------------------------------------------------------------

@pytest.mark.parametrize("gen, width, expected", [
    # bytes/s, one direction = GT/s x 1e9 x payload/line bits / 8 bits per byte x lanes
    (1, 1, 250_000_000.0),               # 2.5e9 x 8/10 / 8 = 250 MB/s (PCIe 1.0a, 8b/10b)
    (2, 8, 4_000_000_000.0),             # 5e9 x 8/10 / 8 = 500 MB/s x 8 (PCIe 2.0, 8b/10b)
    (3, 16, 15_753_846_153.846153),      # 8e9 x 128/130 / 8 = 984,615,384.6 x 16 (128b/130b)
    (4, 16, 31_507_692_307.692307),      # 16e9 x 128/130 / 8 = 1,969,230,769.2 x 16
    (5, 16, 63_015_384_615.384613),      # 32e9 x 128/130 / 8 = 3,938,461,538.5 x 16
    (6, 16, 128_000_000_000.0),          # 64e9 x 1/1 / 8 = 8e9 x 16 (PCIe 6.0 Flit, 1b/1b)
    (4, 4, 7_876_923_076.923077),        # a x4 Gen4 link: a quarter of x16
])
def test_link_max_bytes_per_second(gen, width, expected):
    assert link_max_bytes_per_second(gen, width) == pytest.approx(expected, rel=1e-12)


def test_link_max_unknown():
    assert link_max_bytes_per_second(0, 16) is None   # NVML reports 0 when the link is down
    assert link_max_bytes_per_second(9, 16) is None   # a generation this table does not know
    assert link_max_bytes_per_second(4, 0) is None


def test_advance_counter():
    """Literal cases. 32-bit wrap: previous 2^32 - 100, raw 50 -> 100 + 50 = 150 bytes.
    A 64-bit decrease without a bound is a reset (delta = raw). A 32-bit decrease whose wrap
    would need more than max_delta bytes is a reset too."""
    assert advance_counter(1_000, 1_500, 32, None) == (500, False)
    assert advance_counter(2**32 - 100, 50, 32, None) == (150, False)
    assert advance_counter(2**32 - 100, 50, 32, 1_000.0) == (150, False)
    assert advance_counter(5 * 10**12, 7, 64, None) == (7, True)
    assert advance_counter(100, 40, 32, 1_000.0) == (40, True)   # wrap would be 2^32 - 60 bytes


# ---- the stand-in NVML -------------------------------------------------------------------------

@dataclass
class FakeGpu:
    """What one stand-in GPU reports. ``fields``: field id -> (valueType, raw value); a field
    absent here answers NVML_ERROR_NOT_SUPPORTED in its nvmlReturn. ``throughput``: KB/s per
    pynvml.NVML_PCIE_UTIL_* counter. ``gen``/``width`` None: NVML_ERROR_NOT_SUPPORTED."""

    fields: dict[int, tuple[int, int]] = field(default_factory=dict)
    throughput: dict[int, int] = field(default_factory=dict)
    gen: int | None = 4
    width: int | None = 16
    max_gen: int | None = 4
    max_width: int | None = 16
    used: int = 10 * GiB
    total: int = 80 * GiB
    lost: bool = False
    memory_nodes: tuple[int, ...] | None = None  # nearest memory nodes; None: NOT_SUPPORTED
    bus_id: str | None = None  # NVML's form, "00000000:3B:00.0"; None: NOT_SUPPORTED


class StandInNvml:
    """pynvml's interface over FakeGpus: the same function names and arguments, pynvml's own
    constants, NVMLError classes and ctypes structures."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        for name in dir(pynvml):
            if name.startswith(("NVML_", "NVMLError", "c_nvml")):
                setattr(self, name, getattr(pynvml, name))
        self.gpus = gpus
        self.inits = self.shutdowns = 0

    def _error(self, code):
        return pynvml.NVMLError(code)

    def _live(self, handle: FakeGpu) -> FakeGpu:
        if self.inits == self.shutdowns:
            raise self._error(pynvml.NVML_ERROR_UNINITIALIZED)
        if handle.lost:
            raise self._error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        if self.inits == self.shutdowns:
            raise self._error(pynvml.NVML_ERROR_UNINITIALIZED)
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._live(handle)
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = gpu.total, gpu.used, gpu.total - gpu.used
        return mem

    def _maybe(self, value):
        if value is None:
            raise self._error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return self._maybe(self._live(handle).gen)

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return self._maybe(self._live(handle).width)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        return self._maybe(self._live(handle).max_gen)

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        return self._maybe(self._live(handle).max_width)

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        gpu = self._live(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for fv, field_id in zip(values, fieldIds):
            fv.fieldId = field_id
            if field_id in gpu.fields:
                value_type, raw = gpu.fields[field_id]
                fv.valueType, fv.nvmlReturn = value_type, pynvml.NVML_SUCCESS
                setattr(fv.value, _MEMBER[value_type], raw)
            else:
                fv.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPcieThroughput(self, device, counter):
        return self._maybe(self._live(device).throughput.get(counter))

    def nvmlDeviceGetMemoryAffinity(self, handle, nodeSetSize, scope):
        nodes = self._maybe(self._live(handle).memory_nodes)
        if scope != pynvml.NVML_AFFINITY_SCOPE_NODE:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mask = (ctypes.c_ulonglong * nodeSetSize)()  # pynvml's return type
        for node in nodes:
            mask[node // 64] |= 1 << (node % 64)
        return mask

    def nvmlDeviceGetPciInfo(self, handle):
        info = pynvml.nvmlPciInfo_t()
        info.busId = self._maybe(self._live(handle).bus_id).encode()
        return info


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _gpu_set(nvml: StandInNvml, clock: Clock) -> CollectorSet:
    return CollectorSet(["gpu"], {"gpu": {"nvml": nvml, "clock": clock}})


def test_32_bit_counter_wrap_keeps_the_total_monotonic():
    """TX is a 32-bit field: 4,294,967,000 (= 2^32 - 296) then 704 ten seconds later:
    delta = 704 + 296 = 1,000 bytes, total = 4,294,967,000 + 1,000 = 4,294,968,000.
    RX is 64-bit: 5,000 then 9,000: total 9,000. The Gen4 x16 bound (31.5 GB/s x 10 s x 2)
    easily allows a 1,000-byte wrap."""
    gpu = FakeGpu(fields={TX: (U32, 2**32 - 296), RX: (U64, 5_000)})
    nvml, clock = StandInNvml([gpu]), Clock()
    collectors = _gpu_set(nvml, clock)
    first = collectors.collect()["gpu"].reading.gpus[0]
    assert (first.pcie_tx_bytes, first.pcie_rx_bytes) == (4_294_967_000, 5_000)
    gpu.fields = {TX: (U32, 704), RX: (U64, 9_000)}
    clock.t += 10.0
    second = collectors.collect()["gpu"].reading.gpus[0]
    assert (second.pcie_tx_bytes, second.pcie_rx_bytes) == (4_294_968_000, 9_000)
    assert second.pcie_source == {"tx": "counter", "rx": "counter"}


def test_counter_reset_is_not_taken_for_a_wrap():
    """RX (64-bit) falls from 10^12 to 5 * 10^9 (driver reload): reset, total = 10^12 + 5 * 10^9.
    TX (32-bit) falls from 3 * 10^9 to 10^6 after 1 ms: a wrap would mean 2^32 - 3 * 10^9 + 10^6
    = 1,295,967,296 bytes, above the Gen4 x16 bound of 31,507,692,307.7 B/s x 0.001 s x 2 =
    63,015,384.6 bytes, so it is a reset too: total = 3 * 10^9 + 10^6."""
    gpu = FakeGpu(fields={TX: (U32, 3 * 10**9), RX: (U64, 10**12)})
    nvml, clock = StandInNvml([gpu]), Clock()
    collectors = _gpu_set(nvml, clock)
    collectors.collect()
    gpu.fields = {TX: (U32, 10**6), RX: (U64, 5 * 10**9)}
    clock.t += 0.001
    d = collectors.collect()["gpu"].reading.gpus[0]
    assert (d.pcie_tx_bytes, d.pcie_rx_bytes) == (3 * 10**9 + 10**6, 10**12 + 5 * 10**9)


def test_throughput_fallback_integrates_kb_per_second():
    """No PCIe count fields (old driver): nvmlDeviceGetPcieThroughput gives TX 2,000 KB/s and
    RX 500 KB/s. The first read starts both at 0; 5 s later TX = 2,000 x 1,024 x 5 =
    10,240,000 bytes and RX = 500 x 1,024 x 5 = 2,560,000 bytes. A GPU that answers neither
    source has no PCIe totals at all."""
    gpus = [FakeGpu(throughput={pynvml.NVML_PCIE_UTIL_TX_BYTES: 2_000,
                                pynvml.NVML_PCIE_UTIL_RX_BYTES: 500}), FakeGpu()]
    nvml, clock = StandInNvml(gpus), Clock()
    collectors = _gpu_set(nvml, clock)
    first = collectors.collect()["gpu"].reading.gpus[0]
    assert (first.pcie_tx_bytes, first.pcie_rx_bytes) == (0, 0)
    clock.t += 5.0
    reading = collectors.collect()["gpu"].reading
    assert (reading.gpus[0].pcie_tx_bytes, reading.gpus[0].pcie_rx_bytes) == (10_240_000, 2_560_000)
    assert reading.gpus[0].pcie_source == {"tx": "throughput", "rx": "throughput"}
    assert (reading.gpus[1].pcie_tx_bytes, reading.gpus[1].pcie_source) == (None, None)


def test_gpu_samples_follow_the_catalog():
    """Two GPUs: GPU 0 Gen4 x16 (31,507,692,307.7 B/s), 10 of 80 GiB used, TX 1,000 / RX 2,000;
    GPU 1 Gen3 x8 (8e9 x 128/130 / 8 x 8 = 7,876,923,076.9 B/s), 1 of 24 GiB used, TX only.
    GPU 2 does not report its link: no link sample, the rest still there."""
    gpus = [FakeGpu(fields={TX: (U64, 1_000), RX: (U64, 2_000)}),
            FakeGpu(fields={TX: (U64, 7)}, gen=3, width=8, max_gen=3, max_width=16,
                    used=GiB, total=24 * GiB),
            FakeGpu(gen=None, width=None, max_gen=None, max_width=None, used=0, total=GiB)]
    collectors = _gpu_set(StandInNvml(gpus), Clock())
    s = {spec.name: v for spec, v in collector_samples(collectors.collect()).items()}
    assert s["kvscope_pcie_bytes_total"] == [(["0", "tx"], 1_000.0), (["0", "rx"], 2_000.0),
                                             (["1", "tx"], 7.0)]
    link = dict((tuple(labels), v) for labels, v in s["kvscope_pcie_link_max_bytes_per_second"])
    assert link.keys() == {("0",), ("1",)}
    assert link[("0",)] == pytest.approx(31_507_692_307.692307)
    assert link[("1",)] == pytest.approx(7_876_923_076.923077)
    assert s["kvscope_gpu_memory_used_bytes"] == [(["0"], 10 * GiB), (["1"], GiB), (["2"], 0.0)]
    assert s["kvscope_gpu_memory_total_bytes"] == [(["0"], 80 * GiB), (["1"], 24 * GiB),
                                                   (["2"], GiB)]
    assert s["kvscope_collector_up"] == [(["gpu"], 1.0)]
    assert s["kvscope_host_memory_total_bytes"] == []


def test_lost_gpu_fails_gpu_only_and_shutdown_is_safe(caplog):
    """A GPU that is lost (NVML_ERROR_GPU_IS_LOST) makes gpu up=0 with one warning over three
    scrapes; host data is unaffected. nvmlShutdown runs once for the one successful init,
    however often shutdown() is called."""
    nvml = StandInNvml([FakeGpu(lost=True)])
    collectors = CollectorSet(["host", "gpu"], {"gpu": {"nvml": nvml, "clock": Clock()}})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        results = [collectors.collect() for _ in range(3)]
    assert [r["gpu"].up for r in results] == [False] * 3
    assert all(r["host"].up for r in results)
    lines = [rec for rec in caplog.records if rec.name.startswith(LOGGER)]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "GPU is lost" in lines[0].getMessage()
    collectors.shutdown()
    collectors.shutdown()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_shutdown_without_collect_does_not_touch_nvml():
    nvml = StandInNvml([FakeGpu()])
    collector = GpuCollector(nvml=nvml)
    collector.shutdown()
    collector.shutdown()
    assert (nvml.inits, nvml.shutdowns) == (0, 0)


# ---- topology: link and NUMA node ---------------------------------------------------------------

def test_sysfs_bus_id_and_numa_node_text():
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_bus_id("00000001:C1:1F.7\n") == "0001:c1:1f.7"
    assert sysfs_bus_id("") is None and sysfs_bus_id("3B:00.0") is None
    assert parse_numa_node("1\n") == 1
    assert parse_numa_node("-1\n") is None   # the platform ties the device to no node
    assert parse_numa_node("") is None


def _pci_tree(root, nodes: dict[str, str]):
    """/sys/bus/pci/devices as the kernel lays it out: one directory per bus id with its
    numa_node file."""
    for bus_id, node in nodes.items():
        (root / bus_id).mkdir(parents=True)
        (root / bus_id / "numa_node").write_text(node + "\n")
    return root


def test_topology_info_per_gpu(tmp_path):
    """GPU 0: NVML's memory affinity names node 65 alone (bit 1 of the second 64-bit word).
    GPU 1: affinity names nodes 0 and 1, so the kernel's numa_node of its PCI device decides:
    0000:3b:00.0 -> 0. GPU 2: no affinity; its device's numa_node is -1 (no node): empty.
    GPU 3: neither source (and no link figures): every unknown label is empty."""
    gpus = [FakeGpu(memory_nodes=(65,), gen=5, width=16, max_gen=5, max_width=16),
            FakeGpu(memory_nodes=(0, 1), bus_id="00000000:3B:00.0", gen=1, width=16),
            FakeGpu(bus_id="00000000:86:00.0", gen=4, width=8, max_width=16),
            FakeGpu(gen=None, width=None, max_gen=None, max_width=None)]
    pci = _pci_tree(tmp_path / "devices", {"0000:3b:00.0": "0", "0000:86:00.0": "-1"})
    collectors = CollectorSet(["gpu"], {"gpu": {"nvml": StandInNvml(gpus), "clock": Clock(),
                                                "pci_devices": pci}})
    reading = collectors.collect()["gpu"].reading
    assert [d.numa_node for d in reading.gpus] == [65, 0, None, None]
    assert [(d.link_max_generation, d.link_max_width) for d in reading.gpus] == [
        (5, 16), (4, 16), (4, 16), (None, None)]
    s = {spec.name: v for spec, v in collector_samples(collectors.collect()).items()}
    # labels: gpu, pcie_generation, pcie_width, pcie_max_generation, pcie_max_width, numa_node
    assert s["kvscope_gpu_topology_info"] == [
        (["0", "5", "16", "5", "16", "65"], 1.0),
        (["1", "1", "16", "4", "16", "0"], 1.0),
        (["2", "4", "8", "4", "16", ""], 1.0),
        (["3", "", "", "", "", ""], 1.0)]


def test_topology_without_pci_devices_leaves_the_node_unknown(tmp_path):
    """A bus id the sysfs tree does not hold (a container without the host's /sys): no node,
    the collector still up."""
    nvml = StandInNvml([FakeGpu(bus_id="00000000:3B:00.0")])
    collectors = CollectorSet(["gpu"], {"gpu": {"nvml": nvml, "clock": Clock(),
                                                "pci_devices": tmp_path / "absent"}})
    result = collectors.collect()["gpu"]
    assert result.up and result.reading.gpus[0].numa_node is None
