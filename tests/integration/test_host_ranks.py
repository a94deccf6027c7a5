"""Multi-rank hosts: two hosts of two CPU ranks each (gloo, FSDP2) train one swarm.

Each host is one peer (one id, one heartbeat, one p2pd) whose ranks reduce their own shards
with the matching ranks of the other host; a round commits for every shard or none, and both
hosts end every round on one params_hash over the whole model. A host stopped with SIGTERM
writes every rank's part of a final checkpoint and restarts from it on the common hash. A
rank SIGKILLed mid-round takes its host out (the launcher stops the other rank, nothing is
left running) without the other host committing anything alone. A checkpoint with a part
missing is refused at start-up.

The hosts train in different memory modes (trainer/memory.py), which are local choices: one
with its parameters, gradients and AdamW state under FSDP2's CPU offload (its last checkpoint
exports), one with bf16 parameters, 8-bit AdamW state and a chunked loss (it resumes from its
checkpoint, 8-bit state included, and its checkpoint exports), one with bf16 parameters and
moments (it joins by download); all commit the same rounds on one params_hash.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.nodes import BIN, BOUND, STEP_ENV, alive, children_of, commit_times, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOST = ["--nproc-per-node", "2", "--device", "cpu", "--inner-steps", "3"]
OFFLOADED = ["--set", "inner.offload=all"]
LOW_BITS = ["--set", "inner.param_dtype=bf16", "--set", "inner.optimizer_state=8bit", "--set", "inner.loss_chunk=40"]
BF16 = ["--set", "inner.param_dtype=bf16"]
# A step of two CPU ranks (FSDP2 or DDP over gloo) costs ~0.15 CPU-s; each also waits this long,
# as on accelerators, so three hosts of two ranks leave the machine's cores to the rest of the
# test (the export, the hosts starting) and to the suite's other processes.
STEP_SECONDS = "0.3"


@pytest.fixture
def hosts(nodes):
    """``nodes``, for hosts whose steps wait ``STEP_SECONDS``."""
    def start(name: str, *args: str):
        return nodes(name, *args, env={STEP_ENV: STEP_SECONDS})
    return start


def rank_pids(node) -> dict[int, int]:
    """rank -> pid of the host's rank processes (torch.distributed.run sets RANK)."""
    found = {}
    for pid in children_of(node.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("python") or comm.startswith("gonka"):
            for item in env:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = pid
    node.known_children.update(children_of(node.pid))
    return found


def live_status(node) -> dict:
    out = subprocess.run([str(BIN), "status", "--control", node.control, "--json"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_export(out: Path, parts: list[Path]) -> None:
    """Each tensor of the exported weights is the ranks' shards end to end, under the name
    transformers gives that parameter (the export checked the names and shapes against the model
    transformers builds from its config; tests/integration/test_hf_run.py loads an export)."""
    import torch
    from safetensors.torch import load_file

    from trainer.checkpoint import load_tensors
    from trainer.presets import PresetLlama

    weights = load_file(out / "model.safetensors")
    names = [name for name, _ in PresetLlama("tiny").named_parameters()]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    shards = [load_tensors(p)["worker"]["global_params"] for p in parts]
    assert sorted(weights) == sorted(names) and len(names) == len(shards[0])
    for i, name in enumerate(names):
        assert torch.equal(weights[name], torch.cat([s[i] for s in shards])), name


def host_parts(directory: Path) -> list[Path]:
    return sorted(directory.glob("host-*/rank*.pt"))


def stopped_checkpoint(ckpt: Path, copy: Path) -> list[Path]:
    """The parts of the one host checkpoint a stopped host left in ``ckpt``, copied to ``copy``
    (the host restarts from ``ckpt`` and writes new ones there while its export is checked)."""
    parts = host_parts(ckpt)
    assert [p.name for p in parts] == ["rank0.pt", "rank1.pt"] and len({p.parent for p in parts}) == 1, parts
    shutil.copytree(ckpt, copy)
    return host_parts(copy)


def export_and_check(parts: list[Path], out: Path) -> None:
    """`gonka-node export` of the checkpoint holding ``parts``, then ``check_export``."""
    done = subprocess.run([str(BIN), "export", "--checkpoint-dir", str(parts[0].parent.parent), "--out", str(out),
                           "--dtype", "fp32"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check_export(out, parts)


def test_two_hosts_of_two_ranks_train_restart_from_their_checkpoint_and_lose_a_rank(hosts, tmp_path):
    ckpt = tmp_path / "b-ckpt"
    b_args = [*HOST, *LOW_BITS, "--min-peers", "2", "--checkpoint-dir", str(ckpt), "--identity",
              str(tmp_path / "b.key")]
    a = hosts("a", *HOST, *OFFLOADED, "--min-peers", "2", "--checkpoint-dir", str(tmp_path / "a-ckpt"))
    b = hosts("b", *b_args, "--bootstrap", a.address())
    for n in (a, b):
        n.wait_round(2, timeout=240)
    ra, rb = a.rounds(), b.rounds()
    common = sorted(set(ra) & set(rb))
    assert len(common) >= 2
    assert all(ra[r] == rb[r] for r in common), (ra, rb)
    assert len(set(ra[r] for r in common)) == len(common)  # the model moves every round
    assert "members=2" in a.log() and "layout=fsdpx2" in a.log()
    # One peer per host: each table holds the other host and nobody else; one p2pd per host.
    assert a.status()["peers"] == 2 and b.status()["peers"] == 2
    ranks = rank_pids(b)
    assert sorted(ranks) == [0, 1], ranks
    assert len([p for p in children_of(b.pid) if Path(f"/proc/{p}/comm").read_text().strip() == "p2pd"]) == 1

    # SIGTERM: b's ranks write their parts of a final checkpoint and stop; nothing is left.
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait_exit(90) == 0, b.log()[-3000:]
    wait_until(lambda: not any(alive(p) for p in b.known_children), 30, "b's ranks and p2pd to be gone")
    parts = stopped_checkpoint(ckpt, tmp_path / "b-stopped")
    stopped_at = max(b.rounds())

    # b restarts from its sharded checkpoint; a waited for it (min-peers 2) and both go on as one.
    # A third 2-rank host joins meanwhile: each of its ranks downloads its shard from the donors'
    # matching ranks (every shard checked against rank 0's certified list), then trains with them.
    b2 = hosts("b2", *b_args, "--bootstrap", a.address())
    c = hosts("c", *HOST, *BF16, "--min-peers", "2", "--bootstrap", a.address())
    # While they start: the sharded checkpoint exports as one Hugging Face model, joined tensor
    # by tensor.
    export_and_check(parts, tmp_path / "export")
    for n in (a, b2):
        n.wait_round(stopped_at + 1, timeout=240)
    assert f"resumed from {ckpt} at round {stopped_at}" in b2.log(), b2.log()[-3000:]
    ra, rb = a.rounds(), b2.rounds()
    after = [r for r in rb if stopped_at < r <= max(ra)]
    assert after and all(ra.get(r) == rb[r] for r in after), (ra, rb)
    wait_until(lambda: "resynced round=" in c.log() or c.proc.poll() is not None, 180, "c to download the state")
    wait_until(lambda: "members=3" in c.log() or c.proc.poll() is not None, 180, "c to commit a round with a and b")
    assert c.proc.poll() is None, c.log()[-3000:]
    rc = c.rounds()
    assert all(a.rounds().get(r, h) == h for r, h in rc.items()), (a.rounds(), rc)
    assert live_status(a)["peers"] == 3  # three hosts, three peers

    # Rank 1 of b dies mid-round: b's launcher stops its rank 0 and exits non-zero, nothing of b
    # is left, and a and c commit without it within the documented bound.
    ranks = rank_pids(b2)
    at = max(b2.rounds())
    wait_until(lambda: re.search(rf"trained round={at + 1} ", b2.log()), 120, "b to train its next round")
    killed = time.time()
    os.kill(ranks[1], signal.SIGKILL)
    assert b2.wait_exit(90) == 1
    assert "rank 1 of this host was killed by SIGKILL" in b2.log(), b2.log()[-3000:]
    wait_until(lambda: not any(alive(p) for p in b2.known_children), 30, "b's ranks and p2pd to be gone")
    last = max(b2.rounds())
    for n in (a, c):
        n.wait_round(last + 1, timeout=BOUND + 60)
    after = [t for t, r in commit_times(a) if r > last]
    assert after and after[0] - killed <= BOUND + 15, (after[:1], killed)
    ra, rc = a.rounds(), c.rounds()
    assert all(ra[r] == rc[r] for r in set(ra) & set(rc) if r > last)

    # A sharded checkpoint with a part missing is refused at start-up: one line, exit 2. (A part
    # that b wrote of a checkpoint it did not finish, if any, is not the one in use.)
    pointer = json.loads((ckpt / "latest-host.json").read_text())
    (ckpt / f"host-{pointer['seq']:010d}" / "rank1.pt").unlink()
    b3 = hosts("b3", *b_args)
    assert b3.wait_exit(120) == 2
    assert "the part of rank 1 is missing" in b3.log() and "Traceback" not in b3.log(), b3.log()[-3000:]

    # SIGTERM to a host's launcher reaches rank 0, which stops its ranks.
    for n in (a, c):
        rank_pids(n)
        n.proc.send_signal(signal.SIGTERM)
    for n in (a, c):
        assert n.wait_exit(60) == 0, n.log()[-3000:]
        wait_until(lambda: not any(alive(p) for p in n.known_children), 30, f"{n.name}'s ranks and p2pd to be gone")
    # The offloaded host's final checkpoint exports as the same model, shard by shard.
    export_and_check(stopped_checkpoint(tmp_path / "a-ckpt", tmp_path / "a-stopped"), tmp_path / "export-a")


def test_two_hosts_of_two_ddp_ranks_train_restart_and_take_a_joiner_on_one_hash(hosts, tmp_path):
    """--parallel ddp: every rank a whole replica, each syncing FSDP2's rows of it; the hosts
    commit the same rounds on one params_hash. With int8 and error feedback, as a host of a
    large model runs: each rank's round works in place over its residual's vector (p2p/group.py,
    Group.in_place). Eager overlap: every rank trains the next round while its shard is
    averaged, and all ranks land the average at one step. Whatever loads a state or lands an
    average into a DDP replica ends in a collective of every rank, which the ranks reach
    together: a host restarted from its sharded checkpoint, a host that joins and downloads the
    state, checkpoints taken with an average still to land. The hosts' memory modes differ."""
    ckpt = tmp_path / "b-ckpt"
    ddp = [*HOST, "--parallel", "ddp", "--min-peers", "2", "--set", "swarm.codec=int8", "--overlap", "eager"]
    # b: bf16 replicas (cast before DDP sees them) with a chunked loss; c: 8-bit AdamW state.
    b_args = [*ddp, *BF16, "--set", "inner.loss_chunk=40", "--checkpoint-dir", str(ckpt), "--identity",
              str(tmp_path / "b.key")]
    a = hosts("a", *ddp)
    b = hosts("b", *b_args, "--bootstrap", a.address())
    for n in (a, b):
        n.wait_round(2, timeout=240)
        assert sorted(rank_pids(n)) == [0, 1]
    assert "members=2" in a.log() and "layout=ddpx2" in a.log()
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait_exit(90) == 0, b.log()[-3000:]
    wait_until(lambda: not any(alive(p) for p in b.known_children), 30, "b's ranks and p2pd to be gone")
    stopped_at = max(b.rounds())
    parts = stopped_checkpoint(ckpt, tmp_path / "b-stopped")

    # b resumes from its checkpoint (every rank loads its part at once) and c joins: each of its
    # ranks downloads its shard, and all load them at once.
    b2 = hosts("b2", *b_args, "--bootstrap", a.address())
    c = hosts("c", *ddp, "--set", "inner.optimizer_state=8bit", "--bootstrap", a.address())
    # Meanwhile: each rank's checkpoint part holds its own rows of θ; the export joins them.
    export_and_check(parts, tmp_path / "export")
    wait_until(lambda: "resynced round=" in c.log() or c.proc.poll() is not None, 180, "c to download the state")
    for n in (b2, c):
        wait_until(lambda: "members=3" in n.log() or n.proc.poll() is not None, 180, f"{n.name} to commit with all")
        assert n.proc.poll() is None, n.log()[-3000:]
    assert f"resumed from {ckpt} at round {stopped_at}" in b2.log(), b2.log()[-3000:]
    for n in (a, b2, c):
        rank_pids(n)
        n.proc.send_signal(signal.SIGTERM)
    for n in (a, b2, c):
        assert n.wait_exit(90) == 0, n.log()[-3000:]
        wait_until(lambda: not any(alive(p) for p in n.known_children), 30, f"{n.name}'s ranks and p2pd to be gone")
    by_round: dict[int, set[str]] = {}
    for n in (a, b, b2, c):
        for r, h in n.rounds().items():
            by_round.setdefault(r, set()).add(h)
    assert all(len(hashes) == 1 for hashes in by_round.values()), by_round
