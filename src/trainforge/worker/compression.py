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

Resume: PowerSGD's state is the ``compression`` component: its step counter and generator (the
same on every rank) and each rank's own error feedback and P/Q matrices, by DDP bucket. Under
PowerSGD DDP keeps its initial bucket layout (``ddp_options``), so the buckets the state is keyed
by are those of a restarted DDP too, and a checkpoint from anywhere, inside the warm-up or after,
resumes bit-identically. When the state cannot be used (another worker count, other bucket sizes,
``parallel.static_graph``, a checkpoint written without it) the run goes on with two plain steps,
then compression from zero error, and says so (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, Field
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from trainforge.checkpoint.schema import MAX_STEP
from trainforge.checkpoint.state import State
from trainforge.config import ParallelConfig
from trainforge.metrics.worker.comm import ChosenHook, HookFn, register_hook
from trainforge.worker.components.base import Component, Restore, StateSchema

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun

CAST_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


def ddp_options(cfg: ParallelConfig) -> dict[str, Any]:
    """``DistributedDataParallel`` keyword arguments from ``parallel`` (only those set).

    Under PowerSGD DDP keeps the bucket layout it starts with: its state (error feedback, P/Q
    matrices) is kept by bucket, and a restarted DDP would otherwise compress its first step in the
    initial layout while the state is of the rebuilt one. DDP rebuilds its buckets after the first
    step only when it does not look for unused parameters (and the graph is not static); looking
    costs one traversal of the autograd graph per step."""
    options: dict[str, Any] = {}
    if cfg.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = cfg.bucket_cap_mb
    if cfg.static_graph:
        options["static_graph"] = True
    elif cfg.grad_compression == "powersgd":
        options["find_unused_parameters"] = True
    return options


@dataclass
class Compression:
    """The compression hook registered on the model (the all-reduce timer wraps it), and its state
    (PowerSGD's, or None)."""

    name: str
    hook: ChosenHook
    state: PowerSGDState | None = None
    warmup_steps: int = 0
    model: DistributedDataParallel | None = field(default=None, repr=False)
    fixed_buckets: bool = False  # DDP never rebuilds its buckets (ddp_options): the state's keys hold

    def describe(self) -> str:
        if self.state is None:
            return f"gradient compression {self.name}"
        rank = self.state.matrix_approximation_rank
        return f"gradient compression powersgd (rank {rank}, warm-up {self.warmup_steps} steps)"

    def bucket_sizes(self) -> str:
        """DDP's current bucket sizes in bytes (its own record of them)."""
        return str(self.model._get_ddp_logging_data().get("bucket_sizes", "")) if self.model is not None else ""

    @property
    def device(self) -> torch.device:
        first = next(self.model.parameters(), None) if self.model is not None else None
        return first.device if first is not None else torch.device("cpu")


class PowerSGDValues(StateSchema):
    iter: Annotated[int, Field(ge=0, le=MAX_STEP)]
    buckets: str  # DDP's bucket sizes when saved: the error feedback is keyed by these buckets
    # the generator PowerSGD draws its first Q matrices from (NumPy's MT19937 state)
    rng_keys: Annotated[list[Annotated[int, Field(ge=0, lt=2**32)]], Field(min_length=624, max_length=624)]
    rng_pos: Annotated[int, Field(ge=0, le=624)]
    rng_has_gauss: int
    rng_cached: float


class PowerSGDComponent(Component):
    """PowerSGD's state (``compression``): what makes a resumed run compress exactly as it would have."""

    name: ClassVar[str] = "compression"
    schema: ClassVar[type[BaseModel]] = PowerSGDValues

    def __init__(self, compression: Compression) -> None:
        assert compression.state is not None
        self.compression = compression
        self.state: PowerSGDState = compression.state

    @classmethod
    def from_run(cls, run: WorkerRun) -> PowerSGDComponent | None:
        compression = run.plan.compression
        return cls(compression) if compression is not None and compression.state is not None else None

    def state_dict(self) -> State:
        _, keys, pos, has_gauss, cached = self.state.rng.get_state(legacy=True)
        values = {
            "iter": self.state.iter,
            "buckets": self.compression.bucket_sizes(),
            "rng_keys": np.asarray(keys).tolist(),
            "rng_pos": int(pos),
            "rng_has_gauss": int(has_gauss),
            "rng_cached": float(cached),
        }
        own = None
        if self.state.error_dict or self.state.q_memory_dict:
            own = {
                "error": dict(self.state.error_dict),
                "p": dict(self.state.p_memory_dict),
                "q": dict(self.state.q_memory_dict),
            }
        return State(values, rank_tensors=own)

    def load_state_dict(self, state: State, restore: Restore) -> None:
        """Inside the warm-up nothing is kept yet: the counter goes on and compression starts
        where it would have (DDP's buckets are rebuilt after the first step of the restarted run,
        before it). After the warm-up, the error feedback and P/Q matrices come back when the
        buckets they are keyed by are the same."""
        saved = PowerSGDValues.model_validate(state.values)
        started = saved.iter >= self.compression.warmup_steps
        same_buckets = self.compression.fixed_buckets and saved.buckets == self.compression.bucket_sizes()
        if started and not (restore.same_ranks and state.rank_tensors is not None and same_buckets):
            self._start_over(restore, "its buckets or workers differ from the checkpoint's")
            return
        self.state.iter = saved.iter
        self.state.start_powerSGD_iter = self.compression.warmup_steps
        keys = np.asarray(saved.rng_keys, dtype=np.uint32)
        self.state.rng.set_state(("MT19937", keys, saved.rng_pos, saved.rng_has_gauss, saved.rng_cached))
        if started and state.rank_tensors is not None:
            device = self.compression.device
            for target, part in (
                (self.state.error_dict, "error"),
                (self.state.p_memory_dict, "p"),
                (self.state.q_memory_dict, "q"),
            ):
                target.clear()
                target.update({int(i): t.to(device) for i, t in state.rank_tensors[part].items()})

    def missing(self, restore: Restore) -> None:
        self._start_over(restore, "the checkpoint holds no PowerSGD state")

    def _start_over(self, restore: Restore, why: str) -> None:
        """PowerSGD counts on from the checkpoint's step without what it kept: compression starts no
        sooner than the second step from now (torch needs DDP's buckets rebuilt first, after one step)."""
        self.state.iter = restore.step
        self.state.start_powerSGD_iter = max(self.compression.warmup_steps, restore.step + 2)
        if restore.step >= self.compression.warmup_steps:
            restore.notes.append(
                f"powersgd: {why}: two plain steps, then compression from zero error "
                "(no longer bit-identical to an uninterrupted run)"
            )


def compress(model: DistributedDataParallel, cfg: ParallelConfig) -> Compression | None:
    """Register ``parallel.grad_compression``'s hook on ``model``; None for ``none``."""
    name = cfg.grad_compression
    if name == "none":
        return None
    if name != "powersgd":
        return Compression(name, register_hook(model, None, CAST_HOOKS[name]), model=model)  # None: the default group
    state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=cfg.powersgd.rank,
        start_powerSGD_iter=cfg.powersgd.warmup_steps,
    )
    hook = one_bucket_at_a_time(powerSGD_hook) if dist.get_backend() == "gloo" else powerSGD_hook
    fixed = ddp_options(cfg).get("find_unused_parameters", False)
    return Compression(name, register_hook(model, state, hook), state, cfg.powersgd.warmup_steps, model, fixed)


def one_bucket_at_a_time(hook: HookFn) -> HookFn:
    """``hook`` with each bucket's communication finished before the hook returns (see the module
    docstring: PowerSGD on gloo)."""

    def finished(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        reduced = hook(state, bucket).wait()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(reduced)
        return done

    return finished
