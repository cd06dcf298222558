"""Pure figure builders for the Sizing page, from
:func:`kvscope.analysis.report.sizing_figure_data` (plain dicts and lists; sizes in GiB,
ratios and shares 0-1, seconds)."""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from kvscope.dashboard.figures import message_figure, new_figure

# a miss-ratio curve: one cache of each size, which an inclusive CPU tier's hits and the GPU's
# add up to from the GPU cache's size on (a tryout read its 0% at 0 GiB against "GPU prefix
# cache alone: 37%" under it); on two lines: Plotly does not wrap, and one line ran past the
# chart's edge, cut off
CURVES_TITLE = ("Hit ratio of one cache of each size<br><sup>from the GPU cache's size on: the "
                "GPU and an inclusive CPU tier together</sup>")
COST_TITLE = "Prefill seconds saved vs transfer seconds, against CPU tier size"
_CURVES = (("lru", "LRU, block accesses", "#1f77b4", None),
           ("lru_tokens", "LRU, prompt tokens", "#2ca02c", None),
           ("arc", "ARC, block accesses", "#ff7f0e", "dot"))


def _layout(fig: go.Figure, title: str, y_title: str) -> None:
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 15}},
                      height=380, hovermode="x unified",
                      margin={"l": 70, "r": 10, "t": 64, "b": 45},
                      legend={"x": 1.02, "xanchor": "left", "y": 1}, uirevision=title)
    fig.update_xaxes(title_text="CPU tier size (GiB)", rangemode="tozero")
    fig.update_yaxes(title_text=y_title, rangemode="tozero")


def gib_text(gib: float) -> str:
    """A size in GiB for the page: two decimals from 1 GiB (the vLLM flag is rounded up to
    0.1 GiB, so the size must show finer than that at any scale), 3 digits below."""
    return f"{gib:,.2f}" if gib >= 1 else f"{gib:.3g}"


def _mark(fig: go.Figure, data: Mapping, right_end: float) -> None:
    """The knee, the recommended size and the GPU cache's size as vertical lines on ``fig``,
    whose x axis ends at ``right_end`` GiB."""
    for name, colour in (("knee", "#7f7f7f"), ("recommended", "#d62728")):
        point = data.get(name)
        if point:
            fig.add_vline(x=point["gib"], line={"color": colour, "dash": "dash", "width": 1},
                          annotation_text=f"{name} {gib_text(point['gib'])} GiB",
                          annotation_position="bottom right" if name == "knee" else "top right")
    if data.get("gpu_cache_gib"):
        gpu = data["gpu_cache_gib"]
        # its label on the side with room (left of a line near the y axis it was cut off),
        # above the knee's when both sit right of their lines
        left = gpu > right_end / 2
        fig.add_vline(x=gpu, line={"color": "#9467bd", "dash": "dot", "width": 1},
                      annotation_text=f"GPU cache {gib_text(gpu)} GiB",
                      annotation_position="bottom left" if left else "bottom right",
                      annotation={"yshift": 0 if left else 16})


def sizing_curves(data: Mapping) -> go.Figure:
    """Hit ratio (0-1, as %) of an LRU tier by block accesses and by prompt tokens, and ARC,
    against CPU tier size in GiB; the knee and the recommended size marked."""
    fig = new_figure()
    for key, name, colour, dash in _CURVES:
        curve = data.get(key)
        if curve and curve.get("gib"):
            fig.add_trace(go.Scatter(
                x=curve["gib"], y=curve["hit_ratio"], name=name,
                mode="lines+markers" if key == "arc" else "lines",
                line={"color": colour, "dash": dash},
                hovertemplate="%{y:.1%}<extra>" + name + "</extra>"))
    if not fig.data:
        return message_figure(CURVES_TITLE, "the analysis has no curves")
    _layout(fig, CURVES_TITLE, "hit ratio (%)")
    fig.update_yaxes(tickformat=".0%")
    _mark(fig, data, max(max(t.x) for t in fig.data))
    return fig


def sizing_cost(data: Mapping) -> go.Figure:
    """At each CPU tier size: estimated prefill seconds saved and transfer seconds spent
    (left axis, seconds) and the CPU tier's share of prompt tokens (right axis, %)."""
    cpu = data.get("cpu") or {}
    gib = cpu.get("gib") or []
    if not gib:
        return message_figure(COST_TITLE, "the analysis has no sizing curve")
    fig = new_figure()
    for key, name, colour in (("prefill_seconds_saved", "prefill saved (est.)", "#2ca02c"),
                              ("transfer_seconds", "transfer time", "#d62728")):
        fig.add_trace(go.Scatter(x=gib, y=cpu.get(key, []), name=name, mode="lines",
                                 line={"color": colour},
                                 hovertemplate="%{y:,.4g} s<extra>" + name + "</extra>"))
    fig.add_trace(go.Scatter(x=gib, y=cpu.get("cpu_token_hit_share", []), yaxis="y2",
                             name="CPU tier token share", mode="lines",
                             line={"color": "#1f77b4", "dash": "dot"},
                             hovertemplate="%{y:.1%}<extra>CPU tier token share</extra>"))
    _layout(fig, COST_TITLE, "seconds (s)")
    fig.update_yaxes(ticksuffix="s", tickformat="~s")
    fig.update_layout(yaxis2={"title": {"text": "CPU tier share of prompt tokens (%)"},
                              "overlaying": "y", "side": "right", "tickformat": ".0%",
                              "rangemode": "tozero", "showgrid": False},
                      margin={"r": 70}, height=420, legend={"orientation": "h", "x": 0, "xanchor": "left", "y": -0.22, "yanchor": "top"})
    _mark(fig, data, max(gib))
    return fig
