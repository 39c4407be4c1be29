"""One optimizer step: micro-batches, autocast, grad scaler, clipping, non-finite skip.

Everything per step stays on the device (no ``.item()``): the loop reads the accumulated sums
only at its report interval, so the hot path has no host synchronisation on GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from trainforge.config import ParallelConfig
from trainforge.models import Task
from trainforge.worker.components import Optimization
from trainforge.worker.plan import ParallelPlan

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepTimes:
    """Seconds spent waiting for data, in forward/backward (incl. gradient all-reduce), in the optimizer."""

    data_s: float = 0.0
    compute_s: float = 0.0
    optim_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.data_s + self.compute_s + self.optim_s


@dataclass
class MetricSums:
    """Running sums over steps since the last report, kept as device tensors."""

    device: torch.device
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor | float) -> None:
        tensor = value.detach().to(self.device, torch.float64) if isinstance(value, torch.Tensor) else value
        self.values[name] = self.values.get(name, torch.zeros((), dtype=torch.float64, device=self.device)) + tensor

    def reset(self) -> None:
        self.values.clear()


class StepRunner:
    """Runs one optimizer step over k micro-batches so that k x b equals one batch of k*b."""

    def __init__(
        self,
        model: nn.Module,
        task: Task,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        device: torch.device,
        precision: str,
        grad_clip_norm: float | None,
        plan: ParallelPlan | None = None,
        channels_last: bool = False,
    ) -> None:
        self.model = model
        self.task = task
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.grad_clip_norm = grad_clip_norm
        self.autocast_dtype = AUTOCAST_DTYPES.get(precision)
        self.plan = plan or ParallelPlan(ParallelConfig(), device)
        self.memory_format = torch.channels_last if channels_last else None
        # Loss scaling is only needed for fp16: bf16 has fp32's exponent range.
        self.scaler = self.plan.make_scaler(enabled=precision == "fp16")
        self.params = [p for p in model.parameters() if p.requires_grad]

    @property
    def optim(self) -> Optimization:
        """Optimizer, schedule and scaler as one stateful component (for checkpoints)."""
        return Optimization(self.optimizer, self.scheduler, self.scaler)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def run(self, batches: Iterator[Sequence[torch.Tensor]], accum: int, sums: MetricSums) -> StepTimes | None:
        """Consume ``accum`` micro-batches and step; None when the iterator ends before the first one."""
        times = StepTimes()
        self.model.train()
        for micro in range(accum):
            start = time.perf_counter()
            try:
                inputs, targets = next(batches)
            except StopIteration:
                if micro == 0:
                    return None
                raise RuntimeError("data ran out inside an accumulation window") from None
            inputs = inputs.to(self.device, non_blocking=True)
            if self.memory_format is not None and inputs.ndim == 4:
                inputs = inputs.contiguous(memory_format=self.memory_format)
            targets = targets.to(self.device, non_blocking=True)
            times.data_s += time.perf_counter() - start

            start = time.perf_counter()
            last = micro == accum - 1
            # Gradients are communicated in backward; only the last micro-batch's needs to.
            with self.plan.gradient_sync(self.model, last):
                with self.autocast():
                    output = self.model(inputs)
                    loss = self.task.loss(output, targets)
                # Mean over the micro-batch divided by k: the summed gradient is the mean over k*b.
                self.scaler.scale(loss / accum).backward()
            stats = self.task.stats(output.detach(), targets)
            sums.add("loss_sum", loss.detach().float() * stats["count"])
            for name, value in stats.items():
                sums.add(name, value)
            times.compute_s += self._elapsed(start)

        start = time.perf_counter()
        grad_norm = self._unscale_and_clip()
        # The global norm is the same on every rank (plan.grad_norm), so this decision is rank-consistent.
        finite = torch.isfinite(grad_norm)
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # skips the update itself when grads hold inf/nan
            self.scaler.update()
        else:
            self._step_if_finite(finite)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        sums.add("grad_norm_sum", torch.where(finite, grad_norm, torch.zeros_like(grad_norm)))
        sums.add("skipped_steps", (~finite).double())
        sums.add("steps", 1.0)
        times.optim_s += self._elapsed(start)
        return times

    def _unscale_and_clip(self) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)
        return self.plan.grad_norm(self.params, self.grad_clip_norm)

    def _step_if_finite(self, finite: torch.Tensor) -> None:
        # One host sync per step, only when it matters: a non-finite loss must not reach the weights.
        if bool(finite):
            self.optimizer.step()

    def _elapsed(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start
