"""The Overview page: does offload pay? First, "Should I offload here?": headline stat cards and
the guide's five "skip offload when" conditions judged from the same data
(:mod:`kvscope.dashboard.offload_verdict`), read before any chart because it is the question the
charts below answer in detail. Then hit quality (rate and share), TTFT and promotion
latency percentiles, transfer throughput against the PCIe link, tier residency against
capacity and budget, host RAM against the reserve, the memory budgets (host and GPU memory by
part, stacked against the total), evictions (and those never reused), and
prefill seconds saved against transfer seconds spent; and the load they were measured under,
which a baseline must record: concurrency and the context-length distribution (from the
request records).

:func:`refresh` does the page's only I/O (the samples and the latest request records) and hands
them to the pure :func:`render`.
"""

from __future__ import annotations

from collections.abc import Sequence

import dash
from dash import Input, Output, html

from kvscope.dashboard import (figures, figures_load, figures_memory, offload_verdict,
                               verdict_view)
from kvscope.dashboard.backend import Backend, BackendUnavailable
from kvscope.dashboard.misconfig import detect as detect_misconfig
from kvscope.dashboard.misconfig_view import SECTION_ID as MISCONFIG_ID
from kvscope.dashboard.misconfig_view import section as misconfig_section
from kvscope.dashboard.topology_view import METRICS as TOPOLOGY_METRICS, topologies
from kvscope.dashboard.pages.common import (GRID_STYLE, Context, graph, samples_status, status,
                                            unread_status)
from kvscope.dashboard.series import last_window, thin

PATH = "/"
NAME = "Overview"
STATUS_ID = "overview-status"

# Graph id -> (figure builder, title); the ids are stable (tests and docs refer to them).
GRAPHS = {
    "hit-quality": (figures.hit_quality, figures.HIT_QUALITY_TITLE),
    "hit-share": (figures.hit_share, figures.HIT_SHARE_TITLE),
    "ttft": (figures.ttft, figures.TTFT_TITLE),
    "promotion-latency": (figures.promotion_latency, figures.PROMOTION_LATENCY_TITLE),
    "transfer-throughput": (figures.transfer_throughput, figures.TRANSFER_THROUGHPUT_TITLE),
    "tier-residency": (figures.tier_residency, figures.TIER_RESIDENCY_TITLE),
    "host-memory": (figures.host_memory, figures.HOST_MEMORY_TITLE),
    "memory-budget": (figures_memory.memory_budget, figures_memory.MEMORY_BUDGET_TITLE),
    "evictions": (figures.evictions, figures.EVICTIONS_TITLE),
    "savings": (figures.savings, figures.SAVINGS_TITLE),
    "concurrency": (figures_load.concurrency, figures_load.CONCURRENCY_TITLE),
    "prompt-lengths": (figures_load.prompt_lengths, figures_load.PROMPT_LENGTHS_TITLE),
}
FROM_RECORDS = frozenset({"concurrency", "prompt-lengths"})  # drawn from request records
# the latest finished requests drawn: the Requests page's default, as every refresh reads them
# and the agent sorts its table and encodes each of them for it
RECORDS = 500


def layout() -> html.Div:
    """The status line, "Should I offload here?", then the graphs in a grid (drawn empty until
    the first refresh)."""
    return html.Div([
        status(STATUS_ID),
        html.Div(verdict_view.placeholder(), id=verdict_view.SECTION_ID,
                 style={"padding": "0 16px"}),
        html.Div([], id=MISCONFIG_ID, style={"padding": "0 16px"}),
        html.Div([graph(gid, figures.message_figure(title, "loading…"))
                  for gid, (_build, title) in GRAPHS.items()], style=GRID_STYLE),
    ])


def register_callbacks(app: dash.Dash, ctx: Context) -> None:
    """Bind this page's refresh to ``app`` (not Dash's global list)."""

    @app.callback(*[Output(gid, "figure") for gid in GRAPHS],
                  Output(verdict_view.SECTION_ID, "children"),
                  Output(MISCONFIG_ID, "children"), Output(STATUS_ID, "children"),
                  Input("refresh", "n_intervals"), Input("instance", "value"))
    def _refresh(_n: int, instance: str | None) -> tuple:
        return refresh(ctx.backend, ctx.window_seconds, instance, ctx.max_points, ctx.offload)


def refresh(backend: Backend, window_seconds: float, instance: str | None = None,
            max_points: int = 720,
            offload: offload_verdict.Settings = offload_verdict.Settings()) -> tuple:
    """Read the backend once and render: (*figures in :data:`GRAPHS` order, the "Should I
    offload here?" block judged with ``offload``, the misconfiguration banners (judged on the
    same window), the status line). An unreachable backend gives placeholders and a status line
    saying so (never an exception into Dash); requests that cannot be read (a fleet whose
    agents want a token the dashboard lacks) leave out only what is drawn from them."""
    try:
        samples = backend.timeseries(window_seconds, instance)
    except BackendUnavailable as exc:
        return (*[figures.unreachable_figure(title, exc.url, exc.what)
                  for _build, title in GRAPHS.values()],
                verdict_view.placeholder(str(exc)), [],
                str(exc))
    try:
        page = backend.requests(limit=RECORDS, instance=instance)
        records, unread, missing = page.records, unread_status(page.unread), None
    except BackendUnavailable as exc:  # Prometheus answered; the agents' requests did not
        records, unread, missing = [], f" · requests not read: {exc}", exc
    figs = render(samples, window_seconds, max_points, records)
    if missing is not None:
        figs = [figures.unreachable_figure(title, missing.url, missing.what)
                if gid in FROM_RECORDS else fig
                for fig, (gid, (_build, title)) in zip(figs, GRAPHS.items())]
    advice = verdict_view.section(offload_verdict.assess(samples, records, offload))
    try:  # the NUMA placement detector reads the node collectors' topology
        topology = topologies(backend.node(TOPOLOGY_METRICS, instance))
    except BackendUnavailable:
        topology = None
    try:  # a fleet's samples add its instances up (an agent lists none)
        hosts = 1 if instance else max(1, len(backend.instances()))
    except BackendUnavailable:
        hosts = 1
    found = misconfig_section(detect_misconfig(last_window(samples, offload.window_seconds),
                                               topology=topology, hosts=hosts))
    return (*figs, advice, found, samples_status(backend, instance, samples) + unread)


def render(samples: Sequence[dict], window_seconds: float, max_points: int = 720,
           records: Sequence[dict] = ()) -> list:
    """The figures in :data:`GRAPHS` order: from samples (the last ``window_seconds``, relative
    to the newest sample, thinned to ``max_points``), or, for :data:`FROM_RECORDS`, from
    ``records`` (the API's request dicts; "not measured" where the samples count requests and
    there is none)."""
    recent = thin(last_window(samples, window_seconds), max_points)
    # requests counted and none recorded: what is drawn from records is not measured here
    unrecorded = not records and any(s.get("requests") for s in samples[-1:])
    return [figures.message_figure(title, figures_load.NOT_PER_REQUEST)
            if gid in FROM_RECORDS and unrecorded else
            build(records if gid in FROM_RECORDS else recent)
            for gid, (build, title) in GRAPHS.items()]
