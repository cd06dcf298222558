"""Pure figure builders for the Compare page: a baseline run against a candidate run.

Input: the plain data of :func:`kvscope.analysis.compare.to_dict` (seconds, bytes, 0-1 shares);
output: plotly figures. No I/O and no clock (house rule 9). Latencies are drawn in seconds with
SI ticks ("50ms"); error bars are the percentile-bootstrap confidence intervals.
"""

from __future__ import annotations

import plotly.graph_objects as go

from kvscope.analysis.compare import ms
from kvscope.dashboard.figures import COLOURS, message_figure
from kvscope.rollout.plan import AA_SUFFIX
from kvscope.vocabulary import TOKEN_SOURCES

TTFT_TITLE = "TTFT percentiles, baseline vs candidate (bootstrap CI)"
ITL_TITLE = "Inter-token latency percentiles, baseline vs candidate (bootstrap CI)"
HIT_QUALITY_TITLE = "Hit quality: share of prompt tokens by source"
TRANSFER_TITLE = "Transfer cost: bytes per request by direction"
LEVEL_TITLES = {"ttft": "p{q} TTFT per concurrency level (bootstrap CI over repetitions)",
                "itl": "p{q} inter-token latency per concurrency level (bootstrap CI)",
                "e2e": "p{q} end-to-end latency per concurrency level (bootstrap CI)"}
RUN_COLOURS = {"baseline": "#7f7f7f", "candidate": "#1f77b4"}
VERDICT_COLOURS = {"keep": "#2ca02c", "inconclusive": "#b8860b", "roll back": "#d62728"}
EMPTY = "choose a baseline and a candidate capture, then press Compare"


def _frame(title: str, y_title: str, height: int = 340) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 15}},
                      template="plotly_white", height=height, barmode="group",
                      margin={"l": 70, "r": 10, "t": 50, "b": 45},
                      legend={"x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"})
    fig.update_yaxes(title_text=y_title, rangemode="tozero")
    return fig


def latency(data: dict | None, metric: str = "ttft") -> go.Figure:
    """p50/p95/p99 of ``metric`` (``ttft`` or ``itl``) for both runs as grouped bars with CI
    error bars, in seconds; with a budget for it, a dashed line at the budget. An ITL that a
    run's engine modelled (``itl_modelled``) is said not measured, as the text report says."""
    title = TTFT_TITLE if metric == "ttft" else ITL_TITLE
    if not data:
        return message_figure(title, EMPTY)
    modelled = [side for side in ("baseline", "candidate")
                if metric == "itl" and (data.get(side) or {}).get("itl_modelled")]
    if modelled:  # one value per request, from the cost model: its bars read as a measurement
        return message_figure(title, f"ITL not measured: every request's ITL of the "
                              f"{' and the '.join(modelled)} is the same, the engine's cost "
                              "model")
    rows = data.get(metric) or []
    if not any(r.get("baseline") or r.get("candidate") for r in rows):
        return message_figure(title, f"no {metric.upper()} reported by either run")
    fig = _frame(title, "seconds (s)")
    labels = [f"p{r['quantile'] * 100:g}" for r in rows]
    for side in ("baseline", "candidate"):
        cells = [r.get(side) for r in rows]
        y = [c["value"] if c else None for c in cells]
        plus = [c["high"] - c["value"] if c else 0 for c in cells]
        minus = [c["value"] - c["low"] if c else 0 for c in cells]
        fig.add_trace(go.Bar(
            x=labels, y=y, name=side, marker_color=RUN_COLOURS[side],
            error_y={"type": "data", "symmetric": False, "array": plus, "arrayminus": minus},
            hovertemplate="%{x}: %{y:.4s}s<extra>" + side + "</extra>"))
    fig.update_yaxes(tickformat="~s", ticksuffix="s")
    budget = data.get(f"{metric}_budget")
    if budget:
        fig.add_hline(y=budget, line_dash="dash", line_color=VERDICT_COLOURS["roll back"],
                      annotation_text=f"budget {ms(budget)}",  # as the verdict names it
                      annotation_position="top left")
    return fig


