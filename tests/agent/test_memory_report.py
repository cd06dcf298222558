"""The taps' memory reports (kvscope/agent/taps/memory_report.py) on real torch tensors (CPU:
this machine has no GPU, so the CUDA branch of ``gpu_reports`` runs only on a GPU machine) and
through the real emitter to the real ingest source. vLLM's own run is in test_vllm_tap.py."""

from __future__ import annotations

import logging

import pytest
import torch

from kvscope import events as ev
from kvscope.agent.taps.emitter import Emitter
from kvscope.agent.taps.memory_report import (MemoryReporter, attach, gpu_reports,
                                              offload_budget, storage_bytes)

log = logging.getLogger(__name__)


@pytest.mark.parametrize("extra, expected", [
    ({"cpu_bytes_to_use": 8589934592}, 8589934592),
    ({"cpu_bytes_to_use": 1.5 * (1 << 30)}, 1610612736),  # --kv-offloading-size 1.5 (GiB)
    ({"cpu_bytes_to_use": "4096"}, 4096),  # vLLM reads it with int() too
    ({}, None), ({"cpu_bytes_to_use": 0}, None), ({"cpu_bytes_to_use": -1}, None),
    ({"cpu_bytes_to_use": True}, None), ({"cpu_bytes_to_use": "80m"}, None),
])
def test_offload_budget_reads_cpu_bytes_to_use_as_vllm_does(extra, expected):
    assert offload_budget(extra) == expected


def test_storage_bytes_counts_each_allocation_once():
    """Two layers' views of one 4 x 1024 float32 tensor (16,384 bytes) and a separate 10-byte
    int8 tensor: 16,394 bytes on the CPU, not 16,384 x 2 + 10."""
    shared = torch.zeros((4, 1024), dtype=torch.float32)
    other = torch.zeros(10, dtype=torch.int8)
    assert storage_bytes([shared[:2], shared[2:], other]) == {torch.device("cpu"): 16_394}


def test_a_kv_cache_in_host_memory_makes_no_gpu_report():
    """vLLM's CPU build keeps its KV cache on the CPU: no GPU report, and neither the
    allocator nor the PCI address is asked."""
    asked = []
    reports = gpu_reports([torch.zeros(8)], 1.0, allocated=asked.append, address=asked.append)
    assert reports == [] and asked == []


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_reports_go_out_at_once_and_every_refresh_after_the_previous_tick():
    """Sent at 100 (attach), not at 105 (within the 10 s refresh), again at 110.5 with that
    time; the emitter's previous on_tick runs on every tick before."""
    sent, ticks, clock = [], [], _Clock()

    class Sink:  # the emitter's two members attach uses
        emit = staticmethod(sent.append)
        on_tick = staticmethod(lambda: ticks.append(clock.t))

    report = ev.EngineMemory(ts=0.0, kv_offload_budget=4096)
    reporter = attach(Sink, [report], log, clock=clock)
    assert [e.ts for e in sent] == [100.0] and ticks == []
    for t in (105.0, 110.5):
        clock.t = t
        Sink.on_tick()
    assert [e.ts for e in sent] == [100.0, 110.5] and ticks == [105.0, 110.5]
    assert sent[-1] == ev.EngineMemory(ts=110.5, kv_offload_budget=4096)
    assert reporter.errors == 0
    assert attach(Sink, [], log) is None  # nothing to report: the tick is left alone


def test_a_failing_send_is_counted_and_logged_once(caplog):
    def broken(_event):
        raise RuntimeError("socket gone")

    clock = _Clock()
    reporter = MemoryReporter(broken, [ev.EngineMemory(ts=0.0, kv_offload_budget=1)],
                              logger=log, clock=clock, refresh=1.0)
    with caplog.at_level(logging.WARNING):
        for t in (1.0, 2.0, 3.0):
            clock.t = t
            reporter.tick()
    assert reporter.errors == 3
    assert [r.message for r in caplog.records] == [
        "kvscope tap: memory report failed (RuntimeError: socket gone)"]


def test_the_report_reaches_the_agent_through_the_real_emitter(tmp_path):
    """The real emitter to the agent's real ingest socket: the pipeline holds the budget."""
    from conftest import wait_until
    from kvscope.agent.config import AgentSettings
    from kvscope.service.agent import Agent

    endpoint = f"ipc://{tmp_path}/ingest.sock"
    agent = Agent(AgentSettings(ingest={"endpoint": endpoint},
                                collectors={"gpu": {"enabled": False}}))
    agent.start()
    emitter = Emitter(endpoint, source="vllm", logger=log)
    try:
        attach(emitter, [ev.EngineMemory(ts=1.0, kv_offload_budget=8 << 30)], log)
        assert wait_until(lambda: agent.pipeline.engine_memory()
                          == {("vllm", ""): {"kv_offload_budget": 8 << 30}})
    finally:
        emitter.close()
        agent.shutdown()
