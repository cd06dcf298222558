"""The sources' contract (agent/sources/base.py): each source asks of the pipeline only what the
Consumer interface offers, the pipeline offers all of it, every source is registered with its
config table, and rules between sources are checked on the settings."""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest

from kvscope.agent import sources
from kvscope.agent.config import AgentSettings, ConfigError, load_settings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sections import Section
from kvscope.agent.sources import base
from kvscope.service.agent import Agent

SOURCE_MODULES = sorted(p for p in Path(sources.__file__).parent.glob("*.py")
                        if p.stem not in ("__init__", "base"))
CONSUMER = {name for name, member in vars(base.Consumer).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def _pipeline_calls(path: Path) -> set[str]:
    """Attributes a module reads of ``self.pipeline``."""
    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "pipeline"}


@pytest.mark.parametrize("path", SOURCE_MODULES, ids=lambda p: p.stem)
def test_a_source_asks_only_what_the_consumer_interface_offers(path):
    assert _pipeline_calls(path) <= CONSUMER


def test_the_reader_sees_calls_outside_the_interface(tmp_path):
    """The check above can fail: a source reaching into the pipeline's fold is caught."""
    module = tmp_path / "rogue.py"
    module.write_text("class S:\n    def run(self):\n        self.pipeline._fold.state()\n"
                      "        self.pipeline.drop('s', 'gap')\n")
    assert _pipeline_calls(module) - CONSUMER == {"_fold"}


@pytest.mark.parametrize("name", sorted(CONSUMER))
def test_the_pipeline_offers_the_whole_interface(name):
    ours = inspect.signature(getattr(Pipeline, name))
    theirs = inspect.signature(getattr(base.Consumer, name))
    assert list(ours.parameters) == list(theirs.parameters)


def test_every_source_is_registered_with_its_table_in_the_settings():
    assert set(base.REGISTRY) == {
        "ingest", "kv_events", "otlp_receiver", "vllm_metrics",
        "kvbm_metrics",
        "lmcache_metrics",
        "trtllm",
        "sglang_metrics",
    }
    for name, spec in base.REGISTRY.items():
        assert AgentSettings.model_fields[name].annotation is spec.config
        assert "enabled" in spec.config.model_fields
    # the environment reaches a source's table by its registered name
    assert load_settings(None, **{"kv_events.tiers": "gpu"}).kv_events.tiers == ["gpu"]


class _Config(Section):
    enabled: bool = True
    tiers: list[str] = ["cpu"]


def _spec(name, yields_to=()):
    return base.SourceSpec(name, _Config, lambda config, consumer, built: (name, built),
                           tiers=lambda config: config.tiers, yields_to=yields_to)


def test_two_sources_reporting_one_tier_are_refused_unless_one_yields(monkeypatch):
    """a and b both report cpu: refused, naming both tables. b yielding to a: accepted. b off:
    accepted. A tier each: accepted."""
    monkeypatch.setattr(base, "REGISTRY", {})
    base.register(_spec("a"))
    base.register(_spec("b"))
    with pytest.raises(ValueError, match=r"\[a\] and \[b\] both report the cpu tier"):
        base.check_overlaps({"a": _Config(), "b": _Config()})
    base.check_overlaps({"a": _Config(), "b": _Config(enabled=False)})
    base.check_overlaps({"a": _Config(), "b": _Config(tiers=["disk"])})
    monkeypatch.setattr(base, "REGISTRY", {})
    base.register(_spec("a"))
    base.register(_spec("b", yields_to=("a",)))
    base.check_overlaps({"a": _Config(), "b": _Config()})
    assert base.yielded_tiers(base.REGISTRY["b"], {"a": _Config(), "b": _Config()}) == {"cpu"}


def test_registering_twice_or_yielding_to_a_later_source_is_an_error(monkeypatch):
    monkeypatch.setattr(base, "REGISTRY", {})
    base.register(_spec("a"))
    with pytest.raises(ValueError, match="registered twice"):
        base.register(_spec("a"))
    with pytest.raises(ValueError, match="'later', which must register first"):
        base.register(_spec("b", yields_to=("later",)))


def test_a_new_source_is_built_from_its_spec_alone(monkeypatch):
    """A source registered by a new module is built with its own table, after the sources
    registered before it (which it may read), unless disabled or skipped."""
    monkeypatch.setattr(base, "REGISTRY", {})
    base.register(_spec("first"))
    base.register(_spec("new"))
    configs = {"first": _Config(), "new": _Config(tiers=["disk"])}
    built = base.build_sources(configs, consumer=None)
    assert list(built) == ["first", "new"]
    name, seen = built["new"]
    assert name == "new" and list(seen.parts) == ["first", "new"] and seen.configs is configs
    assert list(base.build_sources(configs, None, skip=("first",))) == ["new"]
    assert list(base.build_sources({**configs, "new": _Config(enabled=False)}, None)) == ["first"]


