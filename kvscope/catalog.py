"""The metric catalog: every metric kvscope exports, defined once, as a :class:`MetricSpec`.

Producers (the pipeline's snapshot, the collectors, the agent's sinks) hand over their values as
:data:`Samples` keyed by these spec objects, never by name; the Prometheus exposition
(``exporter/prometheus.py``), ``docs/metrics.md``, the Grafana mixin and the tests follow from
this table. Names follow Prometheus conventions (``kvscope_`` prefix, base units, ``_total`` on
counters); labels come from bounded sets only (``vocabulary.py``), never request ids or block
hashes. Adding a metric: one entry here (and in :data:`CATALOG`), the code that produces its
value, and (if shown) one figure or panel.

Imports only the standard library and the vocabulary (below everything that uses it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.vocabulary import FAILURE_REASONS, TOKEN_SOURCES

# Transfer-time buckets, seconds: 10 us .. 10 s, covering one-block PCIe copies up to disk reads.
TRANSFER_SECONDS_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
# Request latency buckets (TTFT, inter-token latency), seconds: 1 ms .. 60 s. 2.0 and 2.5 are
# the mixin's default TTFT warning (80% of the budget) and budget: histogram_quantile
# interpolates within a bucket, and with (1.0, 2.5] one request in a hundred at 1.05 s read
# as a p99 of 2.2 s, over the warning.
LATENCY_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5,
                           5.0, 10.0, 30.0, 60.0)
# Promotion wait, seconds: exactly 0 for most requests (nothing to promote), so a bucket of its
# own at 0; without it histogram_quantile spread those zeros over 0 .. 1 ms (a p99 of 1 ms when
# 498 of 500 requests waited nothing).
WAIT_SECONDS_BUCKETS = (0.0, *LATENCY_SECONDS_BUCKETS)
# Hits a block got before eviction: 0 means it was stored for nothing.
EVICTED_HITS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
# Block age at eviction, seconds: 100 ms .. 1 day.
RESIDENCY_SECONDS_BUCKETS = (0.1, 1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)


@dataclass(frozen=True, eq=False)  # one object per metric: hashed by identity, a Samples key
class MetricSpec:
    """One metric. ``type``: counter, gauge or histogram. ``unit``: base unit or "" (counts).
    ``buckets``: upper bounds for histograms, in the unit. ``gpu_only``: has series only where
    an NVIDIA GPU is present."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    buckets: tuple[float, ...] = ()
    gpu_only: bool = False

    def label_values(self, **values: str) -> list[str]:
        """``values`` in this metric's label order; KeyError names a label not given."""
        return [values[label] for label in self.labels]


def _counter(name, help, labels=(), unit="", gpu_only=False):
    return MetricSpec(name, "counter", help, tuple(labels), unit, gpu_only=gpu_only)


def _gauge(name, help, labels=(), unit="", gpu_only=False):
    return MetricSpec(name, "gauge", help, tuple(labels), unit, gpu_only=gpu_only)


def _histogram(name, help, labels, unit, buckets):
    return MetricSpec(name, "histogram", help, tuple(labels), unit, buckets)


# hit quality
PROMPT_TOKENS = _counter("kvscope_prompt_tokens_total",
    "Prompt tokens by where their KV came from: gpu (resident), cpu or disk (promoted), "
    "recompute (prefill). A source is exported from the first lookup that measures it, at 0 "
    "until it has tokens; one no engine measures (LMCache's view of the GPU's hits, a tier the "
    "engine lacks) is absent, not 0.", ["source"])
LOOKUP_BLOCKS = _counter("kvscope_lookup_blocks_total",
    "Block lookups per tier consulted, by result (hit or miss); a tier is consulted when every "
    "tier above it missed. Every resident block of a prompt counts as a hit, even after an "
    "earlier miss, while only the leading run of hits serves tokens "
    "(kvscope_prompt_tokens_total), so hits can exceed the blocks promoted.", ["tier", "result"])
