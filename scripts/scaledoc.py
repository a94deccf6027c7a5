#!/usr/bin/env python3
"""Write the part of docs/scale.md that `gonka-node plan` computes (between its plan markers).

    python scripts/scaledoc.py          # rewrite docs/scale.md
    python scripts/scaledoc.py --check  # exit 1 if docs/scale.md is not what plan says now

Llama-style 40B and 70B configs (written to a temporary directory: config.json only; the plan
reads no weights) on hosts of 8 x H100 80 GB and 8 x H200 141 GB, 1.5 TiB of RAM, 1 Gbit/s and
100 Mbit/s links, 8 hosts a round, one 4096-token sequence per GPU per step, H = 500, a loss
chunk of 2048 tokens, int8 with error feedback.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DOC = ROOT / "docs" / "scale.md"
BEGIN, END = "<!-- plan:begin (scripts/scaledoc.py writes this part) -->", "<!-- plan:end -->"
COMMON = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
              vocab_size=128256, max_position_embeddings=8192)
MODELS = {  # name -> (layers, tied embeddings)
    "40B": (46, True),
    "70B": (80, False),
}
RUN = dict(batch_size=1, seq_len=4096, inner_steps=500, peers=8, codec="int8", loss_chunk=2048)


def generate() -> str:
    from transformers import LlamaConfig

    from node.plan_cmd import render
    from trainer.plan import GiB, Hardware, Run, model_shape, plan_run

    out = [BEGIN, ""]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (layers, tied) in MODELS.items():
            path = Path(tmp) / name
            LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=tied, **COMMON).save_pretrained(path)
            source = f"hf:{path}"
            shape = model_shape(source, 8)
            for gpu, memory in (("H100 80 GB", 80), ("H200 141 GB", 141)):
                plan = plan_run(source, Hardware(gpu_memory=memory * GiB), Run(**RUN), shape=shape)
                text = render(plan).replace(source, f"Llama-style {name}")
                cmd = (f"gonka-node plan --model hf:llama-{name.lower()} --gpu {gpu.split()[0].lower()} "
                       f"--batch-size 1 --seq-len 4096 --inner-steps 500 --codec int8 --loss-chunk 2048")
                out += [f"### {name} on 8 × {gpu}", "", f"`{cmd}`", "", "```", text, "```", ""]
            best = plan_run(source, Hardware(), Run(**RUN), shape=shape).recommended
            if name == "70B" and best is not None:
                out += [f"### 70B on 8 × H100: utilization of the recommended mode by link and codec", "",
                        f"{best.mode}" + (", activation checkpointing" if best.activation_checkpointing else "") +
                        f"; a step {best.step_seconds:.2f} s, a round of H = 500 {best.round_compute_seconds / 60:.0f} "
                        "min of compute.", "",
                        "| link | codec | sync per round | overlap off | eager overlap |", "|---|---|---|---|---|"]
                for link, label in ((1e8, "100 Mbit/s"), (1e9, "1 Gbit/s")):
                    plan = plan_run(source, Hardware(link_bps=link), Run(**RUN), shape=shape)
                    compute = plan.recommended.round_compute_seconds
                    for codec, sync in plan.sync.items():
                        s = sync["seconds"]
                        out.append(f"| {label} | {codec} | {s / 60:,.1f} min | {compute / (compute + s):.0%} | "
                                   f"{min(1.0, compute / s):.0%} |")
                out.append("")
    out.append(END)
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/scale.md differs from the plan")
    args = parser.parse_args()
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC}: no plan markers", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    new = head + generate() + tail
    if args.check:
        if new != text:
            print(f"{DOC} is not what `gonka-node plan` says now: run python scripts/scaledoc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
