"""Agent settings: defaults, TOML file, KVSCOPE_* environment, flags; clear errors."""

import pytest

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
])
def test_bad_values_name_the_key(tmp_path, content, needle):
    path = tmp_path / "agent.toml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=needle):
        load_settings(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_settings(tmp_path / "absent.toml")


def test_otlp_endpoint_must_be_a_url():
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        load_settings(None, otlp_endpoint="not a url")


def test_the_documented_example_is_a_valid_config(tmp_path):
    """docs/agent.md's TOML example must load as it stands (it drifts otherwise)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "agent.md").read_text()
    example = text.split("```toml", 1)[1].split("```", 1)[0]
    path = tmp_path / "agent.toml"
    path.write_text(example)
    settings = load_settings(path)
    assert settings.collectors.host.budgets == {"cpu": 68719476736}
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
