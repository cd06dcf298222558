"""What the pages share: their context (backend, window, sizing), the status line, and the
components every page uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import plotly.graph_objects as go
from dash import dcc, html

from kvscope.dashboard.backend import Backend, BackendUnavailable
from kvscope.dashboard.offload_verdict import Settings as OffloadSettings
from kvscope.dashboard.sizing import SizingSource

GRID_STYLE = {"display": "grid", "gap": "8px", "padding": "8px",
              "gridTemplateColumns": "repeat(auto-fit, minmax(520px, 1fr))"}
STATUS_STYLE = {"color": "#555", "padding": "6px 16px", "fontSize": "14px"}


@dataclass
class Context:
    """Everything a page's callbacks read. ``window_seconds``: seconds of history drawn;
    ``max_points``: points per series at most (older samples are thinned);
    ``capture_roots``: the resolved directories the Compare page may read
    (:mod:`kvscope.dashboard.access`); ``offload``: the thresholds of the Overview's "Should I
    offload here?" (:mod:`kvscope.dashboard.offload_verdict`)."""

    backend: Backend
    window_seconds: float = 900.0
    max_points: int = 720
    sizing: SizingSource | None = None
    capture_roots: tuple[Path, ...] = ()
    offload: OffloadSettings = OffloadSettings()


def graph(gid: str, figure: go.Figure) -> dcc.Graph:
    return dcc.Graph(id=gid, figure=figure, config={"displaylogo": False},
                     style={"minWidth": 0})


def status(gid: str) -> html.Div:
    return html.Div("connecting…", id=gid, className="kvscope-status", style=STATUS_STYLE)


def where(backend: Backend, instance: str | None) -> str:
    """"agent http://..." or "prometheus http://... · instance x" (or "· all instances")."""
    text = f"{backend.kind} {backend.base_url}"
    if backend.kind == "prometheus":
        text += f" · {'instance ' + instance if instance else 'all instances'}"
    return text


def samples_status(backend: Backend, instance: str | None, samples: Sequence[dict]) -> str:
    """The status line after reading ``samples``; none from a Prometheus that holds no agent's
    series under the selector says so (a selector matching nothing read "no samples yet")."""
    if not samples:
        if backend.kind == "prometheus" and not instance and not _any_instance(backend):
            return (f"{where(backend, instance)}: no agent's series match "
                    f"{{{getattr(backend, 'selector', '')}}}: check --prometheus-selector, and "
                    "that this Prometheus scrapes the agents")
        return f"{where(backend, instance)}: no samples yet"
    last = datetime.fromtimestamp(float(samples[-1]["ts"]), tz=timezone.utc)
    return (f"{where(backend, instance)} · {len(samples)} samples · "
            f"last {last:%H:%M:%S} UTC")


def _any_instance(backend: Backend) -> bool:
    try:
        return bool(backend.instances())
    except BackendUnavailable:  # said by the pages' own reads
        return True


def unread_status(unread: Sequence[str]) -> str:
    """" · not read: a (reason), b (reason)" for the fleet's agents a page could not read
    (:attr:`~kvscope.dashboard.backend.RequestPage.unread`), "" when it read them all."""
    return f" · not read: {', '.join(unread)}" if unread else ""
