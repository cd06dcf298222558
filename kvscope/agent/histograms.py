"""Histogram values as the pipeline hands them out (their percentiles: :mod:`kvscope.percentiles`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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
