"""The waiting state of a joined source's finished records (kvscope/agent/settling.py), on a
clock the test moves."""

from __future__ import annotations

from kvscope.agent import settling
from kvscope.agent.requests import RequestRecord
from kvscope.agent.settling import Settling


def _records(n, source="vllm"):
    return [RequestRecord(f"r{i}", f"{i + 1:032x}", source, 1000.0 + i) for i in range(n)]


def test_a_joined_sources_records_wait_their_window_and_others_pass():
    """vllm joined with 6 s: its two records wait; at 5.9 s none is due, at 6 s both, in
    order. The engine's records (not joined) are ready at once."""
    now = [100.0]
    s = Settling(join_window=1.0, clock=lambda: now[0])
    s.join("vllm", 6.0)
    held = _records(2)
    assert s.hold("vllm", held) == [] and len(s) == 2 and s.ids == set(map(id, held))
    engine = _records(1, "engine")
    assert s.hold("engine", engine) is engine
    now[0] = 105.9
    assert s.due() == []
    now[0] = 106.0
    assert s.due() == held and len(s) == 0 and s.ids == set()


def test_a_window_only_grows_and_a_scope_gets_the_default():
    s = Settling(join_window=1.0)
    s.join("vllm", 6.0)
    s.join("vllm", 2.0)
    s.join("worker-scope")
    assert s.joined == {"vllm": 6.0, "worker-scope": 1.0}


def test_everything_flushes_and_the_bounds_hold(monkeypatch):
    """Flushing gives every waiting record; past MAX_SETTLING (here 3) the oldest go early;
    past MAX_JOINED (here 2) a new source is not joined."""
    monkeypatch.setattr(settling, "MAX_SETTLING", 3)
    monkeypatch.setattr(settling, "MAX_JOINED", 2)
    s = Settling(clock=lambda: 0.0)
    for name in ("a", "b", "c"):
        s.join(name, 10.0)
    assert set(s.joined) == {"a", "b"}
    records = _records(5, "a")
    s.hold("a", records)
    assert s.due() == records[:2]  # 5 waiting, 3 at most
    assert s.due(everything=True) == records[2:]
