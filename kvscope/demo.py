"""``kvscope demo``: the reference engine replaying a workload, the agent and the dashboard in
one process, on loopback by default."""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from kvscope.agent.capture import finished_segments
from kvscope.agent.config import load_settings
from kvscope.analysis.inputs import from_requests
from kvscope.analysis.trace import AccessTrace
from kvscope.argtypes import is_loopback
from kvscope.dashboard.app import create_app as create_dashboard
from kvscope.dashboard.app import serve as serve_dashboard
from kvscope.engine.options import open_engine
from kvscope.engine.presets import get_preset
from kvscope.engine.replay import Replayer
from kvscope.engine.workload import (MOONCAKE_BLOCK_TOKENS, SyntheticConfig, read_mooncake,
                                     synthetic)
from kvscope.service.agent import Agent
from kvscope.service.api import create_app
from kvscope.service.run import log_to_stderr
from kvscope.service.server import ApiServer, PortInUse, bind, url
from kvscope.signals import (how_to_stop, ignore_signals_while_exiting, stop_on_signals,
                             wait_for_stop)

# Seconds of the synthetic workload the Sizing page analyses (12,000 requests at its rate: a
# second of analysis in the background)
SIZING_SECONDS = 600.0


@dataclass(frozen=True)
class DemoConfig:
    """``duration``: seconds to run (None: until Ctrl-C). ``trace``: Mooncake JSONL path or None
    for the synthetic workload. Pool sizes are in blocks; ``disk_dir``: the disk tier's chunk
    files (None: a temporary directory). ``capture_dir``: where the agent
    captures block accesses and requests as Parquet (None: off). ``capture_roots``: directories
    whose captures the dashboard's Compare page reads, besides ``capture_dir`` (it reads
    nothing elsewhere). ``dashboard_token``: the token the dashboard
    demands of its visitors (None: open, as on loopback). ``one_off_share``: the synthetic
    workload's share of unique one-off prompts (0-1; 1: no prompt is ever reused)."""

    duration: float | None = None
    trace: str | None = None
    host: str = "127.0.0.1"
    metrics_port: int = 9400
    ui_port: int = 8050
    preset: str = "tiny"
    gpu_blocks: int = 256
    cpu_blocks: int = 1024
    disk_blocks: int = 0
    disk_dir: str | None = None
    policy: str = "lru"
    speed: float = 1.0
    seed: int = 0
    capture_dir: str | None = None
    capture_roots: tuple[str, ...] = ()
    dashboard_token: str | None = None
    one_off_share: float = SyntheticConfig.one_off_share


def _first_requests(workload: SyntheticConfig, count: int, name: str) -> AccessTrace:
    """The block accesses of the first ``count`` requests of ``workload``'s stream."""
    return from_requests(itertools.islice(synthetic(workload), count), workload.block_tokens,
                         name)


def _replay(replayer: Replayer, out, duration: float | None) -> None:
    """Replay the workload, then say it has played out while the demo stays up to be read
    (and, where it fell behind its schedule, by how much: the warning came once, early)."""
    replayer.run()
    if not replayer.stop.is_set():
        until = how_to_stop() + (f" or {duration:g} s from the start" if duration else "")
        served = f"{replayer.served} request" + ("" if replayer.served == 1 else "s")
        if replayer.behind >= replayer.behind_warning:
            served += (f", up to {replayer.behind:.3g} s behind its schedule at speed "
                       f"{replayer.speed:g}: lower --speed to keep it")
        print(f"kvscope demo: the workload has played out ({served}); the metrics, API and "
              f"dashboard stay up until {until}", file=out, flush=True)


def settle_capture(directory: Path) -> str:
    """What a finished demo run left in its capture ``directory``, as the end of its last line.
    A run stopped before any request finished leaves it empty (its state segments alone made
    it one the next demo refused as an earlier run's, and analyze and compare read no run
    from it)."""
    if finished_segments(directory, "requests"):
        return f"; its capture is in {directory}"
    for segment in finished_segments(directory):
        segment.unlink(missing_ok=True)
    return f"; nothing captured (no request finished), {directory} left empty"


