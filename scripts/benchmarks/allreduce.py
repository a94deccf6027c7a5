"""Benchmark ``allreduce``: one outer sync on a rate-limited testbed, gonka-node vs hivemind vs gloo.

Each configuration (system + codec) gets a fresh ``netbed.Testbed`` of
``--peers`` hosts, every host capped at ``--rate`` both ways and using TCP
``--congestion`` (cubic unless asked otherwise, whatever the machine's own
default: see scripts/netbed.py), and one process
per host (``allreduce_peer.py``). Each peer averages its own fp32
pseudo-gradient of ``--params`` normal values ``--warmup`` times untimed
(default once: a sync's first run pays for faulting in its buffers, a cost a
node pays once, not every round), then ``--repeats`` times; the medians of
the timed syncs are reported:

- ``gonka-node``: ``RoundProtocol.average`` over a ``Swarm`` on the host's
  testbed address, once per codec of ``p2p.codecs.CODECS`` (fp32 only if
  ``SwarmConfig`` has no ``codec`` field), error feedback off so every repeat
  syncs the same vector (``--error-feedback`` keeps it on, as a node runs a
  lossy codec by default: each repeat then syncs the vector plus what the
  previous one dropped);
- ``hivemind``: ``DecentralizedAverager.step`` (codecs none and float16;
  its 8-bit codecs are broken with numpy >= 2.4, see docs/design.md);
- ``gloo``: ``torch.distributed.all_reduce`` (fp32).

``seconds`` is end to end: from the moment the last peer calls the averaging
function to the moment the last peer has the result, so it includes gonka's
group formation and vote and hivemind's matchmaking (``min_matchmaking_time``
2 s), and gonka's decode of the committed average, which a node's outer step
does as it reads it; ``commit_s`` is the time to the commit, without that decode
(hivemind: its step's return, as its average needs no decode, so it equals ``seconds``;
gloo: all_reduce's return, before the sum is divided by N). ``allreduce_s`` is the exchange alone: gonka's
``RoundOutcome.allreduce_seconds``, hivemind's time from its group being
found to the result, gloo's all_reduce (slowest peer in each case).
``bound_seconds`` is the bandwidth floor of any all-reduce,
``2 (N-1)/N * wire size / (rate / 8)``, with the wire size of the codec;
TCP over the testbed carries ~95.6% of the nominal rate, so a perfect
implementation reaches a ratio of about 1.05.

``wire_bytes_per_peer`` is gonka's own count of round traffic
(``gonka_node_sent_bytes_total``, the mean over peers); ``nic_tx_bytes_per_peer``
is what left each host's interface (all systems: headers, encryption and
heartbeats included). ``identical``: every peer ended with bit-identical
values; ``within_tol``: the result's relative error to the exact mean
(gonka-node: to its aggregator on the uncompressed pieces) is under the
codec's tolerance (``TOLERANCE``). ``aborted``: gonka-node round
attempts that aborted and were retried (their time counts in ``seconds``).
``cpu_s`` / ``p2pd_cpu_s`` (gonka-node): CPU seconds one sync costs a peer's
process and its p2pd (mean over peers): all peers share the machine's cores,
so CPU is what a 2-core testbed runs out of before bandwidth.
Every peer's log is kept in DIR/allreduce-logs/SYSTEM-CODEC/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .options import add_wan_arguments, non_negative_int, positive_int, wan_settings

ROOT = Path(__file__).resolve().parent.parent.parent
PEER_SCRIPT = Path(__file__).resolve().parent / "allreduce_peer.py"

COLUMNS = ["system", "codec", "peers", "link_mbit", "rtt_ms", "nat", "owners", "payload_bytes", "wire_bytes_per_peer", "x_fp32", "nic_tx_bytes_per_peer",
           "seconds", "commit_s", "allreduce_s", "bound_seconds", "ratio_to_bound", "gather_s", "exchanged_s", "audited_s",
           "voted_s", "outside_s", "outside_rtts", "first_sync_aborted", "identical", "rel_error", "within_tol", "aborted", "cpu_s", "p2pd_cpu_s"]
# Largest acceptable ||result - mean|| / ||mean|| per codec (Gaussian inputs, mean of N peers).
# Float codecs round twice (contribution, then average); block codecs lose up to half a level.
TOLERANCE = {"fp32": 1e-6, "none": 1e-6, "fp16": 2e-3, "float16": 2e-3, "bf16": 1.5e-2,
             "int8": 0.05, "int4": 0.6, "fp4": 0.6}
HIVEMIND_CODECS = ["none", "float16"]
# --quick: one lossless, one 8-bit and one 4-bit codec of each system, to stay a ~2 minute smoke run.
QUICK_GONKA_CODECS = ["fp32", "int8", "fp4"]
QUICK_HIVEMIND_CODECS = ["none"]
# --smoke: each system once, lossless, 2 peers, a 256 KB vector (a run of seconds per system).
SMOKE_GONKA_CODECS = ["fp32", "sparse"]
SMOKE_PEERS, SMOKE_PARAMS = 2, 1 << 16
STARTUP_SLACK = 90.0  # seconds for processes, p2pd and DHT to start and meet, per run
EXIT_SLACK = 20.0  # the coordinator waits this long past a peer's own timeout


class BenchError(RuntimeError):
    """A configuration failed; the message names the peer and shows its log."""


def rate_arg(text: str) -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    from netbed import parse_rate

    try:
        parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def congestion_arg(text: str) -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    from netbed import check_congestion

    try:
        return check_congestion(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--peers", type=positive_int, help="testbed hosts, one peer each (default 4; 2 with --smoke)")
    group.add_argument("--rate", type=rate_arg, default="100mbit", help="every host's link, both ways (default 100mbit)")
    group.add_argument("--congestion", type=congestion_arg, default="cubic",
                       help="TCP congestion control of every testbed host (default cubic; see scripts/netbed.py)")
    group.add_argument("--params", type=positive_int, help="fp32 elements averaged (default 25,000,000; 5,000,000 with "
                                                           "--quick, 65,536 with --smoke)")
    group.add_argument("--repeats", type=positive_int, help="syncs per configuration, median reported (default 3; 1 with --quick)")
    group.add_argument("--warmup", type=non_negative_int,
                       help="untimed syncs before the timed ones, every system alike (default 1; 0 with --quick)")
    group.add_argument("--systems", default="gonka-node,hivemind,gloo",
                       help="comma-separated subset of gonka-node, hivemind, gloo (default: all)")
    group.add_argument("--codecs", help="comma-separated gonka-node codecs (default: every codec of p2p.codecs; "
                       "fp32,int8,fp4 with --quick, fp32 with --smoke)")
    group.add_argument("--error-feedback", action="store_true",
                       help="gonka-node: keep error feedback on for lossy codecs, as a node does by default "
                            "(default off: every repeat syncs the same vector)")
    group.add_argument("--pin", action="store_true",
                       help="give peer i (and its p2pd) CPU i mod the CPUs this process may use, as on hosts that do "
                            "not share cores (default: peers share every CPU)")
    group.add_argument("--peer-timeout", type=float,
                       help="seconds each peer process may live (default: from the size, rate and repeats)")
    # The WAN testbed (docs/testbed.md): every host half the RTT from the switch, so any two are RTT apart.
    add_wan_arguments(group)
    group.add_argument("--nat", type=non_negative_int, default=0,
                       help="the last K hosts sit behind NAT routers of their own (gonka-node only; default 0)")


def link_bound(peers: int, nat: int, size: int, rate_bps: int) -> float:
    """Seconds the busiest uplink needs for one all-reduce of ``size`` wire bytes: with K of N
    peers behind NAT, the N - K others own a part each (``Group.owners``) and each sends its
    pieces to the other owners and its part's average to all, (2N - K - 2) / (N - K) * size;
    2 (N - 1) / N * size with none."""
    return (2 * peers - nat - 2) / (peers - nat) * size / (rate_bps / 8)


# ---- what to run ---------------------------------------------------------------------


def gonka_codecs(requested: str | None, quick: bool, smoke: bool = False) -> list[str]:
    from p2p.codecs import CODECS
    from p2p.config import SwarmConfig

    if "codec" not in SwarmConfig.__dataclass_fields__:
        return ["fp32"]
    default = (SMOKE_GONKA_CODECS if smoke else [n for n in QUICK_GONKA_CODECS if n in CODECS] if quick
               else list(CODECS))
    names = [n for n in requested.split(",") if n] if requested else default
    unknown = [n for n in names if n not in CODECS and not n.startswith("sparse")]
    if unknown:
        raise ValueError(f"--codecs: unknown codec {', '.join(unknown)} (choose from {', '.join(CODECS)}, sparse...)")
    from p2p.codecs import get_codec

    for name in names:
        get_codec(name)  # a sparse name that does not parse: ValueError naming it
    return names


def wire_size(system: str, codec: str, params: int) -> int:
    """Bytes of the whole vector as the system's codec puts it on the wire."""
    if system == "gonka-node":
        from p2p.codecs import get_codec

        c = get_codec(codec)  # a sparse codec's average has a format of its own: their mean each way
        return (c.wire_bytes(params) + c.average.wire_bytes(params)) // 2
    return 2 * params if codec == "float16" else 4 * params


