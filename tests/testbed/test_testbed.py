"""The network testbed: shaped links, ownership, teardown, and a real 2-node swarm across it.

Needs root, `ip` and `tc`; skipped otherwise. Every test uses its own
namespace prefix (with this run's pid), so a failed test cannot block the next.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import netbed  # noqa: E402
import netprobe  # noqa: E402
from tests.integration.nodes import wait_until as wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the network testbed needs root and iproute2 (ip, tc)",
)

GONKA = Path(sys.executable).with_name("gonka-node")
TOLERANCE = 0.15  # measured TCP throughput vs the nominal rate


def prefix(name: str) -> str:
    return f"t{os.getpid()}{name}"


def leftovers(p: str) -> list[str]:
    return [ns for ns in netbed.list_namespaces() if ns.startswith(p + "-")]


def assert_near(measured: float, nominal: float, what: str) -> None:
    assert abs(measured - nominal) <= TOLERANCE * nominal, (
        f"{what}: {measured / 1e6:.2f} Mbit/s, nominal {nominal / 1e6:g} Mbit/s")


@pytest.mark.timeout(60)
def test_two_hosts_are_shaped_both_ways_and_torn_down():
    p = prefix("rate")
    with netbed.Testbed(2, rate="20mbit", prefix=p) as tb:
        # Only the testbed's own /24 is reachable from a host: no default route.
        routes = subprocess.run(["ip", "-n", tb.namespace(0), "route", "show"], capture_output=True, text=True,
                                check=True).stdout.strip().splitlines()
        assert routes == [r for r in routes if r.startswith("10.77.0.0/24 ")] and len(routes) == 1, routes
        assert_near(netprobe.measure_tcp(tb, 0, 1, seconds=2), 20e6, "h0 -> h1")
        assert_near(netprobe.measure_tcp(tb, 1, 0, seconds=2), 20e6, "h1 -> h0")
    assert leftovers(p) == []
    assert netbed.read_marker(p) is None


@pytest.mark.timeout(60)
def test_heterogeneous_rates_cap_each_hosts_upload_and_download():
    with netbed.Testbed(3, rates=["10mbit", "40mbit", "40mbit"], prefix=prefix("het")) as tb:
        assert_near(netprobe.measure_tcp(tb, 0, 1, seconds=2), 10e6, "h0 upload (10mbit) -> h1")
        assert_near(netprobe.measure_tcp(tb, 1, 2, seconds=2), 40e6, "h1 upload (40mbit) -> h2")
        assert_near(netprobe.measure_tcp(tb, 2, 0, seconds=2), 10e6, "h2 -> h0 download (10mbit)")


@pytest.mark.timeout(30)
def test_refuses_to_clobber_a_foreign_namespace():
    p = prefix("foreign")
    foreign = f"{p}-h1"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        tb = netbed.Testbed(2, prefix=p)
        with pytest.raises(netbed.TestbedError, match="already exist"):
            tb.up()
        assert leftovers(p) == [foreign]
        assert netbed.read_marker(p) is None
        with pytest.raises(netbed.TestbedError, match="not created by a testbed"):
            netbed.teardown(p, force=True)
        assert foreign in netbed.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=True)


@pytest.mark.timeout(30)
def test_refuses_a_testbed_owned_by_another_instance_and_cleans_up_after_a_dead_one_with_force():
    p = prefix("owned")
    with netbed.Testbed(1, prefix=p):
        with pytest.raises(netbed.TestbedError, match="running process"):
            netbed.Testbed(1, prefix=p).up()
        with pytest.raises(netbed.TestbedError, match="running process"):
            netbed.teardown(p)
        marker = netbed.read_marker(p)
    # A creator that died without tearing down: the marker names a process that is gone.
    child = subprocess.Popen(["true"])
    child.wait()
    netbed.MARKER_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ip", "netns", "add", f"{p}-h0"], check=True)
    Path(netbed.MARKER_DIR / f"{p}.json").write_text(json.dumps({**marker, "pid": child.pid, "start": 1,
                                                                 "namespaces": [f"{p}-h0"]}))
    try:
        with pytest.raises(netbed.TestbedError, match="died"):
            netbed.Testbed(1, prefix=p).up()
        with netbed.Testbed(1, prefix=p, force=True) as tb:
            assert sorted(leftovers(p)) == sorted([tb.switch, tb.namespace(0)])
            assert netbed.read_marker(p)["pid"] == os.getpid()
        assert leftovers(p) == []
    finally:
        netbed.teardown(p, force=True)


@pytest.mark.timeout(30)
def test_an_error_inside_the_testbed_still_tears_everything_down():
    p = prefix("error")
    with pytest.raises(RuntimeError, match="boom"):
        with netbed.Testbed(2, rate="10mbit", prefix=p) as tb:
            sleeper = tb.run(1, ["sleep", "300"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert leftovers(p) == []
    assert netbed.read_marker(p) is None


def ns_pids(ns: str) -> list[int]:
    return [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                           check=True).stdout.split()]


def node_args(status: Path) -> list[str]:
    return [str(GONKA), "start", "--model", "tiny", "--inner-steps", "4", "--max-rounds", "2", "--min-peers", "2",
            "--metrics-addr", "off", "--control", "off", "--threads", "1", "--set", "data.batch_size=4",
            "--set", "data.seq_len=64", "--status-file", str(status)]


@pytest.mark.timeout(150)
def test_two_node_swarm_trains_across_the_testbed(tmp_path):
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    status = [tmp_path / f"status-{i}.json" for i in range(2)]

    def start(tb: netbed.Testbed, i: int, *extra: str) -> subprocess.Popen:
        with open(logs[i], "wb") as log:  # the child keeps its own copy of the descriptor
            return tb.run(i, [*node_args(status[i]), "--listen", f"/ip4/{tb.host_ip(i)}/tcp/31337", *extra],
                          cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)

    def listening(node: subprocess.Popen) -> str | None:
        m = re.search(r"^listening on (\S+)", logs[0].read_text(), re.M)
        assert m or node.poll() is None, f"node 0 exited with {node.returncode}:\n{logs[0].read_text()[-3000:]}"
        return m and m.group(1)

    # down() kills both nodes (and their p2pd children) by pid even if an assertion fails.
    with netbed.Testbed(2, rate="100mbit", prefix=prefix("swarm")) as tb:
        first = start(tb, 0)
        addr = wait_for(lambda: listening(first), 60, "node 0 to listen")
        peer_id = re.search(r"/p2p/(\w+)", addr).group(1)
        nodes = [first, start(tb, 1, "--bootstrap", f"/ip4/{tb.host_ip(0)}/tcp/31337/p2p/{peer_id}")]
        deadline = time.monotonic() + 100
        for i, node in enumerate(nodes):
            try:
                code = node.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"node {i} exit {code}:\n{logs[i].read_text()[-3000:]}"
        # A node's children (p2pd, hivemind's helpers) die with it: nothing is left in the hosts.
        wait_for(lambda: not any(ns_pids(tb.namespace(i)) for i in range(2)), 10, "the nodes' children to exit")
        final = [json.loads(s.read_text()) for s in status]
        assert [s["round"] for s in final] == [2, 2], final
        assert final[0]["params_hash"] == final[1]["params_hash"], final


CONGESTION_PROBE = """
import socket, sys
role, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "listen":
    with socket.create_server((ip, port)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
else:
    conn = socket.create_connection((ip, port), timeout=10)
print(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode(), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("congestion", ["cubic", "reno"])
def test_every_connection_uses_the_pinned_congestion_control(congestion):
    # Not the machine's own default (bbr on the development VM): both ends of a connection use the testbed's.
    with netbed.Testbed(2, prefix=prefix(f"cc{congestion}"), congestion=congestion) as tb:
        listener = tb.run(1, [sys.executable, "-c", CONGESTION_PROBE, "listen", tb.host_ip(1), "5301"],
                          stdout=subprocess.PIPE, text=True)
        assert listener.stdout.readline().strip() == "ready"
        dialer = subprocess.run(["ip", "netns", "exec", tb.namespace(0), sys.executable, "-c", CONGESTION_PROBE,
                                 "dial", tb.host_ip(1), "5301"], capture_output=True, text=True, timeout=20)
        accepted = listener.communicate(timeout=20)[0].strip()
        assert (dialer.stdout.strip(), accepted) == (congestion, congestion), dialer.stderr


@pytest.mark.timeout(10)
def test_an_unknown_congestion_control_is_refused_before_anything_is_created():
    p = prefix("ccbad")
    with pytest.raises(ValueError, match="congestion"):
        netbed.Testbed(2, prefix=p, congestion="no-such-cc")
    assert leftovers(p) == []
