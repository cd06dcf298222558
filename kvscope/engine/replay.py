"""Replay a workload through an engine, paced by arrival times.

The engine is modelled as one server taking requests first come, first served: a request starts
when it has arrived and the previous one has finished its prefill, so its queueing delay is
``start - arrival`` in workload time. Pacing maps workload seconds to wall seconds by ``speed``.

At each arrival the replay reports that server's queue through the engine
(:meth:`~kvscope.engine.engine.OffloadEngine.report_queue`): the requests arrived and not yet
started (this one too when it must wait), and the one the engine takes now as running (the
server is busy at every arrival, with an earlier request or this one); at the end, none of
either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from kvscope.engine.engine import OffloadEngine
from kvscope.engine.workload import Request

log = logging.getLogger(__name__)
BEHIND_WARNING = 5.0  # wall seconds behind the paced schedule before the replay says so


class Replayer:
    """Feeds ``requests`` to ``engine``. ``speed``: workload seconds per wall second (2.0 plays
    twice as fast); None replays as fast as possible. ``stop``: set it to end the replay early.
    ``behind_warning``: wall seconds behind the paced schedule (the engine slower than the
    arrivals at ``speed``) at which one warning is logged: later arrivals come late, so the
    gaps between them, and the reuse times recorded, stretch (the caller may say so again at
    the end: ``behind``, the most seconds it fell behind). ``progress``: called with the
    requests served so far after each one."""

    def __init__(self, engine: OffloadEngine, requests: Iterable[Request],
                 speed: float | None = 1.0, stop: threading.Event | None = None,
                 behind_warning: float = BEHIND_WARNING,
                 progress: Callable[[int], None] | None = None) -> None:
        if speed is not None and speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.engine = engine
        self.requests = requests
        self.speed = speed
        self.stop = stop or threading.Event()
        self.served = 0
        self.behind = 0.0
        self.behind_warning = behind_warning
        self._progress = progress

    def run(self) -> None:
        """Replay until the workload ends or ``stop`` is set; then finish pending requests.
        The engine's tiers are reported first: they exist before the first request comes."""
        self.engine.report_tiers()
        try:
            self._run()
        finally:
            self.engine.drain()
            self.engine.report_queue(waiting=0)  # the server is idle now

    def _run(self) -> None:
        wall0 = time.monotonic()
        busy_until = 0.0  # workload seconds when the server is free again
        # the starts (workload seconds, ascending: first come, first served) of the requests
        # arrived and not started yet: one float per request waiting
        queued: deque[float] = deque()
        for request in self.requests:
            if self.speed is not None:
                delay = wall0 + request.arrival / self.speed - time.monotonic()
                # at most the longest wait Python takes (--speed 1e-300: an OverflowError)
                if delay > 0 and self.stop.wait(min(delay, threading.TIMEOUT_MAX)):
                    return
                if -delay > self.behind:
                    self._fell_behind(-delay, request.arrival)
            if self.stop.is_set():
                return
            start = max(request.arrival, busy_until)
            queueing = start - request.arrival
            while queued and queued[0] <= request.arrival:
                queued.popleft()
            if start > request.arrival:
                queued.append(start)
            self.engine.report_queue(waiting=len(queued), serving=request)
            outcome = self.engine.process(request, queueing=queueing)
            # with CUDA, promotion times may still be pending here; service_seconds then
            # counts what is known (lookup and prefill)
            busy_until = start + outcome.service_seconds
            self.served += 1
            if self._progress is not None:
                self._progress(self.served)

    def _fell_behind(self, seconds: float, arrival: float) -> None:
        if self.behind < self.behind_warning <= seconds:
            log.warning("%.0f s behind the workload's schedule at speed %g (at its "
                        "second %.0f): the engine serves slower than requests arrive, so "
                        "arrivals, and the reuse times recorded, stretch; lower --speed",
                        seconds, self.speed, arrival)
        self.behind = seconds
