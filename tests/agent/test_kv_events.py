"""The vLLM KV events source: mapping on literal batches, gaps and replay over real ZMQ
sockets (vLLM's replay protocol), and the live stream of a real vLLM engine."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import msgspec
import pytest
import zmq

from kvscope import catalog
from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.agent.metrics import snapshot_samples
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources import kv_events
from kvscope.agent.sources.kv_events import KvEventsSource, KvResidency, decode, vllm_binds
from kvscope.service.agent import Agent
from conftest import wait_until
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


def test_without_block_bytes_the_residency_in_bytes_is_not_measured():
    """block_bytes unset (0, its default): the source knows the blocks it saw, not their size.
    Its snapshots said 0 bytes resident beside 2 blocks; now None (not measured)."""
    r = KvResidency(block_bytes=0, capacity_blocks={"gpu": 8})
    out = r.apply(1.0, decode(payload(stored([1, 2])))[1])
    (snap,) = [e for e in out if type(e).__name__ == "TierSnapshot"]
    assert (snap.resident_blocks, snap.resident_bytes, snap.capacity_bytes) == (2, None, 0)


def test_cpu_stores_of_blocks_on_disk_are_promotions_not_offloads():
    """vLLM's tiering (CPU over an fs tier) announces a disk->cpu promotion as ``BlockStored``
    medium CPU of the same hash as the block's STORAGE store (both come from its OffloadKey).

    batch 1: GPU 1-4, CPU 1-4, CPU 6       -> gpu->cpu 5
    batch 2: STORAGE 1-4                    -> cpu->disk 4
    batch 3: CPU removes 1, 2; GPU 1, 2     -> cpu evictions 2, kept on disk (not dropped)
    batch 4: CPU 1, 2 (on disk); CPU 5      -> disk->cpu 2 (promotions), gpu->cpu 1
    batch 5: CPU removes 6, then STORAGE 6  -> the disk's store of 6 follows the CPU's removal
                                               in one batch (vLLM lists the primary tier's
                                               events first): cpu->disk 1, 6 kept on disk
    batch 6: CPU removes 5                  -> 5 was never on disk: dropped
    batch 7: AllBlocksCleared; CPU 3        -> gpu and cpu cleared (cpu 1-4: kept on disk), the
                                               disk tier keeps its blocks: 3 is a promotion
    Totals: gpu->cpu 6, cpu->disk 5, disk->cpu 3; cpu evictions capacity 4 (dropped 1),
    cleared 4; gpu evictions capacity 2, cleared 2; resident gpu 0, cpu 1, disk 5.
    (Before: every CPU store was an offload, gpu->cpu 9; every eviction dropped; a reset
    emptied the disk tier.)"""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline, residency=KvResidency(block_bytes=10))
    for seq, events in enumerate([
        [stored([1, 2, 3, 4]), stored([1, 2, 3, 4], "CPU"), stored([6], "CPU")],
        [stored([1, 2, 3, 4], "STORAGE")],
        [removed([1, 2], "CPU"), removed([1, 2])],
        [stored([1, 2], "CPU"), stored([5], "CPU")],
        [removed([6], "CPU"), stored([6], "STORAGE")],
        [removed([5], "CPU")],
        [{"type": "AllBlocksCleared"}, stored([3], "CPU")],
    ]):
        src.handle(frames(seq, *events))
    snap = pipeline.snapshot()
    assert snap.transfer_blocks == {("gpu", "cpu"): 6, ("cpu", "disk"): 5, ("disk", "cpu"): 3}
    assert snap.transfer_bytes[("disk", "cpu")] == 30
    assert snap.transfer_seconds == {}  # untimed
    # KV events show no failed copy: no failure series (not measured), where each read 0
    assert snapshot_samples(snap)[catalog.TRANSFER_FAILURES] == []
    assert snap.evicted_blocks == {("cpu", "capacity"): 4, ("cpu", "cleared"): 4,
                                   ("gpu", "capacity"): 2, ("gpu", "cleared"): 2}
    # GPU 1, 2 and the cleared 3, 4 are on disk: gpu 0 dropped, measured (a series at 0)
    assert snap.dropped_blocks == {"cpu": 1, "gpu": 0}
    assert {t: s.resident_blocks for t, s in snap.tiers.items()} == {"gpu": 0, "cpu": 1,
                                                                      "disk": 5}



def test_storage_events_are_disk_whatever_their_ownership_or_locality():
    """vLLM's ``BlockStored``/``BlockRemoved`` carry ``locality`` and ``ownership``
    (0.32 and 0.33 ``distributed/kv_events.py``), but ``ownership`` names no tier type: only the
    kvcr tier sets it, to "kvcr" (``kv_offload/tiering/kvcr/manager.py``); fs and obj both
    publish STORAGE with no ownership (``tiering/fs/manager.py``, ``tiering/obj/manager.py``),
    p2p publishes nothing. So every STORAGE block is the disk tier's: stores 7 (kvcr), 8
    (locality REMOTE) and 9 -> cpu->disk 3, disk resident 3; the removal of 8 -> 2."""
    r = KvResidency(tiers=["disk"])
    out = r.apply(1.0, decode(payload(
        {**stored([7], "STORAGE"), "ownership": "kvcr"},
        {**stored([8], "STORAGE"), "locality": "REMOTE"}, stored([9], "STORAGE")))[1])
    assert [(e.src, e.dst, e.blocks) for e in out if isinstance(e, ev.Transfer)] == [
        ("cpu", "disk", 3)]
    assert [(e.tier, e.resident_blocks) for e in out if isinstance(e, ev.TierSnapshot)] == [
        ("disk", 3)]
    out = r.apply(2.0, decode(payload({**removed([8], "STORAGE"), "locality": "REMOTE",
                                       "ownership": None}))[1])
    assert [(e.tier, e.resident_blocks) for e in out if isinstance(e, ev.TierSnapshot)] == [
        ("disk", 2)]

def test_tiers_limit_what_the_source_reports():
    """``tiers = ["gpu"]`` (the setting beside kvscope's tap): the same stream as above yields
    only the GPU tier: its residency and evictions, no transfers, nothing about cpu or disk.
    ``["cpu"]`` still tells promotions apart (disk residency is kept, not reported)."""
    stream = [[stored([1, 2, 3]), stored([1, 2, 3], "CPU")], [stored([1, 2, 3], "STORAGE")],
              [removed([1]), removed([1, 2], "CPU")], [stored([1], "CPU")]]
    out = []
    gpu_only = KvResidency(tiers=["gpu"])
    for events in stream:
        out += gpu_only.apply(1.0, decode(payload(*events))[1])
    assert {(type(e).__name__, e.tier) for e in out if not isinstance(e, ev.Transfer)} == \
        {("TierSnapshot", "gpu"), ("Eviction", "gpu")}
    assert not any(isinstance(e, ev.Transfer) for e in out)
    assert [(e.blocks, e.offloaded) for e in out if isinstance(e, ev.Eviction)] == [(1, True)]
    assert gpu_only.resident.keys() == {"gpu", "cpu", "disk"}  # tracked, not reported
    out = []
    cpu_only = KvResidency(tiers=["cpu"])
    for events in stream:
        out += cpu_only.apply(1.0, decode(payload(*events))[1])
    assert sorted((e.src, e.dst, e.blocks) for e in out if isinstance(e, ev.Transfer)) == \
        [("disk", "cpu", 1), ("gpu", "cpu", 3)]
    assert [(e.tier, e.blocks, e.offloaded) for e in out if isinstance(e, ev.Eviction)] == \
        [("cpu", 2, True)]
    assert {e.tier for e in out if isinstance(e, ev.TierSnapshot)} == {"cpu"}
    with pytest.raises(ValueError, match="tape"):
        KvResidency(tiers=["gpu", "tape"])


def test_gpu_evictions_of_blocks_kept_in_cpu_or_disk_are_not_dropped():
    """A GPU eviction of a hash resident in the cpu or disk tier at the end of its batch is
    ``offloaded`` (vLLM's GPU block pool and its offloading connector name a block by the same
    hash), also with ``tiers = ["gpu"]`` (cpu and disk tracked, not reported).

    batch 1: GPU 1-6; CPU 1, 2, 3                      -> gpu->cpu 3
    batch 2: STORAGE 1; CPU removes 1                  -> 1 kept on disk only
    batch 3: GPU removes 1, 2, 4, 5; then CPU 4        -> 1 (disk), 2 (cpu) and 4 (the CPU's
                                                          store follows the pool's removal in
                                                          the batch) offloaded; 5 dropped
    batch 4: GPU removes 3; CPU removes 3              -> 3 left both: dropped
    batch 5: GPU 7; CPU 6; STORAGE 6
    batch 6: AllBlocksCleared                          -> gpu 6 (on disk) offloaded, 7 dropped
    GPU evictions: capacity 5 (offloaded 3: 1, 2, 4; dropped 2: 5, 3), cleared 2 (offloaded 1,
    dropped 1): dropped_blocks gpu 3. (Before: every GPU eviction dropped, 7.)"""
    stream = [
        [stored([1, 2, 3, 4, 5, 6]), stored([1, 2, 3], "CPU")],
        [stored([1], "STORAGE"), removed([1], "CPU")],
        [removed([1, 2, 4, 5]), stored([4], "CPU")],
        [removed([3]), removed([3], "CPU")],
        [stored([7]), stored([6], "CPU"), stored([6], "STORAGE")],
        [{"type": "AllBlocksCleared"}],
    ]
    for tiers in (["gpu", "cpu", "disk"], ["gpu"]):
        pipeline = Pipeline()
        src = KvEventsSource(pipeline, residency=KvResidency(block_bytes=10, tiers=tiers))
        for seq, events in enumerate(stream):
            src.handle(frames(seq, *events))
        snap = pipeline.snapshot()
        assert snap.evicted_blocks[("gpu", "capacity")] == 5, tiers
        assert snap.evicted_blocks[("gpu", "cleared")] == 2, tiers
        assert snap.dropped_blocks["gpu"] == 3, tiers
    # per batch, from the mapping itself
    r = KvResidency(tiers=["gpu"])
    evictions = [[(e.reason, e.blocks, e.offloaded) for e in r.apply(1.0, decode(payload(*b))[1])
                  if isinstance(e, ev.Eviction)] for b in stream]
    assert evictions == [[], [], [("capacity", 1, False), ("capacity", 3, True)],
                         [("capacity", 1, False)], [],
                         [("cleared", 1, False), ("cleared", 1, True)]]


def test_lower_tiers_tracked_for_the_gpu_tier_stay_within_max_tracked():
    """cpu and disk are tracked for the GPU tier's sake within ``max_tracked`` hashes each; a
    hash the cpu tier could not remember makes its GPU eviction count as dropped."""
    r = KvResidency(tiers=["gpu"], max_tracked=2)
    r.apply(1.0, decode(payload(stored([1, 2]), stored([3, 1, 2], "CPU"),
                                stored([4, 5, 6], "STORAGE")))[1])
    assert {t: len(h) for t, h in r.resident.items()} == {"gpu": 2, "cpu": 2, "disk": 2}
    out = r.apply(2.0, decode(payload(removed([1, 2])))[1])
    assert [(e.blocks, e.offloaded) for e in out if isinstance(e, ev.Eviction)] == \
        [(1, False), (1, True)]  # 2 was not remembered in the full cpu tier: dropped


def test_removals_of_blocks_stored_before_the_agent_listened_are_ignored():
    """An agent restarted while vLLM runs: GPU hashes 1 and 2 were stored before it listened,
    so their removal says nothing it can place (counted as dropped before: false alarms). Hash
    3, stored since, counts: 1 eviction, dropped (no copy below), residency 0 afterwards."""
    r = KvResidency(tiers=["gpu"])
    out = r.apply(1.0, decode(payload(removed([1, 2]), stored([3]), removed([3])))[1])
    assert [(e.tier, e.blocks, e.offloaded) for e in out if isinstance(e, ev.Eviction)] == \
        [("gpu", 1, False)]
    assert [e.resident_blocks for e in out if isinstance(e, ev.TierSnapshot)] == [0]


def _tap_events(n: int) -> list:
    """What kvscope's tap reports for ``n`` blocks offloaded and 1 evicted from the CPU tier."""
    return [ev.Transfer(ts=1.0, src="gpu", dst="cpu", blocks=n, bytes=n * 10, duration=0.01),
            ev.Eviction(ts=1.0, tier="cpu", blocks=1, bytes=10, age=1.0, hits=0,
                        offloaded=False)]


def test_with_the_tap_tiers_gpu_counts_each_block_once():
    """The tap and the KV events source see the same 3 offloads and 1 CPU eviction. With
    ``tiers = ["gpu"]`` the totals are the tap's: gpu->cpu 3, cpu evictions 1 (all tiers:
    6 and 2, and the source says so)."""
    stream = [stored([1, 2, 3]), stored([1, 2, 3], "CPU"), removed([1], "CPU")]
    for tiers, expected in ((["gpu"], (3, 1, set())), (["gpu", "cpu", "disk"], (6, 2, {"cpu"}))):
        pipeline = Pipeline()
        src = KvEventsSource(pipeline, residency=KvResidency(block_bytes=10, tiers=tiers))
        pipeline.ingest("vllm", _tap_events(3))
        src.handle(frames(0, *stream))
        snap = pipeline.snapshot()
        assert (snap.transfer_blocks[("gpu", "cpu")], snap.evicted_blocks[("cpu", "capacity")],
                src.check_overlap()) == expected, tiers
        assert snap.tiers["gpu"].resident_blocks == 3


def test_another_source_reporting_the_same_tiers_is_warned_about_once(caplog):
    """The source alone: no warning. A second source adding gpu->cpu transfers and CPU
    evictions (the tap): one warning naming the tier, the other source and the key to set."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline, residency=KvResidency(block_bytes=10))
    src.handle(frames(0, stored([1, 2]), stored([1, 2], "CPU"), stored([1], "STORAGE"),
                      removed([2], "CPU")))
    pipeline.ingest("vllm", [ev.Transfer(ts=1.0, src="cpu", dst="gpu", blocks=1, bytes=10,
                                         duration=0.01)])  # loads: only the tap sees them
    assert src.check_overlap() == set() and not caplog.records
    pipeline.ingest("vllm", _tap_events(2))
    with caplog.at_level("WARNING", logger="kvscope.agent.sources.kv_events"):
        assert src.check_overlap() == {"cpu"}
        src.handle(frames(1, stored([3], "CPU")))
        pipeline.ingest("vllm", _tap_events(1))
        assert src.check_overlap() == {"cpu"}
    assert len(caplog.records) == 1, caplog.records
    message = caplog.records[0].getMessage()
    assert "tier cpu" in message and "vllm" in message and "[kv_events] tiers" in message
    assert 'tiers = ["gpu", "disk"]' in message and 'tiers = ["gpu"]' in message
    assert "KVSCOPE_KV_EVENTS__TIERS=gpu,disk" in message


def test_the_run_loop_checks_for_overlap(caplog):
    """Started, the source checks by itself every ``overlap_check`` seconds."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline, f"tcp://127.0.0.1:{_free_port()}", overlap_check=0.05)
    pipeline.ingest("vllm", _tap_events(1))
    with caplog.at_level("WARNING", logger="kvscope.agent.sources.kv_events"):
        src.start()
        try:
            deadline = time.monotonic() + 5
            while not src.shared_tiers and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            src.shutdown()
    assert src.shared_tiers == {"cpu"} and len(caplog.records) == 1


def test_the_agent_passes_tiers_on():
    settings = AgentSettings(kv_events={"enabled": True, "endpoint": "tcp://127.0.0.1:1",
                                        "tiers": ["gpu"]},
                             vllm_metrics={"enabled": True},
                             collectors={"gpu": {"enabled": False}, "host": {"enabled": False}})
    agent = Agent(settings, with_ingest=False)
    assert agent.kv_events.residency.tiers == {"gpu"}
    # the metrics source leaves out what KV events report: GPU residency, gpu->cpu offloads,
    # promotions into the CPU tier and stores below it; and adds the CPU tier's capacity to
    # the residency they report
    def flags(mapper):
        return (mapper.gpu_snapshot, mapper.stores, mapper.cpu_capacity,
                mapper.tier_promotions, mapper.tier_offloads)

    assert flags(agent.vllm_metrics.mapper) == (False, True, False, True, True)
    settings.kv_events.tiers = ["cpu", "disk"]  # GPU residency from /metrics again
    assert flags(Agent(settings, with_ingest=False).vllm_metrics.mapper) == (
        True, False, True, False, False)
    settings.kv_events.enabled = False  # everything from /metrics
    assert flags(Agent(settings, with_ingest=False).vllm_metrics.mapper) == (
        True, True, False, True, True)


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


@pytest.mark.parametrize("ts", [math.nan, math.inf, 1e300, -1.0])
def test_a_batch_of_no_real_time_is_malformed_and_spoils_no_residency(ts):
    """A block stored on CPU at 1000 s, removed in a batch whose time is ``ts``: the batch is
    1 malformed. A NaN time had made the removal's age NaN, and the residency histogram's sum
    NaN for good (a later, sound removal after 1000 s more left it NaN)."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline)
    src.handle([b"kv", (0).to_bytes(8, "big"), payload(stored([1, 2], "CPU"), ts=1000.0)])
    src.handle([b"kv", (1).to_bytes(8, "big"), payload(removed([1], "CPU"), ts=ts)])
    src.handle([b"kv", (2).to_bytes(8, "big"), payload(removed([2], "CPU"), ts=2000.0)])
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("kv_events", "malformed"): 1}
    residency = snap.block_residency_seconds["cpu"]
    assert (residency.count, residency.sum) == (1, 1000.0)


def test_without_replay_endpoint_gaps_are_counted():
    pipeline = Pipeline()
    src = KvEventsSource(pipeline)
    src.handle(frames(10, stored([1])))       # the first seen seq is no gap
    src.handle(frames(14, stored([2])))
    assert pipeline.snapshot().events_dropped == {("kv_events", "gap"): 3}


def test_the_first_drop_of_each_reason_is_logged_with_what_was_wrong(caplog):
    """Drops were only counted: two short messages, one payload that does not decode and a
    gap of 3 give one line each for malformed and gap, saying what was wrong."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline)
    src.handle([b"kv", b"short", b""])
    src.handle([b"kv", b"short"])
    src.handle(frames(9)[:2] + [b"\xc1"])
    src.handle(frames(10, stored([1])))
    src.handle(frames(14, stored([2])))
    assert pipeline.snapshot().events_dropped == {("kv_events", "malformed"): 3,
                                                  ("kv_events", "gap"): 3}
    lines = [r.getMessage() for r in caplog.records if "kv_events: dropped" in r.getMessage()]
    assert lines == ["kv_events: dropped 1 (malformed): 3 frames, not topic, 8-byte sequence, "
                     "payload; logged once per reason",
                     "kv_events: dropped 3 (gap): 3 batches missing after 10; logged once per "
                     "reason"], lines


def test_odd_sequence_numbers_neither_stop_the_source_nor_inflate_gaps(caplog):
    """A negative seq (vLLM counts from 0) once crashed the replay request and killed the
    thread: it is malformed (1). A jump of 2**62 once added 4.6e18 to gap: it is followed and
    logged (a replay endpoint is configured but never asked). Then 2**62 + 2: a gap of 1 (the
    replay endpoint answers nothing: 1 lost)."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline, replay_endpoint=f"tcp://127.0.0.1:{_free_port()}",
                         replay_timeout=0.2)
    for seq in (0, -5, 2**62, 2**62 + 2):
        src.handle([b"kv", seq.to_bytes(8, "big", signed=True), payload(stored([seq % 7]))])
    assert pipeline.snapshot().events_dropped == {("kv_events", "malformed"): 1,
                                                  ("kv_events", "gap"): 1}
    assert "jumped 4611686018427387903 batches ahead" in caplog.text


def test_a_batch_nested_past_the_decoders_depth_is_malformed_and_the_source_goes_on():
    """A KVEventBatch whose events nest 10,000 arrays deep once raised RecursionError out of
    handle() and ended the source's thread: it is 1 malformed, and the next batch folds."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline)
    deep = b"\x93" + msgspec.msgpack.encode(100.0) + b"\x91" * 10_001 + b"\xc0" + b"\x00"
    src.handle([b"kv", (0).to_bytes(8, "big"), deep])
    src.handle(frames(1, stored([1])))
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("kv_events", "malformed"): 1}
    assert snap.tiers["gpu"].resident_blocks == 1


