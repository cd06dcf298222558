"""The rollout's verdict (kvscope.rollout.judge) on cases whose answer is known: identical arms
never come out 'roll back', a planted regression far above the noise is found, and an A/A pair
that differs more than the candidate makes the verdict inconclusive."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from known_runs import simulated_runs
from kvscope.analysis.compare import INCONCLUSIVE, KEEP, ROLL_BACK, RequestSample
from kvscope.rollout.judge import judge, pooled
from kvscope.rollout.plan import aa_slot

OPTIONS = {"resamples": 400, "min_requests": 50}


@pytest.mark.parametrize("seed", range(6))
def test_identical_arms_never_roll_back(seed):
    """A/A: baseline, candidate and the A/A twin are one configuration (0.1 s): whatever the
    seed, the verdict is keep or inconclusive, with and without a relative budget."""
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}
    results = simulated_runs(["A", "B"], scale, seed=seed)
    for budget in (None, "+10%"):
        j = judge(results, "A", "B", ttft_budget=budget, itl_budget=budget, seed=seed, **OPTIONS)
        assert j.verdict.decision in (KEEP, INCONCLUSIVE), j.verdict.text
        assert j.overall.baseline.runs == 3  # one pooled run per repetition
        assert set(j.levels) == {1, 4} and j.aa is not None


@pytest.mark.parametrize("seed", [28, 38, 64, 76])
def test_identical_arms_whose_runs_drifted_apart_do_not_roll_back(seed):
    """A/A with strong run-to-run noise (each run's latencies shifted by exp(N(0, 0.15))), two
    repetitions of 24 requests at one level, as the end-to-end A/A test runs vLLM: in these
    seeds (those of 150 where it happens) the candidate's two runs drew slow shifts, so the
    bootstrap alone says worse and its difference interval clears the A/A pair's. Runs as
    the unit, two runs a side are not significantly apart: inconclusive, saying why."""
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}
    results = simulated_runs(["A", "B"], scale, seed=seed, reps=2, levels=(2,), requests=24,
                             run_sd=0.15)
    j = judge(results, "A", "B", ttft_budget="+10%", itl_budget="+10%", seed=seed,
              resamples=400, min_requests=20)
    over = [label for label, rows, aa_rows in (("TTFT", j.overall.ttft, j.aa.ttft),
                                               ("ITL", j.overall.itl, j.aa.itl))
            if rows[-1].candidate.value > getattr(j.overall, f"{label.lower()}_budget")
            and rows[-1].difference.low > abs(aa_rows[-1].difference.value)]
    assert over  # over the budget, and worse than the baseline beyond the A/A floor
    assert j.verdict.decision != ROLL_BACK, j.verdict.text
    assert "the runs, each one measurement, are not significantly slower" in j.verdict.text


def test_a_planted_regression_far_above_the_noise_is_rolled_back():
    """The candidate's latencies are 1.6x the baseline's at every level; run-to-run noise is
    5% and the A/A twin matches the baseline: p99 rises ~60%, far above a +10% budget and
    above the A/A floor -> roll back; per level too the difference is significant."""
    scale = {"A": 0.1, "B": 0.16, aa_slot("A"): 0.1}
    j = judge(simulated_runs(["A", "B"], scale, seed=1), "A", "B", ttft_budget="+10%", **OPTIONS)
    assert j.verdict.decision == ROLL_BACK, j.verdict.text
    for comparison in j.levels.values():
        assert comparison.ttft[-1].difference.low > 0


@pytest.mark.parametrize("planted", [False, True], ids=["alike", "3x at 1 stream"])
def test_a_regression_at_one_level_alone_is_not_kept(planted):
    """Levels 1 and 16; the candidate 10% faster at 16 streams and, planted, 3 times slower at
    1 stream. The whole ramp's p99 rests on the 16-stream requests (16 times slower than the
    1-stream ones): it keeps the candidate either way, and with the regression the final
    verdict was "keep", the 1-stream roll back shown nowhere. Now it is inconclusive and names
    the level; without it, keep."""
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}
    results = [(step, dataclasses.replace(
        sample, ttft=sample.ttft * factor, itl=sample.itl * factor))
        for step, sample in simulated_runs(["A", "B"], scale, seed=7, levels=(1, 16))
        for factor in [(3.0 if planted and step.level == 1 else 0.9) if step.slot == "B"
                       else 1.0]]
    j = judge(results, "A", "B", **OPTIONS)
    assert j.overall.verdict.decision == KEEP, j.overall.verdict.text
    if planted:
        assert j.levels[1].verdict.decision == ROLL_BACK
        assert j.verdict.decision == INCONCLUSIVE
        assert "a level's own verdict is roll back: at 1 stream (on TTFT, ITL)" in \
            j.verdict.text
    else:
        assert j.verdict.decision == KEEP, j.verdict.text


def test_a_ttft_regression_is_rolled_back_though_an_unchanged_itl_is_noisy():
    """TTFT 1.6x on the candidate; ITL the same on every arm (1 ms), so its A/A difference is
    noise that may exceed the candidate's (also noise): that must not hide the TTFT regression
    (guidellm's mock server, test_rollout_cli.py, once came out inconclusive so)."""
    scale = {"A": 0.1, "B": 0.16, aa_slot("A"): 0.1}
    for seed in range(4):
        results = simulated_runs(["A", "B"], scale, seed=seed, itl_scale=0.001)
        j = judge(results, "A", "B", ttft_budget="+10%", itl_budget="+10%", **OPTIONS)
        assert j.verdict.decision == ROLL_BACK, j.verdict.text
        assert any(r.startswith("noise floor: the A/A pair's p99 ITL") for r in j.verdict.reasons)


def test_an_aa_pair_noisier_than_the_effect_makes_it_inconclusive():
    """The twin runs 1.6x slower than the baseline (a noisy host), the candidate 1.3x: the rule
    alone would roll back, but the A/A difference is larger than the effect."""
    scale = {"A": 0.1, "B": 0.13, aa_slot("A"): 0.16}
    results = simulated_runs(["A", "B"], scale, seed=2)
    rule_alone = judge(results, "A", "B", ttft_budget="+10%", aa=False, **OPTIONS)
    assert rule_alone.verdict.decision == ROLL_BACK
    j = judge(results, "A", "B", ttft_budget="+10%", **OPTIONS)
    assert j.verdict.decision == INCONCLUSIVE
    assert any("noise floor" in r for r in j.verdict.reasons)


def test_an_aa_pair_noisy_in_itl_alone_leaves_a_ttft_regression_standing():
    """The twin's ITL 1.5x the baseline's (the A/A pair itself says roll back on ITL: a noisy
    host, as guidellm's mock server once gave in test_rollout_cli.py), TTFT alike; the candidate
    1.6x slower in TTFT, its ITL the baseline's: TTFT rolls back on its own floor, ITL is too
    noisy to judge. With no TTFT effect (identical arms), nothing rolls back."""
    twin = aa_slot("A")
    for scale, want in (({"A": 0.1, "B": 0.16, twin: 0.1}, ROLL_BACK),
                        ({"A": 0.1, "B": 0.1, twin: 0.1}, None)):
        for seed in range(3):
            results = [(s, dataclasses.replace(r, itl=r.itl * 1.5) if s.slot == twin else r)
                       for s, r in simulated_runs(["A", "B"], scale, seed=seed)]
            j = judge(results, "A", "B", ttft_budget="+10%", **OPTIONS)
            assert j.aa.by_metric["ITL"].decision == ROLL_BACK  # the planted noise is seen
            if want is None:
                assert j.verdict.decision != ROLL_BACK, j.verdict.text
            else:
                assert j.verdict.decision == want, j.verdict.text
                assert any("came out 'roll back' on ITL" in r for r in j.verdict.reasons)


def test_pooled_adds_counts_and_concatenates_latencies():
    a = RequestSample("a", np.array([1.0, 2.0]), np.array([0.1]), tokens={"gpu": 3},
                      transfer_bytes={"gpu->cpu": 10}, transfer_seconds={"gpu->cpu": 0.5},
                      transfer_failures=1, prefill_seconds=2.0,
                      failures_unmeasured=("disk->cpu",))
    b = RequestSample("b", np.array([3.0]), tokens={"gpu": 1, "cpu": 4},
                      transfer_bytes={"gpu->cpu": 5, "cpu->gpu": 7}, prefill_seconds=1.0,
                      failures_unmeasured=("cpu->gpu",))
    p = pooled([a, b], "ab")
    assert list(p.ttft) == [1.0, 2.0, 3.0] and list(p.itl) == [0.1]
    assert p.tokens == {"gpu": 4, "cpu": 4}
    assert p.transfer_bytes == {"gpu->cpu": 15, "cpu->gpu": 7}
    assert p.transfer_seconds == {"gpu->cpu": 0.5}
    assert (p.transfer_failures, p.prefill_seconds) == (1, 3.0)
    assert p.failures_unmeasured == ("cpu->gpu", "disk->cpu")  # either run's: the sum misses them
    assert p.failed_requests is None  # b did not count its own: no share can be formed
    counted = pooled([dataclasses.replace(a, failed_requests=2),
                      dataclasses.replace(b, failed_requests=0)], "ab")
    assert counted.failed_requests == 2


def _with_failures(results, failed):
    """Each run with ``failed(step, sample)`` -> (its requests kept, its failed count)."""
    out = []
    for step, sample in results:
        ttft, n = failed(step, sample)
        out.append((step, dataclasses.replace(sample, ttft=ttft, itl=ttft / 10,
                                              failed_requests=n)))
    return out


def test_a_candidate_that_fails_its_slowest_requests_is_rolled_back():
    """Identical arms, but the candidate's slowest 3 requests of each run's 60 (5%) fail, as a
    timeout would cut them: its finished requests read faster, and on them alone the verdict
    was "keep". Counted, the candidate failed 18 of 360 requests over its 6 runs and the
    baseline none of 360: Fisher's exact one-sided p is about (1/2)^18 = 4e-6, far below
    0.0125 -> roll back, naming the failed requests. A/A with failures: every arm fails 2 of
    each run's requests: nothing to roll back for."""
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}
    results = simulated_runs(["A", "B"], scale, seed=3)

    def slowest_fail(step, sample):
        if step.slot != "B":
            return sample.ttft, 0
        return np.sort(sample.ttft)[:-3], 3

    planted = _with_failures(results, slowest_fail)
    uncounted = [(s, dataclasses.replace(r, failed_requests=None)) for s, r in planted]
    assert judge(uncounted, "A", "B", ttft_budget="+10%", **OPTIONS).verdict.decision == KEEP
    j = judge(planted, "A", "B", ttft_budget="+10%", **OPTIONS)
    assert j.verdict.decision == ROLL_BACK, j.verdict.text
    assert j.overall.by_metric["TTFT"].decision == KEEP  # the latencies alone keep it
    assert "the candidate failed 18 of 360 requests (5.0%), the baseline 0 of 360" in \
        j.verdict.text
    same = _with_failures(results, lambda step, sample: (sample.ttft[:-2], 2))
    j = judge(same, "A", "B", ttft_budget="+10%", **OPTIONS)
    assert j.verdict.decision != ROLL_BACK, j.verdict.text
    assert j.overall.by_metric["failed requests"].decision == KEEP


