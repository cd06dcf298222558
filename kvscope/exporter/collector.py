"""The Prometheus collector: builds every catalog metric from one pipeline snapshot per scrape.

A custom ``Collector`` (prometheus_client's pattern for state owned elsewhere) registered on a
private registry; samples carry no timestamps. Histogram buckets carry the latest exemplar
(``trace_id``) seen in them; only the OpenMetrics exposition shows exemplars.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (CounterMetricFamily, Exemplar, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

from kvscope import __version__
from kvscope.agent.pipeline import Histogram, Pipeline, Snapshot
from kvscope.exporter.catalog import CATALOG, MetricSpec
from kvscope.vocabulary import FAILURE_REASONS

_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
             "histogram": HistogramMetricFamily}

Samples = dict[str, list[tuple[list[str], object]]]


def _labelled(mapping: dict) -> list[tuple[list[str], object]]:
    return [(list(key) if isinstance(key, tuple) else [key], value) for key, value in mapping.items()]


def pipeline_samples(snap: Snapshot) -> Samples:
    """Per metric name: ``(label values, value)`` pairs; a value is a number or a Histogram."""
    tiers = snap.tiers.items()
    return {
        "kvscope_prompt_tokens_total": _labelled(snap.prompt_tokens),
        "kvscope_lookup_blocks_total": _labelled(snap.lookup_blocks),
        "kvscope_prefill_seconds_saved_total": _labelled(snap.prefill_seconds_saved),
        "kvscope_transfer_bytes_total": _labelled(snap.transfer_bytes),
        "kvscope_transfer_blocks_total": _labelled(snap.transfer_blocks),
        "kvscope_transfer_seconds": _labelled(snap.transfer_seconds),
        # at 0 until they happen, so the first failures show in rate() (Prometheus's advice:
        # initialise the label sets known in advance)
        "kvscope_transfer_failures_total": _labelled({
            **{(src, dst, reason): 0 for src, dst in
               [*snap.transfer_bytes, *(key[:2] for key in snap.transfer_failures)]
               for reason in FAILURE_REASONS},
            **snap.transfer_failures}),
        "kvscope_evicted_blocks_total": _labelled(snap.evicted_blocks),
        "kvscope_dropped_blocks_total": _labelled(snap.dropped_blocks),
        "kvscope_evicted_block_hits": _labelled(snap.evicted_block_hits),
        "kvscope_block_residency_seconds": _labelled(snap.block_residency_seconds),
        "kvscope_tier_capacity_bytes": [([t], s.capacity_bytes) for t, s in tiers],
        "kvscope_tier_resident_bytes": [([t], s.resident_bytes) for t, s in tiers],
        "kvscope_tier_capacity_blocks": [([t], s.capacity_blocks) for t, s in tiers],
        "kvscope_tier_resident_blocks": [([t], s.resident_blocks) for t, s in tiers],
        "kvscope_requests_total": [([], snap.requests)],
        "kvscope_ttft_seconds": [([], snap.ttft_seconds)],
        "kvscope_promotion_wait_seconds": [([], snap.promotion_wait_seconds)],
        "kvscope_itl_seconds": [([], snap.itl_seconds)],
        "kvscope_events_received_total": _labelled(snap.events_received),
        "kvscope_events_dropped_total": _labelled({**dict.fromkeys(sorted(snap.expected_drops), 0),
                                                   **snap.events_dropped}),
        "kvscope_source_up": [([s], float(up)) for s, up in snap.source_up.items()],
        "kvscope_engine_info": [([s, e, m], 1) for s, (e, m) in snap.source_info.items()],
        "kvscope_build_info": [([__version__], 1)],
    }


def _buckets(hist: Histogram) -> list[tuple]:
    cumulative, out = 0, []
    for i, (bound, n) in enumerate(zip((*hist.buckets, float("inf")), hist.counts)):
        cumulative += n
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        exemplar = hist.exemplars.get(i)
        if exemplar:
            trace_id, value, ts = exemplar
            out.append((le, cumulative, Exemplar({"trace_id": trace_id}, value, ts)))
        else:
            out.append((le, cumulative))
    return out


def _family(spec: MetricSpec, samples) -> Metric:
    # prometheus_client appends _total itself for counters
    name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
    family = _FAMILIES[spec.type](name, spec.help, labels=list(spec.labels))
    for labels, value in samples:
        if isinstance(value, Histogram):
            family.add_metric(labels, _buckets(value), value.sum)
        else:
            family.add_metric(labels, value)
    return family


class KvscopeCollector(Collector):
    """Yields every metric in the catalog: the pipeline's from one snapshot, and the rest from
    ``scrape_samples()`` (host and GPU collectors, sinks: read at scrape time), merged by
    name."""

    def __init__(self, pipeline: Pipeline, scrape_samples: Callable[[], Samples]) -> None:
        self._pipeline = pipeline
        self._scrape_samples = scrape_samples

    def collect(self) -> Iterator[Metric]:
        values = pipeline_samples(self._pipeline.snapshot())
        values.update(self._scrape_samples())
        for spec in CATALOG:
            yield _family(spec, values.get(spec.name, ()))
