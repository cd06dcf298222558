"""Percentile bootstrap confidence intervals for quantiles, vectorized with numpy.

The method is the percentile bootstrap of Efron & Tibshirani, "An Introduction to the
Bootstrap" (Chapman & Hall, 1993), chapter 13: draw ``resamples`` samples of size n with
replacement from the n observations, compute the statistic on each, and take the
``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of those replicates as the
interval. For a difference between two independent samples (baseline vs candidate) each sample
is resampled on its own and the replicate differences give the interval (ibid., section 8.3,
the two-sample problem).

Quantiles use numpy's default ``linear`` method (Hyndman & Fan 1996, definition 7), for the
estimate and for every replicate. Everything is seeded (``numpy.random.default_rng``), so the
same inputs give the same interval. Pure: arrays in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 2000
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


def interval(replicates: np.ndarray, confidence: float = DEFAULT_CONFIDENCE
             ) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) percentile-bootstrap bounds of replicates (shape (resamples, k)) per column."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(replicates, [alpha, 1.0 - alpha], axis=0)
    return low, high


def quantile_cis(samples: np.ndarray, quantiles: Sequence[float], *,
                 resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                 seed: int = 0) -> list[Estimate]:
    """Each quantile of ``samples`` with its percentile-bootstrap interval (same unit)."""
    x = np.asarray(samples, dtype=np.float64)
    reps = quantile_replicates(x, quantiles, resamples=resamples, rng=np.random.default_rng(seed))
    low, high = interval(reps, confidence)
    values = np.quantile(x, quantiles)
    return [Estimate(float(v), float(lo), float(hi)) for v, lo, hi in zip(values, low, high)]


@dataclass(frozen=True)
class TwoSample:
    """Quantiles of a baseline and a candidate sample and of their difference (candidate minus
    baseline), each with its interval; lists in the order of the quantiles asked for."""

    baseline: list[Estimate]
    candidate: list[Estimate]
    difference: list[Estimate]


def compare_quantiles(baseline: np.ndarray, candidate: np.ndarray, quantiles: Sequence[float],
                      *, resamples: int = DEFAULT_RESAMPLES,
                      confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> TwoSample:
    """Quantiles of two independent samples and of their difference, with percentile-bootstrap
    intervals. The two samples are resampled from independent streams of one seed.

    Raises ValueError for an empty sample.
    """
    b = np.asarray(baseline, dtype=np.float64)
    c = np.asarray(candidate, dtype=np.float64)
    rng_b, rng_c = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    reps_b = quantile_replicates(b, quantiles, resamples=resamples, rng=rng_b)
    reps_c = quantile_replicates(c, quantiles, resamples=resamples, rng=rng_c)
    out = []
    for reps, value in ((reps_b, np.quantile(b, quantiles)), (reps_c, np.quantile(c, quantiles)),
                        (reps_c - reps_b, np.quantile(c, quantiles) - np.quantile(b, quantiles))):
        low, high = interval(reps, confidence)
        out.append([Estimate(float(v), float(lo), float(hi))
                    for v, lo, hi in zip(value, low, high)])
    return TwoSample(*out)
