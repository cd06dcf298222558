"""The compiled assembler's matching rules against their plain-Python reference
(kvscope/agent/join_rules.py): on random histories of one reused request id, the record a late
report or a late transfer joins is the one the reference picks."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvscope import events as ev
from kvscope.agent import join_rules
from kvscope.agent.assembler import RequestAssembler
from kvscope.agent.pipeline import Pipeline


@dataclass(frozen=True)
class _Done:
    arrival: float
    finished: float


# times on a grid near the tolerances (1 ms arrival, 10 ms finish), so that edges are hit
TIMES = st.integers(min_value=0, max_value=400).map(lambda n: 1000.0 + n * 0.005)
DURATIONS = st.integers(min_value=0, max_value=40).map(lambda n: n * 0.005)
HISTORY = st.lists(st.tuples(TIMES, DURATIONS), min_size=0, max_size=8)


def _finish(arrival: float, duration: float) -> ev.RequestFinished:
    """A finish whose arrival (finish less TTFT, as the assembler dates a request without its
    start) is ``arrival``."""
    return ev.RequestFinished(ts=arrival + duration, request_id="r", ttft=duration,
                              prompt_tokens=1)


def _records(history) -> list[_Done]:
    """The history's records, newest (last finished) first, dated as the assembler dates them."""
    return [_Done(max(0.0, f.ts - f.ttft), f.ts) for f in map(lambda h: _finish(*h), history)][::-1]


@settings(max_examples=300, deadline=None)
@given(HISTORY, TIMES, st.one_of(st.none(), DURATIONS))
@example([(1000.0, 0.1), (1000.1, 0.1)], 1000.1, None)  # a reuse starting as one finishes
@example([(1000.0, 0.1), (1000.05, 0.2)], 999.995, 0.3)  # no one under way: nearest end
# two within the span, finishing 1/128 s either side of its end: the older wins the tie
@example([(1000.015625, 0.2265625), (1000.015625, 0.2421875)], 1000.0, 0.25)
def test_a_late_report_joins_the_record_the_reference_picks(history, ts, span):
    assembler = RequestAssembler()
    assembler.finished("engine", [_finish(*h) for h in history])
    until = None if span is None else ts + span
    got = assembler.finished_recently("engine", "r", ts, until=until)
    want = join_rules.report_target(_records(history), ts, until)
    assert (None if got is None else (got.arrival, got.finished)) == (
        None if want is None else (want.arrival, want.finished))


def test_the_reference_can_tell_the_cases_apart():
    """By hand: records [1000, 1000.1] and [1000.1, 1000.2] (newest first: the second).
    At 1000.05 only the first was under way; at 1000.1 both, and the newest wins; a span
    1000.095-1000.25 starts after the first arrived and before the second did (within its
    tolerance), so the second, which finishes nearest the span's end."""
    first, second = _Done(1000.0, 1000.1), _Done(1000.1, 1000.2)
    records = [second, first]
    assert join_rules.report_target(records, 1000.05) is first
    assert join_rules.report_target(records, 1000.1) is second
    assert join_rules.report_target(records, 999.9) is None
    assert join_rules.report_target(records, 999.9, until=1000.25) is second
    assert join_rules.transfer_target(None, records, 1000.05) is first
    assert join_rules.transfer_target(None, records, 1001.0) is second  # after both: newest
    assert join_rules.transfer_target(None, [], 1000.0) is None  # opens a new record


@settings(max_examples=150, deadline=None)
@given(HISTORY, st.one_of(st.none(), TIMES), TIMES)
@example([(1000.0, 0.1)], 1000.5, 1000.05)  # in flight, transfer during the finished one
@example([(1000.0, 0.1)], 1000.5, 1000.6)  # in flight, after it arrived
@example([(1000.0, 0.1)], None, 1002.0)  # none in flight, none under way: the newest
def test_a_late_transfer_joins_the_record_the_reference_picks(history, in_flight, ts):
    """Finished records of id r, maybe one more in flight (arrived at ``in_flight``), then a
    transfer of r at ``ts``; r is finished last, far later (the one in flight, or the one the
    transfer opened, dated by it), so that every record is handed out: the transfer is on the
    record the reference picks."""
    pipeline = Pipeline()
    finished = {}  # every record handed out, by identity (the table keeps an id's newest)
    pipeline.subscribe(lambda record: finished.setdefault(id(record), record), early=True)
    events = [e for arrival, duration in history
              for e in (ev.RequestStarted(ts=arrival, request_id="r", prompt_tokens=1),
                        ev.RequestFinished(ts=arrival + duration, request_id="r", ttft=duration,
                                           prompt_tokens=1))]
    if in_flight is not None:
        events.append(ev.RequestStarted(ts=in_flight, request_id="r", prompt_tokens=1))
    pipeline.ingest("engine", events)
    pipeline.ingest("engine", [ev.Transfer(ts=ts, src="cpu", dst="gpu", blocks=1, bytes=1,
                                           duration=0.001, request_id="r")])
    # finishes the one in flight, or the one the transfer opened (or makes one more)
    pipeline.ingest("engine", [ev.RequestFinished(ts=5000.0, request_id="r", ttft=0.001,
                                                  prompt_tokens=1)])
    done = [_Done(a, a + d) for a, d in history][::-1]
    flying = _Done(in_flight, 5000.0) if in_flight is not None else None
    want = join_rules.transfer_target(flying, done, ts)
    records = list(finished.values())
    with_transfer = [(r.arrival, r.finished) for r in records if r.transfers]
    want = (ts, 5000.0) if want is None else (want.arrival, want.finished)  # None: opened one
    assert with_transfer == [want]
