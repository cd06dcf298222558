"""The "Should I offload here?" verdicts (kvscope/dashboard/offload_verdict.py) on hand-built
samples: each of the guide's five conditions, its thresholds just under and just over, and the
signals no source reports ("not measured", never 0 or a pass)."""

from __future__ import annotations

import pytest

from kvscope.dashboard import offload_verdict as V
from kvscope.dashboard.offload_verdict import NOT_MEASURED, PAYS, SKIP, TOO_LITTLE, Settings
from kvscope.vocabulary import KV_CACHE_DTYPES

T0 = 1_700_000_000.0
N = 61  # samples, one a second: a 60 s window
GIB = 1024 ** 3


def window(n: int = N, *, requests_per_s: float = 2.0, tokens_per_s=None,
           waiting=lambda i: 0, usage=lambda i: 0.2, preemptions=lambda i: 0,
           ttft_p99: float | None = 0.5, wait_p99: float | None = 0.01,
           headroom: float | None = 4 * GIB, saved=None, spent=None, blocks=None,
           prefix_per_s=None, drop=()) -> list[dict]:
    """``n`` samples a second apart: counters growing at the given rates per second, gauges
    from the per-index functions; field names in ``drop`` left out (a source that does not
    report them). ``prefix_per_s``: prompt blocks by prefix seen or new (None: no lookup
    carries block hashes, so the field is empty)."""
    tokens_per_s = tokens_per_s or {"gpu": 300.0, "cpu": 200.0, "recompute": 500.0}
    saved = saved or {"gpu": 0.01, "cpu": 0.02}
    spent = spent or {"gpu->cpu": 0.004, "cpu->gpu": 0.003}
    out = []
    for i in range(n):
        s = {"ts": T0 + i, "requests": requests_per_s * i,
             "prompt_tokens": {k: v * i for k, v in tokens_per_s.items()},
             "prefill_seconds_saved": {k: v * i for k, v in saved.items()},
             "transfer_seconds_sum": {k: v * i for k, v in spent.items()},
             "transfer_blocks": {k: v * i for k, v in (blocks or {}).items()},
             "requests_waiting": {"engine": waiting(i)},
             "requests_running": {"engine": 1},
             "gpu_kv_cache_usage_ratio": {"engine": usage(i)},
             "preemptions": {"engine": preemptions(i)},
             "ttft_seconds": {"p50": None if ttft_p99 is None else ttft_p99 / 4, "p95": None,
                              "p99": ttft_p99},
             "promotion_wait_seconds": {"p50": None, "p95": None, "p99": wait_p99},
             "host_memory_available_bytes": None if headroom is None else headroom + GIB,
             "host_memory_reserve_bytes": None if headroom is None else GIB,
             "host_memory_headroom_bytes": headroom,
             "prompt_prefix_blocks": {k: v * i for k, v in (prefix_per_s or {}).items()}}
        for name in drop:
            s[name] = {} if isinstance(s[name], dict) else None
        out.append(s)
    return out


def records(n: int, ttft: float, wait: float) -> list[dict]:
    return [{"finished": T0 + 30 + i * 0.1, "ttft": ttft, "promotion_wait": wait}
            for i in range(n)]


def check(assessment, key):
    return next(c for c in assessment.checks if c.key == key)


def verdicts(assessment) -> dict[str, str]:
    return {c.key: c.verdict for c in assessment.checks}


# --- 1. GPU memory is not the limiter ------------------------------------------------------

def test_gpu_not_the_limiter_when_all_three_signals_are_low():
    a = V.assess(window())
    assert check(a, "gpu-limiter").verdict == SKIP
    assert a.verdict == SKIP and a.reasons == ("gpu-limiter",)


