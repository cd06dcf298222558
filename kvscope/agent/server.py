"""Serving the agent's API: bind the port up front (so a taken port is a clear error before
anything starts) and run uvicorn on a thread that stops cleanly."""

from __future__ import annotations

import errno
import socket
import threading

import uvicorn
from fastapi import FastAPI


def url(host: str, port: int, path: str = "/") -> str:
    """``http://host:port/path``, an IPv6 ``host`` in brackets (RFC 3986, section 3.2.2)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"


class PortInUse(OSError):
    """The address cannot be bound; the message names it and the flag that changes it."""


def bind(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to ``host:port``. Raises :class:`PortInUse` naming ``flag``."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        # an unresolvable name (socket.gaierror) or a foreign address lands here too
        advice = (f"pass a free port with {flag}" if exc.errno == errno.EADDRINUSE
                  else "check --host: it must be an address of this machine")
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}; {advice}") from None
    sock.listen()  # listening now, so no other socket (e.g. the ZMQ ingest) can share the port
    return sock


class ApiServer:
    """Runs ``app`` with uvicorn on the bound ``sock`` in a daemon thread."""

    def __init__(self, app: FastAPI, sock: socket.socket) -> None:
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="kvscope-api", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop serving and wait for the thread; safe twice and before start."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
