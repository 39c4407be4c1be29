"""``trainforge bench gpu``: without CUDA it refuses in one line with exit code 2 and writes nothing;
the peak table and the MFU arithmetic; on a GPU (marked ``gpu``) the workloads run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from trainforge.bench.gpu import PEAKS, mfu, peak_for, run_gpu_bench
from trainforge.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA shows")
def test_without_cuda_it_refuses_in_one_line_with_exit_code_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "gpu", "--output", str(out)])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device found" in lines[0] and "needs an NVIDIA GPU" in lines[0]
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--peak-tflops", "-5"], "--peak-tflops -5.0: a number of TFLOPS > 0"),
        (
            ["--output", "/nonexistent-dir/gpu.json"],
            "--output /nonexistent-dir/gpu.json: folder /nonexistent-dir does not exist",
        ),
    ],
)
def test_bad_flags_are_one_line_with_exit_code_2(
    flags: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "gpu", *flags])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA GeForce RTX 3090", None),
        ("NVIDIA H200 NVL", None),
    ],
)
def test_peak_table_matches_device_names(device: str, expected: float | None) -> None:
    found = peak_for(device)
    assert (found.bf16_tflops if found else None) == expected
    assert all(peak.source for peak in PEAKS)


def test_mfu_is_model_flops_over_the_peak() -> None:
    # 1e12 FLOP per token at 400 tokens/s on 2 GPUs of 1000 TFLOPS: 0.2 of the peak.
    assert mfu(400.0, 1e12, 2, 1000.0) == pytest.approx(0.2)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_every_workload_has_a_figure(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    figures = run_gpu_bench(
        output=out, console=Console(), resnet_batch=32, llama_batch=1, seq_len=512, warmup=2, steps=3
    )
    assert len(figures) == 3 and all(f.throughput > 0 for f in figures)
    assert json.loads(out.read_text())["figures"][2]["unit"] == "tokens/s"
