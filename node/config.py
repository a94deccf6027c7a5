"""The node's whole configuration: one section per component, four layers.

Every setting lives in exactly one section dataclass (``node`` here, the others
next to the code they configure) and is addressed as ``section.field``. The
effective value comes from, lowest to highest precedence: the dataclass
default, the TOML file, a ``GONKA_<SECTION>_<FIELD>`` environment variable,
and the command line. Any bad value becomes a ``ConfigError`` (node/errors.py)
whose message is one line naming the key (and where the value came from),
which the CLI prints as is with exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from node.errors import ConfigError
from p2p import faults as fault_hooks, hostile as hostile_hooks
from p2p.config import SwarmConfig
from trainer.config import DataConfig, HostConfig, InnerConfig, ModelConfig, OuterConfig, require

import tomllib

DEVICES = ("cpu", "cuda", "auto")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
ENV_PREFIX = "GONKA_"
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
_MAX_SOCKET_PATH = 107


def default_control_path(run_id: str, environ: Mapping[str, str] | None = None) -> str:
    """Where a node with this run id listens for ``gonka-node status`` by default.

    Under $XDG_RUNTIME_DIR when the session has one (per-user, cleaned at
    logout); otherwise a per-uid directory in /tmp, so two users on one host
    never collide.
    """
    env = os.environ if environ is None else environ
    runtime_dir = env.get("XDG_RUNTIME_DIR", "")
    if runtime_dir:
        return os.path.join(runtime_dir, "gonka-node", f"{run_id}.sock")
    return os.path.join("/tmp", f"gonka-node-{os.getuid()}", f"{run_id}.sock")


def parse_host_port(text: str) -> tuple[str, int]:
    """Split "HOST:PORT" (IPv6 hosts in brackets) into (host, port); ValueError if malformed."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0-65535, got {text!r}")
    return host, int(port)


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    # Name of the training run; peers only train together within one run id.
    # Also names the default control socket, so two nodes on one host need two.
    run_id: str = "default"
    # Path of the libp2p private key file (created on first start, never
    # overwritten). Empty: a fresh ephemeral identity, a new peer id each start.
    identity: str = ""
    # Directory for checkpoints written after committed rounds. Empty: none.
    checkpoint_dir: str = ""
    # File rewritten (atomically) with the node's status as JSON. Empty: none.
    status_file: str = ""
    # Unix socket of the local control API (used by `gonka-node status`).
    # Empty: the default path for this run id; "off": no control socket.
    control: str = ""
    # HOST:PORT of the Prometheus /metrics endpoint; "off" disables it.
    metrics_addr: str = "127.0.0.1:9400"
    # Where the model trains: cpu, cuda (the first GPU), cuda:N, or auto (cuda when available).
    device: str = "auto"
    # Seed of model initialisation and data order.
    seed: int = 0
    # Stop after this many committed outer rounds; 0 = train until stopped.
    max_rounds: int = 0
    # torch intra-op threads; 0 = torch's default (one per core).
    threads: int = 0
    # Log verbosity: debug, info, warning or error.
    log_level: str = "info"
    # Log lines: text, or json (one object per line: time, level, logger, message).
    log_format: str = "text"

    def __post_init__(self) -> None:
        require(
            isinstance(self.run_id, str) and _RUN_ID.fullmatch(self.run_id) is not None,
            "node.run_id",
            f"must be 1-64 characters of A-Z a-z 0-9 . _ - (got {self.run_id!r})",
        )
        if self.control not in ("", "off"):
            require(
                len(os.fsencode(self.control)) <= _MAX_SOCKET_PATH,
                "node.control",
                f"socket path longer than {_MAX_SOCKET_PATH} bytes: {self.control!r}",
            )
        if self.metrics_addr != "off":
            try:
                parse_host_port(self.metrics_addr)
            except ValueError as exc:
                raise ValueError(f"node.metrics_addr: {exc} (or 'off')") from None
        require(self.device in DEVICES or re.fullmatch(r"cuda:\d{1,3}", self.device) is not None, "node.device",
                f"must be one of {', '.join(DEVICES)} or cuda:N (got {self.device!r})")
        require(self.seed >= 0, "node.seed", f"must be >= 0 (got {self.seed})")
        require(self.max_rounds >= 0, "node.max_rounds", f"must be >= 0 (got {self.max_rounds})")
        require(self.threads >= 0, "node.threads", f"must be >= 0 (got {self.threads})")
        require(
            self.log_level in LOG_LEVELS,
            "node.log_level",
            f"must be one of {', '.join(LOG_LEVELS)} (got {self.log_level!r})",
        )
        require(self.log_format in LOG_FORMATS, "node.log_format",
                f"must be one of {', '.join(LOG_FORMATS)} (got {self.log_format!r})")

    def control_path(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The control socket to bind, or None when it is "off"."""
        if self.control == "off":
            return None
        return self.control or default_control_path(self.run_id, environ)


@dataclass(kw_only=True, slots=True)
class Config:
    node: NodeConfig
    swarm: SwarmConfig
    model: ModelConfig
    data: DataConfig
    inner: InnerConfig
    outer: OuterConfig
    host: HostConfig


# Section name -> its dataclass, in the order the TOML dump lists them.
SECTIONS: dict[str, type] = {
    "node": NodeConfig,
    "swarm": SwarmConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "inner": InnerConfig,
    "outer": OuterConfig,
    "host": HostConfig,
}


def default_of(key: str) -> object:
    """The built-in default of a setting ("inner.steps" -> 50): what ``--help`` shows."""
    section, name = key.split(".")
    field = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _field_types(cls: type) -> dict[str, Any]:
    # The configs use `from __future__ import annotations`: field.type is a
    # string, get_type_hints resolves it to the real type.
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


FIELD_TYPES: dict[str, dict[str, Any]] = {name: _field_types(cls) for name, cls in SECTIONS.items()}

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _convert(key: str, value: object, kind: Any, *, parse_text: bool) -> object:
    """Check `value` against the field type, parsing it first if it is text from env/flags."""
    if kind is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{key}: expected a string, got {value!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if parse_text and isinstance(value, str):
            if value.strip().lower() in _TRUE:
                return True
            if value.strip().lower() in _FALSE:
                return False
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if parse_text and isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            result = float(value)
        elif parse_text and isinstance(value, str):
            try:
                result = float(value.strip())
            except ValueError:
                raise ValueError(f"{key}: expected a number, got {value!r}") from None
        else:
            raise ValueError(f"{key}: expected a number, got {value!r}")
        # No setting means anything with inf or nan; reject them here once.
        if not math.isfinite(result):
            raise ValueError(f"{key}: expected a finite number, got {value!r}")
        return result
    if typing.get_origin(kind) is list and typing.get_args(kind) == (str,):
        if parse_text and isinstance(value, str):
            # Comma-separated on the command line and in the environment;
            # an empty string is the empty list.
            return [item.strip() for item in value.split(",") if item.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            return list(value)
        raise ValueError(f"{key}: expected a list of strings, got {value!r}")
    raise AssertionError(f"{key}: unsupported field type {kind!r}")


def _split_key(key: str) -> tuple[str, str] | None:
    section, dot, name = key.partition(".")
    if dot and section in FIELD_TYPES and name in FIELD_TYPES[section]:
        return section, name
    return None


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: invalid TOML: {exc}") from None


def env_setting(var: str) -> str | None:
    """The dotted key an environment variable sets, or None if it is no setting.

    Only ``GONKA_<SECTION>_<KEY>`` of a known section is one (an unknown key of a known section
    is still an error); the project's other variables (``GONKA_NATIVE_DIR``, ``GONKA_TEST_FAULT``,
    ...) belong to no section and are left to the code that reads them."""
    if not var.startswith(ENV_PREFIX):
        return None
    section, _, name = var[len(ENV_PREFIX):].lower().partition("_")
    if section not in SECTIONS:
        return None
    return f"{section}.{name}"


def load_config(*, toml_path: str | None, environ: Mapping[str, str], overrides: dict[str, object]) -> Config:
    """Build the effective Config: defaults < TOML file < GONKA_* environment < overrides.

    `overrides` maps dotted keys ("inner.steps") to typed values or to text,
    which is parsed like an environment variable.
    """
    values: dict[str, dict[str, object]] = {section: {} for section in SECTIONS}
    # Where each explicitly set key came from, so a validation error can say.
    sources: dict[str, str] = {}

    def put(key: str, value: object, *, parse_text: bool, source: str | None) -> None:
        section, name = key.split(".")
        suffix = f" (from {source})" if source else ""
        try:
            values[section][name] = _convert(key, value, FIELD_TYPES[section][name], parse_text=parse_text)
        except ValueError as exc:
            raise ConfigError(f"{exc}{suffix}", key) from None
        if source:
            sources[key] = source
        else:
            sources.pop(key, None)

    if toml_path is not None:
        source = f"config file {toml_path}"
        document = _read_toml(toml_path)
        for section, table in document.items():
            if section not in SECTIONS:
                raise ConfigError(f"{source}: unknown section '{section}' (known: {', '.join(SECTIONS)})")
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: '{section}' must be a table ([{section}])")
            for name, value in table.items():
                key = f"{section}.{name}"
                if _split_key(key) is None:
                    raise ConfigError(f"{source}: unknown key '{key}'", key)
                # TOML values are typed already: "20" for an integer is a mistake.
                put(key, value, parse_text=False, source=source)

    for var in sorted(environ):
        key = env_setting(var)
        if key is None:
            continue
        if _split_key(key) is None:
            raise ConfigError(f"{var}: unknown setting (known in [{key.partition('.')[0]}]: "
                              f"{', '.join(FIELD_TYPES[key.partition('.')[0]])})")
        put(key, environ[var], parse_text=True, source=var)

    for key, value in overrides.items():
        if _split_key(key) is None:
            raise ConfigError(f"{key}: unknown setting", key)
        put(key, value, parse_text=True, source=None)

    sections: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        try:
            sections[section] = cls(**values[section])
        except ValueError as exc:
            error = setting_error(exc)
            if error is None:  # no setting named: a fault in the validation itself
                raise
            source = sources.get(error.key)
            raise ConfigError(str(error) + (f" (from {source})" if source else ""), error.key) from None
    return Config(**sections)


@dataclass(frozen=True, slots=True)
class FaultInjection:
    """What tests ask a node to do wrong: die or wait at a chosen point (p2p/faults.py), lie as an
    attacker would (p2p/hostile.py). No setting: only the ``GONKA_TEST_*`` variables set it,
    and the node hands both to the components that act on them."""

    faults: fault_hooks.Faults = dataclasses.field(default_factory=fault_hooks.Faults)
    hostile: hostile_hooks.Behaviour = hostile_hooks.HONEST


def load_injection(environ: Mapping[str, str]) -> FaultInjection:
    """The one place the test hooks are read, at start-up; a bad value is a ``ConfigError``
    naming its variable (exit code 2)."""
    try:
        return FaultInjection(fault_hooks.from_environ(environ), hostile_hooks.from_environ(environ))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def setting_error(exc: ValueError) -> ConfigError | None:
    """``exc`` as the bad setting it reports, or None when it reports none.

    The components validate what they are given and say which setting is wrong with
    ``ValueError("section.key: ...")`` (trainer/config.py ``require``, and e.g. data.paths,
    node.checkpoint_dir, node.identity found at start-up). Only a message that begins with a
    real key is about the user's input (exit code 2); any other ValueError is a fault of the
    program and must surface as one."""
    if isinstance(exc, ConfigError):
        return exc
    message = str(exc)
    key, colon, _ = message.partition(": ")
    if not colon or _split_key(key) is None:
        return None
    return ConfigError(message, key)


@contextlib.contextmanager
def setting_errors() -> Iterator[None]:
    """Around code handed the user's settings: a ValueError naming one becomes its ConfigError
    (exit code 2); any other ValueError propagates as the fault it is."""
    try:
        yield
    except ValueError as exc:
        error = setting_error(exc)
        if error is None or error is exc:
            raise
        raise error from None


def _toml_string(text: str) -> str:
    out = []
    for char in text:
        if char == '"':
            out.append('\\"')
        elif char == "\\":
            out.append("\\\\")
        elif char == "\t":
            out.append(char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            # TOML forbids raw control characters in basic strings.
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        # repr is the shortest text that reads back to the same float, and
        # its forms (1e-05, 0.7) are valid TOML floats.
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise AssertionError(f"cannot write {value!r} as TOML")


def to_toml(config: Config) -> str:
    """The configuration as a TOML document that load_config reads back to an equal Config."""
    lines = ["# gonka-node effective configuration"]
    for section in SECTIONS:
        lines.append("")
        lines.append(f"[{section}]")
        part = getattr(config, section)
        for field in dataclasses.fields(part):
            lines.append(f"{field.name} = {_toml_value(getattr(part, field.name))}")
    return "\n".join(lines) + "\n"