def configurations(args) -> list[tuple[str, str]]:
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - {"gonka-node", "hivemind", "gloo"}
    if unknown:
        raise ValueError(f"--systems: unknown system {', '.join(sorted(unknown))} (gonka-node, hivemind, gloo)")
    configs = []
    if "gonka-node" in systems:
        configs += [("gonka-node", c) for c in gonka_codecs(args.codecs, args.quick, getattr(args, "smoke", False))]
    if "hivemind" in systems:
        configs += [("hivemind", c) for c in (QUICK_HIVEMIND_CODECS if args.quick else HIVEMIND_CODECS)]
    if "gloo" in systems:
        configs.append(("gloo", "fp32"))
    return configs


# ---- one configuration on its own testbed -------------------------------------------------


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:]) or "    (empty log)"


def run_config(netbed, system: str, codec: str, args, timeout: float, tag: str) -> list[dict]:
    """Start one peer per host, wait for all, return their result files (BenchError on any failure)."""
    mode = {"gonka-node": "gonka", "hivemind": "hivemind", "gloo": "gloo"}[system]
    workdir = Path(tempfile.mkdtemp(prefix=f"allreduce-{mode}-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    try:
        with netbed.Testbed(args.peers, rate=args.rate, prefix=f"ar{os.getpid()}-{tag}",
                            congestion=args.congestion, nat=list(range(args.peers - args.nat, args.peers)),
                            **wan_settings(args)) as tb:
            procs, logs = [], []
            for i in range(args.peers):  # peer 0 first: the others bootstrap from it
                log = workdir / f"peer{i}.log"
                argv = [sys.executable, str(PEER_SCRIPT), "--mode", mode, "--index", i, "--peers", args.peers,
                        "--ip", tb.local_ip(i), "--master", tb.host_ip(0), "--workdir", workdir,
                        "--params", args.params, "--repeats", args.repeats, "--warmup", args.warmup, "--codec", codec,
                        "--run-tag", f"{os.getpid()}{tag}", "--timeout", timeout]
                if args.error_feedback:
                    argv.append("--error-feedback")
                pin = {}
                if args.pin:  # inherited by everything the peer starts (p2pd, threads)
                    cpus = sorted(os.sched_getaffinity(0))
                    cpu = cpus[i % len(cpus)]
                    pin["preexec_fn"] = lambda cpu=cpu: os.sched_setaffinity(0, {cpu})
                with open(log, "wb") as f:
                    procs.append(tb.run(i, argv, stdout=f, stderr=subprocess.STDOUT, env=env, **pin))
                logs.append(log)
            deadline = time.monotonic() + timeout + EXIT_SLACK
            pending = set(range(args.peers))
            while pending:
                for i in sorted(pending):
                    code = procs[i].poll()
                    if code is None:
                        continue
                    pending.discard(i)
                    if code != 0:
                        raise BenchError(f"{system}/{codec}: peer {i} ({tb.host_ip(i)}) exited with {code}; "
                                         f"log tail:\n{log_tail(logs[i])}")
                if time.monotonic() > deadline:
                    i = min(pending)
                    raise BenchError(f"{system}/{codec}: peer {i} ({tb.host_ip(i)}) still running after "
                                     f"{timeout + EXIT_SLACK:.0f}s; log tail:\n{log_tail(logs[i])}")
                time.sleep(0.1)
            results = []
            for i in range(args.peers):
                try:
                    results.append(json.loads((workdir / f"peer{i}.json").read_text()))
                except (OSError, ValueError) as e:
                    raise BenchError(f"{system}/{codec}: peer {i} exited 0 but its result is unreadable ({e}); "
                                     f"log tail:\n{log_tail(logs[i])}") from None
            return results
    finally:
        # Keep every peer's log next to the result: a failed or slow run is read from them.
        keep = args.out / "allreduce-logs" / f"{system}-{codec}"
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True, exist_ok=True)
        for log in workdir.glob("peer*.log"):
            shutil.copy(log, keep / log.name)
        shutil.rmtree(workdir, ignore_errors=True)


def summarize(system: str, codec: str, peers: list[dict], args, rate_bps: int) -> dict:
    """One table row from every peer's measurements."""
    repeats = len(peers[0]["repeats"])
    e2e, to_commit, exchange, identical, aborted = [], [], [], True, 0
    for r in range(repeats):
        per_peer = [p["repeats"][r] for p in peers]
        e2e.append(max(x["t_exit"] for x in per_peer) - max(x["t_enter"] for x in per_peer))
        exchange.append(max(x["allreduce_s"] for x in per_peer))
        if all("t_commit" in x for x in per_peer):
            to_commit.append(max(x["t_commit"] for x in per_peer) - max(x["t_enter"] for x in per_peer))
        identical &= len({x["digest"] for x in per_peer}) == 1
        aborted += max(len(x.get("aborted", [])) for x in per_peer)
    sent = [x["sent_bytes"] for p in peers for x in p["repeats"]]
    # CPU seconds per peer and sync (gonka-node only): the peer process, and its p2pd.
    cpu = {key: [statistics.mean(p["repeats"][r][key] for p in peers) for r in range(repeats)]
           for key in ("cpu_s", "p2pd_cpu_s") if all(key in p["repeats"][r] for p in peers for r in range(repeats))}
    nic = [x["nic_tx_bytes"] for p in peers for x in p["repeats"]]
    # gonka-node: where a sync's time went on the slowest peer (RoundOutcome.phases, gather_seconds).
    steps = {}
    for key in ("gather", "exchanged", "audited", "voted"):
        per_repeat = []
        for r in range(repeats):
            values = [x.get("gather_s") if key == "gather" else x.get("phases", {}).get(key)
                      for x in (p["repeats"][r] for p in peers)]
            if None in values:
                break
            per_repeat.append(max(values))
        else:
            steps[f"{key}_s"] = statistics.median(per_repeat)
    size = wire_size(system, codec, args.params)
    bound = link_bound(args.peers, getattr(args, "nat", 0), size, rate_bps)
    seconds = statistics.median(e2e)
    rel_error = max(p["rel_error"] for p in peers)
    return {
        "system": system,
        "codec": codec,
        "peers": args.peers,
        "link_mbit": rate_bps / 1e6,
        "payload_bytes": 4 * args.params,
        "wire_bytes_per_peer": None if None in sent else round(statistics.mean(sent)),
        # What an fp32 butterfly sends per peer, over this row's (gonka-node's own count).
        "x_fp32": None if None in sent else round(2 * (args.peers - 1) / args.peers * 4 * args.params
                                                     / statistics.mean(sent), 1),
        "nic_tx_bytes_per_peer": round(statistics.mean(nic)),
        "seconds": seconds,
        "commit_s": statistics.median(to_commit) if len(to_commit) == repeats else None,
        "allreduce_s": statistics.median(exchange),
        "bound_seconds": bound,
        "ratio_to_bound": seconds / bound,
        **steps,
        # Everything but the exchange itself: the gather, group formation, audits, the vote, the decode.
        "outside_s": seconds - steps["exchanged_s"] if "exchanged_s" in steps else None,
        "outside_rtts": ((seconds - steps["exchanged_s"]) / (args.rtt / 1000)
                         if "exchanged_s" in steps and getattr(args, "rtt", 0) else None),
        "rtt_ms": getattr(args, "rtt", 0.0),
        "nat": getattr(args, "nat", 0),
        # Members that owned a part in the last sync (gonka-node; all of them unless some are behind NAT).
        "owners": max(p.get("owners") or args.peers for p in peers) if system == "gonka-node" else None,
        "first_sync_aborted": max((p["first_sync_aborted"] for p in peers if "first_sync_aborted" in p), default=None),
        "identical": identical,
        "rel_error": rel_error,
        # A sparse codec delivers ~2-3% of the values a round (error feedback the rest, later).
        "within_tol": rel_error <= TOLERANCE.get(codec, 1.2 if codec.startswith("sparse") else 1.0),
        "aborted": aborted,
        "cpu_s": statistics.median(cpu["cpu_s"]) if "cpu_s" in cpu else None,
        "p2pd_cpu_s": statistics.median(cpu["p2pd_cpu_s"]) if "p2pd_cpu_s" in cpu else None,
        "seconds_all": e2e,
        "allreduce_s_all": exchange,
        "codec_wire_bytes": size,
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['system']}\n{r['codec']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5))
    ax.bar([x - 0.2 for x in xs], [r.get("seconds") or 0 for r in rows], 0.4, label="measured (end to end)")
    ax.bar([x + 0.2 for x in xs], [r["bound_seconds"] for r in rows], 0.4, label="bandwidth bound", color="lightgray")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("seconds per sync")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import netbed

    smoke = getattr(args, "smoke", False)
    args.peers = args.peers or (SMOKE_PEERS if smoke else 4)
    args.params = args.params or (SMOKE_PARAMS if smoke else 5_000_000 if args.quick else 25_000_000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    if args.peers < 2:
        raise ValueError("--peers must be at least 2")
    if args.nat and (args.peers - args.nat < 2 or args.systems != "gonka-node"):
        raise ValueError("--nat: at most --peers minus 2 hosts, with --systems gonka-node (the others dial every peer)")
    rate_bps = netbed.parse_rate(args.rate)
    fp32_bound = 2 * (args.peers - 1) / args.peers * 4 * args.params / (rate_bps / 8)
    # Generous: an implementation 8x off the fp32 bound still finishes; a hung one is cut off.
    timeout = args.peer_timeout or STARTUP_SLACK + (args.warmup + args.repeats) * (8 * fp32_bound + 20)
    rows, notes, raw = [], [], {}
    for k, (system, codec) in enumerate(configurations(args)):
        print(f"allreduce: {system}/{codec} on {args.peers} hosts at {args.rate} ...", file=sys.stderr, flush=True)
        try:
            peers = run_config(netbed, system, codec, args, timeout, str(k))
        except (BenchError, netbed.TestbedError) as e:
            notes.append(f"FAILED {e}")
            print(f"allreduce: {e}", file=sys.stderr, flush=True)
            rows.append({"system": system, "codec": codec, "peers": args.peers, "link_mbit": rate_bps / 1e6,
                         "payload_bytes": 4 * args.params, "seconds": None,
                         "bound_seconds": link_bound(args.peers, args.nat, wire_size(system, codec, args.params),
                                                     rate_bps), "error": str(e).splitlines()[0]})
            continue
        row = summarize(system, codec, peers, args, rate_bps)
        raw[f"{system}/{codec}"] = peers
        rows.append(row)
        if not row["identical"]:
            notes.append(f"{system}/{codec}: peers ended with different values")
        if not row["within_tol"]:
            notes.append(f"{system}/{codec}: relative error {row['rel_error']:.3g} above tolerance "
                         f"{TOLERANCE.get(codec, 1.2 if codec.startswith('sparse') else 1.0)}")
    png = args.out / "allreduce.png"
    plot(rows, png, f"one sync of {args.params:,} fp32 values, {args.peers} peers at {args.rate} each"
                    f"{f', {args.rtt:g} ms RTT' if args.rtt else ''}{f', {args.loss:g}% loss' if args.loss else ''}"
                    f"{f', {args.nat} behind NAT' if args.nat else ''}"
                    f"{', one CPU each' if args.pin else ''} "
                    f"(TCP {args.congestion}{', error feedback' if args.error_feedback else ''})")
    notes.append(f"plot: {png}")
    return {"rows": rows, "columns": COLUMNS, "notes": notes, "plot": str(png),
            "config": {"peers": args.peers, "pin": args.pin, "rate": args.rate, "congestion": args.congestion,
                       "rtt_ms": args.rtt, "jitter_ms": args.jitter, "loss_percent": args.loss, "nat": args.nat,
                       "tcp_buffers": args.tcp_buffers,
                       "error_feedback": args.error_feedback, "params": args.params,
                       "repeats": args.repeats, "warmup": args.warmup, "peer_timeout": timeout, "tolerance": TOLERANCE},
            "load_average": os.getloadavg(), "peers_raw": raw}
