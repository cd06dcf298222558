"""The metric catalog follows Prometheus conventions and the exporter and docs follow it."""

import os
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope import __version__
from kvscope import events as ev
from kvscope.agent.collectors import CollectorSet
from kvscope.catalog import CATALOG, render_markdown
from kvscope.service.agent import Agent

ROOT = Path(__file__).resolve().parent.parent
SKELETON_NAMES = {  # fixed by the skeleton issue; never renamed
    "kvscope_prompt_tokens_total", "kvscope_transfer_bytes_total", "kvscope_transfer_seconds",
    "kvscope_evicted_blocks_total", "kvscope_tier_capacity_bytes", "kvscope_tier_resident_bytes",
    "kvscope_host_memory_available_bytes",
}
BOUNDED_LABELS = {"tier", "source", "src", "dst", "reason", "engine", "model", "gpu", "direction",
                  "collector", "result", "version", "sink",
                  # PCIe generations (1-7), lane counts (1-32) and NUMA node numbers
                  "pcie_generation", "pcie_width", "pcie_max_generation", "pcie_max_width",
                  "numa_node",
                  # a memory budget breakdown's parts (vocabulary.HOST_/GPU_MEMORY_PARTS)
                  "part",
                  # an engine's KV cache settings (vocabulary.PREFIX_CACHING, KV_CACHE_DTYPES)
                  "prefix_caching", "kv_cache_dtype",
                  # a prompt block's prefix seen before or new (vocabulary.PREFIX_REUSE)
                  "prefix"}


class _VM:
    total, available = 16 * 2**30, 9 * 2**30


def _numa(tmp_path) -> dict:
    """The NUMA collector's options over a two-node sysfs and a /proc holding engine process
    4242: 16 pages of heap on node 0, a 1 MiB pool (256 pages of 4 KiB) bound to node 1."""
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "online").write_text("0-1\n")
    (tmp_path / "proc" / "4242").mkdir(parents=True)
    (tmp_path / "proc" / "4242" / "numa_maps").write_text(
        "00e4f000 default heap anon=16 dirty=16 N0=16 kernelpagesize_kB=4\n"
        "7f0000000000 bind:1 anon=256 dirty=256 N1=256 kernelpagesize_kB=4\n")
    return {"engine_pid": 4242, "node_root": tmp_path / "node", "proc": tmp_path / "proc"}


def test_names_follow_prometheus_conventions():
    names = [spec.name for spec in CATALOG]
    assert len(names) == len(set(names))
    assert SKELETON_NAMES <= set(names)
    for spec in CATALOG:
        assert re.fullmatch(r"kvscope_[a-z0-9_]+", spec.name), spec.name
        assert (spec.type == "counter") == spec.name.endswith("_total"), spec.name
        if spec.unit:  # the unit is in the name (kvscope_prefill_seconds_saved_total was fixed so)
            assert f"_{spec.unit}" in spec.name, spec.name
        assert set(spec.labels) <= BOUNDED_LABELS, spec.name
        assert (spec.type == "histogram") == bool(spec.buckets), spec.name


