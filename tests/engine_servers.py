"""Engines' metrics endpoints for tests, each a context manager on loopback: a recorded
exposition served over real HTTP (:func:`exposition_server`, for an engine this machine cannot
run, e.g. Dynamo KVBM), and the real LMCache multiprocess server from its cached environment
(:func:`lmcache_server`, with :meth:`LMCacheServer.drive` sending it traffic through LMCache's
own client). The cross-engine tests import them from here."""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

# scripts/vllm_env.sh --lmcache builds it (setup.sh --test runs that); the same versions there
LMCACHE_VERSION, TORCH_VERSION = "0.5.6", "2.13.0"
LMCACHE_ENV = (Path(os.environ.get("KVSCOPE_CACHE", "/var/cache/kvscope"))
               / f"lmcache-{LMCACHE_VERSION}-torch-{TORCH_VERSION}")


class Exposition:
    """A metrics endpoint on 127.0.0.1 (the standard library's HTTP server): GET ``path``
    answers 200 with ``body`` (settable between scrapes), any other path 404. ``url``: the
    endpoint's. ``trickle`` (settable), a stuck or hostile server: "body" sends a long
    Content-Length, then one byte per 0.2 s; "headers" one byte of a header per 0.2 s."""

    def __init__(self, body: str = "", path: str = "/metrics") -> None:
        owner = self
        self.body, self.trickle = body, ""

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path != path:
                    self.send_error(404)
                    return
                if owner.trickle == "headers":
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    self._trickle(b"a")
                    return
                data = owner.body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(10**8 if owner.trickle else len(data)))
                self.end_headers()
                if owner.trickle:
                    self._trickle(b"#")
                else:
                    self.wfile.write(data)

            def _trickle(self, byte: bytes) -> None:
                try:
                    for _ in range(300):
                        self.wfile.write(byte)
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:  # the scraper gave up: what a test of it wants
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def exposition_server(body: str = "", path: str = "/metrics") -> Iterator[Exposition]:
    """An :class:`Exposition` serving ``body`` at ``path``, closed on exit."""
    server = Exposition(body, path)
    try:
        yield server
    finally:
        server.close()


def lmcache_python() -> Path | None:
    """The cached LMCache environment's python, None when it is not built (or half built)."""
    python = LMCACHE_ENV / "bin" / "python"
    return python if (LMCACHE_ENV / ".ready").is_file() and python.is_file() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LMCacheServer:
    """A running ``lmcache server`` (see :func:`lmcache_server`). ``metrics_url``: its
    Prometheus text (served by its HTTP server's ``/metrics``: the OTel Prometheus fallback of
    LMCache 0.5.6 starts no metrics server of its own); ``rpc_url``: its ZMQ request
    endpoint; ``l2_dir``: its fs L2 adapter's directory; ``log``: its output so far."""

    def __init__(self, process: subprocess.Popen, rpc_port: int, http_port: int,
                 l2_dir: Path, log: Path) -> None:
        self.process = process
        self.rpc_url = f"tcp://127.0.0.1:{rpc_port}"
        self.http_url = f"http://127.0.0.1:{http_port}"
        self.metrics_url = f"{self.http_url}/metrics"
        self.l2_dir = l2_dir
        self._log = log

    def log(self) -> str:
        return self._log.read_text(errors="replace")[-4000:]

    def drive(self, start: int, end: int, tokens: int = 512,
              shape: str = "(2,64,16,8,128):float16:4", timeout: float = 300.0) -> None:
        """Requests ``start`` .. ``end - 1`` through LMCache's own client, ``lmcache bench
        server`` in CPU mode: per request a lookup (a miss the first time), a store of its
        ``tokens // 256`` full chunks from CPU KV tensors of ``shape`` (LMCache's shape spec;
        this one: 4 layers of K and V, 8 heads of 128 float16, so 256 tokens are 4 MiB), a
        second lookup and a retrieve, checked by checksum. A request's tokens follow from its
        number, so driving a number again looks up the same chunks. The transfer goes through
        POSIX shared memory (``lmcache_driven``: the server copies, as from a GPU)."""
        python = lmcache_python()
        command = [str(python), "-m", "lmcache.cli.main", "bench", "server",
                   "--rpc-url", self.rpc_url, "--url", self.http_url, "--mode", "cpu",
                   "--transfer-mode", "lmcache_driven", "--num-tokens", str(tokens),
                   "--kvcache-shape-spec", shape, "--start", str(start), "--end", str(end),
                   "--interval", "0.02", "-q"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=lmcache_env(), stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"lmcache bench server failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}\n{self.log()}")


def lmcache_env() -> dict[str, str]:
    """The environment LMCache's processes run in here: no banner, no usage reports (nothing
    outside the machine can be reached), no proxies."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false",
               DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    return env


@contextlib.contextmanager
def lmcache_server(l1_size_gb: float = 0.25, sample_rate: float = 1.0,
                   start_timeout: float = 180.0) -> Iterator[LMCacheServer]:
    """The real LMCache multiprocess server on loopback: ``lmcache server --l1-size-gb
    {l1_size_gb} --eviction-policy LRU --host 127.0.0.1`` on free ports, with an ``fs`` L2
    adapter in a temporary directory and ``--metrics-sample-rate {sample_rate}`` (the share of
    chunks its lifecycle histograms follow). Yields once its ``/metrics`` answers; stopped
    (SIGTERM, then SIGKILL) and its directory removed on exit. RuntimeError (with its log)
    when it does not come up within ``start_timeout`` seconds."""
    python = lmcache_python()
    if python is None:
        raise RuntimeError(f"no LMCache environment at {LMCACHE_ENV} "
                           "(bash scripts/vllm_env.sh --lmcache builds it)")
    work = Path(tempfile.mkdtemp(prefix="kvscope-lmcache-"))
    (work / "l2").mkdir()
    rpc_port, http_port = _free_port(), _free_port()
    log = work / "server.log"
    command = [str(python), "-m", "lmcache.cli.main", "server",
               "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU",
               "--host", "127.0.0.1", "--port", str(rpc_port),
               "--http-host", "127.0.0.1", "--http-port", str(http_port),
               "--metrics-sample-rate", str(sample_rate),
               "--l2-adapter", '{"type": "fs", "base_path": "%s"}' % (work / "l2")]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=work,
                                   env=lmcache_env(), stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    server = LMCacheServer(process, rpc_port, http_port, work / "l2", log)
    try:
        deadline = time.monotonic() + start_timeout
        while not _answers(server.metrics_url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server did not start:\n{server.log()}")
            time.sleep(0.5)
        yield server
    finally:
        _stop(process)
        shutil.rmtree(work, ignore_errors=True)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
