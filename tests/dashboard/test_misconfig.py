"""Misconfiguration detectors (kvscope/dashboard/misconfig.py) on hand-built samples: each fires
on a planted misconfiguration, stays silent on its healthy near miss, and says "not measured"
(never "ok") where no sample carries its signal. The view renders a banner per finding. The
budget over the limit also fires from live agents in a real cgroup with a memory limit."""

from __future__ import annotations

import json
import os

from conftest import agent_samples, start_agent
from dash import html

from tests.cgroups import limited_cgroup, move

from kvscope.dashboard import misconfig as M
from kvscope.dashboard import misconfig_view
from kvscope.dashboard.misconfig import MISCONFIGURED, NOT_MEASURED, OK, Settings
from kvscope.dashboard.topology_view import topologies

T0 = 1_700_000_000.0
N = 61  # one a second: a 60 s window
GIB = 1024 ** 3
S = Settings()


def window(n: int = N, *, counters=None, gauges=None, scalars=None) -> list[dict]:
    """``n`` samples a second apart. ``counters``: field -> {key: increase per second} (or,
    for an unkeyed counter, a number); ``gauges``: field -> value in every sample (a dict or a
    number); ``scalars`` as gauges. Fields not given are absent (not measured)."""
    out = []
    for i in range(n):
        s: dict = {"ts": T0 + i}
        for name, rate in (counters or {}).items():
            s[name] = ({k: v * i for k, v in rate.items()} if isinstance(rate, dict)
                       else rate * i)
        s.update(gauges or {})
        s.update(scalars or {})
        out.append(s)
    return out


def status(findings, key) -> M.Finding:
    return next(f for f in findings if f.key == key)


def test_weight_offload_without_kv_offload():
    """4 GiB of weights per GPU and no offload tier: fires, saying weights, not KV; near
    misses: the same with a cpu budget, with a cpu tier's capacity, with stores into cpu (in
    bytes, or in blocks alone: KV events without block_bytes read as no offload tier, a
    false alarm); no --cpu-offload-gb; and no engine process read (not measured)."""
    weights = {"engine_weight_offload_bytes": 4 * GIB}
    f = M.weight_offload(window(scalars=weights))
    assert f.status == MISCONFIGURED
    assert "4.00 GiB" in f.wrong and "this moves weights, not KV" in f.wrong
    assert "--kv-offloading-size" in f.change
    for healthy in (window(scalars=weights, gauges={"offload_budget_bytes": {"cpu": 16 * GIB}}),
                    window(scalars=weights, gauges={"tier_capacity_bytes": {"cpu": GIB}}),
                    window(scalars=weights, counters={"transfer_bytes": {"gpu->cpu": 1e6}}),
                    window(scalars=weights, gauges={"tier_capacity_blocks": {"cpu": 1000}}),
                    window(scalars=weights, counters={"transfer_blocks": {"gpu->cpu": 500}}),
                    window(scalars={"engine_weight_offload_bytes": 0})):
        assert M.weight_offload(healthy).status == OK
    # a GPU tier's capacity is no KV offload
    assert M.weight_offload(window(scalars=weights, gauges={
        "tier_capacity_bytes": {"gpu": GIB}})).status == MISCONFIGURED
    missing = M.weight_offload(window())
    assert missing.status == NOT_MEASURED and "engine_pid" in missing.wrong


def test_budget_plus_reserve_over_the_limit():
    """A 12 GiB cpu budget + 4 GiB reserve on a 15 GiB limit: 1 GiB over; 11 + 4 on 15 fits
    exactly; a disk budget is not host RAM; no limit reported, or no cpu budget: not
    measured."""
    def host(cpu, limit=15 * GIB, more=None):
        return window(gauges={"offload_budget_bytes": {"cpu": cpu, **(more or {})}},
                      scalars={"host_memory_reserve_bytes": 4 * GIB,
                               "host_memory_limit_bytes": limit})
    f = M.budget_over_limit(host(12 * GIB), S)
    assert f.status == MISCONFIGURED and "1.00 GiB over" in f.wrong and "1.00 GiB" in f.change
    assert M.budget_over_limit(host(11 * GIB), S).status == OK
    assert M.budget_over_limit(host(GIB, more={"disk": 100 * GIB}), S).status == OK
    assert M.budget_over_limit(host(12 * GIB, limit=None), S).status == NOT_MEASURED
    # no host-RAM budget known (zero-code mode): it said "cpu budget 0.00 GiB ...: fits"
    unknown = M.budget_over_limit(host(None, more={"disk": 100 * GIB}), S)
    assert unknown.status == NOT_MEASURED and "[collectors.host] budgets" in unknown.wrong
    # a fleet: budgets added up over hosts (24 GiB), the reserve and limit of its tightest
    # host, whose own budget (memory part kv_offload) is 11 GiB: it fits; 12 GiB does not
    fleet = host(24 * GIB)
    fleet[-1] = {**fleet[-1], "host_memory_part_bytes": {"kv_offload": 11 * GIB}}
    assert M.budget_over_limit(fleet, S).status == OK
    fleet[-1] = {**fleet[-1], "host_memory_part_bytes": {"kv_offload": 12 * GIB}}
    assert "1.00 GiB over" in M.budget_over_limit(fleet, S).wrong


