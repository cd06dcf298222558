"""End to end: a real Prometheus scrapes the running `kvscope demo` and sees prompt-token sources.

Uses Debian's `prometheus` package (installed by `scripts/setup.sh --test`). Prometheus listens on a
free loopback port, keeps its TSDB in tmp_path, scrapes the demo every second and loads the
project's recording rules, so the rules are checked against the metrics the agent really exports.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO_ROOT, artifacts_dir, free_port, http_status, log_tail

PROMETHEUS = "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else shutil.which("prometheus")
RULES = REPO_ROOT / "grafana" / "rules" / "kvscope.rules.yml"

START_TIMEOUT_S = 60.0
DATA_TIMEOUT_S = 90.0  # bound on polling for scraped data; not a speed assertion
POLL_S = 1.0
WANT_SOURCES = {"gpu", "cpu", "recompute"}


@dataclass(frozen=True)
class Prom:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/<path>; returns the JSON `data` field (raises on a non-success status)."""
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{q}", timeout=10) as resp:
            body = json.load(resp)
        assert body.get("status") == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; returns the vector result (list of {metric, value})."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]


def _config(target: str) -> str:
    # JSON is valid YAML, so no YAML library is needed.
    return json.dumps(
        {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "kvscope", "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}
            ],
        },
        indent=2,
    )


pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Prometheus is not installed (/usr/bin/prometheus); run `bash scripts/setup.sh --test`",
)


@pytest.fixture
def prometheus(demo, tmp_path: Path) -> Iterator[Prom]:
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(_config(f"127.0.0.1:{demo.metrics_port}"))
    log_path = artifacts_dir() / "prometheus.log"
    cmd = [
        PROMETHEUS,
        f"--config.file={cfg}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        "--storage.tsdb.retention.time=1h",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    prom = Prom(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while http_status(f"{prom.url}/-/ready") != 200:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with code {proc.returncode}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready after {START_TIMEOUT_S:.0f}s:\n{log_tail(log_path)}")
            time.sleep(0.25)
        yield prom
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@dataclass
class Seen:
    target_health: str | None = None
    target_error: str | None = None
    sources: frozenset[str] = frozenset()
    token_rate: float = 0.0
    share_sums: dict[str, float] | None = None

    def done(self) -> bool:
        return (
            self.target_health == "up"
            and WANT_SOURCES <= self.sources
            and self.token_rate > 0
            and bool(self.share_sums)
        )


def _observe(prom: Prom, demo_target: str) -> Seen:
    seen = Seen()
    for t in prom.api("targets", state="active")["activeTargets"]:
        if t["labels"].get("instance") == demo_target:
            seen.target_health, seen.target_error = t["health"], t.get("lastError")
    seen.sources = frozenset(r["metric"].get("source", "") for r in prom.query("kvscope_prompt_tokens_total"))
    rate = prom.query("sum(rate(kvscope_prompt_tokens_total[30s]))")
    seen.token_rate = float(rate[0]["value"][1]) if rate else 0.0
    shares = prom.query("sum by (instance) (kvscope:prompt_tokens:share_by_source_rate5m)")
    seen.share_sums = {r["metric"].get("instance", ""): float(r["value"][1]) for r in shares}
    return seen


def test_prometheus_scrapes_demo(demo, prometheus: Prom) -> None:
    target = f"127.0.0.1:{demo.metrics_port}"
    deadline = time.monotonic() + DATA_TIMEOUT_S
    seen = _observe(prometheus, target)
    while not seen.done() and time.monotonic() < deadline:
        assert demo.proc.poll() is None, f"kvscope demo exited:\n{demo.log_tail()}"
        time.sleep(POLL_S)
        seen = _observe(prometheus, target)

    assert seen.target_health == "up", f"scrape target {target}: {seen.target_health} ({seen.target_error})"
    assert WANT_SOURCES <= seen.sources, f"sources seen: {sorted(seen.sources)}"
    assert seen.token_rate > 0, "sum(rate(kvscope_prompt_tokens_total[30s])) is 0"
    # The recording rule's shares over all sources add up to 1 for the demo's instance.
    assert seen.share_sums and target in seen.share_sums, f"no share records: {seen.share_sums}"
    assert seen.share_sums[target] == pytest.approx(1.0, abs=1e-9)
