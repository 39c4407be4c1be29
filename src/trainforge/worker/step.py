"""One optimizer step: micro-batches, autocast, grad scaler, clipping, non-finite skip, and
(under auto batch size) a rank-consistent retry after running out of memory.

Everything per step stays on the device (no ``.item()``): the loop reads the accumulated sums
only at its report interval, so the hot path has no host synchronisation on GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainforge.config import ParallelConfig
from trainforge.data.augment import Augmenter
from trainforge.models import Task
from trainforge.models.tasks import to_device
from trainforge.worker import collectives
from trainforge.worker.anomaly import AnomalyGuard, Finding
from trainforge.worker.plan import ParallelPlan
from trainforge.worker.schedule import LRSchedule

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepTimes:
    """Seconds spent waiting for data, in forward/backward (incl. gradient all-reduce), in the optimizer."""

    data_s: float = 0.0
    compute_s: float = 0.0
    optim_s: float = 0.0
    forward_s: float = 0.0  # part of compute_s: this rank's own work, no peer waited for (worker/straggler.py)
    anomaly: Finding | None = None  # train.anomaly: the step was dropped (worker/anomaly.py)

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


RngState = tuple[torch.Tensor, torch.Tensor | None]


def capture_torch_rng(device: torch.device) -> RngState:
    """torch's CPU generator and, on a GPU, the device's: what dropout and the task draw from."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def restore_torch_rng(state: RngState, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class StepOutOfMemory(Exception):
    """Some rank ran out of memory in this step; every rank raises it at the same point, with the
    step's gradients dropped and nothing updated, so the loop can retry it with smaller micro-batches."""


