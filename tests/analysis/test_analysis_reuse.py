"""Reuse statistics on literal requests and the Mooncake trace's published facts."""

import numpy as np

from kvscope.analysis.inputs import from_requests, load_trace
from kvscope.analysis.reuse import SharedPrefix, prefix_tokens, reuse_stats
from kvscope.engine.workload import Request
from tests.traces import trace_path


def literal_trace():
    # block_tokens 4; B's last block is partial (10 tokens = 4 + 4 + 2)
    return from_requests([
        Request("a", 0.0, 12, 1, (1, 2, 3)),
        Request("b", 1.0, 10, 1, (1, 2, 4)),
        Request("c", 3.0, 8, 1, (1, 5)),
    ], block_tokens=4, source="literal")


def test_trace_flattening():
    t = literal_trace()
    assert t.block_ids.tolist() == [1, 2, 3, 1, 2, 4, 1, 5]
    assert t.tokens.tolist() == [4, 4, 4, 4, 4, 2, 4, 4]
    assert t.depths.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert t.requests.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert t.duration == 3.0 and t.request_count == 3 and t.prompt_tokens == 30
    assert prefix_tokens(t).tolist() == [4, 8, 12, 4, 8, 10, 4, 8]


def test_reuse_stats_of_literal_requests():
    s = reuse_stats(literal_trace())
    assert (s.accesses, s.unique_blocks, s.reused_blocks) == (8, 5, 2)
    assert s.reuse_share == 3 / 8
    assert s.token_reuse_share == 12 / 30
    assert s.distance.percentiles == {"p50": 2.0, "p90": 2.0, "p99": 2.0}
    assert sum(s.distance.counts) == 3
    assert s.time_to_reuse.percentiles["p50"] == 1.0
    assert s.time_to_reuse.unit == "seconds"
    # block 1 (3 uses) and the 2-block prefix ending in 2 (2 uses) are maximal; 8 tokens each
    assert s.top_prefixes == [SharedPrefix(1, 1, 4, 3, 8), SharedPrefix(2, 2, 8, 2, 8)]


def test_no_reuse_gives_empty_distributions():
    t = from_requests([Request("a", 0.0, 8, 1, (1, 2))], block_tokens=4)
    s = reuse_stats(t)
    assert s.reuse_share == 0 and s.distance.percentiles == {} and s.top_prefixes == []


def test_mooncake_trace_reuse_matches_its_readme():
    s = reuse_stats(load_trace(trace_path()))
    assert s.accesses == 288_500
    assert s.unique_blocks == 182_790
    assert round(s.reuse_share, 4) == 0.3664
    assert s.reused_blocks == int(np.sum(np.unique(load_trace(trace_path()).block_ids,
                                                   return_counts=True)[1] >= 2))
    # hash id 0 is every prompt's first block: the most shared prefix
    assert s.top_prefixes[0].block_id == 0 and s.top_prefixes[0].uses == 12_031
