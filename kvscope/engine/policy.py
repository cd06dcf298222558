"""Replacement policies: which resident block a full tier gives up. Decisions only, no bytes.

A policy maps a block's prefix hash to a value the tier owns (its :class:`Resident` record) and
keeps the eviction order. Every block has unit size, so inserting into a full tier evicts
exactly one block. The interface, shared by :class:`LRUPolicy` and :class:`ARCPolicy`:

- ``get(h)``: the value of resident block ``h``, or None (no state change);
- ``hit(h)``: a resident block was used;
- ``make_room(h, pinned=())``: before inserting the non-resident block ``h``, evict whatever
  must go and return ``(hash, value)`` of the evicted block, or None; never a block in
  ``pinned`` (a request's cached prefix about to be promoted): the next unpinned one in the
  policy's order goes instead (the pinned ones passed over move to the most recent end of
  their list, where their request's read puts them), and :class:`NoRoom` is raised, nothing
  else changed, when every resident block is pinned;
- ``add(h, value)``: insert ``h`` (call ``make_room(h)`` first);
- ``remove(h)``: forget resident block ``h`` (no ghost entry), return its value or None;
- ``order()``: resident hashes, next victim first (for tests and snapshots).

Both policies are written to make the same decisions as libCacheSim's ``LRU`` and ``ARC``
(https://github.com/1a1a11a/libCacheSim, ``cache/eviction/{LRU,ARC}.c``) on unit-size objects,
which the tests check on a real trace (nothing pinned: the pins are the engine's, as vLLM's
offloading managers never evict a block a request is loading).
"""

from __future__ import annotations

from collections import OrderedDict

POLICIES: tuple[str, ...] = ("lru", "arc")


class NoRoom(Exception):
    """A full tier whose every resident block is pinned: nothing can be evicted."""


def _pop_unpinned(blocks: OrderedDict, pinned) -> tuple | None:
    """Remove and return ``(hash, value)`` of the first block of ``blocks`` (least recent
    first) not in ``pinned``, or None when every one is (the order then as it was). A pinned
    block passed over goes to the most recent end, where the request that pins it puts it
    when it reads it, so the next call does not pass it again (walking the same pinned
    blocks at every insert made a long prompt's placement quadratic)."""
    for _ in range(len(blocks)):
        h = next(iter(blocks))
        if h not in pinned:
            return h, blocks.pop(h)
        blocks.move_to_end(h)
    return None