MIB = 1024 ** 2


def test_a_budget_over_a_real_cgroups_limit_fires_from_live_agents():
    """Two `kvscope agent` processes moved into a cgroup made here, limited to 1 GiB (this
    machine has far more RAM), each with a 200 MiB reserve: one with a cpu budget of 900 MiB
    (1100 MiB against 1024: 76 MiB over -> misconfigured), one of 800 MiB (1000 against 1024:
    fits, the near miss). Each agent reads the limit from inside the cgroup; the detector
    reads their samples as the dashboard does."""
    agents = []
    with limited_cgroup(GIB, "budget") as cgroup:
        try:
            for budget in (900, 800):
                agents.append(start_agent({
                    **os.environ, "KVSCOPE_COLLECTORS__HOST__RESERVE_BYTES": str(200 * MIB),
                    "KVSCOPE_COLLECTORS__HOST__BUDGETS": json.dumps({"cpu": budget * MIB})}))
                move(cgroup, agents[-1][0].pid)
            findings = [M.budget_over_limit(agent_samples(
                proc, port, lambda newest: newest.get("host_memory_limit_bytes") == GIB), S)
                for proc, port in agents]
        finally:
            for proc, _ in agents:
                proc.terminate()
                proc.wait(timeout=30)
    over, fits = findings
    assert over.status == MISCONFIGURED and "76.0 MiB over" in over.wrong, over
    assert "against a limit of 1.00 GiB" in over.wrong
    assert fits.status == OK and "fits" in fits.wrong, fits


def test_swap_in_while_offloading():
    """4 KiB/s swapped in with a cpu budget: fires; without any host-RAM tier, or with no
    swap-in: ok; no swap-in counter: not measured."""
    budget = {"offload_budget_bytes": {"cpu": 8 * GIB}, "host_memory_limit_bytes": 64 * GIB}
    f = M.swap_in(window(counters={"host_swap_in_bytes": 4096}, gauges=budget), S)
    assert f.status == MISCONFIGURED and "0.2 MiB" in f.wrong  # 4096 B/s x 60 s
    assert M.swap_in(window(counters={"host_swap_in_bytes": 4096},
                            gauges={"host_memory_limit_bytes": 64 * GIB}), S).status == OK
    assert M.swap_in(window(counters={"host_swap_in_bytes": 0}, gauges=budget), S).status == OK
    assert M.swap_in(window(gauges=budget), S).status == NOT_MEASURED
    # the counter reads 0 where the host collector gave no reading: not measured, not fine
    assert M.swap_in(window(counters={"host_swap_in_bytes": 0},
                            gauges={"offload_budget_bytes": {"cpu": 8 * GIB}}),
                     S).status == NOT_MEASURED


def test_tier_holding_data_that_serves_a_negligible_share():
    """A disk tier holding 2 GiB serves 0.5 % of prompt tokens: fires (below 1 %); at 2 % it
    is fine. A disk tier that reports no residency (vLLM's disk tier through the tap) but took
    stores counts as holding data. No prompt tokens: not measured."""
    def w(disk_tokens, resident=True):
        gauges = {"tier_resident_bytes": {"gpu": GIB, "disk": 2 * GIB}} if resident else {}
        return window(counters={"prompt_tokens": {"gpu": 600.0, "recompute": 400.0 - disk_tokens,
                                                  "disk": disk_tokens},
                                "transfer_bytes": {"cpu->disk": 1e6}}, gauges=gauges)
    f = M.tier_negligible(w(5.0), S)
    assert f.status == MISCONFIGURED and "disk tier holds 2.00 GiB" in f.wrong
    assert "0.50%" in f.wrong
    assert M.tier_negligible(w(20.0), S).status == OK
    f = M.tier_negligible(w(0.0, resident=False), S)
    assert f.status == MISCONFIGURED and "took" in f.wrong
    assert M.tier_negligible(window(), S).status == NOT_MEASURED


