"""Alerts: ``Kvscope*``, each with severity, a static summary, a templated description and a
runbook_url into ``docs/runbooks.md``.

Each alert also names its *signals*: the expressions it compares against thresholds, without
the comparison. They are not written to the rule file; the end-to-end test evaluates them on a
healthy demo, where the alert itself must stay silent but its inputs must exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.promql import (offload_tiers, promotion_matchers, promotion_seconds_by_tier,
                                  sel, tier_matcher, union)
from kvscope.mixin.rules import Records
from kvscope.vocabulary import TOKEN_SOURCES


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
    """A threshold as PromQL and prose print it: 2.5, 0.01, 67108864; 1.2 for 1.5 * 0.8
    (1.2000000000000002: 15 significant digits drop the float's rounding)."""
    return repr(int(value)) if float(value).is_integer() else repr(float(f"{value:.15g}"))


def _pct(value: float) -> str:
    return f"{value * 100:g}%"


def _bytes(value: float) -> str:
    """A byte count as the descriptions print it: 67108864 -> 64 MiB (humanize1024's units)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value:g} B"


def _floor(per_second: str, by: str, minimum: float) -> str:
    """``and on (by) <events per second> >= minimum``: a traffic floor for a ratio or quantile
    alert, so that a handful of requests or transfers cannot fire it."""
    return f"\nand on ({by})\n{per_second} >= {_g(minimum)}"


def alerts(cfg: MixinConfig) -> list[Alert]:
    r, by, w = Records.of(cfg), cfg.by, cfg.rate_window
    offload = offload_tiers(cfg)
    q = str(cfg.ttft_budget_quantile)
    ttft = f'{r.ttft_quantile}{{quantile="{q}"}}'
    qi = str(cfg.itl_budget_quantile)
    itl = f'{r.itl_quantile}{{quantile="{qi}"}}'
    requests = {metric: f"sum by ({by}) (rate({metric}_count{sel(cfg)}[{w}]))"
                for metric in ("kvscope_ttft_seconds", "kvscope_itl_seconds")}
    # Transfers per second per direction: failed ones plus completed ones (a direction that
    # only failed has no completed series).
    transfers = (f"({r.transfer_failures_rate}\n  + (sum by ({by}, src, dst) "
                 f"(rate(kvscope_transfer_seconds_count{sel(cfg)}[{w}]))\n"
                 f"     or 0 * {r.transfer_failures_rate}))")
    dropped = f"sum by ({by}, tier) (rate(kvscope_dropped_blocks_total{sel(cfg)}[{w}]))"
    share_as_tier = f'label_replace({r.prompt_share}, "tier", "$1", "source", "(.+)")'
    # the offload tiers with a token source of their own: what another (remote) serves counts as
    # another tier's tokens, so its share is unknown, never 0
    served = tier_matcher([t for t in cfg.tiers[1:] if t in TOKEN_SOURCES])
    fill = f"{r.tier_fill}{{{offload}}}"
    unused = f"{r.never_reused_share}{{{offload}}}"
    promo = f'{r.promotion_quantile}{{quantile="0.99"}}'
    rollback = ("Rollback rule: disable the newest offload tier (the one enabled last) and confirm "
                "{name} returns under budget against the baseline before trying it again.")
    ttft_warning = cfg.ttft_budget_seconds * cfg.ttft_budget_warning_ratio
    up = f"up{sel(cfg)}"
    host = {metric: f"sum by ({by}) ({metric}{sel(cfg)})"
            for metric in ("kvscope_host_memory_reserve_bytes", "kvscope_host_memory_limit_bytes")}
    host_budget = (f"sum by ({by}) (kvscope_offload_budget_bytes"
                   f"{sel(cfg, tier_matcher(cfg.host_memory_tiers))})")
    swap_in = f"sum by ({by}) (rate(kvscope_host_swap_in_bytes_total{sel(cfg)}[{w}]))"
    host_tiers = tier_matcher(cfg.host_memory_tiers)
    # a capacity in bytes or, from KV events without block_bytes, in blocks only
    host_offload_on = (f"(\n  {host_budget} > 0\n" + "".join(
        f"  or\n  sum by ({by}) (kvscope_tier_capacity_{unit}{sel(cfg, host_tiers)}) > 0\n"
        for unit in ("bytes", "blocks")) + ")")
    # The headroom alert's advice, by whether its node has a host offload tier at all (a
    # budget or a capacity above 0; both are bytes, so their sum tells): the template asks
    # Prometheus, for the alert's own labels (printf fills them in).
    labels = [label.strip() for label in by.split(",")]
    own = [f'{label}="%s"' for label in labels]
    named = '__name__=~"kvscope_offload_budget_bytes|kvscope_tier_capacity_bytes"'
    has_tier = f"sum({sel(cfg, host_tiers, named, *own)}) > 0"
    shrink = (f"{{{{ if query (printf `{has_tier}` "
              + " ".join(f"$labels.{label}" for label in labels)
              + f") }}}}Shrink the {'/'.join(cfg.host_memory_tiers)} offload tier.{{{{ else }}}}No "
              "offload tier holds host memory here: find what else grew (the engine, other "
              "processes).{{ end }}")
    # per offload tier: the seconds of promotions of its blocks (a staged leg is the tier's it
    # staged from), the promotions out of it (copies toward the GPU whose src is the tier) and
    # the prefill seconds its tokens saved, all per second
    promo_spent = promotion_seconds_by_tier(cfg, w)
    promo_count = (f"sum by ({by}, tier) (label_replace(\n  "
                   + union("rate", "kvscope_transfer_seconds_count", cfg,
                           promotion_matchers(cfg), w)
                   + ',\n  "tier", "$1", "src", "(.+)"))')
    saved = (f'sum by ({by}, tier) (label_replace(rate(kvscope_prefill_seconds_saved_total'
             f'{sel(cfg, tier_matcher(cfg.tiers[1:], "source"))}[{w}]), "tier", "$1", "source", '
             '"(.+)"))')
    # the share of the engine process's memory on a NUMA node of its GPUs (0 when none is):
    # those holding its KV cache where a tap reports them, else every GPU of the host; only
    # where NVML or sysfs names the GPUs' nodes
    topology = "kvscope_gpu_topology_info" + sel(cfg, 'numa_node!=""')
    kv_gpus = "kvscope_gpu_memory_part_bytes" + sel(cfg, 'part="kv_cache"') + " > 0"
    gpu_nodes = (f"(\n    ({topology} and on ({by}, gpu) ({kv_gpus}))\n"
                 f"    or ({topology} unless on ({by}) ({kv_gpus}))\n  )")
    engine_numa = f"sum by ({by}) (kvscope_process_numa_bytes{sel(cfg)})"
    numa_local = (f"(\n  sum by ({by}) (\n    kvscope_process_numa_bytes{sel(cfg)}\n"
                  f"    and on ({by}, numa_node)\n    {gpu_nodes}\n  )\n"
                  f"  or on ({by})\n  0 * {engine_numa}\n)\n/ on ({by})\n"
                  f"({engine_numa} > 0)")
    gpu_nodes_known = f"\nand on ({by})\ncount by ({by}) ({gpu_nodes})"
    weights = f"sum by ({by}) (kvscope_engine_weight_offload_bytes{sel(cfg)})"
    kv_offload_on = (f"(\n  sum by ({by}) (kvscope_offload_budget_bytes{sel(cfg, offload)}) > 0\n"
                     + "".join(f"  or sum by ({by}) (kvscope_tier_capacity_{unit}"
                               f"{sel(cfg, offload)}) > 0\n" for unit in ("bytes", "blocks"))
                     + f"  or sum by ({by}) ({r.offload_bytes_rate}) > 0\n"
                     f"  or sum by ({by}) ({r.offload_blocks_rate}) > 0\n)")
    return [
        Alert(
            "KvscopeTTFTBudgetBreach",
            f"{ttft} > {_g(cfg.ttft_budget_seconds)}"
            + _floor(requests["kvscope_ttft_seconds"], by, cfg.min_requests_per_second),
            cfg.ttft_budget_for, "critical",
            "Time to first token is over its budget: roll back the newest offload tier.",
            f"p{float(q) * 100:g} TTFT at {{{{ $labels.instance }}}} is {{{{ $value | humanizeDuration }}}}, "
            f"above the {_g(cfg.ttft_budget_seconds)}s budget for {cfg.ttft_budget_for}. "
            + rollback.format(name="TTFT"),
            (ttft, requests["kvscope_ttft_seconds"])),
        Alert(
            "KvscopeTTFTBudgetBreach",
            f"{ttft} > {_g(ttft_warning)}"
            + _floor(requests["kvscope_ttft_seconds"], by, cfg.min_requests_per_second),
            cfg.ttft_budget_for, "warning",
            "Time to first token is nearing its budget.",
            f"p{float(q) * 100:g} TTFT at {{{{ $labels.instance }}}} is {{{{ $value | humanizeDuration }}}}, "
            f"above {_pct(cfg.ttft_budget_warning_ratio)} of the {_g(cfg.ttft_budget_seconds)}s "
            f"budget for {cfg.ttft_budget_for}. At the budget the rollback rule applies: find "
            "what grew (promotion wait, recompute share) before it does.",
            (ttft,)),
        Alert(
            "KvscopeITLBudgetBreach",
            f"{itl} > {_g(cfg.itl_budget_seconds)}"
            + _floor(requests["kvscope_itl_seconds"], by, cfg.min_requests_per_second),
            cfg.itl_budget_for, "critical",
            "Inter-token latency is over its budget: roll back the newest offload tier.",
            f"p{float(qi) * 100:g} of the requests' mean inter-token latency at "
            "{{ $labels.instance }} is {{ $value | humanizeDuration }}, above the "
            f"{_g(cfg.itl_budget_seconds)}s budget for {cfg.itl_budget_for}. "
            + rollback.format(name="ITL"),
            (itl, requests["kvscope_itl_seconds"])),
        *(Alert(
            f"Kvscope{name}Regression",
            f"{q99}\n  > {_g(1 + cfg.regression_ratio)} * ({q99} offset "
            f"{cfg.regression_baseline_offset})"
            + _floor(requests[metric], by, cfg.min_requests_per_second),
            cfg.regression_for, "warning",
            f"{name} is well above its own baseline: did an offload tier roll out since?",
            f"p{float(q) * 100:g} {name} at {{{{ $labels.instance }}}} is "
            "{{ $value | humanizeDuration }}, more than "
            f"{_pct(cfg.regression_ratio)} above its value {cfg.regression_baseline_offset} "
            f"earlier, for {cfg.regression_for}. If a tier rolled out since, the rollback rule "
            "applies: disable it and compare the runs (kvscope compare) before trying again.",
            (q99, requests[metric]))
          for name, q99, q, metric in (("TTFT", ttft, q, "kvscope_ttft_seconds"),
                                       ("ITL", itl, qi, "kvscope_itl_seconds"))),
        *(Alert(
            "KvscopeHostMemoryHeadroomLow",
            f"{r.headroom_ratio} < {_g(ratio)}",
            cfg.headroom_for, severity, summary,
            "Host RAM headroom at {{ $labels.instance }} is {{ $value | humanizePercentage }} of "
            f"the memory limit{consequence} {shrink}",
            (r.headroom_ratio,))
          for ratio, severity, summary, consequence in (
              (cfg.headroom_warning_ratio, "warning",
               "Host RAM available to the node is close to the configured reserve.",
               f", below {_pct(cfg.headroom_warning_ratio)}: the reserve kept for the OS and "
               "other services is next."),
              (cfg.headroom_min_ratio, "critical",
               "Host RAM available to the node is below the configured reserve.",
               ": available memory is below the reserve kept for the OS and other services, so "
               "the kernel may swap or kill processes."))),
        # Misconfiguration (the guide's failure mode 3, overcommitting host RAM): the tier's
        # budget is what it grows to, so budget + reserve over the limit is an OOM waiting for
        # the tier to fill, whatever the headroom says now.
        Alert(
            "KvscopeOffloadBudgetOverLimit",
            f"(\n  {host_budget}\n  + on ({by})\n  {host['kvscope_host_memory_reserve_bytes']}\n)\n"
            f"- on ({by})\n{host['kvscope_host_memory_limit_bytes']}\n> 0",
            cfg.budget_over_limit_for, "warning",
            "The host-RAM offload budget plus the reserve exceeds the host's memory limit.",
            f"At {{{{ $labels.instance }}}} the {'/'.join(cfg.host_memory_tiers)} offload "
            "budget plus the reserve exceed the memory limit (physical RAM or the cgroup's "
            "memory limit, the tighter) by {{ $value | humanize1024 }}B: once the tier fills, the "
            "kernel swaps or the OOM killer picks a process. Shrink the budget (vLLM "
            "--kv-offloading-size / cpu_bytes_to_use) by at least that much, or raise the limit.",
            (host_budget, *host.values())),
        # The guide's failure mode 2: weight offload taken for KV offload.
        Alert(
            "KvscopeWeightOffloadWithoutKVOffload",
            f"{weights} > 0\nunless on ({by})\n{kv_offload_on}",
            cfg.weight_offload_for, "warning",
            "The engine offloads model weights to host RAM, but no KV cache.",
            "The engine at {{ $labels.instance }} keeps {{ $value | humanize1024 }}B of model "
            "weights per GPU in host RAM (vLLM --cpu-offload-gb) and no KV offload tier is "
            "configured: this moves weights, not KV; it adds transfer work to every forward "
            "pass and creates no room for KV blocks. Drop --cpu-offload-gb if the model fits "
            "without it; for KV offload use --kv-offloading-size.",
            (weights, kv_offload_on)),
        Alert(
            "KvscopeSwapInWhileOffloading",
            f"{swap_in} > {_g(cfg.swap_in_bytes_per_second)}\nand on ({by})\n{host_offload_on}",
            cfg.swap_in_for, "warning",
            "The host reads pages back from swap while a host-RAM offload tier is on.",
            "The host at {{ $labels.instance }} reads {{ $value | humanize1024 }}B/s back in "
            f"from swap while the {'/'.join(cfg.host_memory_tiers)} offload tier is configured: "
            "host RAM is overcommitted, and pinned KV buffers and the engine compete with "
            "whatever was swapped out. Shrink the tier's budget or move what else runs here.",
            (swap_in, host_offload_on)),
        Alert(
            "KvscopeOffloadThrash",
            f"{unused} > {_g(cfg.thrash_unused_share)}\n"
            f"and on ({by}, tier)\n"
            f"{r.offload_bytes_rate} > {_g(cfg.thrash_min_offload_bytes_per_second)}",
            cfg.thrash_for, "warning",
            "Most blocks offloaded to a tier are evicted before they are ever reused.",
            "{{ $value | humanizePercentage }} of the blocks evicted from the {{ $labels.tier }} "
            "tier at {{ $labels.instance }} were never hit, while offloads into it stay above "
            f"{_bytes(cfg.thrash_min_offload_bytes_per_second)}/s: the tier pays transfer "
            "bandwidth for nothing. Enable admission (store only reused prefixes) or grow the tier.",
            (unused, r.offload_bytes_rate)),
        # The guide's "secondary tier added too early" in its sharpest form: fetching a
        # tier's blocks takes longer than computing their tokens again would.
        Alert(
            "KvscopePromotionSlowerThanRecompute",
            f"{promo_spent}\n/ on ({by}, tier)\n{saved}\n> {_g(cfg.recompute_faster_ratio)}"
            + _floor(promo_count, f"{by}, tier", cfg.min_transfers_per_second),
            cfg.recompute_faster_for, "warning",
            "Promotions from an offload tier take longer than recomputing their tokens.",
            "Promotions from the {{ $labels.tier }} tier at {{ $labels.instance }} take "
            "{{ $value | humanize }} times the prefill seconds their tokens save (more than "
            f"{_g(cfg.recompute_faster_ratio)}): recomputing them would be faster. Disable the "
            "tier, or move it to faster storage, and watch TTFT.",
            (promo_spent, saved)),
        # The guide's failure mode 5 (transfer topology): every copy between the host KV pool
        # and the GPU crosses the socket interconnect when they sit on different nodes.
        Alert(
            "KvscopeKVPoolRemoteNUMA",
            f"{numa_local}\n< {_g(cfg.numa_local_min_share)}{gpu_nodes_known}",
            cfg.numa_remote_for, "warning",
            "The engine's host memory, its KV pool among it, is on another NUMA node than its "
            "GPU.",
            "Only {{ $value | humanizePercentage }} of the engine process's memory at "
            "{{ $labels.instance }} is on its GPUs' NUMA nodes: offloads and promotions "
            "cross the socket interconnect. Bind the engine to its GPU's node (numactl "
            "--cpunodebind=N --membind=N, N the GPU's numa_node) and restart it.",
            (numa_local + gpu_nodes_known,)),
        Alert(
            "KvscopeTierIneffective",
            f"(\n  (\n    {r.tier_fill}{{{served}}} > {_g(cfg.ineffective_fill_ratio)}\n"
            # a tier that reports no capacity (vLLM's disk tier through the tap) holds data
            # while stores keep going into it
            f"    or (\n      ({r.offload_bytes_rate}{{{served}}} > 0\n"
            f"       or {r.offload_blocks_rate}{{{served}}} > 0)\n"
            f"      unless on ({by}, tier)\n      {fill}\n    )\n  )\n"
            f"  unless on ({by}, tier)\n  {share_as_tier} >= {_g(cfg.ineffective_max_share)}\n)\n"
            f"and on ({by}) (sum by ({by}) ({r.prompt_tokens_rate}) > 0)",
            cfg.ineffective_for, "warning",
            "An offload tier holds data but serves almost none of the prompt tokens.",
            "The {{ $labels.tier }} tier at {{ $labels.instance }} holds data (over "
            f"{_pct(cfg.ineffective_fill_ratio)} full, or, where it reports no capacity, still "
            f"taking stores) but served less than {_pct(cfg.ineffective_max_share)} of prompt "
            f"tokens for {cfg.ineffective_for}: its memory buys no hits. Shrink or disable it, "
            "or check that lookups reach it.",
            (fill, r.offload_bytes_rate, r.offload_blocks_rate, r.prompt_share)),
        # Full is an LRU tier's steady state; it matters when the tier loses KV that was being
        # reused: blocks leave the cache altogether (no copy below) while a fair share of what
        # it evicts had been hit.
        Alert(
            "KvscopeTierNearlyFull",
            f"{fill} > {_g(cfg.tier_full_ratio)}\n"
            f"and on ({by}, tier)\n{dropped} > 0\n"
            f"and on ({by}, tier)\n{unused} < {_g(1 - cfg.tier_full_reused_share)}",
            cfg.tier_full_for, "warning",
            "A KV offload tier is full and losing blocks that were being reused.",
            "The {{ $labels.tier }} tier at {{ $labels.instance }} is "
            "{{ $value | humanizePercentage }} full and drops blocks out of the cache while more "
            f"than {_pct(cfg.tier_full_reused_share)} of the blocks it evicts had been hit: "
            "reused prefixes are lost and recomputed. Grow the tier or add one below it.",
            (fill, dropped, unused)),
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
            f"{r.transfer_failures_ratio} > {_g(cfg.transfer_failure_ratio)}"
            + _floor(transfers, f"{by}, src, dst", cfg.min_transfers_per_second),
            cfg.transfer_failures_for, "warning",
            "KV block transfers between tiers are failing.",
            "{{ $value | humanizePercentage }} of {{ $labels.src }} -> {{ $labels.dst }} transfers "
            "at {{ $labels.instance }} failed; their blocks are dropped and recomputed. See "
            "kvscope_transfer_failures_total by reason.",
            (r.transfer_failures_ratio, transfers)),
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
        # up == 0 only covers targets Prometheus still scrapes; one that vanished from service
        # discovery has no up at all, so also fire for a target seen within the window and
        # gone now (the count-unless form; absent() would only catch the whole job vanishing).
        Alert(
            "KvscopeAgentDown",
            f"{up} == 0\nor (\n  group by ({by}) (max_over_time({up}[{cfg.agent_vanished_window}]))"
            f"\n  unless on ({by})\n  {up}\n)",
            cfg.agent_down_for, "warning",
            "Prometheus cannot scrape a kvscope agent, or it vanished from discovery.",
            "The kvscope agent at {{ $labels.instance }} has not answered scrapes, or has vanished "
            f"from service discovery, for {cfg.agent_down_for}; every kvscope panel and alert for "
            "it is blind.",
            (up,)),
    ]


def alert_groups(cfg: MixinConfig) -> dict:
    return {"groups": [{"name": "kvscope.alerts", "rules": [a.rule(cfg) for a in alerts(cfg)]}]}