def test_a_bug_handling_one_message_is_counted_and_the_source_goes_on(monkeypatch, caplog):
    """A bug is simulated: handling raises for the first two messages from a live publisher.
    Each counts as 1 malformed, one traceback is logged (the repeat at debug level), and the
    third message is folded."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pipeline = Pipeline()
    source = KvEventsSource(pipeline, endpoint)
    handle, calls = source.handle, []

    def handle_raising_twice(frames):
        calls.append(1)
        if len(calls) <= 2:
            raise KeyError("a bug")
        handle(frames)

    monkeypatch.setattr(source, "handle", handle_raising_twice)
    caplog.set_level("DEBUG", logger="kvscope.agent.worker")  # log_level = "debug"
    source.start()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    try:
        publisher.connect(endpoint)
        assert wait_until(lambda: pipeline.snapshot().source_up.get("kv_events") is True)
        time.sleep(0.5)  # a PUB drops what it sends before the subscription reaches it
        for seq in range(3):
            publisher.send_multipart(frames(seq, stored([seq])))
        assert wait_until(lambda: "gpu" in pipeline.snapshot().tiers)
    finally:
        publisher.close()
        source.shutdown()
    assert pipeline.snapshot().events_dropped == {("kv_events", "malformed"): 2}
    assert caplog.text.count("Traceback") == 1
    # the repeat: at debug level only, one line without a traceback
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "a bug" in r.getMessage()
            or r.exc_info] == [
        ("ERROR", "kvscope kvscope-kv-events: handling a message failed (a bug; logged once per "
                  "exception type, every one at log_level debug)"),
        ("DEBUG", "kvscope kvscope-kv-events: handling a message failed again (KeyError: "
                  "'a bug')")]


def test_a_vllm_restart_resets_every_reported_tier_at_once():
    """2 CPU blocks resident; vLLM restarts (seq goes back) and its first batch has GPU events
    only: the CPU tier's gauges read 0 at once, not 2 until a CPU event comes. The disk tier,
    reported by default but never seen, stays unreported (its zero snapshot once made every
    later lookup count disk misses)."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline)
    src.handle(frames(5, stored([1, 2], "CPU")))
    assert pipeline.snapshot().tiers["cpu"].resident_blocks == 2
    src.handle(frames(0, stored([9])))
    tiers = pipeline.snapshot().tiers
    assert tiers["cpu"].resident_blocks == 0 and tiers["gpu"].resident_blocks == 1
    assert sorted(tiers) == ["cpu", "gpu"]


