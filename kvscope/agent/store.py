"""The request store: finished requests persisted in append-only segment files.

Each record is one frame — 4-byte big-endian length, 4-byte CRC-32 of the payload, msgpack
payload — appended to the newest segment. A flush thread writes what arrived and fsyncs once per
``flush_interval`` (default 1 s), so a ``kill -9`` loses at most that last interval. A crash can
leave only the final frame of the newest segment incomplete; readers stop at the first frame
whose length or checksum does not hold, and a restarted writer starts a fresh segment, so what
was written is never corrupted. Segments rotate at ``segment_bytes``; the oldest are deleted
beyond ``max_bytes`` in all or ``max_age`` seconds.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path

import msgspec

from kvscope.agent.requests import RequestRecord
from kvscope.agent.worker import Worker

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">II")
_SUFFIX = ".kvseg"


def read_segment(path: Path) -> list[RequestRecord]:
    """Every intact record of one segment, in write order (stops at a torn or corrupt frame)."""
    data = path.read_bytes()
    decoder = msgspec.msgpack.Decoder(RequestRecord)
    records, offset = [], 0
    while offset + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, offset)
        payload = data[offset + _HEADER.size: offset + _HEADER.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        try:
            records.append(decoder.decode(payload))
        except msgspec.DecodeError:
            break
        offset += _HEADER.size + length
    return records


class RequestStore(Worker):
    """Persists finished requests under ``directory`` (created if missing).

    ``add()`` is cheap (an append to a list); the flush thread does the I/O. ``start()`` /
    ``shutdown()`` (flushes) are safe to repeat. ``clock``: Unix seconds, for segment names and
    the age limit.
    """

    def __init__(self, directory: str | Path, *, flush_interval: float = 1.0,
                 segment_bytes: int = 8 << 20, max_bytes: int = 256 << 20,
                 max_age: float = 86_400.0, clock=time.time) -> None:
        super().__init__()
        self.directory = Path(directory)
        self._interval = flush_interval
        self._segment_bytes = segment_bytes
        self._max_bytes = max_bytes
        self._max_age = max_age
        self._clock = clock
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._file = None

    def segments(self) -> list[Path]:
        """Segment files, oldest first."""
        return sorted(self.directory.glob(f"*{_SUFFIX}"))

    def load(self, limit: int) -> list[RequestRecord]:
        """The newest ``limit`` intact records on disk, oldest first."""
        records: list[RequestRecord] = []
        for path in reversed(self.segments()):
            records[:0] = read_segment(path)
            if len(records) >= limit:
                break
        return records[-limit:] if limit else []

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._queue.append(record)

    thread_name = "kvscope-store"

    def prepare(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def run(self) -> None:
        while not self.stopping.wait(self._interval):
            self._flush_logged()
        self._flush_logged()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except OSError as exc:  # disk full, directory removed: keep serving, say so
            log.warning("kvscope store: could not write %s: %s", self.directory, exc)

    def flush(self) -> None:
        """Write and fsync what arrived since the last flush; rotate and prune segments."""
        with self._lock:
            records, self._queue = self._queue, []
        if not records:
            return
        frames = bytearray()
        for record in records:
            payload = self._encoder.encode(record)
            frames += _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        if self._file is None or self._file.tell() >= self._segment_bytes:
            self._rotate()
        self._file.write(frames)
        self._file.flush()
        os.fsync(self._file.fileno())

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"requests-{int(self._clock() * 1000):015d}-{os.getpid()}{_SUFFIX}"
        self._file = open(self.directory / name, "ab")
        self._prune()

    def _prune(self) -> None:
        segments = self.segments()[:-1]  # never the one being written
        sizes = {p: p.stat().st_size for p in segments}
        total = sum(sizes.values())
        now = self._clock()
        for path in segments:
            if total > self._max_bytes or now - path.stat().st_mtime > self._max_age:
                total -= sizes[path]
                path.unlink(missing_ok=True)
