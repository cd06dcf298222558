"""Every engine on the same boards: one real Prometheus (the mixin's rule files loaded) scrapes
one real ``kvscope agent`` per engine, each started as a user would (``kvscope agent --config
agent.toml``, with the table ``docs/engines.md`` gives, vLLM's from ``docs/vllm.md``: only its
``url`` and ``interval`` changed, see :func:`doc_table`), each with its engine's source
against that engine's test server:

- vLLM (``[vllm_metrics]``): vLLM's offload series as its metric classes print them
  (``tests/data/vllm-0.33.0-cpu.prom``, native CPU offload) with its core series (prompt tokens
  by source, GPU blocks, TTFT) as ``tests/agent/test_vllm_metrics.py`` writes them;
- TensorRT-LLM (``[trtllm]``, events and metrics): ``tests/trtllm_server.py`` with the recorded
  drains (``tests/data/trtllm/drain-*.json``) replayed, and the recorded ``/prometheus/metrics``
  of TensorRT-LLM main;
- SGLang (``[sglang_metrics]``): SGLang 0.5.23's exposition as
  ``tests/agent/test_sglang_metrics.py`` records it from its collector's source (SGLang does
  not run on this CPU; its KV events, ``[kv_events] engine = "sglang"``, need SGLang's own
  publisher and are tested in ``tests/agent/test_sglang_kv_events.py``);
- Dynamo KVBM (``[kvbm_metrics]``): KVBM's exposition recorded from its source
  (``tests/data/dynamo-kvbm-3c24940.prom``);
- LMCache (``[lmcache_metrics]``): the real ``lmcache server`` from its cached environment,
  driven by LMCache's own client while the test runs (left out, and its test skipped, where
  that environment is not built).

A recording is one moment, and a board's rate needs counters that keep rising: each recorded
exposition is served *grown*, its n-th answer (from 0) holding every counter and histogram
series at ``baseline + n x (recorded - baseline)`` (baseline: an earlier recording of the same
engine, TensorRT-LLM's ``metrics-main-1.prom``; else 0, as KVBM registers its counters) and its
gauges as recorded; the drains are replayed in cycles, event ids running on and block hashes
new each cycle. So each agent scrape sees the recording's increase once more.

Each engine's agent is found as Grafana finds it (``$instance``: ``label_values(
kvscope_engine_info{engine=...}, instance)``), and every query of the Overview and Tiers boards
is evaluated for it. The test asserts, per engine, exactly which queries have no data (each with
why: what the engine does not report) and which tiers, token sources and directions the tier,
token-source and transfer panels show, so a mapping that breaks, or a board that stops reading
an engine, fails here. The table is in ``docs/engines.md``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import (REPO_ROOT, _stop, artifacts_dir, free_port, http_status,
                      needs_prometheus, running_prometheus, sigint_default)
from tests.engine_servers import Exposition, lmcache_python, lmcache_server
from tests.vllm_env import unavailable
from tests.trtllm_server import DATA as TRTLLM_DATA, serving_trtllm
from kvscope.mixin import MixinConfig
from kvscope.mixin.dashboards import dashboards
from kvscope.mixin.queries import substitute
from tests.agent.test_sglang_metrics import FIRST as SGLANG_1, SECOND as SGLANG_2
from tests.agent.test_sglang_metrics import exposition as sglang_text
from tests.agent.test_vllm_metrics import exposition as vllm_core

pytestmark = needs_prometheus

CFG = MixinConfig()
DATA = REPO_ROOT / "tests" / "data"
BOARDS = ("kvscope / Overview", "kvscope / Tiers")
DATA_TIMEOUT_S = 240.0  # bound on polling until the expected queries have data; not a speed assertion
AGENT_START_TIMEOUT_S = 60.0
POLL_S = 2.0

# --- the recorded payloads, served grown --------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$")
_GROWING = {"counter": ("", "_total"), "histogram": ("_bucket", "_sum", "_count")}


def grown(recorded: str, n: int, baseline: str = "") -> str:
    """``recorded`` (Prometheus text) with every counter and histogram sample at ``baseline +
    n x (recorded - baseline)`` (a series the baseline lacks: from 0; families by their ``#
    TYPE`` lines) and every other line as it is. Pure."""
    def samples(text: str) -> Iterator[tuple[str, re.Match]]:
        for line in text.splitlines():
            yield line, _SAMPLE.match(line)

    base = {(m[1], m[2]): float(m[3]) for _, m in samples(baseline) if m}
    kinds = {}
    for line in recorded.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            kinds[family] = kind
    growing = {family + suffix for family, kind in kinds.items()
               for suffix in _GROWING.get(kind, ())}
    out = []
    for line, m in samples(recorded):
        if m and m[1] in growing:
            b = base.get((m[1], m[2]), 0.0)
            line = f"{m[1]}{m[2] or ''} {b + n * (float(m[3]) - b)!r}"
        out.append(line)
    return "\n".join(out) + "\n"


class Growing(Exposition):
    """An :class:`~engine_servers.Exposition` whose n-th answer (from 0) is ``render(n)``."""

    def __init__(self, render: Callable[[int], str]) -> None:
        self.render, self.answers = render, 0
        super().__init__()

    @property
    def body(self) -> str:
        n, self.answers = self.answers, self.answers + 1
        return self.render(n)

    @body.setter
    def body(self, value: str) -> None:  # Exposition's own body: the render's instead
        pass


def vllm_exposition(n: int) -> str:
    """vLLM's n-th answer: the recorded offload series grown (524,288 B stored per scrape) and
    the core series per scrape: 1,000 prompt tokens, 300 of them GPU hits and 200 CPU hits,
    12 of 24 GPU blocks used, 10 first tokens (8 under 0.1 s, 2 under 1 s)."""
    core = vllm_core(1000 * n, 300 * n, 200 * n, 0, 0, [("0.1", 8 * n), ("1.0", 2 * n), ("+Inf", 0)])
    offload = grown((DATA / "vllm-0.33.0-cpu.prom").read_text(), n)
    return offload + "".join(line + "\n" for line in core.splitlines()
                              if not line.startswith("vllm:kv_offload_"))


# SGLang's gauges among the values of tests/agent/test_sglang_metrics.py's exposition
SGLANG_GAUGES = {"used", "evictable", "queue", "running", "host_used"}


def sglang_exposition(n: int) -> str:
    """SGLang's n-th answer: its exposition (recorded by hand from SGLang 0.5.23's collector, in
    tests/agent/test_sglang_metrics.py) with the counters at FIRST + n x (SECOND - FIRST) (a
    counter FIRST lacks: from 0), the gauges at SECOND. Per scrape, as that test counts it: 800
    prompt tokens, 200 from the GPU, 150 host, 50 storage; 40 blocks gpu->cpu, 5 cpu->gpu, 10
    disk->cpu, 20 cpu->disk; 50 GPU blocks evicted."""
    def at(key):
        first, second = SGLANG_1.get(key, 0), SGLANG_2[key]
        if key in SGLANG_GAUGES:
            return second
        if isinstance(second, list):
            return [a + n * (b - a) for a, b in zip(first, second)]
        return first + n * (second - first)

    return sglang_text({key: at(key) for key in SGLANG_2})


_HASHES = ("block_hash", "parent_hash")


def _rehashed(value, cycle: int):
    """A drain's JSON with every block hash moved by ``cycle`` x a large odd number (mod
    2^64), so each cycle stores blocks of its own."""
    def move(h):
        return None if h is None else (h + cycle * 0x9E3779B97F4A7C15) % 2**64

    if isinstance(value, list):
        return [_rehashed(v, cycle) for v in value]
    if isinstance(value, dict):
        return {k: move(v) if k in _HASHES else [move(h) for h in v] if k == "block_hashes"
                else _rehashed(v, cycle) for k, v in value.items()}
    return value


def trtllm_drains(cycles: int) -> list[bytes]:
    """The four recorded drains, ``cycles`` times over: event ids numbered on without a gap,
    hashes new each cycle (:func:`_rehashed`), the ``created`` event in the first cycle only and
    the unknown ``cleared`` one left out (a healthy engine). Per cycle, as the recorded test
    counts them: 4 blocks stored on the GPU, 2 offloaded to the host (2 x gpu->cpu), 1 dropped
    from the GPU, 1 onboarded back (cpu->gpu), 1 evicted from the host, 1 from the GPU."""
    recorded = [json.loads((TRTLLM_DATA / f"drain-{i}.json").read_text()) for i in range(1, 5)]
    out, event_id = [], 0
    for cycle in range(cycles):
        for drain in recorded:
            body = []
            for event in drain:
                kind = event["data"]["type"]
                if kind == "cleared" or (kind == "created" and cycle):
                    continue
                body.append({**_rehashed(event, cycle), "event_id": event_id})
                event_id += 1
            out.append(json.dumps(body).encode())
    return out


# --- the engines ------------------------------------------------------------------------


def doc_table(table: str, url: str) -> str:
    """The agent table ``[table]`` as the docs give it (docs/vllm.md for vLLM's, else
    docs/engines.md), with two changes only: ``url``, the test server's, and ``interval = 1.0``
    (the boards' 1 m rate window then holds enough scrapes without waiting minutes)."""
    doc = (REPO_ROOT / "docs" / ("vllm.md" if table == "vllm_metrics" else "engines.md")).read_text()
    header = re.compile(rf"^\[{table}\]\n", re.M)  # at a line's start: not a comment naming it
    block = next(b for b in re.findall(r"```toml\n(.*?)```", doc, re.S) if header.search(b))
    text = re.split(r"^\[", header.split(block, 1)[1], flags=re.M)[0]
    text = re.sub(r'^url = "[^"]*"', f'url = "{url}"', text, count=1, flags=re.M)
    text = re.sub(r"^interval = \S+", "interval = 1.0", text, count=1, flags=re.M)
    return f"[{table}]\n{text}"



@dataclass
class Engine:
    """One engine's agent: its ``engine`` label, the ``model`` its documented table names, that
    table (:func:`doc_table`), and what the boards show of it (see the module)."""

    engine: str
    model: str
    table: str
    no_data: dict[str, str]  # query key -> why the engine cannot fill it
    sources: set[str]  # prompt tokens per second by source
    directions: set[str]  # transfer throughput, "src -> dst"
    tiers: set[str]  # resident bytes against capacity, the capacity query
    port: int = 0
    process: subprocess.Popen | None = None
    log: Path | None = None
    url: str = ""
    extra: dict = field(default_factory=dict)


# What no engine here reports, so no agent of this test fills it: timed transfers (vLLM's
# native CPU offload has its time counters at 0 in the recording; the others count blocks or
# bytes only), copies in flight (the vLLM tap and the reference engine report those), promotion latency (vLLM's tiering histogram; the recording is of plain CPU
# offload), and block hits and ages at eviction (taps, and TensorRT-LLM's host evictions).
UNTIMED = {
    "Prefill seconds saved against transfer seconds spent (spent)":
        "no transfer time: its transfers are untimed",
    "Bandwidth of a transfer by direction, against the link maximum ({{src}} → {{dst}})":
        "bytes over transfer seconds: its transfers are untimed",
    "Transfer time p50 / p99 by direction, fleet (exemplars link to traces) ({{src}} → {{dst}} p99)":
        "its transfers are untimed",
    "Transfer time p50 / p99 by direction, fleet (exemplars link to traces) ({{src}} → {{dst}} p50)":
        "its transfers are untimed",
    "Promotion latency p50 / p95 / p99, worst instance ({{src}} → {{dst}} p50)":
        "its promotions are untimed",
    "Promotion latency p50 / p95 / p99, worst instance ({{src}} → {{dst}} p95)":
        "its promotions are untimed",
    "Promotion latency p50 / p95 / p99, worst instance ({{src}} → {{dst}} p99)":
        "its promotions are untimed",
    # both divide by the transfer time histogram's count, which only timed transfers have
    "Average transfer size by direction": "bytes over timed transfers: its transfers are untimed",
    "Failed share of transfers": "failures over timed transfers: its transfers are untimed",
}

# every engine here reports transfers only through sources blind to a failed copy (byte
# counters, KV events): the agent exports no failure series for them (not measured, never 0)
NO_FAILURES = {
    "Transfer failures by reason": "its sources count what moved, not the copies that failed",
}

NO_IN_FLIGHT = {
    "Transfers in flight by direction ({{instance}} {{src}} → {{dst}} transfers)":
        "copies in flight are a tap's (vLLM's worker jobs, the reference engine's)",
    "Transfers in flight by direction ({{instance}} {{src}} → {{dst}} blocks)":
        "copies in flight are a tap's (vLLM's worker jobs, the reference engine's)",
    "Bandwidth of a transfer by direction, against the link maximum (PCIe link max)":
        "the PCIe link maximum is NVML's (no GPU here)",
}
NO_EVICTIONS = {
    "Evictions by tier and reason ({{tier}} {{reason}})": "no eviction is reported",
    "Evictions by tier and reason ({{tier}} dropped)": "no eviction is reported",
    "Evicted before any reuse": "no eviction is reported",
}
NO_EVICTED_HITS = {
    "Hits per evicted block (median, p90) ({{tier}} median)": "evictions carry no hit count",
    "Hits per evicted block (median, p90) ({{tier}} p90)": "evictions carry no hit count",
    "Block age at eviction (median, p95) ({{tier}} median)": "evictions carry no age",
    "Block age at eviction (median, p95) ({{tier}} p95)": "evictions carry no age",
}
NO_IDLE = {
    "Idle time before eviction (median, p95) ({{tier}} median)": "no idle time is reported",
    "Idle time before eviction (median, p95) ({{tier}} p95)": "no idle time is reported",
}
NO_ADMISSIONS = {
    "Store admissions by tier and result": "no store outcome is reported",
    "Stores not made (skipped or failed share) ({{tier}} skipped)": "no store outcome is reported",
    "Stores not made (skipped or failed share) ({{tier}} failed)": "no store outcome is reported",
}
NO_RESIDENCY = {
    "Resident bytes against capacity ({{tier}} resident)": "no tier residency is reported",
    "Resident bytes against capacity ({{tier}} capacity)": "no tier capacity is reported",
    "Resident blocks against capacity ({{tier}} resident)": "no tier residency is reported",
    "Resident blocks against capacity ({{tier}} capacity)": "no tier capacity is reported",
    "Tier fill": "no tier residency is reported",
    "Fullest offload tier": "no offload tier residency is reported",
}
# (The agent exports a token source from the first lookup that measures it, so an engine whose
# sources report no prompt tokens has no token source's series at all: absent, not 0.)
NO_TOKENS = {
    "Prompt tokens per second by source": "no prompt tokens are reported (absent, not 0)",
    "Share of prompt tokens by source": "no prompt tokens are reported",
    "Served from cache": "no prompt tokens are reported",
    "Prefill seconds saved against transfer seconds spent (saved)": "no cached tokens to save prefill",
    "Lookup hit ratio by tier": "no lookups are reported",
}
NO_TTFT = {"TTFT p99, worst instance": "no time to first token is reported"}
NO_BLOCK_HASHES = {"Prompt blocks reused": "no lookup carries block hashes (the vLLM tap and "
                                           "the reference engine send them)"}
NO_CACHE_SETTINGS = {"KV cache settings": "prefix caching and the KV cache dtype are read from "
                                          "vLLM's cache_config_info and the reference engine only"}


def engines() -> dict[str, Engine]:
    """The engines of the fleet, by their ``engine`` label (see the module)."""
    out = {
        "vllm": Engine(
            "vllm", "MODEL",
            "vllm_metrics",
            {**UNTIMED, **NO_FAILURES, **NO_BLOCK_HASHES,
             **NO_IN_FLIGHT, **NO_EVICTIONS, **NO_EVICTED_HITS,
             **NO_ADMISSIONS,
             "Idle time before eviction (median, p95) ({{tier}} median)":
                 "vllm:kv_block_idle_before_evict_seconds needs --kv-cache-metrics (not recorded)",
             "Idle time before eviction (median, p95) ({{tier}} p95)":
                 "vllm:kv_block_idle_before_evict_seconds needs --kv-cache-metrics (not recorded)",
             "Lookup hit ratio by tier": "vLLM's counters are tokens, not blocks looked up",
             "Fullest offload tier": "no CPU tier residency in vLLM's metrics: [kv_events] "
                                     "reports it (docs/vllm.md)"},
            {"gpu", "cpu", "recompute"}, {"gpu → cpu"}, {"gpu"}),
        "tensorrt-llm": Engine(
            "tensorrt-llm", "meta-llama/Llama-3.1-8B-Instruct",
            "trtllm",
            {**UNTIMED, **NO_FAILURES, **NO_BLOCK_HASHES,
             **NO_IN_FLIGHT, **NO_CACHE_SETTINGS,
             "Lookup hit ratio by tier": "its counters are tokens, not blocks looked up",
             "Stores not made (skipped or failed share) ({{tier}} failed)":
                 "its events know no failed write (a block is offloaded or dropped)"},
            {"gpu", "cpu", "recompute"}, {"gpu → cpu", "cpu → gpu"}, {"gpu", "cpu"}),
        "dynamo": Engine(
            "dynamo", "Qwen/Qwen3-0.6B",
            "kvbm_metrics",
            {**UNTIMED, **NO_FAILURES, **NO_BLOCK_HASHES,
             **NO_IN_FLIGHT, **NO_CACHE_SETTINGS, **NO_EVICTIONS, **NO_EVICTED_HITS,
             **NO_IDLE, **NO_ADMISSIONS, **NO_RESIDENCY, **NO_TOKENS, **NO_TTFT},
            set(), {"gpu → cpu", "cpu → disk", "gpu → disk", "gpu → remote", "cpu → gpu",
                    "disk → gpu", "remote → gpu"}, set()),
        "sglang": Engine(
            "sglang", "MODEL",
            "sglang_metrics",
            {**UNTIMED, **NO_FAILURES, **NO_BLOCK_HASHES,
             **NO_IN_FLIGHT, **NO_CACHE_SETTINGS, **NO_EVICTED_HITS, **NO_IDLE,
             "Lookup hit ratio by tier": "its counters are tokens, not blocks looked up",
             "Evicted before any reuse": "evictions carry no hit count",
             "Stores not made (skipped or failed share) ({{tier}} skipped)":
                 "a share of a tier's stored blocks: SGLang counts L3's declined backups, its "
                 "made ones only as transfers",
             "Stores not made (skipped or failed share) ({{tier}} failed)":
                 "no failed write is reported"},
            {"gpu", "cpu", "disk", "recompute"},
            {"gpu → cpu", "cpu → gpu", "disk → cpu", "cpu → disk"}, {"gpu", "cpu"}),
    }
    if lmcache_python() is not None:
        out["lmcache"] = Engine(
            "lmcache", "MODEL",
            "lmcache_metrics",
            {**UNTIMED, **NO_FAILURES, **NO_BLOCK_HASHES,
             **NO_IN_FLIGHT, **NO_CACHE_SETTINGS, **NO_EVICTED_HITS, **NO_ADMISSIONS,
             **NO_TTFT,
             "Evicted before any reuse": "evictions carry no hit count",
             "Lookup hit ratio by tier": "its lookups count tokens, not blocks"},
            # no gpu: LMCache is asked for the tokens the engine's GPU prefix cache missed
            {"cpu", "disk", "recompute"}, {"gpu → cpu", "cpu → gpu", "cpu → disk", "disk → cpu"},
            {"cpu"})
    return out


# --- the fleet ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Prom:
    url: str

    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=20) as resp:
            body = json.load(resp)
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        q = urllib.parse.urlencode({"match[]": match})
        with urllib.request.urlopen(f"{self.url}/api/v1/label/{label}/values?{q}", timeout=20) as resp:
            return json.load(resp)["data"]