@pytest.mark.parametrize("tiers", [["gpu"], ["gpu", "cpu"]])
def test_the_real_rule_holds_in_the_settings_and_the_built_agent(tiers):
    """vllm_metrics leaves the tiers the KV events report to them: both on is valid, and the
    built metrics source's mapper takes no GPU snapshot, and no cpu stores when kv_events
    reports cpu."""
    settings = AgentSettings(kv_events={"enabled": True, "tiers": tiers},
                             vllm_metrics={"enabled": True})
    configs = {name: getattr(settings, name) for name in base.REGISTRY}
    assert base.yielded_tiers(base.REGISTRY["vllm_metrics"], configs) == set(tiers)
    mapper = Agent(settings, with_ingest=False).vllm_metrics.mapper
    assert (mapper.gpu_snapshot, mapper.stores) == (False, "cpu" not in tiers)


@pytest.mark.parametrize("other", ["kvbm_metrics", "lmcache_metrics"])
def test_vllm_metrics_beside_kvbm_or_lmcache_leaves_them_their_tiers(other):
    """Under KVBM's or LMCache's connector vLLM has no vllm:kv_offload_* series: the connector's
    source reports cpu, disk and remote, and vllm_metrics beside it (vLLM's tokens, TTFT and
    scheduler) is valid, its mapper reporting no cpu stores; both turned on with the KV events
    reporting cpu too is refused (two would count the cpu tier)."""
    settings = AgentSettings(vllm_metrics={"enabled": True}, **{other: {"enabled": True}})
    mapper = Agent(settings, with_ingest=False).vllm_metrics.mapper
    assert (mapper.gpu_snapshot, mapper.stores) == (True, False)
    with pytest.raises(ValueError, match=r"both report the cpu tier"):
        AgentSettings(kv_events={"enabled": True, "tiers": ["gpu", "cpu"]},
                      **{other: {"enabled": True}})


def test_two_sources_claiming_a_tier_in_a_file_name_the_file_not_an_empty_key(tmp_path,
                                                                              monkeypatch):
    """The check spans tables, so no one key is at fault: the line names the file and the two
    tables (it read "config agent.toml: : [kvbm_metrics] and ...")."""
    for key in [k for k in os.environ if k.startswith("KVSCOPE_")]:
        monkeypatch.delenv(key)
    path = tmp_path / "agent.toml"
    path.write_text("[trtllm]\nenabled = true\n[kvbm_metrics]\nenabled = true\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert str(caught.value).startswith(f"config {path}: [kvbm_metrics] and [trtllm] both "
                                        "report the cpu tier"), caught.value


ENGINES = {"vllm_metrics": "vllm", "trtllm": "tensorrt-llm", "kvbm_metrics": "dynamo",
           "lmcache_metrics": "lmcache", "sglang_metrics": "sglang"}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_a_source_of_an_engine_tells_its_engine_and_model(name):
    """No tap names the engine behind a zero-code source, so the agent exports
    ``kvscope_engine_info{source=name, engine, model}`` from its spec and its table's ``model``:
    without it the boards' ``$instance`` (the info metric's instances) would not list the
    agent. Built, not started: it is there before the engine first answers."""
    agent = Agent(AgentSettings(**{name: {"enabled": True, "model": "llama-3-8b"}}),
                  with_ingest=False)
    value = agent.exposition.registry.get_sample_value
    assert value("kvscope_engine_info", {"source": name, "engine": ENGINES[name],
                                         "model": "llama-3-8b"}) == 1
    assert agent.pipeline.snapshot().source_info == {name: (ENGINES[name], "llama-3-8b")}
    with pytest.raises(ValueError, match="model"):
        AgentSettings(**{name: {"enabled": True, "model": "m" * 65}})


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_the_kv_events_source_tells_its_flavour_as_the_engine(flavour):
    """The KV events come without a tap's batches naming the engine: the flavour is the
    ``engine`` label, the table's ``model`` the model ("" when not set)."""
    agent = Agent(AgentSettings(kv_events={"enabled": True, "engine": flavour, "model": "m"}),
                  with_ingest=False)
    assert agent.pipeline.snapshot().source_info == {"kv_events": (flavour, "m")}
    agent = Agent(AgentSettings(kv_events={"enabled": True, "engine": flavour}),
                  with_ingest=False)
    assert agent.pipeline.snapshot().source_info == {"kv_events": (flavour, "")}