def test_a_tier_known_in_blocks_alone_can_be_negligible_too():
    """KV events without block_bytes report a cpu tier's residency and stores in blocks alone:
    the check read such a tier as holding nothing. 600 blocks resident, 0.5 % of the tokens:
    fires, in blocks; no residency but 50 blocks stored a second: fires too (took 3,000
    blocks over the window's 60 s); an empty tier (0 blocks) that took stores holds nothing."""
    tokens = {"prompt_tokens": {"gpu": 600.0, "recompute": 395.0, "cpu": 5.0}}
    f = M.tier_negligible(window(counters=tokens,
                                 gauges={"tier_resident_blocks": {"cpu": 600}}), S)
    assert f.status == MISCONFIGURED and "the cpu tier holds 600 blocks but served 0.50%" in f.wrong
    f = M.tier_negligible(window(counters={**tokens, "transfer_blocks": {"gpu->cpu": 50.0}}), S)
    assert f.status == MISCONFIGURED
    assert f"the cpu tier took {50 * (N - 1):,} blocks of offloads" in f.wrong
    empty = window(counters={**tokens, "transfer_blocks": {"gpu->cpu": 50.0}},
                   gauges={"tier_resident_blocks": {"cpu": 0}})
    assert (M.tier_negligible(empty, S).status, M.tier_negligible(empty, S).wrong) == (
        OK, "no offload tier holds data")


def test_a_remote_tier_is_not_judged_on_a_share_it_has_no_source_for():
    """LMCache with a remote L2 holding 2 GiB while half the prompt tokens come from cache,
    counted as cpu (no token source is remote): it read "the remote tier holds 2.00 GiB but
    served 0.00%". Its share is not measured; beside a cpu tier that serves 50% the finding
    is ok and names both. vLLM's obj tier promoting remote->cpu (timed) read "nothing saved",
    misconfigured: the prefill it saved is not measured either."""
    tokens = {"prompt_tokens": {"gpu": 500.0, "cpu": 500.0}}
    remote = {"tier_resident_bytes": {"remote": 2 * GIB}}
    f = M.tier_negligible(window(counters=tokens, gauges=remote), S)
    assert f.status == NOT_MEASURED
    assert "remote holds 2.00 GiB, its share of prompt tokens not measured" in f.wrong
    f = M.tier_negligible(window(counters=tokens, gauges={
        "tier_resident_bytes": {"remote": 2 * GIB, "cpu": GIB}}), S)
    assert f.status == OK and f.wrong.startswith("cpu served 50.0%; remote holds 2.00 GiB")
    promoted = {"transfer_seconds_sum": {"remote->cpu": 0.0375},
                "prefill_seconds_saved": {"cpu": 0.1}}
    f = M.promotion_slower(window(counters=promoted), S)
    assert f.status == NOT_MEASURED
    assert "remote: 2.25 s of promotions, the prefill seconds they saved not measured" in f.wrong


def test_promotions_slower_than_recompute():
    """disk: 0.1 s of disk->cpu promotions per second against 0.05 s of prefill saved (2x):
    fires; cpu at 0.02 s against 0.1 s (0.2x): fine. No timed promotions (zero-code mode):
    not measured."""
    def w(disk_spent, disk_saved):
        return window(counters={
            "transfer_seconds_sum": {"disk->cpu": disk_spent, "cpu->gpu": 0.02,
                                     "gpu->cpu": 5.0},  # offload time is no promotion
            "prefill_seconds_saved": {"disk": disk_saved, "cpu": 0.1}})
    f = M.promotion_slower(w(0.1, 0.05), S)
    assert f.status == MISCONFIGURED and "promoting the disk tier" in f.wrong
    assert "(200% of it)" in f.wrong
    assert M.promotion_slower(w(0.04, 0.05), S).status == OK
    # 0.0002 s against 0.05 s (0.4%): measured, so not "0% of it"
    assert "disk: 0.01 s of promotions for 3.00 s of prefill saved (under 1% of it)" in \
        M.promotion_slower(w(0.0002, 0.05), S).wrong
    # promotions seen but none timed (zero-code mode: blocks, bytes alone from vLLM's
    # /metrics, or only the prefill a tier saved from KV events) say why; no promotion at all
    # says that instead (a tryout read the vLLM explanation on a run without any)
    seen = [window(counters={"transfer_blocks": {"cpu->gpu": 4.0}}),
            window(counters={"transfer_bytes": {"cpu->gpu": 4096.0}}),
            window(counters={"prefill_seconds_saved": {"cpu": 0.1}})]
    none = window(counters={"prefill_seconds_saved": {"gpu": 0.1},
                            "transfer_blocks": {"gpu->cpu": 4.0}})
    for found, why in [(w, "vLLM's KV events") for w in seen] + [
            (none, "no promotions in the window")]:
        f = M.promotion_slower(found, S)
        assert f.status == NOT_MEASURED and why in f.wrong, f


