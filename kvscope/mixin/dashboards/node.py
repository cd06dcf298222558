"""Node: is the host the limiter? Host RAM and headroom, PCIe throughput against the link
maximum, the transfer topology (PCIe links, NUMA placement), whether GPU memory is the limiter
(GPU KV usage, the scheduler's queue, preemptions), and what the agent lost."""

from __future__ import annotations

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.dashboards.common import (
    RATE, RED_BELOW_ONE, UP_DOWN, P, Q, Row, board, headroom_steps, s)
from kvscope.mixin.promql import offload_tiers
from kvscope.mixin.rules import Records


def node(cfg: MixinConfig) -> dict:
    r = Records.of(cfg)
    host = lambda metric, legend: Q(f"sum by (instance) ({metric}{s(cfg)})",  # noqa: E731
                                    f"{{{{instance}}}} {legend}")

    def breakdown(metric: str, whole: str, legend: str) -> dict:
        """A memory budget breakdown's queries and style: ``metric``'s parts stacked, and the
        ``whole`` they add up to as a dashed line."""
        return dict(queries=(Q(f"sum by (part) ({metric}{s(cfg)})", "{{part}}"),
                             Q(f"sum({whole}{s(cfg)})", legend)),
                    unit="bytes", stack="normal", unstacked=("B",))

    rows = [
        Row("Host memory", (
            P("Host memory", "Physical memory, the tighter of it and the cgroup limit, memory "
              "available without swapping, and the reserve kept for the OS.",
              (host("kvscope_host_memory_total_bytes", "total"),
               host("kvscope_host_memory_limit_bytes", "limit"),
               host("kvscope_host_memory_available_bytes", "available"),
               host("kvscope_host_memory_reserve_bytes", "reserve")),
              unit="bytes"),
            P("Headroom", "Available memory minus the reserve; negative when the reserve is "
              "eaten into.",
              (host("kvscope_host_memory_headroom_bytes", "headroom"),),
              unit="bytes", width=6, thresholds=((None, "red"), (0, "green"))),
            P("Headroom ratio", "Headroom as a share of the memory limit (recording rule the "
              "alert reads).",
              (Q(f"{r.headroom_ratio}{s(cfg)}", "{{instance}}"),),
              unit="percentunit", width=6, thresholds=headroom_steps(cfg)),
            P("Offload tiers against their budget",
              "Bytes resident in each offload tier against the budget the operator reserved "
              "for it (e.g. vLLM cpu_bytes_to_use).",
              (Q(f"sum by (instance, tier) (kvscope_tier_resident_bytes{s(cfg, offload_tiers(cfg))})",
                 "{{instance}} {{tier}} resident"),
               Q(f"sum by (instance, tier) (kvscope_offload_budget_bytes{s(cfg)})",
                 "{{instance}} {{tier}} budget")),
              unit="bytes"),
            P("Host memory budget", "The host's memory limit split into parts that add up to "
              "it, stacked: the KV offload budget (what the engine reports, vLLM's "
              "cpu_bytes_to_use, unless collectors.host budgets override it), the engine "
              "process's other memory (collectors.host engine_pid), what every other process "
              "and the kernel hold, the reserve, and what is free. The dashed line is the limit: "
              "a stack above it is overcommitted. The selected instances together.",
              **breakdown("kvscope_host_memory_part_bytes", "kvscope_host_memory_limit_bytes",
                          "limit")),
            P("Swap in use", "Swap the host uses; KV offload in host RAM should not push the "
              "host into swap.",
              (host("kvscope_host_swap_used_bytes", "swap"),), unit="bytes"),
        )),
        Row("PCIe", (
            P("PCIe throughput against link maximum (GPU only)",
              "Bytes per second each GPU moves over PCIe, by direction, against its link's "
              "one-direction maximum (NVML); the KV copies among it are Tiers / Transfer "
              "throughput.",
              (Q(f"sum by (instance, gpu, direction) (rate(kvscope_pcie_bytes_total{s(cfg)}"
                 f"[{RATE}]))", "{{instance}} GPU {{gpu}} {{direction}}"),
               Q(f"max by (instance, gpu) (kvscope_pcie_link_max_bytes_per_second{s(cfg)})",
                 "{{instance}} GPU {{gpu}} link max")),
              unit="Bps", min=0),
            P("PCIe link utilisation (GPU only)", "PCIe throughput as a share of the link "
              "maximum (recording rule the alert reads).",
              (Q(f"{r.pcie_utilization}{s(cfg)}", "{{instance}} GPU {{gpu}} {{direction}}"),),
              unit="percentunit", min=0, max=1, thresholds=((cfg.pcie_saturation_ratio, "red"),)),
        )),
        Row("Topology", (
            P("GPU topology (GPU only)", "Each GPU's PCIe link, current (an idle GPU drops to a "
              "lower generation) and maximum, and the host NUMA node nearest to it (empty: "
              "unknown or none). The figures above were measured on this topology.",
              (Q(f"max by (instance, gpu, pcie_generation, pcie_width, pcie_max_generation, "
                 f"pcie_max_width, numa_node) (kvscope_gpu_topology_info{s(cfg)})",
                 table=True),), kind="table", width=12, hide_columns=("Time", "Value")),
            P("Engine memory per NUMA node", "Memory the engine process (collectors.numa "
              "engine_pid) has mapped on each NUMA node, its host KV pool among it. On a "
              "multi-socket host the pool belongs on the GPU's node (GPU topology); memory on "
              "another node crosses the socket link on every transfer.",
              (Q(f"sum by (instance, numa_node) (kvscope_process_numa_bytes{s(cfg)})",
                 "{{instance}} node {{numa_node}}"),), unit="bytes", stack="normal", width=8),
            P("NUMA nodes", "NUMA nodes online on the host (absent on a kernel without NUMA "
              "support).", (Q(f"kvscope_host_numa_nodes{s(cfg)}", "{{instance}}"),),
              kind="stat", width=4),
        )),
        Row("Is GPU memory the limiter?", (
            P("GPU KV cache usage", "Share of the GPU KV cache held by running requests, as "
              "each source's engine reports it (vLLM: its fullest engine). Cached blocks kept for "
              "reuse do not count (Tiers / Resident blocks has them): near 1 the engine queues "
              "or preempts.",
              (Q(f"max by (instance, source) (kvscope_gpu_kv_cache_usage_ratio{s(cfg)})",
                 "{{instance}} {{source}}"),),
              unit="percentunit", min=0, max=1, width=8,
              thresholds=((cfg.gpu_kv_usage_warning_ratio, "orange"),)),
            P("Requests waiting and running", "Requests queued for the scheduler and requests "
              "in its running batches, as each source's engine reports them. A queue that grows "
              "while GPU KV usage is near 1 means GPU memory is the limiter.",
              (Q(f"sum by (instance, source) (kvscope_requests_waiting{s(cfg)})",
                 "{{instance}} {{source}} waiting"),
               Q(f"sum by (instance, source) (kvscope_requests_running{s(cfg)})",
                 "{{instance}} {{source}} running")),
              unit="short", min=0, width=8),
            P("Preemptions", "Requests the engine preempted per second (their GPU KV blocks "
              "freed for others, recomputed when resumed): GPU memory is the limiter. Only an "
              "engine that preempts reports it (vLLM; not the reference engine).",
              (Q(f"sum by (instance, source) (rate(kvscope_preemptions_total{s(cfg)}[{RATE}]))",
                 "{{instance}} {{source}}"),),
              unit="suffix: preemptions/s", min=0, width=8, no_value="none reported"),
            P("GPU memory used against total (GPU only)", "GPU memory in use and in all (NVML); "
              "vLLM allocates its KV cache up front, so this stays flat while the usage above "
              "moves.",
              (Q(f"sum by (instance, gpu) (kvscope_gpu_memory_used_bytes{s(cfg)})",
                 "{{instance}} GPU {{gpu}} used"),
               Q(f"sum by (instance, gpu) (kvscope_gpu_memory_total_bytes{s(cfg)})",
                 "{{instance}} GPU {{gpu}} total")),
              unit="bytes"),
            P("GPU memory budget (GPU only)", "GPU memory split into parts that add up to NVML's "
              "total, stacked: the KV cache and the weights with the engine's persistent buffers "
              "(from vLLM's tap: its KV cache tensors, and the allocator's bytes in use when they "
              "were handed over), workspace (the rest in use: activations, CUDA graphs and "
              "context, the allocator's cache, other processes), other (in use, no engine report "
              "for that GPU) and free. The dashed line is the total. The selected instances' "
              "GPUs together; docs/collectors.md, Memory budgets.",
              **breakdown("kvscope_gpu_memory_part_bytes", "kvscope_gpu_memory_total_bytes",
                          "total")),
        )),
        Row("Collectors", (
            P("Collectors up", "Each collector: up when its last run succeeded (gpu is down on "
              "hosts without an NVIDIA driver).",
              (Q(f"kvscope_collector_up{s(cfg)}", "{{instance}} {{collector}}"),),
              kind="stat", width=6, thresholds=RED_BELOW_ONE, mappings=UP_DOWN),
            P("Collector run time", "How long each collector's last run took.",
              (Q(f"kvscope_collector_duration_seconds{s(cfg)}", "{{instance}} {{collector}}"),),
              unit="s", width=6),
        )),
        Row("What the agent and the taps lost", (
            P("OTLP spans by result", "Request and transfer spans the agent exports over OTLP "
              "(0 without otlp_endpoint): sent, failed (refused or unreachable) or dropped (the "
              "export queue was full). Failed or dropped spans mean traces with gaps.",
              (Q(f"sum by (instance, result) (rate(kvscope_otlp_spans_total{s(cfg)}[{RATE}]))",
                 "{{instance}} {{result}}"),), unit="suffix: spans/s", min=0, width=8),
            P("Records not written to disk", "Finished requests the store, and rows the Parquet "
              "capture, could not write (a full or removed disk): a restarted agent or "
              "kvscope analyze will miss them.",
              (Q(f"sum by (instance, sink) (rate(kvscope_records_dropped_total{s(cfg)}[{RATE}]))",
                 "{{instance}} {{sink}}"),), unit="suffix: records/s", min=0, width=8),
            P("Tap errors", "What an in-engine tap could not observe, per second: internal (the "
              "tap's own code failed, the engine ran on) or unattributed (a request it could not "
              "follow). Its counts undercount by that much; the engine's log has the first error.",
              (Q(f"sum by (instance, source, reason) ({r.tap_errors_rate}{s(cfg)})",
                 "{{instance}} {{source}} {{reason}}"),), unit="suffix: errors/s", min=0,
              width=8),
        )),
    ]
    return board(cfg, "node", "Node",
                 "Host RAM and headroom, PCIe throughput against the link maximum, the transfer "
                 "topology (PCIe links, NUMA placement), and whether GPU memory is the limiter "
                 "(GPU KV usage, the queue, preemptions, GPU memory).",
                 rows)
