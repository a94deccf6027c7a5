"""Where tokens come from and each peer's sampler over them: the byte corpus and token shards."""

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from trainer.data import (MAX_CORPUS_BYTES, ShardSampler, assigned_windows, stream_windows, default_corpus_paths, load_corpus,
                          open_source)
from trainer.tokens import HEADER_BYTES, ShardWriter, TokenDataset, open_token_dataset, pack_header, shard_name, write_manifest

TOKENIZER = {"sha256": "0" * 64, "vocab_size": 1 << 20, "eos_id": 0, "eos_token": "</s>", "source": "test"}


def test_default_corpus_is_sorted_stdlib_source():
    paths = default_corpus_paths()
    assert len(paths) > 100 and paths == sorted(paths)
    assert all(p.endswith(".py") and "site-packages" not in p for p in paths)
    assert any(p.endswith(os.sep + "os.py") for p in paths)


def test_load_corpus_joins_files_and_directories(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_bytes(b"bb")
    (tmp_path / "d" / "sub" / "a.txt").write_bytes(b"aa")
    (tmp_path / "c.txt").write_bytes(b"cc")
    corpus = load_corpus([str(tmp_path / "c.txt"), str(tmp_path / "d")])
    assert corpus.dtype == torch.uint8 and bytes(corpus.tolist()) == b"cc\nbb\naa"


def test_bad_paths_are_reported(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.txt").write_bytes(b"")
    for paths in ([str(tmp_path / "missing")], [str(tmp_path / "empty")], [str(tmp_path / "blank.txt")]):
        with pytest.raises(ValueError, match=r"^data\.paths: "):
            load_corpus(paths)
    with pytest.raises(ValueError, match=r"^data\.paths: corpus too small"):
        ShardSampler(torch.zeros(100, dtype=torch.uint8), shard_key="a", seed=0, batch_size=2, seq_len=32, eval_fraction=0.1)


def test_load_corpus_says_what_it_leaves_out(tmp_path, caplog):
    big, small = tmp_path / "a-big.txt", tmp_path / "b-small.txt"
    with open(big, "wb") as f:
        f.write(b"x")
        f.truncate(MAX_CORPUS_BYTES + 3 * 2**20)  # sparse: costs no disk
    small.write_bytes(b"never read")
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        corpus = load_corpus([str(tmp_path)])
    assert corpus.numel() == MAX_CORPUS_BYTES
    (record,) = caplog.records
    message = record.getMessage()
    assert "first 64.0 MiB of 67.0 MiB" in message and "remaining 3.0 MiB" in message
    assert str(big) in message and "gonka-node prepare-data" in message
    caplog.clear()
    load_corpus([str(small)])
    assert not caplog.records


def test_open_source_reads_a_token_dataset_alone(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    writer = ShardWriter(str(data), dtype="uint16", shard_tokens=100)
    writer.add(np.arange(50, dtype=np.uint16))
    writer.finish(tokenizer=dict(TOKENIZER, vocab_size=100), documents=1)
    source = open_source([str(data)])
    assert isinstance(source, TokenDataset) and source.total_tokens == 50
    (tmp_path / "a.txt").write_text("some text " * 100)
    with pytest.raises(ValueError, match=r"^data\.paths: .*/data is a token-shard directory; give it alone"):
        open_source([str(data), str(tmp_path / "a.txt")])
    assert isinstance(open_source([str(tmp_path / "a.txt")]), torch.Tensor)


def split_corpus(n=20000, eval_fraction=0.1):
    # Training bytes are < 128 and held-out bytes >= 128, so a batch shows where it came from.
    gen = torch.Generator().manual_seed(0)
    corpus = torch.randint(0, 128, (n,), generator=gen, dtype=torch.uint8)
    corpus[n - int(n * eval_fraction):] += 128
    return corpus


def sampler(corpus, key, seed=0, seq_len=32, eval_fraction=0.1):
    return ShardSampler(corpus, shard_key=key, seed=seed, batch_size=4, seq_len=seq_len, eval_fraction=eval_fraction)


def test_shards_differ_and_eval_is_shared_and_held_out():
    corpus = split_corpus()
    a, b = sampler(corpus, "peer-a"), sampler(corpus, "peer-b")
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    assert xa.shape == ya.shape == (4, 32) and xa.dtype == torch.long
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(xa, xb)
    assert torch.equal(sampler(corpus, "peer-a").next_batch()[0], xa)
    assert not torch.equal(sampler(corpus, "peer-a", seed=1).next_batch()[0], xa)
    for _ in range(200):
        x, y = a.next_batch()
        assert x.max() < 128 and y.max() < 128
    ea, eb = a.eval_batches(3), b.eval_batches(3)
    assert len(ea) == 3
    for (x1, y1), (x2, y2) in zip(ea, eb):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.min() >= 128 and y1.min() >= 128
    assert a.eval_start == len(corpus) - 2000


def test_resumed_sampler_yields_the_same_batches():
    corpus = split_corpus()
    a = sampler(corpus, "peer-a")
    for _ in range(5):
        a.next_batch()
    b = sampler(corpus, "peer-a")
    b.load_state_dict(a.state_dict())
    assert (b.round, b.step) == (0, 5)
    for _ in range(3):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_byte_corpus_batches_are_pinned():
    # Digest of what the sampler draws since data is assigned (trainer/data.py
    # assigned_windows): a change to the scheme changes every peer's batches, and a
    # checker on another version would reconstruct other ones than a member trained on.
    gen = torch.Generator().manual_seed(0)
    corpus = torch.randint(0, 256, (20000,), generator=gen, dtype=torch.uint8)
    s = ShardSampler(corpus, shard_key="peer-a", seed=3, batch_size=4, seq_len=32, eval_fraction=0.1)
    h = hashlib.sha256()
    for x, y in [s.next_batch() for _ in range(5)] + s.eval_batches(3):
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    assert h.hexdigest()[:16] == "c9eefe7449b4502a"


# Token shards. Token k*1_000_000 + i is position i of shard k, so a window
# shows which shard it came from and whether it crossed into another.
SHARD_LENGTHS = [5000, 20, 3000, 7000, 10, 4000]


def shard_arrays(lengths=SHARD_LENGTHS):
    return [k * 1_000_000 + np.arange(n, dtype=np.uint32) for k, n in enumerate(lengths)]


def write_dataset(directory, arrays):
    directory.mkdir(exist_ok=True)
    writer = ShardWriter(str(directory), dtype="uint32", shard_tokens=max(map(len, arrays)))
    for array in arrays:
        writer.add(array)
        writer.end_shard()
    writer.finish(tokenizer=TOKENIZER, documents=len(arrays))
    return open_token_dataset(str(directory))


def token_sampler(source, key, eval_fraction=0.25, seq_len=32):
    return ShardSampler(source, shard_key=key, seed=0, batch_size=8, seq_len=seq_len, eval_fraction=eval_fraction)


def check_windows(x, y):
    """The shard and first position of each row; asserts rows are unbroken runs of one shard."""
    rows = torch.cat([x, y[:, -1:]], dim=1).numpy()
    assert np.all(np.diff(rows, axis=1) == 1), "a window crossed a shard boundary"
    assert torch.equal(x[:, 1:], y[:, :-1])
    return rows[:, 0] // 1_000_000, rows[:, 0] % 1_000_000


@pytest.mark.parametrize("kind", ["dataset", "arrays"])
def test_token_windows_stay_within_one_shard_and_one_split(tmp_path, kind):
    source = write_dataset(tmp_path, shard_arrays()) if kind == "dataset" else shard_arrays()
    a, b = token_sampler(source, "peer-a"), token_sampler(source, "peer-b")
    # 19030 tokens, the last 4757 held out: from position 6253 of shard 3 on.
    assert a.eval_start == 19030 - 4757
    seen = set()
    for _ in range(300):
        x, y = a.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == (8, 32)
        shards, starts = check_windows(x, y)
        seen.update(shards.tolist())
        assert np.all(starts[shards == 3] + 33 <= 6253), "a training window reached into the held-out split"
    assert seen == {0, 2, 3}  # shards 1 and 4 are shorter than one window; 5 is held out
    ea, eb = a.eval_batches(4), b.eval_batches(4)
    held_out = set()
    for (x1, y1), (x2, y2) in zip(ea, eb):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        shards, starts = check_windows(x1, y1)
        held_out.update(shards.tolist())
        assert np.all(starts[shards == 3] >= 6253)
    assert held_out == {3, 5}
    assert not torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert a.split_digest() == b.split_digest()


def test_split_digest_names_the_data_and_the_split(tmp_path):
    dataset = write_dataset(tmp_path / "a", shard_arrays())
    digest = token_sampler(dataset, "x").split_digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert token_sampler(open_token_dataset(str(tmp_path / "a")), "y").split_digest() == digest
    assert token_sampler(dataset, "x", eval_fraction=0.2).split_digest() != digest
    changed = shard_arrays()
    changed[2][100] += 1
    assert token_sampler(write_dataset(tmp_path / "b", changed), "x").split_digest() != digest
    assert token_sampler(shard_arrays(), "x").split_digest() == token_sampler(shard_arrays(), "y").split_digest()
    assert token_sampler(changed, "x").split_digest() != token_sampler(shard_arrays(), "x").split_digest()
    corpus = split_corpus()
    assert sampler(corpus, "a").split_digest() == sampler(corpus.clone(), "b").split_digest()
    other = corpus.clone()
    other[5] ^= 1
    assert sampler(other, "a").split_digest() != sampler(corpus, "a").split_digest()


def test_token_sampler_resumes_exactly_and_only_on_its_data(tmp_path):
    dataset = write_dataset(tmp_path / "a", shard_arrays())
    a = token_sampler(dataset, "peer-a")
    for _ in range(7):
        a.next_batch()
    b = token_sampler(open_token_dataset(str(tmp_path / "a")), "peer-a")
    b.load_state_dict(a.state_dict())
    assert b.step == 7
    for _ in range(5):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    with pytest.raises(ValueError, match=r"^sampler state: written for data split"):
        token_sampler(dataset, "peer-a", eval_fraction=0.2).load_state_dict(a.state_dict())
    legacy = {k: v for k, v in a.state_dict().items() if k != "split"}
    b.load_state_dict(legacy)  # checkpoints from before the digest still load


# Assigned data: which windows a peer trains on in round r is a function of (run key, peer, round).

def keyed(source, key, run_key="run-1", **kw):
    s = token_sampler(source, key, **kw) if isinstance(source, list) else sampler(source, key, **kw)
    s.run_key = run_key
    return s


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["bytes", "arrays"])
def test_the_same_run_peer_and_round_give_the_same_batches(kind):
    source = split_corpus() if kind == "bytes" else shard_arrays()

    def batches(key="peer-a", round=3, run_key="run-1", n=4):
        s = keyed(source, key, run_key)
        s.seek(round)
        return [s.next_batch() for _ in range(n)]

    mine = batches()
    assert same(batches(), mine)  # two fresh samplers
    assert not any(torch.equal(x, mine[0][0]) for x, _ in mine[1:])  # each step its own windows
    for other in (batches(key="peer-b"), batches(round=4), batches(run_key="run-2")):
        assert not any(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(other, mine))
    fallback = keyed(source, "peer-a", run_key="seed:0")  # no run key known: the seed stands in
    fresh = token_sampler(source, "peer-a") if kind == "arrays" else sampler(source, "peer-a")
    fallback.seek(3)
    fresh.seek(3)
    assert torch.equal(fallback.next_batch()[0], fresh.next_batch()[0])


@pytest.mark.timeout(10)
def test_assigned_batches_are_what_the_peer_drew_also_after_a_resume_mid_round():
    corpus = split_corpus()
    peer = keyed(corpus, "peer-a")
    peer.seek(2)
    drawn = [peer.next_batch() for _ in range(3)]
    drawn += [peer.next_batch() for _ in range(2)]  # a second phase of the round: steps continue
    resumed = keyed(corpus, "peer-a")
    resumed.load_state_dict(peer.state_dict())  # mid-round: round 2, 5 batches drawn
    assert resumed.state_dict() == {"round": 2, "steps": 5, "split": peer.split_digest()}
    drawn += [resumed.next_batch() for _ in range(3)]
    checker = keyed(corpus, "checker")  # any sampler of the run, whatever its own position
    checker.seek(7, 11)
    assert same(checker.assigned_batches("peer-a", 2, 8), drawn)
    assert same(checker.assigned_batches("peer-a", 2, range(5, 8)), drawn[5:])
    assert not same(checker.assigned_batches("peer-a", 1, 8), drawn)
    numbers = assigned_windows("run-1", "peer-a", 2, range(8), 4, checker._train.count)
    assert numbers.shape == (8, 4) and numbers.min() >= 0 and numbers.max() < checker._train.count
    assert torch.equal(corpus[numbers[6, 1] : numbers[6, 1] + 32].long(), drawn[6][0][1])


@pytest.mark.timeout(10)
def test_a_sampler_state_from_before_assigned_data_still_loads():
    corpus = split_corpus()
    s = sampler(corpus, "peer-a")
    old = {"batches_drawn": 5, "generator": torch.Generator().get_state(), "split": s.split_digest()}
    s.load_state_dict(old)  # the generator is ignored; the count is round 0's step
    assert (s.round, s.step) == (0, 5)
    for bad in ({**old, "generator": None}, {**old, "batches_drawn": -1}, {"round": 1}, {"round": True, "steps": 0}):
        with pytest.raises(ValueError, match=r"^sampler state: "):
            s.load_state_dict(bad)


@pytest.mark.timeout(10)
def test_a_heldout_batch_chosen_by_a_seed_lies_in_the_eval_split():
    corpus = split_corpus()
    a, b = keyed(corpus, "peer-a"), keyed(corpus, "peer-b", run_key="run-2")
    x, y = a.heldout_batch(7)
    assert x.shape == (4, 32) and x.min() >= 128 and y.min() >= 128  # held-out bytes only
    assert torch.equal(b.heldout_batch(7)[0], x)  # the same on every peer: data and seed only
    assert not torch.equal(a.heldout_batch(8)[0], x)
    arrays = token_sampler(shard_arrays(), "peer-a")
    for seed in range(20):
        shards, starts = check_windows(*arrays.heldout_batch(seed))
        assert set(shards.tolist()) <= {3, 5} and np.all(starts[shards == 3] >= 6253)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", ["off", "eager"])
def test_a_worker_trains_on_the_data_of_the_round_its_pseudo_gradient_goes_into(overlap):
    """Through the round function (trainer/round.py): a phase's batches are steps 0, 1, ... of
    the assigned data of the round whose average takes its pseudo-gradient, numbered as that
    round's commit; overlapped, that is the round after the one in flight, which a single
    member commits while its next phase waits (the simulator evaluates in between)."""
    from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
    from trainer.simulator import Simulator

    corpus = load_corpus(default_corpus_paths()[:4])
    sim = Simulator(1, model=ModelConfig(source="tiny"), data=DataConfig(batch_size=2, seq_len=32, eval_batches=1),
                    inner=InnerConfig(lr=1e-3, warmup_steps=1, total_steps=10), outer=OuterConfig(overlap=overlap),
                    corpus=corpus, seed=5, threads=1)
    sim.assign_data("run-x")
    w = sim.workers[0]
    log, sent = [], []
    draw, delta = w.sampler.next_batch, w.pseudo_gradient

    def next_batch():
        log.append((w.sampler.round, w.sampler.step, draw()))
        return log[-1][2]

    def pseudo_gradient(into=None):
        # Averaged in the round θ is at plus one (overlapped too: the round before has committed).
        sent.append((w.round + 1, list(log)))
        log.clear()
        return delta(into)

    w.sampler.next_batch, w.pseudo_gradient = next_batch, pseudo_gradient
    sim.run_sync(3, 2)
    checker = ShardSampler(corpus, shard_key="checker", seed=0, batch_size=2, seq_len=32,
                           eval_fraction=w.data_cfg.eval_fraction)
    checker.run_key = "run-x"
    assert [r for r, _ in sent] == [1, 2, 3]
    for round, batches in sent:
        assert [(r, j) for r, j, _ in batches] == [(round, 0), (round, 1)]
        assert same(checker.assigned_batches("sim-0", round, 2), [b for _, _, b in batches])


def test_shards_too_short_for_a_window_are_reported():
    with pytest.raises(ValueError, match=r"^data\.paths: corpus too small: 300 tokens in 10 shards"):
        token_sampler(shard_arrays([30] * 10), "a")


def _free_bytes(path):
    return shutil.disk_usage(path).free


# Child process of the RSS test: opens the 2 GB dataset, draws batches, and prints
# its RSS (from /proc, in kB) at the start, after verifying, and at its peak.
RSS_CHILD = textwrap.dedent("""
    import sys
    from trainer.data import ShardSampler
    from trainer.tokens import open_token_dataset

    def rss_kb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    path, batches = sys.argv[1], int(sys.argv[2])
    start = rss_kb()
    try:
        open_token_dataset(path, verify=True)  # every byte hashed; the sha256 is wrong on purpose
    except ValueError as e:
        assert "sha256" in str(e), e
    verified = rss_kb()
    sampler = ShardSampler(open_token_dataset(path, verify=False), shard_key="k", seed=0,
                           batch_size=16, seq_len=1024, eval_fraction=0.01)
    peak = 0
    for i in range(batches):
        sampler.next_batch()
        if i % 100 == 0:
            peak = max(peak, rss_kb())
    sampler.eval_batches(20)
    print(start, verified, max(peak, rss_kb()))
""")


@pytest.mark.timeout(300)
def test_rss_stays_bounded_on_a_2gb_shard(tmp_path):
    if _free_bytes(tmp_path) < 5 * 2**30:
        pytest.skip("needs 5 GB of free disk")
    tokens = (2 * 2**30 + 2**20) // 2  # just over 2 GiB of uint16
    directory = tmp_path / "big"
    directory.mkdir()
    with open(directory / shard_name(0), "wb") as f:
        f.write(pack_header("uint16", tokens))
        f.truncate(HEADER_BYTES + 2 * tokens)  # sparse: reads as zeros, takes no disk
    shard = {"file": shard_name(0), "tokens": tokens, "sha256": "0" * 64}
    write_manifest(str(directory), tokenizer=dict(TOKENIZER, vocab_size=256), dtype="uint16", documents=1, shards=[shard])
    # 4000 batches of 16 windows touch ~64k pages spread over the whole file:
    # without released pages RSS would approach the shard's 2 GiB.
    result = subprocess.run([sys.executable, "-c", RSS_CHILD, str(directory), "4000"], capture_output=True,
                            text=True, timeout=280, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.returncode == 0, result.stderr
    start, verified, peak = map(int, result.stdout.split())
    assert verified - start < 200 * 1024, (start, verified)
    assert peak - start < 200 * 1024, (start, peak)


@pytest.mark.timeout(30)
def test_the_windows_trained_follow_from_the_tokens_whatever_the_batch_size():
    # A member with batch 2 and one with batch 3 that trained the same tokens trained the same
    # windows: the first tokens / seq_len of their stream, which a checker reconstructs.
    count = 10_000
    two = assigned_windows("run", "peer", 4, 3, 2, count).reshape(-1)
    three = assigned_windows("run", "peer", 4, 2, 3, count).reshape(-1)
    assert np.array_equal(two, three)
    assert np.array_equal(two, stream_windows("run", "peer", 4, range(6), count))
    assert np.array_equal(stream_windows("run", "peer", 4, range(3, 6), count), two[3:])
    assert not np.array_equal(two, stream_windows("run", "peer", 5, range(6), count))
