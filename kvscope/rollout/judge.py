"""The rollout's verdict: each candidate against the baseline, per concurrency level and over
the whole ramp, beside the A/A pair (the baseline against its own second run), which measures
the noise floor.

The statistics are :func:`kvscope.analysis.compare.compare`'s: quantiles with two-stage
bootstrap intervals (runs, then requests within runs; Davison & Hinkley 1997, section 3.8) and
its rollback rule on p99 TTFT and ITL, whose runs test (a roll back needs the runs, each one
measurement, significantly slower) pools the A/A twin's run-to-run variance too. Over the
whole ramp a run is one repetition of it (each level's requests of that repetition together),
so every level weighs the same in every resample and the repetitions carry the run-to-run
variance. Two repetitions of identical arms on one vLLM server, the three slots relabelled
every way (648 sessions from 18 recorded), came out ``roll back`` 15 times without the runs
test and once with it (a session run beside a CPU-heavy job: p99 TTFT from 25 to 201 ms).

The A/A gate: two runs of one configuration differ only by noise, so a regression the rule
finds must be larger than that. Per metric (TTFT, ITL), a ``roll back`` stands only when the low
end of the candidate's p99 difference interval is above the A/A pair's p99 difference (worse
than the noise floor, with confidence: with a few repetitions the bootstrap's intervals are
narrow, Davison & Hinkley 1997, section 3.8, so the measured floor backs them); otherwise that
metric is ``inconclusive``, and the metrics are combined as :func:`compare` does (roll back if
one says so, keep if all do). A ``keep`` is not gated: it says no regression beyond the noise
was found, and the reasons give the floor beside each effect. When the A/A pair itself comes
out ``roll back`` on a metric, the set-up is too noisy to judge that metric, whose ``roll
back`` becomes ``inconclusive``; the other metric still stands on its own floor (sub-millisecond
ITL jitter between two runs of one server must not hide a TTFT regression four times over).
Significantly more failed requests (:func:`~kvscope.analysis.compare.failed_requests`, in
the requests and in the runs) is a ``roll back`` unless the A/A pair's own failures are
significant too.
Pure: request samples in, dataclasses out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvscope.analysis.compare import (FAILED, INCONCLUSIVE, KEEP, ROLL_BACK, Comparison,
                                      RequestSample, Verdict, combine, compare,
                                      failed_requests_of, failures_unmeasured,
                                      measured_sources, ms, promotion_waits, transfer_failures)
from kvscope.rollout.plan import Step, aa_slot, streams


@dataclass(frozen=True)
class Judgement:
    """One candidate against the baseline: ``levels`` (concurrency -> :class:`Comparison`),
    ``overall`` (the whole ramp), ``aa`` (the baseline's A/A pair over the whole ramp, or None
    without one), ``aa_levels`` (per level) and the final ``verdict`` (the overall one after
    the A/A gate)."""

    candidate: str
    levels: dict[int, Comparison]
    overall: Comparison
    aa: Comparison | None
    aa_levels: dict[int, Comparison]
    verdict: Verdict


def pooled(samples: Sequence[RequestSample], name: str) -> RequestSample:
    """Several runs' requests as one run (latencies concatenated, counts added up, the
    windows spanned)."""
    def added(key: str) -> dict:
        out: dict = {}
        for s in samples:
            for k, v in getattr(s, key).items():
                out[k] = out.get(k, 0) + v
        return out

    def joined(key: str) -> np.ndarray:
        parts = [np.asarray(getattr(s, key), dtype=np.float64) for s in samples]
        return np.concatenate(parts) if parts else np.zeros(0)

    windows = [s.window for s in samples]
    window = None if not windows or None in windows else \
        (min(w[0] for w in windows), max(w[1] for w in windows))
    return RequestSample(
        name, joined("ttft"), joined("itl"), joined("promotion_wait"), added("tokens"),
        added("transfer_bytes"), added("transfer_blocks"), added("transfer_seconds"),
        transfer_failures(samples), sum(s.prefill_seconds for s in samples),
        promotion_waits(samples), measured_sources(samples), window,
        any(s.transfers_measured for s in samples),
        bool(samples) and all(s.prefill_modelled for s in samples),
        bool(samples) and all(s.itl_modelled for s in samples),
        failures_unmeasured=failures_unmeasured(samples),
        failed_requests=failed_requests_of(samples))


def _runs(results: Sequence[tuple[Step, RequestSample]], slot: str, level: int | None
          ) -> list[RequestSample]:
    """``slot``'s runs at ``level`` (None: each repetition's levels pooled), by repetition."""
    by_rep: dict[int, list[RequestSample]] = {}
    for step, sample in results:
        # a run whose requests all failed still counts its failures (compare leaves it out of
        # the latencies); one with neither finished nor failed requests measured nothing
        if step.slot == slot and (level is None or step.level == level) and (
                sample.requests or sample.failed_requests):
            by_rep.setdefault(step.rep, []).append(sample)
    return [pooled(by_rep[r], f"{slot} rep {r + 1}" + ("" if level is None else f" x{level}"))
            for r in sorted(by_rep)]


def _gate(effect: Comparison, aa: Comparison) -> Verdict:
    """The A/A gate (see the module) on the verdict of ``effect``."""
    gated, why = _gated(effect, aa)
    result = combine(gated) if gated else effect.verdict
    notes = [r for r in effect.verdict.reasons if r not in result.reasons]
    return Verdict(result.decision, result.text, result.reasons + notes + why)


def _gated(effect: Comparison, aa: Comparison) -> tuple[dict[str, Verdict], list[str]]:
    """``effect``'s per-metric verdicts after the A/A gate, and the gate's reasons."""
    gated = dict(effect.by_metric)
    why = []
    for label, rows, aa_rows in (("TTFT", effect.ttft, aa.ttft), ("ITL", effect.itl, aa.itl)):
        v = effect.by_metric.get(label)
        if v is None:
            continue
        d, floor = rows[-1].difference, aa_rows[-1].difference
        if d is not None and floor is not None:
            why.append(f"noise floor: the A/A pair's p99 {label} differs by {ms(floor.value)}, "
                       f"the candidate's by {ms(d.value)} ({effect.confidence * 100:g}% CI "
                       f"from {ms(d.low)})")
            if v.decision == ROLL_BACK and not d.low > abs(floor.value):
                v = Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: the candidate's p99 {label} is "
                            f"worse by {ms(d.value)}, but not clear of the noise floor: the A/A "
                            f"pair differs by {ms(floor.value)} (the rule alone said roll "
                            "back).", v.reasons)
        noisy = aa.by_metric.get(label)  # the A/A pair's own verdict on it
        if noisy is not None and noisy.decision == ROLL_BACK:
            why.append(f"the A/A pair (the baseline against itself) came out 'roll back' on "
                       f"{label}: runs of one configuration differ significantly here")
            if v.decision == ROLL_BACK:
                v = Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: the A/A pair (the baseline "
                            f"against itself) differs significantly in p99 {label}, so {label} "
                            "is too noisy to judge here (the rule alone said roll back).",
                            v.reasons)
        gated[label] = v
    failed, noisy = effect.by_metric.get(FAILED), aa.by_metric.get(FAILED)
    if noisy is not None and noisy.decision == ROLL_BACK:  # no latency floor speaks to it
        why.append("the A/A pair (the baseline against itself) came out 'roll back' on failed "
                   "requests: this set-up fails requests by itself")
        if failed is not None and failed.decision == ROLL_BACK:
            gated[FAILED] = Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: the A/A pair (the "
                                    "baseline against itself) fails significantly more requests "
                                    "too, so failures are too noisy to judge here (the rule "
                                    "alone said roll back).", failed.reasons)
    return gated, why


def judge(results: Sequence[tuple[Step, RequestSample]], baseline: str, candidate: str, *,
          aa: bool = True, **options) -> Judgement:
    """Judge ``candidate`` against ``baseline`` from the runs ``results`` ((step, requests) of
    every run that finished). ``options``: :func:`~kvscope.analysis.compare.compare`'s
    (budgets, resamples, confidence, seed, min_requests). Raises ValueError when an arm has
    neither a finished nor a failed request."""
    levels = sorted({s.level for s, _ in results})
    twin = aa_slot(baseline)

    def versus(a: str, b: str, level: int | None, noise: Sequence[str] = (),
               by_runs: bool = True) -> Comparison | None:
        """``b`` against ``a`` at ``level``, or None when either has no run there (none with a
        finished or failed request);
        ``noise``: slots of ``a``'s configuration whose run-to-run variance the runs test
        pools; ``by_runs``: :func:`compare`'s."""
        runs_a, runs_b = _runs(results, a, level), _runs(results, b, level)
        return compare(runs_a, runs_b, noise=[_runs(results, n, level) for n in noise],
                       by_runs=by_runs, **options) if runs_a and runs_b else None

    twins = [twin] if aa else []
    # the whole ramp first: compare raises, naming the arm, when one has no run
    overall = compare(_runs(results, baseline, None), _runs(results, candidate, None),
                      noise=[_runs(results, t, None) for t in twins], **options)
    per_level = {lv: c for lv in levels if (c := versus(baseline, candidate, lv, twins))}
    # the A/A pair by the bootstrap alone: its "roll back" says the set-up is noisy
    floor = versus(baseline, twin, None, by_runs=False) if aa else None
    aa_levels = {lv: c for lv in levels
                 if floor and (c := versus(baseline, twin, lv, by_runs=False))}
    verdict = overall.verdict if floor is None else _gate(overall, floor)
    if aa and floor is None:
        verdict = dataclasses.replace(verdict, reasons=verdict.reasons + [
            "no A/A run finished: the noise floor is not measured"])
    return Judgement(candidate, per_level, overall, floor, aa_levels,
                     _levels_rolled_back(verdict, per_level, aa_levels))


