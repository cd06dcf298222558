"""The ``kvscope`` command line."""

from __future__ import annotations

import argparse
import os
import re
import sys

from kvscope import __version__
from kvscope.argtypes import (directory, host, http_url, label_matchers, port,
                               path, positive, prometheus_duration, proportion,
                               token_count)
from kvscope.engine.options import add_engine_arguments
from kvscope.engine.presets import PRESETS, UnknownPreset
from kvscope.engine.workload import TraceError
from kvscope.signals import ignore_signals_while_exiting, stop_on_signals, wait_for_stop


class _Parser(argparse.ArgumentParser):
    """argparse with one error line, like every other bad input (argparse's own prints its
    whole usage block above it)."""

    _args: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._args = list(sys.argv[1:] if args is None else args)  # for error()'s hint
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        hint = ""
        missing = re.fullmatch(r"argument (--[\w-]+)(?:/\S+)?: expected one argument", message)
        if missing and (value := _after(self._args, missing[1])).startswith("-"):
            # argparse takes a value like -5% for an option: only with '=' is it a value
            hint = f"; a value that starts with '-' goes after '=': {missing[1]}={value}"
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")


def _after(args: list[str], option: str) -> str:
    """The argument after the last ``option`` in ``args`` ("" if none)."""
    return next((args[i + 1] for i in range(len(args) - 2, -1, -1) if args[i] == option), "")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvscope", description="Observability for KV-cache offload in LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(commands=sub.choices)  # each command's parser, for main()'s errors

    demo = sub.add_parser(
        "demo", help="run the reference engine on a workload with the agent and the dashboard",
        description="Replay a workload (built-in synthetic by default, or a Mooncake JSONL trace) "
                    "through the reference offload engine, with the agent's /metrics and API and "
                    "the dashboard, on loopback unless --host says otherwise. Stops on Ctrl-C, "
                    "SIGTERM or SIGHUP, "
                    "or after --duration.")
    demo.add_argument("--duration", type=positive(float), metavar="SECONDS",
                      help="stop after this many seconds (default: run until Ctrl-C)")
    demo.add_argument("--trace", metavar="FILE", type=path("for the built-in workload"),
                      help="Mooncake JSONL trace to replay "
                      "(default: the built-in synthetic workload)")
    demo.add_argument("--host", type=host, default="127.0.0.1", help="address to listen on (default %(default)s)")
    demo.add_argument("--metrics-port", type=port, default=9400, metavar="PORT",
                      help="port of /metrics and the HTTP API (default %(default)s)")
    demo.add_argument("--ui-port", type=port, default=8050, metavar="PORT", help="port of the dashboard (default %(default)s)")
    add_engine_arguments(demo)
    demo.add_argument("--speed", type=positive(float), default=1.0,
                      help="workload seconds per wall second (default %(default)s)")
    demo.add_argument("--seed", type=int, help="seed of the synthetic workload (default 0)")
    demo.add_argument("--one-off-share", type=proportion, metavar="SHARE",
                      help="share of the synthetic workload's prompts that are unique one-offs, "
                           "never reused (0: none, 1: all of them; default 0.25)")
    demo.add_argument("--insecure", action="store_true",
                      help="with a --host beyond loopback and no KVSCOPE_TOKEN: serve the API "
                           "and the dashboard to anyone who reaches them (otherwise refused)")
    demo.add_argument("--capture-dir", metavar="DIR", type=directory("not to capture"),
                      help="capture block accesses and requests here as Parquet for kvscope "
                      "analyze/compare; a directory without an earlier run's capture in it: "
                      "one run per capture (default: off). Exit code 1 when the capture lost "
                      "rows it could not write (a full disk)")
    _add_capture_root(demo, "--capture-dir's only: to compare this run with an earlier one, "
                            "give the directory holding that one's")

    agent = sub.add_parser(
        "agent", help="run the node agent (ingest, collectors, /metrics, HTTP API)",
        description="Run the node agent: receive events from taps, read host and GPU collectors, "
                    "serve /metrics and the HTTP API. Every flag has a key in the --config TOML "
                    "file and a KVSCOPE_* environment variable; the bearer token for /api is "
                    "set only there (token, KVSCOPE_TOKEN), never on the command line.",
        epilog="Engines are read by sources, each a table of the --config file, off unless "
               "enabled there ([ingest], for kvscope's taps, and [otlp_receiver], for request "
               "spans at /v1/traces, are on): [kv_events] (vLLM's or SGLang's KV events), "
               "[vllm_metrics], [sglang_metrics], [lmcache_metrics], [kvbm_metrics] (Dynamo "
               "KVBM), [trtllm] (trtllm-serve); the collectors are [collectors.host], "
               "[collectors.gpu], [collectors.numa], [collectors.engine_args]. Every key: "
               "docs/agent.md; each engine's setup: docs/vllm.md and docs/engines.md.")
    agent.add_argument("--config", metavar="FILE", type=path("for the defaults"),
                       help="TOML configuration file")
    agent.add_argument("--host", type=host, help="address to listen on (default 127.0.0.1)")
    agent.add_argument("--port", type=port, help="port of /metrics and the API (default 9400)")
    agent.add_argument("--ingest", metavar="ENDPOINT",
                       help="ZMQ endpoint taps send to (ingest is on by default, at "
                            "tcp://127.0.0.1:5560; ipc:// too); turns ingest on even where the "
                            "config turns it off")
    agent.add_argument("--store-dir", metavar="DIR",
                       type=directory("to keep requests in memory only"),
                       help="persist finished requests here (default: memory only)")
    agent.add_argument("--otlp-endpoint", metavar="URL",
                       help="export request spans to this OTLP/HTTP traces URL")
    agent.add_argument("--capture-dir", metavar="DIR", type=directory("not to capture"),
                       help="capture block accesses and finished requests here as Parquet "
                       "segments for kvscope analyze/compare (default: off; bounded by "
                       "capture_max_bytes, 1 GiB)")
    agent.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                       help="least severe log lines shown on stderr (default info)")

    dash = sub.add_parser("dashboard", help="serve the dashboard for a running agent",
                          description="Serve the Dash dashboard, reading a running agent's "
                          "HTTP API (with the agent's token from KVSCOPE_TOKEN, when it has one).")
    dash.add_argument("--api", type=http_url, default="http://127.0.0.1:9400", metavar="URL",
                      help="agent base URL (default %(default)s)")
    dash.add_argument("--host", type=host, default="127.0.0.1", help="address to listen on (default %(default)s)")
    dash.add_argument("--port", type=port, default=8050, help="port (default %(default)s)")
    dash.add_argument("--insecure", action="store_true",
                      help="with a --host beyond loopback and no KVSCOPE_TOKEN: serve the "
                           "dashboard to anyone who reaches it (otherwise refused; with the "
                           "token, visitors open it as /?token=TOKEN)")
    _add_capture_root(dash, "none, the page reads nothing")
    dash.add_argument("--refresh", type=positive(float), default=2.0, metavar="SECONDS",
                      help="seconds between refreshes (default %(default)s)")
    dash.add_argument("--window", type=positive(float), default=900.0, metavar="SECONDS",
                      help="seconds of history drawn (default %(default)s)")
    dash.add_argument("--backend", choices=("agent", "prometheus"), default="agent",
                      help="read one agent's API, or a Prometheus server for a fleet "
                      "(default %(default)s)")
    dash.add_argument("--prometheus", type=http_url, default="http://127.0.0.1:9090",
                      metavar="URL",
                      help="Prometheus base URL for --backend prometheus (default %(default)s)")
    dash.add_argument("--prometheus-selector", type=label_matchers, default="",
                      metavar="MATCHERS",
                      help='label matchers added to every query, e.g. job="kvscope"')
    dash.add_argument("--prometheus-rate-window", type=prometheus_duration, default="1m",
                      metavar="DURATION",
                      help="range of rate() in the queries (default %(default)s): at least "
                      "twice Prometheus's scrape interval, or rates read no traffic (4 times, "
                      "as Grafana's $__rate_interval, is safe); 4m for its default of 1m")
    dash.add_argument("--sizing-trace", metavar="PATH", type=path("to size nothing"),
                      help="trace to analyse for the Sizing page: Mooncake JSONL, or an "
                      "agent's capture directory (kvscope analyze reads the same)")
    dash.add_argument("--sizing-preset", default="llama-3-8b", choices=sorted(PRESETS),
                      help="model preset for the Sizing analysis (default %(default)s)")
    dash.add_argument("--sizing-gpu-tokens", type=token_count, metavar="TOKENS",
                      help="GPU prefix-cache capacity in tokens for the Sizing analysis (vLLM "
                      "logs it as 'GPU KV cache size'; default: a capture's gpu tier as its "
                      "engine reported it, else 0: none)")

    from kvscope.analysis.command import add_arguments as add_analyze_arguments

    add_analyze_arguments(sub.add_parser(
        "analyze", help="reuse, miss-ratio curves and CPU tier sizing for a trace",
        description="Analyze a block-access trace (Mooncake JSONL, or an agent capture "
                    "directory or .parquet segment): reuse statistics, exact LRU "
                    "and SHARDS miss-ratio curves, ARC by miniature simulation, and CPU tier "
                    "sizing advice for a model preset."))

    from kvscope.engine.replay_cmd import add_parser as add_replay_parser

    add_replay_parser(sub)

    from kvscope.analysis.compare_cmd import DESCRIPTION as COMPARE_DESCRIPTION
    from kvscope.analysis.compare_cmd import add_arguments as add_compare_arguments

    add_compare_arguments(sub.add_parser(
        "compare", help="compare two captures: TTFT/ITL with CIs and a rollback verdict",
        description=COMPARE_DESCRIPTION))

    from kvscope.rollout.command import add_arguments as add_rollout_arguments

    add_rollout_arguments(sub.add_parser(
        "rollout", help="baseline vs candidate servers under a load generator: tails per "
        "concurrency level, hit quality, cost and a verdict"))

    docs = sub.add_parser("docs-metrics", help="write docs/metrics.md from the metric catalog",
                          description="Write the metric reference (every metric, its labels and "
                          "meaning) from kvscope's metric catalog: for kvscope's developers, run "
                          "from the repository root after changing the catalog.")
    docs.add_argument("--output", default="docs/metrics.md", metavar="FILE",
                      type=path("for docs/metrics.md"),
                      help="file to write, relative to the current directory (default "
                           "%(default)s)")
    return parser


