"""Builds the kvscope Dash app and serves it in-process.

:func:`create_app` wires the agent backend to the Overview page; :func:`serve` runs the app's
WSGI server on a daemon thread (used by ``kvscope dashboard`` and ``kvscope demo``).
"""

from __future__ import annotations

import socket
import threading

import dash
from werkzeug.serving import (
    BaseWSGIServer,
    WSGIRequestHandler,
    make_server,
    select_address_family,
)

from kvscope.dashboard.backend import AgentBackend
from kvscope.dashboard.pages import overview


def create_app(api_url: str, refresh_seconds: float = 2.0,
               window_seconds: float = 900.0) -> dash.Dash:
    """A new Dash app showing the agent at ``api_url`` (e.g. ``http://127.0.0.1:9400``).

    ``refresh_seconds``: seconds between page refreshes. ``window_seconds``: seconds of
    history drawn, counted back from the newest sample. Each call builds an independent
    app (no global page registry), so several may live in one process.
    """
    app = dash.Dash(__name__, title="kvscope", update_title=None,
                    use_pages=False, pages_folder="")
    app.layout = overview.layout(refresh_seconds)
    overview.register_callbacks(app, AgentBackend(api_url), window_seconds)
    return app


class _QuietHandler(WSGIRequestHandler):
    """Werkzeug's handler without the per-request access log (errors are still logged)."""

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
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serving and wait up to ``timeout`` seconds for the thread; safe to call twice."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.shutdown()
        self._thread.join(timeout)


def serve(app: dash.Dash, host: str = "127.0.0.1", port: int = 8050) -> ServerHandle:
    """Serve ``app`` on ``host``:``port`` from a daemon thread; port 0 picks a free port.

    Raises OSError (e.g. errno EADDRINUSE) when the address cannot be bound. (The socket is
    bound here because werkzeug's own bind error calls ``sys.exit``.)
    """
    sock = socket.create_server((host, port), family=select_address_family(host, port))
    try:
        server = make_server(host, port, app.server, threaded=True,
                             request_handler=_QuietHandler, fd=sock.fileno())
    finally:
        sock.close()  # the server holds its own duplicate of the descriptor
    thread = threading.Thread(target=server.serve_forever, name="kvscope-dashboard",
                              daemon=True)
    thread.start()
    return ServerHandle(server, thread)