class LRUPolicy:
    """Least recently used: evict the block whose last use is oldest. ``capacity``: blocks."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()  # least recently used first
        self.get = self._d.get
        self.hit = self._d.move_to_end

    def __contains__(self, h: int) -> bool:
        return h in self._d

    def __len__(self) -> int:
        return len(self._d)

    def make_room(self, h: int, pinned=()):
        if len(self._d) < self.capacity:
            return None
        if not pinned:
            return self._d.popitem(last=False)
        victim = _pop_unpinned(self._d, pinned)
        if victim is None:
            raise NoRoom
        return victim

    def add(self, h: int, value) -> None:
        self._d[h] = value

    def remove(self, h: int):
        return self._d.pop(h, None)

    def order(self) -> list[int]:
        return list(self._d)


class ARCPolicy:
    """Adaptive Replacement Cache: N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low Overhead
    Replacement Cache", USENIX FAST 2003, Fig. 4.

    ``T1`` holds blocks used once recently, ``T2`` blocks used at least twice; the ghost lists
    ``B1``/``B2`` remember the hashes (no payload) recently evicted from each. A miss that hits
    a ghost list moves the target size ``p`` of ``T1`` (up for ``B1``, down for ``B2``) and
    enters ``T2``. ``capacity``: blocks (``c`` in the paper); ghosts add at most ``c`` hashes.

    Details the paper leaves open follow libCacheSim's ``ARC.c`` (which cross-checks them
    against https://github.com/trauzti/cache) so that the two agree exactly: ``p`` and
    ``delta = max(|B2| / |B1|, 1)`` are real numbers, a ghost hit evicts only when the tier is
    full, and REPLACE takes from T1 when T2 is empty.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0  # target size of T1, blocks (a real number, as in the paper)
        self.t1: OrderedDict = OrderedDict()  # least recently used first
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()  # ghosts: hash -> None
        self.b2: OrderedDict = OrderedDict()
        self._to_t2 = False  # set by make_room: the next add() was a ghost hit

    def __contains__(self, h: int) -> bool:
        return h in self.t1 or h in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def get(self, h: int):
        value = self.t1.get(h)
        return value if value is not None else self.t2.get(h)

    def hit(self, h: int) -> None:
        """Case I: a hit in T1 or T2 moves the block to the MRU end of T2."""
        if h in self.t1:
            self.t2[h] = self.t1.pop(h)
        else:
            self.t2.move_to_end(h)

    def _evict(self, p: float, in_b2: bool, pinned) -> tuple[bool, tuple]:
        """REPLACE(x, p) but its ghost: pop the LRU of T1 or of T2 and return ``(from T1,
        (hash, value))``. Pinned blocks are passed over: when the chosen list's LRU is pinned
        and the other's is not, the other's goes (a list of a long prompt's pinned blocks was
        walked through at every insert), else the chosen list's next unpinned, else the other
        list's; NoRoom when every block is pinned, nothing popped."""
        t1, t2 = self.t1, self.t2
        from_t1 = bool(t1 and (len(t1) > p or (len(t1) == p and in_b2))) or not t2
        if not pinned:
            return from_t1, (t1 if from_t1 else t2).popitem(last=False)
        chosen, other = (t1, t2) if from_t1 else (t2, t1)
        if chosen and other and next(iter(chosen)) in pinned and next(iter(other)) not in pinned:
            from_t1 = not from_t1
        victim = _pop_unpinned(t1 if from_t1 else t2, pinned)
        if victim is None:
            from_t1 = not from_t1
            victim = _pop_unpinned(t1 if from_t1 else t2, pinned)
            if victim is None:
                raise NoRoom
        return from_t1, victim

    def make_room(self, h: int, pinned=()):
        """Cases II-IV for a block not in T1 or T2; returns the evicted ``(hash, value)``. The
        victim is taken before ``p`` or the ghost lists change, so a NoRoom changes neither."""
        c, t1, t2, b1, b2 = self.capacity, self.t1, self.t2, self.b1, self.b2
        full = len(t1) + len(t2) >= c
        if h in b1 or h in b2:  # cases II and III: p moves, and h enters T2
            if h in b1:
                p = min(self.p + max(len(b2) / len(b1), 1.0), c)
            else:
                p = max(self.p - max(len(b1) / len(b2), 1.0), 0.0)
            evicted = self._evict(p, h in b2, pinned) if full else None
            self.p = p
            (b1 if h in b1 else b2).pop(h)
            self._to_t2 = True
        else:  # case IV
            self._to_t2 = False
            if not full:
                return None
            if len(t1) + len(b1) + 1 > c and not b1:  # IV.A, B1 empty: T1's LRU goes, no ghost
                victim = _pop_unpinned(t1, pinned)  # (T1 holds every block)
                if victim is None:
                    raise NoRoom
                return victim
            forget = (b1 if len(t1) + len(b1) + 1 > c  # IV.A: |L1| = c
                      else b2 if len(t1) + len(b1) + len(t2) + len(b2) >= 2 * c and b2  # IV.B
                      else None)
            evicted = self._evict(self.p, False, pinned)
            if forget is not None:
                forget.popitem(last=False)
        if evicted is None:
            return None
        from_t1, victim = evicted
        (b1 if from_t1 else b2)[victim[0]] = None
        return victim

    def add(self, h: int, value) -> None:
        (self.t2 if self._to_t2 else self.t1)[h] = value
        self._to_t2 = False

    def remove(self, h: int):
        value = self.t1.pop(h, None)
        return value if value is not None else self.t2.pop(h, None)

    def order(self) -> list[int]:
        return list(self.t1) + list(self.t2)


def make_policy(name: str, capacity: int):
    """A policy called ``name`` (``lru`` or ``arc``) for ``capacity`` blocks; ValueError else."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
