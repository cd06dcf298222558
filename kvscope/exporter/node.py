"""Node samples: the host and GPU collectors' results as catalog samples.

Pure: turns ``dict[name, CollectorResult]`` into ``dict[metric name, [(label values, value)]]``,
label values in the catalog's label order. Every metric this module owns is a key, with an empty
list when there is nothing to report (no GPU, a failed collector), so the caller can merge the
dict into its per-scrape table. No prometheus_client here; ``exporter/collector.py`` builds the
families.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvscope.agent.collectors.base import CollectorResult
from kvscope.agent.collectors.gpu import GpuReading
from kvscope.agent.collectors.host import HostReading
from kvscope.exporter.catalog import BY_NAME

Samples = dict[str, list[tuple[list[str], float]]]

NODE_METRICS = (
    "kvscope_host_memory_total_bytes", "kvscope_host_memory_available_bytes",
    "kvscope_host_memory_limit_bytes", "kvscope_host_swap_used_bytes",
    "kvscope_host_memory_reserve_bytes", "kvscope_host_memory_headroom_bytes",
    "kvscope_offload_budget_bytes",
    "kvscope_pcie_bytes_total", "kvscope_pcie_link_max_bytes_per_second",
    "kvscope_gpu_memory_used_bytes", "kvscope_gpu_memory_total_bytes",
    "kvscope_collector_up", "kvscope_collector_duration_seconds",
)


def _labels(metric: str, **values: str) -> list[str]:
    """Label values in the catalog's order for ``metric``; KeyError if one is missing."""
    return [values[label] for label in BY_NAME[metric].labels]


def _host(out: Samples, r: HostReading) -> None:
    for metric, value in (("kvscope_host_memory_total_bytes", r.total),
                          ("kvscope_host_memory_available_bytes", r.available),
                          ("kvscope_host_memory_limit_bytes", r.limit),
                          ("kvscope_host_swap_used_bytes", r.swap_used),
                          ("kvscope_host_memory_reserve_bytes", r.reserve),
                          ("kvscope_host_memory_headroom_bytes", r.headroom)):
        out[metric].append(([], float(value)))
    for tier, budget in sorted(r.budgets.items()):
        out["kvscope_offload_budget_bytes"].append(
            (_labels("kvscope_offload_budget_bytes", tier=tier), float(budget)))


def _gpu(out: Samples, r: GpuReading) -> None:
    for d in r.gpus:
        for direction, total in (("tx", d.pcie_tx_bytes), ("rx", d.pcie_rx_bytes)):
            if total is not None:
                out["kvscope_pcie_bytes_total"].append(
                    (_labels("kvscope_pcie_bytes_total", gpu=d.gpu, direction=direction),
                     float(total)))
        if d.link_max_bytes_per_second is not None:
            out["kvscope_pcie_link_max_bytes_per_second"].append(
                (_labels("kvscope_pcie_link_max_bytes_per_second", gpu=d.gpu),
                 float(d.link_max_bytes_per_second)))
        out["kvscope_gpu_memory_used_bytes"].append(
            (_labels("kvscope_gpu_memory_used_bytes", gpu=d.gpu), float(d.memory_used_bytes)))
        out["kvscope_gpu_memory_total_bytes"].append(
            (_labels("kvscope_gpu_memory_total_bytes", gpu=d.gpu), float(d.memory_total_bytes)))


def node_samples(results: Mapping[str, CollectorResult]) -> Samples:
    """dict[metric name, list of (label values, value)] for the node metrics and, per collector
    in ``results``, ``kvscope_collector_up`` (1/0) and ``kvscope_collector_duration_seconds``.
    A reading's metrics appear only when its collector is up."""
    out: Samples = {metric: [] for metric in NODE_METRICS}
    for name, result in sorted(results.items()):
        out["kvscope_collector_up"].append(
            (_labels("kvscope_collector_up", collector=name), 1.0 if result.up else 0.0))
        out["kvscope_collector_duration_seconds"].append(
            (_labels("kvscope_collector_duration_seconds", collector=name),
             float(result.duration)))
        if not result.up:
            continue
        if isinstance(result.reading, HostReading):
            _host(out, result.reading)
        elif isinstance(result.reading, GpuReading):
            _gpu(out, result.reading)
    return out
