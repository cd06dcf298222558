"""The Overview page: hit quality, tier residency, transfer throughput and host RAM.

:func:`layout` builds the components, :func:`register_callbacks` binds the refresh and pause
callbacks to one app. :func:`refresh` does the page's only I/O (one agent read) and hands
the samples to the pure :func:`render`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import dash
import plotly.graph_objects as go
from dash import Input, Output, dcc, html

from kvscope.dashboard import figures
from kvscope.dashboard.backend import AgentBackend, BackendUnavailable

# Graph id -> (figure builder, title); the ids are stable (tests and docs refer to them).
GRAPHS = {
    "hit-quality": (figures.hit_quality, figures.HIT_QUALITY_TITLE),
    "tier-residency": (figures.tier_residency, figures.TIER_RESIDENCY_TITLE),
    "transfer-throughput": (figures.transfer_throughput, figures.TRANSFER_THROUGHPUT_TITLE),
    "host-memory": (figures.host_memory, figures.HOST_MEMORY_TITLE),
}


def layout(refresh_seconds: float) -> html.Div:
    """The page: header with status line and pause button, then the four graphs in a grid.

    ``refresh_seconds``: seconds between refreshes (the ``refresh`` interval).
    """
    graphs = [
        dcc.Graph(id=gid, figure=build([]), config={"displaylogo": False},
                  style={"minWidth": 0})
        for gid, (build, _title) in GRAPHS.items()
    ]
    return html.Div([
        html.Div([
            html.H2("kvscope · Overview", style={"margin": "0 16px 0 0"}),
            html.Button("Pause", id="pause", n_clicks=0,
                        style={"marginRight": "16px", "padding": "4px 14px"}),
            html.Span("connecting…", id="status", style={"color": "#555"}),
        ], style={"display": "flex", "alignItems": "center", "padding": "12px 16px",
                  "borderBottom": "1px solid #ddd"}),
        dcc.Interval(id="refresh", interval=int(refresh_seconds * 1000), n_intervals=0),
        html.Div(graphs, style={"display": "grid", "gap": "8px", "padding": "8px",
                                "gridTemplateColumns": "repeat(auto-fit, minmax(520px, 1fr))"}),
    ], style={"fontFamily": "system-ui, sans-serif"})


def register_callbacks(app: dash.Dash, backend: AgentBackend, window_seconds: float) -> None:
    """Bind this page's callbacks to ``app`` (not to Dash's global list, so several apps
    can live in one process). ``window_seconds``: how much history the graphs show."""

    @app.callback(
        *[Output(gid, "figure") for gid in GRAPHS],
        Output("status", "children"),
        Input("refresh", "n_intervals"),
    )
    def _refresh(_n_intervals: int) -> tuple:
        return refresh(backend, window_seconds)

    @app.callback(
        Output("refresh", "disabled"),
        Output("pause", "children"),
        Input("pause", "n_clicks"),
    )
    def _pause(n_clicks: int) -> tuple[bool, str]:
        return pause_state(n_clicks)


def refresh(backend: AgentBackend, window_seconds: float) -> tuple:
    """Read the agent once and render; an unreachable agent gives placeholder figures and
    a status line saying so (never an exception into Dash)."""
    try:
        samples = backend.timeseries()
    except BackendUnavailable as exc:
        placeholders = [figures.unreachable_figure(title, exc.url)
                        for _build, title in GRAPHS.values()]
        return (*placeholders, f"agent unreachable: {exc.url} ({exc.reason})")
    return render(samples, backend.base_url, window_seconds)


def render(samples: Sequence[dict], url: str, window_seconds: float) -> tuple:
    """The four figures (in :data:`GRAPHS` order) and the status line, from samples.

    Only the last ``window_seconds`` of data (relative to the newest sample) are drawn.
    """
    recent = figures.last_window(samples, window_seconds)
    figs: list[go.Figure] = [build(recent) for build, _title in GRAPHS.values()]
    if not samples:
        status = f"agent {url}: no samples yet"
    else:
        last = datetime.fromtimestamp(float(samples[-1]["ts"]), tz=timezone.utc)
        status = f"agent {url} · {len(samples)} samples · last {last:%H:%M:%S} UTC"
    return (*figs, status)


def pause_state(n_clicks: int | None) -> tuple[bool, str]:
    """(interval disabled?, button label) after ``n_clicks`` clicks: odd counts pause."""
    paused = bool(n_clicks) and n_clicks % 2 == 1
    return paused, ("Resume" if paused else "Pause")
