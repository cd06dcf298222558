"""A trace-shaped workload for a real server: a Mooncake-format trace (one hash id per block,
arrival times, prompt and output lengths) as token-id prompts whose shared prefixes are exactly
the trace's, so that a server's prefix cache sees the trace's sharing.

Each hash id becomes a fixed run of ``block_tokens`` token ids, drawn from a generator seeded
with the id (the same id gives the same tokens in every request, in every process); a prompt is
its blocks' runs one after another, cut to its length scaled from the trace's 512-token blocks
to ``block_tokens``. Token ids are drawn from ``[FIRST_TOKEN, vocab)``, so ids below it (0:
what :data:`NEVER_IN_PROMPTS` names) never occur in a prompt.

:func:`predicted_hits` says how many prompt tokens a server's prefix cache (vLLM's automatic
prefix caching: full blocks of ``cache_block`` tokens, keyed by their whole prefix; at least
one prompt token computed) serves each request, replayed one at a time with a cache large enough
to hold them all. Pure: requests in, lists out; imports the standard library and
:mod:`kvscope.engine.workload` (its :class:`~kvscope.engine.workload.Request` and Mooncake
reader).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvscope.engine.workload import MOONCAKE_BLOCK_TOKENS, Request

FIRST_TOKEN = 3  # token ids below it never occur in a prompt (bos, eos, padding in most vocabs)
NEVER_IN_PROMPTS = 0  # a token id no prompt holds: generate it, and no later prompt matches it
SALT_SHIFT = 64  # a salt goes above the 64-bit hash ids it changes


def block_token_ids(hash_id: int, block_tokens: int, vocab: int) -> list[int]:
    """The ``block_tokens`` token ids of the block ``hash_id`` (each in [FIRST_TOKEN, vocab)).
    Raises ValueError for a vocab of FIRST_TOKEN + 1 ids or fewer or ``block_tokens`` < 1."""
    if vocab <= FIRST_TOKEN + 1 or block_tokens < 1:
        raise ValueError(f"need a vocab over {FIRST_TOKEN + 1} ids and blocks of 1 token or "
                         f"more, not vocab {vocab}, block_tokens {block_tokens}")
    rng = random.Random(hash_id)  # seeding by an int is stable across Python versions
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(block_tokens)]


def prompt_length(request: Request, block_tokens: int,
                  source_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> int:
    """``request``'s prompt length scaled from blocks of ``source_block_tokens`` (a Mooncake
    trace's 512) to ``block_tokens`` (at least 1 token, at most its blocks' tokens)."""
    scaled = round(request.prompt_tokens * block_tokens / source_block_tokens)
    return max(1, min(scaled, len(request.block_hashes) * block_tokens))


def prompt_token_ids(request: Request, block_tokens: int, vocab: int,
                     cache: dict[int, list[int]] | None = None, *, salt: int = 0,
                     source_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """``request``'s prompt as token ids (see the module), its length scaled from blocks of
    ``source_block_tokens``. ``cache``: hash id -> its tokens, filled as blocks are made
    (replaying a trace makes each block once). ``salt``: another run of the same ids (0: the
    ids' own tokens; any other value gives every block other tokens, so that two runs share
    no prefix)."""
    cache = {} if cache is None else cache
    length = prompt_length(request, block_tokens, source_block_tokens)
    out: list[int] = []
    for h in request.block_hashes:
        if len(out) >= length:
            break
        tokens = cache.get(h)
        if tokens is None:
            tokens = cache[h] = block_token_ids(h + (salt << SALT_SHIFT), block_tokens, vocab)
        out += tokens
    return out[:length]


def predicted_hits(requests: Sequence[Request], block_tokens: int, cache_block: int) -> list[int]:
    """Prompt tokens an unbounded prefix cache of ``cache_block``-token blocks serves each of
    ``requests``, replayed in order, one at a time: the leading blocks whose whole prefix of
    hash ids an earlier request cached, as far as the tokens it cached reach (a server caches
    the full ``cache_block`` blocks of each prompt), capped at the prompt's length less one
    token, in whole cache blocks. ``block_tokens`` must be a multiple of ``cache_block``
    (ValueError otherwise), so that a trace block is whole cache blocks."""
    if cache_block < 1 or block_tokens % cache_block:
        raise ValueError(f"block_tokens {block_tokens} must be a multiple of the cache's "
                         f"{cache_block}-token blocks")
    cached: dict[tuple[int, ...], int] = {}  # prefix of hash ids -> its last block's tokens cached
    out = []
    for request in requests:
        ids = request.block_hashes
        length = prompt_length(request, block_tokens)
        found = 0
        for i in range(len(ids)):
            tokens = cached.get(ids[:i + 1], 0)
            found += tokens
            if tokens < block_tokens:  # a partly cached block ends what follows it
                break
        out.append(min(found, length - 1) // cache_block * cache_block)
        whole = length // cache_block * cache_block  # the full cache blocks this prompt leaves
        for i in range(len(ids)):
            tokens = max(0, min(block_tokens, whole - i * block_tokens))
            if tokens == 0:
                break
            key = ids[:i + 1]
            cached[key] = max(cached.get(key, 0), tokens)
    return out
