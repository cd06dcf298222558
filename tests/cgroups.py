"""A real cgroup with a memory limit, made below this process's own for a test (v1 or v2, as
the machine mounts them: this project's machine is a hybrid host, v1's memory controller
beside an empty v2 tree; CI runs as root, which may make one)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvscope.agent.collectors.host import parse_proc_cgroup

ROOT = Path("/sys/fs/cgroup")


def _own() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and the file that sets a limit there: v2's
    when /sys/fs/cgroup is v2, else v1 memory's; None when neither is mounted."""
    text = Path("/proc/self/cgroup").read_text()
    if (ROOT / "cgroup.controllers").is_file():
        own, limit = ROOT / (parse_proc_cgroup(text) or "/").lstrip("/"), "memory.max"
    elif (ROOT / "memory" / "memory.limit_in_bytes").is_file():
        own = ROOT / "memory" / (parse_proc_cgroup(text, "memory") or "/").lstrip("/")
        limit = "memory.limit_in_bytes"
    else:
        return None
    return (own, limit) if own.is_dir() else None


@contextmanager
def limited_cgroup(limit: int, name: str) -> Iterator[Path]:
    """A new cgroup limited to ``limit`` bytes, removed afterwards (its processes must have
    exited by then); move a process in with :func:`move`. Skips the test only where the
    kernel does not let this process make one (no root, a read-only mount, v2 without the
    memory controller delegated)."""
    found = _own()
    if found is None:
        pytest.skip("no cgroup memory controller mounted at /sys/fs/cgroup")
    own, limit_file = found
    made = own / f"kvscope-test-{name}-{os.getpid()}"
    try:
        made.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup below {own}: {exc}")
    try:
        try:
            (made / limit_file).write_text(f"{limit}\n")
        except OSError as exc:
            pytest.skip(f"cannot limit a cgroup's memory at {made}: {exc}")
        yield made
    finally:
        made.rmdir()


def move(cgroup: Path, pid: int) -> None:
    """Move process ``pid`` into ``cgroup``."""
    (cgroup / "cgroup.procs").write_text(f"{pid}\n")
