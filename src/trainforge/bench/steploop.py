"""trainforge's training loop against a plain one, in the same process: what the loop itself costs.

``python -m trainforge.bench.steploop [--workload cnn|lm] [--steps 400] [--repeats 4]``

One rank (a gloo group of one, no Ray), one thread, glibc's thresholds raised for both
(worker/allocator.py) and the CNN in the contiguous layout: bench/workload.py's plain loop (the step
peers (a) to (c) run) and trainforge's worker ``Session`` on the same model, data, batch and optimizer,
interleaved. The heap, the imports and the threads are the process's, the same for both, so what
differs is the loop. Per timed step: waiting for data, forward and backward, the optimizer phase
(trainforge's includes its gradient norm, non-finite check, metric sums and LR schedule) and the rest
(the wall time per step less those three: the loop's bookkeeping between steps, its reports); and
samples per second over the timed window, as ``bench peers`` measures it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainforge.bench.workload import WARMUP_STEPS, Workload

PARTS = ("data", "compute", "optimizer")
SHOWN = {"data": "data", "compute": "forward+backward", "optimizer": "optimizer", "rest": "rest"}
LOOPS = {"plain": "plain loop", "trainforge": "trainforge"}


@dataclasses.dataclass
class PartClock:
    """Seconds per part over the timed steps (those after warm-up, as StepClock counts them)."""

    steps: int = 0
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def add(self, data: float, compute: float, optimizer: float) -> None:
        self.steps += 1
        if self.steps > WARMUP_STEPS:
            for name, value in zip(PARTS, (data, compute, optimizer), strict=True):
                self.seconds[name] += value

    def figures(self, samples_per_s: float, global_batch: int) -> dict[str, float]:
        """Milliseconds per timed step for each part, the rest, the step; and samples/s."""
        timed = max(self.steps - WARMUP_STEPS, 1)
        parts = {name: 1000 * value / timed for name, value in self.seconds.items()}
        step_ms = 1000 * global_batch / samples_per_s if samples_per_s > 0 else 0.0
        return {**parts, "rest": step_ms - sum(parts.values()), "step": step_ms, "samples_per_s": samples_per_s}


def plain(workload: Workload) -> dict[str, float]:
    """bench/workload.py's loop (peer (a)'s at one thread), each part of its steps timed."""
    from torch.utils.data import DataLoader

    from trainforge.bench.workload import StepClock, build, make_optimizer, run_steps

    dataset, model = build(workload)
    loader = DataLoader(dataset, batch_size=workload.batch_size, shuffle=True, drop_last=True)
    clock, parts = StepClock(workload.batch_size), PartClock()
    run_steps(model, loader, make_optimizer(model, workload.kind), workload.total_steps, clock, parts=parts.add)
    return parts.figures(clock.result()["samples_per_s"], workload.batch_size)


def trainforge_loop(workload: Workload, scratch: Path, name: str) -> dict[str, float]:
    """trainforge's worker Session on the workload (as ``bench peers``' (d) configures it, the
    contiguous layout), its step's own part times collected as the step returns them."""
    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.config import Config
    from trainforge.worker.build import build
    from trainforge.worker.loop import Session
    from trainforge.worker.saving import Checkpointing, restore
    from trainforge.worker.step import StepTimes
    from trainforge.worker.warm import GatheringChannel

    equal = dataclasses.replace(workload, overrides=("parallel.channels_last=false",))
    config = Config.model_validate(equal.trainforge_config(1, name=name, output_dir=str(scratch), observed=True))
    run = build(config, ranks=(0, 1))
    parts, step = PartClock(), run.runner.run

    def timed(batches: Iterator[Any], accum: int, sums: Any) -> StepTimes | None:
        times = step(batches, accum, sums)
        if times is not None:
            parts.add(times.data_s, times.compute_s, times.optim_s)
        return times

    run.runner.run = timed  # type: ignore[method-assign]  # this run's runner only
    checkpointing = Checkpointing(run, CheckpointStore.for_run(config.storage_path, config.run.name))
    try:
        final = Session(
            run, checkpointing, restore(run, checkpointing.store), channel=GatheringChannel(0, None)
        ).train()
    finally:
        checkpointing.close()
    return parts.figures(float(final.figures["perf/steady_samples_per_s"]), workload.batch_size)


def measure(rank: int, world: int, kind: str, steps: int, repeats: int) -> list[tuple[str, dict[str, float]]]:
    """Every repeat of both loops in this rank's process, the order reversed every other repeat."""
    import torch

    from trainforge.bench.workload import KINDS
    from trainforge.worker.allocator import apply

    torch.set_num_threads(1)
    apply(True)  # as trainforge's workers run; the plain loop gets the same
    workload = Workload.sized_for(steps, KINDS[kind].batch_size, 1, kind)
    rows: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="tf-steploop-") as scratch:
        for repeat in range(repeats):
            for loop in LOOPS if repeat % 2 == 0 else list(LOOPS)[::-1]:
                if loop == "plain":
                    figures = plain(workload)
                else:
                    figures = trainforge_loop(workload, Path(scratch), f"steploop{repeat}")
                rows.append((loop, figures))
                print(f"  repeat {repeat + 1}  {row_line(loop, figures)}", flush=True)
    return rows


def row_line(loop: str, figures: dict[str, float]) -> str:
    parts = "  ".join(f"{SHOWN[name]} {figures[name]:6.2f} ms" for name in (*PARTS, "rest"))
    return f"{LOOPS[loop]:10s} {figures['samples_per_s']:8.1f} samples/s  {parts}  step {figures['step']:6.2f} ms"


def summary_lines(rows: list[tuple[str, dict[str, float]]]) -> list[str]:
    """Medians of each loop, and trainforge's difference from the plain loop per part."""
    medians = {
        loop: {key: statistics.median(f[key] for name, f in rows if name == loop) for key in rows[0][1]}
        for loop in LOOPS
        if any(name == loop for name, _ in rows)
    }
    lines = [f"  median    {row_line(loop, figures)}" for loop, figures in medians.items()]
    if len(medians) == len(LOOPS):
        ours, base = medians["trainforge"], medians["plain"]
        extra = ", ".join(f"{SHOWN[name]} {ours[name] - base[name]:+.2f} ms" for name in (*PARTS, "rest"))
        lines.append(
            f"trainforge/plain {ours['samples_per_s'] / base['samples_per_s']:.3f} (samples/s); "
            f"per step trainforge - plain: {extra}, of {base['step']:.2f} ms"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    from trainforge.bench.ranks import spawn_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("cnn", "lm"), default="cnn")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per measurement, after 5 warm-up steps")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    if args.steps < 10 or args.repeats < 1:
        parser.error("--steps must be >= 10 and --repeats >= 1")
    print(
        f"bench steploop: {args.workload}, {WARMUP_STEPS} warm-up + {args.steps} timed steps, one process, "
        f"one thread, {args.repeats} repeat(s)",
        flush=True,
    )
    rows = spawn_ranks(measure, 1, args.workload, args.steps, args.repeats)[0]
    for line in summary_lines(rows):
        print(line)


if __name__ == "__main__":
    main()
