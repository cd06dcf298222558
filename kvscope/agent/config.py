"""The agent's settings: one typed object from defaults, ``KVSCOPE_*`` environment variables
(nested keys with ``__``, e.g. ``KVSCOPE_INGEST__ENDPOINT``), a TOML file and command-line flags,
strongest last. Every flag has a key here.

Example TOML (every key optional)::

    host = "127.0.0.1"
    port = 9400
    store_dir = "/var/lib/kvscope"

    [ingest]
    endpoint = "tcp://127.0.0.1:5560"

    [collectors.host]
    reserve_bytes = 8589934592
    engine_pid = 12345

    [collectors.gpu]
    enabled = false

    [collectors.numa]
    engine_pid = 12345
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from kvscope.agent.sections import NUMBERS_NOT_BOOLEANS, Section, TierSize, http_url, tier_keys
from kvscope.agent.sources import REGISTRY as SOURCES
from kvscope.agent.sources import check_overlaps
from kvscope.vocabulary import TIERS


class ConfigError(ValueError):
    """The configuration file is unreadable or has a bad value; the message says which."""


# KVSCOPE_* variables of other kvscope tools (tests, benchmarks, scripts), not agent settings
OTHER_VARIABLES = frozenset({"KVSCOPE_VLLM_PYTHON", "KVSCOPE_VLLM_GPU_BUILD_PYTHON",
                             "KVSCOPE_TRACE_DIR", "KVSCOPE_CACHE"})
BUDGET_TIERS = TIERS


# characters: a bearer token shorter than this can be guessed (16 random hex digits: 64 bits)
MIN_TOKEN_CHARS = 16


def weak_token(token: str) -> str | None:
    """What to warn of a bearer ``token`` short enough to guess (beyond loopback it is all
    that guards /api), or None."""
    if len(token) >= MIN_TOKEN_CHARS:
        return None
    return (f"the token is {len(token)} character{'s' * (len(token) != 1)}, few enough to "
            f"guess: use {MIN_TOKEN_CHARS} random ones at least (e.g. openssl rand -hex 16)")


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be the agent's bearer token (as its readers send it too), or None."""
    if not token.strip():
        return ("is empty, which would lock /api for every client; leave it out for an open API "
                "on loopback")
    if not (token.isascii() and token.isprintable() and token == token.strip()):
        return ("must be printable ASCII without spaces at either end: clients send it in an "
                "HTTP header, where anything else does not arrive as written")
    return None


def _pid(value):
    """A process id as given, refusing a boolean (pydantic would read true as process 1)."""
    if isinstance(value, bool):
        raise ValueError("is true or false; give a process id")
    return value


class HostCollectorConfig(Section):
    """``reserve_bytes``: memory kept free for the OS and other services; ``budgets``: bytes
    reserved per offload tier, overriding what the engine reports (vLLM's tap reports its
    ``cpu_bytes_to_use`` for ``cpu``: give it here only where no tap runs). Neither may be
    negative: refused here, by key, before the host collector would refuse it at start.
    ``engine_pid``: the serving engine's process, whose memory (its descendants' included) is
    the memory budget breakdown's engine part (None: not measured)."""

    enabled: bool = True
    reserve_bytes: int = Field(0, ge=0)
    budgets: dict[str, TierSize] = {}
    engine_pid: int | None = Field(None, gt=0)

    @field_validator("engine_pid", mode="before")
    @classmethod
    def _pid_not_boolean(cls, value):
        return _pid(value)

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, value: dict[str, int]) -> dict[str, int]:
        return tier_keys(value, BUDGET_TIERS)


class GpuCollectorConfig(Section):
    enabled: bool = True


class NumaCollectorConfig(Section):
    """``engine_pid``: the serving engine's process, whose memory per NUMA node is read from
    ``/proc/<pid>/numa_maps`` (None: the processes the taps run in, as their batches name
    them, and the host's NUMA nodes only while no tap has sent; docs/collectors.md)."""

    enabled: bool = True
    engine_pid: int | None = Field(None, gt=0)

    @field_validator("engine_pid", mode="before")
    @classmethod
    def _pid_not_boolean(cls, value):
        return _pid(value)


class EngineArgsCollectorConfig(NumaCollectorConfig):
    """``engine_pid`` (checked as the numa collector's): the serving engine's process, whose
    command line says what no metric of the engine does (vLLM's ``--cpu-offload-gb``); None:
    ``[collectors.numa] engine_pid``, else, with ``find_vllm``, the vLLM server running on
    this host."""

    find_vllm: bool = True


