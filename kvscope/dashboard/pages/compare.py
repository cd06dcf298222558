"""The Compare page: a baseline capture against a candidate capture, and the rollback verdict.

The user names two capture directories (``kvscope agent --capture-dir``, read on the
dashboard's host, under the directories the dashboard may read: :mod:`kvscope.dashboard.access`)
and optionally a p99 TTFT budget (milliseconds, or a percentage of the baseline's p99 such as
``+10%``, as ``kvscope compare --ttft-budget``), and presses Compare; or a
``kvscope rollout`` report directory as the baseline, and optionally which of its candidates
(default its first): the page then shows that candidate's judgement from the report (its
verdict, the A/A gate included) and its per-level p99 TTFT beside the baseline's. The
page then shows the verdict ("keep", "roll back (disable the newest tier)" or "inconclusive")
with its reasons, TTFT and ITL p50/p95/p99 with bootstrap confidence intervals, hit quality by
source, and transfer cost — what ``kvscope compare BASELINE CANDIDATE`` prints.

The page is linkable: ``/compare?baseline=DIR[,DIR...]&candidate=DIR[,DIR...]&ttft_budget=B``
(the budget in seconds or ``+N%``, as ``kvscope compare --ttft-budget``) fills the form and
compares at
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
from kvscope.analysis.compare import Budget, parse_budget
from kvscope.dashboard import figures_compare as fc
from kvscope.dashboard.access import outside_roots, under_roots
from kvscope.dashboard.figures import message_figure
from kvscope.dashboard.pages.common import Context

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
FORM = ("compare-baseline", "compare-candidate", "compare-budget")
LINK_KEYS = ("baseline", "candidate", "ttft_budget")


class Link(NamedTuple):
    """What a ``/compare`` query asks for: the two arms (None when not named), the budget as
    the form holds it (milliseconds, ``"80"``, or a percentage, ``"+10%"``; None: none), and
    ``error``, a status line ("" if none)."""

    baseline: str | None
    candidate: str | None
    budget: str | None
    error: str = ""


def layout() -> html.Div:
    """The form (two capture paths, budget, Compare button), the verdict banner, the
    status line and the four graphs. Typed values persist for the browser session."""
    form = html.Div([
        dcc.Input(id="compare-baseline", type="text",
                  placeholder="baseline capture directory (runs: comma-separated)",
                  persistence=True, persistence_type="session", style=_INPUT, debounce=True),
        dcc.Input(id="compare-candidate", type="text",
                  placeholder="candidate capture directory (runs: comma-separated)",
                  persistence=True, persistence_type="session", style=_INPUT, debounce=True),
        dcc.Input(id="compare-budget", type="text",
                  placeholder="p99 TTFT budget: ms, or +N% of the baseline's",
                  persistence=True, persistence_type="session",
                  style={**_INPUT, "width": "260px"}),
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
    def _compare(n_clicks, search, baseline, candidate, budget):
        # drawing the page "triggers" the button too, with 0 clicks
        clicked = bool(n_clicks) and "compare-run.n_clicks" in dash.ctx.triggered_prop_ids
        return respond(clicked, search, baseline, candidate, budget, roots=ctx.capture_roots)


def respond(clicked: bool, search: str | None, baseline: str | None, candidate: str | None,
            budget: str | float | None, resamples: int = DEFAULT_RESAMPLES, *,
            roots: Sequence[Path]) -> tuple:
    """The callback's outputs: (the figures, verdict, status, the form's three values, the
    URL's query); ``dash.no_update`` where nothing changes. ``budget``: the form's (see
    :func:`form_budget`). ``roots``: the resolved
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
        try:
            parsed = form_budget(budget)
        except ValueError as exc:
            refused = f"cannot compare: {exc}"
        if refused:
            return (*render(None, refused), keep, keep, keep, keep)
        query = link_search(baseline, candidate, parsed)  # as typed: reopened the same way
        return (*render(*run_compare(*arms, parsed, resamples)),
                keep, keep, keep, keep if query == (search or "") else query)
    link = parse_link(search)
    if link is None:
        raise PreventUpdate
    form = (link.baseline, link.candidate, link.budget)
    *arms, refused = _arms(link.baseline, link.candidate, roots)
    if link.error or refused:
        return (*render(None, link.error or refused), *form, keep)
    if not (link.baseline and link.candidate) and not _is_rollout(arms[0]):
        missing = "candidate" if link.baseline else "baseline"
        return (*render(None, f"the link names no {missing} capture: type it and press "
                              f"Compare"), *form, keep)
    return (*render(*run_compare(*arms, form_budget(link.budget), resamples)), *form, keep)


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
    (``ttft_budget`` as ``kvscope compare --ttft-budget`` reads it: seconds, shown in the form
    as milliseconds, or ``+N%``); None when the query names none of :data:`LINK_KEYS` (other
    keys are ignored; of a repeated key, the first counts). A budget that command would
    refuse gives ``error``."""
    query = parse_qs((search or "").lstrip("?"))
    if not any(key in query for key in LINK_KEYS):
        return None
    baseline, candidate = (query[key][0] if key in query else None
                           for key in ("baseline", "candidate"))
    raw = query["ttft_budget"][0] if "ttft_budget" in query else None
    if raw is None:
        return Link(baseline, candidate, None)
    try:
        parsed = parse_budget(raw)
    except ValueError:
        shown = raw if len(raw) <= 40 else raw[:40] + "…"
        return Link(baseline, candidate, None,
                    f"cannot compare: ttft_budget={shown!r} in the link is neither a positive "
                    f"number of seconds nor a percentage above -100% (e.g. ttft_budget=0.5 or "
                    f"+10%, as kvscope compare --ttft-budget)")
    if parsed.relative is not None:
        return Link(baseline, candidate, _percent(parsed.relative))
    return Link(baseline, candidate, f"{parsed.seconds * 1e3:.12g}")


def form_budget(value: str | float | None) -> Budget | None:
    """The form's budget: milliseconds (``"80"``; a number from a session persisted before the
    field took text), or a percentage of the baseline's p99 (``"+10%"``); None when empty or
    0 (none). Raises ValueError, in the form's terms, for anything else."""
    if isinstance(value, str):
        value = value.strip()
        if value.endswith("%"):
            return parse_budget(value)
    if value in (None, "", 0):
        return None
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = math.nan
    if not (math.isfinite(ms) and ms >= 0):
        raise ValueError(f"the p99 TTFT budget {value!r} is neither a positive number of "
                         "milliseconds (empty or 0: none) nor a percentage of the baseline's "
                         "p99 (e.g. +10%)")
    return Budget(seconds=ms / 1e3) if ms else None


