"""Models that run out of memory on cue, for the auto batch size tests (``model.factory``).

CPU tensors never raise ``torch.OutOfMemoryError`` in a test's budget, so these raise it
themselves, as the CUDA allocator would: above a micro-batch size that depends on the rank, or
once at a given training forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class OutOfMemoryOnCue(nn.Module):
    """A digits classifier with batch norm (running statistics) and dropout (random numbers), so
    that a search that left a trace in either would change the run's result.

    ``limits[r]``: rank r's largest micro-batch (beyond: out of memory; missing: no limit).
    ``late[r]``: the training forwards of rank r (counted from 1, trial steps included) that run
    out of memory once, whatever their size."""

    def __init__(self, limits: dict[int, int], late: dict[int, list[int]], hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, 10),
        )
        self.limits = limits
        self.late = late
        self.calls = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training and not isinstance(inputs, FakeTensor):  # the memory planner's fake forwards pass
            me = rank()
            limit = self.limits.get(me)
            if limit is not None and inputs.shape[0] > limit:
                raise torch.OutOfMemoryError(f"test: micro-batch {inputs.shape[0]} above {limit} on rank {me}")
            self.calls += 1
            if self.calls in self.late.get(me, []):
                raise torch.OutOfMemoryError(f"test: out of memory at forward {self.calls} on rank {me}")
        return self.net(inputs)


def oom_net(limits: list[int] | None = None, late: dict[str, list[int]] | None = None, hidden: int = 32) -> nn.Module:
    """``limits``: each rank's largest micro-batch, by rank; ``late``: {"rank": [forward, ...]}."""
    return OutOfMemoryOnCue(
        dict(enumerate(limits or [])), {int(r): list(calls) for r, calls in (late or {}).items()}, hidden
    )


class CudaHog(nn.Module):
    """A digits classifier whose training forward takes ``gb_per_sample`` GiB of GPU memory per
    sample, as a large model's activations would: the CUDA allocator itself runs out of memory
    above a micro-batch that depends on the GPU (the GPU battery's real out-of-memory)."""

    def __init__(self, gb_per_sample: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.bytes_per_sample = int(gb_per_sample * 2**30)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training and inputs.is_cuda:
            held = torch.empty(inputs.shape[0] * self.bytes_per_sample, dtype=torch.uint8, device=inputs.device)
            del held
        return self.net(inputs)


def cuda_hog(gb_per_sample: float = 1.0) -> nn.Module:
    return CudaHog(gb_per_sample)
