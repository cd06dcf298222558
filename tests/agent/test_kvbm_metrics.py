"""The Dynamo KVBM metrics source on KVBM's exposition as its source code writes it
(``tests/data/dynamo-kvbm-3c24940.prom``, recorded by hand from Dynamo's
``lib/llm/src/block_manager/metrics_kvbm.rs`` at commit 3c24940c: this machine cannot run
Dynamo), served over real HTTP on loopback (``tests/engine_servers.py``) and scraped through
the source into the agent's pipeline."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources import REGISTRY, build_sources
from kvscope.agent.sources.kvbm_metrics import KvbmMapper, KvbmMetricsSource
from kvscope.agent.sources.scrape import parse
from tests.engine_servers import exposition_server

RECORDED = (Path(__file__).resolve().parent.parent / "data" / "dynamo-kvbm-3c24940.prom"
            ).read_text()
# what KVBM prints when it starts: every series registered at 0
AT_START = re.sub(r"^(kvbm_\w+) \S+$", r"\1 0", RECORDED, flags=re.M)
BLOCK = 65536  # bytes per KV block, as an operator would configure it

# Hand calculation from the recorded values (every one 0 at start), block_bytes 65536:
#   gpu->cpu    d2h 120 blocks x 65536 = 7,864,320 B
#   cpu->disk   offload h2d 40 x 65536 = 2,621,440 B
#   gpu->disk   offload d2d 8 x 65536 = 524,288 B
#   gpu->remote d2o 6 blocks; bytes from kvbm_offload_bytes_object: 393,216 B (not 6 x 65536)
#   cpu->gpu    onboard h2d 30 x 65536 = 1,966,080 B
#   disk->gpu   onboard d2d 5 x 65536 = 327,680 B
#   remote->gpu o2d 2 blocks; kvbm_onboard_bytes_object: 262,144 B (not 2 x 65536)
EXPECTED = {("gpu", "cpu"): (120, 7_864_320), ("cpu", "disk"): (40, 2_621_440),
            ("gpu", "disk"): (8, 524_288), ("gpu", "remote"): (6, 393_216),
            ("cpu", "gpu"): (30, 1_966_080), ("disk", "gpu"): (5, 327_680),
            ("remote", "gpu"): (2, 262_144)}


def _moved(events):
    assert all(isinstance(e, ev.Transfer) and not e.timed and e.ok for e in events)
    return {(e.src, e.dst): (e.blocks, e.bytes) for e in events}


def test_each_block_counter_is_one_untimed_transfer_between_its_tiers():
    """Start (all 0) is the baselines: nothing. The recorded scrape: one Transfer per counter,
    as in the hand calculation above; the hit-rate gauges and matched tokens make nothing."""
    mapper = KvbmMapper(block_bytes=BLOCK)
    assert mapper.map(parse(AT_START), 1.0) == []
    assert _moved(mapper.map(parse(RECORDED), 2.0)) == EXPECTED
    # nothing moved since: nothing (the gauges alone never make an event)
    assert mapper.map(parse(RECORDED.replace("rate 0.25", "rate 0.9")), 3.0) == []


def test_what_kvbm_does_not_report_is_absent_never_zero():
    """An older KVBM, without the object-storage counters, and no block size configured: no
    remote transfers at all, and the bytes of the others 0 (unknown; the blocks still count).
    A scrape with the d2h counter alone counts only gpu->cpu."""
    older = "\n".join(line for line in RECORDED.splitlines()
                      if "object" not in line and "d2o" not in line and "o2d" not in line)
    mapper = KvbmMapper()
    mapper.map(parse(re.sub(r"^(kvbm_\w+) \S+$", r"\1 0", older, flags=re.M)), 1.0)
    moved = _moved(mapper.map(parse(older), 2.0))
    assert set(moved) == set(EXPECTED) - {("gpu", "remote"), ("remote", "gpu")}
    assert moved[("gpu", "cpu")] == (120, 0)
    alone = KvbmMapper(block_bytes=BLOCK)
    alone.map(parse("kvbm_offload_blocks_d2h 10\n"), 1.0)
    assert _moved(alone.map(parse("kvbm_offload_blocks_d2h 15\n"), 2.0)) == {
        ("gpu", "cpu"): (5, 5 * BLOCK)}


def test_a_restarted_kvbm_counts_from_its_new_values():
    """d2h 120, then KVBM restarts and has offloaded 7 blocks by the next scrape: a counter that
    went down was reset, so 7 blocks (not -113, not 0)."""
    mapper = KvbmMapper(block_bytes=BLOCK)
    mapper.map(parse(RECORDED), 1.0)
    restarted = AT_START.replace("kvbm_offload_blocks_d2h 0", "kvbm_offload_blocks_d2h 7")
    assert _moved(mapper.map(parse(restarted), 2.0)) == {("gpu", "cpu"): (7, 7 * BLOCK)}


def test_a_sample_no_counter_holds_is_no_baseline():
    """d2h 220, then 1e300 (past 2^53: no count; its event is out of bounds, and the agent
    drops it as invalid), then -5 (no count; no event: nothing moved), then 300: 80 blocks
    (300 - 220). The 1e300 was the baseline, so 300 read as a reset and counted 300 (and -5
    then 2.5 counted 7)."""
    mapper = KvbmMapper(block_bytes=BLOCK)
    mapper.map(parse("kvbm_offload_blocks_d2h 220\n"), 1.0)
    moved = [mapper.map(parse(f"kvbm_offload_blocks_d2h {v}\n"), t)
             for t, v in ((2.0, "1e300"), (3.0, "-5"), (4.0, "300"))]
    [absurd] = moved[0]
    with pytest.raises(ev.SchemaError):
        ev.validate(absurd)
    assert moved[1] == []
    assert _moved(moved[2]) == {("gpu", "cpu"): (80, 80 * BLOCK)}


def test_kvbm_served_over_http_reaches_the_pipeline():
    """The recorded exposition on a loopback HTTP server, scraped by the source built from the
    agent's settings (``[kvbm_metrics]``): the first scrape at KVBM's start, the second after
    the traffic; the pipeline's transfer counters hold the hand calculation and the source is
    up. Then the endpoint answers with another server's metrics: the scrape fails and the
    source is down, its counters unchanged."""
    with exposition_server(AT_START) as kvbm:
        settings = AgentSettings(kvbm_metrics={"enabled": True, "url": kvbm.url,
                                               "block_bytes": BLOCK})
        pipeline = Pipeline()
        source = build_sources({name: getattr(settings, name) for name in REGISTRY},
                               pipeline, skip=("ingest",))["kvbm_metrics"]
        assert isinstance(source, KvbmMetricsSource)
        assert source.scrape_once()
        kvbm.body = RECORDED
        assert source.scrape_once()
        snap = pipeline.snapshot()
        assert {k: (snap.transfer_blocks[k], snap.transfer_bytes[k]) for k in EXPECTED} == EXPECTED
        assert snap.source_up["kvbm_metrics"] is True
        kvbm.body = "vllm:num_requests_running 1\n"
        assert not source.scrape_once()
        assert pipeline.snapshot().source_up["kvbm_metrics"] is False
        assert pipeline.snapshot().transfer_blocks == snap.transfer_blocks


def test_a_scrape_that_fails_says_why_in_words_and_one_that_answers_again_says_so(caplog):
    """A url without KVBM's path answers 404: logged as the status and what to check (it was
    httpx's own sentence, ending in a link to MDN); once KVBM answers again, one line says so
    (the log's last word about the source was "unavailable"); its series with values that are
    no numbers are said to be unreadable, not another server's ("is the url KVBM's?")."""
    with exposition_server(AT_START) as kvbm:
        source = KvbmMetricsSource(Pipeline(), kvbm.url.replace("/metrics", "/metricz"))
        assert not source.scrape_once() and not source.scrape_once()
        source.url = kvbm.url
        assert source.scrape_once()
        # KVBM's series, but with values that are no numbers: not "is the url KVBM's?"
        kvbm.body = "kvbm_offload_blocks_d2h abc\n"
        assert not source.scrape_once()
    lines = [r.getMessage() for r in caplog.records if "Dynamo KVBM metrics" in r.getMessage()]
    assert lines == [f"Dynamo KVBM metrics at {kvbm.url.replace('/metrics', '/metricz')}: "
                     "answered HTTP 404 Not Found; is the url Dynamo KVBM's metrics endpoint?",
                     f"Dynamo KVBM metrics at {kvbm.url}: answering again, after 2 failed "
                     "scrapes",
                     f"Dynamo KVBM metrics at {kvbm.url}: its kvbm_ series hold no finite "
                     "number (unreadable values)"], lines


def test_object_bytes_of_a_scrape_whose_blocks_did_not_rise_go_with_the_next_transfer():
    """KVBM adds an offload's d2o blocks, then its bytes: a scrape between the two reads d2o
    0 -> 6 with bytes 0 -> 0 (6 blocks, 0 bytes), the next d2o 6 with bytes 393,216 (no block
    rose), the next d2o 10 with bytes 655,360 (4 blocks, 262,144 B): 10 blocks, 655,360 B in
    all, as KVBM's counters say (10 x 65536), the second transfer's bytes 393,216 + 262,144.
    The 393,216 B of the scrape without blocks were dropped."""
    mapper = KvbmMapper(block_bytes=BLOCK)
    body = "kvbm_offload_blocks_d2o {}\nkvbm_offload_bytes_object {}\n"
    mapper.map(parse(body.format(0, 0)), 1.0)
    moved = [_moved(mapper.map(parse(body.format(blocks, nbytes)), t))
             for t, blocks, nbytes in ((2.0, 6, 0), (3.0, 6, 393_216), (4.0, 10, 655_360))]
    assert moved == [{("gpu", "remote"): (6, 0)}, {}, {("gpu", "remote"): (4, 655_360)}]
