"""A user's regression data for tests: map-style sets of float inputs and two float targets per
sample (a linear function of the inputs each, on different scales and means, plus noise)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from trainforge.config import FactoryData
from trainforge.data import UserData

FEATURES = 6
NOISE_STD = 0.1


def rows(count: int, seed: int) -> TensorDataset:
    """``count`` samples: inputs (6,) standard normal, targets (2,): x @ w0 and 3 x @ w1 + 5, plus noise."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(FEATURES, 2, generator=torch.Generator().manual_seed(99))
    weights = weights / weights.norm(dim=0)
    inputs = torch.randn(count, FEATURES, generator=generator)
    targets = inputs @ weights * torch.tensor([1.0, 3.0]) + torch.tensor([0.0, 5.0])
    return TensorDataset(inputs, targets + NOISE_STD * torch.randn(count, 2, generator=generator))


def two_targets(data: FactoryData, seed: int) -> UserData:
    """1024 training and 256 validation samples, the same for every run seed."""
    return UserData(train=rows(1024, 1), val=rows(256, 2))