class CollectorsConfig(Section):
    host: HostCollectorConfig = HostCollectorConfig()
    gpu: GpuCollectorConfig = GpuCollectorConfig()
    numa: NumaCollectorConfig = NumaCollectorConfig()
    engine_args: EngineArgsCollectorConfig = EngineArgsCollectorConfig()

    @model_validator(mode="after")
    def _one_engine_pid(self):
        """The engine process named once serves every collector that reads it: one named in
        [collectors.numa] or [collectors.host] goes to those sections that name none."""
        pid = self.numa.engine_pid or self.host.engine_pid
        for name in ("numa", "host", "engine_args"):
            section = getattr(self, name)
            if section.engine_pid is None and pid is not None:
                setattr(self, name, section.model_copy(update={"engine_pid": pid}))
        return self


class _Settings(BaseSettings):
    """Everything ``kvscope agent`` can be told. Sizes in bytes, times in seconds.

    ``host``: the listen address, never empty (``0.0.0.0`` or ``::`` for every interface).
    ``token``: bearer token required on ``/api`` (None: open, which is why the default address
    is loopback). ``store_dir``: where finished requests persist (None: memory only; never
    empty, which would mean the working directory).
    ``otlp_endpoint``: OTLP/HTTP traces URL to export request spans to (None: off).
    ``log_level``: the least severe of kvscope's own log lines shown on stderr.
    ``requests_capacity``: finished requests kept in the table, all sources together.
    ``requests_open_per_source``: requests started and not finished held per source (beyond
    it the oldest is abandoned, counted in ``kvscope_events_dropped_total{reason="abandoned"}``);
    ``requests_recent_per_source``: finished records kept per source for late parts to join.
    Both 1 to 1,000,000 (about 4 KB per request with 64 transfers: docs/agent.md, "Memory").
    ``capture_dir``: where block accesses and finished requests are captured as Parquet
    segments for ``kvscope analyze`` / ``kvscope compare`` (None: off; never empty); the
    oldest segments are deleted beyond ``capture_max_bytes`` (:mod:`kvscope.agent.capture`).
    Each registered source has its table (``ingest``, ``kv_events``, ...), declared beside it in
    ``agent/sources/``; two enabled sources that would report one tier are refused.
    """

    model_config = SettingsConfigDict(env_prefix="KVSCOPE_", env_nested_delimiter="__",
                                      extra="forbid")
    _numbers = NUMBERS_NOT_BOOLEANS

    host: str = "127.0.0.1"
    port: int = Field(9400, gt=0, lt=65536)
    token: str | None = None
    sample_interval: float = Field(1.0, ge=0.1, le=3600, allow_inf_nan=False)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    prefill_tokens_per_second: float = Field(10_000.0, ge=1, allow_inf_nan=False)
    requests_capacity: int = Field(100_000, gt=0, le=100_000_000)
    # per source, beside the table (docs/agent.md, "Memory"); 100 times the default at most:
    # the recent index is allocated whole at a source's first event
    requests_open_per_source: int = Field(10_000, gt=0, le=1_000_000)
    requests_recent_per_source: int = Field(10_000, gt=0, le=1_000_000)
    store_dir: Path | None = None
    store_max_bytes: int = Field(256 << 20, gt=0)
    store_max_age: float = Field(86_400.0, gt=0, le=10 * 365 * 86_400,  # 10 years at most
                                 allow_inf_nan=False)
    otlp_endpoint: str | None = None
    capture_dir: Path | None = None
    capture_max_bytes: int = Field(1 << 30, gt=0)
    collectors: CollectorsConfig = CollectorsConfig()

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty, which would listen on every interface; use 0.0.0.0 "
                             "(or :: for IPv6) to listen on all of them, or an address such as "
                             "127.0.0.1")
        return value

    @field_validator("store_dir", "capture_dir", mode="before")
    @classmethod
    def _directory(cls, value, info):
        # pydantic reads "" as Path("."): the agent would write into its working directory
        if isinstance(value, str) and not value.strip():
            off = {"store_dir": "to keep requests in memory only",
                   "capture_dir": "not to capture"}[info.field_name]
            raise ValueError(f"is empty, which would mean the current directory; leave it out "
                             f"{off}, or use . for the current directory")
        return value

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        return value if value is None else http_url(value, "http://127.0.0.1:4318")

    @field_validator("token")
    @classmethod
    def _token(cls, value: str | None) -> str | None:
        problem = None if value is None else token_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _sources_agree(self) -> _Settings:
        check_overlaps({name: getattr(self, name) for name in SOURCES})
        return self


# One table per registered source (agent/sources/*.py): a new source needs no line here.
AgentSettings = create_model("AgentSettings", __base__=_Settings, __module__=__name__,
                             __doc__=_Settings.__doc__,
                             **{name: (spec.config, spec.config())
                                for name, spec in SOURCES.items()})