def test_gpu_evictions_are_shown_beside_the_signals_not_counted_as_one():
    """Zero-code mode: low usage, no queue and no preemptions read "skip" beside 237 GPU
    evictions a tryout saw in a second, unshown. They are shown now (10 blocks a second over
    the 61 samples' 60 seconds: 600), and said not measured where no source reports them; the
    verdict stays the three signals' (a full cache evicts whether its blocks return or not)."""
    samples = window()
    for i, s in enumerate(samples):
        s["evicted_blocks"] = {"gpu": 10 * i}
    c = check(V.assess(samples), "gpu-limiter")
    assert c.verdict == SKIP
    assert ("GPU prefix cache evictions: 600 blocks in the window (a full cache evicts whether "
            "or not its blocks return: condition 2 says whether they do)") in c.evidence
    assert "GPU prefix cache evictions: not measured (no source reports them)" in check(
        V.assess(window()), "gpu-limiter").evidence


@pytest.mark.parametrize("preempted, verdict", [(0, SKIP), (1, PAYS)])
def test_one_preemption_makes_gpu_memory_the_limiter(preempted, verdict):
    a = V.assess(window(preemptions=lambda i: preempted if i == N - 1 else 0))
    assert check(a, "gpu-limiter").verdict == verdict


@pytest.mark.parametrize("high, verdict", [(4, SKIP), (5, PAYS)])
def test_gpu_kv_usage_near_miss(high, verdict):
    """50 samples: usage 0.9 in 5 (10%, the line) is pressure; in 4 (8%) it is not; 0.8999
    never counts."""
    a = V.assess(window(n=50, usage=lambda i: 0.9 if i < high else 0.8999))
    assert check(a, "gpu-limiter").verdict == verdict


@pytest.mark.parametrize("queued, verdict", [(4, SKIP), (5, PAYS)])
def test_waiting_queue_near_miss(queued, verdict):
    a = V.assess(window(n=50, waiting=lambda i: 1 if i < queued else 0))
    assert check(a, "gpu-limiter").verdict == verdict


def test_preemptions_not_reported_are_not_measured_not_zero():
    """The reference engine never reports preemptions: low usage and no queue cannot show
    GPU memory is not the limiter, and the evidence says "not measured"."""
    a = V.assess(window(drop=("preemptions",)))
    c = check(a, "gpu-limiter")
    assert c.verdict == NOT_MEASURED
    assert "preemptions: not measured (no source reports them)" in c.evidence
    assert not any("preemptions: 0" in line for line in c.evidence)


def test_one_signal_over_is_enough_when_others_are_not_measured():
    a = V.assess(window(usage=lambda i: 1.0, drop=("preemptions", "requests_waiting")))
    c = check(a, "gpu-limiter")
    assert c.verdict == PAYS
    assert "requests waiting: not measured (no source reports it)" in c.evidence


def test_several_sources_add_their_queues_and_take_the_fullest_gpu():
    samples = window(n=20)
    for s in samples:
        s["requests_waiting"] = {"a": 0, "b": 1}
        s["gpu_kv_cache_usage_ratio"] = {"a": 0.1, "b": 0.95}
    c = check(V.assess(samples), "gpu-limiter")
    assert c.verdict == PAYS
    assert any(line.startswith("GPU KV usage ≥ 90% in 20 of 20 samples (100.0%; limiter at "
                               "10%)") for line in c.evidence)


def test_a_share_just_under_the_limiter_is_not_shown_at_it():
    """4 of 42 samples with a request waiting is 9.5%, under the 10% line: the evidence read
    "in 10% of samples (limiter at 10%)" beside a verdict that no limit was crossed."""
    samples = window(n=42, drop=("preemptions", "gpu_kv_cache_usage_ratio"))
    for i, s in enumerate(samples):
        s["requests_waiting"] = {"a": 1 if i < 4 else 0}
    c = check(V.assess(samples), "gpu-limiter")
    assert c.verdict == NOT_MEASURED  # not over: the others unmeasured
    assert any(line.startswith("requests waiting ≥ 1.0 in 4 of 42 samples (9.5%; limiter at "
                               "10%)") for line in c.evidence), c.evidence


# --- 2. prompts nearly all unique ----------------------------------------------------------

