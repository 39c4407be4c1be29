"""What the C allocator's thresholds cost a training step (``train.reuse_freed_memory``).

``python -m trainforge.bench.allocator [--workload lm|cnn] [--steps 20] [--repeats 2]``

bench/workload.py's step (the model, data, loss and optimizer every peer of ``bench peers`` trains)
in one process on one thread, under glibc's own thresholds and under the raised ones trainforge's
workers run with (worker/allocator.py), each in a new process, interleaved. Per step: the minor page
faults and the system time (``getrusage``), the training thread's CPU time and the wall time; and
the process's peak resident size. Fault counts do not depend on how loaded the machine is; times do.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

SETTINGS = {"glibc": "glibc's defaults", "reuse": "thresholds raised (trainforge's workers)"}


def measure(setting: str, kind: str, steps: int) -> dict[str, Any]:
    """One process's figures (run in a child: the thresholds cannot be put back)."""
    import torch

    from trainforge.bench.workload import Workload, build, loss_of, make_optimizer
    from trainforge.worker.allocator import set_reuse

    torch.set_num_threads(1)
    if setting == "reuse":
        set_reuse(True)
    workload = Workload.sized_for(steps, 64 if kind == "cnn" else 16, 1, kind=kind)
    data, model = build(workload)
    optimizer = make_optimizer(model, kind)
    batches = list(torch.utils.data.DataLoader(data, batch_size=workload.batch_size))[:4]

    def step(batch: Any) -> None:
        inputs, targets = batch
        loss_of(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in batches:  # warm-up: the heap settles on a step's blocks
        step(batch)
    before, wall, cpu = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.thread_time()
    for i in range(steps):
        step(batches[i % len(batches)])
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "setting": setting,
        "faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
        "system_ms": 1000 * (after.ru_stime - before.ru_stime) / steps,
        "cpu_ms": 1000 * (time.thread_time() - cpu) / steps,
        "wall_ms": 1000 * (time.perf_counter() - wall) / steps,
        "peak_rss_mb": after.ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("lm", "cnn"), default="lm")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    if args.child:
        print(json.dumps(measure(args.child, args.workload, args.steps)))
        return
    print(f"bench allocator: {args.workload}, {args.steps} steps per process, one thread, {args.repeats} repeat(s)")
    order = list(SETTINGS)
    for repeat in range(args.repeats):
        for setting in order if repeat % 2 == 0 else order[::-1]:
            command = [sys.executable, "-m", "trainforge.bench.allocator", "--child", setting]
            command += ["--workload", args.workload, "--steps", str(args.steps)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            figures = (
                f"faults/step {row['faults_per_step']:8.0f}  system {row['system_ms']:5.1f} ms  "
                f"CPU {row['cpu_ms']:6.1f} ms  wall {row['wall_ms']:6.1f} ms  peak RSS {row['peak_rss_mb']:5.0f} MB"
            )
            print(f"  {SETTINGS[setting]:42s} {figures}", flush=True)


if __name__ == "__main__":
    main()
