"""The compiled request bookkeeping against plain-Python models of what it promises.

The assembler keeps each source's recently finished records in an index of its own (open
addressing, see ``assembler._Index``), and the request table indexes its records only when it
is read. Each test drives them with random sequences (hypothesis) and checks every answer
against a model written the obvious way, with an OrderedDict or a list.
"""

from collections import OrderedDict

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvscope import events as ev
from kvscope.agent.assembler import MAX_REUSES, RequestAssembler
from kvscope.agent.requests import RequestRecord, RequestTable

IDS = [f"id{i}" for i in range(7)] + ["", "a" * 200]  # a few ids, so that they are reused


def _recent_model(finishes, capacity):
    """The ids kept and, per id, the finish times of its records kept: an id's newest
    MAX_REUSES records; ids leave whole, the one whose last finish is oldest first."""
    kept, count = OrderedDict(), 0
    for rid, ts in finishes:
        times = kept.pop(rid, [])
        count -= len(times)
        times = (times + [ts])[-MAX_REUSES:]
        kept[rid] = times
        count += len(times)
        while count > capacity:
            count -= len(kept.popitem(last=False)[1])
    return kept


def _check_recent(capacity, ids, every=None):
    """Request r finishes at time i (its i-th finish, TTFT 0, so it was under way at i only):
    the assembler finds r's record under way at i exactly when the model kept that finish
    (checked at the end, and after each ``every`` finishes)."""
    assembler = RequestAssembler(max_recent=capacity)
    finishes = []
    for i, rid in enumerate(ids):
        finishes.append((rid, float(i)))
        assembler.finished("engine", [ev.RequestFinished(ts=float(i), request_id=rid, ttft=0.0,
                                                         prompt_tokens=1)])
        if (every and i % every == 0) or i == len(ids) - 1:
            kept = _recent_model(finishes, capacity)
            for rid_, ts in finishes:
                found = assembler.finished_recently("engine", rid_, ts)
                assert (found is not None) == (ts in kept.get(rid_, ())), (rid_, ts)
                assert found is None or (found.request_id, found.finished) == (rid_, ts)


@settings(max_examples=80, deadline=None)
@given(st.integers(min_value=1, max_value=150),
       st.lists(st.sampled_from(IDS), min_size=1, max_size=400))
@example(100, ["id0"] * 200)  # one id past MAX_REUSES: 64 kept, never counted more
@example(70, ["id0"] * 100 + ["id1"] * 10)  # the count decides when id0 leaves
def test_the_recent_records_are_those_the_model_keeps(capacity, ids):
    """A few ids, reused: the chains of an id's records and the ids' leaving (see
    :func:`_check_recent`)."""
    _check_recent(capacity, ids)


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=40), st.integers(min_value=2, max_value=400),
       st.lists(st.integers(min_value=0, max_value=399), min_size=1, max_size=1500))
@example(5, 400, [i * 7919 % 400 for i in range(1500)])  # 8 slots: clusters wrap the end
@example(12, 50, [i * i % 50 for i in range(1500)])
def test_many_ids_through_a_small_recent_window(capacity, pool, draws):
    """Hundreds of ids through a window of at most 40 records: the index's slots collide, wrap
    around its end, and close the gaps its deletions leave, all the time (see
    :func:`_check_recent`; checked every 97 finishes too)."""
    _check_recent(capacity, [f"r{d % pool}" for d in draws], every=97)


def _record(rid, source, i):
    return RequestRecord(rid, "ab" * 16, source, float(i), finished=float(i))


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=10),
       st.lists(st.tuples(st.sampled_from(IDS[:5]), st.sampled_from(["a", "b"]),
                          st.booleans()), min_size=1, max_size=120))
def test_the_table_answers_as_a_list_of_its_last_records(capacity, steps):
    """Records added one batch after another (a step's boolean: read the table then, so its
    index is built part way); the table holds the last ``capacity`` added and names each
    request's newest among them, in the order they were last added."""
    table, added = RequestTable(capacity), []
    for i, (rid, source, read) in enumerate(steps):
        record = _record(rid, source, i)
        table.add([record])
        added.append(record)
        if read:
            len(table)
    held = added[-capacity:]
    newest = {}
    for record in held:
        newest[(record.source, record.request_id)] = record
    assert len(table) == len(newest)
    for (source, rid), record in newest.items():
        assert table.get(rid, source) is record
    order = [r for r in held if newest[(r.source, r.request_id)] is r]
    assert table.recent(capacity, "arrival", descending=False) == order
    assert table.get("nowhere") is None


def test_what_the_bookkeeping_is_given_wrong_is_an_error_not_a_crash():
    """The compiled parts read events through their fields' offsets and take records by C
    type: another kind of event, None or a negative bound is refused up front."""
    import pytest

    from kvscope.agent.fold import Fold
    from kvscope.agent.requests import under_way

    with pytest.raises(TypeError):
        RequestAssembler().finished("s", [ev.RequestStarted(ts=1.0, request_id="x",
                                                            prompt_tokens=3)])
    with pytest.raises(TypeError):
        RequestTable().add([None])
    with pytest.raises(TypeError):
        under_way(None, 1.0)
    for make in (lambda: RequestTable(-1), lambda: RequestAssembler(max_recent=-1),
                 lambda: RequestAssembler(max_inflight=-1),
                 lambda: Fold(RequestAssembler(), recent=-1)):
        with pytest.raises(ValueError):
            make()


def test_a_record_added_twice_moves_to_the_end_and_counts_once():
    table = RequestTable(3)
    a, b = _record("a", "s", 1), _record("b", "s", 2)
    table.add([a, b])
    table.add([a])
    assert len(table) == 2 and [r.request_id for r in table.recent(3, "finished")] == ["b", "a"]
    table.add([_record("c", "s", 3), _record("d", "s", 4)])  # b leaves; a, added last, stays
    assert table.get("b") is None and table.get("a") is a and len(table) == 3


def test_counts_past_64_bits_stop_at_the_end_never_wrap():
    """A tap sends 1,100 transfers of 2**53 bytes each (the most an event may say): 1,100 x
    2**53 is past 2**63, where the agent's 64-bit counters end. The bytes counter stops at
    2**63 - 1 and a block sampled 1 in 2**20 blocks of 2**53 stands for 2**73 in the residency
    histogram, also stopped there: neither wraps negative (Prometheus would read a counter
    going down as a reset)."""
    from kvscope.agent.pipeline import Pipeline

    pipeline = Pipeline()
    pipeline.ingest("engine", [ev.Transfer(ts=1.0, src="cpu", dst="gpu", blocks=1, bytes=2**53,
                                           duration=0.001) for _ in range(1100)])
    pipeline.ingest("engine", [ev.Eviction(ts=1.0, tier="cpu", blocks=2**53, bytes=1, age=1.0,
                                           hits=0, weight=2**20)])
    snap = pipeline.snapshot()
    assert snap.transfer_bytes == {("cpu", "gpu"): 2**63 - 1}
    assert snap.transfer_blocks == {("cpu", "gpu"): 1100}
    assert snap.block_residency_seconds["cpu"].count == 2**63 - 1
