"""A model whose training forward is slower on one rank: a straggler a test can name
(failure.straggler, worker/straggler.py), the same under Ray Train and in gloo ranks without Ray."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn


class SlowRank(nn.Module):
    """Sleeps ``delay_s`` in each training forward, ``factor`` times longer on ``slow_rank``."""

    def __init__(self, inner: nn.Module, delay_s: float, slow_rank: int, factor: float) -> None:
        super().__init__()
        self.inner = inner
        self.delay_s = delay_s
        self.slow_rank = slow_rank
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            slow = dist.is_initialized() and dist.get_rank() == self.slow_rank
            time.sleep(self.delay_s * (self.factor if slow else 1.0))
        return self.inner(x)


def slow_rank_net(delay_s: float = 0.01, slow_rank: int = 1, factor: float = 5.0, hidden: int = 16) -> nn.Module:
    """A digits classifier ((B, 1, 8, 8) -> (B, 10)) whose rank ``slow_rank`` is a straggler."""
    inner = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return SlowRank(inner, delay_s, slow_rank, factor)
