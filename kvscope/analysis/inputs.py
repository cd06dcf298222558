"""Analysis input: a flat stream of block accesses, and the readers that produce it.

Every analysis works on one :class:`~kvscope.analysis.trace.AccessTrace`: the block accesses of all requests in arrival
order, as parallel numpy arrays. Readers turn a file into requests and
:func:`from_requests` flattens them; a new input format is one more function registered with
:func:`register_reader` for its file suffix (or ``"/"`` for a directory), and the rest of the
analysis does not change. Built in: Mooncake JSONL (``.jsonl``, and any file of another
suffix) and the agent's Parquet captures (a capture directory, or one ``.parquet`` segment; read by
:mod:`~kvscope.analysis.capture_reader`). This module and that reader are the only ones in
:mod:`kvscope.analysis` that read files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from kvscope.analysis.rates import MeasuredRates
from kvscope.analysis.trace import AccessTrace
from kvscope.engine.workload import MOONCAKE_BLOCK_TOKENS, Request, TraceError, read_mooncake
from kvscope.events import block_token_counts


def from_requests(requests: Iterable[Request], block_tokens: int, source: str = "") -> AccessTrace:
    """Flatten ``requests`` (in the order given) into an :class:`AccessTrace`.

    ``block_tokens``: tokens per block of the requests' ``block_hashes``.
    """
    ids: list[int] = []
    times: list[float] = []
    tokens: list[int] = []
    owners: list[int] = []
    depths: list[int] = []
    prompt_tokens = 0
    count = 0
    for index, request in enumerate(requests):
        blocks = len(request.block_hashes)
        ids.extend(request.block_hashes)
        times.extend([request.arrival] * blocks)
        tokens.extend(block_token_counts(request.prompt_tokens, blocks, block_tokens))
        owners.extend([index] * blocks)
        depths.extend(range(blocks))
        prompt_tokens += request.prompt_tokens
        count = index + 1
    return AccessTrace(
        block_ids=np.array(ids, dtype=np.uint64), times=np.array(times, dtype=np.float64),
        tokens=np.array(tokens, dtype=np.int64), requests=np.array(owners, dtype=np.int64),
        depths=np.array(depths, dtype=np.int64), block_tokens=block_tokens,
        request_count=count, prompt_tokens=prompt_tokens, source=source)


def from_block_ids(block_ids: np.ndarray, block_tokens: int = 1, source: str = "") -> AccessTrace:
    """A trace of bare block ids (one request per access, time = index): for synthetic streams."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    n = len(ids)
    index = np.arange(n, dtype=np.int64)
    return AccessTrace(ids, index.astype(np.float64), np.full(n, block_tokens, dtype=np.int64),
                       index, np.zeros(n, dtype=np.int64), block_tokens, n, n * block_tokens, source)


def _read_mooncake(path: Path) -> AccessTrace:
    return from_requests(read_mooncake(path), MOONCAKE_BLOCK_TOKENS, source=str(path))


def _read_capture(path: Path) -> AccessTrace:
    from kvscope.analysis.capture_reader import read_block_trace  # pyarrow only when needed

    return read_block_trace(path)


DIRECTORY = "/"  # the reader key for directories
_READERS: dict[str, Callable[[Path], AccessTrace]] = {".jsonl": _read_mooncake}


def register_reader(suffix: str, reader: Callable[[Path], AccessTrace]) -> None:
    """Make :func:`load_trace` read files ending in ``suffix`` (e.g. ``".parquet"``) with
    ``reader``; the suffix :data:`DIRECTORY` (``"/"``) stands for directories."""
    _READERS[suffix.lower()] = reader


register_reader(".parquet", _read_capture)
register_reader(DIRECTORY, _read_capture)


def load_trace(path: str | Path) -> AccessTrace:
    """Read a trace file into an :class:`AccessTrace`, choosing the reader by file suffix.

    Raises :class:`~kvscope.engine.workload.TraceError` for an unknown suffix, a missing file or
    a malformed record (the message names the file).
    """
    return trace_reader(path)(Path(path))


def load_measured_rates(path: str | Path) -> MeasuredRates:
    """The rates the input at ``path`` measured itself: a capture directory's promotion
    bandwidth and prefill rate (:func:`~kvscope.analysis.capture_reader.read_measured_rates`);
    nothing for a trace file. Raises nothing a readable capture would not."""
    if not Path(path).is_dir():
        return MeasuredRates()
    from kvscope.analysis.capture_reader import read_measured_rates  # pyarrow only when needed

    return read_measured_rates(path)


def trace_reader(path: str | Path) -> Callable[[Path], AccessTrace]:
    """The reader :func:`load_trace` would use for ``path`` (a check before reading it).

    A file whose suffix no reader is registered for is read as Mooncake JSONL, as ``kvscope
    replay`` and the demo read any ``--trace`` (a ``trace.txt``); where that fails, the error
    says so. Raises :class:`~kvscope.engine.workload.TraceError` for a missing file, and for a
    capture's unfinished segment (``*.parquet.tmp``)."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"cannot read trace {path}: No such file or directory")
    if path.name.endswith(".parquet.tmp"):  # read as JSONL, it was "not UTF-8 text (byte 7)"
        raise TraceError(f"{path}: a capture segment still being written (or left by a "
                         "crash); pass the capture directory, whose finished segments are read")
    return _READERS.get(DIRECTORY if path.is_dir() else path.suffix.lower(), _read_other)


def _read_other(path: Path) -> AccessTrace:
    try:
        return _read_mooncake(path)
    except TraceError as exc:
        others = " or ".join(sorted(k for k in _READERS if k not in (DIRECTORY, ".jsonl")))
        raise TraceError(f"{exc} (read as Mooncake JSONL, as a file not ending in {others} is; "
                         "a trace may also be a capture directory)") from None
