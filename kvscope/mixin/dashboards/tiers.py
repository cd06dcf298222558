"""Tiers: is each tier the right size and are its transfers healthy? Residency against capacity,
lookups, evictions, and the transfers between tiers."""

from __future__ import annotations

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.dashboards.common import NO_TRAFFIC, RATE, P, Q, Row, board, quantile, s
from kvscope.mixin.rules import QUANTILES, Records


HIT = 'result="hit"'
STORED, SKIPPED, FAILED = 'result="stored"', 'result="skipped"', 'result="failed"'
BLOCKS_PER_S = "suffix: blocks/s"


def tiers(cfg: MixinConfig) -> dict:
    r = Records.of(cfg)
    hist = lambda metric, q, by: (  # noqa: E731
        f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{s(cfg)}[{RATE}])))")
    lookups = lambda *m: (  # noqa: E731
        f"sum by (tier) (rate(kvscope_lookup_blocks_total{s(cfg, *m)}[{RATE}]))")
    admissions = lambda *m: (  # noqa: E731
        f"sum by (tier) (rate(kvscope_store_admissions_total{s(cfg, *m)}[{RATE}]))")
    # blocks offered per tier, where some source counts the stored ones (guarded: > 0)
    offered = (f"({admissions()}\n     * on (tier) "
               f"group by (tier) (kvscope_store_admissions_total{s(cfg, STORED)}) > 0)")
    per_transfer = lambda series: (  # noqa: E731
        f"sum by (src, dst) (rate(kvscope_transfer_bytes_total{s(cfg)}[{RATE}]))\n"
        f"  / (sum by (src, dst) (rate({series}{s(cfg)}[{RATE}])) > 0)")
    rows = [
        Row("Residency", (
            P("Resident bytes against capacity", "Bytes each tier holds and may hold.",
              (Q(f"sum by (tier) (kvscope_tier_resident_bytes{s(cfg)})", "{{tier}} resident"),
               Q(f"sum by (tier) (kvscope_tier_capacity_bytes{s(cfg)})", "{{tier}} capacity")),
              unit="bytes", width=8),
            P("Resident blocks against capacity", "KV blocks each tier holds and may hold.",
              (Q(f"sum by (tier) (kvscope_tier_resident_blocks{s(cfg)})", "{{tier}} resident"),
               Q(f"sum by (tier) (kvscope_tier_capacity_blocks{s(cfg)})", "{{tier}} capacity")),
              unit="short", width=8),
            P("Tier fill", "Resident bytes against capacity (recording rule). Full is an LRU "
              "tier's steady state; the alert fires only when a full tier also loses reused "
              "blocks (see the evictions below).",
              (Q(f"{r.tier_fill}{s(cfg)}", "{{instance}} {{tier}}"),),
              unit="percentunit", max=1, min=0, width=8,
              thresholds=((cfg.tier_full_ratio, "orange"),)),
        )),
        Row("Lookups and evictions", (
            P("Lookup hit ratio by tier",
              "Blocks found in a tier out of the blocks looked up there (a tier is consulted "
              "when every tier above it missed).",
              (Q(f"{lookups(HIT)}\n  / ({lookups()} > 0)", "{{tier}}"),),
              unit="percentunit", max=1, min=0, no_value=NO_TRAFFIC),
            P("Evictions by tier and reason", "KV blocks leaving each tier per second, and "
              "those that left the cache altogether (no copy kept below).",
              (Q(f"sum by (tier, reason) (rate(kvscope_evicted_blocks_total{s(cfg)}[{RATE}]))",
                 "{{tier}} {{reason}}"),
               Q(f"sum by (tier) (rate(kvscope_dropped_blocks_total{s(cfg)}[{RATE}]))",
                 "{{tier}} dropped")), unit=BLOCKS_PER_S, min=0),
            P("Evicted before any reuse",
              "Share of evicted blocks that were never hit while resident (recording rule).",
              (Q(f"{r.never_reused_share}{s(cfg)}", "{{instance}} {{tier}}"),),
              unit="percentunit", max=1, min=0, width=8, no_value=NO_TRAFFIC,
              thresholds=((cfg.thrash_unused_share, "orange"),)),
            P("Hits per evicted block (median, p90)",
              "How often blocks were reused before they were evicted.",
              (Q(hist("kvscope_evicted_block_hits", 0.5, "tier"), "{{tier}} median"),
               Q(hist("kvscope_evicted_block_hits", 0.9, "tier"), "{{tier}} p90")),
              unit="short", width=8),
            P("Block age at eviction (median, p95)", "How long blocks stayed in each tier: "
              "how far back in time the tier reaches. A prefix reused after a longer gap than "
              "this misses the tier; a larger tier holds blocks longer.",
              (Q(hist("kvscope_block_residency_seconds", 0.5, "tier"), "{{tier}} median"),
               Q(hist("kvscope_block_residency_seconds", 0.95, "tier"), "{{tier}} p95")),
              unit="s", width=12),
            P("Idle time before eviction (median, p95)", "How long an evicted block had gone "
              "unused: since its last hit, or since it was stored if never hit. The signal for "
              "sizing a tier: blocks evicted soon after a hit were still in use (the tier is "
              "too small); a long idle time means room to spare. gpu from vLLM's sampled "
              "blocks (--kv-cache-metrics), cpu from the tap's sampled chunks; a tier no source "
              "measures has no series.",
              (Q(hist("kvscope_block_idle_seconds", 0.5, "tier"), "{{tier}} median"),
               Q(hist("kvscope_block_idle_seconds", 0.95, "tier"), "{{tier}} p95")),
              unit="s", width=12),
        )),
        Row("Store admission", (
            P("Store admissions by tier and result", "KV blocks offered to each tier for "
              "storing per second: stored (written), skipped (declined unwritten: the admission "
              "policy, e.g. a store threshold, or no room) and failed (admitted, the write "
              "failed). Where admission is on, skipped is what it keeps out. cpu from the tap "
              "(stored, failed, skipped when vLLM could not make room) and vLLM's "
              "stores_skipped (its store threshold); a result no source reports has no series.",
              (Q(f"sum by (tier, result) (rate(kvscope_store_admissions_total{s(cfg)}[{RATE}]))",
                 "{{tier}} {{result}}"),), unit=BLOCKS_PER_S, min=0),
            P("Stores not made (skipped or failed share)", "Of the blocks offered to each "
              "tier, the share skipped and the share failed. A high skipped share with "
              "thrash gone is admission working; failed should stay at 0. Only for a tier "
              "whose stores are counted too (vLLM's metrics source alone reports skipped "
              "only: no total to take a share of).",
              (Q(f"{admissions(SKIPPED)}\n  / {offered}", "{{tier}} skipped"),
               Q(f"{admissions(FAILED)}\n  / {offered}", "{{tier}} failed")),
              unit="percentunit", max=1, min=0, no_value=NO_TRAFFIC),
        )),
        Row("Transfers", (
            P("Transfer throughput", "Bytes copied between tiers per second (recording rule): "
              "offloads away from the GPU, promotions toward it. The KV share of the PCIe link "
              "on the Node board.",
              (Q(f"sum by (src, dst) ({r.transfer_bytes_rate}{s(cfg)})", "{{src}} → {{dst}}"),),
              unit="Bps", min=0),
            P("Blocks copied", "KV blocks copied between tiers per second.",
              (Q(f"sum by (src, dst) (rate(kvscope_transfer_blocks_total{s(cfg)}[{RATE}]))",
                 "{{src}} → {{dst}}"),), unit=BLOCKS_PER_S, min=0),
            P("Bandwidth of a transfer by direction, against the link maximum",
              "Bytes moved per second of transfer time (bytes over the summed durations of "
              "the transfers), against the fastest PCIe link's one-direction maximum (NVML; "
              "absent without a GPU). Well under the link while transfers are slow points at "
              "small transfers (below) or NUMA placement (Node); vLLM times a promotion into the "
              "cpu tier from its job's creation, so queueing lowers it there.",
              (Q(per_transfer("kvscope_transfer_seconds_sum"), "{{src}} → {{dst}}"),
               Q(f"max(kvscope_pcie_link_max_bytes_per_second{s(cfg)})", "PCIe link max")),
              unit="Bps", min=0, no_value=NO_TRAFFIC),
            P("Average transfer size by direction",
              "Bytes per batched transfer: small transfers pay the fixed cost of a copy each "
              "and stay far from the link's bandwidth.",
              (Q(per_transfer("kvscope_transfer_seconds_count"), "{{src}} → {{dst}}"),),
              unit="bytes", min=0, no_value=NO_TRAFFIC),
            P("Transfer time p50 / p99 by direction, fleet (exemplars link to traces)",
              "Duration of one batched transfer over the selected instances together; exemplar "
              "dots carry the request's trace id.",
              (Q(hist("kvscope_transfer_seconds", 0.99, "src, dst"), "{{src}} → {{dst}} p99",
                 exemplar=True),
               Q(hist("kvscope_transfer_seconds", 0.5, "src, dst"), "{{src}} → {{dst}} p50")),
              unit="s"),
            P("Promotion latency p50 / p95 / p99, worst instance",
              "Copies toward the GPU only, the highest of the selected instances (recording "
              "rule the alert reads).",
              tuple(Q(f"max by (src, dst) ({r.promotion_quantile}{s(cfg, quantile(q))})",
                      f"{{{{src}}}} → {{{{dst}}}} p{q * 100:g}") for q in QUANTILES),
              unit="s", thresholds=((cfg.promotion_p99_seconds, "red"),)),
            P("Transfers in flight by direction",
              "Copies submitted and not yet finished, and their KV blocks, now, as each engine reports them (vLLM's "
              "worker jobs through the tap; the reference engine's copies whose timing is "
              "pending). A count that climbs while the throughput above stays flat: the copy "
              "engine fell behind, or a job never completes.",
              (Q(f"sum by (instance, src, dst) (kvscope_transfers_in_flight{s(cfg)})",
                 "{{instance}} {{src}} → {{dst}} transfers"),
               Q(f"sum by (instance, src, dst) (kvscope_transfer_blocks_in_flight{s(cfg)})",
                 "{{instance}} {{src}} → {{dst}} blocks")),
              unit="short", min=0, no_value="none reported"),
            P("Transfer failures by reason", "Failed transfers per second (0 when none; no "
              "line for a direction whose copies only sources blind to failures saw, such as "
              "KV events: not measured).",
              (Q(f"sum by (src, dst, reason) (rate(kvscope_transfer_failures_total{s(cfg)}"
                 f"[{RATE}]))", "{{src}} → {{dst}} {{reason}}"),),
              unit="suffix: transfers/s", min=0, no_value="not measured"),
            P("Failed share of transfers", "Failed transfers out of all transfers (recording "
              "rule).",
              (Q(f"{r.transfer_failures_ratio}{s(cfg)}", "{{instance}} {{src}} → {{dst}}"),),
              unit="percentunit", min=0, no_value=NO_TRAFFIC,
              thresholds=((cfg.transfer_failure_ratio, "red"),)),
        )),
    ]
    return board(cfg, "tiers", "Tiers",
                 "Is each tier the right size and are its transfers healthy: residency, "
                 "lookups, evictions and the transfers between tiers.", rows)
