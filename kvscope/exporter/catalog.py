"""The metric catalog: every metric kvscope exports, defined once.

The Prometheus collector, ``docs/metrics.md``, the Grafana mixin and the tests all follow from
this table. Names follow Prometheus conventions (``kvscope_`` prefix, base units, ``_total`` on
counters); labels come from bounded sets only — never request ids or block hashes.
"""

from __future__ import annotations

from dataclasses import dataclass

# Transfer-time buckets, seconds: 10 us .. 10 s, covering one-block PCIe copies up to disk reads.
TRANSFER_SECONDS_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
# TTFT buckets, seconds: 10 ms .. 60 s.
TTFT_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric. ``type``: counter, gauge or histogram. ``unit``: base unit or "" (counts).
    ``buckets``: upper bounds for histograms, in the unit."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    buckets: tuple[float, ...] = ()


CATALOG: tuple[MetricSpec, ...] = (
    MetricSpec("kvscope_prompt_tokens_total", "counter",
               "Prompt tokens by where their KV came from: gpu (resident), cpu or disk (promoted), recompute (prefill).",
               ("source",)),
    MetricSpec("kvscope_transfer_bytes_total", "counter",
               "Bytes copied between tiers (offloads away from the GPU, promotions toward it).",
               ("src", "dst"), "bytes"),
    MetricSpec("kvscope_transfer_blocks_total", "counter",
               "KV blocks copied between tiers.", ("src", "dst")),
    MetricSpec("kvscope_transfer_seconds", "histogram",
               "Measured duration of one batched transfer between tiers.",
               ("src", "dst"), "seconds", TRANSFER_SECONDS_BUCKETS),
    MetricSpec("kvscope_evicted_blocks_total", "counter",
               "KV blocks that left a tier (offloaded to the next tier or dropped).", ("tier",)),
    MetricSpec("kvscope_tier_capacity_bytes", "gauge",
               "Bytes a tier may hold.", ("tier",), "bytes"),
    MetricSpec("kvscope_tier_resident_bytes", "gauge",
               "Bytes a tier currently holds.", ("tier",), "bytes"),
    MetricSpec("kvscope_tier_resident_blocks", "gauge",
               "KV blocks a tier currently holds.", ("tier",)),
    MetricSpec("kvscope_requests_total", "counter", "Requests that finished their prefill."),
    MetricSpec("kvscope_ttft_seconds", "histogram",
               "Time to first token of each request.", (), "seconds", TTFT_SECONDS_BUCKETS),
    MetricSpec("kvscope_host_memory_available_bytes", "gauge",
               "Host memory available to new allocations without swapping (psutil).", (), "bytes"),
    MetricSpec("kvscope_host_memory_total_bytes", "gauge",
               "Host physical memory (psutil).", (), "bytes"),
    MetricSpec("kvscope_events_received_total", "counter",
               "kvscope events the agent accepted, by emitting source.", ("source",)),
    MetricSpec("kvscope_build_info", "gauge",
               "Always 1; the kvscope version in a label.", ("version",)),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOG}


def render_markdown() -> str:
    """``docs/metrics.md``: the catalog as a Markdown table (generated; do not edit by hand)."""
    lines = [
        "# kvscope metrics",
        "",
        "Generated from `kvscope/exporter/catalog.py` by `kvscope docs-metrics`; do not edit by hand.",
        "",
        "| name | type | unit | labels | help |",
        "| --- | --- | --- | --- | --- |",
    ]
    for spec in CATALOG:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        lines.append(f"| `{spec.name}` | {spec.type} | {spec.unit or '-'} | {labels} | {spec.help} |")
    return "\n".join(lines) + "\n"