def _add_capture_root(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--capture-root", metavar="DIR", action="append", default=[],
                        type=directory("for a Compare page that reads nothing"),
                        help="a directory whose captures and rollout reports the dashboard's "
                             f"Compare page may read (repeatable; default: {default})")


def _check_capture_roots(roots: list[str]) -> None:
    """Raise ConfigError for a ``--capture-root`` that is not a directory."""
    from kvscope.agent.config import ConfigError

    for root in roots:
        if not os.path.isdir(root):
            raise ConfigError(f"--capture-root {root} is not a directory: give the directory "
                              "holding the captures or rollout reports the Compare page may read")


def _demo(args) -> int:
    from kvscope.demo import DemoConfig, run_demo

    _check_capture_roots(args.capture_root)
    _synthetic_only(args, "--seed", "--one-off-share")
    config = DemoConfig(duration=args.duration, trace=args.trace, host=args.host,
                        metrics_port=args.metrics_port, ui_port=args.ui_port, preset=args.preset,
                        gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks,
                        disk_blocks=args.disk_blocks, disk_dir=args.disk_dir,
                        policy=args.policy, speed=args.speed,
                        seed=DemoConfig.seed if args.seed is None else args.seed,
                        one_off_share=DemoConfig.one_off_share if args.one_off_share is None
                        else args.one_off_share,
                        capture_dir=args.capture_dir, capture_roots=tuple(args.capture_root),
                        dashboard_token=_visitor_token(
                            args.host, args.insecure,
                            "the demo's dashboard (and, without a token, its API) has"))
    return run_demo(config)


