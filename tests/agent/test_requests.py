"""The request table's pages (issue 26, item 9): the order of a full sort, without one."""

import math
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.agent.requests import SORT_KEYS, RequestRecord, RequestTable

# few values, so that ties and None (sorted last, either way) are common
TIMES = st.one_of(st.none(), st.sampled_from([0.0, 1.0, 2.5]), st.floats(0.0, 10.0))
RECORDS = st.lists(st.tuples(
    st.sampled_from(["r0", "r1", "r2", "r3", "r4", "r5"]), st.sampled_from(["a", "b"]),
    TIMES, TIMES, st.integers(0, 3), st.sampled_from([0.0, 0.5]),
    st.sampled_from(["new", "again", "read"])), min_size=0, max_size=60)


def _sorted_page(held, limit, sort, descending, min_ttft, source):
    """(page, total) by a full stable sort of the live records of ``held`` (the table's places,
    oldest first): each request's newest record, once, at its last place."""
    newest = {(r.source, r.request_id): r for r in held}
    live, seen = [], set()
    for record in reversed(held):
        if newest[(record.source, record.request_id)] is record and id(record) not in seen:
            seen.add(id(record))
            live.append(record)
    live.reverse()
    chosen = [r for r in live if (source is None or r.source == source)
              and (min_ttft is None or (r.ttft or 0.0) >= min_ttft)]
    unknown = -math.inf if descending else math.inf  # "not measured" last, either way
    chosen.sort(key=lambda r: unknown if getattr(r, sort) is None else getattr(r, sort),
                reverse=descending)
    return chosen[:limit], len(chosen)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 30), RECORDS)
def test_a_page_is_what_a_full_sort_then_a_cut_gives(capacity, steps):
    """Records out of finish order, ids reused, one record added twice, the index built part way
    (``read``): every key, order, filter and limit gives what a stable sort of all of them
    does, ties in the order added, and counts what the filters select."""
    table, held = RequestTable(capacity), []
    for i, (rid, source, finished, ttft, tokens, wait, how) in enumerate(steps):
        if how == "again" and held:
            record = held[-1 - i % len(held)]  # an older record moves to the end
        else:
            record = RequestRecord(rid, "", source, arrival=float(i % 4), prompt_tokens=tokens,
                                   ttft=ttft, promotion_wait=wait, finished=finished)
        table.add([record])
        held.append(record)
        if how == "read":
            len(table)
    held = held[-capacity:]
    for sort in SORT_KEYS:
        for descending in (True, False):
            for limit in (0, 1, 3, capacity + 1):
                for min_ttft, source in ((None, None), (None, "a"), (None, "z"), (1.0, None),
                                         (0.0, "b")):
                    records, total = table.page(limit, sort, descending, min_ttft, source)
                    expected, expected_total = _sorted_page(held, limit, sort, descending,
                                                            min_ttft, source)
                    assert ([id(r) for r in records], total) == (
                        [id(r) for r in expected], expected_total), (sort, descending, limit)


def test_the_newest_page_reads_about_limit_records_not_the_table():
    """The default order's page costs memory in proportion to ``limit``, not to the table: a
    full sort of 50,000 records copies the table's list (400 kB) and its keys (1.6 MB)."""
    table = RequestTable(50_000)
    table.add([RequestRecord(f"r{i}", "", "ab"[i % 2], float(i), finished=i + 1.0)
               for i in range(50_000)])
    assert len(table) == 50_000  # the index, built on the first read, is no page's cost
    tracemalloc.start()
    try:
        for source in (None, "a"):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            records = table.recent(10, "finished", True, None, source)
            assert tracemalloc.get_traced_memory()[1] - before < 32_000, source
            newest = [i + 1.0 for i in range(49_999, -1, -1) if source in (None, "ab"[i % 2])]
            assert [r.finished for r in records] == newest[:10]
    finally:
        tracemalloc.stop()


def test_a_page_is_refused_an_unknown_key_or_a_negative_limit():
    table = RequestTable()
    with pytest.raises(ValueError, match="unknown sort key"):
        table.page(10, "id")
    with pytest.raises(ValueError, match="0 records or more"):
        table.recent(-1)
    assert table.page(10) == ([], 0)
