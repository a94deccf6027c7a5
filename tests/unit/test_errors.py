"""Errors in one place (node/errors.py): one usage error, one set of exit codes, no import cycles."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from node.errors import EXIT_USAGE, ConfigError, UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("node", "p2p", "trainer")


def test_config_error_is_the_usage_error_and_a_value_error():
    import node.config

    assert node.config.ConfigError is ConfigError
    assert issubclass(ConfigError, UsageError) and issubclass(ConfigError, ValueError)


def test_plot_of_an_empty_directory_under_python_m_is_one_line_exit_2(tmp_path):
    # `python -m node.cli` runs the CLI as __main__: a UsageError class defined there was another
    # class than the one the plot command raised, and the user got a traceback.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GONKA_")}
    environ["PYTHONPATH"] = ROOT
    result = subprocess.run([sys.executable, "-m", "node.cli", "plot", "--checkpoint-dir", str(tmp_path)],
                            capture_output=True, text=True, env=environ, cwd=ROOT, timeout=60)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.splitlines() == [f"gonka-node: error: --checkpoint-dir: no history.jsonl in {tmp_path}"]


@pytest.mark.parametrize("case, named", [("empty", "holds no committed round"), ("bad-out", "--out")])
def test_plot_bad_input_is_one_line_exit_2(tmp_path, capsys, case, named):
    from node import history
    from node.cli import main

    args = ["plot", "--checkpoint-dir", str(tmp_path)]
    if case == "empty":
        open(history.path_in(str(tmp_path)), "w").close()
    else:
        history.append(str(tmp_path), {"round": 1, "time": 1.0, "loss": 2.0})
        args += ["--out", str(tmp_path / "plot.jpg")]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gonka-node: error: ") and named in err[0], err


def _imports(path: str) -> set[str]:
    """The project modules a file imports, at the top or inside functions."""
    found: set[str] = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in PACKAGES:  # from node import history
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.partition(".")[0] in PACKAGES}


def test_no_import_cycles_between_project_modules():
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for name in os.listdir(os.path.join(ROOT, package)):
            if name.endswith(".py"):
                module = f"{package}.{name[:-3]}"
                graph[module] = _imports(os.path.join(ROOT, package, name)) - {module}
    assert _imports(os.path.join(ROOT, "node", "errors.py")) == set()  # imported by all, imports none
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            assert dep not in path, "import cycle: " + " -> ".join(path[path.index(dep):] + [dep])
            if dep in graph and dep not in done:
                visit(dep, path + [dep])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
