"""The Compare page: a baseline capture against a candidate capture, and the rollback verdict.

The user names two capture directories (``kvscope agent --capture-dir``, read on the
dashboard's host) and optionally a p99 TTFT budget in milliseconds, and presses Compare. The
page then shows the verdict ("keep", "roll back (disable the newest tier)" or "inconclusive")
with its reasons, TTFT and ITL p50/p95/p99 with bootstrap confidence intervals, hit quality by
source, and transfer cost — what ``kvscope compare BASELINE CANDIDATE`` prints.

:func:`run_compare` does the page's only I/O (reading the two captures) and the analysis;
:func:`render` is pure (plain comparison data in, figures and texts out).
"""

from __future__ import annotations

import dash
from dash import Input, Output, State, dcc, html

from kvscope.analysis.bootstrap import DEFAULT_RESAMPLES
from kvscope.dashboard import figures_compare as fc

PATH = "/compare"
NAME = "Compare"
STATUS_ID = "compare-status"
GRAPHS = {"compare-ttft": fc.TTFT_TITLE, "compare-itl": fc.ITL_TITLE,
          "compare-hit-quality": fc.HIT_QUALITY_TITLE, "compare-transfers": fc.TRANSFER_TITLE}
_GRID = {"display": "grid", "gap": "8px", "padding": "8px",
         "gridTemplateColumns": "repeat(auto-fit, minmax(520px, 1fr))"}
_INPUT = {"width": "340px", "marginRight": "10px", "padding": "4px"}


def layout() -> html.Div:
    """The form (two capture paths, budget in ms, Compare button), the verdict banner, the
    status line and the four graphs. Typed values persist for the browser session."""
    form = html.Div([
        dcc.Input(id="compare-baseline", type="text",
                  placeholder="baseline capture directory (runs: comma-separated)",
                  persistence=True, persistence_type="session", style=_INPUT, debounce=True),
        dcc.Input(id="compare-candidate", type="text",
                  placeholder="candidate capture directory (runs: comma-separated)",
                  persistence=True, persistence_type="session", style=_INPUT, debounce=True),
        dcc.Input(id="compare-budget-ms", type="number", min=0, placeholder="p99 TTFT budget, ms",
                  persistence=True, persistence_type="session",
                  style={**_INPUT, "width": "190px"}),
        html.Button("Compare", id="compare-run", n_clicks=0, style={"padding": "4px 14px"}),
    ], style={"display": "flex", "flexWrap": "wrap", "alignItems": "center",
              "gap": "6px", "padding": "10px 16px"})
    graphs = [dcc.Graph(id=gid, figure=fig, config={"displaylogo": False},
                        style={"minWidth": 0})
              for gid, fig in zip(GRAPHS, fc.all_figures(None))]
    return html.Div([
        form,
        html.Div(id="compare-verdict", style={"padding": "4px 16px", "fontSize": "15px"}),
        html.Div(fc.EMPTY, id=STATUS_ID, style={"color": "#555", "padding": "6px 16px",
                                                "fontSize": "14px"}),
        html.Div(graphs, style=_GRID),
    ])


def register_callbacks(app: dash.Dash, ctx=None) -> None:
    """Bind the Compare button to ``app`` (``ctx``, the shared page context, is unused: the
    page reads capture directories, not the live backend)."""

    @app.callback(*[Output(gid, "figure") for gid in GRAPHS],
                  Output("compare-verdict", "children"), Output(STATUS_ID, "children"),
                  Input("compare-run", "n_clicks"), State("compare-baseline", "value"),
                  State("compare-candidate", "value"), State("compare-budget-ms", "value"),
                  prevent_initial_call=True)
    def _compare(_n, baseline, candidate, budget_ms):
        data, message = run_compare(baseline, candidate, budget_ms)
        return render(data, message)


def run_compare(baseline: str | None, candidate: str | None, budget_ms: float | None,
                resamples: int = DEFAULT_RESAMPLES) -> tuple[dict | None, str]:
    """Read both captures and compare them: (comparison data or None, status message).

    ``budget_ms``: p99 TTFT budget in milliseconds (None or 0: judge against the baseline).
    Unreadable captures and bad input become the message (never an exception into Dash).
    """
    if not baseline or not candidate:
        return None, fc.EMPTY
    from kvscope.analysis.capture_reader import read_runs
    from kvscope.analysis.compare import compare, to_dict
    from kvscope.engine.workload import TraceError

    try:
        result = compare(read_runs(baseline), read_runs(candidate),
                         ttft_budget=budget_ms / 1e3 if budget_ms else None, resamples=resamples)
    except (TraceError, ValueError) as exc:  # the dashboard's fetch boundary
        return None, f"cannot compare: {exc}"
    data = to_dict(result)
    return data, (f"baseline {data['baseline']['requests']} requests · candidate "
                  f"{data['candidate']['requests']} requests · {data['resamples']} bootstrap "
                  f"resamples, {data['confidence'] * 100:g}% intervals")


def render(data: dict | None, message: str) -> tuple:
    """(four figures in :data:`GRAPHS` order, verdict children, status line)."""
    figures = fc.all_figures(data)
    if data is None:
        return (*figures, "", message)
    verdict = data["verdict"]
    banner = html.Div([
        html.B(verdict["text"]),
        html.Ul([html.Li(reason) for reason in verdict["reasons"]],
                style={"margin": "4px 0 0 0", "fontSize": "14px"}),
    ], style={"borderLeft": f"6px solid {fc.verdict_colour(verdict['decision'])}",
              "padding": "6px 12px", "background": "#fafafa"})
    return (*figures, banner, message)
