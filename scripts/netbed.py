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
/run/gonka-testbed/<prefix>.json holds the creator's pid (and its start time,
so a reused pid is not mistaken for the owner). `up()` refuses to touch
namespaces it did not create; `force=True` may clean up after a creator that
died. The owner tears down on `down()`, on leaving `with`, at exit and on
SIGINT/SIGTERM. `keep()` hands a testbed over to `scripts/testbed down`.

The TCP throughput probe that checks the shaping lives in scripts/netprobe.py.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import delayline
import wanlink

MARKER_DIR = Path("/run/gonka-testbed")
SUBNET = "10.77.0."  # private /24 that exists only inside the testbed's namespaces
FIRST_HOST = 10  # host i is SUBNET + (FIRST_HOST + i)
MAX_HOSTS = 200
# Queue of each shaper, as tbf's latency: deep enough that TCP keeps the link
# full, short enough that a full queue adds only a home-router-like delay.
QUEUE_LATENCY = "50ms"
# tbf bucket: 16 KiB (about ten full-size frames), or 4 ms of traffic at high
# rates, where timer slack would otherwise leave the link idle between
# releases. The bucket is the only burst above nominal (<1% of a 2 s run).
# Measured TCP goodput is ~95.6% of nominal: tbf counts whole frames, and
# 1448 of every 1514 bytes are payload.
MIN_BURST = 16 * 1024
BURST_SECONDS = 0.004
# TCP congestion control of every host (see the docstring); a non-root namespace may choose
# its default only from tcp_allowed_congestion_control, a route's congctl from any loaded one.
DEFAULT_CONGESTION = "cubic"
GRACE_SECONDS = 3.0  # how long processes get between SIGTERM and SIGKILL at teardown

_PREFIX = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # tc's units: SI, bits
_SIZE = re.compile(r"(\d+)(b|k|kb|m|mb)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}  # tc's units: bytes


class TestbedError(RuntimeError):
    """The testbed cannot be created, used or removed; the message says why and what to do."""

    __test__ = False  # not a pytest test class


def parse_rate(text: str) -> int:
    """'100mbit' -> 100_000_000 bits/s (tc's SI units bit, kbit, mbit, gbit); ValueError if malformed."""
    m = _RATE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"rate must look like 100mbit, 500kbit or 1gbit, got {text!r}")
    bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
    if not 8_000 <= bps <= 10 * 10**9:
        raise ValueError(f"rate must be between 8kbit and 10gbit, got {text!r}")
    return bps


def parse_size(text: str) -> int:
    """'64kb' -> 65536 bytes (tc's size units b, k/kb, m/mb); ValueError if malformed."""
    m = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None or int(m.group(1)) == 0:
        raise ValueError(f"burst must be a size in bytes like 65536, 64kb or 1mb, got {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()]


def burst_for(rate_bps: int) -> int:
    """The tbf bucket used for a rate (see MIN_BURST)."""
    return max(MIN_BURST, int(rate_bps / 8 * BURST_SECONDS))


def check_congestion(name: str) -> str:
    """``name`` if this kernel has that TCP congestion control loaded (what a route's ``congctl`` may
    name), else ValueError."""
    try:
        available = set(Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split())
    except OSError:
        available = {DEFAULT_CONGESTION}
    if name not in available:
        raise ValueError(f"congestion must be one of this kernel's {', '.join(sorted(available))}, got {name!r}")
    return name


def require_root() -> None:
    """Raise TestbedError unless this process can create namespaces and shape links."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces, veth, tc): run it with sudo")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise TestbedError(f"the testbed needs iproute2; not found: {', '.join(missing)}")


def _cmd(*argv: str, timeout: float = 15) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(argv)}` did not finish in {timeout:.0f}s") from None
    if r.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def list_namespaces() -> list[str]:
    """Names of all network namespaces `ip netns` knows."""
    return [line.split()[0] for line in _cmd("ip", "netns", "list").splitlines() if line.strip()]


def _netns_pids(ns: str) -> set[int]:
    try:
        return {int(p) for p in _cmd("ip", "netns", "pids", ns).split()}
    except TestbedError:  # the namespace is already gone
        return set()


def _start_time(pid: int) -> int | None:
    """Start time of a live (non-zombie) process in clock ticks since boot; None if there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _descendants(roots: set[int]) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), list(roots)
    while frontier:
        parent = frontier.pop()
        kids = [c for c, p in parents.items() if p == parent and c not in found]
        found.update(kids)
        frontier += kids
    return found


