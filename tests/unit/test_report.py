"""``trainforge report``: plots and a self-contained page from hand-built run directories (no Ray)."""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from trainforge.observers.report import ReportWriter
from trainforge.protocol import HISTORY_KEY, CheckpointSkipped, Resumed, Straggler, event_to_json
from trainforge.report import ReportError, load_run, write_report
from trainforge.report.html import format_metric
from trainforge.report.plots import pieces, xy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_790_000_000.0
FAILURE = "ActorDiedError: The actor died unexpectedly before finishing this task."


def metrics(step: int, total: int, *, lm: bool = False, val: bool = False, seed: int = 0) -> dict[str, Any]:
    """One report as worker/metrics.py and worker/loop.py write it, with plausible numbers."""
    rng = random.Random(step * 7919 + seed)
    progress = step / total
    if lm:
        loss = 3.0 + 7.8 * math.exp(-8 * progress) + rng.uniform(-0.05, 0.05)
        accuracy = 0.02 + 0.4 * (1 - math.exp(-6 * progress))
    else:
        loss = 2.3 * math.exp(-6 * progress) + 0.02 + rng.uniform(0, 0.01)
        accuracy = min(0.999, 0.1 + 0.9 * (1 - math.exp(-8 * progress)))
    data_s, compute_s, optim_s = 0.002 + rng.uniform(0, 0.001), 0.018 + rng.uniform(0, 0.004), 0.005
    report: dict[str, Any] = {
        "step": step,
        "epoch": step // 50,
        "samples_seen": step * 64,
        "total_steps": total,
        "world_size": 2,
        "time/unix": T0 + step * 0.03,
        "train/lr": 0.003 * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * progress)),
        "train/grad_norm": 0.8 * math.exp(-progress) + 0.1,
        "train/skipped_steps": 0.0,
        "perf/samples_per_s": 1900.0 + rng.uniform(-300, 300),
        "perf/steady_samples_per_s": 1950.0,
        "perf/step_time_s": data_s + compute_s + optim_s,
        "perf/data_wait_s": data_s,
        "perf/compute_s": compute_s,
        "perf/optimizer_s": optim_s,
        "train/loss": loss,
        "train/accuracy": accuracy,
        "time/elapsed_s": step * 0.03,
        "checkpoint/save_failures": 0,
        "checkpoint/stall_s": 0.0004,
    }
    if lm:
        report["train/perplexity"] = math.exp(loss)
        report["perf/comm_s"] = 0.011 + rng.uniform(0, 0.002)  # rank 0's (metrics.comm.CommReport)
        report["perf/comm_exposed_s"] = 0.003 + rng.uniform(0, 0.001)
        report["straggler/rank0/score"] = 1.0 / (1.0 + progress)  # worker/straggler.py: rank 1 slows down
        report["straggler/rank1/score"] = 1.0 + progress
    if val:
        report["val/loss"] = loss * 1.3
        report["val/accuracy"] = accuracy * 0.98
        if lm:
            report["val/perplexity"] = math.exp(loss * 1.3)
    return report


def summary_for(final: dict[str, Any], *, status: str = "finished", **extra: Any) -> dict[str, Any]:
    """summary.json as summary.build_summary writes it."""
    return {
        "status": status,
        "global_step": int(final.get("step", 0)),
        "epoch": int(final.get("epoch", 0)),
        "num_workers": 2,
        "restarts": 0,
        "recovery_s": [],
        "final_metrics": {k: v for k, v in final.items() if "/" in k and isinstance(v, (int, float))},
        "throughput_samples_per_s": float(final.get("perf/steady_samples_per_s", 0.0)),
        "wall_time_s": 84.2,
        "checkpoint": final.get("checkpoint/path"),
        "config": {"run": {"name": "demo", "output_dir": "/tmp/runs"}, "train": {"max_steps": 200}},
        **extra,
    }


