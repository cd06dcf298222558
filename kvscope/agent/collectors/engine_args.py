"""Engine arguments collector: what the serving engine was told on its command line that no
metric of the engine says, read from ``/proc/<engine_pid>/cmdline``.

One fact so far, the guide's failure mode 2 (weight offload mistaken for KV offload): vLLM's
``--cpu-offload-gb`` (GiB of model weights *per GPU* kept in host RAM and streamed to the GPU
on every forward pass; ``vllm/config/offload.py``, ``UVAOffloadConfig.cpu_offload_gb``). vLLM
does not publish it on ``/metrics``: ``vllm:cache_config_info`` carries the ``CacheConfig``'s
fields (``kv_offloading_size`` among them), and ``cpu_offload_gb`` lives in the
``OffloadConfig`` (checked in vLLM 0.32, ``v1/metrics/loggers.py`` ``log_metrics_info``).
An engine started through the Python API (``LLM(cpu_offload_gb=...)``) or with the flag in a
``--config`` YAML file does not show it on its command line: there it reads 0, which
:class:`EngineArgsReading` documents.

Reading and parsing are split: :func:`parse_cmdline` and :func:`weight_offload_bytes` are pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvscope.agent.collectors.base import CollectorError, register

DEFAULT_PROC = Path("/proc")
GIB = 1 << 30
FLAG = "--cpu-offload-gb"


def parse_cmdline(raw: bytes) -> list[str]:
    """``/proc/<pid>/cmdline`` content (NUL-separated, NUL-terminated) -> argv."""
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def is_vllm(argv: Sequence[str]) -> bool:
    """Whether ``argv`` starts vLLM's server: ``vllm serve``, or ``python -m
    vllm.entrypoints...`` (any argument naming ``vllm`` as the program or the module)."""
    return any(Path(arg).name == "vllm" or arg.startswith("vllm.entrypoints") for arg in argv[:4])


def weight_offload_bytes(argv: Sequence[str]) -> int | None:
    """Bytes of model weights per GPU vLLM keeps in host RAM: ``--cpu-offload-gb N`` or
    ``--cpu-offload-gb=N`` (GiB, a float; the last one given wins, as argparse does) x 2^30; 0
    when the flag is absent (vLLM's default); None when ``argv`` is not vLLM's or the value is
    no number (not measured)."""
    if not is_vllm(argv):
        return None
    value: str | None = "0"
    for i, arg in enumerate(argv):
        if arg == FLAG:
            value = argv[i + 1] if i + 1 < len(argv) else None
        elif arg.startswith(FLAG + "="):
            value = arg.partition("=")[2]
    try:
        gib = float(value) if value is not None else None
    except ValueError:
        return None
    return None if gib is None or not gib >= 0 else int(gib * GIB)


@dataclass(frozen=True)
class EngineArgsReading:
    """``engine_pid``: the process read (None: none configured). ``weight_offload_bytes``: see
    :func:`weight_offload_bytes`; None when no process is configured, it is not vLLM, or the
    value is unreadable."""

    engine_pid: int | None = None
    weight_offload_bytes: int | None = None


@register("engine_args", default_enabled=True)
class EngineArgsCollector:
    """Reads the engine process's command line once per ``collect()``.

    ``engine_pid``: the serving engine's process (None: nothing to read, every value None).
    ``proc``: ``/proc``. ``collect()`` raises CollectorError when the process is gone or its
    command line cannot be read. Raises ValueError on a non-positive ``engine_pid``."""

    name = "engine_args"

    def __init__(self, engine_pid: int | None = None, *, proc: Path | str = DEFAULT_PROC) -> None:
        if engine_pid is not None and engine_pid <= 0:
            raise ValueError(f"engine_pid must be a process id > 0, not {engine_pid}")
        self._pid = engine_pid
        self._proc = Path(proc)

    def collect(self) -> EngineArgsReading:
        if self._pid is None:
            return EngineArgsReading()
        path = self._proc / str(self._pid) / "cmdline"
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            raise CollectorError(f"engine process {self._pid} (engine_pid) is not running") from None
        except PermissionError:
            raise CollectorError(f"cannot read {path}") from None
        return EngineArgsReading(self._pid, weight_offload_bytes(parse_cmdline(raw)))

    def shutdown(self) -> None:
        """Nothing to release."""