@contextlib.contextmanager
def _agent(engine: Engine, workdir: Path) -> Iterator[None]:
    """``kvscope agent --config agent.toml --port P`` (the engine's table, no ingest: no tap
    here, and the agents would share its port), until /readyz answers; SIGINT afterwards.

    P is picked just before the start, and picked again (up to 3 times) if another process
    took it in between: the servers started beside it bind ports of their own (CI lost a run
    to "Address already in use" when the ports were picked before the LMCache server)."""
    config = workdir / f"agent-{engine.engine}.toml"
    config.write_text("[ingest]\nenabled = false\n\n" + doc_table(engine.table, engine.url))
    engine.log = artifacts_dir() / f"engines-agent-{engine.engine}.log"
    try:
        for attempt in range(3):
            engine.port = free_port()
            with open(engine.log, "wb") as log:
                engine.process = subprocess.Popen(
                    [sys.executable, "-m", "kvscope", "agent", "--config", str(config),
                     "--port", str(engine.port)], cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=sigint_default)
            deadline = time.monotonic() + AGENT_START_TIMEOUT_S
            while http_status(f"http://127.0.0.1:{engine.port}/readyz") != 200 \
                    and engine.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.25)
            if engine.process.poll() is None or attempt == 2 \
                    or "Address already in use" not in engine.log.read_text():
                break
        assert engine.process.poll() is None \
            and http_status(f"http://127.0.0.1:{engine.port}/readyz") == 200, \
            f"kvscope agent for {engine.engine} did not start:\n{engine.log.read_text()}"
        yield
    finally:
        if engine.process is not None:
            _stop(engine.process)


