"""The mixin's one config object: selectors, windows, thresholds and `for:` durations.

Everything an operator may want to tune lives here (node-mixin's ``_config``). Override it
without forking: ``dataclasses.replace(MixinConfig(), ttft_budget_seconds=1.5)`` from Python, or
a TOML file of the same keys for ``python -m kvscope.mixin --config FILE``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvscope.argtypes import PROMETHEUS_DURATION, label_matchers
from kvscope.vocabulary import TIERS

MIB = 1024 * 1024


# Ratios that are shares of a whole (0 to 1), as every *_share is; the others are multiples
# (regression_ratio 1.5: 150% above the baseline; recompute_faster_ratio 2: twice the time).
_SHARE_RATIOS = {"headroom_min_ratio", "headroom_warning_ratio", "ttft_budget_warning_ratio",
                 "ineffective_fill_ratio", "tier_full_ratio", "gpu_kv_usage_warning_ratio",
                 "pcie_saturation_ratio", "transfer_failure_ratio"}


class MixinConfigError(ValueError):
    """An override names an unknown key, or gives a value of the wrong type or out of range."""


@dataclass(frozen=True)
class MixinConfig:
    # Which series are kvscope's: added to every selector in rules, alerts and boards.
    selector: str = 'job="kvscope"'
    # Labels that identify one agent; rules aggregate by these (plus their own labels).
    group_labels: tuple[str, ...] = ("job", "instance")
    # The label that tells clusters apart in a multi-cluster Prometheus (Thanos, Mimir), kept in
    # every rule's and alert's ``by`` (a series without it just lacks it); "" to drop it.
    # show_multi_cluster adds a $cluster variable that every board query filters by
    # (kubernetes-mixin's clusterLabel and showMultiCluster).
    cluster_label: str = "cluster"
    show_multi_cluster: bool = False
    # The Requests board's list of slow requests' traces and its $traces variable (a Tempo
    # datasource, where `kvscope agent --otlp-endpoint` sends spans); false where none is
    # provisioned, so no empty variable and broken panel show.
    show_traces: bool = True
    # Window of every rate() in the recording rules (and so in the alerts).
    rate_window: str = "5m"
    # Tiers from nearest the GPU outward: a copy to a nearer tier is a promotion.
    tiers: tuple[str, ...] = TIERS
    runbook_url_base: str = "https://github.com/kvscope/kvscope/blob/main/docs/runbooks.md"
    dashboard_uid_prefix: str = "kvscope"
    dashboard_tags: tuple[str, ...] = ("kvscope",)
    dashboard_refresh: str = "30s"
    dashboard_time_from: str = "now-1h"

    # Traffic floors: a latency quantile or a failed share over a handful of events is noise, so
    # the TTFT/ITL budget alerts need this many requests, and KvscopeTransferFailures this many
    # transfers, per second over the rate window (0.2/s: 60 in 5m).
    min_requests_per_second: float = 0.2
    min_transfers_per_second: float = 0.2
    # KvscopeTTFTBudgetBreach: the rollback rule (critical), and a warning at this share of the
    # budget first.
    ttft_budget_seconds: float = 2.5
    ttft_budget_quantile: float = 0.99
    ttft_budget_for: str = "15m"
    ttft_budget_warning_ratio: float = 0.8
    # KvscopeITLBudgetBreach: the rollback rule's other half (the mean inter-token latency of
    # each request, kvscope_itl_seconds).
    itl_budget_seconds: float = 0.1
    itl_budget_quantile: float = 0.99
    itl_budget_for: str = "15m"
    # KvscopeTTFTRegression / KvscopeITLRegression: the budget relative to a recorded baseline,
    # the same p99 this long before (an offset window: the baseline is what the fleet did then,
    # e.g. the day before a tier rolled out); above it by more than this share, for this long.
    regression_baseline_offset: str = "1d"
    regression_ratio: float = 0.25
    regression_for: str = "30m"
    # KvscopeHostMemoryHeadroomLow: headroom / memory limit below this is critical (0: the
    # reserve is eaten), below the warning ratio a warning.
    headroom_min_ratio: float = 0.0
    headroom_warning_ratio: float = 0.05
    headroom_for: str = "10m"
    # KvscopeOffloadBudgetOverLimit: the host-RAM offload budgets (tiers in
    # host_memory_tiers) plus the reserve exceed the memory limit (RAM or the cgroup limit).
    host_memory_tiers: tuple[str, ...] = ("cpu",)
    budget_over_limit_for: str = "5m"
    # KvscopeSwapInWhileOffloading: bytes/s read back in from swap (host-wide) above this while
    # a host-RAM offload tier is configured (a budget or a capacity above 0).
    swap_in_bytes_per_second: float = 0.0
    swap_in_for: str = "5m"
    # KvscopeWeightOffloadWithoutKVOffload: the engine offloads model weights (vLLM
    # --cpu-offload-gb) while no KV offload tier has a budget, a capacity or traffic.
    weight_offload_for: str = "5m"
    # KvscopeOffloadThrash: share of a tier's evictions that were never hit, while offloads run.
    thrash_unused_share: float = 0.8
    thrash_min_offload_bytes_per_second: float = 64 * MIB
    thrash_for: str = "30m"
    # KvscopeTierIneffective: a tier this full that serves less than this share of prompt tokens.
    ineffective_fill_ratio: float = 0.9
    ineffective_max_share: float = 0.01
    ineffective_for: str = "1h"
    # KvscopePromotionSlowerThanRecompute: transfer seconds spent promoting from a tier above
    # this multiple of the prefill seconds its tokens saved (the cost model's), for this long,
    # at min_transfers_per_second promotions or more.
    recompute_faster_ratio: float = 1.0
    recompute_faster_for: str = "15m"
    # KvscopeKVPoolRemoteNUMA: share of the engine process's memory (its host KV pool's
    # placement, numa_maps) on the NUMA nodes of the host's GPUs, below this, for this long.
    numa_local_min_share: float = 0.5
    numa_remote_for: str = "15m"
    # KvscopeTierNearlyFull: this full, and losing reused KV: it drops blocks out of the cache
    # (no copy kept below) while more than this share of its evicted blocks had been hit.
    tier_full_ratio: float = 0.95
    tier_full_reused_share: float = 0.2
    tier_full_for: str = "15m"
    # KvscopePromotionLatencyHigh: p99 of one batched promotion.
    promotion_p99_seconds: float = 0.1
    promotion_for: str = "15m"
    # Node board only: GPU KV cache usage drawn orange from this share (a full GPU KV cache
    # makes the engine queue or preempt).
    gpu_kv_usage_warning_ratio: float = 0.9
    # KvscopePCIeLinkSaturated: PCIe bytes/s against the link maximum, per direction.
    pcie_saturation_ratio: float = 0.9
    pcie_for: str = "15m"
    # KvscopeTransferFailures: failed share of transfers between two tiers.
    transfer_failure_ratio: float = 0.01
    transfer_failures_for: str = "15m"
    # KvscopeEventsDropped: dropped events per second, per source.
    events_dropped_per_second: float = 0.0
    events_dropped_for: str = "15m"
    # KvscopeSourceDown / KvscopeAgentDown.
    source_down_for: str = "10m"
    agent_down_for: str = "10m"
    # KvscopeAgentDown also fires for a target scraped within this window that is gone now
    # (vanished from service discovery); it resolves when the window has passed.
    agent_vanished_window: str = "1h"

    def __post_init__(self) -> None:
        """Refuse values that would make rules promtool rejects or alerts that never (or
        always) fire: a duration Prometheus cannot read, a negative or infinite number, a
        quantile outside (0, 1), a budget of 0, a share above 1, a critical headroom above the
        warning's. Raises MixinConfigError naming the key."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            why = ""
            if f.name.endswith(("_for", "_window", "_offset")) or f.name == "dashboard_refresh":
                if not (isinstance(value, str) and PROMETHEUS_DURATION.fullmatch(value)):
                    why = "want a Prometheus duration such as 5m, 1h30m or 1d"
            elif f.name == "selector":  # written into every rule: promtool refused job=kvscope
                try:
                    label_matchers(value)
                except argparse.ArgumentTypeError as exc:
                    raise MixinConfigError(f"mixin config 'selector': {exc}") from None
            elif isinstance(value, float):
                if not (math.isfinite(value) and value >= 0):
                    why = "want a finite number, 0 or more"
                elif f.name.endswith("_quantile") and not 0 < value < 1:
                    why = "want a quantile between 0 and 1"
                elif f.name.endswith("_seconds") and value == 0:
                    why = "want a budget above 0 seconds"
                elif (f.name.endswith("_share") or f.name in _SHARE_RATIOS) and value > 1:
                    why = "want a share between 0 and 1"
            if why:
                raise MixinConfigError(f"mixin config {f.name!r}: {why}, got {value!r}")
        if self.headroom_min_ratio >= self.headroom_warning_ratio:
            raise MixinConfigError(
                f"mixin config 'headroom_min_ratio' ({self.headroom_min_ratio!r}, critical) is "
                f"not below 'headroom_warning_ratio' ({self.headroom_warning_ratio!r}): the "
                "warning must come first, at the higher headroom")
        if self.ttft_budget_warning_ratio == 0:
            raise MixinConfigError("mixin config 'ttft_budget_warning_ratio': want a share of "
                                   "the budget above 0 (a warning at 0 seconds always fires)")

    @property
    def by(self) -> str:
        """The cluster label and the group labels as a PromQL label list:
        ``cluster, job, instance``."""
        return ", ".join(label for label in (self.cluster_label, *self.group_labels) if label)

    def runbook_url(self, alert: str) -> str:
        return f"{self.runbook_url_base}#{alert.lower()}"


def load_config(path: str | Path | None = None, **overrides) -> MixinConfig:
    """Defaults, then the TOML file's keys, then keyword overrides. Raises MixinConfigError
    for a file that is not TOML or a bad key or value, OSError for a file it cannot read."""
    values: dict = {}
    if path is not None:
        with open(path, "rb") as fh:
            try:
                values.update(tomllib.load(fh))
            except tomllib.TOMLDecodeError as exc:  # its words name a line, not the file
                raise MixinConfigError(f"{path}: not TOML: {exc}") from None
    values.update(overrides)
    fields = {f.name: f for f in dataclasses.fields(MixinConfig)}
    default = MixinConfig()
    for key, value in list(values.items()):
        if key not in fields:
            raise MixinConfigError(f"unknown mixin config key {key!r}")
        want = type(getattr(default, key))
        if want is tuple and isinstance(value, list):
            values[key] = value = tuple(value)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            values[key] = value = float(value)
        if not isinstance(value, want):
            raise MixinConfigError(f"mixin config {key!r}: want {want.__name__}, got {value!r}")
    return dataclasses.replace(default, **values)
