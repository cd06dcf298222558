"""CPU tier sizing: how big a host-RAM KV tier to give an engine, and whether to give one at all.

The model, stated so it can be checked:

- Tiers are LRU and the CPU tier is *inclusive* (vLLM's native offloading stores every
  computed block to host memory): a reuse at stack distance ``d`` is served by the GPU prefix
  cache when ``d < G`` and promoted from the CPU tier when ``G <= d < C``, with ``G`` and ``C``
  the tiers' capacities in blocks. So the CPU tier adds ``H(max(C, G)) - H(G)`` of the prompt
  tokens, ``H`` being the token-weighted LRU hit ratio (Mattson et al. 1970). Under LRU with
  prefix hashes a cached block's whole prefix is cached too, so block hits are prefix hits.
- A promoted token saves its prefill, ``1 / prefill_tokens_per_second`` seconds (measured by
  the capture when it can, else the preset's cost model), and costs ``bytes_per_token /
  bandwidth`` seconds of host-to-device copy (bytes measured by the capture when it can, else
  the preset's; bandwidth measured, given, or assumed:
  :data:`DEFAULT_BANDWIDTH`); the advice's assumptions say which (:mod:`~kvscope.analysis.rates`).
- Every recomputed block is stored to the CPU tier once (device-to-host, off the critical path).

The *knee* is where the CPU tier's gain curve bends most (Kneedle: Satopää, Albrecht, Irwin &
Raghavan, "Finding a 'Kneedle' in a Haystack", ICDCS Workshops 2011, on the curve normalised to
the unit square), over the sizes from the GPU cache's to the trace's working set: a property of
the workload, which a budget does not move (it may lie beyond the budget). The *recommendation*
is the smallest affordable size that buys ``target_share`` of the gain the largest affordable
size (the budget, or the working set) would buy. The curve runs to the working set, past the
budget, so that it shows what a larger budget would buy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from kvscope.analysis.mrc import DistanceHistogram, size_grid
from kvscope.engine.presets import ModelPreset

GIB = 1 << 30
# About 80% of PCIe 4.0 x16's 31.5 GB/s per direction (PCI-SIG): what pinned host-to-device
# copies commonly reach. Replace with the agent's measured promotion bandwidth when there is one.
DEFAULT_BANDWIDTH = 25e9


def seconds(x: float) -> str:
    """Seconds to 4 significant digits, never in scientific notation ("0.04157 s",
    "12350 s"): the report and the verdict say a saving alike."""
    return f"{np.format_float_positional(x, precision=4, fractional=False, trim='-')} s"


def blocks_text(n: float) -> str:
    """``n`` blocks in words: "1 block", "2,438 blocks"."""
    return f"{n:,.0f} block" + ("" if n == 1 else "s")


def size_text(n_bytes: float) -> str:
    """A tier's size in GiB to 2 decimals, in MiB under 0.01 GiB and in bytes under 0.1 MiB (a
    tier of 2 MiB read "0.00 GiB", as if it were none)."""
    if n_bytes < 2**20 / 10:
        return f"{n_bytes:,.0f} bytes"
    if n_bytes < GIB / 100:
        return f"{n_bytes / 2**20:,.1f} MiB"
    return f"{n_bytes / GIB:,.2f} GiB"


def micro(x: float) -> str:
    """Seconds ``x`` as microseconds to 3 significant digits, never in scientific notation
    ("5.24 us", "2050 us")."""
    return f"{np.format_float_positional(x * 1e6, precision=3, fractional=False, trim='-')} us"


@dataclass(frozen=True)
class SizingParams:
    """``preset``: KV shape and prefill cost. ``block_tokens``: tokens per block of the trace.
    ``bandwidth``: host-to-device bytes/s. ``gpu_tokens``: GPU prefix-cache capacity, tokens
    (vLLM logs it as "GPU KV cache size"). ``budget_bytes``: most host RAM to give the tier
    (None: no limit). ``target_share``: share of the affordable gain to recommend (0-1).
    ``min_reuse_share``: below this token reuse share, prompts count as unique.
    ``min_gain``: below this token hit share, a CPU tier is not worth having.
    ``prefill_tokens_per_second``: None: the preset's. ``kv_bytes_per_token``: KV bytes of one
    token, None: the preset's. ``current_blocks``: the CPU tier the input's engine has, blocks
    (None: not known), to be evaluated beside the recommendation. ``rate_sources``: where
    ``bandwidth``, the prefill rate and the
    KV bytes and ``gpu_tokens`` came from (``bandwidth``, ``prefill``, ``kv_bytes``, ``gpu`` ->
    "measured: ...", "given", "assumed: ..."), for the report."""

    preset: ModelPreset
    block_tokens: int
    bandwidth: float = DEFAULT_BANDWIDTH
    gpu_tokens: int = 0
    budget_bytes: float | None = None
    target_share: float = 0.9
    min_reuse_share: float = 0.05
    min_gain: float = 0.02
    prefill_tokens_per_second: float | None = None
    kv_bytes_per_token: float | None = None
    current_blocks: int | None = None
    rate_sources: dict[str, str] = field(default_factory=dict)

    @property
    def prefill_rate(self) -> float:
        """Prefill tokens/s: the given one, else the preset's."""
        return self.prefill_tokens_per_second or self.preset.prefill_tokens_per_second

    @property
    def bytes_per_token(self) -> float:
        """KV bytes of one token: the given ones, else the preset's."""
        return self.kv_bytes_per_token or self.preset.bytes_per_token()

    @property
    def bytes_per_block(self) -> int:
        return round(self.bytes_per_token * self.block_tokens)

    @property
    def gpu_blocks(self) -> int:
        return self.gpu_tokens // self.block_tokens


