"""The segment policies the store and the capture share: pruning by size and age, and a disk
outage logged once and once more at recovery."""

import logging
import os
import sys

from kvscope.agent.segments import OutageLog, prune


def _segment(directory, name, size, mtime=None):
    path = directory / name
    path.write_bytes(b"x" * size)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_the_oldest_segments_go_until_the_total_fits(tmp_path):
    """100, 200, 300, 400 bytes (1000 in all), oldest first, max 700: deleting a (900) and b
    (700) fits; c and d (700, exactly the bound) stay."""
    a, b, c, d = (_segment(tmp_path, f"{n}.seg", size)
                  for n, size in zip("abcd", (100, 200, 300, 400)))
    prune([a, b, c, d], 700)
    assert _names(tmp_path) == ["c.seg", "d.seg"]


def test_the_kept_segment_stays_and_newer_ones_go_in_its_place(tmp_path):
    """The same 1000 bytes, max 500, a (the oldest) kept: b goes (800), then c (500); a and d
    (500) stay."""
    a, b, c, d = (_segment(tmp_path, f"{n}.seg", size)
                  for n, size in zip("abcd", (100, 200, 300, 400)))
    prune([a, b, c, d], 500, keep=(a,))
    assert _names(tmp_path) == ["a.seg", "d.seg"]


def test_segments_last_written_before_the_cutoff_go_but_not_the_kept_one(tmp_path):
    """10 bytes each, last written at t=1000, 2000, 3000, 4000; no size pressure (max 1000),
    cutoff t=2500: a and b are older, but a is kept, so only b goes. Then, a no longer kept and
    the cutoff t=3000: a goes, and c, written exactly at the cutoff, is not older and stays."""
    a, b, c, d = (_segment(tmp_path, f"{n}.seg", 10, mtime=t)
                  for n, t in zip("abcd", (1000, 2000, 3000, 4000)))
    prune([a, b, c, d], 1000, keep=(a,), older_than=2500.0)
    assert _names(tmp_path) == ["a.seg", "c.seg", "d.seg"]
    prune([a, c, d], 1000, older_than=3000.0)
    assert _names(tmp_path) == ["c.seg", "d.seg"]


def test_a_segment_removed_meanwhile_is_no_error_and_not_counted(tmp_path):
    """a was listed but is gone by the prune; b (300) and c (400) are 700, over max 400: b goes,
    and c (400) stays. Raising there would have failed the flush that pruned."""
    a = tmp_path / "a.seg"
    b, c = _segment(tmp_path, "b.seg", 300), _segment(tmp_path, "c.seg", 400)
    prune([a, b, c], 400)
    assert _names(tmp_path) == ["c.seg"]


