"""`gonka-node plan`: what a run needs, per memory mode, before it starts (trainer/plan.py).

The model is read from its config and built on the meta device (no weights are read); the
run's settings come from the node's own config file and `--set`, then the flags. Prints per GPU
and per host memory, bytes and seconds per round, utilization with and without overlap, which
modes fit and the one recommended; `--json` for scripts.
"""

from __future__ import annotations

import argparse
import json
import re

from node.export_cmd import parse_size

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g|t)?(bit|bps|b)?(?:/s)?\s*$", re.IGNORECASE)
_RATE_UNITS = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """'1gbit', '100mbit', '250Mbit/s' or plain bits per second, as bits per second."""
    match = _RATE.match(text)
    if not match or (match.group(3) or "bit").lower() not in ("bit", "bps"):
        raise argparse.ArgumentTypeError(f"expected a link rate such as 1gbit or 100mbit, got {text!r}")
    rate = float(match.group(1)) * _RATE_UNITS[(match.group(2) or "").lower() or None]
    if rate <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive link rate, got {text!r}")
    return rate


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def add_parser(commands: argparse._SubParsersAction) -> None:
    from trainer.plan import GPUS

    plan = commands.add_parser(
        "plan", help="say what a run needs and which memory modes fit, before it starts",
        description="Per GPU and per host memory, bytes and time per round, and utilization of each inner-loop\n"
                    "memory mode, from the model's config (built on the meta device: no weights read) and the\n"
                    "node's settings; marks the modes that fit and the one recommended.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--config", metavar="FILE", help="the node's TOML config: its model, data, inner, swarm and host "
                      "settings are the plan's defaults")
    plan.add_argument("--set", dest="settings", metavar="KEY=VALUE", action="append", default=[],
                      help="a setting, as `gonka-node start --set` takes it; repeat for several")
    plan.add_argument("--model", metavar="PRESET|hf:PATH", help="the model (default: the config's model.source)")
    plan.add_argument("--nproc-per-node", type=_positive(int), metavar="N", help="ranks (GPUs) per host "
                      "(default: host.nproc_per_node, or 8 with --gpu)")
    plan.add_argument("--gpu", choices=(*GPUS, "cpu"), default="h100",
                      help="the hosts' accelerator: its memory and bf16 peak (default: h100); cpu = CPU ranks")
    plan.add_argument("--gpu-memory", type=parse_size, metavar="SIZE", help="memory per GPU, e.g. 80GiB")
    plan.add_argument("--host-memory", type=parse_size, metavar="SIZE", default="1536GiB",
                      help="host RAM, e.g. 1.5TiB (default: 1536GiB)")
    plan.add_argument("--link", type=parse_rate, metavar="RATE", default="1gbit",
                      help="each host's link, each way, e.g. 1gbit or 100mbit (default: 1gbit)")
    plan.add_argument("--rtt", type=_positive(float), metavar="MS", default=100.0,
                      help="round-trip time between hosts in ms (default: 100)")
    plan.add_argument("--peers", type=_positive(int), metavar="M", default=8, help="hosts in a round (default: 8)")
    plan.add_argument("--batch-size", type=_positive(int), metavar="B", help="sequences per rank per step "
                      "(default: data.batch_size)")
    plan.add_argument("--seq-len", type=_positive(int), metavar="T", help="tokens per sequence (default: data.seq_len, "
                      "or the model's context)")
    plan.add_argument("--inner-steps", type=_positive(int), metavar="H", help="H (default: inner.steps)")
    plan.add_argument("--codec", help="the swarm's codec (default: swarm.codec)")
    plan.add_argument("--loss-chunk", type=int, metavar="TOKENS", help="default: inner.loss_chunk")
    plan.add_argument("--mfu", type=_positive(float), default=0.4,
                      help="model FLOPs utilization the step time assumes (default: 0.4)")
    plan.add_argument("--json", action="store_true", help="the plan as one JSON object")


