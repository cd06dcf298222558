"""The rollout's verdict: each candidate against the baseline, per concurrency level and over
the whole ramp, beside the A/A pair (the baseline against its own second run), which measures
the noise floor.

The statistics are :func:`kvscope.analysis.compare.compare`'s: quantiles with two-stage
bootstrap intervals (runs, then requests within runs; Davison & Hinkley 1997, section 3.8) and
its rollback rule on p99 TTFT and ITL. Over the whole ramp a run is one repetition of it (each
level's requests of that repetition together), so every level weighs the same in every
resample and the repetitions carry the run-to-run variance.

The A/A gate: two runs of one configuration differ only by noise, so a regression the rule
finds must be larger than that. Per metric (TTFT, ITL), a ``roll back`` stands only when the low
end of the candidate's p99 difference interval is above the A/A pair's p99 difference (worse
than the noise floor, with confidence: with a few repetitions the bootstrap's intervals are
narrow, Davison & Hinkley 1997, section 3.8, so the measured floor backs them), and when the
runs themselves, each one measurement, are significantly slower (:func:`runs_test`, the
run-to-run variance pooled over the candidate, the baseline and its twin; one-sided at half of
1 - confidence, Bonferroni over the metrics judged: a rollback needs only one). Two
repetitions of identical arms on one vLLM server, relabelled every way (360 sessions from 10
recorded ones), came out ``roll back`` 13 times without the runs test and never with it.
Otherwise that metric is ``inconclusive``, and the metrics are combined as :func:`compare` does (roll back if
one says so, keep if all do). A ``keep`` is not gated: it says no regression beyond the noise
was found, and the reasons give the floor beside each effect. When the A/A pair itself comes
out ``roll back`` on a metric, the set-up is too noisy to judge that metric, whose ``roll
back`` becomes ``inconclusive``; the other metric still stands on its own floor (sub-millisecond
ITL jitter between two runs of one server must not hide a TTFT regression four times over).
Pure: request samples in, dataclasses out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from kvscope.analysis.compare import (INCONCLUSIVE, ROLL_BACK, Comparison, RequestSample,
                                      Verdict, combine, compare, measured_sources, ms,
                                      promotion_waits, transfer_failures)
from kvscope.rollout.plan import Step, aa_slot


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
    """Several runs' requests as one run (latencies concatenated, counts added up)."""
    def added(key: str) -> dict:
        out: dict = {}
        for s in samples:
            for k, v in getattr(s, key).items():
                out[k] = out.get(k, 0) + v
        return out

    def joined(key: str) -> np.ndarray:
        parts = [np.asarray(getattr(s, key), dtype=np.float64) for s in samples]
        return np.concatenate(parts) if parts else np.zeros(0)

    return RequestSample(
        name, joined("ttft"), joined("itl"), joined("promotion_wait"), added("tokens"),
        added("transfer_bytes"), added("transfer_blocks"), added("transfer_seconds"),
        transfer_failures(samples), sum(s.prefill_seconds for s in samples),
        promotion_waits(samples), measured_sources(samples))


def _by_rep(results: Sequence[tuple[Step, RequestSample]], slot: str, level: int | None
            ) -> dict[int, RequestSample]:
    """``slot``'s runs at ``level`` (None: each repetition's levels pooled), by repetition
    (0-based, ascending)."""
    by_rep: dict[int, list[RequestSample]] = {}
    for step, sample in results:
        if step.slot == slot and (level is None or step.level == level) and sample.requests:
            by_rep.setdefault(step.rep, []).append(sample)
    return {r: pooled(by_rep[r], f"{slot} rep {r + 1}" + ("" if level is None else f" x{level}"))
            for r in sorted(by_rep)}


def _runs(results: Sequence[tuple[Step, RequestSample]], slot: str, level: int | None
          ) -> list[RequestSample]:
    """:func:`_by_rep`'s runs in repetition order."""
    return list(_by_rep(results, slot, level).values())


def runs_test(reps: Sequence[dict[int, RequestSample]], metric: str) -> tuple[float, int]:
    """Runs as the unit: a one-sided two-sample t-test that the first slot's runs are slower
    than the second's in p99 ``metric`` ("ttft" or "itl"), on each run's log p99, the
    run-to-run variance pooled over every slot in ``reps`` (each :func:`_by_rep`'s; equal
    under identical arms). Returns (p-value, degrees of freedom); p is 1.0 when the variance
    cannot be estimated (a slot with one run, or fewer than two runs on either side of the
    test).

    Requests within one run share its host state, so a bootstrap over them, even in two
    stages, is narrow when there are few runs (Davison & Hinkley 1997, section 3.8); the runs
    are the independent replicates (Hurlbert 1984, "pseudoreplication")."""
    logs = [np.log([np.quantile(getattr(s, metric), 0.99) for s in slot.values()
                    if len(getattr(s, metric))]) for slot in reps]
    df = sum(len(x) - 1 for x in logs if len(x))
    cand, base = logs[0], logs[1]
    if len(cand) < 2 or len(base) < 2 or df < 1:
        return 1.0, df
    pooled_var = sum(float(((x - x.mean()) ** 2).sum()) for x in logs if len(x)) / df
    se = np.sqrt(pooled_var * (1 / len(cand) + 1 / len(base)))
    diff = cand.mean() - base.mean()
    if se == 0:
        return (0.0 if diff > 0 else 1.0), df
    return float(stats.t.sf(diff / se, df)), df