def test_a_segment_that_cannot_be_deleted_is_logged_and_still_counted(tmp_path, caplog):
    """a is a directory (it holds a file, so its size D is above 0): unlink fails with EISDIR,
    for root too. Then b (300) and c (400) are D + 700 over max 400: b goes (D + 400, still
    over), and c goes too, since the stuck a still takes its D bytes. One warning names a. Without
    a label (the capture's choice) the same prune logs nothing."""
    a = tmp_path / "a.seg"
    a.mkdir()
    (a / "inside").write_bytes(b"x")
    b, c = _segment(tmp_path, "b.seg", 300), _segment(tmp_path, "c.seg", 400)
    with caplog.at_level(logging.WARNING):
        prune([a, b, c], 400, label="kvscope test")
    assert _names(tmp_path) == ["a.seg"]
    assert caplog.messages == [f"kvscope test: cannot delete {a}: [Errno 21] Is a directory: "
                               f"'{a}'"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        prune([a], 0)
    assert caplog.messages == [] and a.is_dir()


def _failing(directory, lost, n):
    """A flush that loses ``n`` things (added to ``lost[0]``) and then fails to write into
    ``directory`` (OSError where it is gone)."""
    def step():
        lost[0] += n
        (directory / "segment").write_bytes(b"x")
    return step


def test_an_outage_is_logged_once_and_its_losses_once_at_recovery(tmp_path, caplog):
    """A flush writes 1 thing; then the directory is removed and two flushes fail, losing 2 and
    3 things (the counter the writer keeps): one warning, with the error. Flushes with nothing
    to write (0, or None as the capture's close returns) are no recovery, so a third failure
    (losing 1) is no new outage and logs nothing; the next flush that writes says 2 + 3 + 1 = 6
    were lost. A second outage losing 7 is logged once more, and its recovery says 7 (the first
    outage's 6 not counted again)."""
    directory = tmp_path / "store"
    directory.mkdir()
    lost, bugs = [0], []
    outage = OutageLog(directory, lambda: lost[0], bugs.append, label="kvscope test",
                       meanwhile="things are lost until it can", lost_as="things were lost")

    def write(n):
        def step():
            (directory / "segment").write_bytes(b"x" * n)
            return n
        return step

    def fail(n):
        return _failing(directory, lost, n)

    def remove():
        (directory / "segment").unlink()
        directory.rmdir()

    gone = f"[Errno 2] No such file or directory: '{directory / 'segment'}'"
    with caplog.at_level(logging.WARNING):
        outage.run(write(1), "a flush")
        remove()
        outage.run(fail(2), "a flush")
        outage.run(fail(3), "a flush")
        directory.mkdir()
        outage.run(write(0), "a flush")
        outage.run(lambda: None, "close")
        remove()
        outage.run(fail(1), "a flush")
        directory.mkdir()
        outage.run(write(4), "a flush")
        remove()
        outage.run(fail(7), "a flush")
        directory.mkdir()
        outage.run(write(1), "a flush")
    failed = (f"kvscope test: could not write {directory}: {gone}; things are lost until it "
              f"can (logged again when it can)")
    recovered = f"kvscope test: writing {directory} again; %d things were lost"
    assert caplog.messages == [failed, recovered % 6, failed, recovered % 7]
    assert bugs == []


def test_a_stop_in_an_outage_says_what_it_lost(tmp_path, caplog):
    """A flush fails losing 2 (logged: the outage begins), then the last step at the stop
    fails losing 3: the stop says 2 + 3 = 5 were lost (it said nothing, so the rows of a
    capture stopped on a full disk went unreported: its drop counter could no longer be
    scraped). A stop whose last step writes is a recovery, said as such, and one without an
    outage says nothing."""
    directory = tmp_path / "gone"
    lost = [0]

    def fail(n):
        return _failing(directory, lost, n)

    def outage():
        return OutageLog(directory, lambda: lost[0], lambda doing: None, label="kvscope test",
                         meanwhile="-", lost_as="things were lost")

    with caplog.at_level(logging.WARNING):
        failing = outage()
        failing.run(fail(2), "a flush")
        failing.stop(fail(3), "close")
    assert caplog.messages[1:] == [
        f"kvscope test: stopped while {directory} could not be written; 5 things were lost"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        recovering = outage()
        recovering.run(fail(1), "a flush")
        directory.mkdir()
        recovering.stop(lambda: 1, "close")
        outage().stop(lambda: 1, "close")
    assert caplog.messages[1:] == [f"kvscope test: writing {directory} again; 1 things were lost"]


def test_a_bug_in_a_flush_goes_to_the_bug_log_and_no_outage_begins(tmp_path, caplog):
    """A flush raising ValueError (no OSError: a bug) calls bug("a flush") inside the handler,
    where Worker.log_bug reads the exception; run raises nothing and logs no outage, and a
    later good flush logs no recovery."""
    seen = []
    outage = OutageLog(tmp_path, lambda: 0, lambda doing: seen.append((doing, sys.exc_info()[0])),
                       label="kvscope test", meanwhile="-", lost_as="-")

    def buggy():
        raise ValueError("a bug")

    with caplog.at_level(logging.WARNING):
        outage.run(buggy, "a flush")
        outage.run(lambda: 1, "a flush")
    assert seen == [("a flush", ValueError)] and caplog.messages == []
