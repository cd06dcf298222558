"""The rollout's prompts (kvscope.rollout.workload) and the tiny model's tokenizer
(kvscope.rollout.tiny_model): text that tokenizes back to the workload's token ids, shared
prefixes within a run and none across runs."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from kvscope.rollout import tiny_model
from kvscope.rollout.workload import MIXED, prompts, write_jsonl

LIMITS = {"block_tokens": 16, "max_prompt_tokens": 448, "max_output_tokens": 32}


def _blocks(text: str) -> set[tuple[str, ...]]:
    """Each 16-token prefix-closed block of a prompt, keyed by its whole prefix (as a prefix
    cache keys them)."""
    words = text.split()
    return {tuple(words[:i + 16]) for i in range(0, len(words) - 15, 16)}


def test_the_tokenizer_reads_one_token_per_word_and_writes_the_files_transformers_reads(tmp_path):
    """Token ids -> words -> the tokenizers library's tokenizer -> the same ids, no special
    token added; the directory holds config.json, tokenizer.json, tokenizer_config.json."""
    path = tiny_model.write(tmp_path / "tiny")
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "tokenizer.json", "tokenizer_config.json"]
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = [3, 4, 99, 511, 3, 250]
    assert tokenizer.encode(tiny_model.words(ids)).ids == ids
    assert tokenizer.get_vocab_size() == json.loads((path / "config.json").read_text())[
        "vocab_size"] == tiny_model.VOCAB
    assert tokenizer.token_to_id("</s>") == tiny_model.CONFIG["eos_token_id"]


def test_mixed_prompts_share_prefixes_within_a_run_and_none_across_runs():
    """The mixed workload's sessions and system prompts give blocks many prompts share in one
    run; a run with another seed shares no block with it (its tokens are salted), and the same
    seed gives the same prompts."""
    a = prompts(MIXED, 60, 1, **LIMITS)
    assert a == prompts(MIXED, 60, 1, **LIMITS)
    counts: dict = {}
    for p in a:
        for block in _blocks(p.text):
            counts[block] = counts.get(block, 0) + 1
    assert max(counts.values()) >= 5  # a system prompt's first block, in many sessions
    lengths = [p.tokens for p in a]
    assert min(lengths) < 64 and max(lengths) > 256  # long and short
    assert all(p.tokens <= 448 and 1 <= p.output_tokens <= 32 for p in a)
    assert all(p.tokens == len(p.text.split()) for p in a)
    b = prompts(MIXED, 60, 2, **LIMITS)
    assert not set().union(*map(_blocks, (p.text for p in a))) & set().union(
        *map(_blocks, (p.text for p in b)))


def test_a_trace_keeps_its_sharing_and_scales_its_blocks(tmp_path):
    """Mooncake requests: a (blocks 1, 2; 1024 tokens) and b (blocks 1, 2, 3; 1300 tokens) at
    16 tokens a block: a is 32 tokens, b round(1300 * 16 / 512) = 41, and b starts with a."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in (
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 1300, "output_length": 50, "hash_ids": [1, 2, 3]})))
    a, b = prompts(str(trace), 2, 0, **LIMITS)
    assert (a.tokens, b.tokens) == (32, 41)
    assert b.text.startswith(a.text + " ")
    assert (a.output_tokens, b.output_tokens) == (5, 32)
    with pytest.raises(ValueError, match="fewer than the 3"):
        prompts(str(trace), 3, 0, **LIMITS)


def test_the_dataset_file_holds_one_json_line_per_prompt(tmp_path):
    rows = prompts(MIXED, 5, 0, **LIMITS)
    write_jsonl(tmp_path / "d.jsonl", rows)
    lines = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [(x["prompt"], x["output_tokens_count"]) for x in lines] == [
        (p.text, p.output_tokens) for p in rows]
