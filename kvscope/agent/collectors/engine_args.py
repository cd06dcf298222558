"""Engine arguments collector: what the serving engine was told on its command line that no
metric of the engine says, read from ``/proc/<engine_pid>/cmdline``.

One fact so far, the guide's failure mode 2 (weight offload mistaken for KV offload): vLLM's
``--cpu-offload-gb`` (GiB of model weights *per GPU* kept in host RAM and streamed to the GPU
on every forward pass; ``vllm/config/offload.py``, ``UVAOffloadConfig.cpu_offload_gb``). vLLM
does not publish it on ``/metrics``: ``vllm:cache_config_info`` carries the ``CacheConfig``'s
fields (``kv_offloading_size`` among them), and ``cpu_offload_gb`` lives in the
``OffloadConfig`` (checked in vLLM 0.32, ``v1/metrics/loggers.py`` ``log_metrics_info``).
A ``--config`` YAML file's keys count as flags before the command line's (vLLM's
``FlexibleArgumentParser._pull_args_from_config``: the command line wins). An engine started
through the Python API (``LLM(cpu_offload_gb=...)``) does not show it on any command line:
there it reads 0, which :class:`EngineArgsReading` documents.

The engine process is the one configured, else found: the vLLM server on this host
(:func:`find_vllm_servers`), so that the misconfiguration this collector exists for, weight
offload without any KV offload (so without a tap to name the process), needs no setting.

Reading and parsing are split: :func:`parse_cmdline`, :func:`config_flags` and
:func:`weight_offload_bytes` are pure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvscope.agent.collectors.base import CollectorError, EngineNotRunning, register

log = logging.getLogger(__name__)

DEFAULT_PROC = Path("/proc")
GIB = 1 << 30
FLAG = "--cpu-offload-gb"
CONFIG = "--config"
# seconds between looks through /proc for a vLLM server while none is found (a look reads
# every process's command line: about 10 us each)
FIND_EVERY = 30.0


def parse_cmdline(raw: bytes) -> list[str]:
    """``/proc/<pid>/cmdline`` content (NUL-separated, NUL-terminated) -> argv."""
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def is_vllm(argv: Sequence[str]) -> bool:
    """Whether ``argv`` starts vLLM's server: ``vllm serve``, or ``python -m
    vllm.entrypoints...`` (any argument naming ``vllm`` as the program or the module)."""
    return any(Path(arg).name == "vllm" or arg.startswith("vllm.entrypoints") for arg in argv[:4])


def is_vllm_server(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is vLLM's OpenAI server: ``vllm serve ...`` or ``python -m
    vllm.entrypoints.openai.api_server`` (not ``vllm bench`` or another of its commands)."""
    return any(arg.startswith("vllm.entrypoints.openai") or Path(arg).name == "vllm"
               and argv[i + 1:i + 2] == ["serve"] for i, arg in enumerate(argv[:4]))


def config_path(argv: Sequence[str]) -> str | None:
    """The ``--config`` file ``argv`` names (vLLM takes one, as the next argument), or None."""
    for i, arg in enumerate(argv[:-1]):
        if arg == CONFIG:
            return argv[i + 1]
    return None


def config_flags(text: str) -> list[str]:
    """A vLLM ``--config`` YAML file's top-level scalar keys as flags (``cpu-offload-gb: 2``
    -> ``["--cpu-offload-gb", "2"]``), as vLLM's ``load_config_file`` turns them. Raises
    ValueError for text that is not a YAML mapping."""
    import yaml  # here only: few engines name a config file, and the GPU check carries no yaml

    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("not a YAML mapping of flags")
    return [x for key, value in config.items() if not isinstance(value, (dict, list, bool))
            for x in (f"--{key}", str(value))]


def weight_offload_bytes(argv: Sequence[str], config: Sequence[str] = ()) -> int | None:
    """Bytes of model weights per GPU vLLM keeps in host RAM: ``--cpu-offload-gb N`` or
    ``--cpu-offload-gb=N`` (GiB, a float; ``--cpu_offload_gb`` too, as vLLM's parser reads
    it; the last one given wins, as argparse does) x 2^30, ``config`` (the ``--config``
    file's flags: :func:`config_flags`) read before ``argv``; 0 when the flag is absent
    (vLLM's default); None when ``argv`` is not vLLM's or the value is no number (not
    measured)."""
    if not is_vllm(argv):
        return None
    value: str | None = "0"
    args = [*config, *argv]
    for i, arg in enumerate(args):
        name, eq, given = arg.partition("=")
        if not name.startswith("--") or name.replace("_", "-") != FLAG:
            continue
        value = given if eq else args[i + 1] if i + 1 < len(args) else None
    try:
        gib = float(value) if value is not None else None
    except ValueError:
        return None
    return None if gib is None or not gib >= 0 else int(gib * GIB)


