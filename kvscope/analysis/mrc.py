"""Miss-ratio curves: the miss ratio a cache of each size would see on a trace.

A :class:`DistanceHistogram` holds the weight (accesses, or tokens) of the hits at each stack
distance plus the weight of cold misses; since LRU hits exactly the accesses with
``distance < size`` (Mattson et al. 1970), the LRU hit ratio of any size is a prefix sum of it.
A :class:`MissRatioCurve` is that function sampled at chosen sizes, in blocks, and converts to
bytes for a model preset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.analysis.stackdist import stack_distances


@dataclass(frozen=True, eq=False)
class DistanceHistogram:
    """``hits[d]``: weight of accesses at stack distance ``d`` (blocks), float64 of length D;
    ``hits[0]`` may be negative after SHARDS_adj (:mod:`kvscope.analysis.shards`), so read
    hit ratios through :meth:`hit_ratio`, which clips them to 0-1.

    ``total``: weight of all accesses, cold misses included. Weights are accesses by default,
    or tokens when the histogram was built with per-access token counts.
    """

    hits: np.ndarray
    total: float

    @classmethod
    def from_distances(cls, distances: np.ndarray, weights: np.ndarray | None = None,
                       scale: float = 1.0) -> DistanceHistogram:
        """Histogram of ``distances`` (``-1`` = cold miss), each scaled by ``scale`` and floored.

        ``weights``: per-access weights (default 1 each). ``scale`` > 1 stretches sampled
        distances to full-trace distances (SHARDS: ``scale = 1 / R``).
        """
        distances = np.asarray(distances)
        warm = distances >= 0
        scaled = np.floor(distances[warm] * scale).astype(np.int64)
        w = None if weights is None else np.asarray(weights, dtype=np.float64)[warm]
        hits = np.bincount(scaled, weights=w, minlength=1).astype(np.float64)
        total = float(len(distances) if weights is None else np.sum(weights, dtype=np.float64))
        return cls(hits, total)

    def hit_ratio(self, sizes: np.ndarray) -> np.ndarray:
        """LRU hit ratio (0-1) at each cache size in ``sizes`` (blocks); float64 array."""
        sizes = np.clip(np.asarray(sizes, dtype=np.int64), 0, len(self.hits))
        if self.total <= 0:
            return np.zeros(len(sizes))
        cumulative = np.concatenate(([0.0], np.cumsum(self.hits)))
        return np.clip(cumulative[sizes] / self.total, 0.0, 1.0)

    @property
    def max_useful_size(self) -> int:
        """Smallest size (blocks) at which the hit ratio stops growing: 1 + the largest distance."""
        nonzero = np.flatnonzero(self.hits)
        return int(nonzero[-1]) + 1 if len(nonzero) else 0


@dataclass(frozen=True, eq=False)
class MissRatioCurve:
    """Miss ratio (0-1, float64) at cache sizes ``sizes`` (blocks, int64, ascending).

    ``method``: how it was obtained (``"lru-exact"``, ``"lru-shards-fixed-rate"``, ...).
    ``weight``: ``"accesses"`` or ``"tokens"``: what the ratio counts.
    """

    sizes: np.ndarray
    miss_ratio: np.ndarray
    method: str
    weight: str = "accesses"

    @property
    def hit_ratio(self) -> np.ndarray:
        return 1.0 - self.miss_ratio

    def at(self, size: float) -> float:
        """Miss ratio at ``size`` blocks, interpolated linearly between curve points."""
        return float(np.interp(size, self.sizes, self.miss_ratio))

    def to_dict(self, bytes_per_block: int | None = None) -> dict:
        """Plain data: ``sizes_blocks``, ``miss_ratio`` and, given ``bytes_per_block``, ``sizes_bytes``."""
        out = {"method": self.method, "weight": self.weight,
               "sizes_blocks": self.sizes.tolist(), "miss_ratio": self.miss_ratio.tolist()}
        if bytes_per_block is not None:
            out["sizes_bytes"] = (self.sizes * bytes_per_block).tolist()
        return out


def curve_from_histogram(histogram: DistanceHistogram, sizes: np.ndarray, method: str,
                         weight: str = "accesses") -> MissRatioCurve:
    """Sample ``histogram`` at ``sizes`` (blocks) into a :class:`MissRatioCurve`."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return MissRatioCurve(sizes, 1.0 - histogram.hit_ratio(sizes), method, weight)


def lru_histogram(block_ids: np.ndarray, weights: np.ndarray | None = None) -> DistanceHistogram:
    """Exact LRU stack-distance histogram of an access stream (O(N log N))."""
    return DistanceHistogram.from_distances(stack_distances(block_ids), weights)


def lru_curve(block_ids: np.ndarray, sizes: np.ndarray,
              weights: np.ndarray | None = None) -> MissRatioCurve:
    """Exact LRU miss-ratio curve of ``block_ids`` at ``sizes`` (blocks).

    ``weights``: per-access tokens for a token-weighted curve (default: count accesses).
    """
    weight = "accesses" if weights is None else "tokens"
    return curve_from_histogram(lru_histogram(block_ids, weights), sizes, "lru-exact", weight)


def size_grid(max_size: int, points: int = 96) -> np.ndarray:
    """Cache sizes (blocks) for a curve up to ``max_size``: half log-spaced from 1, half linear.

    Log spacing resolves small caches; linear spacing keeps the knee and large sizes honest.
    Returns sorted unique int64 values in ``[1, max_size]`` (just ``[1]`` for ``max_size < 1``).
    """
    max_size = max(1, int(max_size))
    half = max(2, points // 2)
    logs = np.geomspace(1, max_size, half)
    lins = np.linspace(max_size / half, max_size, half)
    return np.unique(np.clip(np.round(np.concatenate((logs, lins))), 1, max_size).astype(np.int64))


def mean_absolute_error(a: MissRatioCurve, b: MissRatioCurve) -> float:
    """Mean of ``|a - b|`` over the sizes of ``a`` (``b`` interpolated there)."""
    other = np.interp(a.sizes, b.sizes, b.miss_ratio)
    return float(np.mean(np.abs(a.miss_ratio - other)))