def hit_quality(data: dict | None) -> go.Figure:
    """Share of prompt tokens by source (0-1), one stacked horizontal bar per run; a source
    neither run measured is named in the title, not listed in the legend: "no disk tier"
    where both runs were without that tier (their ``tiers_off``), else "not measured"; a
    tier one run had and the other did not is said at the other's bar ("no cpu tier")."""
    if not data:
        return message_figure(HIT_QUALITY_TITLE, EMPTY)
    runs = ["baseline", "candidate"]
    shares = [data[r]["token_share"] or {} for r in runs]
    measured = [s for s in TOKEN_SOURCES if any(s in share for share in shares)]
    unmeasured = [s for s in TOKEN_SOURCES if s not in measured] if measured else []
    off = [s for s in unmeasured if all(s in data[r].get("tiers_off", ()) for r in runs)]
    said = [f"no {s} tier" for s in off] + (
        [f"{', '.join(s for s in unmeasured if s not in off)} not measured"]
        if len(off) < len(unmeasured) else [])
    fig = _frame(HIT_QUALITY_TITLE + (f" ({'; '.join(said)})" if said else ""), "", height=260)
    fig.update_layout(barmode="stack")
    for source in measured or TOKEN_SOURCES:
        fig.add_trace(go.Bar(
            y=runs, x=[(data[r]["token_share"] or {}).get(source) for r in runs], name=source,
            orientation="h", marker_color=COLOURS.get(source),
            customdata=[(data[r]["tokens"] or {}).get(source, 0) for r in runs],
            hovertemplate="%{y}: %{x:.1%} (%{customdata:,} tokens)<extra>" + source
            + "</extra>"))
    for r in runs:  # an arm whose records carry no tokens by source: said, not drawn as 0
        if data[r]["token_share"] is None:
            fig.add_annotation(x=0.5, y=r, text="not measured", showarrow=False)
            continue
        # a tier the other arm had and this one did not (--cpu-blocks 0): said at its bar
        lacking = [s for s in measured if s in data[r].get("tiers_off", ())]
        if lacking:
            fig.add_annotation(x=1, xanchor="right", y=r, showarrow=False,
                               text=", ".join(f"no {s} tier" for s in lacking),
                               bgcolor="rgba(255,255,255,0.8)")
    fig.update_xaxes(title_text="share of prompt tokens (%)", tickformat=".0%", range=[0, 1])
    return fig


def _moved(cell: dict) -> str:
    """The hover's total seconds and blocks of one side's direction ({}: it moved nothing)."""
    if not cell:
        return "no transfers"
    seconds, blocks = cell.get("seconds"), cell.get("blocks")
    return (("time not measured" if seconds is None else f"{seconds:.3f} s") + ", "
            + ("blocks not measured" if blocks is None else f"{blocks:,.0f} blocks") + " in all")


