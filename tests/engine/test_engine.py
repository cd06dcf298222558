"""The reference engine: a hand-worked LRU sequence, prefix semantics, and real bytes."""

import itertools
import os
import subprocess
import sys

import pytest

from kvscope import events as ev
from kvscope.engine.engine import EngineConfigError, OffloadEngine, prefill_value
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


def _admissions(events):
    """The Admission events' blocks added up: {tier: (stored, skipped, failed)}."""
    out = {}
    for e in _of(events, ev.Admission):
        s, k, f = out.get(e.tier, (0, 0, 0))
        out[e.tier] = (s + e.stored, k + e.skipped, f + e.failed)
    return out


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
    assert engine.cpu.order() == [B, D, E]


def test_a_staged_copy_served_its_promotion_so_it_was_not_stored_for_nothing():
    """gpu 1, cpu 1, disk 2 (LRU, least recent first).

    r0 [A]: recompute.                                      gpu [A]
    r1 [B]: gpu evicts A, offloaded.                        cpu [A]
    r2 [C]: gpu evicts B, offloaded; cpu drops A (0 hits), spilled.  cpu [B] disk [A]
    r3 [A]: gpu evicts C, offloaded; cpu drops B (0 hits), spilled: disk [A,B]. A staged
            from disk: cpu drops C (0 hits), spilled, disk drops B: disk [A,C], cpu [A];
            A's cpu copy is read for the promotion: 16 disk tokens, and a hit of that copy.
    r4 [D]: gpu evicts A, already in cpu.
    r5 [E]: gpu evicts D, offloaded; cpu drops A: 1 hit (it counted 0, so every staged block
            read as stored for nothing), offloaded (disk holds it)."""
    events = []
    engine = OffloadEngine(TINY, 1, 1, 2, emit=events.append, payload=False)
    outcomes = [engine.process(_req(f"r{i}", *hs))
                for i, hs in enumerate([(A,), (B,), (C,), (A,), (D,), (E,)])]
    assert outcomes[3].tokens["disk"] == 16
    assert [(e.hits, e.offloaded) for e in _of(events, ev.Eviction) if e.tier == "cpu"] == [
        (0, True), (0, True), (0, True), (1, True)]


def test_making_room_never_drops_a_block_the_request_found_cached():
    """gpu 2, cpu 2, LRU (least recent first). r0 [A,B], r1 [C]: gpu evicts A, offloaded.
    gpu [B,C], cpu [A]. r2 [A,B]: both cached (A on cpu, B on the gpu), so both pinned.

    A: gpu evicts B, offloaded (cpu [A,B]); A promoted (cpu [B,A]).  gpu [C,A]
    B: gpu evicts C; offloading C needs a cpu victim: the LRU, B, is pinned (its turn has not
       come), so A goes (its turn has); cpu [B,C]; B promoted.      gpu [A,B]
    -> 32 tokens from cpu, none recomputed. vLLM's managers never evict a block a request
    loads; the engine had dropped B there and recomputed it, after counting it a cpu hit."""
    events = []
    engine = _engine(2, 2, events)
    for i, hs in enumerate([(A, B), (C,)]):
        engine.process(_req(f"r{i}", *hs))
    outcome = engine.process(_req("r2", A, B))
    assert outcome.tokens["cpu"] == 32 and outcome.tokens["recompute"] == 0
    assert outcome.block_hits == {"gpu": 0, "cpu": 2, "disk": 0}
    assert engine.cpu.order() == [C, B] and engine.gpu.order() == [A, B]