def test_exposition_holds_every_catalog_metric_with_its_values(tmp_path):
    # psutil injected to fix the numbers; an empty cgroup root means no cgroup limit
    # the engine_args collector on a /proc tree holding one vLLM command line
    (tmp_path / "proc" / "7").mkdir(parents=True)
    (tmp_path / "proc" / "7" / "cmdline").write_bytes(
        b"\0".join([b"vllm", b"serve", b"m", b"--cpu-offload-gb", b"1", b""]))
    collectors = CollectorSet(["host", "numa", "engine_args"],
                              {"host": {"virtual_memory": lambda: _VM, "cgroup_root": tmp_path,
                                        "budgets": {"cpu": 2**30}},
                               "numa": _numa(tmp_path),
                               "engine_args": {"engine_pid": 7, "proc": tmp_path / "proc"}})
    agent = Agent(with_ingest=False, collectors=collectors)
    agent.pipeline.ingest("engine", [
        ev.RequestStarted(ts=0.0, request_id="r", prompt_tokens=8, trace_id="cd" * 16),
        ev.Lookup(ts=0.0, request_id="r", tokens={"gpu": 5, "recompute": 3}, blocks=2,
                  block_hits={"gpu": 1}, block_hashes=(9, 9)),
        ev.Transfer(ts=0.0, src="gpu", dst="cpu", blocks=1, bytes=32, duration=1.0, ok=False,
                    reason="io"),
        ev.Transfer(ts=0.0, src="cpu", dst="gpu", blocks=2, bytes=64, duration=0.001),
        ev.Eviction(ts=0.0, tier="gpu", blocks=1, bytes=32, age=1.0, hits=0, idle=1.0),
        ev.Admission(ts=0.0, tier="cpu", stored=1, skipped=0, failed=0),
        ev.TierSnapshot(ts=0.0, tier="cpu", capacity_bytes=128, resident_bytes=64,
                        capacity_blocks=4, resident_blocks=2),
        ev.RequestFinished(ts=0.0, request_id="r", ttft=0.2, prompt_tokens=8,
                           output_tokens=5, itl=0.02),
        ev.SchedulerStats(ts=0.0, waiting=2, running=1, preemptions=1, gpu_kv_usage=0.5),
        ev.TransfersInFlight(ts=0.0, src="gpu", dst="cpu", transfers=3, blocks=7),
    ])
    agent.pipeline.drop("ingest", "malformed")
    agent.pipeline.count_tap_errors("engine", "internal", 2)
    agent.pipeline.set_source_up("ingest", True)
    agent.pipeline.set_source_info("engine", "kvscope-reference", "tiny")
    agent.pipeline.set_cache_config("engine", True, "float16")
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(agent.exposition.registry).decode())}
    for spec in CATALOG:
        family_name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        assert family_name in families, spec.name
        if not spec.gpu_only:
            assert families[family_name].samples, spec.name
    value = agent.exposition.registry.get_sample_value
    assert value("kvscope_prompt_tokens_total", {"source": "recompute"}) == 3
    assert value("kvscope_transfer_bytes_total", {"src": "cpu", "dst": "gpu"}) == 64
    # block 9 twice in one prompt: new, then seen
    assert value("kvscope_prompt_prefix_blocks_total", {"prefix": "seen"}) == 1
    assert value("kvscope_engine_weight_offload_bytes") == 2**30
    assert value("kvscope_engine_cache_config_info", {"source": "engine", "prefix_caching": "on",
                                                      "kv_cache_dtype": "16bit"}) == 1
    # every reason of each direction seen exported, at 0 until it happens
    failures = {(s.labels["src"], s.labels["dst"], s.labels["reason"]): s.value
                for s in families["kvscope_transfer_failures"].samples
                if s.name.endswith("_total")}
    assert failures[("gpu", "cpu", "io")] == 1
    assert failures[("cpu", "gpu", "io")] == failures[("gpu", "cpu", "timeout")] == 0
    assert len(failures) == 2 * 10  # two directions, nine reasons and "other"
    assert value("kvscope_transfer_seconds_bucket", {"src": "cpu", "dst": "gpu", "le": "0.001"}) == 1
    assert value("kvscope_tier_resident_bytes", {"tier": "cpu"}) == 64
    assert value("kvscope_host_memory_available_bytes") == 9 * 2**30
    assert value("kvscope_host_numa_nodes") == 2
    assert value("kvscope_process_numa_bytes", {"numa_node": "1"}) == 2**20
    assert value("kvscope_ttft_seconds_count") == 1
    # its mean inter-token latency, 20 ms, in the (10, 25] ms bucket
    assert value("kvscope_itl_seconds_bucket", {"le": "0.01"}) == 0
    assert value("kvscope_itl_seconds_bucket", {"le": "0.025"}) == 1
    assert value("kvscope_itl_seconds_sum") == 0.02
    assert value("kvscope_otlp_spans_total", {"result": "dropped"}) == 0  # no OTLP export
    assert value("kvscope_records_dropped_total", {"sink": "store"}) == 0  # no store_dir
    assert value("kvscope_tap_errors_total", {"source": "engine", "reason": "internal"}) == 2
    assert value("kvscope_requests_waiting", {"source": "engine"}) == 2
    assert value("kvscope_preemptions_total", {"source": "engine"}) == 1
    assert value("kvscope_gpu_kv_cache_usage_ratio", {"source": "engine"}) == 0.5
    assert value("kvscope_transfer_blocks_in_flight",
                 {"source": "engine", "src": "gpu", "dst": "cpu"}) == 7


def test_docs_metrics_is_generated_from_the_catalog():
    """Regenerate with `kvscope docs-metrics`."""
    assert (ROOT / "docs" / "metrics.md").read_text() == render_markdown()


GOLDEN = ROOT / "tests" / "data" / "golden_metrics.txt"


