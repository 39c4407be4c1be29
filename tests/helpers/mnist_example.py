"""The official PyTorch MNIST example's network (pytorch/examples, mnist/main.py), sized for the
8x8 digits: two convolutions, max-pooling, dropout, two linear layers, log-softmax. Named in
tests' configs as ``model.factory: tests.helpers.mnist_example:mnist_net``."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)
        self.delay_s = delay_s  # a training step slow enough for a test to act mid-run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.delay_s:
            time.sleep(self.delay_s)
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def mnist_net(delay_s: float = 0.0) -> nn.Module:
    return Net(delay_s)
