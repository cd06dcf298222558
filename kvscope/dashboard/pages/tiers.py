"""The Tiers page: per tier, residency over time against capacity and budget; the block flow
gpu -> cpu -> disk -> dropped with promotions back (a Sankey); histograms of block age and
hits at eviction; transfer throughput and promotion latency beside the topology they ran on
(each GPU's PCIe link and NUMA node, where the engine's memory lies: :mod:`topology_view`).
All over the dashboard's window."""

from __future__ import annotations

from collections.abc import Sequence

import dash
from dash import Input, Output, html

from kvscope.dashboard import figures
from kvscope.dashboard import figures_tiers as ft
from kvscope.dashboard import topology_view
from kvscope.dashboard.backend import Backend, BackendUnavailable
from kvscope.dashboard.pages.common import GRID_STYLE, Context, graph, samples_status, status
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
    # the Overview's transfer charts again, here beside the topology (their own ids: one
    # output per id across the app)
    "tiers-transfer-throughput": (figures.transfer_throughput, figures.TRANSFER_THROUGHPUT_TITLE),
    "tiers-promotion-latency": (figures.promotion_latency, figures.PROMOTION_LATENCY_TITLE),
}
TRANSFER_IDS = ("tiers-transfer-throughput", "tiers-promotion-latency")


def layout() -> html.Div:
    loading = {gid: graph(gid, figures.message_figure(title, "loading…"))
               for gid, (_b, title) in GRAPHS.items()}
    return html.Div([
        status(STATUS_ID),
        html.Div([loading[gid] for gid in RESIDENCY_IDS.values()],
                 style={**GRID_STYLE, "gridTemplateColumns": "repeat(auto-fit, minmax(420px, 1fr))"}),
        html.Div([loading["block-flow"]], style={"padding": "0 8px"}),
        html.Div([loading["eviction-age"], loading["eviction-hits"]], style=GRID_STYLE),
        html.Div([html.Div([loading[gid] for gid in TRANSFER_IDS],
                           style={**GRID_STYLE, "gridTemplateColumns": "1fr"}),
                  html.Div(topology_view.placeholder(), id=topology_view.SECTION_ID,
                           style=topology_view.PANEL_STYLE)],
                 style={"display": "grid", "gridTemplateColumns": "minmax(0, 3fr) minmax(320px, 1fr)",
                        "alignItems": "start"}),
    ])


def register_callbacks(app: dash.Dash, ctx: Context) -> None:
    @app.callback(*[Output(gid, "figure") for gid in GRAPHS],
                  Output(topology_view.SECTION_ID, "children"), Output(STATUS_ID, "children"),
                  Input("refresh", "n_intervals"), Input("instance", "value"))
    def _refresh(_n, instance):
        return refresh(ctx.backend, ctx.window_seconds, instance, ctx.max_points)


def refresh(backend: Backend, window_seconds: float, instance: str | None = None,
            max_points: int = 720) -> tuple:
    """Read the backend once and render: (*figures in :data:`GRAPHS` order, the topology
    panel, the status line); placeholders and a status line when unreachable. A backend whose
    node collectors cannot be read (an agent without ``/api/v1/node``) still draws the charts,
    its topology panel saying why."""
    try:
        samples = backend.timeseries(window_seconds, instance)
    except BackendUnavailable as exc:
        return (*[figures.unreachable_figure(title, exc.url, exc.what)
                  for _b, title in GRAPHS.values()],
                topology_view.placeholder(str(exc)), str(exc))
    try:
        topology = topology_view.section(backend.node(topology_view.METRICS, instance))
    except BackendUnavailable as exc:
        topology = topology_view.placeholder(f"{topology_view.NOT_MEASURED}: "
                                             f"{str(exc)}")
    return (*render(samples, window_seconds, max_points), topology,
            samples_status(backend, instance, samples))


def render(samples: Sequence[dict], window_seconds: float, max_points: int = 720) -> list:
    """The figures in :data:`GRAPHS` order. Flow and histograms use every sample in the window
    (exact increases); the residency and transfer lines a thinned copy."""
    recent = last_window(samples, window_seconds)
    thinned = thin(recent, max_points)
    lines = {*RESIDENCY_IDS.values(), *TRANSFER_IDS}
    return [build(thinned if gid in lines else recent)
            for gid, (build, _t) in GRAPHS.items()]