def _golden_agent(tmp_path) -> Agent:
    """An agent with host and NUMA readings and collector timings fixed, after a fixed event sequence
    from two sources: a vLLM-like tap (tiers gpu and cpu, a failed offload, a sampled eviction,
    tap errors, its scheduler with preemptions) and the reference engine (a disk tier, a
    dropped block, a request with promotion wait and ITL, its queue without preemptions)."""
    # a host with 1 MiB swapped out (psutil's swap_memory()) and 64 KiB read back in (16 pages
    # of 4 KiB in its /proc/vmstat)
    swap = SimpleNamespace(used=2**20)
    (tmp_path / "host-proc").mkdir()
    (tmp_path / "host-proc" / "vmstat").write_text("pswpin 16\npswpout 256\n")
    collectors = CollectorSet(["host", "numa"], {"host": {"virtual_memory": lambda: _VM,
                                                          "swap_memory": lambda: swap,
                                                          "cgroup_root": tmp_path,
                                                          "proc_root": tmp_path / "host-proc",
                                                          "page_size": lambda: 4096,
                                                          "budgets": {"cpu": 2**30}},
                                                 "numa": {**_numa(tmp_path),
                                                          "page_size": lambda: 4096}},
                              clock=lambda: 1.0)
    agent = Agent(with_ingest=False, collectors=collectors)
    p = agent.pipeline
    p.ingest("vllm", [
        ev.TierSnapshot(ts=10.0, tier="gpu", capacity_bytes=4096, resident_bytes=1024,
                        capacity_blocks=64, resident_blocks=16),
        ev.TierSnapshot(ts=10.0, tier="cpu", capacity_bytes=8192, resident_bytes=2048,
                        capacity_blocks=128, resident_blocks=32),
        ev.RequestStarted(ts=10.0, request_id="a", prompt_tokens=64, trace_id="ab" * 16),
        ev.Lookup(ts=10.0, request_id="a", tokens={"gpu": 32, "cpu": 16, "recompute": 16},
                  blocks=4, block_hits={"gpu": 2, "cpu": 1}),
        ev.Transfer(ts=10.01, src="cpu", dst="gpu", blocks=1, bytes=64, duration=0.0004,
                    request_id="a"),
        ev.Transfer(ts=10.02, src="gpu", dst="cpu", blocks=2, bytes=128, duration=0.002,
                    ok=False, reason="timeout"),
        # a sampled chunk of 4 blocks standing for 4: 16 observations of 42 s idle
        ev.Eviction(ts=10.03, tier="cpu", blocks=4, bytes=256, age=42.0, hits=0, weight=4,
                    idle=42.0),
        # vLLM's sampled GPU blocks between two scrapes: 0.5 s, 2 s and 2 s; 1 over 1800 s
        ev.IdleHistogram(ts=10.04, tier="gpu", bounds=[1.0, 5.0, 1800.0], counts=[1, 2, 0, 1],
                         sum=2004.5),
        # the tap's store outcomes in blocks: cpu 6 stored, 2 skipped (no room), 2 failed
        ev.Admission(ts=10.05, tier="cpu", stored=6, skipped=2, failed=2),
        ev.RequestFinished(ts=10.2, request_id="a", ttft=0.05, prompt_tokens=64,
                           output_tokens=9, itl=0.012),
        ev.SchedulerStats(ts=10.3, waiting=3, running=2, preemptions=4, gpu_kv_usage=0.875),
    ])
    p.ingest("engine", [
        ev.TierSnapshot(ts=11.0, tier="disk", capacity_bytes=1 << 20, resident_bytes=1 << 19,
                        capacity_blocks=1024, resident_blocks=512),
        ev.RequestStarted(ts=11.0, request_id="b", prompt_tokens=32, trace_id="cd" * 16),
        ev.Lookup(ts=11.0, request_id="b", tokens={"disk": 16, "recompute": 16}, blocks=2,
                  block_hits={"disk": 1}),
        ev.Transfer(ts=11.0, src="disk", dst="cpu", blocks=1, bytes=64, duration=0.03,
                    request_id="b"),
        ev.Eviction(ts=11.1, tier="disk", blocks=1, bytes=64, age=3600.0, hits=5, idle=600.0),
        ev.RequestFinished(ts=11.5, request_id="b", ttft=0.4, prompt_tokens=32,
                           output_tokens=1, promotion_wait=0.03),
        # the reference engine never preempts: no preemptions series of its source
        ev.SchedulerStats(ts=11.6, waiting=1, running=1, gpu_kv_usage=0.25),
    ])
    p.publish_settled(everything=True)
    p.drop("ingest", "malformed", 2)
    p.count_tap_errors("vllm", "internal", 3)
    p.count_tap_errors("vllm", "unattributed", 0)
    p.set_source_up("ingest", True)
    p.set_source_info("vllm", "vllm", "tiny-llama")
    p.set_cache_config("vllm", False, "fp8_e4m3")
    return agent


def test_the_exposition_of_a_fixed_event_sequence_is_the_committed_golden_file(tmp_path):
    """Any change to a metric's name, help, labels or value shows up as a diff of
    tests/data/golden_metrics.txt (OpenMetrics, with exemplars). After a deliberate change,
    rewrite it with ``KVSCOPE_UPDATE_GOLDEN=1 pytest tests/test_catalog.py`` and review the
    diff."""
    body, _ = _golden_agent(tmp_path).exposition.render("application/openmetrics-text")
    text = body.decode().replace(__version__, "VERSION")  # a release is no exposition change
    if os.environ.get("KVSCOPE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
