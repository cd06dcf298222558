"""The memory budget breakdown (kvscope/agent/memory_budget.py): the parts' arithmetic on literal
readings, the engines' reports through the real pipeline and agent into /metrics, the engine
process's memory read from this machine's real /proc, and the GPU side through the stand-in
NVML of test_collectors_gpu.py (the one replacement allowed: this machine has no GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvscope import catalog as m
from kvscope import events as ev
from kvscope.agent.collectors import CollectorSet
from kvscope.agent.collectors.gpu import GpuDevice, GpuReading
from kvscope.agent.collectors.host import HostCollector, HostReading, engine_memory
from kvscope.agent.config import AgentSettings
from kvscope.agent.memory_budget import (gpu_parts, host_parts, memory_samples,
                                         offload_budgets)
from kvscope.agent.pipeline import Pipeline
from kvscope.service.agent import Agent
from kvscope.vocabulary import GPU_MEMORY_PARTS, HOST_MEMORY_PARTS
from tests.agent.test_collectors_gpu import Clock, FakeGpu, StandInNvml

GiB = 1 << 30
MiB = 1 << 20


def _host(limit=64 * GiB, available=40 * GiB, reserve=8 * GiB, engine=None, budgets=None):
    return HostReading(total=limit, available=available, limit=limit, reserve=reserve,
                       budgets=budgets or {}, headroom=available - reserve, engine=engine)


# ---- host parts --------------------------------------------------------------------------------

def test_host_parts_add_up_to_the_limit():
    """Limit 64 GiB, available 40 (24 in use), engine 20, budget 16, reserve 8:
    kv_offload 16; engine_other 20 - 16 = 4; other 24 - 20 = 4; reserve 8;
    free 64 - (16 + 4 + 4 + 8) = 32, which is the headroom (40 - 8)."""
    parts = host_parts(_host(engine=20 * GiB), 16 * GiB)
    assert parts == {"kv_offload": 16 * GiB, "engine_other": 4 * GiB, "other": 4 * GiB,
                     "reserve": 8 * GiB, "free": 32 * GiB}
    assert list(parts) == list(HOST_MEMORY_PARTS)
    assert sum(parts.values()) == 64 * GiB


def test_a_pool_not_yet_touched_comes_out_of_free():
    """An engine holding 6 GiB of a 16 GiB budget it grows lazily: engine_other max(6 - 16, 0)
    = 0; other 24 - 6 = 18 (everything in use that is not the engine's); free
    64 - (16 + 0 + 18 + 8) = 22 = headroom 32 less the 10 GiB of budget not yet touched."""
    parts = host_parts(_host(engine=6 * GiB), 16 * GiB)
    assert parts == {"kv_offload": 16 * GiB, "engine_other": 0, "other": 18 * GiB,
                     "reserve": 8 * GiB, "free": 22 * GiB}
    assert sum(parts.values()) == 64 * GiB


def test_without_the_engine_its_memory_is_not_split_out():
    """No engine process read: engine_other absent (not 0); other = in use less the budget,
    24 - 16 = 8; free 64 - 32 = 32. Without a budget either: other 24, free 32."""
    assert host_parts(_host(), 16 * GiB) == {"kv_offload": 16 * GiB, "other": 8 * GiB,
                                            "reserve": 8 * GiB, "free": 32 * GiB}
    assert host_parts(_host(), None) == {"other": 24 * GiB, "reserve": 8 * GiB,
                                        "free": 32 * GiB}


def test_an_overcommitted_host_shows_parts_beyond_the_limit():
    """Limit 64, available 10 (54 in use), engine 50, budget 48, reserve 16: kv_offload 48,
    engine_other 2, other 4, reserve 16 -> 70 GiB, 6 over the limit; free stops at 0."""
    parts = host_parts(_host(available=10 * GiB, reserve=16 * GiB, engine=50 * GiB), 48 * GiB)
    assert parts["free"] == 0
    assert sum(parts.values()) == 70 * GiB


def test_the_configured_budget_overrides_the_reported_one():
    """Two vLLM instances report 8 and 4 GiB: cpu 12 GiB. A configured cpu budget (20 GiB)
    wins; a configured disk budget stands beside the reported cpu one."""
    reports = {("vllm-dp0", ""): {"kv_offload_budget": 8 * GiB},
               ("vllm-dp1", ""): {"kv_offload_budget": 4 * GiB},
               ("vllm-worker", "0000:3b:00.0"): {"kv_cache": GiB}}
    assert offload_budgets({}, reports) == {"cpu": 12 * GiB}
    assert offload_budgets({"cpu": 20 * GiB}, reports) == {"cpu": 20 * GiB}
    assert offload_budgets({"disk": 100 * GiB}, reports) == {"cpu": 12 * GiB, "disk": 100 * GiB}
    assert offload_budgets({}, {}) == {}


# ---- GPU parts ---------------------------------------------------------------------------------

def _gpu(used=76 * GiB, total=80 * GiB, bus="0000:3b:00.0"):
    return GpuDevice(gpu="0", memory_used_bytes=used, memory_total_bytes=total, pci_bus_id=bus)


def test_gpu_parts_add_up_to_the_total():
    """Total 80, used 76, KV cache 40, allocated 56: kv_cache 40, weights 56 - 40 = 16,
    workspace 76 - 56 = 20, nothing unaccounted (no other), free 80 - 76 = 4."""
    parts = gpu_parts(_gpu(), 40 * GiB, 56 * GiB)
    assert parts == {"kv_cache": 40 * GiB, "weights": 16 * GiB, "workspace": 20 * GiB,
                     "free": 4 * GiB}
    assert set(parts) <= set(GPU_MEMORY_PARTS)
    assert sum(parts.values()) == 80 * GiB


def test_gpu_parts_without_the_engines_report_are_unattributed():
    """Only the KV cache reported (40): other 76 - 40 = 36, no weights or workspace. Nothing
    reported: all 76 in use is other, free 4."""
    assert gpu_parts(_gpu(), 40 * GiB, None) == {"kv_cache": 40 * GiB, "other": 36 * GiB,
                                                 "free": 4 * GiB}
    assert gpu_parts(_gpu(), None, None) == {"other": 76 * GiB, "free": 4 * GiB}


def test_memory_samples_match_reports_to_gpus_by_pci_address():
    """GPU 0 (0000:3b:00.0) has the worker's report: kv_cache 40, weights 16, workspace 20,
    free 4. GPU 1 (0000:86:00.0) has none: other 10, free 70. A report for a device NVML does
    not list changes nothing. The host reading gives the budget (reported 16 GiB) and its
    parts; without the host reading, neither budgets nor host parts are exported."""
    reports = {("vllm", ""): {"kv_offload_budget": 16 * GiB},
               ("vllm-worker", "0000:3b:00.0"): {"kv_cache": 40 * GiB, "allocated": 56 * GiB},
               ("vllm-worker-1", "0000:d8:00.0"): {"kv_cache": GiB}}
    gpus = GpuReading((_gpu(), GpuDevice(gpu="1", memory_used_bytes=10 * GiB,
                                         memory_total_bytes=80 * GiB,
                                         pci_bus_id="0000:86:00.0")))
    out = memory_samples(_host(engine=20 * GiB), gpus, reports)
    assert out[m.OFFLOAD_BUDGET_BYTES] == [(["cpu"], 16.0 * GiB)]
    assert dict((p[0], v) for p, v in out[m.HOST_MEMORY_PART_BYTES])["kv_offload"] == 16 * GiB
    assert out[m.GPU_MEMORY_PART_BYTES] == [
        (["0", "kv_cache"], 40.0 * GiB), (["0", "weights"], 16.0 * GiB),
        (["0", "workspace"], 20.0 * GiB), (["0", "free"], 4.0 * GiB),
        (["1", "other"], 10.0 * GiB), (["1", "free"], 70.0 * GiB)]
    empty = memory_samples(None, None, reports)
    assert empty == {m.OFFLOAD_BUDGET_BYTES: [], m.HOST_MEMORY_PART_BYTES: [],
                     m.GPU_MEMORY_PART_BYTES: []}


def test_the_gpu_collector_gives_the_address_reports_are_matched_by():
    """The stand-in NVML's busId "00000000:3B:00.0" is sysfs's 0000:3b:00.0; a GPU whose
    NVML does not say has none (its parts are unattributed). Used 10 of 80 GiB, KV cache 6,
    allocated 8: kv_cache 6, weights 2, workspace 2, free 70."""
    nvml = StandInNvml([FakeGpu(bus_id="00000000:3B:00.0"), FakeGpu()])
    collectors = CollectorSet(["gpu"], {"gpu": {"nvml": nvml, "clock": Clock()}})
    reading = collectors.collect()["gpu"].reading
    assert [d.pci_bus_id for d in reading.gpus] == ["0000:3b:00.0", None]
    reports = {("w", "0000:3b:00.0"): {"kv_cache": 6 * GiB, "allocated": 8 * GiB}}
    parts = memory_samples(None, reading, reports)[m.GPU_MEMORY_PART_BYTES]
    assert parts == [(["0", "kv_cache"], 6.0 * GiB), (["0", "weights"], 2.0 * GiB),
                     (["0", "workspace"], 2.0 * GiB), (["0", "free"], 70.0 * GiB),
                     (["1", "other"], 10.0 * GiB), (["1", "free"], 70.0 * GiB)]


# ---- the engines' reports through the pipeline and the agent -----------------------------------

def test_the_pipeline_keeps_each_senders_last_reports_until_it_stops():
    """A later report without a field keeps the earlier value; another device is its own;
    forget_tiers (the sender's emitter closed) drops them."""
    pipe = Pipeline()
    pipe.ingest("vllm", [ev.EngineMemory(ts=1.0, kv_offload_budget=8 * GiB)])
    pipe.ingest("vllm-worker", [ev.EngineMemory(ts=1.0, device="0000:3b:00.0", kv_cache=GiB,
                                                allocated=3 * GiB)])
    pipe.ingest("vllm", [ev.EngineMemory(ts=2.0)])
    assert pipe.engine_memory() == {
        ("vllm", ""): {"kv_offload_budget": 8 * GiB},
        ("vllm-worker", "0000:3b:00.0"): {"kv_cache": GiB, "allocated": 3 * GiB}}
    assert pipe.snapshot().engine_memory == pipe.engine_memory()
    pipe.forget_tiers("vllm")
    assert list(pipe.engine_memory()) == [("vllm-worker", "0000:3b:00.0")]


def _exposed(agent: Agent, name: str) -> dict[tuple[str, ...], float]:
    samples = agent._scrape_samples()
    return {tuple(labels): value for labels, value in samples[m.BY_NAME[name]]}


def test_the_agent_exports_the_engines_budget_unless_configured():
    """The engine reports 2 GiB: kvscope_offload_budget_bytes{tier="cpu"} is 2 GiB with no
    budget typed in the agent's config, and the host parts start with kv_offload 2 GiB; a
    configured 3 GiB overrides it. The dashboard's sample carries the same."""
    agent = Agent(AgentSettings(collectors={"gpu": {"enabled": False},
                                            "numa": {"enabled": False}}), with_ingest=False)
    assert _exposed(agent, "kvscope_offload_budget_bytes") == {}
    agent.pipeline.ingest("vllm", [ev.EngineMemory(ts=1.0, kv_offload_budget=2 * GiB)])
    assert _exposed(agent, "kvscope_offload_budget_bytes") == {("cpu",): 2.0 * GiB}
    parts = _exposed(agent, "kvscope_host_memory_part_bytes")
    assert parts[("kv_offload",)] == 2 * GiB and ("engine_other",) not in parts
    agent.sample()
    sample = agent.pipeline.samples()[-1]
    assert sample["offload_budget_bytes"] == {"cpu": 2.0 * GiB}
    assert sample["host_memory_part_bytes"]["kv_offload"] == 2 * GiB
    configured = Agent(AgentSettings(collectors={"gpu": {"enabled": False},
                                                 "numa": {"enabled": False},
                                                 "host": {"budgets": {"cpu": 3 * GiB}}}),
                       with_ingest=False)
    configured.pipeline.ingest("vllm", [ev.EngineMemory(ts=1.0, kv_offload_budget=2 * GiB)])
    assert _exposed(configured, "kvscope_offload_budget_bytes") == {("cpu",): 3.0 * GiB}


# ---- the engine process's memory, on this machine's real /proc ---------------------------------

_CHILD = """
import sys
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
block = bytearray(64 << 20)  # zeroed: every page touched
sys.stdout.write("allocated\\n"); sys.stdout.flush()
sys.stdin.readline()
"""


def test_the_engine_memory_counts_the_process_and_its_descendants():
    """A child of this process allocates 64 MiB (a bytearray, every page written): the
    memory of this process with its descendants rises by 64 MiB (within 8 MiB: the
    interpreter's own pages move too). A process that is gone reads None, not 0."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        before = engine_memory(os.getpid())
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "allocated\n"
        after = engine_memory(os.getpid())
        assert abs(after - before - 64 * MiB) <= 8 * MiB, (before, after)
        reading = HostCollector(engine_pid=os.getpid()).collect()
        assert abs(reading.engine - after) <= 8 * MiB
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert engine_memory(child.pid) is None
    assert HostCollector().collect().engine is None


def test_the_engine_process_is_named_once_for_every_collector():
    """engine_pid in [collectors.host] serves numa and engine_args too, and one in
    [collectors.numa] serves host; one given in a section stays that section's."""
    host_only = AgentSettings(collectors={"host": {"engine_pid": 4242}}).collectors
    assert (host_only.numa.engine_pid, host_only.engine_args.engine_pid) == (4242, 4242)
    numa_only = AgentSettings(collectors={"numa": {"engine_pid": 77}}).collectors
    assert numa_only.host.engine_pid == 77
    both = AgentSettings(collectors={"numa": {"engine_pid": 77},
                                     "host": {"engine_pid": 4242}}).collectors
    assert (both.numa.engine_pid, both.host.engine_pid) == (77, 4242)
