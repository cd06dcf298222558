"""The dashboard's one-second sample, declared once: each field as a :class:`SampleField`.

A *sample* is a plain dict: ``ts`` (Unix seconds) and one value per field of :data:`FIELDS`,
in their order. The agent's pipeline records one per ``sample_interval``
(``Pipeline.record_sample``, keyed by these objects and checked by :func:`record`), the HTTP API
serves them (``/api/v1/timeseries?metric=`` takes :data:`NAMES`), the Prometheus backend
rebuilds them from PromQL over each field's catalog metric (``dashboard/prometheus.py``), and
the figures read ``sample[name]`` (``dashboard/series.py``).

Each field comes from one catalog metric (:attr:`SampleField.spec`, the object) and has one of
these shapes (:class:`Kind`), its unit the spec's:

- ``COUNTER``: cumulative counter; ``SUM``: a histogram's cumulative sum of observations;
- ``BUCKETS``: a histogram's per-bucket counts (the spec's buckets plus +Inf, not cumulative
  across buckets), cumulative over time;
- ``PERCENTILES``: ``{"p50", "p95", "p99"}`` of a histogram's observations in the last
  ``quantile_window`` samples (None each without observations);
- ``GAUGE``: a current value; ``SCALAR``: one current value, None when unknown.

With key labels (:attr:`SampleField.key`), the value is a dict keyed by those labels' values
joined with "->" (a source, a tier, a "src->dst" direction, a GPU); without, the value itself.
Adding a field: one entry below (and in :data:`FIELDS`), and its value in ``record_sample``.

Imports only the standard library, the catalog and the vocabulary.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvscope import catalog as c

# the percentiles a PERCENTILES field holds: name -> quantile (0-1)
PERCENTILES: dict[str, float] = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
KEY_SEPARATOR = "->"


class Kind(enum.Enum):
    """A field's shape (see the module doc)."""

    COUNTER = "counter"
    SUM = "sum"
    BUCKETS = "buckets"
    PERCENTILES = "percentiles"
    GAUGE = "gauge"
    SCALAR = "scalar"


# the catalog type each kind is read from
SPEC_TYPE = {Kind.COUNTER: "counter", Kind.SUM: "histogram", Kind.BUCKETS: "histogram",
             Kind.PERCENTILES: "histogram", Kind.GAUGE: "gauge", Kind.SCALAR: "gauge"}
# the suffix of the series a kind is read from in Prometheus
SERIES_SUFFIX = {Kind.SUM: "_sum", Kind.BUCKETS: "_bucket", Kind.PERCENTILES: "_bucket"}


@dataclass(frozen=True, eq=False)  # one object per field: hashed by identity, a record() key
class SampleField:
    """One field of the sample. ``key``: the spec's labels whose values make a dict's keys
    (other labels are summed over). ``fleet``: how a fleet's gauges or scalars aggregate in
    PromQL (sum, or max). ``fleet_by``: labels Prometheus adds that the fleet's key starts with
    ("instance" where a key repeats across hosts, as GPU indices do). ``host``: one host's
    memory, which a fleet shows as its host with the least headroom (every such field from
    that one host: summed, the hosts read as one large one, and a host eating into its reserve
    was hidden by the others' headroom)."""

    name: str
    spec: c.MetricSpec
    kind: Kind
    key: tuple[str, ...] = ()
    fleet: str = "sum"
    fleet_by: tuple[str, ...] = ()
    host: bool = False

    @property
    def series(self) -> str:
        """The Prometheus series this field is read from: the spec's name, with ``_sum`` or
        ``_bucket`` for a histogram's parts."""
        return self.spec.name + SERIES_SUFFIX.get(self.kind, "")


def _f(name, spec, kind, key=(), fleet="sum", fleet_by=(), host=False) -> SampleField:
    return SampleField(name, spec, kind, tuple(key), fleet, tuple(fleet_by), host)


PROMPT_TOKENS = _f("prompt_tokens", c.PROMPT_TOKENS, Kind.COUNTER, ["source"])
PROMPT_PREFIX_BLOCKS = _f("prompt_prefix_blocks", c.PROMPT_PREFIX_BLOCKS, Kind.COUNTER, ["prefix"])
TRANSFER_BYTES = _f("transfer_bytes", c.TRANSFER_BYTES, Kind.COUNTER, ["src", "dst"])
EVICTED_BLOCKS = _f("evicted_blocks", c.EVICTED_BLOCKS, Kind.COUNTER, ["tier"])
TIER_RESIDENT_BYTES = _f("tier_resident_bytes", c.TIER_RESIDENT_BYTES, Kind.GAUGE, ["tier"])
TIER_CAPACITY_BYTES = _f("tier_capacity_bytes", c.TIER_CAPACITY_BYTES, Kind.GAUGE, ["tier"])
HOST_MEMORY_AVAILABLE_BYTES = _f("host_memory_available_bytes", c.HOST_MEMORY_AVAILABLE_BYTES,
                                 Kind.SCALAR, host=True)
