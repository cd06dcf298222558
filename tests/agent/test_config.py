"""Agent settings: defaults, TOML file, KVSCOPE_* environment, flags; clear errors."""

import re

import pytest

from conftest import REPO_ROOT
from kvscope.agent.config import AgentSettings, ConfigError, load_settings


def test_defaults_listen_on_loopback():
    settings = AgentSettings()
    assert settings.host == "127.0.0.1" and settings.port == 9400
    assert settings.ingest.endpoint == "tcp://127.0.0.1:5560"
    assert settings.token is None and settings.requests_capacity == 100_000


def test_file_then_environment_then_flags(tmp_path, monkeypatch):
    path = tmp_path / "agent.toml"
    path.write_text('port = 9500\nstore_dir = "/var/lib/kv"\n[ingest]\nendpoint = "ipc:///run/kv"\n'
                    '[collectors.host]\nreserve_bytes = 1024\nbudgets = { cpu = 4096 }\n'
                    '[collectors.gpu]\nenabled = false\n')
    monkeypatch.setenv("KVSCOPE_TOKEN", "t0k")
    settings = load_settings(path, port=9600, host=None)
    assert settings.port == 9600 and settings.host == "127.0.0.1"  # flag wins; None is ignored
    assert str(settings.store_dir) == "/var/lib/kv" and settings.token == "t0k"
    assert settings.ingest.endpoint == "ipc:///run/kv"
    assert settings.collectors.host.budgets == {"cpu": 4096}
    assert settings.collectors.gpu.enabled is False


