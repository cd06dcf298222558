"""Pure builders for the Requests page: table rows from request records, and one request's
waterfall. A *record* is the agent's RequestRecord as JSON (``/api/v1/requests``): times
``arrival``/``finished`` in Unix seconds, TTFT parts ``queueing``, ``lookup``,
``promotion_wait``, ``prefill`` and ``ttft`` in seconds, ``tokens``: dict[source, tokens],
``transfers``: [{src, dst, blocks, bytes, start (Unix s), duration (s), ok}], ``trace_id``.
"""

from __future__ import annotations

import json

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timezone

import plotly.graph_objects as go

from kvscope.dashboard.figures import COLOURS, message_figure, new_figure
from kvscope.dashboard.series import bytes_text
from kvscope.vocabulary import NOT_MEASURED, OFFLOAD_TIERS, TOKEN_SOURCES

WATERFALL_TITLE = "Request waterfall"
NO_TIER = "no tier"  # an offload tier's tokens where the agent reports no such tier

# DataTable columns: (id, header, type); numbers are sortable and filterable as numbers.
COLUMNS = (
    ("request_id", "request", "text"),
    ("source", "source", "text"),  # the tap that reported it (two may use the same ids)
    ("instance", "instance", "text"),  # the agent, in a fleet (two nodes may use the same ids)
    ("finished", "finished (UTC)", "text"),
    ("ttft_ms", "TTFT (ms)", "numeric"),
    ("prompt_tokens", "prompt tokens", "numeric"),
    *((f"tokens_{s}", f"{s} tokens", "numeric") for s in TOKEN_SOURCES),
    ("promotion_wait_ms", "promotion wait (ms)", "numeric"),
    ("transfers", "transfers", "numeric"),
)


def _num(record: Mapping, key: str) -> float:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _ms(record: Mapping, key: str) -> float | None:
    """``record[key]`` seconds as milliseconds (2 decimals); None where it was not measured."""
    value = record.get(key)
    return round(float(value) * 1000, 2) if isinstance(value, (int, float)) else None


def _part(label: str, record: Mapping, key: str) -> str:
    """A waterfall row's label: ``label``, marked when ``record`` did not measure ``key``."""
    return label if isinstance(record.get(key), (int, float)) else f"{label}: {NOT_MEASURED}"


def _clock(ts: float | None) -> str:
    if not isinstance(ts, (int, float)):
        return ""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def table_rows(records: Sequence[Mapping], tiers: Collection[str] | None = None,
               unconfigured: Collection[str] = ()) -> list[dict]:
    """One DataTable row per record; ``id`` names the request uniquely (instance, source and
    request id: engines may share ids) so a selected cell finds its row; times in ms rounded
    to 0.01 ms; ``instance`` "" outside a fleet. What the record does not hold is None (the
    grid shows "not measured"): a TTFT, a promotion wait, tokens by source (none at all: a
    source that did not report them), transfers (:func:`transfer_count`). An offload tier's
    tokens are None too where ``tiers``, those the agent reports, when given, lack that tier
    and the record has none from it (no disk tier read "disk tokens 0"). ``no_tier`` lists
    such columns of the ``unconfigured`` tiers, those the samples show nowhere, which the grid
    shows as "no tier" (the Tiers page's "no disk tier configured"), not "not measured"."""
    rows = []
    absent = [f"tokens_{s}" for s in TOKEN_SOURCES if s in unconfigured]
    for r in records:
        tokens = r.get("tokens") or {}
        request_id, source = r.get("request_id", ""), r.get("source", "")
        row = {
            "id": json.dumps([r.get("instance", ""), source, request_id]),
            "request_id": request_id, "source": source, "instance": r.get("instance", ""),
            "finished": _clock(r.get("finished")),
            "ttft_ms": _ms(r, "ttft"),
            "prompt_tokens": int(_num(r, "prompt_tokens")),
            **{f"tokens_{s}": _tokens(tokens, s, tiers) for s in TOKEN_SOURCES},
            "promotion_wait_ms": _ms(r, "promotion_wait"),
            "transfers": transfer_count(r),
        }
        row["no_tier"] = [c for c in absent if tokens and row[c] is None]
        rows.append(row)
    return rows


def _tokens(tokens: Mapping, source: str, tiers: Collection[str] | None) -> int | None:
    if not tokens or (tiers is not None and source in OFFLOAD_TIERS and source not in tiers
                      and not tokens.get(source)):
        return None
    return int(tokens.get(source, 0))


