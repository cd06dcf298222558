"""Shared pytest fixtures: repository paths, free ports, and a running `kvscope demo`.

The `demo` fixture starts the real demo (`python -m kvscope demo`) once per session on two free
loopback ports and stops it with SIGINT (Ctrl-C) at the end, asserting a clean exit (code 0).
The `vllm_plain_outputs` fixture runs the vLLM driver's ``plain`` mode once per session (the
reference outputs every vLLM offloading proof compares against).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS_DIR = REPO_ROOT / "test-artifacts"

DEMO_START_TIMEOUT_S = 120.0  # torch import + engine warm-up on a 2-core machine
DEMO_STOP_TIMEOUT_S = 30.0
DEMO_DURATION_S = 3600  # seconds; an upper bound: the session stops it, after 20-35 min of tests


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll until ``predicate()`` holds (True) or ``timeout`` seconds pass (False): a bound
    against hanging, not a speed assertion."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def http_exchange(port: int, method: str, target: str, headers: dict[str, str] | None = None,
                  body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request to 127.0.0.1:``port`` on a new connection, headers sent as given
    (latin-1): (status, lowercase headers, body). A connection the server drops raises here
    (http.client's RemoteDisconnected, ConnectionResetError)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value.encode("latin-1"))
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """Return n distinct free loopback ports (sockets held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_agent(env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """`kvscope agent` started on a free loopback port (its ingest on another), its output
    discarded, with ``env`` (default this process's): (the process, its HTTP port)."""
    port, ingest = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "agent", "--port", str(port),
                             "--ingest", f"tcp://127.0.0.1:{ingest}"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, port


def agent_samples(proc: subprocess.Popen, port: int, ready, timeout: float = 60.0) -> list:
    """The dashboard samples of the agent ``proc`` serving ``port`` (as the dashboard reads
    them), once ``ready(newest sample)`` holds; AssertionError with the process's exit code
    and the newest sample when it does not within ``timeout`` seconds."""
    from kvscope.dashboard.backend import AgentBackend, BackendUnavailable

    backend = AgentBackend(f"http://127.0.0.1:{port}")
    samples: list = []

    def seen() -> bool:
        nonlocal samples
        try:
            samples = backend.fetch_samples()
        except BackendUnavailable:
            return False
        return bool(samples) and ready(samples[-1])
    assert wait_until(seen, timeout=timeout), (proc.poll(), samples[-1:])
    return samples


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted at ``path`` (made if missing) with mount ``options`` (e.g.
    "size=64k": a small disk that fills; "ro": one that denies root too), unmounted after;
    skips the test where mounting is not allowed (CI runs as root, where it is)."""
    path.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def artifacts_dir() -> Path:
    """test-artifacts/ under the repository root (git-ignored), created on demand."""
    ARTIFACTS_DIR.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS_DIR


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET on url, or None when nothing answers (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def log_tail(path: Path, n_chars: int = 4000) -> str:
    """The last n_chars characters of a log file ('' when it does not exist)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-n_chars:].decode("utf-8", errors="replace")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def artifacts() -> Path:
    return artifacts_dir()


@dataclasses.dataclass(frozen=True)
class Demo:
    """A running `kvscope demo`: URLs of its agent (metrics + API) and dashboard, and its process."""

    metrics_port: int
    ui_port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.api_url}/metrics"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.ui_port}/"

    def log_tail(self, n_chars: int = 4000) -> str:
        return log_tail(self.log_path, n_chars)


def _wait_ready(demo: Demo, deadline: float) -> None:
    """Poll until /healthz answers 200 and the UI port answers; fail early if the demo exits."""
    health_url = f"{demo.api_url}/healthz"
    while True:
        rc = demo.proc.poll()
        if rc is not None:
            pytest.fail(
                f"kvscope demo exited early with code {rc}; log {demo.log_path}:\n{demo.log_tail()}"
            )
        if http_status(health_url) == 200 and http_status(demo.ui_url, timeout=5.0) is not None:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"kvscope demo not ready after {DEMO_START_TIMEOUT_S:.0f}s "
                f"({health_url} and {demo.ui_url}); log {demo.log_path}:\n{demo.log_tail()}"
            )
        time.sleep(0.5)


