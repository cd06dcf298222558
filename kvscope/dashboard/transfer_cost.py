"""Transfer seconds charged to the offload tier whose blocks they moved.

A promotion from a tier below the one next to the GPU may be staged: the reference engine and
vLLM's tiering manager copy a disk block ``disk->cpu``, then ``cpu->gpu``. The second leg is
the cpu tier's copy but the disk tier's cost: its tokens count as ``disk`` in the prefill
seconds saved. Charging every ``cpu->gpu`` second to cpu made the cpu tier look dearer and the
disk tier cheaper than they were. An engine may also copy ``disk->gpu`` directly; how much of
each ``x->gpu`` leg was staged is therefore read from the blocks each leg moved, never assumed.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvscope.dashboard.series import TIER_RANK, is_promotion

GPU = "gpu"


def _pair(direction: str) -> tuple[str, str]:
    src, _, dst = direction.partition("->")
    return src, dst


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
