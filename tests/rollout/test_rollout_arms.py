"""What a run cost an arm (kvscope.rollout.arms.cost), from its metrics before and after: the
agent's when it has one, else vLLM's own; what neither reports stays empty (not measured)."""

from __future__ import annotations

from kvscope.agent.sources.scrape import parse
from kvscope.rollout.arms import cost

AGENT = """kvscope_prompt_tokens_total{{source="gpu"}} {gpu}
kvscope_prompt_tokens_total{{source="cpu"}} {cpu}
kvscope_prompt_tokens_total{{source="recompute"}} {re}
kvscope_transfer_bytes_total{{src="gpu",dst="cpu"}} {store}
kvscope_transfer_bytes_total{{src="cpu",dst="gpu"}} {load}
kvscope_transfer_blocks_total{{src="gpu",dst="cpu"}} {store_blocks}
kvscope_transfer_seconds_sum{{src="gpu",dst="cpu"}} {store_s}
kvscope_transfer_failures_total{{src="cpu",dst="gpu",reason="unknown"}} {failed}
"""
VLLM = """vllm:prompt_tokens_total{{engine="0"}} {prompt}
vllm:prefix_cache_hits_total{{engine="0"}} {hits}
vllm:request_prefill_time_seconds_sum{{engine="0"}} {prefill}
"""


def test_an_arm_with_an_agent_costs_its_counters_increases():
    """Before: 100 gpu, 0 cpu, 50 recompute tokens; 4096 B stored in 1 block in 0.5 s. After:
    160 / 32 / 90; 12288 B in 3 blocks in 0.75 s, 2048 B loaded, one failed load. By hand:
    tokens gpu 60, cpu 32, recompute 40; gpu->cpu 8192 B, 2 blocks, 0.25 s; cpu->gpu 2048 B;
    1 failure; prefill 3.5 - 1.25 = 2.25 s from vLLM."""
    before = (parse(VLLM.format(prompt=150, hits=100, prefill=1.25)), parse(AGENT.format(
        gpu=100, cpu=0, re=50, store=4096, load=0, store_blocks=1, store_s=0.5, failed=0)))
    after = (parse(VLLM.format(prompt=282, hits=160, prefill=3.5)), parse(AGENT.format(
        gpu=160, cpu=32, re=90, store=12288, load=2048, store_blocks=3, store_s=0.75,
        failed=1)))
    c = cost(before, after)
    assert c.source == "agent"
    assert c.tokens == {"gpu": 60, "cpu": 32, "recompute": 40}
    assert c.transfer_bytes == {"gpu->cpu": 8192, "cpu->gpu": 2048}
    assert c.transfer_blocks == {"gpu->cpu": 2}
    assert c.transfer_seconds == {"gpu->cpu": 0.25}
    assert (c.transfer_failures, c.prefill_seconds) == (1, 2.25)


def test_an_arm_without_an_agent_costs_vllms_prefix_cache_counters():
    """vLLM's prompt tokens 150 -> 282 (+132) with prefix-cache hits 100 -> 160 (+60): gpu 60,
    recompute 72; no transfer seen, so none (not 0 seconds: not measured); vLLM counts no
    failed transfers: not measured (None), not 0."""
    before = (parse(VLLM.format(prompt=150, hits=100, prefill=1.0)), None)
    after = (parse(VLLM.format(prompt=282, hits=160, prefill=2.0)), None)
    c = cost(before, after)
    assert c.source == "server"
    assert c.tokens == {"gpu": 60, "recompute": 72}
    assert (c.transfer_bytes, c.transfer_seconds, c.prefill_seconds) == ({}, {}, 1.0)
    assert c.transfer_failures is None


def test_a_server_without_prefix_cache_counters_measures_nothing():
    c = cost((parse("other_metric 1\n"), None), (parse("other_metric 2\n"), None))
    assert (c.source, c.tokens, c.prefill_seconds) == ("none", {}, 0.0)