def test_a_tier_full_of_pinned_blocks_skips_the_offload_instead():
    """gpu 2, cpu 2. r0 [A,B]; r1 [C,D]: gpu evicts A and B, both offloaded: cpu [A,B].
    r2 [A,B]: both on the cpu tier, pinned. A: gpu evicts C; the cpu holds only pinned blocks,
    so C is not offloaded (an Admission skip: no room) and A is promoted. B: gpu evicts D; A's
    turn has passed, so it makes room for D; B promoted (cpu [D,B]). -> 32 cpu tokens.
    Before, C's offload evicted A (the cpu LRU) and D's then B: both recomputed, after the
    Lookup counted two cpu hits."""
    events = []
    engine = _engine(2, 2, events)
    for i, hs in enumerate([(A, B), (C, D)]):
        engine.process(_req(f"r{i}", *hs))
    outcome = engine.process(_req("r2", A, B))
    assert outcome.tokens["cpu"] == 32 and outcome.block_hits["cpu"] == 2
    assert engine.cpu.order() == [D, B]  # B promoted last
    assert _admissions(events)["cpu"] == (3, 1, 0)  # A, B, D offloaded; C skipped


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
    engine.drain()  # with CUDA, host rows are read once the copy stream is done with them
    for tier in (engine.gpu, engine.cpu):
        for block_hash in tier.order():
            resident = tier.get(block_hash)
            block = tier.pool.data[resident.slot]
            assert bool((block == prefill_value(block_hash)).all()), (tier.name, block_hash)


def test_gpu_tier_needs_a_block():
    with pytest.raises(ValueError, match="at least 1"):
        OffloadEngine(TINY, 0, 4, payload=False)


# -- three tiers, ARC, admission ------------------------------------------------------------


def _resident_bytes_ok(engine):
    """Every resident block in every tier holds exactly the bytes its prefill wrote; disk
    chunks are read back through the checksummed path."""
    import numpy as np

    engine.drain()  # with CUDA, host rows are read once the copy stream is done with them
    for tier in engine.tiers:
        for block_hash in tier.order():
            slot = tier.get(block_hash).slot
            if tier.name == "disk":
                out = np.empty(engine.block_bytes, dtype=np.uint8)
                tier.pool.read_into(slot, block_hash, out)
                values = np.frombuffer(out.tobytes(), dtype=np.float16)
                assert bool((values == prefill_value(block_hash)).all()), (tier.name, block_hash)
            else:
                block = tier.pool.data[slot]
                assert bool((block == prefill_value(block_hash)).all()), (tier.name, block_hash)


def test_hand_worked_three_tier_cascade(tmp_path):
    """gpu 1, cpu 1, disk 2, LRU everywhere.

    r0 [A]: recompute.                                   gpu [A]  cpu []   disk []
    r1 [B]: evict A -> offload A.                        gpu [B]  cpu [A]  disk []
    r2 [C]: evict B -> offload B; cpu evicts A -> spill. gpu [C]  cpu [B]  disk [A]
    r3 [A]: A only on disk (a disk hit). Making a gpu slot offloads C, which spills B
            (disk [A,B]); staging A touches it on disk (disk [B,A]) and needs a cpu slot:
            cpu evicts C -> spill C, disk evicts B (dropped). Then disk->cpu, cpu->gpu.
                                                         gpu [A]  cpu [A]  disk [A,C]
    """
    events = []
    engine = OffloadEngine(TINY, 1, 1, 2, emit=events.append, disk_dir=tmp_path)
    outcomes = [engine.process(_req(f"r{i}", h)) for i, h in enumerate([A, B, C, A])]
    assert outcomes[3].tokens == {"gpu": 0, "cpu": 0, "disk": 16, "recompute": 0}
    assert outcomes[3].block_hits == {"gpu": 0, "cpu": 0, "disk": 1}
    moves = {}
    for t in _of(events, ev.Transfer, "r3"):  # the 1-slot cpu tier forces several batches
        moves[(t.src, t.dst)] = moves.get((t.src, t.dst), 0) + t.blocks
    assert moves == {("gpu", "cpu"): 1, ("cpu", "disk"): 2, ("disk", "cpu"): 1, ("cpu", "gpu"): 1}
    assert all(t.ok and t.bytes == t.blocks * BLOCK for t in _of(events, ev.Transfer))
    assert [engine.gpu.order(), engine.cpu.order(), engine.disk.order()] == [[A], [A], [A, C]]
    assert engine.stats.evictions == {"gpu": 3, "cpu": 3, "disk": 1}
    # every offer admitted: offloads A, B, C into cpu; spills A (r2), B and C (r3) into disk
    assert _admissions(events) == {"cpu": (3, 0, 0), "disk": (3, 0, 0)}
    (finished,) = _of(events, ev.RequestFinished, "r3")
    stage = [t.duration for t in _of(events, ev.Transfer, "r3") if t.dst == "gpu" or t.src == "disk"]
    assert finished.promotion_wait == pytest.approx(sum(stage)) and finished.promotion_wait > 0
    assert finished.ttft >= finished.promotion_wait
    _resident_bytes_ok(engine)
    engine.close()


