"""The misconfiguration banners on the Overview: one banner per misconfiguration found, saying
what is wrong and what to change, then one line naming what was checked and found fine and
what could not be measured (and why).

Pure: :class:`~kvscope.dashboard.misconfig.Finding` objects in, Dash components out. Every
finding is an element with the id ``misconfig-<key>`` and its status in ``data-status``; the
section is ``misconfig`` (tests and docs refer to them).
"""

from __future__ import annotations

from collections.abc import Sequence

from dash import html

from kvscope.dashboard.misconfig import MISCONFIGURED, NOT_MEASURED, OK, Finding, by_status

SECTION_ID = "misconfig"
BANNER_STYLE = {"border": "1px solid #d62728", "borderLeft": "6px solid #d62728",
                "background": "#fdecea", "borderRadius": "4px", "padding": "6px 10px",
                "margin": "6px 0"}
QUIET_STYLE = {"color": "#555", "fontSize": "13px", "margin": "2px 0"}


def banner(f: Finding) -> html.Div:
    """A misconfiguration: its title and alert, what is wrong, what to change."""
    return html.Div([
        html.Div([html.Strong(f.title), html.Span(f" · alert {f.alert}", style=QUIET_STYLE)]),
        html.Div(["What is wrong: ", f.wrong]),
        html.Div(["What to change: ", html.Strong(f.change)]),
    ], id=f"{SECTION_ID}-{f.key}", className="misconfig-banner", style=BANNER_STYLE,
        **{"data-status": f.status})


def quiet(f: Finding) -> html.Span:
    """A finding that is fine or not measured, in one line of the summary."""
    return html.Span(f"{f.title}: {f.wrong}. ", id=f"{SECTION_ID}-{f.key}",
                     **{"data-status": f.status})


def section(findings: Sequence[Finding]) -> list:
    """The section's children: the banners, then the fine and the not measured findings."""
    groups = by_status(findings)
    out: list = [banner(f) for f in groups[MISCONFIGURED]]
    if not out:
        out.append(html.Div("No misconfiguration found among those kvscope can measure.",
                            style={"margin": "6px 0"}))
    for status, label in ((OK, "Checked, fine"), (NOT_MEASURED, "Not measured")):
        if groups[status]:
            out.append(html.Details([html.Summary(f"{label}: {len(groups[status])}"),
                                     html.Div([quiet(f) for f in groups[status]])],
                                    style=QUIET_STYLE))
    return out