PROMPT_PREFIX_BLOCKS = _counter("kvscope_prompt_prefix_blocks_total",
    "Prompt blocks by whether their prefix was seen before (seen) or not (new), whatever any "
    "tier held: the prompts' own reuse, which kvscope_prompt_tokens_total shows only as far as "
    "the tiers were big enough. Estimated from the block hashes lookups carry (the vLLM tap's "
    "SHARDS sample counts each sampled block 1/rate times; the reference engine sends every "
    "block), against the last 131,072 distinct sampled prefixes; absent when no lookup "
    "carries hashes.", ["prefix"])
PREFILL_SECONDS_SAVED = _counter("kvscope_prefill_seconds_saved_total",
    "Estimated prefill seconds saved by tokens served from cache: tokens over the prefill "
    "rate the source's lookups carry, else the one its finished requests measured "
    "(recomputed tokens over prefill seconds, from 10 requests), else the agent's "
    "prefill_tokens_per_second.",
    ["source"], "seconds")

# transfers
TRANSFER_BYTES = _counter("kvscope_transfer_bytes_total",
    "Bytes copied between tiers (offloads away from the GPU, promotions toward it).",
    ["src", "dst"], "bytes")
TRANSFER_BLOCKS = _counter("kvscope_transfer_blocks_total",
    "KV blocks copied between tiers.", ["src", "dst"])
TRANSFER_SECONDS = _histogram("kvscope_transfer_seconds",
    "Measured duration of one batched transfer between tiers; exemplars carry the request's "
    "trace id. vLLM's /metrics time a promotion into the cpu tier from its job's creation, "
    "queueing included.", ["src", "dst"], "seconds", TRANSFER_SECONDS_BUCKETS)
TRANSFER_FAILURES = _counter("kvscope_transfer_failures_total",
    "Transfers that failed, by reason (" + ", ".join(FAILURE_REASONS) + "); 0 for each "
    "reason of a direction a source that sees failures has transferred in, absent where only "
    "sources blind to them did (KV events, scraped byte counters).", ["src", "dst", "reason"])

# evictions
EVICTED_BLOCKS = _counter("kvscope_evicted_blocks_total",
    "KV blocks that left a tier, by reason (capacity: made room; cleared: the engine reset; "
    "failed: unreadable).", ["tier", "reason"])
DROPPED_BLOCKS = _counter("kvscope_dropped_blocks_total",
    "KV blocks evicted from a tier with no copy kept in a tier below (they left the cache); 0 "
    "for a tier with evictions that all kept a copy.", ["tier"])
EVICTED_BLOCK_HITS = _histogram("kvscope_evicted_block_hits",
    "Hits a block got while resident, observed when it is evicted (0: stored for nothing). A "
    "sampling source (vLLM's tap) counts each sampled block for the ones it stands for.",
    ["tier"], "", EVICTED_HITS_BUCKETS)
BLOCK_RESIDENCY_SECONDS = _histogram("kvscope_block_residency_seconds",
    "Age of a block when it is evicted. A sampling source (vLLM's tap) counts each sampled "
    "block for the ones it stands for.", ["tier"], "seconds", RESIDENCY_SECONDS_BUCKETS)
BLOCK_IDLE_SECONDS = _histogram("kvscope_block_idle_seconds",
    "Seconds an evicted block had gone unused: since its last hit, or since it was stored if "
    "never hit; observed at eviction, the signal for sizing a tier (blocks evicted long idle: "
    "the tier is big enough; evicted soon after a hit: too small). From the reference engine, "
    "vLLM's tap (its sampled CPU chunks, each counted for the ones it stands for) and vLLM's "
    "vllm:kv_block_idle_before_evict_seconds (GPU blocks, vLLM's sample as it is: the shape, "
    "not the number of evictions); absent for a tier no source measures.",
    ["tier"], "seconds", RESIDENCY_SECONDS_BUCKETS)
STORE_ADMISSIONS = _counter("kvscope_store_admissions_total",
    "KV blocks offered to a tier for storing, by result (blocks, not chunks or calls): stored "
    "(written there), skipped (declined unwritten, by the admission policy, e.g. a store "
    "threshold or minimum priority, or because the tier could not make room), failed "
    "(admitted, but the write failed). From the reference engine (cpu and disk), vLLM's tap "
    "(cpu: stored and failed store jobs, skipped when vLLM's manager could not make room) and "
    "vLLM's vllm:kv_offload_stores_skipped (cpu: skipped by its store threshold); a result no "
    "source reports is absent.", ["tier", "result"])

