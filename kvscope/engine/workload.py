"""Workloads: the requests an engine replays.

A request is a prompt cut into blocks of ``block_tokens`` tokens, each named by a *prefix hash*:
the hash of the block's content and every block before it, so equal hashes mean reusable KV.
Two sources: a seeded synthetic generator (the demo's default) and Mooncake JSONL traces.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # Mooncake FAST'25 traces: one hash id per 512-token block


class TraceError(ValueError):
    """A trace file is missing or malformed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request to replay.

    ``arrival``: seconds from the workload's start. ``block_hashes``: one prefix hash per block
    of ``block_tokens`` tokens, first to last (the last block may be partial).
    ``block_priorities``: one retention priority (0-100) per block, or empty for the engine's
    default; offload admission compares it with ``min_priority``.
    """

    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]
    block_priorities: tuple[int, ...] = ()


def _chain(parent: int, content: str) -> int:
    digest = hashlib.blake2b(f"{parent}:{content}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the synthetic workload.

    ``rate``: mean arrivals per second (Poisson). Shares of arrivals: ``session_share`` continue a
    multi-turn session, ``one_off_share`` are unique prompts, the rest start a new session. Each
    session starts from one of ``system_prompts`` shared system prompts of ``system_blocks``
    blocks; each turn appends ``turn_blocks`` (a uniform range) blocks; sessions end after
    ``max_turns`` turns. ``live_sessions``: sessions kept open at once. Block priorities
    (0-100): ``system_priority`` for system-prompt blocks, ``one_off_priority`` for one-off
    prompts, ``turn_priority`` for session turns (35 is TensorRT-LLM's default).
    """

    seed: int = 0
    rate: float = 20.0
    block_tokens: int = 16
    system_prompts: int = 4
    system_blocks: int = 24
    turn_blocks: tuple[int, int] = (4, 12)
    one_off_blocks: tuple[int, int] = (4, 48)
    session_share: float = 0.55
    one_off_share: float = 0.25
    max_turns: int = 8
    live_sessions: int = 64
    output_tokens: tuple[int, int] = (16, 256)
    system_priority: int = 90
    turn_priority: int = 35
    one_off_priority: int = 20


@dataclass(eq=False)
class _Session:
    prefix: list[int]
    turns: int = 0


def synthetic(config: SyntheticConfig = SyntheticConfig()) -> Iterator[Request]:
    """Yield an endless, seeded stream of requests (same seed, same stream)."""
    rng = random.Random(config.seed)
    systems = []
    for s in range(config.system_prompts):
        prefix, h = [], 0
        for b in range(config.system_blocks):
            h = _chain(h, f"sys{s}/{b}")
            prefix.append(h)
        systems.append(prefix)
    sessions: list[_Session] = []
    t, n = 0.0, 0
    while True:
        t += rng.expovariate(config.rate)
        roll = rng.random()
        if roll < config.one_off_share:
            prefix, h = [], 0
            for b in range(rng.randint(*config.one_off_blocks)):
                h = _chain(h, f"one{n}/{b}")
                prefix.append(h)
            priorities = (config.one_off_priority,) * len(prefix)
        else:
            if roll < config.one_off_share + config.session_share and sessions:
                session = sessions[rng.randrange(len(sessions))]
            else:
                session = _Session(list(systems[rng.randrange(len(systems))]))
                sessions.append(session)
                if len(sessions) > config.live_sessions:
                    sessions.pop(0)
            for b in range(rng.randint(*config.turn_blocks)):
                session.prefix.append(_chain(session.prefix[-1], f"turn{n}/{b}"))
            session.turns += 1
            if session.turns >= config.max_turns and session in sessions:
                sessions.remove(session)
            prefix = list(session.prefix)
            system = min(config.system_blocks, len(prefix))
            priorities = ((config.system_priority,) * system
                          + (config.turn_priority,) * (len(prefix) - system))
        # the last block is partial: drop a few tokens so block_token_counts is exercised
        tokens = len(prefix) * config.block_tokens - rng.randrange(config.block_tokens)
        yield Request(f"syn-{n}", t, tokens, rng.randint(*config.output_tokens), tuple(prefix),
                      priorities)
        n += 1


