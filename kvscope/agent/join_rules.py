"""Which record a late part of a request joins: the matching rules of the compiled assembler
(``assembler.pyx``, ``requests.pyx``), written plainly as the reference the tests hold the
compiled code to (``tests/agent/test_join_rules.py``).

A late part is a report of a request another source saw whole (vLLM's span: its start ``ts``
and end ``until``), or a worker's transfer at ``ts``. A client may reuse a request id, so one
id may name several finished records; ``records`` here are one id's finished records, newest
first, each with ``arrival`` and ``finished`` Unix seconds. The state machine around these rules
(in flight, waiting, settled) is :mod:`kvscope.agent.settling`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvscope.agent.requests import ARRIVAL_TOLERANCE, FINISH_TOLERANCE


class Timed(Protocol):
    arrival: float
    finished: float


R = TypeVar("R", bound=Timed)


def under_way(record: Timed, ts: float) -> bool:
    """The request ran at ``ts``: from its arrival (less :data:`ARRIVAL_TOLERANCE`, a
    clock's rounding) to its finish."""
    return record.arrival - ARRIVAL_TOLERANCE <= ts <= record.finished


def within(record: Timed, start: float, end: float) -> bool:
    """The request ran within a report's span ``start``-``end``, give or take
    :data:`FINISH_TOLERANCE` (a record whose start event went missing dates its arrival from
    its finish, so it may begin after the span's start)."""
    return start - FINISH_TOLERANCE <= record.arrival and record.finished <= end + FINISH_TOLERANCE


def report_target(records: Sequence[R], ts: float, until: float | None = None) -> R | None:
    """The record a report of the span ``ts``-``until`` joins: the newest one under way at
    ``ts``; else, with ``until``, of those that ran within the span the one finishing nearest
    its end (a reused id's next request, arriving as this one finished, finishes after it), the
    older of two as near; else None (another request of a reused id: a new one)."""
    for record in records:
        if under_way(record, ts):
            return record
    if until is None:
        return None
    nearest = None
    for record in records:
        if within(record, ts, until) and (
                nearest is None or abs(record.finished - until) <= abs(nearest.finished - until)):
            nearest = record
    return nearest


def transfer_target(in_flight: R | None, records: Sequence[R], ts: float) -> R | None:
    """The record a transfer at ``ts`` joins: the request in flight of its id, unless the
    transfer began before that request arrived; then (or with none in flight) the finished one
    under way at ``ts``; else the one in flight; else the newest finished; None when the id has
    no record at all (the transfer opens one)."""
    if in_flight is not None and ts >= in_flight.arrival:
        return in_flight
    earlier = report_target(records, ts)
    if earlier is not None:
        return earlier
    if in_flight is not None:
        return in_flight
    return records[0] if records else None
