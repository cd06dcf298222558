"""What every config table shares: the base model and the value checks several tables use.

Each source's and collector's table is declared beside its code and built on :class:`Section`;
``config.py`` assembles them into the agent's settings.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvscope.argtypes import is_http_url


def http_url(value: str, example: str) -> str:
    """``value`` if it is an http(s) URL with a host, else ValueError naming ``example``."""
    if not is_http_url(value):
        raise ValueError(f"must be an http:// or https:// URL with a host, e.g. {example}")
    return value


def tier_keys(value: dict, tiers: tuple[str, ...]) -> dict:
    """``value`` if every key is one of ``tiers``, else ValueError naming the first other."""
    unknown = [t for t in value if t not in tiers]
    if unknown:
        raise ValueError(f"unknown tier {unknown[0]!r}: the tiers are {', '.join(tiers)}")
    return value


def zmq_endpoint(value: str) -> str:
    """``value`` if it is a ZMQ endpoint the agent can use: ``ipc://PATH``, or
    ``tcp://HOST:PORT`` with a port of 1-65535 (ZMQ itself would read ``:99999`` as another
    port, and ``:*`` as any free one, which no tap could find); else ValueError."""
    if value.startswith("ipc://"):
        return value
    if not value.startswith("tcp://"):
        raise ValueError("must start with tcp:// or ipc://")
    port = value.rpartition(":")[2]
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):  # not "٥٥٦٠"
        raise ValueError(f"must end in :PORT, a port of 1-65535 (tcp://127.0.0.1:5560), "
                         f"not {value!r}")
    return value


def _numbers_not_booleans(cls, value, info):
    # pydantic reads true as 1 for a number: `port = true` would listen on port 1
    if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in (int, float):
        raise ValueError("is true or false; give a number")
    return value


NUMBERS_NOT_BOOLEANS = field_validator("*", mode="before")(_numbers_not_booleans)
# A per-tier size (bytes or blocks) in a table: not negative, and strict, since the check above
# does not reach into tables (`cpu = true` would be 1).
TierSize = Annotated[int, Field(ge=0, strict=True)]


class Section(BaseModel):
    """A config table: unknown keys are refused, so a misspelt key never silently keeps its
    default, and a boolean is no number."""

    model_config = ConfigDict(extra="forbid")
    _numbers = NUMBERS_NOT_BOOLEANS


class EngineSection(Section):
    """The table of a source that observes one engine through the engine's own interface (no
    tap sends its name): ``model``, the model that engine serves, is the ``model`` label of
    ``kvscope_engine_info`` (the boards' ``$model``; empty: none); the source's spec names the
    engine (:class:`~kvscope.agent.sources.base.SourceSpec` ``engine``)."""

    model: str = Field("", max_length=64)


class ScrapeSection(EngineSection):
    """The table of a source that scrapes an engine's metrics endpoint: ``url`` (a subclass
    gives its engine's as the default, also the example a bad value is told), ``interval``
    seconds between scrapes; off by default (the engine may not run here)."""

    enabled: bool = False
    url: str
    interval: float = Field(5.0, ge=0.1, le=3600, allow_inf_nan=False)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return http_url(value, cls.model_fields["url"].default)
