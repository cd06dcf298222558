"""Requests & SLO: request rate, TTFT against its budget, and what promotions add to it."""

from __future__ import annotations

from kvscope.catalog import LATENCY_SECONDS_BUCKETS
from kvscope.mixin.config import MixinConfig
from kvscope.mixin.dashboards.common import RATE, P, Q, Row, board, s
from kvscope.mixin.promql import le_matcher
from kvscope.mixin.rules import Records


def budget_bucket(budget: float) -> float:
    """The smallest TTFT bucket bound at or above the budget (the largest when none is)."""
    return next((b for b in LATENCY_SECONDS_BUCKETS if b >= budget), LATENCY_SECONDS_BUCKETS[-1])


def requests(cfg: MixinConfig) -> dict:
    r = Records.of(cfg)
    bucket = budget_bucket(cfg.ttft_budget_seconds)
    budget = ((cfg.ttft_budget_seconds, "red"),)
    quantile = f'quantile="{cfg.ttft_budget_quantile}"'
    hist = lambda metric, q, by="": (  # noqa: E731
        f"histogram_quantile({q}, sum by ({by + ', ' if by else ''}le) "
        f"(rate({metric}_bucket{s(cfg)}[{RATE}])))")
    ttft_q = tuple(Q(hist("kvscope_ttft_seconds", q), f"p{q * 100:g}", exemplar=(q == 0.99))
                   for q in (0.5, 0.95, 0.99))
    wait_q = tuple(Q(hist("kvscope_promotion_wait_seconds", q), f"p{q * 100:g}")
                   for q in (0.5, 0.95, 0.99))
    rows = [
        Row("Throughput and SLO", (
            P("Requests per second", "Requests that finished their prefill.",
              (Q(f"sum(rate(kvscope_requests_total{s(cfg)}[{RATE}]))", "requests/s"),),
              unit="reqps", width=12),
            P(f"Requests with TTFT within {bucket:g}s",
              f"Share of requests whose TTFT fell in a bucket at or under {bucket:g}s, the "
              f"bucket bound nearest above the {cfg.ttft_budget_seconds:g}s budget.",
              (Q(f"sum(rate(kvscope_ttft_seconds_bucket{s(cfg, le_matcher(bucket))}[{RATE}]))\n"
                 f"  / sum(rate(kvscope_ttft_seconds_count{s(cfg)}[{RATE}]))"),),
              unit="percentunit", kind="stat", width=6, max=1, min=0),
            P(f"TTFT p{cfg.ttft_budget_quantile * 100:g} (rollback rule)",
              f"What the TTFT budget alert compares with {cfg.ttft_budget_seconds:g}s "
              f"(recording rule over {cfg.rate_window}).",
              (Q(f"max({r.ttft_quantile}{s(cfg, quantile)})"),),
              unit="s", kind="stat", width=6, thresholds=budget),
        )),
        Row("Time to first token", (
            P("TTFT p50 / p95 / p99 (exemplars link to traces)",
              "Time to first token; exemplar dots on p99 carry the request's trace id. The "
              "dashed line is the budget.",
              ttft_q, unit="s", thresholds=budget),
            P("Mean TTFT", "Sum of TTFT over requests.",
              (Q(f"sum(rate(kvscope_ttft_seconds_sum{s(cfg)}[{RATE}]))\n"
                 f"  / sum(rate(kvscope_ttft_seconds_count{s(cfg)}[{RATE}]))", "mean"),),
              unit="s"),
        )),
        Row("Promotions", (
            P("Promotion wait per request p50 / p95 / p99",
              "Seconds of each request's TTFT spent waiting for promotions.",
              wait_q, unit="s", width=8),
            P("Share of TTFT spent waiting for promotions",
              "Promotion wait against TTFT, summed over requests.",
              (Q(f"sum(rate(kvscope_promotion_wait_seconds_sum{s(cfg)}[{RATE}]))\n"
                 f"  / sum(rate(kvscope_ttft_seconds_sum{s(cfg)}[{RATE}]))", "share"),),
              unit="percentunit", min=0, width=8),
            P("Transfer time p99 by direction (exemplars link to traces)",
              "Duration of one batched transfer; exemplar dots carry the request's trace id.",
              (Q(hist("kvscope_transfer_seconds", 0.99, "src, dst"), "{{src}} → {{dst}}",
                 exemplar=True),), unit="s", width=8),
        )),
    ]
    return board(cfg, "requests", "Requests & SLO",
                 "Requests, time to first token against its budget, and promotion wait.", rows)
