"""Writing files so that a reader never sees half of one, and holding a directory that one
writer at a time may fill."""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same directory,
    fsynced and renamed over the target: a crash leaves the old file or the new one, never a
    mix. The file gets the mode it had, else the one ``open()`` would give it (0o666 less
    the umask: a temporary file's 0o600 left reports and Grafana's provisioning files
    unreadable to other users). Raises OSError naming ``path`` (not the temporary file,
    which is removed): its folder missing, ``path`` a directory, no permission."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _naming(exc, path) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:  # closed whatever fails
            try:
                mode = path.stat().st_mode & 0o7777
            except FileNotFoundError:
                mode = _new_file_mode()
            os.fchmod(fd, mode)
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _naming(exc, path) from None
        raise


def check_writable(directory: Path) -> None:
    """Make ``directory`` (and its parents) if missing, then create and delete a file in it.
    Raises OSError where no file can be written there (a read-only mount or directory, a file
    in the way, a filesystem that takes no files): a writer refuses to start rather than run
    and drop everything it is given. One rule for every writer of files (the store refused
    such a directory, the capture started and dropped every row, the reference engine's disk
    tier failed every chunk)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".kvscope-probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)


def _new_file_mode() -> int:
    """0o666 less the process's umask. Read from /proc (Linux 4.7+): setting the umask to
    learn it would race other threads' file creation."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644  # the usual umask's (022)


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` again, naming ``path`` (the file asked for) as its file."""
    return type(exc)(exc.errno, exc.strerror, str(path)) if exc.errno else exc


def hold_directory(path: str | Path, holder: str) -> int:
    """Take ``path`` (an existing directory) for this process until the returned descriptor is
    closed: an exclusive ``flock`` of the directory itself, so that no lock file is left in
    it. Raises OSError (``EBUSY``) saying it is "in use by ``holder``" when another holder,
    in this process or another, has it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException as exc:  # any failure: the descriptor goes with it
        os.close(fd)
        if isinstance(exc, BlockingIOError):
            raise OSError(errno.EBUSY, f"in use by {holder}: give each its own "
                          "directory") from None
        raise
    return fd
