"""The `gonka-node` command as users run it: exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args: str, env: dict[str, str] | None = None, cwd: str = ROOT) -> subprocess.CompletedProcess:
    # The user's own GONKA_* settings must not leak into the tests.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GONKA_")}
    environ["PYTHONPATH"] = ROOT
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, env=environ, cwd=cwd, timeout=60
    )


def assert_usage_error(result: subprocess.CompletedProcess, *names: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gonka-node: error: "), lines[0]
    for name in names:
        assert name in lines[0], lines[0]


@pytest.mark.parametrize(
    "args, env, names",
    [
        (["start", "--inner-steps", "0"], {}, ["inner.steps", "--inner-steps"]),
        (["start", "--inner-steps", "x"], {}, ["--inner-steps"]),
        (["start", "--model", "huge"], {}, ["model.source", "huge"]),
        (["start", "--device", "cuda:x"], {}, ["node.device", "cuda:x"]),
        (["start", "--set", "model.init=copied"], {}, ["model.init", "copied"]),
        (["start", "--set", "inner.precision=fp8"], {}, ["inner.precision", "fp8"]),
        (["start", "--bogus-flag"], {}, ["--bogus-flag"]),
        (["start", "--config", "missing.toml"], {}, ["missing.toml"]),
        (["start"], {"GONKA_INNER_STEPS": "abc"}, ["inner.steps", "GONKA_INNER_STEPS"]),
        (["start", "--set", "inner.stepz=3"], {}, ["inner.stepz"]),
        (["start", "--set", "nokey"], {}, ["--set"]),
        (["start", "--metrics-addr", "nope"], {}, ["node.metrics_addr"]),
        (["start", "--listen", "notamultiaddr"], {}, ["swarm.listen", "--listen"]),
        ([], {}, ["COMMAND"]),
        (["start", "--nproc-per-node", "0"], {}, ["host.nproc_per_node", "--nproc-per-node"]),
        (["start", "--parallel", "tp"], {}, ["host.parallel", "tp"]),
        # Checked before any rank starts: more CPU ranks than cores, more ranks than GPUs, one GPU
        # named for several ranks.
        (["start", "--nproc-per-node", str(4 * (os.cpu_count() or 1)), "--device", "cpu"], {},
         ["host.nproc_per_node", "cores"]),
        (["start", "--nproc-per-node", "2", "--device", "cuda:1"], {}, ["node.device"]),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(args, env, names):
    assert_usage_error(run(*args, env=env), *names)


def test_print_config(tmp_path, capsys, monkeypatch):
    config = tmp_path / "c.toml"
    config.write_text('[inner]\nsteps = 3\nlr = 0.002\n[swarm]\nbootstrap = ["/ip4/127.0.0.1/tcp/1"]\n')
    result = run(
        "start",
        "--config", str(config),
        "--print-config",
        "--inner-steps", "7",
        "--bootstrap", "/ip4/127.0.0.1/tcp/2",
        "--bootstrap", "/ip4/127.0.0.1/tcp/3",
        "--nat-traversal",
        "--set", "outer.lr=0.5",
        env={"GONKA_NODE_RUN_ID": "envrun"},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "steps = 7" in out
    assert "lr = 0.002" in out  # from the file, not overridden
    assert "lr = 0.5" in out
    assert 'run_id = "envrun"' in out
    # Repeated flags replace the file's list.
    assert 'bootstrap = ["/ip4/127.0.0.1/tcp/2", "/ip4/127.0.0.1/tcp/3"]' in out
    assert "nat_traversal = true" in out
    # The printed config is itself a valid config file.
    again = tmp_path / "again.toml"
    again.write_text(out)
    # In-process, to keep the test fast: the subprocess path is covered above.
    from node.cli import main

    for var in [v for v in os.environ if v.startswith("GONKA_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("GONKA_NODE_RUN_ID", "envrun")
    capsys.readouterr()
    assert main(["start", "--config", str(again), "--print-config"]) == 0
    assert capsys.readouterr().out == out


def test_version():
    result = run("version")
    assert result.returncode == 0
    assert result.stdout.startswith("gonka-node ")


def test_help_documents_every_flag():
    result = run("start", "--help")
    assert result.returncode == 0
    for flag in ("--config", "--run-id", "--bootstrap", "--listen", "--announce", "--identity", "--data", "--model",
                 "--inner-steps", "--max-rounds", "--checkpoint-dir", "--metrics-addr", "--control", "--status-file",
                 "--device", "--seed", "--min-peers", "--nat-traversal", "--log-level", "--threads", "--set",
                 "--print-config"):
        assert flag in result.stdout, flag


def _subparser(parser, name):
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _shown_default(help_text: str) -> str | None:
    """What a help text gives as the default: "(default: 50)" -> "50"; None if it names none."""
    import re

    found = re.findall(r"\(default: (.*?)(?:\)$|\)|, |; )", help_text)
    assert len(found) <= 1, help_text
    return found[0] if found else None


def test_every_shown_default_is_its_config_fields_default():
    """The defaults --help shows are the config classes' (node/config.py, p2p/config.py,
    trainer/config.py): read back as that flag's value, each gives the built-in default."""
    from node.cli import START_FLAGS, build_parser
    from node.config import load_config

    defaults = load_config(toml_path=None, environ={}, overrides={})
    parser = build_parser()
    flags = [(_subparser(parser, "start"), flag, key) for flag, key, _ in START_FLAGS]
    flags += [(_subparser(parser, command), "--run-id", "node.run_id") for command in ("status", "peers", "top")]
    checked = 0
    for subparser, flag, key in flags:
        action = next(a for a in subparser._actions if flag in a.option_strings)
        text = action.help.replace("%%", "%")
        assert "{default}" not in text, (flag, text)
        section, name = key.split(".")
        default = getattr(getattr(defaults, section), name)
        shown = _shown_default(text)
        if default in ("", []):  # nothing to show: the help says in words what no value means
            continue
        assert shown is not None, (flag, text)
        if isinstance(default, bool):  # a store_true flag: the default is off
            assert shown == ("on" if default else "off"), (flag, text)
        else:
            value = getattr(getattr(load_config(toml_path=None, environ={}, overrides={key: shown}), section), name)
            assert value == default, (flag, shown, default)
        checked += 1
    assert checked >= 20


