"""The function every Ray Train worker runs: build -> restore -> steps -> report -> close.

Workers talk to the driver only through ``ray.train.report``. Every report is a barrier across
ranks, so all ranks report at the same steps, decided from the step count alone.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
from torch import nn

from trainforge.config import Config
from trainforge.data import ResumableDistributedSampler, build_datasets, make_loader
from trainforge.errors import DataError, TrainforgeError
from trainforge.models import Task, build_model, build_task
from trainforge.worker import parallel
from trainforge.worker.optim import build_optimizer, build_scheduler, effective_lr
from trainforge.worker.saving import CheckpointWriter, restore_latest
from trainforge.worker.step import MetricSums, StepRunner

log = logging.getLogger("trainforge.worker")

WARMUP_STEPS = 5  # steps excluded from the throughput figure (allocator, caches, first all-reduce)


@dataclass
class WorkerRun:
    """The components of one worker's run, built from the config."""

    config: Config
    rank: int
    world: int
    device: torch.device
    model: nn.Module
    task: Task
    runner: StepRunner
    train_set: Any
    val_set: Any
    sampler: ResumableDistributedSampler
    total_steps: int
    steps_per_epoch: int


def train_loop_per_worker(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Ray Train entry point; returns rank 0's final metrics to the driver."""
    config = Config.model_validate(config_dict)
    try:
        run = build(config)
    except TrainforgeError as err:
        # Every rank fails the same way on a bad data path or model; returning (instead of raising)
        # spares Ray's retries, which are meant for crashes, and the driver re-raises it.
        return {"user_error": type(err).__name__, "message": str(err)}
    writer = CheckpointWriter(run)
    progress = restore_latest(run, ray.train.get_checkpoint())
    final = train(run, progress, writer)
    return final


def build(config: Config) -> WorkerRun:
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(config.train.threads_per_worker)
    device = ray.train.torch.get_device() if config.scaling.use_gpu else torch.device("cpu")
    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False

    train_set, val_set, spec = build_datasets(config.data, config.seed)
    # Same seed on every rank for the weights; DDP also broadcasts rank 0's copy.
    seed_all(config.seed)
    plain = build_model(config.model, spec)
    task = build_task(config.model, spec)
    model = parallel.wrap_model(plain, device, sync_batchnorm=config.train.sync_batchnorm)
    # Per-rank streams from here on (dropout, augmentation), reproducible per rank.
    seed_all(config.seed * 1000 + rank + 1)

    sampler = ResumableDistributedSampler(len(train_set), world, rank, config.data.shuffle, config.seed, even=True)
    samples_per_step = config.train.batch_size * config.train.grad_accum_steps
    steps_per_epoch = sampler.per_rank_size() // samples_per_step
    if steps_per_epoch == 0:
        raise DataError(
            f"train.batch_size x train.grad_accum_steps = {samples_per_step} exceeds the {sampler.per_rank_size()} "
            f"training samples each of {world} workers gets; lower the batch size or use fewer workers"
        )
    total_steps = min(config.train.max_steps or math.inf, (config.train.epochs or math.inf) * steps_per_epoch)
    total_steps = int(total_steps)

    global_batch = samples_per_step * world
    optimizer = build_optimizer(config.optim, model, effective_lr(config.optim, global_batch))
    scheduler = build_scheduler(config.schedule, optimizer, total_steps)
    runner = StepRunner(
        model,
        task,
        optimizer,
        scheduler,
        device=device,
        precision=config.precision,
        grad_clip_norm=config.train.grad_clip_norm,
    )
    return WorkerRun(
        config, rank, world, device, model, task, runner, train_set, val_set, sampler, total_steps, steps_per_epoch
    )


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(run: WorkerRun, progress: Any, writer: CheckpointWriter) -> dict[str, Any]:
    cfg = run.config
    per_step = cfg.train.batch_size * cfg.train.grad_accum_steps
    sums = MetricSums(run.device)
    meter = Throughput(per_step * run.world)
    val_metrics: dict[str, float] = {}
    start = time.perf_counter()
    last_report = start
    first_step = progress.global_step
    next_report = first_step + cfg.train.log_every_n_steps

    while progress.global_step < run.total_steps:
        run.sampler.set_epoch(progress.epoch)
        run.sampler.set_start(progress.epoch_position)
        loader = make_loader(
            run.train_set,
            run.sampler,
            cfg.train.batch_size,
            num_workers=cfg.data.num_workers,
            pin_memory=_pin_memory(cfg, run.device),
            drop_last=True,
            seed=cfg.seed,
            epoch=progress.epoch,
            rank=run.rank,
        )
        batches = iter(loader)
        epoch_len = run.steps_per_epoch * per_step
        while progress.global_step < run.total_steps and progress.epoch_position < epoch_len:
            times = run.runner.run(batches, cfg.train.grad_accum_steps, sums)
            if times is None:
                break
            progress.global_step += 1
            progress.epoch_position += per_step
            progress.samples_seen += per_step * run.world
            meter.step_done()
            sums.add("data_s", times.data_s)
            sums.add("compute_s", times.compute_s)
            sums.add("optim_s", times.optim_s)

            if _due(progress.global_step, cfg.train.eval_every_n_steps):
                val_metrics = timed_evaluate(run, meter)
            if progress.global_step >= run.total_steps:
                break
            if progress.global_step >= next_report or writer.due(progress):
                now = time.perf_counter()
                metrics = reduce_metrics(run, sums, now - last_report, progress, val_metrics, meter)
                metrics["time/elapsed_s"] = now - start
                last_report, val_metrics = now, {}
                next_report = progress.global_step + report_stride(cfg, metrics["perf/step_time_s"])
                writer.report(progress, metrics)
        if progress.epoch_position >= epoch_len:
            # A full epoch: the next one starts at its beginning with a new shuffle.
            progress.epoch += 1
            progress.epoch_position = 0
            more = progress.global_step < run.total_steps
            if more and run.val_set is not None and cfg.train.eval_every_n_steps is None:
                val_metrics = timed_evaluate(run, meter)

    interval_s = time.perf_counter() - last_report
    final_val = timed_evaluate(run, meter) if run.val_set is not None else {}
    metrics = reduce_metrics(run, sums, interval_s, progress, final_val, meter)
    metrics["time/elapsed_s"] = time.perf_counter() - start
    # A run restored after it had already finished trains nothing and writes no new checkpoint.
    writer.report(progress, metrics, force_checkpoint=progress.global_step > first_step)
    writer.close()
    return metrics


def report_stride(cfg: Config, step_time_s: float) -> int:
    """Steps until the next report: every log_every_n_steps, stretched so that reports are at least
    train.report_min_interval_s apart. Each report is a barrier through the Ray Train controller,
    so reporting faster than it polls would stall training. ``step_time_s`` is all-reduced, hence
    the same on every rank, and so is the stride."""
    by_time = math.ceil(cfg.train.report_min_interval_s / step_time_s) if step_time_s > 0 else 1
    return max(cfg.train.log_every_n_steps, by_time)


def timed_evaluate(run: WorkerRun, meter: Throughput) -> dict[str, float]:
    started = time.perf_counter()
    metrics = evaluate(run)
    meter.exclude(time.perf_counter() - started)
    return metrics


def _due(step: int, every: int | None) -> bool:
    return every is not None and step % every == 0


def _pin_memory(cfg: Config, device: torch.device) -> bool:
    return cfg.data.pin_memory if cfg.data.pin_memory is not None else device.type == "cuda"


class Throughput:
    """Samples per second over all workers, wall clock from the end of warm-up to the last step.

    Reports and checkpoint stalls count (they cost training time); validation does not.
    """

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch
        self.local_steps = 0
        self.timed_steps = 0
        self.started: float | None = None
        self.last = 0.0
        self.excluded_s = 0.0

    def step_done(self) -> None:
        now = time.perf_counter()
        self.local_steps += 1
        if self.local_steps == WARMUP_STEPS:
            self.started = now
        elif self.started is not None:
            self.timed_steps += 1
            self.last = now

    def exclude(self, seconds: float) -> None:
        if self.started is not None:
            self.excluded_s += seconds

    @property
    def samples_per_s(self) -> float:
        if self.started is None or self.timed_steps == 0:
            return 0.0
        return self.timed_steps * self.global_batch / max(self.last - self.started - self.excluded_s, 1e-9)


def reduce_metrics(
    run: WorkerRun,
    sums: MetricSums,
    interval_s: float,
    progress: Any,
    val_metrics: dict[str, float],
    meter: Throughput,
) -> dict[str, Any]:
    """One all-reduce of the interval's sums; every rank gets the same numbers."""
    names = sorted(sums.values)
    vector = torch.stack([sums.values[n] for n in names]) if names else torch.zeros(0, dtype=torch.float64)
    totals = dict(zip(names, parallel.all_reduce_sum(vector, run.device).tolist(), strict=True))
    sums.reset()
    steps = max(totals.get("steps", 0.0) / run.world, 1.0)
    metrics: dict[str, Any] = {
        "step": progress.global_step,
        "epoch": progress.epoch,
        "samples_seen": progress.samples_seen,
        "total_steps": run.total_steps,
        "world_size": run.world,
        "train/lr": run.runner.optimizer.param_groups[0]["lr"],
        "train/grad_norm": totals.get("grad_norm_sum", 0.0) / run.world / steps,
        "train/skipped_steps": totals.get("skipped_steps", 0.0) / run.world,
        "perf/samples_per_s": steps * meter.global_batch / interval_s if interval_s > 0 else 0.0,
        "perf/steady_samples_per_s": meter.samples_per_s,
        "perf/step_time_s": sum(totals.get(k, 0.0) for k in ("data_s", "compute_s", "optim_s")) / run.world / steps,
        "perf/data_wait_s": totals.get("data_s", 0.0) / run.world / steps,
        "perf/compute_s": totals.get("compute_s", 0.0) / run.world / steps,
        "perf/optimizer_s": totals.get("optim_s", 0.0) / run.world / steps,
    }
    if totals.get("count"):
        for name, value in run.task.finalize(totals).items():
            metrics[f"train/{name}"] = value
    metrics.update(val_metrics)
    return metrics


@torch.no_grad()
def evaluate(run: WorkerRun) -> dict[str, float]:
    """Validation over every rank's disjoint share; metrics averaged over all samples of all ranks."""
    if run.val_set is None:
        return {}
    cfg = run.config
    sampler = ResumableDistributedSampler(len(run.val_set), run.world, run.rank, False, cfg.seed, even=False)
    loader = make_loader(
        run.val_set,
        sampler,
        cfg.train.batch_size,
        num_workers=cfg.data.num_workers,
        pin_memory=_pin_memory(cfg, run.device),
        drop_last=False,
        seed=cfg.seed,
        epoch=0,
        rank=run.rank,
    )
    # The unwrapped module: no DDP hooks, and ranks may see different numbers of batches.
    model = parallel.unwrap(run.model)
    model.eval()
    sums = MetricSums(run.device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(run.device), targets.to(run.device)
        with run.runner.autocast():
            output = model(inputs)
            loss = run.task.loss(output, targets)
        stats = run.task.stats(output, targets)
        sums.add("loss_sum", loss.float() * stats["count"])
        for name, value in stats.items():
            sums.add(name, value)
    names = ["loss_sum", "correct", "count"]
    values = [sums.values.get(n, torch.zeros((), dtype=torch.float64, device=run.device)) for n in names]
    totals = dict(zip(names, parallel.all_reduce_sum(torch.stack(values), run.device).tolist(), strict=True))
    model.train()
    if not totals["count"]:
        return {}
    return {f"val/{k}": v for k, v in run.task.finalize(totals).items()}


def worker_env() -> dict[str, str]:
    """Environment every worker process gets: one BLAS thread unless the user set otherwise."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
