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


def _start_failing_with(monkeypatch, exc: Exception) -> int:
    """`gonka-node start`, in-process, whose start-up raises ``exc`` at its first step."""
    import node.allocator
    from node.cli import main

    for var in [v for v in os.environ if v.startswith("GONKA_")]:
        monkeypatch.delenv(var)

    def tune_malloc() -> None:
        raise exc

    monkeypatch.setattr(node.allocator, "tune_malloc", tune_malloc)
    return main(["start", "--control", "off", "--metrics-addr", "off", "--device", "cpu"])


@pytest.mark.timeout(120)
def test_an_internal_value_error_at_start_up_is_a_crash_not_bad_input(monkeypatch, capsys, caplog):
    code = _start_failing_with(monkeypatch, ValueError("math domain error"))
    assert code not in (0, EXIT_USAGE)
    failed = [r for r in caplog.records if r.getMessage() == "node failed"]
    assert failed and failed[0].exc_info is not None  # logged with its traceback
    assert failed[0].exc_info[0] is ValueError
    assert "gonka-node: error: math domain error" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("message", ["checkpoint: expected a dict", "nodes.seed: not a setting", "node.seeds: no"])
def test_a_value_error_naming_no_real_setting_is_no_usage_error(monkeypatch, message):
    assert _start_failing_with(monkeypatch, ValueError(message)) not in (0, EXIT_USAGE)


@pytest.mark.timeout(120)
def test_a_value_error_naming_a_setting_at_start_up_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    message = f"data.paths: {tmp_path}/shard-0: truncated"
    assert _start_failing_with(monkeypatch, ValueError(message)) == EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == [f"gonka-node: error: {message}"]


def test_export_reports_only_its_input_errors_as_bad_input(monkeypatch, capsys, tmp_path):
    import trainer.export
    from node.cli import main

    args = ["export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "out")]

    def export_checkpoint(*args, **kwargs):
        raise ValueError(message)

    monkeypatch.setattr(trainer.export, "export_checkpoint", export_checkpoint)
    message = f"export: {tmp_path}/latest.pt: no such file"
    assert main(args) == EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == [f"gonka-node: error: {message}"]
    message = "could not convert string to float: 'x'"
    with pytest.raises(ValueError, match="could not convert"):  # a traceback, exit code 1
        main(args)
