"""The request store: finished requests persisted in append-only segment files.

Each record is one frame — 4-byte big-endian length, 4-byte CRC-32 of the payload, msgpack
payload — appended to the newest segment. A flush thread writes what arrived and fsyncs once per
``flush_interval`` (default 1 s), so a ``kill -9`` loses at most that last interval. A crash can
leave only the final frame of the newest segment incomplete, which readers ignore; a restarted
writer starts a fresh segment, so what was written is never corrupted. A frame damaged in place
(a flipped bit on disk) is skipped with a warning, and reading resumes at the next intact frame.

Retention is enforced at every flush, also one with nothing new to write:

- size: a segment holds at most ``min(segment_bytes, max_bytes // 4)`` bytes (a single record
  larger than that gets a segment of its own), and the oldest segments are deleted until all of
  them total at most ``max_bytes``. So after a flush the directory holds at most ``max_bytes``
  (unless the one segment being written alone is larger), and while a flush writes, at most one
  segment more.
- age: a segment takes writes for about ``max_age / 4`` seconds and is deleted once its last
  write (its mtime) is ``max_age`` old, so a record stays on disk at most about
  ``1.25 * max_age`` after it was written; :meth:`RequestStore.load` never returns a record
  that finished (without a finish time: arrived) more than ``max_age`` ago.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path

import msgspec

from kvscope.agent.record_data import RecordData
from kvscope.agent.requests import FUTURE, MAX_TRANSFERS, RequestRecord
from kvscope.agent.segments import OutageLog, prune
from kvscope.events import MAX_SECONDS
from kvscope.files import check_writable
from kvscope.agent.worker import Worker

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">II")
_SUFFIX = ".kvseg"


def _frame_at(data: memoryview, offset: int,
              decoder: msgspec.msgpack.Decoder) -> tuple[RequestRecord | None, int] | None:
    """The record whose frame starts at ``offset`` and where that frame ends, or None when no
    intact frame starts there. An intact frame of a record with a count past 64 bits (a store
    from before records held 64-bit counts) gives no record, and its end."""
    if offset + _HEADER.size > len(data):
        return None
    length, crc = _HEADER.unpack_from(data, offset)
    end = offset + _HEADER.size + length
    if length == 0 or end > len(data):
        return None
    payload = data[offset + _HEADER.size:end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        record = decoder.decode(payload)
    except msgspec.DecodeError:
        return None
    try:
        return RequestRecord.from_data(record), end
    except OverflowError:
        return None, end


# The bytes a msgpack map begins with (fixmap, map 16, map 32), as 1s among 0s: a record's
# payload is a map (RecordData decodes from nothing else), so a frame starts only 8 bytes before one
_MAP_BYTES = bytes((*range(0x80, 0x90), 0xDE, 0xDF))
_MAP_STARTS = bytes(int(b in _MAP_BYTES) for b in range(256))
_MAX_CHUNK = 1 << 20


def _next_start(data: memoryview, offset: int) -> int:
    """The first offset from ``offset`` where a frame can start: its payload (``_HEADER.size``
    bytes on) begins with a msgpack map; ``len(data)`` when none does. Every other offset would
    fail :func:`_frame_at`'s decode, so skipping them changes no result. Searched in C (a
    translate and a find, in chunks that double from 512 bytes to 1 MiB): damaged bytes, zeroed
    after a power loss, are passed at hundreds of MB/s rather than the 1.2 MB/s of trying every
    offset in Python; random damage still offers a start every 14 bytes or so."""
    pos, size = offset + _HEADER.size, 512
    while pos < len(data):
        hit = bytes(data[pos:pos + size]).translate(_MAP_STARTS).find(1)
        if hit >= 0:
            return pos + hit - _HEADER.size
        pos += size
        size = min(2 * size, _MAX_CHUNK)
    return len(data)


def _segment_order(path: Path) -> tuple:
    """Sort key of a segment: its stamp, pid and sequence as numbers (a stamp past 15 digits,
    after a segment named far ahead, still sorts after it), a name not of that form first."""
    parts = path.name.removesuffix(_SUFFIX).split("-")
    try:
        return (1, *map(int, parts[1:4]), path.name) if len(parts) == 4 else (0, path.name)
    except ValueError:
        return (0, path.name)


def read_segment(path: Path) -> list[RequestRecord]:
    """Every intact record of one segment, in write order.

    An incomplete last frame (a crash mid-write) is ignored quietly. Damaged bytes elsewhere are
    skipped with a warning: reading resumes at the next offset where a whole frame holds — a
    length that fits, a matching CRC-32 and a payload that decodes as a record. A false match
    in damaged or payload bytes needs a 1-in-2**32 CRC coincidence and then a valid record, so
    what is resumed from is a real frame. Only offsets where a frame can start are tried (see
    :func:`_next_start`): 256 MiB zeroed by a power loss are passed in about a second, not
    minutes.
    """
    data = memoryview(path.read_bytes())
    decoder = msgspec.msgpack.Decoder(RecordData)
    records: list[RequestRecord] = []
    offset, damaged = 0, None  # damaged: where the bytes being skipped began
    while offset < len(data):
        frame = _frame_at(data, offset, decoder)
        if frame is None:
            damaged = offset if damaged is None else damaged
            offset = _next_start(data, offset + 1)
            continue
        if damaged is not None:
            log.warning("kvscope store: %s: skipped %d damaged bytes at offset %d",
                        path, offset - damaged, damaged)
            damaged = None
        record, offset = frame
        if record is None:
            log.warning("kvscope store: %s: skipped a record with a count past 64 bits at "
                        "offset %d", path, offset)
            continue
        records.append(record)
    if damaged is None:
        return records
    # A last frame that claims more bytes than remain is a torn tail, the normal crash case (a
    # damaged length field there looks the same).
    if (damaged + _HEADER.size > len(data)
            or damaged + _HEADER.size + _HEADER.unpack_from(data, damaged)[0] > len(data)):
        log.debug("kvscope store: %s: ignored an incomplete last frame at offset %d",
                  path, damaged)
    else:
        log.warning("kvscope store: %s: skipped %d damaged bytes at offset %d",
                    path, len(data) - damaged, damaged)
    return records


_DURATIONS = ("queueing", "lookup", "promotion_wait", "prefill", "itl")


def _durations_in_bounds(record: RequestRecord) -> bool:
    """Whether ``record``'s TTFT and its parts are durations events allow (0 to 1e9 s; a
    NaN TTFT restored made the summary's percentiles null until 10,000 newer requests)."""
    return all(value is None or 0.0 <= value <= MAX_SECONDS for value in (
        record.ttft, *map(record.__getattribute__, _DURATIONS)))


