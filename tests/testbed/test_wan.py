"""The WAN testbed: delay-line RTT and loss, hosts behind NAT, teardown, and the delay line's refusals.

Needs root, `ip` and `tc` (and `nft` for NAT); skipped otherwise. Every test
uses its own namespace prefix (with this run's pid).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import delayline  # noqa: E402
import netbed  # noqa: E402
import netprobe  # noqa: E402
from tests.integration.nodes import wait_until as wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the network testbed needs root and iproute2 (ip, tc)",
)
needs_nft = pytest.mark.skipif(shutil.which("nft") is None, reason="NAT needs nft (Debian package nftables)")


def prefix(name: str) -> str:
    return f"w{os.getpid()}{name}"


def leftovers(p: str) -> list[str]:
    return [ns for ns in netbed.list_namespaces() if ns.startswith(p + "-")]


def delay_line_pids() -> set[int]:
    binary = delayline.build().name
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/comm").read_text().strip() == binary[:15]:
                pids.add(int(entry))
        except OSError:
            continue
    return pids


@pytest.mark.timeout(40)
def test_ping_rtt_follows_the_hosts_delays():
    # 60 ms + 40 ms: the RTT is the sum of the two hosts' shares.
    with netbed.Testbed(2, prefix=prefix("rtt"), delay=["60ms", "40ms"]) as tb:
        assert tb.rtt(0, 1) == pytest.approx(0.1)
        netprobe.ping(tb, 0, 1, count=1, timeout=3)  # resolve the neighbour first: ARP crosses the delay too
        rtts = [r for r in netprobe.ping(tb, 0, 1, count=40, interval=0.01) if r is not None]
        assert len(rtts) == 40
        # The delay line is a process: on a loaded machine it (and ping) run late, so frames come
        # late, never early (a suite run beside two pytest processes: median 113.6 ms).
        assert 0.1 <= statistics.median(rtts) <= 0.13, rtts
        assert min(rtts) >= 0.1, "a frame left the delay line early"


@pytest.mark.timeout(40)
def test_loss_is_honoured_within_a_wide_binomial_band():
    # 20% on h0's link, each direction: an echo and its reply both survive with 0.8^2, so 36% of the
    # pings are lost. Over 500 pings the standard deviation is 10.7 lost; the band is over +-6 of them.
    with netbed.Testbed(2, prefix=prefix("loss"), loss=[0.2, 0.0], delay=["2ms", "0ms"]) as tb:
        rtts = netprobe.ping(tb, 0, 1, count=500, interval=0.002, timeout=1)
        lost = sum(r is None for r in rtts)
        assert 110 <= lost <= 250, f"{lost} of 500 lost, expected about 180"
        stats = tb.link_stats(0)
        for direction in ("up", "down"):
            seen = stats[direction]["frames_in"]
            assert 0.1 * seen <= stats[direction]["drop_loss"] <= 0.3 * seen, stats
            assert stats[direction]["drop_queue"] == 0, stats
        assert tb.link_stats(1) is None  # a host without delay, jitter or loss keeps its plain veth link


CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""
LISTEN = """
import socket, sys
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as server:
    print("ready", flush=True)
    server.settimeout(20)
    while True:
        conn, peer = server.accept()
        print(peer[0], flush=True)
        conn.close()
"""


@needs_nft
@pytest.mark.timeout(40)
def test_a_host_behind_nat_dials_out_and_cannot_be_dialled():
    with netbed.Testbed(2, prefix=prefix("nat"), nat=[1], delay=["0ms", "10ms"]) as tb:
        assert tb.local_ip(1) != tb.host_ip(1) and tb.local_ip(0) == tb.host_ip(0)
        servers = [tb.run(i, [sys.executable, "-c", LISTEN, tb.local_ip(i), "5401"], stdout=subprocess.PIPE,
                          text=True) for i in (0, 1)]
        for server in servers:
            assert netprobe._readline(server, timeout=10).strip() == "ready"

        def dial(src: int, ip: str) -> str:
            return subprocess.run(["ip", "netns", "exec", tb.namespace(src), sys.executable, "-c", CONNECT, ip,
                                   "5401", "3"], capture_output=True, text=True, timeout=20).stdout.strip()

        assert dial(1, tb.host_ip(0)) == "connected"
        # The public host sees the router's public address, not the private one.
        assert netprobe._readline(servers[0], timeout=10).strip() == tb.host_ip(1)
        assert dial(0, tb.host_ip(1)) in ("ConnectionRefusedError", "TimeoutError")
        assert dial(0, tb.local_ip(1)) in ("OSError", "TimeoutError")  # no route to the private subnet
        routes = subprocess.run(["ip", "-n", tb.router(1), "route", "show"], capture_output=True, text=True,
                                check=True).stdout.strip().splitlines()
        assert not [r for r in routes if r.startswith("default")], routes


@needs_nft
@pytest.mark.timeout(30)
def test_teardown_leaves_no_namespaces_and_no_delay_lines():
    before = delay_line_pids()
    p = prefix("down")
    with pytest.raises(RuntimeError, match="boom"):
        with netbed.Testbed(3, prefix=p, delay="5ms", jitter="1ms", nat=[2]) as tb:
            assert len(delay_line_pids() - before) == 3
            assert sorted(leftovers(p)) == sorted([tb.switch, tb.router(2)] + [tb.namespace(i) for i in range(3)])
            raise RuntimeError("boom")
    assert leftovers(p) == []
    assert delay_line_pids() - before == set()
    assert not (netbed.MARKER_DIR / f"{p}.links").exists()


@pytest.mark.timeout(30)
def test_a_delay_line_dies_with_its_parent():
    p = prefix("orphan")
    owner = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(ROOT / 'scripts')!r})
import netbed
tb = netbed.Testbed(1, prefix={p!r}, delay="5ms").up()
print(tb._delay_lines[0].pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(netprobe._readline(owner, timeout=20))
        owner.kill()  # no teardown runs: only PR_SET_PDEATHSIG stops the delay line
        owner.wait()
        wait_for(lambda: netbed.start_time(pid) is None, 10, "the orphaned delay line to exit")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        netbed.teardown(p, force=True)
    assert leftovers(p) == []


@pytest.mark.timeout(20)
@pytest.mark.parametrize("argv, flag", [
    (["--up-loss", "1.5"], "--up-loss"),
    (["--down-delay-us", "-3"], "--down-delay-us"),
    (["--up-jitter-us", "20000000"], "--up-jitter-us"),
    (["--queue-bytes", "12x"], "--queue-bytes"),
    (["--a-ns", "x", "--a-dev", "a-name-longer-than-15", "--b-ns", "y", "--b-dev", "p0"], "--a-dev"),
    (["--bogus"], "--bogus"),
])
def test_the_delay_line_refuses_bad_settings(argv, flag):
    r = subprocess.run([str(delayline.build()), *argv], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and flag in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs, match", [
    ({"delay": "50"}, "delay"), ({"jitter": "-1ms"}, "jitter"), ({"loss": 1.0}, "loss"),
    ({"nat": [5]}, "nat"), ({"up_rates": ["10mbit"]}, "up_rates"), ({"tcp_buffers": "huge"}, "tcp_buffers"),
])
def test_bad_wan_settings_are_refused_before_anything_is_created(kwargs, match):
    p = prefix("bad")
    with pytest.raises(ValueError, match=match):
        netbed.Testbed(2, prefix=p, **kwargs)
    assert leftovers(p) == []
