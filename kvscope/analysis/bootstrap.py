"""Percentile bootstrap confidence intervals for quantiles, vectorized with numpy.

The method is the percentile bootstrap of Efron & Tibshirani, "An Introduction to the
Bootstrap" (Chapman & Hall, 1993), chapter 13: draw ``resamples`` samples of size n with
replacement from the n observations, compute the statistic on each, and take the
``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of those replicates as the
interval. For a difference between two independent samples (baseline vs candidate) each sample
is resampled on its own and the replicate differences give the interval (ibid., section 8.3,
the two-sample problem).

When each side is several runs (repeated captures of one configuration), requests of one run
share that run's conditions (host noise, warm-up, scheduling) and are not independent: the
two-stage bootstrap for hierarchical data (Davison & Hinkley, "Bootstrap Methods and their
Application", Cambridge 1997, section 3.8) draws the runs with replacement first and then the
requests within each drawn run, so the interval carries the run-to-run variance too
(:func:`run_quantile_replicates`). With one run it is the one-stage bootstrap above.

Quantiles use numpy's default ``linear`` method (Hyndman & Fan 1996, definition 7), for the
estimate and for every replicate. Everything is seeded (``numpy.random.default_rng``), so the
same inputs give the same interval. Pure: arrays in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 2000
# the most a command line may ask for: each resample's quantiles are kept (24 bytes a
# resample), and a million takes seconds per arm; more once ran out of memory (2 TiB asked)
MAX_RESAMPLES = 1_000_000
DEFAULT_CONFIDENCE = 0.95
_CHUNK_ELEMENTS = 4_000_000  # resampled values held at once (32 MB of float64)


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its confidence interval, in the sample's unit."""

    value: float
    low: float
    high: float

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high


def quantile_replicates(samples: np.ndarray, quantiles: Sequence[float], *,
                        resamples: int = DEFAULT_RESAMPLES,
                        rng: np.random.Generator) -> np.ndarray:
    """Bootstrap replicates of ``quantiles`` (each 0-1) of ``samples``.

    Returns float64 array of shape (``resamples``, len(``quantiles``)). Resamples are drawn in
    chunks of about 4M values, so memory stays bounded for large samples. Raises ValueError
    for an empty sample or ``resamples`` < 1.
    """
    x = np.asarray(samples, dtype=np.float64)
    n = len(x)
    if n == 0:
        raise ValueError("cannot bootstrap an empty sample")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    q = np.asarray(quantiles, dtype=np.float64)
    out = np.empty((resamples, len(q)), dtype=np.float64)
    step = max(1, _CHUNK_ELEMENTS // n)
    for start in range(0, resamples, step):
        rows = min(step, resamples - start)
        idx = rng.integers(0, n, size=(rows, n))
        out[start:start + rows] = np.quantile(x[idx], q, axis=1).T
    return out


def run_quantile_replicates(runs: Sequence[np.ndarray], quantiles: Sequence[float], *,
                            resamples: int = DEFAULT_RESAMPLES,
                            rng: np.random.Generator) -> np.ndarray:
    """Two-stage bootstrap replicates of ``quantiles`` (each 0-1) of the pooled ``runs`` (one
    array of observations per run): each replicate draws len(runs) runs with replacement, then
    each drawn run's observations with replacement (as many as it has), and takes the quantiles
    of all of them together (Davison & Hinkley 1997, section 3.8). One run: the one-stage
    bootstrap of :func:`quantile_replicates`, draw for draw.

    Returns float64 array of shape (``resamples``, len(``quantiles``)). Raises ValueError for no
    runs, an empty run or ``resamples`` < 1.
    """
    xs = [np.asarray(r, dtype=np.float64) for r in runs]
    if not xs or any(len(x) == 0 for x in xs):
        raise ValueError("cannot bootstrap an empty run")
    if len(xs) == 1:
        return quantile_replicates(xs[0], quantiles, resamples=resamples, rng=rng)
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    q = np.asarray(quantiles, dtype=np.float64)
    out = np.empty((resamples, len(q)), dtype=np.float64)
    for i in range(resamples):
        drawn = [xs[j] for j in rng.integers(0, len(xs), size=len(xs))]
        pooled = np.concatenate([x[rng.integers(0, len(x), size=len(x))] for x in drawn])
        out[i] = np.quantile(pooled, q)
    return out


def interval(replicates: np.ndarray, confidence: float = DEFAULT_CONFIDENCE
             ) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) percentile-bootstrap bounds of replicates (shape (resamples, k)) per column."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(replicates, [alpha, 1.0 - alpha], axis=0)
    return low, high


def _runs(samples) -> list[np.ndarray]:
    """One array of observations, or a list of them (one per run), as a list of runs."""
    runs = samples if isinstance(samples, (list, tuple)) else [samples]
    return [np.asarray(r, dtype=np.float64) for r in runs]


def quantile_cis(samples, quantiles: Sequence[float], *,
                 resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                 seed: int = 0) -> list[Estimate]:
    """Each quantile of ``samples`` (one array, or a list of arrays, one per run: see
    :func:`run_quantile_replicates`) with its percentile-bootstrap interval (same unit)."""
    runs = _runs(samples)
    reps = run_quantile_replicates(runs, quantiles, resamples=resamples,
                                   rng=np.random.default_rng(seed))
    low, high = interval(reps, confidence)
    values = np.quantile(np.concatenate(runs), quantiles)
    return [Estimate(float(v), float(lo), float(hi)) for v, lo, hi in zip(values, low, high)]


@dataclass(frozen=True)
class TwoSample:
    """Quantiles of a baseline and a candidate sample and of their difference (candidate minus
    baseline), each with its interval; lists in the order of the quantiles asked for.
    ``replicates``: the difference's bootstrap replicates, shape (resamples, quantiles), for
    intervals at another level (:func:`interval`)."""

    baseline: list[Estimate]
    candidate: list[Estimate]
    difference: list[Estimate]
    replicates: np.ndarray


def compare_quantiles(baseline, candidate, quantiles: Sequence[float],
                      *, resamples: int = DEFAULT_RESAMPLES,
                      confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> TwoSample:
    """Quantiles of two independent samples and of their difference, with percentile-bootstrap
    intervals. Each side is one array of observations, or a list of arrays, one per run
    (resampled in two stages: :func:`run_quantile_replicates`); the estimates are the pooled
    observations' quantiles. The two sides are resampled from independent streams of one seed.

    Raises ValueError for an empty sample.
    """
    runs_b, runs_c = _runs(baseline), _runs(candidate)
    b, c = np.concatenate(runs_b), np.concatenate(runs_c)
    rng_b, rng_c = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    reps_b = run_quantile_replicates(runs_b, quantiles, resamples=resamples, rng=rng_b)
    reps_c = run_quantile_replicates(runs_c, quantiles, resamples=resamples, rng=rng_c)
    out = []
    difference = reps_c - reps_b
    for reps, value in ((reps_b, np.quantile(b, quantiles)), (reps_c, np.quantile(c, quantiles)),
                        (difference, np.quantile(c, quantiles) - np.quantile(b, quantiles))):
        low, high = interval(reps, confidence)
        out.append([Estimate(float(v), float(lo), float(hi))
                    for v, lo, hi in zip(value, low, high)])
    return TwoSample(*out, difference)
