"""Reuse statistics: how much of a trace is ever reused, how far apart, and by which prefixes.

- *reuse share*: accesses (or tokens) whose block was accessed before: the hit ratio of an
  infinite cache, the ceiling on what any offload tier can serve.
- *reuse distance*: distinct other blocks between two uses of a block (the LRU stack distance,
  Mattson et al. 1970): a reuse at distance ``d`` hits an LRU cache of more than ``d`` blocks.
- *time to reuse*: seconds between two uses of a block (how long a tier must keep it).
- *most shared prefixes*: prefix-hash ids (one id stands for its whole prefix) that are
  *maximal*, i.e. no longer prefix is shared by as many requests, ranked by the tokens their
  reuses would save: ``(uses - 1) * prefix tokens``. Nested prefixes each count their own
  tokens, so the savings of different rows overlap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from kvscope.analysis.stackdist import previous_access, stack_distances
from kvscope.analysis.trace import AccessTrace

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SharedPrefix:
    """One maximal shared prefix. ``block_id``: the prefix hash of its last block. ``blocks``,
    ``tokens``: its length. ``uses``: accesses to it. ``tokens_saved``: ``(uses - 1) * tokens``."""

    block_id: int
    blocks: int
    tokens: int
    uses: int
    tokens_saved: int


@dataclass(frozen=True)
class Distribution:
    """Percentiles (``p50``, ``p90``, ``p99``) and a histogram: ``counts[i]`` values fall in
    ``[edges[i], edges[i+1])``. ``unit``: ``"blocks"`` or ``"seconds"``. Empty when no reuse."""

    unit: str
    percentiles: dict[str, float] = field(default_factory=dict)
    edges: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ReuseStats:
    """Reuse of one trace. Counts are accesses or blocks; shares are 0-1. ``top_prefixes``:
    None when not measured (a sampled capture lacks most of a prompt's blocks)."""

    accesses: int
    unique_blocks: int
    reused_blocks: int
    reuse_share: float
    token_reuse_share: float
    distance: Distribution
    time_to_reuse: Distribution
    top_prefixes: list[SharedPrefix] | None

    def to_dict(self) -> dict:
        return asdict(self)


def _distribution(values: np.ndarray, edges: np.ndarray, unit: str) -> Distribution:
    if len(values) == 0:
        return Distribution(unit)
    pct = np.percentile(values, PERCENTILES)
    counts, _ = np.histogram(values, bins=edges)
    return Distribution(unit, {f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)},
                        edges.tolist(), counts.tolist())


def _log2_edges(top: float, first: float) -> np.ndarray:
    """``[0, first, 2*first, 4*first, ...]`` past ``top``."""
    steps = max(1, int(np.ceil(np.log2(max(top, first) / first))) + 2)
    return np.concatenate(([0.0], first * 2.0 ** np.arange(steps)))


def prefix_tokens(trace: AccessTrace) -> np.ndarray:
    """Tokens of the prefix each access stands for (its block and all before it); int64."""
    cumulative = np.cumsum(trace.tokens)
    index = np.arange(len(trace))
    first = np.maximum.accumulate(np.where(trace.depths == 0, index, 0))
    return cumulative - (cumulative - trace.tokens)[first]


def top_prefixes(trace: AccessTrace, limit: int = 10) -> list[SharedPrefix]:
    """The ``limit`` maximal shared prefixes that save the most tokens (see the module doc).

    Needs each request's accesses contiguous and in prompt order (as :mod:`inputs` builds them).
    """
    if len(trace) == 0:
        return []
    ids, first, codes, uses = np.unique(trace.block_ids, return_index=True, return_inverse=True,
                                        return_counts=True)
    child = np.flatnonzero(trace.depths > 0)
    longest_child_uses = np.zeros(len(ids), dtype=np.int64)
    np.maximum.at(longest_child_uses, codes[child - 1], uses[codes[child]])
    tokens = prefix_tokens(trace)[first]
    saved = (uses - 1) * tokens
    maximal = np.flatnonzero((uses >= 2) & (longest_child_uses < uses))
    best = maximal[np.argsort(-saved[maximal], kind="stable")[:limit]]
    return [SharedPrefix(int(ids[i]), int(trace.depths[first[i]]) + 1, int(tokens[i]),
                         int(uses[i]), int(saved[i])) for i in best]


def reuse_stats(trace: AccessTrace, reuse_distances: np.ndarray | None = None,
                prefixes: int = 10) -> ReuseStats:
    """Reuse statistics of ``trace``.

    ``reuse_distances``: stack distances (blocks) of the reuse accesses if already known, or an
    estimate (e.g. SHARDS-scaled distances of a sample) for traces too large for the exact
    pass; None computes them exactly. Shares, counts and times are always exact.
    """
    prev = previous_access(trace.block_ids)
    reused = prev >= 0
    if reuse_distances is None:
        reuse_distances = stack_distances(trace.block_ids)[reused]
    n = len(trace)
    _, counts = np.unique(trace.block_ids, return_counts=True)
    gaps = (trace.times - trace.times[np.maximum(prev, 0)])[reused]
    total_tokens = float(trace.tokens.sum())
    time_first = max(1e-3, float(np.min(gaps[gaps > 0])) if np.any(gaps > 0) else 1.0)
    top_distance = float(np.max(reuse_distances, initial=1)) + 1
    return ReuseStats(
        accesses=n, unique_blocks=len(counts), reused_blocks=int(np.sum(counts >= 2)),
        reuse_share=float(reused.mean()) if n else 0.0,
        token_reuse_share=float(trace.tokens[reused].sum() / total_tokens) if total_tokens else 0.0,
        distance=_distribution(reuse_distances, _log2_edges(top_distance, 1.0), "blocks"),
        time_to_reuse=_distribution(gaps, _log2_edges(float(gaps.max(initial=1.0)), time_first),
                                    "seconds"),
        top_prefixes=top_prefixes(trace, prefixes))
