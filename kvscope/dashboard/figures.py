"""Pure figure builders for the Overview page, and the house look shared by every page.

Plain samples in, plotly figures out; no I/O and no clock (house rule 9). The sample shape
and the transforms (rates, increases, percentiles) live in :mod:`kvscope.dashboard.series`.
Every axis names its unit; an empty input gives a readable message instead of a blank chart.
"""

from __future__ import annotations

import textwrap

from collections.abc import Callable, Sequence

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

from kvscope.analysis.transfer_cost import is_promotion
from kvscope.dashboard import series as S
from kvscope.dashboard.series import Sample, counter_rates, gauge_series, ordered
from kvscope.vocabulary import NOT_MEASURED, OFFLOAD_TIERS

TIME_AXIS_TITLE = "time (UTC)"
NO_DATA = "no data yet"
MESSAGE_WIDTH = 44  # characters a line: a Tiers panel is a third of a 1400-px page at 16 px
NO_TRANSFERS = "no transfers between tiers in this window (is an offload tier configured?)"

HIT_QUALITY_TITLE = "Hit quality: prompt tokens by source"
HIT_SHARE_TITLE = "Hit quality: share of prompt tokens by source"
# estimated from histogram buckets, as PromQL's histogram_quantile: they differ from the
# summary's exact percentiles (a bucket's observations spread over it)
TTFT_TITLE = "Time to first token (from histogram buckets)"
PROMOTION_LATENCY_TITLE = "Promotion latency by direction (from histogram buckets)"
TRANSFER_THROUGHPUT_TITLE = "Transfer throughput by direction"
TIER_RESIDENCY_TITLE = "Tier residency vs capacity and budget"
HOST_MEMORY_TITLE = "Host RAM: available, reserve and headroom"
EVICTIONS_TITLE = "Evictions, and the share evicted before any reuse"
SAVINGS_TITLE = "Prefill seconds saved vs transfer seconds spent"

# Fixed colours so a source, tier or direction keeps its colour across refreshes.
COLOURS: dict[str, str] = {
    "gpu": "#2ca02c", "cpu": "#1f77b4", "disk": "#ff7f0e", "remote": "#9467bd",
    "recompute": "#d62728",
    "gpu->cpu": "#1f77b4", "cpu->gpu": "#2ca02c", "cpu->disk": "#ff7f0e",
    "disk->cpu": "#9467bd", "disk->gpu": "#8c564b",
}
_AXIS_TITLES = {"B": "bytes (B)", "B/s": "bytes/s (B/s)", "s": "seconds (s)",
                "tokens/s": "tokens/s", "share": "share of prompt tokens (%)",
                "blocks/s": "blocks/s", "blocks": "blocks"}
_DASH = {"p50": None, "p95": "dash", "p99": "dot"}
# plotly_white's look for the figure kinds drawn here (2-D axes, no colour scales or 3-D/geo
# defaults): a full template is deep-copied and validated for every figure, ~6x the cost.
TEMPLATE = {"layout": {k: v for k, v in pio.templates["plotly_white"].layout.to_plotly_json()
                       .items() if k in ("autotypenumbers", "colorway", "font", "hovermode",
                                         "hoverlabel", "paper_bgcolor", "plot_bgcolor",
                                         "xaxis", "yaxis", "title", "annotationdefaults")}}


def new_figure(data=None) -> go.Figure:
    """An empty figure with the house template, set at construction (setting a template later
    through ``update_layout`` walks plotly's property tree and costs ~100x more)."""
    return go.Figure(data=data, layout={"template": TEMPLATE})


def base(title: str, unit: str, height: int = 320) -> go.Figure:
    """An empty figure with the house look and a date x axis. ``unit``: one of "tokens/s",
    "B", "B/s", "s", "share", "blocks", "blocks/s" (bytes and seconds get SI ticks with the unit as
    suffix, e.g. "20MB", "5ms"; shares show as percent)."""
    yaxis = {"title": {"text": _AXIS_TITLES.get(unit, unit)}, "rangemode": "tozero",
             "tickformat": "~s"}
    if unit in ("B", "B/s", "s"):
        yaxis["ticksuffix"] = unit
    if unit == "share":
        yaxis.update(tickformat=".0%", range=[0, 1])
    return go.Figure(layout={
        "title": {"text": title, "x": 0.01, "font": {"size": 15}},
        "template": TEMPLATE,
        "height": height,
        "margin": {"l": 70, "r": 10, "t": 50, "b": 45},
        "legend": {"x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"},
        "hovermode": "x unified",
        "uirevision": title,  # keep the user's zoom across refreshes
        "xaxis": {"title": {"text": TIME_AXIS_TITLE}, "type": "date"},
        "yaxis": yaxis,
    })


