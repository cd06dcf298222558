"""Overview: is offload paying off, and is anything wrong? Hit quality, cost against benefit,
and one number per concern that links to the board that explains it."""

from __future__ import annotations

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.dashboards.common import (
    NO_TRAFFIC, RATE, RED_BELOW_ONE, UP_DOWN, P, Q, Row, board, headroom_steps, quantile, s)
from kvscope.mixin.promql import offload_tiers, tier_matcher
from kvscope.mixin.rules import Records

TOKENS_PER_S = "suffix: tokens/s"
CACHED = 'source!="recompute"'
PREFIX_SEEN = 'prefix="seen"'


def overview(cfg: MixinConfig) -> dict:
    r = Records.of(cfg)
    tokens = f"{r.prompt_tokens_rate}{s(cfg)}"
    rows = [
        Row("Hit quality", (
            P("Prompt tokens per second by source",
              "Where each prompt token's KV came from: gpu (resident), cpu or disk (promoted), "
              "recompute (prefill).",
              (Q(f"sum by (source) (rate(kvscope_prompt_tokens_total{s(cfg)}[{RATE}]))",
                 "{{source}}"),), unit=TOKENS_PER_S, stack="normal", min=0, width=10),
            P("Share of prompt tokens by source",
              "The same split as shares of all prompt tokens (recording rule over "
              f"{cfg.rate_window}).",
              (Q(f"sum by (source) ({tokens})\n  / ignoring (source) group_left ()\n"
                 f"(sum({tokens}) > 0)", "{{source}}"),),
              unit="percentunit", stack="normal", max=1, min=0, width=8, no_value=NO_TRAFFIC),
            P("Served from cache",
              "Share of prompt tokens that did not need prefill (every source but recompute).",
              (Q(f"sum({r.prompt_tokens_rate}{s(cfg, CACHED)})\n  / (sum({tokens}) > 0)"),),
              unit="percentunit", kind="stat", width=3, max=1, min=0, no_value=NO_TRAFFIC),
            P("Prompt blocks reused",
              "Share of prompt blocks whose prefix was seen before, whatever the tiers held: "
              "the reuse a large enough tier could serve (from the block hashes lookups "
              f"carry; none without them), over {cfg.rate_window} as Served from cache. Far "
              "above it: the tiers are too small for the reuse distance.",
              (Q(f"sum(rate(kvscope_prompt_prefix_blocks_total{s(cfg, PREFIX_SEEN)}"
                 f"[{cfg.rate_window}]))\n  / (sum(rate(kvscope_prompt_prefix_blocks_total"
                 f"{s(cfg)}[{cfg.rate_window}])) > 0)"),),
              unit="percentunit", kind="stat", width=3, max=1, min=0,
              no_value=f"{NO_TRAFFIC}, or not measured"),
        )),
        Row("Cost and benefit", (
            P("Prefill seconds saved against transfer seconds spent",
              "Estimated prefill time saved by tokens the offload tiers served (cost model; "
              "not the GPU prefix cache's, which no transfer pays for) against measured "
              "transfer time, in seconds per second of wall time: 0.5 s/s saved is half a "
              "prefill engine's time.",
              (Q(f"sum(rate(kvscope_prefill_seconds_saved_total"
                 f"{s(cfg, tier_matcher(cfg.tiers[1:], 'source'))}[{RATE}]))", "saved"),
               Q(f"sum(rate(kvscope_transfer_seconds_sum{s(cfg)}[{RATE}]))", "spent")),
              unit="suffix: s/s", min=0, width=16),
            P("TTFT p99, worst instance",
              f"The highest p{cfg.ttft_budget_quantile * 100:g} time to first token of the "
              f"selected instances (recording rule over {cfg.rate_window}) against the "
              f"{cfg.ttft_budget_seconds:g}s budget; Requests & SLO shows each instance.",
              (Q(f"max({r.ttft_quantile}{s(cfg, quantile(cfg.ttft_budget_quantile))})"),),
              unit="s", kind="stat", width=8,
              thresholds=((cfg.ttft_budget_seconds * cfg.ttft_budget_warning_ratio, "orange"),
                          (cfg.ttft_budget_seconds, "red"))),
        )),
        Row("At a glance (details on Tiers and Node)", (
            P("Fullest offload tier", "The fullest offload tier of the selected instances; "
              "full is normal for an LRU tier (Tiers shows whether it loses reused blocks).",
              (Q(f"max({r.tier_fill}{s(cfg, offload_tiers(cfg))})"),),
              unit="percentunit", kind="stat", width=4, max=1, min=0, no_value="no tier",
              thresholds=((cfg.tier_full_ratio, "orange"),)),
            P("Lowest host RAM headroom",
              "Available memory minus the reserve, as a share of the memory limit, on the "
              f"tightest instance; below {cfg.headroom_min_ratio:g} the reserve is being eaten "
              "into (Node shows each instance).",
              (Q(f"min({r.headroom_ratio}{s(cfg)})"),),
              unit="percentunit", kind="stat", width=4, thresholds=headroom_steps(cfg)),
            P("Sources up", "Each source: up when it delivers events, down when it fails.",
              (Q(f"kvscope_source_up{s(cfg)}", "{{instance}} {{source}}"),),
              kind="stat", width=4, thresholds=RED_BELOW_ONE, mappings=UP_DOWN),
            P("Events dropped per second", "Events the agent or a tap dropped (0 when none).",
              (Q(f"sum by (source) ({r.events_dropped_rate}{s(cfg)})", "{{source}}"),),
              unit="suffix: events/s", kind="stat", width=4, min=0,
              thresholds=((1e-9, "red"),)),
            P("Engines", "One row per engine and model the selected agents observe; Value: "
              "how many sources observe it.",
              (Q(f"count by (engine, model) (kvscope_engine_info{s(cfg)})", table=True),),
              kind="table", width=6, hide_columns=("Time",)),
            P("KV cache settings", "Each source's engine's GPU prefix caching (on, off) and KV "
              "cache dtype width (auto: the model's; 8bit and 4bit: quantized), as the engine "
              "reports them: the cheaper steps before offload. Value: how many agents report "
              "that setting.",
              (Q("count by (source, prefix_caching, kv_cache_dtype) "
                 f"(kvscope_engine_cache_config_info{s(cfg)})", table=True),),
              kind="table", width=8, hide_columns=("Time",)),
            P("Agent version", "kvscope version of each agent.",
              (Q(f"count by (version) (kvscope_build_info{s(cfg)})", "{{version}}"),),
              kind="stat", width=2),
        )),
    ]
    return board(cfg, "overview", "Overview",
                 "Is KV-cache offload paying off, and is anything wrong: hit quality, cost "
                 "against benefit, and one number per concern.", rows)
