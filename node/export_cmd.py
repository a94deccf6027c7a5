"""`gonka-node export`: the swarm's model as a Hugging Face directory, from a node's checkpoint.

This file is the command-line face of trainer/export.py: flags, their
parsing, and what is printed. It imports torch and transformers only when the
command runs, so `gonka-node --help` stays instant.
"""

from __future__ import annotations

import argparse
import re

# Units of --max-shard-size, as transformers spells them (KB = 1000, KiB = 1024).
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

EPILOG = """\
The export reads the last complete checkpoint, so it can run while the node
trains. The result loads offline:
  AutoModelForCausalLM.from_pretrained(OUT, local_files_only=True)
"""


def parse_size(text: str) -> int:
    """'5GB', '500MiB' or plain bytes '4096' as a number of bytes (at least 1)."""
    match = _SIZE.match(text)
    unit = match and _UNITS.get(match.group(2).upper())
    size = int(float(match.group(1)) * unit) if unit else 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 500MiB or 4096 (bytes), got {text!r}")
    return size


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `export` with the `gonka-node` subcommands."""
    export = commands.add_parser(
        "export",
        help="write the swarm's model as a Hugging Face directory",
        description="Write the global parameters of a node's last checkpoint (DIR/latest.pt, or a\n"
                    "multi-rank host's DIR/latest-host.json and every rank's part, joined tensor by\n"
                    "tensor) as a Hugging Face model directory: config.json, safetensors weights and\n"
                    "the run's tokenizer files.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("--checkpoint-dir", metavar="DIR", required=True,
                        help="the node's --checkpoint-dir")
    export.add_argument("--out", metavar="DIR", required=True,
                        help="directory to create; must not exist or be empty")
    export.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="precision of the written weights (default: bf16)")
    export.add_argument("--max-shard-size", metavar="SIZE", type=parse_size, default="5GB",
                        help="largest weights file, e.g. 5GB or 500MiB; more weights are split into shards with "
                             "an index, as transformers does (default: 5GB)")


def run(args: argparse.Namespace) -> int:
    from node.errors import UsageError
    from trainer.export import export_checkpoint

    try:
        result = export_checkpoint(args.checkpoint_dir, args.out, dtype=args.dtype,
                                   max_shard_bytes=args.max_shard_size)
    except ValueError as exc:
        # trainer/export.py says what of the user's input is wrong as "export: PATH: ...";
        # any other ValueError is a fault of the program and propagates.
        if not str(exc).startswith("export: "):
            raise
        raise UsageError(str(exc)) from None
    print(f"exported run {result.run_id!r} round {result.round}: {result.parameters:,} parameters, "
          f"{result.dtype}, {result.bytes / 1e6:,.1f} MB of weights, to {result.out}")
    for name in result.files:
        print(f"  {name}")
    return 0
