"""Rollout comparison: a baseline run against a candidate run, and the rollback verdict.

Typical use: the baseline ran without the newest tier (say, no CPU offload), the candidate
with it. :func:`compare` takes the finished requests of each arm, one
:class:`RequestSample` per run (read from an agent capture by
:func:`kvscope.analysis.capture_reader.read_request_sample`), and reports:

- TTFT and ITL p50/p95/p99 of each arm and of the difference (candidate minus baseline), with
  percentile-bootstrap confidence intervals (:mod:`kvscope.analysis.bootstrap`; Efron &
  Tibshirani 1993); with several runs per arm, the two-stage bootstrap (runs, then requests
  within runs; Davison & Hinkley 1997, section 3.8), so that run-to-run variance widens them;
- hit quality: prompt tokens by source (``gpu``, ``cpu``, ``disk``, ``recompute``), or "not
  measured" for an arm whose records carry none;
- transfer cost: bytes, blocks and seconds per direction, failed transfers, and the promotion
  wait per request;
- a verdict against the rollback rule: **p99 TTFT or p99 ITL above its budget and
  significantly worse than the baseline, or significantly more failed requests -> roll back**
  (disable the newest tier; the latencies count only the requests that finished, so a
  candidate that fails its slowest ones would otherwise read faster: :func:`failed_requests`);
  a budget is absolute (seconds) or relative to the baseline's p99 (:class:`Budget`, e.g.
  ``+10%``). With one run per arm the run-to-run variance is not measured, and a candidate
  that looks worse is ``inconclusive``, never ``roll back``: two runs of one configuration
  differ by more than their requests' own spread suggests; with several, a ``roll back``
  also needs the runs themselves significantly slower (:func:`runs_test`). See
  :func:`verdict` for exactly how the intervals decide it.

Pure: samples in, dataclasses out. :func:`to_json` and :func:`render_text` render them.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvscope import events as ev
from kvscope.analysis.bootstrap import (DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, MAX_RESAMPLES,
                                        Estimate, compare_quantiles, interval, quantile_cis)
from kvscope.analysis.rates import prefill_rate
from kvscope.analysis.transfer_cost import farther_tier, seconds_by_tier
from kvscope.percentiles import histogram_quantile
from kvscope.vocabulary import OFFLOAD_TIERS

QUANTILES = (0.5, 0.95, 0.99)
# the offload tiers prompt tokens can come from: a run with none of them had no offload
OFFLOAD_SOURCES = frozenset(ev.TOKEN_SOURCES) & frozenset(OFFLOAD_TIERS)
KEEP = "keep"
ROLL_BACK = "roll back (disable the newest tier)"
INCONCLUSIVE = "inconclusive"
FAILED = "failed requests"  # the third metric's name in a verdict (:func:`failed_requests`)
DEFAULT_MIN_REQUESTS = 100  # a p99 needs about 100 requests before one lies beyond it
# resamples each end of a bootstrap interval must rest on at least (1 put a 95% interval's
# ends on no resample at all: a zero-width interval beside a confident verdict)
MIN_TAIL_RESAMPLES = 2


def least_resamples(confidence: float) -> int:
    """The fewest resamples that leave :data:`MIN_TAIL_RESAMPLES` beyond each end of a
    ``confidence`` interval."""
    return math.ceil(2 * MIN_TAIL_RESAMPLES / (1 - confidence) - 1e-9)


def check_resamples(resamples: int, confidence: float) -> None:
    """Raise ValueError, saying the least that would do, when ``resamples`` bootstrap
    resamples leave fewer than :data:`MIN_TAIL_RESAMPLES` beyond each end of a ``confidence``
    interval, or when no number of resamples allowed (:data:`MAX_RESAMPLES`) would."""
    least = least_resamples(confidence)
    if least > MAX_RESAMPLES:  # no --resamples would do: asking for one was a dead end
        top = 1 - 2 * MIN_TAIL_RESAMPLES / MAX_RESAMPLES
        raise ValueError(f"--confidence {confidence:g} needs {least:,} resamples, above the "
                         f"{MAX_RESAMPLES:,} allowed: give --confidence {top:g} or less")
    if resamples < least:
        raise ValueError(f"--resamples {resamples} is too few for a {confidence * 100:g}% "
                         f"interval: give at least {least} (default {DEFAULT_RESAMPLES})")


@dataclass(frozen=True, eq=False)
class RequestSample:
    """The finished requests of one run.

    ``ttft``: seconds, one per request with a known TTFT. ``itl``: seconds, the mean
    inter-token latency of each request that reported one (> 0). ``promotion_wait``: seconds
    per request. ``tokens``: dict[source, prompt tokens] (the requests', or counted over the
    run where they carry none: a rollout arm's counters, a zero-code capture's token totals).
    ``transfer_bytes``,
    ``transfer_blocks``: dict["src->dst", int]; ``transfer_seconds``: dict["src->dst", float]
    (successful transfers; a direction missing from it or from ``transfer_blocks`` was not
    measured); ``transfer_failures``: failed transfers (None: not measured);
    ``failures_unmeasured``: the directions ("src->dst") that moved blocks though no source
    could see their copies fail (KV events, byte counters): ``transfer_failures`` counts the
    others only. ``failed_requests``: requests of the run that failed or were cut off, so
    have no TTFT here (None: not counted, e.g. a capture, whose records are the finished
    requests). ``prefill_seconds``:
    the requests' prefill time in all (0: not reported); ``prefill_modelled``: every request
    prefilled at one exact rate, an engine's cost model's (the reference engine's), not a
    measurement; ``itl_modelled``: every request's ITL is one value, likewise (the reference
    engine prices decode). ``promotion_waits``: the waits as a
    histogram where they were not recorded one by one (a rollout arm's agent: ``{"bounds",
    "counts", "sum"}`` as :class:`kvscope.rollout.arms.Cost` has it), else None.
    ``token_sources``: the sources ``tokens`` measured, a missing one counting 0 (None: every
    source, as a capture's records drop sources that served nothing); the others are not
    measured (a rollout arm read from vLLM's metrics: gpu and recompute) or off, as
    ``tiers_off`` says. ``tiers_off``: offload tiers the run did not have (its agent reported
    its tiers, not these, and nothing was copied into or out of them: no disk tier, or
    --cpu-blocks 0), neither measured nor 0. ``window``: (first arrival, last finish) of its
    requests, Unix seconds (None: not known). ``transfers_measured``: False where nothing
    counted transfers (a rollout arm read without an agent or an engine's transfer metrics, a
    capture of spans alone): its empty transfer dicts are then not measured, not none.
    ``name``: for reports.
    """

    name: str
    ttft: np.ndarray
    itl: np.ndarray = field(default_factory=lambda: np.zeros(0))
    promotion_wait: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tokens: dict[str, int] = field(default_factory=dict)
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    transfer_blocks: dict[str, int] = field(default_factory=dict)
    transfer_seconds: dict[str, float] = field(default_factory=dict)
    transfer_failures: int | None = 0
    prefill_seconds: float = 0.0
    promotion_waits: dict | None = None
    token_sources: tuple[str, ...] | None = None
    window: tuple[float, float] | None = None
    transfers_measured: bool = True
    prefill_modelled: bool = False
    itl_modelled: bool = False
    tiers_off: tuple[str, ...] = ()
    failures_unmeasured: tuple[str, ...] = ()
    failed_requests: int | None = None

    @property
    def requests(self) -> int:
        return len(self.ttft)


@dataclass(frozen=True)
class QuantileRow:
    """One quantile (0-1) of a latency: baseline, candidate and candidate minus baseline, in
    seconds with intervals (None when a side has no observations)."""

    quantile: float
    baseline: Estimate | None
    candidate: Estimate | None
    difference: Estimate | None


@dataclass(frozen=True)
class Side:
    """Hit quality and transfer cost of one arm (its runs added up). ``runs``: how many.
    ``tokens``, ``token_share``: dict[source, prompt tokens] and dict[source, 0-1] of the
    sources every run measured (the others not measured, or off: ``tiers_off``); both None
    when the records carry no tokens by source (not measured, e.g. a GPU-only vLLM seen
    through spans alone);
    ``promotion_wait_mean``, ``promotion_wait_p99``: seconds per request (None: not
    measured, e.g. a rollout arm without an agent); ``transfers``:
    dict["src->dst", {"bytes", "blocks", "seconds", "bytes_per_request"}] (each None when no
    run measured it: untimed copies, or bytes of a source that did not know a block's size,
    whose bytes 0 beside blocks moved are no measurement (:class:`kvscope.events.Transfer`);
    ``bytes_per_request`` over the requests of the runs that measured the bytes), None when no
    run counted transfers (:attr:`RequestSample.transfers_measured`); ``transfer_failures``:
    None when no run counted them; ``failures_unmeasured``: the directions some run moved
    blocks in without counting their failures (:attr:`RequestSample.failures_unmeasured`).
    ``failed_requests``: the runs' added up, None when a run did not count them.
    ``prefill_rate``:
    tokens/s the engine prefilled (recomputed tokens over prefill seconds), None when not
    measured; ``prefill_modelled``: that rate is its engine's cost model (every run's
    :attr:`RequestSample.prefill_modelled`), not measured; ``itl_modelled``: so is every
    run's ITL (:attr:`RequestSample.itl_modelled`); ``tiers_off``: offload tiers no run had
    (:attr:`RequestSample.tiers_off`), left out of the shares like those not measured.
    ``value``: what each offload tier bought and cost, dict[tier, {"tokens": prompt tokens it
    served, "prefill_seconds_saved": those tokens at the prefill rate (None: not measured),
    "transfer_seconds": the seconds of its copies both ways
    (:func:`~kvscope.analysis.transfer_cost.seconds_by_tier`: promotions of its blocks,
    offloads into it; None: none of them timed, or none recorded though it served tokens)}],
    None when no tokens by source were measured (what a tier bought is then unknown); a GPU
    prefix hit is not offload's doing."""

    name: str
    requests: int
    runs: int
    tokens: dict[str, int] | None
    token_share: dict[str, float] | None
    transfers: dict[str, dict[str, float | None]] | None
    transfer_failures: int | None
    promotion_wait_mean: float | None
    promotion_wait_p99: float | None
    prefill_rate: float | None = None
    value: dict[str, dict[str, float | None]] | None = field(default_factory=dict)
    prefill_modelled: bool = False
    itl_modelled: bool = False
    tiers_off: tuple[str, ...] = ()
    failures_unmeasured: tuple[str, ...] = ()
    failed_requests: int | None = None


@dataclass(frozen=True)
class Verdict:
    """``decision``: :data:`KEEP`, :data:`ROLL_BACK` or :data:`INCONCLUSIVE`; ``text``: the
    plain sentence; ``reasons``: the facts behind it."""

    decision: str
    text: str
    reasons: list[str]


@dataclass(frozen=True)
class Budget:
    """A p99 latency budget: ``seconds`` (absolute), or ``relative`` to the baseline's p99
    (0.1: the baseline's p99 plus 10%). Exactly one is set; :func:`parse_budget` reads the
    command line's form."""

    seconds: float | None = None
    relative: float | None = None

    def resolve(self, baseline_p99: float) -> float:
        """The budget in seconds against a baseline p99 of ``baseline_p99`` seconds."""
        if self.seconds is not None:
            return self.seconds
        return baseline_p99 * (1.0 + self.relative)

    def describe(self, baseline_p99: float) -> str:
        text = f"budget {ms(self.resolve(baseline_p99))}"
        if self.relative is not None:
            text += f" (the baseline's p99 {ms(baseline_p99)} {self.relative * 100:+g}%)"
        return text


def parse_budget(text: str | float | Budget | None) -> Budget | None:
    """``"0.5"`` or ``0.5``: 0.5 seconds; ``"+10%"``: the baseline's p99 plus 10% (``"-5%"``:
    5% below it, a required improvement); a :class:`Budget` or None as they are. Raises
    ValueError for anything else, a budget under 1 us, a relative one of -100% or less,
    or a signed one without % (``"+10"``: a percentage was meant)."""
    if text is None or isinstance(text, Budget):
        return text
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        spec = text.strip()
        if spec.endswith("%"):
            try:
                relative = float(spec[:-1]) / 100.0
            except ValueError:
                relative = math.nan
            if not math.isfinite(relative) or relative <= -1.0:
                raise ValueError(f"budget {text!r}: a relative budget is a percentage above "
                                 "-100%, e.g. +10% (the baseline's p99 plus 10%)")
            return Budget(relative=relative)
        if spec.startswith("+"):  # a sign says "relative to the baseline": "+10" meant +10%?
            raise ValueError(f"budget {text!r}: a signed budget is relative and ends in %, "
                             f"e.g. {spec}% (the baseline's p99 plus {spec[1:]}%); seconds "
                             "take no sign (e.g. 0.5)")
        try:
            seconds = float(spec)
        except ValueError:
            raise ValueError(f"budget {text!r}: give seconds (e.g. 0.5) or a percentage of "
                             "the baseline's p99 (e.g. +10%)") from None
    # below a microsecond no latency is measured (a budget of 1e-300 s was printed with 300
    # zeros)
    if not math.isfinite(seconds) or seconds < 1e-6:
        raise ValueError(f"budget {text!r}: want a finite number of seconds, at least 0.000001 "
                         "(1 us)")
    return Budget(seconds=seconds)


@dataclass(frozen=True)
class RunsTest:
    """:func:`runs_test`'s result: the one-sided ``p`` that the candidate's runs are slower
    (None when not measured: fewer than two runs a side have the metric, a quantile is not a
    positive number of seconds, or no run differs from its arm's others, as copies of one run
    would not), on ``df`` degrees of freedom."""

    p: float | None
    df: int


@dataclass(frozen=True)
class Comparison:
    """Result of :func:`compare`; latencies in seconds. ``ttft_budget``, ``itl_budget``: the
    p99 budgets in seconds (relative ones resolved against the baseline), or None.
    ``verdict``: the combined one; ``by_metric``: each judged metric's own (``"TTFT"``,
    ``"ITL"``), which :func:`combine` made it from. ``runs``: each judged metric's
    :func:`runs_test` (absent when the comparison was by the bootstrap alone), and
    ``runs_alpha`` the one-sided p under which it lets a roll back stand (None: not applied)."""

    baseline: Side
    candidate: Side
    ttft: list[QuantileRow]
    itl: list[QuantileRow]
    ttft_budget: float | None
    itl_budget: float | None
    confidence: float
    resamples: int
    seed: int
    verdict: Verdict
    by_metric: dict[str, Verdict] = field(default_factory=dict)
    runs: dict[str, RunsTest] = field(default_factory=dict)
    runs_alpha: float | None = None


def _rows(b: list[np.ndarray], c: list[np.ndarray], resamples: int, confidence: float,
          seed: int) -> tuple[list[QuantileRow], np.ndarray | None]:
    """Quantile rows of two arms, each a list of runs' observations (runs without any left
    out), and the bootstrap replicates of their differences (resamples x quantiles; None
    where an arm has no observation)."""
    b, c = [x for x in b if len(x)], [x for x in c if len(x)]
    if not b or not c:  # e.g. no ITL reported on one side: no difference
        one = {}
        for key, runs in (("baseline", b), ("candidate", c)):
            one[key] = (quantile_cis(runs, QUANTILES, resamples=resamples, confidence=confidence,
                                     seed=seed) if runs else [None] * len(QUANTILES))
        return [QuantileRow(q, one["baseline"][i], one["candidate"][i], None)
                for i, q in enumerate(QUANTILES)], None
    two = compare_quantiles(b, c, QUANTILES, resamples=resamples, confidence=confidence,
                            seed=seed)
    return [QuantileRow(q, two.baseline[i], two.candidate[i], two.difference[i])
            for i, q in enumerate(QUANTILES)], two.replicates


def promotion_waits(samples: Sequence[RequestSample]) -> dict | None:
    """The ``promotion_waits`` histograms of ``samples`` added up (one bucket layout: the
    agent's); None when none has one."""
    hists = [s.promotion_waits for s in samples if s.promotion_waits]
    if not hists:
        return None
    counts = np.sum([h["counts"] for h in hists], axis=0)
    return {"bounds": hists[0]["bounds"], "counts": counts.tolist(),
            "sum": sum(h["sum"] for h in hists)}


def _wait_stats(runs: Sequence[RequestSample]) -> tuple[float | None, float | None]:
    """(mean, p99) seconds of the runs' promotion waits: of the recorded ones, else of their
    histograms (p99 as PromQL's histogram_quantile); (None, None) when there are neither."""
    wait = np.concatenate([np.asarray(r.promotion_wait, dtype=np.float64) for r in runs])
    if len(wait):
        return float(wait.mean()), float(np.quantile(wait, 0.99))
    hist = promotion_waits(runs)
    if hist is None:
        return None, None
    return (hist["sum"] / sum(hist["counts"]),
            histogram_quantile(0.99, hist["bounds"], hist["counts"]))


def transfer_failures(samples: Sequence[RequestSample]) -> int | None:
    """The failed transfers of ``samples`` added up; None when none of them counted any."""
    counted = [s.transfer_failures for s in samples if s.transfer_failures is not None]
    return sum(counted) if counted else None


def failed_requests_of(samples: Sequence[RequestSample]) -> int | None:
    """The failed requests of ``samples`` added up; None when one of them did not count its
    own (a share of failures over some runs' requests would be wrong)."""
    counted = [s.failed_requests for s in samples]
    return None if not counted or None in counted else sum(counted)


def failures_unmeasured(samples: Sequence[RequestSample]) -> tuple[str, ...]:
    """The directions in which some of ``samples`` moved blocks without counting their
    failures (:attr:`RequestSample.failures_unmeasured`), sorted."""
    return tuple(sorted({d for s in samples for d in s.failures_unmeasured}))


def measured_sources(samples: Sequence[RequestSample]) -> tuple[str, ...] | None:
    """The token sources every one of ``samples`` measured (None: every source)."""
    listed = [set(s.token_sources) for s in samples if s.token_sources is not None]
    if not listed:
        return None
    return tuple(src for src in ev.TOKEN_SOURCES if all(src in known for known in listed))


def _side(runs: list[RequestSample]) -> Side:
    sources = measured_sources(runs)
    sources = ev.TOKEN_SOURCES if sources is None else sources
    tokens = {src: sum(int(r.tokens.get(src, 0)) for r in runs) for src in sources}
    total = sum(tokens.values())
    share = {src: tokens[src] / total for src in sources} if total else None
    requests = sum(r.requests for r in runs)
    moved: dict[str, dict[str, float | None]] = {}
    sized: dict[str, int] = {}  # by direction, the requests of the runs that measured its bytes
    for r in runs:
        for d in set(r.transfer_bytes) | set(r.transfer_seconds) | set(r.transfer_blocks):
            t = moved.setdefault(d, {"bytes": None, "blocks": None, "seconds": None})
            nbytes = r.transfer_bytes.get(d)
            # 0 bytes of blocks moved: the source did not know a block's size (ev.Transfer)
            if nbytes is not None and (nbytes or not r.transfer_blocks.get(d)):
                t["bytes"] = (t["bytes"] or 0.0) + nbytes
                sized[d] = sized.get(d, 0) + r.requests
            for key, measured in (("blocks", r.transfer_blocks), ("seconds", r.transfer_seconds)):
                if d in measured:  # else not measured: None unless another run measured it
                    t[key] = (t[key] or 0) + measured[d]
    transfers = {d: {**moved[d], "bytes_per_request": None if moved[d]["bytes"] is None
                     else moved[d]["bytes"] / max(sized[d], 1)} for d in sorted(moved)}
    prefill = sum(r.prefill_seconds for r in runs)
    rate = prefill_rate(tokens.get("recompute", 0), prefill)
    measured = any(r.transfers_measured for r in runs)
    # each tier's copies as the dashboard charges them (a staged promotion to the tier the
    # blocks came from, an offload to the tier it stores into)
    charged = seconds_by_tier({d: t["seconds"] for d, t in transfers.items()
                               if t["seconds"] is not None},
                              {d: t["blocks"] or 0 for d, t in transfers.items()})
    value = {}
    for tier in ev.TIERS[1:]:  # the offload tiers: a GPU prefix hit is not offload's doing
        # its own copies, promotions out of it and offloads into it: none timed, or none
        # recorded though it served tokens (they were copied), not measured
        legs = [t["seconds"] for d, t in transfers.items() if farther_tier(d) == tier]
        timed = any(seconds is not None for seconds in legs)
        spent = charged.get(tier, 0.0) if measured and timed else None
        if tokens.get(tier) or legs:
            value[tier] = {"tokens": tokens.get(tier, 0), "transfer_seconds": spent,
                           "prefill_seconds_saved": tokens.get(tier, 0) / rate if rate else None}
    # every request has prompt tokens: none by any source is none measured
    return Side(", ".join(r.name for r in runs), requests, len(runs),
                tokens if total else None, share, transfers if measured else None,
                transfer_failures(runs), *_wait_stats(runs), rate,
                value if total else None,  # no tokens by source: what a tier bought, unknown
                rate is not None and all(r.prefill_modelled for r in runs),
                bool(runs) and all(r.itl_modelled for r in runs),
                tuple(t for t in ev.TOKEN_SOURCES if runs and all(t in r.tiers_off for r in runs)),
                failures_unmeasured(runs), failed_requests_of(runs))


def _ran_first(base: Sequence[RequestSample], cand: Sequence[RequestSample]) -> str | None:
    """"baseline" or "candidate" when every run of that arm finished before any run of the
    other started, else None (interleaved, or a run's window not known)."""
    windows = [[s.window for s in arm] for arm in (base, cand)]
    if any(w is None for arm in windows for w in arm):
        return None
    (b, c) = windows
    if max(e for _, e in b) <= min(s for s, _ in c):
        return "baseline"
    if max(e for _, e in c) <= min(s for s, _ in b):
        return "candidate"
    return None


def ms(x: float) -> str:
    """Seconds as milliseconds to 3 significant digits, never in scientific notation: waits
    and differences run from microseconds to seconds."""
    return f"{np.format_float_positional(x * 1e3, precision=3, fractional=False, trim='-')} ms"


def _bytes(n: float) -> str:
    """``n`` bytes in SI units, from B to TB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def runs_test(baseline: Sequence[np.ndarray], candidate: Sequence[np.ndarray],
              noise: Sequence[Sequence[np.ndarray]] = (), q: float = 0.99) -> RunsTest:
    """Runs as the unit: a one-sided two-sample t-test that the ``candidate``'s runs are slower
    than the ``baseline``'s in their ``q`` quantile, on each run's log quantile (each arm a
    list of runs' latencies in seconds; runs without any left out), the run-to-run variance
    pooled over both arms and the ``noise`` arms (more runs of the baseline's configuration,
    such as the rollout's A/A twin).

    Requests within one run share its host's state, so a bootstrap over them, even in two
    stages, is narrow when the runs are few (Davison & Hinkley 1997, section 3.8, bias
    (a - 1)/a with a runs); the runs are the independent replicates (Hurlbert 1984,
    "pseudoreplication")."""
    quantiles = [[float(np.quantile(x, q)) for x in arm if len(x)]
                 for arm in (candidate, baseline, *noise)]
    df = sum(len(x) - 1 for x in quantiles if x)
    if min(len(quantiles[0]), len(quantiles[1])) < 2 or \
            not all(v > 0 and math.isfinite(v) for x in quantiles for v in x):
        return RunsTest(None, df)
    logs = [np.log(x) for x in quantiles if x]
    variance = sum(float(((x - x.mean()) ** 2).sum()) for x in logs) / df
    cand, base = logs[0], logs[1]
    se = math.sqrt(variance * (1 / len(cand) + 1 / len(base)))
    if se == 0:  # a copy of a run is no second run: no run-to-run variance was measured
        return RunsTest(None, df)
    from scipy import stats  # here only: every kvscope command imports this module

    return RunsTest(float(stats.t.sf(float(cand.mean() - base.mean()) / se, df)), df)


def runs_alpha(confidence: float) -> float:
    """The one-sided p under which :func:`runs_test` lets a roll back stand: ``1 -
    confidence`` halved for one side, halved again by Bonferroni over TTFT and ITL (either
    one rolls back)."""
    return round((1 - confidence) / 4, 12)  # 0.0125, not 0.012500000000000011


def verdict(p99: QuantileRow, budget: float | Budget | None, confidence: float,
            baseline_requests: int, candidate_requests: int,
            min_requests: int = DEFAULT_MIN_REQUESTS, *, baseline_runs: int = 1,
            candidate_runs: int = 1, runs: RunsTest | None = None,
            metric: str = "TTFT") -> Verdict:
    """Apply the rollback rule to a p99 row (seconds) of ``metric`` (TTFT or ITL; the
    requests are those that reported it). ``budget``: seconds, or a :class:`Budget` (a
    relative one is resolved against the baseline's p99 estimate).

    With a ``budget`` B (seconds), candidate p99 estimate c with interval [lo, hi], and the
    interval [dlo, dhi] of candidate minus baseline (worse: dlo > 0; better: dhi < 0):

    1. fewer than ``min_requests`` requests on either side -> inconclusive;
    2. c > B and better (disabling the tier would raise p99 further) -> keep;
    3. hi <= B (within the budget with confidence) -> keep;
    4. c > B and worse -> roll back; c <= B and better -> keep;
    5. c > B but not worse than the baseline -> inconclusive (the newest tier is not shown to
       be the cause: both arms are over the budget); else (the interval contains B)
       inconclusive.

    Without a budget only the baseline decides: worse -> roll back, otherwise keep.

    A roll back needs the run-to-run variance measured: with fewer than two runs on either
    side (``baseline_runs``, ``candidate_runs``) it is inconclusive instead, as two runs of one
    configuration differ by more than one run's requests suggest (identical arms must never
    come out roll back). Given ``runs`` (:func:`runs_test`'s, None: the bootstrap alone), it
    also needs the runs, each one measurement, significantly slower: ``runs.p`` under
    ``(1 - confidence) / 4``, one-sided and Bonferroni over the rule's two metrics (either one
    rolls back); not measured, it is inconclusive.
    """
    pct = f"{confidence * 100:g}%"
    reasons = [f"baseline {baseline_requests} requests in {baseline_runs} run"
               f"{'s' * (baseline_runs != 1)}, candidate {candidate_requests} requests in "
               f"{candidate_runs} run{'s' * (candidate_runs != 1)}"]
    if min(baseline_requests, candidate_requests) < min_requests:
        fewest = min(baseline_requests, candidate_requests)
        # none: every request of that side failed (the failed-requests test judges it)
        reasons.append(f"fewer than {min_requests} requests on a side: " + (
            f"a p99 of {fewest} rests on its slowest {max(1, fewest // 100)}" if fewest
            else "one finished none, and has no p99"))
        return Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: too few requests to judge p99 {metric} "
                       f"(need {min_requests} per arm).", reasons)
    c, d = p99.candidate, p99.difference
    cand = f"candidate p99 {metric} {ms(c.value)} ({pct} CI {ms(c.low)}-{ms(c.high)})"
    diff = f"{'+' if d.value >= 0 else ''}{ms(d.value)} vs baseline ({pct} CI " \
           f"{ms(d.low)} to {ms(d.high)})"
    reasons += [cand, diff]
    worse, better = d.low > 0, d.high < 0
    replicated = min(baseline_runs, candidate_runs) >= 2
    single = "per arm" if max(baseline_runs, candidate_runs) < 2 else \
        "of the baseline" if baseline_runs < 2 else "of the candidate"
    if not replicated:
        reasons.append(f"one run {single}: run-to-run variance not measured (give two or more "
                       "captures per arm, e.g. kvscope compare A1,A2,A3 B1,B2,B3)")

    def roll_back(why: str) -> Verdict:
        if not replicated:
            return Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: {why} But with one run {single} "
                           "the difference may be run-to-run noise: repeat each arm and "
                           "compare the runs.", reasons)
        if runs is None:
            return Verdict(ROLL_BACK, f"{ROLL_BACK}: {why}", reasons)
        if runs.p is None:
            reasons.append(f"runs as the unit: the run-to-run variance of p99 {metric} is not "
                           "measured (fewer than two runs a side report it, or the runs are "
                           "alike to the last digit, as copies of one run are)")
            return Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: {why} But the run-to-run variance "
                           "is not measured: the difference may be run-to-run noise.", reasons)
        alpha = runs_alpha(confidence)
        reasons.append(f"runs as the unit: one-sided p = {runs.p:.3g} that the candidate's "
                       f"runs are slower in p99 {metric} (a t-test on each run's log p99, "
                       f"{runs.df} degrees of freedom; a roll back needs under {alpha:.3g})")
        if runs.p < alpha:
            return Verdict(ROLL_BACK, f"{ROLL_BACK}: {why}", reasons)
        return Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: {why} But the runs, each one "
                       f"measurement, are not significantly slower (one-sided p = "
                       f"{runs.p:.3g}): the difference may be run-to-run noise; more "
                       "repetitions would tell.", reasons)

    base = ms(p99.baseline.value)
    budget = parse_budget(budget)
    if budget is None:
        reasons.append(f"no {metric} budget given: judged against the baseline only")
        if worse:
            return roll_back(f"{cand} is significantly above the baseline's {base}.")
        return Verdict(KEEP, f"{KEEP}: {cand} shows no significant p99 regression against the "
                       f"baseline's {base}.", reasons)
    reasons.append(budget.describe(p99.baseline.value))
    budget = budget.resolve(p99.baseline.value)
    b = ms(budget)
    if c.value > budget and better:
        return Verdict(KEEP, f"{KEEP}: {cand} is over the {b} budget, but significantly "
                       f"below the baseline's {base}: disabling the tier would raise p99 "
                       "further; the budget needs more than a rollback.", reasons)
    if c.high <= budget:
        return Verdict(KEEP, f"{KEEP}: {cand} is within the {b} budget.", reasons)
    if c.value > budget and worse:
        return roll_back(f"{cand} is over the {b} budget and significantly worse than the "
                         f"baseline's {base}.")
    if c.value <= budget and better:
        return Verdict(KEEP, f"{KEEP}: {cand} is within the {b} budget by its estimate and "
                       "significantly better than the baseline.", reasons)
    if c.value > budget:
        return Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: {cand} is over the {b} budget, but not "
                       f"significantly worse than the baseline's {base}: the newest tier is "
                       "not shown to be the cause.", reasons)
    return Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: {cand} straddles the {b} budget; collect "
                   "more requests.", reasons)


def failed_requests(baseline: Sequence[RequestSample], candidate: Sequence[RequestSample],
                    confidence: float, noise: Sequence[Sequence[RequestSample]] = (),
                    seed: int = 0) -> Verdict | None:
    """Roll back when the ``candidate`` (its runs) failed a significantly larger share of its
    requests (finished plus failed) than the ``baseline``: Fisher's exact test, one-sided, on
    the requests, and the runs as the unit too, at :func:`runs_alpha` each (also for the
    rollout's A/A pair, judged by the bootstrap alone on latency: by Fisher's test alone, its
    pair came out roll back in 23% of sessions whose runs stall alike, each gating a real
    candidate's rise to inconclusive; its twin's failures weigh in the candidate's runs test
    instead, as ``noise``).
    Failures come in bursts: one stall cuts off every request in flight (8 of 360 against
    none: Fisher's p = 0.004), so requests are no independent draws; with stalls in 3 of 10
    runs of either arm alike, Fisher alone rolled identical arms back in 12% of comparisons.
    The runs test (:func:`runs_permutation`) compares each run's share of failed requests,
    the candidate's against the baseline's and the ``noise`` arms' (runs of the baseline's
    configuration); it cannot go below 1 / C(n, k) (k candidate runs of n), so 3 runs against
    3 can only say ``inconclusive`` (1/20), 3 against 6 (the rollout's baseline and A/A twin)
    can roll back (1/84). None when either arm did not count them, or neither failed any.
    The latency rule reads finished requests only, so without this a candidate that fails its
    slowest requests reads faster (a review planted 5% failed requests, the slowest, into
    identical arms: "keep", p99 TTFT 67 ms better). A third test beside TTFT's and ITL's at
    the same level: identical arms roll back in at most 3.75% of comparisons."""
    b, c = failed_requests_of(baseline), failed_requests_of(candidate)
    if b is None or c is None or not (b or c):
        return None
    from scipy import stats  # here only: every kvscope command imports this module

    finished = (sum(s.requests for s in candidate), sum(s.requests for s in baseline))
    table = [[c, finished[0]], [b, finished[1]]]
    p = float(stats.fisher_exact(table, alternative="greater").pvalue)
    shares = (f"the candidate failed {c} of {c + finished[0]} requests "
              f"({c / (c + finished[0]):.1%}), the baseline {b} of "
              f"{b + finished[1]} ({b / (b + finished[1]):.1%})")
    reasons = [f"failed requests: {shares}; one-sided Fisher's exact p = {p:.3g}"]
    alpha = runs_alpha(confidence)
    if p >= alpha:
        return Verdict(KEEP, f"{KEEP}: {shares}, not significantly more.", reasons)
    # runs of the baseline's configuration; a noise run that did not count its own says
    # nothing of them
    pool = [*baseline, *(s for arm in noise for s in arm if s.failed_requests is not None)]
    ours, theirs = _failed_shares(candidate), _failed_shares(pool)
    runs_p, floor = runs_permutation(ours, theirs, seed)
    reasons.append(f"runs as the unit: one-sided permutation p = {runs_p:.3g} that the "
                   f"candidate's {len(ours)} runs fail a larger share than the "
                   f"{len(theirs)} of the baseline's configuration (the least p they can "
                   f"give: {floor:.3g}; a roll back needs under {alpha:.3g})")
    if runs_p >= alpha:
        return Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: {shares}, significantly more "
                       "requests, but not significantly more in its runs (one stall cuts "
                       "off every request in flight): a burst is not shown to be the "
                       "candidate's; run more repetitions.", reasons)
    return Verdict(ROLL_BACK, f"{ROLL_BACK}: {shares}, significantly more; its latencies "
                   "leave those requests out.", reasons)


def _failed_shares(runs: Sequence[RequestSample]) -> np.ndarray:
    """Each run's failed requests over its requests (finished plus failed); a run of none
    has no share and is left out."""
    return np.array([s.failed_requests / (s.failed_requests + s.requests) for s in runs
                     if s.failed_requests + s.requests], dtype=np.float64)


def runs_permutation(candidate: np.ndarray, baseline: np.ndarray, seed: int = 0,
                     draws: int = 20_000) -> tuple[float, float]:
    """One-sided permutation test that the ``candidate``'s values (one per run) are larger
    than the ``baseline``'s: ``(p, the least p possible)``, p being the share of the ways of
    splitting the runs into groups of their sizes whose candidate group sums to as much or
    more (exact: every split, up to ``draws`` of them; else ``draws`` random ones, seeded,
    p = (1 + as many or more) / (1 + draws); Phipson & Smyth 2010). Identical arms: p is
    uniform or above it, so they fall under a level alpha in at most alpha of comparisons."""
    k, values = len(candidate), np.concatenate((candidate, baseline))
    n = len(values)
    if not k or k == n:
        return 1.0, 1.0
    observed = float(candidate.sum()) - 1e-12 * max(1.0, float(np.abs(values).sum()))
    if math.comb(n, k) <= draws:
        splits = np.array(list(itertools.combinations(range(n), k)), dtype=np.intp)
        return float((values[splits].sum(axis=1) >= observed).mean()), 1 / len(splits)
    rng = np.random.default_rng(seed)
    sums = np.array([values[rng.permutation(n)[:k]].sum() for _ in range(draws)])
    return float((1 + (sums >= observed).sum()) / (1 + draws)), 1 / (1 + draws)


def combine(verdicts: dict[str, Verdict]) -> Verdict:
    """One verdict of several metrics' (``{"TTFT": ..., "ITL": ...}``): roll back when one
    says so, keep when all do, inconclusive otherwise. Its text names each metric's decision,
    then gives each metric's reason, the deciding ones first (a bare "inconclusive: ...
    keep: ..." read as two verdicts); its reasons are each metric's in turn, a shared one once."""
    decisions = [v.decision for v in verdicts.values()]
    decision = ROLL_BACK if ROLL_BACK in decisions else KEEP if set(decisions) == {KEEP} \
        else INCONCLUSIVE
    if len(verdicts) == 1:
        return next(iter(verdicts.values()))
    ordered = sorted(verdicts.items(), key=lambda item: item[1].decision != decision)
    # each metric's decision without roll back's "(disable the newest tier)": once is enough
    text = f"{decision}; " + ", ".join(f"{m} {v.decision.split(' (')[0]}" for m, v in ordered) \
        + ". " + " ".join(f"{m}: {v.text.removeprefix(f'{v.decision}: ')}" for m, v in ordered)
    # each metric's reasons in turn, a line they share (the arms' sizes) once
    return Verdict(decision, text,
                   list(dict.fromkeys(r for v in verdicts.values() for r in v.reasons)))


def _slower_elsewhere(metrics, confidence: float, min_requests: int) -> list[str]:
    """Notes for the quantiles the rule does not judge (p50, p95) where the candidate is
    significantly slower: the rule reads p99 alone, and a keep beside a slower median should
    not pass unremarked. ``metrics``: (label, quantile rows, difference replicates or None,
    (baseline, candidate) requests that reported it). They are several tests at once, so each
    is made at the Bonferroni level, ``confidence`` for all of them together (each at
    ``confidence``, identical arms drew a note in about 1 comparison in 30). A metric with
    fewer than ``min_requests`` on an arm is not tested, as its p99 is not judged (1 request
    against 1 read "significantly worse, CI 5 ms to 5 ms"; A/A pairs of 2 requests drew a
    note in 18 of 100); nor is any quantile when the resamples leave fewer than
    :data:`MIN_TAIL_RESAMPLES` beyond each end of the Bonferroni level's interval: one that
    would have read worse is named, with the resamples a test needs."""
    few = [label for label, _, replicates, counts in metrics
           if replicates is not None and min(counts) < min_requests]
    unjudged = " and ".join(f"p{q * 100:g}" for q in QUANTILES if q != 0.99)
    notes = [f"{label} {unjudged} not tested either: fewer than {min_requests} requests on a "
             "side" for label in few]
    tested = [(label, r, replicates[:, i]) for label, rows, replicates, counts in metrics
              if replicates is not None and label not in few
              for i, r in enumerate(rows) if r.quantile != 0.99]
    if not tested:
        return notes
    level = 1.0 - (1.0 - confidence) / len(tested)
    least, pct = least_resamples(level), f"{level * 100:.4g}%"
    untested = []
    for label, r, replicates in tested:
        low, high = (float(x[0]) for x in interval(replicates[:, None], level))
        if low <= 0:
            continue
        name = f"{label} p{r.quantile * 100:g}"
        if len(replicates) < least:  # its interval's ends rest on too few resamples
            untested.append(name)
            continue
        sign = "+" if r.difference.value >= 0 else ""
        notes.append(f"{name} is significantly worse than the baseline's ({sign}"
                     f"{ms(r.difference.value)}, {pct} CI {ms(low)} to {ms(high)}: "
                     f"{len(tested)} quantiles tested at once); the rule judges p99 only")
    if untested:
        notes.append(f"{' and '.join(untested)} may be worse than the baseline's, not tested: "
                     f"{len(tested[0][2])} resamples leave too few beyond the ends of the "
                     f"{pct} CI that {len(tested)} quantiles tested at once need (give "
                     f"--resamples {least} or more)")
    return notes


def compare(baseline: RequestSample | Sequence[RequestSample],
            candidate: RequestSample | Sequence[RequestSample], *,
            ttft_budget: float | str | Budget | None = None,
            itl_budget: float | str | Budget | None = None,
            resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
            seed: int = 0, min_requests: int = DEFAULT_MIN_REQUESTS,
            noise: Sequence[Sequence[RequestSample]] = (), by_runs: bool = True
            ) -> Comparison:
    """Compare two arms (see the module docstring), each one run or a list of runs of one
    configuration. ``ttft_budget``, ``itl_budget``: seconds, or what :func:`parse_budget`
    reads (``"+10%"``). ``noise``: more arms of the baseline's configuration (the rollout's
    A/A twin), whose run-to-run variance :func:`runs_test` pools. ``by_runs``: False judges
    latency by the bootstrap alone, without the runs test (the rollout's A/A pair, whose "roll
    back" says its runs differ beyond their requests' spread); failed requests are judged by
    the runs either way (:func:`failed_requests`). ITL is judged when both arms
    measured it; where one did not (none reported, or every request's the same: an engine's
    cost model, :attr:`RequestSample.itl_modelled`), the verdict says so and judges TTFT alone
    (an ITL budget then makes it inconclusive).

    A run whose every request failed (none finished, ``failed_requests`` > 0) counts in the
    failed-requests test only; latency reads the runs that finished requests.

    Raises ValueError when an arm has no run, a run has neither a request with a TTFT nor a
    failed request, or for a bad option (resamples too few for the confidence:
    :func:`check_resamples`).
    """
    ttft_budget, itl_budget = parse_budget(ttft_budget), parse_budget(itl_budget)
    check_resamples(resamples, confidence)
    arms = [[x] if isinstance(x, RequestSample) else list(x) for x in (baseline, candidate)]
    for arm, label in zip(arms, ("baseline", "candidate")):
        if not arm:
            raise ValueError(f"no {label} run")
        for s in arm:
            if s.requests == 0 and not s.failed_requests:
                raise ValueError(f"{s.name or 'run'}: no finished requests with a TTFT")
    base, cand = arms
    # per metric, each arm's runs' latencies: the baseline's, the candidate's, the noise arms'
    latencies = {m: [[np.asarray(getattr(s, m), float) for s in arm]
                     for arm in (base, cand, *noise)] for m in ("ttft", "itl")}
    ttft, ttft_replicates = _rows(*latencies["ttft"][:2], resamples, confidence, seed)
    itl, itl_replicates = _rows(*latencies["itl"][:2], resamples, confidence, seed + 1)
    sides = _side(base), _side(cand)

    runs = {label: runs_test(*latencies[m][:2], latencies[m][2:])
            for label, m in (("TTFT", "ttft"), ("ITL", "itl"))} if by_runs else {}

    def tested(metric: str) -> dict:
        """``verdict``'s runs arguments for ``metric``: the runs that reported it, and the
        runs test."""
        b, c = latencies[metric.lower()][:2]
        return {"baseline_runs": sum(1 for x in b if len(x)),
                "candidate_runs": sum(1 for x in c if len(x)), "runs": runs.get(metric)}

    p99 = next(r for r in ttft if r.quantile == 0.99)
    judged = [verdict(p99, ttft_budget, confidence, sides[0].requests, sides[1].requests,
                      min_requests, **tested("TTFT"))]
    itl99 = next(r for r in itl if r.quantile == 0.99)
    itl_counts = sum(len(s.itl) for s in base), sum(len(s.itl) for s in cand)
    # a modelled ITL is no measurement: a demo's read "ITL keep", CI 0.995-0.995 ms
    # the arms without a measured ITL, by why (a demo against a capture whose requests
    # reported none read "the baseline and the candidate (the engine's cost model ...)")
    why = {"modelled": [], "none": []}
    for arm, n, side in zip(("baseline", "candidate"), itl_counts, sides):
        if side.itl_modelled or not n:
            why["modelled" if side.itl_modelled else "none"].append(arm)
    missing = " and the ".join(
        " and the ".join(arms) + (" (the engine's cost model: every request's ITL the same)"
                                  if kind == "modelled" else
                                  " (none reported)" if why["modelled"] else "")
        for kind, arms in why.items() if arms)
    measured = itl99.difference is not None and not missing
    notes = []
    if measured and (itl_budget is not None or min(itl_counts) >= min_requests):
        judged.append(verdict(itl99, itl_budget, confidence, *itl_counts, min_requests,
                              metric="ITL", **tested("ITL")))
    elif measured:  # no ITL budget asked for: too few is no verdict
        notes.append(f"ITL not judged: fewer than {min_requests} requests reported one on an "
                     "arm")
    if not measured and itl_budget is not None:
        judged.append(Verdict(INCONCLUSIVE, f"{INCONCLUSIVE}: an ITL budget was given, but "
                              f"ITL was not measured on the {missing}.",
                              [f"ITL not measured on the {missing}"]))
    notes += _slower_elsewhere(
        (("TTFT", ttft, ttft_replicates, (sides[0].requests, sides[1].requests)),)
        + ((("ITL", itl, itl_replicates, itl_counts),) if measured else ()),
        confidence, min_requests)
    if not measured:
        notes.append(f"ITL not measured on the {missing}: judged on TTFT alone")
    first = _ran_first(base, cand)
    if first is not None and min(len(base), len(cand)) >= 2:
        notes.append(f"the {first}'s runs all ran before the other arm's (not interleaved): a "
                     "drift of the host between the two windows reads as a difference; "
                     "interleave the arms' runs (A B A B ...)")
    by_metric = {"TTFT": judged[0], **({"ITL": judged[1]} if len(judged) > 1 else {})}
    failed = failed_requests(base, cand, confidence, noise, seed)
    if failed is not None:
        by_metric[FAILED] = failed
    result = combine(by_metric)
    result = Verdict(result.decision, result.text, result.reasons + notes)

    def resolved(budget: Budget | None, row: QuantileRow) -> float | None:
        return None if budget is None or row.baseline is None else \
            budget.resolve(row.baseline.value)

    return Comparison(*sides, ttft, itl, resolved(ttft_budget, p99),
                      resolved(itl_budget, itl99), confidence, resamples, seed, result,
                      by_metric, {m: runs[m] for m in by_metric if m in runs},
                      runs_alpha(confidence) if by_runs else None)


def json_ready(value):
    """``value`` (dicts, lists, tuples, numbers) with every non-finite float as None: JSON
    has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def to_dict(comparison: Comparison) -> dict:
    """The comparison as JSON-ready plain data (seconds, bytes, 0-1 shares; NaN -> None)."""
    return json_ready(asdict(comparison))


def to_json(comparison: Comparison) -> str:
    return json.dumps(to_dict(comparison), indent=2)


def _ms2(seconds: float) -> str:
    """Milliseconds to 2 decimals; a value that rounds to zero reads 0.00, never -0.00."""
    return f"{round(seconds * 1e3, 2) + 0.0:.2f}"


def _cell(e: Estimate | None) -> str:
    return "-" if e is None else f"{_ms2(e.value):>9} [{_ms2(e.low)}, {_ms2(e.high)}]"


def _count(side: Side) -> str:
    return f"{side.requests} requests" + (f" in {side.runs} runs" if side.runs > 1 else "")


def _moved_bytes(t: dict) -> str:
    """A direction's bytes, or that they were not measured (with its blocks, where counted)."""
    if t["bytes"] is not None:
        return _bytes(t["bytes"])
    return "bytes not measured" if t["blocks"] is None else \
        f"{t['blocks']:,.0f} blocks (bytes not measured)"


def _unspent(side: Side, tier: str) -> str:
    """Why the seconds a ``tier``'s copies took are not measured."""
    if side.transfers is None:
        return "not measured (no transfers counted)"
    if any(farther_tier(d) == tier for d in side.transfers):
        return "not measured (untimed copies)"
    return "not measured (no copies recorded)"


def render_text(comparison: Comparison) -> str:
    """A plain-text report: verdict first, then latencies, hit quality and transfer cost."""
    c = comparison
    pct = f"{c.confidence * 100:g}%"
    lines = [f"verdict: {c.verdict.text}", *[f"  - {r}" for r in c.verdict.reasons], "",
             f"baseline  {c.baseline.name} ({_count(c.baseline)})",
             f"candidate {c.candidate.name} ({_count(c.candidate)})",
             f"latency, ms, with {pct} bootstrap CI ({c.resamples} resamples, seed {c.seed}):"]
    modelled = [arm for arm, side in (("baseline", c.baseline), ("candidate", c.candidate))
                if side.itl_modelled]
    # a modelled ITL's quantiles are no measurement: tryouts read a demo's "ITL keep", CI
    # 0.995-0.995 ms, and its rows printed beside "not measured", as measured (--json has them)
    for label, rows in (("TTFT", c.ttft), ("ITL", () if modelled else c.itl)):
        for r in rows:
            lines.append(f"  {label:4s} p{r.quantile * 100:<4g} baseline {_cell(r.baseline)}  "
                         f"candidate {_cell(r.candidate)}  diff {_cell(r.difference)}")
    if modelled:
        lines.append(f"  ITL not measured: every request's ITL of the "
                     f"{' and the '.join(modelled)} is the same, the engine's cost model (the "
                     "reference engine prices decode)")
    if c.runs:  # whatever the verdict: a keep's too, as --json gives it
        lines.append(f"runs as the unit (one-sided p that the candidate's runs are slower in "
                     f"p99; a roll back needs under {c.runs_alpha:g}): " + ", ".join(
                         f"{m} " + ("run-to-run variance not measured" if t.p is None
                                    else f"p = {t.p:.3g}, {t.df} degrees of freedom")
                         for m, t in c.runs.items()))
    lines.append("hit quality, share of prompt tokens by source:")
    for side in (c.baseline, c.candidate):
        lines.append(f"  {side.name}: " + (", ".join(
            f"{s} {side.token_share[s] * 100:.1f}%" if s in side.token_share
            else f"no {s} tier" if s in side.tiers_off else f"{s} not measured"
            for s in ev.TOKEN_SOURCES)
            if side.token_share is not None else "not measured (the records carry no tokens "
            "by source)"))
    lines.append("transfer cost:")
    for side in (c.baseline, c.candidate):
        if not side.transfers and set(side.tiers_off) >= OFFLOAD_SOURCES:
            # a tryout read "promotion wait 0 ms; failed transfers 0" of a run without offload
            lines.append(f"  {side.name}: none (no offload tier: nothing to copy, promote or "
                         "fail)")
            continue
        moved = "not measured" if side.transfers is None else ", ".join(
            f"{d} {_moved_bytes(t)} in " + (
                "time not measured" if t["seconds"] is None else f"{t['seconds']:.3f} s")
            for d, t in side.transfers.items()) or "none"
        wait = "not measured" if side.promotion_wait_mean is None else \
            f"mean {ms(side.promotion_wait_mean)}, p99 {ms(side.promotion_wait_p99)}"
        failed = "not measured" if side.transfer_failures is None else \
            f"{side.transfer_failures}" + (f" ({', '.join(side.failures_unmeasured)} not "
                                           "measured)" if side.failures_unmeasured else "")
        lines.append(f"  {side.name}: {moved}; promotion wait {wait}; failed transfers {failed}")
    lines.append("offload's value per tier (prefill seconds saved by the tokens it served, "
                 "against the seconds of its copies both ways):")
    for side in (c.baseline, c.candidate):
        rate = (f"prefill {side.prefill_rate:,.0f} tokens/s "
                + ("modelled by the engine" if side.prefill_modelled else "measured")
                if side.prefill_rate else "prefill rate not measured")
        tiers = "; ".join(
            f"{tier}: {v['tokens']:,} tokens, saved "
            + ("not measured" if v["prefill_seconds_saved"] is None
               else ms(v["prefill_seconds_saved"]))
            + ", spent " + (_unspent(side, tier) if v["transfer_seconds"] is None
                            else ms(v["transfer_seconds"]))
            for tier, v in (side.value or {}).items()) or (
                "not measured (the records carry no tokens by source)"
                if side.token_share is None else "no tier below the GPU served tokens")
        lines.append(f"  {side.name} ({rate}): {tiers}")
    return "\n".join(lines) + "\n"
