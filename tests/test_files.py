"""kvscope/files.py: an atomic write leaves the old file or the new one, and its errors name the
file asked for, never the temporary sibling it wrote first."""

from __future__ import annotations

import pytest

from kvscope.files import write_atomic


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
