"""`gonka-node prepare-data`: tokenize text into the token shards the trainer reads.

Only argparse is imported here, so `gonka-node --help` stays instant; the
tokenizing pipeline (trainer/prepare.py: tokenizers, numpy, worker processes)
is imported when the command runs.
"""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Tokenize text with a Hugging Face tokenizer into a dataset directory of
memory-mapped token shards, for `gonka-node start --data DIR`.

Inputs: plain text files (one document each), directories (read recursively,
in sorted order), and .jsonl files (one JSON object per line, the document
under --text-key). The tokenizer's end-of-sequence token follows every
document. The output is the same whatever --workers is, and appears only when
complete: it is written next to DIR and renamed into place at the end.
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add the `prepare-data` subcommand to ``commands`` (gonka-node's subparsers)."""
    # The defaults below are PrepareConfig's (trainer/prepare.py); a test keeps them in step.
    parser = commands.add_parser(
        "prepare-data",
        help="tokenize text files into token shards to train on",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", metavar="INPUT", nargs="+", help="text file, directory of text files, or .jsonl file")
    parser.add_argument("--tokenizer", metavar="PATH", required=True, help="Hugging Face tokenizer directory (with tokenizer.json), e.g. the model's directory")
    parser.add_argument("--out", metavar="DIR", required=True, help="dataset directory to create; must not exist or be empty")
    parser.add_argument("--text-key", metavar="KEY", help="key of the document text in .jsonl objects (default: text)")
    parser.add_argument("--workers", metavar="N", type=_positive_int, help="tokenizing processes (default: the number of CPUs, at most 8)")
    parser.add_argument("--shard-tokens", metavar="N", type=_positive_int, help="tokens per shard file; the last holds the rest (default: 100000000)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    """Run `prepare-data`; bad input raises UsageError (one line, exit code 2)."""
    from node.errors import UsageError
    from trainer.prepare import InputError, PrepareConfig, prepare_dataset

    given = {
        "text_key": args.text_key,
        "workers": args.workers,
        "shard_tokens": args.shard_tokens,
    }
    try:
        config = PrepareConfig(
            tokenizer=args.tokenizer,
            out=args.out,
            inputs=list(args.inputs),
            progress=not args.no_progress,
            **{key: value for key, value in given.items() if value is not None},
        )
        summary = prepare_dataset(config)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    print(
        f"{summary.path}: {summary.documents} documents, {summary.total_tokens} tokens "
        f"in {len(summary.shards)} shards ({summary.dtype})"
    )
    return 0