def test_a_publisher_back_after_a_lost_connection_reports_every_tier_again():
    """Batch 0 stores GPU 1-4, CPU 1-4, STORAGE 1-2; the connection drops (the tiers leave the
    gauges) and the same vLLM comes back with batch 1 (its sequence goes on: no restart),
    which stores GPU 5 only. Gauges: gpu 4 + 1 = 5, cpu 4 and disk 2 unchanged. Only gpu 5
    was read: the cpu and disk tiers, with no event in batch 1, stayed absent although the
    residency still held their blocks."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline, "tcp://127.0.0.1:5557")
    src.handle(frames(0, stored([1, 2, 3, 4]), stored([1, 2, 3, 4], "CPU"),
                      stored([1, 2], "STORAGE")))
    src._peer_event(zmq.EVENT_CONNECTED)
    src._peer_event(zmq.EVENT_DISCONNECTED)
    assert pipeline.snapshot().tiers == {}
    src._peer_event(zmq.EVENT_CONNECTED)
    src.handle(frames(1, stored([5])))
    tiers = pipeline.snapshot().tiers
    assert {t: s.resident_blocks for t, s in tiers.items()} == {"gpu": 5, "cpu": 4, "disk": 2}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_vllm_engine_streams_kv_events(tmp_path):
    """vLLM with --kv-events-config connecting to us (no '*': the subscriber binds) and the
    kvscope tap: GPU residency, CPU offloads and evictions arrive, with no gap. Once vLLM has
    gone its tiers leave the gauges; what they held is read as its publisher went."""
    python = vllm_python()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pipeline = Pipeline()
    ups = []  # the source's up/down states, in order
    record_up = pipeline.set_source_up
    pipeline.set_source_up = lambda name, up: (ups.append(up), record_up(name, up))
    left = []  # the tiers as vLLM left them
    forget = pipeline.forget_tiers
    pipeline.forget_tiers = lambda name: (left.append(pipeline.snapshot().tiers), forget(name))
    source = KvEventsSource(pipeline, endpoint, topic="kv",
                            residency=KvResidency(block_bytes=32768))
    source.start()
    try:
        run_driver(python, "offload", str(tmp_path / "out.json"), "--kv-events", endpoint,
                   "--endpoint", f"ipc://{tmp_path}/nobody.sock", log=tmp_path / "vllm.log")
        assert wait_until(lambda: left, timeout=10)
    finally:
        source.shutdown()
    snap = pipeline.snapshot()
    assert snap.tiers == {}
    snap.tiers = left[0]
    result = json.loads((tmp_path / "out.json").read_text())
    assert snap.events_received.get("kv_events", 0) > 0
    assert ups[:2] == [False, True]  # down until vLLM connected, up while it published
    assert snap.transfer_blocks.get(("gpu", "cpu"), 0) > 0
    assert snap.transfer_bytes[("gpu", "cpu")] == snap.transfer_blocks[("gpu", "cpu")] * 32768
    assert snap.evicted_blocks.get(("gpu", "capacity"), 0) > 0
    assert snap.evicted_blocks.get(("cpu", "capacity"), 0) > 0
    assert 0 < snap.tiers["gpu"].resident_blocks <= result["gpu_blocks"]
    assert 0 < snap.tiers["cpu"].resident_blocks <= result["cpu_blocks"]
    assert ("kv_events", "gap") not in snap.events_dropped


def test_the_source_is_up_only_while_a_publisher_is_connected():
    """A SUB socket hears nothing, silently, from an endpoint nobody publishes on: the source
    reads 0 until vLLM's PUB (here a plain ZMQ PUB) connects, 1 while it is, 0 once it left;
    the GPU tier it reported (1 block) leaves with it (it stayed resident for good)."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pipeline = Pipeline()
    source = KvEventsSource(pipeline, endpoint, residency=KvResidency())
    source.start()
    up = lambda: pipeline.snapshot().source_up.get("kv_events")  # noqa: E731
    gpu = lambda: pipeline.snapshot().tiers.get("gpu")  # noqa: E731
    try:
        assert up() is False
        publisher = zmq.Context.instance().socket(zmq.PUB)
        publisher.setsockopt(zmq.LINGER, 0)
        publisher.connect(endpoint)
        assert wait_until(lambda: up() is True)
        # what it sends before the subscription reached it is lost: repeats are duplicates
        assert wait_until(lambda: publisher.send_multipart(frames(0, stored([1]))) or gpu())
        assert gpu().resident_blocks == 1
        publisher.close()
        assert wait_until(lambda: up() is False)
        assert gpu() is None
    finally:
        source.shutdown()


