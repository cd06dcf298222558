"""Alerts: ``Kvscope*``, each with severity, a static summary, a templated description and a
runbook_url into ``docs/runbooks.md``.

Each alert also names its *signals*: the expressions it compares against thresholds, without
the comparison. They are not written to the rule file; the end-to-end test evaluates them on a
healthy demo, where the alert itself must stay silent but its inputs must exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.promql import offload_tiers, sel
from kvscope.mixin.rules import Records


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    signals: tuple[str, ...]

    def rule(self, cfg: MixinConfig) -> dict:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description,
                            "runbook_url": cfg.runbook_url(self.name)},
        }


def _g(value: float) -> str:
    """A threshold as PromQL and prose print it: 2.5, 0.01, 67108864."""
    return repr(int(value)) if float(value).is_integer() else repr(value)


def _pct(value: float) -> str:
    return f"{value * 100:g}%"


def alerts(cfg: MixinConfig) -> list[Alert]:
    r, by = Records.of(cfg), cfg.by
    offload = offload_tiers(cfg)
    q = str(cfg.ttft_budget_quantile)
    ttft = f'{r.ttft_quantile}{{quantile="{q}"}}'
    qi = str(cfg.itl_budget_quantile)
    itl = f'{r.itl_quantile}{{quantile="{qi}"}}'
    share_as_tier = f'label_replace({r.prompt_share}, "tier", "$1", "source", "(.+)")'
    fill = f"{r.tier_fill}{{{offload}}}"
    unused = f"{r.never_reused_share}{{{offload}}}"
    promo = f'{r.promotion_quantile}{{quantile="0.99"}}'
    return [
        Alert(
            "KvscopeTTFTBudgetBreach",
            f"{ttft} > {_g(cfg.ttft_budget_seconds)}",
            cfg.ttft_budget_for, "critical",
            "Time to first token is over its budget: roll back the newest offload tier.",
            f"p{float(q) * 100:g} TTFT at {{{{ $labels.instance }}}} is {{{{ $value | humanizeDuration }}}}, "
            f"above the {_g(cfg.ttft_budget_seconds)}s budget for {cfg.ttft_budget_for}. Rollback rule: "
            "disable the newest offload tier (the one enabled last) and confirm TTFT returns "
            "under budget against the baseline before trying it again.",
            (ttft,)),
        Alert(
            "KvscopeITLBudgetBreach",
            f"{itl} > {_g(cfg.itl_budget_seconds)}",
            cfg.itl_budget_for, "critical",
            "Inter-token latency is over its budget: roll back the newest offload tier.",
            f"p{float(qi) * 100:g} of the requests' mean inter-token latency at "
            "{{ $labels.instance }} is {{ $value | humanizeDuration }}, above the "
            f"{_g(cfg.itl_budget_seconds)}s budget for {cfg.itl_budget_for}. Rollback rule: "
            "disable the newest offload tier (the one enabled last) and confirm ITL returns "
            "under budget against the baseline before trying it again.",
            (itl,)),
        *(Alert(
            f"Kvscope{name}Regression",
            f"{q99}\n  > {_g(1 + cfg.regression_ratio)} * ({q99} offset "
            f"{cfg.regression_baseline_offset})",
            cfg.regression_for, "warning",
            f"{name} is well above its own baseline: did an offload tier roll out since?",
            f"p{float(q) * 100:g} {name} at {{{{ $labels.instance }}}} is "
            "{{ $value | humanizeDuration }}, more than "
            f"{_pct(cfg.regression_ratio)} above its value {cfg.regression_baseline_offset} "
            f"earlier, for {cfg.regression_for}. If a tier rolled out since, the rollback rule "
            "applies: disable it and compare the runs (kvscope compare) before trying again.",
            (q99,))
          for name, q99, q in (("TTFT", ttft, q), ("ITL", itl, qi))),
        Alert(
            "KvscopeHostMemoryHeadroomLow",
            f"{r.headroom_ratio} < {_g(cfg.headroom_min_ratio)}",
            cfg.headroom_for, "critical",
            "Host RAM available to the node is below the configured reserve.",
            "Host RAM headroom at {{ $labels.instance }} is {{ $value | humanizePercentage }} of "
            "the memory limit: available memory is below the reserve kept for the OS and other "
            "services, so the kernel may swap or kill processes. Shrink the cpu offload tier.",
            (r.headroom_ratio,)),
        Alert(
            "KvscopeOffloadThrash",
            f"{unused} > {_g(cfg.thrash_unused_share)}\n"
            f"and on ({by}, tier)\n"
            f"{r.offload_bytes_rate} > {_g(cfg.thrash_min_offload_bytes_per_second)}",
            cfg.thrash_for, "warning",
            "Most blocks offloaded to a tier are evicted before they are ever reused.",
            "{{ $value | humanizePercentage }} of the blocks evicted from the {{ $labels.tier }} "
            "tier at {{ $labels.instance }} were never hit, while offloads into it stay above "
            f"{_g(cfg.thrash_min_offload_bytes_per_second)} bytes/s: the tier pays transfer "
            "bandwidth for nothing. Enable admission (store only reused prefixes) or grow the tier.",
            (unused, r.offload_bytes_rate)),
        Alert(
            "KvscopeTierIneffective",
            f"(\n  {fill} > {_g(cfg.ineffective_fill_ratio)}\n"
            f"  unless on ({by}, tier)\n  {share_as_tier} >= {_g(cfg.ineffective_max_share)}\n)\n"
            f"and on ({by}) (sum by ({by}) ({r.prompt_tokens_rate}) > 0)",
            cfg.ineffective_for, "warning",
            "An offload tier is full but serves almost none of the prompt tokens.",
            "The {{ $labels.tier }} tier at {{ $labels.instance }} is "
            "{{ $value | humanizePercentage }} full but served less than "
            f"{_pct(cfg.ineffective_max_share)} of prompt tokens for {cfg.ineffective_for}: its "
            "memory buys no hits. Shrink or disable it, or check that lookups reach it.",
            (fill, r.prompt_share)),
        Alert(
            "KvscopeTierNearlyFull",
            f"{fill} > {_g(cfg.tier_full_ratio)}",
            cfg.tier_full_for, "warning",
            "KV offload tier is nearly full.",
            "The {{ $labels.tier }} tier at {{ $labels.instance }} is "
            "{{ $value | humanizePercentage }} full; new offloads will evict reusable blocks.",
            (fill,)),
        Alert(
            "KvscopePromotionLatencyHigh",
            f"{promo} > {_g(cfg.promotion_p99_seconds)}",
            cfg.promotion_for, "warning",
            "Promotions of KV blocks toward the GPU are slow.",
            "p99 of one {{ $labels.src }} -> {{ $labels.dst }} promotion at "
            "{{ $labels.instance }} is {{ $value | humanizeDuration }}, above "
            f"{_g(cfg.promotion_p99_seconds)}s; requests that reuse offloaded prefixes wait for it "
            "before their first token.",
            (promo,)),
        Alert(
            "KvscopePCIeLinkSaturated",
            f"{r.pcie_utilization} > {_g(cfg.pcie_saturation_ratio)}",
            cfg.pcie_for, "warning",
            "A GPU's PCIe link runs near its maximum throughput.",
            "PCIe {{ $labels.direction }} on GPU {{ $labels.gpu }} at {{ $labels.instance }} runs "
            "at {{ $value | humanizePercentage }} of the link maximum; offloads and promotions "
            "queue behind each other and behind other traffic.",
            (r.pcie_utilization,)),
        Alert(
            "KvscopeTransferFailures",
            f"{r.transfer_failures_ratio} > {_g(cfg.transfer_failure_ratio)}",
            cfg.transfer_failures_for, "warning",
            "KV block transfers between tiers are failing.",
            "{{ $value | humanizePercentage }} of {{ $labels.src }} -> {{ $labels.dst }} transfers "
            "at {{ $labels.instance }} failed; their blocks are dropped and recomputed. See "
            "kvscope_transfer_failures_total by reason.",
            (r.transfer_failures_ratio,)),
        Alert(
            "KvscopeEventsDropped",
            f"{r.events_dropped_rate} > {_g(cfg.events_dropped_per_second)}",
            cfg.events_dropped_for, "warning",
            "The kvscope agent is dropping events; its metrics undercount.",
            "Source {{ $labels.source }} at {{ $labels.instance }} drops "
            "{{ $value | humanize }} events/s; counters and request records from it are incomplete.",
            (r.events_dropped_rate,)),
        Alert(
            "KvscopeSourceDown",
            f"kvscope_source_up{sel(cfg)} == 0",
            cfg.source_down_for, "warning",
            "A kvscope source is not delivering events.",
            "Source {{ $labels.source }} at {{ $labels.instance }} has been failing for "
            f"{cfg.source_down_for}; kvscope no longer sees that engine's KV cache.",
            (f"kvscope_source_up{sel(cfg)}",)),
        Alert(
            "KvscopeAgentDown",
            f"up{sel(cfg)} == 0",
            cfg.agent_down_for, "warning",
            "Prometheus cannot scrape a kvscope agent.",
            "The kvscope agent at {{ $labels.instance }} has not answered scrapes for "
            f"{cfg.agent_down_for}; every kvscope panel and alert for it is blind.",
            (f"up{sel(cfg)}",)),
    ]


def alert_groups(cfg: MixinConfig) -> dict:
    return {"groups": [{"name": "kvscope.alerts", "rules": [a.rule(cfg) for a in alerts(cfg)]}]}
