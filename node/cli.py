"""The `gonka-node` command: start a node, ask a running one how it is doing.

Exit codes (node/errors.py): 0 success; 2 a bad flag, setting or path, reported
as one line on stderr naming it; 1 a runtime failure (no node answering, the
node failed) or a bug, with a traceback. Heavy imports (torch, hivemind, the
daemon) happen inside the subcommands, so `--help` and mistakes in flags answer
at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, NoReturn

from node import admit_cmd, export_cmd, ledger_cmd, logformat, plan_cmd, plot_cmd, prepare_cmd, top_cmd
from node.config import ConfigError, default_of, load_config, load_injection, setting_errors, to_toml
from node.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, PROG, UsageError, report, version


class ArgumentParser(argparse.ArgumentParser):
    # argparse prints the whole usage block and exits; one line naming the
    # bad flag is easier to read and to test.
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def shown_default(key: str) -> str:
    """A setting's built-in default as ``--help`` shows it: off/on, lists comma-separated."""
    value = default_of(key)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def _help(key: str, text: str) -> str:
    """``text`` with {default} replaced by the setting's default from its config class: the
    defaults are written once, in the dataclasses, never again in a help string."""
    return text.replace("{default}", shown_default(key).replace("%", "%%"))


# (flag, config key, argparse options) of `gonka-node start`. Flags left out
# keep the value from the lower layers (config file, environment). "{default}"
# in a help text is the key's default (a setting whose default is empty says in
# words what that means instead).
START_FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("--run-id", "node.run_id", dict(metavar="NAME", help="name of the training run; peers train together only within one run id (default: {default})")),
    ("--bootstrap", "swarm.bootstrap", dict(metavar="MULTIADDR", action="append", help="multiaddr of a running peer to join through, e.g. /ip4/10.0.0.5/tcp/31337/p2p/12D3...; repeat for several (default: none, start a new swarm)")),
    ("--listen", "swarm.listen", dict(metavar="MULTIADDR", action="append", help="multiaddr to listen on; repeat for several (default: {default}, loopback only; use e.g. /ip4/0.0.0.0/tcp/31337 on a real host)")),
    ("--announce", "swarm.announce", dict(metavar="MULTIADDR", action="append", help="multiaddr other peers should dial, with an explicit port, e.g. your public address; repeat for several (default: the listen addresses as bound)")),
    ("--identity", "node.identity", dict(metavar="PATH", help="libp2p private key file, created on first start and never overwritten, so the peer id survives restarts (default: a new ephemeral identity each start)")),
    ("--data", "data.paths", dict(metavar="PATH", action="append", help="a directory written by `gonka-node prepare-data` (token shards), or text files and directories read as bytes for the byte-level presets; repeat for several text paths (default: the built-in byte corpus)")),
    ("--model", "model.source", dict(metavar="PRESET|hf:PATH", help="a built-in preset (tiny, small, base), or hf:PATH, a local Hugging Face model directory (config.json, *.safetensors, tokenizer); see model.init (default: {default})")),
    ("--inner-steps", "inner.steps", dict(metavar="H", type=int, help="local optimizer steps between two outer synchronisations (default: {default})")),
    ("--max-rounds", "node.max_rounds", dict(metavar="N", type=int, help="stop after N committed outer rounds; 0 = train until stopped (default: {default})")),
    ("--checkpoint-dir", "node.checkpoint_dir", dict(metavar="DIR", help="directory for checkpoints; a restart resumes from the latest (default: no checkpoints)")),
    ("--metrics-addr", "node.metrics_addr", dict(metavar="HOST:PORT|off", help="serve Prometheus metrics at http://HOST:PORT/metrics, or 'off' (default: {default})")),
    ("--control", "node.control", dict(metavar="PATH|off", help="unix socket for `gonka-node status` and `peers`, or 'off' (default: $XDG_RUNTIME_DIR/gonka-node/RUN_ID.sock, else /tmp/gonka-node-UID/RUN_ID.sock)")),
    ("--status-file", "node.status_file", dict(metavar="PATH", help="file rewritten with the node's status as JSON (default: none)")),
    ("--device", "node.device", dict(metavar="cpu|cuda|cuda:N|auto", help="where the model trains; auto = cuda when available (default: {default})")),
    ("--seed", "node.seed", dict(metavar="N", type=int, help="seed of model initialisation and data order (default: {default})")),
    ("--overlap", "outer.overlap", dict(metavar="MODE", help="off, delayed or eager: run a round's all-reduce during the next round's inner steps (default: {default})")),
    ("--min-peers", "swarm.min_peers", dict(metavar="N", type=int, help="a round commits only with at least N members, this peer included (default: {default})")),
    ("--allow", "swarm.allow", dict(metavar="PEERID", action="append", help="closed swarm: admit this peer id; repeat for several (default: an open swarm)")),
    ("--allow-file", "swarm.allow_file", dict(metavar="FILE", help="closed swarm: admit the peer ids in FILE, one per line; re-read when it changes")),
    ("--swarm-authority", "swarm.authority", dict(metavar="PUBKEY", help="closed swarm: admit peers holding a membership certificate signed by this operator key (see `gonka-node admit`)")),
    ("--member-cert", "swarm.member_cert", dict(metavar="FILE", help="this node's membership certificate for a swarm with --swarm-authority")),
    ("--aggregator", "swarm.aggregator", dict(metavar="NAME", help="how a part owner combines pseudo-gradients: mean, clip or centered_clip (default: {default})")),
    ("--nat-traversal", "swarm.nat_traversal", dict(action="store_true", help="enable UPnP port mapping, AutoNAT and circuit relays in libp2p (default: {default}; the node talks only to the addresses it is given)")),
    ("--log-level", "node.log_level", dict(metavar="LEVEL", help="debug, info, warning or error (default: {default})")),
    ("--log-format", "node.log_format", dict(metavar="FORMAT", help="text, or json: one JSON object per line (time, level, logger, message) for log shippers (default: {default})")),
    ("--nproc-per-node", "host.nproc_per_node", dict(metavar="N", type=int, help="train on N local ranks under torch.distributed.run: one per GPU (NCCL), or N CPU processes (gloo); one peer id for the host (default: {default}, the node's own process)")),
    ("--parallel", "host.parallel", dict(metavar="MODE", help="with --nproc-per-node > 1: fsdp (FSDP2, each rank holds 1/N of the model) or ddp (a replica per rank) (default: {default})")),
    ("--param-dtype", "inner.param_dtype", dict(metavar="fp32|bf16", help="the local copy's parameters and gradients; bf16 rounds AdamW's updates stochastically (default: {default})")),
    ("--optimizer-state", "inner.optimizer_state", dict(metavar="MODE", help="AdamW's moments: auto (the parameters' dtype), fp32, bf16 or 8bit (default: {default})")),
    ("--offload", "inner.offload", dict(metavar="MODE", help="none, optimizer (AdamW state and step on the CPU, one GPU) or all (FSDP2 CPU offload of parameters, gradients and state) (default: {default})")),
    ("--loss-chunk", "inner.loss_chunk", dict(metavar="TOKENS", type=int, help="compute the loss this many tokens at a time, never the whole batch's logits; 0 = at once (default: {default})")),
    ("--threads", "node.threads", dict(metavar="N", type=int, help="torch intra-op threads; 0 = torch's default (default: {default})")),
]

