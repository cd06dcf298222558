"""The Prometheus collector: builds every catalog metric from one pipeline snapshot per scrape.

A custom ``Collector`` (prometheus_client's pattern for state owned elsewhere) registered on a
private registry; samples carry no timestamps.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

from kvscope import __version__
from kvscope.agent.collectors.host import HostCollector
from kvscope.agent.pipeline import Histogram, Pipeline, Snapshot
from kvscope.exporter.catalog import CATALOG, MetricSpec

_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
             "histogram": HistogramMetricFamily}


def _split(key: str) -> list[str]:
    return key.split("->")


def _values(snap: Snapshot, host) -> dict[str, list[tuple[list[str], object]]]:
    """Per metric name: ``(label values, value)`` pairs; a value is a number or a Histogram."""
    return {
        "kvscope_prompt_tokens_total": [([s], n) for s, n in snap.prompt_tokens.items()],
        "kvscope_transfer_bytes_total": [(_split(k), n) for k, n in snap.transfer_bytes.items()],
        "kvscope_transfer_blocks_total": [(_split(k), n) for k, n in snap.transfer_blocks.items()],
        "kvscope_transfer_seconds": [(_split(k), h) for k, h in snap.transfer_seconds.items()],
        "kvscope_evicted_blocks_total": [([t], n) for t, n in snap.evicted_blocks.items()],
        "kvscope_tier_capacity_bytes": [([t], s.capacity_bytes) for t, s in snap.tiers.items()],
        "kvscope_tier_resident_bytes": [([t], s.resident_bytes) for t, s in snap.tiers.items()],
        "kvscope_tier_resident_blocks": [([t], s.resident_blocks) for t, s in snap.tiers.items()],
        "kvscope_requests_total": [([], snap.requests)],
        "kvscope_ttft_seconds": [([], snap.ttft_seconds)],
        "kvscope_host_memory_available_bytes": [([], host.available)],
        "kvscope_host_memory_total_bytes": [([], host.total)],
        "kvscope_events_received_total": [([s], n) for s, n in snap.events_received.items()],
        "kvscope_build_info": [([__version__], 1)],
    }


def _family(spec: MetricSpec, samples) -> Metric:
    # prometheus_client appends _total itself for counters
    name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
    family = _FAMILIES[spec.type](name, spec.help, labels=list(spec.labels), unit="")
    for labels, value in samples:
        if isinstance(value, Histogram):
            cumulative, buckets = 0, []
            for bound, n in zip((*value.buckets, float("inf")), value.counts):
                cumulative += n
                buckets.append((repr(bound) if bound != float("inf") else "+Inf", cumulative))
            family.add_metric(labels, buckets, value.sum)
        else:
            family.add_metric(labels, value)
    return family


class KvscopeCollector(Collector):
    """Yields every metric in the catalog from one pipeline snapshot and one host reading."""

    def __init__(self, pipeline: Pipeline, host: HostCollector) -> None:
        self._pipeline = pipeline
        self._host = host

    def collect(self) -> Iterator[Metric]:
        values = _values(self._pipeline.snapshot(), self._host.collect())
        for spec in CATALOG:
            yield _family(spec, values[spec.name])
