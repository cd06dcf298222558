"""The capture sink: block accesses, finished requests, transfer and token totals and tier
capacities recorded to Parquet segments.

A capture directory holds five kinds of segments, each a complete Parquet file (Apache Parquet
format, written with pyarrow):

- ``blocks-<ms>-<pid>-<seq>.parquet``: one row per block looked up (:data:`BLOCKS_SCHEMA`),
  from :class:`~kvscope.events.Lookup` events that carry ``block_hashes`` (engines fill them
  on request, e.g. ``OffloadEngine(record_blocks=True)``; the vLLM tap fills them with a
  spatially hashed sample of the blocks, whose rate each row records, and a sampled lookup
  with no block sampled is one row of depth -1, so that its blocks count in the full
  stream); ``kvscope analyze DIR`` reads them.
- ``requests-<ms>-<pid>-<seq>.parquet``: one row per finished request (:data:`REQUESTS_SCHEMA`),
  from the pipeline's request records; ``kvscope compare BASELINE CANDIDATE`` reads them.
- ``totals-<ms>-<pid>-<seq>.parquet``: the agent's cumulative transfer counters by direction
  (:data:`TOTALS_SCHEMA`), a row per direction whenever they changed at a dashboard sample:
  every transfer, the offloads no request's record holds included (vLLM's stores are
  background work), and the failed ones where a source sees copies fail; ``kvscope compare``
  takes the transfer cost and failures from them.
- ``tokens-<ms>-<pid>-<seq>.parquet``: the agent's cumulative prompt tokens by source
  (:data:`TOKENS_SCHEMA`), a row per source whenever they changed at a dashboard sample: the
  engine's own counts too, which no request's record holds (vLLM in zero-code mode counts
  tokens by source in its /metrics, not per request); ``kvscope compare`` takes tokens by
  source from them where the records carry none.
- ``tiers-<ms>-<pid>-<seq>.parquet``: each tier's capacity as its engine reported it
  (:data:`TIERS_SCHEMA`), a row per tier whenever it changed at a dashboard sample;
  ``kvscope analyze`` takes the GPU prefix cache's size and the KV bytes per block from them.

Crash safety: a segment is written as ``<name>.parquet.tmp`` (one row group per flush), then
closed, fsynced and renamed to ``<name>.parquet``, so a ``.parquet`` file is always whole; a
crash leaves at most a ``.tmp`` file, which readers ignore and the next writer removes (one that
no running writer holds a ``flock`` on). A crash loses the rows of the open segment (at most
``segment_seconds`` or ``segment_rows`` of them). Segments rotate at ``segment_rows`` rows,
``segment_bytes`` bytes (at most a quarter of ``max_bytes``) or ``segment_seconds`` seconds,
whichever comes first; after each rotation the oldest finished segments (both kinds, by start
time) are deleted while all of them together exceed ``max_bytes`` (the one just finished is
kept). Disk use is therefore at most about ``max_bytes`` plus one open segment per kind. Memory
is bounded by ``max_pending_rows`` rows per kind between flushes; rows beyond it are dropped and
counted in :attr:`CaptureWriter.dropped`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import BinaryIO
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pyarrow as pa
import pyarrow.parquet as pq

from kvscope import events as ev
from kvscope import samples as sf
from kvscope.agent.record_data import RecordData
from kvscope.agent.requests import RequestRecord
from kvscope.agent.segments import OutageLog, prune
from kvscope.agent.worker import Worker
from kvscope.files import check_writable, hold_directory

log = logging.getLogger(__name__)

SUFFIX = ".parquet"
WRITER_KEY = "kvscope.writer"  # segment metadata: the writer that made it (CaptureWriter)
TMP_SUFFIX = ".parquet.tmp"
KINDS = ("blocks", "requests", "totals", "tokens", "tiers")
# the kinds whose rows are the agent's state when written, all of it at each change (the
# counters since it started, the tiers' capacities): the newest segment of each is kept
# whatever the size cap, or a long run's capacities, written once, were the first pruned
STATE_KINDS = ("totals", "tokens", "tiers")
_U64 = (1 << 64) - 1
_I32 = (1 << 31) - 1

BLOCKS_SCHEMA = pa.schema([
    pa.field("ts", pa.float64()),           # Unix seconds of the lookup
    pa.field("source", pa.string()),        # the emitter (pipeline source name)
    pa.field("request_id", pa.string()),
    pa.field("depth", pa.int32()),          # block position in the prompt, 0 = first
    pa.field("block_hash", pa.uint64()),    # prefix hash (equal = reusable KV)
    pa.field("outcome", pa.string()),       # gpu, cpu, disk or recompute ("" unknown)
    pa.field("tokens", pa.int32()),         # tokens this block covers (partial last block)
    pa.field("block_tokens", pa.int32()),   # tokens per full block (0 unknown)
    pa.field("prompt_tokens", pa.int64()),  # the request's prompt length, tokens
    # share of blocks (0-1, by hash) the lookup's rows were sampled at (1: every block)
    pa.field("sample_rate", pa.float64()),
    pa.field("lookup_blocks", pa.int64()),  # blocks the lookup looked up, sampled or not
], metadata={"kvscope.kind": "blocks"})
BLOCKS_ADDED = {"sample_rate": 1.0, "lookup_blocks": -1}  # columns older captures lack: default

# Scalar types of the request schema (RecordData) as Arrow types; float | None is a float
# column with NaN for None (unknown)
_ARROW = {mi.StrType: pa.string(), mi.FloatType: pa.float64(), mi.IntType: pa.int64(),
          mi.BoolType: pa.bool_()}


def _arrow(kind: mi.Type) -> pa.DataType:
    if isinstance(kind, mi.UnionType):
        (kind,) = [t for t in kind.types if not isinstance(t, mi.NoneType)]
    if isinstance(kind, mi.VarTupleType):  # the transfers: a list of structs
        return pa.list_(pa.struct([pa.field(f.name, _arrow(f.type))
                                   for f in kind.item_type.fields]))
    return _ARROW[type(kind)]


_REQUEST_FIELDS = mi.type_info(RecordData).fields


def _request_fields() -> list[pa.Field]:
    """The capture's columns of the request schema, field for field, in its order; its
    dict of prompt tokens by source is one column per token source (``tokens_<source>``)."""
    out = []
    for f in _REQUEST_FIELDS:
        if isinstance(f.type, mi.DictType):
            out += [pa.field(f"{f.name}_{s}", _arrow(f.type.value_type))
                    for s in ev.TOKEN_SOURCES]
        else:
            out.append(pa.field(f.name, _arrow(f.type)))
    return out


# one row per finished request: the request schema (agent/record_data.py), times in Unix
# seconds, durations in seconds, NaN for a TTFT or finish unknown; and the tiers the agent
# reported then, comma-separated nearest the GPU first ("" unknown: before its first sample,
# or no source reports tiers), so that a tier that was off is not read as one that served 0
REQUESTS_SCHEMA = pa.schema([*_request_fields(), pa.field("tiers", pa.string())],
                            metadata={"kvscope.kind": "requests"})
REQUESTS_ADDED = {"tiers": ""}  # columns older captures lack: default

TOTALS_SCHEMA = pa.schema([
    pa.field("ts", pa.float64()),           # Unix seconds of the agent's sample
    pa.field("direction", pa.string()),     # "src->dst"
    pa.field("bytes", pa.int64()),          # cumulative since the agent started
    pa.field("blocks", pa.int64()),
    pa.field("seconds", pa.float64()),      # of the timed transfers
    pa.field("failures", pa.int64()),       # failed transfers; null: no source sees them fail
], metadata={"kvscope.kind": "totals"})
TOTALS_ADDED = {"failures": None}  # columns older captures lack: default (not measured)

TOKENS_SCHEMA = pa.schema([
    pa.field("ts", pa.float64()),           # Unix seconds of the agent's sample
    pa.field("source", pa.string()),        # gpu, cpu, disk or recompute
    pa.field("tokens", pa.int64()),         # prompt tokens, cumulative since the agent started
], metadata={"kvscope.kind": "tokens"})

TIERS_SCHEMA = pa.schema([
    pa.field("ts", pa.float64()),               # Unix seconds of the agent's sample
    pa.field("tier", pa.string()),              # gpu, cpu or disk
    pa.field("capacity_bytes", pa.int64()),     # 0: the engine reported blocks only
    pa.field("capacity_blocks", pa.int64()),    # blocks of the engine's block size
], metadata={"kvscope.kind": "tiers"})

SCHEMAS = {"blocks": BLOCKS_SCHEMA, "requests": REQUESTS_SCHEMA, "totals": TOTALS_SCHEMA,
           "tokens": TOKENS_SCHEMA, "tiers": TIERS_SCHEMA}


def segment_key(path: Path) -> tuple[str, str]:
    """Sort key of a segment file: its start time (then pid and sequence), whatever its kind."""
    return path.name.split("-", 1)[1], path.name


class _Stream:
    """One kind of segment: pending rows (column lists) and the open ``.tmp`` segment."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.schema = SCHEMAS[kind]
        self.pending: dict[str, list] = {name: [] for name in self.schema.names}
        self.rows = 0            # pending rows
        self.writer: pq.ParquetWriter | None = None
        self.tmp: Path | None = None
        self.lock: BinaryIO | None = None  # the .tmp opened again, flock()ed while written
        self.opened_at = 0.0
        self.segment_rows = 0    # rows in the open segment

    def take(self) -> tuple[dict[str, list], int]:
        pending, rows = self.pending, self.rows
        self.pending = {name: [] for name in self.schema.names}
        self.rows = 0
        return pending, rows