# tiers
TIER_CAPACITY_BYTES = _gauge("kvscope_tier_capacity_bytes",
    "Bytes a tier may hold (absent where its source does not report it).", ["tier"], "bytes")
TIER_RESIDENT_BYTES = _gauge("kvscope_tier_resident_bytes",
    "Bytes a tier currently holds (absent where no source reports it, or its source lacks "
    "the block size: then its blocks alone).", ["tier"], "bytes")
TIER_CAPACITY_BLOCKS = _gauge("kvscope_tier_capacity_blocks",
    "KV blocks a tier may hold (absent where its source does not report it).", ["tier"])
TIER_RESIDENT_BLOCKS = _gauge("kvscope_tier_resident_blocks",
    "KV blocks a tier currently holds (absent where no source reports it, or its source "
    "lacks the block size: then its bytes alone).", ["tier"])

# requests
REQUESTS = _counter("kvscope_requests_total",
    "Requests that finished their prefill: kvscope_ttft_seconds's observations, from request "
    "records or an engine's own TTFT histogram.")
TTFT_SECONDS = _histogram("kvscope_ttft_seconds",
    "Time to first token of each request; exemplars carry its trace id.",
    [], "seconds", LATENCY_SECONDS_BUCKETS)
PROMOTION_WAIT_SECONDS = _histogram("kvscope_promotion_wait_seconds",
    "Seconds of a request's TTFT spent waiting for promotions, one observation for each "
    "request whose source measured it (kvscope's taps do; vLLM's spans alone do not).",
    [], "seconds", WAIT_SECONDS_BUCKETS)
ITL_SECONDS = _histogram("kvscope_itl_seconds",
    "Mean inter-token latency of each request that generated two or more tokens (the tap's, or "
    "vLLM's decode time over its tokens from its span): one observation a request, not one a "
    "token as vllm:inter_token_latency_seconds.", [], "seconds", LATENCY_SECONDS_BUCKETS)

# the scheduler: is GPU memory the limiter? (each source's own, absent until it reports it)
REQUESTS_WAITING = _gauge("kvscope_requests_waiting",
    "Requests that arrived and wait to be scheduled, as the source's engine reports them "
    "(vLLM's vllm:num_requests_waiting over its engines; the reference engine's replay queue).",
    ["source"])
REQUESTS_RUNNING = _gauge("kvscope_requests_running",
    "Requests in the engine's running batches (prefilling or decoding), as the source's engine "
    "reports them (vLLM's vllm:num_requests_running over its engines; the reference engine's "
    "replay: 1 while it serves, 0 once played out).", ["source"])
PREEMPTIONS = _counter("kvscope_preemptions_total",
    "Requests the engine preempted (their GPU KV blocks freed for others, to be recomputed "
    "when resumed): GPU memory is the limiter when this rises. Only from an engine that "
    "preempts (vLLM's vllm:num_preemptions_total).", ["source"])
GPU_KV_CACHE_USAGE_RATIO = _gauge("kvscope_gpu_kv_cache_usage_ratio",
    "Share of the GPU KV cache in use, 0 to 1, as the source's engine reports it (vLLM's "
    "vllm:kv_cache_usage_perc, the fullest of its engines; the reference engine: the blocks of "
    "the request it serves). Blocks held by running requests, not the cached ones a warm tier "
    "keeps (those are in kvscope_tier_resident_blocks).",
    ["source"], "ratio")
TRANSFERS_IN_FLIGHT = _gauge("kvscope_transfers_in_flight",
    "Copies from src to dst the source's engine submitted and has not seen finish, now (vLLM's "
    "worker jobs through the tap; the reference engine's batched copies). Climbing while "
    "finished transfers stay flat: the copy engine fell behind, or a job never completes.",
    ["source", "src", "dst"])
TRANSFER_BLOCKS_IN_FLIGHT = _gauge("kvscope_transfer_blocks_in_flight",
    "KV blocks in the copies of kvscope_transfers_in_flight.", ["source", "src", "dst"])

