"""Exact LRU stack distances.

The *stack distance* of an access is the number of distinct other blocks accessed since the
previous access to the same block (``-1`` for a first access: infinite). LRU is a stack
algorithm, so a cache of ``C`` blocks hits exactly the accesses with ``0 <= distance < C``, and
one pass yields the hit ratio of every size at once (Mattson, Gecsei, Slutz & Traiger,
"Evaluation techniques for storage hierarchies", IBM Systems Journal 9(2), 1970).

Two O(N log N) ways to count, with the same results:

- :class:`StackCounter` streams: a Fenwick tree (Fenwick, "A new data structure for cumulative
  frequency tables", Software: Practice and Experience 24(3), 1994) marks the position of each
  block's last access; the distance is the number of marks after the previous access (Bennett &
  Kruskal 1975 and Olken 1981 count the same way with other trees). Memory grows with distinct
  blocks, not accesses. SHARDS fixed-size uses it, because it must forget blocks.
- :func:`stack_distances` is the offline, vectorized form for numpy arrays: with ``prev[j]`` the
  previous access to the block of access ``j``, the distance of access ``i`` with previous access
  ``p`` is ``#{j < i : prev[j] < p} - (p + 1)`` (every ``j <= p`` has ``prev[j] < p``; a ``j`` in
  ``(p, i)`` with ``prev[j] < p`` is the first access to its block in the window). Those
  dominance counts come from a wavelet matrix over ``prev`` (Claude & Navarro, "The wavelet
  matrix", SPIRE 2012): one stable partition and one prefix sum per bit of ``N``.
"""

from __future__ import annotations

import numpy as np


def previous_access(block_ids: np.ndarray) -> np.ndarray:
    """Index of the previous access to the same block, per access; ``-1`` for a first access.

    ``block_ids``: 1-D array of any integer dtype. Returns int64, same length.
    """
    ids = np.asarray(block_ids)
    n = len(ids)
    prev = np.full(n, -1, dtype=np.int64)
    if n < 2:
        return prev
    order = np.argsort(ids, kind="stable")  # stable: equal ids keep access order
    ordered = ids[order]
    same = ordered[1:] == ordered[:-1]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def _count_less_before(values: np.ndarray, ends: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """``#{j < ends[q] : values[j] < limits[q]}`` for every query ``q``, by a wavelet matrix.

    ``values``: non-negative int64 array. ``ends``, ``limits``: int64 arrays of equal length.
    """
    bits = max(int(values.max(initial=0)), int(limits.max(initial=0))).bit_length()
    current = values.copy()
    start = np.zeros(len(ends), dtype=np.int64)
    end = ends.astype(np.int64, copy=True)
    count = np.zeros(len(ends), dtype=np.int64)
    zeros_before = np.empty(len(values) + 1, dtype=np.int64)
    zeros_before[0] = 0
    for level in range(bits - 1, -1, -1):
        ones = ((current >> level) & 1).astype(bool)
        np.cumsum(~ones, out=zeros_before[1:])
        total_zeros = zeros_before[-1]
        z_start, z_end = zeros_before[start], zeros_before[end]
        take_ones = ((limits >> level) & 1).astype(bool)
        # limit bit 1: every value with bit 0 here is smaller; continue among the ones
        count += np.where(take_ones, z_end - z_start, 0)
        start = np.where(take_ones, total_zeros + start - z_start, z_start)
        end = np.where(take_ones, total_zeros + end - z_end, z_end)
        current = np.concatenate((current[~ones], current[ones]))
    return count


def stack_distances(block_ids: np.ndarray) -> np.ndarray:
    """Exact LRU stack distance of every access (offline, vectorized; see the module docstring).

    ``block_ids``: 1-D integer array, accesses in order. Returns int64 of the same length:
    distinct other blocks since the previous access to the same block, ``-1`` for first accesses.
    Time O(N log N), memory about 10 arrays of N int64.
    """
    prev = previous_access(block_ids)
    distances = np.full(len(prev), -1, dtype=np.int64)
    reused = np.flatnonzero(prev >= 0)
    if len(reused) == 0:
        return distances
    limits = prev[reused] + 1
    counts = _count_less_before(prev + 1, reused, limits)
    distances[reused] = counts - limits
    return distances


class StackCounter:
    """Streaming exact LRU stack distances with a Fenwick tree over last-access positions.

    :meth:`access` returns the stack distance of one access (``-1`` when the block is new);
    :meth:`forget` drops a block as if it had never been seen (SHARDS fixed-size needs this).
    Memory is O(distinct blocks held): positions are renumbered when the tree fills up.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._last: dict[int, int] = {}  # block -> position of its last access
        self._capacity = max(16, capacity)
        self._tree = [0] * (self._capacity + 1)  # 1-based Fenwick tree of marks
        self._next = 0  # next position to hand out

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, block: int) -> bool:
        return block in self._last

    def _add(self, position: int, delta: int) -> None:
        i, tree, size = position + 1, self._tree, self._capacity
        while i <= size:
            tree[i] += delta
            i += i & -i

    def _marks_through(self, position: int) -> int:
        i, tree, total = position + 1, self._tree, 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    def _compact(self) -> None:
        live = sorted(self._last.items(), key=lambda item: item[1])
        self._capacity = max(16, 2 * len(live) + 16)
        self._tree = [0] * (self._capacity + 1)
        self._last = {}
        for position, (block, _) in enumerate(live):
            self._last[block] = position
            self._add(position, 1)
        self._next = len(live)

    def access(self, block: int) -> int:
        """Record an access to ``block``; return its stack distance (``-1`` if new)."""
        if self._next >= self._capacity:
            self._compact()
        previous = self._last.get(block)
        distance = -1
        if previous is not None:
            distance = len(self._last) - self._marks_through(previous)
            self._add(previous, -1)
        position = self._next
        self._next += 1
        self._add(position, 1)
        self._last[block] = position
        return distance

    def forget(self, block: int) -> None:
        """Drop ``block``: later distances no longer count it. Unknown blocks are ignored."""
        position = self._last.pop(block, None)
        if position is not None:
            self._add(position, -1)