def test_help_defaults_follow_the_config_classes(monkeypatch):
    """A default changed in its dataclass is what --help shows: it is written nowhere else."""
    import dataclasses

    from node.cli import build_parser
    from trainer.config import InnerConfig

    field = next(f for f in dataclasses.fields(InnerConfig) if f.name == "steps")
    monkeypatch.setattr(field, "default", 77)
    start = _subparser(build_parser(), "start")
    action = next(a for a in start._actions if "--inner-steps" in a.option_strings)
    assert _shown_default(action.help) == "77"


def test_status_without_node_is_exit_1():
    result = run("status", "--control", "/nonexistent.sock")
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gonka-node: error: no node answering on /nonexistent.sock: ")


def test_identity_command(tmp_path, capsys):
    path = tmp_path / "id.key"
    first = run("identity", "--identity", str(path))
    assert first.returncode == 0, first.stderr
    from p2p.identity import peer_id_of

    assert first.stdout.strip() == peer_id_of(str(path))
    ephemeral = run("identity")
    assert ephemeral.returncode == 0
    assert ephemeral.stdout.strip() and ephemeral.stdout != first.stdout
    assert "ephemeral" in ephemeral.stderr
    path.write_bytes(b"junk")
    from node.cli import main

    capsys.readouterr()
    assert main(["identity", "--identity", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gonka-node: error: node.identity: "), err
    assert path.read_bytes() == b"junk"


def test_status_and_peers_against_a_live_server(tmp_path):
    """In-process: a control server in a thread answers the real CLI code."""
    import asyncio
    import contextlib
    import io
    import threading

    from node.cli import main
    from node.control import ControlServer

    path = f"/tmp/gonka-cli-test-{os.getpid()}.sock"
    status = {"peer_id": "12D3x", "run_id": "r", "state": "training", "round": 4, "inner_step": 10,
              "loss": 2.5, "peers": 2, "params_hash": "abcd", "multiaddrs": ["/ip4/127.0.0.1/tcp/5"]}
    peers = [{"peer_id": "12D3x", "state": "training", "round": 4, "params_hash": "abcd"},
             {"peer_id": "12D3y", "state": "joining", "round": 3, "params_hash": "ef01", "lag": 1}]

    async def get_status():
        return status

    async def get_peers():
        return peers

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    server = ControlServer(path, {"status": get_status, "peers": get_peers})

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        def cli(*args):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main(list(args))
            return code, out.getvalue()

        code, out = cli("status", "--control", path, "--json")
        assert code == 0 and json.loads(out) == status
        code, out = cli("status", "--control", path)
        assert code == 0 and "12D3x" in out and "training" in out and "2.5000" in out
        code, out = cli("peers", "--control", path, "--json")
        assert code == 0 and json.loads(out) == peers
        code, out = cli("peers", "--control", path)
        assert code == 0
        lines = out.splitlines()
        assert lines[0].split() == ["PEER_ID", "STATE", "ROUND", "PARAMS_HASH", "LAG"]
        assert lines[2].split() == ["12D3y", "joining", "3", "ef01", "1"]
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
