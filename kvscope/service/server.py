"""Serving the agent's API: bind the port up front (so a taken port is a clear error before
anything starts) and run uvicorn on a thread that stops cleanly."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import resource
import socket
import threading
import time

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol


def address(host: str, port: int) -> str:
    """``host:port``, an IPv6 ``host`` in brackets (RFC 3986, section 3.2.2): ``[::]:9400``."""
    return f"{f'[{host}]' if ':' in host else host}:{port}"


def url(host: str, port: int, path: str = "/") -> str:
    """``http://host:port/path`` (see :func:`address`)."""
    return f"http://{address(host, port)}{path}"


class PortInUse(OSError):
    """The address cannot be bound; the message names it and the flag that changes it."""


def bind(host: str, port: int, flag: str, host_flag: str = "--host") -> socket.socket:
    """A TCP socket bound to ``host:port``. Raises :class:`PortInUse` naming ``flag`` (what
    sets the port) or ``host_flag`` (what sets the host)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        # an unresolvable name (socket.gaierror) or a foreign address lands here too
        advice = (f"pass a free port with {flag}" if exc.errno == errno.EADDRINUSE
                  else f"check {host_flag}: it must be an address of this machine")
        raise PortInUse(f"cannot listen on {address(host, port)}: {exc.strerror}; "
                        f"{advice}") from None
    sock.listen()  # listening now, so no other socket (e.g. the ZMQ ingest) can share the port
    return sock


GRACE_SECONDS = 3.0  # what requests under way get to finish when the server stops
# Connections (or requests under way) at once; past it uvicorn answers 503 at once. Scrapes,
# dashboards and OTLP exporters need a few; the cap bounds the sockets and tasks that clients
# which connect and then stall can hold.
MAX_CONNECTIONS = 256
# seconds a client has to send a request's headers and body, from connecting or from the
# previous response (Go's http.Server calls the headers' part ReadHeaderTimeout)
READ_TIMEOUT = 10.0


class _ReadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request has not arrived whole
    within ``read_timeout`` seconds. uvicorn closes a connection idle after a response, but not
    one that sends nothing, part of its headers or part of a body: clients that connect and
    stall would hold every one of the :data:`MAX_CONNECTIONS` slots, and the agent would answer
    503 to scrapes and health probes for as long as they stay. A request received whole is
    never cut, however long its response takes."""

    def __init__(self, *args, read_timeout: float = READ_TIMEOUT, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.read_timeout, self._read_expired)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._deadline.cancel()
        self._deadline = self.loop.call_later(self.read_timeout, self._read_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.cancel()
        super().connection_lost(exc)

    def _read_expired(self) -> None:
        # IDLE: no whole request line and headers yet; SEND_BODY: its body not all sent
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


class _NoCancelledTraceback(logging.Filter):
    """Drops uvicorn's traceback of a request cancelled when the grace period ran out: its own
    line ("Cancel N running task(s), timeout graceful shutdown exceeded") says it already."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


_QUIET = _NoCancelledTraceback()
ACCEPT_ERROR_EVERY = 60.0  # seconds between two log lines of a listening socket out of fds


class _AcceptErrorsEvery(logging.Filter):
    """Lets asyncio's "socket.accept() out of system resource" (the process is out of file
    descriptors) through once per :data:`ACCEPT_ERROR_EVERY` seconds. CPython 3.11's accept
    loop logs it, with a traceback, once for every connection of the listen backlog on every
    try (uvicorn's backlog is 2048): a tryout's agent wrote 163 MB of them in 24 s."""

    def __init__(self) -> None:
        super().__init__()
        self._next = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + ACCEPT_ERROR_EVERY
        return True


_ACCEPT_ERRORS = _AcceptErrorsEvery()


def raise_open_files_limit(cap: int = 1 << 20) -> int:
    """Raise this process's soft limit of open files to its hard limit (at most ``cap``), as
    Go programs do from the start (Go 1.19): every ingest connection, request and segment
    holds a descriptor, and systemd's default soft limit of 1,024 runs out under a thousand
    local connections. Returns the soft limit now; never raises (a limit that cannot be
    changed stays as it was)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            pass
    return soft


class ApiServer:
    """Runs ``app`` with uvicorn on the bound ``sock`` in a daemon thread, with at most
    ``max_connections`` connections at once (the next client gets 503), each given
    ``read_timeout`` seconds to send a request whole (headers and body) or be closed."""

    def __init__(self, app: FastAPI, sock: socket.socket,
                 max_connections: int = MAX_CONNECTIONS,
                 read_timeout: float = READ_TIMEOUT) -> None:
        # without a grace limit uvicorn waits for every request under way, so one client that
        # stalls inside its body would keep the agent from stopping
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                     http=functools.partial(
                                                         _ReadDeadline, read_timeout=read_timeout),
                                                     timeout_graceful_shutdown=GRACE_SECONDS,
                                                     limit_concurrency=max_connections))
        uvicorn_log = logging.getLogger("uvicorn.error")
        if _QUIET not in uvicorn_log.filters:
            uvicorn_log.addFilter(_QUIET)
        asyncio_log = logging.getLogger("asyncio")
        if _ACCEPT_ERRORS not in asyncio_log.filters:
            asyncio_log.addFilter(_ACCEPT_ERRORS)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="kvscope-api", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop serving and wait for the thread (requests under way get
        :data:`GRACE_SECONDS`); safe twice and before start."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