START_EPILOG = """\
Settings are taken from, lowest to highest precedence: built-in defaults, the
--config file, GONKA_<SECTION>_<KEY> environment variables (e.g.
GONKA_INNER_STEPS=20, GONKA_SWARM_BOOTSTRAP=addr1,addr2), then --set, then the
flags above. A repeated flag replaces the whole list from the lower layers.
Every setting and its value: gonka-node start --print-config.
"""


def _control_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--control", metavar="PATH", help="control socket of the node (default: the default path for --run-id)")
    parser.add_argument("--run-id", metavar="NAME", help=_help("node.run_id", "run id of the node, to find its default control socket (default: {default})"))
    parser.add_argument("--json", action="store_true", help="print the node's answer as JSON")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Peer-to-peer DiLoCo training daemon: hosts train one language model together over the internet, with no central server.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    start = commands.add_parser(
        "start",
        help="start a node and train until stopped",
        description="Start a node: join the swarm (or start one) and train until stopped (SIGINT/SIGTERM) or --max-rounds.",
        epilog=START_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    start.add_argument("--config", metavar="FILE.toml", help="TOML file with one table per section ([node], [swarm], [model], [data], [inner], [outer])")
    for flag, key, options in START_FLAGS:
        start.add_argument(flag, **dict(options, help=_help(key, options["help"])))
    start.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", help="set any setting, e.g. --set inner.lr=3e-4 or --set swarm.listen=addr1,addr2 (lists comma-separated); repeatable")
    start.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")

    status = commands.add_parser("status", help="show a running node's status", description="Ask a running node on this host for its status.")
    _control_args(status)
    peers = commands.add_parser("peers", help="list the swarm peers a running node sees", description="Ask a running node on this host which swarm peers it sees.")
    _control_args(peers)

    identity = commands.add_parser("identity", help="print the peer id of an identity key file", description="Print the peer id of an identity key file, creating the file if it does not exist.")
    identity.add_argument("--identity", metavar="PATH", help="key file (default: generate an ephemeral key and print its peer id)")

    commands.add_parser("version", help="print the version", description="Print the version of gonka-node.")
    prepare_cmd.add_parser(commands)
    export_cmd.add_parser(commands)
    admit_cmd.add_parser(commands)
    plot_cmd.add_parser(commands)
    plan_cmd.add_parser(commands)
    ledger_cmd.add_parser(commands)
    top_cmd.add_parser(commands, _control_args)
    return parser


def _start_overrides(args: argparse.Namespace) -> tuple[dict[str, object], dict[str, str]]:
    """Config overrides from the flags given, and which flag set each key."""
    overrides: dict[str, object] = {}
    flag_of: dict[str, str] = {}
    for item in getattr(args, "set", []):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"argument --set: expected SECTION.KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value
        flag_of[key.strip()] = "--set"
    # Named flags win over --set: they are the more specific request.
    for flag, key, _ in START_FLAGS:
        dest = flag.lstrip("-").replace("-", "_")
        if hasattr(args, dest):
            overrides[key] = getattr(args, dest)
            flag_of[key] = flag
    return overrides, flag_of


def _cmd_start(args: argparse.Namespace) -> int:
    overrides, flag_of = _start_overrides(args)
    try:
        config = load_config(toml_path=getattr(args, "config", None), environ=os.environ, overrides=overrides)
    except ConfigError as exc:
        message = str(exc)
        if exc.key in flag_of and "(from " not in message:
            raise ConfigError(f"{message} (from {flag_of[exc.key]})", exc.key) from None
        raise
    injection = load_injection(os.environ)  # GONKA_TEST_* (tests only): read here and nowhere else
    if getattr(args, "print_config", False):
        sys.stdout.write(to_toml(config))
        return EXIT_OK
    logformat.configure(config.node.log_level, config.node.log_format)
    _check_memory_modes(config)  # a mode this host cannot run: ConfigError, exit code 2, nothing loaded
    if config.host.nproc_per_node > 1:
        from trainer.parallel import launched

        if not launched():  # this process becomes the host's launcher; the ranks run start again
            from node.launch import check_host, launch_host

            check_host(config)  # a bad host setting: ConfigError, exit code 2
            return launch_host(config, args.argv)
        if int(os.environ["RANK"]) > 0:
            from node.follower import run_follower

            return run_follower(config, injection)
    from node.daemon import run_node

    try:
        return run_node(config, injection)  # reports the user's bad input itself (exit code 2)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # a fault, not bad input: with its traceback
        logging.getLogger(PROG).exception("node failed")
        report(str(exc) or type(exc).__name__)
        return EXIT_RUNTIME


def _check_memory_modes(config) -> None:
    import torch

    from trainer.memory import check_modes

    device = config.node.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with setting_errors():
        check_modes(config.inner, config.host, device)
        from trainer.plan import fit_error

        reason = fit_error(config, device)  # the model's own state alone does not fit this host
        if reason is not None:
            raise ValueError(reason)


def _control_path(args: argparse.Namespace) -> str:
    if args.control:
        return args.control
    # Same resolution as `start`: honours GONKA_NODE_CONTROL / GONKA_NODE_RUN_ID.
    overrides: dict[str, object] = {}
    if args.run_id is not None:
        overrides["node.run_id"] = args.run_id
    config = load_config(toml_path=None, environ=os.environ, overrides=overrides)
    path = config.node.control_path()
    if path is None:
        raise ConfigError("node.control: is 'off'; pass --control PATH")
    return path


def _ask(args: argparse.Namespace, cmd: str) -> Any:
    from node.control import request

    return request(_control_path(args), cmd)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list):
        return ", ".join(str(item) for item in value) or "-"
    return str(value)


