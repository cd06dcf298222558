"""The prompts' own prefix reuse (kvscope/agent/prefix_reuse.py): counts by hand, the SHARDS
estimate against the exact share on the Mooncake conversation trace, and the pipeline's export
of it (``kvscope_prompt_prefix_blocks_total``, the sample's ``prompt_prefix_blocks``)."""

from __future__ import annotations

import json

import pytest

from kvscope import events as ev
from kvscope import sampling
from kvscope.agent.metrics import snapshot_samples
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.prefix_reuse import MAX_PREFIXES, PrefixReuse
from kvscope.catalog import PROMPT_PREFIX_BLOCKS
from tests.traces import trace_path


def lookup(hashes, rate=1.0, request_id="r"):
    return ev.Lookup(ts=1.0, request_id=request_id, tokens={"recompute": 16 * len(hashes)},
                     blocks=len(hashes), block_hashes=tuple(hashes), block_sample_rate=rate)


def test_counts_by_hand_with_the_lru_bound():
    """Two prefixes remembered. [1, 2]: both new (list 1, 2). [1, 3]: 1 seen (list 2, 1), 3 new
    (list 2, 1, 3: 2 falls out). [2]: new again. Seen 1, new 4."""
    reuse = PrefixReuse(max_prefixes=2)
    for hashes in ([1, 2], [1, 3], [2]):
        reuse.add(lookup(hashes))
    assert reuse.counts() == {"seen": 1.0, "new": 4.0}


def test_a_sampled_block_stands_for_one_over_the_rate():
    """At rate 1/4 each sampled block counts 4: [7] twice is 4 new, then 4 seen."""
    reuse = PrefixReuse()
    reuse.add(lookup([7], rate=0.25))
    reuse.add(lookup([7], rate=0.25))
    assert reuse.counts() == {"seen": 4.0, "new": 4.0}


def test_no_hashes_is_not_measured_not_zero():
    """Lookups without hashes (an engine that records none, a sampled lookup with none kept)
    leave the counts empty: the dashboard then says "not measured", not "0% reuse"."""
    reuse = PrefixReuse()
    reuse.add(lookup([]))
    reuse.add(lookup([], rate=1 / 16))
    assert reuse.counts() == {}
    with pytest.raises(ValueError, match="max_prefixes must be >= 1"):
        PrefixReuse(max_prefixes=0)


def test_sampled_estimate_matches_the_exact_share_on_the_mooncake_trace():
    """The share of the trace's blocks whose prefix came before, exactly (a set of every
    ``hash_id``, unbounded: the second implementation) and estimated from the blocks the vLLM
    tap's default rate samples (1 in 16, kvscope.sampling's predicate, as the tap applies it):
    36.6% exactly, within 0.035 estimated. The error is SHARDS' heavy hitter: block 0, every
    conversation's first, is 12,031 of the 288,500 accesses and not sampled, so the estimate
    is about (105,710 - 12,030) / (288,500 - 12,031) = 33.9% (by hand). The LRU bound (131,072
    sampled prefixes) is beyond the trace's distinct sampled prefixes, so it does not enter;
    at rate 1 it is lifted."""
    t = sampling.threshold(sampling.DEFAULT_RATE)
    rate = sampling.rate_of(t)
    exact, sampled = PrefixReuse(max_prefixes=1 << 30), PrefixReuse()
    everything, seen, total = set(), 0, 0
    with open(trace_path()) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"]
            for h in ids:
                seen += h in everything
                everything.add(h)
            total += len(ids)
            exact.add(lookup(ids))
            keys, _depths, _dropped = sampling.sample(ids, len(ids), t)
            sampled.add(lookup(keys, rate=rate))
    assert len(everything) * rate < MAX_PREFIXES
    share = seen / total
    counts = exact.counts()
    assert counts["seen"] / (counts["seen"] + counts["new"]) == pytest.approx(share)
    estimate = sampled.counts()
    assert estimate["seen"] / (estimate["seen"] + estimate["new"]) == pytest.approx(share, abs=0.035)
    assert estimate["seen"] + estimate["new"] == pytest.approx(total, rel=0.05)


def test_the_pipeline_exports_the_reuse_of_the_lookups_it_folds():
    """Two requests with the same two-block prefix: 2 new blocks, then 2 seen, in the snapshot,
    on /metrics' samples and in the dashboard's sample; nothing before a lookup with hashes."""
    pipe = Pipeline()
    assert pipe.record_sample(1.0, None)["prompt_prefix_blocks"] == {}
    for rid in ("a", "b"):
        pipe.ingest("engine", [ev.RequestStarted(ts=1.0, request_id=rid, prompt_tokens=32),
                               lookup([11, 12], request_id=rid)])
    assert pipe.snapshot().prompt_prefix_blocks == {"seen": 2.0, "new": 2.0}
    assert sorted(snapshot_samples(pipe.snapshot())[PROMPT_PREFIX_BLOCKS]) == [
        (["new"], 2.0), (["seen"], 2.0)]
    assert pipe.record_sample(2.0, None)["prompt_prefix_blocks"] == {"seen": 2.0, "new": 2.0}


def test_the_metric_help_names_the_bound():
    assert f"{MAX_PREFIXES:,} distinct sampled prefixes" in PROMPT_PREFIX_BLOCKS.help
