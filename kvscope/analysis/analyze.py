"""The whole analysis of one trace, as plain data: reuse, miss-ratio curves and sizing advice.

:func:`analyze` is pure (arrays in, dataclasses out); reading files is
:func:`kvscope.analysis.inputs.load_trace`'s job and rendering is :mod:`report`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvscope.analysis import shards
from kvscope.analysis.arc import arc_curve
from kvscope.analysis.mrc import DistanceHistogram, MissRatioCurve, curve_from_histogram, size_grid
from kvscope.analysis.reuse import ReuseStats, reuse_stats
from kvscope.analysis.sizing import DEFAULT_BANDWIDTH, SizingAdvice, SizingParams, advise
from kvscope.analysis.stackdist import stack_distances
from kvscope.analysis.trace import AccessTrace
from kvscope.engine.presets import ModelPreset
from kvscope.engine.workload import TraceError

METHODS = ("auto", "exact", "shards-rate", "shards-size")
# Below this many distinct sampled blocks a SHARDS curve is too coarse to size from (the SHARDS
# paper, Waldspurger et al., FAST 2015, evaluates samples of thousands of blocks).
MIN_SAMPLED_BLOCKS = 1_000


@dataclass(frozen=True)
class AnalyzeOptions:
    """``method``: how to build the LRU curve: ``exact`` (stack distances, O(N log N)),
    ``shards-rate`` (SHARDS at ``sample_rate``), ``shards-size`` (SHARDS keeping
    ``sample_blocks`` blocks), or ``auto`` (exact up to ``exact_limit`` accesses, else
    ``shards-rate`` at a rate that samples about ``sample_target`` accesses).
    ``arc_points``: sizes of the ARC curve (0: skip ARC); ``arc_sample_target``: sampled
    accesses per ARC size. The rest are :class:`~kvscope.analysis.sizing.SizingParams`."""

    preset: ModelPreset
    bandwidth: float = DEFAULT_BANDWIDTH
    gpu_tokens: int = 0
    budget_bytes: float | None = None
    target_share: float = 0.9
    method: str = "auto"
    exact_limit: int = 20_000_000
    sample_rate: float | None = None
    sample_target: int = 2_000_000
    sample_blocks: int = 65_536
    curve_points: int = 96
    arc_points: int = 12
    arc_sample_target: int = 100_000
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad option."""
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.sample_rate is not None and not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {self.sample_rate}")
        if self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.gpu_tokens < 0:
            raise ValueError(f"gpu tokens must be >= 0, got {self.gpu_tokens}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget must be > 0 bytes, got {self.budget_bytes}")
        if not 0 < self.target_share <= 1:
            raise ValueError(f"target share must be in (0, 1], got {self.target_share}")


@dataclass(frozen=True, eq=False)
class Analysis:
    """Result of :func:`analyze`. ``lru``: miss ratio by accesses; ``lru_tokens``: by tokens;
    ``arc``: by accesses (None when skipped). ``bytes_per_block``: for the preset at the trace's
    block size. ``method``: how the LRU curves were built (with the sampling rate if any)."""

    source: str
    accesses: int
    requests: int
    duration_seconds: float
    block_tokens: int
    bytes_per_block: int
    method: str
    reuse: ReuseStats
    lru: MissRatioCurve
    lru_tokens: MissRatioCurve
    arc: MissRatioCurve | None
    sizing: SizingAdvice
    notes: list[str] = field(default_factory=list)


def _histograms(trace: AccessTrace, options: AnalyzeOptions):
    """(accesses histogram, tokens histogram, reuse distances, method label)."""
    ids, tokens, n = trace.block_ids, trace.tokens, len(trace)
    method = options.method
    if method == "auto":
        method = "exact" if n <= options.exact_limit else "shards-rate"
    if method == "exact":
        d = stack_distances(ids)
        return (DistanceHistogram.from_distances(d), DistanceHistogram.from_distances(d, tokens),
                d[d >= 0], "lru-exact")
    if method == "shards-size":
        by_access = shards.fixed_size(ids, options.sample_blocks, seed=options.seed)
        by_token = shards.fixed_size(ids, options.sample_blocks, tokens, seed=options.seed)
        label = f"lru-shards-fixed-size(blocks={options.sample_blocks}, final R={by_access.rate:.3g})"
    else:
        rate = options.sample_rate or min(1.0, options.sample_target / max(n, 1))
        by_access = shards.fixed_rate(ids, rate, seed=options.seed)
        by_token = shards.fixed_rate(ids, rate, tokens, seed=options.seed)
        label = f"lru-shards-fixed-rate(R={by_access.rate:.3g})"
    if by_access.sampled_blocks < MIN_SAMPLED_BLOCKS < len(np.unique(ids)):
        raise ValueError(f"the SHARDS sample holds only {by_access.sampled_blocks} distinct blocks "
                         f"(R={by_access.rate:.3g}), too few for a curve to size a tier from; "
                         f"raise --sample-rate / --sample-blocks or use --method exact")
    # reuse distances for the distribution: the sample's, stretched by 1/R (an estimate)
    rate = by_access.rate
    keep = shards.spatial_hash(ids, options.seed) < max(1, round(rate * shards.MODULUS))
    d = stack_distances(ids[keep])
    return by_access.histogram, by_token.histogram, np.floor(d[d >= 0] / rate), label


def analyze(trace: AccessTrace, options: AnalyzeOptions) -> Analysis:
    """Reuse statistics, LRU and ARC miss-ratio curves and sizing advice for ``trace``.

    Raises ValueError for invalid options or an empty trace.
    """
    options.validate()
    if len(trace) == 0:
        raise TraceError(f"{trace.source or 'trace'}: no block accesses to analyze")
    by_access, by_token, reuse_distances, method = _histograms(trace, options)
    reuse = reuse_stats(trace, reuse_distances)
    working_set = max(by_access.max_useful_size, 1)
    grid = size_grid(working_set, options.curve_points)
    lru = curve_from_histogram(by_access, grid, method)
    lru_tokens = curve_from_histogram(by_token, grid, method, weight="tokens")
    params = SizingParams(options.preset, trace.block_tokens, options.bandwidth,
                          options.gpu_tokens, options.budget_bytes, options.target_share)
    sizing = advise(by_token, params, trace.duration)
    notes = []
    arc = None
    if options.arc_points > 0:
        arc_sizes = np.unique(np.linspace(working_set / options.arc_points, working_set,
                                          options.arc_points).round().astype(np.int64))
        arc_rate = min(1.0, options.arc_sample_target / len(trace))
        arc = arc_curve(trace.block_ids, arc_sizes, arc_rate, seed=options.seed)
        notes.append("ARC block hit ratios overstate prefix hits: ARC may evict a block whose "
                     "longer prefixes stay cached, and only leading cached blocks serve tokens.")
    if options.gpu_tokens == 0:
        notes.append("No GPU prefix cache assumed: the CPU tier is credited with every reuse "
                     "it holds; give vLLM's 'GPU KV cache size' in tokens (analyze "
                     "--gpu-tokens, dashboard --sizing-gpu-tokens).")
    return Analysis(source=trace.source, accesses=len(trace), requests=trace.request_count,
                    duration_seconds=trace.duration, block_tokens=trace.block_tokens,
                    bytes_per_block=params.bytes_per_block, method=method, reuse=reuse,
                    lru=lru, lru_tokens=lru_tokens, arc=arc, sizing=sizing, notes=notes)