STATUS_FIELDS = ("peer_id", "run_id", "state", "round", "inner_step", "loss", "peers", "params_hash", "multiaddrs")


def _cmd_status(args: argparse.Namespace) -> int:
    status = _ask(args, "status")
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return EXIT_OK
    if not isinstance(status, dict):
        raise RuntimeError(f"unexpected status reply: {status!r}")
    # The listed fields first, in a fixed order; whatever else the node
    # reports after them.
    keys = list(STATUS_FIELDS) + sorted(k for k in status if k not in STATUS_FIELDS)
    width = max(len(k) for k in keys)
    for key in keys:
        print(f"{key.replace('_', ' '):<{width}}  {_fmt(status.get(key))}")
    return EXIT_OK


PEER_COLUMNS = ("peer_id", "state", "round", "params_hash")


def _cmd_peers(args: argparse.Namespace) -> int:
    peers = _ask(args, "peers")
    if args.json:
        print(json.dumps(peers, indent=2, sort_keys=True))
        return EXIT_OK
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise RuntimeError(f"unexpected peers reply: {peers!r}")
    columns = list(PEER_COLUMNS)
    for peer in peers:
        columns += [k for k in peer if k not in columns]
    rows = [[c.upper() for c in columns]] + [[_fmt(p.get(c)) for c in columns] for p in peers]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return EXIT_OK


