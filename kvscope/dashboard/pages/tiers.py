"""The Tiers page: per tier, residency over time against capacity and budget; the block flow
gpu -> cpu -> disk -> dropped with promotions back (a Sankey); histograms of block age and
hits at eviction. All over the dashboard's window."""

from __future__ import annotations

from collections.abc import Sequence

import dash
from dash import Input, Output, html

from kvscope.dashboard import figures
from kvscope.dashboard import figures_tiers as ft
from kvscope.dashboard.backend import Backend, BackendUnavailable
from kvscope.dashboard.pages.common import (GRID_STYLE, Context, graph, samples_status, status,
                                            unreachable_status)
from kvscope.dashboard.series import last_window, thin

PATH = "/tiers"
NAME = "Tiers"
STATUS_ID = "tiers-status"
RESIDENCY_IDS = {tier: f"tier-{tier}" for tier in ft.TIERS}
GRAPHS = {
    **{gid: (lambda s, t=tier: ft.tier_residency(s, t), ft.residency_title(tier))
       for tier, gid in RESIDENCY_IDS.items()},
    "block-flow": (ft.block_flow, ft.BLOCK_FLOW_TITLE),
    "eviction-age": (ft.eviction_age, ft.EVICTION_AGE_TITLE),
    "eviction-hits": (ft.eviction_hits, ft.EVICTION_HITS_TITLE),
}


def layout() -> html.Div:
    loading = {gid: graph(gid, figures.message_figure(title, "loading…"))
               for gid, (_b, title) in GRAPHS.items()}
    return html.Div([
        status(STATUS_ID),
        html.Div([loading[gid] for gid in RESIDENCY_IDS.values()],
                 style={**GRID_STYLE, "gridTemplateColumns": "repeat(auto-fit, minmax(420px, 1fr))"}),
        html.Div([loading["block-flow"]], style={"padding": "0 8px"}),
        html.Div([loading["eviction-age"], loading["eviction-hits"]], style=GRID_STYLE),
    ])


def register_callbacks(app: dash.Dash, ctx: Context) -> None:
    @app.callback(*[Output(gid, "figure") for gid in GRAPHS], Output(STATUS_ID, "children"),
                  Input("refresh", "n_intervals"), Input("instance", "value"))
    def _refresh(_n, instance):
        return refresh(ctx.backend, ctx.window_seconds, instance, ctx.max_points)


def refresh(backend: Backend, window_seconds: float, instance: str | None = None,
            max_points: int = 720) -> tuple:
    """Read the backend once and render (placeholders and a status line when unreachable)."""
    try:
        samples = backend.timeseries(window_seconds, instance)
    except BackendUnavailable as exc:
        return (*[figures.unreachable_figure(title, exc.url, exc.what)
                  for _b, title in GRAPHS.values()], unreachable_status(exc))
    return (*render(samples, window_seconds, max_points),
            samples_status(backend, instance, samples))


def render(samples: Sequence[dict], window_seconds: float, max_points: int = 720) -> list:
    """The figures in :data:`GRAPHS` order. Flow and histograms use every sample in the window
    (exact increases); the residency lines a thinned copy."""
    recent = last_window(samples, window_seconds)
    thinned = thin(recent, max_points)
    return [build(thinned if gid in RESIDENCY_IDS.values() else recent)
            for gid, (build, _t) in GRAPHS.items()]
