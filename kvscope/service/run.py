"""``kvscope agent``: the node agent as a foreground process (stops on SIGINT, SIGTERM or
SIGHUP)."""

from __future__ import annotations

import logging
import sys
import threading

from kvscope.agent.config import AgentSettings, weak_token
from kvscope.agent.sources import REGISTRY as SOURCES
from kvscope.argtypes import is_loopback
from kvscope.service.agent import Agent
from kvscope.service.api import create_app
from kvscope.service.server import ApiServer, bind, raise_open_files_limit, url
from kvscope.signals import ignore_signals_while_exiting, stop_on_signals, wait_for_stop


def _reachable_off_host(endpoint: str) -> bool:
    """Whether a ZMQ endpoint the agent binds takes connections from other hosts: ``tcp://`` on
    ``*`` or an address that is not loopback (``ipc://`` is a local socket file)."""
    if not endpoint.startswith("tcp://"):
        return False
    return not is_loopback(endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]"))


def log_to_stderr(level: str) -> None:
    """Show kvscope's own log lines from ``level`` up on stderr; other libraries keep Python's
    default (warnings and worse, unformatted)."""
    logger = logging.getLogger("kvscope")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def run_agent(settings: AgentSettings, out=sys.stdout, stop: threading.Event | None = None) -> int:
    """Serve until SIGINT, SIGTERM or SIGHUP (or ``stop`` is set); return the exit code.

    Raises :class:`~kvscope.service.server.PortInUse` or
    :class:`~kvscope.agent.config.ConfigError` (a part that cannot start: ingest endpoint
    taken, store directory impossible) before anything is left running.
    """
    log_to_stderr(settings.log_level)
    raise_open_files_limit()
    # either may come from the config file as well as a flag
    sock = bind(settings.host, settings.port, "--port (or port in the config)",
                "--host (or host in the config)")
    agent = Agent(settings)
    # serving first: /healthz answers while the store is restored (a damaged one takes
    # seconds), /readyz says 503 until every part has started
    server = ApiServer(create_app(agent), sock)
    server.start()
    stop = stop or threading.Event()
    stop_on_signals(stop)  # a stop during a long restore: the agent starts, then stops cleanly
    try:
        agent.start()
    except BaseException:
        server.shutdown()
        sock.close()
        raise
    base = url(settings.host, settings.port, "")
    print(f"kvscope agent: {base}/metrics  {base}/api/v1/summary  (docs: {base}/docs)", file=out)
    for name, part in agent.sources.items():
        print("  " + SOURCES[name].banner(getattr(settings, name), part, base), file=out)
    if settings.store_dir:
        restored = len(agent.pipeline.requests)
        print(f"  store: {settings.store_dir} ({restored} request{'s' * (restored != 1)} "
              "restored)", file=out)
    if settings.capture_dir:
        print(f"  capture: {settings.capture_dir} (at most {settings.capture_max_bytes:,} bytes)",
              file=out)
    if settings.otlp_endpoint:
        print(f"  otlp export: {agent.otlp.endpoint}", file=out)
    if settings.token is None and not is_loopback(settings.host):
        print(f"  warning: /api and /v1/traces are open to anyone who reaches {settings.host}:"
              f"{settings.port}; set token in the config (or KVSCOPE_TOKEN)", file=out)
    elif not is_loopback(settings.host) and (weak := weak_token(settings.token)):
        print(f"  warning: {weak}", file=out)
    if agent.ingest is not None and _reachable_off_host(settings.ingest.endpoint):
        print(f"  warning: ingest {settings.ingest.endpoint} takes events from anyone who reaches "
              "it (ZMQ has no authentication); bind it to loopback or an ipc:// path unless "
              "taps on other hosts send to it", file=out)
    out.flush()
    wait_for_stop(stop)
    server.shutdown()
    agent.shutdown()
    print("kvscope agent: stopped", file=out, flush=True)
    ignore_signals_while_exiting()
    return 0
