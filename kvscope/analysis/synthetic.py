"""Large seeded synthetic block-access streams with prefix reuse, generated with numpy.

Shaped like chat traffic at the block level: a request either reuses a shared *document*
prefix (a system prompt, a conversation so far) followed by a few blocks of its own, or is a
one-off prompt of blocks never seen again. Document popularity is Zipf-like and drifts over
time (the popular set rotates), so reuse distances spread over many cache sizes. Millions of
accesses take a second or two, which is what the SHARDS accuracy test and the benchmark need;
the engine's :func:`kvscope.engine.workload.synthetic` produces requests, not bulk arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamShape:
    """``documents``: shared prefixes. ``alpha``: Zipf exponent of their popularity.
    ``doc_blocks``: (min, max) blocks of a document. ``own_blocks``: (min, max) blocks a
    reusing request adds of its own. ``one_off_share``: share of requests that share nothing,
    with ``one_off_blocks`` (min, max) blocks. ``drift_requests``: every this many requests the
    popularity ranking shifts by one document."""

    documents: int = 200_000
    alpha: float = 0.8
    doc_blocks: tuple[int, int] = (1, 32)
    own_blocks: tuple[int, int] = (0, 8)
    one_off_share: float = 0.2
    one_off_blocks: tuple[int, int] = (1, 24)
    drift_requests: int = 20


def prefix_stream(accesses: int, seed: int = 0, shape: StreamShape = StreamShape()) -> np.ndarray:
    """Exactly ``accesses`` block ids (uint64), same seed same stream.

    Document ``d`` owns ids ``d * M .. d * M + len(d) - 1`` with ``M = doc_blocks[1]``; private
    and one-off blocks take fresh ids above ``documents * M``.
    """
    rng = np.random.default_rng(seed)
    width = shape.doc_blocks[1]
    doc_len = rng.integers(shape.doc_blocks[0], width + 1, shape.documents)
    ranks = np.arange(1, shape.documents + 1, dtype=np.float64)
    popularity = ranks ** -shape.alpha
    popularity /= popularity.sum()
    mean = ((1 - shape.one_off_share) * (np.mean(shape.doc_blocks) + np.mean(shape.own_blocks))
            + shape.one_off_share * np.mean(shape.one_off_blocks))
    requests = int(accesses / mean * 1.2) + 16
    one_off = rng.random(requests) < shape.one_off_share
    rank = rng.choice(shape.documents, size=requests, p=popularity)
    doc = (rank + np.arange(requests) // shape.drift_requests) % shape.documents
    shared = np.where(one_off, 0, doc_len[doc])
    own = np.where(one_off, rng.integers(shape.one_off_blocks[0], shape.one_off_blocks[1] + 1, requests),
                   rng.integers(shape.own_blocks[0], shape.own_blocks[1] + 1, requests))
    lengths = shared + own
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    total = int(lengths.sum())
    if total < accesses:  # cannot happen with the 1.2 margin for sane shapes; be exact anyway
        raise ValueError("stream shape produced too few accesses; widen the margin")
    position = np.arange(total) - np.repeat(starts, lengths)
    in_prefix = position < np.repeat(shared, lengths)
    ids = np.repeat(doc.astype(np.int64) * width, lengths) + position
    fresh = np.cumsum(~in_prefix) - 1 + shape.documents * width
    ids = np.where(in_prefix, ids, fresh)
    return ids[:accesses].astype(np.uint64)
