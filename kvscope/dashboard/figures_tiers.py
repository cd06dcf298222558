"""Pure figure builders for the Tiers page: residency per tier, the block flow between tiers
(Sankey), and histograms of block age and hits at eviction. Samples in, figures out."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from kvscope.analysis.transfer_cost import is_promotion
from kvscope.catalog import EVICTED_HITS_BUCKETS, RESIDENCY_SECONDS_BUCKETS
from kvscope.dashboard import series as S
from kvscope.dashboard.figures import COLOURS, NO_DATA, base, line, message_figure, new_figure
from kvscope.vocabulary import LOCAL_TIERS, NOT_MEASURED

TIERS = LOCAL_TIERS  # the residency panels: gpu, cpu, disk (a remote tier's is not drawn)
BLOCK_FLOW_TITLE = "Block flow between tiers (blocks in the window)"
EVICTION_AGE_TITLE = "Block age at eviction"
EVICTION_HITS_TITLE = "Hits before eviction"


# vLLM's tap reports the tiers it adds, not the GPU's KV cache (a tryout read "no gpu tier
# configured" beside a GPU serving prefixes)
GPU_NOT_REPORTED = f"{NOT_MEASURED} (no source reports the GPU's KV cache)"


def residency_title(tier: str) -> str:
    return f"{tier} tier: residency"


def tier_residency(samples: Sequence[S.Sample], tier: str) -> go.Figure:
    """One tier's resident bytes (filled) against its capacity (dashed) and budget (dotted);
    its blocks instead where only they are known (a source without the block size). "No
    <tier> tier configured" when nothing shows the tier (the GPU's, which every engine has:
    not measured), "residency not measured" when it served tokens, moved blocks or has a
    budget but no source reports what it holds ("residency not measured" in the title beside
    a capacity), and "capacity not measured" in the title when its source reported what it
    holds but not its capacity (0, unknown)."""
    title = residency_title(tier)
    unit = "B"
    resident = S.gauge_series(samples, "tier_resident_bytes").get(tier)
    capacity = S.gauge_series(samples, "tier_capacity_bytes").get(tier)
    if not samples:
        return message_figure(title, NO_DATA, height=260)
    blocks = [S.gauge_series(samples, f"tier_{what}_blocks").get(tier)
              for what in ("resident", "capacity")]
    if resident is None and capacity is None and blocks != [None, None]:
        unit, (resident, capacity) = "blocks", blocks
        title += " (blocks: their size not measured)"
    known = capacity is not None and (capacity[1] > 0).any()
    if not known and resident is None:
        return message_figure(title, GPU_NOT_REPORTED if tier == "gpu" else
                              f"{NOT_MEASURED} (no source reports what the {tier} tier holds)"
                              if S.tier_shown(samples, tier) else f"no {tier} tier configured",
                              height=260)
    if resident is None:  # a capacity alone (vLLM's /metrics): what it holds, unsaid
        title += f" (residency {NOT_MEASURED})"
    fig = base(title if known else f"{title} (capacity {NOT_MEASURED})", unit, height=260)
    colour = COLOURS.get(tier)
    suffix = unit if unit == "B" else f" {unit}"  # "4kB", "144 blocks" in the hover
    if resident is not None:
        line(fig, *resident, "resident", suffix, colour, fill="tozeroy")
    if known:
        line(fig, *capacity, "capacity", suffix, colour, "dash")
    budget = S.gauge_series(samples, "offload_budget_bytes").get(tier)
    if budget is not None and unit == "B":
        line(fig, *budget, "budget", "B", "#d62728", "dot")
    return fig


def block_flow(samples: Sequence[S.Sample]) -> go.Figure:
    """A Sankey of blocks moved over the samples: offloads down (gpu -> cpu -> disk),
    promotions back up, and drops (evicted with no copy kept below) into "dropped".
    Link widths are blocks; "no block movement" when nothing moved, "not measured" when bytes
    were copied but no source counted their blocks (vLLM's /metrics without block_bytes)."""
    moved = {k: v for k, v in S.window_increase(samples, "transfer_blocks").items() if v > 0}
    dropped = {k: v for k, v in S.window_increase(samples, "dropped_blocks").items() if v > 0}
    if len(samples) < 2:
        return message_figure(BLOCK_FLOW_TITLE, NO_DATA, height=360)
    if not moved and not dropped:
        copied = any(n > 0 for n in S.window_increase(samples, "transfer_bytes").values())
        return message_figure(BLOCK_FLOW_TITLE, f"blocks copied: {NOT_MEASURED} (the sources "
                              "count the copies' bytes, not their blocks)" if copied
                              else "no block movement in this window", height=360)
    tiers = S.ordered({t for d in moved for t in d.split("->")} | set(dropped))
    nodes = tiers + ["dropped"]
    index = {n: i for i, n in enumerate(nodes)}
    src, dst, value, colour, label = [], [], [], [], []
    for direction, n in moved.items():
        a, _, b = direction.partition("->")
        src.append(index[a])
        dst.append(index[b])
        value.append(n)
        colour.append("rgba(44,160,44,0.45)" if is_promotion(direction)
                      else "rgba(31,119,180,0.45)")
        label.append(("promotion " if is_promotion(direction) else "offload ") + direction)
    for tier, n in dropped.items():
        src.append(index[tier])
        dst.append(index["dropped"])
        value.append(n)
        colour.append("rgba(214,39,40,0.45)")
        label.append(f"dropped from {tier}")
    fig = new_figure(go.Sankey(
        arrangement="snap",
        node={"label": nodes, "pad": 24, "thickness": 18,
              "color": [COLOURS.get(n, "#d62728") for n in nodes]},
        link={"source": src, "target": dst, "value": value, "color": colour, "label": label,
              "hovertemplate": "%{label}: %{value:,.0f} blocks<extra></extra>"},
        valueformat=",.0f", valuesuffix=" blocks",
    ))
    fig.update_layout(title={"text": BLOCK_FLOW_TITLE, "x": 0.01, "font": {"size": 15}},
                      height=360,
                      margin={"l": 20, "r": 20, "t": 50, "b": 20}, uirevision=BLOCK_FLOW_TITLE)
    return fig


def _age_label(bound: float) -> str:
    for unit, seconds in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if bound >= seconds:
            return f"≤{bound / seconds:g} {unit}"
    return f"≤{bound * 1000:g} ms"


AGE_LABELS = [_age_label(b) for b in RESIDENCY_SECONDS_BUCKETS] + [
    f">{_age_label(RESIDENCY_SECONDS_BUCKETS[-1])[1:]}"]


def _hits_labels(bounds=EVICTED_HITS_BUCKETS) -> list[str]:
    out, lower = [], None
    for b in bounds:
        lo = 0 if lower is None else int(lower) + 1
        out.append(f"{int(b)}" if lo >= b else f"{lo}-{int(b)}")
        lower = b
    return out + [f">{int(bounds[-1])}"]


HITS_LABELS = _hits_labels()


def _histogram(samples, field: str, labels: list[str], title: str, x_title: str,
               what: str) -> go.Figure:
    """Blocks evicted in the window per bucket of ``field``, by tier. Evictions counted
    without ``what`` they measure (vLLM's KV events carry no age or hits) are said to be so,
    not shown as "no evictions"."""
    counts = S.bucket_increase(samples, field)
    counts = {t: c for t, c in counts.items() if len(c) == len(labels) and c.sum() > 0}
    if not counts:
        evicted = {t: n for t, n in S.window_increase(samples, "evicted_blocks").items() if n > 0}
        if evicted:
            return message_figure(title, ", ".join(f"{t}: {n:,.0f}" for t, n in evicted.items())
                                  + f" blocks evicted, {what} not measured (the source "
                                  "reports evictions without it, e.g. vLLM's KV events)")
        return message_figure(title, "no evictions in this window" if samples else NO_DATA)
    fig = new_figure()
    for tier, c in counts.items():
        share = c / c.sum()
        fig.add_trace(go.Bar(x=labels, y=c, name=tier, marker_color=COLOURS.get(tier),
                             customdata=np.round(share * 100, 1),
                             hovertemplate="%{x}: %{y:,.0f} blocks (%{customdata}% of "
                                           + tier + ")<extra></extra>"))
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 15}},
                      height=320, barmode="group",
                      margin={"l": 70, "r": 10, "t": 50, "b": 45}, uirevision=title)
    fig.update_xaxes(title_text=x_title, type="category")
    fig.update_yaxes(title_text="blocks evicted", tickformat="~s", rangemode="tozero")
    return fig


def eviction_age(samples: Sequence[S.Sample]) -> go.Figure:
    """Blocks evicted in the window per age bucket (seconds resident), grouped by tier."""
    return _histogram(samples, "block_residency_seconds", AGE_LABELS, EVICTION_AGE_TITLE,
                      "age at eviction (time resident)", "their age")


def eviction_hits(samples: Sequence[S.Sample]) -> go.Figure:
    """Blocks evicted in the window per hits-while-resident bucket (0: never reused)."""
    return _histogram(samples, "evicted_block_hits", HITS_LABELS, EVICTION_HITS_TITLE,
                      "hits while resident (count)", "their hits")
