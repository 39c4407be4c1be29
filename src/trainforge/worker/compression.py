"""DDP's gradient communication as configured: a compression hook, the bucket size, the static graph.

``parallel.grad_compression`` picks one of PyTorch's DDP communication hooks:

* ``bf16`` / ``fp16``: each bucket is cast to 16 bits, divided by the world size, all-reduced and
  cast back: half the bytes, a rounding error per step (bf16 keeps fp32's range, fp16 its
  precision).
* ``powersgd``: every gradient matrix M (n x m) is sent as two thin factors P (n x r) and Q (m x r),
  ``parallel.powersgd.rank`` r, with the error the approximation left fed back into the next step;
  vectors (biases, norms) are all-reduced whole. For ``parallel.powersgd.warmup_steps`` steps it
  all-reduces plainly (torch's ``start_powerSGD_iter``).

The hook goes through ``metrics.comm.register_hook`` and the plan keeps it (``Compression.hook``):
the all-reduce timer (``metrics.comm_timing``) is handed it and wraps it rather than being refused,
as DDP takes one hook per model.

On gloo (CPU) PowerSGD runs one bucket at a time: torch's hook waits, inside gloo's worker
threads, for the all-reduces it starts, so two buckets in flight take both of gloo's threads and
the all-reduces they wait for never run. DDP's first bucket is 1 MiB, so any model with more
gradient bytes than that has two; on the namespace cluster such a run hung in its first
compressed step. Waiting for each bucket in the hook costs its overlap with the backward.

Resume: PowerSGD's step counter is set from the checkpoint's step; its error feedback and Q
matrices are not saved. A checkpoint written at least two steps before the warm-up ends resumes
bit-identically; one written later continues with two plain steps (DDP rebuilds its buckets after
the first), then compression from zero error (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from trainforge.config import ParallelConfig
from trainforge.metrics.worker.comm import ChosenHook, HookFn, register_hook

CAST_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


def ddp_options(cfg: ParallelConfig) -> dict[str, Any]:
    """``DistributedDataParallel`` keyword arguments from ``parallel`` (only those set)."""
    options: dict[str, Any] = {}
    if cfg.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = cfg.bucket_cap_mb
    if cfg.static_graph:
        options["static_graph"] = True
    return options


@dataclass
class Compression:
    """The compression hook registered on the model (the all-reduce timer wraps it), and its state
    (PowerSGD's, or None)."""

    name: str
    hook: ChosenHook
    state: PowerSGDState | None = None
    warmup_steps: int = 0

    def resume_at(self, step: int) -> None:
        """After a restore at ``step``: PowerSGD counts on from there. Compression starts no sooner
        than the second step from now (torch needs DDP's buckets rebuilt first, after one step)."""
        if self.state is None:
            return
        self.state.iter = step
        self.state.start_powerSGD_iter = max(self.warmup_steps, step + 2)

    def describe(self) -> str:
        if self.state is None:
            return f"gradient compression {self.name}"
        rank = self.state.matrix_approximation_rank
        return f"gradient compression powersgd (rank {rank}, warm-up {self.warmup_steps} steps)"


def compress(model: DistributedDataParallel, cfg: ParallelConfig) -> Compression | None:
    """Register ``parallel.grad_compression``'s hook on ``model``; None for ``none``."""
    name = cfg.grad_compression
    if name == "none":
        return None
    if name != "powersgd":
        return Compression(name, register_hook(model, None, CAST_HOOKS[name]))  # None: the default group
    state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=cfg.powersgd.rank,
        start_powerSGD_iter=cfg.powersgd.warmup_steps,
    )
    hook = one_bucket_at_a_time(powerSGD_hook) if dist.get_backend() == "gloo" else powerSGD_hook
    return Compression(name, register_hook(model, state, hook), state, cfg.powersgd.warmup_steps)


def one_bucket_at_a_time(hook: HookFn) -> HookFn:
    """``hook`` with each bucket's communication finished before the hook returns (see the module
    docstring: PowerSGD on gloo)."""

    def finished(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        reduced = hook(state, bucket).wait()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(reduced)
        return done

    return finished
