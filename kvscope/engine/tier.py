"""A tier: a fixed number of block slots, LRU replacement, and (optionally) real payload.

The tier decides *which* blocks it holds (by prefix hash) and in which slot; the payload, when
present, is a :class:`BlockPool` of real tensors the engine copies between. Keeping the two apart
lets the same decisions run with or without bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Resident:
    """Book-keeping of one resident block: its slot, when it was stored (s), hits since."""

    slot: int
    stored_at: float
    hits: int = 0


class BlockPool:
    """``blocks`` KV blocks of ``block_elems`` elements each, as one torch tensor.

    Shape ``(blocks, block_elems)``; ``device`` "cuda" puts it in device memory, and a host pool
    is pinned when CUDA is present so copies to the device can run asynchronously.
    """

    def __init__(self, blocks: int, block_elems: int, dtype: str, device: str) -> None:
        import torch  # the engine extra; only payload tiers need it

        pin = device == "cpu" and torch.cuda.is_available()
        self.device = device
        self.data = torch.zeros((blocks, block_elems), dtype=getattr(torch, dtype), device=device,
                                pin_memory=pin)


class Tier:
    """A tier (``gpu``, ``cpu``, ...) of ``capacity_blocks`` slots of ``block_bytes`` each, LRU.

    ``pool``: the payload, or None for decisions only.
    """

    def __init__(self, name: str, capacity_blocks: int, block_bytes: int,
                 pool: BlockPool | None = None) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"{name} tier: capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.pool = pool
        self._blocks: OrderedDict[int, Resident] = OrderedDict()  # least recently used first
        self._free = list(range(capacity_blocks - 1, -1, -1))

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def resident(self, block_hash: int) -> Resident:
        return self._blocks[block_hash]

    def touch(self, block_hash: int) -> Resident:
        """Record a hit: the block becomes most recently used."""
        entry = self._blocks[block_hash]
        entry.hits += 1
        self._blocks.move_to_end(block_hash)
        return entry

    def insert(self, block_hash: int, now: float) -> tuple[int, tuple[int, Resident] | None] | None:
        """Store a block that is not resident; return ``(slot, victim)`` or None if capacity is 0.

        ``victim`` is ``(hash, Resident)`` of the least recently used block, evicted to make
        room, or None when a slot was free. The victim's payload still sits in the returned slot
        until the caller overwrites it.
        """
        if self.capacity_blocks == 0:
            return None
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._blocks.popitem(last=False)
            slot = victim[1].slot
        self._blocks[block_hash] = Resident(slot, now)
        return slot, victim

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    @property
    def resident_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes
