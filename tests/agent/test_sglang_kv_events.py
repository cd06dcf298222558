"""The KV events source with ``engine = "sglang"``: SGLang 0.5.23's own KV events, made by its
``KVCacheEventRecorder`` and sent by its ``ZmqEventPublisher`` (tests/sglang_driver.py, in
SGLang's cached environment) over real ZMQ sockets, one publisher per data-parallel rank on the
endpoint's port plus the rank, replayed by its own ROUTER; the config that selects it; and the
agent with it beside the SGLang metrics source, read from the agent's own exposition.

Why not an SGLang server: SGLang 0.5.23 does not run on this machine's CPU (tried with
``python -m sglang.launch_server --device cpu --attention-backend torch_native --load-format
dummy`` on a tiny Llama, sglang installed ``--no-deps`` over the CPU torch 2.13.0). Its wheel
pins torch 2.14.1 and CUDA packages (flashinfer cu13, sglang-kernel); its CPU engine
(``SGLANG_USE_CPU_ENGINE=1``, without which ``--device cpu`` takes CUDA paths) imports
``copy_all_layer_kv_cache_cpu`` from ``sgl_kernel`` at start (``kernels/ops/kvcache/
cache_move.py``), an op of sgl-kernel's CPU build, which PyPI does not have: ``sglang-kernel``
0.4.10 on PyPI ships CUDA ops only (``sm90``/``sm100`` ``common_ops``, ``flash_ops``), pinned to
torch 2.14.1. Before that, its config imports need torchvision, whose PyPI wheel is a CUDA
build that fails to load beside the CPU torch (``operator torchvision::nms does not exist``).
HiCache's host pool and cache controller are CUDA-stream code besides. So the events come from
SGLang's own classes, as its scheduler would publish them, and tests skip with the reason when
the environment (``bash scripts/vllm_env.sh --sglang``) is absent.

Each scenario's expected totals are worked out by hand in its test's docstring from
tests/sglang_driver.py's batches (pages of 4 tokens: node A = 2 blocks A1 A2, B = 1 block below
A, C = 1 block).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from kvscope.agent.config import AgentSettings, ConfigError, load_settings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.kv_events import (SGLANG, VLLM, KvEventsConfig, KvEventsSource,
                                             KvResidency, batch_rank, describe_endpoint,
                                             rank_endpoint)
from kvscope.service.agent import Agent
from conftest import wait_until
from tests.agent.test_sglang_metrics import FIRST, SECOND, exposition
from tests.engine_servers import exposition_server
from tests.vllm_env import kill_group, unavailable

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "sglang_driver.py"
# scripts/vllm_env.sh --sglang builds it; the same versions there
SGLANG_ENV = (Path(os.environ.get("KVSCOPE_CACHE", "/var/cache/kvscope"))
              / "sglang-0.5.23-torch-2.13.0")
BLOCK_BYTES = 100


def sglang_python() -> str:
    """The python of SGLang's cached environment, or :func:`~vllm_env.unavailable` saying
    how to get it."""
    python = SGLANG_ENV / "bin" / "python"
    if not python.is_file() or not (SGLANG_ENV / ".ready").is_file():
        unavailable(f"no SGLang environment at {SGLANG_ENV}: run `bash scripts/vllm_env.sh "
                    "--sglang`")
    return str(python)


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (each rank publishes on its own),
    below Linux's ephemeral range (32768 up): the publisher binds them seconds after this
    check, and a port the kernel may hand any outgoing connection meanwhile was taken once."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free run of ports")


@contextmanager
def sglang_publishing(scenario: str, endpoint: str, *args: str):
    """tests/sglang_driver.py publishing ``scenario`` with SGLang's classes; yields once its
    publishers have sent every batch; keeps them (and their replay ROUTERs) up until the block
    ends."""
    proc = subprocess.Popen([sglang_python(), str(DRIVER), scenario, endpoint, "--topic", "kv",
                             *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, cwd="/")
    try:
        line = proc.stdout.readline()
        if line.strip() != b"published":
            proc.stdin.close()
            kill_group(proc)
            pytest.fail(f"SGLang driver: {line!r} {proc.stderr.read()[-3000:]!r}")
        yield proc
    finally:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            kill_group(proc)
        proc.stdout.close()
        proc.stderr.close()


def totals(pipeline: Pipeline) -> dict:
    snap = pipeline.snapshot()
    return {"moved": snap.transfer_blocks, "evicted": snap.evicted_blocks,
            "dropped": snap.dropped_blocks,
            "resident": {t: s.resident_blocks for t, s in snap.tiers.items()}}


def sglang_source(pipeline: Pipeline, endpoint: str, **kwargs) -> KvEventsSource:
    tiers = kwargs.pop("tiers", None)
    return KvEventsSource(pipeline, endpoint, topic="kv", flavour=SGLANG,
                          residency=KvResidency(BLOCK_BYTES, tiers=tiers, flavour=SGLANG),
                          **kwargs)


def streamed(source: KvEventsSource, scenario: str, done, *args: str) -> None:
    """Start ``source``, have SGLang publish ``scenario`` to its endpoint (``args``: the
    driver's), and stop it once ``done(source)`` holds (failing after 20 s)."""
    source.start()
    try:
        with sglang_publishing(scenario, source.endpoint, *args):
            assert wait_until(lambda: done(source), timeout=20), source.last_seqs
            source.shutdown()  # while SGLang is up: its tiers leave the gauges as it goes
    finally:
        source.shutdown()


# what the ``tree`` scenario leaves, rank 0 publishing all of it and rank 1 batches 0-4 (see
# test_each_data_parallel_rank_is_followed_on_its_own_port_and_cache)
TWO_RANKS = {
    "moved": {("gpu", "cpu"): 4},
    "evicted": {("gpu", "capacity"): 6, ("gpu", "cleared"): 3, ("cpu", "capacity"): 4},
    "dropped": {"gpu": 5, "cpu": 4}, "resident": {"gpu": 3, "cpu": 0}}


def test_sglang_streams_its_radix_tree_into_gpu_and_cpu_tiers():
    """SGLang binds ``tcp://*:PORT`` (its default), the agent connects. Scenario ``tree``:

    batch 0: GPU stores A1 A2 B1 (one coalesced event), C1 -> gpu holds 4; no transfer
    batch 1: CPU_PINNED stores A1 A2 (write-through backup) -> gpu->cpu 2 (200 bytes)
    batch 2: GPU removes B1 A1 A2 -> gpu capacity evictions 3: B1 dropped (no host copy),
             A1 A2 offloaded (on cpu)
    batch 3: GPU stores A1 A2 (load back) -> no transfer (a GPU store never is one)
    batch 4: CPU_PINNED removes A1 A2 -> cpu capacity evictions 2, dropped (nothing below)
    batch 5: AllBlocksCleared -> gpu cleared 3 (A1 A2 C1), dropped (cpu is empty)
    Totals: gpu->cpu 2; evicted gpu capacity 3, gpu cleared 3, cpu capacity 2; dropped gpu
    1 + 3 = 4, cpu 2; resident gpu 0, cpu 0; no gap, nothing malformed or unknown."""
    pipeline = Pipeline()
    streamed(sglang_source(pipeline, f"tcp://*:{free_ports(1)}"), "tree",
             lambda source: source.last_seq == 5)
    assert totals(pipeline) == {
        "moved": {("gpu", "cpu"): 2},
        "evicted": {("gpu", "capacity"): 3, ("gpu", "cleared"): 3, ("cpu", "capacity"): 2},
        "dropped": {"gpu": 4, "cpu": 2}, "resident": {"gpu": 0, "cpu": 0}}
    snap = pipeline.snapshot()
    assert snap.transfer_bytes[("gpu", "cpu")] == 2 * BLOCK_BYTES
    assert snap.events_dropped == {}


def test_sglang_events_read_as_vllm_s_count_their_host_events_as_dropped_and_say_why(caplog):
    """``[kv_events]`` without ``engine = "sglang"`` reads SGLang's events in vLLM's dialect,
    whose media do not name ``CPU_PINNED``: the host pool's events were dropped silently (a
    tryout: 6 events taken of 11, nothing counted or logged). Scenario ``tree`` (see above)
    has two of them (batch 1's store, batch 4's removal): counted as ``unknown_kind``, and
    one line naming the medium and the setting."""
    pipeline = Pipeline()
    source = KvEventsSource(pipeline, f"tcp://*:{free_ports(1)}", topic="kv",
                            residency=KvResidency(BLOCK_BYTES))
    streamed(source, "tree", lambda source: source.last_seq == 5)
    assert pipeline.snapshot().events_dropped == {("kv_events", "unknown_kind"): 2}
    (line,) = [r.getMessage() for r in caplog.records if "unknown_kind" in r.getMessage()]
    assert "events of medium CPU_PINNED, which vLLM's KV events do not name" in line
    assert 'is [kv_events] engine = "sglang" meant?' in line


def test_each_data_parallel_rank_is_followed_on_its_own_port_and_cache():
    """``dp_size`` 2: SGLang's rank r binds the endpoint's port + r (``offset_endpoint_port``)
    with its own sequence; both ranks hold the same hashes in their own caches. Rank 0
    publishes all of ``tree`` (see the test above), rank 1 its batches 0-4 (no reset).
    Rank 0: gpu->cpu 2; gpu capacity 3 (dropped 1), cpu capacity 2 (dropped 2), gpu cleared 3
    (dropped 3); resident 0. Rank 1: gpu->cpu 2; gpu capacity 3 (dropped 1), cpu capacity 2
    (dropped 2); resident gpu A1 A2 C1 = 3. Totals: gpu->cpu 4; evicted gpu capacity 6, cpu
    capacity 4, gpu cleared 3; dropped gpu 5, cpu 4; resident gpu 3 (rank 0's reset leaves
    rank 1's blocks, one hash in two ranks being two blocks), cpu 0."""
    pipeline = Pipeline()
    streamed(sglang_source(pipeline, f"tcp://*:{free_ports(2)}", dp_size=2), "tree",
             lambda source: source.last_seqs == {0: 5, 1: 4}, "--dp-size", "2",
             "--rank-batches", "5")
    assert totals(pipeline) == TWO_RANKS
    assert pipeline.snapshot().events_dropped == {}


def test_gaps_are_replayed_from_each_ranks_own_replay_endpoint():
    """SGLang's replay ROUTER of rank r binds the replay endpoint's port + r. The batches of
    two ranks are taken off the wire with a plain SUB socket, and the source is handed only
    rank 0's seq 0 and 5 and rank 1's seq 0 and 4: it asks rank 0's ROUTER for 1-4 and rank 1's
    for 1-3, gets all 7, and ends with the totals of the test above (no gap counted)."""
    port = free_ports(2)
    replay = free_ports(2)
    while abs(replay - port) < 2:
        replay = free_ports(2)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for rank in range(2):
        sub.connect(f"tcp://127.0.0.1:{port + rank}")
    pipeline = Pipeline()
    source = sglang_source(pipeline, f"tcp://*:{port}", dp_size=2,
                           replay_endpoint=f"tcp://127.0.0.1:{replay}")
    taken: dict[tuple[int, int], list[bytes]] = {}
    try:
        with sglang_publishing("tree", f"tcp://*:{port}", "--dp-size", "2", "--rank-batches",
                               "5", "--replay", f"tcp://*:{replay}"):
            while len(taken) < 11 and sub.poll(5000):
                frames = sub.recv_multipart()
                taken[(batch_rank(frames[2]), int.from_bytes(frames[1], "big"))] = frames
            assert len(taken) == 11, sorted(taken)
            for key in ((0, 0), (1, 0), (0, 5), (1, 4)):
                source.handle(taken[key])
    finally:
        sub.close()
    assert source.replayed == 7
    assert totals(pipeline) == TWO_RANKS
    assert pipeline.snapshot().events_dropped == {}


def test_disk_and_external_media_are_the_disk_and_remote_tiers():
    """The media SGLang 0.5.23 defines but does not publish yet, with ``tiers`` set to all
    four. Scenario ``storage``:

    batch 0: GPU A1 A2; CPU_PINNED A1 A2 -> gpu->cpu 2
    batch 1: EXTERNAL A1 A2 -> cpu->remote 2; GPU C1; CPU_PINNED C1 -> gpu->cpu 1; DISK C1 ->
             cpu->disk 1
    batch 2: CPU_PINNED removes A1 A2 C1 -> cpu capacity 3, all offloaded (A on remote, C on
             disk)
    batch 3: CPU_PINNED A1 A2 -> remote->cpu 2 (promotions); CPU_PINNED C1 -> disk->cpu 1
    batch 4: EXTERNAL removes A1 A2 -> remote capacity 2, dropped (nothing below)
    Totals: gpu->cpu 3, cpu->remote 2, cpu->disk 1, remote->cpu 2, disk->cpu 1; evicted cpu 3,
    remote 2; dropped cpu 0 (all offloaded), remote 2; resident gpu 3, cpu 3, disk 1,
    remote 0."""
    pipeline = Pipeline()
    streamed(sglang_source(pipeline, f"tcp://*:{free_ports(1)}",
                           tiers=["gpu", "cpu", "disk", "remote"]), "storage",
             lambda source: source.last_seq == 4)
    assert totals(pipeline) == {
        "moved": {("gpu", "cpu"): 3, ("cpu", "remote"): 2, ("cpu", "disk"): 1,
                  ("remote", "cpu"): 2, ("disk", "cpu"): 1},
        "evicted": {("cpu", "capacity"): 3, ("remote", "capacity"): 2},
        "dropped": {"cpu": 0, "remote": 2},
        "resident": {"gpu": 3, "cpu": 3, "disk": 1, "remote": 0}}


def test_the_engine_selects_media_default_tiers_and_binding():
    """``engine`` picks the media and the default tiers (vLLM gpu, cpu, disk; SGLang gpu and
    cpu, the only media 0.5.23 publishes); remote is SGLang's only; SGLang binds 0.0.0.0 too,
    vLLM does not; ranks need tcp endpoints and ports that exist."""
    assert KvEventsConfig().tiers == ["gpu", "cpu", "disk"]
    assert KvEventsConfig(engine="sglang").tiers == ["gpu", "cpu"]
    assert KvEventsConfig(engine="sglang", tiers="gpu,remote").tiers == ["gpu", "remote"]
    with pytest.raises(ValueError, match="vLLM's tiers are gpu, cpu, disk"):
        KvEventsConfig(tiers=["remote"])
    with pytest.raises(ValueError, match="unknown tier 'remote'"):
        KvEventsConfig(capacity_blocks={"remote": 1})
    assert KvEventsConfig(engine="sglang", capacity_blocks={"remote": 1},
                          tiers="gpu,remote").capacity_blocks
    with pytest.raises(ValueError, match="must be tcp://"):
        KvEventsConfig(endpoint="ipc:///tmp/kv", dp_size=2)
    with pytest.raises(ValueError, match="past port 65535"):
        KvEventsConfig(endpoint="tcp://*:65535", dp_size=2)
    # rank 1 would publish on 5558, rank 0's replay port: SGLang's publisher fails to bind
    with pytest.raises(ValueError, match="ports 5557-5558 and the replay_endpoint's 5558-5559 "
                                         "overlap.*e.g. 5560"):
        KvEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://127.0.0.1:5558",
                       dp_size=2)
    assert KvEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://127.0.0.1:5559",
                          dp_size=2).dp_size == 2
    assert KvEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://127.0.0.1:5558")
    # one rank: the publisher and the replay socket on one port cannot both be bound (a
    # fresh-user tryout's config was taken); dp_size left at its default is checked too
    for extra in ({}, {"dp_size": 1}):
        with pytest.raises(ValueError, match="are the same socket"):
            KvEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5557", **extra)
    with pytest.raises(ValueError, match="are the same socket"):
        KvEventsConfig(endpoint="ipc:///tmp/kv", replay_endpoint="ipc:///tmp/kv")
    assert KvEventsConfig(endpoint="ipc:///tmp/kv", replay_endpoint="ipc:///tmp/kv-replay")
    # the agent binds its endpoint here, the engine's replay socket is on another host
    assert KvEventsConfig(endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://10.0.0.5:5557")
    assert KvEventsConfig(endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://10.0.0.5:5558",
                          dp_size=2)
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert SGLANG.binds("tcp://0.0.0.0:5557") and not VLLM.binds("tcp://0.0.0.0:5557")
    assert describe_endpoint("tcp://0.0.0.0:5557", SGLANG).startswith(
        "connects to tcp://127.0.0.1:5557: SGLang must bind")
    assert "vLLM must connect" in describe_endpoint("tcp://0.0.0.0:5557")


def test_a_bad_engine_or_rank_count_names_its_key(tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("KVSCOPE_")]:
        monkeypatch.delenv(key)
    path = tmp_path / "agent.toml"
    path.write_text('[kv_events]\nengine = "trtllm"\n')
    with pytest.raises(ConfigError, match="kv_events.engine"):
        load_settings(path)
    path.write_text('[kv_events]\nengine = "sglang"\ntiers = ["gpu", "tape"]\n')
    with pytest.raises(ConfigError, match="kv_events.tiers.*SGLang's tiers are gpu, cpu, disk, "
                                          "remote"):
        load_settings(path)


def test_the_agent_builds_the_flavour_and_its_ranks():
    settings = AgentSettings(kv_events={"enabled": True, "engine": "sglang", "dp_size": 2,
                                        "endpoint": "tcp://*:5557"},
                             collectors={"gpu": {"enabled": False}, "host": {"enabled": False}})
    source = Agent(settings, with_ingest=False).kv_events
    assert source.flavour is SGLANG and source.dp_size == 2
    assert source.residency.tiers == {"gpu", "cpu"} and source.residency.media is SGLANG.media
    assert "SGLang: tcp://*:5557 -> connects to tcp://127.0.0.1:5557" in source.describe()
    assert "2 data-parallel ranks, to tcp://*:5558" in source.describe()


def test_through_the_agent_kv_events_and_metrics_side_by_side():
    """The agent as ``docs/engines.md`` sets it up for SGLang: ``[kv_events] engine = "sglang"``
    receiving the ``tree`` scenario from SGLang's publisher, and ``[sglang_metrics]`` scraping
    SGLang's exposition (tests/agent/test_sglang_metrics.py's FIRST, then SECOND), read from
    the agent's own ``/metrics`` registry. From the KV events (the test above): gpu->cpu 2, GPU
    evictions capacity 3 (dropped 1) and cleared 3 (dropped 3), CPU capacity 2 (dropped 2). From
    the metrics, which leave gpu and cpu to the KV events: loads back cpu->gpu 80 / 16 = 5
    blocks, L3 backups cpu->disk 320 / 16 = 20, no gpu->cpu of theirs (40 would make it 42), the
    cpu tier's capacity 65536 / 16 = 4096 blocks beside the KV events' residency 0, recomputed
    prompt tokens 400, and both sources named engine "sglang"."""
    port = free_ports(1)
    with exposition_server(exposition(FIRST)) as server:
        settings = AgentSettings(
            kv_events={"enabled": True, "engine": "sglang", "endpoint": f"tcp://*:{port}",
                       "topic": "kv"},
            sglang_metrics={"enabled": True, "url": server.url, "interval": 0.2,
                            "model": "tiny"},
            collectors={"gpu": {"enabled": False}, "host": {"enabled": False},
                        "numa": {"enabled": False}})
        agent = Agent(settings, with_ingest=False)
        value = agent.exposition.registry.get_sample_value
        agent.start()
        try:
            assert wait_until(lambda: agent.pipeline.snapshot().source_up.get("sglang_metrics"))
            server.body = exposition(SECOND)
            with sglang_publishing("tree", f"tcp://*:{port}"):
                assert wait_until(lambda: agent.kv_events.last_seq == 5, timeout=20)
            assert wait_until(lambda: value("kvscope_transfer_blocks_total",
                                            {"src": "cpu", "dst": "disk"}) == 20)
        finally:
            agent.shutdown()
    moved = {(s, d): value("kvscope_transfer_blocks_total", {"src": s, "dst": d})
             for s, d in (("gpu", "cpu"), ("cpu", "gpu"), ("cpu", "disk"), ("disk", "cpu"))}
    assert moved == {("gpu", "cpu"): 2, ("cpu", "gpu"): 5, ("cpu", "disk"): 20,
                     ("disk", "cpu"): None}
    assert value("kvscope_evicted_blocks_total", {"tier": "gpu", "reason": "capacity"}) == 3
    assert value("kvscope_dropped_blocks_total", {"tier": "gpu"}) == 4
    assert value("kvscope_tier_capacity_blocks", {"tier": "cpu"}) == 4096
    # the metrics source tells the cpu tier's capacity alone; the KV events, what it holds,
    # had no cpu block to tell of: not measured, absent (it read 0, "empty")
    assert value("kvscope_tier_resident_blocks", {"tier": "cpu"}) is None
    assert value("kvscope_prompt_tokens_total", {"source": "recompute"}) == 400
    for source in ("kv_events", "sglang_metrics"):
        assert value("kvscope_engine_info", {"source": source, "engine": "sglang",
                                             "model": "tiny" if source != "kv_events" else ""})