def test_a_block_staged_now_may_push_a_pinned_one_to_disk(tmp_path):
    """gpu 1, cpu 1, disk 2, LRU. r0 [X], r1 [Y], r2 [Z]: gpu [Z], cpu [Y], disk [X].
    r3 [X,Y]: X on disk, Y on the cpu tier, both pinned.

    X: gpu evicts Z; the cpu holds only pinned Y, so Z is not offloaded. Staging X needs the
       cpu slot all the same (else X and all after it were recomputed): Y goes, spilled to
       disk (disk [X,Y]); X staged and promoted.                        cpu [X]
    Y: gpu evicts X (already on cpu). Y staged from disk: the cpu evicts X (unpinned now,
       and already on disk); Y promoted.                                cpu [Y], disk [X,Y]
    -> 32 disk tokens. Without pins, Z's offload pushed Y to disk and staging X then spilled
    Z over it (disk [X,Z]): Y recomputed."""
    X, Y, Z = 201, 202, 203
    events = []
    engine = OffloadEngine(TINY, 1, 1, 2, emit=events.append, disk_dir=tmp_path)
    for i, hs in enumerate([(X,), (Y,), (Z,)]):
        engine.process(_req(f"r{i}", *hs))
    assert [engine.gpu.order(), engine.cpu.order(), engine.disk.order()] == [[Z], [Y], [X]]
    outcome = engine.process(_req("r3", X, Y))
    assert outcome.tokens == {"gpu": 0, "cpu": 0, "disk": 32, "recompute": 0}
    assert outcome.block_hits == {"gpu": 0, "cpu": 0, "disk": 2}  # each found at its turn
    moves = {}
    for t in _of(events, ev.Transfer, "r3"):
        moves[(t.src, t.dst)] = moves.get((t.src, t.dst), 0) + t.blocks
    assert moves == {("cpu", "disk"): 1, ("disk", "cpu"): 2, ("cpu", "gpu"): 2}
    assert [engine.cpu.order(), sorted(engine.disk.order())] == [[Y], sorted([X, Y])]
    _resident_bytes_ok(engine)
    engine.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("gpu,cpu,disk", [(8, 16, 32), (4, 3, 6), (3, 2, 3)])
def test_every_resident_block_holds_its_own_bytes_in_three_tiers(tmp_path, policy, gpu, cpu, disk):
    """Small pools and many requests: eviction, offload, spill, staging and promotion all
    happen inside single requests, and no block ends up holding another block's bytes."""
    engine = OffloadEngine(TINY, gpu, cpu, disk, policy=policy, disk_dir=tmp_path)
    config = SyntheticConfig(seed=5, system_blocks=6, turn_blocks=(1, 4), one_off_blocks=(1, 6))
    for request in itertools.islice(synthetic(config), 300):
        engine.process(request)
    assert engine.stats.moved["disk->cpu"] > 0 and engine.stats.moved["cpu->disk"] > 0
    assert engine.stats.errors == {}
    _resident_bytes_ok(engine)
    engine.close()


@pytest.mark.parametrize("policy,last_is_hit", [("lru", False), ("arc", True)])
def test_arc_keeps_a_reused_block_through_a_scan(policy, last_is_hit):
    """gpu 2, no cpu. A, A, then the scan B, C, D, then A. LRU has forgotten A; ARC (Megiddo
    and Modha) keeps A in T2 while the scan churns through T1 and its ghost list B1."""
    engine = OffloadEngine(TINY, 2, 0, policy=policy, payload=False)
    outcomes = [engine.process(_req(f"r{i}", h)) for i, h in enumerate([A, A, B, C, D, A])]
    assert [o.block_hits["gpu"] for o in outcomes] == [0, 1, 0, 0, 0, int(last_is_hit)]