@dataclass(frozen=True)
class SizePoint:
    """What a CPU tier of ``blocks`` blocks (``bytes``) would do over the whole trace.
    Shares are of all prompt tokens (0-1); seconds are totals over the trace."""

    blocks: int
    bytes: int
    token_hit_share: float
    cpu_token_hit_share: float
    prefill_seconds_saved: float
    transfer_seconds: float


@dataclass(frozen=True)
class SizingAdvice:
    """The advice. ``offload``: whether a CPU tier pays (None: the input is too thin to say).
    ``reasons``: plain sentences why not (empty when it pays or cannot be said).
    ``recommended``: None when there is nothing to size; ``knee``: None when the gain curve
    bends nowhere above the GPU cache's size (it may lie beyond the budget:
    ``assumptions["budget_bytes"]``).
    ``kv_offloading_size_gib``: vLLM ``--kv-offloading-size`` for ``recommended`` (GiB, rounded
    up to 0.1, or finer within the budget: :func:`flag_gib`). ``offload_bytes_per_second``:
    average device-to-host store traffic at that size (None: the trace spans no time).
    ``current``: what the input's own CPU tier (``SizingParams.current_blocks``) does by the
    same model, None when not known.
    ``curve``: every evaluated size, ascending."""

    offload: bool | None
    verdict: str
    reasons: list[str]
    recommended: SizePoint | None
    kv_offloading_size_gib: float | None
    knee: SizePoint | None
    gpu_token_hit_share: float
    reuse_token_share: float
    offload_bytes_per_second: float | None
    curve: list[SizePoint] = field(default_factory=list)
    assumptions: dict = field(default_factory=dict)
    current: SizePoint | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def kneedle(x: np.ndarray, y: np.ndarray) -> int | None:
    """Index of the knee of an increasing curve: the largest ``y_n - x_n`` after scaling both to
    [0, 1] (Satopää et al. 2011). None for a flat curve, one of under 3 points, or one with no
    point above its chord (a straight or convex curve bends nowhere: its largest difference
    would be an end point)."""
    if len(x) < 3 or y[-1] <= y[0] or x[-1] <= x[0]:
        return None
    xn = (x - x[0]) / (x[-1] - x[0])
    yn = (y - y[0]) / (y[-1] - y[0])
    i = int(np.argmax(yn - xn))
    return i if yn[i] - xn[i] > 1e-9 else None


