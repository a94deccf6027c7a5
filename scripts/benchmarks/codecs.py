"""Benchmark ``codecs``: speed, size and error of every wire codec.

For each codec on one Gaussian fp32 vector (25M elements, 5M with --quick):
median encode and decode seconds over several repeats (both measured in the
same loop, so they see the same machine state), the exact wire size, the
ratio to fp32, and the time the payload takes on a 1 Gbit/s link
(bytes * 8 / 1e9). ``speedup_vs_1gbit`` = send time / (encode + decode);
the goal (issue 5) is at least 10, i.e. compression never the bottleneck of
a 1 Gbit/s peer. ``rel_error`` = ||decode(encode(x)) - x|| / ||x||.
A sparse codec sends so few bytes that no codec work is faster than its
send; ``vs_fp32_send`` is what matters for it: fp32's send time over
encode + decode (above 1: sparse and its work beat sending fp32). Its
averages' format (``NAME/average``, what owners encode and every member
decodes) has a row of its own.

Decode gets ``bytes``, as payloads arrive from the network, so its time
includes the copy a read-only buffer needs before torch can use it. Other
load on the machine slows torch ops a lot (threads wait for the cores), so
the JSON also keeps every repeat, the fastest (``speedup_best``) and the load
average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from p2p.codecs import CODECS, get_codec

from .options import positive_int

LINK_BITS_PER_S = 1e9
GOAL_SPEEDUP = 10.0
COLUMNS = ["codec", "wire_MB", "ratio_vs_fp32", "encode_s", "decode_s", "send_1gbit_s",
           "speedup_vs_1gbit", "meets_10x", "vs_fp32_send", "speedup_best", "rel_error"]
DEFAULT_CODECS = [*CODECS, "sparse", "sparse-k128"]


def codec_names(text: str) -> list[str]:
    """``--codecs`` value: known codec names, comma-separated."""
    names = [n for n in text.split(",") if n]
    unknown = []
    for n in names:
        try:
            get_codec(n)
        except ValueError:
            unknown.append(n)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown codec {', '.join(unknown) or repr(text)} "
                                         f"(choose from {', '.join(CODECS)}, sparse[-k..]...)")
    return names


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--numel", type=positive_int,
                       help="vector length (default 25,000,000; 5,000,000 with --quick, 65,536 with --smoke)")
    group.add_argument("--repeats", type=positive_int,
                       help="timed repeats per codec, median reported (default 5; 3 with --quick, 1 with --smoke)")
    group.add_argument("--codecs", type=codec_names, default=DEFAULT_CODECS,
                       help=f"comma-separated codecs (default: {','.join(DEFAULT_CODECS)})")


def time_codec(codec, x: torch.Tensor, repeats: int) -> dict:
    name = codec.name
    payload = codec.encode(x)  # warm-up: first calls pay for allocator growth
    codec.decode(payload, x.numel())
    encode_s, decode_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = codec.encode(x)
        t1 = time.perf_counter()
        y = codec.decode(payload, x.numel())
        t2 = time.perf_counter()
        encode_s.append(t1 - t0)
        decode_s.append(t2 - t1)
    enc, dec = statistics.median(encode_s), statistics.median(decode_s)
    send_s = len(payload) * 8 / LINK_BITS_PER_S
    speedup = send_s / (enc + dec)
    return {
        "codec": name,
        "wire_bytes": len(payload),
        "wire_MB": len(payload) / 1e6,
        "ratio_vs_fp32": 4 * x.numel() / len(payload),
        "encode_s": enc,
        "decode_s": dec,
        "encode_s_all": encode_s,
        "decode_s_all": decode_s,
        "send_1gbit_s": send_s,
        "speedup_vs_1gbit": speedup,
        "meets_10x": speedup >= GOAL_SPEEDUP,
        "vs_fp32_send": 4 * x.numel() * 8 / LINK_BITS_PER_S / (enc + dec),
        "speedup_best": send_s / (min(encode_s) + min(decode_s)),
        "rel_error": ((y.double() - x.double()).norm() / x.double().norm()).item(),
    }


def run(args: argparse.Namespace) -> dict:
    smoke = getattr(args, "smoke", False)
    numel = args.numel or (1 << 16 if smoke else 5_000_000 if args.quick else 25_000_000)
    repeats = args.repeats or (1 if smoke else 3 if args.quick else 5)
    names = args.codecs
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    load_before = os.getloadavg()
    codecs = [get_codec(n) for n in names]
    rows = [time_codec(c, x, repeats) for codec in codecs
            for c in ([codec] if codec.average is codec else [codec, codec.average])]
    failing = [r["codec"] for r in rows if not r["meets_10x"]]
    return {
        "numel": numel,
        "repeats": repeats,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "link_bits_per_s": LINK_BITS_PER_S,
        "goal_speedup": GOAL_SPEEDUP,
        "columns": COLUMNS,
        "rows": rows,
        "notes": [f"{numel:,} fp32 elements, median of {repeats}, {torch.get_num_threads()} torch threads, "
                  f"load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}; "
                  f"goal: encode+decode >= {GOAL_SPEEDUP:g}x faster than sending over 1 Gbit/s; "
                  + (f"missed by: {', '.join(failing)}" if failing else "met by all codecs")],
    }