def _gate(effect: Comparison, aa: Comparison, reps: Sequence[dict[int, RequestSample]]
          ) -> Verdict:
    """The A/A gate (see the module) on the verdict of ``effect``; ``reps``: the candidate's,
    the baseline's and its twin's runs, each :func:`_by_rep`'s."""
    gated: dict[str, Verdict] = {}
    why = []
    metrics = (("TTFT", effect.ttft, aa.ttft), ("ITL", effect.itl, aa.itl))
    # one-sided, and Bonferroni over the metrics judged: any one of them rolls back
    alpha = (1 - effect.confidence) / 2 / sum(1 for m in metrics if m[0] in effect.by_metric)
    for label, rows, aa_rows in metrics:
        v = effect.by_metric.get(label)
        if v is None:
            continue
        d, floor = rows[-1].difference, aa_rows[-1].difference
        if d is not None and floor is not None:
            p, df = runs_test(reps, label.lower())
            why.append(f"noise floor: the A/A pair's p99 {label} differs by {ms(floor.value)}, "
                       f"the candidate's by {ms(d.value)} ({effect.confidence * 100:g}% CI "
                       f"from {ms(d.low)}); runs as the unit, the candidate's runs are slower "
                       f"in p99 {label} with p = {p:.2g} (t-test, {df} degrees of freedom)")
            if v.decision == ROLL_BACK and not d.low > abs(floor.value):
                v = Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: the candidate's p99 {label} is "
                            f"worse by {ms(d.value)}, but not clear of the noise floor: the A/A "
                            f"pair differs by {ms(floor.value)} (the rule alone said roll "
                            "back).", v.reasons)
            elif v.decision == ROLL_BACK and not p < alpha:
                v = Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: the candidate's p99 {label} is "
                            f"worse by {ms(d.value)}, but its runs are not significantly slower "
                            f"than the baseline's, each run one measurement (p = {p:.2g}, not "
                            f"under {alpha:.2g}): run-to-run noise may be the difference (the "
                            "rule alone said roll back).", v.reasons)
        noisy = aa.by_metric.get(label)
        if noisy is not None and noisy.decision == ROLL_BACK:
            why.append(f"the A/A pair (the baseline against itself) came out 'roll back' on "
                       f"{label}: runs of one configuration differ significantly here")
            if v.decision == ROLL_BACK:
                v = Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: the A/A pair (the baseline "
                            f"against itself) differs significantly in p99 {label}, so {label} "
                            "is too noisy to judge here (the rule alone said roll back).",
                            v.reasons)
        gated[label] = v
    result = combine(gated) if gated else effect.verdict
    notes = [r for r in effect.verdict.reasons if r not in result.reasons]
    return Verdict(result.decision, result.text, result.reasons + notes + why)


def judge(results: Sequence[tuple[Step, RequestSample]], baseline: str, candidate: str, *,
          aa: bool = True, **options) -> Judgement:
    """Judge ``candidate`` against ``baseline`` from the runs ``results`` ((step, requests) of
    every run that finished). ``options``: :func:`~kvscope.analysis.compare.compare`'s
    (budgets, resamples, confidence, seed, min_requests). Raises ValueError when an arm has
    no finished request."""
    levels = sorted({s.level for s, _ in results})
    twin = aa_slot(baseline)

    def versus(a: str, b: str, level: int | None) -> Comparison | None:
        """``b`` against ``a`` at ``level``, or None when either has no finished run there."""
        runs_a, runs_b = _runs(results, a, level), _runs(results, b, level)
        return compare(runs_a, runs_b, **options) if runs_a and runs_b else None

    # the whole ramp first: compare raises, naming the arm, when one has no finished run
    overall = compare(_runs(results, baseline, None), _runs(results, candidate, None),
                      **options)
    per_level = {lv: c for lv in levels if (c := versus(baseline, candidate, lv))}
    floor = versus(baseline, twin, None) if aa else None
    aa_levels = {lv: c for lv in levels if floor and (c := versus(baseline, twin, lv))}
    verdict = overall.verdict if floor is None else _gate(
        overall, floor, [_by_rep(results, slot, None) for slot in (candidate, baseline, twin)])
    if aa and floor is None:
        verdict = dataclasses.replace(verdict, reasons=verdict.reasons + [
            "no A/A run finished: the noise floor is not measured"])
    return Judgement(candidate, per_level, overall, floor, aa_levels, verdict)
