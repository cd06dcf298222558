"""The analysis input: a flat stream of block accesses (:class:`AccessTrace`), as its readers
(``inputs.py``, ``capture_reader.py``) produce it and every analysis reads it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class AccessTrace:
    """Block accesses of a workload, first to last, as parallel arrays of length ``accesses``.

    ``block_ids``: uint64, the prefix hash of each accessed block (equal ids = reusable KV).
    ``times``: float64 seconds from the workload's start (the request's arrival).
    ``tokens``: int64 tokens each access covers (``block_tokens``, less for a partial last block).
    ``requests``: int64 index of the request making the access (0-based, arrival order).
    ``depths``: int64 position of the block in its request's prompt (0 = first block).
    ``block_tokens``: tokens per full block. ``prompt_tokens``: total prompt tokens of all
    requests (may exceed ``tokens.sum()`` when a trace lists fewer blocks than a prompt needs).
    ``source``: where the trace came from, for reports.

    A spatially sampled trace (a vLLM tap's capture; SHARDS, :mod:`kvscope.sampling`) holds the
    accesses to the sampled blocks only: ``sample_rate`` is the rate (0-1; 1: every access),
    ``total_accesses`` and ``total_tokens`` the full stream's block accesses and their tokens
    (None: the trace's own). ``request_count`` and ``prompt_tokens`` are the full stream's.
    """

    block_ids: np.ndarray
    times: np.ndarray
    tokens: np.ndarray
    requests: np.ndarray
    depths: np.ndarray
    block_tokens: int
    request_count: int
    prompt_tokens: int
    source: str = ""
    sample_rate: float = 1.0
    total_accesses: int | None = None
    total_tokens: int | None = None

    @property
    def full_accesses(self) -> int:
        """Block accesses of the full stream (the trace's own unless sampled)."""
        return len(self) if self.total_accesses is None else self.total_accesses

    @property
    def full_tokens(self) -> int:
        """Tokens of the full stream's block accesses (the trace's own unless sampled)."""
        return int(self.tokens.sum()) if self.total_tokens is None else self.total_tokens

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last access (0 for fewer than two)."""
        return float(self.times[-1] - self.times[0]) if len(self.times) > 1 else 0.0
