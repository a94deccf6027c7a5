"""A network testbed: gonka-node hosts in Linux network namespaces behind a rate-limited switch.

Topology: one "switch" namespace `<prefix>-sw` holds a Linux bridge `br0`;
every host namespace `<prefix>-h<i>` has one interface `eth0` (10.77.0.<10+i>/24)
joined by a veth pair to port `port<i>` of the bridge. Both ends of every link
are shaped with tbf: `eth0` egress in the host is its upload, `port<i>` egress
in the switch is its download, so host i is capped at its rate both ways, like
an access line. The hosts have only the connected /24 route (no default route,
IPv6 off), and the root namespace is never touched: traffic cannot leave the
testbed's own namespaces.

Measured TCP goodput (`scripts/testbed measure`) is ~95.6% of nominal, the
payload share of a full frame; at 1gbit the 2-core machine's CPU, handling
one frame per packet, held it to 80-86%.

Every host's route to the others pins TCP's congestion control (`congctl`,
default cubic, Linux's stock default) instead of inheriting whatever the
machine's root namespace uses: figures must not depend on a sysctl of the
machine they were taken on. This matters here: the development VM defaults to
bbr, whose bandwidth estimate on veth behind tbf read 3.9 Gbit/s on 100 Mbit/s
links (`ss -ti`), and flows through the shapers stalled for 100 ms at a time
(a 4-host fp32 all-reduce, medians of runs of one day: 14.2-14.9 s with
bbr, 13.3-14.6 s with cubic).
`congestion="bbr"` measures that case on purpose.

By default the testbed models bandwidth only: the round-trip time is that of
veth (tens of microseconds) plus whatever the shapers' queues hold (at most
QUEUE_LATENCY per shaper). A host given a `delay`, `jitter` or `loss` gets a
WAN link instead (TAP devices and a user-space delay line, since the kernel
here has no netem), and hosts listed in `nat` sit behind a NAT router
namespace `<prefix>-r<i>`: see scripts/wanlink.py and docs/testbed.md.
Rates may differ per direction (`up_rates`, `down_rates`).

Every host's TCP buffer limits (tcp_wmem/tcp_rmem) are set too, for the same
reason as the congestion control: by default raised so that one stream can
fill a long fat link, or Linux's stock values with `tcp_buffers="stock"`.

A testbed belongs to the process that created it: a marker file
/run/gonka-testbed/<prefix>.json holds the creator's pid (scripts/netowner.py).
`up()` refuses to touch namespaces it did not create; `force=True` may clean
up after a creator that died. The owner tears down on `down()`, on leaving
`with`, at exit and on SIGINT/SIGTERM. `keep()` hands a testbed over to
`scripts/testbed down`.

Beside this module: the shapers' units and sizes (scripts/netshape.py), the
`ip` commands and the processes in the namespaces (scripts/netns.py),
ownership (scripts/netowner.py), WAN links and NAT (scripts/wanlink.py), and
the TCP throughput probe that checks the shaping (scripts/netprobe.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import delayline
import wanlink
from netns import TestbedError, cmd, list_namespaces, require_root, start_time, stop_processes
from netowner import MARKER_DIR, claim, is_ours, list_testbeds, marker_path, owner_state, read_marker, register, \
    unregister, write_marker
from netshape import DEFAULT_CONGESTION, QUEUE_LATENCY, burst_for, check_congestion, parse_rate, parse_size

# The testbed's whole interface in one place: the scripts and tests use these through netbed.
__all__ = ["DEFAULT_CONGESTION", "MARKER_DIR", "Testbed", "TestbedError", "burst_for", "check_congestion",
           "list_namespaces", "list_testbeds", "parse_rate", "parse_size", "read_marker", "require_root",
           "start_time", "teardown"]

SUBNET = "10.77.0."  # private /24 that exists only inside the testbed's namespaces
FIRST_HOST = 10  # host i is SUBNET + (FIRST_HOST + i)
MAX_HOSTS = 200
_PREFIX = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


def _per_host(value, hosts: int, what: str) -> list:
    """One value for every host, or a list with one per host."""
    if isinstance(value, (list, tuple)):
        if len(value) != hosts:
            raise ValueError(f"{what} has {len(value)} entries for {hosts} hosts")
        return list(value)
    return [value] * hosts


class Testbed:
    """N hosts in network namespaces behind a bridge, each link shaped to its rates, optionally with WAN delay,
    jitter and loss, optionally behind NAT.

    rate/rates: each host's cap both ways (tc units: 100mbit); up_rates/down_rates override one direction.
    delay, jitter: each host's share of the RTT and its spread ("50ms", or seconds), one for all or one per host.
    loss: probability that a frame is dropped, each direction of the host's link, one or one per host.
    nat: indices of hosts behind a NAT router. tcp_buffers: "raised" (default) or "stock" (wanlink.TCP_BUFFERS).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: int, rate: str = "100mbit", rates: list[str] | None = None,
                 prefix: str = "gnk", burst: str | None = None, force: bool = False,
                 congestion: str = DEFAULT_CONGESTION, *, up_rates: list[str] | None = None,
                 down_rates: list[str] | None = None, delay: str | float | list = 0, jitter: str | float | list = 0,
                 loss: float | list = 0.0, nat: list[int] = (), tcp_buffers: str = "raised"):
        if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 1-{MAX_HOSTS}, got {hosts!r}")
        if not isinstance(prefix, str) or len(prefix) > 24 or not _PREFIX.fullmatch(prefix):
            raise ValueError(f"prefix must be 1-24 characters of a-z 0-9 and inner dashes, "
                             f"starting with a letter, got {prefix!r}")
        rates = _per_host(list(rates) if rates is not None else rate, hosts, "rates")
        ups = _per_host(list(up_rates) if up_rates is not None else rates, hosts, "up_rates")
        downs = _per_host(list(down_rates) if down_rates is not None else rates, hosts, "down_rates")
        delays = [wanlink.parse_duration(d, "delay") for d in _per_host(delay, hosts, "delay")]
        jitters = [wanlink.parse_duration(j, "jitter") for j in _per_host(jitter, hosts, "jitter")]
        losses = _per_host(loss, hosts, "loss")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in losses):
            raise ValueError(f"loss must be a fraction in [0, 1) (0.01 is 1%), got {loss!r}")
        nat = sorted(set(nat))
        if not all(isinstance(i, int) and 0 <= i < hosts for i in nat):
            raise ValueError(f"nat must list host indices 0-{hosts - 1}, got {nat!r}")
        if tcp_buffers not in wanlink.TCP_BUFFERS:
            raise ValueError(f"tcp_buffers must be one of {', '.join(wanlink.TCP_BUFFERS)}, got {tcp_buffers!r}")
        self.prefix = prefix
        self.links = [wanlink.Link(up_rate=parse_rate(u), down_rate=parse_rate(d), delay=dl, jitter=j, loss=float(ls))
                      for u, d, dl, j, ls in zip(ups, downs, delays, jitters, losses)]
        self.nat = nat
        self.tcp_buffers = tcp_buffers
        self._burst = parse_size(burst) if burst is not None else None
        self.congestion = check_congestion(congestion)
        self.force = force
        self._hosts = hosts
        self._delay_lines: dict[int, subprocess.Popen] = {}  # host -> its link's delay line
        self._created: list[str] = []  # namespaces this instance made, in creation order
        self._procs: list[subprocess.Popen] = []
        self._owner = False  # holds the marker, so down() must clean up
        self._kept = False  # handed over to `scripts/testbed down` by keep()

    @property
    def hosts(self) -> int:
        return self._hosts

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def namespace(self, i: int) -> str:
        self._check_host(i)
        return f"{self.prefix}-h{i}"

    def router(self, i: int) -> str:
        """The namespace of host i's NAT router (only for hosts in ``nat``)."""
        self._check_host(i)
        if i not in self.nat:
            raise ValueError(f"host {i} is not behind NAT")
        return f"{self.prefix}-r{i}"

    def host_ip(self, i: int) -> str:
        """The address the other hosts reach host i at (its NAT router's, for a host behind NAT)."""
        self._check_host(i)
        return f"{SUBNET}{FIRST_HOST + i}"

    def local_ip(self, i: int) -> str:
        """The address on host i's own eth0, the one to listen on: host_ip(i), or its private one behind NAT."""
        self._check_host(i)
        return f"{wanlink.NAT_SUBNET.format(i=i)}2" if i in self.nat else self.host_ip(i)

    @property
    def rates(self) -> list[int]:
        """Each host's slower direction in bits/s (its rate, when both ways are the same)."""
        return [min(link.up_rate, link.down_rate) for link in self.links]

    @property
    def up_rates(self) -> list[int]:
        return [link.up_rate for link in self.links]

    @property
    def down_rates(self) -> list[int]:
        return [link.down_rate for link in self.links]

    def nominal_rate(self, src: int, dst: int) -> int:
        """The rate of the path src -> dst: the slower of src's upload and dst's download, bits/s."""
        return min(self.links[src].up_rate, self.links[dst].down_rate)

    def rtt(self, i: int, j: int) -> float:
        """The nominal round-trip time between hosts i and j in seconds, without jitter or queueing."""
        return self.links[i].delay + self.links[j].delay

    def burst(self, rate_bps: int) -> int:
        """The tbf bucket of a shaper at this rate, in bytes."""
        return self._burst if self._burst is not None else burst_for(rate_bps)

    def link_stats(self, i: int) -> dict | None:
        """The counters of host i's delay line (frames in, out, dropped by reason, per direction "up" and
        "down"), or None for a plain link."""
        proc = self._delay_lines.get(i)
        if proc is None:
            return None
        return delayline.stats(proc.pid, self._files / f"port{i}.json")

    @property
    def _files(self) -> Path:
        """Where the delay lines write their counters and logs; removed at down()."""
        return MARKER_DIR / f"{self.prefix}.links"

    def _check_host(self, i: int) -> None:
        if not isinstance(i, int) or not 0 <= i < self._hosts:
            raise ValueError(f"host must be 0-{self._hosts - 1}, got {i!r}")

    def __enter__(self) -> "Testbed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ---- lifecycle ----

    def up(self) -> "Testbed":
        """Create the switch and the hosts; TestbedError if any of their names is taken."""
        require_root()
        if self._owner:
            raise TestbedError(f"testbed {self.prefix!r} is already up")
        marker = read_marker(self.prefix)
        if marker is not None:
            state = owner_state(marker)
            if state == "dead" and self.force:
                teardown(self.prefix, force=True)
            else:
                owner = {"alive": f"running process {marker.get('pid')}",
                         "kept": "`scripts/testbed up` (remove it with `scripts/testbed down`)",
                         "dead": f"process {marker.get('pid')}, which died (force=True / --force removes it)"}[state]
                raise TestbedError(f"testbed {self.prefix!r} already exists, created by {owner}")
        names = ([self.switch] + [f"{self.prefix}-h{i}" for i in range(self._hosts)]
                 + [f"{self.prefix}-r{i}" for i in self.nat])
        taken = sorted(set(names) & set(list_namespaces()))
        if taken:
            raise TestbedError(f"namespaces {', '.join(taken)} already exist and this testbed did not create "
                               "them; not touching them (choose another prefix, or remove them with `ip netns del`)")
        claim(self.prefix)
        self._owner = True
        self._save_marker()
        register(self)
        try:
            if self.nat and shutil.which("nft") is None:
                raise TestbedError("hosts behind NAT need nft (Debian package nftables; scripts/setup installs it)")
            self._files.mkdir(parents=True, exist_ok=True)
            self._add_namespace(self.switch)
            cmd("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            cmd("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(self._hosts):
                self._add_host(i)
        except BaseException as exc:
            try:
                self.down()
            except Exception as cleanup:  # the first error is the one to report
                exc.add_note(f"and tearing down failed: {cleanup}")
            raise
        return self

    def _add_namespace(self, ns: str) -> None:
        cmd("ip", "netns", "add", ns)
        self._created.append(ns)
        self._save_marker()
        # No IPv6: the hosts would otherwise chatter (router solicitations, MLD) on the bridge.
        cmd("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1")
        cmd("ip", "-n", ns, "link", "set", "lo", "up")

    def _add_host(self, i: int) -> None:
        ns, link = self.namespace(i), self.links[i]
        self._add_namespace(ns)
        wan = ns  # the namespace holding the host's public address and its shaped link
        if i in self.nat:
            wan = self.router(i)
            self._add_namespace(wan)
        upload, download = (["root", "tbf", "rate", f"{rate}bit", "burst", str(self.burst(rate)), "latency",
                             QUEUE_LATENCY] for rate in (link.up_rate, link.down_rate))
        proc = wanlink.add_link(cmd, link, wan, self.switch, f"port{i}", upload, download, self._files,
                                seed=int.from_bytes(os.urandom(8), "little"))
        if proc is not None:
            self._procs.append(proc)
            self._delay_lines[i] = proc
        cmd("ip", "-n", wan, "addr", "add", f"{self.host_ip(i)}/24", "dev", "eth0")
        cmd("ip", "-n", wan, "link", "set", "eth0", "up")
        wanlink.set_tcp_buffers(cmd, ns, self.tcp_buffers)
        # The host's route to the others again, with the congestion control every TCP connection of it uses.
        if i in self.nat:
            wanlink.add_router(cmd, wan, ns, i)
            cmd("ip", "-n", ns, "route", "replace", "default", "via", f"{wanlink.NAT_SUBNET.format(i=i)}1",
                 "dev", "eth0", "congctl", self.congestion)
        else:
            cmd("ip", "-n", ns, "route", "replace", f"{SUBNET}0/24", "dev", "eth0", "proto", "kernel", "scope",
                 "link", "src", self.host_ip(i), "congctl", self.congestion)

    def _save_marker(self) -> None:
        write_marker(self.prefix, {
            "hosts": self._hosts, "rates": [f"{r}bit" for r in self.rates],
            "up_rates": [f"{r}bit" for r in self.up_rates], "down_rates": [f"{r}bit" for r in self.down_rates],
            "delays": [k.delay for k in self.links], "jitters": [k.jitter for k in self.links],
            "losses": [k.loss for k in self.links], "nat": self.nat, "tcp_buffers": self.tcp_buffers,
            "congestion": self.congestion, "ips": [self.host_ip(i) for i in range(self._hosts)],
            "namespaces": self._created, "created": time.time()}, kept=self._kept)

    def keep(self) -> None:
        """Leave the testbed up after this process exits; `scripts/testbed down` removes it."""
        assert self._owner, "keep() of a testbed that is not up"
        for i, proc in self._delay_lines.items():  # they would die with this process; `testbed down` kills them
            delayline.stats(proc.pid, self._files / f"port{i}.json", detach=True)
        self._kept = True
        self._save_marker()
        unregister(self)

    @classmethod
    def _adopt(cls, prefix: str, marker: dict) -> "Testbed":
        """Ownership of a testbed from its marker, for tearing it down from another process."""
        rates = marker.get("rates")
        hosts = marker.get("hosts")
        try:
            tb = cls(hosts, rates=rates, prefix=prefix)
        except (TypeError, ValueError):  # an unreadable marker: still remove what it names
            tb = cls(1, prefix=prefix)
        existing = set(list_namespaces())
        tb._created = [ns for ns in marker.get("namespaces", []) if is_ours(prefix, ns) and ns in existing]
        tb._owner, tb._kept = True, bool(marker.get("kept"))
        return tb

    def down(self) -> None:
        """Kill every process in the testbed and delete everything it created; safe to call twice."""
        if not self._owner:
            return
        errors: list[str] = []
        try:
            self._procs = stop_processes(self._procs, self._created)
        except Exception as exc:  # keep going: the namespaces must go regardless
            errors.append(f"stopping processes: {exc}")
        for ns in reversed(self._created):  # hosts first, then the switch; veths die with their namespace
            try:
                cmd("ip", "netns", "del", ns)
            except TestbedError as exc:
                if ns in list_namespaces():
                    errors.append(str(exc))
        self._created = []
        self._delay_lines = {}
        try:
            shutil.rmtree(self._files, ignore_errors=True)
            marker_path(self.prefix).unlink(missing_ok=True)
        except OSError as exc:
            errors.append(f"removing {marker_path(self.prefix)}: {exc}")
        self._owner = False
        unregister(self)
        if errors:
            raise TestbedError(f"teardown of testbed {self.prefix!r} incomplete: " + "; ".join(errors))

    # ---- processes in the hosts ----

    def run(self, i: int, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start argv inside host i (its pid is argv's own: `ip netns exec` execs it); killed at down()."""
        if not self._owner:
            raise TestbedError(f"testbed {self.prefix!r} is not up")
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *map(str, argv)], **popen_kwargs)
        self._procs.append(proc)
        return proc

    def check_call(self, i: int, argv: list[str], timeout: float = 60) -> None:
        """Run argv inside host i to completion; TestbedError if it fails or overruns."""
        proc = self.run(i, argv)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise TestbedError(f"{argv[0]} in host {i} did not finish in {timeout:.0f}s") from None
        if code != 0:
            raise TestbedError(f"{' '.join(map(str, argv))} in host {i} exited with {code}")


def teardown(prefix: str, force: bool = False) -> bool:
    """Remove testbed `prefix` left by `keep()` (or, with force, by a creator that died); False if none."""
    require_root()
    marker = read_marker(prefix)
    if marker is None:
        strays = [ns for ns in list_namespaces() if is_ours(prefix, ns)]
        if strays:
            raise TestbedError(f"namespaces {', '.join(strays)} were not created by a testbed (no "
                               f"{marker_path(prefix)}); not touching them, remove them with `ip netns del`")
        return False
    state = owner_state(marker)
    if state == "alive":
        raise TestbedError(f"testbed {prefix!r} belongs to running process {marker['pid']}; stop it "
                           "(it tears the testbed down on exit)")
    if state == "dead" and not force:
        raise TestbedError(f"testbed {prefix!r} was left by process {marker.get('pid')}, which died; "
                           f"`scripts/testbed down --prefix {prefix} --force` removes it")
    Testbed._adopt(prefix, marker).down()
    return True