def test_a_staged_promotion_is_the_lower_tier_s_cost():
    """Disk blocks staged disk->cpu->gpu: 80 of the 100 blocks a second cpu->gpu promotes came
    from disk. cpu->gpu takes 0.3 s/s, disk->cpu 0.05 s/s; cpu tokens save 0.1 s/s, disk
    tokens 0.4 s/s. Charged by blocks: cpu 0.3 x 0.2 = 0.06 s/s (0.60x), disk 0.05 + 0.24 =
    0.29 s/s (0.72x): fine. Charged by the leg's source, cpu read 3.00x and fired."""
    f = M.promotion_slower(window(counters={
        "transfer_seconds_sum": {"cpu->gpu": 0.3, "disk->cpu": 0.05},
        "transfer_blocks": {"cpu->gpu": 100.0, "disk->cpu": 80.0},
        "prefill_seconds_saved": {"cpu": 0.1, "disk": 0.4}}), S)
    assert f.status == OK
    assert "cpu: 3.60 s of promotions for 6.00 s of prefill saved (60% of it)" in f.wrong
    assert "disk: 17.40 s of promotions for 24.00 s of prefill saved (72% of it)" in f.wrong


def test_blocks_stored_for_nothing():
    """cpu evicts 1 block a second (the counter), 90 % of them never hit (the hit histogram,
    a weighted sample reading 4 times as many evictions, as one that samples the same few
    repeated prompts does): fires (over 80 %) and names the counter's 60, not the
    histogram's 240; 70 %: fine, saying where the line is; fewer than 20 evictions in the
    window, or no hit counts at all: not measured."""
    def w(never, hit, n=N):  # buckets: 0 hits, 1 hit, then 7 empty ones
        return [{"ts": T0 + i, "evicted_blocks": {"cpu": float(i)},
                 "evicted_block_hits": {"cpu": [4 * never * i, 4 * hit * i] + [0] * 7}}
                for i in range(n)]
    f = M.stored_for_nothing(w(0.9, 0.1), S)
    assert f.status == MISCONFIGURED and "cpu: 90% of 60 evicted blocks never" in f.wrong
    f = M.stored_for_nothing(w(0.7, 0.3), S)
    assert f.status == OK and f.wrong == ("cpu: 70% of 60 evicted blocks never reused (stored "
                                          "for nothing over 80%)")
    assert M.stored_for_nothing(w(0.9, 0.1, n=5), S).status == NOT_MEASURED
    f = M.stored_for_nothing(window(), S)
    assert f.status == NOT_MEASURED and "hit counts" in f.wrong


def test_host_kv_pool_on_another_numa_node():
    """The node collectors' series of a two-node host (as ``/api/v1/node`` gives them): 30 GiB
    of the engine on node 0, 2 GiB on node 1, its GPU on node 1: 6 %, fires; the GPU on node
    0: fine; a GPU whose node NVML and sysfs do not say, no engine memory, or no topology read
    at all: not measured."""
    def series(gpu_node, engine=True):
        out = [{"name": "kvscope_gpu_topology_info", "value": 1.0,
                "labels": {"gpu": "0", "pcie_generation": "4", "pcie_width": "16",
                           "numa_node": gpu_node}}]
        if engine:
            out += [{"name": "kvscope_process_numa_bytes", "value": v,
                     "labels": {"numa_node": n}} for n, v in (("0", 30 * GIB), ("1", 2 * GIB))]
        return topologies(out)
    f = M.numa_remote(series("1"), S)
    assert f.status == MISCONFIGURED and "6% of the engine's 32.00 GiB" in f.wrong
    assert "--membind=1" in f.change
    assert M.numa_remote(series("0"), S).status == OK
    assert M.numa_remote(series(""), S).status == NOT_MEASURED
    assert M.numa_remote(series("1", engine=False), S).status == NOT_MEASURED
    assert M.numa_remote(None, S).status == NOT_MEASURED


