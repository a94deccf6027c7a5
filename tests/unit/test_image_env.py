"""The shipped image's own environment and command, and every environment variable the docs
name, as `gonka-node` reads them: each starts (``--print-config``), an unknown key of a known
section is still a one-line error."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from tests.unit.test_cli import ROOT, assert_usage_error, run

pytestmark = pytest.mark.timeout(120)

DOCKERFILES = sorted(os.path.join(ROOT, "docker", f) for f in os.listdir(os.path.join(ROOT, "docker"))
                     if f.startswith("Dockerfile"))
DOCS = [os.path.join(ROOT, "README.md"), *(os.path.join(ROOT, "docs", f) for f in
                                           sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md"))]
# A value for every variable the docs name, as a user would set it.
EXAMPLES = {
    "GONKA_INNER_STEPS": "20",
    "GONKA_MODEL_SOURCE": "tiny",
    "GONKA_SWARM_BOOTSTRAP": "/ip4/127.0.0.1/tcp/31337/p2p/QmQ9iYULqGccfwpSsr1QHfCPsgDuPzPaUWKUECkuaHX9vQ",
    "GONKA_NATIVE": "0",
    "GONKA_NATIVE_DIR": "/tmp/gonka-native",
    "GONKA_CACHE_DIR": "/tmp/gonka-cache",
    "GONKA_TEST_FAULT": "reduce@2",
    "GONKA_TEST_HOSTILE": "abort",
    "GONKA_TEST_STEP_SECONDS": "0.05",
}


def image(path: str) -> tuple[dict[str, str], list[str]]:
    """The ENV settings and the ENTRYPOINT + CMD of a Dockerfile (exec form)."""
    text = re.sub(r"\\\n", " ", open(path).read())
    env: dict[str, str] = {}
    entry: list[str] = []
    cmd: list[str] = []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                # $VAR as docker expands it: from the ENV lines before, else the base image's (ours here)
                env[key] = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), os.environ.get(m.group(1), "")), value)
        elif word == "ENTRYPOINT":
            entry = json.loads(rest)
        elif word == "CMD":
            cmd = json.loads(rest)
    return env, entry + cmd


def documented() -> set[str]:
    names = set()
    for path in DOCS:
        names |= set(re.findall(r"\bGONKA_[A-Z][A-Z_]*[A-Z]\b", open(path).read()))
    return names


def test_every_documented_variable_has_an_example_here():
    assert documented() <= set(EXAMPLES), sorted(documented() - set(EXAMPLES))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=os.path.basename)
def test_the_image_command_starts_with_its_environment(dockerfile):
    env, command = image(dockerfile)
    assert command[:2] == ["gonka-node", "start"], command
    result = run(*command[1:], "--print-config", env=env)  # the real entrypoint, in its own process
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=os.path.basename)
@pytest.mark.parametrize("var", sorted(EXAMPLES))
def test_the_image_command_takes_each_documented_variable(dockerfile, var, monkeypatch, capsys):
    # The entrypoint's function in this process (a process each would cost a second of imports).
    from node.cli import main

    env, command = image(dockerfile)
    for key in [k for k in os.environ if k.startswith("GONKA_")]:
        monkeypatch.delenv(key)
    for key, value in {**env, var: EXAMPLES[var]}.items():
        monkeypatch.setenv(key, value)
    assert main([*command[1:], "--print-config"]) == 0, capsys.readouterr().err
    if var == "GONKA_INNER_STEPS":
        assert "steps = 20" in capsys.readouterr().out


def test_an_unknown_key_of_a_known_section_is_still_an_error():
    assert_usage_error(run("start", "--print-config", env={"GONKA_SWARM_BOOTSTRAPS": "x"}), "GONKA_SWARM_BOOTSTRAPS")
    assert run("start", "--print-config", env={"GONKA_SOMETHING_ELSE": "x"}).returncode == 0  # no section of ours