@pytest.mark.parametrize("seen, verdict", [(99.0, SKIP), (100.0, PAYS)])
def test_reuse_share_near_miss(seen, verdict):
    """Nothing served from cache: 99 of 1,000 prompt blocks (9.9%) repeating a prefix is
    "nearly all unique"; 100 (10%) is not."""
    a = V.assess(window(tokens_per_s={"recompute": 1000.0},
                        prefix_per_s={"seen": seen, "new": 1000.0 - seen}))
    c = check(a, "unique-prompts")
    assert c.verdict == verdict
    assert c.evidence[0].startswith(f"reuse share {seen / 10:.1f}%: prompt blocks whose prefix "
                                    "was seen before, of 60,000")


def test_served_reuse_the_sample_missed_is_still_reuse():
    """A 3-block system prompt before 12 unique blocks, at the tap's 1 in 16: the prompt's
    blocks go unsampled most of the time, and the sampled reuse share reads 0%, while the
    GPU prefix cache serves 20% of tokens (a fresh-user tryout's case, through the real
    sampling). Served reuse is reuse: "offload pays", not "skip offload"."""
    a = V.assess(window(tokens_per_s={"gpu": 200.0, "recompute": 800.0},
                        prefix_per_s={"new": 100.0}))
    assert check(a, "unique-prompts").verdict == PAYS


def test_reuse_the_tiers_were_too_small_to_serve_is_still_reuse():
    """The Mooncake trace on the demo's tiers: hardly any token served from cache, but a third
    of the prompt blocks repeat a prefix. A larger tier would serve them: offload is not ruled
    out (it was "skip offload" when the served share decided)."""
    a = V.assess(window(tokens_per_s={"gpu": 40.0, "recompute": 960.0},
                        prefix_per_s={"seen": 37.0, "new": 63.0}))
    c = check(a, "unique-prompts")
    assert c.verdict == PAYS
    assert c.evidence[:2] == (
        "reuse share 37.0%: prompt blocks whose prefix was seen before, of 6,000 (from the "
        "block hashes lookups carry; unique when this and the share served are both under "
        "10%)",
        "served from cache: 4.0% of 60,000 prompt tokens (by source: gpu 4%, recompute 96%)")


@pytest.mark.parametrize("served, verdict", [(99.0, NOT_MEASURED), (100.0, PAYS)])
def test_without_block_hashes_the_served_share_only_proves_reuse(served, verdict):
    """No lookup carries block hashes (zero-code mode): 10% of tokens served from cache proves
    reuse; 9.9% proves nothing either way (the tiers may be too small), so "not measured",
    never "skip offload"."""
    a = V.assess(window(tokens_per_s={"cpu": served, "recompute": 1000.0 - served}))
    c = check(a, "unique-prompts")
    assert c.verdict == verdict
    assert c.evidence[0].startswith(f"served from cache: {served / 10:.1f}% of 60,000")
    assert c.evidence[1].startswith("reuse share: not measured")


def test_gpu_hits_count_as_reuse():
    a = V.assess(window(tokens_per_s={"gpu": 500.0, "recompute": 500.0}))
    assert check(a, "unique-prompts").verdict == PAYS


def test_unique_prompts_skip_offload_whatever_else():
    a = V.assess(window(tokens_per_s={"recompute": 1000.0}, prefix_per_s={"new": 100.0},
                        usage=lambda i: 1.0))
    assert verdicts(a)["unique-prompts"] == SKIP
    assert a.verdict == SKIP and "unique-prompts" in a.reasons


# --- 3. tail SLO ---------------------------------------------------------------------------

@pytest.mark.parametrize("p99, verdict", [(2.5, PAYS), (2.5001, SKIP)])
def test_p99_ttft_against_the_budget(p99, verdict):
    """The default budget is the mixin's (2.5 s); over it with promotions 20% of TTFT: skip."""
    a = V.assess(window(ttft_p99=p99), records(30, ttft=3.0, wait=0.6))
    assert check(a, "tail-slo").verdict == verdict


@pytest.mark.parametrize("wait, verdict", [(0.299, PAYS), (0.3, SKIP)])
def test_over_budget_blames_promotions_only_from_a_tenth_of_ttft(wait, verdict):
    a = V.assess(window(ttft_p99=4.0), records(30, ttft=3.0, wait=wait))
    c = check(a, "tail-slo")
    assert c.verdict == verdict
    assert any(line.startswith(f"promotion wait {wait / 3:.1%} of TTFT over 30 requests")
               for line in c.evidence)


