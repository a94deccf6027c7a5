"""On a GPU host: two rounds on CUDA in bf16, then the checkpoint round trip (skips without CUDA)."""

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_two_rounds_on_cuda_and_resume(nodes, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--device", "cuda:0", "--model", "small", "--inner-steps", "5", "--max-rounds", "2",
            "--set", "inner.precision=bf16", "--checkpoint-dir", str(ckpt), "--threads", "4"]
    first = nodes("gpu", *args)
    assert first.wait_exit(timeout=240) == 0, first.log()[-3000:]
    assert set(first.rounds()) == {1, 2}
    saved = torch.load(ckpt / "latest.pt", map_location="cpu", weights_only=True)
    assert saved["worker"]["round"] == 2
    # θ and the outer momentum stay fp32 on the host; the local copy came back from the GPU.
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in saved["worker"]["global_params"])
    assert all(t.device.type == "cpu" for t in saved["worker"]["local_params"])

    resumed = nodes("gpu-resumed", *[a if a != "2" else "3" for a in args])
    assert resumed.wait_exit(timeout=240) == 0, resumed.log()[-3000:]
    log = resumed.log()
    assert "resumed from" in log and "at round 2" in log
    assert set(resumed.rounds()) == {3}
