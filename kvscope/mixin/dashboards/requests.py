"""Requests & SLO: are requests within their latency budget, and what do promotions add to it?"""

from __future__ import annotations

from kvscope.catalog import LATENCY_SECONDS_BUCKETS
from kvscope.mixin.config import MixinConfig
from kvscope.mixin.dashboards.common import (
    NO_TRAFFIC, RATE, TRACE_LIMIT, P, Q, Row, board, quantile, s)
from kvscope.mixin.promql import le_matcher
from kvscope.mixin.rules import QUANTILES, Records


def budget_bucket(budget: float) -> float:
    """The smallest TTFT bucket bound at or above the budget (the largest when none is)."""
    return next((b for b in LATENCY_SECONDS_BUCKETS if b >= budget), LATENCY_SECONDS_BUCKETS[-1])


def requests(cfg: MixinConfig) -> dict:
    r = Records.of(cfg)
    bucket = budget_bucket(cfg.ttft_budget_seconds)
    budget = ((cfg.ttft_budget_seconds * cfg.ttft_budget_warning_ratio, "orange"),
              (cfg.ttft_budget_seconds, "red"))
    hist = lambda metric, q: (  # noqa: E731
        f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{s(cfg)}[{RATE}])))")
    rate = lambda series: f"sum(rate({series}{s(cfg)}[{RATE}]))"  # noqa: E731
    ttft_q = tuple(Q(hist("kvscope_ttft_seconds", q), f"p{q * 100:g}", exemplar=(q == 0.99))
                   for q in QUANTILES)
    itl_q = tuple(Q(hist("kvscope_itl_seconds", q), f"p{q * 100:g}") for q in QUANTILES)
    wait_q = tuple(Q(hist("kvscope_promotion_wait_seconds", q), f"p{q * 100:g}")
                   for q in QUANTILES)
    within = (f"sum(rate(kvscope_ttft_seconds_bucket{s(cfg, le_matcher(bucket))}[{RATE}]))\n"
              f"  / ({rate('kvscope_ttft_seconds_count')} > 0)")
    rows = [
        Row("Throughput and SLO", (
            P("Requests per second", "Requests that finished their prefill.",
              (Q(rate("kvscope_requests_total"), "requests/s"),), unit="reqps", min=0, width=8),
            P(f"Requests with TTFT within {bucket:g}s",
              f"Share of requests whose TTFT fell in a bucket at or under {bucket:g}s, the "
              f"bucket bound nearest above the {cfg.ttft_budget_seconds:g}s budget.",
              (Q(within),), unit="percentunit", kind="stat", width=4, max=1, min=0,
              no_value=NO_TRAFFIC),
            P(f"TTFT p{cfg.ttft_budget_quantile * 100:g} by instance (what the budget alerts "
              "compare)",
              f"Each instance's p{cfg.ttft_budget_quantile * 100:g} time to first token "
              f"(recording rule over {cfg.rate_window}); the alert warns above "
              f"{cfg.ttft_budget_warning_ratio:.0%} of the {cfg.ttft_budget_seconds:g}s budget "
              "and rolls back above it, when the instance serves enough requests.",
              (Q(f"max by (instance) ({r.ttft_quantile}{s(cfg, quantile(cfg.ttft_budget_quantile))})",
                 "{{instance}}"),),
              unit="s", width=12, thresholds=budget),
        )),
        Row("Time to first token and inter-token latency", (
            P("TTFT p50 / p95 / p99, fleet (exemplars link to traces)",
              "Time to first token over the selected instances together; exemplar dots on p99 "
              "carry the request's trace id. The dashed lines are the budget and its warning.",
              ttft_q, unit="s", thresholds=budget),
            P("ITL p50 / p95 / p99, fleet",
              "Each request's mean inter-token latency (one observation a request) over the "
              "selected instances together: what promotions and a busy batch cost decoding. The "
              f"dashed line is the {cfg.itl_budget_seconds:g}s budget.",
              itl_q, unit="s", thresholds=((cfg.itl_budget_seconds, "red"),)),
            P("TTFT distribution, fleet",
              "Requests per second in each TTFT bucket (le: the bucket's upper bound): a second "
              "band of slow requests (promotions, queueing) shows here before it moves p99.",
              (Q(f"sum by (le) (rate(kvscope_ttft_seconds_bucket{s(cfg)}[{RATE}]))", "{{le}}"),),
              kind="heatmap", unit="reqps", y_unit="s"),
            P("Mean TTFT", "Sum of TTFT over requests, fleet.",
              (Q(f"{rate('kvscope_ttft_seconds_sum')}\n  / ({rate('kvscope_ttft_seconds_count')}"
                 " > 0)", "mean"),),
              unit="s", no_value=NO_TRAFFIC),
        )),
        Row("Promotions", (
            P("Promotion wait per request p50 / p95 / p99, fleet",
              "Seconds of each request's TTFT spent waiting for promotions (transfer times "
              "by direction on the Tiers board).",
              wait_q, unit="s"),
            P("Share of TTFT spent waiting for promotions",
              "Promotion wait against TTFT, summed over requests, of the instances that "
              "measured promotion waits. Empty where none did (vLLM's spans alone carry "
              "none): not 0, which would point away from the tiers.",
              # the TTFTs of instances that measured waits only: a fleet's spans-only
              # instance halved a tapped one's share of 0.5
              (Q(f"{rate('kvscope_promotion_wait_seconds_sum')}\n"
                 f"  / (sum(\n    rate(kvscope_ttft_seconds_sum{s(cfg)}[{RATE}])\n"
                 f"    and on ({cfg.by})\n"
                 f"    rate(kvscope_promotion_wait_seconds_count{s(cfg)}[{RATE}]) > 0\n"
                 "  ) > 0)", "share"),),
              unit="percentunit", min=0, no_value=f"{NO_TRAFFIC}, or not measured"),
        )),
    ]
    if cfg.show_traces:
        slow = cfg.ttft_budget_seconds * cfg.ttft_budget_warning_ratio
        rows.append(Row("Traces", (
            P(f"Requests with TTFT of {slow:g}s or more (traces)",
              f"The latest {TRACE_LIMIT} requests over the budget's warning, from the Tempo that "
              "receives the agents' spans (`kvscope agent --otlp-endpoint`): open one to see its "
              "lookups, promotions and transfers. Spans carry no instance, so this lists every "
              "agent that exports there, whatever the selection above.",
              (Q(f'{{ name = "kv.request" && span.kv.ttft_seconds >= {slow:g} }}'),),
              kind="traces", width=24),
        )))
    return board(cfg, "requests", "Requests & SLO",
                 "Are requests within their latency budget, and what do promotions add to it.",
                 rows)
