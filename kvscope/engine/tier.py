"""A tier: a fixed number of block slots, a replacement policy, and (optionally) real payload.

The tier decides *which* blocks it holds (by prefix hash) and in which slot; the payload, when
present, is a :class:`BlockPool` of real tensors (``gpu``, ``cpu``) or a
:class:`~kvscope.engine.disk.DiskStore` of chunk files (``disk``) that the engine copies
between. Keeping the two apart lets the same decisions run with or without bytes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kvscope.engine.policy import NoRoom, make_policy


@dataclass(slots=True)
class Resident:
    """Book-keeping of one resident block: its slot, when it was stored (Unix s), hits since,
    and when the last of them came (Unix s; meaningless while ``hits`` is 0)."""

    slot: int
    stored_at: float
    hits: int = 0
    last_hit: float = 0.0

    def idle(self, now: float) -> float:
        """Seconds it has gone unused at ``now``: since its last hit, else since stored."""
        return now - (self.last_hit if self.hits else self.stored_at)


class BlockPool:
    """``blocks`` KV blocks of ``block_elems`` elements each, as one torch tensor.

    Shape ``(blocks, block_elems)``; ``device`` "cuda" puts it in device memory, and a host pool
    is pinned when CUDA is present so copies to the device can run asynchronously.
    ``host_bytes``: for a host pool, a writable uint8 numpy view of shape
    ``(blocks, block_bytes)`` sharing the tensor's memory (the disk tier reads and writes it).
    :meth:`cuda_view` gives a pinned host pool's rows to kernels on a GPU.
    """

    def __init__(self, blocks: int, block_elems: int, dtype: str, device: str) -> None:
        import torch  # the engine extra; only payload tiers need it

        pin = device == "cpu" and torch.cuda.is_available()
        self.device = device
        self.is_cuda = device.startswith("cuda")
        self.data = torch.zeros((blocks, block_elems), dtype=getattr(torch, dtype), device=device,
                                pin_memory=pin)
        rows = self.data.view(torch.uint8)
        self.host_bytes = None if self.is_cuda else rows.numpy()
        self._pinned_rows = rows if pin else None  # what cuda_view maps
        self._views: dict = {}  # torch.device -> CUDA view or None

    def cuda_view(self, device):
        """For a pinned host pool, a uint8 tensor on CUDA ``device`` (a ``torch.device`` with
        an index) of shape ``(blocks, block_bytes)`` over this pool's memory, so kernels there
        read and write its rows over PCIe; None for any other pool, or where CUDA will not
        address the memory (then copy run by run). Made once per device."""
        if self._pinned_rows is None:
            return None
        if device not in self._views:
            self._views[device] = _cuda_view(self._pinned_rows, device)
        return self._views[device]


class _CudaArray:
    """The CUDA Array Interface (v3, as defined by Numba) of a pinned uint8 host tensor; holds
    the tensor, so the memory lives as long as a view made of it."""

    def __init__(self, host) -> None:
        self.host = host
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "|u1",
                                         "data": (host.data_ptr(), False), "version": 3,
                                         "strides": None}


def _cuda_view(host, device):
    """A tensor on CUDA ``device`` over pinned ``host`` memory, or None where CUDA will not
    address it there.

    Under unified virtual addressing (CUDA Programming Guide, "Unified Virtual Address Space":
    every 64-bit process on compute capability 2.0+) pinned host memory has the same address on
    every device, so kernels reach it over PCIe. A torch that moves the memory instead of
    viewing it (older ones copy what they take for another device's memory to the current one)
    gives a tensor at another address: refused, since writes to it would never reach the
    host."""
    import torch

    try:
        with torch.cuda.device(device):
            view = torch.as_tensor(_CudaArray(host), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    return view if view.data_ptr() == host.data_ptr() and view.device == device else None


class Tier:
    """A tier (``gpu``, ``cpu``, ``disk``) of ``capacity_blocks`` slots of ``block_bytes`` each.

    ``policy``: ``lru`` or ``arc`` (see :mod:`kvscope.engine.policy`). ``pool``: the payload
    (:class:`BlockPool` or ``DiskStore``), or None for decisions only.
    """

    def __init__(self, name: str, capacity_blocks: int, block_bytes: int, policy: str = "lru",
                 pool=None) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"{name} tier: capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.pool = pool
        self.policy = make_policy(policy, capacity_blocks)
        self.get = self.policy.get  # hash -> Resident or None; no state change
        # Slots freed by removals, and the next slot never used: handed out 0, 1, 2, ... as
        # the tier fills, so a tier of a billion slots costs nothing until it holds blocks (a
        # list of every free slot was a MemoryError at start, and slowed every full collection).
        self._free: list[int] = []
        self._unused = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def touch(self, block_hash: int, now: float, reorder: bool = True) -> Resident:
        """Record a hit at ``now`` (Unix s) on a resident block (the policy updates its order,
        unless not ``reorder``: a read that is part of the access that inserted the block);
        return its record."""
        entry = self.policy.get(block_hash)
        entry.hits += 1
        entry.last_hit = now
        if reorder:
            self.policy.hit(block_hash)
        return entry

    def insert(self, block_hash: int, now: float,
               pinned: Collection[int] = ()) -> tuple[int, tuple[int, Resident] | None] | None:
        """Store a block that is not resident; return ``(slot, victim)``, or None when the tier
        cannot take it (capacity 0, or full of ``pinned`` blocks, which it never evicts).

        ``victim`` is ``(hash, Resident)`` of the block the policy evicted to make room, or
        None. The victim's payload still sits in its slot (often the returned one) until the
        caller overwrites it.
        """
        if self.capacity_blocks == 0:
            return None
        try:
            victim = self.policy.make_room(block_hash, pinned)
        except NoRoom:
            return None
        if victim is not None:
            slot = victim[1].slot
        else:
            slot = self._free.pop() if self._free else self.new_slot()
        self.policy.add(block_hash, Resident(slot, now))
        return slot, victim

    def new_slot(self) -> int:
        """A slot never used before (the caller found no freed one in ``_free``)."""
        slot = self._unused
        self._unused += 1
        return slot

    def remove(self, block_hash: int) -> Resident | None:
        """Forget a resident block (its bytes are bad or gone); free its slot."""
        entry = self.policy.remove(block_hash)
        if entry is not None:
            self._free.append(entry.slot)
        return entry

    def order(self) -> list[int]:
        """Resident hashes, next victim first (ARC: T1 then T2)."""
        return self.policy.order()

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    @property
    def resident_bytes(self) -> int:
        return len(self.policy) * self.block_bytes
