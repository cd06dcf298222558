"""The reference engine: a hand-worked LRU sequence, prefix semantics, and real bytes."""

import itertools

import pytest

from kvscope import events as ev
from kvscope.engine.engine import OffloadEngine, prefill_value
from kvscope.engine.presets import get_preset
from kvscope.engine.workload import Request, SyntheticConfig, synthetic

TINY = get_preset("tiny")
BLOCK = TINY.bytes_per_block()  # 2 * 4 layers * 16 tokens * 2 heads * 64 dims * 2 bytes = 32 KiB
A, B, C, D, E, F = 101, 102, 103, 104, 105, 106


def _req(name, *hashes):
    return Request(name, 0.0, 16 * len(hashes), 1, hashes)


def _engine(gpu, cpu, events):
    return OffloadEngine(TINY, gpu, cpu, emit=events.append)


def _of(events, kind, request_id=None):
    return [e for e in events if isinstance(e, kind)
            and (request_id is None or getattr(e, "request_id", None) == request_id)]


def test_block_size_of_tiny_preset():
    assert BLOCK == 2 * 4 * 16 * 2 * 64 * 2 == 32768


def test_hand_worked_lru_sequence():
    """gpu holds 2 blocks, cpu 3; LRU order is least recent first.

    r0 [A,B]: both miss -> recompute 32.              gpu [A,B]      cpu []
    r1 [C]:   miss; evict A, offload A.               gpu [B,C]      cpu [A]
    r2 [A,B]: A: evict B, offload B; promote A.       gpu [C,A]      cpu [B,A]
              B: evict C, offload C; promote B.       gpu [A,B]      cpu [A,C,B]
              -> 32 tokens from cpu; gpu->cpu 2 blocks (B, C), cpu->gpu 2 blocks (A, B).
    r3 [D,E]: evict A then B, both already in cpu: no copies.  gpu [D,E]
    r4 [F]:   evict D, offload D; cpu full -> drop A (LRU), which had 1 hit.  cpu [C,B,D]
    r5 [A]:   A is nowhere -> recompute; evict E, offload E; cpu drops C (0 hits).  cpu [B,D,E]
    """
    events = []
    engine = _engine(2, 3, events)
    outcomes = [engine.process(_req(f"r{i}", *hs)) for i, hs in
                enumerate([(A, B), (C,), (A, B), (D, E), (F,), (A,)])]
    assert [o.tokens["recompute"] for o in outcomes] == [32, 16, 0, 32, 16, 16]
    assert outcomes[2].tokens["cpu"] == 32

    moves = {(t.src, t.dst): (t.blocks, t.bytes) for t in _of(events, ev.Transfer, "r2")}
    assert moves == {("gpu", "cpu"): (2, 2 * BLOCK), ("cpu", "gpu"): (2, 2 * BLOCK)}
    assert _of(events, ev.Transfer, "r3") == []
    assert [(t.src, t.dst, t.blocks) for t in _of(events, ev.Transfer, "r4")] == [("gpu", "cpu", 1)]

    dropped = [e for e in _of(events, ev.Eviction) if e.tier == "cpu"]
    assert [(e.hits, e.offloaded) for e in dropped] == [(1, False), (0, False)]  # A, then C
    assert sum(e.tier == "gpu" for e in _of(events, ev.Eviction)) == 7  # A,B,C,A,B,D,E
    assert list(engine.cpu._blocks) == [B, D, E]


def test_making_room_can_drop_the_block_about_to_be_promoted():
    """gpu 2, cpu 2. r0 [A,B], r1 [C] (A offloaded), r2 [A,B]: promoting A offloads B into the
    last cpu slot; then making room for B offloads C, which drops B (cpu LRU) -> B recomputed."""
    events = []
    engine = _engine(2, 2, events)
    for i, hs in enumerate([(A, B), (C,)]):
        engine.process(_req(f"r{i}", *hs))
    outcome = engine.process(_req("r2", A, B))
    assert outcome.tokens["cpu"] == 16 and outcome.tokens["recompute"] == 16
    assert outcome.block_hits == {"gpu": 0, "cpu": 2}


def test_prefix_semantics_tokens_after_a_miss_are_recomputed():
    """[A,B] cached; [X,A,B]: X misses so A and B, though resident, count as recompute."""
    engine = _engine(8, 8, [])
    engine.process(_req("r0", A, B))
    outcome = engine.process(_req("r1", 999, A, B))
    assert outcome.tokens["recompute"] == 48 and outcome.tokens["gpu"] == 0
    assert outcome.block_hits["gpu"] == 2


def test_partial_last_block_and_lookup_event_sum_to_prompt():
    events = []
    engine = _engine(4, 4, events)
    engine.process(Request("r0", 0.0, 40, 1, (A, B, C)))  # 16 + 16 + 8 tokens
    (lookup,) = _of(events, ev.Lookup)
    assert sum(lookup.tokens.values()) == 40


@pytest.mark.parametrize("gpu,cpu", [(8, 16), (16, 4), (3, 3)])
def test_every_resident_block_holds_its_own_bytes(gpu, cpu):
    """After many requests with small pools (lots of eviction, offload and promotion inside one
    request), every resident block in both tiers holds exactly the bytes its prefill wrote."""
    engine = _engine(gpu, cpu, [])
    config = SyntheticConfig(seed=3, system_blocks=6, turn_blocks=(1, 4), one_off_blocks=(1, 6))
    for request in itertools.islice(synthetic(config), 400):
        engine.process(request)
    for tier in (engine.gpu, engine.cpu):
        for block_hash, resident in tier._blocks.items():
            block = tier.pool.data[resident.slot]
            assert bool((block == prefill_value(block_hash)).all()), (tier.name, block_hash)


def test_gpu_tier_needs_a_block():
    with pytest.raises(ValueError, match="at least 1"):
        OffloadEngine(TINY, 0, 4, payload=False)