class StepRunner:
    """Runs one optimizer step over k micro-batches so that k x b equals one batch of k*b."""

    def __init__(
        self,
        model: nn.Module,
        task: Task,
        optimizer: torch.optim.Optimizer,
        scheduler: LRSchedule,
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
        # Catch out-of-memory errors and retry the step (auto batch size, when forwards do not
        # communicate: worker/autobatch.py turns it on); otherwise they end the run.
        self.recover_oom = False
        # data.augment (data/augment.py): each training micro-batch's inputs, once on the device.
        self.augmenter: Augmenter | None = None
        # train.anomaly (worker/anomaly.py): each step's verdict before its optimizer step.
        self.guard: AnomalyGuard | None = None

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group, as the schedule left it."""
        return float(self.optimizer.param_groups[0]["lr"])

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def run(self, batches: Iterator[Any], accum: int, sums: MetricSums) -> StepTimes | None:
        """Consume ``accum`` micro-batches and step; None when the iterator ends before the first one."""
        times = StepTimes()
        self.model.train()
        # With recovery or the anomaly guard on, the step's figures join ``sums`` only once it went through.
        guard = self.guard
        step_sums = MetricSums(self.device) if self.recover_oom or guard is not None else sums
        oom = False
        # The guard's re-run needs the step's micro-batches, its random state and its loss.
        kept: list[Any] = []
        rng = capture_torch_rng(self.device) if guard is not None else None
        step_loss = torch.zeros((), device=self.device)
        forwards: list[tuple[float | torch.cuda.Event, float | torch.cuda.Event]] = []  # each forward's marks
        for micro in range(accum):
            last = micro == accum - 1
            if oom:  # out of memory on this rank: nothing more to compute, on to the agreement
                if last:
                    self._agree_on_memory(True)
                continue
            start = time.perf_counter()
            try:
                batch = self.on_device(next(batches))
            except StopIteration:
                if micro == 0:
                    return None
                raise RuntimeError("data ran out inside an accumulation window") from None
            times.data_s += time.perf_counter() - start
            if guard is not None:
                kept.append(batch)

            start = time.perf_counter()
            if self.plan.pipelined:  # forward and backward stage to stage, in one schedule step
                with self.plan.gradient_sync(self.model, last), self.autocast():
                    stats = self.plan.forward_backward(self.model, self.task, batch, accum)
                for name, value in stats.items():
                    step_sums.add(name, value)
                times.compute_s += self._elapsed(start)
                continue
            # Gradients are communicated in backward; only the last micro-batch's needs to.
            with self.plan.gradient_sync(self.model, last):
                forward_started = self._clock()
                forward = self._forward(batch)
                forwards.append((forward_started, self._clock()))
                if last and self.recover_oom:
                    self._agree_on_memory(forward is None)
                if forward is not None:
                    loss, stats = forward
                    if guard is not None:
                        step_loss = step_loss + loss.detach().float() / accum
                    # Mean over the micro-batch divided by k: the summed gradient is the mean over k*b.
                    if self._backward(loss / accum, last):
                        for name, value in stats.items():
                            step_sums.add(name, value)
                oom = forward is None or oom
            times.compute_s += self._elapsed(start)
        times.forward_s = sum(self._between(*marks) for marks in forwards)  # read after the sync above
        start = time.perf_counter()
        grad_norm = self._unscale_and_clip()
        if guard is not None and rng is not None:
            times.anomaly = guard.check(step_loss, grad_norm, lambda: self._rerun(kept, accum, rng))
            if times.anomaly is not None:
                self._drop_anomalous(sums)
                times.optim_s += self._elapsed(start)
                return times
        if self.recover_oom or guard is not None:
            for name, value in step_sums.values.items():
                sums.add(name, value)
        # The global norm is the same on every rank (plan.grad_norm), so this decision is rank-consistent.
        finite = torch.isfinite(grad_norm)
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # skips the update itself when grads hold inf/nan
            self.scaler.update()
        else:
            self._step_if_finite(finite)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # an optimizer step taken: the schedule decides whether its scheduler steps
        sums.add("grad_norm_sum", torch.where(finite, grad_norm, torch.zeros_like(grad_norm)))
        sums.add("skipped_steps", (~finite).double())
        sums.add("steps", 1.0)
        times.optim_s += self._elapsed(start)
        return times

    def _rerun(self, batches: list[Any], accum: int, rng: RngState) -> tuple[torch.Tensor, torch.Tensor]:
        """The step once more from the same weights, micro-batches and random state (every rank:
        the last backward synchronises): its loss and gradient norm. The random state after the
        first run is put back, so that the re-run changes no later draw."""
        after = capture_torch_rng(self.device)
        restore_torch_rng(rng, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        for micro, batch in enumerate(batches):
            with self.plan.gradient_sync(self.model, micro == len(batches) - 1):
                with self.autocast():
                    loss, _ = self.task.train_step(self.model, batch)
                self.scaler.scale(loss / accum).backward()
            step_loss = step_loss + loss.detach().float() / accum
        grad_norm = self.plan.grad_norm(self.params, None)
        if self.scaler.is_enabled():
            grad_norm = grad_norm / self.scaler.get_scale()
        restore_torch_rng(after, self.device)
        return step_loss, grad_norm

    def _drop_anomalous(self, sums: MetricSums) -> None:
        """An anomalous step is not taken: no update, its figures left out; it counts as a skipped
        step and the schedule moves on (a rollback restores the schedule with the rest)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler.is_enabled():
            self.scaler.update()  # closes the step the scaler unscaled; the next one may unscale again
        self.scheduler.step()
        sums.add("skipped_steps", 1.0)
        sums.add("steps", 1.0)

    def on_device(self, batch: Any) -> Any:
        """A training batch on the device: (inputs, targets) with the inputs augmented
        (data.augment) and in the model's memory format; a custom task's batch as it came."""
        if not self.task.supervised:
            return to_device(batch, self.device, non_blocking=True)
        inputs, targets = batch
        inputs = inputs.to(self.device, non_blocking=True)
        if self.augmenter is not None:
            inputs = self.augmenter(inputs)
        if self.memory_format is not None and inputs.ndim == 4:
            inputs = inputs.contiguous(memory_format=self.memory_format)
        return inputs, targets.to(self.device, non_blocking=True)

    def _caught(self, *, synchronising: bool = False) -> tuple[type[BaseException], ...]:
        return (torch.OutOfMemoryError,) if self.recover_oom and not synchronising else ()

    def _forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The loss and the batch's metric sums (the task's step); None when it ran out of memory
        (recover_oom only; otherwise it raises)."""
        try:
            with self.autocast():
                return self.task.train_step(self.model, batch)
        except self._caught():
            return None

    def _backward(self, loss: torch.Tensor, last: bool) -> bool:
        """False when it ran out of memory. Not caught in the last micro-batch's backward, which
        synchronises gradients: the other ranks would be left in its all-reduce."""
        try:
            self.scaler.scale(loss).backward()
            return True
        except self._caught(synchronising=last):
            return False

    def _agree_on_memory(self, oom: bool) -> None:
        """The step's one extra collective under recovery, after the last micro-batch's forward and
        before its gradient-synchronising backward: when any rank ran out of memory, every rank
        drops the step (StepOutOfMemory) here, at the same point, with no collective left open."""
        if self.any_rank(oom):
            self.plan.forget_step(self.model)
            self.drop_step()
            raise StepOutOfMemory

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one all-reduce; a host sync on GPU)."""
        if collectives.world_size() == 1:
            return flag
        return bool(collectives.all_reduce_sum([1.0 if flag else 0.0], self.device).item() > 0)

    def drop_step(self) -> None:
        """Forget the step's gradients and give the allocator's cached blocks back."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _unscale_and_clip(self) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)
        return self.plan.grad_norm(self.params, self.grad_clip_norm)

    def _step_if_finite(self, finite: torch.Tensor) -> None:
        # One host sync per step, only when it matters: a non-finite loss must not reach the weights.
        if bool(finite):
            self.optimizer.step()

    def _clock(self) -> float | torch.cuda.Event:
        """A mark of now: on a GPU an event in the stream (no sync: read once the step synchronised)."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _between(start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return float(start.elapsed_time(end)) / 1000.0
        assert isinstance(start, float) and isinstance(end, float)
        return end - start

    def _elapsed(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start
