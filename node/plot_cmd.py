"""`gonka-node plot`: loss and throughput by round, from a node's history file (node/history.py)."""

from __future__ import annotations

import argparse
import os

from node import history
from node.errors import EXIT_OK, UsageError  # UsageError: the CLI's one-line, exit-2 error


def add_parser(commands) -> None:
    p = commands.add_parser(
        "plot", help="draw loss and throughput by round from a node's history",
        description="Draw a node's training and eval loss and its tokens/s by committed round to a PNG, "
                    f"from {history.FILE_NAME} in its checkpoint directory (needs matplotlib).")
    p.add_argument("--checkpoint-dir", metavar="DIR", required=True, help="the node's --checkpoint-dir")
    p.add_argument("--out", metavar="FILE.png", help="where to write the PNG (default: DIR/history.png)")


def run(args: argparse.Namespace) -> int:
    source = history.path_in(args.checkpoint_dir)
    out = args.out or os.path.join(args.checkpoint_dir, "history.png")
    if not os.path.isfile(source):
        raise UsageError(f"--checkpoint-dir: no {history.FILE_NAME} in {args.checkpoint_dir}")
    records = history.read(source)
    if len(records) < 1:
        raise UsageError(f"--checkpoint-dir: {source} holds no committed round")
    if not out.endswith(".png"):
        raise UsageError(f"--out: {out} must end in .png")
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plot: needs matplotlib (pip install 'gonka-node[plot]')") from None
    matplotlib.use("Agg")
    draw(records, out)
    print(out)
    return EXIT_OK


def throughput(records: list[dict]) -> list[tuple[int, float]]:
    """(round, tokens/s) from one commit to the next: the round's tokens over the wall time."""
    out = []
    for before, after in zip(records, records[1:]):
        seconds = after["time"] - before["time"]
        if seconds > 0 and isinstance(after.get("tokens"), (int, float)):
            out.append((after["round"], after["tokens"] / seconds))
    return out


def draw(records: list[dict], out: str) -> None:
    import matplotlib.pyplot as plt

    from trainer.files import atomic_write

    rounds = [r["round"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for key, label in (("loss", "training loss"), ("eval_loss", "eval loss")):
        points = [(r["round"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            top.plot(*zip(*points), marker=".", label=label)
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    speed = throughput(records)
    if speed:
        bottom.plot(*zip(*speed), marker=".", color="tab:green")
    bottom.set_ylabel("tokens/s (this node)")
    bottom.set_xlabel("committed round")
    bottom.grid(alpha=0.3)
    fig.suptitle(f"rounds {rounds[0]}–{rounds[-1]}, last params_hash {str(records[-1].get('params_hash'))[:12]}")
    fig.tight_layout()
    try:
        atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)