@pytest.mark.parametrize("content,needle", [
    ("port = 99999\n", "port"),
    ('[ingest]\nendpoint = "http://x"\n', "ingest.endpoint"),
    ("colour = 'blue'\n", "colour"),
    ("port = \n", "agent.toml"),
    # [kv_events] tiers: only gpu, cpu and disk, at least one, a list of names
    ('[kv_events]\ntiers = ["gpu", "tape"]\n', "kv_events.tiers: .*unknown tier 'tape'"),
    ("[kv_events]\ntiers = []\n", "kv_events.tiers: .*at least one tier"),
    ('[kv_events]\ntiers = "gpu, tape"\n', "kv_events.tiers: .*unknown tier 'tape'"),
    ("[kv_events]\ntiers = [1]\n", "kv_events.tiers: .*list of tiers"),
    # a typo must not silently keep a default (kv_events ``tier`` for ``tiers`` would leave
    # every tier on and count the tap's tiers twice)
    ('[kv_events]\ntier = ["gpu"]\n', "kv_events.tier: not a setting .did you mean 'tiers'"),
    ('[ingest]\nendpoint_url = "tcp://127.0.0.1:5560"\n',
     "ingest.endpoint_url: not a setting .did you mean 'endpoint'"),
    ("[collectors.host]\nreserve = 1\n",
     "collectors.host.reserve: not a setting .did you mean 'reserve_bytes'"),
    ("zzz = 1\n", r"zzz: not a setting \(the keys here: host, port, "),
    # values that would be silently useless: a budget or capacity for a tier that does not
    # exist, a scrape URL without a scheme (it would fail only at run time), an empty token
    # (every /api call would get 401)
    ("[collectors.host]\nbudgets = { cpuu = 5000 }\n", "collectors.host.budgets: .*'cpuu'"),
    ("[kv_events]\ncapacity_blocks = { gpuu = 10 }\n", "kv_events.capacity_blocks: .*'gpuu'"),
    # a capacity for a tier the source does not report vanished (a tryout)
    ('[kv_events]\ntiers = ["gpu"]\ncapacity_blocks = { gpu = 100, cpu = 100 }\n',
     "kv_events.tiers: capacity_blocks gives tier 'cpu', which this source does not report "
     r"\(tiers: gpu\): add it to tiers or leave its capacity out"),
    ('[kv_events]\nengine = "sglang"\ncapacity_blocks = { disk = 100 }\n',  # tiers: gpu, cpu
     r"kv_events.*: capacity_blocks gives tier 'disk', .*\(tiers: gpu, cpu\)"),
    # an L2 holds what L1 (cpu) evicts: on the GPU it would count gpu tokens as an offload's
    ('[lmcache_metrics]\nl2_tiers = { nixl_store = "gpu" }\n',
     "lmcache_metrics.l2_tiers: .*nixl_store = 'gpu': an L2 adapter holds what LMCache's L1 "
     r"\(the cpu tier\) evicts, so its tier is disk or remote"),
    # trtllm-serve's paths are added to its URL: this one asked for .../metrics/kv_cache_events
    ('[trtllm]\nurl = "http://127.0.0.1:8000/prometheus/metrics"\n',
     "trtllm.url: is trtllm-serve's base URL, without /prometheus/metrics"),
    ('[trtllm]\nurl = "http://127.0.0.1:8000/kv_cache_events/"\n',
     "trtllm.url: is trtllm-serve's base URL, without /kv_cache_events"),
    ('[vllm_metrics]\nurl = "127.0.0.1:8000/metrics"\n', "vllm_metrics.url: .*http://"),
    ('token = " "\n', "token: .*empty"),
    # pydantic would read true as 1: port 1, one source, one request kept
    ("port = true\n", "^config .*: port: is true or false; give a number$"),
    # ZMQ would listen on another port than the one the taps are told
    ('[ingest]\nendpoint = "tcp://127.0.0.1:99999"\n', "ingest.endpoint: must end in :PORT"),
    ('[ingest]\nendpoint = "tcp://127.0.0.1:*"\n', "ingest.endpoint: must end in :PORT"),
    ('[ingest]\nendpoint = "tcp://127.0.0.1:\u0665\u0665\u0666\u0660"\n',  # Arabic-Indic digits
     "ingest.endpoint: must end in :PORT"),
    ("[ingest]\nmax_sources = true\n", "ingest.max_sources: is true or false"),
    # an interval of inf killed the sampler thread; 1e-9 spun a core
    ("sample_interval = inf\n", "sample_interval: .*finite"),
    ("sample_interval = 1e-9\n", "sample_interval: .*greater than or equal to 0.1"),
    # a negative budget got past the config and crashed the host collector with a traceback
    ("[collectors.host]\nbudgets = { cpu = -5 }\n",
     "collectors.host.budgets.cpu: .*greater than or equal to 0"),
    # the receiver's source becomes a metric label, like an ingest source name
    ('[otlp_receiver]\nsource = "Bad Name"\n',
     r"otlp_receiver.source: 'Bad Name' is not a lowercase word .*\[a-z\].*; use the engine"),
    # the agent's own source names: the tap's series would merge with the receiver's
    ('[otlp_receiver]\nsource = "otlp"\n', "otlp_receiver.source: 'otlp' is the agent's own"),
    ("prefill_tokens_per_second = inf\n", "prefill_tokens_per_second: .*finite"),
    # under 1 token/s the seconds saved could overflow to inf
    ("prefill_tokens_per_second = 1e-300\n",
     "prefill_tokens_per_second: .*greater than or equal to 1"),
    # twice this is ZMQ's size limit, a C long: 2**63 - 1 was a traceback
    ("[ingest]\nmax_batch_bytes = 9223372036854775807\n",
     "ingest.max_batch_bytes: .*less than or equal to 1073741824"),
    # curl sends a header's bytes as UTF-8, the server reads them as latin-1: never equal
    ('token = "pässwörd"\n', "token: must be printable ASCII"),
    # HTTPBearer strips what the client sends: " s3cret" could never match
    ('token = " s3cret"\n', "token: must be printable ASCII without spaces at either end"),
    ("prefill_tokens_per_second = nan\n", "prefill_tokens_per_second: .*finite"),
    ("sample_interval = nan\n", "sample_interval: .*finite"),  # once "<= 3600"
    # "" listened on every interface (and the banner said http://:9400/metrics)
    ('host = ""\n', "host: is empty, .*use 0.0.0.0 \\(or :: for IPv6\\)"),
    # "" is Path("."): the agent wrote its store or captures into its working directory
    ('store_dir = ""\n', "store_dir: is empty, .*leave it out to keep requests in memory only"),
    ('capture_dir = ""\n', "capture_dir: is empty, .*leave it out not to capture"),
    # inside a table a true was 1 and a negative count got through
    ("[collectors.host]\nbudgets = { cpu = true }\n", "collectors.host.budgets.cpu: .*integer"),
    ("[kv_events]\ncapacity_blocks = { gpu = -1 }\n",
     "kv_events.capacity_blocks.gpu: .*greater than or equal to 0"),
    ("store_max_age = inf\n", "store_max_age: .*finite"),
    ("store_max_age = 1e308\n", "store_max_age: .*less than or equal to"),
    # past a C ssize_t the request table's constructor raised OverflowError (a traceback)
    ("requests_capacity = 99999999999999999999999\n",
     "requests_capacity: .*less than or equal to 100000000"),
])
def test_bad_values_name_the_key(tmp_path, content, needle):
    path = tmp_path / "agent.toml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=needle):
        load_settings(path)