def _percent(relative: float) -> str:
    return f"{relative * 100:+.12g}%"


def link_search(baseline: str | None, candidate: str | None, budget: Budget | None) -> str:
    """The URL query that reopens this comparison (:func:`parse_link` reads it back): the
    arms as typed, and the budget when there is one (seconds, or ``+N%``); "" when the form
    names neither arm."""
    query = {key: value for key, value in (("baseline", baseline), ("candidate", candidate))
             if value}
    if not query:
        return ""
    if budget is not None:
        query["ttft_budget"] = (_percent(budget.relative) if budget.relative is not None
                                else f"{budget.seconds:.12g}")
    return "?" + urlencode(query, safe="/,:")


def run_compare(baseline: str | None, candidate: str | None, budget: Budget | None,
                resamples: int = DEFAULT_RESAMPLES) -> tuple[dict | None, str]:
    """Read both captures and compare them: (comparison data or None, status message).

    ``budget``: the p99 TTFT budget (None: judge against the baseline). Unreadable captures
    and bad input become the message (never an exception into Dash).
    """
    if _is_rollout(baseline):
        return _rollout(baseline, candidate)
    if not baseline or not candidate:
        return None, fc.EMPTY
    from kvscope.analysis.capture_reader import read_arms, segments_gone
    from kvscope.analysis.compare import compare, to_dict
    from kvscope.engine.workload import TraceError

    try:
        result = compare(*read_arms(baseline, candidate),
                         ttft_budget=budget, resamples=resamples)
        notes = segments_gone(baseline) + segments_gone(candidate)
    except (TraceError, ValueError) as exc:  # the dashboard's fetch boundary
        return None, f"cannot compare: {exc}"
    data = to_dict(result)
    return data, (f"baseline {data['baseline']['requests']} requests · candidate "
                  f"{data['candidate']['requests']} requests · {data['resamples']} bootstrap "
                  f"resamples, {data['confidence'] * 100:g}% intervals"
                  + "".join(f" · {note}" for note in notes))


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
    """(the figures in :data:`GRAPHS` order, verdict children, status line). Without
    ``data`` every chart says the ``message`` too (a tryout's charts asked to choose two
    captures under "cannot compare: ...")."""
    if data is None:
        return (*[message_figure(title, message or fc.EMPTY) for title in GRAPHS.values()],
                "", message)
    figures = _figures(data)
    verdict = data["verdict"]
    banner = html.Div([
        html.B(verdict["text"]),
        html.Ul([html.Li(reason) for reason in verdict["reasons"]],
                style={"margin": "4px 0 0 0", "fontSize": "14px"}),
    ], style={"borderLeft": f"6px solid {fc.verdict_colour(verdict['decision'])}",
              "padding": "6px 12px", "background": "#fafafa"})
    return (*figures, banner, message)