# ---- ownership markers ------------------------------------------------------------


def _marker_path(prefix: str) -> Path:
    return MARKER_DIR / f"{prefix}.json"


def read_marker(prefix: str) -> dict | None:
    """The marker of testbed `prefix` ({} if unreadable), or None if there is none."""
    try:
        data = json.loads(_marker_path(prefix).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def owner_state(marker: dict) -> str:
    """'kept' (handed to `testbed down`), 'alive' (its creator runs) or 'dead' (its creator died)."""
    if marker.get("kept") is True:
        return "kept"
    pid, start = marker.get("pid"), marker.get("start")
    if isinstance(pid, int) and start is not None and _start_time(pid) == start:
        return "alive"
    return "dead"


def _is_ours(prefix: str, ns: object) -> bool:
    # Marker contents come from a file anyone root could edit: delete only names of this prefix's shape.
    return isinstance(ns, str) and re.fullmatch(re.escape(prefix) + r"-(sw|h\d+|r\d+)", ns) is not None


def list_testbeds() -> list[dict]:
    """Every testbed with a marker: its marker plus 'prefix', 'owner' and the namespaces that exist now."""
    existing = set(list_namespaces())
    found = []
    for path in sorted(MARKER_DIR.glob("*.json")) if MARKER_DIR.is_dir() else []:
        marker = read_marker(path.stem) or {}
        names = [ns for ns in marker.get("namespaces", []) if _is_ours(path.stem, ns)]
        found.append({**marker, "prefix": path.stem, "owner": owner_state(marker),
                      "present": [ns for ns in names if ns in existing]})
    return found


def teardown(prefix: str, force: bool = False) -> bool:
    """Remove testbed `prefix` left by `keep()` (or, with force, by a creator that died); False if none."""
    require_root()
    marker = read_marker(prefix)
    if marker is None:
        strays = [ns for ns in list_namespaces() if _is_ours(prefix, ns)]
        if strays:
            raise TestbedError(f"namespaces {', '.join(strays)} were not created by a testbed (no "
                               f"{_marker_path(prefix)}); not touching them, remove them with `ip netns del`")
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


# ---- teardown on exit and on signals ---------------------------------------------

_live: list["Testbed"] = []
_previous_handlers: dict[int, object] = {}
_atexit_registered = False


def _register(tb: "Testbed") -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_down_all)
        _atexit_registered = True
    if not _live and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) != signal.SIG_IGN:  # a process that ignores it keeps ignoring it
                _previous_handlers[signum] = signal.signal(signum, _on_signal)
    _live.append(tb)


def _unregister(tb: "Testbed") -> None:
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


