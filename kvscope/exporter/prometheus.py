"""The Prometheus exposition: every catalog metric, built per scrape from what producers hand over.

A custom ``Collector`` (prometheus_client's pattern for state owned elsewhere) on a private
registry. It never sees where values come from: each producer is a callable returning catalog
:data:`~kvscope.catalog.Samples` (the pipeline's snapshot, the collectors, the sinks' counts),
read once per scrape. Samples carry no timestamps. Histogram buckets carry the latest exemplar
(``trace_id``) seen in them; only the OpenMetrics exposition shows exemplars. The only module
besides ``bench/`` that imports prometheus_client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, Exemplar, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from kvscope.catalog import CATALOG, MetricSpec, Samples

_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
             "histogram": HistogramMetricFamily}

Producer = Callable[[], Samples]


def _buckets(hist) -> list[tuple]:
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
        if spec.type == "histogram":
            family.add_metric(labels, _buckets(value), value.sum)
        else:
            family.add_metric(labels, value)
    return family


class CatalogCollector(Collector):
    """Yields every metric in the catalog, in its order, from the producers' samples merged by
    metric (a later producer's samples of a metric replace an earlier one's); a metric nobody
    produced is a family without samples."""

    def __init__(self, *producers: Producer) -> None:
        self._producers = producers

    def collect(self) -> Iterator[Metric]:
        values: Samples = {}
        for produce in self._producers:
            values.update(produce())
        for spec in CATALOG:
            yield _family(spec, values.get(spec, ()))


class Exposition:
    """The agent's ``/metrics``: a private registry holding one :class:`CatalogCollector`.

    ``registry``: for readers of single values (``registry.get_sample_value(name, labels)``).
    """

    def __init__(self, *producers: Producer) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(CatalogCollector(*producers))

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """``(body, content type)`` of one scrape: OpenMetrics (with exemplars) when the
        ``Accept`` header names ``application/openmetrics-text``, else the text format 0.0.4."""
        if "application/openmetrics-text" in accept:
            return openmetrics.generate_latest(self.registry), openmetrics.CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
