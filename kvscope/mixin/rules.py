"""Recording rules: the ratios and quantiles the boards and the alerts share.

Every rule aggregates by the config's group labels (``job, instance``) plus its own. Rules that
count rare events exist at 0 on a healthy system, so boards draw a flat zero and the alert's
input is there instead of absent: the agent exports each failure reason at 0 for the directions
whose failures a source sees (none for the others: not measured, never 0); drops fall back to 0
for every tier that is active.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.promql import le_matcher, offload_matchers, promotion_matchers, sel, union

QUANTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True)
class Records:
    """Names of the recorded series for one config (the window is part of each name)."""

    prompt_tokens_rate: str
    prompt_share: str
    transfer_bytes_rate: str
    offload_bytes_rate: str
    offload_blocks_rate: str
    transfer_failures_rate: str
    transfer_failures_ratio: str
    promotion_quantile: str
    ttft_quantile: str
    itl_quantile: str
    never_reused_share: str
    tier_fill: str
    headroom_ratio: str
    events_dropped_rate: str
    tap_errors_rate: str
    pcie_utilization: str

    @classmethod
    def of(cls, cfg: MixinConfig) -> "Records":
        w = cfg.rate_window
        return cls(
            prompt_tokens_rate=f"kvscope:prompt_tokens:rate{w}",
            prompt_share=f"kvscope:prompt_tokens:share_by_source_rate{w}",
            transfer_bytes_rate=f"kvscope:transfer_bytes:rate{w}",
            offload_bytes_rate=f"kvscope:offload_bytes:rate{w}",
            offload_blocks_rate=f"kvscope:offload_blocks:rate{w}",
            transfer_failures_rate=f"kvscope:transfer_failures:rate{w}",
            transfer_failures_ratio=f"kvscope:transfer_failures:ratio_rate{w}",
            promotion_quantile=f"kvscope:promotion_seconds:quantile_rate{w}",
            ttft_quantile=f"kvscope:ttft_seconds:quantile_rate{w}",
            itl_quantile=f"kvscope:itl_seconds:quantile_rate{w}",
            never_reused_share=f"kvscope:evicted_blocks:never_reused_share_rate{w}",
            tier_fill="kvscope:tier_fill:ratio",
            headroom_ratio="kvscope:host_memory_headroom:ratio",
            events_dropped_rate=f"kvscope:events_dropped:rate{w}",
            tap_errors_rate=f"kvscope:tap_errors:rate{w}",
            pcie_utilization=f"kvscope:pcie_link:utilization_rate{w}",
        )


def quantiles(cfg: MixinConfig) -> tuple[float, ...]:
    return tuple(sorted({*QUANTILES, cfg.ttft_budget_quantile, cfg.itl_budget_quantile}))


def recording_rules(cfg: MixinConfig) -> list[dict]:
    """The ``kvscope.rules`` group's rules, in evaluation order (later rules read earlier ones)."""
    r, w, by = Records.of(cfg), cfg.rate_window, cfg.by
    s = lambda *m: sel(cfg, *m)  # noqa: E731
    rules = [
        {"record": r.prompt_tokens_rate,
         "expr": f"sum by ({by}, source) (rate(kvscope_prompt_tokens_total{s()}[{w}]))"},
        {"record": r.prompt_share,
         "expr": f"{r.prompt_tokens_rate}\n  / ignoring (source) group_left ()\n"
                 f"(sum by ({by}) ({r.prompt_tokens_rate}) > 0)"},
        {"record": r.transfer_bytes_rate,
         "expr": f"sum by ({by}, src, dst) (rate(kvscope_transfer_bytes_total{s()}[{w}]))"},
        *({"record": record,
           "expr": f"sum by ({by}, tier) (label_replace(\n  "
                   + union("rate", metric, cfg, offload_matchers(cfg), w)
                   + ',\n  "tier", "$1", "dst", "(.+)"))'}
          # blocks too: KV events without block_bytes count blocks, their bytes 0
          for record, metric in ((r.offload_bytes_rate, "kvscope_transfer_bytes_total"),
                                 (r.offload_blocks_rate, "kvscope_transfer_blocks_total"))),
        {"record": r.transfer_failures_rate,
         "expr": f"sum by ({by}, src, dst) (rate(kvscope_transfer_failures_total{s()}[{w}]))"},
        {"record": r.transfer_failures_ratio,
         "expr": f"{r.transfer_failures_rate}\n  / ({r.transfer_failures_rate}\n"
                 f"     + (sum by ({by}, src, dst) (rate(kvscope_transfer_seconds_count{s()}[{w}]))"
                 f"\n        or 0 * {r.transfer_failures_rate}) > 0)"},
    ]
    promo = union("rate", "kvscope_transfer_seconds_bucket", cfg, promotion_matchers(cfg), w)
    for q in QUANTILES:
        rules.append({"record": r.promotion_quantile, "labels": {"quantile": str(q)},
                      "expr": f"histogram_quantile({q}, sum by ({by}, src, dst, le) (\n  {promo}))"})
    for record, metric in ((r.ttft_quantile, "kvscope_ttft_seconds"),
                           (r.itl_quantile, "kvscope_itl_seconds")):
        for q in quantiles(cfg):
            rules.append({"record": record, "labels": {"quantile": str(q)},
                          "expr": f"histogram_quantile({q}, sum by ({by}, le) "
                                  f"(rate({metric}_bucket{s()}[{w}])))"})
    rules += [
        {"record": r.never_reused_share,
         "expr": f"sum by ({by}, tier) (rate(kvscope_evicted_block_hits_bucket"
                 f"{s(le_matcher(0))}[{w}]))\n"
                 f"  / (sum by ({by}, tier) (rate(kvscope_evicted_block_hits_count{s()}[{w}])) > 0)"},
        # in bytes, else in blocks (KV events without block_bytes: no capacity in bytes)
        {"record": r.tier_fill,
         "expr": " or\n".join(f"sum by ({by}, tier) (kvscope_tier_resident_{unit}{s()})\n"
                               f"  / (sum by ({by}, tier) (kvscope_tier_capacity_{unit}{s()}) > 0)"
                               for unit in ("bytes", "blocks"))},
        {"record": r.headroom_ratio,
         "expr": f"sum by ({by}) (kvscope_host_memory_headroom_bytes{s()})\n"
                 f"  / (sum by ({by}) (kvscope_host_memory_limit_bytes{s()}) > 0)"},
        {"record": r.events_dropped_rate,
         "expr": f"sum by ({by}, source) (rate(kvscope_events_dropped_total{s()}[{w}]))\n"
                 f"or 0 * sum by ({by}, source) (rate(kvscope_events_received_total{s()}[{w}]))"},
        {"record": r.tap_errors_rate,
         "expr": f"sum by ({by}, source, reason) (rate(kvscope_tap_errors_total{s()}[{w}]))\n"
                 f"or 0 * sum by ({by}, source) (rate(kvscope_events_received_total{s()}[{w}]))"},
        {"record": r.pcie_utilization,
         "expr": f"sum by ({by}, gpu, direction) (rate(kvscope_pcie_bytes_total{s()}[{w}]))\n"
                 f"  / on ({by}, gpu) group_left ()\n"
                 # the fastest link of the window: an idle GPU drops to a slower generation,
                 # so the link at the evaluation instant can be slower than the one that
                 # carried the window's bytes
                 f"(max by ({by}, gpu) (max_over_time("
                 f"kvscope_pcie_link_max_bytes_per_second{s()}[{w}])) > 0)"},
    ]
    return rules


def rule_groups(cfg: MixinConfig) -> dict:
    return {"groups": [{"name": "kvscope.rules", "rules": recording_rules(cfg)}]}
