"""Overview: hit quality, latency, cost against benefit, tiers, host and the agent at a glance."""

from __future__ import annotations

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.dashboards.common import RATE, P, Q, Row, board, s
from kvscope.mixin.rules import Records


RECOMPUTE = 'source="recompute"'


def overview(cfg: MixinConfig) -> dict:
    r = Records.of(cfg)
    budget = ((cfg.ttft_budget_seconds, "red"),)
    rows = [
        Row("Hit quality", (
            P("Prompt tokens per second by source",
              "Where each prompt token's KV came from: gpu (resident), cpu or disk (promoted), "
              "recompute (prefill).",
              (Q(f"sum by (source) (rate(kvscope_prompt_tokens_total{s(cfg)}[{RATE}]))",
                 "{{source}}"),), unit="short", stack="normal", width=10),
            P("Share of prompt tokens by source",
              "The same split as shares of all prompt tokens (recording rule over "
              f"{cfg.rate_window}).",
              (Q(f"sum by (source) ({r.prompt_tokens_rate}{s(cfg)})\n  / ignoring (source) "
                 f"group_left ()\nsum({r.prompt_tokens_rate}{s(cfg)})", "{{source}}"),),
              unit="percentunit", stack="normal", max=1, min=0, width=10),
            P("Served from cache",
              "Share of prompt tokens that did not need prefill (1 - recompute share).",
              (Q(f'1 - sum({r.prompt_tokens_rate}{s(cfg, RECOMPUTE)})\n'
                 f"  / sum({r.prompt_tokens_rate}{s(cfg)})"),),
              unit="percentunit", kind="stat", width=4, max=1, min=0),
        )),
        Row("Latency", (
            P("TTFT p50 / p95 / p99",
              f"Time to first token (recording rule over {cfg.rate_window}); the dashed line is "
              f"the TTFT budget ({cfg.ttft_budget_seconds:g}s) of the rollback rule.",
              (Q(f"max by (quantile) ({r.ttft_quantile}{s(cfg)})", "p{{quantile}}"),),
              unit="s", thresholds=budget),
            P("Promotion latency p50 / p95 / p99",
              "Duration of one batched copy toward the GPU, by direction (recording rule).",
              (Q(f"max by (src, dst, quantile) ({r.promotion_quantile}{s(cfg)})",
                 "{{src}} → {{dst}} p{{quantile}}"),),
              unit="s", thresholds=((cfg.promotion_p99_seconds, "red"),)),
        )),
        Row("Cost and benefit", (
            P("Prefill seconds saved against transfer seconds spent",
              "Estimated prefill time saved by cached tokens (cost model) against measured "
              "transfer time, per second of wall time.",
              (Q(f"sum(rate(kvscope_prefill_seconds_saved_total{s(cfg)}[{RATE}]))", "saved"),
               Q(f"sum(rate(kvscope_transfer_seconds_sum{s(cfg)}[{RATE}]))", "spent")),
              unit="s"),
            P("Transfer throughput by direction",
              "KV bytes copied between tiers per second (offloads away from the GPU, promotions "
              "toward it).",
              (Q(f"sum by (src, dst) ({r.transfer_bytes_rate}{s(cfg)})", "{{src}} → {{dst}}"),),
              unit="Bps"),
        )),
        Row("Tiers and host", (
            P("Tier fill", "Resident bytes against capacity, per tier.",
              (Q(f"{r.tier_fill}{s(cfg)}", "{{instance}} {{tier}}"),),
              unit="percentunit", max=1, min=0, width=8,
              thresholds=((cfg.tier_full_ratio, "orange"),)),
            P("Evicted before any reuse",
              "Share of the blocks evicted from each tier that were never hit while resident.",
              (Q(f"{r.never_reused_share}{s(cfg)}", "{{instance}} {{tier}}"),),
              unit="percentunit", max=1, min=0, width=8,
              thresholds=((cfg.thrash_unused_share, "orange"),)),
            P("Host RAM headroom",
              "Available memory minus the reserve, as a share of the memory limit; below "
              f"{cfg.headroom_min_ratio:g} the reserve is being eaten into.",
              (Q(f"{r.headroom_ratio}{s(cfg)}", "{{instance}}"),),
              unit="percentunit", width=8, thresholds=((cfg.headroom_min_ratio, "red"),)),
        )),
        Row("Agent", (
            P("Sources up", "1 when a source delivers events, 0 when it fails.",
              (Q(f"kvscope_source_up{s(cfg)}", "{{instance}} {{source}}"),),
              kind="stat", width=6, thresholds=((1, "green"),)),
            P("Events dropped per second", "Events the agent or a tap dropped (0 when none).",
              (Q(f"sum by (source) ({r.events_dropped_rate}{s(cfg)})", "{{source}}"),),
              kind="stat", width=6, thresholds=((1e-9, "red"),)),
            P("Engines", "Engines and models the selected agents observe.",
              (Q(f"kvscope_engine_info{s(cfg)}", instant=True),), kind="table", width=8),
            P("Agent version", "kvscope version of each agent.",
              (Q(f"count by (version) (kvscope_build_info{s(cfg)})", "{{version}}"),),
              kind="stat", width=4),
        )),
    ]
    return board(cfg, "overview", "Overview",
                 "KV-cache offload at a glance: hit quality, latency, cost, tiers, host.", rows)
