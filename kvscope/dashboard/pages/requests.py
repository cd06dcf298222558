"""The Requests page: a sortable, filterable table of recent requests; selecting one opens
its waterfall. Deep link: ``/requests?id=<request id>``, with ``&source=<source>`` to pick one of
two engines' requests of that id (without it: the one that finished last) and, in a fleet,
``&instance=<instance>``.

Sorting by TTFT, prompt tokens, promotion wait or finish time asks the backend (so "slowest
first" covers the agent's whole table, not just the rows shown); other columns sort the rows
shown. The filter row filters the rows shown (e.g. ``> 50`` under TTFT); "min TTFT" asks the
backend for slow requests only.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlencode

import dash
from dash import Input, Output, State, dash_table, dcc, html

from kvscope.dashboard import figures_requests as fr
from kvscope.dashboard.backend import Backend, BackendUnavailable
from kvscope.dashboard.pages.common import STATUS_STYLE, Context, graph, status, where

PATH = "/requests"
NAME = "Requests"
STATUS_ID = "requests-status"
LIMITS = (100, 500, 1000, 5000)
# table column -> the agent's sort key (kvscope.agent.requests.SORT_KEYS)
API_SORT = {"finished": "finished", "ttft_ms": "ttft", "prompt_tokens": "prompt_tokens",
            "promotion_wait_ms": "promotion_wait"}


def layout() -> html.Div:
    columns = [{"id": cid, "name": name, "type": kind} for cid, name, kind in fr.COLUMNS]
    return html.Div([
        html.Div([
            html.Label("min TTFT (ms) ", htmlFor="min-ttft"),
            dcc.Input(id="min-ttft", type="number", min=0, debounce=True, placeholder="any",
                      style={"width": "90px", "marginRight": "16px"}),
            html.Label("rows ", htmlFor="requests-limit"),
            dcc.Dropdown(id="requests-limit", options=list(LIMITS), value=500, clearable=False,
                         style={"width": "100px", "display": "inline-block",
                                "verticalAlign": "middle"}),
        ], style={"padding": "8px 16px", "display": "flex", "alignItems": "center",
                  "gap": "6px"}),
        status(STATUS_ID),
        html.Div(dash_table.DataTable(
            id="requests-table", columns=columns, data=[], sort_action="custom",
            sort_mode="single", sort_by=[], filter_action="native", page_action="native",
            page_size=15, cell_selectable=True,
            style_table={"overflowX": "auto"},
            style_cell={"fontFamily": "system-ui, sans-serif", "fontSize": "13px",
                        "padding": "4px 8px"},
            style_header={"fontWeight": "600"},
            style_cell_conditional=[{"if": {"column_id": "request_id"}, "textAlign": "left"}],
        ), style={"padding": "0 16px"}),
        html.Div(id="request-details", style=STATUS_STYLE),
        graph("waterfall", fr.waterfall_placeholder()),
    ])


def register_callbacks(app: dash.Dash, ctx: Context) -> None:
    @app.callback(Output("requests-table", "data"), Output(STATUS_ID, "children"),
                  Output("requests-table", "active_cell"),
                  Output("requests-table", "selected_cells"),
                  Input("refresh", "n_intervals"), Input("requests-table", "sort_by"),
                  Input("min-ttft", "value"), Input("requests-limit", "value"),
                  Input("instance", "value"))
    def _table(_n, sort_by, min_ttft_ms, limit, instance):
        # new rows: drop the cell selection (it would point at another request now); the
        # open request stays highlighted through the URL (see _waterfall)
        return (*table(ctx.backend, sort_by, min_ttft_ms, limit or 500, instance), None, [])

    @app.callback(Output("url", "search"), Input("requests-table", "active_cell"),
                  State("requests-table", "data"), prevent_initial_call=True)
    def _select(cell, rows):
        return select(cell, rows)

    @app.callback(Output("waterfall", "figure"), Output("request-details", "children"),
                  Output("requests-table", "style_data_conditional"),
                  Input("url", "search"), Input("instance", "value"))
    def _waterfall(search, instance):
        return (*waterfall(ctx.backend, search, instance), highlight(search))


def table(backend: Backend, sort_by: list | None, min_ttft_ms: float | None, limit: int,
          instance: str | None) -> tuple[list[dict], str]:
    """(table rows, status line); the backend sorts when it can (see module doc)."""
    column = sort_by[0]["column_id"] if sort_by else "finished"
    descending = sort_by[0]["direction"] == "desc" if sort_by else True
    min_ttft = float(min_ttft_ms) / 1000 if isinstance(min_ttft_ms, (int, float)) else None
    try:
        total, records = backend.requests(limit, API_SORT.get(column, "finished"),
                                          descending, min_ttft, instance)
    except BackendUnavailable as exc:
        return [], f"{exc.what} unreachable: {exc.url} ({exc.reason})"
    rows = fr.table_rows(records)
    if column not in API_SORT:
        rows.sort(key=lambda r: r.get(column) or 0, reverse=descending)
    shown = f"{len(rows):,} of {total:,} requests"
    if min_ttft is not None:
        shown += f" with TTFT ≥ {min_ttft * 1000:g} ms"
    return rows, f"{where(backend, instance)} · {shown} · select a cell to open its waterfall"


def select(cell: dict | None, rows: list[dict] | None) -> str:
    """The URL query opening the request of the selected cell (``dash.no_update`` without)."""
    if not cell or cell.get("row_id") is None:
        return dash.no_update
    row = next((r for r in rows or () if r.get("id") == cell["row_id"]), None)
    if row is None:
        return dash.no_update
    query = {"id": row["request_id"]}
    query.update((key, row[key]) for key in ("source", "instance") if row.get(key))
    return "?" + urlencode(query)


def _link(search: str | None) -> dict[str, str]:
    """The deep link's ``id``, ``source`` and ``instance`` (those present)."""
    query = parse_qs((search or "").lstrip("?"))
    return {key: query[key][0] for key in ("id", "source", "instance") if query.get(key)}


