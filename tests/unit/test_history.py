"""A report's per-log-interval history: the worker's accumulator and its one all-reduce, and how
a report turns into curve points (no Ray; two ranks through a gloo group in child processes)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainforge.models.tasks import ClassificationTask
from trainforge.protocol import HISTORY_KEY, curve_points, merge_points
from trainforge.worker.components.training import Progress
from trainforge.worker.metrics import IntervalHistory, Signals, Throughput, reduce_metrics
from trainforge.worker.step import MetricSums

BATCH = 4  # samples per step and rank


def fake_run(world: int = 1, rank: int = 0) -> Any:
    """The parts of a WorkerRun that reduce_metrics reads."""
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}])
    return SimpleNamespace(
        device=torch.device("cpu"),
        world=world,
        rank=rank,
        total_steps=100,
        runner=SimpleNamespace(optimizer=optimizer),
        task=ClassificationTask(),
        data=SimpleNamespace(epoch=0),
        parameters=None,
    )


def step(sums: MetricSums, loss: float, correct: int) -> None:
    """What StepRunner and the loop add to the sums for one step (as device tensors and floats)."""
    sums.add("loss_sum", torch.tensor(loss * BATCH))
    sums.add("correct", torch.tensor(float(correct)))
    sums.add("count", torch.tensor(float(BATCH)))
    sums.add("grad_norm_sum", torch.tensor(1.0))
    sums.add("skipped_steps", torch.tensor(0.0))
    sums.add("steps", 1.0)
    for name in ("data_s", "compute_s", "optim_s"):
        sums.add(name, 0.001)


def train(run: Any, losses: list[float], log_every: int, history: IntervalHistory, sums: MetricSums) -> Progress:
    """The loop's bookkeeping (worker/loop.py Session.epoch): a step, then an interval end every log_every."""
    progress = Progress()
    for loss in losses:
        progress.global_step += 1
        run.runner.optimizer.param_groups[0]["lr"] = 0.001 * progress.global_step
        step(sums, loss, correct=progress.global_step % BATCH)
        if progress.global_step % log_every == 0:
            history.close(sums, progress.global_step, run.runner.optimizer.param_groups[0]["lr"])
    return progress


def test_a_report_carries_one_point_per_log_interval_and_keeps_its_span_figures() -> None:
    run, sums, history = fake_run(), MetricSums(torch.device("cpu")), IntervalHistory()
    losses = [2.0 - 0.05 * i for i in range(25)]  # 25 steps, log every 10: intervals end at 10, 20, 25
    progress = train(run, losses, 10, history, sums)
    stop = Signals(stop=1.0)  # a control signal (loop.gather_control_signals) rides the same reduce
    reduced = reduce_metrics(run, sums, history, 2.5, progress, Throughput(BATCH), stop)

    points = reduced.report.history
    assert [p["step"] for p in points] == [10, 20, 25]
    for point, chunk in zip(points, (losses[:10], losses[10:20], losses[20:]), strict=True):
        assert point["train/loss"] == pytest.approx(sum(chunk) / len(chunk))
    assert [p["train/lr"] for p in points] == pytest.approx([0.010, 0.020, 0.025])
    assert all(p["perf/step_time_s"] == pytest.approx(0.003) for p in points)
    # The report itself: the whole span since the last report, as before there was a history.
    assert reduced.report.step == 25
    assert reduced.report.figures["train/loss"] == pytest.approx(sum(losses) / len(losses))
    figures = reduced.report.figures
    assert figures["train/accuracy"] == pytest.approx(sum(s % BATCH for s in range(1, 26)) / (25 * BATCH))
    assert figures["perf/samples_per_s"] == pytest.approx(25 * BATCH / 2.5)
    assert reduced.signals.stop == 1.0 and reduced.totals["steps"] == 25
    assert reduced.local["steps"] == 25 and reduced.local["step_s"] == pytest.approx(0.003)
    # Everything was taken: the next report starts from nothing.
    assert not sums.values and not history.intervals


def test_a_report_without_steps_has_an_empty_history() -> None:
    """The final report right after a stop: no steps since the last report."""
    run, sums, history = fake_run(), MetricSums(torch.device("cpu")), IntervalHistory()
    reduced = reduce_metrics(run, sums, history, 1.0, Progress(global_step=7), Throughput(BATCH), Signals())
    assert reduced.report.history == []
    assert "train/loss" not in reduced.report.figures
    assert curve_points(reduced.report) == [reduced.report.scalars()]


def test_the_history_is_bounded_by_merging_neighbouring_intervals() -> None:
    run, sums, history = fake_run(), MetricSums(torch.device("cpu")), IntervalHistory(capacity=8)
    losses = [float(i) for i in range(20)]
    progress = train(run, losses, 1, history, sums)  # 20 one-step intervals into room for 8
    reduced = reduce_metrics(run, sums, history, 1.0, progress, Throughput(BATCH))
    points = reduced.report.history
    assert len(points) <= 8
    assert points[-1]["step"] == 20 and sorted(p["step"] for p in points) == [p["step"] for p in points]
    # Merging loses resolution, not steps: each point is the mean of exactly the steps it covers.
    previous = 0
    for point in points:
        covered = losses[previous : point["step"]]
        assert point["train/loss"] == pytest.approx(sum(covered) / len(covered))
        previous = point["step"]
    assert reduced.report.figures["train/loss"] == pytest.approx(sum(losses) / len(losses))


