"""The command line: bad input gives one clear line on stderr and exit code 2, nothing is left
running, and a stopped command exits cleanly."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import free_port, sigint_default, tmpfs


def _kvscope(*args, timeout=60, env=None, sigint=signal.SIG_DFL):
    """The command's result; ``sigint``: its SIGINT disposition at start (SIG_IGN: a shell
    script's background job; SIG_DFL whatever this process was started with)."""
    return subprocess.run([sys.executable, "-m", "kvscope", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


def _started_agent(*args, ingest, stderr=subprocess.STDOUT, env=None):
    """`kvscope agent` on a free port with ``args`` (``env``: its environment, None: ours),
    and its output lines up to its start line (the process's stdout stays open for the
    rest)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "agent", "--port", str(free_port()),
                             "--ingest", ingest, *args], stdout=subprocess.PIPE, stderr=stderr,
                            text=True, stdin=subprocess.DEVNULL, env=env,
                            preexec_fn=sigint_default)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("kvscope agent: http"):
            break
    return proc, lines


def _one_error_line(result, *needles):
    """Exit code 2 and one error line (no traceback), named as argparse names the command's
    own errors (``kvscope demo: error: ...``) whether the parser or the run found it; the
    agent's info log lines from parts that started before the failing one (e.g. the GPU
    collector's) may precede it."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if " INFO kvscope." not in line]
    assert len(lines) == 1, result.stderr
    command = result.args[3]  # [python, -m, kvscope, COMMAND or an option, ...]
    prefix = f"kvscope {command}: error: "
    if command.startswith("-") or "argument COMMAND: invalid choice" in lines[0]:
        prefix = "kvscope: error: "  # no command to name
    assert lines[0].startswith(prefix), lines[0]
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize("content,needle", [
    (None, "cannot read trace"),
    ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n{oops\n', ":2: not JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n', ":1: record has no list"),
    # once tracebacks (OverflowError) or a message naming no line
    ('{"timestamp": 0, "input_length": 5, "hash_ids": [-1, 2]}\n', ":1: 'hash_ids' must be"),
    ('{"timestamp": 0, "input_length": 5, "hash_ids": [18446744073709551616]}\n',
     ":1: 'hash_ids' must be"),
    ('{"timestamp": 0, "input_length": 1e400, "hash_ids": [1]}\n', ":1: timestamp must be a"),
    ('{"timestamp": NaN, "input_length": 5, "hash_ids": [1]}\n', ":1: timestamp must be a"),
    # once taken: cut to 100 tokens; and an arrival before the start, queued for 100 ms
    ('{"timestamp": 0, "input_length": 100.7, "hash_ids": [1]}\n', "whole numbers"),
    ('{"timestamp": -100, "input_length": 5, "hash_ids": [1]}\n', ":1: timestamp (milliseconds"),
])
def test_bad_trace(tmp_path, content, needle):
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    _one_error_line(_kvscope("demo", "--trace", str(path), "--duration", "5"), needle)


TRACE = '{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}\n'


def test_a_trace_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    """An editor's UTF-8 BOM before the first record: "not JSON (Unexpected UTF-8 BOM (decode
    using utf-8-sig) column 1)", advice a user cannot take. It reads as the same trace."""
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text(TRACE * 3)
    marked.write_bytes(b"\xef\xbb\xbf" + (TRACE * 3).encode())
    results = [_kvscope("analyze", str(p), "--json") for p in (plain, marked)]
    assert [r.returncode for r in results] == [0, 0], results[1].stderr
    assert results[0].stdout == results[1].stdout.replace(str(marked), str(plain))


def test_a_closed_stdout_or_a_reader_that_left_is_no_error(tmp_path):
    """`kvscope analyze trace >&-` (stdout closed: None in Python) raised a traceback, as did
    the agent and the demo (uvicorn's log format asks stdout whether it is a terminal); a
    replay whose reader left before its summary (`| head -1`) said "error: [Errno 32] Broken
    pipe", exit 2. Both exit 0, saying nothing."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE * 3)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe's buffer
    closed = subprocess.run([sys.executable, "-m", "kvscope", "analyze", str(trace)],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            timeout=120, preexec_fn=lambda: os.close(1), env=env)
    assert (closed.returncode, closed.stderr) == (0, "")
    replay = subprocess.Popen([sys.executable, "-m", "kvscope", "replay", "--simulate",
                               "--requests", "50", "--fast"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    replay.stdout.close()  # the reader leaves at once
    _, err = replay.communicate(timeout=120)
    assert (replay.returncode, err) == (0, "")


@pytest.mark.parametrize("flag", ["--metrics-port", "--ui-port"])
def test_port_already_taken(flag):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            free_port = str(free.getsockname()[1])
        other = ["--ui-port" if flag == "--metrics-port" else "--metrics-port", free_port]
        result = _kvscope("demo", flag, port, *other, "--duration", "5")
    _one_error_line(result, port, flag)


def test_help_lists_the_demo_flags():
    result = _kvscope("demo", "--help")
    assert result.returncode == 0
    for flag in ("--duration", "--trace", "--host", "--metrics-port", "--ui-port"):
        assert flag in result.stdout


def test_agent_help_names_every_source_and_collector_table():
    """``kvscope agent --help`` named no engine table: a user found [trtllm] and the others
    only in docs/agent.md. Every registered source (but ingest, on by default) and collector
    is named, as its table."""
    from kvscope import cli
    from kvscope.agent.collectors import REGISTRY as COLLECTORS
    from kvscope.agent.sources import REGISTRY

    epilog = " ".join(cli._parser().parse_args(["docs-metrics"]).commands["agent"].epilog.split())
    for name in [n for n in REGISTRY if n != "ingest"]:
        assert f"[{name}]" in epilog, name
    for name in COLLECTORS:
        assert f"[collectors.{name}]" in epilog, name


def test_disk_tier_without_cpu_tier_is_a_clear_error():
    ports = [str(free_port()), str(free_port())]
    _one_error_line(_kvscope("demo", "--cpu-blocks", "0", "--disk-blocks", "4", "--duration", "5",
                             "--metrics-port", ports[0], "--ui-port", ports[1]), "cpu tier")


@pytest.mark.parametrize("args,needle", [
    (["--cpu-blocks", "-1"], "must be >= 0"),
    (["--metrics-port", "19555", "--ui-port", "19555"], "different ports"),
    # the demo has no --simulate: the way to size beyond the host is replay's
    (["--preset", "llama-3-8b", "--cpu-blocks", "100000000"],
     "GiB of host memory but only"),
    (["--preset", "llama-3-8b", "--cpu-blocks", "100000000"],
     "(to size tiers beyond this host, `kvscope replay --simulate` holds no KV bytes)"),
])
def test_impossible_demo_settings(args, needle):
    _one_error_line(_kvscope("demo", "--duration", "5", *args), needle)


@pytest.mark.parametrize("args,needle", [
    # numpy's own words ("expected non-negative integer"), naming no flag
    (["--seed", "-1"], "argument --seed: must be >= 0"),
    (["--min-requests", "0"], "argument --min-requests: must be > 0"),  # was taken
    (["--ttft-budget", "1e400"], "want a finite number of seconds, at least"),  # "must be > 0"
    # 1e-300 s was taken, and the verdict printed it as 0.000...0 ms, 300 zeros
    (["--ttft-budget", "1e-300"], "want a finite number of seconds, at least 0.000001 (1 us)"),
])
def test_compare_options_are_checked_before_the_captures_are_read(tmp_path, args, needle):
    _one_error_line(_kvscope("compare", str(tmp_path / "a"), str(tmp_path / "b"), *args), needle)


@pytest.mark.parametrize("args,needle", [
    (["--disk-dir", "/proc/no-such-dir", "--disk-blocks", "10"],
     "--disk-dir /proc/no-such-dir: cannot create it: No such file or directory"),
    (["--disk-dir", "/tmp"], "--disk-dir is for the disk tier, which is off: give --disk-blocks"),
    (["--disk-dir", __file__, "--disk-blocks", "10"],
     f"argument --disk-dir: {__file__} is a file, not a directory"),
])
@pytest.mark.parametrize("command", [["replay", "--requests", "10"], ["demo", "--duration", "1"]])
def test_a_disk_dir_that_cannot_work_names_the_flag(command, args, needle):
    """Replay's and the demo's (the demo had none: its disk tier's space error named a
    temporary directory its user could not change)."""
    ports = ["--metrics-port", str(free_port()), "--ui-port", str(free_port())]
    _one_error_line(_kvscope(*command, *args, *(ports if command[0] == "demo" else ())), needle)


def test_a_demo_disk_tier_that_does_not_fit_names_its_directory(tmp_path):
    """The space check names --disk-dir's directory, which the demo now takes."""
    _one_error_line(_kvscope("demo", "--duration", "1", "--disk-blocks", "100000000",
                             "--disk-dir", str(tmp_path), "--metrics-port", str(free_port()),
                             "--ui-port", str(free_port())),
                    "the disk tier needs", f"GiB is free at {tmp_path}")


def test_every_command_describes_itself_in_its_help():
    """``kvscope COMMAND --help`` opens with what the command does (docs-metrics' said
    nothing, and not that it writes relative to the current directory)."""
    from kvscope import cli

    commands = cli._parser().parse_args(["docs-metrics"]).commands
    assert set(commands) >= {"demo", "agent", "dashboard", "analyze", "compare", "rollout",
                             "replay", "docs-metrics"}
    for name, parser in commands.items():
        assert parser.description and len(parser.description) > 40, name


def test_every_value_an_option_takes_is_named_in_a_word():
    """``--gpu-blocks N``, not argparse's default ``--gpu-blocks GPU_BLOCKS`` (the option's
    name again, upper-cased: demo and replay showed it for five options, dashboard for
    --api, --refresh and --window)."""
    from kvscope import cli

    commands = cli._parser().parse_args(["docs-metrics"]).commands
    shown = {(name, a.option_strings[0]): a.metavar or a.dest.upper()
             for name, parser in commands.items() for a in parser._actions
             if a.option_strings and a.nargs != 0 and a.choices is None}
    assert ("replay", "--gpu-blocks") in shown
    assert {k: v for k, v in shown.items() if "_" in str(v)} == {}


def test_a_workload_without_one_off_prompts_is_accepted():
    """``--one-off-share 0`` (every prompt reused) is a workload, not a mistake: it was refused
    with "must be in (0, 1]", the check of a sampling rate."""
    from kvscope import cli

    args = cli._parser().parse_args(["demo", "--one-off-share", "0"])
    assert args.one_off_share == 0.0


@pytest.mark.parametrize("args,needle", [
    (["bogus"], "invalid choice: 'bogus'"),
    (["demo", "--duration", "soon"], "--duration"),
    (["demo", "--one-off-share", "1.5"], "must be in [0, 1]"),
    (["agent", "--port", "70000"], "--port"),
    # flags of the synthetic workload beside --trace were ignored unsaid
    (["replay", "--trace", "t.jsonl", "--seed", "5"],
     "--seed shapes the synthetic workload; --trace replays the trace as it is: leave --seed "
     "out"),
    (["demo", "--trace", "t.jsonl", "--one-off-share", "0.5"],
     "--one-off-share shapes the synthetic workload"),
    # argparse takes -5% for an option: the way to give it was in --help only
    (["compare", "--ttft-budget", "-5%", "a", "b"],
     "expected one argument; a value that starts with '-' goes after '=': --ttft-budget=-5%"),
    (["analyze", "t.jsonl", "--bandwidth-gbps", "nan"], "must be a finite number"),
    (["analyze", "t.jsonl", "--bandwidth-gbps", "fast"], "invalid float value: 'fast'"),
    (["analyze", "t.jsonl", "--arc-points", "100000"], "must be 0 to 64"),
    (["analyze", "t.jsonl", "--method", "shards-size", "--sample-blocks", "0"], "must be > 0"),
    # "" would be the current directory: the store or the captures landed wherever it was run
    (["agent", "--store-dir", ""], "--store-dir: is empty"),
    (["agent", "--capture-dir", ""], "--capture-dir: is empty"),
    (["demo", "--capture-dir", "", "--duration", "1"], "--capture-dir: is empty"),
    # an empty path to read: the demo played its own workload (its Sizing page failing on "."),
    # replay too, analyze read the current directory (a tryout's)
    (["demo", "--trace", "", "--duration", "1"],
     "--trace: is empty; give a path, or leave the flag out for the built-in workload"),
    (["replay", "--trace", ""], "--trace: is empty"),
    (["analyze", ""], "argument INPUT: is empty; give a path"),
    (["compare", "a", " "], "argument CANDIDATE: is empty"),
    (["dashboard", "--sizing-trace", ""], "--sizing-trace: is empty"),
    # bytes that are not UTF-8 (kept as lone surrogates): pyarrow cannot open such a path, and
    # compare ended in a UnicodeEncodeError traceback (a tryout's)
    (["compare", "a", "/tmp/run-\udcff"],
     "argument CANDIDATE: /tmp/run-\\xff is not UTF-8 text (character 10)"),
    (["agent", "--capture-dir", "/tmp/run-\udcff"], "--capture-dir: /tmp/run-\\xff is not UTF-8"),
    (["agent", "--config", ""], "--config: is empty"),
    (["docs-metrics", "--output", ""], "--output: is empty"),
    (["rollout", "--arm", "a=http://127.0.0.1:1", "--arm", "b=http://127.0.0.1:2", "--out", ""],
     "--out: is empty"),
    # a file named as the directory: the agent's own error named its config key, capture_dir
    (["demo", "--capture-dir", __file__, "--duration", "1"],
     f"--capture-dir: {__file__} is a file, not a directory"),
    (["agent", "--store-dir", __file__], f"--store-dir: {__file__} is a file, not a directory"),
    # the presets listed, as --preset lists them (it said "unknown preset 'nosuch'" alone)
    (["dashboard", "--sizing-preset", "nosuch"], "invalid choice: 'nosuch' (choose from"),
    # values so large that a tryout got a traceback from inside numpy (2**74 tokens: an int
    # numpy cannot take a log of), a NaN (1e300 GiB in bytes) or 2 TiB asked for resamples
    (["analyze", "t.jsonl", "--gpu-tokens", str(2**74)], "must be 0 to 9,007,199,254,740,992"),
    (["dashboard", "--sizing-gpu-tokens", str(2**74)], "must be 0 to 9,007,199,254,740,992"),
    (["analyze", "t.jsonl", "--budget-gib", "1e300"], "at most 1,073,741,824"),
    (["compare", "a", "b", "--resamples", "99999999999"], "at most 1,000,000"),
    # a rate of 1e-300 priced a prompt's prefill at a 300-digit number of seconds
    (["analyze", "t.jsonl", "--prefill-tokens-per-second", "1e-300"],
     "must be at least 1 token/s"),
    (["analyze", "t.jsonl", "--bandwidth-gbps", "1e-300"], "must be at least 0.001 GB/s"),
    # the rate() range of the Prometheus backend's queries (it was fixed at 1m)
    (["dashboard", "--prometheus-rate-window", "4"], "must be a Prometheus duration such as 1m"),
])
def test_a_bad_argument_is_one_line_that_points_to_help(args, needle):
    _one_error_line(_kvscope(*args), needle, "--help)")


def test_a_misspelt_flag_points_to_its_commands_help():
    _one_error_line(_kvscope("agent", "--prot", "9401"), "unrecognized arguments: --prot 9401",
                    "(see kvscope agent --help)")


def test_unreadable_trace_is_one_line(tmp_path):
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    _one_error_line(_kvscope("demo", "--trace", str(path), "--duration", "5"), "not UTF-8")


def test_docs_metrics_writes_the_catalog_atomically(tmp_path):
    from kvscope.catalog import render_markdown

    out = tmp_path / "metrics.md"
    assert _kvscope("docs-metrics", "--output", str(out)).returncode == 0
    assert out.read_text() == render_markdown()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.md"]  # no temporary left
    # errors name the file asked for, never the temporary one beside it
    absent = tmp_path / "absent" / "metrics.md"
    _one_error_line(_kvscope("docs-metrics", "--output", str(absent)),
                    f"cannot write {absent}: No such file or directory (run it from the "
                    "repository root, or give --output FILE)")
    _one_error_line(_kvscope("docs-metrics", "--output", str(tmp_path)),
                    f"cannot write {tmp_path}: Is a directory")
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.md"]


def test_the_dashboard_refuses_bad_input_before_it_serves(tmp_path):
    """A base URL without its scheme, a sizing trace that is not there, a taken port: each an
    error line and exit code 2, as the demo and the agent give. The dashboard once started
    and showed the first two on its pages, and the third as a raw errno."""
    result = _kvscope("dashboard", "--api", "localhost:9400")
    assert result.returncode == 2 and "--api: must be an http:// or https:// URL" in result.stderr
    result = _kvscope("dashboard", "--backend", "prometheus", "--prometheus", "prom:9090")
    assert result.returncode == 2 and "--prometheus: must be an http://" in result.stderr
    _one_error_line(_kvscope("dashboard", "--sizing-trace", str(tmp_path / "nope.jsonl"),
                             "--port", str(free_port())), "cannot read trace")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        _one_error_line(_kvscope("dashboard", "--port", str(taken.getsockname()[1])),
                        "cannot listen on 127.0.0.1:", "pass a free port with --port")
    # a token the agent would refuse (it once raised UnicodeEncodeError, with a traceback)
    result = subprocess.run([sys.executable, "-m", "kvscope", "dashboard"], capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL,
                            env={**os.environ, "KVSCOPE_TOKEN": "s\u00e9cret"})
    _one_error_line(result, "KVSCOPE_TOKEN must be printable ASCII")


@pytest.mark.parametrize("token, warned", [("a", True), ("0123456789abcdef", False)])
def test_a_guessable_token_beyond_loopback_is_warned_of(tmp_path, token, warned):
    """A one-character token guarded /api on 0.0.0.0 without a word; one under 16 characters
    (64 bits of random hex) is warned of in the banner, one of 16 is not."""
    proc, lines = _started_agent("--host", "0.0.0.0", ingest=f"ipc://{tmp_path}/i.sock",
                                 env={**os.environ, "KVSCOPE_TOKEN": token})
    try:
        # the banner is flushed whole: read it all. SIGTERM, which the agent always handles: a
        # SIGINT the test process was started ignoring (a CI job run in the background) is
        # ignored by the agent too, and it ran on
        proc.send_signal(signal.SIGTERM)
        lines += proc.stdout
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = ("  warning: the token is 1 character, few enough to guess: use 16 random ones at "
            "least (e.g. openssl rand -hex 16)\n")
    assert (said in lines) is warned, "".join(lines)


def test_agent_refuses_an_ingest_endpoint_on_its_own_port():
    port = str(free_port())
    result = _kvscope("agent", "--port", port, "--ingest", f"tcp://127.0.0.1:{port}")
    _one_error_line(result, "ingest endpoint", "own endpoints (its --port, [ingest], a "
                    "source's) holds it: choose a free one")


def test_an_ingest_endpoint_on_the_command_line_turns_ingest_on(tmp_path):
    """The config turns ingest off, and --ingest names an endpoint: the flag wins (it was
    silently ignored). Shown by its own-port refusal, which happens only with ingest on."""
    config = tmp_path / "agent.toml"
    config.write_text("[ingest]\nenabled = false\n")
    port = str(free_port())
    result = _kvscope("agent", "--config", str(config), "--port", port,
                      "--ingest", f"tcp://127.0.0.1:{port}", timeout=20)
    _one_error_line(result, "ingest endpoint")


def test_the_log_level_hides_kvscopes_info_lines():
    """--log-level warning: the failed start prints its error line alone, with no info line
    from a part that started before (at info, this machine's GPU collector logs one)."""
    port = str(free_port())
    result = _kvscope("agent", "--port", port, "--ingest", f"tcp://127.0.0.1:{port}",
                      "--log-level", "warning")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_an_empty_host_is_refused():
    result = _kvscope("demo", "--host", "", "--duration", "5")
    assert result.returncode == 2 and "must be an address" in result.stderr


@pytest.mark.parametrize("command", [["demo", "--duration", "5"], ["dashboard"], ["agent"]])
def test_a_host_that_does_not_resolve_is_refused_before_a_token_is_asked_for(command):
    """A mistyped --host was first asked for KVSCOPE_TOKEN (it is not loopback), and only
    with one said it cannot be listened on. ``.invalid`` never resolves (RFC 6761)."""
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_TOKEN"}
    result = _kvscope(*command, "--host", "nosuch.invalid", env=env)
    assert result.returncode == 2, result.stderr
    assert "cannot resolve 'nosuch.invalid'" in result.stderr, result.stderr
    assert "KVSCOPE_TOKEN" not in result.stderr, result.stderr


def test_a_host_from_the_config_that_does_not_resolve_names_the_config_too(tmp_path):
    """--host is checked as it is parsed; a host from the config file only when the agent
    binds it, whose error named --host alone, which the operator never gave."""
    config = tmp_path / "agent.toml"
    config.write_text('host = "nosuch.invalid"\n')
    _one_error_line(_kvscope("agent", "--config", str(config)), "cannot listen on nosuch.invalid:",
                    "check --host (or host in the config)")


@pytest.mark.parametrize("command", [["demo", "--duration", "5"], ["dashboard"]])
def test_a_dashboard_beyond_loopback_without_a_token_is_refused(command):
    """The dashboard has no authentication of its own: beyond loopback it needs KVSCOPE_TOKEN
    or --insecure, and says so before taking a port."""
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_TOKEN"}
    result = _kvscope(*command, "--host", "0.0.0.0", env=env)
    assert result.returncode == 2, result.stderr
    assert "set KVSCOPE_TOKEN" in result.stderr and "--insecure" in result.stderr


def test_ctrl_c_while_a_command_imports_is_an_interruption_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C in a command's first quarter second landed in the import of the agent's config
    (pydantic), before main's handlers, and printed the import's traceback. Here the import
    itself raises KeyboardInterrupt, as the signal would (a finder ahead of the others): main
    says it was interrupted and returns 130."""
    from kvscope import cli

    class Interrupted:
        def find_spec(self, name, path=None, target=None):
            if name == "kvscope.agent.config":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "kvscope.agent.config", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    assert cli.main(["docs-metrics"]) == 130
    assert capsys.readouterr().err == "kvscope docs-metrics: interrupted\n"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_while_the_agent_shuts_down_does_not_spoil_its_exit_code(tmp_path, sig):
    """Ctrl-C stops the agent; more Ctrl-C every 5 ms until the process is gone (an impatient
    user) must not turn its clean stop into death by SIGINT: Python restores the default action
    of handled signals while it shuts down, so the agent ignores them once it has stopped.
    SIGTERM and SIGHUP (a closed terminal; it killed the agent with exit code 129, before its
    store's last flush) stop it the same way."""
    proc, lines = _started_agent("--store-dir", str(tmp_path / "store"),
                                 ingest=f"ipc://{tmp_path}/ingest.sock")
    try:
        proc.send_signal(sig)
        for line in proc.stdout:
            lines.append(line)
            if "stopped" in line:
                break
        while proc.poll() is None:
            proc.send_signal(sig)
            time.sleep(0.005)
        assert proc.wait(timeout=30) == 0, "".join(lines)
        assert lines[-1] == "kvscope agent: stopped\n", "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_dashboard_says_it_stopped():
    """SIGTERM stops ``kvscope dashboard`` with exit code 0 and a last line saying so, as the
    demo and the agent say it (it ended silent)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "dashboard", "--port",
                             str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("kvscope dashboard: http"):
                break
        proc.send_signal(signal.SIGTERM)
        lines += proc.stdout.readlines()
        assert proc.wait(timeout=60) == 0, "".join(lines)
        assert lines[-1] == "kvscope dashboard: stopped\n", "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_burst_of_stop_signals_stops_the_agent_cleanly(tmp_path):
    """30 SIGTERMs back to back (a supervisor and a process-group kill at once), 4 times: the
    agent stops each time, exit code 0. Its handler once set the stop event itself, and a
    signal coming while the handler was inside ``Event.set`` waited for the lock its own
    thread held: 2 of 4 such agents hung until SIGKILL, without their store's last flush."""
    for trial in range(4):
        proc = subprocess.Popen([sys.executable, "-m", "kvscope", "agent",
                                 "--port", str(free_port()),
                                 "--ingest", f"ipc://{tmp_path}/ingest.sock",
                                 "--store-dir", str(tmp_path / "store")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
        try:
            for line in proc.stdout:
                if line.startswith("kvscope agent: http"):
                    break
            for _ in range(30):
                proc.send_signal(signal.SIGTERM)
            try:  # a hang is for good: 60 s is no speed limit, only the end of the wait
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rc = None
            assert rc == 0, f"trial {trial}: exit code {rc} (None: hung)"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_stop_signals_set_the_stop_event_of_every_long_running_command(sig):
    """``demo``, ``agent`` and ``dashboard`` all wait on the event :func:`stop_on_signals`
    sets; a signal it does not handle kills them without their clean stop."""
    import os
    import threading

    from kvscope.signals import stop_on_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for s in saved:  # not SIG_DFL: a signal left unhandled would kill pytest itself
            signal.signal(s, lambda *_: None)
        stop = threading.Event()
        stop_on_signals(stop)
        os.kill(os.getpid(), sig)
        assert stop.wait(5)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


_SIGNAL_TO_ANOTHER_THREAD = r'''
import signal, threading
from kvscope.signals import stop_on_signals, wait_for_stop

stop = threading.Event()
stop_on_signals(stop)
# the kernel may hand a process's SIGINT to any thread: here, one that is not the main one
threading.Timer(0.2, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT)).start()
wait_for_stop(stop)
print("stopped")
'''


def test_a_stop_signal_delivered_to_another_thread_still_stops_the_command():
    """1 agent in about 20 hung on Ctrl-C in the tests: the signal came to uvicorn's thread
    while the main thread sat in ``stop.wait()`` with no timeout, where CPython never ran the
    Python handler. ``wait_for_stop`` wakes the main thread so that it does; with
    ``stop.wait()`` in its place this script never ends (the timeout is a hang guard only)."""
    done = subprocess.run([sys.executable, "-c", _SIGNAL_TO_ANOTHER_THREAD], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL,
                          preexec_fn=sigint_default)
    assert (done.returncode, done.stdout) == (0, "stopped\n"), done.stderr


def test_commands_run_one_after_another_share_one_signal_relay():
    """Five commands in one process (a test, a notebook) each install the handlers: one relay
    thread serves them all, and a signal sets the newest command's event. Each once left a
    thread blocked on its own pipe for good."""
    import os
    import threading

    from kvscope.signals import stop_on_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        stops = [threading.Event() for _ in range(5)]
        for stop in stops:
            stop_on_signals(stop)
        relays = [t for t in threading.enumerate() if t.name == "kvscope-signals"]
        assert len(relays) == 1
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops[-1].wait(5) and not any(stop.is_set() for stop in stops[:-1])
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


_SIGNAL_ROUTES = r'''
import os, signal, sys, threading, time
from kvscope.signals import stop_on_signals

first, second = threading.Event(), threading.Event()
stop_on_signals(first)
os.kill(os.getpid(), signal.SIGTERM)  # meant for the first command, which then ends
stop_on_signals(second)               # another way as the next one starts
assert first.wait(5) and not second.wait(0.5), "(a) the signal went to the next command"
parent = threading.Event()
stop_on_signals(parent)
pid = os.fork()
if pid == 0:  # a forked child that runs a command of its own
    child = threading.Event()
    stop_on_signals(child)
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(0 if child.wait(5) else 3)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
assert code == 0, f"(b) the child's command did not stop: exit {code}"
assert not parent.wait(0.5), "(b) the child's signal stopped the parent's command"
print("ok")
'''


def test_a_signal_stops_the_command_it_came_for_in_its_own_process():
    """(a) A SIGTERM comes for one command, which ends another way before the signal thread
    reads it, and the next command starts: the first's event is set, not the next one's. (b) A
    forked child running a command of its own: its SIGTERM stops the child's command (the
    child had no signal thread) and not the parent's (the child wrote into the parent's pipe)."""
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_ROUTES], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_sighup_ignored_at_start_stays_ignored():
    """``nohup kvscope agent``: the agent must outlive its terminal, as nohup asked."""
    import os
    import threading

    from kvscope.signals import stop_on_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        stop = threading.Event()
        stop_on_signals(stop)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)
        assert not stop.wait(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


_CTRL_C_WHILE_THE_DEMO_STARTS = r'''
import os, signal, sys
import kvscope.demo as demo
from kvscope.cli import main

serve_dashboard = demo.serve_dashboard
def ctrl_c_first(*args, **kwargs):  # Ctrl-C after the agent started, before the dashboard
    os.kill(os.getpid(), signal.SIGINT)
    return serve_dashboard(*args, **kwargs)
demo.serve_dashboard = ctrl_c_first
sys.exit(main(["demo", "--metrics-port", sys.argv[1], "--ui-port", sys.argv[2],
               "--duration", "600"]))
'''


def test_ctrl_c_while_the_demo_starts_stops_it_cleanly():
    """The demo once handled Ctrl-C only once its servers were up: before, it exited 130 with
    "interrupted", where the README promises exit code 0. A stop during the start now lets the
    start finish and stops at once (well before ``--duration``)."""
    done = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_THE_DEMO_STARTS,
                           str(free_port()), str(free_port())], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, preexec_fn=sigint_default)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kvscope demo: stopped after" in done.stdout, done.stdout


def test_ctrl_c_while_the_commands_are_loaded_is_an_interruption(monkeypatch, capsys):
    """Building the parser imports every command's module (a quarter of a second); Ctrl-C
    then printed the import machinery's traceback."""
    import kvscope.cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(kvscope.cli, "_parser", interrupted)
    assert kvscope.cli.main(["demo"]) == 130
    assert capsys.readouterr().err == "kvscope: interrupted\n"


_SIGINT_TWICE = r'''
import os, signal, threading
from kvscope.signals import ignore_signals_while_exiting, stop_on_signals

for command in range(2):  # two commands one after the other, as in a notebook
    stop = threading.Event()
    stop_on_signals(stop)
    os.kill(os.getpid(), signal.SIGINT)
    print("stopped" if stop.wait(0.5) else "ignored")
    ignore_signals_while_exiting()
'''


@pytest.mark.parametrize("started_ignoring", [True, False], ids=["background", "foreground"])
def test_a_sigint_ignored_at_start_stays_ignored(started_ignoring):
    """A shell script's background job (``kvscope demo &``) starts with SIGINT ignored, so that
    Ctrl-C stops the script's foreground command alone: the commands once installed their
    handler over it, and Ctrl-C stopped the demo too. Started normally, each command of a
    process handles SIGINT, also after the one before it ignored signals while exiting."""
    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    done = subprocess.run([sys.executable, "-c", _SIGINT_TWICE], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL,
                          preexec_fn=ignore_sigint if started_ignoring else sigint_default)
    expected = "ignored" if started_ignoring else "stopped"
    assert (done.returncode, done.stdout.split()) == (0, [expected] * 2), done.stderr


@pytest.mark.parametrize("where", ["file", "environment"])
def test_a_negative_budget_is_one_line_naming_the_key(tmp_path, monkeypatch, where):
    """The new-user trial: ``budgets = {cpu = -5}`` ended in the host collector's traceback
    (exit code 1); like ``reserve_bytes = -1`` it is one line naming the key, exit code 2."""
    args = ["agent", "--port", str(free_port()), "--ingest", f"ipc://{tmp_path}/ingest.sock"]
    if where == "file":
        (tmp_path / "agent.toml").write_text("[collectors.host]\nbudgets = { cpu = -5 }\n")
        args += ["--config", str(tmp_path / "agent.toml")]
        needle = "collectors.host.budgets.cpu: Input should be greater than or equal to 0"
    else:
        monkeypatch.setenv("KVSCOPE_COLLECTORS__HOST__BUDGETS", '{"cpu": -5}')
        needle = "KVSCOPE_COLLECTORS__HOST__BUDGETS: Input should be greater than or equal to 0"
    _one_error_line(_kvscope(*args), needle)


def test_a_bad_kvscope_variable_stops_the_demo_with_one_line(monkeypatch):
    """The demo's agent reads KVSCOPE_* too; a value that does not parse ended in pydantic's
    ValidationError traceback (exit code 1), where ``kvscope agent`` says one line."""
    monkeypatch.setenv("KVSCOPE_CAPTURE_MAX_BYTES", "abc")
    _one_error_line(_kvscope("demo", "--duration", "1", "--metrics-port", str(free_port()),
                             "--ui-port", str(free_port())),
                    "environment: KVSCOPE_CAPTURE_MAX_BYTES: Input should be a valid integer")


def _agent_banner(tmp_path, config: str, *args: str, last: str = "  kv_events:") -> list[str]:
    """The lines ``kvscope agent --config`` prints when it starts, up to the one starting with
    ``last`` (then it is stopped)."""
    (tmp_path / "agent.toml").write_text(config)
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "agent", "--port", str(free_port()),
                             "--ingest", f"ipc://{tmp_path}/ingest.sock",
                             "--config", str(tmp_path / "agent.toml"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, preexec_fn=sigint_default)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(last) or "error" in line:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    return lines


@pytest.mark.parametrize("endpoint,action,vllm", [
    # the new-user trial: "tcp://*:5582" here and "tcp://127.0.0.1:5582" in vLLM: both connected
    ("tcp://*:{port}", "connects to tcp://127.0.0.1:{port}", '"tcp://*:{port}"'),
    ("tcp://127.0.0.1:{port}", "binds tcp://127.0.0.1:{port}", '"tcp://127.0.0.1:{port}"'),
])
def test_agent_banner_says_whether_kv_events_bind_or_connect(tmp_path, endpoint, action, vllm):
    """vLLM binds ``*``/``::``/ipc endpoints and connects to the rest; the agent does the
    opposite. The banner names the endpoint, what the agent does with it and the vLLM
    ``--kv-events-config`` endpoint that pairs with it, so a bind/connect mismatch shows."""
    port = free_port()
    endpoint, action, vllm = (s.format(port=port) for s in (endpoint, action, vllm))
    lines = _agent_banner(tmp_path, f'[kv_events]\nenabled = true\nendpoint = "{endpoint}"\n'
                                    'tiers = ["gpu"]\n')
    kv = [line for line in lines if line.startswith("  kv_events:")]
    assert len(kv) == 1, lines
    assert kv[0].startswith(f"  kv_events: vLLM: {endpoint} -> {action}: vLLM must "), kv[0]
    assert f"--kv-events-config endpoint must be {vllm}" in kv[0]
    assert ("must bind" if "*" in endpoint else "must connect") in kv[0]
    assert kv[0].endswith("reports tiers gpu")


def test_agent_banner_without_kv_events_has_no_kv_events_line(tmp_path):
    lines = _agent_banner(tmp_path, "[kv_events]\nenabled = false\n", "--store-dir",
                          str(tmp_path / "store"), last="  store:")  # the banner's last line
    assert lines[-1].startswith("  store:") and not any("kv_events" in line for line in lines)


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("::1", True),
                                           ("localhost", True), ("0.0.0.0", False),
                                           ("10.1.2.3", False), ("node-7", False)])
