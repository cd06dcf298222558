"""The agent's per-source bounds on requests it holds beside the table: open requests
(``requests_open_per_source``) and recent finished ones (``requests_recent_per_source``).
From the config to the assembler, what a full bound drops and how it is counted, and what one
open request costs (the figures docs/agent.md, "Memory", gives)."""

import gc
import tracemalloc

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope import events as ev
from kvscope.agent.config import ConfigError, load_settings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.requests import MAX_TRANSFERS
from kvscope.service.agent import Agent

NO_COLLECTORS = {"host": {"enabled": False}, "gpu": {"enabled": False},
                 "numa": {"enabled": False}}


def _start(rid: str, ts: float = 1.0) -> ev.RequestStarted:
    return ev.RequestStarted(ts=ts, request_id=rid, prompt_tokens=4, trace_id="ab" * 16)


def _finish(rid: str, ts: float = 2.0) -> ev.RequestFinished:
    return ev.RequestFinished(ts=ts, request_id=rid, ttft=0.5, prompt_tokens=4)


def _dropped_on_metrics(agent: Agent) -> dict[tuple[str, str], float]:
    """kvscope_events_dropped_total as /metrics serves it: {(source, reason): value}."""
    text = agent.exposition.render()[0].decode()
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "kvscope_events_dropped")
    return {(s.labels["source"], s.labels["reason"]): s.value for s in family.samples
            if s.name == "kvscope_events_dropped_total"}


def test_the_bounds_in_the_config_reach_the_assembler_and_what_they_drop_is_on_metrics(tmp_path):
    """requests_open_per_source = 5 in the TOML file: 8 requests started and not finished on
    "engine" abandon exactly the 3 oldest, counted on /metrics as dropped with reason
    abandoned under "engine"; the 5 newest are still open (their finish joins the start's
    trace id), the abandoned ones are not (a finish opens a new record, with a trace id of
    its own); "quiet",
    whose 2 open requests were there first, loses none and counts no drop."""
    path = tmp_path / "agent.toml"
    path.write_text("requests_open_per_source = 5\nrequests_recent_per_source = 2\n")
    settings = load_settings(path, collectors=NO_COLLECTORS)
    agent = Agent(settings, with_ingest=False)
    pipeline = agent.pipeline
    pipeline.ingest("quiet", [_start("q0"), _start("q1")])
    pipeline.ingest("engine", [_start(f"r{i}") for i in range(8)])
    assert _dropped_on_metrics(agent)[("engine", "abandoned")] == 3
    assert _dropped_on_metrics(agent).get(("quiet", "abandoned"), 0) == 0

    pipeline.ingest("quiet", [_finish("q0"), _finish("q1")])
    pipeline.ingest("engine", [_finish(f"r{i}") for i in range(8)])
    assert [pipeline.requests.get(f"q{i}", "quiet").trace_id for i in range(2)] == ["ab" * 16] * 2
    assert [pipeline.requests.get(f"r{i}", "engine").trace_id == "ab" * 16 for i in range(8)] == [
        False] * 3 + [True] * 5
    assert _dropped_on_metrics(agent)[("engine", "abandoned")] == 3  # finishing drops none

    # requests_recent_per_source = 2: of the 8 finished, only the last 2 are kept for late
    # parts to join
    assembler = pipeline._assembler
    assert [assembler.finished_recently("engine", f"r{i}", 1.5) is not None
            for i in range(8)] == [False] * 6 + [True] * 2


def test_the_default_bounds_are_the_assemblers_own():
    """Without the keys: 10,000 open and 10,000 recent per source, as before they were settings
    (a Pipeline built without them has the same)."""
    settings = load_settings(None)
    assert settings.requests_open_per_source == 10_000 == settings.requests_recent_per_source
    pipeline = Pipeline()
    pipeline.ingest("engine", [_start(f"r{i}") for i in range(10_001)])
    assert pipeline.snapshot().events_dropped == {("engine", "abandoned"): 1}


@pytest.mark.parametrize("key", ["requests_open_per_source", "requests_recent_per_source"])
@pytest.mark.parametrize("value,needle", [
    ("0", "greater than 0"),  # no request could ever be assembled (or joined late)
    ("-1", "greater than 0"),
    # the recent index is allocated whole at a source's first event: 10**12 slots would not fit
    ("1000001", "less than or equal to 1000000"),
    ("true", "is true or false; give a number"),
    ('"many"', "'many' is text; give a number, without quotes"),
])
def test_a_bad_bound_stops_the_agent_naming_the_key(tmp_path, key, value, needle):
    path = tmp_path / "agent.toml"
    path.write_text(f"{key} = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(info.value).startswith(f"config {path}: {key}: ")
    assert needle in str(info.value)


def _bytes_per_open_request(n: int, transfers: int, id_length: int) -> float:
    """Python heap bytes (tracemalloc) that ``n`` requests started and never finished hold in a
    Pipeline, per request: each opened by a start with a W3C trace id, a lookup naming three
    token sources, and ``transfers`` one-block transfers, under an id of ``id_length``
    characters. The events themselves are freed once folded; a warm-up source first, so that
    what every source shares (interned tier names, the fold's state) is not counted."""
    pipeline = Pipeline(open_per_source=n)

    def events(i: int) -> list:
        rid = f"r{i}".ljust(id_length, "x")
        return [_start(rid),
                ev.Lookup(ts=1.0, request_id=rid, blocks=256,
                          tokens={"gpu": 1024, "cpu": 1024, "recompute": 2048},
                          block_hits={"gpu": 64, "cpu": 64}),
                *(ev.Transfer(ts=1.0 + j, src="cpu", dst="gpu", blocks=1, bytes=1 << 20,
                              duration=0.001, request_id=rid) for j in range(transfers))]

    pipeline.ingest("warm", events(-1))
    # and the source's own tables with their preallocated recent index
    pipeline.ingest("engine", [_start("first"), _finish("first")])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            pipeline.ingest("engine", events(i))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert pipeline.snapshot().events_dropped == {}  # all n still open
    return grown / n


@pytest.mark.parametrize("transfers,id_length,documented", [
    (1, 36, 450),                 # a UUID's id, one transfer
    (MAX_TRANSFERS, 36, 4_100),   # the most transfers a record keeps
    (MAX_TRANSFERS, 256, 4_300),  # and the longest id a tap sends: the worst case
])
def test_an_open_request_costs_what_the_docs_say(transfers, id_length, documented):
    """docs/agent.md sizes requests_open_per_source from these: each figure is at or above what
    10,000 open requests (the default bound: the dict's share per request depends on its fill)
    measure per request, so a record that grew fails this, and at most 10 % above it, so
    figures left behind by a record that shrank fail too."""
    measured = _bytes_per_open_request(10_000, transfers, id_length)
    assert 0.9 * documented <= measured <= documented, measured
