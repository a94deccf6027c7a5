"""Config layering (defaults < TOML < environment < flags), errors and the TOML dump."""

from __future__ import annotations

import pytest

from node.config import Config, ConfigError, default_control_path, load_config, parse_host_port, to_toml


def write(tmp_path, text: str) -> str:
    path = tmp_path / "x.toml"
    path.write_text(text)
    return str(path)


def test_defaults():
    config = load_config(toml_path=None, environ={}, overrides={})
    assert isinstance(config, Config)
    assert config.node.run_id == "default"
    assert config.node.metrics_addr == "127.0.0.1:9400"
    assert config.inner.steps == 50
    assert config.swarm.listen == ["/ip4/127.0.0.1/tcp/0"]


def test_precedence_defaults_toml_env_flags(tmp_path):
    path = write(
        tmp_path,
        """
[node]
run_id = "from-toml"
seed = 1
[inner]
steps = 10
lr = 0.01
[swarm]
min_peers = 2
bootstrap = ["/ip4/127.0.0.1/tcp/1000"]
[outer]
nesterov = false
""",
    )
    environ = {
        "GONKA_NODE_RUN_ID": "from-env",
        "GONKA_INNER_STEPS": "20",
        "GONKA_SWARM_MIN_PEERS": "3",
        "GONKA_SWARM_BOOTSTRAP": "/ip4/127.0.0.1/tcp/2000, /ip4/127.0.0.1/tcp/2001",
        "GONKA_OUTER_NESTEROV": "yes",
        "PATH": "/usr/bin",  # not ours: ignored
    }
    overrides = {"inner.steps": 30, "swarm.min_peers": "4", "data.paths": ["a.txt"]}

    toml_only = load_config(toml_path=path, environ={}, overrides={})
    assert (toml_only.node.run_id, toml_only.inner.steps, toml_only.swarm.min_peers) == ("from-toml", 10, 2)
    assert toml_only.outer.nesterov is False
    assert toml_only.inner.lr == 0.01 and toml_only.node.seed == 1

    with_env = load_config(toml_path=path, environ=environ, overrides={})
    assert (with_env.node.run_id, with_env.inner.steps, with_env.swarm.min_peers) == ("from-env", 20, 3)
    assert with_env.swarm.bootstrap == ["/ip4/127.0.0.1/tcp/2000", "/ip4/127.0.0.1/tcp/2001"]
    assert with_env.outer.nesterov is True
    assert with_env.inner.lr == 0.01  # not overridden: TOML value stays

    everything = load_config(toml_path=path, environ=environ, overrides=overrides)
    assert (everything.node.run_id, everything.inner.steps, everything.swarm.min_peers) == ("from-env", 30, 4)
    assert everything.data.paths == ["a.txt"]
    assert everything.model.source == "tiny"  # default everywhere


def test_env_text_conversion():
    config = load_config(
        toml_path=None,
        environ={"GONKA_SWARM_NAT_TRAVERSAL": "1", "GONKA_INNER_LR": "3e-4", "GONKA_SWARM_ANNOUNCE": ""},
        overrides={},
    )
    assert config.swarm.nat_traversal is True
    assert config.inner.lr == 3e-4
    assert config.swarm.announce == []