# ---- the testbed ------------------------------------------------------------------


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
        MARKER_DIR.mkdir(parents=True, exist_ok=True)
        try:  # O_EXCL: of two processes bringing up one prefix at once, exactly one gets it
            os.close(os.open(_marker_path(self.prefix), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            raise TestbedError(f"testbed {self.prefix!r} is being created by another process") from None
        self._owner = True
        self._save_marker()
        _register(self)
        try:
            if self.nat and shutil.which("nft") is None:
                raise TestbedError("hosts behind NAT need nft (Debian package nftables; scripts/setup installs it)")
            self._files.mkdir(parents=True, exist_ok=True)
            self._add_namespace(self.switch)
            _cmd("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _cmd("ip", "-n", self.switch, "link", "set", "br0", "up")
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
        _cmd("ip", "netns", "add", ns)
        self._created.append(ns)
        self._save_marker()
        # No IPv6: the hosts would otherwise chatter (router solicitations, MLD) on the bridge.
        _cmd("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1")
        _cmd("ip", "-n", ns, "link", "set", "lo", "up")

    def _add_host(self, i: int) -> None:
        ns, link = self.namespace(i), self.links[i]
        self._add_namespace(ns)
        wan = ns  # the namespace holding the host's public address and its shaped link
        if i in self.nat:
            wan = self.router(i)
            self._add_namespace(wan)
        upload, download = (["root", "tbf", "rate", f"{rate}bit", "burst", str(self.burst(rate)), "latency",
                             QUEUE_LATENCY] for rate in (link.up_rate, link.down_rate))
        proc = wanlink.add_link(_cmd, link, wan, self.switch, f"port{i}", upload, download, self._files,
                                seed=int.from_bytes(os.urandom(8), "little"))
        if proc is not None:
            self._procs.append(proc)
            self._delay_lines[i] = proc
        _cmd("ip", "-n", wan, "addr", "add", f"{self.host_ip(i)}/24", "dev", "eth0")
        _cmd("ip", "-n", wan, "link", "set", "eth0", "up")
        wanlink.set_tcp_buffers(_cmd, ns, self.tcp_buffers)
        # The host's route to the others again, with the congestion control every TCP connection of it uses.
        if i in self.nat:
            wanlink.add_router(_cmd, wan, ns, i)
            _cmd("ip", "-n", ns, "route", "replace", "default", "via", f"{wanlink.NAT_SUBNET.format(i=i)}1",
                 "dev", "eth0", "congctl", self.congestion)
        else:
            _cmd("ip", "-n", ns, "route", "replace", f"{SUBNET}0/24", "dev", "eth0", "proto", "kernel", "scope",
                 "link", "src", self.host_ip(i), "congctl", self.congestion)

    def _save_marker(self) -> None:
        data = {"pid": os.getpid(), "start": _start_time(os.getpid()), "kept": False, "hosts": self._hosts,
                "rates": [f"{r}bit" for r in self.rates], "up_rates": [f"{r}bit" for r in self.up_rates],
                "down_rates": [f"{r}bit" for r in self.down_rates], "delays": [k.delay for k in self.links],
                "jitters": [k.jitter for k in self.links], "losses": [k.loss for k in self.links], "nat": self.nat,
                "tcp_buffers": self.tcp_buffers, "congestion": self.congestion,
                "ips": [self.host_ip(i) for i in range(self._hosts)],
                "namespaces": self._created, "created": time.time()}
        if self._kept:
            data.update(pid=None, start=None, kept=True)
        tmp = _marker_path(self.prefix).with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, _marker_path(self.prefix))

    def keep(self) -> None:
        """Leave the testbed up after this process exits; `scripts/testbed down` removes it."""
        assert self._owner, "keep() of a testbed that is not up"
        for i, proc in self._delay_lines.items():  # they would die with this process; `testbed down` kills them
            delayline.stats(proc.pid, self._files / f"port{i}.json", detach=True)
        self._kept = True
        self._save_marker()
        _unregister(self)

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
        tb._created = [ns for ns in marker.get("namespaces", []) if _is_ours(prefix, ns) and ns in existing]
        tb._owner, tb._kept = True, bool(marker.get("kept"))
        return tb

    def down(self) -> None:
        """Kill every process in the testbed and delete everything it created; safe to call twice."""
        if not self._owner:
            return
        errors: list[str] = []
        try:
            self._stop_processes()
        except Exception as exc:  # keep going: the namespaces must go regardless
            errors.append(f"stopping processes: {exc}")
        for ns in reversed(self._created):  # hosts first, then the switch; veths die with their namespace
            try:
                _cmd("ip", "netns", "del", ns)
            except TestbedError as exc:
                if ns in list_namespaces():
                    errors.append(str(exc))
        self._created = []
        self._delay_lines = {}
        try:
            shutil.rmtree(self._files, ignore_errors=True)
            _marker_path(self.prefix).unlink(missing_ok=True)
        except OSError as exc:
            errors.append(f"removing {_marker_path(self.prefix)}: {exc}")
        self._owner = False
        _unregister(self)
        if errors:
            raise TestbedError(f"teardown of testbed {self.prefix!r} incomplete: " + "; ".join(errors))

    def _victims(self) -> set[int]:
        pids = {p.pid for p in self._procs if p.poll() is None}  # not reaped, so the pid is still theirs
        pids |= _descendants({p.pid for p in self._procs})
        for ns in self._created:  # also whatever `scripts/testbed run` or a reparented child left there
            pids |= _netns_pids(ns)
        pids.discard(os.getpid())
        return {p for p in pids if _start_time(p) is not None}

    def _stop_processes(self) -> None:
        victims = self._victims()
        for pid in victims:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while victims and time.monotonic() < deadline:
            for p in self._procs:
                p.poll()  # reap, so a finished child stops counting as alive
            victims = {p for p in victims if _start_time(p) is not None}
            time.sleep(0.05)
        for _ in range(3):  # a process may fork while we kill; look again
            victims = self._victims()
            if not victims:
                break
            for pid in victims:
                _signal(pid, signal.SIGKILL)
            for p in self._procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            time.sleep(0.05)
        self._procs = [p for p in self._procs if p.poll() is None]

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


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
