"""Histogram values as the pipeline hands them out, and percentiles of bucket counts.

One way to compute a percentile from buckets, PromQL's, shared by the dashboard's samples, the
summary and the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvscope import samples as sf


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
    return {p: histogram_quantile(q, bounds, counts) for p, q in sf.PERCENTILES.items()}


def window_counts(now: Sequence[int], before: Sequence[int] | None) -> list[int]:
    """Per-bucket counts observed since ``before`` (all of ``now`` when None)."""
    return list(now) if before is None else [a - b for a, b in zip(now, before)]


@dataclass
class Histogram:
    """Observations counted per bucket. ``counts[i]``: observations <= ``buckets[i]`` and above
    the previous bound; the last entry counts those above every bound. ``exemplars``: per bucket
    index, the latest ``(trace_id, value, unix_seconds)`` observed with a trace id."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    exemplars: dict[int, tuple[str, float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)