def test_store_threshold_offloads_only_blocks_seen_often_enough():
    """store_threshold=2, gpu 1, cpu 4: A seen once is dropped, seen twice is offloaded."""
    events = []
    engine = OffloadEngine(TINY, 1, 4, store_threshold=2, payload=False, emit=events.append)
    for i, h in enumerate([A, B, A, B]):
        engine.process(_req(f"r{i}", h))
    # r1 evicts A (seen once): dropped. r2 evicts B (once): dropped. r3 evicts A (twice): kept.
    assert engine.cpu.order() == [A]
    assert engine.stats.offloaded["gpu"] == 1 and engine.stats.evictions["gpu"] == 3
    # the admission outcomes, cpu: 1 stored (A at r3), 2 skipped (A at r1, B at r2); no disk
    assert _admissions(events) == {"cpu": (1, 2, 0)}
    # one event per request that offered blocks (r1, r2, r3), none for r0 (nothing evicted)
    assert [(a.stored, a.skipped) for a in _of(events, ev.Admission)] == [(0, 1), (0, 1), (1, 0)]
    assert engine.process(_req("r4", A)).tokens["cpu"] == 16


def test_min_priority_drops_low_priority_blocks_instead_of_offloading():
    """min_priority=50: the system-prompt-like block (90) is offloaded, the low one (10) and
    one without a priority (default 35) are dropped."""
    events = []
    engine = OffloadEngine(TINY, 1, 4, min_priority=50, payload=False, emit=events.append)
    engine.process(Request("r0", 0.0, 32, 1, (A, B), (90, 10)))
    engine.process(_req("r1", C))
    engine.process(_req("r2", D))
    assert engine.cpu.order() == [A]
    assert engine.stats.evictions["gpu"] == 3 and engine.stats.offloaded["gpu"] == 1
    # A stored (r0, evicted by B), B (10) skipped at r1, C (default 35) skipped at r2
    assert _admissions(events) == {"cpu": (1, 2, 0)}


@pytest.mark.parametrize("admission", [{}, {"store_threshold": 2, "min_priority": 30}],
                         ids=["defaults", "store-threshold-and-priority"])
def test_a_long_run_remembers_a_bounded_number_of_blocks(admission):
    """The demo's tiers (gpu 256, cpu 1,024 blocks) on the synthetic workload, whose requests
    carry block priorities. The engine remembered every block's priority, read or not (only
    min_priority reads them), and every access count: 895,405 blocks and 74 MiB after the
    demo's first hour. Its memory (tracemalloc) from request 8,000 to 16,000, past the bound
    (at least 65,536 blocks remembered, each map), grows by under 1 MiB; it grew 9 to 14 MiB."""
    import tracemalloc

    engine = OffloadEngine(TINY, 256, 1024, payload=False, **admission)
    sizes = []
    tracemalloc.start()
    try:
        for n, request in enumerate(itertools.islice(synthetic(SyntheticConfig()), 16_000), 1):
            engine.process(request)
            if n in (8_000, 16_000):
                sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert sizes[1] - sizes[0] < 1 << 20, sizes


def test_admission_forgets_the_blocks_seen_least_recently(monkeypatch):
    """store_threshold 2, the bound cut to 5 blocks (gpu 1 + cpu 4, 1 each): a hot block in
    every request beside a new one each time. Forgetting the first remembered forgot the hot
    block, the first in, every few requests (its count starting over each time); it is seen
    last each time, so it stays, with its whole count: 40."""
    import kvscope.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "MIN_REMEMBERED", 4)
    monkeypatch.setattr(engine_module, "REMEMBERED_PER_BLOCK", 1)
    engine = OffloadEngine(TINY, 1, 4, payload=False, store_threshold=2)
    for i in range(40):
        engine.process(_req(f"r{i}", A, 1000 + i))
    assert engine._seen.get(A) == 40 and len(engine._seen) == 5


def test_ttft_is_queueing_plus_lookup_plus_promotion_plus_prefill():
    engine = OffloadEngine(TINY, 4, 4, payload=False)
    engine.process(_req("r0", A, B))
    outcome = engine.process(_req("r1", A, B, C), queueing=0.25)
    assert outcome.tokens == {"gpu": 32, "cpu": 0, "disk": 0, "recompute": 16}
    assert outcome.prefill == pytest.approx(TINY.prefill_seconds(16))
    assert outcome.ttft == pytest.approx(0.25 + outcome.lookup + outcome.promotion_wait
                                         + outcome.prefill)