def transfer_count(record: Mapping) -> int | None:
    """The request's transfers: those its record lists and those left out of the list
    (``transfers_omitted``, past the agent's cap per request); None (not measured) for a
    record no tap saw (no tokens by source, no transfer: vLLM's span alone), whose
    promotions, if any, nobody timed."""
    n = len(record.get("transfers") or ()) + int(record.get("transfers_omitted") or 0)
    return n if n or record.get("tokens") else None


def waterfall(record: Mapping) -> go.Figure:
    """The request on one time axis (ms since arrival): queueing, lookup, each transfer hop
    (tiers, blocks, bytes, measured duration, at its measured start), promotion wait, prefill
    of the recomputed tokens, and the first token. Parts that took 0 s still get their row;
    a part the engine did not measure (None) is labelled so, not drawn as 0 s."""
    arrival = _num(record, "arrival")
    q, lk = _num(record, "queueing") * 1000, _num(record, "lookup") * 1000
    wait, prefill = _num(record, "promotion_wait") * 1000, _num(record, "prefill") * 1000
    ttft = _num(record, "ttft") * 1000 if record.get("ttft") is not None else q + lk + wait + prefill
    tokens = record.get("tokens") or {}  # none: no lookup reported (vLLM's span alone)
    recomputed = (f"{int(tokens.get('recompute', 0)):,} recomputed tokens" if tokens
                  else f"recomputed tokens {NOT_MEASURED}")
    rows: list[tuple[str, float, float, str, str]] = [  # (label, start, duration, colour, note)
        ("arrival → queueing", 0.0, q, "#bbbbbb", ""),
        (_part("lookup", record, "lookup"), q, lk, "#7f7f7f", ""),
    ]
    for i, t in enumerate(record.get("transfers") or ()):
        direction = f"{t.get('src')}->{t.get('dst')}"
        ok = t.get("ok", True)
        label = (f"#{i + 1} {direction} · {int(t.get('blocks', 0))} blocks · "
                 f"{bytes_text(float(t.get('bytes', 0)))}" + ("" if ok else " · FAILED"))
        start = (float(t.get("start", arrival)) - arrival) * 1000
        rows.append((label, start, float(t.get("duration", 0.0)) * 1000,
                     COLOURS.get(direction, "#8c564b") if ok else "#d62728", direction))
    rows += [(_part("promotion wait", record, "promotion_wait"), q + lk, wait, "#9467bd", ""),
             (f"prefill ({recomputed})", q + lk + wait, prefill, "#d62728", "")]
    accounted = q + lk + wait + prefill
    if ttft - accounted > max(0.01 * ttft, 1e-3):  # the engine did not report every part
        rows.append(("not attributed by the engine", accounted, ttft - accounted, "#e0e0e0", ""))
    end = max([ttft] + [r[1] + r[2] for r in rows])
    labels = [r[0] for r in rows] + ["first token"]
    fig = new_figure()
    fig.add_trace(go.Bar(
        y=[r[0] for r in rows], x=[max(r[2], 1e-6) for r in rows], base=[r[1] for r in rows],
        orientation="h", marker_color=[r[3] for r in rows], showlegend=False,
        text=["" if r[0].endswith(NOT_MEASURED) else f"{r[2]:.3g} ms" for r in rows],
        textposition="outside", cliponaxis=False,
        customdata=[[r[1], r[2]] for r in rows],
        hovertemplate="%{y}<br>start %{customdata[0]:.3f} ms, took %{customdata[1]:.3f} ms"
                      "<extra></extra>"))
    fig.add_trace(go.Scatter(
        y=["first token"], x=[ttft], mode="markers+text", marker={"symbol": "diamond",
                                                                   "size": 14, "color": "#000"},
        text=[f"TTFT {ttft:.3g} ms"], textposition="middle right", showlegend=False,
        hovertemplate="first token at %{x:.3f} ms<extra></extra>"))
    fig.add_vline(x=ttft, line={"color": "#000", "dash": "dot", "width": 1})
    arrived = datetime.fromtimestamp(arrival, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    fig.update_layout(
        title={"text": f"{WATERFALL_TITLE}: {record.get('request_id', '')} · arrived {arrived} "
                       f"UTC · trace {record.get('trace_id', '')}", "x": 0.01,
               "font": {"size": 14}},
                      height=140 + 34 * len(labels), bargap=0.35,
        margin={"l": 260, "r": 90, "t": 50, "b": 45}, uirevision=record.get("request_id"))
    fig.update_xaxes(title_text="time since arrival (ms)", ticksuffix=" ms",
                     range=[0, (end or 1.0) * 1.18])
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=labels,
                     autorange="reversed")
    return fig


def waterfall_placeholder(message: str = "select a request in the table") -> go.Figure:
    """The waterfall's empty state."""
    return message_figure(WATERFALL_TITLE, message, height=260)
