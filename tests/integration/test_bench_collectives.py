"""``trainforge bench collectives`` in 2 real gloo ranks (no Ray): every figure positive, busbw
consistent with the time, the alpha-beta fit with a positive beta, and its JSON read back by
``predict --link measured``. Sizes parsing and bad flags run in this process."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from trainforge.bench.collectives import (
    COLLECTIVES,
    Point,
    bus_factor,
    fit_alpha_beta,
    parse_sizes,
    run_collectives_bench,
)
from trainforge.errors import TrainforgeError
from trainforge.predict.links import measured_link

SIZES = [4 << 10, 256 << 10, 4 << 20]


def test_two_gloo_ranks_time_every_collective_and_fit_alpha_beta(tmp_path: Path) -> None:
    output = tmp_path / "collectives.json"
    shown = Console(width=200, record=True)
    report = run_collectives_bench(SIZES, workers=2, iters=3, output=output, console=shown, show_progress=False)
    assert json.loads(output.read_text()) == json.loads(json.dumps(report))
    assert report["backend"] == "gloo" and report["workers"] == 2 and report["unsupported"] == {}
    for name in COLLECTIVES:
        points = report["results"][name]
        assert [p["bytes"] for p in points] == SIZES
        for p in points:
            assert p["time_s"] > 0
            assert p["algbw_GBps"] == pytest.approx(p["bytes"] / p["time_s"] / 1e9)
            assert p["busbw_GBps"] == pytest.approx(p["algbw_GBps"] * bus_factor(name, 2))
    # The fit is the one of the reported points (its arithmetic is tested on exact lines below);
    # whether beta comes out above zero on 3 iterations depends on the machine's load, not on the code.
    for name in COLLECTIVES:
        points = [Point(p["bytes"], p["time_s"], 0.0, 0.0) for p in report["results"][name]]
        fit = fit_alpha_beta(points)
        assert report["fits"][name]["alpha_s"] == pytest.approx(fit.alpha_s)
        assert report["fits"][name]["beta_s_per_byte"] == pytest.approx(fit.beta_s_per_byte)
        assert fit.alpha_s >= 0 and fit.beta_s_per_byte >= 0
    text = shown.export_text()
    assert "AR busbw" in text and "alpha (us)" in text


def test_predict_reads_the_measured_link_and_refuses_a_fit_without_bandwidth(tmp_path: Path) -> None:
    output = tmp_path / "collectives.json"
    fit = {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}
    output.write_text(json.dumps({"workers": 2, "backend": "gloo", "fits": {"all_reduce": fit}}))
    link = measured_link(output)
    # Two ranks: a ring of 2 steps, each moving half the buffer.
    assert link.alpha_s == pytest.approx(5e-5) and link.bandwidth_Bps == pytest.approx(1e9)
    output.write_text(json.dumps({"workers": 2, "fits": {"all_reduce": {"alpha_s": 1e-3, "beta_s_per_byte": 0.0}}}))
    with pytest.raises(TrainforgeError, match="positive beta"):
        measured_link(output)


def test_bus_factors_are_nccl_tests() -> None:
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("reduce_scatter", 4) == bus_factor("all_gather", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0


def test_the_fit_recovers_a_line() -> None:
    points = [Point(size, 1e-4 + size * 2e-9, 0.0, 0.0) for size in (1 << 10, 1 << 16, 1 << 22)]
    fit = fit_alpha_beta(points)
    assert fit.alpha_s == pytest.approx(1e-4) and fit.beta_s_per_byte == pytest.approx(2e-9)
    assert fit.bandwidth_GBps == pytest.approx(0.5)


def test_noise_that_tilts_the_line_below_zero_is_fitted_on_the_boundary() -> None:
    # The slowest small size (a loaded machine's hiccup) tilts the free line's slope negative:
    # the constrained fit is a flat line at the weighted mean, never a negative cost per byte.
    points = [Point(4 << 10, 5e-3, 0.0, 0.0), Point(256 << 10, 7e-3, 0.0, 0.0), Point(4 << 20, 3.5e-3, 0.0, 0.0)]
    fit = fit_alpha_beta(points)
    assert fit.beta_s_per_byte == 0.0 and fit.bandwidth_GBps == float("inf")
    weights = [1 / p.time_s**2 for p in points]
    assert fit.alpha_s == pytest.approx(sum(w * p.time_s for w, p in zip(weights, points, strict=True)) / sum(weights))
    # A line through (nearly) the origin whose free intercept comes out negative: alpha 0.
    steep = [Point(size, size * 1e-9 - 2e-7, 0.0, 0.0) for size in (1 << 10, 1 << 16, 1 << 22)]
    fit = fit_alpha_beta(steep)
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte == pytest.approx(1e-9, rel=0.3)


def test_sizes_are_the_powers_of_two_of_the_range() -> None:
    assert parse_sizes("1KB..8KB") == [1024, 2048, 4096, 8192]
    assert parse_sizes("256MB") == [256 << 20]
    assert parse_sizes("3KB..5KB") == [4096]
    for bad in ("1KB..", "1XB..2KB", "8KB..1KB", "1KB..2KB..4KB", "0B..1KB", "5B..7B"):
        with pytest.raises(TrainforgeError, match="--sizes"):
            parse_sizes(bad)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--sizes", "1KB-4MB"], "--sizes '1KB-4MB': expected LO..HI such as 1KB..256MB"),
        (["--workers", "1"], "--workers 1: from 2 to 64"),
        (["--iters", "0"], "--iters 0: from 1 to 10000"),
        (["--output", "/absent/x.json"], "--output /absent/x.json: folder /absent does not exist"),
    ],
)
def test_bad_flags_are_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    from trainforge.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["bench", "collectives", *args])
    err = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().err)
    done = subprocess.CompletedProcess(args, exited.value.code, "", err)
    assert done.returncode == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], err
