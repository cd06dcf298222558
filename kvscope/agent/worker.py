"""The lifecycle every threaded agent component shares."""

from __future__ import annotations

import threading


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

    def prepare(self) -> None:
        """Set up before the thread starts; raise to refuse to start."""

    def run(self) -> None:
        raise NotImplementedError

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
