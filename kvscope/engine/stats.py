"""Engine counters and the replay summary (the ``kvscope replay --json`` object).

Two hit ratios, both 0-1:

- **block hit ratio**: block accesses that found the block resident in some tier / block
  accesses (each request's blocks counted first to last, in trace order);
- **prefix hit ratio**: prompt tokens served from a cache tier / prompt tokens. Only the
  leading contiguous run of cached blocks can serve tokens (a last, partial block weighs
  less than a full one, so the two ratios are not ordered).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from kvscope.percentiles import value_percentiles
from kvscope.vocabulary import LOCAL_TIERS, TOKEN_SOURCES

DIRECTIONS = ("cpu->disk", "gpu->cpu", "disk->cpu", "cpu->gpu")  # in transfer phase order
# TTFTs kept for the summary's percentiles: the latest this many requests' (about 32 MB), so an
# endless run (the demo's synthetic stream, 20 requests a second) does not grow without bound
MAX_TTFTS = 1_000_000


@dataclass
class EngineStats:
    """Running totals of one engine. Counts are blocks unless named otherwise.

    ``block_hits``: dict[tier, block accesses that found the block there first].
    ``tokens``: dict[source, prompt tokens]. ``evictions``: dict[tier, blocks that left it];
    ``offloaded``: dict[tier, of those, blocks that went on to the next tier down].
    ``moved``: dict["src->dst", blocks copied]; ``seconds``: dict["src->dst", seconds spent].
    ``errors``: dict[reason, failed block copies]. ``ttfts``: seconds, one per request, the
    latest :data:`MAX_TTFTS` (the summary's TTFT percentiles and mean are theirs).
    """

    requests: int = 0
    block_accesses: int = 0
    prompt_tokens: int = 0
    block_hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOCAL_TIERS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_SOURCES, 0))
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOCAL_TIERS, 0))
    offloaded: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOCAL_TIERS, 0))
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))
    errors: dict[str, int] = field(default_factory=dict)
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_TTFTS))

    def decisions(self) -> dict:
        """The counters that depend only on placement decisions (not on timing or faults):
        equal for the engine with payload and the simulator on the same input."""
        return {"requests": self.requests, "block_accesses": self.block_accesses,
                "block_hits": dict(self.block_hits), "tokens": dict(self.tokens),
                "evictions": dict(self.evictions), "offloaded": dict(self.offloaded),
                "moved": dict(self.moved)}

    def summary(self, block_bytes: int, wall_seconds: float,
                tiers: Collection[str] = LOCAL_TIERS) -> dict:
        """The replay summary: a JSON-ready dict (ratios 0-1, bytes, seconds), of the engine's
        ``tiers`` only: a tier that is off has no hit ratio, tokens, transfers or evictions,
        not ones of 0."""
        accesses = self.block_accesses or 1
        prompt = self.prompt_tokens or 1
        served = self.tokens["gpu"] + self.tokens["cpu"] + self.tokens["disk"]
        on = [d for d in DIRECTIONS if set(d.split("->")) <= set(tiers)]
        return {
            "requests": self.requests,
            "block_accesses": self.block_accesses,
            "block_hit_ratio": sum(self.block_hits.values()) / accesses,
            "block_hit_ratio_by_tier": {t: n / accesses for t, n in self.block_hits.items()
                                        if t in tiers},
            "prefix_hit_ratio": served / prompt,
            "prompt_tokens": self.prompt_tokens,
            "tokens_by_source": {s: n for s, n in self.tokens.items()
                                 if s in tiers or s not in LOCAL_TIERS},
            "transfers": {d: {"blocks": self.moved[d], "bytes": self.moved[d] * block_bytes,
                              "seconds": self.seconds[d]} for d in on},
            "evictions": {t: n for t, n in self.evictions.items() if t in tiers},
            "evictions_offloaded": {t: n for t, n in self.offloaded.items() if t in tiers},
            "errors": dict(self.errors),
            # None when no request finished: not measured
            "ttft_seconds": {**value_percentiles(self.ttfts),
                             "mean": sum(self.ttfts) / len(self.ttfts) if self.ttfts else None},
            "wall_seconds": wall_seconds,
        }