class RequestStore(Worker):
    """Persists finished requests under ``directory`` (created if missing).

    ``add()`` is cheap (an append to a list); the flush thread does the I/O. ``start()`` /
    ``shutdown()`` (flushes) are safe to repeat. ``max_bytes``, ``max_age``: see the module
    docstring. ``max_queued``: records waiting for the flush thread at most (a stalled disk
    holds it up); beyond it records are counted in ``lost``. ``clock``: Unix seconds, for
    segment names and ages (compared with segment mtimes) and record ages.
    """

    def __init__(self, directory: str | Path, *, flush_interval: float = 1.0,
                 segment_bytes: int = 8 << 20, max_bytes: int = 256 << 20,
                 max_age: float = 86_400.0, max_queued: int = 100_000,
                 clock=time.time) -> None:
        super().__init__()
        self.directory = Path(directory)
        self._interval = flush_interval
        # a quarter of max_bytes, so that deleting whole segments keeps the total near it
        self._segment_bytes = min(segment_bytes, max_bytes // 4)
        self._max_bytes = max_bytes
        self._max_age = max_age
        self._clock = clock
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: list[RequestRecord] = []
        self._max_queued = max_queued
        self._overflowed = False  # the queue was full since the last flush took it (logged)
        self._lock = threading.Lock()
        self._file = None
        self._owner = None  # the open lock file while this store has the directory (take())
        self._path: Path | None = None  # the segment being written
        self._opened = 0.0  # when it was opened, by clock
        self._size = 0  # its bytes
        self._synced = 0  # of them, those the last fsync made durable
        self._unsynced = 0  # records written to it since then
        self._durable = 0  # records of the running flush an fsync made durable
        self._seq = 0  # tells apart segments opened in the same millisecond
        self.unwritable = 0  # records skipped: a value msgpack cannot encode
        self.lost = 0  # records that will not come back: the disk failed (full, removed)
        self._outage = OutageLog(
            self.directory, lambda: self.lost, self.log_bug, label="kvscope store",
            meanwhile="requests finishing until it can are not stored",
            lost_as="requests could not be stored")

    def segments(self) -> list[Path]:
        """Segment files, oldest first (anything else with their suffix is left alone)."""
        return sorted((p for p in self.directory.glob(f"*{_SUFFIX}") if p.is_file()),
                      key=_segment_order)

    def load(self, limit: int) -> list[RequestRecord]:
        """The newest ``limit`` intact records on disk that finished within ``max_age``, oldest
        first, each request once (as last written). A store written before the agent bounded
        what a record holds is read within the bounds: records that finished more than
        :data:`~kvscope.agent.requests.FUTURE` seconds ahead of the clock are skipped, and only
        the first :data:`~kvscope.agent.requests.MAX_TRANSFERS` transfers are kept (the rest
        counted in ``transfers_omitted``); records with a TTFT or TTFT part that is no
        duration an emitter could send (NaN, infinite, negative: see
        :data:`~kvscope.events.Seconds`) are skipped."""
        now = self._clock()
        cutoff, ahead = now - self._max_age, now + FUTURE
        # newest first; a joined source's request is written at its finish and again once it
        # waited: the last version counts, at its place
        newest = (r for path in reversed(self.segments()) for r in reversed(read_segment(path))
                  if cutoff <= (r.arrival if r.finished is None else r.finished) <= ahead
                  and _durations_in_bounds(r))
        seen: set[tuple[str, str]] = set()
        records: list[RequestRecord] = []
        for record in newest if limit > 0 else ():
            if (record.source, record.request_id) not in seen:
                seen.add((record.source, record.request_id))
                records.append(record)
                if len(records) == limit:
                    break
        records.reverse()
        for record in records:
            extra = record.transfers[MAX_TRANSFERS:]
            if extra:
                record.transfers = record.transfers[:MAX_TRANSFERS]
                record.transfers_omitted += len(extra)
        return records

    def add(self, record: RequestRecord) -> None:
        """Queue ``record`` for the next flush; count it in ``lost`` when the queue is full."""
        with self._lock:
            if len(self._queue) < self._max_queued:
                self._queue.append(record)
                return
            self.lost += 1
            if self._overflowed:
                return
            self._overflowed = True
        log.warning("kvscope store: %d requests wait to be written to %s (they finish faster "
                    "than the store writes, or the disk is slow or stalled); more are counted "
                    "as lost (kvscope_records_dropped_total{sink=\"store\"}) until a flush "
                    "takes them", self._max_queued, self.directory)

    thread_name = "kvscope-store"

    def take(self) -> None:
        """Take the directory (created if missing) for this store alone, until the store stops
        or the process exits. Raises OSError (EBUSY) when another store, e.g. another agent's,
        has it: two writers would delete each other's segments and restore each other's
        records; other OSErrors where no file can be written there (see
        :func:`~kvscope.files.check_writable`)."""
        if self._owner is not None:
            return
        check_writable(self.directory)
        owner = open(self.directory / ".lock", "w")
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner.close()
            raise OSError(errno.EBUSY, "another kvscope agent uses this directory") from None
        self._owner = owner

    def prepare(self) -> None:
        self.take()

    def run(self) -> None:
        while not self.stopping.wait(self._interval):
            self._flush_logged()
        self._outage.stop(self.flush, "a flush")
        try:
            self._close()
        except OSError as exc:  # disk full at the end: what was written stays readable
            log.warning("kvscope store: could not close %s: %s", self._path, exc)
        self._owner.close()  # releases the directory
        self._owner = None

    def _flush_logged(self) -> None:
        self._outage.run(self.flush, "a flush")

    def flush(self) -> int:
        """Write and fsync what arrived since the last flush; rotate and prune segments.
        Returns how many records were written; raises OSError when the disk fails (e.g. full),
        giving up the segment being written (see :meth:`_abandon`): the next flush starts a new
        one. Of this flush's records, those an fsync made durable before the failure (in a
        segment it filled) count as written, the others in ``lost``: exactly those that a
        restart will not read back."""
        with self._lock:
            records, self._queue, self._overflowed = self._queue, [], False
        skipped = self.unwritable
        self._durable = 0
        try:
            self._hold_lock()
            if self._path is not None and not self._path.exists():
                self._abandon()  # its directory was removed: write on in a new one
            if self._file is not None and self._clock() - self._opened >= self._max_age / 4:
                self._close()  # closed, it can age out whole, even if nothing more comes
            written = self._write(records)
        except OSError:
            self.lost += len(records) - (self.unwritable - skipped) - self._durable
            self._abandon()
            raise
        self._prune()
        return written

    def _write(self, records: list[RequestRecord]) -> int:
        written = 0
        for record in records:
            try:
                payload = self._encoder.encode(record.data())
            except (OverflowError, TypeError, msgspec.EncodeError) as exc:
                # a value msgpack cannot hold (the events' bounds keep them out): skip that
                # record, never the store
                self.unwritable += 1
                if self.unwritable == 1:
                    log.warning("kvscope store: cannot write request %r (%s); skipped (logged "
                                "once)", record.request_id[:64], exc)
                continue
            frame = _HEADER.size + len(payload)
            if self._file is None or (self._size and self._size + frame > self._segment_bytes):
                self._rotate()
            self._file.write(_HEADER.pack(len(payload), zlib.crc32(payload)))
            self._file.write(payload)
            self._size += frame
            self._unsynced += 1
            written += 1
        if written:
            self._sync()
        return written

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._synced = self._size
        self._durable += self._unsynced
        self._unsynced = 0

    def _close(self) -> None:
        if self._file is not None:
            self._sync()
            self._file.close()
            self._file = self._path = None

    def _abandon(self) -> None:
        """Give up the segment being written: cut it back to what the last fsync made durable,
        so that no record counted lost comes back at a restart (the frames written before a full
        disk refused the rest did: 10,533 counted lost, 10,308 missing); delete it when that is
        nothing (a full disk left one empty segment per second). When even the cut fails (the
        file is gone with its directory; an I/O error), its whole frames past that point may
        still be read back."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # the disk failed: its buffered bytes are lost anyway
                pass
            try:
                if self._synced == 0:
                    self._path.unlink(missing_ok=True)
                else:
                    os.truncate(self._path, self._synced)
            except OSError:
                pass
        self._file = self._path = None
        self._unsynced = 0

    def _hold_lock(self) -> None:
        """Check that the lock this store took is still its directory's ``.lock``, and take it
        again when the directory or the file was removed or replaced (then another agent could
        have taken the directory). Raises OSError (EBUSY) when another agent holds it now: this
        store writes nothing there until it can take it back."""
        if self._owner is None:  # never taken (a store used on its own)
            return
        try:
            now, held = os.stat(self.directory / ".lock"), os.fstat(self._owner.fileno())
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return
        except FileNotFoundError:
            pass
        owner, self._owner = self._owner, None
        try:
            self.take()
        except OSError:
            self._owner = owner
            raise
        owner.close()

    def _rotate(self) -> None:
        self._close()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        self._opened = self._clock()
        name = f"requests-{self._stamp():015d}-{os.getpid()}-{self._seq:06d}{_SUFFIX}"
        self._path = self.directory / name
        self._file = open(self._path, "ab")
        self._size = self._synced = self._unsynced = 0
        self._prune()  # before this segment fills: the total stays within one segment of max

    def _stamp(self) -> int:
        """Milliseconds that name a new segment: the clock's, or past the newest segment's
        when the clock has stepped back since (NTP), as names order the segments: the newest
        version of a record is the one load() keeps, the oldest segment the one pruned."""
        stamp = int(self._opened * 1000)
        for path in reversed(self.segments()):
            newest = path.name.split("-")[1:2]
            if newest and newest[0].isdigit():
                return max(stamp, int(newest[0]) + 1)
        return stamp

    def _prune(self) -> None:
        """Delete the oldest segments beyond ``max_bytes`` in all, and those last written
        more than ``max_age`` ago (every record in them is older); never the one being written."""
        prune(self.segments(), self._max_bytes, keep=(self._path,),
              older_than=self._clock() - self._max_age, label="kvscope store")