def test_failures_in_one_burst_or_in_the_aa_pair_too_are_inconclusive():
    """Failures come in bursts: one stall cuts off every request in flight. The candidate's
    first repetition at 4 streams loses 8 of its 60 requests, no other run any: 8 of 360
    against 0 of 360 is significant (Fisher's p = 0.004) but all in one run: inconclusive
    (runs as the unit, 1 failing run of 9: p = 3/9). The same 3 failures a run in the
    candidate and in the A/A twin (the baseline's own configuration) say the set-up fails
    requests: inconclusive too, by the runs test itself (6 failing runs of 9: p = 20/84), as
    the A/A pair is by its own runs (3 against 3: p = 1/20; by Fisher's test alone it rolled
    back, and in 23% of sessions whose runs stall alike). And a level
    where the candidate finished nothing (all 60 failed at 4 streams, every repetition) still
    counts its failures over the ramp: roll back."""
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}
    results = simulated_runs(["A", "B"], scale, seed=3)

    def burst(step, sample):
        if step.slot == "B" and step.rep == 0 and step.level == 4:
            return sample.ttft[8:], 8
        return sample.ttft, 0

    j = judge(_with_failures(results, burst), "A", "B", ttft_budget="+10%", **OPTIONS)
    assert j.verdict.decision == INCONCLUSIVE, j.verdict.text
    failed = j.overall.by_metric["failed requests"]
    assert "a burst is not shown to be the candidate's" in failed.text
    assert "one-sided permutation p = 0.333" in failed.reasons[-1]
    twin = _with_failures(results, lambda step, sample: (
        (sample.ttft[3:], 3) if step.slot in ("B", aa_slot("A")) else (sample.ttft, 0)))
    j = judge(twin, "A", "B", ttft_budget="+10%", **OPTIONS)
    failed = j.overall.by_metric["failed requests"]
    assert failed.decision == INCONCLUSIVE and "permutation p = 0.238" in failed.reasons[-1]
    assert j.verdict.decision == INCONCLUSIVE, j.verdict.text
    assert j.aa.by_metric["failed requests"].decision == INCONCLUSIVE
    lost = _with_failures(results, lambda step, sample: (
        (sample.ttft[:0], 60) if step.slot == "B" and step.level == 4 else (sample.ttft, 0)))
    j = judge(lost, "A", "B", ttft_budget="+10%", **OPTIONS)
    assert j.verdict.decision == ROLL_BACK, j.verdict.text
    assert "the candidate failed 180 of 360 requests" in j.verdict.text