def find_vllm_servers(proc: Path = DEFAULT_PROC) -> list[int]:
    """The process ids of vLLM servers (:func:`is_vllm_server`) in ``proc``, lowest first;
    processes that exit or may not be read meanwhile are left out."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = parse_cmdline((entry / "cmdline").read_bytes())
        except OSError:
            continue
        if is_vllm_server(argv):
            found.append(int(entry.name))
    return sorted(found)


@dataclass(frozen=True)
class EngineArgsReading:
    """``engine_pid``: the process read (None: none configured or found).
    ``weight_offload_bytes``: see :func:`weight_offload_bytes`; None when no process is
    read, it is not vLLM, the value is unreadable, or so is the ``--config`` file it names."""

    engine_pid: int | None = None
    weight_offload_bytes: int | None = None


@register("engine_args", default_enabled=True)
class EngineArgsCollector:
    """Reads the engine process's command line (and the ``--config`` file it names, from the
    process's working directory) once per ``collect()``.

    ``engine_pid``: the serving engine's process. None: with ``find_vllm`` the vLLM server on this
    host (:func:`find_vllm_servers`: the first, looked for again when it exits and at most
    every :data:`FIND_EVERY` seconds while none runs; several are logged once, as the node's
    other servers go unread), else nothing to read (every value None). ``proc``: ``/proc``;
    ``clock``: monotonic seconds. ``collect()`` raises CollectorError when the configured
    process is gone or its command line cannot be read.
    Raises ValueError on a non-positive ``engine_pid``."""

    name = "engine_args"

    def __init__(self, engine_pid: int | None = None, *, find_vllm: bool = True,
                 proc: Path | str = DEFAULT_PROC,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if engine_pid is not None and engine_pid <= 0:
            raise ValueError(f"engine_pid must be a process id > 0, not {engine_pid}")
        self._pid = engine_pid
        self._find = find_vllm and engine_pid is None
        self._found: int | None = None
        self._next_look = float("-inf")
        self._told_several = False
        self._proc = Path(proc)
        self._clock = clock

    def collect(self) -> EngineArgsReading:
        if self._pid is not None:
            argv = self._argv(self._pid)
            if argv is None:
                raise EngineNotRunning(self._pid)
            return EngineArgsReading(self._pid, self._weights(self._pid, argv))
        if not self._find:
            return EngineArgsReading()
        argv = self._argv(self._found) if self._found is not None else None
        if argv is None or not is_vllm_server(argv):  # none yet, or it exited
            self._found = None
            now = self._clock()
            if now < self._next_look:
                return EngineArgsReading()
            self._next_look = now + FIND_EVERY
            servers = find_vllm_servers(self._proc)
            if len(servers) > 1 and not self._told_several:
                self._told_several = True
                log.warning("engine_args: %d vLLM servers on this host (process ids %s): "
                            "reading the first that runs; set [collectors] engine_pid to the "
                            "one this agent serves (logged once)", len(servers),
                            ", ".join(map(str, servers)))
            for pid in servers:
                if (argv := self._argv(pid)) is not None:
                    self._found = pid
                    break
            else:
                return EngineArgsReading()
        return EngineArgsReading(self._found, self._weights(self._found, argv))

    def _argv(self, pid: int) -> list[str] | None:
        """``pid``'s command line, None when the process is gone. Raises CollectorError when
        it may not be read."""
        path = self._proc / str(pid) / "cmdline"
        try:
            return parse_cmdline(path.read_bytes())
        except (FileNotFoundError, ProcessLookupError):
            return None
        except PermissionError:
            raise CollectorError(f"cannot read {path}") from None

    def _weights(self, pid: int, argv: list[str]) -> int | None:
        """:func:`weight_offload_bytes` of ``argv`` with its ``--config`` file (a relative
        path from the process's working directory, an absolute one in its root: a container's
        own); None when that file cannot be read."""
        path = config_path(argv)
        if path is None:
            return weight_offload_bytes(argv)
        where = self._proc / str(pid) / ("root" if path.startswith("/") else "cwd")
        try:
            text = (where / path.lstrip("/")).read_text()
            return weight_offload_bytes(argv, config_flags(text))
        except (OSError, UnicodeDecodeError, ValueError):
            return None

    def shutdown(self) -> None:
        """Nothing to release."""