def test_records_outside_the_window_do_not_count():
    old = [{"finished": T0 - 10, "ttft": 3.0, "promotion_wait": 3.0}]
    a = V.assess(window(ttft_p99=4.0), old + records(30, ttft=3.0, wait=0.0))
    assert check(a, "tail-slo").verdict == PAYS


def test_over_budget_with_no_wait_measured_is_not_measured():
    """Requests known only from vLLM's spans carry no promotion wait (None): read as 0 they
    said promotions took 0% of TTFT and offload pays; nothing measured says either."""
    a = V.assess(window(ttft_p99=4.0), records(30, ttft=3.0, wait=None))
    c = check(a, "tail-slo")
    assert c.verdict == NOT_MEASURED
    assert ("promotion wait share of TTFT: not measured (no request in the window measured its "
            "promotion wait)") in c.evidence
    # beside measured ones, the unmeasured requests count in neither sum
    a = V.assess(window(ttft_p99=4.0), records(30, ttft=3.0, wait=None)
                 + records(10, ttft=3.0, wait=0.6))
    assert check(a, "tail-slo").verdict == SKIP


def test_ttft_budget_is_a_setting():
    a = V.assess(window(ttft_p99=0.5), records(30, ttft=0.5, wait=0.2),
                 Settings(ttft_budget_seconds=0.4))
    assert check(a, "tail-slo").verdict == SKIP
    assert a.headline.ttft_budget == 0.4


def test_tail_slo_not_measured_without_ttft_or_without_promotions():
    assert check(V.assess(window(ttft_p99=None)), "tail-slo").verdict == NOT_MEASURED
    c = check(V.assess(window(tokens_per_s={"gpu": 10.0, "recompute": 90.0})), "tail-slo")
    assert c.verdict == NOT_MEASURED
    assert "no tokens were promoted: the transfer path was not exercised" in c.evidence


# --- 4. host DRAM contested ----------------------------------------------------------------

@pytest.mark.parametrize("low, verdict, text", [(0.0, PAYS, "0 B"), (-1.0, SKIP, "-1 B")])
def test_headroom_near_miss(low, verdict, text):
    samples = window()
    samples[10]["host_memory_headroom_bytes"] = low
    c = check(V.assess(samples), "host-dram")
    assert c.verdict == verdict
    assert "swap: not measured (no swap-in counter)" in c.evidence
    # the window's lowest, named as such (it may read below the newest, on the headroom card),
    # and the default floor said in words ("contested under 0.00 GiB" read oddly), in a unit
    # that shows the byte it is short by ("-0.00 GiB" hid it)
    assert (f"lowest headroom in the window {text} (contested once available "
            "memory eats into the reserve)") in c.evidence


@pytest.mark.parametrize("swap_per_s, verdict", [(0.0, PAYS), (4096.0, SKIP)])
def test_swap_in_contests_host_dram(swap_per_s, verdict):
    """Pages read back in from swap (4 KiB/s: 0.2 MiB over the 60 s window) contest host DRAM
    whatever the headroom says; none read back is fine. Without a host reading (no memory
    limit) the counter is not judged."""
    samples = window()
    for i, x in enumerate(samples):
        x["host_swap_in_bytes"] = swap_per_s * i
        x["host_memory_limit_bytes"] = 64 * GIB
    c = check(V.assess(samples), "host-dram")
    assert c.verdict == verdict
    assert f"swap-in: {swap_per_s * 60 / 2**20:.1f} MiB read back from swap" in c.evidence[2]
    for x in samples:
        x["host_memory_limit_bytes"] = None
    assert "swap: not measured (no swap-in counter)" in check(V.assess(samples),
                                                              "host-dram").evidence