def finished_segments(directory: Path, kind: str | None = None) -> list[Path]:
    """The finished segments (of ``kind``, or every kind) of the capture in ``directory``,
    oldest first by start time."""
    kinds = (kind,) if kind else KINDS
    paths = [p for k in kinds for p in directory.glob(f"{k}-*{SUFFIX}") if p.is_file()]
    return sorted(paths, key=segment_key)


def missing_segments(directory: Path) -> int:
    """How many segments the writers of the capture in ``directory`` finished or began that
    are gone: deleted by the size cap (``max_bytes``, oldest first) or lost (a failed write,
    a crashed writer's unfinished one). A writer numbers the segments it opens, every kind
    together, 1, 2, 3, ... (``<kind>-<ms>-<pid>-<seq>``), so below the highest number a writer
    left, each one missing is a segment gone. A writer's numbers start again at 1 (a new
    agent with the pid of an old one: pid 1 in a container) where, in time order, a number
    does not exceed the one before. A segment still open (``.tmp``: a running writer's) is
    there, not gone."""
    runs: dict[str, tuple[int, int]] = {}  # pid -> (its highest number, segments left)
    missing = 0
    opened = [p for k in KINDS for p in directory.glob(f"{k}-*{TMP_SUFFIX}")]
    for path in sorted([*finished_segments(directory), *opened], key=segment_key):
        parts = path.name.removesuffix(TMP_SUFFIX).removesuffix(SUFFIX).split("-")
        if len(parts) != 4 or not (parts[2].isdigit() and parts[3].isdigit()):
            continue  # not a name this writer gives: nothing to tell from it
        seq, (last, left) = int(parts[3]), runs.get(parts[2], (0, 0))
        if seq <= last:  # a new writer with this pid: its run starts over
            missing += last - left
            last = left = 0
        runs[parts[2]] = (seq, left + 1)
    return missing + sum(last - left for last, left in runs.values())