def agent_settings(args):
    """The agent's settings from ``kvscope agent`` arguments: each flag overrides its config
    key (raises ConfigError)."""
    from kvscope.agent.config import load_settings

    return load_settings(args.config, host=args.host, port=args.port,
                         store_dir=args.store_dir, otlp_endpoint=args.otlp_endpoint,
                         capture_dir=args.capture_dir, log_level=args.log_level,
                         **{"ingest.endpoint": args.ingest,  # turns ingest on, as asked
                            "ingest.enabled": True if args.ingest else None})


def _agent(args) -> int:
    from kvscope.service.run import run_agent

    return run_agent(agent_settings(args))


def _token() -> str | None:
    """The agent's token, as the agent takes it (KVSCOPE_TOKEN; never a flag, which ps would
    show); raises ConfigError when the agent would refuse it."""
    from kvscope.agent.config import ConfigError, token_problem

    token = os.environ.get("KVSCOPE_TOKEN") or None
    if token is not None and (problem := token_problem(token)):
        raise ConfigError(f"KVSCOPE_TOKEN {problem}")
    return token


def _visitor_token(host: str, insecure: bool, what: str = "the dashboard has") -> str | None:
    """The token a dashboard listening on ``host`` demands of its visitors: None on loopback,
    else KVSCOPE_TOKEN (None with ``--insecure`` and no token). Raises ConfigError beyond
    loopback without a token and without ``--insecure`` (``what``: the subject of its
    message)."""
    from kvscope.agent.config import ConfigError
    from kvscope.argtypes import is_loopback

    if is_loopback(host):
        return None
    token = _token()
    if token is None and not insecure:
        raise ConfigError(f"--host {host} listens beyond loopback, and {what} no "
                          "authentication of its own: set KVSCOPE_TOKEN (visitors open it as "
                          "/?token=TOKEN), or pass --insecure to serve it to anyone who "
                          "reaches it")
    return token