@pytest.mark.parametrize("seed", range(6))
def test_identical_failure_rates_never_roll_back(seed):
    """A/A in failures: every run of every arm fails each of its 60 requests with
    probability 0.05 (binomial draws, the latencies otherwise identical): whatever the seed,
    never roll back."""
    rng = np.random.default_rng(seed)
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}

    def random_failures(step, sample):
        n = int(rng.binomial(len(sample.ttft), 0.05))
        return sample.ttft[n:], n

    results = _with_failures(simulated_runs(["A", "B"], scale, seed=seed), random_failures)
    j = judge(results, "A", "B", ttft_budget="+10%", seed=seed, **OPTIONS)
    assert j.verdict.decision != ROLL_BACK, j.verdict.text


def test_an_arm_without_finished_requests_is_an_error():
    scale = {"A": .1, "B": .1, aa_slot("A"): .1}
    results = [(s, r) for s, r in simulated_runs(["A", "B"], scale, seed=0) if s.slot != "B"]
    with pytest.raises(ValueError, match="no candidate run"):
        judge(results, "A", "B", **OPTIONS)


def test_a_levels_reason_names_only_the_metrics_its_aa_gate_left_rolling_back():
    """Per level, the candidate's TTFT is 1.2x the baseline's and its ITL 1.5x; the A/A twin's
    TTFT is 1.4x (ITL alike). Both metrics roll back by the rule, but the twin's p99 TTFT
    differs by about 40%, more than the candidate's 20%, so the gate leaves TTFT inconclusive:
    the level's reason names ITL alone ("(on ITL)"), not "(on TTFT, ITL)"."""
    scale = {"A": 0.1, "B": 0.12, aa_slot("A"): 0.14}
    results = [(s, dataclasses.replace(r, itl=r.itl * (1.5 if s.slot == "B" else 1.0)))
               for s, r in simulated_runs(["A", "B"], scale, seed=3, requests=300,
                                          run_sd=0.02, itl_scale=0.01)]
    j = judge(results, "A", "B", **OPTIONS)
    assert all(c.by_metric["TTFT"].decision == ROLL_BACK for c in j.levels.values())
    said = [r for r in j.verdict.reasons if "a level's own verdict" in r]
    assert said == ["a level's own verdict is roll back: at 1 stream (on ITL), at 4 streams "
                    "(on ITL)"], said