def transfer_cost(data: dict | None) -> go.Figure:
    """Bytes moved per finished request, by direction, for both runs (grouped bars); the hover
    adds the total seconds and blocks of each direction ("not measured" where a side's source
    did not time or count them). A direction whose bytes a side did not measure (a source
    that did not know a block's size) has no bar there, and the title says so, not a bar of
    0."""
    if not data:
        return message_figure(TRANSFER_TITLE, EMPTY)
    unmeasured = [side for side in ("baseline", "candidate") if data[side]["transfers"] is None]
    directions = sorted({d for side in ("baseline", "candidate")
                         for d in data[side]["transfers"] or {}})
    if not directions:
        return message_figure(TRANSFER_TITLE, "no transfers in either run" if not unmeasured
                              else f"transfers not measured in the {' and '.join(unmeasured)}"
                              + ("" if len(unmeasured) == 2 else "; none in the other"))
    def unsized(side: str, d: str) -> bool:  # moved in d, bytes not measured (not none moved)
        cell = (data[side]["transfers"] or {}).get(d)
        return cell is not None and cell.get("bytes_per_request") is None

    said = [f"{d} bytes not measured in the {' and the '.join(sides)}" for d in directions
            if (sides := [s for s in ("baseline", "candidate") if unsized(s, d)])]
    fig = _frame(TRANSFER_TITLE + (f" ({'; '.join(said)})" if said else ""), "bytes (B)")
    for side in ("baseline", "candidate"):
        if data[side]["transfers"] is None:
            continue  # not measured: no bars, not bars of 0
        moved = data[side]["transfers"]
        cells = [moved.get(d, {}) for d in directions]
        fig.add_trace(go.Bar(
            x=directions, y=[c.get("bytes_per_request", 0.0) for c in cells], name=side,
            marker_color=RUN_COLOURS[side],
            customdata=[_moved(c) for c in cells],
            hovertemplate="%{x}: %{y:.4s}B per request; %{customdata}<extra>" + side
            + "</extra>"))
    fig.update_yaxes(tickformat="~s", ticksuffix="B")
    return fig


def level_tails(tails: dict | None, metric: str = "ttft", quantile: float = 0.99) -> go.Figure:
    """``quantile`` of ``metric`` (``ttft``, ``itl`` or ``e2e``) against concurrency, one line
    per arm with CI error bars, in seconds. ``tails``: a rollout report's
    ``{arm: {level: {metric: [{"quantile", "value", "low", "high"}, ...]}}}`` (levels as
    strings or ints; a metric an arm did not report: an empty list)."""
    title = LEVEL_TITLES[metric].format(q=f"{quantile * 100:g}")
    if not tails:
        return message_figure(title, "no rollout runs")
    fig = _frame(title, "seconds (s)")
    palette = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#bcbd22"]
    for i, (arm, levels) in enumerate(tails.items()):
        points = sorted((int(level), next((e for e in cells.get(metric, [])
                                           if e["quantile"] == quantile), None))
                        for level, cells in levels.items())
        points = [(x, e) for x, e in points if e is not None]
        if not points:
            continue
        fig.add_trace(go.Scatter(
            x=[x for x, _ in points], y=[e["value"] for _, e in points], name=arm,
            mode="lines+markers", line={"color": palette[i % len(palette)],
                                        "dash": "dot" if arm.endswith(AA_SUFFIX) else "solid"},
            error_y={"type": "data", "symmetric": False,
                     "array": [e["high"] - e["value"] for _, e in points],
                     "arrayminus": [e["value"] - e["low"] for _, e in points]},
            hovertemplate="%{x} streams: %{y:.4s}s<extra>" + arm + "</extra>"))
    if not fig.data:
        return message_figure(title, f"no {metric.upper()} reported by any arm")
    # ticks at the levels run: a log axis of one level spread ticks 0.125 to 8
    levels = sorted({x for trace in fig.data for x in trace.x})
    fig.update_xaxes(title_text="concurrent streams", type="log", tickvals=levels,
                     ticktext=[str(x) for x in levels])
    fig.update_yaxes(tickformat="~s", ticksuffix="s")
    return fig


def verdict_colour(decision: str) -> str:
    """The banner colour of a verdict decision (``keep``, ``roll back (...)``, ``inconclusive``)."""
    for key, colour in VERDICT_COLOURS.items():
        if decision.startswith(key):
            return colour
    return "#555"


def all_figures(data: dict | None) -> tuple[go.Figure, go.Figure, go.Figure, go.Figure]:
    """(TTFT, ITL, hit quality, transfer cost) for one comparison (None: placeholders)."""
    return latency(data, "ttft"), latency(data, "itl"), hit_quality(data), transfer_cost(data)
