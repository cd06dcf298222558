"""The prompts a rollout run sends: the guide's mixed workload (shared system prompts, multi-turn
sessions, one-off prompts, long and short) or a Mooncake trace, as text prompts with their
output lengths.

Both start as :class:`~kvscope.engine.workload.Request` s (prefix-hashed blocks): the mixed one
from :func:`kvscope.engine.workload.synthetic`, the trace from
:func:`~kvscope.engine.workload.read_mooncake`. Each block becomes a fixed run of
``block_tokens`` token ids (:func:`kvscope.rollout.trace_workload.prompt_token_ids`; a trace's
512-token blocks and prompt lengths are scaled to it), salted by the run's seed so that no two
runs share a prompt (a later run would otherwise find an earlier one's prefixes cached, and the
A/A pair would not be alike), and the ids are written as words of the tiny model's tokenizer
(:func:`kvscope.rollout.tiny_model.words`): one word per token there, so that the server's
prefix cache sees exactly the workload's sharing. A real model's tokenizer splits a word into
a few tokens; the sharing is kept, but lengths are then in words, not tokens.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from kvscope.engine.workload import (MOONCAKE_BLOCK_TOKENS, SyntheticConfig, read_mooncake,
                                     synthetic)
from kvscope.files import write_atomic
from kvscope.rollout.tiny_model import VOCAB, words
from kvscope.rollout.trace_workload import prompt_token_ids

MIXED = "mixed"
# the mixed workload, in blocks: 4 system prompts of 8 blocks, sessions of up to 6 turns of
# 1-4 blocks each, one-off prompts of 1-16 blocks; outputs of 4-64 tokens
MIXED_SHAPE = {"system_prompts": 4, "system_blocks": 8, "turn_blocks": (1, 4),
               "one_off_blocks": (1, 16), "max_turns": 6, "live_sessions": 8,
               "output_tokens": (4, 64)}


@dataclass(frozen=True)
class Prompt:
    """One request of a run: ``text`` (its words), ``tokens`` (its length in the tiny model's
    tokens) and ``output_tokens`` (the completion length to ask for)."""

    text: str
    tokens: int
    output_tokens: int


def prompts(workload: str, count: int, seed: int, *, block_tokens: int,
            max_prompt_tokens: int, max_output_tokens: int) -> list[Prompt]:
    """``count`` prompts of ``workload`` (``"mixed"``, or a Mooncake JSONL trace's path: its
    first ``count`` requests, in order) for the run seeded ``seed``, in blocks of
    ``block_tokens`` tokens. Prompts are cut to ``max_prompt_tokens`` (a cut keeps the prefix,
    so the sharing is kept), output lengths to ``max_output_tokens``.

    Raises TraceError for an unreadable trace, ValueError for a trace with fewer requests than
    ``count``, or limits below 2 prompt tokens, 1 output token or 1 token per block.
    """
    if max_prompt_tokens < 2 or max_output_tokens < 1 or block_tokens < 1:
        raise ValueError(f"need max prompt tokens >= 2, max output tokens >= 1 and block "
                         f"tokens >= 1, got {max_prompt_tokens}, {max_output_tokens} and "
                         f"{block_tokens}")
    if workload == MIXED:
        source = synthetic(SyntheticConfig(seed=seed, block_tokens=block_tokens, **MIXED_SHAPE))
        source_block = block_tokens
    else:
        source, source_block = iter(read_mooncake(workload)), MOONCAKE_BLOCK_TOKENS
    chosen = list(itertools.islice(source, count))
    if len(chosen) < count:
        raise ValueError(f"{workload}: {len(chosen)} requests, fewer than the {count} a run "
                         "sends; ask for fewer requests per run")
    blocks: dict[int, list[int]] = {}
    out = []
    for r in chosen:
        ids = prompt_token_ids(r, block_tokens, VOCAB, blocks, salt=seed,
                               source_block_tokens=source_block)[:max_prompt_tokens]
        out.append(Prompt(words(ids), len(ids), max(1, min(max_output_tokens, r.output_tokens))))
    return out


def write_jsonl(path: str | Path, rows: list[Prompt]) -> None:
    """Write ``rows`` as the load generator's dataset: JSON lines ``{"prompt": text,
    "prompt_tokens_count": n, "output_tokens_count": m}``, whole or not at all."""
    write_atomic(path, "".join(json.dumps({"prompt": p.text, "prompt_tokens_count": p.tokens,
                                           "output_tokens_count": p.output_tokens}) + "\n"
                               for p in rows))