def sigint_default() -> None:
    """A child's ``preexec_fn``: SIGINT as Ctrl-C delivers it, whatever pytest inherited (a
    shell script's background job starts with it ignored, and a demo stopped with SIGINT then
    prints "stop with kill" and runs on)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen) -> int | None:
    """SIGINT (Ctrl-C), then wait; kill if it hangs. Returns the exit code, or None if it hung."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=DEMO_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return None


@contextlib.contextmanager
def running_demo(env: dict[str, str] | None = None, log_name: str = "demo.log",
                 args: Sequence[str] = ()) -> Iterator[Demo]:
    """A real `kvscope demo` on free loopback ports (``env``: extra environment; ``args``:
    extra flags), until it is stopped with Ctrl-C afterwards; asserts it stops cleanly."""
    metrics_port, ui_port = free_ports(2)
    log_path = artifacts_dir() / log_name
    cmd = [
        sys.executable, "-m", "kvscope", "demo",
        "--duration", str(DEMO_DURATION_S),
        "--metrics-port", str(metrics_port),
        "--ui-port", str(ui_port),
        *args,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, preexec_fn=sigint_default,
        )
    started = time.monotonic()
    d = Demo(metrics_port=metrics_port, ui_port=ui_port, proc=proc, log_path=log_path)
    try:
        _wait_ready(d, started + DEMO_START_TIMEOUT_S)
        yield d
    finally:
        was_running = proc.poll() is None
        rc = _stop(proc)
    # After --duration it may have ended by itself; before that, it must still be running.
    ran_out = time.monotonic() - started >= DEMO_DURATION_S
    assert was_running or (ran_out and rc == 0), (
        f"kvscope demo died during the tests (code {rc}):\n{d.log_tail()}"
    )
    assert rc is not None, (
        f"kvscope demo did not stop within {DEMO_STOP_TIMEOUT_S:.0f}s of SIGINT; killed:\n{d.log_tail()}"
    )
    assert rc == 0, f"kvscope demo exited with code {rc} after SIGINT (want 0):\n{d.log_tail()}"


@pytest.fixture(scope="session")
def demo() -> Iterator[Demo]:
    """Session-wide `kvscope demo` on free loopback ports; asserts it stops cleanly on Ctrl-C."""
    with running_demo() as d:
        yield d


PROMETHEUS = "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Prometheus is not installed (/usr/bin/prometheus); run `bash scripts/setup.sh --test`")
PROMETHEUS_START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def running_prometheus(target: str | list[str], workdir: Path, log_name: str, rule_files=(),
                       flags=()) -> Iterator[str]:
    """A real Prometheus (Debian's package) on a free loopback port, scraping ``target``
    (host:port, or a list of them) every second with ``rule_files`` loaded, its TSDB under
    ``workdir``; yields its base URL and stops it with SIGTERM afterwards. Fails the test with
    the log's tail when it does not become ready within a bound."""
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": "kvscope", "static_configs": [
            {"targets": [target] if isinstance(target, str) else target}]}],
    }))
    log_path = artifacts_dir() / log_name
    cmd = [PROMETHEUS, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
           f"--storage.tsdb.path={workdir / 'data'}", "--storage.tsdb.retention.time=1h", *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PROMETHEUS_START_TIMEOUT_S
        while http_status(f"{url}/-/ready") != 200:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with code {proc.returncode}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready after {PROMETHEUS_START_TIMEOUT_S:.0f}s:\n"
                            f"{log_tail(log_path)}")
            time.sleep(0.25)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def vllm_plain_outputs(tmp_path_factory) -> list[list[int]]:
    """Greedy token ids of tests/vllm_driver.py ``plain`` (prefix caching, no offloading) on
    the ``shared`` workload, run once per session; skips without a vLLM environment."""
    from tests.vllm_env import run_driver, vllm_python

    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_plain")
    run_driver(python, "plain", str(tmp / "plain.json"), log=tmp / "plain.log")
    return json.loads((tmp / "plain.json").read_text())["outputs"]
