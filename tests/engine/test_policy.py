"""Pinned blocks in the replacement policies (the engine pins a request's cached prefix until
its turn). With nothing pinned, both policies make libCacheSim's decisions
(test_engine_oracle.py); these cases are worked by hand."""

import pytest

from kvscope.engine.policy import ARCPolicy, LRUPolicy, NoRoom


def _filled(policy, blocks):
    for h in blocks:
        assert policy.make_room(h) is None
        policy.add(h, f"v{h}")
    return policy


def test_lru_passes_over_pinned_blocks_to_the_next_least_recent():
    """LRU [1,2,3] (least recent first), 1 and 2 pinned: inserting 4 evicts 3, the least
    recent unpinned block; the order of the rest stays [1,2,4]."""
    lru = _filled(LRUPolicy(3), [1, 2, 3])
    assert lru.make_room(4, {1, 2}) == (3, "v3")
    lru.add(4, "v4")
    assert lru.order() == [1, 2, 4]


def test_lru_full_of_pinned_blocks_has_no_room_and_keeps_them():
    lru = _filled(LRUPolicy(2), [1, 2])
    with pytest.raises(NoRoom):
        lru.make_room(3, {1, 2, 99})
    assert lru.order() == [1, 2]


def test_arc_passes_over_pinned_blocks_and_ghosts_the_one_it_evicts():
    """ARC of 2, p = 0: T1 [1,2]. Inserting 3 (case IV.A: |T1| + |B1| = c, B1 empty) evicts
    T1's LRU outright, which is 1, pinned, so 2 goes instead: T1 [1,3]. Then 2 again is a
    miss not in the ghost lists (an outright eviction leaves none); with 1 pinned, case IV.A
    with B1 empty again evicts 3: T1 [1,2]."""
    arc = _filled(ARCPolicy(2), [1, 2])
    assert arc.make_room(3, {1}) == (2, "v2")
    arc.add(3, "v3")
    assert (list(arc.t1), list(arc.t2)) == ([1, 3], [])
    assert arc.make_room(2, {1}) == (3, "v3")
    arc.add(2, "v2")
    assert arc.order() == [1, 2]


def test_arc_replace_takes_the_other_list_when_the_chosen_one_is_all_pinned():
    """ARC of 2: 1 and 2 inserted, 1 hit (T2 [1], T1 [2]); 3 inserted: |T1| + |B1| = 1 < c,
    so REPLACE with p = 0 takes T1's LRU, 2, into B1: T1 [3], T2 [1]. Now 2 is a B1 ghost
    hit: p becomes 1, and REPLACE (|T1| = 1 = p, not from B2) takes T2's LRU, 1; with 1
    pinned, T1's 3 goes instead, into B1. 2 enters T2: T2 [1,2]."""
    arc = _filled(ARCPolicy(2), [1, 2])
    arc.hit(1)
    assert arc.make_room(3) == (2, "v2")
    arc.add(3, "v3")
    assert arc.make_room(2, {1}) == (3, "v3")
    arc.add(2, "v2")
    assert (list(arc.t1), list(arc.t2), list(arc.b1), arc.p) == ([], [1, 2], [3], 1.0)


def test_arc_full_of_pinned_blocks_has_no_room_and_changes_nothing():
    """A ghost hit moves p and drops the ghost before it evicts: with every block pinned it
    must do neither."""
    arc = _filled(ARCPolicy(2), [1, 2])
    arc.hit(1)
    arc.make_room(3)
    arc.add(3, "v3")  # T1 [3], T2 [1], B1 [2]
    before = (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2), arc.p)
    with pytest.raises(NoRoom):
        arc.make_room(2, {1, 3})
    assert (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2), arc.p) == before


def test_a_pinned_block_passed_over_moves_to_the_most_recent_end():
    """LRU [1,2,3], 1 pinned: inserting 4 passes over 1 (to the recent end: [2,3,1]) and
    evicts 2: [3,1,4]. The next insert, 1 still pinned, evicts 3 without passing 1 again:
    a long prompt's pinned blocks were walked past at every insert (quadratic)."""
    lru = _filled(LRUPolicy(3), [1, 2, 3])
    assert lru.make_room(4, {1}) == (2, "v2")
    lru.add(4, "v4")
    assert lru.order() == [3, 1, 4]
    assert lru.make_room(5, {1}) == (3, "v3")


def test_arc_takes_the_other_lists_lru_when_the_chosen_ones_is_pinned():
    """ARC of 3: 1, 2, 3 inserted and 3 hit: T1 [1,2], T2 [3]. Inserting 4 (case IV.B, p =
    0) would REPLACE from T1, whose LRU 1 is pinned, while T2's LRU 3 is not: 3 goes, into
    B2 (walking T1 for its next unpinned block is what made long prompts quadratic)."""
    arc = _filled(ARCPolicy(3), [1, 2, 3])
    arc.hit(3)
    assert arc.make_room(4, {1}) == (3, "v3")
    arc.add(4, "v4")
    assert (list(arc.t1), list(arc.t2), list(arc.b2)) == ([1, 2, 4], [], [3])
