"""The node collectors' results (host, GPU, NUMA) as catalog samples.

Pure: turns ``dict[name, CollectorResult]`` into catalog :data:`~kvscope.catalog.Samples`. Every
metric this module owns is a key, with an empty list when there is nothing to report (no GPU, a
failed collector), so a scrape shows the family without series. The exposition
(``exporter/prometheus.py``) encodes them.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvscope import catalog as m
from kvscope.agent.collectors.base import CollectorResult
from kvscope.agent.collectors.engine_args import EngineArgsReading
from kvscope.agent.collectors.gpu import GpuReading
from kvscope.agent.collectors.host import HostReading
from kvscope.agent.collectors.numa import NumaReading
from kvscope.catalog import Samples

NODE_METRICS = (
    m.HOST_MEMORY_TOTAL_BYTES, m.HOST_MEMORY_AVAILABLE_BYTES, m.HOST_MEMORY_LIMIT_BYTES,
    m.HOST_SWAP_USED_BYTES, m.HOST_SWAP_IN_BYTES, m.HOST_MEMORY_RESERVE_BYTES,
    m.HOST_MEMORY_HEADROOM_BYTES, m.OFFLOAD_BUDGET_BYTES, m.HOST_NUMA_NODES, m.PROCESS_NUMA_BYTES, m.PCIE_BYTES,
    m.PCIE_LINK_MAX_BYTES_PER_SECOND, m.GPU_MEMORY_USED_BYTES, m.GPU_MEMORY_TOTAL_BYTES,
    m.GPU_TOPOLOGY_INFO, m.ENGINE_WEIGHT_OFFLOAD_BYTES, m.COLLECTOR_UP,
    m.COLLECTOR_DURATION_SECONDS,
)


def _host(out: Samples, r: HostReading) -> None:
    for metric, value in ((m.HOST_MEMORY_TOTAL_BYTES, r.total),
                          (m.HOST_MEMORY_AVAILABLE_BYTES, r.available),
                          (m.HOST_MEMORY_LIMIT_BYTES, r.limit),
                          (m.HOST_SWAP_USED_BYTES, r.swap_used),
                          (m.HOST_MEMORY_RESERVE_BYTES, r.reserve),
                          (m.HOST_MEMORY_HEADROOM_BYTES, r.headroom)):
        out[metric].append(([], float(value)))
    if r.swap_in is not None:
        out[m.HOST_SWAP_IN_BYTES].append(([], float(r.swap_in)))
    for tier, budget in sorted(r.budgets.items()):
        out[m.OFFLOAD_BUDGET_BYTES].append(
            (m.OFFLOAD_BUDGET_BYTES.label_values(tier=tier), float(budget)))


def _gpu(out: Samples, r: GpuReading) -> None:
    for d in r.gpus:
        for direction, total in (("tx", d.pcie_tx_bytes), ("rx", d.pcie_rx_bytes)):
            if total is not None:
                out[m.PCIE_BYTES].append(
                    (m.PCIE_BYTES.label_values(gpu=d.gpu, direction=direction), float(total)))
        if d.link_max_bytes_per_second is not None:
            out[m.PCIE_LINK_MAX_BYTES_PER_SECOND].append(
                (m.PCIE_LINK_MAX_BYTES_PER_SECOND.label_values(gpu=d.gpu),
                 float(d.link_max_bytes_per_second)))
        out[m.GPU_MEMORY_USED_BYTES].append(
            (m.GPU_MEMORY_USED_BYTES.label_values(gpu=d.gpu), float(d.memory_used_bytes)))
        out[m.GPU_MEMORY_TOTAL_BYTES].append(
            (m.GPU_MEMORY_TOTAL_BYTES.label_values(gpu=d.gpu), float(d.memory_total_bytes)))
        out[m.GPU_TOPOLOGY_INFO].append((m.GPU_TOPOLOGY_INFO.label_values(
            gpu=d.gpu, pcie_generation=_label(d.link_generation), pcie_width=_label(d.link_width),
            pcie_max_generation=_label(d.link_max_generation),
            pcie_max_width=_label(d.link_max_width), numa_node=_label(d.numa_node)), 1.0))


def _label(value: int | None) -> str:
    """An info label's value: empty (the label absent, to Prometheus) when unknown."""
    return "" if value is None else str(value)


def _numa(out: Samples, r: NumaReading) -> None:
    if r.nodes is not None:
        out[m.HOST_NUMA_NODES].append(([], float(len(r.nodes))))
    for node, size in (r.engine_bytes or {}).items():
        out[m.PROCESS_NUMA_BYTES].append(
            (m.PROCESS_NUMA_BYTES.label_values(numa_node=str(node)), float(size)))


def collector_samples(results: Mapping[str, CollectorResult]) -> Samples:
    """Catalog samples of the node metrics and, per collector in ``results``,
    ``kvscope_collector_up`` (1/0) and ``kvscope_collector_duration_seconds``. A reading's
    metrics appear only when its collector is up."""
    out: Samples = {metric: [] for metric in NODE_METRICS}
    for name, result in sorted(results.items()):
        out[m.COLLECTOR_UP].append(
            (m.COLLECTOR_UP.label_values(collector=name), 1.0 if result.up else 0.0))
        out[m.COLLECTOR_DURATION_SECONDS].append(
            (m.COLLECTOR_DURATION_SECONDS.label_values(collector=name), float(result.duration)))
        if not result.up:
            continue
        if isinstance(result.reading, HostReading):
            _host(out, result.reading)
        elif isinstance(result.reading, GpuReading):
            _gpu(out, result.reading)
        elif isinstance(result.reading, NumaReading):
            _numa(out, result.reading)
        elif isinstance(result.reading, EngineArgsReading):
            if result.reading.weight_offload_bytes is not None:
                out[m.ENGINE_WEIGHT_OFFLOAD_BYTES].append(
                    ([], float(result.reading.weight_offload_bytes)))
    return out
