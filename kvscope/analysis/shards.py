"""SHARDS: miss-ratio curves from a spatially hashed sample of blocks.

Waldspurger, Park, Garthwaite & Ahmad, "Efficient MRC Construction with SHARDS", USENIX FAST
2015. A block is sampled iff ``hash(block) mod P < T``; the sample keeps every access to a
sampled block, so the sampled stream is a miniature of the whole: at rate ``R = T / P`` a stack
distance ``d`` in the sample stands for ``d / R`` in the full trace.

- **Fixed rate** (section 3.1) keeps ``R`` fixed; memory grows with ``R`` times the distinct
  blocks. ``SHARDS_adj`` (section 4.2) corrects the sample's size: the difference between the
  expected sampled weight (``R`` times the total) and the actual one is added to the first
  histogram bucket, either sign: a hot block in the sample makes it negative, and the
  curve then reads no hit at the smallest sizes, where the hot block's hits belong (a cache
  of 9 to 20 blocks reads 0 where the exact curve reads 0.111 in the test of it). The
  adjustment assumes the sample misses or over-counts a few hot blocks;
  in a sample of under :data:`MIN_SAMPLED_BLOCKS` distinct blocks the difference is the
  sample's own variance (a tap's capture of 42 requests: 8 sampled accesses of an expected
  14.4 added 103 of its 231 accesses as hits, 45% of them, to a sample without one reuse), so
  there the histogram is scaled to the expected total instead, its hit ratios kept.
- **Fixed size** (section 3.2) bounds memory to ``max_blocks`` sampled blocks: when the sample
  would grow beyond that, the blocks with the largest hash leave it and ``T`` drops to their
  hash. The paper rescales the histogram by ``R_new / R_old`` at each drop; weighting each
  sampled access by ``1 / R`` at its time, as here, gives the same curve. With that weighting
  the expected total is the trace's own, so the same first-bucket adjustment applies (our
  extension; on the Mooncake conversation trace at 4,096 blocks it cuts the mean absolute
  error six- to eightfold: 0.003 to 0.004 against 0.026 to 0.029, 3 seeds).

- **Already sampled** (a vLLM tap's capture: the tap keeps the blocks of a fixed rate ``R``):
  :func:`fixed_rate` with ``sampled_at=R`` and the full stream's ``total`` scales the sample as
  fixed rate does; a lower ``rate`` samples it again (nested rates nest, see
  :mod:`kvscope.sampling`).

Histograms are in the full stream's units: each sampled access weighs ``1 / R`` of its weight.

The hash and the predicate are :mod:`kvscope.sampling`'s (one definition, shared with the tap):
MurmurHash3's 64-bit finalizer of the block id xor a seed, ``P = 2**32``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kvscope import sampling
from kvscope.analysis.mrc import DistanceHistogram
from kvscope.analysis.stackdist import StackCounter, stack_distances

MODULUS = sampling.MODULUS  # P: sampling thresholds T are integers in [1, P]
# Below this many distinct sampled blocks a SHARDS curve is too coarse to size from (the
# SHARDS paper evaluates samples of thousands of blocks), and SHARDS_adj is not applied.
MIN_SAMPLED_BLOCKS = 1_000


def spatial_hash(block_ids: np.ndarray, seed: int = 0) -> np.ndarray:
    """Uniform hash of each block id into ``[0, 2**32)``; int64 array
    (:func:`kvscope.sampling.spatial_hash` of each id, reduced mod 2**64)."""
    ids = np.ascontiguousarray(np.asarray(block_ids).astype(np.uint64))
    out = np.empty(len(ids), dtype=np.int64)
    sampling.hash_array(ids, seed, out)
    return out


@dataclass(frozen=True, eq=False)
class ShardsResult:
    """A SHARDS estimate. ``histogram``: full-trace distances (blocks). ``rate``: the final
    sampling rate (0-1). ``sampled_accesses``: accesses processed. ``sampled_blocks``: distinct
    blocks in the sample at the end."""

    histogram: DistanceHistogram
    rate: float
    sampled_accesses: int
    sampled_blocks: int


def _weights(block_ids: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    if weights is None:
        return np.ones(len(block_ids), dtype=np.float64)
    return np.asarray(weights, dtype=np.float64)


def fixed_rate(block_ids: np.ndarray, rate: float, weights: np.ndarray | None = None,
               seed: int = 0, adjust: bool = True, sampled_at: float = 1.0,
               total: float | None = None) -> ShardsResult:
    """SHARDS at a fixed sampling ``rate`` (0 < rate <= 1), vectorized.

    ``weights``: per-access weight (tokens) or None to count accesses. ``adjust``: apply
    SHARDS_adj. ``sampled_at``: the rate the ids were already sampled at with this seed (a
    tap's capture; 1: the full stream); the sample's rate is the lower of the two.
    ``total``: the full stream's weight (accesses, or tokens with ``weights``), for SHARDS_adj;
    None: the ids' own, right only when ``sampled_at`` is 1. Raises ValueError for a rate
    outside (0, 1].
    """
    ids = np.asarray(block_ids)
    w = _weights(ids, weights)
    limit = min(sampling.threshold(rate), sampling.threshold(sampled_at))
    effective = sampling.rate_of(limit)
    sampled = spatial_hash(ids, seed) < limit
    sample_ids, sample_w = ids[sampled], w[sampled]
    histogram = DistanceHistogram.from_distances(stack_distances(sample_ids),
                                                 sample_w / effective, scale=1.0 / effective)
    blocks = len(np.unique(sample_ids))
    if adjust:
        histogram = _adjusted(histogram.hits, histogram.total,
                              float(w.sum()) if total is None else float(total), blocks)
    return ShardsResult(histogram, effective, int(sampled.sum()), blocks)


def _adjusted(hits: np.ndarray, total: float, expected: float,
              blocks: int) -> DistanceHistogram:
    """SHARDS_adj: put ``expected - total`` (either sign) into the first bucket (full-stream
    units: ``expected`` is the full stream's weight, ``total`` the sample's scaled by 1 / R);
    for a sample of fewer than :data:`MIN_SAMPLED_BLOCKS` distinct ``blocks``, scale every
    bucket by ``expected / total`` instead (see the module docstring)."""
    hits = hits.astype(np.float64, copy=True)
    if len(hits) == 0:
        hits = np.zeros(1)
    if blocks < MIN_SAMPLED_BLOCKS:
        if total > 0:
            hits *= max(expected, 0.0) / total
    else:  # signed, as in the paper: a hot block in the sample makes it negative
        hits[0] += expected - total
    return DistanceHistogram(hits, max(expected, 0.0))


def fixed_size(block_ids: np.ndarray, max_blocks: int = 8192, weights: np.ndarray | None = None,
               seed: int = 0, adjust: bool = True, chunk: int = 1 << 16) -> ShardsResult:
    """SHARDS keeping at most ``max_blocks`` sampled blocks (the rate falls as blocks arrive).

    Streams in ``chunk``-sized slices: a vectorized filter drops accesses above the current
    threshold (it only falls), then a Fenwick stack counter handles the survivors.
    Raises ValueError for ``max_blocks < 1``.
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    ids = np.asarray(block_ids)
    w = _weights(ids, weights)
    hashes = spatial_hash(ids, seed)
    threshold = MODULUS
    counter = StackCounter(capacity=min(4 * max_blocks, 1 << 16))
    largest: list[tuple[int, int]] = []  # max-heap of (-hash, block) over the sample
    buckets: list[int] = []
    bucket_weights: list[float] = []
    total = 0.0
    processed = 0
    for start in range(0, len(ids), chunk):
        part = slice(start, start + chunk)
        keep = np.flatnonzero(hashes[part] < threshold)
        for h, block, weight in zip(hashes[part][keep].tolist(), ids[part][keep].tolist(),
                                    w[part][keep].tolist()):
            if h >= threshold:
                continue
            processed += 1
            scale = MODULUS / threshold  # 1 / R at this access
            total += weight * scale
            distance = counter.access(block)
            if distance >= 0:
                buckets.append(int(distance * scale))
                bucket_weights.append(weight * scale)
            else:
                heapq.heappush(largest, (-h, block))
                while len(counter) > max_blocks:
                    top = -largest[0][0]
                    while largest and -largest[0][0] == top:
                        counter.forget(heapq.heappop(largest)[1])
                    threshold = top
    hits = np.bincount(np.array(buckets, dtype=np.int64),
                       weights=np.array(bucket_weights, dtype=np.float64), minlength=1)
    histogram = (_adjusted(hits, total, float(w.sum()), len(counter)) if adjust
                 else DistanceHistogram(hits.astype(np.float64), total))
    return ShardsResult(histogram, threshold / MODULUS, processed, len(counter))
