"""Optimizer and LR schedule built from their config sections."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from trainforge.config import OptimConfig, ScheduleConfig


def effective_lr(cfg: OptimConfig, global_batch: int) -> float:
    """The configured LR, scaled linearly with the global batch if asked (Goyal et al. 2017)."""
    if cfg.lr_scaling == "linear":
        return cfg.lr * global_batch / cfg.base_batch_size
    return cfg.lr


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    # Weight decay on matrices and convolution kernels only, as is standard for biases and norms.
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps)


def lr_multiplier(cfg: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """step -> factor on the base LR: linear warmup, then the named decay."""
    decay_steps = max(1, total_steps - cfg.warmup_steps)

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
        if cfg.name == "constant":
            return 1.0
        if cfg.name == "step":
            return float(cfg.gamma ** ((step - cfg.warmup_steps) // cfg.step_size))
        if cfg.name == "cosine":
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * (1 - progress)

    return factor


def build_scheduler(
    cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, total_steps))