class _Driver(threading.Thread):
    """Drives the LMCache server until stopped, through :meth:`LMCacheServer.drive` (4
    requests of 2 chunks a call): new requests (4..7, 8..11, ...: first lookups miss, then
    stored, second lookups hit L1) in turn with requests 0..3 again (from the second time on
    evicted from the 12-chunk L1 by the 16 chunks stored since, so loaded from the fs L2).
    Every 1 m window so has tokens from cpu, disk and recompute."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server, self.stop, self.error = server, threading.Event(), None

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                start = 0 if n % 2 else 4 * (n // 2 + 1)
                self.server.drive(start, start + 4)
            except Exception as exc:  # noqa: BLE001 (reported by the test)
                self.error = exc
                return
            n += 1


@dataclass
class Fleet:
    prom: Prom
    engines: dict[str, Engine]
    started: float
    lmcache: _Driver | None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    """Each engine's test server and agent, and one Prometheus scraping every agent."""
    workdir = tmp_path_factory.mktemp("engines")
    fleet = engines()
    with contextlib.ExitStack() as stack:
        fleet["vllm"].url = stack.enter_context(contextlib.closing(Growing(vllm_exposition))).url
        main_1, main_2 = ((TRTLLM_DATA / f"metrics-main-{i}.prom").read_text() for i in (1, 2))
        trtllm = stack.enter_context(serving_trtllm(
            trtllm_drains(100), [grown(main_2, n, main_1) for n in range(600)]))
        fleet["tensorrt-llm"].url = trtllm.url
        fleet["sglang"].url = stack.enter_context(
            contextlib.closing(Growing(sglang_exposition))).url
        kvbm = (DATA / "dynamo-kvbm-3c24940.prom").read_text()
        fleet["dynamo"].url = stack.enter_context(
            contextlib.closing(Growing(lambda n: grown(kvbm, n)))).url
        driver = None
        if "lmcache" in fleet:
            # 0.05 GiB: 12 of the driver's 4 MiB chunks, so L1 evicts
            server = stack.enter_context(lmcache_server(l1_size_gb=0.05))
            fleet["lmcache"].url = server.metrics_url
            driver = _Driver(server)
            driver.start()
            stack.callback(driver.join, 60)
            stack.callback(driver.stop.set)
        for engine in fleet.values():
            stack.enter_context(_agent(engine, workdir))
        url = stack.enter_context(running_prometheus(
            [f"127.0.0.1:{e.port}" for e in fleet.values()], workdir, "prometheus-engines.log",
            rule_files=[REPO_ROOT / "grafana" / "rules" / "kvscope.rules.yml"]))
        yield Fleet(Prom(url), fleet, time.monotonic(), driver)


