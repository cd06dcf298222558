"""What one request did (:class:`RequestOutcome`) and what prefill writes into a block."""

from __future__ import annotations

from dataclasses import dataclass, field


def prefill_value(block_hash: int) -> float:
    """The value prefill writes into every element of a recomputed block.

    An integer below 2048, so float16 holds it exactly; a promoted block must carry its own.
    """
    return float(block_hash % 2039)


@dataclass
class RequestOutcome:
    """What one request did. ``tokens``: dict[source, tokens]; ``block_hits``: dict[tier, block
    accesses that found the block there]; ``block_accesses``: blocks looked up. Seconds:
    ``lookup``, ``prefill``, ``promotion_wait`` and ``ttft`` (None until the request's CUDA
    copies are timed; see :meth:`OffloadEngine.poll`)."""

    tokens: dict[str, int]
    block_accesses: int
    block_hits: dict[str, int]
    lookup: float
    prefill: float
    queueing: float = 0.0
    output_tokens: int = 0
    promotion_wait: float | None = None
    ttft: float | None = None
    failed_blocks: int = 0
    moved: list[int] = field(default_factory=list, repr=False)  # blocks per copy phase
    results: list = field(default_factory=list, repr=False)

    @property
    def service_seconds(self) -> float:
        """Seconds the engine was busy before the first token (TTFT less queueing)."""
        return self.lookup + (self.promotion_wait or 0.0) + self.prefill
