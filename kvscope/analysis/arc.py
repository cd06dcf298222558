"""ARC miss-ratio curves by scaled-down ("miniature") simulation.

ARC is not a stack algorithm, so one pass cannot give every size; each size needs its own
simulation. :class:`ArcCache` follows the pseudocode of Megiddo & Modha, "ARC: A
Self-Tuning, Low Overhead Replacement Cache", USENIX FAST 2003 (figure 4). :func:`arc_curve`
runs it per size on a SHARDS-style spatially hashed sample at rate ``R`` with the cache scaled
to ``R * size`` (Waldspurger, Saemundsson, Ahmad & Park, "Cache Modeling and Optimization using
Miniature Simulations", USENIX ATC 2017), so a curve of ``k`` sizes costs about ``k * R * N``
cache operations instead of ``k * N``.

ARC hit ratios count blocks; unlike LRU, ARC does not keep every prefix of a cached prefix
cached, so with prefix semantics the token hit share can be lower than the block hit ratio.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvscope.analysis.mrc import MissRatioCurve
from kvscope.analysis.shards import MODULUS, spatial_hash


class ArcCache:
    """ARC over ``capacity`` blocks: T1/T2 resident (recent / frequent), B1/B2 ghost lists.

    ``p``: target size of T1 (blocks, real-valued as in the paper). Raises ValueError for a
    capacity below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ARC capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def _replace(self, in_b2: bool) -> None:
        t1 = len(self.t1)
        if t1 >= 1 and ((in_b2 and t1 == self.p) or t1 > self.p):
            block, _ = self.t1.popitem(last=False)
            self.b1[block] = None
        else:
            block, _ = self.t2.popitem(last=False)
            self.b2[block] = None

    def access(self, block: int) -> bool:
        """Reference ``block``; return True on a hit (it was in T1 or T2)."""
        c = self.capacity
        if block in self.t1:  # case I
            del self.t1[block]
            self.t2[block] = None
            return True
        if block in self.t2:
            self.t2.move_to_end(block)
            return True
        if block in self.b1:  # case II: a recency ghost hit grows T1's target
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self._replace(False)
            del self.b1[block]
            self.t2[block] = None
            return False
        if block in self.b2:  # case III: a frequency ghost hit shrinks it
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self._replace(True)
            del self.b2[block]
            self.t2[block] = None
            return False
        l1 = len(self.t1) + len(self.b1)  # case IV: a new block
        if l1 == c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._replace(False)
            else:
                self.t1.popitem(last=False)
        elif l1 < c and l1 + len(self.t2) + len(self.b2) >= c:
            if l1 + len(self.t2) + len(self.b2) == 2 * c:
                self.b2.popitem(last=False)
            self._replace(False)
        self.t1[block] = None
        return False


def arc_hit_ratio(block_ids: np.ndarray, capacity: int, weights: np.ndarray | None = None) -> float:
    """ARC hit ratio (0-1) of ``capacity`` blocks on the whole stream (weighted if given)."""
    cache = ArcCache(capacity)
    ids = np.asarray(block_ids).tolist()
    if weights is None:
        hits = sum(map(cache.access, ids))
        return hits / len(ids) if ids else 0.0
    w = np.asarray(weights, dtype=np.float64).tolist()
    hit_weight = sum(wi for block, wi in zip(ids, w) if cache.access(block))
    total = sum(w)
    return hit_weight / total if total else 0.0


def arc_curve(block_ids: np.ndarray, sizes: np.ndarray, rate: float = 1.0,
              weights: np.ndarray | None = None, seed: int = 0,
              min_scaled: int = 64) -> MissRatioCurve:
    """ARC miss-ratio curve at ``sizes`` (blocks) by simulation on spatially hashed samples.

    Size ``C`` is simulated with ``round(C * R_C)`` blocks on the accesses to blocks sampled at
    ``R_C = min(1, max(rate, min_scaled / C))``: large caches run at ``rate``, while small ones
    get a denser sample so the miniature cache still holds ``min_scaled`` blocks (tiny
    miniatures are noisy). The sample's size error is corrected as SHARDS_adj does (the
    difference between expected and sampled weight counts as hits: hot blocks, Waldspurger et
    al. FAST'15 section 4.2). ``rate=1`` simulates every size at full scale. Raises ValueError
    for a rate outside (0, 1].
    """
    if not 0 < rate <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {rate}")
    ids = np.asarray(block_ids)
    hashes = spatial_hash(ids, seed) if rate < 1 else None
    total = float(len(ids) if weights is None else np.sum(weights, dtype=np.float64))
    sizes = np.asarray(sizes, dtype=np.int64)
    miss = np.empty(len(sizes))
    for i, size in enumerate(sizes.tolist()):
        size_rate = min(1.0, max(rate, min_scaled / max(size, 1)))
        threshold = max(1, round(size_rate * MODULUS))
        if hashes is None or threshold >= MODULUS:
            miss[i] = 1.0 - arc_hit_ratio(ids, max(1, size), weights)
            continue
        keep = hashes < threshold
        sample_w = None if weights is None else np.asarray(weights)[keep]
        scaled = max(1, round(size * threshold / MODULUS))
        ratio = arc_hit_ratio(ids[keep], scaled, sample_w)
        sampled = float(keep.sum() if weights is None else sample_w.sum())
        expected = threshold / MODULUS * total
        # SHARDS_adj on the miniature: a hot block in or out of the sample skews its size
        adjusted = (ratio * sampled + expected - sampled) / expected if expected > 0 else 0.0
        miss[i] = 1.0 - min(1.0, max(0.0, adjusted))
    method = "arc-exact" if rate >= 1 else f"arc-miniature(R={rate:.4g})"
    return MissRatioCurve(sizes, miss, method, "accesses" if weights is None else "tokens")
