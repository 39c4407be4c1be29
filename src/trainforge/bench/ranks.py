"""Ranks of a gloo process group in local processes, without Ray: benchmarks that compare
strategies rank by rank, and tests of the step, the Session and checkpointing (a multi-rank
signal in seconds).

``spawn_ranks(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh processes
joined in one gloo group (a FileStore under a temporary directory) and returns every rank's
return value, in rank order. ``fn`` must be a module-level function of an importable module.
``backend="nccl"`` joins them over NCCL instead, rank ``r`` on CUDA device ``r``.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo") -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="tfranks-") as tmp:
        mp.start_processes(_entry, args=(world, tmp, fn, args, backend), nprocs=world, start_method="spawn", join=True)
        return [pickle.loads((Path(tmp) / f"rank{rank}.pkl").read_bytes()) for rank in range(world)]


def _entry(
    rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple[Any, ...], backend: str = "gloo"
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=dist.FileStore(f"{tmp}/store", world), rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    (Path(tmp) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
