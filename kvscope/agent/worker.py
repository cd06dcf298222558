"""The lifecycle every threaded agent component shares."""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger(__name__)


class Worker:
    """A component that does its work on one background (daemon) thread.

    Subclasses implement :meth:`run`, which returns once :attr:`stopping` is set, and may
    override :meth:`prepare` for work that must succeed before the thread starts (binding a
    socket, creating a directory: its exceptions reach the caller of :meth:`start`).
    ``start()`` and ``shutdown()`` are safe to repeat, and ``shutdown()`` is safe without
    ``start()`` (the OpenTelemetry Collector's component contract).
    """

    thread_name = "kvscope-worker"

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._bugs_logged: set[type] = set()

    def prepare(self) -> None:
        """Set up before the thread starts; raise to refuse to start."""

    def run(self) -> None:
        raise NotImplementedError

    def log_bug(self, doing: str) -> None:
        """Log the exception being handled, with its traceback: the first of each type only,
        since a sender may repeat the message that raised it. For the ``except Exception`` of
        a loop in :meth:`run` that keeps the thread (and every later message) alive. Each
        repeat is logged at debug level (``log_level = "debug"``), without the traceback."""
        error = sys.exc_info()[1]
        if type(error) not in self._bugs_logged:
            self._bugs_logged.add(type(error))
            log.exception("kvscope %s: %s failed (a bug; logged once per exception type, every "
                          "one at log_level debug)", self.thread_name, doing)
        else:
            log.debug("kvscope %s: %s failed again (%s: %s)", self.thread_name, doing,
                      type(error).__name__, error)

    def start(self) -> None:
        if self._thread is None:
            self.prepare()
            self._thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self.stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
