"""Small collectives over the workers' process group (gloo on CPU, NCCL on GPU); no-ops for one worker."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a flat vector over ranks in one collective (float64 so counts stay exact)."""
    tensor = torch.as_tensor(values, dtype=torch.float64, device=device)
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(obj: object) -> list[object]:
    """Every rank's small JSON-able object, on every rank (used at checkpoint time only)."""
    if world_size() == 1:
        return [obj]
    gathered: list[object] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: object) -> object:
    """Rank 0's small picklable object, on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (auto batch size: the micro-batch every rank fits)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
