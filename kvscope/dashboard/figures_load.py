"""The load a baseline must record (the guide: concurrency and the context-length
distribution), from the agent's request records: pure builders for the Overview page.

Records are the API's request dicts (``arrival`` and ``finished`` Unix seconds, ``prompt_tokens``);
the table holds finished requests, so concurrency counts those (a request still in flight joins
the curve when it finishes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from kvscope.dashboard.figures import base, message_figure, new_figure
from kvscope.vocabulary import NOT_MEASURED

CONCURRENCY_TITLE = "Concurrency: requests in flight (finished ones)"
PROMPT_LENGTHS_TITLE = "Context length: prompt tokens per request"
NO_RECORDS = "no finished requests yet"
# requests counted, none of them recorded one by one (vLLM's /metrics alone)
NOT_PER_REQUEST = (f"{NOT_MEASURED}: the sources count requests, not each one (vLLM's "
                   "/metrics alone: send the agent its spans, or run the tap)")


def in_flight(records: Sequence[Mapping]) -> tuple[np.ndarray, np.ndarray]:
    """(times in Unix seconds, requests in flight from each time on): +1 at each arrival, -1 at
    each finish (a finish and an arrival at one instant: the finish first). Records without
    both times are left out."""
    spans = [(float(r["arrival"]), float(r["finished"])) for r in records
             if r.get("arrival") is not None and r.get("finished") is not None]
    if not spans:
        return np.zeros(0), np.zeros(0)
    times = np.array([t for span in spans for t in span])
    steps = np.tile([1, -1], len(spans))
    order = np.lexsort((steps, times))  # by time, then -1 before +1
    return times[order], np.cumsum(steps[order])


def concurrency(records: Sequence[Mapping]) -> go.Figure:
    """Requests in flight over time, as a step line, with its peak in the legend."""
    times, counts = in_flight(records)
    if not len(times):
        return message_figure(CONCURRENCY_TITLE, NO_RECORDS)
    fig = base(CONCURRENCY_TITLE, "requests")
    fig.add_trace(go.Scatter(x=times * 1000.0, y=counts, mode="lines", line={"shape": "hv"},
                             name=f"in flight (peak {int(counts.max())})",
                             hovertemplate="%{y} requests<extra></extra>"))
    fig.update_yaxes(dtick=max(1, -(-int(counts.max()) // 5)), tickformat=",d")  # whole ones
    return fig


def prompt_lengths(records: Sequence[Mapping]) -> go.Figure:
    """Histogram of the requests' prompt lengths (tokens; up to 40 equal bins), with p50 and
    p95 marked."""
    tokens = np.array([int(r["prompt_tokens"]) for r in records if r.get("prompt_tokens")])
    if not len(tokens):
        return message_figure(PROMPT_LENGTHS_TITLE, NO_RECORDS)
    counts, edges = np.histogram(tokens, bins=min(40, max(1, len(np.unique(tokens)))))
    fig = new_figure(go.Bar(
        x=(edges[:-1] + edges[1:]) / 2, y=counts, width=np.diff(edges), name="requests",
        customdata=np.stack([edges[:-1], edges[1:]], axis=1),
        hovertemplate="%{customdata[0]:,.0f}-%{customdata[1]:,.0f} tokens: %{y} requests"
                      "<extra></extra>"))
    fig.update_layout(title={"text": PROMPT_LENGTHS_TITLE, "x": 0.01, "font": {"size": 15}},
                      height=320, margin={"l": 70, "r": 10, "t": 50, "b": 45}, bargap=0.05,
                      showlegend=False, xaxis_title="prompt tokens", yaxis_title="requests")
    for q, dash in ((50, "dash"), (95, "dot")):
        value = float(np.percentile(tokens, q))
        fig.add_vline(x=value, line_dash=dash, line_color="#444",
                      annotation_text=f"p{q} {value:,.0f}", annotation_position="top right")
    return fig