def _cmd_identity(args: argparse.Namespace) -> int:
    from p2p.identity import generate_identity, load_or_create_identity, peer_id_from_key

    if args.identity:
        with setting_errors():  # a corrupt or unreadable key file: node.identity, exit code 2
            peer_id = load_or_create_identity(args.identity)
        print(peer_id)
    else:
        print(peer_id_from_key(generate_identity()))
        print(f"{PROG}: this identity is ephemeral (not saved); pass --identity PATH to keep one", file=sys.stderr)
    return EXIT_OK


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"{PROG} {version()}")
    return EXIT_OK


COMMANDS = {
    "start": _cmd_start,
    "status": _cmd_status,
    "peers": _cmd_peers,
    "identity": _cmd_identity,
    "version": _cmd_version,
    "prepare-data": prepare_cmd.run,
    "export": export_cmd.run,
    "admit": admit_cmd.run,
    "plot": plot_cmd.run,
    "plan": plan_cmd.run,
    "ledger": ledger_cmd.run,
    "top": lambda args: top_cmd.run(args, lambda cmd: _ask(args, cmd)),
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what a host's ranks run again
        return COMMANDS[args.command](args)
    except UsageError as exc:  # ConfigError too; nothing else is the user's input
        report(str(exc))
        return EXIT_USAGE
    except BrokenPipeError:
        # Output piped into something that stopped reading (`| head`): not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (ConnectionError, RuntimeError) as exc:
        report(str(exc))
        return EXIT_RUNTIME


if __name__ == "__main__":
    raise SystemExit(main())