# added for the dashboard (issue 6)
REQUESTS = _f("requests", c.REQUESTS, Kind.COUNTER)
PREFILL_SECONDS_SAVED = _f("prefill_seconds_saved", c.PREFILL_SECONDS_SAVED, Kind.COUNTER,
                           ["source"])
TRANSFER_BLOCKS = _f("transfer_blocks", c.TRANSFER_BLOCKS, Kind.COUNTER, ["src", "dst"])
TRANSFER_SECONDS_SUM = _f("transfer_seconds_sum", c.TRANSFER_SECONDS, Kind.SUM, ["src", "dst"])
DROPPED_BLOCKS = _f("dropped_blocks", c.DROPPED_BLOCKS, Kind.COUNTER, ["tier"])
EVICTED_BLOCK_HITS = _f("evicted_block_hits", c.EVICTED_BLOCK_HITS, Kind.BUCKETS, ["tier"])
BLOCK_RESIDENCY_SECONDS = _f("block_residency_seconds", c.BLOCK_RESIDENCY_SECONDS, Kind.BUCKETS,
                             ["tier"])
TTFT_SECONDS = _f("ttft_seconds", c.TTFT_SECONDS, Kind.PERCENTILES)
PROMOTION_WAIT_SECONDS = _f("promotion_wait_seconds", c.PROMOTION_WAIT_SECONDS, Kind.PERCENTILES)
TRANSFER_SECONDS = _f("transfer_seconds", c.TRANSFER_SECONDS, Kind.PERCENTILES, ["src", "dst"])
TIER_RESIDENT_BLOCKS = _f("tier_resident_blocks", c.TIER_RESIDENT_BLOCKS, Kind.GAUGE, ["tier"])
TIER_CAPACITY_BLOCKS = _f("tier_capacity_blocks", c.TIER_CAPACITY_BLOCKS, Kind.GAUGE, ["tier"])
HOST_MEMORY_RESERVE_BYTES = _f("host_memory_reserve_bytes", c.HOST_MEMORY_RESERVE_BYTES,
                               Kind.SCALAR, host=True)
HOST_MEMORY_HEADROOM_BYTES = _f("host_memory_headroom_bytes", c.HOST_MEMORY_HEADROOM_BYTES,
                                Kind.SCALAR, host=True)
# a fleet: added up, as the tiers' residency and capacity it is drawn beside (the host with the
# least headroom's cpu budget is its memory part "kv_offload")
OFFLOAD_BUDGET_BYTES = _f("offload_budget_bytes", c.OFFLOAD_BUDGET_BYTES, Kind.GAUGE, ["tier"])
# a fleet's line is its fastest link: max, per host (GPU indices repeat across hosts)
PCIE_LINK_MAX_BYTES_PER_SECOND = _f("pcie_link_max_bytes_per_second",
                                    c.PCIE_LINK_MAX_BYTES_PER_SECOND, Kind.GAUGE, ["gpu"],
                                    fleet="max", fleet_by=["instance"])
# is GPU memory the limiter? Each source's scheduler, keyed by source (a fleet: the queues
# added up, the fullest GPU KV cache); absent for a source that does not report it
REQUESTS_WAITING = _f("requests_waiting", c.REQUESTS_WAITING, Kind.GAUGE, ["source"])
REQUESTS_RUNNING = _f("requests_running", c.REQUESTS_RUNNING, Kind.GAUGE, ["source"])
PREEMPTIONS = _f("preemptions", c.PREEMPTIONS, Kind.COUNTER, ["source"])
GPU_KV_CACHE_USAGE_RATIO = _f("gpu_kv_cache_usage_ratio", c.GPU_KV_CACHE_USAGE_RATIO, Kind.GAUGE,
                              ["source"], fleet="max")
# the memory budget breakdown: host parts by part (a fleet: its host with the least headroom),
# GPU parts by "gpu->part" (a fleet: per host, GPU indices repeat across hosts), and the wholes
# they add up to
HOST_MEMORY_PART_BYTES = _f("host_memory_part_bytes", c.HOST_MEMORY_PART_BYTES, Kind.GAUGE,
                            ["part"], host=True)