def test_a_candidate_that_fails_every_request_is_rolled_back():
    """The candidate finishes none of its 360 requests (60 a run, 6 runs), the baseline fails
    none: it was no verdict at all ("no candidate run"). Now the failed-requests test judges
    it: Fisher's p ~ 0, and runs as the unit its 3 repetitions (share 1 each) against the 6 of
    the baseline's configuration (share 0) give p = 1/C(9, 3) = 1/84 = 0.0119 < 0.0125 ->
    roll back; latency is not measured on the candidate, not judged as 0."""
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}
    lost = _with_failures(simulated_runs(["A", "B"], scale, seed=3), lambda step, sample: (
        (sample.ttft[:0], 60) if step.slot == "B" else (sample.ttft, 0)))
    j = judge(lost, "A", "B", **OPTIONS)
    assert j.verdict.decision == ROLL_BACK, j.verdict.text
    assert "the candidate failed 360 of 360 requests" in j.verdict.text
    assert "permutation p = 0.0119" in j.overall.by_metric["failed requests"].reasons[-1]
    assert j.overall.ttft[-1].candidate is None and j.overall.ttft[-1].difference is None
    assert set(j.levels) == {1, 4}
    # its latency reasons say so in words (they read "0 requests in 0 run" and "a p99 of 0
    # rests on its slowest 1")
    ttft = j.overall.by_metric["TTFT"].reasons
    assert ttft[0].endswith("candidate 0 requests in 0 runs")
    assert ttft[1].endswith("one finished none, and has no p99")