def test_the_edges_of_the_new_checks_are_still_accepted(tmp_path):
    """A zero budget, a source name with a digit and a dash, every interface said explicitly and
    the current directory said as ``.`` all stay valid."""
    path = tmp_path / "agent.toml"
    path.write_text('host = "0.0.0.0"\nstore_dir = "."\n[collectors.host]\nbudgets = { cpu = 0 }\n'
                    '[otlp_receiver]\nsource = "vllm-dp1"\n'
                    # a capacity for a reported tier; an L2 placed remote; a server behind a
                    # proxy's path prefix
                    '[kv_events]\ntiers = ["gpu"]\ncapacity_blocks = { gpu = 100 }\n'
                    '[lmcache_metrics]\nl2_tiers = { nixl_store = "remote" }\n'
                    '[trtllm]\nurl = "http://gateway:8080/trtllm/"\n')
    settings = load_settings(path)
    assert settings.kv_events.capacity_blocks == {"gpu": 100}
    assert settings.lmcache_metrics.l2_tiers == {"nixl_store": "remote"}
    assert settings.trtllm.url == "http://gateway:8080/trtllm/"
    assert settings.host == "0.0.0.0" and str(settings.store_dir) == "."
    assert settings.collectors.host.budgets == {"cpu": 0}
    assert settings.otlp_receiver.source == "vllm-dp1"


@pytest.mark.parametrize("variable,value,needle", [
    ("KVSCOPE_COLLECTORS__HOST__BUDGETS", '{"cpu": -5}', "greater than or equal to 0"),
    ("KVSCOPE_OTLP_RECEIVER__SOURCE", "Bad Name", "is not a lowercase word"),
    ("KVSCOPE_PREFILL_TOKENS_PER_SECOND", "inf", "finite"),
    ("KVSCOPE_HOST", "", "is empty"),
    ("KVSCOPE_STORE_DIR", "", "is empty"),
    ("KVSCOPE_CAPTURE_DIR", "", "is empty"),
])
def test_the_same_bad_values_from_the_environment_name_their_variable(monkeypatch, variable,
                                                                     value, needle):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"^environment: {variable}: .*{needle}"):
        load_settings(None)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_settings(tmp_path / "absent.toml")


def test_otlp_endpoint_must_be_a_url():
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        load_settings(None, otlp_endpoint="not a url")


def test_the_documented_example_is_a_valid_config(tmp_path):
    """docs/agent.md's TOML example must load as it stands (it drifts otherwise)."""

    text = (REPO_ROOT / "docs" / "agent.md").read_text()
    example = text.split("```toml", 1)[1].split("```", 1)[0]
    path = tmp_path / "agent.toml"
    path.write_text(example)
    settings = load_settings(path)
    # no budget typed: the engine reports its own (docs/collectors.md, Memory budgets)
    assert settings.collectors.host.budgets == {}
    assert settings.collectors.host.engine_pid == settings.collectors.numa.engine_pid == 12345
    assert settings.kv_events.enabled is False and settings.otlp_receiver.enabled is True


@pytest.mark.parametrize("url", ["http://", "https://[::1", "http://127.0.0.1:99999",
                                 "http://127.0.0.1:abc", "http://:4318", "http://exa mple.com"])
def test_malformed_otlp_urls_are_refused(url):
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        load_settings(None, otlp_endpoint=url)