def write_run(run_dir: Path, lines: list[dict[str, Any]], summary: dict[str, Any] | None) -> Path:
    run_dir.mkdir(parents=True)
    if lines:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.yaml").write_text(f"run:\n  name: {run_dir.name}\ntrain:\n  max_steps: 200\n")
    return run_dir


def restarted_run(root: Path) -> Path:
    """200 steps, validation every 50; rank 1 dies after step 120, the run resumes from step 100."""
    lines: list[dict[str, Any]] = [metrics(s, 200, val=s % 50 == 0) for s in range(10, 121, 10)]
    for line in lines:
        if line["step"] >= 100:
            line["checkpoint/path"] = "/tmp/runs/restarted/checkpoint_000000100"
    lines.append({"event": "worker_error", "errors": {"1": FAILURE}})
    resumed = metrics(101, 200, seed=1)
    resumed["events"] = [event_to_json(Resumed(100, "/tmp/runs/restarted/checkpoint_000000100"))]
    lines.append(resumed)
    lines += [metrics(s, 200, val=s % 50 == 0, seed=1) for s in range(110, 201, 10)]
    final = lines[-1]
    final.update({"checkpoint/path": "/tmp/runs/restarted/checkpoint_000000200", "status": "finished"})
    return write_run(root / "restarted", lines, summary_for(final, restarts=1, recovery_s=[6.8]))


def no_val_run(root: Path) -> Path:
    lines = [metrics(s, 60) for s in range(10, 61, 10)]
    lines[-1]["status"] = "finished"
    return write_run(root / "no_val", lines, summary_for(lines[-1]))


def failed_run(root: Path) -> Path:
    lines: list[dict[str, Any]] = [metrics(s, 200) for s in (10, 20, 30)]
    lines.append({"event": "worker_error", "errors": {"0": "RuntimeError: loss is NaN", "1": FAILURE}})
    error = "ray.train.TrainingFailedError: Training failed after 0 restarts (max_failures 0)"
    return write_run(root / "failed", lines, summary_for({}, status="failed", restarts=1, error=error))


def failed_early_run(root: Path) -> Path:
    """Failed before its first report: summary.json only."""
    return write_run(root / "failed_early", [], summary_for({}, status="failed", error="OSError: disk full"))


def lm_run(root: Path) -> Path:
    lines = [metrics(s, 300, lm=True, val=s % 100 == 0) for s in range(10, 301, 10)]
    lines[-1]["status"] = "finished"
    return write_run(root / "lm", lines, summary_for(lines[-1]))


def single_report_run(root: Path) -> Path:
    line = metrics(5, 5, val=True)
    line["status"] = "finished"
    return write_run(root / "single", [line], summary_for(line))


