"""What an operator sees of a live two-node swarm, one swarm for all of it (started by the
module's fixture, stopped by the last test): `gonka-node status` saying ``ready`` while a node
waits for the others; a real Prometheus (Debian's `prometheus`) scraping both nodes, every
dashboard query and every side of every alert rule returning data; `gonka-node top` in a real
terminal (tmux), one screen of every peer, refreshed, Ctrl-C quits; the metrics endpoint and
p2pd's flags; SIGTERM stopping a node cleanly with its p2pd."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.integration.nodes import BIN, NodeProc, alive, wait_until
from tests.integration.test_prometheus import ALERTS, alert_sides, dashboard_queries, free_port, query

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NO_PROMETHEUS = shutil.which("prometheus") is None or shutil.which("promtool") is None


def status_state(node) -> str | None:
    out = subprocess.run([str(BIN), "status", "--control", node.control, "--json"], capture_output=True, text=True,
                         timeout=30)
    return json.loads(out.stdout)["state"] if out.returncode == 0 else None


class Swarm:
    """Node a, started at once; node b, started by the first test that needs both."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[NodeProc] = []
        self.ports = [free_port(), free_port()]
        self.a = self._node("a")
        self.b: NodeProc | None = None
        self.ready_seen: str | None = None  # a's state while it waited alone

    def _node(self, name: str, *args: str) -> NodeProc:
        port = self.ports[len(self.started)]
        return NodeProc(name, self.workdir, ["--inner-steps", "3", "--min-peers", "2", "--metrics-addr",
                                             f"127.0.0.1:{port}", "--checkpoint-dir", str(self.workdir / f"ckpt-{name}"),
                                             "--set", "data.eval_every=1", *args], self.started)

    def both(self) -> tuple[NodeProc, NodeProc]:
        if self.b is None:
            address = self.a.address()
            # Alone with --min-peers 2, after its first inner round a waits for a peer, and says so.
            wait_until(lambda: status_state(self.a) == "ready", 60, "status to say ready")
            self.ready_seen = self.a.status()["state"]  # the status file says the same
            self.b = self._node("b", "--bootstrap", address)
        return self.a, self.b

    def close(self) -> None:
        for node in self.started:
            node.kill_all()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = Swarm(tmp_path_factory.mktemp("operator"))
    yield s
    s.close()


def test_status_says_ready_while_a_node_waits_for_its_peers(swarm):
    a, b = swarm.both()
    assert swarm.ready_seen == "ready"
    for n in (a, b):
        n.wait_round(2, timeout=150)


@pytest.mark.skipif(NO_PROMETHEUS, reason="Debian's prometheus is not installed (scripts/setup installs it when root)")
def test_a_real_prometheus_scrapes_a_live_swarm_and_every_query_returns_data(swarm, tmp_path):
    a, b = swarm.both()
    web = free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [ALERTS],
              "scrape_configs": [{"job_name": "gonka-node",
                                  "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in swarm.ports]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{web}"
    try:
        for n in (a, b):
            n.wait_round(3, timeout=150)

        def rounds_seen():
            try:
                return len([r for r in query(base, "gonka_node_rounds_total > 0")]) == 2
            except OSError:
                return False

        wait_until(rounds_seen, 90, "Prometheus to see rounds on both nodes")
        # Rates need two samples of a committed round in their window: a few more scrapes.
        wait_until(lambda: len(query(base, "rate(gonka_node_rounds_total[5m]) > 0")) == 2, 60, "round rates")
        empty = [expr for expr in [*dashboard_queries(), *alert_sides()] if not query(base, expr)]
        assert not empty, f"queries returning nothing on a live swarm: {empty}"
        rules = json.loads(urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10).read())
        loaded = [r for g in rules["data"]["groups"] for r in g["rules"]]
        assert len(loaded) == 5 and all(r["health"] == "ok" for r in loaded), loaded
    finally:
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(10)
        log.close()


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10, check=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_top_shows_every_peer_refreshes_and_quits_on_ctrl_c(swarm):
    a, b = swarm.both()
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


def p2pd_of(node) -> int:
    pids = wait_until(node.p2pd_pids, 60, "p2pd to start")
    assert len(pids) == 1
    return pids[0]


def test_metrics_p2pd_flags_and_sigterm_stopping_cleanly_with_p2pd(swarm):
    # Last in this module: it stops the swarm.
    a, b = swarm.both()
    a.wait_round(1, timeout=150)
    url = wait_until(lambda: re.search(r"^metrics on (\S+)", a.log(), re.M), 10, "metrics address").group(1)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert f'gonka_node_info{{peer_id="{a.status()["peer_id"]}",run_id="default"' in text
    rounds = re.search(r"^gonka_node_rounds_total (\S+)", text, re.M)
    assert rounds and float(rounds.group(1)) >= 1
    assert re.search(r"^gonka_node_allreduce_seconds_count [1-9]", text, re.M)
    p2pds = [p2pd_of(n) for n in (a, b)]
    args = Path(f"/proc/{p2pds[0]}/cmdline").read_bytes().split(b"\0")
    # docs/design.md network rules: nothing beyond the addresses we are given.
    for flag in (b"-natPortMap=0", b"-autonat=0", b"-relay=0", b"-b=0"):
        assert flag in args, args
    assert any(x.startswith(b"-hostAddrs=/ip4/127.0.0.1/") for x in args), args
    for n in (a, b):
        n.proc.send_signal(signal.SIGTERM)
    for n, p2pd in zip((a, b), p2pds):
        assert n.wait_exit(60) == 0, n.log()[-3000:]
        wait_until(lambda: not alive(p2pd), 10, "p2pd to exit")
        assert n.status()["state"] == "stopped"
