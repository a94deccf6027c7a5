"""What every `gonka-node` command shares about failing: exit codes, the usage error, the one-line report.

Exit codes:
  0 (EXIT_OK)       success, or stopped by SIGINT/SIGTERM after a final checkpoint;
  1 (EXIT_RUNTIME)  a runtime failure: no node answering, the node failed, or a bug
                    (those with a traceback);
  2 (EXIT_USAGE)    the user's input is wrong: a flag, setting, file or path, reported
                    as one line on stderr that names it;
  130               interrupted (Ctrl-C) before the node could stop on its own.

Only a ``UsageError`` becomes exit code 2. A ``ValueError`` is not one by itself: the
components report a bad setting as ``ValueError("section.key: ...")``, and the code that
handed them the user's input turns it into a ``ConfigError`` at that boundary
(``node.config.setting_error``); any other ``ValueError`` is a fault of the program.

This module imports nothing of the project, so every module may import it and it takes
part in no import cycle. It must be the one home of these classes: under
``python -m node.cli`` the CLI module runs as ``__main__``, and a class defined there
would exist twice, the copy a subcommand raises not being the one ``main`` catches.
"""

from __future__ import annotations

import sys

PROG = "gonka-node"

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


class UsageError(Exception):
    """The user's input is wrong; ``str(error)`` is one line naming the flag, key or path (exit code 2)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        # The dotted setting at fault, when there is one: lets the CLI say which flag set it.
        self.key = key


class ConfigError(UsageError, ValueError):
    """A bad setting (node/config.py); ``str(error)`` names the key or source.

    Also a ValueError, as every component config's validation raises."""


def report(message: str) -> None:
    """The one line a failing command prints on stderr."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def version() -> str:
    """The installed version of gonka-node (a source checkout that is not installed: 0.1.0+unknown)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("gonka-node")
    except PackageNotFoundError:
        return "0.1.0+unknown"