@pytest.mark.parametrize(
    "environ, overrides, toml, expected",
    [
        ({}, {}, "[inner]\nstepz = 3\n", "config file x.toml: unknown key 'inner.stepz'"),
        ({}, {}, "[innr]\nsteps = 3\n", "config file x.toml: unknown section 'innr'"),
        ({}, {}, "[inner]\nsteps = 'abc'\n", "inner.steps: expected an integer, got 'abc' (from config file x.toml)"),
        ({}, {}, "[inner\nsteps = 3\n", "config file x.toml: invalid TOML"),
        ({"GONKA_INNER_STEPZ": "3"}, {}, None, "GONKA_INNER_STEPZ: unknown setting"),
        ({"GONKA_INNER_STEPS": "abc"}, {}, None, "inner.steps: expected an integer, got 'abc' (from GONKA_INNER_STEPS)"),
        ({"GONKA_OUTER_NESTEROV": "maybe"}, {}, None, "outer.nesterov: expected true or false, got 'maybe'"),
        ({"GONKA_INNER_LR": "fast"}, {}, None, "inner.lr: expected a number, got 'fast'"),
        ({}, {"inner.steps": "abc"}, None, "inner.steps: expected an integer, got 'abc'"),
        ({}, {"inner.stepz": 1}, None, "inner.stepz: unknown setting"),
        ({}, {"inner.steps": 0}, None, "inner.steps: must be >= 1 (got 0)"),
        ({"GONKA_INNER_STEPS": "0"}, {}, None, "inner.steps: must be >= 1 (got 0) (from GONKA_INNER_STEPS)"),
        ({}, {"swarm.listen": ["notamultiaddr"]}, None, "swarm.listen: not a multiaddr: 'notamultiaddr'"),
        ({}, {"node.metrics_addr": "nope"}, None, "node.metrics_addr: expected HOST:PORT"),
        ({}, {"node.metrics_addr": "127.0.0.1:70000"}, None, "node.metrics_addr: expected HOST:PORT"),
        ({}, {"model.source": "huge"}, None, "model.source: must be a preset (tiny, small, base) or hf:PATH"),
        ({}, {"model.source": "hf:"}, None, "model.source: must be a preset"),
        ({}, {"model.init": "pretrained"}, None, "model.init: pretrained needs hf:PATH"),
        ({}, {"node.device": "cuda:1x"}, None, "node.device: must be one of cpu, cuda, auto or cuda:N"),
        ({}, {"node.run_id": "a/b"}, None, "node.run_id: must be 1-64 characters"),
        ({}, {"node.device": "tpu"}, None, "node.device: must be one of cpu, cuda, auto"),
        ({}, {"node.log_level": "loud"}, None, "node.log_level: must be one of"),
        ({}, {"node.log_format": "xml"}, None, "node.log_format: must be one of text, json (got 'xml')"),
        ({}, {"node.max_rounds": -1}, None, "node.max_rounds: must be >= 0"),
        ({}, {"outer.land_step": -1}, None, "outer.land_step: must be >= 0 (got -1)"),
        ({}, {"inner.lr": "nan"}, None, "inner.lr: expected a finite number"),
    ],
)
def test_bad_values_name_the_key(tmp_path, environ, overrides, toml, expected):
    path = None
    if toml is not None:
        path = write(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        load_config(toml_path=path, environ=environ, overrides=overrides)
    message = str(info.value).replace(str(tmp_path / "x.toml"), "x.toml")
    assert message.startswith(expected), message
    assert "\n" not in message


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file .*missing\.toml: cannot read"):
        load_config(toml_path=str(tmp_path / "missing.toml"), environ={}, overrides={})


def test_validation_error_carries_key():
    with pytest.raises(ConfigError) as info:
        load_config(toml_path=None, environ={}, overrides={"inner.steps": 0})
    assert info.value.key == "inner.steps"


@pytest.mark.parametrize("message, key", [
    ("data.paths: /d/shard-0: truncated", "data.paths"),
    ("node.metrics_addr: expected HOST:PORT with a port in 0-65535, got 'x'", "node.metrics_addr"),
    ("swarm.member_cert: peer.cert: issued to another peer", "swarm.member_cert"),
    ("checkpoint: expected a dict", None),  # no setting: a fault of the program
    ("nodes.seed: x", None),
    ("node.seeds: x", None),
    ("math domain error", None),
])
def test_setting_error_only_for_a_message_naming_a_real_setting(message, key):
    from node.config import setting_error, setting_errors

    error = setting_error(ValueError(message))
    assert (error and error.key) == key
    if key is None:
        with pytest.raises(ValueError, match=message) as info, setting_errors():
            raise ValueError(message)
        assert not isinstance(info.value, ConfigError)
    else:
        assert str(error) == message
        with pytest.raises(ConfigError, match=message) as info, setting_errors():
            raise ValueError(message)
        assert info.value.key == key


def test_a_validation_fault_naming_no_setting_is_no_config_error(monkeypatch):
    from node.config import NodeConfig

    def broken(self):
        raise ValueError("invalid literal for int() with base 10: 'x'")

    monkeypatch.setattr(NodeConfig, "__post_init__", broken)
    with pytest.raises(ValueError, match="invalid literal") as info:
        load_config(toml_path=None, environ={}, overrides={})
    assert not isinstance(info.value, ConfigError)


def test_to_toml_round_trip(tmp_path):
    config = load_config(
        toml_path=None,
        environ={},
        overrides={
            "node.run_id": "run-1.a_b",
            "node.identity": 'C:\\keys\\"odd"\tname\x01',
            "node.metrics_addr": "off",
            "swarm.bootstrap": ["/ip4/127.0.0.1/tcp/1000", "/ip4/127.0.0.1/tcp/1001"],
            "swarm.nat_traversal": True,
            "swarm.gather_timeout": 12.5,
            "inner.lr": 3e-4,
            "inner.steps": 7,
            "outer.nesterov": False,
            "data.paths": ["ünïcode.txt"],
        },
    )
    text = to_toml(config)
    assert "steps = 7" in text
    assert "nesterov = false" in text
    path = write(tmp_path, text)
    assert load_config(toml_path=path, environ={}, overrides={}) == config
    default = load_config(toml_path=None, environ={}, overrides={})
    assert load_config(toml_path=write(tmp_path, to_toml(default)), environ={}, overrides={}) == default


def test_default_control_path():
    assert default_control_path("r1", {"XDG_RUNTIME_DIR": "/run/user/5"}) == "/run/user/5/gonka-node/r1.sock"
    assert default_control_path("r1", {}).endswith("/r1.sock")
    assert default_control_path("r1", {}).startswith("/tmp/gonka-node-")
    config = load_config(toml_path=None, environ={}, overrides={"node.control": "off"})
    assert config.node.control_path() is None
    config = load_config(toml_path=None, environ={}, overrides={"node.run_id": "x"})
    assert config.node.control_path({"XDG_RUNTIME_DIR": "/r"}) == "/r/gonka-node/x.sock"


def test_parse_host_port():
    assert parse_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_host_port("[::1]:9400") == ("::1", 9400)
    for bad in ("nope", ":9400", "host:", "host:-1", "host:65536"):
        with pytest.raises(ValueError):
            parse_host_port(bad)
