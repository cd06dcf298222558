"""End to end: a real Prometheus scrapes the running `kvscope demo` with the mixin's rule files
loaded, and every PromQL expression of the boards, recording rules and alerts is evaluated
through its HTTP API.

The rule (documented in docs/grafana.md): every board query, variable query and recording rule
returns at least one finite sample on the healthy demo; an alert is checked through its
*signals* (the expressions it compares, without the threshold), since on a healthy system it
must stay silent. Rare-event rules (failures, drops) fall back to 0 so they have data too. The
listed exception is the GPU-only queries (catalog `gpu_only`), which have no series without an
NVIDIA driver: they are checked to parse and evaluate. Exemplar panels must return exemplars
with a trace id, and every loaded rule must evaluate without error.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO_ROOT, needs_prometheus, running_prometheus
from kvscope.mixin import MixinConfig
from kvscope.mixin.queries import Query, all_queries, gpu_only, substitute

RULE_FILES = [REPO_ROOT / "grafana" / "rules" / "kvscope.rules.yml", REPO_ROOT / "grafana" / "alerts" / "kvscope.alerts.yml"]
CFG = MixinConfig()
DATA_TIMEOUT_S = 150.0  # bound on polling until every query has data; not a speed assertion
POLL_S = 2.0

pytestmark = needs_prometheus


@dataclass(frozen=True)
class Prom:
    url: str

    def get(self, path: str, **params: str) -> dict:
        q = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=20) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as e:  # 400 on a bad query: return its error body
            return json.load(e)

    def instant(self, expr: str) -> dict:
        return self.get("query", query=expr)


@pytest.fixture
def prometheus(demo, tmp_path: Path) -> Iterator[Prom]:
    with running_prometheus(f"127.0.0.1:{demo.metrics_port}", tmp_path, "prometheus-mixin.log",
                            rule_files=RULE_FILES,
                            flags=["--enable-feature=exemplar-storage"]) as url:
        yield Prom(url)


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _problem(prom: Prom, q: Query, instance: str) -> str | None:
    """None when the query is fine, else what is wrong with it."""
    body = prom.instant(substitute(q.expr, instance=instance))
    if body.get("status") != "success":
        return f"error: {body.get('error')}"
    if gpu_only(q.expr, CFG):
        return None  # parses and evaluates; no series without a GPU
    if not _finite(body["data"]["result"]):
        return f"no finite sample ({len(body['data']['result'])} series)"
    return None


def test_every_query_returns_data_from_the_demo(demo, prometheus: Prom) -> None:
    instance = f"127.0.0.1:{demo.metrics_port}"
    queries = all_queries(CFG)
    assert len(queries) > 50
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        assert demo.proc.poll() is None, f"kvscope demo exited:\n{demo.log_tail()}"
        problems = {f"{q.kind} {q.where}: {q.expr}": p for q in queries
                    if (p := _problem(prometheus, q, instance)) is not None}
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    assert not problems, "queries without data on the demo:\n" + "\n".join(f"- {k}\n    {v}" for k, v in problems.items())

    # The recorded series exist too (not just their expressions).
    for record in sorted({q.where for q in queries if q.kind == "record"}):
        body = prometheus.instant(record)
        if not gpu_only(record, CFG):
            assert _finite(body["data"]["result"]), f"recorded series {record} is empty"

    # Every rule loaded and evaluates without error (e.g. no many-to-many matches).
    groups = prometheus.get("rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == sum(1 for q in queries if q.kind == "record") + len({q.where for q in queries if q.kind == "signal"})
    bad = [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"]
    assert not bad, bad


def test_exemplar_panels_link_to_traces(demo, prometheus: Prom) -> None:
    instance = f"127.0.0.1:{demo.metrics_port}"
    exemplar_queries = [q for q in all_queries(CFG) if q.exemplar]
    assert exemplar_queries
    deadline = time.monotonic() + DATA_TIMEOUT_S
    for q in exemplar_queries:
        expr = substitute(q.expr, instance=instance)
        while True:
            now = time.time()
            body = prometheus.get("query_exemplars", query=expr, start=str(now - 600), end=str(now + 60))
            assert body.get("status") == "success", (q.where, body)
            ids = [e["labels"].get("trace_id") for s in body["data"] for e in s["exemplars"]]
            if any(ids) or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        assert any(ids), f"{q.where}: no exemplars with a trace_id"