# host
HOST_MEMORY_TOTAL_BYTES = _gauge("kvscope_host_memory_total_bytes",
    "Host physical memory (psutil).", [], "bytes")
HOST_MEMORY_AVAILABLE_BYTES = _gauge("kvscope_host_memory_available_bytes",
    "Host memory available to new allocations without swapping (psutil), capped by the cgroup's"
    " remaining limit when that is tighter.", [], "bytes")
HOST_MEMORY_LIMIT_BYTES = _gauge("kvscope_host_memory_limit_bytes",
    "The tighter of host physical memory and the cgroup's memory limit (v2 memory.max, v1 "
    "memory.limit_in_bytes).", [], "bytes")
HOST_SWAP_USED_BYTES = _gauge("kvscope_host_swap_used_bytes",
    "Swap in use (psutil).", [], "bytes")
HOST_SWAP_IN_BYTES = _counter("kvscope_host_swap_in_bytes_total",
    "Bytes the host read back in from swap since boot (Linux's /proc/vmstat pswpin pages "
    "times the kernel's page size), host-wide; absent where vmstat cannot be read. Rising "
    "means pages the host needs now were swapped out: memory is overcommitted.", [], "bytes")
HOST_MEMORY_RESERVE_BYTES = _gauge("kvscope_host_memory_reserve_bytes",
    "Memory the operator keeps free for the OS and other services (config).", [], "bytes")
HOST_MEMORY_HEADROOM_BYTES = _gauge("kvscope_host_memory_headroom_bytes",
    "Available memory minus the reserve; negative when the reserve is eaten into.", [], "bytes")
OFFLOAD_BUDGET_BYTES = _gauge("kvscope_offload_budget_bytes",
    "Bytes reserved for an offload tier: what the engine reports (vLLM's tap: cpu_bytes_to_use), "
    "unless the agent's collectors.host budgets override it.", ["tier"], "bytes")
HOST_MEMORY_PART_BYTES = _gauge("kvscope_host_memory_part_bytes",
    "The host's memory limit split into parts that add up to it: kv_offload (the KV offload "
    "budget), engine_other (the engine process's memory beyond it), other (in use by everything "
    "else), reserve, free (docs/collectors.md, Memory budgets); a part not measured is absent.",
    ["part"], "bytes")
HOST_NUMA_NODES = _gauge("kvscope_host_numa_nodes",
    "NUMA nodes online on the host (/sys/devices/system/node/online).")
PROCESS_NUMA_BYTES = _gauge("kvscope_process_numa_bytes",
    "Memory the engine process (collectors.numa engine_pid, else the processes kvscope's taps "
    "run in) has mapped on each NUMA node, from /proc/<pid>/numa_maps.", ["numa_node"], "bytes")

# GPU (NVML)
PCIE_BYTES = _counter("kvscope_pcie_bytes_total",
    "PCIe bytes moved by a GPU, by direction (tx, rx).",
    ["gpu", "direction"], "bytes", gpu_only=True)
PCIE_LINK_MAX_BYTES_PER_SECOND = _gauge("kvscope_pcie_link_max_bytes_per_second",
    "Maximum PCIe throughput of a GPU's current link, one direction.",
    ["gpu"], "bytes_per_second", gpu_only=True)
GPU_MEMORY_USED_BYTES = _gauge("kvscope_gpu_memory_used_bytes",
    "GPU memory in use (NVML).", ["gpu"], "bytes", gpu_only=True)
GPU_MEMORY_TOTAL_BYTES = _gauge("kvscope_gpu_memory_total_bytes",
    "GPU memory in all (NVML).", ["gpu"], "bytes", gpu_only=True)
GPU_MEMORY_PART_BYTES = _gauge("kvscope_gpu_memory_part_bytes",
    "A GPU's memory (NVML total) split into parts that add up to it: kv_cache and weights (from "
    "the engine's tap), workspace (activations, CUDA graphs and context), other (in use, "
    "unattributed), free (docs/collectors.md, Memory budgets).", ["gpu", "part"], "bytes",
    gpu_only=True)
