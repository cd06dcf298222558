"""The "Should I offload here?" block at the top of the Overview: headline stat cards, the
overall verdict and the guide's five conditions with their evidence.

Pure: an :class:`~kvscope.dashboard.offload_verdict.Assessment` in, Dash components out. Each
condition's row has the id ``offload-check-<key>`` and its verdict in ``data-verdict``; the
banner is ``offload-verdict`` (tests and docs refer to them).
"""

from __future__ import annotations

from dash import html

from kvscope.dashboard.offload_verdict import (CONDITIONS, NOT_MEASURED, NOT_PAYING, PAYS, SKIP,
                                               TOO_LITTLE, Assessment, requests_text,
                                               saved_and_spent, seconds_text)
from kvscope.dashboard.series import bytes_text

SECTION_ID = "offload-advice"
TITLE = "Should I offload here?"
VERDICT_COLOURS = {PAYS: "#2ca02c", SKIP: "#d62728", NOT_MEASURED: "#7f7f7f",
                   TOO_LITTLE: "#e6a000", NOT_PAYING: "#e6a000"}
CARD_STYLE = {"border": "1px solid #ddd", "borderRadius": "6px", "padding": "8px 12px",
              "minWidth": "220px", "flex": "1"}
CELL_STYLE = {"borderBottom": "1px solid #eee", "padding": "4px 8px", "verticalAlign": "top",
              "textAlign": "left"}


def placeholder(text: str = "loading…") -> html.Div:
    """The block before the first refresh, or when the backend cannot be read."""
    return html.Div([html.H3(TITLE, style={"margin": "4px 0"}), html.Div(text)])


def section(a: Assessment) -> list:
    """The block's children: the title, the stat cards, the overall verdict, the conditions."""
    return [html.H3(TITLE, style={"margin": "4px 0"}), cards(a), banner(a), table(a)]


def badge(verdict: str) -> html.Span:
    return html.Span(verdict, className="offload-verdict-badge",
                     style={"background": VERDICT_COLOURS[verdict], "color": "white",
                            "borderRadius": "4px", "padding": "1px 8px",
                            "whiteSpace": "nowrap", "fontWeight": "600"})


# where the seconds saved come from (a tryout read the card at 19.5x, at the agent's assumed
# rate, where kvscope compare measured 4.8x from the same capture)
SAVED_HINT = ("prompt tokens a tier served, each priced at the prefill rate its engine's "
              "lookups carry (the reference engine's model), else the rate its finished "
              "requests measured (recomputed tokens over prefill seconds, from 10 requests on), "
              "else the agent's prefill_tokens_per_second (10,000 tokens/s by default), an "
              "assumption")


def card(cid: str, title: str, value: str, detail: str, colour: str = "#222",
         hint: str | None = None) -> html.Div:
    """A stat card: ``title``, ``value`` large, ``detail`` under it; ``hint``: shown on
    hover."""
    return html.Div([html.Div(title, style={"color": "#555", "fontSize": "13px"}),
                     html.Div(value, className="offload-card-value",
                              style={"fontSize": "22px", "fontWeight": "600",
                                     "color": colour}),
                     html.Div(detail, style={"color": "#555", "fontSize": "13px"})],
                    id=cid, style=CARD_STYLE, title=hint)


