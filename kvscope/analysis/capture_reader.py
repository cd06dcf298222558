"""Readers of the agent's Parquet captures (:mod:`kvscope.agent.capture`).

- :func:`read_block_trace`: the ``blocks`` segments of a capture directory (or one segment file)
  -> :class:`~kvscope.analysis.trace.AccessTrace`, for ``kvscope analyze``; registered in
  :mod:`kvscope.analysis.inputs` for directories and ``.parquet`` files.
- :func:`read_request_sample`: the ``requests`` segments, with the ``totals`` and ``tokens``
  segments' counts -> :class:`~kvscope.analysis.compare.RequestSample`, for ``kvscope
  compare``.
- :func:`read_measured_rates`: what the ``requests``, ``totals`` and ``tiers`` segments
  measured (rates, KV bytes per block, the GPU tier's size), for ``kvscope analyze``.

Only finished segments (``*.parquet``) are read, in start-time order; a ``.parquet.tmp`` file
(a segment being written, or left by a crash) is never read. Like
:mod:`~kvscope.analysis.inputs`, this module does I/O; the analyses it feeds do not.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvscope import events as ev
from kvscope import sampling
from kvscope.agent.capture import (BLOCKS_ADDED, REQUESTS_ADDED, SCHEMAS, SUFFIX, TMP_SUFFIX,
                                   TOTALS_ADDED, WRITER_KEY, finished_segments,
                                   missing_segments)
from kvscope.analysis.compare import RequestSample
from kvscope.analysis.rates import MeasuredRates, measured_rates
from kvscope.analysis.shards import spatial_hash
from kvscope.analysis.trace import AccessTrace
from kvscope.engine.workload import TraceError
from kvscope.vocabulary import OFFLOAD_TIERS

log = logging.getLogger(__name__)
T = TypeVar("T")
UNKNOWN_BLOCK_TOKENS = 16  # vLLM's default block_size, assumed when a capture does not say

_BLOCK_COLUMNS = ["ts", "request_id", "depth", "block_hash", "tokens", "block_tokens",
                  "prompt_tokens", *BLOCKS_ADDED]
_REQUEST_COLUMNS = ["arrival", "finished", "ttft", "itl", "promotion_wait", "prefill",
                    "prompt_tokens", *[f"tokens_{s}" for s in ev.TOKEN_SOURCES], "transfers",
                    "tiers"]
# Counted prompt tokens (the engine's, zero-code) price the records' prefill seconds only
# where the records' own prompt tokens are these within this share: then they are the same
# requests (a capture's first and last requests may fall on either side of a scrape), not a
# sample of them (traces sampled) or others.
SAME_REQUESTS = 0.1


def capture_segments(path: str | Path, kind: str) -> list[Path]:
    """Finished ``kind`` segments (``blocks``, ``requests``, ...) of the capture at ``path``,
    oldest first; a single ``.parquet`` file is its own list. Raises TraceError when ``path``
    does not exist."""
    path = Path(path)
    if path.is_dir():
        return finished_segments(path, kind)
    if path.is_file():
        return [path]
    raise TraceError(f"{path}: no such capture directory or file")


def _read(paths: list[Path], columns: list[str], kind: str, where: Path,
          added: dict[str, object] | None = None, writer: bool = False) -> pa.Table:
    """The ``columns`` of every segment, concatenated in order; ``added``: columns a segment
    written before them lacks -> the value they read as there; ``writer``: a last column,
    ``writer``, holding each row's segment's writer ("" unknown: written before segments
    named it). A segment deleted meanwhile
    (pruned by a running agent) is skipped. An unreadable one raises TraceError naming it,
    unless ``where`` is a directory with other readable segments: then it is skipped and a
    warning names it (one damaged copy should not cost the analysis of the rest)."""
    tables, problems = [], []
    for p in paths:
        try:
            table = pq.read_table(p, columns=_present(p, columns, added))
            for name, default in (added or {}).items():
                if name not in table.column_names:
                    table = table.append_column(name, pa.array([default] * table.num_rows,
                                                               type=_ADDED_TYPES[name]))
            table = table.select(columns)
            if writer:
                table = table.append_column("writer", pa.array([_writer(p)] * table.num_rows,
                                                               type=pa.string()))
        except FileNotFoundError:
            continue
        except (pa.ArrowInvalid, OSError, KeyError) as exc:
            # the first line only: Arrow goes on to list the file's whole schema
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            other = _kind(p)
            if other and other != kind:  # another kind's segment: say so, not which column
                reason = f"it is a {other} segment"
            # named as one, and not even its schema reads: "pass one of its blocks files"
            # misled a tryout
            damaged = p.name.startswith(f"{kind}-") and p.name.endswith(SUFFIX) \
                and not _readable(p)
            problems.append(f"{p}: a {kind} segment that cannot be read, damaged or cut short "
                            f"({reason})" if damaged else
                            f"{p}: not a kvscope {kind} segment ({reason})")
            continue
        tables.append(table)
    if problems and not (tables and where.is_dir()):
        if where.is_dir():  # given the directory, as it should be: none of its segments reads
            raise TraceError(f"{where}: no {kind} segment of it can be read: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        advice = "pass its capture directory to read the other segments" if damaged else \
            f"pass the capture directory, or one of its {kind}-*{SUFFIX} files"
        raise TraceError(f"{problems[0]}; {advice}")
    for problem in problems:
        log.warning("kvscope: skipped %s", problem)
    # segments still being written (or left by a crash) are not read: say so, or their rows
    # go missing from the analysis unremarked
    open_ = len(list(where.glob(f"{kind}-*{TMP_SUFFIX}"))) if where.is_dir() else 0
    unfinished = (f"{open_} {kind} segment{'s' * (open_ > 1)} still being written (*{TMP_SUFFIX}, "
                  "finished every minute and when the agent stops, or left by a crash)")
    if not tables:
        writes = {"blocks": "from lookups whose events carry block_hashes (the reference "
                            "engine's and vLLM's taps do; a tap of your own must fill them)",
                  "requests": "from finished requests"}[kind]
        if open_:
            raise TraceError(f"{where}: no finished {kind} segments yet, {unfinished}; run "
                             "again once the agent has finished them (a crash's are removed "
                             "by the next agent writing there)")
        if where.is_dir() and not any(where.glob(f"*{SUFFIX}*")):  # a wrong path, most likely
            also = "a trace file or " if kind == "blocks" else ""  # analyze reads traces too
            # a rollout's --out: its runs are judged in its own report
            report = (f"; it holds a rollout's report: open {where / 'rollout.html'}, or give "
                      "the directory to the dashboard's Compare page"
                      if (where / "rollout.json").is_file() else "")
            raise TraceError(f"{where}: not a capture directory (no segments in it); give "
                             f"{also}a directory kvscope agent --capture-dir wrote{report}")
        if where.is_dir() and not finished_segments(where, "blocks") + finished_segments(
                where, "requests"):  # the agent's samples alone: it stopped before any request
            kinds = sorted({s.name.split("-")[0] for s in finished_segments(where)})
            raise TraceError(f"{where}: no request reached this capture (it holds only "
                             f"{' and '.join(kinds)} segments: the agent stopped before a "
                             "lookup or a finished request came); capture while the engine "
                             "serves")
        raise TraceError(f"{where}: no {kind} segments (kvscope agent --capture-dir writes them "
                         f"{writes})")
    if open_:
        log.warning("kvscope: %s: left out %s", where, unfinished)
    table = pa.concat_tables(tables)
    # the agent writes no nulls (NaN for an unknown time; _NULLABLE aside); read as numbers they
    # would be garbage
    nulls = [c for c in columns if table.column(c).null_count and c not in _NULLABLE]
    if nulls:
        raise TraceError(f"{where}: {kind} segments with empty values in {', '.join(nulls)} "
                         "(the agent writes none)")
    return table


_NULLABLE = frozenset({"failures"})  # columns whose null reads "not measured" (as None)
_ADDED_TYPES = {"sample_rate": pa.float64(), "lookup_blocks": pa.int64(), "tiers": pa.string(),
                "failures": pa.int64()}


def _present(path: Path, columns: list[str], added: dict | None) -> list[str]:
    """``columns`` less the ``added`` ones the segment at ``path`` was written without."""
    if not added:
        return columns
    names = set(pq.read_schema(path).names)
    return [c for c in columns if c in names or c not in added]


def _converted(path: Path, kind: str, build: Callable[[], T]) -> T:
    """``build()``; a failure on values the agent never writes (nulls, a foreign file's types)
    becomes a TraceError naming the capture."""
    try:
        return build()
    except TraceError:
        raise
    except (ValueError, TypeError, pa.ArrowException) as exc:
        raise TraceError(f"{path}: {kind} segments with values the agent does not write "
                         f"({exc})") from None


def read_block_trace(path: str | Path) -> AccessTrace:
    """The block accesses of a capture, lookup by lookup in time order (each lookup's blocks
    together, in depth order), as an :class:`AccessTrace`.

    ``times``: seconds since the first access; ``requests``: one per lookup (a new one starts
    where the time, the request or a non-increasing depth says so). When the capture does not
    record the block size, 16 tokens (vLLM's default ``block_size``) are assumed and every
    block counts as full; the trace's ``source`` says so. A sampled capture (the vLLM tap's)
    gives a sampled trace at the lowest rate it holds: rows sampled at a higher rate are
    sampled again at it (the predicate nests, :mod:`kvscope.sampling`), and each lookup's
    blocks, sampled or not, count in the full stream's totals. Raises TraceError for a missing
    capture, no block rows, an unreadable segment, or segments with different block sizes.
    """
    path = Path(path)
    table = _read(capture_segments(path, "blocks"), _BLOCK_COLUMNS, "blocks", path, BLOCKS_ADDED)
    if table.num_rows == 0:
        raise TraceError(f"{path}: the capture holds no block accesses")
    return _converted(path, "blocks", lambda: _block_trace(table, path))


def _block_trace(table: pa.Table, path: Path) -> AccessTrace:
    col = {name: table.column(name).to_numpy(zero_copy_only=False) for name in _BLOCK_COLUMNS}
    sizes = np.unique(col["block_tokens"])
    known = sizes[sizes > 0]
    if len(known) > 1:
        raise TraceError(f"{path}: segments with different block sizes {known.tolist()} tokens")
    source = str(path)
    if len(known) == 1 and len(sizes) == 1:
        block_tokens = int(known[0])
        tokens = col["tokens"].astype(np.int64)
    else:
        block_tokens = int(known[0]) if len(known) else UNKNOWN_BLOCK_TOKENS
        tokens = np.full(table.num_rows, block_tokens, dtype=np.int64)
        source += f" (block size unknown for some blocks: {block_tokens} tokens assumed)"
    depths = col["depth"].astype(np.int64)
    ts = col["ts"].astype(np.float64)
    rid = col["request_id"]
    # a lookup's rows are written together, depths increasing; a sampled one may lack depth 0
    starts = np.ones(len(ts), dtype=bool)
    starts[1:] = (ts[1:] != ts[:-1]) | (rid[1:] != rid[:-1]) | (depths[1:] <= depths[:-1])
    lookup = np.cumsum(starts) - 1
    # Lookups in time order, each one's blocks together at its time: two taps' batches may
    # interleave, and a clock may step back (times once ran backwards: a negative duration).
    lookup_ts = ts[starts][lookup]
    order = np.lexsort((np.arange(len(ts)), lookup_ts))
    depths, starts, lookup_ts = depths[order], starts[order], lookup_ts[order]
    ids, tokens = col["block_hash"].astype(np.uint64)[order], tokens[order]
    rates = col["sample_rate"].astype(np.float64)[order]
    requests = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    prompts = col["prompt_tokens"][order][first].astype(np.int64)
    rate = float(rates.min())
    keep = depths >= 0  # not a sampled lookup's row that stands for no block
    if rate < 1.0:
        keep &= (rates == rate) | (spatial_hash(ids) < sampling.threshold(rate))
    totals = None
    if rate < 1.0 or not keep.all():
        per_lookup = col["lookup_blocks"][order][first].astype(np.int64)
        counted = np.bincount(requests[depths >= 0], minlength=len(first))
        blocks = np.where(per_lookup >= 0, per_lookup, counted)
        totals = (int(blocks.sum()), int(np.minimum(prompts, blocks * block_tokens).sum()))
        source += f" (sampled by the tap: 1 block in {1 / rate:.4g})" if rate < 1.0 else ""
    lookup_ts = lookup_ts[keep]
    times = lookup_ts - lookup_ts[0] if len(lookup_ts) else lookup_ts
    return AccessTrace(
        block_ids=ids[keep], times=times, tokens=tokens[keep], requests=requests[keep],
        depths=depths[keep], block_tokens=block_tokens, request_count=len(first),
        prompt_tokens=int(prompts.sum()), source=source, sample_rate=rate,
        total_accesses=totals[0] if totals else None, total_tokens=totals[1] if totals else None)


def _sum_by(keys: np.ndarray, values: np.ndarray) -> dict[str, float]:
    return {str(k): float(values[keys == k].sum()) for k in np.unique(keys)}


def read_request_sample(path: str | Path, name: str | None = None) -> RequestSample:
    """The finished requests of a capture as a :class:`RequestSample` (``name``: default the
    path). Requests without a TTFT are left out; ITL counts only requests that reported one.
    The transfer cost and the failed transfers are the capture's transfer totals
    (:func:`read_transfer_totals`: every transfer, background offloads included; failures not
    measured where no source sees a copy fail) when it has readable ones, else its requests'
    transfers; a direction whose copies took 0 s in all was not timed (its seconds: not
    measured), and one that copied blocks in 0 bytes was not sized (its bytes: not measured;
    from the records, left out of ``transfer_bytes``; from the totals, 0 beside its blocks).
    Tokens by source are the requests', or where they carry none (vLLM in zero-code mode, its
    requests seen through their spans), the agent's counts (:func:`read_token_totals`).
    Raises TraceError for a missing capture, no request rows, or no readable requests
    segment."""
    path = Path(path)
    table = _read(capture_segments(path, "requests"), _REQUEST_COLUMNS, "requests", path,
                  REQUESTS_ADDED)
    counted = _or_warn(read_token_totals, path, "tokens by source are the records' alone") \
        if path.is_dir() else None
    sample = _converted(path, "requests",
                        lambda: _request_sample(table, name or str(path), counted))
    totals = _or_warn(read_transfer_totals, path, "its requests' transfers are its transfer "
                      "cost") if path.is_dir() else None
    if totals is None:
        return sample
    sample = dataclasses.replace(  # the agent's totals: transfers measured, by a tap or a source
        sample, tiers_off=_unmoved(sample.tiers_off, totals),
        transfer_bytes={d: t[0] for d, t in totals.items()},
        transfer_blocks={d: t[1] for d, t in totals.items()},
        transfer_seconds=_timed({d: t[2] for d, t in totals.items()}), transfers_measured=True)
    if not _written_with(path, "totals", "failures"):
        return sample  # totals from before their failures: the failed copies the records hold
    failures = [t[3] for t in totals.values() if t[3] is not None]
    return dataclasses.replace(
        sample, transfer_failures=sum(failures) if failures else None,
        failures_unmeasured=tuple(sorted(d for d, t in totals.items() if t[3] is None)))


def _written_with(path: Path, kind: str, column: str) -> bool:
    """Whether every readable ``kind`` segment of the capture at ``path`` has ``column`` (one
    gone or unreadable is skipped, as :func:`_read` skips it)."""
    for segment in capture_segments(path, kind):
        try:
            if column not in pq.read_schema(segment).names:
                return False
        except (pa.ArrowInvalid, OSError):
            continue
    return True


def _timed(seconds: dict[str, float]) -> dict[str, float]:
    """The directions of ``seconds`` (by "src->dst") whose copies took time: one whose copies
    all took 0 s was not timed (untimed transfers, such as the vLLM tap's disk promotions,
    carry 0), so its time is not measured rather than free."""
    return {d: s for d, s in seconds.items() if s > 0}


def read_transfer_totals(path: str | Path
                         ) -> dict[str, tuple[int, int, float, int | None]] | None:
    """The transfers the agent counted while the capture at ``path`` ran, by "src->dst":
    (bytes, blocks, seconds, failures), from its ``totals`` segments (failures None: no
    source sees that direction's copies fail, or the capture predates their column); None for
    a capture without any (written before the agent recorded them). Raises TraceError for an
    unreadable segment."""
    counted = _counted(path, "totals", ["bytes", "blocks", "seconds", "failures"],
                       TOTALS_ADDED)
    return None if counted is None else {d: (int(b), int(n), float(s), f)
                                         for d, (b, n, s, f) in counted.items()}


def read_token_totals(path: str | Path) -> dict[str, int] | None:
    """The prompt tokens the agent counted by source while the capture at ``path`` ran, from
    its ``tokens`` segments: the engine's own counts included (vLLM's /metrics in zero-code
    mode); None for a capture without any (none counted, or written before the agent
    recorded them). Raises TraceError for an unreadable segment."""
    counted = _counted(path, "tokens", ["tokens"])
    return None if counted is None else {s: int(n) for s, (n,) in counted.items()}


def _counted(path: str | Path, kind: str, values: list[str],
             added: dict[str, object] | None = None) -> dict[str, list] | None:
    """What the agent's cumulative counters in the ``kind`` segments of the capture at
    ``path`` (rows of ``ts``, a key, then ``values``) counted while it ran: per key, each of
    ``values``. The counters run since the agent started, from 0: per writer (an agent's run,
    the segments' metadata) and key, the first row's values plus each later increase, a value
    lower than the one before counting from 0 (as Prometheus' increase(): segments written
    before they named their writer are one run). A null value was not counted: a key's total
    is None where all of its rows were. ``added``: as :func:`_read`'s. None for a capture
    without such segments."""
    path = Path(path)
    segments = capture_segments(path, kind)
    if not segments:
        return None
    columns = ["ts", SCHEMAS[kind].names[1], *values]
    table = _read(segments, columns, kind, path, added, writer=True)
    rows = sorted(zip(*(table.column(c).to_pylist() for c in [*columns, "writer"])),
                  key=lambda row: row[0])
    last: dict[tuple[str, str], tuple] = {}  # (writer, key) -> its last row's values
    out: dict[str, list] = {}
    for _ts, key, *counts, writer in rows:
        before = last.get((writer, key), (None,) * len(counts))
        total = out.setdefault(key, [None] * len(counts))
        for i, value in enumerate(counts):
            if value is not None:
                prior = before[i] or 0
                total[i] = (total[i] or 0) + (value - prior if value >= prior else value)
        last[writer, key] = tuple(counts)
    return out


def read_tier_capacities(path: str | Path) -> dict[str, tuple[int, int]]:
    """Each tier's capacity the engine reported last while the capture at ``path`` ran, from
    its ``tiers`` segments: tier -> (bytes, blocks), either 0 where not reported, nearest the
    GPU first; empty for a capture without any (written before the agent recorded them).
    Raises TraceError for an unreadable segment."""
    path = Path(path)
    segments = capture_segments(path, "tiers")
    if not segments:
        return {}
    columns = ["ts", "tier", "capacity_bytes", "capacity_blocks"]
    table = _read(segments, columns, "tiers", path)
    rows = sorted(zip(*(table.column(c).to_pylist() for c in columns)), key=lambda r: r[0])
    last = {tier: (int(nbytes), int(blocks)) for _ts, tier, nbytes, blocks in rows}
    return {tier: last[tier] for tier in ev.TIERS if tier in last}


def read_measured_rates(path: str | Path) -> MeasuredRates:
    """The promotion bandwidth, prefill rate, KV bytes per block and tier sizes the capture
    directory at ``path`` measured (:mod:`~kvscope.analysis.rates`): from its requests (and
    transfer totals), or its transfer totals alone when it has no readable requests segment,
    and the tier capacities its engine reported; nothing measured for a single segment file.
    A kind of segment none of which reads is warned about and measures nothing, the others
    still do (and the block accesses can still be sized)."""
    path = Path(path)
    if not path.is_dir():
        return MeasuredRates()
    capacities = _or_warn(read_tier_capacities, path, "no tier sizes measured") or {}
    sample = (_or_warn(read_request_sample, path, "no prefill rate measured")
              if capture_segments(path, "requests") else None)
    if sample is not None:
        return measured_rates(sample.tokens.get("recompute", 0), sample.prefill_seconds,
                              sample.transfer_bytes, sample.transfer_seconds,
                              sample.transfer_blocks, sample.prefill_modelled, capacities)
    totals = _or_warn(read_transfer_totals, path, "no transfer measured") or {}
    return measured_rates(0, 0.0, {d: t[0] for d, t in totals.items()},
                          {d: t[2] for d, t in totals.items()},
                          {d: t[1] for d, t in totals.items()}, capacities=capacities)


def _or_warn(read: Callable[[Path], T], path: Path, instead: str) -> T | None:
    """``read(path)``; None, with a warning saying what goes ``instead``, when it raises
    TraceError (its segments cannot be read)."""
    try:
        return read(path)
    except TraceError as exc:
        log.warning("kvscope: %s; %s", exc, instead)
        return None


def _captures(paths: str) -> list[str]:
    """The captures a comma-separated ``paths`` names; TraceError when it names none."""
    parts = [p.strip() for p in paths.split(",") if p.strip()]
    if not parts:
        raise TraceError(f"no capture named in {paths!r}")
    return parts


def segments_gone(paths: str, what: str = "requests") -> list[str]:
    """A note for each capture directory of a comma-separated ``paths`` that has segments gone
    (deleted by its size cap or lost: :func:`~kvscope.agent.capture.missing_segments`): its
    oldest ``what`` (requests, block accesses), or some, are missing from what is read of
    it."""
    gone = {part: missing_segments(Path(part)) for part in _captures(paths)
            if Path(part).is_dir()}
    return [f"{part}: {n} of its segments {'is' if n == 1 else 'are'} gone (deleted by its "
            f"size cap, capture_max_bytes, oldest first, or lost to a failed write): {what} "
            "it recorded may be missing"
            for part, n in gone.items() if n]


def _segments_of(part: str) -> set[str]:
    """What the requests segments capture ``part`` reads were written by: each one's writer
    (the id the agent's writer put in its metadata), which a copy keeps, renamed too, and
    another run never shares; a segment without the id (written before it, or unreadable:
    reading it says so), its resolved path. None for a path that does not exist: reading it
    says so."""
    try:
        segments = capture_segments(part, "requests")
    except TraceError:
        return set()
    return {_writer(p) or str(p.resolve()) for p in segments}


def _writer(segment: Path) -> str:
    """The id of the writer that made ``segment`` ("" unknown)."""
    return _metadata(segment, WRITER_KEY)


def _readable(segment: Path) -> bool:
    """Whether the Parquet file ``segment``'s schema reads (False: damaged or not Parquet)."""
    try:
        pq.read_schema(segment)
    except (pa.ArrowInvalid, OSError):
        return False
    return True


def _kind(segment: Path) -> str:
    """The kind of capture segment ``segment`` is ("" unknown: not one of the agent's)."""
    return _metadata(segment, "kvscope.kind")


def _metadata(segment: Path, key: str) -> str:
    """``key`` of the Parquet file ``segment``'s schema metadata ("" absent or unreadable)."""
    try:
        metadata = pq.read_schema(segment).metadata or {}
    except (pa.ArrowInvalid, OSError):
        return ""
    return metadata.get(key.encode(), b"").decode(errors="replace")


def _sharing(parts: list[str], others: list[str]) -> tuple[str, str] | None:
    """A pair of captures, one of ``parts`` and another of ``others``, that read a requests
    segment in common (a directory and one of its own segments, or a copy of it), or
    None."""
    segments = {part: _segments_of(part) for part in {*parts, *others}}
    for part in parts:
        for other in others:
            if other != part and segments[part] & segments[other]:
                return part, other
    return None


def read_runs(paths: str) -> list[RequestSample]:
    """One :class:`RequestSample` per capture of ``paths``, a comma-separated list of capture
    directories (or requests segments): the repeated runs of one arm. Raises TraceError as
    :func:`read_request_sample` does, and for a list that names none, one capture twice, a
    capture and one of its own segments, or captures whose agents reported different offload
    tiers (runs of different setups: pooled, a tier one of them lacked read "not measured"
    and its tokens left the shares)."""
    parts = _captures(paths)
    resolved = [Path(p).resolve() for p in parts]
    if len(set(resolved)) < len(resolved):  # one run read twice would fake run-to-run variance
        twice = next(p for p, r in zip(parts, resolved) if resolved.count(r) > 1)
        raise TraceError(f"{paths}: names {twice} twice; each run of an arm is a capture of "
                         "its own")
    shared = _sharing(parts, parts)
    if shared:
        raise TraceError(f"{paths}: {shared[0]} and {shared[1]} read the same requests "
                         "segments (one is the other, a segment of it or a copy); each run of "
                         "an arm is a capture of its own")
    for part in parts:  # an access trace has no request timings to compare
        if Path(part).suffix.lower() == ".jsonl":
            raise TraceError(f"{part}: a block-access trace, not an agent capture; compare "
                             "reads captures (kvscope agent --capture-dir), and `kvscope "
                             "analyze` reads traces")
    runs = [read_request_sample(p) for p in parts]
    tiers = {run.name: [s for s in run.token_sources if s in OFFLOAD_TIERS]
             for run in runs if run.token_sources is not None}
    if len({tuple(t) for t in tiers.values()}) > 1:
        said = "; ".join(f"{name}: {', '.join(t) or 'none'}" for name, t in tiers.items())
        raise TraceError(f"{paths}: the runs' offload tiers differ ({said}); an arm's runs "
                         "repeat one setup: compare different setups as two arms")
    return runs


def read_arms(baseline: str, candidate: str) -> tuple[list[RequestSample], list[RequestSample]]:
    """The runs of both arms (:func:`read_runs` of each). Raises TraceError as it does, and
    when a capture (or one of its segments) is named on both sides: compared with itself it
    would read as an A/A check that found no difference, which two runs of one setup, not one
    run twice, can show."""
    both = ({Path(p).resolve() for p in _captures(baseline)}
            & {Path(p).resolve() for p in _captures(candidate)})
    if both:
        raise TraceError(f"{min(both)} is named as both the baseline and the candidate; an "
                         "A/A check compares two runs of one setup, each captured on its own")
    shared = _sharing(_captures(baseline), _captures(candidate))
    if shared:
        raise TraceError(f"the baseline's {shared[0]} and the candidate's {shared[1]} read the "
                         "same requests segments (one is the other, a segment of it or a "
                         "copy); an A/A check compares two runs of one setup, each captured on "
                         "its own")
    return read_runs(baseline), read_runs(candidate)


def _token_sources(tiers: pa.ChunkedArray, tokens: dict[str, int]) -> tuple[str, ...] | None:
    """The token sources the requests measured, from the tiers the agent reported with them
    (``tiers``: a row's comma-separated, "" unknown): an offload tier none of them reported
    is not (off, :attr:`RequestSample.tiers_off`, unless blocks were copied into or out of
    it); gpu and recompute always are, and so is a source that served tokens. None (every
    source) when no row knows its tiers (a capture written before they were recorded)."""
    reported = {t for row in pc.unique(tiers).to_pylist() for t in row.split(",") if t}
    if not reported:
        return None
    return tuple(s for s in ev.TOKEN_SOURCES
                 if s not in OFFLOAD_TIERS or s in reported or tokens[s])


def _request_sample(table: pa.Table, name: str,
                    counted: dict[str, int] | None = None) -> RequestSample:
    """The sample of the requests in ``table``; where they carry no tokens by source, those the
    agent ``counted`` (:func:`read_token_totals`), which price the records' prefill seconds
    only where they are the same requests' (:data:`SAME_REQUESTS`)."""
    col = {c: table.column(c).to_numpy() for c in _REQUEST_COLUMNS
           if c not in ("transfers", "tiers")}
    ttft = col["ttft"].astype(np.float64)
    itl = col["itl"].astype(np.float64)
    wait = col["promotion_wait"].astype(np.float64)
    flat = pc.list_flatten(table.column("transfers"))
    if len(flat) and any(pc.struct_field(flat, f.name).null_count for f in flat.type):
        raise ValueError("empty values in transfers")  # ok would read False, src "None"
    if len(flat):
        fields = {f: pc.struct_field(flat, f).to_numpy(zero_copy_only=False)
                  for f in ("src", "dst", "blocks", "bytes", "duration", "ok")}
        direction = np.char.add(np.char.add(fields["src"].astype(str), "->"),
                                fields["dst"].astype(str))
        ok = fields["ok"].astype(bool)
        d = direction[ok]
        # a copy of blocks in 0 bytes: its source did not know a block's size (ev.Transfer), so
        # its direction's bytes are not measured (a sum of the others' would read too few)
        unsized = set(d[(fields["bytes"][ok] == 0) & (fields["blocks"][ok] > 0)].tolist())
        moved_bytes = {k: int(v) for k, v in _sum_by(d, fields["bytes"][ok]).items()
                       if k not in unsized}
        moved_blocks = {k: int(v) for k, v in _sum_by(d, fields["blocks"][ok]).items()}
        seconds = _timed(_sum_by(d, fields["duration"][ok].astype(np.float64)))
        failures = int((~ok).sum())
    else:
        moved_bytes, moved_blocks, seconds, failures = {}, {}, {}, 0
    tokens = {s: int(col[f"tokens_{s}"].sum()) for s in ev.TOKEN_SOURCES}
    # records of no tap (spans alone: no tokens by source, no transfer), whatever tiers the
    # agent reported (vLLM's /metrics report its GPU's): transfers not measured, not none
    spans_alone = not len(flat) and not any(tokens.values())
    # a request has prompt tokens: a row with none by source did not measure them (written as
    # 0), so its prefill seconds price none of the tokens counted
    by_source = sum(col[f"tokens_{s}"] for s in ev.TOKEN_SOURCES) > 0
    prefill = float(np.nansum(col["prefill"][by_source] if by_source.any() else col["prefill"]))
    if not any(tokens.values()) and counted and any(counted.values()):
        tokens = {s: counted.get(s, 0) for s in ev.TOKEN_SOURCES}
        recorded = int(col["prompt_tokens"].sum())
        if abs(recorded - sum(tokens.values())) > SAME_REQUESTS * sum(tokens.values()):
            log.warning("kvscope: %s: its requests' records hold %d prompt tokens, the agent "
                        "counted %d by source: not the same requests, so their prefill seconds "
                        "price no token (prefill rate not measured). Start the agent before the "
                        "traffic and stop it once the engine sent the last spans (vLLM: every "
                        "5 s), and export every trace (no sampling)",
                        name, recorded, sum(tokens.values()))
            prefill = 0.0
    sources = _token_sources(table.column("tiers"), tokens)
    arrival, finished = col["arrival"].astype(np.float64), col["finished"].astype(np.float64)
    window = (float(np.nanmin(arrival)), float(np.nanmax(finished))) \
        if len(arrival) and np.isfinite(arrival).any() and np.isfinite(finished).any() else None
    return RequestSample(
        name=name, ttft=ttft[np.isfinite(ttft)], itl=itl[itl > 0],
        promotion_wait=wait[np.isfinite(wait)], tokens=tokens,
        transfer_bytes=moved_bytes, transfer_blocks=moved_blocks, transfer_seconds=seconds,
        transfer_failures=None if spans_alone else failures,
        prefill_seconds=prefill,
        prefill_modelled=_modelled(col["tokens_recompute"], col["prefill"]),
        itl_modelled=_constant(itl[itl > 0]),
        token_sources=sources, window=window, transfers_measured=not spans_alone,
        tiers_off=_unmoved(() if sources is None else tuple(
            s for s in ev.TOKEN_SOURCES if s not in sources), moved_blocks))


def _unmoved(tiers: tuple[str, ...], directions: Iterable[str]) -> tuple[str, ...]:
    """``tiers`` less those the ``directions`` ("src->dst") copied blocks into or out of: such
    a tier exists, though its agent reported no capacity of it (vLLM's /metrics without KV
    events), so it is not off (:attr:`RequestSample.tiers_off`)."""
    moved = {tier for d in directions for tier in d.split("->")}
    return tuple(t for t in tiers if t not in moved)


def _modelled(recomputed: np.ndarray, prefill: np.ndarray) -> bool:
    """Whether every request that prefilled did so at one exact rate (recomputed tokens over
    prefill seconds): a cost model's prefill (the reference engine prices it; a demo capture's
    read 197,800 tokens/s, preset tiny's, for every request), which no measurement gives."""
    timed = (recomputed > 0) & (prefill > 0)
    return _constant(recomputed[timed] / prefill[timed].astype(np.float64))


def _constant(values: np.ndarray) -> bool:
    """Whether two values at least are all one, within float rounding: a cost model's, as the
    reference engine's decode gives every request one ITL."""
    return len(values) >= 2 and bool(np.ptp(values) <= 1e-9 * values.max())