def run_demo(config: DemoConfig, out=sys.stdout) -> int:
    """Run the demo until ``config.duration`` passes or SIGINT/SIGTERM; return the exit code:
    0, or 1 when its capture lost rows it could not write (a full disk).

    Raises :class:`~kvscope.engine.workload.TraceError` for an unreadable trace,
    FileExistsError for a ``capture_dir`` that holds an earlier run's capture,
    :class:`~kvscope.engine.engine.EngineConfigError` for impossible tier sizes or a
    ``disk_dir`` the disk tier cannot use,
    :class:`~kvscope.agent.config.ConfigError` for a bad ``KVSCOPE_*`` variable and
    :class:`~kvscope.service.server.PortInUse` for a port already taken, before anything is left
    running.
    """
    # the engine's and the agent's warnings as the agent shows them (they came out bare, so a
    # warning did not say whose it was); its info lines would bury the demo's own
    log_to_stderr("warning")
    preset = get_preset(config.preset)
    block_tokens = MOONCAKE_BLOCK_TOKENS if config.trace else preset.block_tokens
    disk_budget = config.disk_blocks * preset.bytes_per_block(block_tokens)
    # The reference engine runs in this process: its host tiers are this process's memory. It
    # reports its cpu tier's size as its host KV budget itself, as vLLM's tap does; the disk
    # tier's is configured (no engine reports it). Read (KVSCOPE_* included) before anything
    # starts, so a bad variable is an error, not a traceback.
    settings = load_settings(capture_dir=config.capture_dir, **{
        "collectors.host": {"budgets": {"disk": disk_budget} if disk_budget else {},
                            "engine_pid": os.getpid()},
        "collectors.numa": {"engine_pid": os.getpid()}})
    # --capture-dir, else the agent's KVSCOPE_CAPTURE_DIR: the run is captured there all the same
    capture_dir = settings.capture_dir
    named = "--capture-dir" if config.capture_dir else "KVSCOPE_CAPTURE_DIR"
    if capture_dir and (earlier := finished_segments(capture_dir)):
        # analyze and compare would read the two runs as one (an agent restarted into its
        # capture directory carries on; a demo run is a run of its own)
        raise FileExistsError(f"{named} {capture_dir} holds {len(earlier)} "
                              f"segment{'s' * (len(earlier) != 1)} of an earlier run, which "
                              "analyze and compare would "
                              "read as part of this one; give a directory without them")
    sizing_trace, sizing_accesses = config.trace, None
    if config.trace:
        requests = read_mooncake(config.trace)
    else:
        workload = SyntheticConfig(seed=config.seed, block_tokens=block_tokens,
                                   one_off_share=config.one_off_share)
        requests = synthetic(workload)
        # the Sizing page sizes the stream the demo replays (the same seed), its first minutes
        count = round(SIZING_SECONDS * workload.rate)
        sizing_trace = (f"the synthetic workload's first {count:,} requests "
                        f"({SIZING_SECONDS / 60:g} minutes), as the demo replays them")
        sizing_accesses = functools.partial(_first_requests, workload, count, sizing_trace)
    # From here Ctrl-C stops the demo cleanly (exit 0), also while it starts: it had stopped it
    # with exit code 130 until its servers were up
    stop = threading.Event()
    stop_on_signals(stop)
    if config.metrics_port == config.ui_port:
        raise PortInUse(f"--metrics-port and --ui-port are both {config.ui_port}; give them "
                        "different ports")
    # the engine first: a bad tier configuration is reported before any port is taken
    engine = open_engine(preset, config.gpu_blocks, config.cpu_blocks, config.disk_blocks,
                         config.disk_dir, block_tokens=block_tokens, policy=config.policy,
                         # block hashes: the capture's, and the agent's reuse share
                         # (kvscope_prompt_prefix_blocks_total)
                         record_blocks=True,
                         emit=lambda event: agent.pipeline.ingest("engine", (event,)))
    try:
        metrics_sock = bind(config.host, config.metrics_port, "--metrics-port")
        try:
            bind(config.host, config.ui_port, "--ui-port").close()  # fail before starting anything
        except PortInUse:
            metrics_sock.close()
            raise
    except PortInUse:
        engine.close()
        raise

    agent = Agent(settings, with_ingest=False)
    agent.pipeline.set_source_info("engine", "kvscope-reference", preset.name)
    agent.pipeline.set_cache_config("engine", *engine.cache_config)
    agent.pipeline.set_source_up("engine", True)  # the engine feeds the pipeline in-process
    server = ApiServer(create_app(agent), metrics_sock)
    replayer = Replayer(engine, requests, speed=config.speed, stop=stop)
    replay_thread = threading.Thread(target=_replay, args=(replayer, out, config.duration),
                                     name="kvscope-replay", daemon=True)
    try:
        agent.start()  # ConfigError: a capture directory another writer holds, say
    except BaseException:
        metrics_sock.close()
        engine.close()  # its disk tier's temporary directory with it
        raise
    server.start()
    api_url = url(config.host, config.metrics_port, "")
    try:
        # the agent takes KVSCOPE_TOKEN from the environment: its dashboard must send it
        dashboard = serve_dashboard(create_dashboard(api_url, sizing_trace=sizing_trace,
                                                       sizing_accesses=sizing_accesses,
                                                       sizing_preset=preset.name,
                                                       sizing_preset_flag="--preset",
                                                       sizing_gpu_tokens=config.gpu_blocks
                                                       * block_tokens,
                                                       token=agent.settings.token,
                                                       capture_roots=[
                                                           str(d) for d in (capture_dir,
                                                                            *config.capture_roots)
                                                           if d],
                                                       require_token=config.dashboard_token),
                                    config.host, config.ui_port, "--ui-port")
    except PortInUse:
        server.shutdown()
        agent.shutdown()
        engine.close()
        raise

    print(f"kvscope demo: {'trace ' + config.trace if config.trace else 'synthetic workload'}, "
          f"preset {preset.name}, gpu {config.gpu_blocks} blocks, cpu {config.cpu_blocks} blocks"
          + (f", disk {config.disk_blocks} blocks" if config.disk_blocks else "")
          + (f" in {config.disk_dir}" if config.disk_blocks and config.disk_dir else "")
          + f", policy {config.policy}", file=out)
    print(f"  metrics and API: {api_url}/metrics  {api_url}/api/v1/summary", file=out)
    print(f"  dashboard:       {url(config.host, config.ui_port)}"
          + ("?token=<KVSCOPE_TOKEN>" if config.dashboard_token else ""), file=out)
    if config.dashboard_token is None and not is_loopback(config.host):
        print(f"  warning: the dashboard and /api are open to anyone who reaches "
              f"{config.host} (--insecure)", file=out)
    if capture_dir:
        print(f"  capture:         {capture_dir}"
              + ("" if config.capture_dir else " (KVSCOPE_CAPTURE_DIR)")
              + " (kvscope analyze / kvscope compare read it)", file=out)
    if settings.store_dir:
        print(f"  request store:   {settings.store_dir} (KVSCOPE_STORE_DIR)", file=out)
    if config.capture_roots:
        print(f"  compare page reads under: {', '.join(config.capture_roots)}"
              + (" and the capture" if capture_dir else ""), file=out)
    print(f"  stop with {how_to_stop()}"
          + (f" (or after {config.duration:g} s)" if config.duration else ""), file=out, flush=True)
    replay_thread.start()
    wait_for_stop(stop, config.duration)
    stop.set()
    replay_thread.join()
    engine.close()
    dashboard.shutdown()
    server.shutdown()
    agent.shutdown()
    lost = sum(agent.capture.dropped.values()) if agent.capture is not None else 0
    # what the run left behind: a tryout found it said only in the banner, long scrolled away
    kept = "; nothing kept (--capture-dir DIR records a run)"
    if capture_dir:  # a capture that lost rows gets its own error line below
        kept = "" if lost else settle_capture(capture_dir)
    served = f"{replayer.served} request" + ("" if replayer.served == 1 else "s")
    print(f"kvscope demo: stopped after {served}{kept}", file=out, flush=True)
    ignore_signals_while_exiting()
    if lost:  # a script reading the capture next must not take it for the whole run
        print(f"kvscope demo: error: the capture lost {lost} rows it could not write (see the "
              f"capture's lines above); {capture_dir} holds only the segments written "
              "whole", file=sys.stderr, flush=True)
        return 1
    return 0