class CaptureWriter(Worker):
    """Writes a capture under ``directory`` (created on start).

    ``add_lookup`` / ``add_request`` are cheap (appends under a lock) and are meant to be
    subscribed to the pipeline (:meth:`~kvscope.agent.pipeline.Pipeline.subscribe_lookups`,
    :meth:`~kvscope.agent.pipeline.Pipeline.subscribe`), ``add_sample`` to be given each
    dashboard sample (the agent's sampler does); a flush thread writes every
    ``flush_interval`` seconds. Sizes in bytes, times in seconds. ``clock``: Unix seconds,
    for segment names and ages. ``start()`` / ``shutdown()`` (which finishes every open
    segment) are safe to repeat, and ``shutdown()`` is safe without ``start()``.
    """

    def __init__(self, directory: str | Path, *, max_bytes: int = 1 << 30,
                 segment_rows: int = 1_000_000, segment_bytes: int = 64 << 20,
                 segment_seconds: float = 60.0, flush_interval: float = 1.0,
                 max_pending_rows: int = 1_000_000,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_rows = segment_rows
        # a quarter of max_bytes at most, so that the segment kept at a prune is no excess
        self.segment_bytes = min(segment_bytes, max(1, max_bytes // 4))
        self.segment_seconds = segment_seconds
        self.max_pending_rows = max_pending_rows
        self._interval = flush_interval
        self._clock = clock
        self._streams = {kind: _Stream(kind) for kind in KINDS}
        self._lock = threading.Lock()      # pending rows
        self._io_lock = threading.Lock()   # segment files
        self._seq = 0
        # in every segment's metadata: a copy of a capture (cp -r) keeps it, another run's
        # differs even where a segment's name is the same (two writers of one process in one
        # millisecond), so compare can tell a run from its copy
        self.writer_id = os.urandom(8).hex()
        self.dropped: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._unfit_logged = False
        self._outage = OutageLog(
            self.directory, lambda: sum(self.dropped.values()), self.log_bug,
            label="kvscope capture", meanwhile="rows are dropped until it can",
            lost_as="rows could not be written")
        self._totals: dict[str, tuple] = {}  # the transfer counters last queued (add_sample)
        self._tokens: dict[str, tuple] = {}  # the token counters last queued (add_sample)
        self._capacities: dict[str, tuple] = {}  # the tier capacities last queued (add_sample)
        self._tiers = ""  # the tiers the last sample reported (add_sample), for add_request
        self._held = -1  # the directory's descriptor while started (prepare)

    # -- sinks ------------------------------------------------------------------------------

    def add_lookup(self, source: str, lookup: ev.Lookup) -> None:
        """Queue one row per block of ``lookup`` (nothing when it carries no block hashes and
        is not sampled; one row of depth -1, hash 0, when it is sampled and none was kept).

        Hashes are stored as unsigned 64-bit (a negative or wider int is reduced mod 2**64).
        A block's position is its ``block_depths`` entry (its index when there are none); its
        tokens come from the prompt length (the sum of ``lookup.tokens``) and
        ``lookup.block_tokens`` (0 when unknown). Rows that do not fit (``max_pending_rows``
        queued, or a block over 2**31 - 1 tokens) are counted in ``dropped``.
        """
        hashes = lookup.block_hashes
        rate = lookup.block_sample_rate
        if not hashes and rate >= 1.0:
            return
        n = len(hashes)
        prompt = sum(lookup.tokens.values())
        bt = lookup.block_tokens
        depths = lookup.block_depths if len(lookup.block_depths) == n else range(n)
        if not n:  # sampled, none kept: the lookup's blocks still count in the full stream
            hashes, depths = (0,), (-1,)
            tokens, outcomes = [0], [""]
        elif bt > 0:
            counts = ev.block_token_counts(prompt, depths[-1] + 1, bt)
            tokens = [counts[d] for d in depths]
        else:
            tokens = [0] * n
        if n:
            outcomes = list(lookup.block_sources) if len(lookup.block_sources) == n else [""] * n
        rows = len(hashes)
        with self._lock:
            stream = self._streams["blocks"]
            # a block of 2**31 tokens or more is no block (its columns are int32): this
            # lookup's rows are dropped, never the flush with every other lookup's rows
            if stream.rows + rows > self.max_pending_rows or bt > _I32:
                self.dropped["blocks"] += rows
                return
            cols = stream.pending
            cols["ts"].extend([lookup.ts] * rows)
            cols["source"].extend([source] * rows)
            cols["request_id"].extend([lookup.request_id] * rows)
            cols["depth"].extend(depths)
            cols["block_hash"].extend([h & _U64 for h in hashes])
            cols["outcome"].extend(outcomes)
            cols["tokens"].extend(tokens)
            cols["block_tokens"].extend([bt] * rows)
            cols["prompt_tokens"].extend([prompt] * rows)
            cols["sample_rate"].extend([rate] * rows)
            cols["lookup_blocks"].extend([max(lookup.blocks, n)] * rows)
            stream.rows += rows

    def add_request(self, record: RequestRecord) -> None:
        """Queue one row for a finished request record (:data:`REQUESTS_SCHEMA`)."""
        row = msgspec.structs.asdict(record.data())
        for f in _REQUEST_FIELDS:  # the columns' forms of the schema's fields (_request_fields)
            if isinstance(f.type, mi.UnionType) and row[f.name] is None:
                row[f.name] = float("nan")
            elif isinstance(f.type, mi.DictType):
                by_source = row.pop(f.name)
                row.update({f"{f.name}_{s}": by_source.get(s, 0) for s in ev.TOKEN_SOURCES})
            elif isinstance(f.type, mi.VarTupleType):
                row[f.name] = [msgspec.structs.asdict(item) for item in row[f.name]]
        with self._lock:
            row["tiers"] = self._tiers
            stream = self._streams["requests"]
            if stream.rows + 1 > self.max_pending_rows:
                self.dropped["requests"] += 1
                return
            for name, value in row.items():
                stream.pending[name].append(value)
            stream.rows += 1

    def add_sample(self, sample: dict) -> None:
        """Queue the transfer and token counters and tier capacities of one dashboard sample
        (:meth:`~kvscope.agent.pipeline.Pipeline.record_sample`'s: ``ts``, and
        ``transfer_bytes``, ``transfer_blocks``, ``transfer_seconds_sum`` and
        ``transfer_failures`` (a direction missing: no source sees its copies fail) by
        "src->dst"; ``prompt_tokens`` by source; ``tier_capacity_bytes`` and
        ``tier_capacity_blocks`` by tier, when it has them): a row per direction, one per
        source (once any counted a token) and one per tier, when they changed since the last
        rows queued (an idle agent adds none). The tiers it reports go with the requests
        added after it."""
        seconds, blocks = sample["transfer_seconds_sum"], sample["transfer_blocks"]
        moved = {d: (int(n), int(blocks.get(d, 0)), float(seconds.get(d, 0.0)))
                 for d, n in sample["transfer_bytes"].items()}
        failures = sample.get(sf.TRANSFER_FAILURES.name) or {}
        totals = {d: (*moved.get(d, (0, 0, 0.0)),  # (0, 0, 0.0): every copy of it failed
                      int(failures[d]) if d in failures else None)
                  for d in {**moved, **failures}}
        counted = sample.get(sf.PROMPT_TOKENS.name) or {}
        tokens = {s: (int(n),) for s, n in counted.items()} if any(counted.values()) else {}
        reported = sample.get(sf.TIER_CAPACITY_BYTES.name)
        nbytes, blocks = reported or {}, sample.get(sf.TIER_CAPACITY_BLOCKS.name) or {}
        capacities = {t: (int(nbytes.get(t, 0)), int(blocks.get(t, 0)))
                      for t in ev.TIERS if t in nbytes or t in blocks}
        with self._lock:
            if reported is not None:
                self._tiers = ",".join(t for t in ev.TIERS if t in reported)
            if totals != self._totals and self._queue("totals", sample["ts"], totals):
                self._totals = totals
            if tokens != self._tokens and self._queue("tokens", sample["ts"], tokens):
                self._tokens = tokens
            if capacities and capacities != self._capacities and self._queue(
                    "tiers", sample["ts"], capacities):
                self._capacities = capacities

    def _queue(self, kind: str, ts: float, rows: dict[str, tuple]) -> bool:
        """Queue ``rows`` (key -> the other columns, in schema order) of ``kind`` at ``ts``
        (under the lock); False, with them counted as dropped, when they do not fit."""
        stream = self._streams[kind]
        if stream.rows + len(rows) > self.max_pending_rows:
            self.dropped[kind] += len(rows)
            return False
        names = stream.schema.names
        for key, values in rows.items():
            stream.pending[names[0]].append(ts)
            stream.pending[names[1]].append(key)
            for name, value in zip(names[2:], values):
                stream.pending[name].append(value)
        stream.rows += len(rows)
        return True

    # -- lifecycle --------------------------------------------------------------------------

    thread_name = "kvscope-capture"

    def prepare(self) -> None:
        """Make the directory if missing, take it (:func:`~kvscope.files.hold_directory`, until
        the writer stops) and remove orphaned ``.tmp`` segments; raises OSError where no file
        can be written there (see :func:`~kvscope.files.check_writable`: a capture
        that would drop every row does not start) or another writer has it (two demos into
        one directory wrote one capture of both, every request twice)."""
        check_writable(self.directory)
        self._held = hold_directory(self.directory, "another kvscope capture (an agent or "
                                    "demo writing to it now)")
        try:
            self._remove_orphans()
        except BaseException:
            os.close(self._held)
            raise

    def run(self) -> None:
        try:
            while not self.stopping.wait(self._interval):
                self._logged(self.flush)
            self._outage.stop(self.close, "close")  # and at the stop, what an outage lost
        finally:
            os.close(self._held)  # the directory is free for the next writer

    def _logged(self, step: Callable[[], int | None]) -> None:
        """Run ``step`` (flush or close), logging a failure to write once until rows are
        written again (see :class:`~kvscope.agent.segments.OutageLog`)."""
        self._outage.run(step, step.__name__)

    # -- segments ---------------------------------------------------------------------------

    def segments(self, kind: str | None = None) -> list[Path]:
        """Finished segments (of ``kind``, or every kind), oldest first by start time."""
        return finished_segments(self.directory, kind)

    def flush(self) -> int:
        """Write pending rows into the open segments; finish those due for rotation. A stream
        whose segment cannot be written (a full disk, the directory removed) gives that
        segment up (see :meth:`_abandon`); the other stream is still written, and the first
        such OSError is raised afterwards. Returns the rows of the segments it finished: rows
        only in an open segment are not written yet (a full disk took them, then refused the
        segment's end, and counting them made the outage log "writing again" every other
        flush)."""
        failure: OSError | None = None
        written = 0
        with self._io_lock:
            now = self._clock()
            for stream in self._streams.values():
                with self._lock:
                    columns, rows = stream.take()
                table = self._table(stream, columns) if rows else None
                unwritten = rows if table is not None else 0
                try:
                    if table is not None:
                        if stream.writer is None:
                            self._open(stream, now)
                        stream.writer.write_table(table)
                        stream.segment_rows += rows
                        unwritten = 0
                    if stream.writer is not None and (
                            stream.segment_rows >= self.segment_rows
                            or now - stream.opened_at >= self.segment_seconds
                            or stream.tmp.stat().st_size >= self.segment_bytes):
                        written += self._finish(stream)
                except OSError as exc:  # this segment cannot be whole
                    self._abandon(stream, unwritten)
                    failure = failure or exc
        if failure is not None:
            raise failure
        return written

    def _table(self, stream: _Stream, columns: dict[str, list]) -> pa.Table | None:
        """The pending rows as a table of the stream's schema; None, with the rows counted as
        dropped and the first such loss logged, when a value does not fit its column."""
        try:
            return pa.Table.from_pydict(columns, schema=stream.schema)
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
            rows = len(next(iter(columns.values()), ()))
            with self._lock:
                self.dropped[stream.kind] += rows
            if not self._unfit_logged:
                self._unfit_logged = True
                log.warning("kvscope capture: dropped %d %s rows that do not fit the Parquet "
                            "schema: %s (logged once)", rows, stream.kind, exc)
            return None

    def close(self) -> int:
        """Flush, then finish every open segment (shutdown does this); one that cannot be
        finished is given up (see :meth:`_abandon`), and the first OSError raised afterwards.
        Returns the rows of the segments finished."""
        failure: OSError | None = None
        written = 0
        try:
            written = self.flush()
        except OSError as exc:
            failure = exc
        with self._io_lock:
            for stream in self._streams.values():
                if stream.writer is not None:
                    try:
                        written += self._finish(stream)
                    except OSError as exc:
                        self._abandon(stream, 0)
                        failure = failure or exc
        if failure is not None:
            raise failure
        return written

    def _open(self, stream: _Stream, now: float) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        name = f"{stream.kind}-{int(now * 1000):015d}-{os.getpid()}-{self._seq:06d}"
        stream.tmp = self.directory / (name + TMP_SUFFIX)
        stream.lock = open(stream.tmp, "wb")  # locked before anything is written: a writer
        fcntl.flock(stream.lock, fcntl.LOCK_EX)  # starting now must not take it for an orphan
        schema = stream.schema.with_metadata({**stream.schema.metadata,
                                              WRITER_KEY: self.writer_id})
        stream.writer = pq.ParquetWriter(stream.tmp, schema, compression="zstd")
        stream.opened_at = now
        stream.segment_rows = 0

    def _abandon(self, stream: _Stream, rows: int) -> None:
        """Give up the open segment after a failed write: delete it (a Parquet file without its
        footer would break every reader of the directory) and count its rows, and the ``rows``
        that failed, as dropped. The next flush opens a new one."""
        with self._lock:
            self.dropped[stream.kind] += stream.segment_rows + rows
        try:
            if stream.writer is not None:
                stream.writer.close()
        except Exception:  # noqa: BLE001 (broken already: only the file matters now)
            pass
        if stream.tmp is not None:
            stream.tmp.unlink(missing_ok=True)
        _release(stream)
        stream.writer, stream.tmp, stream.segment_rows = None, None, 0

    def _finish(self, stream: _Stream) -> int:
        """Close the open segment, fsync it, rename it into place, then prune; returns its
        rows. Until the rename, a failure leaves the segment to :meth:`_abandon` (deleted, its
        rows counted)."""
        tmp, rows = stream.tmp, stream.segment_rows
        stream.writer.close()
        stream.writer = None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        final = tmp.with_name(tmp.name[: -len(TMP_SUFFIX)] + SUFFIX)
        os.replace(tmp, final)
        _release(stream)
        stream.tmp, stream.segment_rows = None, 0
        try:  # the rows are in place: a failure here risks only the name, on a power loss
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            log.warning("kvscope capture: could not fsync %s after writing %s: %s",
                        self.directory, final.name, exc)
        newest = [segments[-1] for kind in STATE_KINDS if (segments := self.segments(kind))]
        prune(self.segments(), self.max_bytes, keep=(final, *newest))
        return rows

    def _remove_orphans(self) -> None:
        """Delete ``.tmp`` segments left by writers that are no longer running: those no
        writer holds a lock on (see :meth:`_open`). Telling them by the pid in their name
        kept every orphan of an agent that runs as pid 1, as in a container. Says how many and
        how large (a crashed run's last rows go with them)."""
        removed, size = 0, 0
        for path in self.directory.glob(f"*{TMP_SUFFIX}"):
            try:
                with open(path, "rb") as orphan:
                    fcntl.flock(orphan, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    size += os.fstat(orphan.fileno()).st_size
                    path.unlink(missing_ok=True)
                    removed += 1
            except (BlockingIOError, FileNotFoundError):  # a live writer's, or gone
                continue
        if removed:
            log.warning("capture: removed %d unfinished segment(s) (%d bytes) in %s, left by a "
                        "writer that stopped without closing them (killed or crashed); their "
                        "rows were never part of the capture", removed, size, self.directory)


def _release(stream: _Stream) -> None:
    """Close ``stream``'s lock on its ``.tmp`` segment (done with it)."""
    if stream.lock is not None:
        stream.lock.close()
        stream.lock = None
