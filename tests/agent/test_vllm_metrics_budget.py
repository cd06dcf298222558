"""The host KV offload budget from vLLM's own /metrics (kvscope/agent/sources/vllm_metrics.py),
for an engine without kvscope's tap, on exposition text in vLLM's form (labels from 0.32's
``CacheConfig.metrics_info``, which renders every field with ``str()``: "None" when unset)."""

from __future__ import annotations

from kvscope import events as ev
from kvscope.agent import memory_budget
from kvscope.agent.memory_budget import offload_budgets
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.scrape import parse
from kvscope.agent.sources import vllm_metrics
from kvscope.agent.sources.vllm_metrics import MetricsMapper

GiB = 1 << 30


def _budgets(text: str, mapper: MetricsMapper | None = None) -> list[ev.EngineMemory]:
    return [e for e in (mapper or MetricsMapper()).map(parse(text), 5.0)
            if isinstance(e, ev.EngineMemory)]


def test_kv_offloading_size_in_cache_config_info_is_the_budget():
    """--kv-offloading-size 1.5 on two engines: 1.5 x 2^30 = 1,610,612,736 bytes each, 3 GiB
    in all, reported at the first scrape and again only when it changes (engine 0 at 2 GiB:
    3.5 GiB). "None" (offloading set up another way, or off) gives no report, not 0."""
    text = ('vllm:cache_config_info{block_size="16",engine="0",kv_offloading_size="1.5",'
            'num_gpu_blocks="100"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",kv_offloading_size="1.5",'
            'num_gpu_blocks="100"} 1.0\n')
    mapper = MetricsMapper()
    assert _budgets(text, mapper) == [ev.EngineMemory(ts=5.0, kv_offload_budget=3 * GiB)]
    assert _budgets(text, mapper) == []  # unchanged: the pipeline keeps the last
    assert _budgets(text.replace('"1.5"', '"2"', 1), mapper) == [
        ev.EngineMemory(ts=5.0, kv_offload_budget=int(3.5 * GiB))]  # engine 0 now 2 GiB
    assert _budgets(text.replace('"1.5"', '"None"')) == []
    assert _budgets('vllm:cache_config_info{block_size="16",engine="0"} 1.0\n') == []


def test_the_sized_pool_of_0_33_wins_over_the_typed_size():
    """0.33's kv_offload_config_info says the pool vLLM sized (cpu_kv_cache_size_bytes
    4,194,304): that, not the 1 GiB typed (vLLM rounds the pool down to whole chunks)."""
    text = ('vllm:kv_offload_config_info{cpu_blocks_per_chunk="2",cpu_kv_cache_size_bytes='
            '"4194304",cpu_num_chunks="64",engine="0"} 1.0\n'
            'vllm:cache_config_info{engine="0",kv_offloading_size="1.0"} 1.0\n')
    assert _budgets(text) == [ev.EngineMemory(ts=5.0, kv_offload_budget=4194304)]


def test_a_tap_in_the_same_vllm_is_not_counted_twice():
    """The scrape says 2 GiB; the tap in that vLLM says 2 GiB too: the budget is 2 GiB, not 4.
    Without the tap, the scrape's 2 GiB."""
    assert memory_budget.VLLM_METRICS == vllm_metrics.NAME  # the name the breakdown yields by
    pipeline = Pipeline()
    pipeline.ingest("vllm_metrics", [ev.EngineMemory(ts=1.0, kv_offload_budget=2 * GiB)])
    assert offload_budgets({}, pipeline.engine_memory()) == {"cpu": 2 * GiB}
    pipeline.ingest("vllm", [ev.EngineMemory(ts=1.0, kv_offload_budget=2 * GiB)])
    assert offload_budgets({}, pipeline.engine_memory()) == {"cpu": 2 * GiB}