def flag_gib(n_bytes: float, budget_bytes: float | None = None) -> float:
    """GiB for vLLM's ``--kv-offloading-size`` (a float of GiB) that holds ``n_bytes``:
    rounded up to 0.1 GiB, or to the first finer step (0.01, 0.001, ...) that stays within
    ``budget_bytes`` (rounding 1 MiB up to 0.1 GiB gave 50 times a 2 MiB budget)."""
    for digits in range(1, 7):
        step = 10.0 ** -digits
        gib = round(math.ceil(n_bytes / GIB / step - 1e-9) * step, digits)
        if budget_bytes is None or gib * GIB <= budget_bytes:
            return gib
    return n_bytes / GIB


def _smallest_size(histogram: DistanceHistogram, hit_ratio: float) -> int:
    """Smallest LRU size (blocks) whose hit ratio reaches ``hit_ratio`` (assumed reachable)."""
    cumulative = np.cumsum(histogram.hits) / histogram.total
    return int(np.searchsorted(cumulative, hit_ratio - 1e-12)) + 1


def advise(histogram: DistanceHistogram, params: SizingParams, duration_seconds: float,
           points: int = 256) -> SizingAdvice:
    """Size the CPU tier from a token-weighted stack-distance ``histogram`` (LRU).

    ``duration_seconds``: the trace's span (for average store traffic). Pure: no I/O.
    """
    preset, g = params.preset, params.gpu_blocks
    bpb, bpt = params.bytes_per_block, params.bytes_per_token
    total = histogram.total
    working_set = max(histogram.max_useful_size, 1)
    budget_blocks = (working_set if params.budget_bytes is None
                     else max(0, int(params.budget_bytes // bpb)))
    # the curve runs to the working set, and as finely up to the budget as it would stop there
    top = max(1, min(budget_blocks, working_set), g)
    sizes = np.unique(np.concatenate((size_grid(top, points),
                                      size_grid(max(working_set, g), points), [max(g, 1)])))
    gpu_hit = float(histogram.hit_ratio([g])[0])
    reuse = float(histogram.hit_ratio([working_set])[0])

    def points(sizes) -> list[SizePoint]:  # an inclusive tier of each size, over the GPU's
        hit = histogram.hit_ratio(np.maximum(sizes, g))
        promoted = (hit - gpu_hit) * total
        return [SizePoint(int(s), int(s) * bpb, float(h), float(h - gpu_hit),
                          float(p / params.prefill_rate), float(p * bpt / params.bandwidth))
                for s, h, p in zip(sizes, hit, promoted)]

    curve = points(sizes)
    affordable = [p for p in curve if p.blocks <= budget_blocks]
    best_gain = max((p.cpu_token_hit_share for p in affordable), default=0.0)
    unlimited_gain = reuse - gpu_hit

    reasons = []
    if reuse < params.min_reuse_share:
        reasons.append(f"Prompts are nearly all unique: only {reuse:.1%} of prompt tokens are ever "
                       f"reused, so no cache of any size can serve more.")
    recompute_s, promote_s = 1.0 / params.prefill_rate, bpt / params.bandwidth
    if promote_s >= recompute_s:
        reasons.append(f"Promotions are slower than recomputing: copying one token's KV "
                       f"({bpt:,.0f} bytes at {params.bandwidth / 1e9:.3g} GB/s) takes "
                       f"{micro(promote_s)}, prefill takes {micro(recompute_s)}.")
    if not reasons and best_gain < params.min_gain:
        if unlimited_gain < params.min_gain:
            reasons.append(f"The GPU prefix cache ({params.gpu_tokens:,} tokens) already serves "
                           f"{gpu_hit:.1%} of the {reuse:.1%} reusable prompt tokens; a CPU tier "
                           f"adds at most {unlimited_gain:.1%}.")
        elif not budget_blocks:  # a 70B model's block is 160 MB: it was recommended anyway
            reasons.append(f"The budget holds no block: {size_text(params.budget_bytes)} of "
                           f"host RAM is less than one block of {params.block_tokens:,} tokens "
                           f"({size_text(bpb)}).")
        else:
            need = _smallest_size(histogram, gpu_hit + params.min_gain)
            reasons.append(f"Reuse is too far apart for the budget: "
                           f"{params.budget_bytes / GIB:.3g} GiB of host RAM adds only "
                           f"{best_gain:.1%} token hits; {params.min_gain:.0%} needs about "
                           f"{flag_gib(need * bpb):g} GiB.")

    knee = None
    # over the sizes the tier adds to: below the GPU cache's an inclusive tier serves nothing,
    # and that flat start made the first point (1 block, 0%) the knee of a convex curve; up to
    # the working set whatever the budget, so that the knee is the workload's (over the
    # affordable sizes alone a budget moved it: 38,334 blocks without one, 14,080 with 40 GiB)
    tier = [p for p in curve if p.blocks >= g]
    if unlimited_gain > 0:
        i = kneedle(np.array([p.blocks for p in tier], dtype=np.float64),
                    np.array([p.cpu_token_hit_share for p in tier]))
        knee = None if i is None else tier[i]
    recommended = None
    if not reasons:
        recommended = next(p for p in affordable
                           if p.cpu_token_hit_share >= params.target_share * best_gain)
    stored = (1.0 - (recommended.token_hit_share if recommended else gpu_hit)) * total * bpt
    offload = not reasons
    if offload:
        # the share at the recommended size, beside that size (a tryout read "a 0.1 GiB tier
        # serves 28.7%" where 0.1 is the flag rounded up from 0.07 GiB, which serves more)
        verdict = (f"Offload: a CPU tier of {blocks_text(recommended.blocks)} "
                   f"({size_text(recommended.bytes)}) serves "
                   f"{recommended.cpu_token_hit_share:.1%} of prompt tokens, saving "
                   f"{seconds(recommended.prefill_seconds_saved)} of prefill for "
                   f"{seconds(recommended.transfer_seconds)} of transfers; vLLM "
                   f"--kv-offloading-size {flag_gib(recommended.bytes, params.budget_bytes):g}.")
    else:
        verdict = "Do not offload. " + reasons[0]  # a sentence of its own, as in ``reasons``
    prefill_source = params.rate_sources.get(
        "prefill", f"assumed: preset {preset.name}'s cost model")
    kv_bytes_source = params.rate_sources.get(
        "kv_bytes", f"assumed: preset {preset.name}'s KV shape")
    assumed = not {"prefill", "kv_bytes"} <= params.rate_sources.keys()  # taken from the preset
    return SizingAdvice(
        offload=offload, verdict=verdict, reasons=reasons, recommended=recommended,
        kv_offloading_size_gib=(flag_gib(recommended.bytes, params.budget_bytes)
                                if recommended else None),
        knee=knee, gpu_token_hit_share=gpu_hit, reuse_token_share=reuse,
        offload_bytes_per_second=stored / duration_seconds if duration_seconds > 0 else None,
        curve=curve,
        # the preset named only where something was taken from it (a tryout read
        # "llama-3-8b", analyze's default, for a capture whose figures were all measured)
        assumptions={"preset": preset.name if assumed else None,
                     "block_tokens": params.block_tokens,
                     "bytes_per_block": bpb, "bandwidth_bytes_per_second": params.bandwidth,
                     "prefill_tokens_per_second": params.prefill_rate,
                     "bandwidth_source": params.rate_sources.get("bandwidth", "given"),
                     "prefill_source": prefill_source, "kv_bytes_source": kv_bytes_source,
                     "gpu_tokens": params.gpu_tokens,
                     "gpu_tokens_source": params.rate_sources.get("gpu", "given"),
                     "budget_bytes": params.budget_bytes,
                     "target_share": params.target_share, "cpu_tier": "inclusive LRU"},
        current=points([params.current_blocks])[0] if params.current_blocks else None)
