"""The Compare page: a baseline capture against a candidate capture, and the rollback verdict.

The user names two capture directories (``kvscope agent --capture-dir``, read on the
dashboard's host, under the directories the dashboard may read: :mod:`kvscope.dashboard.access`) and optionally a p99 TTFT budget in milliseconds, and presses Compare; or a
``kvscope rollout`` report directory as the baseline, and optionally which of its candidates
(default its first): the page then shows that candidate's judgement from the report (its
verdict, the A/A gate included) and its per-level p99 TTFT beside the baseline's. The
page then shows the verdict ("keep", "roll back (disable the newest tier)" or "inconclusive")
with its reasons, TTFT and ITL p50/p95/p99 with bootstrap confidence intervals, hit quality by
source, and transfer cost — what ``kvscope compare BASELINE CANDIDATE`` prints.

The page is linkable: ``/compare?baseline=DIR[,DIR...]&candidate=DIR[,DIR...]&ttft_budget=S``
(the budget in seconds, as ``kvscope compare --ttft-budget``) fills the form and compares at
once, and pressing Compare writes that query into the address bar (a ``dcc.Location`` on
the page, without reloading), so a result can be shared or reopened. A link's values
win over the form's persisted ones; a query without any of the three keys leaves the form as it
was.

:func:`run_compare` does the page's only I/O (reading the two captures) and the analysis;
:func:`render`, :func:`parse_link` and :func:`link_search` are pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, urlencode

import dash
from dash import Input, Output, State, dcc, html
from dash.exceptions import PreventUpdate

from kvscope.analysis.bootstrap import DEFAULT_RESAMPLES
from kvscope.dashboard import figures_compare as fc
from kvscope.dashboard.access import outside_roots, under_roots
from kvscope.dashboard.pages.common import Context
from kvscope.dashboard.series import is_number

PATH = "/compare"
NAME = "Compare"
STATUS_ID = "compare-status"
URL_ID = "compare-url"
GRAPHS = {"compare-ttft": fc.TTFT_TITLE, "compare-itl": fc.ITL_TITLE,
          "compare-hit-quality": fc.HIT_QUALITY_TITLE, "compare-transfers": fc.TRANSFER_TITLE,
          "compare-levels": fc.LEVEL_TITLES["ttft"].format(q="99")}
_GRID = {"display": "grid", "gap": "8px", "padding": "8px",
         "gridTemplateColumns": "repeat(auto-fit, minmax(520px, 1fr))"}
_INPUT = {"width": "340px", "marginRight": "10px", "padding": "4px"}
FORM = ("compare-baseline", "compare-candidate", "compare-budget-ms")
LINK_KEYS = ("baseline", "candidate", "ttft_budget")


class Link(NamedTuple):
    """What a ``/compare`` query asks for: the two arms (None when not named), the budget in
    milliseconds as the form holds it (None: none), and ``error``, a status line ("" if none)."""

    baseline: str | None
    candidate: str | None
    budget_ms: float | None
    error: str = ""


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
              for gid, fig in zip(GRAPHS, _figures(None))]
    return html.Div([
        # the page's own URL: its query opens a comparison, and Compare writes it (no reload;
        # "callback-nav" tells the shell's Location too). Not the shell's: with an Input
        # outside the page, the callback would fire on every page, without its button there
        dcc.Location(id=URL_ID, refresh="callback-nav"),
        form,
        html.Div(id="compare-verdict", style={"padding": "4px 16px", "fontSize": "15px"}),
        html.Div(fc.EMPTY, id=STATUS_ID, style={"color": "#555", "padding": "6px 16px",
                                                "fontSize": "14px"}),
        html.Div(graphs, style=_GRID),
    ])


def register_callbacks(app: dash.Dash, ctx: Context) -> None:
    """Bind the Compare button and the URL's query (the page's own ``dcc.Location``) to
    ``app``; of ``ctx``, the shared page context, the page reads only ``capture_roots`` (it
    reads capture directories, not the live backend). The callback writes the query it reads;
    Dash does not call a callback again for its own output."""

    @app.callback(*[Output(gid, "figure") for gid in GRAPHS],
                  Output("compare-verdict", "children"), Output(STATUS_ID, "children"),
                  *[Output(fid, "value") for fid in FORM], Output(URL_ID, "search"),
                  Input("compare-run", "n_clicks"), Input(URL_ID, "search"),
                  *[State(fid, "value") for fid in FORM])
    def _compare(n_clicks, search, baseline, candidate, budget_ms):
        # drawing the page "triggers" the button too, with 0 clicks
        clicked = bool(n_clicks) and "compare-run.n_clicks" in dash.ctx.triggered_prop_ids
        return respond(clicked, search, baseline, candidate, budget_ms,
                       roots=ctx.capture_roots)


def respond(clicked: bool, search: str | None, baseline: str | None, candidate: str | None,
            budget_ms: float | None, resamples: int = DEFAULT_RESAMPLES, *,
            roots: Sequence[Path]) -> tuple:
    """The callback's outputs: (the figures, verdict, status, the form's three values, the
    URL's query); ``dash.no_update`` where nothing changes. ``roots``: the resolved
    directories the page may read (:func:`~kvscope.dashboard.access.outside_roots`); a path
    outside them is refused before anything is read, and a relative one is taken under them.

    ``clicked``: Compare was pressed, so compare the form's values and write them into the
    URL (unless it already holds them). Otherwise the URL changed or the page was drawn: open
    the link in ``search``, filling the form; a query naming none of :data:`LINK_KEYS` changes
    nothing (:class:`~dash.exceptions.PreventUpdate`), so the persisted form stays as it was.
    """
    keep = dash.no_update
    if clicked:
        *arms, refused = _arms(baseline, candidate, roots)
        error = budget_error(budget_ms) or refused
        if error:
            return (*render(None, error), keep, keep, keep, keep)
        query = link_search(baseline, candidate, budget_ms)  # as typed: reopened the same way
        return (*render(*run_compare(*arms, budget_ms, resamples)),
                keep, keep, keep, keep if query == (search or "") else query)
    link = parse_link(search)
    if link is None:
        raise PreventUpdate
    form = (link.baseline, link.candidate, link.budget_ms)
    *arms, refused = _arms(link.baseline, link.candidate, roots)
    if link.error or refused:
        return (*render(None, link.error or refused), *form, keep)
    if not (link.baseline and link.candidate) and not _is_rollout(arms[0]):
        missing = "candidate" if link.baseline else "baseline"
        return (*render(None, f"the link names no {missing} capture: type it and press "
                              f"Compare"), *form, keep)
    return (*render(*run_compare(*arms, link.budget_ms, resamples)), *form, keep)


def _arms(baseline: str | None, candidate: str | None,
          roots: Sequence[Path]) -> tuple[str | None, str | None, str]:
    """The arms with relative paths taken under ``roots`` (:func:`under_roots`), and why they
    may not be read ("" when they may): each a path under ``roots``, except the candidate of
    a rollout report, which names one of its arms (looked for only once the report's own
    directory is known to be under a root)."""
    baseline = under_roots(baseline, roots)
    refused = outside_roots(baseline, roots)
    if refused or _is_rollout(baseline):
        return baseline, candidate, refused
    candidate = under_roots(candidate, roots)
    return baseline, candidate, outside_roots(candidate, roots)


def parse_link(search: str | None) -> Link | None:
    """The :class:`Link` in a URL query such as ``?baseline=a,b&candidate=c&ttft_budget=0.5``
    (``ttft_budget`` in seconds, converted to the form's milliseconds); None when the query
    names none of :data:`LINK_KEYS` (other keys are ignored; of a repeated key, the first
    counts). A budget that is not a positive number of seconds gives ``error``."""
    query = parse_qs((search or "").lstrip("?"))
    if not any(key in query for key in LINK_KEYS):
        return None
    baseline, candidate = (query[key][0] if key in query else None
                           for key in ("baseline", "candidate"))
    raw = query["ttft_budget"][0] if "ttft_budget" in query else None
    if raw is None:
        return Link(baseline, candidate, None)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        shown = raw if len(raw) <= 40 else raw[:40] + "…"
        return Link(baseline, candidate, None,
                    f"cannot compare: ttft_budget={shown!r} in the link is not a positive number "
                    f"of seconds (e.g. ttft_budget=0.5, as kvscope compare --ttft-budget 0.5)")
    return Link(baseline, candidate, float(f"{seconds * 1e3:.12g}"))


def link_search(baseline: str | None, candidate: str | None, budget_ms: float | None) -> str:
    """The URL query that reopens this comparison (:func:`parse_link` reads it back): the
    arms as typed, and the budget in seconds when there is one (a form budget of 0 or none
    means none); "" when the form names neither arm."""
    query = {key: value for key, value in (("baseline", baseline), ("candidate", candidate))
             if value}
    if not query:
        return ""
    if is_number(budget_ms) and budget_ms > 0:
        query["ttft_budget"] = f"{budget_ms / 1e3:.12g}"
    return "?" + urlencode(query, safe="/,:")


def budget_error(budget_ms: float | None) -> str:
    """The status line refusing the form's budget ("" when it is none, 0 or positive)."""
    if budget_ms is None or (is_number(budget_ms) and budget_ms >= 0):
        return ""
    return (f"cannot compare: the p99 TTFT budget must be a positive number of milliseconds "
            f"(empty or 0: none), not {budget_ms!r}")


def run_compare(baseline: str | None, candidate: str | None, budget_ms: float | None,
                resamples: int = DEFAULT_RESAMPLES) -> tuple[dict | None, str]:
    """Read both captures and compare them: (comparison data or None, status message).

    ``budget_ms``: p99 TTFT budget in milliseconds (None or 0: judge against the baseline).
    Unreadable captures and bad input become the message (never an exception into Dash).
    """
    if _is_rollout(baseline):
        return _rollout(baseline, candidate)
    if not baseline or not candidate:
        return None, fc.EMPTY
    from kvscope.analysis.capture_reader import read_arms
    from kvscope.analysis.compare import compare, to_dict
    from kvscope.engine.workload import TraceError

    try:
        result = compare(*read_arms(baseline, candidate),
                         ttft_budget=budget_ms / 1e3 if budget_ms else None, resamples=resamples)
    except (TraceError, ValueError) as exc:  # the dashboard's fetch boundary
        return None, f"cannot compare: {exc}"
    data = to_dict(result)
    return data, (f"baseline {data['baseline']['requests']} requests · candidate "
                  f"{data['candidate']['requests']} requests · {data['resamples']} bootstrap "
                  f"resamples, {data['confidence'] * 100:g}% intervals")


def _is_rollout(path: str | None) -> bool:
    from kvscope.rollout.report import JSON_NAME

    return bool(path) and Path(path, JSON_NAME).is_file()


def _rollout(directory: str, candidate: str | None) -> tuple[dict | None, str]:
    """A rollout report's judgement of ``candidate`` (None: its first) as comparison data,
    with the report's verdict and the tails of the arms it compares; or None and why not."""
    from kvscope.rollout.plan import aa_slot
    from kvscope.rollout.report import read

    try:
        doc = read(directory)
    except ValueError as exc:
        return None, f"cannot compare: {exc}"
    names = [j["candidate"] for j in doc["judgements"]]
    if not names:
        return None, f"cannot compare: the rollout in {directory} judged no candidate"
    name = candidate or names[0]
    if name not in names:
        return None, (f"cannot compare: the rollout in {directory} has no candidate "
                      f"{name!r} (it has {', '.join(names)})")
    j = doc["judgements"][names.index(name)]
    shown = (doc["baseline"], name, aa_slot(doc["baseline"]))
    data = {**j["overall"], "verdict": j["verdict"],
            "tails": {k: v for k, v in doc["tails"].items() if k in shown}}
    return data, (f"rollout {directory}: {name} against {doc['baseline']}, "
                  f"{len(doc['runs'])} runs, levels {doc['levels']}, "
                  f"{doc['repetitions']} repetitions" + (" (stopped early: partial)"
                                                         if doc.get("error") else ""))


def _figures(data: dict | None) -> tuple:
    return (*fc.all_figures(data), fc.level_tails((data or {}).get("tails")))


def render(data: dict | None, message: str) -> tuple:
    """(the figures in :data:`GRAPHS` order, verdict children, status line)."""
    figures = _figures(data)
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