def load_settings(path: str | Path | None = None, **overrides) -> AgentSettings:
    """Settings from the TOML file at ``path`` (if any), the environment, then ``overrides``
    (flags; None values are ignored). Raises :class:`ConfigError` naming the file and key."""
    values: dict = {}
    if path is not None:
        try:
            values = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {path}: not UTF-8 text (byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path}: {exc}") from None
    # pydantic-settings matches top-level keys in any case (PORT and port both set port, one
    # of them winning unsaid), where TOML and the tables' keys are case-sensitive
    spelt = sorted(k for k in values if k not in AgentSettings.model_fields
                   and k.lower() in AgentSettings.model_fields)
    if spelt:
        raise ConfigError(f"config {path}: {spelt[0]}: kvscope's keys are lower case; write "
                          f"{spelt[0].lower()}")
    quoted = _text_for_a_number(values, AgentSettings)
    if quoted:
        raise ConfigError(f"config {path}: {quoted}")
    file_values = copy.deepcopy(values)
    for key, value in overrides.items():
        if value is not None:
            section = values
            *parents, leaf = key.split(".")
            for parent in parents:
                section = section.setdefault(parent, {})
            section[leaf] = value
    # pydantic-settings reads names in any case, and of two spellings one wins unsaid
    spelt = sorted(k for k in os.environ if k.upper().startswith("KVSCOPE_") and k != k.upper())
    if spelt:
        raise ConfigError(f"environment: {spelt[0]}: kvscope's variables are upper case; "
                          f"rename it {spelt[0].upper()} (or unset it)")
    unknown = sorted(set(_settings_variables()).difference(_known_variables(AgentSettings),
                                                           OTHER_VARIABLES))
    if unknown:
        raise ConfigError(f"environment: {unknown[0]} is not a setting (nested keys take two "
                          "underscores, e.g. KVSCOPE_INGEST__ENDPOINT; see docs/agent.md)")
    try:
        settings = AgentSettings(**values)
        if values:
            _check_overridden(values)
        _check_file_overridden(file_values, overrides, path)
        return settings
    except SettingsError as exc:  # a KVSCOPE_* variable that does not parse (e.g. bad JSON)
        # pydantic names only the top-level field ('error parsing value for field "collectors"')
        field = re.search(r'field "(\w+)"', str(exc))
        prefix = f"KVSCOPE_{field.group(1).upper()}" if field else "KVSCOPE_"
        given = {k: v for k, v in _settings_variables().items() if k.startswith(prefix)}
        # the value pydantic-settings failed to read as JSON (it reads lists and tables so),
        # not every variable of the table: KVSCOPE_TRTLLM__ENABLED=true was blamed beside
        # KVSCOPE_TRTLLM__LEVELS=gpu,cpu
        unread = [k for k, v in given.items() if not _json(v) and _takes_json(k)]
        names = " or ".join(sorted(unread or given))
        raise ConfigError(f"environment: {names or exc} does not parse "
                          f"({exc.__cause__ or 'invalid'}; KVSCOPE_* values for lists and tables "
                          "are JSON)") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(p) for p in error["loc"]]
        key = ".".join(loc)
        if not loc:  # a check across tables (two sources claiming one tier): no one key
            where = f"config{' ' + str(path) if path else ''}"
        elif overrides.get(key) is not None:
            where = f"command line: {key}"
        elif _set_in(values, loc):
            where = f"config{' ' + str(path) if path else ''}: {key}"
        elif named := [v for v in _variables_of(loc) if v in _settings_variables()]:
            where = "environment: " + " or ".join(named)
        elif len(loc) > 1 and _set_in(values, loc[:-1]):
            # a default checked against the table's other keys (kv_events' dp_size against its
            # endpoints), which the file set
            where = f"config{' ' + str(path) if path else ''}: {'.'.join(loc[:-1])}"
        else:  # not from the file or a flag, so from the environment: the table's variables
            where = "environment: " + ("__".join(_variables_of(loc[:-1])[:1] + ["*"])
                                       if len(loc) > 1 else "KVSCOPE_*")
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = _unknown_key(loc)
        raise ConfigError(f"{where}: {message}") from None


