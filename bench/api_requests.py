"""``/api/v1/requests`` at a full table (issue 26, item 9): the page of the request table the
API asks for, against the method before it, a full sort of every record then a cut, side by
side in one run on the same table.

The table holds 100,000 finished requests of two engines, in the order they finished give or
take the 5 ms one engine's records reach the agent late. Each line times one query both ways
(best of ``--repeat`` runs of ``--calls`` calls) and checks that both give the same records.

Run: python bench/api_requests.py [--records N] [--calls C] [--repeat R]
"""

from __future__ import annotations

import argparse
import random
import time

from kvscope.agent.requests import RequestRecord, RequestTable


def filled(n: int) -> tuple[RequestTable, list[RequestRecord]]:
    """A table of ``n`` requests, and its records in the order added."""
    rng = random.Random(1)
    records = []
    for i in range(n):
        source = ("engine-a", "engine-b")[i % 2]
        finished = 1_700_000_000.0 + i * 0.001 - (0.005 if source == "engine-b" else 0.0)
        ttft = rng.lognormvariate(-2.0, 1.0)
        records.append(RequestRecord(f"req-{i}", "", source, finished - ttft - 0.5,
                                     prompt_tokens=rng.randrange(64, 8192), ttft=ttft,
                                     promotion_wait=rng.random() * 0.01, finished=finished))
    table = RequestTable(n)
    table.add(records)
    len(table)  # the index, built on the first read (as for the first call to the API)
    return table, records


def full_sort(table: RequestTable, live: list[RequestRecord], limit: int, sort: str,
              descending: bool, min_ttft: float | None, source: str | None) -> list:
    """The method before: the table copies out its live records (``page(0)`` in ascending
    order does that, and counts them in one pass of compiled code, about 1 ms), then all of
    them are filtered, sorted and cut."""
    table.page(0, "finished", False)
    records = list(live)
    if source is not None:
        records = [r for r in records if r.source == source]
    if min_ttft is not None:
        records = [r for r in records if (r.ttft or 0.0) >= min_ttft]
    records.sort(key=lambda r: getattr(r, sort) or 0.0, reverse=descending)
    return records[:limit]


def best(fn, calls: int, repeat: int) -> float:
    """Seconds per call, best of ``repeat`` runs of ``calls``."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return min(runs)


QUERIES = [  # (what, limit, sort, descending, min_ttft, source)
    ("default order (finished, desc)", 100, "finished", True, None, None),
    ("default order, dashboard's 500 rows", 500, "finished", True, None, None),
    ("default order, one engine's", 100, "finished", True, None, "engine-b"),
    ("default order, min_ttft=0.5", 100, "finished", True, 0.5, None),
    ("ttft, desc", 100, "ttft", True, None, None),
    ("arrival, desc", 100, "arrival", True, None, None),
    ("arrival, desc, 1000 rows", 1000, "arrival", True, None, None),
    ("prompt_tokens, asc", 100, "prompt_tokens", False, None, None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    table, live = filled(args.records)
    print(f"{args.records:,} records; ms per call, best of {args.repeat} x {args.calls} calls")
    print(f"{'query':40} {'full sort':>10} {'page':>10} {'ratio':>8}")
    for what, limit, sort, descending, min_ttft, source in QUERIES:
        query = (limit, sort, descending, min_ttft, source)
        page, _total = table.page(*query)
        assert page == full_sort(table, live, *query), what
        old = best(lambda: full_sort(table, live, *query), args.calls, args.repeat)
        new = best(lambda: table.page(*query), args.calls, args.repeat)
        print(f"{what:40} {old * 1e3:10.3f} {new * 1e3:10.3f} {old / new:7.1f}x")


if __name__ == "__main__":
    main()