def _levels_rolled_back(verdict: Verdict, levels: dict[int, Comparison],
                        aa_levels: dict[int, Comparison]) -> Verdict:
    """``verdict`` (the whole ramp's), ``inconclusive`` where it keeps but a level's own
    verdict, after that level's A/A gate, is roll back: the ramp's p99 rests on its busiest
    levels, so a candidate 3 times slower at 1 stream and faster at 16 read "keep". Not a
    roll back: each level is one more test, and identical arms must not roll back more often
    for it."""
    slower = []
    for lv, c in sorted(levels.items()):
        # each metric's verdict after the level's A/A gate (not one it cleared): the level's
        # own verdict (their combination) is roll back when one of them is
        by = c.by_metric if lv not in aa_levels else _gated(c, aa_levels[lv])[0]
        if on := [m for m, v in by.items() if v.decision == ROLL_BACK]:
            slower.append(f"{streams(lv)} (on {', '.join(on)})")
    if not slower:
        return verdict
    said = f"a level's own verdict is roll back: at {', at '.join(slower)}"
    if verdict.decision != KEEP:
        return dataclasses.replace(verdict, reasons=verdict.reasons + [said])
    return Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: the whole ramp keeps it, but {said}. The "
                   "ramp's p99 rests on its busiest levels: judge whether those levels' "
                   "latency matters to the service.", verdict.reasons + [said])