def _rank(rank: int, store: str, outs: list[str]) -> None:
    """One of two ranks in a gloo group: train 30 steps, report once, save what it got."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    calls = 0
    reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return reduce(*args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]
    run, sums, history = fake_run(world=2, rank=rank), MetricSums(torch.device("cpu")), IntervalHistory()
    losses = [1.0 + rank + 0.1 * i for i in range(30)]  # rank 1's losses are 1 higher than rank 0's
    for _ in range(30):
        sums.add("forward_s", 0.002 * (rank + 1))  # rank 1's forwards take twice rank 0's
    progress = train(run, losses, 10, history, sums)
    failures = Signals(save_failures=float(rank == 0))
    reduced = reduce_metrics(run, sums, history, 1.0, progress, Throughput(BATCH * 2), failures)
    report = reduced.report.to_json()
    torch.save({"metrics": report, "signals": reduced.signals, "calls": calls, "own_s": reduced.own_s}, outs[rank])
    dist.destroy_process_group()


def test_two_ranks_reduce_every_interval_in_one_collective_and_agree(tmp_path: Path) -> None:
    outs = [str(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    mp.start_processes(_rank, args=(str(tmp_path / "store"), outs), nprocs=2, join=True, start_method="spawn")
    results = [torch.load(out, weights_only=False) for out in outs]
    assert [r["calls"] for r in results] == [1, 1]  # one all_reduce per report, however many intervals
    # ... which also gathers every rank's own time per step (data wait 0.001 s + forward)
    assert results[0]["own_s"] == results[1]["own_s"] == pytest.approx([0.003, 0.005])
    first, second = (r["metrics"] for r in results)
    drop = {"time/unix", "perf/samples_per_s"}  # each rank's own clock (the driver shows rank 0's)
    assert [{k: v for k, v in p.items() if k not in drop} for p in first[HISTORY_KEY]] == [
        {k: v for k, v in p.items() if k not in drop} for p in second[HISTORY_KEY]
    ]
    for index, point in enumerate(first[HISTORY_KEY]):
        mean_of_ranks = 1.5 + 0.1 * (10 * index + 4.5)  # both ranks' 10 steps of this interval
        assert point["step"] == 10 * (index + 1)
        assert math.isclose(point["train/loss"], mean_of_ranks, rel_tol=1e-9)
    assert results[0]["signals"].save_failures == results[1]["signals"].save_failures == 1.0


def test_validation_passes_join_the_history_at_their_steps() -> None:
    """The loop merges each validation pass since the last report into the history (worker/loop.py)."""
    intervals = [{"step": 10, "train/loss": 1.0}, {"step": 20, "train/loss": 0.9}]
    passes = [{"step": 15, "val/loss": 1.2}, {"step": 20, "val/loss": 1.1}]
    history = merge_points(intervals, passes)
    assert history == [
        {"step": 10, "train/loss": 1.0},
        {"step": 15, "val/loss": 1.2},
        {"step": 20, "train/loss": 0.9, "val/loss": 1.1},
    ]
    # The report's own val/loss is the last pass: drawn once, from the history.
    points = curve_points({"step": 20, "train/loss": 0.95, "val/loss": 1.1, "epoch": 1, HISTORY_KEY: history})
    assert points[-1] == {"step": 20, "epoch": 1}


def test_curve_points_unfold_the_history_and_leave_the_report_its_own_figures() -> None:
    report = {
        "step": 20,
        "time/unix": 1000.0,
        "train/loss": 0.5,
        "val/loss": 0.7,
        "checkpoint/path": "/ckpt",
        HISTORY_KEY: [
            {"step": 10, "time/unix": 990.0, "train/loss": 0.6},
            {"step": 20, "time/unix": 1000.0, "train/loss": 0.4},
            {"train/loss": 9.9},  # no step: read back from an untrusted file, left out
            "not a point",
        ],
    }
    assert curve_points(report) == [
        {"step": 10, "time/unix": 990.0, "train/loss": 0.6},
        {"step": 20, "time/unix": 1000.0, "train/loss": 0.4},
        {"step": 20, "time/unix": 1000.0, "val/loss": 0.7, "checkpoint/path": "/ckpt"},
    ]
    plain = {"step": 5, "train/loss": 1.0}  # a report from before histories: one point, itself
    assert curve_points(plain) == [plain]


def test_reports_land_on_log_interval_ends_so_that_points_cover_whole_intervals() -> None:
    from trainforge.config import load_config
    from trainforge.worker.loop import next_report_step

    config = load_config(
        {"model": {"name": "mlp"}, "train": {"max_steps": 500, "log_every_n_steps": 10, "report_min_interval_s": 1.0}},
        env={},
    )
    assert next_report_step(config, 10, step_time_s=0.5) == 20  # 2 steps per second: every interval
    assert next_report_step(config, 40, step_time_s=0.04) == 70  # 25 steps take 1 s: the interval end after
    # After a restore's report at step 32, back on interval ends.
    assert next_report_step(config, 32, step_time_s=0.5) == 50