def test_other_processes_memory_is_shown_where_the_engines_is_read():
    """The Overview read "other processes' memory: not measured" beside the memory budgets
    chart's 'everything else' (the demo reads its engine's memory). Measured where the
    engine's memory is (engine_other beside other); without it, "other" holds the engine's
    memory beyond its KV budget too: not other processes'."""
    samples = window()
    samples[-1]["host_memory_part_bytes"] = {"kv_offload": 16 * GIB, "engine_other": 4 * GIB,
                                             "other": 3 * GIB, "reserve": GIB, "free": 40 * GIB}
    evidence = check(V.assess(samples), "host-dram").evidence
    assert "other processes' memory 3.00 GiB (in use, not the engine's)" in evidence
    del samples[-1]["host_memory_part_bytes"]["engine_other"]
    assert "other processes' memory: not measured (the engine's own is not: engine_pid)" in \
        check(V.assess(samples), "host-dram").evidence


def test_host_dram_not_measured_without_headroom():
    c = check(V.assess(window(headroom=None)), "host-dram")
    assert c.verdict == NOT_MEASURED
    assert "headroom: not measured" in c.evidence


# --- 5. cheaper steps ----------------------------------------------------------------------

def with_cache_config(samples: list[dict], *keys: str) -> list[dict]:
    """``samples`` whose engines report KV cache settings ``keys``
    ("source->prefix_caching->kv_cache_dtype") from the middle of the window on."""
    for i, x in enumerate(samples):
        x["engine_cache_config"] = dict.fromkeys(keys, 1) if i >= len(samples) // 2 else {}
    return samples


def test_cheaper_steps_not_measured_when_no_engine_reports_its_cache_settings():
    c = check(V.assess(window()), "cheaper-steps")
    assert c.verdict == NOT_MEASURED
    assert c.evidence[0] == "KV cache settings: not measured (no engine reports them)"
    assert c.evidence[1] == "GPU prefix cache served 30.0% of prompt tokens: prefix caching is on"
    assert any(line.startswith("not measured: batching") for line in c.evidence)


def test_cheaper_steps_hint_at_prefix_caching_only_on_gpu_tokens_measured():
    """With no engine's settings, a GPU prefix cache that served none of the prompt tokens
    hints that prefix caching may be off; it said so with no traffic at all (an agent just
    started) and where no source measures the GPU's hits (LMCache's view: no gpu tokens
    exported), where there is nothing to hint from."""
    def seen(tokens_per_s):
        return check(V.assess(window(tokens_per_s=tokens_per_s)), "cheaper-steps").evidence[1]

    assert seen({"gpu": 0.0, "recompute": 500.0}) == (
        "GPU prefix cache served no tokens: check prefix caching is on (vLLM "
        "--enable-prefix-caching)")
    assert seen({"gpu": 0.0, "recompute": 0.0}) == (
        "GPU prefix cache: no prompt tokens in the window")
    assert seen({"cpu": 200.0, "recompute": 500.0}) == (
        "GPU prefix cache: not measured (no source reports its hits)")


def test_cheaper_steps_skip_offload_while_prefix_caching_is_off():
    """One engine of two with prefix caching off: turn it on first, whatever the other says."""
    a = V.assess(with_cache_config(window(), "vllm_metrics->off->auto", "engine->on->8bit"))
    c = check(a, "cheaper-steps")
    assert c.verdict == SKIP
    assert a.verdict == SKIP and "cheaper-steps" in a.reasons
    assert c.evidence[:3] == (
        "engine: prefix caching on; KV cache dtype 8-bit (quantized): the KV bytes are half a "
        "16-bit cache's already",
        "vllm_metrics: prefix caching off; KV cache dtype auto (the model's, 16-bit as a rule): "
        "fp8 would halve the KV bytes before any offload (vLLM --kv-cache-dtype fp8)",
        "turn GPU prefix caching on first (vllm_metrics; vLLM --enable-prefix-caching): it "
        "reuses prefixes without any transfer")


def test_cheaper_steps_say_the_settings_two_sources_share_once():
    """vLLM's tap and its /metrics both report one engine's settings: two identical lines
    were listed, one per source; a third source that differs keeps its own line."""
    c = check(V.assess(with_cache_config(window(), "vllm->on->16bit", "vllm_metrics->on->16bit",
                                         "engine->on->8bit")), "cheaper-steps")
    assert c.evidence[:2] == (
        "engine: prefix caching on; KV cache dtype 8-bit (quantized): the KV bytes are half a "
        "16-bit cache's already",
        "vllm, vllm_metrics: prefix caching on; KV cache dtype 16-bit: fp8 would halve the KV "
        "bytes before any offload (vLLM --kv-cache-dtype fp8)")


