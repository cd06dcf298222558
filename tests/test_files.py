"""kvscope/files.py: an atomic write leaves the old file or the new one, with the mode a plain
write would give it, and its errors name the file asked for, never the temporary sibling it
wrote first; a held directory is one holder's at a time."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from kvscope.files import hold_directory, write_atomic


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.md"
    target.write_text("old")
    write_atomic(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out.md"]


def test_errors_name_the_file_asked_for(tmp_path):
    absent = tmp_path / "absent" / "out.md"
    with pytest.raises(FileNotFoundError) as missing:
        write_atomic(absent, "x")
    assert missing.value.filename == str(absent)
    # a directory in the way: found at the rename, after the temporary was written
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError) as directory:
        write_atomic(tmp_path / "dir", "x")
    assert directory.value.filename == str(tmp_path / "dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]  # the temporary removed


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_the_mode_open_would_give_it(tmp_path, umask, mode):
    """0o666 less the umask, as ``open()`` creates a file: the temporary file's own 0o600 made
    a rollout's report and the mixin's Grafana provisioning files unreadable to other users
    (a Grafana or Prometheus running as its own user)."""
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "new.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == mode


def test_a_rewritten_file_keeps_its_mode(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    target.chmod(0o640)
    write_atomic(target, "new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and target.read_text() == "new"


def test_a_failed_write_closes_what_it_opened(tmp_path, monkeypatch):
    """A file system that refuses the mode (fault injected: fchmod fails) left the temporary
    file's descriptor open at every try (the ingest source saves its state every interval):
    5 failed writes held 5 more. Each fails naming the file, and nothing stays open or on disk."""
    def refuse(_fd, _mode):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refuse)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(PermissionError, match="state.json"):
            write_atomic(tmp_path / "state.json", "{}")
    assert len(os.listdir("/proc/self/fd")) == before
    assert list(tmp_path.iterdir()) == []


def test_a_held_directory_is_refused_to_a_second_holder_until_released(tmp_path):
    """One holder at a time, in this process too (flock of the directory: no file is left in
    it); closing the descriptor frees it."""
    fd = hold_directory(tmp_path, "the test's first holder")
    with pytest.raises(OSError, match="in use by the test's first holder: give each its own "
                                      "directory") as refused:
        hold_directory(tmp_path, "the test's first holder")
    assert refused.value.errno == errno.EBUSY and list(tmp_path.iterdir()) == []
    os.close(fd)
    os.close(hold_directory(tmp_path, "a second holder"))