def test_the_agent_warns_about_an_open_api_only_off_loopback(host, loopback):
    """Without a token the banner warns when the agent listens beyond loopback (a host name
    may resolve to anything, so it counts as beyond)."""
    from kvscope.argtypes import is_loopback

    assert is_loopback(host) is loopback


@pytest.mark.parametrize("endpoint,reachable", [
    ("tcp://127.0.0.1:5560", False), ("tcp://[::1]:5560", False), ("ipc:///run/k.sock", False),
    ("tcp://*:5560", True), ("tcp://0.0.0.0:5560", True), ("tcp://[::]:5560", True),
    ("tcp://10.1.2.3:5560", True)])
def test_the_agent_warns_about_an_ingest_endpoint_other_hosts_reach(endpoint, reachable):
    """ZMQ ingest has no authentication: the banner warns when other hosts can reach it."""
    from kvscope.service.run import _reachable_off_host

    assert _reachable_off_host(endpoint) is reachable


def test_a_misspelt_top_level_flag_is_named():
    """Before, `kvscope --hepl` said a COMMAND was required, as if nothing had been typed."""
    _one_error_line(_kvscope("--hepl"), "unrecognized arguments: --hepl")


def test_banner_urls_put_an_ipv6_host_in_brackets():
    from kvscope.service.server import PortInUse, address, bind, url

    assert url("::1", 9400, "/metrics") == "http://[::1]:9400/metrics"
    assert url("127.0.0.1", 8050) == "http://127.0.0.1:8050/"
    # and so do the warnings and errors: "--host ::" was warned about as ":::9412"
    assert address("::", 9412) == "[::]:9412" and address("0.0.0.0", 1) == "0.0.0.0:1"
    with socket.socket(socket.AF_INET6) as taken:
        try:
            taken.bind(("::1", 0))
        except OSError:
            pytest.skip("this machine has no IPv6 loopback")
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"cannot listen on \[::1\]:{port}: "):
            bind("::1", port, "--port")


