"""Peer (g): the workload's loop under Hugging Face Accelerate (``Accelerator``, ``prepare``, ``backward``).

Launched by ``bench peers`` with ``accelerate launch``: ``--cpu --num_processes 1`` for one worker,
``--multi_gpu --num_processes K`` (its torchrun launcher) for K > 1, since its ``--cpu`` launcher
starts one process unless mpirun is set up; ``Accelerator(cpu=True)`` then makes the K processes
one gloo group and ``prepare`` wraps the model in DDP and shards the loader. Rank 0 writes its
figure to the ``--out`` PATH as JSON.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from trainforge.bench.workload import StepClock, Workload, build, make_optimizer, parse_args, run_steps, write_result


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv, "Peer (g): Hugging Face Accelerate on CPU.")
    workload = Workload.from_json(args.workload)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:  # the processes would train apart and the figure mean nothing
        raise SystemExit(f"accelerate made a group of {accelerator.num_processes} of the {launched} processes started")
    dataset, model = build(workload)
    optimizer = make_optimizer(model, workload.kind)
    loader = DataLoader(dataset, batch_size=workload.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    clock = StepClock(workload.batch_size * accelerator.num_processes)
    run_steps(model, loader, optimizer, workload.total_steps, clock, backward=accelerator.backward)
    if accelerator.is_main_process:
        write_result(args.out, clock.result())
    accelerator.end_training()


if __name__ == "__main__":
    main()
