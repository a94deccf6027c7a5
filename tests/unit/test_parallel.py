"""A host's ranks in one process group: DDP replicas keep one model while each rank keeps the
outer state of its own rows only (trainer/parallel.py), the rows being FSDP2's."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from trainer.parallel import replica_slice, rows_of

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 64, 65])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_rows_are_fsdp2s_dim0_chunks(rows, world):
    chunks = torch.arange(rows).chunk(world)
    for rank in range(world):
        got = torch.arange(rows)[rows_of(rows, rank, world)]
        want = chunks[rank] if rank < len(chunks) else torch.arange(0)
        assert torch.equal(got, want), (rows, world, rank)
    # Every row is one rank's, in order: the export joins shards with torch.cat.
    assert torch.equal(torch.cat([torch.arange(rows)[rows_of(rows, r, world)] for r in range(world)]),
                       torch.arange(rows))


def test_a_replica_slice_writes_through():
    p = torch.nn.Parameter(torch.zeros(5, 3))
    replica_slice(p, 1, 2).fill_(1.0)
    assert p[3:].eq(1).all() and p[:3].eq(0).all()
    scalar = torch.nn.Parameter(torch.tensor(2.0))
    assert replica_slice(scalar, 0, 2).tolist() == [2.0] and replica_slice(scalar, 1, 2).numel() == 0


def _ddp(rank: int, world: int) -> dict:
    from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
    from trainer.data import default_corpus_paths, load_corpus
    from trainer.diloco import DiLoCoWorker
    from trainer.parallel import Ranks

    worker = DiLoCoWorker(model=ModelConfig(source="tiny"), data=DataConfig(batch_size=2, seq_len=32, eval_batches=1),
                          inner=InnerConfig(lr=1e-3, warmup_steps=1, total_steps=10), outer=OuterConfig(),
                          corpus=load_corpus(default_corpus_paths()[:5]), shard_key="host", seed=0,
                          ranks=Ranks(rank, world, "ddp", torch.device("cpu")))
    worker.inner_steps(2)
    trained = [p.detach().clone() for p in worker.model.parameters()]
    eval_loss = worker.eval_loss()  # of θ, put in the model and taken out again
    after_eval = [p.detach().clone() for p in worker.model.parameters()]
    delta = worker.pseudo_gradient()
    worker.apply_outer(delta)  # our own Δ stands in for the swarm's average
    after_outer = [p.detach().clone() for p in worker.model.parameters()]
    return {"trained": trained, "after_outer": after_outer, "after_eval": after_eval, "eval": eval_loss,
            "theta": [g.clone() for g in worker.global_params], "delta": delta,
            "moved": worker.params_hash() != worker.init_hash, "layout": worker.ranks.layout}


def test_ddp_ranks_keep_one_replica_and_the_outer_state_of_their_own_rows(host_of_two):
    world = 2
    parts = [p["ddp"] for p in host_of_two["ranks"]]
    a, b = parts
    assert a["layout"] == "ddpx2" and a["moved"] and b["moved"]
    # DDP's gradient all-reduce kept the replicas one while each rank trained on its own batches.
    assert all(torch.equal(x, y) for x, y in zip(a["trained"], b["trained"]))
    # An evaluation puts θ in the model and gives every replica its trained copy back.
    for part in parts:
        assert all(torch.equal(x, y) for x, y in zip(part["after_eval"], part["trained"]))
    assert a["eval"] == b["eval"]
    for i, whole in enumerate(a["after_outer"]):
        rows = [p["theta"][i] for p in parts]
        # Each rank's θ and Δ are its FSDP2 rows of the parameter...
        for r, part in enumerate(parts):
            want = rows_of(whole.shape[0], r, world)
            assert part["theta"][i].shape[0] == want.stop - want.start
            assert part["delta"][i].shape == part["theta"][i].shape
        # ...and after the outer step every replica is the whole new θ, every rank's rows in it.
        assert torch.equal(torch.cat(rows), whole), i
        assert torch.equal(b["after_outer"][i], whole), i
        assert not torch.equal(whole, a["trained"][i]), i  # the local copy restarted from θ


def _fsdp(rank: int, world: int) -> dict:
    from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
    from trainer.data import default_corpus_paths, load_corpus
    from trainer.diloco import DiLoCoWorker
    from trainer.parallel import Ranks

    worker = DiLoCoWorker(model=ModelConfig(source="tiny"), data=DataConfig(batch_size=2, seq_len=32, eval_batches=1),
                          inner=InnerConfig(), outer=OuterConfig(), corpus=load_corpus(default_corpus_paths()[:5]),
                          shard_key="host", seed=7, ranks=Ranks(rank, world, "fsdp", torch.device("cpu")))
    buffers = {n: b.clone() for n, b in worker.model.named_buffers()}
    loss = worker.eval_loss()
    return {"theta": [g.clone() for g in worker.global_params], "buffers": buffers, "loss": loss}


def test_fsdp_ranks_initialise_only_their_rows_with_the_bits_of_the_unsharded_init(host_of_two):
    # Built on the meta device and sharded first, each rank draws one parameter at a time and
    # keeps its rows: no rank holds the whole model, and θ is what one process would build.
    from trainer.config import ModelConfig
    from trainer.model import load_model

    parts = [p["fsdp"] for p in host_of_two["ranks"]]
    whole = load_model(ModelConfig(source="tiny"), 7).module
    params = list(whole.parameters())
    assert len(params) == len(parts[0]["theta"])
    for i, p in enumerate(params):
        assert torch.equal(torch.cat([part["theta"][i] for part in parts]), p.detach()), i
    for name, b in whole.named_buffers():  # computed buffers (rotary frequencies) as built, not left empty
        assert all(torch.equal(part["buffers"][name], b) for part in parts), name
    assert parts[0]["loss"] == parts[1]["loss"] and 5.0 < parts[0]["loss"] < 6.0  # an untrained byte model: ~ln 256


def _overlap(rank: int, world: int, mode: str, land_step: int) -> dict:
    """An eager overlapped round whose average reaches one rank two steps after the other (DDP,
    landing as soon as it can), or reaches rank 0 only while the others wait for it at
    outer.land_step (FSDP): the inner steps at which each rank's local copy took it."""
    import threading

    from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
    from trainer.data import default_corpus_paths, load_corpus
    from trainer.diloco import DiLoCoWorker
    from trainer.parallel import Ranks

    worker = DiLoCoWorker(model=ModelConfig(source="tiny"), data=DataConfig(batch_size=2, seq_len=32, eval_batches=1),
                          inner=InnerConfig(lr=1e-3, warmup_steps=1, total_steps=10),
                          outer=OuterConfig(overlap="eager", land_step=land_step),
                          corpus=load_corpus(default_corpus_paths()[:5]), shard_key="host", seed=3,
                          ranks=Ranks(rank, world, mode, torch.device("cpu")))
    worker.inner_steps(2)
    delta = worker.pseudo_gradient()
    avg = [d.clone() for d in delta]  # our own Δ stands in for the swarm's average
    worker.start_overlapped(delta)
    landed, rebase = [], worker.landing.rebase_if_due

    def spy():
        if worker.landing.rebase_due:
            landed.append(worker.inner_step)
        rebase()

    worker.landing.rebase_if_due = spy
    late = rank == (1 if mode == "ddp" else 0)
    if not late:
        worker.apply_outer(avg, reset_local=False)
        worker.settle()
        worker.inner_steps(4)
    elif mode == "ddp":  # at the third step of the phase, from the trainer's own thread
        def arrive():
            if worker.inner_step == 4 and not worker.landing.rebase_due and not landed:
                worker.apply_outer(avg, reset_local=False)
            return False

        worker.inner_steps(4, arrive)
    else:  # rank 0's round commits while the ranks' steps wait for it at land_step
        timer = threading.Timer(1.0, lambda: (worker.apply_outer(avg, reset_local=False), worker.settle()))
        timer.start()
        worker.inner_steps(4)
        timer.join()
    return {"landed": landed, "params": [p.detach().clone() for p in worker.model.parameters()],
            "round": worker.round}


