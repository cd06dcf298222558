"""End to end: a real Prometheus scrapes the running `kvscope demo` with the mixin's rule files
loaded, and every PromQL expression of the boards, recording rules and alerts is evaluated
through its HTTP API.

The rule (documented in docs/grafana.md): every board query, variable query and recording rule
returns at least one finite sample on the healthy demo; an alert is checked through its
*signals* (the expressions it compares, without the threshold), since on a healthy system it
must stay silent. Rare-event rules (failures, drops) fall back to 0 so they have data too. The
listed exceptions are the GPU-only queries (catalog `gpu_only`), which have no series without an
NVIDIA driver, and the queries of signals the demo's engine does not produce (NOT_ON_DEMO): they
are checked to parse and evaluate (and the latter to stay empty, so the list cannot go stale). Exemplar panels must return exemplars
with a trace id, and every loaded rule must evaluate without error.

Selecting an engine: with a fleet of two agents of different engines and models, selecting one
engine (model and instance at All, resolved as Grafana does) leaves every panel query with that
engine's agent only (see the fleet fixture below for how the fleet is made).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import PROMETHEUS, REPO_ROOT, free_port, needs_prometheus, running_prometheus
from kvscope.mixin import MixinConfig
from kvscope.mixin.alerts import alerts
from kvscope.mixin.dashboards import dashboards
from kvscope.catalog import BY_NAME
from kvscope.mixin.queries import Query, all_queries, gpu_only, metric_names, reads, substitute
from kvscope.mixin.rules import Records

RULE_FILES = [REPO_ROOT / "grafana" / "rules" / "kvscope.rules.yml", REPO_ROOT / "grafana" / "alerts" / "kvscope.alerts.yml"]
CFG = MixinConfig()
TIER_FILL = Records.of(CFG).tier_fill  # a recorded series: the rules have run
DATA_TIMEOUT_S = 150.0  # bound on polling until every query has data; not a speed assertion
POLL_S = 2.0
# Signals the demo's reference engine does not produce: it serves one prompt at a time and makes
# room by evicting blocks, never a request, so it has no preemption to count (vLLM does).
# Nor does it run with an engine process whose command line the engine_args collector reads.
NOT_ON_DEMO = {"kvscope_preemptions_total", "kvscope_engine_weight_offload_bytes"}

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


def demo_lacks(expr: str) -> bool:
    return bool(reads(expr, CFG) & NOT_ON_DEMO)


def _problem(prom: Prom, q: Query, instance: str) -> str | None:
    """None when the query is fine, else what is wrong with it."""
    body = prom.instant(substitute(q.expr, instance=instance))
    if body.get("status") != "success":
        return f"error: {body.get('error')}"
    if gpu_only(q.expr, CFG):
        return None  # parses and evaluates; no series without a GPU
    if demo_lacks(q.expr):
        return "has data: the demo produces it now, drop it from NOT_ON_DEMO" if body["data"]["result"] else None
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
    assert len(rules) == sum(1 for q in queries if q.kind == "record") + len(alerts(CFG))
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


# --- Selecting an engine: a fleet of two agents in a real Prometheus -------------------------
# Two agents are recorded samples, not two running agents (a second demo would double the load
# on a 2-core machine): scrapes of the session's demo, written as agent A (engine vllm) and, with
# counters and histograms tripled, agent B (engine sglang), backfilled into Prometheus's TSDB with
# `promtool tsdb create-blocks-from openmetrics`. Their timestamps end just before Prometheus
# starts, so its recording rules evaluate them as live data.

FLEET = {"10.0.0.1:9400": ("vllm", "llama-a"), "10.0.0.2:9400": ("sglang", "qwen-b")}
SCRAPES = 6
STEP_S = 15.0  # spacing of the recorded samples: $__rate_interval (1m) spans four of them
_GRAFANA_REGEX_SPECIAL = set("$^*{}[]'+?.()|\\")


def _grafana_regex(values: list[str]) -> str:
    """A multi-value variable as Grafana's Prometheus datasource writes it into a regex
    matcher: each value escaped (backslashes doubled for the PromQL string), ``(a|b)``."""
    esc = ["".join("\\\\" + c if c in _GRAFANA_REGEX_SPECIAL else c for c in v) for v in values]
    return "(" + "|".join(esc) + ")"


def _om_labels(labels: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


def _fleet_openmetrics(scrapes: list[str], end: float) -> str:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    parsed = [list(text_string_to_metric_families(text)) for text in scrapes]
    lines = []
    for i, family in enumerate(parsed[0]):
        lines.append(f"# TYPE {family.name} {family.type}")
        for instance, (engine, model) in FLEET.items():
            scale = 3.0 if instance != next(iter(FLEET)) and family.type in ("counter", "histogram") else 1.0
            for n, scrape in enumerate(parsed):
                ts = end - (len(parsed) - 1 - n) * STEP_S
                for sample in scrape[i].samples:
                    if sample.name.endswith("_created"):
                        continue
                    labels = dict(sample.labels, job="kvscope", instance=instance)
                    if family.name == "kvscope_engine_info":
                        labels.update(engine=engine, model=model)
                    lines.append(f"{sample.name}{_om_labels(labels)} {sample.value * scale!r} {ts:.3f}")
    return "\n".join(lines) + "\n# EOF\n"


def _values(body: dict) -> dict[tuple, float]:
    assert body.get("status") == "success", body
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in body["data"]["result"]}


def _same(a: dict[tuple, float], b: dict[tuple, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12)
        for k in a)


def _scrape(url: str) -> str:
    req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(req, timeout=20) as resp:
        return resp.read().decode()


def _exposed(text: str) -> set[str]:
    """Catalog metrics with at least one sample in an exposition."""
    return {m for line in text.splitlines() if line and not line.startswith("#")
            for m in metric_names(line.split("{")[0].split(" ")[0].removesuffix("_created"))}


@pytest.fixture
def fleet_prometheus(demo, tmp_path: Path) -> Iterator[Prom]:
    promtool = Path(PROMETHEUS).with_name("promtool")
    # Record once the demo has exposed every metric a panel reads (evictions come after warm-up).
    wanted = {m for q in all_queries(CFG) if q.kind == "panel" for m in metric_names(q.expr)
              if not BY_NAME[m].gpu_only and m not in NOT_ON_DEMO}
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while wanted - _exposed(_scrape(demo.metrics_url)):
        assert time.monotonic() < deadline, f"the demo never exposed {wanted - _exposed(_scrape(demo.metrics_url))}"
        time.sleep(POLL_S)
    scrapes = []
    for _ in range(SCRAPES):
        scrapes.append(_scrape(demo.metrics_url))
        time.sleep(1.0)
    source = tmp_path / "fleet.om"
    source.write_text(_fleet_openmetrics(scrapes, end=time.time() - 1.0))
    (tmp_path / "data").mkdir()
    r = subprocess.run([str(promtool), "tsdb", "create-blocks-from", "openmetrics", "-q", str(source),
                        str(tmp_path / "data")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # The scrape target is a closed port: the only kvscope series are the backfilled ones.
    with running_prometheus(f"127.0.0.1:{free_port()}", tmp_path, "prometheus-fleet.log",
                            rule_files=RULE_FILES) as url:
        yield Prom(url)


def test_selecting_an_engine_shows_only_its_agents(fleet_prometheus: Prom) -> None:
    prom, (a, b) = fleet_prometheus, list(FLEET)
    deadline = time.monotonic() + 60
    while not prom.instant(TIER_FILL)["data"]["result"]:
        assert time.monotonic() < deadline, "recording rules never evaluated the backfilled samples"
        time.sleep(POLL_S)
    now = time.time()
    board = next(iter(dashboards(CFG).values()))
    var = {v["name"]: v["query"] for v in board["templating"]["list"] if v["type"] == "query"}
    # Grafana writes All as the variable's allValue when it has one, else as its listed values.
    all_value = next(v.get("allValue") for v in board["templating"]["list"] if v["name"] == "instance")

    def label_values(query: str, **chosen: str) -> list[str]:
        m = re.fullmatch(r"label_values\((.*),\s*([a-z_]+)\)", query, re.S)
        expr, label = m.group(1), m.group(2)
        for name, value in chosen.items():
            expr = expr.replace(f"${name}", value)
        body = prom.get(f"label/{label}/values", **{"match[]": expr})
        assert body["status"] == "success", body
        return body["data"]

    assert sorted(label_values(var["engine"])) == ["sglang", "vllm"]
    # engine vllm, model All (".*"), instance All: the instances the variable lists.
    selected = label_values(var["instance"], engine="vllm", model=".*")
    assert selected == [a]
    fleet = label_values(var["instance"], engine=".*", model=".*")
    assert sorted(fleet) == [a, b]

    def run(expr: str, instance: str) -> dict[tuple, float]:
        expr = expr.replace('instance=~"$instance"', instance).replace("$__rate_interval", "1m")
        return _values(prom.get("query", query=expr, time=str(now)))

    panels = [q for q in all_queries(CFG) if q.kind == "panel"]
    problems, differs = [], set()
    for q in panels:
        got = run(q.expr, f'instance=~"{all_value or _grafana_regex(selected)}"')
        if not got and not gpu_only(q.expr, CFG) and not demo_lacks(q.expr):
            problems.append(f"{q.where}: no data for engine vllm")
        if any(dict(k).get("instance") == b for k in got):
            problems.append(f"{q.where}: shows {b}, which runs sglang")
        if not _same(got, run(q.expr, f'instance="{a}"')):
            problems.append(f"{q.where}: differs from {a} alone")
        if not _same(got, run(q.expr, f'instance=~"{_grafana_regex(fleet)}"')):
            differs.add(q.where.split(" / ")[1])
    assert not problems, "\n".join(problems)
    # The selection matters: with every engine, each board shows other numbers somewhere.
    assert differs == {d["title"].removeprefix("kvscope / ") for d in dashboards(CFG).values()}, differs


def test_the_promotion_wait_share_is_empty_where_no_wait_was_measured(tmp_path: Path) -> None:
    """Backfilled into a real Prometheus, two agents over one minute at 15 s steps: ``a``
    measures TTFT (its sum grows 6 s a step) and no promotion wait (vLLM's spans alone: count
    and sum stay 0); ``b`` measures both (TTFT sum +4 s, wait sum +1 s, count +10 a step). The
    share panel read 0 for ``a``, which points away from the tiers: now no value; for ``b``,
    by hand, 1 / 4 = 0.25; for the two together also 0.25, from b's TTFTs alone (a review:
    every instance's TTFT in the denominator read 1 / (6 + 4) = 0.1)."""
    promtool = Path(PROMETHEUS).with_name("promtool")
    (query,) = [q for q in all_queries(CFG)
                if q.where.endswith(" / Share of TTFT spent waiting for promotions")]
    end = time.time() - 1.0
    grow = {"a": {"kvscope_ttft_seconds_sum": 6.0, "kvscope_promotion_wait_seconds_sum": 0.0,
                  "kvscope_promotion_wait_seconds_count": 0.0},
            "b": {"kvscope_ttft_seconds_sum": 4.0, "kvscope_promotion_wait_seconds_sum": 1.0,
                  "kvscope_promotion_wait_seconds_count": 10.0}}
    lines = []
    for name in grow["a"]:
        lines.append(f"# TYPE {name.removesuffix('_total')} counter")
        for instance, per_step in grow.items():
            for n in range(5):
                lines.append(f'{name}{{instance="{instance}",job="kvscope"}} {n * per_step[name]} '
                             f"{end - (4 - n) * STEP_S:.3f}")
    source = tmp_path / "share.om"
    source.write_text("\n".join(lines) + "\n# EOF\n")
    (tmp_path / "data").mkdir()
    r = subprocess.run([str(promtool), "tsdb", "create-blocks-from", "openmetrics", "-q",
                        str(source), str(tmp_path / "data")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    with running_prometheus(f"127.0.0.1:{free_port()}", tmp_path, "prometheus-share.log") as url:
        prom = Prom(url)
        a = _values(prom.instant(substitute(query.expr, instance="a")))
        b = _values(prom.instant(substitute(query.expr, instance="b")))
        fleet = _values(prom.instant(substitute(query.expr, instance="a|b")))
    assert a == {}
    assert list(b.values()) == [pytest.approx(0.25)]
    assert list(fleet.values()) == [pytest.approx(0.25)]
