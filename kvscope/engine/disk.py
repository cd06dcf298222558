"""The ``disk`` tier's payload: one chunk file per slot, checksummed, written atomically.

A chunk file ``chunk-<slot>.kv`` holds one KV block: a 32-byte header, then the payload.

    offset  size  field
    0       4     magic b"KVSC"
    4       2     format version (1)
    6       2     header size (32)
    8       8     prefix hash of the block (unsigned, little-endian)
    16      8     payload length, bytes
    24      4     CRC-32 of the payload (zlib.crc32, the IEEE 802.3 polynomial)
    28      4     zero padding

A write goes to ``.chunk-<slot>.kv.tmp`` and is renamed over the chunk (``os.replace``, atomic
on POSIX), so a reader sees the old file or the new one, never half of one; a failed write
removes its temporary file. Every read checks magic, hash, length and checksum before the
caller may use the bytes. Failures raise :class:`DiskError` with a bounded ``reason``.
Reads and writes of a batch run on a thread pool (``os.readv``/``os.writev`` and zlib release
the GIL).
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvscope.files import check_writable, hold_directory

HEADER = struct.Struct("<4sHHQQI4x")
MAGIC = b"KVSC"
VERSION = 1
_U64 = (1 << 64) - 1

# Bounded set of failure reasons (a metric label, so never open-ended; docs/agent.md, Events).
# disk_full: ENOSPC, EDQUOT or EFBIG; permission: EACCES, EPERM or EROFS; missing: no chunk
# file; truncated: shorter than header + payload; corrupt: a bad header, or the chunk holds
# another block; checksum: payload CRC mismatch; io: any other OSError.
REASONS: tuple[str, ...] = ("disk_full", "permission", "missing", "truncated", "checksum",
                            "corrupt", "io")


class DiskError(Exception):
    """A chunk could not be written or read back intact. ``reason``: one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def _reason(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "disk_full"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    if exc.errno == errno.ENOENT:
        return "missing"
    return "io"


class DiskStore:
    """Chunk files of ``block_bytes``-byte blocks under ``directory``.

    ``directory``: created if absent; None makes a private temporary directory. :meth:`close`
    removes the chunks written (a disk tier's chunks mean nothing without the engine's index of
    them, which ends with it: a large preset's would leave gigabytes behind) and the
    directories this store created, once empty. ``threads``: I/O worker threads. Leftover
    temporary files from an earlier crash are removed at start.

    One store a directory: it holds a lock on it (``flock`` of the directory itself, so no
    file of its own is left) until :meth:`close`. Raises OSError (``EBUSY``) when another
    store, in this process or another, holds it: two replays on one directory overwrote each
    other's chunks and read them back as corrupt.
    """

    def __init__(self, directory: str | Path | None, block_bytes: int, threads: int = 4) -> None:
        self._temporary = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="kvscope-disk-") if directory is None
                              else directory)
        # the directories this store creates, deepest first: removed at close once empty
        self._created = list(itertools.takewhile(lambda d: not d.exists(),
                                                 (self.directory, *self.directory.parents)))
        check_writable(self.directory)  # a tier that fails every chunk does not start
        self._lock = hold_directory(self.directory, "another kvscope engine (a replay or "
                                    "demo running now)")
        self._written: set[int] = set()  # slots with a chunk file (set.add: one bytecode, atomic)
        self.block_bytes = block_bytes
        self._threads = threads
        try:
            for stale in self.directory.glob(".chunk-*.kv.tmp"):
                stale.unlink(missing_ok=True)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvscope-disk")
        except BaseException:  # the directory is free again for the next store
            os.close(self._lock)
            raise

    def bytes_for(self, chunks: int) -> int:
        """Bytes of disk ``chunks`` chunk files take: each its header and ``block_bytes``,
        rounded up to the file system's block, and one more per I/O thread (a rewrite's
        temporary file stands beside the chunk it replaces until the rename)."""
        unit = os.statvfs(self.directory).f_frsize or 1
        size = -(-(HEADER.size + self.block_bytes) // unit) * unit
        return (chunks + self._threads) * size

    def path(self, slot: int) -> Path:
        return self.directory / f"chunk-{slot:08d}.kv"

    def write(self, slot: int, block_hash: int, payload) -> None:
        """Write ``payload`` (a bytes-like of ``block_bytes`` bytes) as slot ``slot``'s chunk.

        Raises :class:`DiskError` (``disk_full``, ``permission``, ``io``); the old chunk,
        if any, is left as it was and no temporary file remains.
        """
        final = self.path(slot)
        tmp = final.with_name(f".{final.name}.tmp")
        header = HEADER.pack(MAGIC, VERSION, HEADER.size, block_hash & _U64, len(payload),
                             zlib.crc32(payload))
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            buffers = [memoryview(header), memoryview(payload).cast("B")]
            while buffers:
                n = os.writev(fd, buffers)
                while buffers and n >= len(buffers[0]):
                    n -= len(buffers[0])
                    buffers.pop(0)
                if buffers:
                    buffers[0] = buffers[0][n:]
            os.close(fd)
            fd = -1
            self._written.add(slot)  # before the rename: an interrupt after it leaves no chunk
            os.replace(tmp, final)
        except BaseException as exc:  # an interrupt too (SIGTERM stops a replay so): no .tmp
            if fd >= 0:
                os.close(fd)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the directory itself refuses us; nothing was created in it
            if not isinstance(exc, OSError):
                raise
            raise DiskError(_reason(exc), f"writing {final}: {exc.strerror or exc}") from None

    def read_into(self, slot: int, block_hash: int, out) -> None:
        """Read slot ``slot``'s chunk into ``out`` (a writable buffer of ``block_bytes``) and
        verify it holds ``block_hash`` intact.

        Raises :class:`DiskError` (``missing``, ``permission``, ``truncated``, ``corrupt``,
        ``checksum``, ``io``); ``out`` may then hold garbage and must
        not be used.
        """
        path = self.path(slot)
        header = bytearray(HEADER.size)
        view = memoryview(out).cast("B")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DiskError(_reason(exc), f"opening {path}: {exc.strerror or exc}") from None
        try:
            n = os.readv(fd, [header, view])
        except OSError as exc:
            raise DiskError(_reason(exc), f"reading {path}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        if n < HEADER.size + len(view):
            raise DiskError("truncated", f"{path}: {n} bytes, expected {HEADER.size + len(view)}")
        magic, version, size, stored_hash, length, crc = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION or size != HEADER.size or length != len(view):
            raise DiskError("corrupt", f"{path}: bad header")
        if stored_hash != block_hash & _U64:
            raise DiskError("corrupt", f"{path}: holds block {stored_hash}, not {block_hash}")
        if zlib.crc32(view) != crc:
            raise DiskError("checksum", f"{path}: payload checksum mismatch")

    def _run(self, fn, items) -> list[str | None]:
        def one(item):
            try:
                fn(*item)
            except DiskError as exc:
                return exc.reason
            return None

        if len(items) == 1:
            return [one(items[0])]
        return list(self._pool.map(one, items))

    def write_many(self, items) -> list[str | None]:
        """Write ``(slot, hash, payload)`` items in parallel; per item None or a reason."""
        return self._run(self.write, items)

    def read_many(self, items) -> list[str | None]:
        """Read ``(slot, hash, out)`` items in parallel; per item None or a reason."""
        return self._run(self.read_into, items)

    def close(self) -> None:
        """Stop the I/O threads; remove the chunks written, and the directories this store
        created once empty; then release the directory. Safe twice."""
        self._pool.shutdown(wait=True)
        if self._temporary:
            shutil.rmtree(self.directory, ignore_errors=True)
        for slot in self._written:
            try:
                self.path(slot).unlink(missing_ok=True)
            except OSError:  # a chunk that cannot go stays: closing never fails for it
                pass
        self._written.clear()
        for directory in self._created:
            try:
                directory.rmdir()  # only if empty: what else it holds is not ours
            except OSError:
                break
        self._created = []
        if self._lock >= 0:  # last: another store may use the directory from here on
            os.close(self._lock)  # the flock goes with it
            self._lock = -1
