"""How often prompts repeat a prefix, from the block hashes the lookups carry: the guide's "prompts
nearly all unique" question. The tokens the tiers served answer it only as far as the tiers were
big enough: a trace whose reuse spans more blocks than the tiers hold reads as unique there
(the Mooncake conversation trace on the demo's tiers: 4% of tokens served, 37% of its blocks
reused). Here a block counts as reused when its prefix hash was seen before, whatever any tier
held.
"""

from __future__ import annotations

from collections import OrderedDict

from kvscope import events as ev
from kvscope.vocabulary import PREFIX_REUSE

# distinct sampled prefixes remembered (LRU): about 16 MiB; at the vLLM tap's default sampling
# (1 block in 16) a reuse distance of two million blocks, 32 million tokens of 16-token blocks
MAX_PREFIXES = 1 << 17


class PrefixReuse:
    """Counts the blocks of each :class:`~kvscope.events.Lookup` that carries ``block_hashes``
    as ``seen`` (its prefix hash is among the last ``max_prefixes`` distinct hashes seen, an LRU
    list) or ``new``. A spatially sampled lookup's block stands for 1 / ``block_sample_rate``
    blocks (SHARDS, Waldspurger et al., FAST'15: sampling by hash keeps every access to a
    sampled prefix, so its repeats are kept too), and the list is then the LRU list of a
    cache 1 / rate times larger. Not thread-safe: the pipeline calls it under its lock.

    Lookups without hashes (an engine that records none, or a sampled lookup with no block
    sampled) add nothing; :meth:`counts` stays empty until one has hashes, so a source that
    sends none reads as not measured, never as 0 reuse. Raises ValueError for
    ``max_prefixes`` < 1.
    """

    def __init__(self, max_prefixes: int = MAX_PREFIXES) -> None:
        if max_prefixes < 1:
            raise ValueError(f"max_prefixes must be >= 1, not {max_prefixes}")
        self._max = max_prefixes
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._blocks = dict.fromkeys(PREFIX_REUSE, 0.0)
        self._measured = False

    def add(self, lookup: ev.Lookup) -> None:
        """Count ``lookup``'s sampled blocks."""
        hashes, rate = lookup.block_hashes, lookup.block_sample_rate
        if not hashes or rate <= 0:
            return
        recent, seen = self._recent, 0
        for block_hash in hashes:
            if block_hash in recent:
                recent.move_to_end(block_hash)
                seen += 1
            else:
                recent[block_hash] = None
                if len(recent) > self._max:
                    recent.popitem(last=False)
        self._blocks["seen"] += seen / rate
        self._blocks["new"] += (len(hashes) - seen) / rate
        self._measured = True

    def counts(self) -> dict[str, float]:
        """Estimated blocks by :data:`~kvscope.vocabulary.PREFIX_REUSE` value since the start
        (cumulative); empty until a lookup carried hashes."""
        return dict(self._blocks) if self._measured else {}