def test_simulator_prices_promotions_from_the_cost_model():
    engine = OffloadEngine(TINY, 1, 4, payload=False)
    engine.process(_req("r0", A))
    engine.process(_req("r1", B))  # A offloaded
    outcome = engine.process(_req("r2", A))  # A promoted cpu->gpu
    assert outcome.promotion_wait == pytest.approx(TINY.transfer_seconds("cpu", "gpu", BLOCK))


def test_disk_tier_needs_a_cpu_tier():
    with pytest.raises(ValueError, match="cpu tier"):
        OffloadEngine(TINY, 4, 0, 4, payload=False)


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        OffloadEngine(TINY, 4, 4, policy="mru", payload=False)


@pytest.mark.parametrize("kwargs, refused", [
    ({"policy": {"gpu": "lru", "cpu": "lru", "disk": "fifo"}}, "unknown eviction policy 'fifo'"),
    ({"policy": {"gpu": "lru", "cpu": "arc", "dsik": "arc"}}, "unknown tier 'dsik'"),
    ({"cpu_blocks": -1, "disk_blocks": 0}, "tier sizes must be >= 0"),
])
def test_a_refused_engine_leaves_its_disk_directory_free(tmp_path, kwargs, refused):
    """A bad policy or size is refused before the disk tier's store takes its directory: an
    unknown disk policy had left the store's lock held (a second engine on the directory was
    refused as in use), a misspelt tier fell back to LRU, and a negative cpu tier failed in
    torch."""
    sizes = {"gpu_blocks": 4, "cpu_blocks": 4, "disk_blocks": 4}
    with pytest.raises(EngineConfigError, match=refused):
        OffloadEngine(TINY, **{**sizes, **kwargs}, disk_dir=tmp_path)
    OffloadEngine(TINY, **sizes, disk_dir=tmp_path).close()


def test_request_finished_carries_every_part_of_ttft():
    """TTFT = queueing + lookup + promotion wait + prefill (module docstring), and the event
    carries each part so a waterfall adds up: here 0.5 s of queueing plus the rest."""
    events = []
    engine = OffloadEngine(TINY, 2, 4, emit=events.append)
    for name, hashes in [("r0", (A, B)), ("r1", (C, D)), ("r2", (A, B))]:
        engine.process(_req(name, *hashes), queueing=0.5)
    engine.drain()
    for done in _of(events, ev.RequestFinished):
        parts = done.queueing + done.lookup + done.promotion_wait + done.prefill
        assert done.queueing == 0.5 and abs(parts - done.ttft) < 1e-12
    (first,) = _of(events, ev.RequestFinished, "r0")
    assert first.prefill == TINY.prefill_seconds(32) > 0
    # one time axis: arrival is queueing before the engine took it; first token at arrival + TTFT
    for started in _of(events, ev.RequestStarted):
        (done,) = _of(events, ev.RequestFinished, started.request_id)
        assert abs(done.ts - started.ts - done.ttft) < 1e-6  # float Unix seconds: ~0.2 us
        copies = _of(events, ev.Transfer, started.request_id)
        for copy in copies:
            assert started.ts + done.queueing <= copy.ts  # copies run once the engine took it
        if copies:  # the copies run before the prefill: the wait ends with the last of them
            wait_ends = started.ts + done.queueing + done.lookup + done.promotion_wait
            assert abs(wait_ends - max(c.ts + c.duration for c in copies)) < 1e-6
    # r2 offloads C and D to make room, then promotes A and B: the waterfall's promotion wait
    # is that promotion (it was drawn before it, over the offload)
    (started,) = _of(events, ev.RequestStarted, "r2")
    (done,) = _of(events, ev.RequestFinished, "r2")
    offload, promotion = _of(events, ev.Transfer, "r2")
    assert (offload.src, promotion.src) == ("gpu", "cpu") and done.promotion_wait > 0
    assert abs(started.ts + done.queueing + done.lookup - promotion.ts) < 1e-5