def _check_overridden(values: dict) -> None:
    """Raise ConfigError for a ``KVSCOPE_*`` variable with a bad value whose key the file or a
    flag (``values``) sets too: the stronger value won, and the variable's was never read, so
    ``KVSCOPE_PORT=abc`` beside a file's ``port`` went unnoticed."""
    try:
        AgentSettings()  # the environment alone
    except ValidationError as exc:
        set_now = _settings_variables()
        for error in exc.errors():
            loc = [str(p) for p in error["loc"]]
            variable = _variables_of(loc)[0] if loc else ""
            if variable in set_now and _set_in(values, loc):
                raise ConfigError(
                    f"environment: {variable}: {error['msg'].removeprefix('Value error, ')} "
                    f"(the config file or a flag sets {'.'.join(loc)} too and takes "
                    "precedence; fix or unset the variable)") from None


def _check_file_overridden(file_values: dict, overrides: dict, path) -> None:
    """Raise ConfigError for a bad value in the config file at ``path`` whose key a flag
    (``overrides``) sets too: the flag's value won and the file's was never checked, so
    ``port = 70000`` beside ``--port`` went unnoticed until the flag left the unit file."""
    flagged = [key.split(".") for key, value in overrides.items()
               if value is not None and _set_in(file_values, key.split("."))]
    if not flagged:
        return
    try:
        AgentSettings(**file_values)  # the file alone (and the environment, checked already)
    except ValidationError as exc:
        for error in exc.errors():
            loc = [str(p) for p in error["loc"]]
            if any(loc[:len(key)] == key for key in flagged):
                raise ConfigError(
                    f"config {path}: {'.'.join(loc)}: "
                    f"{error['msg'].removeprefix('Value error, ')} (a flag sets it too and "
                    "takes precedence; fix the file)") from None


def _unknown_key(loc: list[str]) -> str:
    """What to say of the unknown key at ``loc``: the closest known key, and the known ones."""
    model: type[BaseModel] = AgentSettings
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type)
                                 and issubclass(field.annotation, BaseModel)):
            return "not a setting (see docs/agent.md)"
        model = field.annotation
    close = difflib.get_close_matches(loc[-1], model.model_fields, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"not a setting ({hint}the keys here: {', '.join(model.model_fields)})"


def _settings_variables() -> dict[str, str]:
    # upper case only: load_settings refuses the other spellings first
    return {k: v for k, v in os.environ.items() if k.startswith("KVSCOPE_")}


def _known_variables(model: type[BaseModel], prefix: str = "KVSCOPE_") -> set[str]:
    """Every environment variable that sets a key of ``model``: ``KVSCOPE_PORT``, a table as
    JSON (``KVSCOPE_INGEST``) and its keys (``KVSCOPE_INGEST__ENDPOINT``), recursively."""
    out = set()
    for name, field in model.model_fields.items():
        variable = prefix + name.upper()
        out.add(variable)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out |= _known_variables(field.annotation, variable + "__")
    return out


def _json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _text_for_a_number(values: dict, model: type[BaseModel], where: str = "") -> str | None:
    """The first key of a TOML file's ``values`` (its tables' included) that gives text where
    ``model`` takes a number, with what to write, or None. pydantic reads "19440" as 19440, as
    it must for environment variables (all text); a file's quotes are a slip, and `port = " 1 "`
    should not listen on port 1 unsaid."""
    for key, value in values.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        annotation = field.annotation
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        kinds = set(typing.get_args(annotation) if union else (annotation,))
        if isinstance(value, str) and kinds & {int, float} and str not in kinds:
            return f"{where}{key}: {value!r} is text; give a number, without quotes"
        table = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)),
                     None)
        if isinstance(value, dict) and table is not None:
            found = _text_for_a_number(value, table, f"{where}{key}.")
            if found:
                return found
    return None


def _takes_json(variable: str) -> bool:
    """Whether ``variable`` (``KVSCOPE_A__B``) sets a key whose value is a list or a table:
    pydantic-settings reads those as JSON."""
    model: object = AgentSettings
    annotation: object = None
    for part in variable.removeprefix("KVSCOPE_").lower().split("__"):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        annotation = model = fields[part].annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = typing.get_args(annotation) if union else (annotation,)
    return any((typing.get_origin(k) or k) in (list, dict, tuple, set)
               or (isinstance(k, type) and issubclass(k, BaseModel)) for k in kinds)


def _variables_of(loc: list[str]) -> list[str]:
    """The variables that can set the key at ``loc``: the key's own and its tables' (JSON)."""
    return ["KVSCOPE_" + "__".join(loc[:n]).upper() for n in range(len(loc), 0, -1)]


def _set_in(values: dict, loc: list[str]) -> bool:
    """Whether the file or flags (``values``) set the key at ``loc`` (or one of its tables
    to a non-table value)."""
    for part in loc:
        if not isinstance(values, dict):  # e.g. a list the file gave, with a bad item
            return True
        if part not in values:
            return False
        values = values[part]
    return True