GPU_MEMORY_PART_BYTES = _f("gpu_memory_part_bytes", c.GPU_MEMORY_PART_BYTES, Kind.GAUGE,
                           ["gpu", "part"], fleet_by=["instance"])
HOST_MEMORY_LIMIT_BYTES = _f("host_memory_limit_bytes", c.HOST_MEMORY_LIMIT_BYTES, Kind.SCALAR,
                             host=True)
GPU_MEMORY_TOTAL_BYTES = _f("gpu_memory_total_bytes", c.GPU_MEMORY_TOTAL_BYTES, Kind.GAUGE,
                            ["gpu"], fleet_by=["instance"])
# misconfigurations (kvscope.dashboard.misconfig): bytes read back in from swap since boot (a
# counter, 0 without a host reading: measured only where host_memory_limit_bytes is), and the
# model weights per GPU the engine keeps in host RAM (a fleet: the largest)
HOST_SWAP_IN_BYTES = _f("host_swap_in_bytes", c.HOST_SWAP_IN_BYTES, Kind.COUNTER)
ENGINE_WEIGHT_OFFLOAD_BYTES = _f("engine_weight_offload_bytes", c.ENGINE_WEIGHT_OFFLOAD_BYTES,
                                 Kind.SCALAR, fleet="max")
# the cheaper steps before offload (kvscope.dashboard.offload_verdict): each source's engine's
# KV cache settings, keyed "source->prefix_caching->kv_cache_dtype", 1 each (a fleet: how
# many agents report that key); absent for a source whose engine does not say
ENGINE_CACHE_CONFIG = _f("engine_cache_config", c.ENGINE_CACHE_CONFIG_INFO, Kind.GAUGE,
                         ["source", "prefix_caching", "kv_cache_dtype"])
# failed transfers by direction, every reason added up: only the directions a source that sees
# failures moved blocks in (0 included), absent for the others (not measured, never 0)
TRANSFER_FAILURES = _f("transfer_failures", c.TRANSFER_FAILURES, Kind.COUNTER, ["src", "dst"])

# in sample order (the order of a recorded sample's keys, after ``ts``)
FIELDS: tuple[SampleField, ...] = (
    PROMPT_TOKENS, TRANSFER_BYTES, EVICTED_BLOCKS, TIER_RESIDENT_BYTES, TIER_CAPACITY_BYTES,
    HOST_MEMORY_AVAILABLE_BYTES, REQUESTS, PREFILL_SECONDS_SAVED, TRANSFER_BLOCKS,
    TRANSFER_SECONDS_SUM, DROPPED_BLOCKS, EVICTED_BLOCK_HITS, BLOCK_RESIDENCY_SECONDS,
    TTFT_SECONDS, PROMOTION_WAIT_SECONDS, TRANSFER_SECONDS, TIER_RESIDENT_BLOCKS,
    TIER_CAPACITY_BLOCKS, HOST_MEMORY_RESERVE_BYTES, HOST_MEMORY_HEADROOM_BYTES,
    OFFLOAD_BUDGET_BYTES, PCIE_LINK_MAX_BYTES_PER_SECOND, REQUESTS_WAITING, REQUESTS_RUNNING,
    PREEMPTIONS, GPU_KV_CACHE_USAGE_RATIO, HOST_MEMORY_PART_BYTES, GPU_MEMORY_PART_BYTES,
    HOST_MEMORY_LIMIT_BYTES, GPU_MEMORY_TOTAL_BYTES, HOST_SWAP_IN_BYTES,
    ENGINE_WEIGHT_OFFLOAD_BYTES, ENGINE_CACHE_CONFIG, PROMPT_PREFIX_BLOCKS, TRANSFER_FAILURES,
)
NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
BY_NAME: dict[str, SampleField] = {f.name: f for f in FIELDS}
_KNOWN = frozenset(FIELDS)


def join_key(values: Sequence[str]) -> str:
    """A dict key from label values: ``("cpu", "gpu")`` -> ``"cpu->gpu"``."""
    return KEY_SEPARATOR.join(values)


def record(ts: float, values: Mapping[SampleField, object]) -> dict:
    """The sample: ``{"ts": ts, name: value, ...}`` in :data:`FIELDS` order. ``values``: one
    value per field, keyed by the field object; ValueError names a field missing or unknown."""
    missing = [f.name for f in FIELDS if f not in values]
    unknown = [getattr(f, "name", repr(f)) for f in values if f not in _KNOWN]
    if missing or unknown:
        raise ValueError(f"sample fields missing: {missing}, unknown: {unknown}")
    return {"ts": ts, **{f.name: values[f] for f in FIELDS}}