def message_figure(title: str, message: str, height: int = 320) -> go.Figure:
    """A chart-sized figure with no axes that shows ``message`` in its middle, in lines of at
    most :data:`MESSAGE_WIDTH` characters (joined by ``<br>``): Plotly does not wrap text, and
    a long message ran past a narrow chart's edges, cut off."""
    message = "<br>".join(textwrap.wrap(message, MESSAGE_WIDTH, break_long_words=False,
                                        break_on_hyphens=False)) or message
    return go.Figure(layout={
        "title": {"text": title, "x": 0.01, "font": {"size": 15}}, "template": TEMPLATE,
        "height": height, "margin": {"l": 70, "r": 10, "t": 50, "b": 45},
        "xaxis": {"visible": False}, "yaxis": {"visible": False},
        "annotations": [{"text": message, "x": 0.5, "y": 0.5, "xref": "paper", "yref": "paper",
                         "showarrow": False, "font": {"size": 16, "color": "#666"}}]})


def unreachable_figure(title: str, url: str, what: str = "agent") -> go.Figure:
    """The figure shown in place of a chart while the backend at ``url`` cannot be read."""
    return message_figure(title, f"{what} unreachable: {url}")


def line(fig: go.Figure, xs, ys, name: str, unit: str, colour: str | None = None,
         dash: str | None = None, **kw) -> None:
    """Add one line (markers too while it has a single point, which draws no line)."""
    fig.add_trace(go.Scatter(
        x=xs, y=ys, name=name, mode="lines" if len(xs) > 1 else "lines+markers",
        line={"color": colour, "dash": dash},
        hovertemplate="%{y:.4s}" + unit + "<extra>" + name + "</extra>", **kw))


def hit_quality(samples: Sequence[Sample]) -> go.Figure:
    """Prompt tokens per second by source (gpu, cpu, disk, recompute), stacked.

    One point per pair of consecutive samples, at the later sample's time; y in tokens/s.
    Fewer than two samples gives the "no data yet" figure.
    """
    rates = counter_rates(samples, "prompt_tokens")
    if not rates:
        return message_figure(HIT_QUALITY_TITLE, NO_DATA)
    fig = base(HIT_QUALITY_TITLE, "tokens/s")
    for key, (xs, ys) in rates.items():
        line(fig, xs, ys, key, " tokens/s", COLOURS.get(key), stackgroup="tokens")
    return fig


