"""The Requests page: a sortable, filterable, paged table of recent requests (AG Grid);
clicking a row opens its waterfall. Deep link: ``/requests?id=<request id>``, with
``&source=<source>`` to pick one of two engines' requests of that id (without it: the one that
finished last) and, in a fleet, ``&instance=<instance>``.

Sorting by TTFT, prompt tokens, promotion wait or finish time asks the backend (so "slowest
first" covers the agent's whole table, not just the rows shown); other columns sort the rows
shown. The filter row filters the rows shown (e.g. ``> 50`` under TTFT); "min TTFT" asks the
backend for slow requests only. A value the engine did not report reads "not measured", never 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from urllib.parse import parse_qs, urlencode

import dash
import dash_ag_grid as dag
from dash import Input, Output, State, dcc, html

from kvscope.dashboard import figures_requests as fr
from kvscope.dashboard import series as S
from kvscope.dashboard.backend import Backend, BackendUnavailable, by_value
from kvscope.dashboard.pages.common import (STATUS_STYLE, Context, graph, status, unread_status,
                                           where)
from kvscope.events import MAX_REQUEST_ID, MAX_SOURCE_NAME

PATH = "/requests"
NAME = "Requests"
STATUS_ID = "requests-status"
LIMITS = (100, 500, 1000, 5000)
PAGE_SIZE = 15
TIERS_WINDOW = 10.0  # seconds of samples read for the tiers the agent reports (one will do)
# table column -> the agent's sort key (kvscope.agent.requests.SORT_KEYS)
API_SORT = {"finished": "finished", "ttft_ms": "ttft", "prompt_tokens": "prompt_tokens",
            "promotion_wait_ms": "promotion_wait"}
HIGHLIGHT = {"backgroundColor": "#fff3c4", "fontWeight": "600"}

# AG Grid evaluates these expressions in the browser (dash-ag-grid's function strings).
# A number column's filter reads "50" (= 50), "> 50", ">= 50", "< 50", "<= 50", "!= 50", as
# the DataTable's filter row did; a blank ("not measured") never matches.
_OPERATORS = ((">=", ">="), ("<=", "<="), ("!=", "!=="), (">", ">"), ("<", "<"), ("=", "==="))
_TEXT = "params.filterText.trim()"
NUMBER_MATCHER = "".join(
    f"{_TEXT}.startsWith('{op}') ? Number(params.value) {js} Number({_TEXT}.slice({len(op)})) : "
    for op, js in _OPERATORS) + f"Number(params.value) === Number({_TEXT})"
NUMBER_FORMAT = ("params.value != null ? '' + params.value : "
                 "((params.data && params.data.no_tier) || [])"
                 f".includes(params.colDef.field) ? '{fr.NO_TIER}' : '{fr.NOT_MEASURED}'")
# every column filters by the text typed in the filter row: one condition, no operator menu
_FILTER = {"filterOptions": ["contains"], "maxNumConditions": 1}


def column_defs(fleet: bool = False) -> list[dict]:
    """AG Grid columns from :data:`fr.COLUMNS`: headers with their units, numbers right-aligned
    with the comparison filter, blanks shown as "not measured" (or "no tier": see
    :func:`fr.table_rows`); the instance column shown in a ``fleet`` only (one agent has one
    instance)."""
    defs = []
    for cid, name, kind in fr.COLUMNS:
        col = {"field": cid, "headerName": name,
               "minWidth": {"request_id": 110, "finished": 135, "instance": 120}.get(cid, 90)}
        if cid == "instance":
            col["hide"] = not fleet
        if kind == "numeric":
            col.update(type="rightAligned", cellDataType=False,
                       valueFormatter={"function": NUMBER_FORMAT},
                       headerTooltip=f"{name}; filter: 50, > 50, <= 10, != 0",
                       filterParams={**_FILTER, "textMatcher": {"function": NUMBER_MATCHER}})
        else:
            col.update(cellDataType="text", filterParams=_FILTER)
        defs.append(col)
    return defs


def layout() -> html.Div:
    return html.Div([
        html.Div([
            html.Label("min TTFT (ms) ", htmlFor="min-ttft"),
            # applied half a second after typing stops (True waited for Enter: a tryout
            # typed 5 and saw the table unchanged)
            dcc.Input(id="min-ttft", type="number", min=0, debounce=0.5, placeholder="any",
                      style={"width": "90px", "marginRight": "16px"}),
            html.Label("rows ", htmlFor="requests-limit"),
            dcc.Dropdown(id="requests-limit", options=list(LIMITS), value=500, clearable=False,
                         style={"width": "100px", "display": "inline-block",
                                "verticalAlign": "middle"}),
        ], style={"padding": "8px 16px", "display": "flex", "alignItems": "center",
                  "gap": "6px"}),
        status(STATUS_ID),
        # the grid's sort, as [{"column_id", "direction"}]: the table callback reads this, not
        # the grid's columnState, which also changes when a column is resized or moved
        dcc.Store(id="requests-sort", data=[]),
        html.Div(dag.AgGrid(
            id="requests-table", columnDefs=column_defs(), rowData=[],
            getRowId="params.data.id",
            # the filter row is the filter: no header menus (a number column's menu would
            # offer the text filter's "contains"); long headers wrap rather than being cut
            defaultColDef={"sortable": True, "filter": "agTextColumnFilter",
                           "floatingFilter": True, "suppressFloatingFilterButton": True,
                           "resizable": True,
                           "suppressHeaderMenuButton": True, "suppressHeaderFilterButton": True,
                           "wrapHeaderText": True, "autoHeaderHeight": True},
            columnSize="responsiveSizeToFit",
            dashGridOptions={"pagination": True, "paginationPageSize": PAGE_SIZE,
                             "paginationPageSizeSelector": [PAGE_SIZE, 50, 100],
                             "domLayout": "autoHeight", "rowHeight": 30,
                             "floatingFiltersHeight": 34, "animateRows": False,
                             "tooltipShowDelay": 300},
            getRowStyle={"styleConditions": []},
            style={"fontSize": "13px"},
        ), style={"padding": "0 16px"}),
        html.Div(id="request-details", style=STATUS_STYLE),
        graph("waterfall", fr.waterfall_placeholder()),
    ])


def register_callbacks(app: dash.Dash, ctx: Context) -> None:
    @app.callback(Output("requests-sort", "data"), Input("requests-table", "columnState"),
                  State("requests-sort", "data"), prevent_initial_call=True)
    def _sort(column_state, current):
        new = sort_by(column_state)
        return dash.no_update if new == current else new

    @app.callback(Output("requests-table", "rowData"), Output(STATUS_ID, "children"),
                  Input("refresh", "n_intervals"), Input("requests-sort", "data"),
                  Input("min-ttft", "value"), Input("requests-limit", "value"),
                  Input("instance", "value"))
    def _table(_n, sort, min_ttft_ms, limit, instance):
        return table(ctx.backend, sort, min_ttft_ms, limit or 500, instance)

    if ctx.backend.kind == "prometheus":  # a fleet: requests of two nodes may share ids
        @app.callback(Output("requests-table", "columnDefs"), Input("requests-table", "id"))
        def _fleet_columns(_id):
            return column_defs(fleet=True)

    @app.callback(Output("url", "search"), Input("requests-table", "cellClicked"),
                  State("requests-table", "rowData"), prevent_initial_call=True)
    def _select(cell, rows):
        return select(cell, rows)

    @app.callback(Output("waterfall", "figure"), Output("request-details", "children"),
                  Output("requests-table", "getRowStyle"),
                  Input("url", "search"), Input("instance", "value"))
    def _waterfall(search, instance):
        return (*waterfall(ctx.backend, search, instance), highlight(search))


def sort_by(column_state: Sequence[Mapping] | None) -> list[dict]:
    """The grid's sort (its ``columnState``) as ``[{"column_id", "direction"}]``: the column
    sorted first, or ``[]`` when none is."""
    sorted_columns = [c for c in column_state or () if c.get("sort") in ("asc", "desc")]
    if not sorted_columns:
        return []
    first = min(sorted_columns, key=lambda c: c.get("sortIndex") or 0)
    return [{"column_id": first["colId"], "direction": first["sort"]}]


def table(backend: Backend, sort_by: list | None, min_ttft_ms: float | None, limit: int,
          instance: str | None) -> tuple[list[dict], str]:
    """(table rows, status line); the backend sorts when it can (see module doc)."""
    column = sort_by[0]["column_id"] if sort_by else "finished"
    descending = sort_by[0]["direction"] == "desc" if sort_by else True
    min_ttft = float(min_ttft_ms) / 1000 if isinstance(min_ttft_ms, (int, float)) else None
    # a column the agent cannot sort sorts the newest rows: ascending by "finished" fetched
    # the oldest ones instead
    sorted_by_api = column in API_SORT
    try:
        page = backend.requests(limit, API_SORT.get(column, "finished"),
                                descending or not sorted_by_api, min_ttft, instance)
    except BackendUnavailable as exc:
        return [], str(exc)
    rows = fr.table_rows(page.records, *_tiers(backend, instance))
    if not sorted_by_api:
        rows.sort(key=by_value(column, descending), reverse=descending)
    shown = f"{len(rows):,} of {page.total:,} requests"
    if min_ttft is not None:
        shown += f" with TTFT ≥ {min_ttft * 1000:g} ms"
    return rows, (f"{where(backend, instance)} · {shown}{unread_status(page.unread)} · "
                  "click a row to open its waterfall")


def _tiers(backend: Backend, instance: str | None) -> tuple[set[str] | None, set[str]]:
    """The tiers the newest sample reports (None where unknown: no sample, none reported, a
    source of spans alone, as a capture's requests read them), and the offload tiers the
    samples show nowhere (:func:`S.unconfigured_tiers`, as the Tiers page reads them)."""
    try:
        samples = backend.timeseries(TIERS_WINDOW, instance)
    except BackendUnavailable:
        return None, set()
    if not samples:
        return None, set()
    return S.reported_tiers(samples[-1]) or None, S.unconfigured_tiers(samples)


def select(cell: dict | None, rows: list[dict] | None) -> str:
    """The URL query opening the request of the clicked cell (the grid's ``cellClicked``;
    ``dash.no_update`` without)."""
    if not cell or cell.get("rowId") is None:
        return dash.no_update
    row = next((r for r in rows or () if r.get("id") == cell["rowId"]), None)
    if row is None:
        return dash.no_update
    query = {"id": row["request_id"]}
    query.update((key, row[key]) for key in ("source", "instance") if row.get(key))
    return "?" + urlencode(query)


def _link(search: str | None) -> dict[str, str]:
    """The deep link's ``id``, ``source`` and ``instance`` (those present), each cut to the
    longest that can name one: :data:`~kvscope.events.MAX_REQUEST_ID` characters, as every
    sender cuts a request id (a longer one matches nothing, and its message echoed it whole),
    and a source to :data:`~kvscope.events.MAX_SOURCE_NAME` (no source is named longer; the
    agent's API refused 65 characters and more, which read as the agent unreachable)."""
    query = parse_qs((search or "").lstrip("?"))
    cut = {"id": MAX_REQUEST_ID, "source": MAX_SOURCE_NAME, "instance": MAX_REQUEST_ID}
    return {key: query[key][0][:n] for key, n in cut.items() if query.get(key)}


def highlight(search: str | None) -> dict:
    """The grid's ``getRowStyle``: marks the row of the request the URL opens (the request
    id, and the source and instance the link names: two nodes or taps may share ids)."""
    link = _link(search)
    if "id" not in link:
        return {"styleConditions": []}
    match = " && ".join(f"params.data.{field} === {json.dumps(link[key])}"
                        for key, field in (("id", "request_id"), ("source", "source"),
                                           ("instance", "instance")) if key in link)
    return {"styleConditions": [{"condition": match, "style": HIGHLIGHT}]}


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
        message = str(exc)
        return fr.waterfall_placeholder(message), message
    if record is None:
        message = (f"request {request_id!r} is not in the table (the agent keeps the most "
                   f"recent requests only)")
        if source:  # the id may be there under another source: say which was asked for
            message = (f"no request {request_id!r} from source {source!r} in the table (the "
                       "agent keeps the most recent requests only; leave source out of the "
                       "link for the one that finished last under any source)")
        return fr.waterfall_placeholder(message), message
    transfers = fr.transfer_count(record)
    link = {k: v for k, v in (("id", request_id), ("source", record.get("source")),
                              ("instance", record.get("instance"))) if v}
    details = [html.B(f"request {request_id}"), " · trace id ",
               html.Code(record.get("trace_id", ""), id="trace-id"),
               f" · TTFT {_ms(record.get('ttft'))} · "
               + (f"transfers {fr.NOT_MEASURED}" if transfers is None else
                  f"{transfers:,} transfer{'' if transfers == 1 else 's'}{_omitted(record)}")
               + " · ",
               dcc.Link("link to this request", href=f"{PATH}?{urlencode(link)}")]
    return fr.waterfall(record), details


def _omitted(record: dict) -> str:
    """What the waterfall leaves out: the transfers past the agent's cap per request."""
    n = int(record.get("transfers_omitted") or 0)
    drawn = len(record.get("transfers") or ())
    return f" ({drawn:,} drawn, {n:,} past the agent's cap per request)" if n else ""


def _ms(seconds: float | None) -> str:
    return fr.NOT_MEASURED if seconds is None else f"{float(seconds) * 1000:.3g} ms"