def _pretrained(rank: int, world: int, model_dirs: list[str]) -> dict:
    import trainer.model as model_module
    from trainer.config import ModelConfig
    from trainer.parallel import Ranks, shard_model

    def whole(path):
        raise AssertionError(f"{path} was loaded whole")

    loads, model_module._pretrained_model = model_module._pretrained_model, whole  # each rank reads its rows only
    try:
        ranks = Ranks(rank, world, "fsdp", torch.device("cpu"))
        out = {}
        for d in model_dirs:
            loaded = model_module.load_model(ModelConfig(source=f"hf:{d}"), 0,
                                             shard=lambda m: shard_model(m, ranks, "fp32"))
            out[d] = [p.to_local().detach().clone() for p in loaded.module.parameters()]
        return out
    finally:
        model_module._pretrained_model = loads


def _host_rank(rank: int, world: int, init_file: str, out_dir: str, model_dirs: list[str]) -> None:
    """One rank of a 2-rank CPU host (gloo): what each test below looks at, from one process group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save({"ddp": _ddp(rank, world), "fsdp": _fsdp(rank, world),
                    "overlap_ddp": _overlap(rank, world, "ddp", 0), "overlap_fsdp": _overlap(rank, world, "fsdp", 2),
                    "pretrained": _pretrained(rank, world, model_dirs)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def host_of_two(tmp_path_factory):
    from tests.hf_models import build_model_dir

    tmp = tmp_path_factory.mktemp("host")
    dirs = [build_model_dir(tmp / "qwen2", "qwen2", seed=1),  # tied embeddings
            build_model_dir(tmp / "llama", "llama", seed=2, vocab_size=333)]  # untied, rows not even
    mp.start_processes(_host_rank, args=(2, str(tmp / "init"), str(tmp), dirs), nprocs=2, start_method="spawn",
                       join=True)
    return {"dirs": dirs, "ranks": [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(2)]}


def test_fsdp_ranks_read_only_their_rows_of_pretrained_weights(host_of_two):
    from trainer.config import ModelConfig
    from trainer.model import load_model

    dirs = host_of_two["dirs"]
    parts = [p["pretrained"] for p in host_of_two["ranks"]]
    for d in dirs:
        params = list(load_model(ModelConfig(source=f"hf:{d}"), 0).module.parameters())
        assert len(params) == len(parts[0][d])
        for i, p in enumerate(params):
            assert torch.equal(torch.cat([part[d][i] for part in parts]), p.detach()), (d, i)


def test_an_overlapped_average_lands_on_every_rank_at_one_step(host_of_two):
    # DDP: rank 0 has the average before the phase, rank 1 two steps into it; both take it at
    # that step (one all-reduce of flags per step), so the replicas stay one, bit for bit.
    a, b = (p["overlap_ddp"] for p in host_of_two["ranks"])
    assert a["landed"] == b["landed"] == [4], (a["landed"], b["landed"])
    assert a["round"] == b["round"] == 1
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    # FSDP with outer.land_step=2: rank 1 has it at once, but every rank waits at the second step
    # of the flight until rank 0's round is over (settle), and then all land it there.
    a, b = (p["overlap_fsdp"] for p in host_of_two["ranks"])
    assert a["landed"] == b["landed"] == [3], (a["landed"], b["landed"])
