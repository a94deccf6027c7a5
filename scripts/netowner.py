"""Who owns a testbed (scripts/netbed.py): marker files, and teardown when the owner exits.

A testbed belongs to the process that created it: a marker file
/run/gonka-testbed/<prefix>.json holds the creator's pid (and its start time,
so a reused pid is not mistaken for the owner) and the namespaces it made.
A testbed whose marker says "kept" was handed over to `scripts/testbed down`.
While a process owns testbeds, ``register`` makes sure they come down at exit
and on SIGINT/SIGTERM, whatever else the process does.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

from netns import TestbedError, list_namespaces, start_time

MARKER_DIR = Path("/run/gonka-testbed")


def marker_path(prefix: str) -> Path:
    return MARKER_DIR / f"{prefix}.json"


def read_marker(prefix: str) -> dict | None:
    """The marker of testbed `prefix` ({} if unreadable), or None if there is none."""
    try:
        data = json.loads(marker_path(prefix).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def claim(prefix: str) -> None:
    """Create the marker of `prefix`, empty; TestbedError if another process got there first."""
    MARKER_DIR.mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: of two processes bringing up one prefix at once, exactly one gets it
        os.close(os.open(marker_path(prefix), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        raise TestbedError(f"testbed {prefix!r} is being created by another process") from None


def write_marker(prefix: str, data: dict, kept: bool) -> None:
    """Replace the marker of `prefix` with ``data`` and its owner: this process, or (``kept``) nobody."""
    owner = {"pid": None, "start": None, "kept": True} if kept else \
        {"pid": os.getpid(), "start": start_time(os.getpid()), "kept": False}
    tmp = marker_path(prefix).with_suffix(".tmp")
    tmp.write_text(json.dumps({**owner, **data}, indent=1) + "\n")
    os.replace(tmp, marker_path(prefix))


def owner_state(marker: dict) -> str:
    """'kept' (handed to `testbed down`), 'alive' (its creator runs) or 'dead' (its creator died)."""
    if marker.get("kept") is True:
        return "kept"
    pid, start = marker.get("pid"), marker.get("start")
    if isinstance(pid, int) and start is not None and start_time(pid) == start:
        return "alive"
    return "dead"


def is_ours(prefix: str, ns: object) -> bool:
    """Whether ``ns`` is a namespace name testbed `prefix` could have made."""
    # Marker contents come from a file anyone root could edit: delete only names of this prefix's shape.
    return isinstance(ns, str) and re.fullmatch(re.escape(prefix) + r"-(sw|h\d+|r\d+)", ns) is not None


def list_testbeds() -> list[dict]:
    """Every testbed with a marker: its marker plus 'prefix', 'owner' and the namespaces that exist now."""
    existing = set(list_namespaces())
    found = []
    for path in sorted(MARKER_DIR.glob("*.json")) if MARKER_DIR.is_dir() else []:
        marker = read_marker(path.stem) or {}
        names = [ns for ns in marker.get("namespaces", []) if is_ours(path.stem, ns)]
        found.append({**marker, "prefix": path.stem, "owner": owner_state(marker),
                      "present": [ns for ns in names if ns in existing]})
    return found


# ---- teardown on exit and on signals ---------------------------------------------

_live: list = []  # testbeds this process owns, each with a down() method
_previous_handlers: dict[int, object] = {}
_atexit_registered = False


def register(tb) -> None:
    """``tb.down()`` at exit and on SIGINT/SIGTERM, until ``unregister(tb)``."""
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_down_all)
        _atexit_registered = True
    if not _live and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) != signal.SIG_IGN:  # a process that ignores it keeps ignoring it
                _previous_handlers[signum] = signal.signal(signum, _on_signal)
    _live.append(tb)


def unregister(tb) -> None:
    if tb in _live:
        _live.remove(tb)
    if not _live and _previous_handlers and threading.current_thread() is threading.main_thread():
        for signum, handler in _previous_handlers.items():
            signal.signal(signum, handler)
        _previous_handlers.clear()


def _down_all() -> None:
    for tb in reversed(list(_live)):
        try:
            tb.down()
        except Exception as exc:  # at exit or in a signal handler nobody else can report it
            print(f"testbed {tb.prefix}: {exc}", file=sys.stderr)


def _on_signal(signum: int, frame) -> None:
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    _down_all()  # the last down() put the previous handlers back
    if callable(previous):
        previous(signum, frame)  # e.g. Python's SIGINT handler: KeyboardInterrupt as usual
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # die of the signal, so the parent sees the usual status
