"""The dashboard's sample is declared once (kvscope/samples.py), and every form follows it: the
pipeline records exactly the declared fields in their shapes, the HTTP API names them, the
Prometheus backend queries each from its catalog metric and rebuilds the same fields, and the
figures read no field that is not declared."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping

import pytest

from kvscope import catalog, samples
from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.dashboard import prometheus as P
from kvscope.dashboard.pages import overview, tiers
from kvscope.samples import FIELDS, NAMES, PERCENTILES, Kind
from kvscope.service.api import SAMPLE_FIELDS

T = 1764410000.0
ALL_LABELS = {"source": "gpu", "src": "cpu", "dst": "gpu", "tier": "cpu", "gpu": "0",
              "instance": "node1:9400"}


def _busy_pipeline() -> Pipeline:
    """A pipeline that has seen one of everything a sample counts."""
    pipe = Pipeline()
    pipe.ingest("e", [
        ev.RequestStarted(ts=T, request_id="a", prompt_tokens=16),
        ev.Lookup(ts=T, request_id="a", tokens={"cpu": 8, "recompute": 8}, blocks=2,
                  block_hits={"cpu": 1}, prefill_tokens_per_second=1000.0,
                  block_hashes=(1, 2)),
        ev.TierSnapshot(ts=T, tier="cpu", capacity_bytes=8192, resident_bytes=4096,
                        capacity_blocks=8, resident_blocks=4),
        ev.Transfer(ts=T, src="cpu", dst="gpu", blocks=4, bytes=4096, duration=0.002),
        ev.Eviction(ts=T, tier="cpu", blocks=2, bytes=2048, age=20.0, hits=3, offloaded=False),
        ev.RequestFinished(ts=T, request_id="a", ttft=0.02, prompt_tokens=16,
                           promotion_wait=0.01),
        ev.SchedulerStats(ts=T, waiting=2, running=1, preemptions=1, gpu_kv_usage=0.5),
    ])
    pipe.set_cache_config("e", True, "fp8_e4m3")
    return pipe


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_value(field: samples.SampleField, value, fleet: bool = False) -> None:
    """``value`` has the shape the declaration gives ``field`` (see kvscope/samples.py);
    ``fleet``: built by the Prometheus backend (keys start with ``fleet_by``'s labels; as
    many buckets as Prometheus answered)."""
    def one(v):
        if field.kind in (Kind.COUNTER, Kind.SUM, Kind.GAUGE):
            assert _is_number(v), (field.name, v)
        elif field.kind is Kind.SCALAR:
            assert v is None or _is_number(v), (field.name, v)
        elif field.kind is Kind.BUCKETS:
            assert isinstance(v, list) and all(_is_number(n) for n in v), (field.name, v)
            if not fleet:
                assert len(v) == len(field.spec.buckets) + 1, field.name  # +Inf last
        elif field.kind is Kind.PERCENTILES:
            assert isinstance(v, Mapping) and set(v) <= set(PERCENTILES), (field.name, v)
            assert all(p is None or _is_number(p) for p in v.values()), (field.name, v)
        else:
            raise AssertionError(f"undeclared kind {field.kind}")

    if field.key:
        assert isinstance(value, Mapping), (field.name, value)
        parts = len(field.key) + (len(field.fleet_by) if fleet else 0)
        for key, v in value.items():
            assert isinstance(key, str) and len(key.split("->")) == parts, (field.name, key)
            one(v)
    else:
        one(value)


# --- the declaration ---------------------------------------------------------------------

def test_every_field_comes_from_a_catalog_metric_and_keys_by_its_labels():
    assert len(set(NAMES)) == len(NAMES)
    assert NAMES == tuple(f.name for f in FIELDS)
    assert set(samples.BY_NAME) == set(NAMES)
    for f in FIELDS:
        assert any(f.spec is spec for spec in catalog.CATALOG), f.name
        assert f.spec.type == samples.SPEC_TYPE[f.kind], f.name
        assert set(f.key) <= set(f.spec.labels), f.name
        assert len(set(f.key)) == len(f.key), f.name
        assert f.series.startswith(f.spec.name), f.name
        if f.kind is Kind.SCALAR:
            assert f.key == () and f.spec.labels == (), f.name  # one value, nothing summed over
        if f.kind in (Kind.GAUGE, Kind.SCALAR):
            assert f.fleet in ("sum", "max"), f.name
            assert not set(f.fleet_by) & set(f.spec.labels), f.name  # Prometheus's own labels
        else:
            assert (f.fleet, f.fleet_by) == ("sum", ()), f.name  # not read for other kinds


def test_the_samples_module_imports_only_the_standard_library_catalog_and_vocabulary():
    from test_architecture import import_graph
    graph, external = import_graph()
    assert graph["kvscope.samples"] <= {"kvscope", "kvscope.catalog", "kvscope.vocabulary"}
    assert external["kvscope.samples"] <= set(sys.stdlib_module_names)


def test_record_orders_the_fields_and_refuses_missing_or_unknown_ones():
    values = {f: None for f in reversed(FIELDS)}
    assert list(samples.record(T, values)) == ["ts", *NAMES]
    with pytest.raises(ValueError, match="missing: \\['requests'\\]"):
        samples.record(T, {f: None for f in FIELDS if f is not samples.REQUESTS})
    stray = samples.SampleField("stray", catalog.REQUESTS, Kind.COUNTER)
    with pytest.raises(ValueError, match="unknown: \\['stray'\\]"):
        samples.record(T, {**values, stray: 1})


# --- the pipeline and the HTTP API ---------------------------------------------------------

def test_the_pipeline_records_exactly_the_declared_fields_in_their_shapes():
    pipe = _busy_pipeline()
    sample = pipe.record_sample(T, 1e9, host_memory_reserve=2e8, host_memory_headroom=8e8,
                                offload_budgets={"cpu": 4096}, pcie_link_max={"0": 3.2e10},
                                host_memory_parts={"kv_offload": 4096.0, "free": 1e9},
                                gpu_memory_parts={"0->kv_cache": 2048.0},
                                host_memory_limit=2e9, gpu_memory_total={"0": 8e10},
                                host_swap_in=4096.0, engine_weight_offload=2.0**31)
    assert list(sample) == ["ts", *NAMES]  # the JSON's keys, in this order
    assert pipe.samples()[-1] is sample
    for f in FIELDS:
        _check_value(f, sample[f.name])
    # every keyed field has a key here, so each key's shape was checked
    assert [f.name for f in FIELDS if f.key and not sample[f.name]] == []
    empty = Pipeline().record_sample(T, None)
    assert list(empty) == ["ts", *NAMES]
    for f in FIELDS:
        _check_value(f, empty[f.name])


def test_the_api_names_the_declared_fields():
    assert SAMPLE_FIELDS == NAMES


# --- the Prometheus backend ----------------------------------------------------------------

def test_the_prometheus_backend_queries_every_field_from_its_declaration():
    jobs = P.queries('{job="kvscope"}', "1m", 5.0)
    assert [name for name, _e, _f in jobs] == [
        f.name for f in FIELDS for _ in (PERCENTILES if f.kind is Kind.PERCENTILES else [0])]
    by_field: dict[str, list[str]] = {}
    for name, expr, _fill in jobs:
        by_field.setdefault(name, []).append(expr)
    for f in FIELDS:
        for expr in by_field[f.name]:
            assert f'{f.series}{{job="kvscope"}}' in expr, (f.name, expr)
            if f.kind is not Kind.SCALAR:
                by = expr.split(" by (", 1)[1].split(")", 1)[0]
                assert [b for b in by.split(", ") if b and b != "le"] == [*f.fleet_by, *f.key]
    # a few in full: the PromQL the dashboard has always sent
    assert by_field["transfer_seconds_sum"] == [
        'sum by (src, dst) (rate(kvscope_transfer_seconds_sum{job="kvscope"}[1m]))']
    assert by_field["evicted_block_hits"] == [
        'sum by (tier, le) (rate(kvscope_evicted_block_hits_bucket{job="kvscope"}[1m]))']
    assert by_field["pcie_link_max_bytes_per_second"] == [
        'max by (instance, gpu) (kvscope_pcie_link_max_bytes_per_second{job="kvscope"})']
    # a host's memory: the fleet's host with the least headroom, every field from that host
    lowest = 'and on (instance) bottomk(1, kvscope_host_memory_headroom_bytes{job="kvscope"})'
    assert by_field["host_memory_headroom_bytes"] == [
        f'sum((kvscope_host_memory_headroom_bytes{{job="kvscope"}} {lowest}))']
    assert by_field["host_memory_part_bytes"] == [
        f'sum by (part) ((kvscope_host_memory_part_bytes{{job="kvscope"}} {lowest}))']
    assert [f.name for f in FIELDS if f.host] == [
        "host_memory_available_bytes", "host_memory_reserve_bytes", "host_memory_headroom_bytes",
        "host_memory_part_bytes", "host_memory_limit_bytes"]
    # a fleet's queue is every engine's; its GPU KV usage, the fullest engine's
    assert by_field["requests_waiting"] == [
        'sum by (source) (kvscope_requests_waiting{job="kvscope"})']
    assert by_field["preemptions"] == [
        'sum by (source) (rate(kvscope_preemptions_total{job="kvscope"}[1m]))']
    assert by_field["gpu_kv_cache_usage_ratio"] == [
        'max by (source) (kvscope_gpu_kv_cache_usage_ratio{job="kvscope"})']
    assert by_field["ttft_seconds"][1] == (
        'histogram_quantile(0.95, sum by (le) '
        '(rate(kvscope_ttft_seconds_bucket{job="kvscope"}[1m])))')


def test_the_prometheus_backend_rebuilds_every_declared_field_in_its_shape():
    """Every query answered with one series carrying every label: each sample the backend
    builds holds exactly ``ts`` and the declared fields, each in the pipeline's shape."""
    backend = P.PrometheusBackend("http://127.0.0.1:9", clock=lambda: T)
    asked: list[str] = []

    def query_range(expr, start, end, step):
        asked.append(expr)
        points = [[start + i * step, "2"] for i in range(int((end - start) / step) + 1)]
        return [{"metric": {**ALL_LABELS, "le": "+Inf"}, "values": points}]

    backend.query_range = query_range
    try:
        built = backend.timeseries(window_seconds=10)
    finally:
        backend.close()
    assert built and len(asked) == len(P.queries("{}", "1m", 1.0))
    for sample in built:
        assert set(sample) == {"ts", *NAMES}
        for f in FIELDS:
            _check_value(f, sample[f.name], fleet=True)
    assert built[-1]["pcie_link_max_bytes_per_second"] == {"node1:9400->0": 2.0}
    assert built[-1]["transfer_seconds"] == {"cpu->gpu": {p: 2.0 for p in PERCENTILES}}


# --- the figures ---------------------------------------------------------------------------

class _Watched(Mapping):
    """A sample that notes every field read from it."""

    def __init__(self, data: dict, read: set[str]) -> None:
        self._data, self._read = data, read

    def __getitem__(self, name: str):
        self._read.add(name)
        return self._data[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_the_figures_read_only_declared_fields():
    pipe = _busy_pipeline()
    recorded = [pipe.record_sample(T + i, 1e9, host_memory_reserve=2e8,
                                   host_memory_headroom=8e8, offload_budgets={"cpu": 4096},
                                   pcie_link_max={"0": 3.2e10}) for i in range(3)]
    read: set[str] = set()
    watched = [_Watched(s, read) for s in recorded]
    overview.render(watched, window_seconds=900)
    tiers.render(watched, window_seconds=900)
    assert read - {"ts"} <= set(NAMES)
    assert len(read) > 10  # the figures did read the samples
