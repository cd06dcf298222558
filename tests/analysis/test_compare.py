"""``kvscope compare``: bootstrap intervals, and verdicts on hand-built captures whose right
answer follows by hand (each case's docstring says why)."""

import dataclasses
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from known_runs import write_capped_capture, write_capture
from kvscope.agent.capture import CaptureWriter
from kvscope.agent.requests import RequestRecord, TransferRecord
from kvscope.analysis.bootstrap import compare_quantiles, quantile_cis, quantile_replicates
from kvscope.analysis.capture_reader import read_request_sample
from kvscope.analysis.compare import (INCONCLUSIVE, KEEP, ROLL_BACK, RequestSample, compare,
                                      failed_requests, measured_sources, render_text,
                                      runs_permutation, runs_test, to_dict)
from kvscope.cli import main
from kvscope.dashboard.figures_compare import transfer_cost

BUDGET = 0.1  # seconds


def _mixture(n_low, n_mid, n_high):
    """n_low requests at 50 ms, n_mid at 90 ms, n_high at 110 ms."""
    return np.repeat([0.05, 0.09, 0.11], [n_low, n_mid, n_high])


def _verdict(tmp_path, baseline, candidate, *extra, runs=1, itl=(0.02, 0.02)):
    """``kvscope compare`` arguments for ``runs`` captures per arm, run i holding the given
    TTFTs and ITL times 1 + i / 10,000 (a repeated run is never quite the same: copies of one
    run measure no run-to-run variance); ``itl``: each arm's (seconds, 0: none), spread by
    +-0.01% over the requests (one value for all would be an engine's model, not judged)."""
    def itls(seconds, n, i):
        return seconds * (1 + i / 1e4) * (1 + np.linspace(-1e-4, 1e-4, n))

    b = ",".join(str(write_capture(tmp_path / f"baseline{i}", baseline * (1 + i / 1e4),
                                   itl=itls(itl[0], len(baseline), i))) for i in range(runs))
    c = ",".join(str(write_capture(tmp_path / f"candidate{i}", candidate * (1 + i / 1e4),
                                   itl=itls(itl[1], len(candidate), i), cpu_tokens=32))
                 for i in range(runs))
    args = ["compare", b, c, "--json", "--resamples", "1000", *extra]
    return args


def test_keep_when_every_candidate_ttft_is_under_the_budget(tmp_path, capsys):
    """Candidate TTFTs run 20-60 ms: every resampled p99 is at most the sample maximum, 60 ms,
    so the whole interval lies under the 100 ms budget -> keep."""
    args = _verdict(tmp_path, np.linspace(0.1, 0.2, 400), np.linspace(0.02, 0.06, 400),
                    "--ttft-budget", str(BUDGET))
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"]["decision"] == KEEP
    p99 = out["ttft"][2]
    assert p99["quantile"] == 0.99 and p99["candidate"]["high"] <= 0.06
    assert p99["difference"]["high"] < 0  # and much better than the baseline
    # hit quality and transfer cost come through from the capture
    assert out["candidate"]["token_share"]["cpu"] == 0.5
    assert out["baseline"]["token_share"]["recompute"] == 1.0
    assert out["candidate"]["transfers"]["cpu->gpu"]["bytes"] == 400 * 1_000_000
    assert out["candidate"]["promotion_wait_mean"] == pytest.approx(0.001)
    assert out["itl"][0]["candidate"]["value"] == pytest.approx(0.02)


def test_roll_back_when_every_candidate_ttft_is_over_the_budget(tmp_path, capsys):
    """Three runs per arm. Candidate TTFTs run 150-300 ms: every resampled p99 is at least the
    sample minimum, 150 ms, so the whole interval lies above the 100 ms budget, and every
    candidate value exceeds every baseline one (20-60 ms), so every replicate difference is
    > 0 -> roll back. The same pair with one run per arm cannot tell that from run-to-run
    noise -> inconclusive, and it says why."""
    base, cand = np.linspace(0.02, 0.06, 400), np.linspace(0.15, 0.3, 400)
    args = _verdict(tmp_path, base, cand, "--ttft-budget", str(BUDGET), runs=3)
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    verdict = data["verdict"]
    assert verdict["decision"] == ROLL_BACK == "roll back (disable the newest tier)"
    assert "over the 100 ms budget and significantly worse" in verdict["text"]
    assert data["runs"]["TTFT"]["df"] == 4 and data["runs"]["TTFT"]["p"] < data["runs_alpha"]
    assert main(_verdict(tmp_path / "one", base, cand, "--ttft-budget", str(BUDGET))) == 0
    verdict = json.loads(capsys.readouterr().out)["verdict"]
    assert verdict["decision"] == INCONCLUSIVE and "run-to-run noise" in verdict["text"]
    assert any("one run per arm" in r for r in verdict["reasons"]), verdict
    one = compare(RequestSample("b", base),
                  [RequestSample(f"c{i}", cand * (1 + i / 1e4)) for i in range(3)],
                  ttft_budget=BUDGET, resamples=400)
    assert one.verdict.decision == INCONCLUSIVE
    assert "with one run of the baseline the difference" in one.verdict.text


def test_keep_when_over_the_budget_but_better_than_the_baseline(tmp_path, capsys):
    """Candidate 150-300 ms (every resampled p99 >= 150 ms, above the 100 ms budget) against a
    baseline of 400-600 ms: every candidate value is below every baseline value, so every
    replicate difference is < 0. Rolling back would raise p99 further -> keep, and say the
    budget needs more than a rollback (the rule once said roll back here)."""
    args = _verdict(tmp_path, np.linspace(0.4, 0.6, 400), np.linspace(0.15, 0.3, 400),
                    "--ttft-budget", str(BUDGET))
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ttft"][2]["candidate"]["low"] > BUDGET and out["ttft"][2]["difference"]["high"] < 0
    assert out["verdict"]["decision"] == KEEP
    assert "needs more than a rollback" in out["verdict"]["text"]


def test_over_the_budget_and_better_than_the_baseline_keeps_however_far_over():
    """Baseline p99 500 ms (450-550); budget 100 ms. A candidate at 200 ms (150-300) and one
    barely over at 105 ms (95-115, straddling the budget) are both significantly better than
    the baseline (difference intervals below 0): both keep. The second was once inconclusive,
    a softer verdict for a run nearer the budget."""
    from kvscope.analysis.bootstrap import Estimate
    from kvscope.analysis.compare import QuantileRow, verdict

    base = Estimate(0.5, 0.45, 0.55)
    for cand in (Estimate(0.2, 0.15, 0.3), Estimate(0.105, 0.095, 0.115)):
        diff = Estimate(cand.value - base.value, cand.low - base.high, cand.high - base.low)
        decision = verdict(QuantileRow(0.99, base, cand, diff), BUDGET, 0.95, 1000, 1000)
        assert decision.decision == KEEP, cand


def test_inconclusive_when_the_p99_interval_straddles_the_budget(tmp_path, capsys):
    """Both runs: 980 requests at 50 ms, 10 at 90 ms, 10 at 110 ms. The p99 (linear, position
    989.01 of 1000) is 90.2 ms, under the budget; a resample's p99 is 110 ms when it draws 11
    or more of the 110 ms requests and at most 90.2 ms when it draws 10 or fewer. That count is
    Binomial(1000, 0.01): P(>= 11) = 0.42 and P(<= 9) = 0.46, so the 95% interval runs from
    <= 90 ms to 110 ms and contains the 100 ms budget, and the same distributions on both sides
    give a difference interval around 0 -> inconclusive."""
    mix = _mixture(980, 10, 10)
    assert main(_verdict(tmp_path, mix, mix, "--ttft-budget", str(BUDGET))) == 0
    out = json.loads(capsys.readouterr().out)
    p99 = out["ttft"][2]["candidate"]
    assert p99["value"] == pytest.approx(0.0902)
    assert p99["low"] <= 0.09 and p99["high"] == pytest.approx(0.11)
    assert out["verdict"]["decision"] == INCONCLUSIVE


def test_roll_back_when_the_interval_straddles_but_the_candidate_is_worse(tmp_path, capsys):
    """Three runs per arm alike but for 0.01% a run, so a replicate pools 3 x 1000 requests
    drawn from one run's. Candidate: 980 at 50 ms, 8 at 90 ms, 12 at 110 ms per run: p99
    (linear, position 2969.01 of the pooled 3000, whose top 36 are the runs' 12 at 110 ms,
    110.011 ms and 110.022 ms) = 110 ms (> budget), but a replicate
    drawing K <= 30 of them (K ~ Binomial(3000, 0.012), mean 36, sd 5.96: P(K <= 30) ~ 0.18)
    has p99 <= 90.2 ms, so the interval straddles the budget. Baseline: 40-50 ms, p99 under
    50 ms. A candidate replicate's p99 stays at 50 ms or less only if it draws 30 or fewer of
    the slow requests (Binomial(3000, 0.02), mean 60, sd 7.7: P ~ 1e-4 < 2.5%), so the
    difference interval lies above 0: over budget by the estimate and significantly worse ->
    roll back."""
    args = _verdict(tmp_path, np.linspace(0.04, 0.05, 1000), _mixture(980, 8, 12),
                    "--ttft-budget", str(BUDGET), runs=3)
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    c, d = out["ttft"][2]["candidate"], out["ttft"][2]["difference"]
    assert c["value"] == pytest.approx(0.11) and c["low"] < BUDGET < c["high"] + 1e-12
    assert d["low"] > 0
    assert out["verdict"]["decision"] == ROLL_BACK


