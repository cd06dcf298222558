"""The vLLM KV events source: mapping on literal batches, gaps and replay over real ZMQ
sockets (vLLM's replay protocol), and the live stream of a real vLLM engine."""

from __future__ import annotations

import json
import socket
import threading
import time

import msgspec
import zmq

from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.kv_events import KvEventsSource, KvResidency, decode, vllm_binds
from tests.vllm_env import run_driver, vllm_python


def stored(hashes, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 16, "lora_id": None, "medium": medium,
            "lora_name": None, "group_idx": 0, "future_field": "ignored"}


def removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def payload(*events, ts=100.0):
    """A KVEventBatch as vLLM encodes it: array-like [ts, events, dp_rank]."""
    return msgspec.msgpack.encode([ts, list(events), 0])


def frames(seq, *events):
    return [b"kv", seq.to_bytes(8, "big"), payload(*events)]


def test_decode_tolerates_new_fields_and_counts_unknown_kinds():
    ts, events, unknown = decode(payload(stored([b"a", 7]), {"type": "BlockMoved", "x": 1}))
    assert ts == 100.0 and unknown == 1 and events[0].block_hashes == [b"a", 7]


def test_residency_counts_offloads_evictions_and_clears_by_tier():
    r = KvResidency(block_bytes=10, capacity_blocks={"gpu": 8})
    out = r.apply(1.0, decode(payload(stored([1, 2, 3]), stored([1, 2], "CPU"),
                                      stored([2], "CPU"), removed([3]), removed([2], "CPU")))[1])
    kinds = [(type(e).__name__, getattr(e, "tier", None) or f"{e.src}->{e.dst}", e.blocks
              if hasattr(e, "blocks") else e.resident_blocks) for e in out]
    assert ("Transfer", "gpu->cpu", 2) in kinds           # the re-announced hash 2 is no offload
    assert ("Eviction", "gpu", 1) in kinds
    assert not any(k[0] == "Eviction" and k[1] == "cpu" for k in kinds)  # 2 still held once
    snaps = {e.tier: e for e in out if type(e).__name__ == "TierSnapshot"}
    assert snaps["gpu"].resident_blocks == 2 and snaps["gpu"].capacity_bytes == 80
    assert snaps["cpu"].resident_blocks == 2 and snaps["cpu"].resident_bytes == 20
    transfer = next(e for e in out if type(e).__name__ == "Transfer")
    assert transfer.bytes == 20 and transfer.timed is False
    out = r.apply(2.0, decode(payload({"type": "AllBlocksCleared"}))[1])
    cleared = {e.tier: e.blocks for e in out if type(e).__name__ == "Eviction"}
    assert cleared == {"gpu": 2, "cpu": 2}
    assert all(e.reason == "cleared" and not e.measured for e in out
               if type(e).__name__ == "Eviction")


def test_bind_or_connect_follows_vllm():
    assert vllm_binds("tcp://*:5557") and vllm_binds("ipc:///tmp/kv")
    assert not vllm_binds("tcp://10.0.0.5:5557")


class ReplayServer:
    """vLLM's replay protocol on a real ROUTER socket: request [id, "", start seq]; replies
    [id, "", topic, seq, payload] for each buffered seq >= start, then seq -1."""

    def __init__(self, buffered: dict[int, bytes]):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.buffered = buffered
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        if not self.sock.poll(5000):
            return
        client, _, start = self.sock.recv_multipart()
        for seq, buf in sorted(self.buffered.items()):
            if seq >= int.from_bytes(start, "big"):
                self.sock.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), buf])
        self.sock.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self):
        self.thread.join(6)
        self.sock.close(0)


def test_gaps_are_replayed_when_possible_and_counted_when_not():
    pipeline = Pipeline()
    server = ReplayServer({2: payload(stored([20])), 3: payload(stored([30]))})
    try:
        src = KvEventsSource(pipeline, replay_endpoint=f"tcp://127.0.0.1:{server.port}",
                             residency=KvResidency())
        src.handle(frames(0, stored([1])))
        src.handle(frames(1, stored([2])))
        src.handle(frames(5, stored([50])))   # 2, 3 replayed; 4 lost (not in vLLM's buffer)
    finally:
        server.close()
    assert src.replayed == 2
    assert pipeline.snapshot().events_dropped == {("kv_events", "gap"): 1}
    assert src.residency.resident["gpu"].keys() == {1, 2, 20, 30, 50}
    src.handle(frames(5, stored([50])))       # a duplicate: ignored
    src.handle(frames(0, stored([9])))        # vLLM restarted: residency starts over
    assert src.residency.resident["gpu"].keys() == {9}
    src.handle([b"kv", b"short", b""])
    src.handle(frames(1)[:2] + [b"\xc1"])
    assert pipeline.snapshot().events_dropped[("kv_events", "malformed")] == 2


def test_without_replay_endpoint_gaps_are_counted():
    pipeline = Pipeline()
    src = KvEventsSource(pipeline)
    src.handle(frames(10, stored([1])))       # the first seen seq is no gap
    src.handle(frames(14, stored([2])))
    assert pipeline.snapshot().events_dropped == {("kv_events", "gap"): 3}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_vllm_engine_streams_kv_events(tmp_path):
    """vLLM with --kv-events-config connecting to us (no '*': the subscriber binds) and the
    kvscope tap: GPU residency, CPU offloads and evictions arrive, with no gap."""
    python = vllm_python()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pipeline = Pipeline()
    source = KvEventsSource(pipeline, endpoint, topic="kv",
                            residency=KvResidency(block_bytes=32768))
    source.start()
    try:
        run_driver(python, "offload", str(tmp_path / "out.json"), "--kv-events", endpoint,
                   "--endpoint", f"ipc://{tmp_path}/nobody.sock", log=tmp_path / "vllm.log")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not pipeline.snapshot().transfer_blocks:
            time.sleep(0.1)
    finally:
        source.shutdown()
    snap = pipeline.snapshot()
    result = json.loads((tmp_path / "out.json").read_text())
    assert snap.events_received.get("kv_events", 0) > 0
    assert snap.source_up == {"kv_events": True}
    assert snap.transfer_blocks.get(("gpu", "cpu"), 0) > 0
    assert snap.transfer_bytes[("gpu", "cpu")] == snap.transfer_blocks[("gpu", "cpu")] * 32768
    assert snap.evicted_blocks.get(("gpu", "capacity"), 0) > 0
    assert snap.evicted_blocks.get(("cpu", "capacity"), 0) > 0
    assert 0 < snap.tiers["gpu"].resident_blocks <= result["gpu_blocks"]
    assert 0 < snap.tiers["cpu"].resident_blocks <= result["cpu_blocks"]
    assert ("kv_events", "gap") not in snap.events_dropped
