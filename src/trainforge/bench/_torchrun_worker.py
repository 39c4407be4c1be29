"""Peer (b): one torchrun process of an idiomatic DDP training script (gloo, DistributedSampler).

Launched by ``bench peers`` as
``python -m torch.distributed.run --standalone --nproc_per_node K -m trainforge.bench._torchrun_worker
--workload JSON --out PATH``; rank 0 writes its figure to PATH as JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from trainforge.bench.workload import StepClock, Workload, build, make_optimizer, parse_args, run_steps, write_result


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv, "Peer (b): one torchrun + DDP worker.")
    workload = Workload.from_json(args.workload)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # rank, world size and rendezvous come from torchrun's environment
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        dataset, model = build(workload)
        ddp = DistributedDataParallel(model)
        sampler: DistributedSampler[int] = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=workload.seed
        )
        loader = DataLoader(dataset, batch_size=workload.batch_size, sampler=sampler, drop_last=True)
        clock = StepClock(workload.batch_size * world)
        optimizer = make_optimizer(ddp, workload.kind)
        run_steps(ddp, loader, optimizer, workload.total_steps, clock, set_epoch=sampler.set_epoch)
        if rank == 0:
            write_result(args.out, clock.result())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