def test_the_engines_own_gpus_decide_on_a_host_with_gpus_on_both_nodes():
    """Two sockets, GPU 0 on node 0 and GPU 1 on node 1, the engine's memory 30 GiB on node 0
    and 2 GiB on node 1. Its KV cache on GPU 1 (the tap's report, as the newest sample's
    gpu_memory_part_bytes has it): 2 / 32 = 6 % on its GPU's node, fires (any GPU's node
    counted it 100 %, and it never fired on such a host); on GPU 0: 94 %, fine. No tap naming
    the engine's GPUs: every GPU's node counts (100 %), and the finding says it could not
    tell. In a fleet the key starts with the instance."""
    topology = topologies(
        [{"name": "kvscope_gpu_topology_info", "value": 1.0,
          "labels": {"gpu": gpu, "numa_node": gpu, "instance": "a:9400"}} for gpu in "01"]
        + [{"name": "kvscope_process_numa_bytes", "value": v,
            "labels": {"numa_node": n, "instance": "a:9400"}}
           for n, v in (("0", 30 * GIB), ("1", 2 * GIB))])

    def kv_cache_on(gpu):
        return window(2, gauges={"gpu_memory_part_bytes": {
            f"a:9400->{gpu}->kv_cache": 40 * GIB, f"a:9400->{gpu}->weights": 16 * GIB,
            f"a:9400->{1 - int(gpu)}->free": 80 * GIB}})
    assert M.engine_gpus(kv_cache_on("1")) == {("a:9400", "1")}
    f = M.numa_remote(topology, S, M.engine_gpus(kv_cache_on("1")))
    assert f.status == MISCONFIGURED and "6% of the engine's 32.00 GiB on the engine's GPUs' " \
        "NUMA node 1" in f.wrong, f
    assert "--membind=1" in f.change
    assert M.numa_remote(topology, S, M.engine_gpus(kv_cache_on("0"))).status == OK
    unknown = M.numa_remote(topology, S, M.engine_gpus(window(2)))
    assert unknown.status == OK and "which serve the engine is not reported" in unknown.wrong
    # detect() takes the engine's GPUs from the window it judges
    found = {f.key: f for f in M.detect(kv_cache_on("1"), S, topology)}
    assert found["numa-remote"].status == MISCONFIGURED


def test_a_fleet_of_several_instances_leaves_the_per_host_detectors_unjudged():
    """The fleet view (Prometheus, all instances) adds its hosts up: host A's 8 GiB of weights
    per GPU and no KV tier beside host B's 48 GiB cpu budget read "ok" (the alert fired for
    A). Over 2 instances the three detectors of one host's settings are not judged, and say
    to pick an instance and which alert judges each host; over 1 they judge as before."""
    w = window(scalars={"engine_weight_offload_bytes": 8 * GIB},
               gauges={"offload_budget_bytes": {"cpu": 48 * GIB}})
    assert status(M.detect(w), "weight-offload").status == OK
    fleet = M.detect(w, hosts=2)
    assert [f.key for f in fleet] == list(M.TITLES)
    for key in M.PER_HOST:
        f = status(fleet, key)
        assert f.status == NOT_MEASURED and "not judged across 2 instances" in f.wrong
        assert "pick an instance" in f.wrong and f.alert in f.wrong


def test_detect_and_the_view():
    """Every detector answers once, in order; the view has a banner for each misconfiguration
    (what is wrong, what to change) and lists the rest by status, each with its id."""
    w = window(scalars={"engine_weight_offload_bytes": 4 * GIB})
    findings = M.detect(w)
    assert [f.key for f in findings] == list(M.TITLES)
    assert status(findings, "weight-offload").status == MISCONFIGURED
    assert all(f.change == "" for f in findings if f.status != MISCONFIGURED)
    children = misconfig_view.section(findings)
    banner = children[0]
    assert banner.id == "misconfig-weight-offload"
    assert "What to change" in str(banner) and "--kv-offloading-size" in str(banner)
    assert all(isinstance(c, html.Details) for c in children[1:])
    assert "No misconfiguration found" in str(misconfig_view.section(M.detect(window())))
