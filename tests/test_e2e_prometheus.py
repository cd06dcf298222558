"""End to end: a real Prometheus scrapes the running `kvscope demo` and sees prompt-token sources.

Uses Debian's `prometheus` package (installed by `scripts/setup.sh --test`). Prometheus listens on a
free loopback port, keeps its TSDB in tmp_path, scrapes the demo every second and loads the
project's recording rules, so the rules are checked against the metrics the agent really exports.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO_ROOT, needs_prometheus, running_prometheus

RULES = REPO_ROOT / "grafana" / "rules" / "kvscope.rules.yml"

DATA_TIMEOUT_S = 90.0  # bound on polling for scraped data; not a speed assertion
POLL_S = 1.0
WANT_SOURCES = {"gpu", "cpu", "recompute"}


@dataclass(frozen=True)
class Prom:
    url: str

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


pytestmark = needs_prometheus


@pytest.fixture
def prometheus(demo, tmp_path: Path) -> Iterator[Prom]:
    with running_prometheus(f"127.0.0.1:{demo.metrics_port}", tmp_path, "prometheus.log",
                            rule_files=[RULES]) as url:
        yield Prom(url)


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