def highlight(search: str | None) -> list[dict]:
    """DataTable style rules marking the row of the request the URL opens."""
    link = _link(search)
    if "id" not in link:
        return []
    match = "{request_id} = " + json.dumps(link["id"])
    if "source" in link:
        match += " && {source} = " + json.dumps(link["source"])
    return [{"if": {"filter_query": match}, "backgroundColor": "#fff3c4", "fontWeight": "600"}]


def waterfall(backend: Backend, search: str | None, instance: str | None) -> tuple:
    """(figure, details) for the request the URL names; placeholders when none is named,
    unknown, or the backend is unreachable."""
    link = _link(search)
    request_id, source = link.get("id"), link.get("source")
    if not request_id:
        return fr.waterfall_placeholder(), ""
    instance = link.get("instance", instance)
    try:
        record = backend.request(request_id, instance, source)
    except BackendUnavailable as exc:
        message = f"{exc.what} unreachable: {exc.url}"
        return fr.waterfall_placeholder(message), message
    if record is None:
        message = (f"request {request_id!r} is not in the table (the agent keeps the most "
                   f"recent requests only)")
        return fr.waterfall_placeholder(message), message
    transfers = record.get("transfers") or []
    link = {k: v for k, v in (("id", request_id), ("source", record.get("source")),
                              ("instance", record.get("instance"))) if v}
    details = [html.B(f"request {request_id}"), " · trace id ",
               html.Code(record.get("trace_id", ""), id="trace-id"),
               f" · TTFT {float(record.get('ttft') or 0) * 1000:.3g} ms · "
               f"{len(transfers)} transfers · ",
               dcc.Link("link to this request", href=f"{PATH}?{urlencode(link)}")]
    return fr.waterfall(record), details
