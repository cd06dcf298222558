"""Stopping the long-running commands (``demo``, ``agent``, ``dashboard``, ``rollout``) on
SIGINT, SIGTERM or SIGHUP."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

# SIGHUP: the terminal closed (e.g. an ssh session dropped); by default it killed the process
# (exit code 129) without the agent's last store flush. There is no reload to do instead. Not on
# Windows.
_HANGUP = getattr(signal, "SIGHUP", None)
_STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, _HANGUP) if s is not None)
# SIGINT and SIGHUP that :func:`ignore_signals_while_exiting` ignored (a command that ended in
# this process), as against those the process's starter ignored, which stay ignored
_IGNORED_BY_US: set[int] = set()


class _Relay:
    """One pipe and one thread per process (made at the first use) that set, for the signal
    handler, the stop event that was the newest :func:`stop_on_signals` call's when the signal
    came."""

    def __init__(self) -> None:
        read_end, self.write_end = os.pipe()
        os.set_blocking(self.write_end, False)
        self.pid = os.getpid()
        self.stop: threading.Event | None = None
        self.signalled: list[threading.Event] = []  # appended by the handler, set by the thread
        threading.Thread(target=self._run, args=(read_end,), name="kvscope-signals",
                         daemon=True).start()

    def _run(self, read_end: int) -> None:
        while os.read(read_end, 1):
            while self.signalled:
                self.signalled.pop().set()

    def on_signal(self, sig: int, _frame) -> None:
        if os.getpid() != self.pid:  # a forked child that kept the handler: act as if unset
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            return
        if self.stop is not None:
            self.signalled.append(self.stop)
        try:
            os.write(self.write_end, b"\0")
        except BlockingIOError:  # the pipe is full of stops not yet read: one is enough
            pass


_relay: _Relay | None = None


def stop_on_signals(stop: threading.Event) -> None:
    """Set ``stop`` on SIGINT, SIGTERM or SIGHUP. A SIGHUP or SIGINT the process was started
    ignoring stays ignored: ``nohup kvscope agent`` asked to survive its terminal, and a shell
    script's background job (``kvscope demo &``) is started ignoring SIGINT so that Ctrl-C
    stops the script's foreground command only. SIGTERM, a service manager's stop, is always
    handled.
    Only the main thread can install handlers; elsewhere (a test running a command in a thread)
    this does nothing and the caller sets ``stop``.

    The handler only writes a byte to a pipe, and a thread sets ``stop``: a handler runs between
    any two bytecodes of the main thread, and one that called ``stop.set()`` could find that
    event's lock held by the main thread itself (inside ``set``, when a second signal came:
    a burst of SIGTERMs hung the agent for good)."""
    global _relay
    if threading.current_thread() is not threading.main_thread():
        return
    if _relay is None or _relay.pid != os.getpid():  # a forked child has no relay thread
        _relay = _Relay()
    _relay.stop = stop
    for sig in _handled_signals():
        signal.signal(sig, _relay.on_signal)


@contextlib.contextmanager
def stopping_on_signals(stop: threading.Event) -> Iterator[None]:
    """:func:`stop_on_signals` for the block, the handlers before it put back after: for a
    command that ends once its work is done (``replay``), which must leave its caller's
    handlers as they were (run in a test's process, its stop handler, or the ignoring of a
    later signal, outlived it and changed what the test's other commands inherited)."""
    saved = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    stop_on_signals(stop)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in saved.items():
                if handler is not None:  # None: a handler not set from Python
                    signal.signal(sig, handler)


def how_to_stop() -> str:
    """What stops this process, for a command to print: "Ctrl-C", or ``kill <pid>`` (SIGTERM)
    where SIGINT is ignored (a shell script's background job: Ctrl-C does not reach it)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        return f"kill {os.getpid()}"
    return "Ctrl-C"


def _handled_signals() -> list[int]:
    """The stop signals to handle: all but a SIGINT or SIGHUP the process was started
    ignoring (SIGTERM always; see :func:`stop_on_signals`)."""
    return [sig for sig in _STOP_SIGNALS
            if sig == signal.SIGTERM or sig in _IGNORED_BY_US
            or signal.getsignal(sig) != signal.SIG_IGN]


def interrupt_on_signals() -> None:
    """Raise KeyboardInterrupt in the main thread on SIGTERM and SIGHUP as on SIGINT: for a
    command whose clean stop is its ``try``/``finally`` blocks (``rollout``: the servers and
    load generator it started, each in its own session, which no signal to the command
    reaches). Ignored signals stay ignored as in :func:`stop_on_signals`; elsewhere than the
    main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _handled_signals():
        signal.signal(sig, signal.default_int_handler)


def wait_for_stop(stop: threading.Event, timeout: float | None = None,
                  tick: float = 0.5) -> None:
    """Block the main thread until ``stop`` is set (or ``timeout`` seconds passed), waking
    every ``tick`` seconds. A wait
    without a timeout can miss the stop for good: the kernel may deliver SIGINT to another
    thread (uvicorn's, say), and CPython runs the Python handler only when the main thread
    next runs bytecode, which a thread blocked on a lock never does (1 agent in about 20
    ignored its Ctrl-C so)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not stop.wait(tick if deadline is None else min(tick, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            return


def ignore_signals_while_exiting() -> None:
    """Once a command has stopped cleanly: ignore further SIGINT/SIGTERM/SIGHUP. While the
    interpreter shuts down it puts back the default action of every signal it handles, so a
    second Ctrl-C then killed the process (exit code 130) after it had already said "stopped";
    a signal set to be ignored is left alone."""
    if threading.current_thread() is threading.main_thread():
        for sig in _STOP_SIGNALS:
            if signal.signal(sig, signal.SIG_IGN) != signal.SIG_IGN:
                _IGNORED_BY_US.add(sig)