GPU_TOPOLOGY_INFO = _gauge("kvscope_gpu_topology_info",
    "Always 1; a GPU's PCIe link, current (pcie_generation, pcie_width: an idle GPU drops "
    "to a lower generation) and maximum (pcie_max_generation, pcie_max_width), and the host "
    "NUMA node nearest to it (numa_node: NVML's memory affinity, else the PCI device's "
    "numa_node in sysfs); a label is empty when NVML or the kernel does not say.",
    ["gpu", "pcie_generation", "pcie_width", "pcie_max_generation", "pcie_max_width",
     "numa_node"], gpu_only=True)

# the agent itself
EVENTS_RECEIVED = _counter("kvscope_events_received_total",
    "kvscope events the agent accepted, by source.", ["source"])
EVENTS_DROPPED = _counter("kvscope_events_dropped_total",
    "kvscope events the agent (or a tap's emitter) dropped, by source and reason (reason gap "
    "counts missing batches, abandoned requests never finished).", ["source", "reason"])
OTLP_SPANS = _counter("kvscope_otlp_spans_total",
    "Request and transfer spans of OTLP export (0 without otlp_endpoint), by result: sent (the "
    "endpoint accepted them), failed (refused, or unreachable after retries), dropped (never "
    "queued: the endpoint was too slow or away and the queue was full).", ["result"])
RECORDS_DROPPED = _counter("kvscope_records_dropped_total",
    "Records the agent could not write to disk (a full or removed disk, a value that does not "
    "fit), by sink: store (finished requests, store_dir), capture_requests, capture_blocks, "
    "capture_totals, capture_tokens and capture_tiers (the Parquet capture, capture_dir); 0 "
    "for a sink not configured.", ["sink"])
TAP_ERRORS = _counter("kvscope_tap_errors_total",
    "What an in-engine tap could not observe, by source and reason (internal: the tap's own "
    "code failed at its boundary, or it had to forget state it tracks, and the engine ran on; "
    "unattributed: a request the tap could not follow, its blocks counted without it), as the "
    "tap reports it with its batches.", ["source", "reason"])
SOURCE_UP = _gauge("kvscope_source_up",
    "1 when a source the agent reads works, 0 when it is failing: its ingest socket, OTLP "
    "receiver, KV events and each engine's metrics it scrapes (vllm_metrics, sglang_metrics, "
    "lmcache_metrics, kvbm_metrics, trtllm; while 0, their tier and scheduler gauges are left "
    "out), the demo's engine too, not each tap.", ["source"])
COLLECTOR_UP = _gauge("kvscope_collector_up",
    "1 when a collector's last run succeeded, 0 otherwise.", ["collector"])
COLLECTOR_DURATION_SECONDS = _gauge("kvscope_collector_duration_seconds",
    "How long a collector's last run took.", ["collector"], "seconds")
ENGINE_INFO = _gauge("kvscope_engine_info",
    "Always 1; the engine and model a source observes.", ["source", "engine", "model"])
ENGINE_CACHE_CONFIG_INFO = _gauge("kvscope_engine_cache_config_info",
    "Always 1; the KV cache settings of the engine a source observes, as the engine reports "
    "them (vLLM's vllm:cache_config_info and its tap, the reference engine its own): "
    "prefix_caching (on, off: GPU prefix caching, vLLM's --enable-prefix-caching) and "
    "kv_cache_dtype (the KV "
    "cache's element type by width: auto (the model's), 32bit, 16bit, 8bit (fp8, int8), 4bit, "
    "other); absent for a source whose engine does not say.",
    ["source", "prefix_caching", "kv_cache_dtype"])
ENGINE_WEIGHT_OFFLOAD_BYTES = _gauge("kvscope_engine_weight_offload_bytes",
    "Model weight bytes per GPU the engine keeps in host RAM and streams to the GPU on every "
    "forward pass: vLLM's --cpu-offload-gb x 2^30, read from the command line of the engine "
    "process (collectors.engine_args engine_pid, else the vLLM server found on the host); 0 "
    "without the flag, absent when there is no such process or it is not vLLM. Weight "
    "offload, not KV offload.", [], "bytes")
