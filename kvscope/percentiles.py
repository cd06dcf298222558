"""Percentiles, computed one way for each kind of input, everywhere in kvscope: of observations
counted per bucket as PromQL's ``histogram_quantile`` does (:func:`bucket_percentiles`), and of
raw values with linear interpolation between closest ranks, numpy's default
(:func:`value_percentiles`). Both answer ``{"p50", "p95", "p99"}``, None when there is nothing
to take them of (not measured, never 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvscope.samples import PERCENTILES


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The ``q``-quantile (0-1) of observations counted per bucket, as PromQL's
    ``histogram_quantile`` computes it: linear interpolation inside the bucket holding the
    rank, the first bucket starting at 0 (or at its bound when that is <= 0), and a rank in the
    +Inf bucket answered with the highest finite bound.

    ``bounds``: upper bounds, ascending; ``counts``: per-bucket (not cumulative) counts, one
    more than ``bounds`` (the last is +Inf). None when there are no observations.
    Source: prometheus/promql/quantile.go (bucketQuantile).
    """
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts):
        if seen + n >= rank and n > 0:
            if i == len(bounds):
                return float(bounds[-1])
            upper = float(bounds[i])
            lower = float(bounds[i - 1]) if i > 0 else (0.0 if upper > 0 else upper)
            return lower + (upper - lower) * (rank - seen) / n
        seen += n
    return float(bounds[-1])


def bucket_percentiles(bounds: Sequence[float],
                       counts: Sequence[float]) -> dict[str, float | None]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` of observations counted per bucket (see
    :func:`histogram_quantile`); None each when there are none."""
    return {p: histogram_quantile(q, bounds, counts) for p, q in PERCENTILES.items()}


def value_percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` of ``values`` by ``numpy.percentile`` (linear
    interpolation between closest ranks, Hyndman & Fan 1996 type 7); None each when there are
    none."""
    if len(values) == 0:
        return dict.fromkeys(PERCENTILES)
    found = np.percentile(values, [q * 100 for q in PERCENTILES.values()])
    return {name: float(v) for name, v in zip(PERCENTILES, found)}