def test_copies_flushed_during_planning_are_counted_once():
    """One GPU block: r3 = (A, B), both in the cpu tier, promotes A, then must offload A to
    promote B into the same slot, so the first promotion runs (a flush for the slot conflict)
    inside the timed planning. That time was in lookup and again in the wait; now the parts
    end where the last copy ends, as for any request: arrival + queueing + lookup + wait."""
    events = []
    block_tokens = 16 * 256  # 8 MiB blocks: copies long enough to tell a double count
    engine = OffloadEngine(TINY, 1, 4, block_tokens=block_tokens, emit=events.append)
    for name, hashes in [("r0", (A,)), ("r1", (B,)), ("r2", (C,)), ("r3", (A, B))]:
        engine.process(Request(name, 0.0, block_tokens * len(hashes), 1, hashes))
    engine.drain()
    (started,) = _of(events, ev.RequestStarted, "r3")
    (done,) = _of(events, ev.RequestFinished, "r3")
    copies = _of(events, ev.Transfer, "r3")
    assert [c.src + "->" + c.dst for c in copies].count("cpu->gpu") == 2
    wait_ends = started.ts + done.queueing + done.lookup + done.promotion_wait
    assert abs(wait_ends - max(c.ts + c.duration for c in copies)) < 1e-6


def test_the_first_requests_blocks_count_as_lookups_in_the_engines_tiers():
    """A lookup counts misses in the tiers its engine reported; the engine reported them only
    as its first request finished, so that request's 3 blocks were in no tier's hits or
    misses (14 of the Mooncake trace's 288,500 accesses were missing from the metrics). The
    tiers now come first: 3 misses in gpu, then in cpu."""
    from kvscope.agent.pipeline import Pipeline

    pipeline = Pipeline()
    engine = OffloadEngine(TINY, 4, 4, payload=False,
                           emit=lambda event: pipeline.ingest("engine", (event,)))
    engine.process(_req("r0", A, B, C))
    engine.drain()
    assert {key: n for key, n in pipeline.snapshot().lookup_blocks.items() if n} == {
        ("gpu", "miss"): 3, ("cpu", "miss"): 3}


def test_idle_time_before_eviction_counts_from_the_last_hit():
    """gpu holds 2 blocks, cpu 3 (LRU, least recent first); a block's idle time is since its
    last hit, or since it was stored if it had none (t: the engine's clock, seconds).

    t=0   r0 [A,B]  gpu [A,B]
    t=10  r1 [A]    gpu hit on A                      gpu [B,A]
    t=30  r2 [C]    gpu evicts B: age 30, 0 hits, idle 30; cpu [B]
    t=50  r3 [D]    gpu evicts A: age 50, 1 hit (t=10), idle 40; cpu [B,A]
    t=60  r4 [B]    gpu evicts C: age 30, idle 30; cpu [B,A,C]; B promoted: a cpu hit at 60,
                    cpu [A,C,B]
    t=100 r5 [E]    gpu evicts D: age 50, idle 50; cpu drops A: age 50, idle 50; cpu [C,B,D]
    t=130 r6 [G]    gpu evicts B (stored at 60): age 70, idle 70 (already in cpu)
    t=150 r7 [H]    gpu evicts E: age 50, idle 50; cpu drops C: age 90, idle 90
    t=170 r8 [I]    gpu evicts G: age 40, idle 40; cpu drops B: stored at 30, age 140,
                    1 hit (t=60): idle 110
    """
    G, H, I = 107, 108, 109
    events, now = [], [0.0]
    engine = OffloadEngine(TINY, 2, 3, emit=events.append, clock=lambda: now[0])
    for t, hashes in ((0, (A, B)), (10, (A,)), (30, (C,)), (50, (D,)), (60, (B,)),
                      (100, (E,)), (130, (G,)), (150, (H,)), (170, (I,))):
        now[0] = float(t)
        engine.process(_req(f"r{t}", *hashes))
    evictions = {tier: [(e.ts, e.age, e.hits, e.idle) for e in _of(events, ev.Eviction)
                        if e.tier == tier] for tier in ("gpu", "cpu")}
    assert evictions["gpu"] == [(30, 30, 0, 30), (50, 50, 1, 40), (60, 30, 0, 30),
                                (100, 50, 0, 50), (130, 70, 0, 70), (150, 50, 0, 50),
                                (170, 40, 0, 40)], evictions["gpu"]
    assert evictions["cpu"] == [(100, 50, 0, 50), (150, 90, 0, 90), (170, 140, 1, 110)], \
        evictions["cpu"]


