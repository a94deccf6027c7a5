"""A round taken from its average by a peer that missed it (node/catchup.py): the outer
step from the pieces as they came over the wire gives the members' state bit for bit, and an
average that does not give its certificate's hash is undone."""

import pytest
import torch

from node.catchup import step_verified
from p2p.averagelog import RoundAverage
from p2p.codecs import get_codec
from p2p.compression import PIECE_ELEMS, CommittedAverage, piece_bounds
from p2p.snapshot import Snapshot
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import default_corpus_paths, load_corpus
from trainer.diloco import DiLoCoWorker

pytestmark = pytest.mark.timeout(120)


def worker(corpus) -> DiLoCoWorker:
    return DiLoCoWorker(model=ModelConfig(source="tiny"), data=DataConfig(batch_size=2, seq_len=32, eval_batches=1),
                        inner=InnerConfig(lr=1e-3, warmup_steps=1, total_steps=10), outer=OuterConfig(),
                        corpus=corpus, shard_key="peer-a", seed=5)


def wire_average(member: DiLoCoWorker, codec) -> tuple[list, list]:
    """The member's pseudo-gradient as one round's encoded pieces (what every member decodes)."""
    flat = torch.cat([d.reshape(-1) for d in member.pseudo_gradient()])
    pieces = piece_bounds(0, flat.numel(), codec, PIECE_ELEMS)
    return pieces, [codec.encode(flat[s:e].contiguous()) for s, e in pieces]


def test_an_average_from_the_wire_gives_the_members_state_and_a_wrong_one_is_undone():
    corpus = load_corpus(default_corpus_paths()[:4])
    codec = get_codec("int8")
    member, late = worker(corpus), worker(corpus)
    for round in (1, 2):  # the second round with momentum: m and θ both come out the same
        member.inner_steps(2)
        pieces, payloads = wire_average(member, codec)
        prev = member.params_hash()
        member.apply_outer(CommittedAverage(codec, pieces, list(payloads), member.global_params))
        avg = RoundAverage(round, prev, member.params_hash(), codec.name, pieces, payloads)
        assert step_verified(late, avg, codec, None)
        assert late.round == member.round == round and late.params_hash() == member.params_hash()
        assert all(torch.equal(a, b) for a, b in zip(late.outer_opt.momentum_buffers(),
                                                     member.outer_opt.momentum_buffers()))
    # Bytes that decode (the codec checks them) but are not the round's average: its hash is not
    # the certificate's, and the state downloaded before is back.
    snap = late.with_global_state(lambda r, params, momentum: Snapshot.build(r, late.params_hash(), params, momentum,
                                                                             1 << 20))
    member.inner_steps(2)
    pieces, payloads = wire_average(member, codec)
    wrong = [codec.encode(torch.full((e - s,), 1e-3)) for s, e in pieces]
    avg = RoundAverage(3, late.params_hash(), "not-this", codec.name, pieces, wrong)
    assert not step_verified(late, avg, codec, snap)
    assert late.round == 2 and late.params_hash() == snap.params_hash