def test_without_a_budget_the_baseline_decides(tmp_path, capsys):
    """Two runs per arm, the second 0.01% slower. Candidate 200-300 ms vs baseline 50-100 ms:
    every candidate value exceeds every baseline value, so every replicate difference is > 0
    and the runs are far apart -> roll back (a significant regression); the swapped pair is
    significantly better -> keep."""
    slow, fast = np.linspace(0.2, 0.3, 300), np.linspace(0.05, 0.1, 300)
    b, c = (",".join(str(write_capture(tmp_path / f"{name}{i}", x * (1 + i / 1e4)))
                     for i in range(2)) for name, x in (("fast", fast), ("slow", slow)))
    assert main(["compare", str(b), str(c), "--json", "--resamples", "500"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"]["decision"] == ROLL_BACK
    assert main(["compare", str(c), str(b), "--json", "--resamples", "500"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"]["decision"] == KEEP


def test_a_keep_names_a_median_significantly_worse_than_the_baseline(tmp_path, capsys):
    """Baseline: 400 at 20 ms and 100 at 150 ms; candidate: 400 at 40 ms and 100 at 150 ms.
    Both p99s are 150 ms (no regression: keep, without a budget), but every candidate median
    resample is 40 ms against the baseline's 20 ms: p50 is significantly worse, and the
    verdict's reasons say so (a keep once read as an endorsement of a slower run)."""
    base = np.repeat([0.02, 0.15], [400, 100])
    cand = np.repeat([0.04, 0.15], [400, 100])
    b, c = write_capture(tmp_path / "b", base), write_capture(tmp_path / "c", cand)
    assert main(["compare", str(b), str(c), "--json", "--resamples", "500"]) == 0
    verdict = json.loads(capsys.readouterr().out)["verdict"]
    assert verdict["decision"] == KEEP
    assert any(r.startswith("TTFT p50 is significantly worse than the baseline's (+20 ms")
               for r in verdict["reasons"])
    assert not any(r.startswith("TTFT p95") for r in verdict["reasons"])


def test_too_few_requests_is_inconclusive_and_the_report_says_so(tmp_path, capsys):
    """50 requests per side: a p99 rests on about one request -> inconclusive."""
    few = np.linspace(0.01, 0.02, 50)
    b, c = write_capture(tmp_path / "b", few), write_capture(tmp_path / "c", few)
    assert main(["compare", str(b), str(c), "--ttft-budget", "0.1", "--resamples", "200"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("verdict: inconclusive: too few requests")
    assert "a p99 of 50 rests on its slowest 1" in text
    # the reason follows --min-requests: 400 requests against 1000 asked for; the p99 of 400
    # rests on its slowest 4 (400 // 100)
    more = np.linspace(0.01, 0.02, 400)
    b, c = write_capture(tmp_path / "b4", more), write_capture(tmp_path / "c4", more)
    assert main(["compare", str(b), str(c), "--min-requests", "1000", "--resamples", "200"]) == 0
    assert "fewer than 1000 requests on a side: a p99 of 400 rests on its slowest 4" in \
        capsys.readouterr().out
    assert "TTFT p99" in text and "hit quality" in text and "transfer cost" in text


def test_the_report_gives_transfer_sizes_and_waits_in_readable_units(tmp_path, capsys):
    """400 requests each promoting 2 blocks (1 MB, waiting 1 ms): 400 MB in 0.4 s, a mean wait
    of 1 ms. Sizes were always in MB (288,297.6 MB for 288 GB), and a 7 us wait read 0.0 ms
    (a new user)."""
    ttfts = np.linspace(0.02, 0.06, 400)
    b = write_capture(tmp_path / "b", ttfts)
    c = write_capture(tmp_path / "c", ttfts, cpu_tokens=32)
    assert main(["compare", str(b), str(c), "--resamples", "200"]) == 0
    text = capsys.readouterr().out
    assert "cpu->gpu 400.0 MB in 0.400 s; promotion wait mean 1 ms, p99 1 ms" in text
    from kvscope.analysis.compare import _bytes, ms
    assert (_bytes(288_297_600_000), _bytes(999)) == ("288.3 GB", "999 B")
    # 3 significant digits, never 1.5e+03 nor 0.0
    assert (ms(1.5), ms(7.3e-6), ms(0.0902), ms(4e-5)) == (
        "1500 ms", "0.0073 ms", "90.2 ms", "0.04 ms")


def test_compare_is_deterministic_and_rejects_bad_input(tmp_path, capsys):
    b = write_capture(tmp_path / "b", np.linspace(0.01, 0.02, 200))
    c = write_capture(tmp_path / "c", np.linspace(0.01, 0.03, 200))
    sb, sc = read_request_sample(b), read_request_sample(c)
    assert to_dict(compare(sb, sc, seed=7, resamples=300)) == \
        to_dict(compare(sb, sc, seed=7, resamples=300))
    assert "inconclusive" not in render_text(compare(sb, sc, ttft_budget=1.0, resamples=300))
    with pytest.raises(ValueError, match="budget"):
        compare(sb, sc, ttft_budget=0.0)
    with pytest.raises(ValueError, match="no finished requests"):
        compare(RequestSample("empty", np.zeros(0)), sc)
    for flag, value in (("--confidence", "95"), ("--resamples", "0")):
        with pytest.raises(SystemExit) as stopped:  # argparse's one line, naming the flag
            main(["compare", str(b), str(c), flag, value])
        assert stopped.value.code == 2
        assert f"argument {flag}: must be" in capsys.readouterr().err
    # 2 resamples beyond each end of the interval at the least: 2 * 2 / 0.05 = 80 at 95%, and
    # 2 * 2 / 0.01 = 400 at 99% (1 gave a zero-width interval beside a confident keep)
    for extra, least in ((["--resamples", "79"], 80),
                         (["--resamples", "399", "--confidence", "0.99"], 400)):
        assert main(["compare", str(b), str(c), *extra]) == 2
        err = capsys.readouterr().err
        assert "is too few for a 9" in err and f"give at least {least} " in err
    # a confidence no allowed count serves: 2 * 2 / 1e-6 = 4,000,000 resamples, above the
    # 1,000,000 cap (it asked for 4,000,000, then refused them); 1 - 4 / 1e6 = 0.999996 does
    assert main(["compare", str(b), str(c), "--confidence", "0.999999"]) == 2
    assert "--confidence 0.999999 needs 4,000,000 resamples, above the 1,000,000 allowed: " \
        "give --confidence 0.999996 or less" in capsys.readouterr().err
    assert main(["compare", str(b), str(c), "--resamples", "80", "--json"]) == 0
    capsys.readouterr()
    # one run named twice in an arm would fake the run-to-run variance a roll back needs
    assert main(["compare", f"{b},,{b}", str(c)]) == 2
    assert f"names {b} twice" in capsys.readouterr().err
    # nor one capture on both sides, however spelled: compared with itself it reads as an A/A
    # check that passed, which says nothing of run-to-run variance
    assert main(["compare", f"{b},{c}", f"{tmp_path}/./c/"]) == 2
    assert f"{c} is named as both the baseline and the candidate" in capsys.readouterr().err
    # nor a capture and one of its own segments (a tryout's read as 2 runs, or as an A/A)
    segment = sorted(c.glob("requests-*.parquet"))[0]
    assert main(["compare", str(b), f"{c},{segment}"]) == 2
    assert f"{c} and {segment} read the same requests segments" in capsys.readouterr().err
    assert main(["compare", str(c), str(segment)]) == 2
    assert (f"the baseline's {c} and the candidate's {segment} read the same requests segments"
            in capsys.readouterr().err)
    # nor a copy of one (a tryout's `cp -r` passed as an A/A pair): its segments keep their
    # names and the id of the writer that made them
    copy = tmp_path / "copy"
    shutil.copytree(c, copy)
    assert main(["compare", str(c), str(copy)]) == 2
    assert (f"the baseline's {c} and the candidate's {copy} read the same requests segments "
            "(one is the other, a segment of it or a copy)" in capsys.readouterr().err)
    # renamed too (a second tryout's copy renamed each segment)
    for segment in copy.glob("*.parquet"):
        segment.rename(segment.with_name(segment.name.replace("requests-", "requests-9")))
    assert main(["compare", str(c), str(copy)]) == 2
    assert "read the same requests segments" in capsys.readouterr().err


def test_a_parquet_file_of_another_kind_is_one_line_saying_what_to_pass(tmp_path, capsys):
    """A user passed a capture's blocks segment where a requests one belongs: Arrow's error
    lists the file's whole schema; the message keeps its first line and says what to pass."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    other = tmp_path / "blocks-1.parquet"
    pq.write_table(pa.table({"ts": [1.0], "block_hash": [7], "depth": [0]}), other)
    c = write_capture(tmp_path / "c", [0.02] * 10)
    assert main(["compare", str(other), str(c)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "not a kvscope requests segment" in err[0] and "pass the capture directory" in err[0]


def test_a_trace_file_given_to_compare_is_told_to_go_to_analyze(tmp_path, capsys):
    """A Mooncake trace (.jsonl, the format `kvscope analyze` reads) has block accesses but no
    request timings: compare says which command reads it, instead of Arrow's parquet error."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, '
                     '"hash_ids": [1]}\n')
    c = write_capture(tmp_path / "c", [0.02] * 10)
    assert main(["compare", str(c), str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "not an agent capture" in err[0] and "`kvscope analyze` reads traces" in err[0]


def test_a_capture_whose_size_cap_deleted_segments_is_named(tmp_path, capsys):
    """100 requests written 10 at a time, a segment each (numbered 1 to 10), under a cap that
    keeps the newest few (known_runs.write_capped_capture): compare reads what is left, and
    says on stderr how many segments are gone (10 less those left) and why, so that a run with
    fewer requests than it served is not taken for one that served fewer. A capture with all
    its segments draws no note."""
    capped, gone = write_capped_capture(tmp_path / "capped")
    whole = write_capture(tmp_path / "whole", [0.02] * 50)
    assert main(["compare", str(capped), str(whole)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvscope compare: note: {capped}: {gone} of its segments are gone "
                   "(deleted by its size cap, capture_max_bytes, oldest first, or lost to a "
                   "failed write): requests it recorded may be missing"]


def test_bootstrap_median_interval_covers_the_true_median_about_95_percent():
    """Standard normal samples (true median 0), n = 101, 1000 resamples, 200 seeded repeats:
    the 95% percentile-bootstrap interval of the median should contain 0 in about 95% of
    repeats (binomial sd over 200 repeats: 1.5 points). Efron & Tibshirani 1993, ch. 13."""
    rng = np.random.default_rng(2024)
    hits = 0
    for repeat in range(200):
        x = rng.standard_normal(101)
        (median,) = quantile_cis(x, [0.5], resamples=1000, seed=repeat)
        hits += median.contains(0.0)
    assert 0.89 <= hits / 200 <= 0.99


def test_bootstrap_replicates_are_chunked_seeded_and_shaped():
    x = np.arange(10.0)
    a = quantile_replicates(x, [0.5, 0.99], resamples=300,
                            rng=np.random.default_rng(1))
    b = quantile_replicates(x, [0.5, 0.99], resamples=300,
                            rng=np.random.default_rng(1))
    assert a.shape == (300, 2) and np.array_equal(a, b)
    assert a.min() >= 0 and a.max() <= 9
    two = compare_quantiles(x, x + 5, [0.5], resamples=400)
    assert two.difference[0].value == 5.0 and two.candidate[0].value == 9.5
    with pytest.raises(ValueError):
        quantile_replicates(np.zeros(0), [0.5], rng=np.random.default_rng(0))


def test_one_damaged_segment_in_a_capture_directory_is_skipped_with_a_warning(tmp_path,
                                                                               capsys, caplog):
    """A capture directory holding a requests segment that is not Parquet (a damaged copy):
    compare used to refuse the whole directory. Now that file is skipped, a warning names it,
    and the comparison runs on the readable segments (10 requests each side)."""
    b, c = write_capture(tmp_path / "b", [0.02] * 10), write_capture(tmp_path / "c", [0.04] * 10)
    (c / f"requests-{'9' * 15}-1-000001.parquet").write_bytes(b"not parquet")
    assert main(["compare", str(b), str(c)]) == 0
    assert "skipped" in caplog.text and "requests-999999999999999-1-000001.parquet" in caplog.text
    assert f"candidate {c} (10 requests)" in capsys.readouterr().out


def test_two_stage_bootstrap_draws_runs_then_requests():
    """Runs of constant values 1 (3 requests), 2 (2) and 3 (4): a replicate's minimum is 1 when
    run 0 is among the 3 runs drawn with replacement (P = 1 - (2/3)^3 = 19/27), else 2 when run
    1 is (P = (2/3)^3 - (1/3)^3 = 7/27), else 3 (1/27), whatever requests are drawn within
    them. One run is the one-stage bootstrap, draw for draw."""
    from kvscope.analysis.bootstrap import run_quantile_replicates

    runs = [np.full(3, 1.0), np.full(2, 2.0), np.full(4, 3.0)]
    reps = run_quantile_replicates(runs, [0.0], resamples=20_000,
                                   rng=np.random.default_rng(3))[:, 0]
    for value, p in ((1.0, 19 / 27), (2.0, 7 / 27), (3.0, 1 / 27)):
        assert np.mean(reps == value) == pytest.approx(p, abs=0.01), value
    x = np.linspace(0, 1, 50)
    one = run_quantile_replicates([x], [0.5, 0.9], resamples=300, rng=np.random.default_rng(5))
    assert np.array_equal(one, quantile_replicates(x, [0.5, 0.9], resamples=300,
                                                   rng=np.random.default_rng(5)))


def _runs_with_effects(rng, runs, shift=0.0, n=300, run_sd=0.05):
    """``runs`` runs of ``n`` requests: TTFT = 100 ms + a run effect (normal, ``run_sd``
    seconds: host noise, warm-up, scheduling shared by one run's requests) + 20 ms
    exponential per request, + ``shift`` seconds."""
    return [RequestSample(f"run{i}", 0.1 + shift + rng.normal(0, run_sd)
                          + rng.exponential(0.02, n)) for i in range(runs)]


def test_the_runs_test_takes_runs_as_the_unit():
    """By hand: candidate runs' p99 e^1 and e^1.2, baseline's e^0 and e^0.2, a noise arm's
    e^0.1 and e^0.1 (one request each, so each run's p99 is its value). Log p99 means 1.1 and
    0.1, pooled variance (0.02 + 0.02 + 0) / 3 = 0.01333 on 3 degrees of freedom, standard
    error sqrt(0.01333 * (1/2 + 1/2)) = 0.11547, t = 1 / 0.11547 = 5 sqrt(3); with 3 degrees of
    freedom the upper tail is 1/2 - (theta + sin(theta) cos(theta)) / pi with theta =
    atan(t / sqrt(3)) = atan(5) (Abramowitz & Stegun 26.7.3): 1/2 - (1.373401 + 5/26) / pi =
    0.0016195."""
    def runs(*logs):
        return [np.array([np.exp(x)]) for x in logs]
    test = runs_test(runs(0.0, 0.2), runs(1.0, 1.2), [runs(0.1, 0.1)])
    assert test.df == 3 and test.p == pytest.approx(0.0016195, rel=1e-4)
    reverse = runs_test(runs(1.0, 1.2), runs(0.0, 0.2), [runs(0.1, 0.1)])
    assert reverse.p == pytest.approx(1 - test.p)
    # not measured: one run with values on a side (an empty run is left out), a p99 of 0 s
    assert runs_test(runs(0.0, 0.2), runs(1.0) + [np.zeros(0)]).p is None
    assert runs_test(runs(0.0, 0.2), [np.array([0.0]), np.array([1.0])]).p is None
    # no spread at all (copies of one run on each side): not measured either
    assert runs_test(runs(0.0, 0.0), runs(1.0, 1.0)).p is None


def test_a_regression_resting_on_two_runs_that_vary_is_inconclusive_and_says_why():
    """Two runs a side of 200 requests each, every run's requests alike: baseline runs at 100
    and 110 ms, candidate runs at 150 and 300 ms. Every bootstrap replicate's candidate p99
    (150 ms or more) is above every baseline one (110 ms or less): the bootstrap alone rolls
    back. Runs as the unit: log p99s -2.303, -2.207 vs -1.897, -1.204; mean difference
    0.7045; squares about the arm means 2 (0.0477)^2 + 2 (0.3466)^2 = 0.2448 on 2 degrees of
    freedom, variance 0.1224, standard error sqrt(0.1224 (1/2 + 1/2)) = 0.350, t = 2.01;
    with 2 degrees of freedom the upper tail is (1 - t / sqrt(2 + t^2)) / 2 (Abramowitz &
    Stegun 26.7.3) = 0.0908, not under (1 - 0.95) / 4 = 0.0125 -> inconclusive, saying so."""
    base = [RequestSample(f"b{i}", np.full(200, x)) for i, x in enumerate((0.10, 0.11))]
    cand = [RequestSample(f"c{i}", np.full(200, x)) for i, x in enumerate((0.15, 0.30))]
    assert compare(base, cand, resamples=400, by_runs=False).verdict.decision == ROLL_BACK
    result = compare(base, cand, resamples=400)
    assert result.verdict.decision == INCONCLUSIVE, result.verdict.text
    assert "not significantly slower (one-sided p = 0.0908)" in result.verdict.text
    test = runs_test([s.ttft for s in base], [s.ttft for s in cand])
    assert test.df == 2 and test.p == pytest.approx(0.0908, abs=5e-4)
    # the JSON gives the test and its threshold as fields; by the bootstrap alone, neither
    data = to_dict(result)
    assert data["runs"]["TTFT"] == {"p": test.p, "df": 2} and data["runs_alpha"] == 0.0125
    assert "runs as the unit (one-sided p that the candidate's runs are slower in p99; a " \
        "roll back needs under 0.0125): TTFT p = 0.0908, 2 degrees of freedom" \
        in render_text(result)
    assert to_dict(compare(base, cand, resamples=400, by_runs=False))["runs"] == {}
    # runs alike to the last digit (copies of one run) measure no variance: the line says what
    # is not measured (it read "TTFT not measured" beside the TTFT the table had measured)
    copies = [[RequestSample(f"{arm}{i}", np.full(200, x)) for i in range(2)]
              for arm, x in (("b", 0.1), ("c", 0.3))]
    assert "): TTFT run-to-run variance not measured" in render_text(
        compare(*copies, resamples=400))


def test_itl_counts_the_runs_that_reported_it():
    """Two runs an arm, but one of the candidate's reported no ITL (every request's 50 ms on
    the other, 20 ms on the baseline's, over a 30 ms budget): ITL rests on one candidate run,
    so it says so and is inconclusive rather than claiming two runs."""
    ttft = np.linspace(0.02, 0.06, 200)
    base = [RequestSample(f"b{i}", ttft * (1 + i / 1e4), np.full(200, 0.02 * (1 + i / 1e4)))
            for i in range(2)]
    cand = [RequestSample("c0", ttft, np.full(200, 0.05)), RequestSample("c1", ttft * 1.0001)]
    itl = compare(base, cand, itl_budget=0.03, resamples=400).by_metric["ITL"]
    assert itl.decision == INCONCLUSIVE
    assert "candidate 200 requests in 1 run" in itl.reasons[0]
    assert "with one run of the candidate the difference" in itl.text


def test_arms_whose_runs_ran_in_two_windows_are_told_to_interleave(tmp_path):
    """Captures know when their requests ran (write_capture: request i arrives at 1000 + i s;
    each run's window is moved here). Two runs an arm: all the baseline's before all the
    candidate's -> a note says so and names the baseline; interleaved (b, c, b, c) -> no
    note; one run an arm is never noted (two runs are always in two windows)."""
    def arm(name, runs):
        return [read_request_sample(str(write_capture(tmp_path / f"{name}{i}", np.full(
            50, 0.01) * (1 + i / 1e6)))) for i in runs]

    def shifted(samples, by):
        return [dataclasses.replace(s, window=(s.window[0] + by, s.window[1] + by))
                for s in samples]
    base, cand = arm("b", (0, 1)), arm("c", (2, 3))
    assert base[0].window == (1000.0, 1049.01)
    note = "the baseline's runs all ran before the other arm's (not interleaved)"
    windows = {"apart": (shifted(base, 0), shifted(cand, 200)),
               "interleaved": ([base[0], shifted(base, 200)[1]],
                               [shifted(cand, 100)[0], shifted(cand, 300)[1]])}
    apart = compare(*windows["apart"], resamples=400)
    assert any(r.startswith(note) for r in apart.verdict.reasons)
    for sides in (windows["interleaved"], (base[:1], shifted(cand, 200)[:1])):
        assert not any("not interleaved" in r for r in compare(*sides, resamples=400)
                       .verdict.reasons)


def test_identical_arms_never_roll_back_while_a_planted_regression_is_found():
    """A/A: 12 pairs of arms of 3 runs each drawn from one configuration whose runs differ by
    a 50 ms (sd) run effect, far beyond the requests' own spread. Two-stage intervals carry
    that variance: no pair is 'roll back'. Pooling each arm's requests as one run (the one-stage
    bootstrap, as if they were independent) calls several of the same pairs significant: the
    control that shows the A/A check can fail. A planted +1 s regression (20 run sds) is rolled
    back in every one of 5 pairs."""
    rng = np.random.default_rng(42)
    pooled_significant = 0
    for _ in range(12):
        a, b = _runs_with_effects(rng, 3), _runs_with_effects(rng, 3)
        result = compare(a, b, resamples=400)
        assert result.verdict.decision != ROLL_BACK, result.verdict
        pooled = compare(RequestSample("a", np.concatenate([r.ttft for r in a])),
                         RequestSample("b", np.concatenate([r.ttft for r in b])), resamples=400)
        pooled_significant += pooled.ttft[2].difference.low > 0 or \
            pooled.ttft[2].difference.high < 0
    assert pooled_significant >= 3, pooled_significant
    for _ in range(5):
        result = compare(_runs_with_effects(rng, 3), _runs_with_effects(rng, 3, shift=1.0),
                         resamples=400)
        assert result.verdict.decision == ROLL_BACK, result.verdict


def _stalling_runs(rng, n, stall):
    """``n`` runs of 200 finished requests, each stalling with probability ``stall``: a stall
    cuts off the 8 requests in flight, failed."""
    ttft = np.full(200, 0.05)
    return [RequestSample("run", ttft, ttft / 10,
                          failed_requests=8 if rng.random() < stall else 0) for _ in range(n)]


def test_bursts_of_failures_in_identical_arms_never_roll_back_and_a_planted_rise_does():
    """A/A: 200 pairs of arms of 3 runs each, then 400 with an A/A twin of 3 more, every run
    stalling with probability 0.3 (8 requests lost). Fisher's test on the requests alone
    called 2 or 3 stalls against none significant, and with the candidate's failures in 2
    runs or more it rolled back 12% of
    identical pairs; with the runs as the unit, 3 runs against 3 cannot go below p = 1/20
    and never do. Planted: the candidate stalls in every run, the baseline and its A/A twin
    (6 runs) never: p = 1/C(9, 3) = 1/84 < 0.0125, roll back; without the twin, 3 against 3,
    inconclusive (the least p, 0.05, said)."""
    rng = np.random.default_rng(11)
    decisions = [getattr(failed_requests(_stalling_runs(rng, 3, 0.3),
                                         _stalling_runs(rng, 3, 0.3), 0.95), "decision", None)
                 for _ in range(200)]
    assert ROLL_BACK not in decisions and decisions.count(INCONCLUSIVE) > 10
    # with an A/A twin, 3 runs against 6 can roll back (1/84): identical arms then do in at
    # most 0.0125 of comparisons (none of these 400), where Fisher's test alone did in 23%
    decisions = [getattr(failed_requests(
        _stalling_runs(rng, 3, 0.3), _stalling_runs(rng, 3, 0.3), 0.95,
        noise=[_stalling_runs(rng, 3, 0.3)]), "decision", None) for _ in range(400)]
    assert decisions.count(ROLL_BACK) <= 5 and decisions.count(INCONCLUSIVE) > 20
    stalling, calm = _stalling_runs(rng, 3, 1.0), _stalling_runs(rng, 6, 0.0)
    planted = failed_requests(calm[:3], stalling, 0.95, noise=[calm[3:]])
    assert planted.decision == ROLL_BACK
    assert "one-sided permutation p = 0.0119" in planted.reasons[-1]
    alone = failed_requests(calm[:3], stalling, 0.95)
    assert alone.decision == INCONCLUSIVE and "the least p they can give: 0.05;" in \
        alone.reasons[-1]


def test_the_runs_permutation_test_counts_the_splits_by_hand():
    """Exact: all 3 high runs in the candidate, of 9 -> 1/C(9,3) = 1/84; one of its 3 high,
    none of the 6 others -> the splits holding that run, C(8,2) = 28 of 84 = 1/3. Random
    (C(20,10) = 184,756 splits, over the 20,000 drawn): 10 high against 10 low -> no draw
    but the observed split reaches it, p = 1/20,001 (Phipson & Smyth's +1)."""
    ones, zeros = np.ones(3), np.zeros(6)
    assert runs_permutation(ones, zeros) == (pytest.approx(1 / 84), pytest.approx(1 / 84))
    assert runs_permutation(np.array([1.0, 0, 0]), zeros)[0] == pytest.approx(28 / 84)
    p, least = runs_permutation(np.ones(10), np.zeros(10), seed=3)
    assert least == pytest.approx(1 / 20_001) and p <= 2 / 20_001


def test_identical_arms_draw_no_note_on_the_unjudged_quantiles_and_a_slower_median_does():
    """The notes on p50 and p95 (the rule judges p99) are four tests at once: made each at
    95%, 2 of 60 A/A pairs (a baseline of 2 runs, a candidate of 1, lognormal TTFTs and ITLs
    of 150 requests) drew one, the control that shows this check can fail; at the Bonferroni
    level, 95% for the four together, none does. A candidate 20 ms slower everywhere (TTFT
    median 50 ms) is still noted in every one of 10 pairs."""
    rng = np.random.default_rng(7)

    def arm(name, runs=1, shift=0.0):
        return [RequestSample(f"{name}{i}", rng.lognormal(np.log(0.05), 0.5, 150) + shift,
                              rng.lognormal(np.log(0.02), 0.3, 150)) for i in range(runs)]

    noted = each_at_95 = 0
    for seed in range(60):
        result = compare(arm("a", 2), arm("b"), resamples=400, seed=seed)
        noted += any("the rule judges p99 only" in r for r in result.verdict.reasons)
        each_at_95 += any(r.quantile != 0.99 and r.difference.low > 0
                          for r in (*result.ttft, *result.itl))
    assert noted == 0 and each_at_95 >= 2, (noted, each_at_95)
    for seed in range(10):
        result = compare(arm("a"), arm("b", shift=0.02), resamples=400, seed=seed)
        assert any(r.startswith("TTFT p50 is significantly worse") and "4 quantiles tested"
                   in r for r in result.verdict.reasons), result.verdict.reasons


def test_too_few_requests_or_resamples_claim_nothing_of_the_unjudged_quantiles():
    """1 request against 1 (TTFT 100 ms and 105 ms): every resample of one request is that
    request, so the p50 difference's 98.75% interval was "5 ms to 5 ms" and the note read
    "TTFT p50 is significantly worse". Like the p99, p50 and p95 are not tested with fewer
    than 100 requests (--min-requests) on a side, and the note says so. A/A pairs of 2
    requests a side (lognormal TTFTs, 100 seeded pairs) drew the note in 18; now none does.

    A planted difference (candidate +20 ms, 150 requests a side, lognormal TTFT median 50 ms
    and ITL) is still noted, given the resamples its test needs: TTFT and ITL p50 and p95 are
    4 tests at once, each at the Bonferroni level 1 - 0.05 / 4 = 98.75%, 0.625% beyond each
    end; MIN_TAIL_RESAMPLES = 2 there take 2 / 0.00625 = 320 resamples. At 100 (0.625 of a
    resample beyond each end) the slower p50 is named as not tested, with the 320 it needs."""
    one = compare(RequestSample("b", np.array([0.100]), np.array([0.01])),
                  RequestSample("c", np.array([0.105]), np.array([0.01])))
    reasons = one.verdict.reasons
    assert not any("significantly worse" in r for r in reasons), reasons
    assert "TTFT p50 and p95 not tested either: fewer than 100 requests on a side" in reasons
    rng = np.random.default_rng(0)
    claims = [seed for seed in range(100)
              if any("significantly worse" in r for r in compare(
                  RequestSample("b", rng.lognormal(-2, 0.5, 2)),
                  RequestSample("c", rng.lognormal(-2, 0.5, 2)),
                  resamples=400, seed=seed).verdict.reasons)]
    assert claims == []

    def arm(name, shift=0.0):
        return RequestSample(name, rng.lognormal(np.log(0.05), 0.5, 150) + shift,
                             rng.lognormal(np.log(0.02), 0.3, 150))

    for seed in range(5):
        base, cand = arm("a"), arm("b", shift=0.02)
        thin = compare(base, cand, resamples=100, seed=seed).verdict.reasons
        assert not any("significantly worse" in r for r in thin), thin
        assert any(r.startswith("TTFT p50") and " may be worse than the baseline's, not "
                   "tested: 100 resamples " in r and "98.75% CI that 4 quantiles tested at "
                   "once need (give --resamples 320 or more)" in r for r in thin), thin
        enough = compare(base, cand, resamples=320, seed=seed).verdict.reasons
        assert any(r.startswith("TTFT p50 is significantly worse than the baseline's (+")
                   and "98.75% CI" in r for r in enough), enough


def test_an_arm_without_tokens_by_source_is_not_measured_never_zero(tmp_path, capsys):
    """A GPU-only vLLM seen through its spans alone: records without tokens by source or
    promotion waits. Its hit quality and promotion wait are 'not measured' (None in JSON, said
    in the report), not 0% of every source and 0 ms; the other arm's waits of 0 (no promotion
    was waited for) are measured, and shown."""
    base = RequestSample("spans-only", np.linspace(0.05, 0.1, 200))
    cand = RequestSample("tap", np.linspace(0.05, 0.1, 200), tokens={"gpu": 52, "recompute": 48},
                         promotion_wait=np.zeros(200))
    result = compare(base, cand, resamples=200)
    assert result.baseline.token_share is None
    assert result.candidate.token_share["gpu"] == pytest.approx(0.52)
    assert to_dict(result)["baseline"]["token_share"] is None
    assert to_dict(result)["baseline"]["promotion_wait_mean"] is None
    text = render_text(result)
    assert "spans-only: not measured" in text
    assert "spans-only: none; promotion wait not measured;" in text
    assert "tap: none; promotion wait mean 0 ms, p99 0 ms;" in text
    # its tokens by source are not measured either: null, not 0 from every source
    assert to_dict(result)["baseline"]["tokens"] is None


def test_the_arm_without_itl_is_named():
    """ITL reported by the baseline's requests only: the note names the candidate (it said
    "not measured on both arms"), and an ITL budget is inconclusive, saying the same."""
    ttft = np.linspace(0.02, 0.06, 200)
    base = [RequestSample(f"b{i}", ttft * (1 + i / 1e4), np.full(200, 0.02)) for i in range(2)]
    cand = [RequestSample(f"c{i}", ttft * (1 + i / 1e4)) for i in range(2)]
    result = compare(base, cand, resamples=400)
    assert "ITL not measured on the candidate: judged on TTFT alone" in result.verdict.reasons
    itl = compare(base, cand, itl_budget=0.03, resamples=400).by_metric["ITL"]
    assert itl.decision == INCONCLUSIVE and "not measured on the candidate" in itl.text
    assert "not measured on the baseline and the candidate" in compare(
        cand, cand, itl_budget=0.03, resamples=400).by_metric["ITL"].text


def test_a_capture_of_spans_alone_measured_no_transfers(tmp_path):
    """A capture whose records came from spans alone (no tokens by source, no transfers, no
    tiers reported: no tap) read 'transfer cost: none; ... failed transfers 0' in a tryout:
    nothing there counted transfers. Now not measured (None in JSON); the tap's capture of
    the same, with its tiers reported, measured none (0)."""
    writer = CaptureWriter(tmp_path / "spans")
    for i in range(200):
        writer.add_request(RequestRecord(f"r{i}", f"{i + 1:032x}", "vllm", 1000.0 + i,
                                         prompt_tokens=64, ttft=0.05 + i / 4000,
                                         finished=1001.0 + i))
    writer.close()
    spans = read_request_sample(tmp_path / "spans")
    assert spans.transfer_failures is None and spans.token_sources is None
    assert not spans.transfers_measured
    result = compare(spans, read_request_sample(write_capture(tmp_path / "tap",
                                                              np.full(200, 0.05))),
                     resamples=200)
    assert result.baseline.transfer_failures is None and result.baseline.tokens is None
    assert result.baseline.transfers is None and result.candidate.transfers == {}
    # the Compare page's chart says so, rather than "no transfers in either run"
    chart = transfer_cost(to_dict(result))
    assert chart.layout.annotations[0].text.replace("<br>", " ") == \
        "transfers not measured in the baseline; none in the other"
    assert "spans: not measured; promotion wait not measured; failed transfers not measured" \
        in render_text(result)


def test_sources_a_run_did_not_measure_are_not_measured_never_zero():
    """A rollout arm read from vLLM's own metrics: gpu 60 and recompute 40 tokens, nothing
    said of cpu or disk. Its shares are of those two (60%, 40%), cpu and disk "not measured"
    (they read 0.0%); pooled with a run that measured every source, still only those two. A
    capture's run (every source measured, those that served nothing left out) shows cpu 0%."""
    ttft = np.linspace(0.05, 0.1, 200)
    server = RequestSample("vllm", ttft, tokens={"gpu": 60, "recompute": 40},
                           token_sources=("gpu", "recompute"))
    capture = RequestSample("capture", ttft, tokens={"gpu": 30, "recompute": 70})
    result = compare(server, capture, resamples=200)
    assert result.baseline.token_share == {"gpu": 0.6, "recompute": 0.4}
    assert result.candidate.token_share == {"gpu": 0.3, "cpu": 0.0, "disk": 0.0,
                                            "recompute": 0.7}
    assert "vllm: gpu 60.0%, cpu not measured, disk not measured, recompute 40.0%" in \
        render_text(result)
    assert measured_sources([server, capture]) == ("gpu", "recompute")
    assert measured_sources([capture]) is None


def test_budgets_are_seconds_or_a_percentage_of_the_baseline(tmp_path, capsys):
    """"0.5" is 0.5 s; "+10%" the baseline's p99 plus 10%. Baseline TTFTs 90-100 ms (400, 3
    runs): p99 (linear) = 90 + 10 * 395.01/399 = 99.90 ms, so "+50%" is 149.85 ms. A candidate
    at 20-60 ms is within it with confidence -> keep; one at 200-300 ms is above it and worse
    than every baseline value -> roll back. Malformed budgets are one line, exit 2."""
    from kvscope.analysis.compare import Budget, parse_budget

    assert parse_budget("0.5") == Budget(seconds=0.5) and parse_budget(0.25) == Budget(0.25)
    assert parse_budget("+10%") == Budget(relative=0.1) and parse_budget(None) is None
    for bad in ("abc", "0", "-1", "-100%", "nan%", "inf"):
        with pytest.raises(ValueError):
            parse_budget(bad)
    with pytest.raises(ValueError, match=r"e\.g\. \+10% \(the baseline's p99 plus 10%\)"):
        parse_budget("+10")  # not 10 s: a sign is relative
    base = np.linspace(0.09, 0.1, 400)
    for name, cand, decision in (("fast", np.linspace(0.02, 0.06, 400), KEEP),
                                 ("slow", np.linspace(0.2, 0.3, 400), ROLL_BACK)):
        assert main(_verdict(tmp_path / name, base, cand, "--ttft-budget", "+50%", runs=3)) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["ttft_budget"] == pytest.approx(0.09990 * 1.5, rel=1e-3), out["ttft_budget"]
        assert out["verdict"]["decision"] == decision, out["verdict"]
        assert any("+50%" in r for r in out["verdict"]["reasons"]), out["verdict"]
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "a", "b", "--ttft-budget", "fast"])
    assert exit_.value.code == 2 and "--ttft-budget: budget 'fast'" in capsys.readouterr().err


def test_an_itl_regression_over_its_budget_rolls_back_with_ttft_fine(tmp_path, capsys):
    """Same TTFTs (20-60 ms, within the 100 ms budget) on both arms of 3 runs; every request's
    ITL is 20 ms on the baseline and 50 ms on the candidate, so every replicate p99 ITL is 20
    and 50 ms: over the 30 ms ITL budget and worse by 30 ms in every replicate -> roll back,
    and the verdict names ITL. Without ITL on one arm an ITL budget cannot be judged ->
    inconclusive."""
    ttft = np.linspace(0.02, 0.06, 400)
    args = _verdict(tmp_path, ttft, ttft, "--ttft-budget", str(BUDGET), "--itl-budget", "0.03",
                    runs=3, itl=(0.02, 0.05))
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"]["decision"] == ROLL_BACK and out["itl_budget"] == 0.03
    assert out["verdict"]["text"].startswith(
        f"{ROLL_BACK}; ITL roll back, TTFT {KEEP}. ITL: candidate p99 ITL 50 ms")
    assert out["itl"][2]["difference"]["low"] == pytest.approx(0.03, rel=1e-3)
    args = _verdict(tmp_path / "none", ttft, ttft, "--itl-budget", "0.03", runs=3,
                    itl=(0.02, 0.0))
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"]["decision"] == INCONCLUSIVE and "ITL" in out["verdict"]["text"]


def test_transfer_cost_counts_the_offloads_no_request_holds(tmp_path, capsys):
    """The agent's samples (cumulative counters since it started) go to the capture's totals
    when they change: gpu->cpu stores no request's record holds (1 MB, then 3 MB, then after a
    restart 0.5 MB; failures 1, then 2, then 1), cpu->gpu promotions (2 MB, in the records
    too, one failed), disk->cpu promotions seen through KV events (1 MB; their failures seen
    by no source). Per direction the cost is the first row plus each increase, a drop counting
    from 0: gpu->cpu 3 + 0.5 = 3.5 MB in 0.02 + 0.005 s, 2 + 1 = 3 failed stores, cpu->gpu
    2 MB and 1 failure, disk->cpu 1 MB, failures not measured; a sample that changed nothing
    adds no rows. The failed transfers are the totals' 4, not the records' 1 (the failed
    stores are background work), disk->cpu's not measured. A capture from before the totals
    had failures reads the failures its records hold: 1 here, 0 in one whose records hold
    none (not "not measured": the records counted them before)."""
    from kvscope.analysis.capture_reader import read_transfer_totals

    def capture(directory, samples, failed_records):
        writer = CaptureWriter(directory)
        for s in samples:
            writer.add_sample(s)
        for i in range(3):
            copy = TransferRecord("cpu", "gpu", 2, 2000, 1.0, 0.001, ok=i >= failed_records)
            writer.add_request(RequestRecord(f"r{i}", f"{i + 1:032x}", "engine", 1.0,
                                             prompt_tokens=8, ttft=0.05, finished=1.1,
                                             transfers=[copy]))
        writer.close()
        return directory

    def sample(ts, stored, seconds, promoted, failed):
        return {"ts": ts,
                "transfer_bytes": {"gpu->cpu": stored, "cpu->gpu": promoted,
                                   "disk->cpu": promoted // 2},
                "transfer_blocks": {"gpu->cpu": stored // 1000, "cpu->gpu": promoted // 1000,
                                    "disk->cpu": promoted // 2000},
                "transfer_seconds_sum": {"gpu->cpu": seconds, "cpu->gpu": 0.002},
                "transfer_failures": {"gpu->cpu": failed, "cpu->gpu": 1}}

    directory = capture(tmp_path / "cap", [
        sample(1.0, 1_000_000, 0.01, 2_000_000, 1), sample(2.0, 3_000_000, 0.02, 2_000_000, 2),
        sample(3.0, 3_000_000, 0.02, 2_000_000, 2), sample(4.0, 500_000, 0.005, 0, 1)], 1)
    totals = read_transfer_totals(directory)
    assert totals == {"gpu->cpu": (3_500_000, 3_500, pytest.approx(0.025), 3),
                      "cpu->gpu": (2_000_000, 2_000, pytest.approx(0.002), 1),
                      "disk->cpu": (1_000_000, 1_000, 0.0, None)}, totals
    sample_ = read_request_sample(directory)
    assert sample_.transfer_bytes == {"gpu->cpu": 3_500_000, "cpu->gpu": 2_000_000,
                                      "disk->cpu": 1_000_000}
    assert (sample_.transfer_failures, sample_.failures_unmeasured) == (4, ("disk->cpu",))
    other = write_capture(tmp_path / "other", [0.05] * 3)  # one capture, or a copy, is refused
    args = ["compare", str(other), str(directory), "--resamples", "100", "--min-requests", "1"]
    assert main([*args, "--json"]) == 0
    cand = json.loads(capsys.readouterr().out)["candidate"]
    assert cand["transfers"]["gpu->cpu"]["bytes"] == 3_500_000 and cand["transfer_failures"] == 4
    assert cand["failures_unmeasured"] == ["disk->cpu"]
    assert main(args) == 0
    assert "; failed transfers 4 (disk->cpu not measured)" in capsys.readouterr().out
    (segment,) = directory.glob("totals-*.parquet")
    assert pq.read_table(segment).num_rows == 9  # 3 changes
    older = capture(tmp_path / "older", [sample(1.0, 1_000_000, 0.01, 2_000_000, 1)], 0)
    for path in (segment, *older.glob("totals-*.parquet")):
        pq.write_table(pq.read_table(path).drop_columns(["failures"]), path)
    assert {d: t[3] for d, t in read_transfer_totals(directory).items()} == dict.fromkeys(
        ("gpu->cpu", "cpu->gpu", "disk->cpu"))
    assert read_request_sample(directory).transfer_failures == 1
    assert read_request_sample(older).transfer_failures == 0
    assert read_request_sample(older).failures_unmeasured == ()


def _promoting_capture(directory, source, copies, tiers=None, jitter=0.0) -> CaptureWriter:
    """A capture (left open) of 100 requests of 64 prompt tokens, 32 of them from ``source``
    and 32 recomputed in 3.2 ms of prefill (``jitter`` seconds more and less in turn); each
    request made ``copies``, (src, dst, seconds), of 2 blocks (1 MB) each. ``tiers``: those
    the agent's sample before them reported (None: no sample, the tiers unknown)."""
    writer = CaptureWriter(directory)
    if tiers is not None:
        writer.add_sample({"ts": 999.0, "transfer_bytes": {}, "transfer_blocks": {},
                           "transfer_seconds_sum": {},
                           "tier_capacity_bytes": dict.fromkeys(tiers, 1 << 30)})
    for i in range(100):
        writer.add_request(RequestRecord(
            f"r{i}", f"{i + 1:032x}", "engine", 1000.0 + i, prompt_tokens=64,
            tokens={source: 32, "recompute": 32}, ttft=0.01,
            prefill=0.0032 + (jitter if i % 2 else -jitter),
            transfers=[TransferRecord(src, dst, 2, 1_000_000, 1000.0 + i, seconds)
                       for src, dst, seconds in copies],
            finished=1000.0 + i + 0.01))
    return writer


def test_a_prefill_at_one_exact_rate_is_the_engines_model_not_a_measurement(tmp_path, capsys):
    """The reference engine prices prefill by its preset (a demo capture's 197,800 tokens/s,
    tiny's, for every request), and compare and analyze called that rate measured. 100
    requests recomputing 32 tokens each in 3.2 ms: exactly 10,000 tokens/s every one, a
    model's; in 3.0 and 3.4 ms in turn, the same 0.32 s in all (10,000 tokens/s) but a rate
    that varies as a measured one does. Compare says "modelled by the engine" for the first,
    "measured" for the second; analyze's rate source says "modelled:" and "measured:"."""
    from kvscope.analysis.capture_reader import read_measured_rates

    model, measured = tmp_path / "model", tmp_path / "measured"
    _promoting_capture(model, "cpu", []).close()
    _promoting_capture(measured, "cpu", [], jitter=0.0002).close()
    assert main(["compare", str(measured), str(model), "--resamples", "100"]) == 0
    text = capsys.readouterr().out
    assert f"{measured} (prefill 10,000 tokens/s measured)" in text
    assert f"{model} (prefill 10,000 tokens/s modelled by the engine)" in text
    for path, said in ((model, "modelled: every request's prefill in the capture is its "
                               "recomputed tokens at exactly 10,000 tokens/s"),
                       (measured, "measured: 3,200 recomputed prompt tokens in 0.32 s")):
        rate, source = read_measured_rates(path).pick("prefill", None, "")
        assert rate == pytest.approx(10_000) and source.startswith(said), source


def test_one_itl_for_every_request_is_the_engines_model_not_a_measurement(tmp_path, capsys):
    """The reference engine prices decode: every request of a demo capture had an ITL of
    0.995 ms, and compare read "ITL keep" with a CI of 0.995-0.995 ms as if measured. A
    baseline whose 50 requests all have 20 ms is the model's; a candidate's 15 to 25 ms,
    spread as a measurement's, is not: the report says so of the baseline alone, and the
    verdict judges TTFT alone. No ITL quantile is printed: a modelled one is no measurement,
    and a difference from it is none either (a tryout read rows of 1.00 [1.00, 1.00] beside
    "not measured")."""
    ttft = np.linspace(0.02, 0.06, 50)
    base = write_capture(tmp_path / "base", ttft, itl=0.02)
    cand = write_capture(tmp_path / "cand", ttft, itl=np.linspace(0.015, 0.025, 50))
    assert main(["compare", str(base), str(cand), "--resamples", "100"]) == 0
    text = capsys.readouterr().out
    assert ("  ITL not measured: every request's ITL of the baseline is the same, the "
            "engine's cost model (the reference engine prices decode)\n") in text
    assert "of the candidate" not in text and "and the candidate" not in text
    assert "  TTFT p99 " in text and "  ITL  p" not in text
    # and the verdict does not judge it: TTFT alone, as where an arm reported no ITL
    assert ("  - ITL not measured on the baseline (the engine's cost model: every request's ITL "
            "the same): judged on TTFT alone\n") in text
    assert main(["compare", str(base), str(cand), "--resamples", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["baseline"]["itl_modelled"], out["candidate"]["itl_modelled"]) == (True, False)
    # a candidate whose requests reported no ITL (0: unknown) is not the cost model's (a
    # tryout's capture from an emitter read "the baseline and the candidate (the engine's
    # cost model ...)")
    none = write_capture(tmp_path / "none", ttft, itl=0.0)
    assert main(["compare", str(base), str(none), "--resamples", "100"]) == 0
    assert ("  - ITL not measured on the baseline (the engine's cost model: every request's ITL "
            "the same) and the candidate (none reported): judged on TTFT alone\n"
            ) in capsys.readouterr().out


def test_a_tier_the_capture_did_not_have_reads_no_tier_never_zero(tmp_path, capsys):
    """The candidate's agent reported a gpu and a cpu tier, no disk tier; its 100 requests of
    64 prompt tokens took 32 from cpu and recomputed 32: cpu 3,200 / 6,400 = 50%, recompute
    50%, gpu 0%, and "no disk tier" (it read 0.0%, then "disk not measured", where the agent
    had said there was none), left out of the JSON shares as a rollout arm's unmeasured
    sources are, and listed in ``tiers_off``. The baseline was captured before the tiers were
    recorded: every source measured, as before (disk 0.0%). A source that served tokens was
    measured whatever tiers were reported: cpu's 32 tokens a request beside a gpu tier alone."""
    _promoting_capture(tmp_path / "cand", "cpu", [], tiers=("gpu", "cpu")).close()
    base = write_capture(tmp_path / "base", np.linspace(0.01, 0.02, 100))
    assert main(["compare", str(base), str(tmp_path / "cand"), "--json", "--resamples",
                 "100"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidate"]["token_share"] == {"gpu": 0.0, "cpu": 0.5, "recompute": 0.5}
    assert out["baseline"]["token_share"] == {"gpu": 0.0, "cpu": 0.0, "disk": 0.0,
                                              "recompute": 1.0}
    assert (out["candidate"]["tiers_off"], out["baseline"]["tiers_off"]) == (["disk"], [])
    assert main(["compare", str(base), str(tmp_path / "cand"), "--resamples", "100"]) == 0
    text = capsys.readouterr().out
    assert "cand: gpu 0.0%, cpu 50.0%, no disk tier, recompute 50.0%" in text
    assert "base: gpu 0.0%, cpu 0.0%, disk 0.0%, recompute 100.0%" in text
    _promoting_capture(tmp_path / "gpu", "cpu", [], tiers=("gpu",)).close()
    assert read_request_sample(tmp_path / "gpu").token_sources == ("gpu", "cpu", "recompute")
    # copies into a cpu tier whose capacity nobody reported (vLLM's /metrics without KV
    # events): the tier is there, its share not measured, never "no cpu tier"
    _promoting_capture(tmp_path / "blind", "gpu", [("gpu", "cpu", 0.001)], tiers=("gpu",)).close()
    blind = read_request_sample(tmp_path / "blind")
    assert (blind.token_sources, blind.tiers_off) == (("gpu", "recompute"), ("disk",))
    # a run with no offload tier at all copied, promoted and failed nothing: said so, where a
    # tryout read "promotion wait mean 0 ms, p99 0 ms; failed transfers 0"
    _promoting_capture(tmp_path / "none", "gpu", [], tiers=("gpu",)).close()
    assert main(["compare", str(base), str(tmp_path / "none"), "--resamples", "100"]) == 0
    text = capsys.readouterr().out
    assert f"  {tmp_path / 'none'}: none (no offload tier: nothing to copy, promote or fail)\n" \
        in text
    assert f"  {base}: none; promotion wait" in text  # tiers unknown: as before


def test_an_arm_of_runs_with_different_offload_tiers_is_refused(tmp_path, capsys):
    """An arm of a run without an offload tier and one with a cpu tier (two setups) read cpu
    "not measured": its tokens, 28% of the prompt, left the shares. The arm is refused, naming
    each run's tiers; two runs of the cpu setup are one arm, and a capture from before tiers
    were recorded (unknown) joins either."""
    _promoting_capture(tmp_path / "gpu", "gpu", [], tiers=("gpu",)).close()
    for name in ("cpu-1", "cpu-2"):
        _promoting_capture(tmp_path / name, "cpu", [], tiers=("gpu", "cpu")).close()
    base = write_capture(tmp_path / "base", np.linspace(0.01, 0.02, 100))
    mixed = f"{tmp_path / 'gpu'},{tmp_path / 'cpu-1'}"
    assert main(["compare", str(base), mixed, "--resamples", "100"]) == 2
    assert (f"{mixed}: the runs' offload tiers differ ({tmp_path / 'gpu'}: none; "
            f"{tmp_path / 'cpu-1'}: cpu); an arm's runs repeat one setup: compare different "
            "setups as two arms") in capsys.readouterr().err
    same = f"{tmp_path / 'cpu-1'},{tmp_path / 'cpu-2'},{base}"
    assert main(["compare", str(tmp_path / "gpu"), same, "--resamples", "100"]) == 0
    capsys.readouterr()


def test_offloads_value_per_tier_is_prefill_saved_against_copies_both_ways(tmp_path, capsys):
    """100 requests of 64 prompt tokens, 32 from the cpu tier and 32 recomputed in 3.2 ms of
    prefill each: the engine prefilled 3,200 tokens in 0.32 s, 10,000 tokens/s, so the cpu
    tier's 3,200 tokens saved 0.32 s; its copies took 1 ms of promotion each (0.1 s) plus the
    agent's offload totals (gpu->cpu 0.05 s): 0.15 s. The copies between cpu and disk (2 s
    down, 0.5 s up, 1 block up of the 200 that went on to the GPU) are the disk tier's, and so
    is that block's share of the cpu->gpu leg, as the dashboard charges a staged promotion
    (kvscope/analysis/transfer_cost.py): disk 2.5 + 0.1 / 200 = 2.5005 s, cpu 0.15 - 0.0005 =
    0.1495 s (counted for both tiers, the cpu tier read 2.65 s). A baseline without prefill
    times has its saving "not measured", never 0."""
    directory = tmp_path / "cand"
    writer = _promoting_capture(directory, "cpu", [("cpu", "gpu", 0.001)])
    writer.add_sample({"ts": 1100.0,
                       "transfer_bytes": {"gpu->cpu": 10, "cpu->gpu": 100, "cpu->disk": 10,
                                          "disk->cpu": 10},
                       "transfer_blocks": {"gpu->cpu": 1, "cpu->gpu": 200, "cpu->disk": 1,
                                           "disk->cpu": 1},
                       "transfer_seconds_sum": {"gpu->cpu": 0.05, "cpu->gpu": 0.1,
                                                "cpu->disk": 2.0, "disk->cpu": 0.5}})
    writer.close()
    base = write_capture(tmp_path / "base", np.linspace(0.01, 0.02, 100))
    assert main(["compare", str(base), str(directory), "--json", "--resamples", "100"]) == 0
    out = json.loads(capsys.readouterr().out)
    cand = out["candidate"]
    assert cand["prefill_rate"] == pytest.approx(10_000)
    assert cand["value"]["cpu"] == {"tokens": 3200, "prefill_seconds_saved": pytest.approx(0.32),
                                    "transfer_seconds": pytest.approx(0.1495)}
    assert cand["value"]["disk"] == {"tokens": 0, "prefill_seconds_saved": 0.0,
                                     "transfer_seconds": pytest.approx(2.5005)}
    assert out["baseline"]["prefill_rate"] is None and out["baseline"]["value"] == {}
    assert main(["compare", str(base), str(directory), "--resamples", "100"]) == 0
    text = capsys.readouterr().out
    # (every request prefilled at exactly 10,000 tokens/s: a cost model's rate, so said)
    assert "prefill 10,000 tokens/s modelled by the engine): cpu: 3,200 tokens, saved 320 ms, " \
        "spent 150 ms" in text and "prefill rate not measured): no tier below the GPU served " \
        "tokens" in text
    # records without tokens by source (a load generator's, not the agent's): not measured,
    # never "none"
    writer = CaptureWriter(tmp_path / "untold")
    for i in range(100):
        writer.add_request(RequestRecord(f"r{i}", "", "engine", 1000.0 + i, prompt_tokens=64,
                                         output_tokens=8, tokens={}, ttft=0.01,
                                         finished=1000.01 + i))
    writer.close()
    assert main(["compare", str(base), str(tmp_path / "untold"), "--resamples", "100"]) == 0
    assert "prefill rate not measured): not measured (the records carry no tokens by source)" \
        in capsys.readouterr().out
    # and in the JSON null, as the text says, not {} ("no tier served tokens")
    assert main(["compare", str(base), str(tmp_path / "untold"), "--resamples", "100",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["candidate"]["value"] is None


def _zero_code_capture(directory, requests: int) -> None:
    """vLLM in zero-code mode: ``requests`` span records of 64 prompt tokens and 10 ms of
    prefill each, none with tokens by source, and the agent's counts by source from vLLM's
    /metrics, with a restart between two samples: gpu 1,000 then 600, cpu 2,000 then 1,200,
    recompute 1,000 then 600 (the counters start again at the restart). The agent reported
    the gpu and cpu tiers (vLLM's /metrics: its GPU's usage, its CPU tier's capacity) before
    the requests, and counted no transfer."""
    writer = CaptureWriter(directory)
    writer.add_sample({"ts": 999.0, "transfer_bytes": {}, "transfer_blocks": {},
                       "transfer_seconds_sum": {},
                       "tier_capacity_bytes": {"gpu": 1 << 30, "cpu": 1 << 30}})
    for ts, n in ((1100.0, 1000), (1200.0, 600)):
        writer.add_sample({"ts": ts, "transfer_bytes": {}, "transfer_blocks": {},
                           "transfer_seconds_sum": {},
                           "prompt_tokens": {"gpu": n, "cpu": 2 * n, "recompute": n}})
    for i in range(requests):
        writer.add_request(RequestRecord(f"r{i}", f"{i + 1:032x}", "vllm", 1000.0 + i,
                                         prompt_tokens=64, tokens={}, ttft=0.02, prefill=0.01,
                                         finished=1000.5 + i))
    writer.close()


def test_a_zero_code_arm_takes_tokens_by_source_from_the_agents_counts(tmp_path, capsys,
                                                                        caplog):
    """vLLM in zero-code mode counts tokens by source in /metrics, not per request: its
    captures read "not measured" for hit quality and offload's value, the rollout method's
    answer. The agent's counts over the capture are gpu 1,000 + 600, cpu 2,000 + 1,200 and
    recompute 1,000 + 600 (6,400 tokens: 25%, 50%, 25%), the 100 span records' 6,400 prompt
    tokens too, so their 1 s of prefill prices the 1,600 recomputed tokens: 1,600 tokens/s,
    and the cpu tier's 3,200 tokens saved 2 s. Spans of 10 requests (traces sampled: 640
    prompt tokens against 6,400 counted) are not the counted requests: the shares stand, the
    prefill rate and the saving are not measured, and a warning says why. No transfer was
    counted (no totals) and the records hold none: the transfers are not measured, never
    "none" (the reported tiers once made them read "none", failures 0)."""
    _zero_code_capture(tmp_path / "all", 100)
    _zero_code_capture(tmp_path / "sampled", 10)
    base = write_capture(tmp_path / "base", np.linspace(0.01, 0.02, 100))
    assert main(["compare", str(base), str(tmp_path / "all"), "--json", "--resamples",
                 "100"]) == 0
    cand = json.loads(capsys.readouterr().out)["candidate"]
    assert cand["token_share"] == {"gpu": 0.25, "cpu": 0.5, "recompute": 0.25}  # no disk tier
    assert cand["prefill_rate"] == pytest.approx(1600)
    assert cand["transfers"] is None and cand["transfer_failures"] is None
    assert cand["value"]["cpu"]["prefill_seconds_saved"] == pytest.approx(2.0)
    with caplog.at_level("WARNING", logger="kvscope.analysis.capture_reader"):
        assert main(["compare", str(base), str(tmp_path / "sampled"), "--json",
                     "--resamples", "100"]) == 0
    cand = json.loads(capsys.readouterr().out)["candidate"]
    assert cand["token_share"]["cpu"] == 0.5 and cand["prefill_rate"] is None
    assert cand["value"]["cpu"] == {"tokens": 3200, "prefill_seconds_saved": None,
                                    "transfer_seconds": None}
    assert "hold 640 prompt tokens, the agent counted 6400 by source" in caplog.text


def test_untimed_copies_and_uncounted_failures_are_not_measured_never_zero(tmp_path, capsys):
    """A vLLM capture whose 100 requests each had 2 blocks promoted disk->cpu (the tap sees
    those copies as manager events, untimed: duration 0) and 32 tokens from the disk tier:
    the copies' time is "not measured", and so is what the disk tier spent, never "0.000 s"
    (offload looked free). A rollout arm read from vLLM's /metrics counts no failures: "failed
    transfers not measured"; a capture counts them (0 here). Timed cpu->gpu copies (1 ms each)
    beside them still add up: 0.1 s."""
    directory = tmp_path / "cand"
    _promoting_capture(directory, "disk", [("disk", "cpu", 0.0), ("cpu", "gpu", 0.001)]).close()
    cand = read_request_sample(directory)
    assert "disk->cpu" not in cand.transfer_seconds and cand.transfer_failures == 0
    server = RequestSample("server", np.linspace(0.01, 0.02, 100),
                           tokens={"cpu": 3200, "recompute": 3200},
                           transfer_bytes={"cpu->gpu": 10**8}, transfer_failures=None)
    c = compare(server, cand, ttft_budget=None, resamples=100)
    disk, moved = c.candidate.value["disk"], c.candidate.transfers
    assert disk["transfer_seconds"] is None and disk["tokens"] == 3200
    assert moved["disk->cpu"]["seconds"] is None and moved["disk->cpu"]["blocks"] == 200
    assert moved["cpu->gpu"]["seconds"] == pytest.approx(0.1)
    assert c.baseline.transfers["cpu->gpu"]["seconds"] is None
    assert c.baseline.transfers["cpu->gpu"]["blocks"] is None
    assert (c.baseline.transfer_failures, c.candidate.transfer_failures) == (None, 0)
    text = render_text(c)
    assert "disk->cpu 100.0 MB in time not measured" in text
    assert "cpu->gpu 100.0 MB in 0.100 s" in text
    assert "disk: 3,200 tokens, saved " in text and "spent not measured (untimed copies)" in text
    assert "server: cpu->gpu 100.0 MB in time not measured" in text
    assert "failed transfers not measured" in text and "failed transfers 0" in text


def _unsized_capture(directory, legs, tokens=None) -> CaptureWriter:
    """A capture (left open) of 100 requests of 64 prompt tokens (``tokens`` by source:
    default cpu 32, recompute 32), 3.2 ms of prefill each, each request making ``legs``,
    (blocks, bytes, seconds) cpu->gpu copies."""
    writer = CaptureWriter(directory)
    for i in range(100):
        writer.add_request(RequestRecord(
            f"r{i}", f"{i + 1:032x}", "engine", 1000.0 + i, prompt_tokens=64,
            tokens=tokens or {"cpu": 32, "recompute": 32}, ttft=0.01 + i * 1e-4,
            prefill=0.0032, finished=1000.0 + i + 0.02,
            transfers=[TransferRecord("cpu", "gpu", blocks, nbytes, 1000.0 + i, seconds)
                       for blocks, nbytes, seconds in legs]))
    return writer


def test_copies_of_blocks_in_0_bytes_are_bytes_not_measured_never_zero(tmp_path):
    """A source that does not know a block's size sends its copies as bytes 0 beside the
    blocks they moved (kvscope.events.Transfer): not a measurement. 100 requests each copying
    4 blocks cpu->gpu in 0 bytes and 2 ms: 400 blocks in 0.2 s, bytes not measured (None in
    JSON; they read "0 B" and bytes_per_request 0.0). Beside a sized leg (2 blocks, 1 MB, 1
    ms) in each request, still not measured: 100 MB over 600 blocks would undercount.

    An arm of a sized run (write_capture: 100 requests, one 2-block 1 MB copy each, 100 MB)
    and the unsized one has the sized run's bytes: 100 MB over its own 100 requests, 1 MB a
    request (not 100 MB over 200 requests); blocks 200 + 400 = 600."""
    _unsized_capture(tmp_path / "unsized", [(4, 0, 0.002)]).close()
    _unsized_capture(tmp_path / "mixed", [(2, 1_000_000, 0.001), (4, 0, 0.002)]).close()
    unsized, mixed = (read_request_sample(tmp_path / n) for n in ("unsized", "mixed"))
    assert "cpu->gpu" not in mixed.transfer_bytes and mixed.transfer_blocks["cpu->gpu"] == 600
    c = compare(unsized, mixed, resamples=100)
    out = to_dict(c)
    assert out["baseline"]["transfers"]["cpu->gpu"] == {
        "bytes": None, "blocks": 400, "seconds": pytest.approx(0.2), "bytes_per_request": None}
    assert out["candidate"]["transfers"]["cpu->gpu"]["bytes"] is None
    assert out["candidate"]["transfers"]["cpu->gpu"]["bytes_per_request"] is None
    text = render_text(c)
    assert f"{tmp_path / 'unsized'}: cpu->gpu 400 blocks (bytes not measured) in 0.200 s" \
        in text
    assert "0 B" not in text
    sized = read_request_sample(write_capture(tmp_path / "sized", np.full(100, 0.01),
                                              cpu_tokens=32))
    pooled = compare([sized, unsized], sized, resamples=100).baseline.transfers["cpu->gpu"]
    assert pooled["bytes"] == 100_000_000 and pooled["blocks"] == 600
    assert pooled["bytes_per_request"] == 1_000_000


def test_a_tier_that_served_tokens_without_recorded_copies_spent_not_measured(tmp_path):
    """100 requests of 64 prompt tokens, 32 from the cpu tier and 32 recomputed in 3.2 ms
    each: 3,200 tokens in 0.32 s, 10,000 tokens/s, so the cpu tier's 3,200 tokens saved
    0.32 s. No copy was recorded, though its tokens were copied to the GPU: what it spent is
    not measured (None; it read 0.0, "spent 0 ms", offload free), not 0."""
    _unsized_capture(tmp_path / "c", []).close()
    cand = read_request_sample(tmp_path / "c")
    base = read_request_sample(write_capture(tmp_path / "b", np.full(100, 0.01)))
    c = compare(base, cand, resamples=100)
    assert to_dict(c)["candidate"]["value"]["cpu"] == {
        "tokens": 3200, "prefill_seconds_saved": pytest.approx(0.32), "transfer_seconds": None}
    assert "cpu: 3,200 tokens, saved 320 ms, spent not measured (no copies recorded)" in \
        render_text(c)


def test_a_difference_that_rounds_to_zero_reads_zero_not_minus_zero():
    """A new user read a CI of ``[-1.53, -0.00]``: a bound of -0.4 us printed in milliseconds to
    two decimals. It reads 0.00; a bound that rounds to -0.01 stays negative."""
    from kvscope.analysis.bootstrap import Estimate
    from kvscope.analysis.compare import _cell

    assert _cell(Estimate(-0.0008, -0.00153, -0.0000004)).split() == ["-0.80", "[-1.53,", "0.00]"]
    assert "[-0.01," in _cell(Estimate(0.0, -0.00001, 0.0))


def test_a_combined_verdict_names_each_metrics_decision():
    """TTFT: 400 requests per arm, identical, all under a 100 ms budget -> keep. ITL: 20
    requests per arm reported one, with a 50 ms ITL budget -> too few (100 needed) ->
    inconclusive. Combined: inconclusive, and the text says which metric decided what (it
    once read "inconclusive: ... keep: ...", two verdicts on one line)."""
    ttft = np.linspace(0.01, 0.05, 400)
    itl = np.full(20, 0.01)
    arms = [RequestSample(name, ttft, itl) for name in ("baseline", "candidate")]
    c = compare(*arms, ttft_budget=BUDGET, itl_budget=0.05, resamples=200)
    assert (c.by_metric["TTFT"].decision, c.by_metric["ITL"].decision) == (KEEP, INCONCLUSIVE)
    assert c.verdict.decision == INCONCLUSIVE
    assert c.verdict.text.startswith("inconclusive; ITL inconclusive, TTFT keep. ITL: too few")
    assert " TTFT: candidate p99 TTFT " in c.verdict.text
    assert "keep:" not in c.verdict.text and c.verdict.text.count("inconclusive") == 2
    # a roll back says what it means once, not again inside the list of decisions
    runs = [[RequestSample(f"{name}{i}", (ttft + shift) * (1 + i / 1e3), np.full(400, 0.01))
             for i in range(3)] for name, shift in (("base", 0.0), ("slow", 0.2))]
    c = compare(*runs, ttft_budget=BUDGET, resamples=200)
    assert c.verdict.text.startswith(f"{ROLL_BACK}; TTFT roll back, ITL keep. TTFT: "), \
        c.verdict.text
    assert c.verdict.text.count("disable the newest tier") == 1, c.verdict.text
    assert len(set(c.verdict.reasons)) == len(c.verdict.reasons), c.verdict.reasons


def test_a_run_whose_every_request_failed_counts_in_the_failed_requests_test_only():
    """A candidate run of 0 finished and 50 failed requests beside one of 200 finished (0
    failed): compare took it for an empty run and raised. Now latency reads the 200 (the
    candidate's p99 is that run's), the failed-requests test counts 50 of 250 against the
    baseline's 0 of 200 (Fisher's p ~ 1e-12), but runs as the unit its 2 runs (shares 0 and
    1) against the baseline's 1 (share 0) give p = 2/C(3, 2) = 2/3: inconclusive. A run
    with neither finished nor failed requests still raises."""
    rng = np.random.default_rng(0)
    lat = rng.lognormal(np.log(0.05), 0.3, 200)
    base = [RequestSample("b", lat, lat / 10, failed_requests=0)]
    cand = [RequestSample("c1", lat, lat / 10, failed_requests=0),
            RequestSample("c2", np.zeros(0), np.zeros(0), failed_requests=50)]
    c = compare(base, cand, resamples=400)
    assert c.candidate.requests == 200 and c.candidate.failed_requests == 50
    assert c.ttft[-1].candidate.value == pytest.approx(np.quantile(lat, 0.99), rel=0.05)
    failed = c.by_metric["failed requests"]
    assert "the candidate failed 50 of 250 requests" in failed.text
    assert failed.decision == INCONCLUSIVE and "permutation p = 0.667" in failed.reasons[-1]
    with pytest.raises(ValueError, match="no finished requests"):
        compare(base, [cand[0], RequestSample("c3", np.zeros(0), np.zeros(0),
                                              failed_requests=0)])