class _PendingEvent:
    """A CUDA event's interface (``torch.cuda.Event``: query, synchronize, elapsed_time), for
    the one boundary this machine lacks: a copy whose timing has not completed yet. ``done``:
    a shared flag the test sets when the "GPU" finishes."""

    def __init__(self, done: list[bool], at_ms: float) -> None:
        self._done, self._at = done, at_ms

    def query(self) -> bool:
        return self._done[0]

    def synchronize(self) -> None:
        self._done[0] = True

    def elapsed_time(self, end: "_PendingEvent") -> float:
        return end._at - self._at


def test_copies_in_flight_are_reported_per_direction_when_they_change(monkeypatch):
    """On this CPU every copy is timed when issued: the first request's report says 0 copies in
    flight for each direction between the two tiers (gpu->cpu, cpu->gpu; no disk tier, no disk
    directions), and later requests send nothing (nothing changed). With copies whose CUDA
    events are pending (gpu 1 block, cpu 4): r3 [C] evicts B (offload, one batched copy of 1
    block), so gpu->cpu reports 1 copy, 1 block, while it is pending; once the events complete
    and the engine drains, 0 again."""
    events = []
    engine = _engine(1, 4, events)
    engine.process(_req("r1", A))
    engine.process(_req("r2", B))
    assert _of(events, ev.TransfersInFlight) == [
        ev.TransfersInFlight(ts=e.ts, src=s, dst=d, transfers=0, blocks=0)
        for e, (s, d) in zip(_of(events, ev.TransfersInFlight), [("gpu", "cpu"), ("cpu", "gpu")])]
    done = [False]
    monkeypatch.setattr(engine._copier, "copy", lambda *args: (
        None, (_PendingEvent(done, 0.0), _PendingEvent(done, 2.0))))
    engine.process(_req("r3", C))
    reported = _of(events, ev.TransfersInFlight)[2:]
    assert [(e.src, e.dst, e.transfers, e.blocks) for e in reported] == [("gpu", "cpu", 1, 1)]
    done[0] = True
    engine.drain()
    reported = _of(events, ev.TransfersInFlight)[3:]
    assert [(e.src, e.dst, e.transfers, e.blocks) for e in reported] == [("gpu", "cpu", 0, 0)]
    (offload,) = [t for t in _of(events, ev.Transfer, "r3")]
    assert (offload.src, offload.dst, offload.duration) == ("gpu", "cpu", 0.002)
    engine.close()


def test_no_cpu_tier_no_copies_in_flight_reported():
    """cpu_blocks 0 (the demo's --cpu-blocks 0): no copy goes to or from a cpu tier, and
    /metrics showed kvscope_transfers_in_flight{gpu->cpu, cpu->gpu} at 0 for it. Now none."""
    events = []
    engine = _engine(1, 0, events)
    engine.process(_req("r1", A))
    engine.process(_req("r2", B))
    assert _of(events, ev.TransfersInFlight) == []
    engine.close()


def test_a_tier_takes_its_slots_as_it_fills_so_its_size_costs_nothing_up_front():
    """A tier of 10**15 blocks builds at once (every free slot listed up front was a
    MemoryError). Slots go 0, 1, 2 as blocks come; a removed block's slot is the next one
    taken; a full tier's victim gives up its slot to the newcomer."""
    from kvscope.engine.tier import Tier

    huge = Tier("disk", 10**15, BLOCK)
    assert [huge.insert(h, 0.0)[0] for h in (10, 11, 12)] == [0, 1, 2]
    huge.remove(11)
    assert huge.insert(13, 0.0)[0] == 1 and huge.insert(14, 0.0)[0] == 3
    small = Tier("cpu", 2, BLOCK)
    small.insert(1, 0.0), small.insert(2, 0.0)
    slot, victim = small.insert(3, 1.0)
    assert victim[0] == 1 and slot == victim[1].slot == 0


