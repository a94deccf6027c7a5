"""The gpu benchmark's arithmetic: the dense bf16 peak by device name, FLOPs per token, MFU.

Pure: no GPU, no processes (the benchmark itself runs from scripts/bench.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from benchmarks import gpu  # noqa: E402


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4),
    ("NVIDIA H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.4),
    ("NVIDIA H200 NVL", 835.5),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
])
def test_peak_by_device_name(name, peak):
    assert gpu.peak_tflops_for(name) == peak


@pytest.mark.parametrize("name", ["NVIDIA A10", "NVIDIA GeForce RTX 4090", "NVIDIA L40S", "cpu"])
def test_unknown_device_has_no_peak(name):
    assert gpu.peak_tflops_for(name) is None


def test_flops_per_token_and_mfu():
    dense, with_attention = gpu.flops_per_token(params=1_000_000_000, layers=16, hidden=2048, seq=2048)
    assert dense == 6e9
    assert with_attention == 6e9 + 12 * 16 * 2048 * 2048
    # 6 GFLOP per token at 50,000 tokens/s is 300 TFLOPS: about 30.3% of a 989.4 TFLOPS peak.
    assert gpu.mfu_pct(50_000, dense, 989.4) == pytest.approx(100 * 300 / 989.4)


def test_round_gaps_leave_out_the_first_boundary():
    line = "2026-11-30 21:00:{:02d},000 INFO gonka.node: trained round={} steps=20 seconds={:.3f} loss=4.0000"
    # Phases end at 10, 20, 30, 40 s; the second starts at 15 (5 s after round 1, the warm-up's
    # boundary, left out), the third and fourth 2 s after the phase before them.
    log = "\n".join([line.format(10, 1, 5.0), line.format(20, 2, 5.0), line.format(30, 3, 8.0), line.format(40, 4, 8.0)])
    assert gpu.round_gaps(log) == pytest.approx([2.0, 2.0])
