"""What every test shares: caches a node writes go to the test session's temporary directory,
and torch.compile (torchao's optimizers compile their step) builds its kernels in the process
that needs them, not in a pool of one worker per core started beside the suite's own processes."""

import os

import pytest

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def node_cache_dir(tmp_path_factory):
    """The init-hash cache (trainer/inithash.py) of every worker and node the tests start."""
    before = os.environ.get("GONKA_CACHE_DIR")
    os.environ["GONKA_CACHE_DIR"] = str(tmp_path_factory.mktemp("node-cache"))
    yield os.environ["GONKA_CACHE_DIR"]
    if before is None:
        os.environ.pop("GONKA_CACHE_DIR", None)
    else:
        os.environ["GONKA_CACHE_DIR"] = before