def read_mooncake(path: str | Path) -> list[Request]:
    """Read a Mooncake JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``; see ``shared/traces/README.md``) into requests sorted by arrival, their
    arrivals in seconds from the first request's.

    Raises :class:`TraceError` naming the file and line for a missing or unreadable file (not
    UTF-8 text), a line that is not a JSON object, a record without a valid ``hash_ids`` list
    (integers from 0 to 2**64 - 1), with lengths or a time that are no finite numbers, with
    negative lengths or a number of ``hash_ids`` other than the 512-token blocks its
    ``input_length`` fills (the format's ``len(hash_ids) == ceil(input_length / 512)``), or a
    file with no records at all.
    """
    path = Path(path)
    if path.is_dir():  # a capture directory, say: only `kvscope analyze` reads those
        raise TraceError(f"cannot read trace {path}: a directory, not a Mooncake JSONL file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM (saved by some editors) is no JSON
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"cannot read trace {path}: not UTF-8 text (byte {exc.start})") from None
    lines = text.splitlines()
    requests = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            # a last line without its newline is most likely a copy or download cut short
            cut = (lineno == len(lines) and not text.endswith("\n")
                   and exc.msg.startswith(("Expecting", "Unterminated")))
            raise TraceError(f"{path}:{lineno}: not JSON ({exc.msg} column {exc.colno})"
                             + ("; the file's last line, with no newline after it: was the "
                                "file cut short?" if cut else "")) from None
        if not isinstance(record, dict):
            raise TraceError(f"{path}:{lineno}: expected a JSON object")
        hash_ids = record.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
            raise TraceError(f"{path}:{lineno}: record has no list of integer 'hash_ids'")
        if not all(0 <= h < 2**64 for h in hash_ids):  # the analyses keep them as uint64
            raise TraceError(f"{path}:{lineno}: 'hash_ids' must be from 0 to 2**64 - 1")
        try:
            arrival = float(record.get("timestamp", 0))  # ms, until all are read
            lengths = (record.get("input_length", len(hash_ids) * MOONCAKE_BLOCK_TOKENS),
                       record.get("output_length", 0))
            prompt, output = (int(n) for n in lengths)
            if not math.isfinite(arrival) or (prompt, output) != lengths:
                raise ValueError  # a fractional length was cut to an int, silently
        except (TypeError, ValueError, OverflowError):  # OverflowError: int() of an infinity
            raise TraceError(f"{path}:{lineno}: timestamp must be a finite number, "
                             "input_length and output_length whole numbers") from None
        if prompt < 0 or output < 0 or arrival < 0:
            # a negative arrival came before the replay's start: queued for it, TTFT + 100 ms
            raise TraceError(f"{path}:{lineno}: timestamp (milliseconds), input_length and "
                             "output_length must be >= 0")
        blocks = math.ceil(prompt / MOONCAKE_BLOCK_TOKENS)
        if blocks != len(hash_ids):
            # more: read as blocks x 512 tokens, the trace's own lengths went unused; fewer: a
            # prompt of blocks no id names, which no analysis can count (a replay of one id
            # and 10^8 tokens said TTFT 505 s)
            raise TraceError(f"{path}:{lineno}: {len(hash_ids)} hash_ids, but an input_length "
                             f"of {prompt} tokens fills {blocks} blocks of "
                             f"{MOONCAKE_BLOCK_TOKENS} (one hash id a block)")
        requests.append(Request(f"mc-{lineno}", arrival, prompt, output, tuple(hash_ids)))
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    requests.sort(key=lambda r: r.arrival)
    # seconds from the first request's arrival: a trace's tail (first timestamp 3,480 s) or
    # one in Unix milliseconds was replayed after waiting that long (at --speed 1, 58
    # minutes); subtracted in milliseconds, whose differences are exact
    first = requests[0].arrival
    return [replace(r, arrival=(r.arrival - first) / 1000.0) for r in requests]