@pytest.mark.parametrize("dtype, advice", [
    ("8bit", "8-bit (quantized): the KV bytes are half a 16-bit cache's already"),
    ("16bit", "16-bit: fp8 would halve the KV bytes before any offload (vLLM --kv-cache-dtype "
              "fp8)")])
def test_cheaper_steps_pay_with_prefix_caching_on(dtype, advice):
    """Prefix caching on: offload pays for what is measured, the dtype's saving named, and
    batching, context limits and model selection said to be unmeasured."""
    c = check(V.assess(with_cache_config(window(), f"engine->on->{dtype}")), "cheaper-steps")
    assert c.verdict == PAYS
    assert c.evidence[:3] == (
        f"engine: prefix caching on; KV cache dtype {advice}",
        "GPU prefix cache served 30.0% of prompt tokens",
        "not measured: batching (vLLM --max-num-seqs, --max-num-batched-tokens), context "
        "limits (--max-model-len), model selection")
    # every width the vocabulary names has its advice
    assert set(V.DTYPE_ADVICE) == set(KV_CACHE_DTYPES)


# --- traffic, window, overall, headline ----------------------------------------------------

@pytest.mark.parametrize("n, verdict", [(20, TOO_LITTLE), (21, PAYS)])
def test_too_little_traffic_near_miss(n, verdict):
    """1 request a second: 19 requests over 20 samples is too little, 20 over 21 is enough."""
    a = V.assess(window(n=n, requests_per_s=1.0, usage=lambda i: 1.0))
    assert check(a, "gpu-limiter").verdict == verdict
    assert check(a, "unique-prompts").verdict == verdict


def test_overall_offload_pays_with_reuse_and_gpu_pressure():
    a = V.assess(window(usage=lambda i: 1.0, drop=("preemptions",)),
                 records(30, ttft=0.5, wait=0.01))
    assert verdicts(a) == {"gpu-limiter": PAYS, "unique-prompts": PAYS, "tail-slo": PAYS,
                           "host-dram": PAYS, "cheaper-steps": NOT_MEASURED}
    assert a.verdict == PAYS
    assert a.reasons == ("gpu-limiter", "unique-prompts", "tail-slo", "host-dram")


def test_overall_too_little_traffic_and_empty():
    a = V.assess(window(n=5, usage=lambda i: 1.0))
    assert a.verdict == TOO_LITTLE
    empty = V.assess([])
    assert empty.verdict == TOO_LITTLE and empty.n_samples == 0
    assert empty.headline.token_share == {} and empty.headline.ttft_p99 is None


@pytest.mark.parametrize("moved", ["transfer_blocks", "evicted_blocks", "resident", None])
def test_kv_events_alone_are_not_too_little_traffic(moved):
    """Zero-code mode with KV events alone: no source counts requests, so the window read 0
    requests and "too little traffic" while the engine offloaded and evicted blocks. Blocks
    moved (offloaded 5 a second, evicted, or the resident count changing) with no request
    counted: the requests are not measured, and the checks judge what was (here GPU usage at
    1.0: "offload pays"). Nothing moved and no request: still too little traffic, and so with
    prompt tokens counted (a source that counts requests: none finished in the window)."""
    samples = window(requests_per_s=0.0, usage=lambda i: 1.0, ttft_p99=None, wait_p99=None,
                     drop=("prompt_tokens",))
    for i, sample in enumerate(samples):
        if moved == "resident":
            sample["tier_resident_blocks"] = {"cpu": 10.0 * i}
        elif moved:
            sample[moved] = {"gpu->cpu" if moved == "transfer_blocks" else "gpu": 5.0 * i}
    a = V.assess(samples)
    if moved is None:
        assert a.verdict == TOO_LITTLE and a.requests == 0
        return
    counted = [{**s, "prompt_tokens": {"recompute": 100.0 * i}} for i, s in enumerate(samples)]
    assert V.assess(counted).verdict == TOO_LITTLE
    assert a.requests is None and a.verdict == PAYS
    assert verdicts(a) == {"gpu-limiter": PAYS, "unique-prompts": NOT_MEASURED,
                           "tail-slo": NOT_MEASURED, "host-dram": PAYS,
                           "cheaper-steps": NOT_MEASURED}
    assert check(a, "gpu-limiter").evidence[-1].endswith(
        "requests not measured (no source counts them)")