def board_queries() -> dict[str, str]:
    """The Overview's and Tiers' queries by key: the panel's title, with the target's legend in
    brackets where the panel has several."""
    out = {}
    for board in dashboards(CFG).values():
        if board["title"] not in BOARDS:
            continue
        for panel in board["panels"]:
            targets = panel.get("targets", [])
            for target in targets:
                key = panel["title"] if len(targets) == 1 else \
                    f"{panel['title']} ({target.get('legendFormat')})"
                out[key] = target["expr"]
    return out


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _labels(result: list[dict], *names: str) -> set[str]:
    """The label values (joined by " → ") of the series above 0."""
    return {" → ".join(r["metric"].get(n, "") for n in names) for r in result
            if float(r["value"][1]) > 0}


@pytest.mark.parametrize("name", ["vllm", "tensorrt-llm", "sglang", "dynamo", "lmcache"])
def test_the_overview_and_tiers_boards_show_each_engine(fleet: Fleet, name: str) -> None:
    """``name``'s agent is listed for ``$engine = name`` (its model too), and of the Overview's
    and Tiers' queries exactly those the engine cannot fill (its ``no_data``, each with why)
    have no finite sample for it; token sources, transfer directions and tiers are those its
    recording holds (see :func:`engines`; by hand from the recorded files: e.g. KVBM's seven
    block counters are all above 0, so seven directions)."""
    if name not in fleet.engines:
        unavailable("no LMCache environment: bash scripts/vllm_env.sh --lmcache")
    engine, prom = fleet.engines[name], fleet.prom
    queries = board_queries()
    assert set(engine.no_data) <= set(queries), set(engine.no_data) - set(queries)
    deadline = fleet.started + DATA_TIMEOUT_S
    while True:
        assert engine.process.poll() is None, engine.log.read_text()
        if fleet.lmcache is not None:
            assert fleet.lmcache.error is None, fleet.lmcache.error
        instances = prom.label_values("instance", f'kvscope_engine_info{{engine="{name}"}}')
        regex = "|".join(re.escape(i).replace("\\", "\\\\") for i in instances)  # in a PromQL string
        results = {key: prom.query(substitute(expr, instance=regex)) for key, expr in queries.items()}
        empty = {key for key, result in results.items() if not _finite(result)}
        shown = (_labels(results["Prompt tokens per second by source"], "source"),
                 _labels(results["Transfer throughput"], "src", "dst"),
                 _labels(results["Resident bytes against capacity ({{tier}} capacity)"], "tier"))
        want = (engine.sources, engine.directions, engine.tiers)
        if (instances and empty <= set(engine.no_data) and shown == want) \
                or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    # what each query returned, for whoever reads a failure
    (artifacts_dir() / f"engines-boards-{name}.json").write_text(json.dumps(results, indent=1))
    assert instances == [f"127.0.0.1:{engine.port}"]
    assert prom.label_values("model", f'kvscope_engine_info{{engine="{name}"}}') == [engine.model]
    assert sorted(empty) == sorted(engine.no_data), (
        f"{name}: without data but expected: {sorted(empty - set(engine.no_data))}; "
        f"with data, expected none: {sorted(set(engine.no_data) - empty)}")
    assert shown == want
