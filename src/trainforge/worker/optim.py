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


# Optimizer hyperparameters a config sets, by optimizer, as torch names them in a param group.
GROUP_KEYS = {"sgd": ("momentum", "nesterov"), "adam": ("betas", "eps"), "adamw": ("betas", "eps")}


def hyperparameters_differ(saved: dict, cfg_optim: OptimConfig, cfg_schedule: ScheduleConfig) -> bool:
    """Whether a checkpoint's config (``saved``, a config dict) set other optimizer or schedule
    values than this run's: then restoring the optimizer and schedule state brought them back."""
    mine = {"optim": cfg_optim.model_dump(mode="json"), "schedule": cfg_schedule.model_dump(mode="json")}
    return any(saved.get(section) != values for section, values in mine.items())


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cfg: OptimConfig,
    lr: float,
) -> None:
    """Put this run's optimizer hyperparameters into a restored optimizer and schedule.

    ``load_state_dict`` restores the param groups (lr, initial_lr, weight decay, momentum, betas)
    and the schedule's base LRs of the run that saved the checkpoint. A run that starts from
    another run's checkpoint with its own values (a PBT exploit, a fine-tune) keeps the restored
    weights, moments and step count, but trains with its own values: base LR ``lr``, scaled by its
    own schedule at the restored step.
    """
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR), "build_scheduler makes LambdaLR schedules"
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch) if scheduler.last_epoch >= 0 else 1.0
    extra = GROUP_KEYS[cfg.name]
    for group in optimizer.param_groups:
        group["initial_lr"] = lr
        group["lr"] = lr * factor
        decays = any(param.ndim >= 2 for param in group["params"])
        group["weight_decay"] = cfg.weight_decay if decays else 0.0
        for key in extra:
            if key == "nesterov":
                group[key] = cfg.nesterov and cfg.momentum > 0
            elif key == "betas":
                group[key] = tuple(cfg.betas)
            else:
                group[key] = getattr(cfg, key)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
