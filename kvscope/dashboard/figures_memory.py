"""The memory budget breakdown as a figure: the host's memory and each GPU's, in the parts that
add up to them (docs/collectors.md, "Memory budgets"), stacked bars against their total.

Pure: samples in, a plotly figure out (house rule 9); the newest sample is drawn. A whole
nobody measured (no host collector, no NVML) is named under the chart as not measured, never
drawn as 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from kvscope.dashboard.figures import NO_DATA, base, message_figure
from kvscope.dashboard.series import Sample, is_number
from kvscope.samples import KEY_SEPARATOR
from kvscope.vocabulary import GPU_MEMORY_PARTS, HOST_MEMORY_PARTS

MEMORY_BUDGET_TITLE = "Memory budgets: host and GPU memory by part (newest sample)"
HOST = "host"
NOT_MEASURED = "not measured"
# one colour per part; the budgets the operator acts on are the strong ones
PART_COLOURS: dict[str, str] = {
    "kv_offload": "#1f77b4", "kv_cache": "#2ca02c", "weights": "#9467bd",
    "workspace": "#ff7f0e", "engine_other": "#8c564b", "other": "#7f7f7f",
    "reserve": "#d62728", "free": "#dddddd",
}
# each part as the legend says it (docs/collectors.md, "Memory budgets")
PART_NAMES: dict[str, str] = {
    "kv_offload": "KV offload budget", "kv_cache": "KV cache", "weights": "model weights",
    "workspace": "activations and workspace", "engine_other": "engine's other memory",
    "other": "everything else", "reserve": "reserve", "free": "free",
}
PARTS: tuple[str, ...] = tuple(dict.fromkeys((*GPU_MEMORY_PARTS[:3], *HOST_MEMORY_PARTS[:2],
                                              "other", "reserve", "free")))


def wholes(sample: Sample) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """``(parts, totals)`` of one sample, each keyed by whole (``"host"``, ``"GPU 0"``, ...):
    dict[part, bytes] of each whole measured, and the total it adds up to (the host's memory
    limit, a GPU's NVML total; absent when not in the sample)."""
    parts: dict[str, dict[str, float]] = {}
    host = sample.get("host_memory_part_bytes") or {}
    if host:
        parts[HOST] = dict(host)
    for key, value in (sample.get("gpu_memory_part_bytes") or {}).items():
        gpu, _, part = key.rpartition(KEY_SEPARATOR)
        parts.setdefault(f"GPU {gpu}", {})[part] = value
    totals: dict[str, float] = {}
    limit = sample.get("host_memory_limit_bytes")
    if HOST in parts and is_number(limit):
        totals[HOST] = float(limit)
    for gpu, total in (sample.get("gpu_memory_total_bytes") or {}).items():
        if f"GPU {gpu}" in parts and is_number(total):
            totals[f"GPU {gpu}"] = float(total)
    return parts, totals


def memory_budget(samples: Sequence[Sample]) -> go.Figure:
    """Stacked bars, one per whole (the host, each GPU), of the newest sample's parts (bytes;
    each trace named in words, its ``legendgroup`` the part's id),
    each whole's total a black mark across its bar (a stack above it is overcommitted). Under
    the chart: the wholes not measured (no GPU without NVML) and each part left out where it
    was not measured."""
    if not samples:
        return message_figure(MEMORY_BUDGET_TITLE, NO_DATA)
    parts, totals = wholes(samples[-1])
    if not parts:
        return message_figure(MEMORY_BUDGET_TITLE, f"{NOT_MEASURED}: no host or GPU reading")
    names = list(parts)
    fig = base(MEMORY_BUDGET_TITLE, "B")
    for part in PARTS:
        ys = [parts[w].get(part) for w in names]
        if any(y is not None for y in ys):
            fig.add_trace(go.Bar(x=names, y=ys, name=PART_NAMES[part], legendgroup=part,
                                 marker_color=PART_COLOURS[part],
                                 hovertemplate="%{y:.4s}B<extra>" + PART_NAMES[part]
                                 + "</extra>"))
    marked = [w for w in names if w in totals]
    if marked:
        fig.add_trace(go.Scatter(x=marked, y=[totals[w] for w in marked], name="total",
                                 mode="markers", marker={"symbol": "line-ew-open", "size": 60,
                                                         "color": "#000",
                                                         "line": {"width": 3}},
                                 hovertemplate="%{y:.4s}B<extra>total</extra>"))
    fig.update_layout(barmode="stack", hovermode="closest",
                      xaxis={"type": "category", "title": {"text": "memory (newest sample)"}})
    notes = _unmeasured(parts)
    if notes:
        fig.add_annotation(text=notes, showarrow=False, xref="paper", yref="paper", x=0,
                           y=1.02, xanchor="left", yanchor="bottom", font={"size": 11})
    return fig


def _unmeasured(parts: Mapping[str, Mapping[str, float]]) -> str:
    """What the figure leaves out for want of a measurement, as a line of text."""
    out = []
    if HOST not in parts:
        out.append(f"host: {NOT_MEASURED}")
    elif "engine_other" not in parts[HOST]:
        out.append(f"engine memory: {NOT_MEASURED} (collectors.host engine_pid)")
    if not any(w.startswith("GPU ") for w in parts):
        out.append(f"GPU: {NOT_MEASURED} (no NVML)")
    return "; ".join(out)