def test_a_disk_tier_larger_than_the_free_space_is_refused_and_leaves_nothing(tmp_path):
    """The free space under tmp_path (shutil.disk_usage) plus 1024 blocks is refused, naming
    the GiB needed, with no chunk file written and the directory it created, or a temporary
    one of its own, not left behind; 1024 blocks less than the free space is accepted. A
    block's chunk file takes its 32-byte header and the block, in whole file-system blocks."""
    import shutil
    import tempfile
    from pathlib import Path

    from kvscope.engine.engine import EngineConfigError

    unit = os.statvfs(tmp_path).f_frsize
    on_disk = -(-(32 + BLOCK) // unit) * unit
    fits = shutil.disk_usage(tmp_path).free // on_disk - 1024  # room for the test's own writes
    where = tmp_path / "chunks"
    with pytest.raises(EngineConfigError, match=r"the disk tier needs [\d.,]+ GiB but only"):
        OffloadEngine(TINY, 1, 1, fits + 2048, disk_dir=where)
    assert not where.exists()  # created for the tier, and removed with it
    OffloadEngine(TINY, 1, 1, fits, disk_dir=where).close()
    before = set(Path(tempfile.gettempdir()).glob("kvscope-disk-*"))
    with pytest.raises(EngineConfigError, match="GiB is free at "):
        OffloadEngine(TINY, 1, 1, 2 * shutil.disk_usage(tempfile.gettempdir()).free // BLOCK)
    assert set(Path(tempfile.gettempdir()).glob("kvscope-disk-*")) == before


def test_a_host_engine_copies_on_one_torch_thread():
    """Host copies are memory-bound, and torch's OpenMP threads spin-wait: on a busy 2-core
    host six identical replays of 200 requests reported gpu->cpu copies of 0.009 s to 1.8 s
    with torch's default threads (a tryout's analyze then called 7.66 and 13.3 GB/s
    "measured" for one setup), and steady ones with one. A CPU engine sets one thread: in a
    fresh interpreter started with two (OMP_NUM_THREADS=2, torch's default on 2 cores)."""
    code = ("import torch; before = torch.get_num_threads(); "
            "from kvscope.engine.engine import OffloadEngine; "
            "from kvscope.engine.presets import get_preset; "
            "OffloadEngine(get_preset('tiny'), 8, 8, device='cpu'); "
            "print(before, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="2"), check=True).stdout.split()
    assert out == ["2", "1"]


def test_a_host_copy_is_timed_as_its_threads_work_not_its_waits_for_the_gil():
    """torch lets go of the GIL for each copy; a busy Python thread then takes it, and the
    copying thread waits up to ``sys.getswitchinterval()`` (20 ms here) to get it back. That
    wait is the other thread's time: in ``kvscope demo`` (engine, agent and dashboard in one
    process) it made the copies of the first 2 s read 187 ms of wall time for 15 ms of CPU
    time. The copier reports the copying thread's CPU time: 10 copies of 4 scattered 2 MiB
    rows (one torch copy a row, 40 chances to wait), beside a busy thread, take a few ms of
    CPU each and wait 20 ms at each row whose copy outlasted the busy thread's wake-up, so
    the seconds reported are a small part of the wall time around the calls. (Timed with
    ``perf_counter``, the copier's seconds were that wall time, less the call's overhead.)"""
    import threading
    import time

    from kvscope.engine.tier import BlockPool
    from kvscope.engine.transfers import Copier

    copier = Copier(cuda=False)
    src, dst = (BlockPool(8, 1 << 20, "float16", "cpu") for _ in range(2))
    running, stop = threading.Event(), threading.Event()

    def busy() -> None:
        running.set()
        while not stop.is_set():
            pass

    hog = threading.Thread(target=busy, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.02)
    hog.start()
    running.wait()
    reported, wall = 0.0, 0.0
    try:
        for i in range(10):
            t0 = time.perf_counter()
            seconds, events = copier.copy(src, [i % 8, (i + 3) % 8, (i + 6) % 8, (i + 1) % 8],
                                          dst, [3, 5, 0, 7])
            wall += time.perf_counter() - t0
            reported += seconds
            assert events is None
    finally:
        stop.set()
        hog.join()
        sys.setswitchinterval(interval)
    assert 0 < reported < wall / 4, (reported, wall)
