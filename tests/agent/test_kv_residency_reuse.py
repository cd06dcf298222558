"""Zero-code "stored for nothing": the KV events residency model gives an offload tier's
evictions their age (from the batch times of the block's store and removal) and hits (the
times its copy came back while held: a GPU store of a hash the cpu tier holds, a cpu store of
a hash the disk tier holds), on literal vLLM KV event batches."""

from __future__ import annotations

import msgspec

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.kv_residency import KvResidency, decode


def stored(hashes, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": [], "block_size": 16, "lora_id": None, "medium": medium}


def removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def apply(r: KvResidency, ts: float, *events) -> list:
    return r.apply(ts, decode(msgspec.msgpack.encode([ts, list(events), 0]))[1])


def evictions(out, tier):
    return sorted((e.blocks, e.hits, e.age, e.measured, e.offloaded) for e in out
                  if isinstance(e, ev.Eviction) and e.tier == tier)


def test_cpu_evictions_carry_age_and_hits():
    """t=1: GPU computes 1, 2, 3, offloaded to CPU. t=2: GPU evicts them. t=4: a request brings
    prefix 1 back: GPU stores 1 while the CPU holds it (a CPU hit). t=11: CPU evicts 1, 2, 3:
    1 had 1 hit, 2 and 3 none, each 10 s old, none kept below (dropped). GPU evictions stay
    unmeasured (its prefix-cache hits make no events)."""
    r = KvResidency(block_bytes=10)
    apply(r, 1.0, stored([1, 2, 3]), stored([1, 2, 3], "CPU"))
    out = apply(r, 2.0, removed([1, 2, 3]))
    assert evictions(out, "gpu") == [(3, 0, 0.0, False, True)]
    apply(r, 4.0, stored([1]))
    out = apply(r, 11.0, removed([1, 2, 3], "CPU"))
    assert evictions(out, "cpu") == [(1, 1, 10.0, True, False), (2, 0, 10.0, True, False)]
    # the never-reused share the alert and the banner read: 2 of the 3 evicted cpu blocks
    p = Pipeline()
    p.ingest("kv_events", out)
    counts = p.snapshot().evicted_block_hits["cpu"].counts
    assert counts[0] == 2 and sum(counts) == 3


def test_disk_promotions_are_the_disk_copies_hits_and_clears_stay_unmeasured():
    """A block offloaded cpu->disk at t=1, promoted back (CPU store of a disk-held hash) at
    t=3, evicted from disk at t=6: 1 hit, 5 s old. A cpu block cleared by AllBlocksCleared is
    no retention verdict: counted, unmeasured."""
    r = KvResidency(block_bytes=10)
    apply(r, 1.0, stored([7], "CPU"), stored([7, 8], "STORAGE"))
    apply(r, 2.0, removed([7], "CPU"))
    apply(r, 3.0, stored([7], "CPU"))
    out = apply(r, 6.0, removed([7, 8], "STORAGE"))
    assert evictions(out, "disk") == [(1, 0, 5.0, True, False), (1, 1, 5.0, True, False)]
    out = apply(r, 7.0, {"type": "AllBlocksCleared"})
    assert evictions(out, "cpu") == [(1, 0, 0.0, False, False)]
    assert r.seen == {"cpu": {}, "disk": {}}  # nothing left behind