def test_a_restarted_engine_numbering_from_where_its_predecessor_stopped_starts_over():
    """vLLM published step 0 (blocks 1, 2) and went; restarted, it publishes step 0 again
    (blocks 7, 8, 9), then step 1 (block 10). The restart's step 0 was a duplicate of the
    old one, ignored, so its blocks went unseen and the old ones stayed resident for good:
    a publisher lost since its last step sends no step twice, so its next 0 is a new
    engine's. Its cache is {7, 8, 9, 10}."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pipeline = Pipeline()
    source = KvEventsSource(pipeline, endpoint, residency=KvResidency())
    up = lambda: pipeline.snapshot().source_up.get("kv_events")  # noqa: E731
    gpu = lambda: source.residency.resident.get("gpu", {}).keys()  # noqa: E731
    source.start()
    try:
        for hashes in ([1, 2], [7, 8, 9]):
            publisher = zmq.Context.instance().socket(zmq.PUB)
            publisher.setsockopt(zmq.LINGER, 0)
            publisher.connect(endpoint)
            # until the subscription has reached the publisher, what it sends is lost: send
            # the first step until it arrives (its repeats are duplicates, ignored)
            assert wait_until(lambda: publisher.send_multipart(frames(0, stored(hashes)))
                              or gpu() == set(hashes))
            if hashes == [1, 2]:
                publisher.close()
                assert wait_until(lambda: up() is False)
        publisher.send_multipart(frames(1, stored([10])))
        assert wait_until(lambda: gpu() == {7, 8, 9, 10})
        publisher.close()
    finally:
        source.shutdown()
    assert pipeline.snapshot().events_dropped == {}


def test_a_publisher_already_bound_when_the_agent_starts_reads_up(caplog, monkeypatch):
    """vLLM binds its PUB (``tcp://*:PORT``) and runs before the agent starts: the agent's
    connection is made as soon as it connects, in ZMQ's I/O thread, so the source reads 1 and
    logs "connected". Its connection monitor once began after connect(), and when the agent's
    other threads held the GIL in between, the source read 0 while events arrived, and warned
    after 120 s that no publisher was there. Starting the monitor is slowed here by 50 ms
    (pyzmq's own method, delayed) so that the connection is made first whenever it can be."""
    real = zmq.Socket.get_monitor_socket

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(zmq.Socket, "get_monitor_socket", slow)
    port = _free_port()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.bind(f"tcp://*:{port}")
    pipeline = Pipeline()
    source = KvEventsSource(pipeline, f"tcp://*:{port}")
    caplog.set_level("INFO", logger="kvscope.agent.sources.kv_events")
    try:
        source.start()
        assert wait_until(lambda: pipeline.snapshot().source_up.get("kv_events") is True, 10)
        assert wait_until(lambda: publisher.send_multipart(frames(0, stored([1])))
                          or "gpu" in pipeline.snapshot().tiers)
    finally:
        source.shutdown()
        publisher.close()
    assert any("connected to vLLM's publisher" in r.getMessage() for r in caplog.records)


def test_no_publisher_in_time_is_logged_once_with_what_the_engine_needs(monkeypatch, caplog):
    """Nobody publishes on the endpoint: after NO_PUBLISHER_AFTER (0.2 s here) one warning
    that says so and what vLLM's --kv-events-config needs (the log said nothing at all, and
    the source read 0 on /metrics alone)."""
    monkeypatch.setattr(kv_events, "NO_PUBLISHER_AFTER", 0.2)
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    with caplog.at_level("WARNING", logger="kvscope.agent.sources.kv_events"):
        quiet = KvEventsSource(Pipeline(), endpoint)
        quiet.start()
        try:
            assert wait_until(lambda: caplog.records)
            time.sleep(0.5)  # and no second one
        finally:
            quiet.shutdown()
    assert [r.getMessage() for r in caplog.records] == [
        f"kvscope kv_events: no vLLM publisher yet after 0.2 s; this agent binds {endpoint}: vLLM "
        f'must connect, so its --kv-events-config endpoint must be "{endpoint}" (with * or '
        ":: vLLM binds as well and nothing arrives)"]


def test_the_log_names_the_address_connected_to_not_the_wildcard(caplog):
    """vLLM binds ``tcp://*:PORT`` (its --kv-events-config endpoint) and the agent connects to
    ``tcp://127.0.0.1:PORT``: the connected line named the wildcard, which is no address.
    The source's monitor events are handed over as ZMQ reports them (a live publisher's:
    test_the_source_is_up_only_while_a_publisher_is_connected)."""
    source = KvEventsSource(Pipeline(), "tcp://*:5557")
    with caplog.at_level("INFO", logger="kvscope.agent.sources.kv_events"):
        source._peer_event(zmq.EVENT_CONNECTED)
        source._peer_event(zmq.EVENT_DISCONNECTED)
    assert [r.getMessage() for r in caplog.records] == [
        "kvscope kv_events: connected to vLLM's publisher at tcp://127.0.0.1:5557",
        "kvscope kv_events: lost vLLM's publisher at tcp://127.0.0.1:5557"]


def test_a_step_of_megabytes_from_the_vllm_it_connects_to_is_read_and_so_is_what_follows():
    """vLLM binds (``tcp://*:PORT``, the agent connects): a step publishing 5 MiB (a long
    prompt's token ids; 1.2M here) and then a small one both arrive. With the 4 MiB MAXMSGSIZE
    the bound socket has, ZMQ ended the connecting session at the big one and the source never
    heard vLLM again (source_up stayed 0 until a restart)."""
    port = _free_port()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    pipeline = Pipeline()
    source = KvEventsSource(pipeline, f"tcp://*:{port}", residency=KvResidency())
    source.start()
    big = dict(stored([1]), token_ids=list(range(1_200_000)))
    try:
        # until the subscription has reached the publisher, what it sends is lost: send a
        # first step until it arrives (its repeats are duplicates, ignored)
        assert wait_until(lambda: publisher.send_multipart(frames(0, stored([0])))
                          or source.residency.resident.get("gpu", {}).keys() == {0})
        publisher.send_multipart(frames(1, big))
        assert len(frames(1, big)[2]) > 5 << 20
        publisher.send_multipart(frames(2, stored([2])))
        assert wait_until(lambda: source.residency.resident["gpu"].keys() == {0, 1, 2})
        assert pipeline.snapshot().events_dropped == {}
    finally:
        source.shutdown()
        publisher.close()


def test_a_topic_vllm_does_not_use_is_said_once_and_its_messages_ignored(caplog):
    """The agent is set to topic "kv", vLLM publishes on its default "": the source was up
    (connected), folded nothing and said nothing. Now one warning names both topics; messages
    on other topics are not counted as malformed, whatever their shape."""
    pipeline = Pipeline()
    src = KvEventsSource(pipeline, topic="kv", residency=KvResidency())
    for seq in range(3):
        src.handle([b"", seq.to_bytes(8, "big"), payload(stored([seq]))])
    assert "gpu" not in src.residency.resident and src.last_seq is None
    src.handle([b"metrics", b"two frames"])  # another topic, another shape: not malformed
    assert caplog.text.count("ignoring messages on topic '', as [kv_events] topic is 'kv'") == 1
    src.handle(frames(0, stored([7])))  # "kv"
    assert src.residency.resident["gpu"].keys() == {7}
    assert pipeline.snapshot().events_dropped == {}