def _dashboard(args) -> int:
    import threading

    from kvscope.dashboard.app import create_app, serve
    from kvscope.service.server import address, url

    backend = None
    if args.backend == "prometheus":
        from kvscope.dashboard.prometheus import PrometheusBackend

        backend = PrometheusBackend(args.prometheus, selector=args.prometheus_selector,
                                    rate_window=args.prometheus_rate_window)
    if args.sizing_trace:  # and a trace it cannot read (it is read in the background)
        from kvscope.analysis.inputs import trace_reader

        trace_reader(args.sizing_trace)
    visitors = _visitor_token(args.host, args.insecure)
    _check_capture_roots(args.capture_root)
    stop = threading.Event()
    stop_on_signals(stop)  # before serving: a stop signal as it starts is a clean stop too
    handle = serve(create_app(args.api, refresh_seconds=args.refresh, window_seconds=args.window,
                              backend=backend, sizing_trace=args.sizing_trace,
                              sizing_preset=args.sizing_preset,
                              sizing_gpu_tokens=args.sizing_gpu_tokens, token=_token(),
                              capture_roots=args.capture_root, require_token=visitors),
                   args.host, args.port)
    source = args.prometheus if backend is not None else args.api
    print(f"kvscope dashboard: {url(args.host, args.port)}"
          + ("?token=<KVSCOPE_TOKEN>" if visitors else "")
          + f" reading {args.backend} {source}", flush=True)
    if args.capture_root:
        print(f"  compare page reads under: {', '.join(args.capture_root)}", flush=True)
    from kvscope.argtypes import is_loopback

    if visitors is None and not is_loopback(args.host):
        print(f"  warning: open to anyone who reaches {address(args.host, args.port)} "
              "(--insecure)", flush=True)
    wait_for_stop(stop)
    handle.shutdown()
    print("kvscope dashboard: stopped", flush=True)  # as the demo and the agent say it
    ignore_signals_while_exiting()
    return 0


def _docs_metrics(args) -> int:
    from kvscope.catalog import render_markdown
    from kvscope.files import write_atomic

    try:
        write_atomic(args.output, render_markdown())
    except OSError as exc:
        print(f"kvscope docs-metrics: error: cannot write {args.output}: "
              f"{exc.strerror or exc} (run it from the repository root, or give --output FILE)",
              file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


def _analyze(args) -> int:
    from kvscope.analysis.command import run

    return run(args)


def _compare(args) -> int:
    from kvscope.analysis.compare_cmd import run

    return run(args)


def _rollout(args) -> int:
    from kvscope.rollout.command import run

    return run(args)


def _replay(args) -> int:
    from kvscope.engine.replay_cmd import run

    _synthetic_only(args, "--seed")
    return run(args)


def _synthetic_only(args, *flags: str) -> None:
    """A usage error (exit 2) for ``flags`` of the synthetic workload given beside --trace,
    which replays the trace as it is (they were ignored unsaid)."""
    given = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) is not None]
    if args.trace and given:
        args.commands[args.command].error(
            f"{' and '.join(given)} shape{'s' * (len(given) == 1)} the synthetic workload; "
            f"--trace replays the trace as it is: leave {' and '.join(given)} out")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (2 for bad input, with one line on stderr)."""
    for name in ("stdout", "stderr"):  # closed (cmd >&-): Python has None there; write nowhere
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 (for the process's life)
    try:
        parser = _parser()  # imports the commands' modules (pydantic...): a quarter of a second
    except KeyboardInterrupt:  # Ctrl-C meanwhile printed the import's traceback
        print("kvscope: interrupted", file=sys.stderr)
        return 130
    first = (sys.argv[1:] if argv is None else argv)[:1]
    if first and first[0].startswith("-") and first[0] not in ("-h", "--help", "--version"):
        parser.error(f"unrecognized arguments: {first[0]}")  # else: "COMMAND is required"
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser, so that it names `kvscope COMMAND --help`
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    handler = {"demo": _demo, "agent": _agent, "dashboard": _dashboard,
               "docs-metrics": _docs_metrics, "analyze": _analyze, "replay": _replay,
               "compare": _compare, "rollout": _rollout}[args.command]
    prog = args.commands[args.command].prog  # "kvscope demo", as argparse's errors say
    try:
        # imported here, inside the try: a quarter of a second, and Ctrl-C meanwhile is an
        # interruption like any other (it printed the import's traceback)
        from kvscope.agent.config import ConfigError
        from kvscope.engine.engine import EngineConfigError

        code = handler(args)
        sys.stdout.flush()  # now: flushed at exit, a reader gone would end it with 120
        return code
    except KeyboardInterrupt:  # Ctrl-C in a command that has no clean stop of its own
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of the output left (| head): it read what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    except (TraceError, ConfigError, EngineConfigError, UnknownPreset, OSError) as exc:
        message = exc.args[0] if isinstance(exc, UnknownPreset) else str(exc)
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
