"""What the store and the capture do alike with their segment files: log a failing disk once
(and once more when it writes again) and delete the oldest segments beyond their bounds (they
refuse a directory they cannot write with :func:`kvscope.files.check_writable`).

The file formats, names, locking and crash safety stay with each writer
(:mod:`kvscope.agent.store`, :mod:`kvscope.agent.capture`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

log = logging.getLogger(__name__)


class OutageLog:
    """Runs a writer's flushes and logs a disk outage twice: at the first flush that fails and
    at the first one after it that writes, with how many things were lost in between (a full
    disk once logged a warning every flush, each second).

    ``directory``: the writer's, named in the lines. ``lost``: the writer's running count of
    things lost (records, rows), read before and after each flush. ``bug``: called with what
    failed (``doing``) inside the handler of an exception other than OSError, e.g.
    :meth:`~kvscope.agent.worker.Worker.log_bug`. The lines read
    ``"{label}: could not write DIR: ERR; {meanwhile} (logged again when it can)"``,
    ``"{label}: writing DIR again; N {lost_as}"`` and, at a stop in an outage,
    ``"{label}: stopped while DIR could not be written; N {lost_as}"``.
    """

    def __init__(self, directory: Path, lost: Callable[[], int], bug: Callable[[str], None], *,
                 label: str, meanwhile: str, lost_as: str) -> None:
        self._directory = directory
        self._lost = lost
        self._bug = bug
        self._failing = f"{label}: could not write %s: %s; {meanwhile} (logged again when it can)"
        self._recovered = f"{label}: writing %s again; %d {lost_as}"
        self._stopped = f"{label}: stopped while %s could not be written; %d {lost_as}"
        self._lost_before: int | None = None  # lost when writes began failing; None: they work

    def run(self, step: Callable[[], int | None], doing: str) -> None:
        """Run ``step`` (a flush: returns how many things it wrote where they will last, e.g.
        the capture's rows in segments it finished, not those in one still open; None counts
        as 0) and raise
        nothing: an OSError (full disk, directory removed) is logged only when writes were
        working until then; any other exception goes to ``bug(doing)``, as the thread running
        the flushes must outlive a bug. The outage ends at the first ``step`` that writes
        something: a flush with nothing to write proves nothing."""
        lost = self._lost()
        try:
            written = step()
        except OSError as exc:
            if self._lost_before is None:
                self._lost_before = lost
                log.warning(self._failing, self._directory, exc)
            return
        except Exception:  # a bug: logged, and every later flush still runs
            self._bug(doing)
            return
        if self._lost_before is not None and written:
            log.warning(self._recovered, self._directory, self._lost() - self._lost_before)
            self._lost_before = None

    def stop(self, step: Callable[[], int | None], doing: str) -> None:
        """:meth:`run` the writer's last ``step``; if writes still fail after it, log how many
        things were lost since they began to (a stop in an outage said nothing of them, nor of
        the last step's)."""
        self.run(step, doing)
        if self._lost_before is not None:
            log.warning(self._stopped, self._directory, self._lost() - self._lost_before)


def prune(segments: Iterable[Path], max_bytes: int, *, keep: Collection[Path] = (),
          older_than: float | None = None, label: str | None = None) -> None:
    """Delete the oldest ``segments`` (given oldest first) while all of them total more than
    ``max_bytes`` (bytes, by their size now), and every one last modified (mtime, Unix seconds)
    before ``older_than`` when given; never one of ``keep`` (the segment being written, ...).

    Raises nothing for a segment deleted meanwhile (it is no longer counted) or one that
    cannot be deleted (permissions; a directory by that name): that one still counts in the
    total, so newer segments go in its place, and it is logged as ``"{label}: cannot delete
    PATH: ERR"`` when ``label`` is given (a failure to delete is no failure to write: what the
    flush wrote is on disk). Other OSErrors from ``stat`` (e.g. a directory no longer
    searchable) are raised.
    """
    sized = []
    for path in segments:
        try:
            sized.append((path, path.stat()))
        except FileNotFoundError:  # deleted meanwhile
            continue
    total = sum(stat.st_size for _, stat in sized)
    for path, stat in sized:
        expired = older_than is not None and stat.st_mtime < older_than
        if path in keep or not (total > max_bytes or expired):
            continue
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            if label is not None:
                log.warning("%s: cannot delete %s: %s", label, path, exc)
            continue
        total -= stat.st_size