RUNS = {
    "restarted": restarted_run,
    "no_val": no_val_run,
    "failed": failed_run,
    "failed_early": failed_early_run,
    "lm": lm_run,
    "single": single_report_run,
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every fixture run, reported once for the whole module: name -> report.html."""
    root = tmp_path_factory.mktemp("runs")
    return {name: write_report(build(root)) for name, build in RUNS.items()}


def pngs(page: Path) -> dict[str, Path]:
    return {path.stem: path for path in sorted(page.parent.glob("*.png"))}


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        ("restarted", {"loss", "accuracy", "throughput", "step_time", "lr"}),
        ("no_val", {"loss", "accuracy", "throughput", "step_time", "lr"}),
        ("failed", {"loss", "accuracy", "throughput", "step_time", "lr"}),
        ("failed_early", set()),
        ("lm", {"loss", "perplexity", "accuracy", "throughput", "step_time", "communication", "stragglers", "lr"}),
        ("single", {"loss", "accuracy", "throughput", "step_time", "lr"}),
    ],
)
def test_plots_are_valid_pngs(reports: dict[str, Path], run: str, expected: set[str]) -> None:
    from PIL import Image

    written = pngs(reports[run])
    assert set(written) == expected
    for path in written.values():
        content = path.read_bytes()
        assert content.startswith(PNG_MAGIC)
        assert len(content) > 10_000, f"{path.name} is only {len(content)} bytes"
        with Image.open(path) as image:
            image.verify()
            assert image.size[0] >= 800 and image.size[1] >= 300


@pytest.mark.parametrize("run", list(RUNS))
def test_page_is_self_contained_and_embeds_every_plot(reports: dict[str, Path], run: str) -> None:
    page = reports[run].read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert "http://" not in page and "https://" not in page
    for forbidden in ("<script", "<link", "@import", "url("):
        assert forbidden not in page.lower()
    written = pngs(reports[run])
    assert page.count('src="data:image/png;base64,') == len(written)
    for path in written.values():
        assert base64.b64encode(path.read_bytes()).decode("ascii") in page


def test_restarted_run_page(reports: dict[str, Path]) -> None:
    page = reports["restarted"].read_text()
    assert "finished" in page
    assert "val/accuracy" in page and "val/loss" in page and "train/loss" in page
    final = json.loads((reports["restarted"].parent.parent / "summary.json").read_text())["final_metrics"]
    assert f"{final['val/accuracy'] * 100:.2f} %" in page
    assert f"{final['train/loss']:.4g}" in page
    assert f"worker failure on rank 1: {FAILURE}" in page
    assert "resumed from /tmp/runs/restarted/checkpoint_000000100 at step 100" in page
    assert "recovered in 6.8 s" in page
    assert "/tmp/runs/restarted/checkpoint_000000200" in page
    assert "max_steps: 200" in page  # the resolved config


def test_a_run_written_before_events_had_kinds_still_loads(tmp_path: Path) -> None:
    """Events were plain strings: they show as text, unread (no marker is made out of a sentence)."""
    run_dir = restarted_run(tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    old = [json.loads(line) for line in lines]
    for record in old:
        if "events" in record:
            record["events"] = [event["text"] for event in record["events"]] + ["skipped checkpoint c: bad", 7]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in old))
    data = load_run(run_dir)
    assert [(m.kind, m.step) for m in data.markers] == [("failure", 120)]
    texts = [(e.kind, e.text) for e in data.events]
    assert ("event", "resumed from /tmp/runs/restarted/checkpoint_000000100 at step 100") in texts
    assert ("event", "skipped checkpoint c: bad") in texts and len(data.reports) == len(old) - 1
    assert "resumed from /tmp/runs/restarted/checkpoint_000000100 at step 100" in write_report(run_dir).read_text()


def test_events_are_read_by_kind_and_hostile_entries_are_left_out(tmp_path: Path) -> None:
    run_dir = no_val_run(tmp_path)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines[1]["events"] = [
        event_to_json(CheckpointSkipped("checkpoint_000000010", "manifest.json is missing")),
        {"kind": "resumed", "step": "ten", "path": 3, "text": "resumed from nowhere"},  # a Note, no marker
        {"kind": "resumed"},  # no text: left out
        ["not", "an", "event"],
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = load_run(run_dir)
    assert data.markers == []
    assert [e.text for e in data.events] == [
        "skipped checkpoint checkpoint_000000010: manifest.json is missing",
        "resumed from nowhere",
    ]


def test_restart_markers_and_lost_steps(tmp_path: Path) -> None:
    data = load_run(restarted_run(tmp_path))
    assert [(m.kind, m.step) for m in data.markers] == [("failure", 120), ("resume", 100)]
    assert [len(segment) for segment in data.segments()] == [12, 11]
    parts = pieces(data)
    assert [(p.lost, p.points[0]["step"], p.points[-1]["step"]) for p in parts] == [
        (False, 10, 100),
        (True, 100, 120),  # starts at the last kept report so the faded curve joins the kept one
        (False, 101, 200),
    ]


def with_history(report: dict[str, Any], previous: int, every: int) -> dict[str, Any]:
    """A report as the worker writes it now: one point per log interval since the previous report."""
    points = []
    for end in range(previous + every, report["step"] + 1, every):
        point = metrics(end, report["total_steps"])
        points.append(
            {
                "step": end,
                "time/unix": point["time/unix"],
                "train/loss": point["train/loss"],
                "train/lr": point["train/lr"],
                "perf/step_time_s": point["perf/step_time_s"],
                "perf/data_wait_s": point["perf/data_wait_s"],
                "perf/compute_s": point["perf/compute_s"],
                "perf/optimizer_s": point["perf/optimizer_s"],
            }
        )
    return {**report, HISTORY_KEY: points}


def test_curves_have_a_point_per_log_interval_when_reports_carry_history(tmp_path: Path) -> None:
    """Reports every 30 steps (stretched to report_min_interval_s), log intervals of 5 steps."""
    steps = (30, 60, 90)
    lines = [with_history(metrics(s, 90, val=s == 90), s - 30, 5) for s in steps]
    run_dir = write_run(tmp_path / "history", lines, summary_for(lines[-1]))
    data = load_run(run_dir)
    assert len(data.reports) == 3  # metrics.jsonl stays one line per report
    (piece,) = pieces(data)
    assert xy(piece.points, "train/loss")[0] == list(range(5, 91, 5))  # 18 points, not 3
    assert xy(piece.points, "val/loss")[0] == [90]  # validation stays at its report
    # The report's own train/loss (its 30-step span) is not drawn twice at the report's step.
    assert xy(piece.points, "perf/steady_samples_per_s")[0] == [30, 60, 90]
    page = write_report(run_dir)
    assert {"loss", "lr", "step_time"} <= set(pngs(page))


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("system/10.0.0.1/net_recv_mb_s", 26.3, "26.3 MB/s"),
        ("system/10.0.0.1/disk_read_mb_s", 0.0, "0 MB/s"),
        ("system/10.0.0.1/net_sent_mb_s", 1234.5, "1,234.5 MB/s"),
        ("perf/samples_per_s", 1950.0, "1,950.0 /s"),
        ("perf/steady_samples_per_s", 12.5, "12.5 /s"),
        ("samples/s", 300.0, "300.0 /s"),
        ("perf/step_time_s", 0.025, "25 ms"),
        ("checkpoint/stall_s", 3.0, "3.0 s"),
        ("time/elapsed_s", 300.0, "5 min 0 s"),
    ],
)
def test_rates_are_per_second_and_durations_are_seconds(key: str, value: float, shown: str) -> None:
    assert format_metric(key, value) == shown


def test_run_without_validation(reports: dict[str, Path]) -> None:
    page = reports["no_val"].read_text()
    assert "val/" not in page
    assert "train/loss" in page
    assert "None." in page  # no events


def test_failed_runs_have_no_final_metrics(reports: dict[str, Path]) -> None:
    page = reports["failed"].read_text()
    assert 'class="badge failed"' in page
    assert "Training failed after 0 restarts" in page
    assert "No final metrics" in page
    assert "worker failure on rank 0: RuntimeError: loss is NaN" in page
    early = reports["failed_early"].read_text()
    assert "disk full" in early and "No plots" in early


def test_lm_run_shows_perplexity(reports: dict[str, Path]) -> None:
    page = reports["lm"].read_text()
    assert "train/perplexity" in page and "val/perplexity" in page
    assert 'alt="Perplexity"' in page


def test_a_straggler_is_named_in_the_events(tmp_path: Path) -> None:
    named = Straggler(40, 1, "10.0.0.2", 2.5, 0.05, 30, 1.5, "report")
    lines = [metrics(step, 40) for step in (20, 40)]
    lines[-1]["events"] = [event_to_json(named)]
    page = write_report(write_run(tmp_path / "slow", lines, summary_for(lines[-1]))).read_text()
    assert html.escape(named.text) in page


def test_cut_short_metrics_line_is_skipped(tmp_path: Path) -> None:
    run_dir = no_val_run(tmp_path)
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 70, "train/lo')
    data = load_run(run_dir)
    assert len(data.reports) == 6 and data.skipped_lines == 1


@pytest.mark.parametrize("layout", ["missing", "empty", "file"])
def test_not_a_run_directory_is_a_user_error(tmp_path: Path, layout: str) -> None:
    target = tmp_path / "absent"
    if layout == "empty":
        target.mkdir()
    elif layout == "file":
        target.write_text("x")
    with pytest.raises(ReportError):
        load_run(target)


def test_cli_bad_directory_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainforge.cli import main

    monkeypatch.setattr(sys, "argv", ["trainforge", "report", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error:") and "neither metrics.jsonl nor summary.json" in err


def test_cli_prints_the_page_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainforge.cli import main

    run_dir = failed_early_run(tmp_path)  # no plots to draw: the cheapest real report
    monkeypatch.setattr(sys, "argv", ["trainforge", "report", str(run_dir)])
    main()
    assert capsys.readouterr().out.strip() == str(run_dir / "report" / "report.html")


def test_report_writer_writes_at_the_end_and_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = failed_early_run(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()  # on_end gets the summary from the driver
    writer = ReportWriter(run_dir)
    writer.on_start({})
    writer.on_end(summary)
    assert "disk full" in (run_dir / "report" / "report.html").read_text()

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "metrics.jsonl").write_text(json.dumps(metrics(10, 10)) + "\n")
    (blocked / "report").write_text("a file where the report folder should be")
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        ReportWriter(blocked).on_end({"status": "finished"})
    assert "could not write the run report" in caplog.text
    assert "trainforge report" in caplog.text


def test_a_run_directory_written_before_a_masking_rule_is_masked_again(tmp_path: Path) -> None:
    # A config.yaml from an older trainforge (or another user) with secrets under keys the old
    # rule did not know: the report masks them key by key; a refused YAML is not shown at all.
    from trainforge.report.data import config_text

    path = tmp_path / "config.yaml"
    path.write_text("model:\n  kwargs:\n    hf_token: hf_abcdef123\n    secretKey: s3cr3t\n  name: mlp\n")
    shown = config_text(path)
    assert "hf_abcdef123" not in shown and "s3cr3t" not in shown and "hf_token: '***'" in shown, shown
    assert "name: mlp" in shown
    path.write_text("c: " + "[" * 200 + "]" * 200 + "\n")  # deeper than safeyaml reads
    assert config_text(path).startswith("# config.yaml not shown: ")


@pytest.mark.parametrize(
    ("model", "figures", "label"),
    [
        ({}, {"train/loss": 2.0}, "cross-entropy loss"),
        ({}, {"train/loss": 2.0, "train/perplexity": 7.4}, "cross-entropy loss per token"),
        ({}, {"train/loss": 0.5, "val/mse": 0.5}, "mean squared error"),  # regression inferred from its metrics
        ({"task": "regression", "loss": "l1"}, {"train/loss": 0.5}, "mean absolute error (L1)"),
        ({"task": "custom"}, {"train/loss": 0.5}, "loss (the model's training_step)"),
        ({"task": "hf"}, {"train/loss": 0.5}, "loss (the model's own)"),
    ],
)
def test_the_loss_axis_is_labelled_by_the_task(
    tmp_path: Path, model: dict[str, Any], figures: dict[str, float], label: str
) -> None:
    from trainforge.report.data import RunData
    from trainforge.report.plots import loss_label

    data = RunData(tmp_path, reports=[{"step": 10, **figures}], summary={"config": {"model": model}})
    assert loss_label(data) == label
    from_yaml = RunData(tmp_path, reports=[{"step": 10, **figures}], config_text=f"model: {json.dumps(model)}\n")
    assert loss_label(from_yaml) == label  # a run still going: its config.yaml
