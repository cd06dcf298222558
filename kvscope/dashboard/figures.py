"""Pure figure builders for the dashboard: plain samples in, plotly figures out.

No I/O and no clock here (house rule 9): callers fetch samples from the agent
(:mod:`kvscope.dashboard.backend`) and pass them in.

A *sample* is one entry of the agent's ``GET /api/v1/timeseries`` answer, a dict:

- ``ts``: Unix seconds (float, wall clock);
- ``prompt_tokens``: dict[source, int], cumulative prompt tokens by source
  (``gpu``, ``cpu``, ``disk``, ``recompute``); a counter;
- ``transfer_bytes``: dict["src->dst", int], cumulative bytes copied by direction; a counter;
- ``tier_resident_bytes`` / ``tier_capacity_bytes``: dict[tier, int], bytes now (gauges);
- ``host_memory_available_bytes``: float, bytes now (a gauge).

Samples come oldest first. Any key may be missing (a tier or direction that never occurred
counts as 0 for counters and is simply not drawn for gauges). Counters are turned into
per-second rates between consecutive samples; a counter that went down was reset (the
agent restarted), and the increase across the reset is taken to be the new value, as
PromQL ``rate()`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone

import plotly.graph_objects as go

Sample = Mapping[str, object]

TIME_AXIS_TITLE = "time (UTC)"
NO_DATA = "no data yet"

HIT_QUALITY_TITLE = "Hit quality: prompt tokens by source"
TIER_RESIDENCY_TITLE = "Tier residency vs capacity"
TRANSFER_THROUGHPUT_TITLE = "Transfer throughput by direction"
HOST_MEMORY_TITLE = "Host RAM available"

# Fixed colours so a source, tier or direction keeps its colour across refreshes.
_COLOURS: dict[str, str] = {
    "gpu": "#2ca02c",
    "cpu": "#1f77b4",
    "disk": "#ff7f0e",
    "remote": "#9467bd",
    "recompute": "#d62728",
    "gpu->cpu": "#1f77b4",
    "cpu->gpu": "#2ca02c",
    "cpu->disk": "#ff7f0e",
    "disk->cpu": "#9467bd",
}
_AXIS_TITLES = {"B": "bytes (B)", "B/s": "bytes/s (B/s)"}
_ORDER = ("gpu", "cpu", "disk", "remote", "recompute",
          "gpu->cpu", "cpu->gpu", "cpu->disk", "disk->cpu")


def hit_quality(samples: Sequence[Sample]) -> go.Figure:
    """Prompt tokens per second by source (gpu, cpu, disk, recompute), stacked.

    One point per pair of consecutive samples, at the later sample's time; y in tokens/s.
    Fewer than two samples gives the "no data yet" figure.
    """
    title = HIT_QUALITY_TITLE
    rates = counter_rates(samples, "prompt_tokens")
    if not rates:
        return message_figure(title, NO_DATA)
    fig = _base(title, "tokens/s")
    for key, (xs, ys) in rates.items():
        fig.add_trace(go.Scatter(
            x=xs, y=ys, name=key, mode=_mode(xs), stackgroup="tokens",
            line={"color": _COLOURS.get(key)},
            hovertemplate="%{y:.4s} tokens/s<extra>" + key + "</extra>",
        ))
    return fig


def tier_residency(samples: Sequence[Sample]) -> go.Figure:
    """Bytes resident per tier (solid line) against the tier's capacity (dashed, same colour).

    y in bytes (SI ticks). No sample with residency or capacity gives "no data yet".
    """
    title = TIER_RESIDENCY_TITLE
    resident = gauge_series(samples, "tier_resident_bytes")
    capacity = gauge_series(samples, "tier_capacity_bytes")
    if not resident and not capacity:
        return message_figure(title, NO_DATA)
    fig = _base(title, "B")
    for tier in _ordered(set(resident) | set(capacity)):
        colour = _COLOURS.get(tier)
        if tier in resident:
            xs, ys = resident[tier]
            fig.add_trace(go.Scatter(
                x=xs, y=ys, name=f"{tier} resident", mode=_mode(xs), legendgroup=tier,
                line={"color": colour}, hovertemplate="%{y:.4s}B<extra>%{fullData.name}</extra>",
            ))
        if tier in capacity:
            xs, ys = capacity[tier]
            fig.add_trace(go.Scatter(
                x=xs, y=ys, name=f"{tier} capacity", mode=_mode(xs), legendgroup=tier,
                line={"color": colour, "dash": "dash"},
                hovertemplate="%{y:.4s}B<extra>%{fullData.name}</extra>",
            ))
    return fig


def transfer_throughput(samples: Sequence[Sample]) -> go.Figure:
    """Bytes per second copied between tiers, one line per direction ("src->dst").

    One point per pair of consecutive samples, at the later sample's time; y in B/s.
    """
    title = TRANSFER_THROUGHPUT_TITLE
    rates = counter_rates(samples, "transfer_bytes")
    if not rates:
        return message_figure(title, NO_DATA)
    fig = _base(title, "B/s")
    for key, (xs, ys) in rates.items():
        fig.add_trace(go.Scatter(
            x=xs, y=ys, name=key, mode=_mode(xs), line={"color": _COLOURS.get(key)},
            hovertemplate="%{y:.4s}B/s<extra>" + key + "</extra>",
        ))
    return fig


def host_memory(samples: Sequence[Sample]) -> go.Figure:
    """Host RAM available (bytes, SI ticks) over time; samples without the value are skipped."""
    title = HOST_MEMORY_TITLE
    xs, ys = [], []
    for sample in samples:
        value = sample.get("host_memory_available_bytes")
        if isinstance(value, (int, float)):
            xs.append(_time(sample))
            ys.append(float(value))
    if not xs:
        return message_figure(title, NO_DATA)
    fig = _base(title, "B")
    fig.add_trace(go.Scatter(
        x=xs, y=ys, name="available", mode=_mode(xs), line={"color": "#7f7f7f"},
        hovertemplate="%{y:.4s}B<extra>available</extra>",
    ))
    fig.update_layout(showlegend=False)
    return fig


def unreachable_figure(title: str, url: str) -> go.Figure:
    """The figure shown in place of a chart while the agent at ``url`` cannot be read."""
    return message_figure(title, f"agent unreachable: {url}")


def message_figure(title: str, message: str) -> go.Figure:
    """A chart-sized figure with no axes that shows ``message`` in its middle."""
    fig = _base(title, "")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper",
                       showarrow=False, font={"size": 16, "color": "#666"})
    return fig


def last_window(samples: Sequence[Sample], seconds: float) -> list[Sample]:
    """The samples no older than ``seconds`` before the newest one (relative to the data,
    not the wall clock, so replays of old data still show)."""
    if not samples:
        return []
    newest = float(samples[-1]["ts"])
    return [s for s in samples if float(s["ts"]) >= newest - seconds]


def counter_rates(samples: Sequence[Sample], field: str
                  ) -> dict[str, tuple[list[datetime], list[float]]]:
    """Per-second rates of the cumulative counters ``sample[field][key]``.

    Returns dict[key, (times, rates)], keys in canonical order; one point per pair of
    consecutive samples whose timestamps increase. A missing key counts as 0. A value
    lower than the previous one is a reset: the increase is the new value itself
    (PromQL ``rate()``'s reset handling). Rates are in the counter's unit per second.
    """
    keys = _ordered({k for s in samples for k in _dict(s, field)})
    out: dict[str, tuple[list[datetime], list[float]]] = {k: ([], []) for k in keys}
    for prev, cur in zip(samples, samples[1:]):
        dt = float(cur["ts"]) - float(prev["ts"])
        if dt <= 0:
            continue
        before, after = _dict(prev, field), _dict(cur, field)
        for key in keys:
            old, new = float(before.get(key, 0)), float(after.get(key, 0))
            increase = new - old if new >= old else new
            out[key][0].append(_time(cur))
            out[key][1].append(increase / dt)
    return {k: v for k, v in out.items() if v[0]}


def gauge_series(samples: Sequence[Sample], field: str
                 ) -> dict[str, tuple[list[datetime], list[float]]]:
    """The gauges ``sample[field][key]`` as dict[key, (times, values)], canonical key order.

    A sample without a key contributes no point to that key's series.
    """
    out: dict[str, tuple[list[datetime], list[float]]] = {}
    for sample in samples:
        for key, value in _dict(sample, field).items():
            xs, ys = out.setdefault(key, ([], []))
            xs.append(_time(sample))
            ys.append(float(value))
    return {k: out[k] for k in _ordered(out)}


def _base(title: str, unit: str) -> go.Figure:
    """An empty figure with the house look. ``unit``: "tokens/s", "B" or "B/s" (byte units
    get SI ticks with the unit as suffix, e.g. "20MB")."""
    fig = go.Figure()
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}},
        template="plotly_white",
        height=320,
        margin={"l": 70, "r": 10, "t": 50, "b": 45},
        legend={"x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"},
        hovermode="x unified",
        uirevision=title,  # keep the user's zoom across refreshes
    )
    fig.update_xaxes(title_text=TIME_AXIS_TITLE, type="date")
    fig.update_yaxes(title_text=_AXIS_TITLES.get(unit, unit), rangemode="tozero", tickformat="~s")
    if unit in ("B", "B/s"):
        fig.update_yaxes(ticksuffix=unit)
    return fig


def _mode(xs: Sequence[object]) -> str:
    """Lines, plus markers while a series has a single point (a lone point draws no line)."""
    return "lines" if len(xs) > 1 else "lines+markers"


def _dict(sample: Sample, field: str) -> Mapping[str, float]:
    value = sample.get(field)
    return value if isinstance(value, Mapping) else {}


def _time(sample: Sample) -> datetime:
    """The sample's timestamp as a naive UTC datetime (plotly draws it as given)."""
    return datetime.fromtimestamp(float(sample["ts"]), tz=timezone.utc).replace(tzinfo=None)


def _ordered(keys: Iterable[str]) -> list[str]:
    """Known keys in :data:`_ORDER`, then any others alphabetically."""
    keys = set(keys)
    return [k for k in _ORDER if k in keys] + sorted(keys - set(_ORDER))
