"""The inner loop's memory modes (trainer/memory.py, trainer/loss.py): each trains from the same
θ as fp32 masters, commits rounds, and resumes from a checkpoint with the state it saved; the
chunked loss is the whole batch's loss; a mode the host cannot run is refused by its key."""

import pytest
import torch

from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import DataConfig, HostConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import default_corpus_paths, load_corpus
from trainer.diloco import DiLoCoWorker
from trainer.loss import ChunkedLossHead, install_chunked_loss
from trainer.memory import check_modes
from trainer.model import lm_loss, load_model
from trainer.simulator import Simulator

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(default_corpus_paths()[:30])


def make_worker(corpus, **inner):
    return DiLoCoWorker(model=ModelConfig(source="tiny"), data=DataConfig(batch_size=4, seq_len=64, eval_batches=2),
                        inner=InnerConfig(lr=3e-3, warmup_steps=2, total_steps=40, **inner), outer=OuterConfig(),
                        corpus=corpus, shard_key="peer-a", seed=11)


def rounds(worker, n, steps=4) -> list[dict]:
    records = Simulator.of([worker]).run_sync(n, steps)
    assert all(r["committed"] == [True] for r in records)
    return records


def losses_and_grads(module, x, y):
    module.zero_grad(set_to_none=True)
    loss = lm_loss(module, x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("source", ["tiny", "llama"])
def test_chunked_loss_is_the_whole_batch_loss(source, tmp_path):
    if source == "llama":  # untied output layer, a real transformers architecture
        from tests.hf_models import build_model_dir

        source = "hf:" + build_model_dir(tmp_path / "llama", "llama")
    whole = load_model(ModelConfig(source=source), 3).module
    chunked = load_model(ModelConfig(source=source), 3).module
    install_chunked_loss(chunked, 37)  # not a divisor of the 3 x 40 positions: a short last chunk
    assert isinstance(chunked.lm_head, ChunkedLossHead)
    assert [n for n, _ in chunked.named_parameters()] == [n for n, _ in whole.named_parameters()]
    x = torch.randint(0, 200, (3, 41))
    x, y = x[:, :-1], x[:, 1:]
    loss_a, grads_a = losses_and_grads(whole, x, y)
    loss_b, grads_b = losses_and_grads(chunked, x, y)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert chunked.lm_head.targets is None  # set for one forward only


def test_chunked_loss_refuses_an_architecture_whose_logits_are_more_than_its_output_layer():
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"^inner\.loss_chunk: .*gpt2 is not one"):
        install_chunked_loss(gpt2, 16)


MODES = {
    "bf16": dict(param_dtype="bf16"),
    "8bit": dict(optimizer_state="8bit"),
    "bf16-8bit-chunked": dict(param_dtype="bf16", optimizer_state="8bit", loss_chunk=50),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_memory_mode_trains_from_the_fp32_theta_and_resumes_its_state(mode, corpus, tmp_path):
    reference = make_worker(corpus)
    worker = make_worker(corpus, **MODES[mode])
    # The same θ, fp32, whatever the local copy is kept in: hosts in different modes share a run.
    assert worker.init_hash == reference.init_hash
    assert all(g.dtype == torch.float32 for g in worker.global_params)
    want = torch.bfloat16 if MODES[mode].get("param_dtype") == "bf16" else torch.float32
    assert {p.dtype for p in worker.model.parameters()} == {want}
    # A local copy that has not trained sends nothing, rounding to bf16 included.
    assert all(not d.any() for d in worker.pseudo_gradient())
    records = rounds(worker, 3)
    assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.05, records
    if MODES[mode].get("optimizer_state") == "8bit":
        state = next(s for s in worker.inner_opt.state.values() if s["exp_avg"].numel() >= 4096)
        assert type(state["exp_avg"]).__name__ == "OptimState8bit"

    save_checkpoint(str(tmp_path / "ckpt"), worker.state_dict())
    resumed = make_worker(corpus, **MODES[mode])
    resumed.load_state_dict(load_checkpoint(str(tmp_path / "ckpt")))
    assert resumed.params_hash() == worker.params_hash() and resumed.round == worker.round
    for a, b in zip(resumed.model.parameters(), worker.model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(resumed.outer_opt.momentum_buffers(), worker.outer_opt.momentum_buffers()):
        assert torch.equal(a, b)
    for p_a, p_b in zip(resumed.model.parameters(), worker.model.parameters()):
        sa, sb = resumed.inner_opt.state[p_a], worker.inner_opt.state[p_b]
        assert sa.keys() == sb.keys()
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(sa[key]) is type(sb[key]) and sa[key].dtype == sb[key].dtype
            for part in ("codes", "scale") if hasattr(sa[key], "codes") else ("data",):
                assert torch.equal(getattr(sa[key], part), getattr(sb[key], part)), (key, part)
    # The resumed worker goes on training: a round commits and the loss keeps falling.
    more = rounds(resumed, 1)
    assert more[-1]["eval_loss"] < records[0]["eval_loss"]


def test_modes_a_host_cannot_run_are_refused_by_key():
    def refused(match, **inner):
        host = inner.pop("host", HostConfig())
        device = inner.pop("device", "cpu")
        with pytest.raises(ValueError, match=match):
            check_modes(InnerConfig(**inner), host, device)

    refused(r"^inner\.offload: optimizer offload .* this node trains on cpu", offload="optimizer")
    refused(r"^inner\.offload: optimizer offload serves one device", offload="optimizer", device="cuda",
            host=HostConfig(nproc_per_node=2))
    refused(r"^inner\.offload: all is FSDP2's", offload="all")
    refused(r"^inner\.offload: all is FSDP2's", offload="all", host=HostConfig(nproc_per_node=2, parallel="ddp"))
    check_modes(InnerConfig(offload="all"), HostConfig(nproc_per_node=2), "cpu")
    check_modes(InnerConfig(offload="optimizer"), HostConfig(), "cuda")

    for match, inner in [
        (r"^inner\.precision: fp32 arithmetic needs fp32 parameters", dict(param_dtype="bf16", precision="fp32")),
        (r"^inner\.optimizer_state: bf16 moments need inner\.param_dtype = bf16", dict(optimizer_state="bf16")),
        (r"^inner\.optimizer_state: fp32 moments need inner\.param_dtype = fp32",
         dict(param_dtype="bf16", optimizer_state="fp32")),
        (r"^inner\.offload: optimizer offload steps fp32 AdamW", dict(offload="optimizer", optimizer_state="8bit")),
        (r"^inner\.param_dtype: must be one of fp32, bf16", dict(param_dtype="fp16")),
        (r"^inner\.loss_chunk: must be >= 0", dict(loss_chunk=-1)),
    ]:
        with pytest.raises(ValueError, match=match):
            InnerConfig(**inner)


def test_compiled_blocks_train_as_the_eager_model(corpus, monkeypatch):
    # Dynamo's capture of each block and AOT autograd's graphs, as a GPU host compiles them, with
    # the graphs run as they are (Inductor's C++ kernels cost a CPU test ~15 s to build).
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager"))
    eager, compiled = make_worker(corpus), make_worker(corpus, compile=True)
    assert all(hasattr(block, "_compiled_call_impl") and block._compiled_call_impl is not None
               for block in compiled.model.model.layers)
    a, b = eager.inner_steps(2), compiled.inner_steps(2)
    assert b.mean_loss == pytest.approx(a.mean_loss, rel=1e-4)
    for p, q in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