def cards(a: Assessment) -> html.Div:
    """Four cards: prompt tokens reused (and the share by source, and the share of prompt
    blocks whose prefix was seen before: what a large enough tier could serve), prefill
    seconds saved vs transfer seconds spent per offload tier, p99 TTFT against the budget,
    host RAM headroom."""
    h = a.headline
    reused = sum(v for k, v in h.token_share.items() if k != "recompute")
    shares = " · ".join(f"{k} {v:.0%}" for k, v in h.token_share.items())
    if h.prefix_reuse_share is not None:
        shares += f" · prompt blocks seen before {h.prefix_reuse_share:.0%}"
    tiers = " · ".join(f"{tier} {saved:.2f} s saved / "
                       + (f"{spent:.2f} s copying in and out" if spent is not None
                          else f"transfer time {NOT_MEASURED}")
                       for tier, (saved, spent) in h.saved_vs_spent.items())
    over = h.ttft_p99 is not None and h.ttft_p99 > h.ttft_budget
    return html.Div([
        card("offload-card-tokens", "prompt tokens from a cache",
             f"{reused:.0%}" if h.token_share else NOT_MEASURED, shares or "no prompt tokens"),
        card("offload-card-savings", "estimated prefill seconds saved per transfer second",
             _net(h.saved_vs_spent), tiers or "no offload tier served or moved anything",
             hint=SAVED_HINT),
        card("offload-card-ttft", "p99 TTFT vs budget",
             seconds_text(h.ttft_p99), f"budget {seconds_text(h.ttft_budget)}",
             VERDICT_COLOURS[SKIP] if over else "#222"),
        card("offload-card-headroom", "host RAM headroom",
             NOT_MEASURED if h.headroom_bytes is None else bytes_text(h.headroom_bytes),
             "reserve " + (NOT_MEASURED if h.reserve_bytes is None
                           else bytes_text(h.reserve_bytes)),
             VERDICT_COLOURS[SKIP] if (h.headroom_bytes or 0) < 0 else "#222"),
    ], style={"display": "flex", "gap": "8px", "flexWrap": "wrap", "margin": "6px 0"})


def banner(a: Assessment) -> html.Div:
    """The overall verdict, the conditions behind it and the window; under "not paying as
    sized", what the tiers cost (the conditions say whether offload is the right step here,
    not whether these tiers, as sized, pay for it)."""
    behind = ", ".join(str(list(CONDITIONS).index(k) + 1) for k in a.reasons)
    conditions = f"condition{'s' if len(a.reasons) > 1 else ''} {behind}"
    if a.verdict == NOT_PAYING:  # the conditions said "offload pays": the tiers' cost did not
        said = f" overall: {conditions} say{'s' * (len(a.reasons) == 1)} offload pays, the " \
               "tiers' own cost says otherwise"
    else:
        said = f" overall, from {conditions}" if behind else " overall"
    children = [badge(a.verdict), html.Span(said),
                html.Span(f" · last {a.span_seconds:.0f} s, {a.n_samples} samples, "
                          f"{requests_text(a.requests)}", style={"color": "#555"})]
    if a.verdict == NOT_PAYING:
        saved, spent = saved_and_spent(a.headline.saved_vs_spent)
        children.append(html.Div(
            f"no condition rules offload out, but the offload tiers' transfers (offloads and "
            f"promotions) took {spent:.2f} s for {saved:.2f} s of prefill saved in the window: "
            "as sized, these tiers cost more than they save (the Sizing page sizes them from "
            "the traffic)", id="offload-verdict-cost",
            style={"color": VERDICT_COLOURS[SKIP], "fontSize": "13px"}))
    return html.Div(children, id="offload-verdict", **{"data-verdict": a.verdict},
                    style={"margin": "6px 0"})


def table(a: Assessment) -> html.Table:
    """One row per condition: number and the guide's wording, verdict, evidence lines (the
    last, the window, is in the banner and left out here)."""
    head = html.Tr([html.Th(t, style=CELL_STYLE) for t in ("skip offload when", "verdict",
                                                           "evidence")])
    rows = [html.Tr([html.Td(f"{i}. {c.condition}", style=CELL_STYLE),
                     html.Td(badge(c.verdict), style=CELL_STYLE),
                     html.Td([html.Div(line) for line in c.evidence[:-1]],
                             style={**CELL_STYLE, "fontSize": "13px"})],
                    id=f"offload-check-{c.key}", **{"data-verdict": c.verdict})
            for i, c in enumerate(a.checks, 1)]
    return html.Table([html.Thead(head), html.Tbody(rows)],
                      style={"borderCollapse": "collapse", "width": "100%"})


def _net(saved_vs_spent: dict[str, tuple[float, float | None]]) -> str:
    """Seconds saved per second spent over the tiers; the seconds saved alone where a tier's
    transfer time was not measured (no ratio can be formed) or none was spent."""
    if not saved_vs_spent:
        return NOT_MEASURED
    saved, spent = saved_and_spent(saved_vs_spent)
    return f"{saved / spent:.1f}×" if spent else f"{saved:.2f} s saved"