def test_a_repetition_whose_every_run_failed_counts_its_failures():
    """The candidate's second repetition fails all its requests at both levels (120 of its
    360), the others none: that repetition vanished and the verdict was a silent keep. Now
    it counts: 120 of 360 failed against 0 of 360 (Fisher's p ~ 0), but runs as the unit one
    failing repetition of 9 runs of the baseline's configuration gives p = C(8, 2)/C(9, 3) =
    28/84 = 0.333 -> inconclusive; latency reads the 2 repetitions that finished requests.
    The same repetition failing in every arm (A/A in failures) is nothing to roll back for,
    and a run with neither finished nor failed requests still does not count."""
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}
    results = simulated_runs(["A", "B"], scale, seed=3)
    rep2 = _with_failures(results, lambda step, sample: (
        (sample.ttft[:0], 60) if step.slot == "B" and step.rep == 1 else (sample.ttft, 0)))
    j = judge(rep2, "A", "B", **OPTIONS)
    assert j.verdict.decision == INCONCLUSIVE, j.verdict.text
    assert j.overall.candidate.failed_requests == 120 and j.overall.candidate.runs == 3
    assert j.overall.candidate.requests == 240
    assert "permutation p = 0.333" in j.overall.by_metric["failed requests"].reasons[-1]
    alike = _with_failures(results, lambda step, sample: (
        (sample.ttft[:0], 60) if step.rep == 1 else (sample.ttft, 0)))
    j = judge(alike, "A", "B", **OPTIONS)
    assert j.verdict.decision != ROLL_BACK, j.verdict.text
    assert j.overall.by_metric["failed requests"].decision == KEEP
    assert j.aa.by_metric["failed requests"].decision == KEEP
    empty = _with_failures(results, lambda step, sample: (
        (sample.ttft[:0], 0) if step.slot == "B" and step.rep == 1 else (sample.ttft, 0)))
    j = judge(empty, "A", "B", **OPTIONS)
    assert j.overall.candidate.runs == 2 and "failed requests" not in j.overall.by_metric
    nothing = _with_failures(results, lambda step, sample: (
        (sample.ttft[:0], 0) if step.slot == "B" else (sample.ttft, 0)))
    with pytest.raises(ValueError, match="no candidate run"):
        judge(nothing, "A", "B", **OPTIONS)