def test_a_config_that_is_not_utf8(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_bytes(b"port = 9400\n\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(path)


def test_kv_events_tiers_from_file_and_environment(tmp_path, monkeypatch):
    """``[kv_events] tiers``: all three by default; a TOML list; in the environment JSON or a
    comma-separated list (like every other key, it has a KVSCOPE_* form)."""
    assert AgentSettings().kv_events.tiers == ["gpu", "cpu", "disk"]
    path = tmp_path / "agent.toml"
    path.write_text('[kv_events]\nenabled = true\ntiers = ["gpu"]\n')
    assert load_settings(path).kv_events.tiers == ["gpu"]
    for value, expected in (('["gpu", "disk"]', ["gpu", "disk"]), ("gpu", ["gpu"]),
                            (" cpu , gpu,cpu", ["cpu", "gpu"])):
        monkeypatch.setenv("KVSCOPE_KV_EVENTS__TIERS", value)
        assert load_settings(None).kv_events.tiers == expected, value


def test_an_environment_value_that_does_not_parse_is_one_config_error(monkeypatch):
    monkeypatch.setenv("KVSCOPE_KV_EVENTS__CAPACITY_BLOCKS", "x")
    with pytest.raises(ConfigError, match="^environment: KVSCOPE_KV_EVENTS__CAPACITY_BLOCKS "
                       "does not parse .* are JSON"):
        load_settings(None)


def test_only_the_variable_that_does_not_parse_is_named(monkeypatch):
    """A tryout's two variables of one table, one of them a list not in JSON: the error named
    both ("KVSCOPE_TRTLLM__ENABLED or KVSCOPE_TRTLLM__LEVELS does not parse"); ENABLED=true,
    a plain value, and URL, text that is no JSON but needs none, are fine."""
    monkeypatch.setenv("KVSCOPE_TRTLLM__ENABLED", "true")
    monkeypatch.setenv("KVSCOPE_TRTLLM__URL", "http://127.0.0.1:8000")
    monkeypatch.setenv("KVSCOPE_TRTLLM__LEVELS", "gpu,cpu")
    with pytest.raises(ConfigError, match="^environment: KVSCOPE_TRTLLM__LEVELS does not parse"):
        load_settings(None)


@pytest.mark.parametrize("variable", ["KVSCOPE_PROT", "KVSCOPE_INGEST_ENDPOINT",
                                      "KVSCOPE_INGETS__ENDPOINT", "KVSCOPE_KV_EVENTS_ENABLED"])
def test_an_unknown_environment_variable_is_refused_by_name(monkeypatch, variable):
    """A misspelt variable (one underscore where two nest a key is the likely slip) must not be
    ignored silently; kvscope's other tools' variables are not settings and pass."""
    monkeypatch.setenv("KVSCOPE_VLLM_PYTHON", "/usr/bin/python3")
    assert load_settings(None).port == 9400
    monkeypatch.setenv(variable, "1")
    with pytest.raises(ConfigError, match=f"environment: {variable} is not a setting"):
        load_settings(None)


@pytest.mark.parametrize("variable", ["kvscope_port", "KVSCOPE_port", "Kvscope_Port"])
def test_a_variable_not_in_upper_case_is_refused(monkeypatch, variable):
    """kvscope_port=1 beside KVSCOPE_PORT=19504 was read, and won (the agent bound port 1);
    a bad value in it was blamed on KVSCOPE_PORT."""
    monkeypatch.setenv("KVSCOPE_PORT", "19504")
    monkeypatch.setenv(variable, "1")
    with pytest.raises(ConfigError, match=f"^environment: {variable}: kvscope's variables are "
                       "upper case; rename it KVSCOPE_PORT"):
        load_settings(None)


@pytest.mark.parametrize("text, key", [("port = 19440\nPORT = 19442\n", "PORT"),
                                       ("Port = 19442\n", "Port"),
                                       ("[INGEST]\nendpoint = 'tcp://127.0.0.1:19441'\n",
                                        "INGEST")])
def test_a_key_not_in_lower_case_is_refused(tmp_path, text, key):
    """A tryout's file set port twice, as port and PORT: the agent started on one of them,
    unsaid (TOML itself refuses a key twice, and the tables' keys, ENDPOINT, were refused)."""
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^config {path}: {key}: kvscope's keys are lower "
                       f"case; write {key.lower()}$"):
        load_settings(path)


@pytest.mark.parametrize("text, key, value", [
    ('port = "19440"\n', "port", "19440"), ('sample_interval = " 1 "\n', "sample_interval", " 1 "),
    ('[ingest]\nmax_sources = "16"\n', "ingest.max_sources", "16"),
    ('[collectors.host]\nengine_pid = "12"\n', "collectors.host.engine_pid", "12")])
def test_a_number_given_as_text_in_the_file_is_refused(tmp_path, text, key, value):
    """A tryout's port = "19440" (and " 19440 ", sample_interval = "1") started the agent:
    pydantic reads text as a number, as it must for environment variables, while the file's
    true and [19440] were refused. The same value without quotes, or from the environment,
    still goes."""
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^config {re.escape(str(path))}: {re.escape(key)}: "
                       f"{re.escape(repr(value))} is text; give a number, without quotes$"):
        load_settings(path)
    path.write_text(text.replace(f'"{value}"', value.strip()))
    load_settings(path)


def test_a_bad_environment_value_names_its_variable_not_the_file(tmp_path, monkeypatch):
    path = tmp_path / "agent.toml"
    path.write_text("[ingest]\n")
    monkeypatch.setenv("KVSCOPE_PORT", "abc")
    with pytest.raises(ConfigError, match="^environment: KVSCOPE_PORT: Input should be"):
        load_settings(path)
    path.write_text('port = "abc"\n')  # the file's own bad value is the file's
    with pytest.raises(ConfigError, match=f"^config {path}: port: 'abc' is text; give a number"):
        load_settings(path)
    # the file (or a flag) wins over a variable, but a bad variable is still no silence
    path.write_text("port = 9555\n")
    with pytest.raises(ConfigError, match="^environment: KVSCOPE_PORT: Input should be a "
                       "valid integer.* sets port too and takes precedence"):
        load_settings(path)
    with pytest.raises(ConfigError, match="^environment: KVSCOPE_PORT: .* takes precedence"):
        load_settings(None, port=9556)
    monkeypatch.setenv("KVSCOPE_PORT", "9000")  # a good one is overridden as documented
    assert load_settings(path).port == 9555


