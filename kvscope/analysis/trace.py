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

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last access (0 for fewer than two)."""
        return float(self.times[-1] - self.times[0]) if len(self.times) > 1 else 0.0