def build(args: argparse.Namespace):
    """The plan ``args`` ask for (UsageError for bad input)."""
    import os

    from node.config import load_config, setting_errors
    from node.errors import UsageError
    from p2p.codecs import CODECS
    from trainer.plan import GPUS, Hardware, Run, plan_run

    overrides = {}
    for item in args.settings:
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"--set: expected KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value
    config = load_config(toml_path=args.config, environ=os.environ, overrides=overrides)
    source = args.model or config.model.source
    cpu = args.gpu == "cpu"
    nproc = args.nproc_per_node or (config.host.nproc_per_node if cpu or config.host.nproc_per_node > 1 else 8)
    gpu = GPUS.get(args.gpu, dict(memory=0, tflops=1.0))
    codec = args.codec or config.swarm.codec
    if codec not in CODECS:
        raise UsageError(f"--codec: must be one of {', '.join(CODECS)} (got {codec!r})")
    loss_chunk = config.inner.loss_chunk if args.loss_chunk is None else args.loss_chunk
    if loss_chunk < 0:
        raise UsageError(f"--loss-chunk: must be >= 0 (got {loss_chunk})")
    hw = Hardware(device="cpu" if cpu else "cuda", gpu_memory=args.gpu_memory or gpu["memory"],
                  host_memory=args.host_memory, tflops=gpu["tflops"], mfu=args.mfu, nproc=nproc, link_bps=args.link,
                  rtt=args.rtt / 1000)
    with setting_errors():  # model.source: a path that is not a model directory, ...
        from trainer.config import ModelConfig

        ModelConfig(source=source)
        if source.startswith("hf:"):
            from trainer.model import read_hf_config

            read_hf_config(source[3:])
        from trainer.plan import model_shape

        shape = model_shape(source, nproc)
    seq_len = args.seq_len or config.data.seq_len or _context(source)
    run = Run(batch_size=args.batch_size or config.data.batch_size, seq_len=seq_len,
              inner_steps=args.inner_steps or config.inner.steps, peers=args.peers, codec=codec, loss_chunk=loss_chunk,
              catchup_rounds=config.swarm.catchup_rounds, state_on_disk=bool(config.outer.state_dir))
    return plan_run(source, hw, run, shape=shape)


def _context(source: str) -> int:
    from trainer.config import ModelConfig
    from trainer.model import preset_config, read_hf_config

    cfg = ModelConfig(source=source)
    if cfg.hf_path is None:
        return preset_config(source)["max_position_embeddings"]
    config = read_hf_config(cfg.hf_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None) or 2048


def run(args: argparse.Namespace) -> int:
    plan = build(args)
    if args.json:
        print(json.dumps(plan.as_dict(), indent=1))
        return 0
    print(render(plan))
    return 0


def _gib(value: float) -> str:
    return f"{value / 2**30:,.1f}"


def render(plan) -> str:
    """The plan as text: the model, one line per mode (with and without activation
    checkpointing), the sync per codec, the start."""
    s, hw, run = plan.shape, plan.hardware, plan.run
    where = f"{hw['nproc']} CPU ranks" if hw["device"] == "cpu" else \
        f"{hw['nproc']} GPUs of {_gib(hw['gpu_memory'])} GiB ({hw['tflops']:.0f} TFLOPS, MFU {hw['mfu']:.0%})"
    lines = [
        f"model {plan.model}: {s['architecture']}, {s['params'] / 1e9:,.2f}B parameters, {s['layers']} blocks; "
        f"the largest rank holds {s['rank_params'] / 1e9:,.2f}B",
        f"host: {where}, {_gib(hw['host_memory'])} GiB RAM, link {hw['link_bps'] / 1e6:,.0f} Mbit/s, "
        f"RTT {hw['rtt'] * 1000:.0f} ms; {run['peers']} hosts a round, codec {run['codec']}",
        f"step: {run['batch_size']} x {run['seq_len']} tokens per rank, H = {run['inner_steps']}, "
        f"loss chunk {run['loss_chunk'] or 'none'}",
        "",
        f"{'mode':27} {'ckpt':>4} {'GPU GiB':>8} {'host GiB':>9} {'fits':>4} {'step s':>7} {'util':>5} {'overlap':>7}",
    ]
    for m in plan.modes:
        mark = " <- recommended" if m.recommended else ("" if m.fits else f"  ({m.why_not})")
        lines.append(f"{m.mode:27} {'yes' if m.activation_checkpointing else 'no':>4} {_gib(m.gpu_total):>8} "
                     f"{_gib(m.host_total):>9} {'yes' if m.fits else 'no':>4} {m.step_seconds:7.2f} "
                     f"{m.utilization:5.0%} {m.utilization_overlapped:7.0%}{mark}")
    best = plan.recommended
    if best is not None:
        lines += ["", f"recommended: {best.mode}" + (", activation checkpointing" if best.activation_checkpointing
                                                    else "") + " -- per GPU:"]
        lines += [f"  {name.replace('_', ' '):28} {_gib(v):>8} GiB" for name, v in best.gpu.items()]
        lines += ["  per host:"]
        lines += [f"  {name.replace('_', ' '):28} {_gib(v):>8} GiB" for name, v in best.host.items()]
        lines += ["  settings: " + ", ".join(f"{k} = {v}" for k, v in best.settings.items())]
    else:
        lines += ["", "no mode fits: more GPUs per host (--nproc-per-node), a smaller batch or sequence, "
                      "or a host with more memory"]
    lines += ["", "per round, each host, each way:"]
    lines += [f"  {name:5} {v['bytes_per_peer'] / 1e9:10,.1f} GB  {v['seconds'] / 60:8,.1f} min"
              for name, v in plan.sync.items()]
    st = plan.start_seconds
    lines += ["", f"start: ~{st['total']:,.0f} s before the first step (weights read {st['read_weights']:,.0f} s, "
                  f"θ hashed {st['hash_theta']:,.0f} s)"]
    return "\n".join(lines)