def test_a_bad_file_value_a_flag_overrides_is_still_refused(tmp_path):
    """The flag wins over the file, but the file's bad value was never checked: port = 70000
    beside --port, an empty store_dir beside --store-dir and a bogus ingest endpoint beside
    --ingest started the agent, until the flag left the unit file. Each is refused, naming
    the file and the key; a good value a flag overrides is overridden as documented."""
    path = tmp_path / "agent.toml"
    for text, flag, says in (
            ("port = 70000\n", {"port": 19840}, "port: Input should be less than 65536"),
            ('store_dir = ""\n', {"store_dir": str(tmp_path / "s")}, "store_dir: "),
            ('[ingest]\nendpoint = "bogus"\n', {"ingest.endpoint": "tcp://127.0.0.1:19841"},
             "ingest.endpoint: ")):
        path.write_text(text)
        with pytest.raises(ConfigError) as refused:
            load_settings(path, **flag)
        message = str(refused.value)
        assert message.startswith(f"config {path}: {says}") and message.endswith(
            "(a flag sets it too and takes precedence; fix the file)"), message
    path.write_text("port = 9555\n")
    assert load_settings(path, port=19840).port == 19840


def test_a_check_across_a_tables_keys_names_where_the_table_was_set(tmp_path, monkeypatch):
    """kv_events' endpoint and replay_endpoint on one socket fail dp_size's check (its default,
    set nowhere): the file that set the endpoints is named, not "environment: KVSCOPE_*"; the
    same from the environment names the table's variables."""
    path = tmp_path / "agent.toml"
    path.write_text('[kv_events]\nendpoint = "tcp://*:5557"\nreplay_endpoint = "tcp://*:5557"\n')
    with pytest.raises(ConfigError, match=f"^config {path}: kv_events: the endpoint .* are the "
                       "same socket"):
        load_settings(path)
    monkeypatch.setenv("KVSCOPE_KV_EVENTS__ENDPOINT", "tcp://*:5557")
    monkeypatch.setenv("KVSCOPE_KV_EVENTS__REPLAY_ENDPOINT", "tcp://*:5557")
    with pytest.raises(ConfigError, match=r"^environment: KVSCOPE_KV_EVENTS__\*: the endpoint"):
        load_settings(None)


# each `kvscope agent` flag, a value for it, and the same setting in the TOML file
AGENT_FLAGS = {
    "--host": ("0.0.0.0", 'host = "0.0.0.0"'),
    "--port": ("9555", "port = 9555"),
    "--ingest": ("ipc:///run/kvscope.sock", '[ingest]\nendpoint = "ipc:///run/kvscope.sock"'),
    "--store-dir": ("/var/lib/kvscope", 'store_dir = "/var/lib/kvscope"'),
    "--otlp-endpoint": ("http://127.0.0.1:4318/v1/traces",
                        'otlp_endpoint = "http://127.0.0.1:4318/v1/traces"'),
    "--capture-dir": ("/var/lib/kvscope/capture", 'capture_dir = "/var/lib/kvscope/capture"'),
    "--log-level": ("debug", 'log_level = "debug"'),
}


def test_every_agent_flag_has_a_config_key_with_the_same_effect(tmp_path):
    """The issue asks for a config key behind every flag: each flag of `kvscope agent --help`
    (but --config) is listed above, and setting it equals setting its key in the file, and
    differs from the default."""
    from kvscope.cli import _parser, agent_settings

    parser = _parser()
    agent = parser.parse_args(["agent"])
    flags = {option for action in agent.commands["agent"]._actions
             for option in action.option_strings if option.startswith("--")}
    assert flags - {"--help", "--config"} == set(AGENT_FLAGS)
    default = agent_settings(agent)
    for flag, (value, toml) in AGENT_FLAGS.items():
        path = tmp_path / f"{flag.strip('-')}.toml"
        path.write_text(toml + "\n")
        by_flag = agent_settings(parser.parse_args(["agent", flag, value]))
        by_file = agent_settings(parser.parse_args(["agent", "--config", str(path)]))
        assert by_flag == by_file != default, flag
