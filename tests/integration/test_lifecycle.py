"""Signals: SIGTERM stops cleanly; neither SIGTERM nor SIGKILL leaves a child behind;
p2pd runs with UPnP, AutoNAT and relays off."""

import re
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.integration.nodes import alive, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _p2pd(node) -> int:
    pids = wait_until(node.p2pd_pids, 60, "p2pd to start")
    assert len(pids) == 1
    return pids[0]


def test_sigterm_stops_cleanly_and_takes_children_along(nodes):
    node = nodes("term", "--inner-steps", "2", "--metrics-addr", "127.0.0.1:0")
    node.address()
    node.wait_round(1, timeout=60)
    url = wait_until(lambda: re.search(r"^metrics on (\S+)", node.log(), re.M), 10, "metrics address").group(1)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert f'gonka_node_info{{peer_id="{node.status()["peer_id"]}",run_id="default"' in text
    rounds = re.search(r"^gonka_node_rounds_total (\S+)", text, re.M)
    assert rounds and float(rounds.group(1)) >= 1
    assert re.search(r"^gonka_node_allreduce_seconds_count [1-9]", text, re.M)
    p2pd = _p2pd(node)
    args = Path(f"/proc/{p2pd}/cmdline").read_bytes().split(b"\0")
    # docs/design.md network rules: nothing beyond the addresses we are given.
    for flag in (b"-natPortMap=0", b"-autonat=0", b"-relay=0", b"-b=0"):
        assert flag in args, args
    assert any(a.startswith(b"-hostAddrs=/ip4/127.0.0.1/") for a in args), args
    node.proc.send_signal(signal.SIGTERM)
    assert node.wait_exit(60) == 0, node.log()[-3000:]
    wait_until(lambda: not alive(p2pd), 10, "p2pd to exit")
    assert node.status()["state"] == "stopped"


def test_sigkill_leaves_no_child_behind(nodes):
    node = nodes("kill", "--inner-steps", "1000")
    node.address()
    p2pd = _p2pd(node)
    node.proc.send_signal(signal.SIGKILL)
    node.wait_exit(30)
    wait_until(lambda: not alive(p2pd), 10, "p2pd to die with its node")

