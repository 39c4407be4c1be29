"""Automatic batch size (``train.batch_size: auto``): the largest micro-batch that fits, and the
split of the global batch into micro-batches that follows from it.

The global batch is the user's (``train.global_batch_size``) and never changes: each
data-parallel rank's share of it, ``per_step``, is split into ``accum`` micro-batches of
``micro`` samples, ``micro`` a divisor of ``per_step``, so that micro x accum x ranks is exactly
the global batch and a step sees the same samples whatever the split.

* ``choose_batch`` (after restore, before the first step): a resumed run keeps its checkpoint's
  split. Otherwise each rank finds the largest micro-batch that fits on its own, without
  communicating (one rank's out-of-memory error must not leave the others in a collective): the
  memory planner's estimate (``worker/capacity/estimate.py``) against ``train.memory_limit_gb`` (CPU) or the
  device's memory (GPU) bounds it, then trial steps (forward and backward of real samples, no
  optimizer step) search down from that bound, catching ``torch.OutOfMemoryError``; on GPU the
  choice keeps a margin below the largest that passed. The ranks then agree on the smallest. When
  forwards communicate (FSDP gathers parameters, tensor parallelism splits matrices) there are no
  trials: the planner's estimate is the choice.
* ``shrink_after_oom`` (during training): after a step that ran out of memory on some rank (see
  ``StepRunner`` in ``worker/step.py``), the next smaller split, the same on every rank.

Trials leave the model, its buffers (batch-norm statistics), gradients and every random number
generator as they found them: the run is the one configured by hand with the chosen split.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from trainforge.checkpoint.state import capture_rng, restore_rng
from trainforge.data import collate_of
from trainforge.errors import ConfigError, ModelError
from trainforge.worker import collectives
from trainforge.worker.capacity.estimate import GIB, max_micro_batch, optimizer_states

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun

log = logging.getLogger("trainforge.worker")

GPU_MARGIN = 0.9  # on GPU, use at most this share of the largest micro-batch that passed a trial


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def largest_divisor_at_most(n: int, limit: float) -> int:
    """The largest divisor of ``n`` not above ``limit``; 0 when ``limit`` < 1."""
    return max((d for d in divisors(n) if d <= limit), default=0)


def choose_batch(run: WorkerRun) -> str | None:
    """Settle the data source's split under auto batch size; every rank calls it. The event to
    log (None when the batch size is configured). ConfigError on every rank when not even a
    micro-batch of one fits."""
    data, cfg = run.data, run.config
    if not cfg.train.auto_batch:
        return None
    trials = not forwards_communicate(run)
    run.runner.recover_oom = trials
    per_step = data.samples_per_step
    if data.batch_from == "checkpoint":
        return f"batch size auto: micro-batch {data.micro_batch} x {data.accum} accumulation steps, from the checkpoint"
    bound = planner_bound(run)
    candidates = [d for d in divisors(per_step) if d <= bound]
    found = largest_that_fits(run, candidates) if trials else max(candidates, default=0)
    if trials and run.device.type == "cuda" and found:
        found = largest_divisor_at_most(per_step, max(1.0, GPU_MARGIN * found))
    log.info("rank %d: the largest micro-batch that fits is %d (planner bound %d)", run.rank, found, bound)
    agreed = collectives.all_reduce_min(found, run.device)
    if agreed == 0:
        where = "train.memory_limit_gb" if run.device.type == "cpu" else "the device's memory"
        raise ConfigError(
            f"train.batch_size auto: not even a micro-batch of 1 fits in {where} on some worker; "
            "raise train.memory_limit_gb, use more workers or parallel.strategy fsdp, or a smaller model"
        )
    data.split(agreed)
    data.batch_from = "search"
    how = "trial steps" if trials else "the memory planner's estimate"
    return (
        f"batch size auto: micro-batch {data.micro_batch} x {data.accum} accumulation steps x "
        f"{run.data_world} workers = global batch {data.samples_per_step * run.data_world} ({how})"
    )


def shrink_after_oom(run: WorkerRun) -> str:
    """The next smaller split after a step ran out of memory: about half the micro-batch, twice the
    accumulation steps, the global batch unchanged. Every rank calls it after the same step, so
    all take the same split. Raises the out-of-memory error when the micro-batch is already 1."""
    data = run.data
    old = data.micro_batch
    smaller = largest_divisor_at_most(data.samples_per_step, old // 2)
    if smaller == 0:
        raise torch.OutOfMemoryError(f"out of memory with a micro-batch of {old}: nothing smaller to retry with")
    data.split(smaller)
    return (
        f"out of memory with micro-batch {old}: step retried with micro-batch {data.micro_batch} x "
        f"{data.accum} accumulation steps (global batch unchanged)"
    )


def forwards_communicate(run: WorkerRun) -> bool:
    """Whether a training forward is a collective (FSDP's parameter gathers, tensor parallelism,
    SyncBatchNorm's statistics): then no rank may run one alone, nor stop in one."""
    cfg = run.config
    return run.plan.eval_in_lockstep or cfg.parallel.tensor_parallel > 1 or cfg.train.sync_batchnorm


def planner_bound(run: WorkerRun) -> int:
    """The memory planner's largest micro-batch for this rank: against ``train.memory_limit_gb`` on
    CPU, the device's whole memory on GPU (where trial steps have the last word, so at least 1).
    A model the planner cannot trace gives no bound (the rank's whole share), with a warning."""
    cfg = run.config
    cuda = run.device.type == "cuda"
    memory = torch.cuda.get_device_properties(run.device).total_memory if cuda else cfg.train.memory_limit_gb * GIB
    try:
        bound = max_micro_batch(cfg, run.world, int(memory))
    except (RuntimeError, ValueError, TypeError, NotImplementedError, ModelError) as err:
        if run.rank == 0:
            log.warning("batch size auto: the memory planner could not estimate this model (%s); trial steps only", err)
        return run.data.samples_per_step
    return max(1, bound) if cuda else bound


def largest_that_fits(run: WorkerRun, candidates: list[int]) -> int:
    """The largest of ``candidates`` (ascending) whose trial step fits: the largest first (the
    common case is one trial), then a binary search below it; 0 when none does."""
    if not candidates:
        return 0
    with untouched(run):
        if fits(run, candidates[-1]):
            return candidates[-1]
        low, high = -1, len(candidates) - 2  # candidates[low] fits (-1: none known); above high none does
        while low < high:
            middle = (low + high + 1) // 2
            if fits(run, candidates[middle]):
                low = middle
            else:
                high = middle - 1
        return candidates[low] if low >= 0 else 0


def fits(run: WorkerRun, size: int) -> bool:
    """One trial step at micro-batch ``size``; False when it ran out of memory."""
    model = run.plan.eval_model(run.model)
    try:
        trial_step(run, model, size)
        ok = True
    except torch.OutOfMemoryError:
        ok = False  # leaving the handler releases the trial's frame, and its tensors with it
    for param in model.parameters():
        param.grad = None
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    log.debug("rank %d: trial step at micro-batch %d %s", run.rank, size, "fits" if ok else "ran out of memory")
    return ok


def trial_step(run: WorkerRun, model: torch.nn.Module, size: int) -> None:
    """Forward and backward of ``size`` real training samples on the plain module (no gradient
    communication), as the step runs them; no optimizer step."""
    batch = run.runner.on_device(trial_batch(run, size))
    with run.runner.autocast():
        loss, _ = run.task.train_step(model, batch)
    loss.backward()


def trial_batch(run: WorkerRun, size: int) -> Any:
    """``size`` samples from the start of the training set (repeated when it is smaller), batched
    as the loader batches them."""
    data = run.data.train_set
    return collate_of(data)([data[i % len(data)] for i in range(size)])


@contextlib.contextmanager
def untouched(run: WorkerRun) -> Iterator[None]:
    """Trials inside leave no trace: random generators, buffers (batch-norm statistics) and the
    train/eval mode restored, gradients dropped. On GPU the optimizer state a fresh run has yet to
    allocate is held meanwhile, so that trials see the memory the steps will."""
    model = run.plan.eval_model(run.model)
    rng = capture_rng()
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    mode = model.training
    reserved = optimizer_placeholders(run)
    model.train()
    try:
        yield
    finally:
        del reserved
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        for param in model.parameters():
            param.grad = None
        model.train(mode)
        restore_rng(rng)


def optimizer_placeholders(run: WorkerRun) -> list[torch.Tensor]:
    """Tensors the size of the optimizer state a fresh run allocates at its first step (GPU only:
    on CPU trials only catch errors, they do not measure)."""
    optimizer = run.runner.optimizer
    if run.device.type != "cuda" or any(optimizer.state.values()):
        return []
    slots, _ = optimizer_states(run.config)  # the planner's count of state tensors per parameter
    return [torch.empty_like(p) for group in optimizer.param_groups for p in group["params"] for _ in range(slots)]