def test_every_check_names_its_window():
    a = V.assess(window(n=400), settings=Settings(window_seconds=120))
    assert a.n_samples == 121 and a.span_seconds == 120 and a.requests == 240
    for c in a.checks:
        assert c.verdict in V.VERDICTS
        assert c.evidence[-1] == "last 120 s, 121 samples, 240 requests"


def test_headline_shares_and_seconds_per_tier():
    h = V.assess(window(spent={"gpu->cpu": 0.004, "cpu->gpu": 0.003, "cpu->disk": 0.001})
                 ).headline
    assert h.token_share == {"gpu": 0.3, "cpu": 0.2, "recompute": 0.5}
    assert h.saved_vs_spent == {"cpu": pytest.approx((1.2, 0.42)),
                                "disk": pytest.approx((0.0, 0.06))}
    assert h.ttft_p99 == 0.5 and h.headroom_bytes == 4 * GIB and h.reserve_bytes == GIB


def test_headline_charges_a_staged_leg_to_the_tier_it_staged_from():
    """60 s: cpu->gpu 0.18 s for 600 blocks, 300 of them staged disk->cpu (0.06 s). disk:
    0.06 + 0.18 x 300/600 = 0.15 s; cpu: its offloads (gpu->cpu) 0.24 s + the other 0.09 s =
    0.33 s. Charged by the leg's source, cpu read 0.42 s and disk 0.06 s."""
    h = V.assess(window(spent={"gpu->cpu": 0.004, "cpu->gpu": 0.003, "disk->cpu": 0.001},
                        saved={"cpu": 0.02, "disk": 0.01},
                        blocks={"cpu->gpu": 10.0, "disk->cpu": 5.0})).headline
    assert h.saved_vs_spent == {"cpu": pytest.approx((1.2, 0.33)),
                                "disk": pytest.approx((0.6, 0.15))}


def test_transfer_time_not_measured_is_none_not_zero_seconds():
    """Zero-code mode: vLLM's /metrics count cache hits (prefill saved) but time no transfer.
    The card said "0.00 s spent", as if promotions were free; now the tier's spent is None,
    the card says so and gives the seconds saved without a ratio."""
    from kvscope.dashboard import verdict_view

    a = V.assess(window(drop=("transfer_seconds_sum",)), records(30, ttft=0.5, wait=None))
    assert a.headline.saved_vs_spent == {"cpu": (pytest.approx(1.2), None)}
    savings = {c.id: c for c in verdict_view.cards(a).children}["offload-card-savings"]
    assert savings.children[1].children == "1.20 s saved"
    # estimated, and on hover how (a tryout read 19.5x at the agent's assumed prefill rate
    # where kvscope compare measured 4.8x)
    assert savings.children[0].children.startswith("estimated prefill seconds saved")
    assert "prefill_tokens_per_second (10,000 tokens/s by default), an assumption" in \
        savings.title and "else the rate its finished requests measured" in savings.title
    assert savings.children[2].children == "cpu 1.20 s saved / transfer time not measured"
    # one tier timed, one not: no ratio over the timed one alone
    a = V.assess(window(saved={"cpu": 0.02, "disk": 0.01}, spent={"cpu->gpu": 0.003}))
    assert a.headline.saved_vs_spent == {"cpu": pytest.approx((1.2, 0.18)),
                                         "disk": (pytest.approx(0.6), None)}
    savings = {c.id: c for c in verdict_view.cards(a).children}["offload-card-savings"]
    assert savings.children[1].children == "1.80 s saved"
    # the spent side is offloads and promotions, as the card says (the misconfiguration
    # panel's is promotions only, and says so: a tryout read the two as contradicting)
    assert savings.children[2].children == ("cpu 1.20 s saved / 0.18 s copying in and out · "
                                            "disk 0.60 s saved / transfer time not measured")