def hit_share(samples: Sequence[Sample]) -> go.Figure:
    """The share (0-1, shown as %) of prompt tokens per source over each point's rate window
    (S.counter_rates), stacked to 1; a window without prompt tokens is a gap, and each point
    a marker too (sparse traffic leaves points between gaps, which lines alone do not draw)."""
    rates = counter_rates(samples, "prompt_tokens")
    if not rates:
        return message_figure(HIT_SHARE_TITLE, NO_DATA)
    total = np.sum([ys for _xs, ys in rates.values()], axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = {k: (xs, np.where(total > 0, ys / total, np.nan)) for k, (xs, ys) in rates.items()}
    fig = base(HIT_SHARE_TITLE, "share")
    for key, (xs, ys) in shares.items():
        fig.add_trace(go.Scatter(x=xs, y=ys, name=key, mode="lines+markers",
                                 stackgroup="share", marker={"size": 4},
                                 line={"color": COLOURS.get(key)},
                                 hovertemplate="%{y:.1%}<extra>" + key + "</extra>"))
    return fig


def ttft(samples: Sequence[Sample]) -> go.Figure:
    """TTFT p50/p95/p99 (seconds) over time; each point covers the agent's quantile window."""
    qs = S.quantile_series(samples, "ttft_seconds")
    if not qs:
        return message_figure(TTFT_TITLE, "no finished requests yet")
    fig = base(TTFT_TITLE, "s")
    for p, (xs, ys) in qs.items():
        line(fig, xs, ys, f"TTFT {p}", "s", "#444", _DASH[p])
    return fig


def promotion_latency(samples: Sequence[Sample]) -> go.Figure:
    """Duration of promotions (copies toward the GPU) p50/p95/p99 per direction, seconds:
    colour by direction, dash by percentile."""
    directions = [d for d in S.keys_of(samples, "transfer_seconds") if is_promotion(d)]
    fig = base(PROMOTION_LATENCY_TITLE, "s")
    for direction in directions:
        for p, (xs, ys) in S.quantile_series(samples, "transfer_seconds", direction).items():
            line(fig, xs, ys, f"{direction} {p}", "s", COLOURS.get(direction), _DASH[p],
                 legendgroup=direction)
    if not fig.data:
        moved = any(n > 0 and is_promotion(d) for field in ("transfer_bytes", "transfer_blocks")
                    for d, n in S.window_increase(samples, field).items())
        return message_figure(PROMOTION_LATENCY_TITLE, "promotions happened, but their "
                              "durations are not measured by this source" if moved
                              else "no promotions yet")
    return fig


def _no_transfers(samples: Sequence[Sample], missing: str) -> str:
    """What a transfer chart without its figures says: no data yet (fewer than two samples),
    the copies' ``missing`` not measured (blocks were copied: KV events without a block size,
    vLLM's untimed counters), or no transfer in the window (no offload tier?)."""
    if len(samples) < 2:
        return NO_DATA
    if any(n > 0 for n in S.window_increase(samples, "transfer_blocks").values()):
        return f"blocks were copied, but their {missing} are not measured by this source"
    return NO_TRANSFERS


def transfer_throughput(samples: Sequence[Sample]) -> go.Figure:
    """Bytes per second copied between tiers, one line per direction ("src->dst"), against
    the PCIe link's one-direction maximum (dashed) when a GPU reports it; y in B/s."""
    rates = counter_rates(samples, "transfer_bytes")
    if not rates:
        return message_figure(TRANSFER_THROUGHPUT_TITLE, _no_transfers(samples, "sizes"))
    fig = base(TRANSFER_THROUGHPUT_TITLE, "B/s")
    for key, (xs, ys) in rates.items():
        line(fig, xs, ys, key, "B/s", COLOURS.get(key))
    link = gauge_series(samples, "pcie_link_max_bytes_per_second")
    if link:
        # one line at the fastest GPU link: what one GPU's copies can reach at most
        xs = next(iter(rates.values()))[0]
        peak = max(float(ys.max()) for _xs, ys in link.values())
        line(fig, [xs[0], xs[-1]], [peak, peak], "PCIe link max (one GPU)", "B/s", "#000", "dash")
    return fig


def tier_residency(samples: Sequence[Sample]) -> go.Figure:
    """Bytes resident per tier (solid) against its capacity (dashed) and the operator's budget
    (dotted), one colour per tier; y in bytes. Where no tier's bytes are known (its source
    lacks the block size), blocks, resident against capacity; a tier known in blocks alone
    beside others in bytes is named in the title, its bytes not measured."""
    resident = gauge_series(samples, "tier_resident_bytes")
    capacity = gauge_series(samples, "tier_capacity_bytes")
    budget = gauge_series(samples, "offload_budget_bytes")
    blocks = gauge_series(samples, "tier_resident_blocks")
    if not resident and not capacity:
        if not blocks:
            return message_figure(TIER_RESIDENCY_TITLE, NO_DATA)
        # a budget is bytes: drawn on the memory budgets, not on an axis of blocks
        fig = base("Tier residency vs capacity (blocks: their size not measured)", "blocks")
        capacity = gauge_series(samples, "tier_capacity_blocks")
        for tier in ordered(set(blocks) | set(capacity)):
            for what, data, dash in (("resident", blocks, None), ("capacity", capacity, "dash")):
                if tier in data:
                    line(fig, *data[tier], f"{tier} {what}", " blocks", COLOURS.get(tier), dash,
                         legendgroup=tier)
        return fig
    unsized = [t for t in ordered(blocks) if t not in resident]
    fig = base(TIER_RESIDENCY_TITLE + (f" ({', '.join(unsized)}: bytes {NOT_MEASURED})"
                                       if unsized else ""), "B")
    for tier in ordered(set(resident) | set(capacity) | set(budget)):
        for what, data, dash in (("resident", resident, None), ("capacity", capacity, "dash"),
                                 ("budget", budget, "dot")):
            if tier in data:
                xs, ys = data[tier]
                line(fig, xs, ys, f"{tier} {what}", "B", COLOURS.get(tier), dash,
                     legendgroup=tier)
    return fig


def host_memory(samples: Sequence[Sample]) -> go.Figure:
    """Host RAM available, the operator's reserve (dashed) and the headroom left beyond it
    (available minus reserve; below 0 the reserve is being eaten into); bytes."""
    drawn = [(name, S.scalar_series(samples, field), colour, dash)
             for name, field, colour, dash in (
                 ("available", "host_memory_available_bytes", "#7f7f7f", None),
                 ("reserve", "host_memory_reserve_bytes", "#d62728", "dash"),
                 ("headroom", "host_memory_headroom_bytes", "#2ca02c", None))]
    if not len(drawn[0][1][0]):
        return message_figure(HOST_MEMORY_TITLE, NO_DATA)
    fig = base(HOST_MEMORY_TITLE, "B")
    for name, (xs, ys), colour, dash in drawn:
        if len(xs):
            line(fig, xs, ys, name, "B", colour, dash)
    fig.update_yaxes(rangemode="normal")  # headroom may go negative
    return fig


def evictions(samples: Sequence[Sample]) -> go.Figure:
    """Blocks evicted per second by tier (left axis) and, per tier, the share of them that
    were never hit while resident (right axis, 0-1 shown as %, dotted); "not measured" when
    no source reports evictions."""
    window = S.rate_window(samples, "evicted_blocks")  # the share's parts over one window
    rates = counter_rates(samples, "evicted_blocks", window)
    if not rates:  # two samples and no count: the sources report none (vLLM's /metrics)
        return message_figure(EVICTIONS_TITLE, NO_DATA if len(samples) < 2 else
                              f"{NOT_MEASURED}: no source reports evictions")
    fig = base(EVICTIONS_TITLE, "blocks/s")
    for tier, (xs, ys) in rates.items():
        line(fig, xs, ys, f"{tier} evicted", " blocks/s", COLOURS.get(tier), legendgroup=tier)
    unused, observed = (_hits_rates(samples, window, part) for part in (_first, sum))
    for tier, (xs, ys) in unused.items():
        total = observed.get(tier)
        if total is None or len(total[1]) != len(ys):
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(total[1] > 0, ys / total[1], np.nan)
        fig.add_trace(go.Scatter(x=xs, y=share, name=f"{tier} never reused", yaxis="y2",
                                 mode="lines", legendgroup=tier,
                                 line={"color": COLOURS.get(tier), "dash": "dot"},
                                 hovertemplate="%{y:.1%}<extra>%{fullData.name}</extra>"))
    fig.update_layout(yaxis2={"title": {"text": "evicted before any reuse (%)"},
                              "overlaying": "y", "side": "right", "range": [0, 1],
                              "tickformat": ".0%", "dtick": 0.25, "showgrid": False})
    fig.update_layout(margin={"r": 60, "b": 40}, height=370, legend={
        "orientation": "h", "x": 0, "xanchor": "left", "y": -0.3, "yanchor": "top"})
    return fig


def _first(counts: Sequence[float]) -> float:
    return counts[0]


def _hits_rates(samples: Sequence[Sample], window: float,
                part: Callable[[Sequence[float]], float]) -> dict[str, S.Series]:
    """Per tier, blocks/s (over ``window`` seconds) of ``part`` of the evicted blocks' hits
    histogram: its first bucket (le=0: evicted with 0 hits) or all of it (``sum``). The share
    never reused is one over the other, of the same histogram, as the recording rule's: over
    the evictions counter it read half where a sampled tap put half the evictions into the
    histogram (a review)."""
    counts = [{"ts": s["ts"], "n": {t: part(c) for t, c in
                                    S.mapping(s, "evicted_block_hits").items() if c}}
              for s in samples]
    return counter_rates(counts, "n", window)


def savings(samples: Sequence[Sample]) -> go.Figure:
    """Since the window's start: estimated prefill seconds saved by the offload tiers' hits
    (not the GPU prefix cache's, which no transfer pays for: counted in, a tier that did not
    pay read as paying beside the card that said it did not) against the seconds transfers
    took, promotions and offloads apart; y in seconds."""
    saved = {source: series for source, series
             in S.cumulative_increase(samples, "prefill_seconds_saved").items()
             if source in OFFLOAD_TIERS}
    spent = S.cumulative_increase(samples, "transfer_seconds_sum")
    if not saved and not spent:
        return message_figure(SAVINGS_TITLE, _no_transfers(samples, "times"))
    fig = base(SAVINGS_TITLE, "s")
    if saved:
        xs = next(iter(saved.values()))[0]
        line(fig, xs, np.sum([ys for _x, ys in saved.values()], axis=0),
             "prefill saved by offload (est.)", "s", "#2ca02c")
    for name, pick, colour in (("promotion time", True, "#d62728"),
                               ("offload time", False, "#ff7f0e")):
        parts = [ys for d, (_x, ys) in spent.items() if is_promotion(d) == pick]
        if parts:
            xs = next(iter(spent.values()))[0]
            line(fig, xs, np.sum(parts, axis=0), name, "s", colour)
    return fig
