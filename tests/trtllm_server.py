"""A stand-in for ``trtllm-serve`` on loopback, for tests: the two routes kvscope reads, with
their real paths and methods (TensorRT-LLM ``tensorrt_llm/serve/openai_server.py``,
``register_routes`` and ``mount_metrics``): ``POST /kv_cache_events`` answers the next recorded
drain body (a drain empties the engine's queue, so each body is answered once; then ``[]``),
``GET /prometheus/metrics`` the next recorded exposition (the last one again once they run
out). Another method on either path answers 405, as FastAPI does; another path 404.

A drain may also be a :class:`Cut` (the answer stops short and the connection closes) or a
:class:`Trickle` (its bytes come slower than any timeout). The bodies are what TensorRT-LLM's
serializer and metric collector print: recorded under ``tests/data/trtllm/`` (its README cites
the sources).
"""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "trtllm"
EVENTS, METRICS = "/kv_cache_events", "/prometheus/metrics"


@dataclass(frozen=True)
class Cut:
    """A drain that sends ``body`` of a longer ``Content-Length``, then closes the
    connection."""

    body: bytes


@dataclass(frozen=True)
class Trickle:
    """A drain that sends a long ``Content-Length``, then one byte per 0.2 s."""


class TrtllmServer:
    """The server (see the module). ``drains``: bodies (bytes), :class:`Cut` or
    :class:`Trickle`, one per ``POST``; ``expositions``: texts, one per ``GET``. ``url``: its
    base URL; ``posts``: drains asked for so far. Append to ``drains`` and ``expositions`` while
    it runs."""

    def __init__(self, drains: Iterable = (), expositions: Iterable[str] = ()) -> None:
        self.drains = deque(drains)
        self.expositions = deque(expositions)
        self.posts = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 (http.server's name)
                if self.path != EVENTS:
                    return self._send(404 if self.path != METRICS else 405, b"{}")
                owner.posts += 1
                drain = owner.drains.popleft() if owner.drains else b"[]"
                if isinstance(drain, Cut):
                    return self._send(200, drain.body, length=len(drain.body) + 1000,
                                      close=True)
                if isinstance(drain, Trickle):
                    return self._trickle()
                return self._send(200, drain)

            def do_GET(self):  # noqa: N802
                if self.path != METRICS:
                    return self._send(405 if self.path == EVENTS else 404, b"{}")
                text = (owner.expositions.popleft() if len(owner.expositions) > 1
                        else owner.expositions[0] if owner.expositions else "")
                self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

            def _send(self, status, body, kind="application/json", length=None, close=False):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                if close:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                if close:
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(2)  # socket.SHUT_RDWR

            def _trickle(self):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(10**8))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client gave up: as the test wants
                    for _ in range(300):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.2)
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def serving_trtllm(drains: Iterable = (), expositions: Iterable[str] = ()
                   ) -> Iterator[TrtllmServer]:
    """A :class:`TrtllmServer` for the ``with`` block, e.g. ``with serving_trtllm([(DATA /
    "drain-1.json").read_bytes()]) as server: ... server.url``."""
    server = TrtllmServer(drains, expositions)
    try:
        yield server
    finally:
        server.close()