BUILD_INFO = _gauge("kvscope_build_info",
    "Always 1; the kvscope version in a label.", ["version"])

# in exposition order (docs/metrics.md, /metrics)
CATALOG: tuple[MetricSpec, ...] = (
    PROMPT_TOKENS, LOOKUP_BLOCKS, PROMPT_PREFIX_BLOCKS, PREFILL_SECONDS_SAVED, TRANSFER_BYTES,
    TRANSFER_BLOCKS, TRANSFER_SECONDS, TRANSFER_FAILURES, EVICTED_BLOCKS, DROPPED_BLOCKS,
    EVICTED_BLOCK_HITS,
    BLOCK_RESIDENCY_SECONDS, BLOCK_IDLE_SECONDS, STORE_ADMISSIONS, TIER_CAPACITY_BYTES,
    TIER_RESIDENT_BYTES, TIER_CAPACITY_BLOCKS, TIER_RESIDENT_BLOCKS, REQUESTS, TTFT_SECONDS,
    PROMOTION_WAIT_SECONDS, ITL_SECONDS,
    REQUESTS_WAITING, REQUESTS_RUNNING, PREEMPTIONS, GPU_KV_CACHE_USAGE_RATIO, TRANSFERS_IN_FLIGHT,
    TRANSFER_BLOCKS_IN_FLIGHT,
    HOST_MEMORY_TOTAL_BYTES, HOST_MEMORY_AVAILABLE_BYTES, HOST_MEMORY_LIMIT_BYTES,
    HOST_SWAP_USED_BYTES, HOST_SWAP_IN_BYTES, HOST_MEMORY_RESERVE_BYTES,
    HOST_MEMORY_HEADROOM_BYTES,
    OFFLOAD_BUDGET_BYTES, HOST_MEMORY_PART_BYTES, HOST_NUMA_NODES, PROCESS_NUMA_BYTES, PCIE_BYTES,
    PCIE_LINK_MAX_BYTES_PER_SECOND, GPU_MEMORY_USED_BYTES, GPU_MEMORY_TOTAL_BYTES,
    GPU_MEMORY_PART_BYTES, GPU_TOPOLOGY_INFO, EVENTS_RECEIVED, EVENTS_DROPPED, OTLP_SPANS, RECORDS_DROPPED,
    TAP_ERRORS, SOURCE_UP, COLLECTOR_UP, COLLECTOR_DURATION_SECONDS, ENGINE_INFO,
    ENGINE_CACHE_CONFIG_INFO, ENGINE_WEIGHT_OFFLOAD_BYTES, BUILD_INFO,
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOG}

# What producers hand the exposition: per metric, ``(label values in the spec's order, value)``
# pairs; a value is a number, or for a histogram an object with ``buckets``, ``counts`` (per
# bucket, +Inf last), ``sum`` and ``exemplars`` (``agent.histograms.Histogram``).
Samples = dict[MetricSpec, list[tuple[Sequence[str], object]]]


# the metrics whose ``source`` label is a token source, not the agent input (render_markdown)
TOKEN_SOURCE_METRICS = (PROMPT_TOKENS, PREFILL_SECONDS_SAVED)


def render_markdown() -> str:
    """``docs/metrics.md``: the catalog as a Markdown table (generated; do not edit by hand)."""
    lines = [
        "# kvscope metrics",
        "",
        "Generated from `kvscope/catalog.py` by `kvscope docs-metrics`; do not edit by hand.",
        "",
        "The `source` label names the agent input a series came from (a tap's emitter, e.g. "
        "`engine` or `vllm`, or a source the agent reads), except on "
        + " and ".join(f"`{spec.name}`" for spec in TOKEN_SOURCE_METRICS)
        + ", where it is the token source, as the guide uses the word: where a prompt token's "
        "KV came from (" + ", ".join(TOKEN_SOURCES) + ").",
        "",
        "| name | type | unit | labels | help |",
        "| --- | --- | --- | --- | --- |",
    ]
    for spec in CATALOG:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        lines.append(f"| `{spec.name}` | {spec.type} | {spec.unit or '-'} | {labels} | {spec.help} |")
    return "\n".join(lines) + "\n"
