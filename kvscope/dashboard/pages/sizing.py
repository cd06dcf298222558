"""The Sizing page: how big a CPU tier should be, from an analysis of a trace file
(``kvscope dashboard --sizing-trace FILE``; the demo passes its ``--trace``): hit-ratio curves
against tier size with the knee and the recommended size, prefill seconds saved against
transfer seconds, and the verdict. Without a trace the page says how to enable it."""

from __future__ import annotations

import dash
from dash import Input, Output, html

from kvscope.dashboard import figures_sizing as fz
from kvscope.dashboard.backend import Backend, BackendUnavailable
from kvscope.dashboard.figures import message_figure
from kvscope.dashboard.pages.common import GRID_STYLE, Context, graph, status
from kvscope.dashboard.sizing import HOW_TO_ENABLE, SizingState

PATH = "/sizing"
NAME = "Sizing"
STATUS_ID = "sizing-status"
GRAPHS = {"sizing-curves": fz.CURVES_TITLE, "sizing-cost": fz.COST_TITLE}


def layout() -> html.Div:
    return html.Div([
        status(STATUS_ID),
        html.Div(id="sizing-verdict", style={"padding": "4px 16px", "fontSize": "15px"}),
        html.Div([graph(gid, message_figure(title, "loading…")) for gid, title in GRAPHS.items()],
                 style=GRID_STYLE),
    ])


def register_callbacks(app: dash.Dash, ctx: Context) -> None:
    @app.callback(*[Output(gid, "figure") for gid in GRAPHS], Output("sizing-verdict", "children"),
                  Output(STATUS_ID, "children"), Input("refresh", "n_intervals"))
    def _refresh(_n):
        state = ctx.sizing.state() if ctx.sizing else SizingState("off", message=HOW_TO_ENABLE)
        return render(state, host_limit(ctx.backend) if state.status == "ready" else None)


def host_limit(backend: Backend) -> float | None:
    """The node's memory limit, bytes (the host collector's, newest sample of the last
    minute, from the agent's own samples, which the page's refresh has cached), or None when
    no sample has it, the backend cannot be read or is a fleet's (Prometheus: its samples sum
    every node's)."""
    if backend.kind != "agent":
        return None
    try:
        samples = backend.timeseries(60.0)
    except BackendUnavailable:
        return None
    limits = [x["host_memory_limit_bytes"] for x in samples
              if isinstance(x.get("host_memory_limit_bytes"), (int, float))]
    return float(limits[-1]) if limits else None


def render(state: SizingState, host_limit_bytes: float | None = None) -> tuple:
    """(curves figure, cost figure, verdict children, status line) for a sizing state;
    ``host_limit_bytes``: the node's memory limit, to say when the recommended tier would not
    fit in it (None: not known, nothing said)."""
    if state.status != "ready" or state.data is None:
        return (*[message_figure(title, state.message if state.status != "off"
                                 else "no trace given (see above)")
                  for title in GRAPHS.values()], "", state.message)
    data = state.data
    verdict = [html.B(data.get("verdict", ""))]
    rec = data.get("recommended")
    if rec:
        verdict += [html.Br(), f"Recommended CPU tier: {fz.gib_text(rec['gib'])} GiB "
                    f"({rec['blocks']:,} blocks), token hit share {rec['token_hit_share']:.1%} "
                    f"with the GPU cache's (the CPU tier's {rec['cpu_token_hit_share']:.1%}); vLLM "
                    f"--kv-offloading-size {data.get('kv_offloading_size_gib', 0):g} (the size "
                    "rounded up for the flag)"]
        if host_limit_bytes is not None and rec["gib"] * 2**30 >= host_limit_bytes:
            verdict += [html.Br(), html.B(
                f"At or above this node's memory limit ({fz.gib_text(host_limit_bytes / 2**30)}"
                " GiB, the agent's host collector): it would not fit here; the curve shows "
                "what a smaller tier serves.", id="sizing-over-host")]
    current = data.get("current")
    if current:
        verdict += [html.Br(), f"The capture's own CPU tier: {fz.gib_text(current['gib'])} GiB "
                    f"({current['blocks']:,} blocks), token hit share "
                    f"{current['token_hit_share']:.1%} (the CPU tier's "
                    f"{current['cpu_token_hit_share']:.1%}) by the same curve"]
    verdict += [html.Br(), f"Reused prompt tokens (ceiling for any cache): "
                f"{data.get('reuse_token_share', 0):.1%}; GPU prefix cache alone: "
                f"{data.get('gpu_token_hit_share', 0):.1%}"]
    for note in data.get("notes", ()):  # what the analysis assumed
        verdict += [html.Br(), html.Small(note)]
    return (fz.sizing_curves(data), fz.sizing_cost(data), verdict,
            f"trace {state.trace} · {state.message}")
