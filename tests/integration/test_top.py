"""`gonka-node top` in a real terminal (tmux): one screen of every peer, refreshed, Ctrl-C quits;
and `gonka-node status` saying ``ready`` while a node waits for the others."""

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.integration.nodes import BIN, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10, check=True).stdout


def status_state(node) -> str | None:
    out = subprocess.run([str(BIN), "status", "--control", node.control, "--json"], capture_output=True, text=True,
                         timeout=30)
    return json.loads(out.stdout)["state"] if out.returncode == 0 else None


def test_top_shows_every_peer_refreshes_and_quits_on_ctrl_c(nodes):
    a = nodes("a", "--inner-steps", "4", "--min-peers", "2")
    address = a.address()
    # Alone with --min-peers 2, after its first inner round a waits for a peer, and says so.
    wait_until(lambda: status_state(a) == "ready", 60, "status to say ready")
    assert a.status()["state"] == "ready"  # the status file says the same
    b = nodes("b", "--inner-steps", "4", "--min-peers", "2", "--bootstrap", address)
    for n in (a, b):
        n.wait_round(2, timeout=150)
    ids = [n.status()["peer_id"][-8:] for n in (a, b)]
    session = f"gonka-top-{os.getpid()}"
    tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "40",
         # bash waits out a child that handles Ctrl-C itself, then says how it exited
         f"bash -c '{BIN} top --control {a.control} --interval 0.5; echo top exited $?; sleep 60'")
    try:
        def screen() -> str:
            return tmux("capture-pane", "-p", "-t", session)

        def rounds_shown(text: str) -> dict[str, int]:
            return {m.group(1): int(m.group(2)) for m in re.finditer(r"^[* ](\w{8}) +\w+ +(\d+) ", text, re.M)}

        def screen_when(ok):
            text = screen()
            return text if ok(rounds_shown(text)) else None

        first = wait_until(lambda: screen_when(lambda shown: set(shown) == set(ids)), 60, "top to show both peers")
        assert re.search(r"2 peers, 2 on our params_hash", first) or "≠" in first, first
        assert f"*{ids[0]}" in first  # this node's own row is marked and first among the rows
        shown = rounds_shown(first)
        # Refreshed in place: later screens show later rounds, on one screen (no scrolling output).
        later = wait_until(lambda: screen_when(lambda now: min(now.values(), default=0) > max(shown.values())), 90,
                           "top to show a later round")
        assert later.count("gonka-node top") == 1, later
        tmux("send-keys", "-t", session, "C-c")
        wait_until(lambda: "top exited" in screen(), 20, "top to quit on Ctrl-C")
        assert "top exited 0" in screen(), screen()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=10)
