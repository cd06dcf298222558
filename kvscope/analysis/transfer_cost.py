"""Transfer seconds charged to the offload tier whose blocks they moved.

A promotion from a tier below the one next to the GPU may be staged: the reference engine and
vLLM's tiering manager copy a disk block ``disk->cpu``, then ``cpu->gpu``. The second leg is
the cpu tier's copy but the disk tier's cost: its tokens count as ``disk`` in the prefill
seconds saved. Charging every ``cpu->gpu`` second to cpu made the cpu tier look dearer and the
disk tier cheaper than they were. An engine may also copy ``disk->gpu`` directly; how much of
each ``x->gpu`` leg was staged is therefore read from the blocks each leg moved, never assumed.
An offload is the cost of the tier it stores into (``cpu->disk``: disk's). The dashboard's
headline and ``kvscope compare`` charge tiers alike, through :func:`seconds_by_tier`.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvscope.vocabulary import TIERS

GPU = "gpu"
TIER_RANK = {tier: rank for rank, tier in enumerate(TIERS)}  # 0: the GPU, then farther away


def _pair(direction: str) -> tuple[str, str]:
    src, _, dst = direction.partition("->")
    return src, dst


def farther_tier(direction: str) -> str:
    """Of a copy's two tiers (``"cpu->disk"``), the one farther from the GPU (``disk``): the
    offload tier whose promotion or offload it is."""
    return max(_pair(direction), key=lambda tier: TIER_RANK.get(tier, -1))


def is_promotion(direction: str) -> bool:
    """True for a copy toward the GPU ("cpu->gpu", "disk->cpu"), False for offloads."""
    src, dst = _pair(direction)
    return TIER_RANK.get(dst, 9) < TIER_RANK.get(src, 9)


def promotion_seconds_by_tier(seconds: Mapping[str, float],
                              blocks: Mapping[str, float]) -> dict[str, float]:
    """Seconds of promotions (copies toward the GPU) by the offload tier the blocks came from.

    ``seconds``: transfer seconds by direction ("disk->cpu"), ``blocks``: blocks copied by
    direction, both over the same window. A leg into a tier other than the GPU (staging,
    ``disk->cpu``) is its source's. Of a leg ``x->gpu``, each lower tier ``y`` is charged the
    share of its blocks that ``y->x`` staged, ``blocks[y->x] / blocks[x->gpu]`` (the shares
    scaled down together where they add up to more than 1: blocks staged and not yet, or
    never, promoted); ``x`` keeps the rest. Tiers charged nothing are absent.
    """
    out: dict[str, float] = {}
    for direction, spent in seconds.items():
        if not is_promotion(direction) or not spent > 0:
            continue
        src, dst = _pair(direction)
        shares = {}
        if dst == GPU and blocks.get(direction, 0.0) > 0:
            for leg, staged in blocks.items():
                below, into = _pair(leg)
                if into == src and staged > 0 and TIER_RANK.get(below, 9) > TIER_RANK.get(src, 9):
                    shares[below] = staged / blocks[direction]
        scale = max(1.0, sum(shares.values()))
        for tier, share in shares.items():
            out[tier] = out.get(tier, 0.0) + spent * share / scale
        own = spent * (1 - sum(shares.values()) / scale)
        if own > 0:
            out[src] = out.get(src, 0.0) + own
    return out


def seconds_by_tier(seconds: Mapping[str, float],
                    blocks: Mapping[str, float]) -> dict[str, float]:
    """Transfer seconds by the offload tier they served: promotions as
    :func:`promotion_seconds_by_tier` charges them, an offload to the tier it stores into
    (``cpu->disk`` is the disk tier's, not the cpu tier's). A tier with a promotion in
    ``seconds`` reads at least 0 (timed, none in the window); tiers with neither are absent."""
    out = promotion_seconds_by_tier(seconds, blocks)
    for direction, timed in seconds.items():
        src, dst = _pair(direction)
        if is_promotion(direction):
            out.setdefault(src, 0.0)
        else:
            out[dst] = out.get(dst, 0.0) + timed
    return out
