"""``kvscope rollout`` against guidellm's own mock OpenAI server (``guidellm mock-server``: a
real HTTP server whose TTFT and ITL are set on its command line), so that the answer is known:
a planted TTFT regression is rolled back; and the bad inputs end with one line on stderr, exit
code 2 and the runs that finished kept. The mock has no ``/metrics``: hit quality is then "not
measured". Skipped when guidellm's environment is absent (``bash scripts/vllm_env.sh
--guidellm``; the README's test command builds it)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

import httpx
import pytest

from conftest import REPO_ROOT, free_ports, sigint_default, wait_until
from vllm_env import guidellm_path


ROOT = REPO_ROOT
FAST = ["--requests", "12", "--warmup-requests", "0", "--max-prompt-tokens", "64",
        "--max-output-tokens", "8", "--block-tokens", "8", "--resamples", "400",
        "--request-timeout", "10"]


def _mock(guidellm: str, port: int, ttft_ms: float) -> str:
    return (f"exec {shlex.quote(guidellm)} mock-server --host 127.0.0.1 --port {port} "
            f"--ttft-ms {ttft_ms:g} --ttft-ms-std {ttft_ms / 10:g} --itl-ms 1 --output-tokens 8")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _rollout(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return subprocess.Popen([sys.executable, "-m", "kvscope", "rollout", *args], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            **{"preexec_fn": sigint_default, **kwargs})


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line]


def test_a_planted_ttft_regression_is_rolled_back(tmp_path):
    """Baseline mock TTFT 20 ms, candidate 200 ms (each +-10%), 2 levels x 2 repetitions of 12
    requests: the candidate's p99 TTFT is about ten times the baseline's, far over a +10%
    budget and above the A/A floor -> roll back (at 80 ms, a loaded machine's noise in the
    baseline's A/A pair once left a 77 ms difference inconclusive: the plant must stand clear
    of it). Hit quality and transfers are not measured (no /metrics)."""
    guidellm = guidellm_path()
    base, cand = free_ports(2)
    done = _rollout("--arm", f"base=http://127.0.0.1:{base}",
                    "--arm", f"slow=http://127.0.0.1:{cand}",
                    "--start", f"base={_mock(guidellm, base, 20)}",
                    "--start", f"slow={_mock(guidellm, cand, 200)}",
                    "--levels", "1,2", "--repetitions", "2", "--ttft-budget", "+10%",
                    "--min-requests", "20", "--out", str(tmp_path / "r"), *FAST)
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, err[-3000:]
    doc = json.loads((tmp_path / "r" / "rollout.json").read_text())
    (j,) = doc["judgements"]
    assert j["verdict"]["decision"] == "roll back (disable the newest tier)", j["verdict"]
    assert out.startswith("slow: roll back")
    assert j["overall"]["baseline"]["token_share"] is None  # not measured, not 0
    # nor the transfers: neither an agent nor the server's metrics counted them (the report's
    # chart said "no transfers in either run")
    assert j["overall"]["baseline"]["transfers"] is None
    assert j["overall"]["candidate"]["transfers"] is None
    assert "not measured" in j["text"]
    assert {r["cost"]["source"] for r in doc["runs"]} == {"none"}
    # JSON values, not their Python text ("None", "Budget(seconds=None, relative=0.1)")
    assert doc["meta"]["budgets"] == {"ttft_budget": {"relative": 0.1}, "itl_budget": None}


def test_a_server_that_dies_mid_run_stops_the_session_and_keeps_the_finished_runs(tmp_path):
    """The candidate's mock server is killed once the first run finished: one error line
    naming the arm, exit code 2, and rollout.json/html with the run(s) that finished."""
    guidellm = guidellm_path()
    base, cand = free_ports(2)
    report = tmp_path / "r" / "rollout.json"
    pidfile = tmp_path / "slow.pid"
    proc = _rollout("--arm", f"base=http://127.0.0.1:{base}",
                    "--arm", f"slow=http://127.0.0.1:{cand}",
                    "--start", f"base={_mock(guidellm, base, 5)}",
                    "--start", f"slow=echo $$ > {pidfile}; {_mock(guidellm, cand, 5)}",
                    "--levels", "1,2", "--repetitions", "2", "--no-aa",
                    "--out", str(tmp_path / "r"), *FAST)
    try:
        assert wait_until(lambda: report.is_file() and json.loads(report.read_text())["runs"],
                          timeout=300, interval=0.2), "no run finished"
        os.killpg(int(pidfile.read_text()), signal.SIGKILL)  # the server and its workers
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2
    (line,) = _errors(err)
    assert line.startswith("kvscope rollout: error: ") and "slow" in line, err[-2000:]
    doc = json.loads(report.read_text())
    assert doc["error"] and 1 <= len(doc["runs"]) < 8
    assert (tmp_path / "r" / "rollout.html").read_text().count("Partial results") == 1


def test_sigterm_stops_the_servers_and_the_load_generator_and_keeps_the_finished_runs(
        tmp_path):
    """SIGTERM to the rollout once a run finished (a service manager's stop, or ``kill``):
    exit code 130, both mock servers' process groups and every guidellm it started gone (each
    in its own session, no signal to the rollout reaches them: before, they ran on after it
    died, holding their ports), and rollout.json/html with the finished runs, marked
    interrupted."""
    psutil = pytest.importorskip("psutil")
    guidellm = guidellm_path()
    ports = free_ports(2)
    out = tmp_path / "r"
    pids = [tmp_path / f"{name}.pid" for name in ("base", "cand")]
    proc = _rollout("--arm", f"base=http://127.0.0.1:{ports[0]}",
                    "--arm", f"cand=http://127.0.0.1:{ports[1]}",
                    "--start", f"base=echo $$ > {pids[0]}; {_mock(guidellm, ports[0], 5)}",
                    "--start", f"cand=echo $$ > {pids[1]}; {_mock(guidellm, ports[1], 5)}",
                    "--levels", "1,2", "--repetitions", "2", "--no-aa",
                    "--out", str(out), *FAST)
    report = out / "rollout.json"

    def ours() -> list:  # processes of this rollout: the servers, and guidellm (its files)
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            line = " ".join(p.info["cmdline"] or ())
            if p.info["pid"] != proc.pid and (str(out) in line or any(
                    f"--port {port}" in line for port in ports)):
                found.append(line)
        return found

    try:
        assert wait_until(lambda: report.is_file() and json.loads(report.read_text())["runs"],
                          timeout=300, interval=0.2), "no run finished"
        assert wait_until(lambda: any("guidellm run" in line for line in ours()),
                          timeout=60, interval=0.05), ours()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert wait_until(lambda: not ours(), timeout=10), ours()
    doc = json.loads(report.read_text())
    assert doc["error"] == "interrupted" and 1 <= len(doc["runs"]) < 8
    # how far it got, where the results are, and that a rollout does not resume
    assert f"interrupted after {len(doc['runs'])} of 8 runs (partial results in {out}: " \
        "rollout.html, rollout.json); a rollout does not resume: run it again with another " \
        "--out" in err, err[-2000:]
    assert (out / "rollout.html").read_text().count(
        f"Partial results: the rollout stopped early, after {len(doc['runs'])} of 8 runs: "
        "interrupted") == 1


def test_a_signal_while_the_servers_stop_lets_them_stop_and_the_report_be_written(tmp_path):
    """SIGINT once the runs are done, while the rollout stops its servers: one arm's server
    ignores SIGTERM (and so does a child it left), so its stop takes the grace period and then
    SIGKILL. The signal cut that stop short: the candidate's server ran on and no rollout.html
    was written (a tryout). Now the signal is noted: the stop goes on to the end (every
    process of both groups gone), the whole report is written (its runs were all in: judged,
    not partial), and the exit code is 130."""
    psutil = pytest.importorskip("psutil")
    guidellm = guidellm_path()
    ports = free_ports(2)
    out = tmp_path / "r"
    group = tmp_path / "cand.pgid"  # the shell's pid: its process group's id (--start: setsid)
    stubborn = f"echo $$ > {group}; trap '' TERM; sleep 600 & {_mock(guidellm, ports[1], 5)}"
    proc = _rollout("--arm", f"base=http://127.0.0.1:{ports[0]}",
                    "--arm", f"cand=http://127.0.0.1:{ports[1]}",
                    "--start", f"base={_mock(guidellm, ports[0], 5)}", "--start", f"cand={stubborn}",
                    "--levels", "1", "--repetitions", "1", "--no-aa", "--out", str(out), *FAST)
    try:
        for line in proc.stderr:  # until the rollout says it stops its servers
            if "[rollout] stopping the servers it started" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert not [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                if any(f"--port {port}" in " ".join(p.info["cmdline"] or ()) for port in ports)]
    with pytest.raises(ProcessLookupError):  # the sleep that ignored SIGTERM too
        os.killpg(int(group.read_text()), 0)
    doc = json.loads((out / "rollout.json").read_text())
    assert "error" not in doc and len(doc["runs"]) == 2 and doc["judgements"]
    assert "Partial results" not in (out / "rollout.html").read_text()
    assert f"interrupted after 2 of 2 runs (results in {out}: rollout.html, rollout.json)" \
        in err, err[-2000:]


def test_a_server_already_on_a_started_arms_port_is_refused_not_measured(tmp_path):
    """A server (here guidellm's mock) already answers on the port an arm's --start command
    will serve: before, the rollout measured that server (a stopped rollout's leftover) and
    its own failed to bind, unnoticed. Now: exit code 2 naming the arm and the port, before
    any command starts."""
    guidellm = guidellm_path()
    port, other = free_ports(2)
    squatter = subprocess.Popen(_mock(guidellm, port, 5), shell=True, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health"), timeout=120)
        proc = _rollout("--arm", f"base=http://127.0.0.1:{port}",
                        "--arm", f"cand=http://127.0.0.1:{other}",
                        "--start", f"base={_mock(guidellm, port, 5)}",
                        "--out", str(tmp_path / "r"), *FAST)
        _, err = proc.communicate(timeout=300)
    finally:
        os.killpg(squatter.pid, signal.SIGKILL)
    assert proc.returncode == 2, err[-2000:]
    (line,) = _errors(err)
    assert f"arm base: http://127.0.0.1:{port}/health answers before its --start" in line
    assert json.loads((tmp_path / "r" / "rollout.json").read_text())["runs"] == []


def test_an_agent_that_cannot_be_read_is_said_before_any_run(tmp_path):
    """--agent names a port nothing listens on: the rollout stops once the servers are up,
    before warm-ups and runs (it read the agent first after run 1), exit code 2 naming it."""
    guidellm = guidellm_path()
    base, cand, agent = free_ports(3)
    proc = _rollout("--arm", f"base=http://127.0.0.1:{base}",
                    "--arm", f"cand=http://127.0.0.1:{cand}",
                    "--start", f"base={_mock(guidellm, base, 5)}",
                    "--start", f"cand={_mock(guidellm, cand, 5)}",
                    "--agent", f"cand=http://127.0.0.1:{agent}", "--warmup-requests", "5",
                    "--out", str(tmp_path / "r"), *FAST[:2], *FAST[4:])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-2000:]
    (line,) = _errors(err)
    assert f"cand's agent: cannot read http://127.0.0.1:{agent}/metrics" in line
    assert "warming up" not in err
    assert json.loads((tmp_path / "r" / "rollout.json").read_text())["runs"] == []


def test_an_agent_that_counts_nothing_is_warned_of_and_its_hit_quality_not_measured(tmp_path):
    """--agent names a real kvscope agent that no engine reports to (the one beside another
    server, say): it answers, but counts no prompt tokens while the arm serves its requests.
    Each such run says so (progress line, rollout.json, the page), and the arm's hit quality
    reads not measured, not 0% from every source."""
    guidellm = guidellm_path()
    base, cand, agent = free_ports(3)
    with open(tmp_path / "agent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvscope", "agent", "--port", str(agent),
                                 "--ingest", f"ipc://{tmp_path}/ingest.sock"], cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: _answers(f"http://127.0.0.1:{agent}/healthz"), 60, 0.2)
        done = _rollout("--arm", f"base=http://127.0.0.1:{base}",
                        "--arm", f"cand=http://127.0.0.1:{cand}",
                        "--start", f"base={_mock(guidellm, base, 5)}",
                        "--start", f"cand={_mock(guidellm, cand, 5)}",
                        "--agent", f"cand=http://127.0.0.1:{agent}", "--levels", "1",
                        "--repetitions", "2", "--min-requests", "20",
                        "--out", str(tmp_path / "r"), *FAST)
        _, err = done.communicate(timeout=300)
    finally:
        proc.terminate()
        proc.wait(30)
    assert done.returncode == 0, err[-3000:]
    said = (f"cand's agent (http://127.0.0.1:{agent}) counted no prompt tokens in a run of 12 "
            f"requests: is it the agent beside http://127.0.0.1:{cand}?")
    assert err.count(f"[rollout] warning: {said}") == 2, err[-3000:]
    doc = json.loads((tmp_path / "r" / "rollout.json").read_text())
    assert [said in r.get("warning", "") for r in doc["runs"]] == \
        [r["arm"] == "cand" for r in doc["runs"]]
    assert said.replace("'", "&#x27;") in (tmp_path / "r" / "rollout.html").read_text()
    (j,) = doc["judgements"]
    assert j["overall"]["candidate"]["token_share"] is None, j["overall"]["candidate"]


@pytest.mark.parametrize("args, says", [
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}",
      "--start-timeout", "1"], "did not answer 200"),
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--loadgen",
      "/nonexistent/guidellm"], "is not an executable file"),
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--ttft-budget",
      "10ms"], "budget '10ms'"),
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--levels", "0,2"],
     "distinct stream counts"),
    # an item left out was dropped silently
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--levels", "1,,2"],
     "'1,,2': give distinct stream counts"),
    (["--arm", "a=http://127.0.0.1:{p}"], "two arms or more"),
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--agent",
      "c=http://127.0.0.1:1"], "no --arm named c"),
    # the last one silently won
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--start",
      "a=true", "--start", "a=false"], "--start a=... given twice: one per arm"),
    # an OpenAI base URL (/v1) is the server's: its /health is asked for, and nothing answers
    (["--arm", "a=http://127.0.0.1:{p}/v1", "--arm", "b=http://127.0.0.1:{p}/v1/",
      "--start-timeout", "1"], "arm a: http://127.0.0.1:{p}/health did not answer 200"),
    # refused before any run, not when judging after them
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--resamples", "10"],
     "--resamples 10 is too few for a 95% interval: give at least 80"),
    # the baseline's second run is "<name> (A/A)": an arm of that name was merged with it
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "a (A/A)=http://127.0.0.1:{p}"],
     "--arm a (A/A)=...: a name ending in '(A/A)' is the A/A run's; name the arm otherwise"),
    # a trace the runs could not read: said before any server is waited for
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--workload",
      "{tmp}/bad.jsonl"], "bad.jsonl:1: not JSON"),
    # said before any server is waited for, naming the flag: not guidellm's failure at the
    # first run, nor an OSError's words alone
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--tokenizer",
      "{tmp}/no-such-model"], "--tokenizer {tmp}/no-such-model: no such directory"),
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--out",
      "{tmp}/bad.jsonl/r"], "--out {tmp}/bad.jsonl/r: cannot create it (Not a directory)"),
    # a file said to be "not an empty directory", and no word of what to do
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--out",
      "{tmp}/bad.jsonl"], "--out {tmp}/bad.jsonl: a file already; a rollout writes its report "
                          "into a new or empty directory: give another --out"),
    (["--arm", "a=http://127.0.0.1:{p}", "--arm", "b=http://127.0.0.1:{p}", "--out", "{tmp}"],
     "--out {tmp}: a directory that holds files already; a rollout writes its report into a "
     "new or empty directory: give another --out"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, says):
    """Nothing listens on the port; the load generator named does not exist; a budget, levels,
    arms, resamples, trace, tokenizer path or report directory the command cannot use. Only a
    session that began (a server waited for) leaves its --out."""
    port, = free_ports(1)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    loadgen_args = [] if "--loadgen" in args else ["--loadgen", sys.executable]
    out_args = [] if "--out" in args else ["--out", str(tmp_path / "r")]
    proc = _rollout(*[a.format(p=port, tmp=tmp_path) for a in args], *loadgen_args, *out_args)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert says.format(p=port, tmp=tmp_path) in lines[-1] and len(_errors(err)) == 1, err
    if "did not answer" in says:  # the session had begun: its (empty) report is kept
        assert json.loads((tmp_path / "r" / "rollout.json").read_text())["runs"] == []
    elif out_args:  # refused before: no --out made (one arm had left an empty one)
        assert not (tmp_path / "r").exists()


def test_an_arm_left_unjudged_is_named_in_the_report_page():
    """A rollout stopped before the candidate's first run finished: rollout.json said
    ``not_judged: {"slow": ...}``, the HTML page nothing of it."""
    from kvscope.rollout import report

    doc = {"runs": [], "judgements": [], "arms": [{"name": "base"}, {"name": "slow"}],
           "levels": [1], "repetitions": 1, "baseline": "base",
           "error": "arm slow: its server command exited with code 1",
           "not_judged": {"slow": "no run of slow finished"}}
    html = report.page(doc)
    assert "<b>slow</b>: not judged: no run of slow finished" in html
    assert html.count("Partial results") == 1
    # no empty charts: the page was 4.8 MB, nearly all of it Plotly's JavaScript
    assert "No run finished: nothing to chart." in html and "plotly" not in html.lower()
