"""Builds the kvscope Dash app and serves it in-process.

:func:`create_app` wires a data backend (one agent, or a Prometheus server for a fleet) to the
pages — Overview, Requests, Tiers, Sizing — under one shell (navigation, instance selector,
pause button, live refresh). Routing is a ``dcc.Location`` callback rather than Dash's global
page registry, so several independent apps can live in one process (tests build many).
:func:`serve` runs the app's WSGI server on a daemon thread (``kvscope dashboard``, ``kvscope demo``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable

import dash
from dash import Input, Output, dcc, html
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from kvscope.analysis.trace import AccessTrace
from kvscope.dashboard.access import protect, resolve_roots
from kvscope.dashboard.backend import AgentBackend, Backend, BackendUnavailable
from kvscope.dashboard.offload_verdict import Settings as OffloadSettings
from kvscope.dashboard.pages import compare, overview, requests, sizing, tiers
from kvscope.dashboard.pages.common import Context
from kvscope.dashboard.sizing import SizingSource
from kvscope.service.server import MAX_CONNECTIONS, READ_TIMEOUT, bind
from kvscope.service.server import url as http_url

# A callback's request carries its inputs and states: a page's are kilobytes; a body past this
# is refused (413) before it is read (a 40 MiB one was read and parsed whole)
MAX_BODY = 8 << 20

PAGES = (overview, requests, tiers, sizing, compare)
NAV_STYLE = {"marginRight": "14px", "textDecoration": "none", "color": "#1f4e99",
             "fontWeight": "500"}


def create_app(api_url: str | None = None, refresh_seconds: float = 2.0,
               window_seconds: float = 900.0, *, backend: Backend | None = None,
               sizing_trace: str | None = None, sizing_preset: str = "llama-3-8b",
               sizing_gpu_tokens: int | None = None,
               sizing_accesses: Callable[[], AccessTrace] | None = None,
               sizing_preset_flag: str = "--sizing-preset", max_points: int = 720,
               token: str | None = None, capture_roots: Iterable[str | os.PathLike] = (),
               require_token: str | None = None,
               offload_settings: OffloadSettings | None = None) -> dash.Dash:
    """A new Dash app showing the agent at ``api_url`` (e.g. ``http://127.0.0.1:9400``), or
    ``backend`` (e.g. a :class:`~kvscope.dashboard.prometheus.PrometheusBackend`).

    ``refresh_seconds``: seconds between refreshes. ``window_seconds``: seconds of history
    drawn, counted back from the newest sample. ``sizing_trace``: a trace file for the Sizing
    page, analysed in the background with model ``sizing_preset`` and a GPU prefix cache of
    ``sizing_gpu_tokens`` tokens (None: a capture's gpu tier, else none); ``sizing_accesses``
    makes the block accesses instead, which ``sizing_trace`` then names;
    ``sizing_preset_flag``: the option that sets ``sizing_preset``, as the page names it.
    ``max_points``: points per series at most. ``token``: the agent's bearer token, when it
    has one.
    ``capture_roots``: the directories the Compare page may read (none: it reads nothing).
    ``require_token``: the token every visitor must present (None: open; see
    :mod:`kvscope.dashboard.access`).
    ``offload_settings``: the thresholds and TTFT budget of the Overview's "Should I offload
    here?" (None: the defaults of :class:`~kvscope.dashboard.offload_verdict.Settings`). Each
    call builds an independent app.
    """
    if backend is None:
        if api_url is None:
            raise ValueError("create_app needs api_url or backend")
        backend = AgentBackend(api_url, token=token)
    source = SizingSource(sizing_trace, sizing_preset, sizing_gpu_tokens,
                          accesses=sizing_accesses, preset_flag=sizing_preset_flag)
    source.start()
    ctx = Context(backend, window_seconds, max_points, source, resolve_roots(capture_roots),
                  offload_settings or OffloadSettings())
    app = dash.Dash(__name__, title="kvscope", update_title=None,
                    use_pages=False, pages_folder="")
    app.layout = shell(refresh_seconds, fleet=backend.kind == "prometheus")
    app.validation_layout = html.Div([shell(refresh_seconds, fleet=True),
                                      *[page.layout() for page in PAGES]])
    app.kvscope = ctx  # for tests and benchmarks: the backend and settings behind the app
    app.server.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    if require_token is not None:
        protect(app.server, require_token)
    register_shell(app, ctx)
    for page in PAGES:
        page.register_callbacks(app, ctx)
    return app


def shell(refresh_seconds: float, fleet: bool = False) -> html.Div:
    """The frame around every page: title, navigation, instance selector (fleet only), pause
    button; the URL, the refresh interval, and the page container."""
    nav = [dcc.Link(page.NAME, href=page.PATH, id=f"nav-{page.NAME.lower()}", style=NAV_STYLE)
           for page in PAGES]
    return html.Div([
        dcc.Location(id="url", refresh="callback-nav"),
        html.Div([
            html.H2("kvscope", style={"margin": "0 20px 0 0"}),
            html.Nav(nav, style={"marginRight": "auto"}),
            dcc.Dropdown(id="instance", placeholder="all instances", clearable=True,
                         style={"width": "260px", "marginRight": "12px",
                                **({} if fleet else {"display": "none"})}),
            html.Button("Pause", id="pause", n_clicks=0,
                        style={"marginRight": "8px", "padding": "4px 14px"}),
        ], style={"display": "flex", "alignItems": "center", "padding": "12px 16px",
                  "borderBottom": "1px solid #ddd"}),
        dcc.Interval(id="refresh", interval=int(refresh_seconds * 1000), n_intervals=0),
        html.Div(id="page"),
    ], style={"fontFamily": "system-ui, sans-serif"})


def register_shell(app: dash.Dash, ctx: Context) -> None:
    """Routing, pause, and the instance list."""

    @app.callback(Output("page", "children"), Input("url", "pathname"))
    def _route(pathname: str | None):
        return route(pathname)

    @app.callback(Output("refresh", "disabled"), Output("pause", "children"),
                  Input("pause", "n_clicks"))
    def _pause(n_clicks: int) -> tuple[bool, str]:
        return pause_state(n_clicks)

    if ctx.backend.kind == "prometheus":
        @app.callback(Output("instance", "options"), Input("refresh", "n_intervals"))
        def _instances(_n):
            try:
                return ctx.backend.instances()
            except BackendUnavailable:
                return dash.no_update


def route(pathname: str | None):
    """The layout of the page at ``pathname`` (a trailing slash is ignored); unknown paths get
    a short "not found" with links."""
    path = (pathname or "/").rstrip("/") or "/"
    for page in PAGES:
        if page.PATH == path:
            return page.layout()
    return html.Div([html.H3(f"no page at {path}"),
                     html.P(["Pages: ", *[dcc.Link(p.NAME + " ", href=p.PATH) for p in PAGES]])],
                    style={"padding": "16px"})


def pause_state(n_clicks: int | None) -> tuple[bool, str]:
    """(interval disabled?, button label) after ``n_clicks`` clicks: odd counts pause."""
    paused = bool(n_clicks) and n_clicks % 2 == 1
    return paused, ("Resume" if paused else "Pause")


class _QuietHandler(WSGIRequestHandler):
    """Werkzeug's handler without the per-request access log (errors are still logged), with
    the agent's bounds (:mod:`kvscope.service.server`): a client silent for ``timeout``
    seconds mid-request is let go, and past the server's ``slots`` connections a new one is
    answered 503 and closed. Werkzeug's threaded server has neither: 200 clients that sent
    half a request each held a thread apiece for good, the token check (which needs the
    whole request) no help."""

    timeout = READ_TIMEOUT

    def handle(self) -> None:
        slots = self.server.slots
        if not slots.acquire(blocking=False):
            self.connection.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0"
                                    b"\r\nConnection: close\r\n\r\n")
            return
        try:
            super().handle()
        finally:
            slots.release()

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        return


class ServerHandle:
    """A running dashboard server: ``host``, ``port`` (the bound one), ``url``; call
    :meth:`shutdown` to stop it."""

    def __init__(self, server: BaseWSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._lock = threading.Lock()
        self._stopped = False
        self.host: str = server.host
        self.port: int = server.port

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:8050`` (IPv6 hosts in brackets)."""
        return http_url(self.host, self.port, "")

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serving and wait up to ``timeout`` seconds for the thread; safe to call twice."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.shutdown()
        self._thread.join(timeout)


def serve(app: dash.Dash, host: str = "127.0.0.1", port: int = 8050,
          flag: str = "--port", max_connections: int = MAX_CONNECTIONS) -> ServerHandle:
    """Serve ``app`` on ``host``:``port`` from a daemon thread; port 0 picks a free port; at
    most ``max_connections`` at once (see :class:`_QuietHandler`).

    Raises :class:`~kvscope.service.server.PortInUse`, naming ``flag`` (or ``--host``), when the
    address cannot be bound. (The socket is bound here because werkzeug's own bind error calls
    ``sys.exit``.)
    """
    sock = bind(host, port, flag)
    try:
        server = make_server(host, port, app.server, threaded=True,
                             request_handler=_QuietHandler, fd=sock.fileno())
    finally:
        sock.close()  # the server holds its own duplicate of the descriptor
    server.slots = threading.BoundedSemaphore(max_connections)
    thread = threading.Thread(target=server.serve_forever, name="kvscope-dashboard",
                              daemon=True)
    thread.start()
    return ServerHandle(server, thread)