def test_a_demo_behind_its_schedule_warns_once_and_says_whose_warning_it_is():
    """At speed 100,000 the synthetic workload's arrivals (20 a second) come faster than
    any engine serves them: after 5 s behind, one warning, in the agent's log format (it came
    out as a bare line that did not say it was kvscope's), and the demo runs on."""
    result = _kvscope("demo", "--speed", "100000", "--duration", "9",
                      "--metrics-port", str(free_port()), "--ui-port", str(free_port()))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "behind" in line]
    assert len(warnings) == 1
    assert re.fullmatch(r"\S+ \S+ WARNING kvscope\.engine\.replay: \d+ s behind the "
                        r"workload's schedule at speed 100000 .*; lower --speed", warnings[0])
    assert result.stdout.splitlines()[-1].startswith("kvscope demo: stopped after ")


def test_demo_says_when_its_trace_has_played_out(tmp_path):
    """Three requests at speed 1000 play out in milliseconds; the demo says so (and how many)
    and stays up until its duration, where it once fell silent; stopping, it says what it left
    behind (its capture, or nothing). Its capture directory is then refused to a second run."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(f'{{"timestamp": {i * 10}, "input_length": 1024, '
                            f'"output_length": 1, "hash_ids": [1, 2]}}\n' for i in range(3)))
    result = _kvscope("demo", "--trace", str(path), "--speed", "1000", "--duration", "4",
                      "--metrics-port", str(free_port()), "--ui-port", str(free_port()),
                      "--capture-dir", str(tmp_path / "cap"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # it says where it captures (a new user could not tell)
    assert f"  capture:         {tmp_path / 'cap'} (kvscope analyze / kvscope compare read it)" \
        in lines
    assert "the workload has played out (3 requests)" in lines[-2]
    assert lines[-2].endswith("stay up until Ctrl-C or 4 s from the start")
    assert "  stop with Ctrl-C (or after 4 s)" in lines
    # and what it left behind, again at the end (the banner has long scrolled away)
    assert lines[-1] == ("kvscope demo: stopped after 3 requests; its capture is in "
                         f"{tmp_path / 'cap'}")
    # a background job of a script ignores SIGINT: Ctrl-C cannot stop it, kill (SIGTERM) can
    result = _kvscope("demo", "--trace", str(path), "--speed", "1000", "--duration", "2",
                      "--metrics-port", str(free_port()), "--ui-port", str(free_port()),
                      sigint=signal.SIG_IGN)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    stop = [line for line in lines if line.startswith("  stop with ")]
    assert len(stop) == 1 and re.fullmatch(r"  stop with kill \d+ \(or after 2 s\)", stop[0])
    pid = stop[0].split()[3]
    assert lines[-2].endswith(f"stay up until kill {pid} or 2 s from the start")
    assert lines[-1].endswith(" requests; nothing kept (--capture-dir DIR records a run)")
    # a second run into that directory: analyze and compare would read both runs as one
    _one_error_line(_kvscope("demo", "--trace", str(path), "--duration", "1", "--metrics-port",
                             str(free_port()), "--ui-port", str(free_port()), "--capture-dir",
                             str(tmp_path / "cap")), "segments of an earlier run")
    # The agent's KVSCOPE_CAPTURE_DIR captures the demo's run too: it says so, as for the flag,
    # and refuses a second run there (it had said "nothing kept" and added a second run).
    env = {**os.environ, "KVSCOPE_CAPTURE_DIR": str(tmp_path / "env-cap")}
    result = _kvscope("demo", "--trace", str(path), "--speed", "1000", "--duration", "2",
                      "--metrics-port", str(free_port()), "--ui-port", str(free_port()), env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (f"  capture:         {tmp_path / 'env-cap'} (KVSCOPE_CAPTURE_DIR) (kvscope analyze "
            "/ kvscope compare read it)") in lines
    assert lines[-1] == ("kvscope demo: stopped after 3 requests; its capture is in "
                         f"{tmp_path / 'env-cap'}")
    _one_error_line(_kvscope("demo", "--trace", str(path), "--duration", "1", "--metrics-port",
                             str(free_port()), "--ui-port", str(free_port()), env=env),
                    f"KVSCOPE_CAPTURE_DIR {tmp_path / 'env-cap'} holds", "of an earlier run")


@pytest.mark.parametrize("requests", [0, 1])
def test_a_demo_run_that_finished_no_request_leaves_its_capture_directory_empty(tmp_path,
                                                                              requests):
    """A demo stopped before its first request finished (Ctrl-C a second in) left a tiers
    segment alone in its capture: the next demo refused the directory as an earlier run's,
    and analyze and compare read no request from it. Its segments now go, and its last line
    says so; a capture with a request stays."""
    from kvscope.agent.capture import CaptureWriter, finished_segments
    from kvscope.agent.requests import RequestRecord
    from kvscope.demo import settle_capture

    capture = tmp_path / "cap"
    writer = CaptureWriter(capture)
    writer.start()
    writer.add_sample({"ts": time.time(), "transfer_bytes": {}, "transfer_blocks": {},
                       "transfer_seconds_sum": {}, "tier_capacity_bytes": {"gpu": 4096},
                       "tier_capacity_blocks": {"gpu": 1}})
    for i in range(requests):
        writer.add_request(RequestRecord(f"r{i}", "ab" * 16, "engine", time.time(),
                                         prompt_tokens=8, finished=time.time() + 1))
    writer.shutdown()
    assert finished_segments(capture, "tiers")
    said = settle_capture(capture)
    if requests:
        assert said == f"; its capture is in {capture}" and finished_segments(capture, "tiers")
    else:
        assert said == f"; nothing captured (no request finished), {capture} left empty"
        assert finished_segments(capture) == []


def test_a_demo_whose_capture_lost_rows_says_so_and_exits_1(tmp_path):
    """A demo capturing onto a disk that fills (a real 64 KiB tmpfs: 5 s of the synthetic
    workload write some hundred thousand rows) logged the loss but exited 0, so a script
    analysing the capture next took it for the whole run. It now ends with exit code 1 and
    one error line naming the rows lost; on a disk with room it exits 0 (the test above)."""
    with tmpfs(tmp_path / "cap", "size=64k") as capture:
        result = _kvscope("demo", "--duration", "5", "--speed", "50", "--metrics-port",
                          str(free_port()), "--ui-port", str(free_port()), "--capture-dir",
                          str(capture))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"kvscope demo: error: the capture lost [1-9]\d* rows it could not "
                        rf"write \(see the capture's lines above\); {re.escape(str(capture))} "
                        r"holds only the segments written whole", last), last
    assert "No space left on device" in result.stderr
    assert result.stdout.splitlines()[-1].startswith("kvscope demo: stopped after ")


def test_a_capture_directory_being_written_is_refused_to_a_second_writer(tmp_path):
    """Two demos into one --capture-dir at once were both accepted and wrote one capture of
    both runs (every request twice, read by analyze as reuse). While an agent writes there,
    a demo and a second agent are each refused in one line; once it stopped, the directory
    is free (a demo then says its segments are an earlier run's: that refusal is its own)."""
    from kvscope.agent.capture import CaptureWriter

    capture = tmp_path / "cap"
    proc, _ = _started_agent("--capture-dir", str(capture), ingest=f"ipc://{tmp_path}/a.sock",
                             stderr=subprocess.DEVNULL)
    said = (f"cannot start capture_dir {capture}: in use by another kvscope capture (an agent "
            "or demo writing to it now): give each its own directory")
    try:
        _one_error_line(_kvscope("demo", "--duration", "1", "--metrics-port", str(free_port()),
                                 "--ui-port", str(free_port()), "--capture-dir", str(capture)),
                        said)
        _one_error_line(_kvscope("agent", "--port", str(free_port()), "--ingest",
                                 f"ipc://{tmp_path}/b.sock", "--capture-dir", str(capture)), said)
    finally:
        proc.terminate()
        proc.wait(30)
    again = CaptureWriter(capture)
    again.start()
    again.shutdown()


def test_the_agents_start_lines_name_every_part_it_runs(tmp_path):
    """The start lines say where each configured part reads or writes: vLLM's metrics URL,
    the OTLP receiver and exporter, the store and the capture (they once named only ingest,
    kv_events and the store)."""
    config = tmp_path / "agent.toml"
    config.write_text(f'otlp_endpoint = "http://127.0.0.1:{free_port()}"\n'
                      f'capture_dir = "{tmp_path / "capture"}"\n'
                      f'[vllm_metrics]\nenabled = true\nurl = "http://127.0.0.1:{free_port()}/metrics"\n'
                      '[otlp_receiver]\nenabled = true\n')
    proc, lines = _started_agent("--config", str(config), ingest=f"ipc://{tmp_path}/ingest.sock",
                                 stderr=subprocess.DEVNULL)
    try:
        proc.send_signal(signal.SIGTERM)
        lines += proc.stdout.readlines()
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    parts = {line.split(":", 1)[0].strip() for line in lines if line.startswith("  ")}
    assert {"ingest", "vllm_metrics", "otlp receiver", "capture", "otlp export"} <= parts, lines
    export = next(line for line in lines if line.startswith("  otlp export: "))
    assert export.rstrip().endswith("/v1/traces")
