"""The whole analysis of one trace, as plain data: reuse, miss-ratio curves and sizing advice.

:func:`analyze` is pure (arrays in, dataclasses out); reading files is
:func:`kvscope.analysis.inputs.load_trace`'s job and rendering is :mod:`report`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from kvscope.analysis import shards
from kvscope.analysis.arc import arc_curve
from kvscope import sampling
from kvscope.analysis.mrc import DistanceHistogram, MissRatioCurve, curve_from_histogram, size_grid
from kvscope.analysis.rates import MeasuredRates
from kvscope.analysis.reuse import ReuseStats, reuse_stats
from kvscope.analysis.sizing import DEFAULT_BANDWIDTH, SizingAdvice, SizingParams, advise
from kvscope.analysis.stackdist import stack_distances
from kvscope.analysis.trace import AccessTrace
from kvscope.engine.presets import ModelPreset
from kvscope.engine.workload import TraceError

METHODS = ("auto", "exact", "shards-rate", "shards-size")


@dataclass(frozen=True)
class AnalyzeOptions:
    """``method``: how to build the LRU curve: ``exact`` (stack distances, O(N log N)),
    ``shards-rate`` (SHARDS at ``sample_rate``), ``shards-size`` (SHARDS keeping
    ``sample_blocks`` blocks), or ``auto`` (exact up to ``exact_limit`` accesses, else
    ``shards-rate`` at a rate that samples about ``sample_target`` accesses).
    ``arc_points``: sizes of the ARC curve (0: skip ARC); ``arc_sample_target``: sampled
    accesses per ARC size. ``bandwidth`` (bytes/s) and ``prefill_tokens_per_second``: None
    takes ``measured``'s (the capture's own, :mod:`~kvscope.analysis.rates`), else assumes
    :data:`~kvscope.analysis.sizing.DEFAULT_BANDWIDTH` and the preset's prefill rate. A trace
    the tap already sampled (``AccessTrace.sample_rate`` < 1) is analysed at its rate
    (``exact``, and ``auto`` up to ``exact_limit``) or sampled again lower (``shards-rate``;
    ``shards-size`` cannot start from a sample). ``gpu_tokens``: None takes the GPU tier's size
    ``measured`` holds (the capture's engine reported it), else 0: none. The rest are
    :class:`~kvscope.analysis.sizing.SizingParams`."""

    preset: ModelPreset
    bandwidth: float | None = None
    prefill_tokens_per_second: float | None = None
    measured: MeasuredRates | None = None
    gpu_tokens: int | None = None
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
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.prefill_tokens_per_second is not None and not self.prefill_tokens_per_second > 0:
            raise ValueError(f"prefill rate must be > 0 tokens/s, got "
                             f"{self.prefill_tokens_per_second}")
        if self.gpu_tokens is not None and self.gpu_tokens < 0:
            raise ValueError(f"gpu tokens must be >= 0, got {self.gpu_tokens}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget must be > 0 bytes, got {self.budget_bytes}")
        if not 0 < self.target_share <= 1:
            raise ValueError(f"target share must be in (0, 1], got {self.target_share}")


@dataclass(frozen=True, eq=False)
class Analysis:
    """Result of :func:`analyze`. ``lru``: miss ratio by accesses; ``lru_tokens``: by tokens;
    ``arc``: by accesses (None when skipped). ``bytes_per_block``: for the preset at the trace's
    block size. ``method``: how the LRU curves were built (with the sampling rate if any).
    ``accesses``: of the full stream; ``sample_rate``: the rate the tap sampled the trace at
    (1: every block), ``sampled_accesses``: the accesses the trace holds."""

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
    sample_rate: float = 1.0
    sampled_accesses: int = 0


def _method(trace: AccessTrace, options: AnalyzeOptions) -> str:
    """The curve's method: ``options.method``, with "auto" resolved by the trace's length."""
    if options.method != "auto":
        return options.method
    return "exact" if len(trace) <= options.exact_limit else "shards-rate"


def _histograms(trace: AccessTrace, options: AnalyzeOptions, method: str):
    """(accesses histogram, tokens histogram, reuse distances, method label) by ``method``
    (:func:`_method`'s)."""
    ids, tokens, n = trace.block_ids, trace.tokens, len(trace)
    tapped = trace.sample_rate < 1.0
    if method == "exact" and not tapped:
        d = stack_distances(ids)
        return (DistanceHistogram.from_distances(d), DistanceHistogram.from_distances(d, tokens),
                d[d >= 0], "lru-exact")
    # the tap samples with seed 0: sampling its sample again must use the same hash
    seed = 0 if tapped else options.seed
    if method == "shards-size":
        if tapped:
            raise ValueError(f"--method shards-size cannot start from a capture the tap "
                             f"sampled (1 block in {1 / trace.sample_rate:.4g}); use --method "
                             "exact, or shards-rate with a lower --sample-rate")
        by_access = shards.fixed_size(ids, options.sample_blocks, seed=seed)
        by_token = shards.fixed_size(ids, options.sample_blocks, tokens, seed=seed)
        label = f"lru-shards-fixed-size(blocks={options.sample_blocks}, final R={by_access.rate:.3g})"
    else:
        rate = (trace.sample_rate if method == "exact" else options.sample_rate
                or min(1.0, trace.sample_rate * options.sample_target / max(n, 1)))
        common = dict(seed=seed, sampled_at=trace.sample_rate)
        by_access = shards.fixed_rate(ids, rate, total=trace.full_accesses, **common)
        by_token = shards.fixed_rate(ids, rate, tokens, total=trace.full_tokens, **common)
        label = f"lru-shards-fixed-rate(R={by_access.rate:.3g}" + (
            ", sampled by the tap)" if tapped else ")")
    kept = by_access.sampled_blocks
    # A sample that dropped blocks must keep enough of them (curves of 0 and 1 blocks said a
    # 0.1 GiB tier serves 100%), a small trace's too; a tap's capture is a sample already,
    # whatever its size, and only sampling it again can thin it.
    resampled = not tapped or by_access.rate < trace.sample_rate
    if resampled and kept < shards.MIN_SAMPLED_BLOCKS and kept < len(np.unique(ids)):
        raise ValueError(f"the SHARDS sample holds only {by_access.sampled_blocks} distinct blocks "
                         f"(R={by_access.rate:.3g}), too few for a curve to size a tier from; "
                         f"raise --sample-rate / --sample-blocks or use --method exact")
    # reuse distances for the distribution: the sample's, stretched by 1/R (an estimate)
    rate = by_access.rate
    keep = shards.spatial_hash(ids, seed) < sampling.threshold(rate)
    d = stack_distances(ids[keep])
    return by_access.histogram, by_token.histogram, np.floor(d[d >= 0] / rate), label


def _sampled_reuse(reuse: ReuseStats, trace: AccessTrace) -> ReuseStats:
    """``reuse`` of a trace the tap sampled at rate R, as estimates for the full stream (SHARDS,
    Waldspurger et al., FAST '15): block counts scaled by 1 / R; a reuse share is 1 less the
    first accesses (one per distinct block, scaled by 1 / R) over the full stream's accesses
    (tokens likewise), as the curves count them. The sample's own shares weighted each block
    by its accesses: a hot block the hash left out read 0.335 for the Mooncake trace's 0.366,
    below the curves' ceiling. No shared prefixes: they need every block of a prompt."""
    rate = trace.sample_rate
    first_tokens = float(trace.tokens.sum()) * (1.0 - reuse.token_reuse_share) / rate

    def share(first: float, total: float) -> float:
        return min(1.0, max(0.0, 1.0 - first / total)) if total else 0.0

    return replace(reuse, accesses=trace.full_accesses,
                   unique_blocks=round(reuse.unique_blocks / rate),
                   reused_blocks=round(reuse.reused_blocks / rate),
                   reuse_share=share(reuse.unique_blocks / rate, trace.full_accesses),
                   token_reuse_share=share(first_tokens, trace.full_tokens), top_prefixes=None)


def _rates(options: AnalyzeOptions, block_tokens: int) -> tuple[float, float | None,
                                                                float | None, int,
                                                                dict[str, str]]:
    """(bandwidth bytes/s, prefill tokens/s and KV bytes per block, each None for the
    preset's, GPU prefix cache tokens, where each came from)."""
    measured = options.measured or MeasuredRates()
    bandwidth, bandwidth_from = measured.pick("bandwidth", options.bandwidth, "--bandwidth-gbps")
    prefill, prefill_from = measured.pick("prefill", options.prefill_tokens_per_second,
                                          "--prefill-tokens-per-second")
    block_bytes, block_bytes_from = measured.pick("kv_bytes", None, "")
    sources = {"bandwidth": bandwidth_from or (
        f"assumed: {DEFAULT_BANDWIDTH / 1e9:g} GB/s, about 80% of PCIe 4.0 x16 (no timed "
        "cpu->gpu copy in the input)")}
    gpu_tokens, gpu_from = options.gpu_tokens, "given (--gpu-tokens)"
    if gpu_tokens is None:
        gpu_blocks, gpu_from = measured.pick("gpu", None, "")
        gpu_tokens = int(gpu_blocks or 0) * block_tokens
        gpu_from = gpu_from or "assumed: none (the input does not say; give --gpu-tokens)"
    for name, found in (("prefill", prefill_from), ("kv_bytes", block_bytes_from),
                        ("gpu", gpu_from)):
        if found:
            sources[name] = found
    return bandwidth or DEFAULT_BANDWIDTH, prefill, block_bytes, gpu_tokens, sources


def analyze(trace: AccessTrace, options: AnalyzeOptions) -> Analysis:
    """Reuse statistics, LRU and ARC miss-ratio curves and sizing advice for ``trace``.

    Raises ValueError for invalid options or an empty trace.
    """
    options.validate()
    if len(trace) == 0:
        raise TraceError(f"{trace.source or 'trace'}: no block accesses to analyze")
    resolved = _method(trace, options)
    by_access, by_token, reuse_distances, method = _histograms(trace, options, resolved)
    reuse = reuse_stats(trace, reuse_distances)
    tapped = trace.sample_rate < 1.0
    if tapped:
        reuse = _sampled_reuse(reuse, trace)
    working_set = max(by_access.max_useful_size, 1)
    grid = size_grid(working_set, options.curve_points)
    lru = curve_from_histogram(by_access, grid, method)
    lru_tokens = curve_from_histogram(by_token, grid, method, weight="tokens")
    bandwidth, prefill, block_bytes, gpu_tokens, rate_sources = _rates(options,
                                                                       trace.block_tokens)
    # the capture's transfers and tiers count blocks of its lookups' size (vLLM's block, the
    # engine's)
    params = SizingParams(options.preset, trace.block_tokens, bandwidth,
                          gpu_tokens, options.budget_bytes, options.target_share,
                          prefill_tokens_per_second=prefill, rate_sources=rate_sources,
                          kv_bytes_per_token=block_bytes / trace.block_tokens
                          if block_bytes else None,
                          current_blocks=(options.measured or MeasuredRates()).cpu_blocks)
    sizing = advise(by_token, params, trace.duration)
    notes = []
    # a tap's sample is fixed-rate whatever the method: only shards-rate samples it again
    if options.sample_rate and resolved != "shards-rate":
        notes.append(f"--sample-rate {options.sample_rate:g} was not used: the curve is "
                     f"{method} (the rate is for --method shards-rate, and for auto beyond "
                     f"{options.exact_limit:,} accesses).")
    if options.sample_blocks != AnalyzeOptions.sample_blocks and "fixed-size" not in method:
        notes.append(f"--sample-blocks {options.sample_blocks:,} was not used: the curve is "
                     f"{method} (the sample size is for --method shards-size).")
    if tapped:
        distinct = len(np.unique(trace.block_ids))
        notes.append(f"The tap sampled 1 block in {1 / trace.sample_rate:.4g} by its hash "
                     f"(SHARDS, R={trace.sample_rate:.4g}): the curves are the sample's, scaled "
                     f"to the full stream's {trace.full_accesses:,} block accesses, and block "
                     "counts are estimates; most shared prefixes are not shown (they need every "
                     "block).")
        if options.sample_rate and options.sample_rate > trace.sample_rate:
            notes.append(f"--sample-rate {options.sample_rate:g} is above the tap's "
                         f"{trace.sample_rate:.4g}: a sample cannot hold blocks the tap did not "
                         "keep, so the curve is at the tap's rate.")
        if distinct < shards.MIN_SAMPLED_BLOCKS:
            # a few shared blocks, sampled or not, swing the whole curve: a tryout's 40 vLLM
            # requests of one shared prefix read 0% reuse and "Do not offload" beside a third
            # of their prompt tokens served from cache
            sizing = replace(sizing, offload=None, recommended=None, kv_offloading_size_gib=None,
                             reasons=[], verdict=(
                                 f"Not enough data to size a tier: the tap's sample holds "
                                 f"{distinct:,} distinct block{'s' * (distinct != 1)}, of the "
                                 f"{shards.MIN_SAMPLED_BLOCKS:,} a curve needs; capture longer, "
                                 "or raise the tap's kvscope_block_sample_rate."))
            notes.append(f"The sample holds only {distinct:,} distinct "
                         f"block{'s' * (distinct != 1)}: the curve is "
                         "coarse (capture longer, or raise the tap's kvscope_block_sample_rate).")
    elif reuse.unique_blocks < shards.MIN_SAMPLED_BLOCKS:
        # exact, but of very little traffic: a tryout's 2 requests read "Offload: a CPU tier
        # of 2 blocks serves 50.0%" without a word on how little that rests on
        notes.append(f"The input holds only {reuse.unique_blocks:,} distinct "
                     f"block{'s' * (reuse.unique_blocks != 1)} in {reuse.accesses:,} "
                     f"access{'es' * (reuse.accesses != 1)}: its curve is exact for it, but "
                     "a larger workload's may differ; size from a longer trace or capture.")
    arc = None
    if options.arc_points > 0 and tapped:
        notes.append("No ARC curve: the tap's sample would have to be sampled again for it.")
    elif options.arc_points > 0:
        # at least 1 block: a working set under 6 blocks rounded its first size to 0, which
        # read as a 0-byte cache that hits
        arc_sizes = np.unique(np.maximum(np.linspace(
            working_set / options.arc_points, working_set, options.arc_points).round(),
            1).astype(np.int64))
        arc_rate = min(1.0, options.arc_sample_target / len(trace))
        arc = arc_curve(trace.block_ids, arc_sizes, arc_rate, seed=options.seed)
        notes.append("ARC block hit ratios overstate prefix hits: ARC may evict a block whose "
                     "longer prefixes stay cached, and only leading cached blocks serve tokens.")
    if "kv_bytes" not in rate_sources and rate_sources.get("prefill", "").startswith(
            ("measured:", "modelled:")):
        # the capture's prefill rate (its engine's model) against another model's KV bytes:
        # a tiny model's demo capture without transfers read "do not offload" at llama-3-8b's
        notes.append(f"The prefill rate is the capture's, but the KV bytes per block are "
                     f"preset {options.preset.name}'s, assumed (the capture moved no blocks to "
                     "measure them by): a verdict from two models if the engine's is another; "
                     "give --preset for it.")
    own = params.current_blocks
    if own and own <= params.gpu_blocks:
        notes.append(f"The input's own CPU tier ({own:,} blocks) is no larger than its GPU prefix "
                     f"cache ({params.gpu_blocks:,}): the curve's tier, inclusive (holding the "
                     "GPU's blocks too), serves nothing at that size; the engine's, holding "
                     "other blocks, may serve some.")
    if 0 < gpu_tokens < trace.block_tokens:
        notes.append(f"A GPU prefix cache of {gpu_tokens:,} tokens holds no whole block of "
                     f"{trace.block_tokens:,}: none is assumed.")
    if gpu_tokens == 0 and options.gpu_tokens is None:
        notes.append("No GPU prefix cache assumed: the CPU tier is credited with every reuse "
                     "it holds; give vLLM's 'GPU KV cache size' in tokens (analyze "
                     "--gpu-tokens, dashboard --sizing-gpu-tokens).")
    return Analysis(source=trace.source, accesses=trace.full_accesses,
                    requests=trace.request_count, sample_rate=trace.sample_rate,
                    sampled_accesses=len(trace),
                    duration_seconds=trace.duration, block_tokens=trace.block_tokens,
                    bytes_per_block=params.bytes_per_block, method=method, reuse=reuse,
                    lru=lru, lru_tokens=lru_tokens, arc=arc, sizing=sizing, notes=notes)