# --- the view ------------------------------------------------------------------------------

def test_the_view_marks_each_row_with_its_verdict():
    from kvscope.dashboard import verdict_view

    a = V.assess(window(drop=("preemptions",)), records(30, ttft=0.5, wait=0.01))
    children = verdict_view.section(a)
    text = str(children)
    for c in a.checks:
        assert f"'id': 'offload-check-{c.key}'" in text or f"id='offload-check-{c.key}'" in text
    assert "preemptions: not measured (no source reports them)" in text
    banner = verdict_view.banner(a)
    assert getattr(banner, "data-verdict") == a.verdict == PAYS
    cards = {card.id: card.children[1].children for card in verdict_view.cards(a).children}
    assert cards == {"offload-card-tokens": "50%", "offload-card-savings": "2.9×",
                     "offload-card-ttft": "500.0 ms", "offload-card-headroom": "4.00 GiB"}


def test_tiers_whose_transfers_took_longer_than_they_saved_are_not_paying_as_sized():
    """Fresh-user tryouts: a green "offload pays" beside a savings card of 0.1x read as a
    recommendation to keep tiers that cost more than they save (twice: with a red line under
    it, too). No condition rules offload out here. 60 s: cpu saved 0.02 s/s = 1.2 s;
    gpu->cpu 0.004 + cpu->gpu 0.003 s/s = 0.42 s spent: "offload pays", no line; gpu->cpu
    0.05 s/s = 3.0 s + 0.18 s = 3.18 s spent: "not paying as sized", and the line says why;
    1.14 s spent (0.016 + 0.003 s/s), just under what it saved: it pays for itself."""
    from kvscope.dashboard import verdict_view

    def judged(spent):
        a = V.assess(window(usage=lambda i: 1.0, spent=spent), records(30, ttft=0.5, wait=0.01))
        banner = verdict_view.banner(a)
        lines = [c.children for c in banner.children
                 if getattr(c, "id", None) == "offload-verdict-cost"]
        assert getattr(banner, "data-verdict") == a.verdict
        return a.verdict, lines[0] if lines else None

    assert judged({"gpu->cpu": 0.004, "cpu->gpu": 0.003}) == (PAYS, None)
    verdict, line = judged({"gpu->cpu": 0.05, "cpu->gpu": 0.003})
    assert verdict == V.NOT_PAYING
    a = V.assess(window(usage=lambda i: 1.0, spent={"gpu->cpu": 0.05, "cpu->gpu": 0.003}),
                 records(30, ttft=0.5, wait=0.01))
    said = verdict_view.banner(a).children[1].children
    assert said.startswith(" overall: conditions ") and said.endswith(
        " say offload pays, the tiers' own cost says otherwise")
    assert line.startswith("no condition rules offload out, but the offload tiers' transfers "
                           "(offloads and promotions) took 3.18 s for 1.20 s")
    assert judged({"gpu->cpu": 0.016, "cpu->gpu": 0.003}) == (PAYS, None)


def test_the_tokens_card_puts_the_reuse_beside_what_was_served():
    """Served 4%, seen before 37%: the card says both, so the five-second read is "the tiers
    are too small", not "nothing repeats"; without hashes it names no reuse share."""
    from kvscope.dashboard import verdict_view

    def detail(samples):
        card = next(c for c in verdict_view.cards(V.assess(samples)).children
                    if c.id == "offload-card-tokens")
        return card.children[1].children, card.children[2].children

    assert detail(window(tokens_per_s={"gpu": 40.0, "recompute": 960.0},
                         prefix_per_s={"seen": 37.0, "new": 63.0})) == (
        "4%", "gpu 4% · recompute 96% · prompt blocks seen before 37%")
    assert detail(window(tokens_per_s={"gpu": 40.0, "recompute": 960.0})) == (
        "4%", "gpu 4% · recompute 96%")
