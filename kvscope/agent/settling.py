"""The join of late parts: a joined source's finished records wait for what other sources send
about them later, then settle.

A request of a *joined* source (one whose records another source also reports on: vLLM's worker
tap sends the scheduler tap's transfers on another connection; vLLM's spans arrive seconds after
the request) goes through these states (docs/agent.md, "Requests and traces", draws them)::

    in flight --finish--> waiting --window over--> settled
                           |   ^                     |
                late part  |   | (amends the record) | late part: amended, stored again
                           +---+                     v

- *in flight*: started, not finished; late parts of it join it as they come;
- *waiting*: finished and in the table, handed to the early subscribers (the store), not yet
  counted in the request metrics; late parts amend it;
- *settled*: the window is over (or more than :data:`MAX_SETTLING` wait, or everything is
  flushed at shutdown): counted in the request metrics as joined, handed to every subscriber;
  a later part still amends it and it goes to the early subscribers again.

Which record a late part joins (the request under way at its time, of an id a client may
reuse) is decided by the compiled assembler; :mod:`kvscope.agent.join_rules` is its
plain-Python reference. A source that is not joined skips *waiting*.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable

from kvscope.agent.requests import RequestRecord

MAX_JOINED = 64  # sources whose finished requests wait for other sources' events (a bound)
MAX_SETTLING = 10_000  # finished requests waiting at most (the oldest go early beyond it)


class Settling:
    """The waiting records, due in order of their windows' ends. ``join_window``: seconds a
    record waits when another source's events name its source (a scope), unless :meth:`join`
    asked for longer. ``clock``: monotonic seconds. Not thread-safe: the pipeline calls it under
    its lock."""

    def __init__(self, join_window: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.join_window = join_window
        self.joined: dict[str, float] = {}  # source -> seconds its records wait
        self._clock = clock
        # a heap of (due, arrival order, record): windows differ by source
        self._heap: list[tuple[float, int, RequestRecord]] = []
        self.ids: set[int] = set()  # id() of the records waiting
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def join(self, source: str, window: float | None = None) -> None:
        """Have ``source``'s finished records wait ``window`` seconds (default
        ``join_window``), at least what an earlier call asked. At most :data:`MAX_JOINED`
        sources (another is not joined)."""
        if source in self.joined or len(self.joined) < MAX_JOINED:
            window = self.join_window if window is None else window
            self.joined[source] = max(window, self.joined.get(source, 0.0))

    def hold(self, source: str, finished: list[RequestRecord]) -> list[RequestRecord]:
        """The records of ``finished`` (of ``source``) ready now: all of them unless ``source``
        is joined, else none (they wait)."""
        window = self.joined.get(source)
        if not finished or window is None:
            return finished
        due = self._clock() + window
        for record in finished:
            heapq.heappush(self._heap, (due, next(self._order), record))
            self.ids.add(id(record))
        return []

    def due(self, everything: bool = False) -> list[RequestRecord]:
        """The waiting records whose window is over (``everything``: all), in the order they
        fall due; beyond :data:`MAX_SETTLING` waiting, the oldest too."""
        now, out, heap = self._clock(), [], self._heap
        while heap and (everything or heap[0][0] <= now or len(heap) > MAX_SETTLING):
            out.append(heapq.heappop(heap)[2])
            self.ids.discard(id(out[-1]))
        return out
