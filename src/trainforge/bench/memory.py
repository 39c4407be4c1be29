"""Per-rank bytes of parameters, gradients and optimizer state: DDP against FSDP, measured.

For each strategy, ``workers`` local gloo ranks (no Ray) build the configured model through
trainforge's own worker build, take one optimizer step (so the optimizer state exists) and a
second backward (so gradients exist), then sum the storage of the tensors each rank really
holds: a DTensor counts its local shard only. Nothing is estimated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainforge.bench.ranks import spawn_ranks

PARTS = ("params", "grads", "optimizer")


def bench_config(model: str, kwargs: dict[str, Any], strategy: str, workers: int) -> dict[str, Any]:
    return {
        "run": {"name": "bench-memory", "output_dir": "/tmp"},
        "model": {"name": model, "kwargs": kwargs},
        "data": {"name": "synthetic", "kind": "tokens", "seq_len": 32, "vocab_size": 1000, "num_samples": 256},
        "train": {"max_steps": 2, "batch_size": 2},
        "optim": {"name": "adamw"},
        "scaling": {"num_workers": workers},
        "parallel": {"strategy": strategy},
    }


def held_bytes(rank: int, world: int, config_dict: dict[str, Any]) -> dict[str, int]:
    """This rank's tensor bytes after one step and with a fresh set of gradients."""
    from trainforge.config import Config
    from trainforge.data import make_loader
    from trainforge.worker.build import build
    from trainforge.worker.step import MetricSums

    run = build(Config.model_validate(config_dict), ranks=(rank, world))
    sampler = run.data.sampler
    assert sampler is not None, "bench memory reads a map-style data set"
    sampler.set_epoch(0)
    loader = make_loader(
        run.data.train_set,
        sampler,
        run.data.micro_batch,
        num_workers=0,
        pin_memory=False,
        drop_last=True,
        seed=0,
        epoch=0,
        rank=rank,
    )
    batches = iter(loader)
    run.runner.run(batches, 1, MetricSums(run.device))
    inputs, targets = next(batches)
    if run.plan.pipelined:  # the stages' forward and backward, through the schedule
        run.plan.forward_backward(run.model, run.task, (inputs, targets), 1)
    else:
        run.task.loss(run.model(inputs), targets).backward()
    return run.plan.tensor_bytes(run.model, run.runner.optimizer)


def run_memory_bench(
    model: str, kwargs: dict[str, Any], workers: int, output: Path | None, console: Console
) -> dict[str, Any]:
    figures = {
        strategy: spawn_ranks(held_bytes, workers, bench_config(model, kwargs, strategy, workers))
        for strategy in ("ddp", "fsdp")
    }
    table = Table(title=f"{model} {kwargs or ''}: tensor bytes per rank, {workers} workers (MB)")
    for column in ("strategy", "rank", *PARTS, "total", "of ddp"):
        table.add_column(column, justify="right")
    for strategy, ranks in figures.items():
        for rank, held in enumerate(ranks):
            total = sum(held.values())
            baseline = sum(figures["ddp"][rank].values())
            table.add_row(
                strategy,
                str(rank),
                *(f"{held[p] / 1e6:.2f}" for p in PARTS),
                f"{total / 1e6:.2f}",
                f"{100 * total / baseline:.1f}%",
            )
    console.print(table)
    result = {"model": model, "kwargs": kwargs, "workers": workers, "bytes": figures}
    if output is not None:
        output.write_text(json.dumps(result, indent=1))
    return result
