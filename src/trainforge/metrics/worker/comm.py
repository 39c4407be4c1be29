"""Gradient all-reduce timing through a DDP communication hook.

DDP all-reduces gradients in buckets while backward is still running. The hook below does what
DDP's own ``allreduce_hook`` does (divide by the world size, then sum) with a timestamp when a
bucket is handed to the process group and one when its all-reduce completes. Per step that
gives two honest figures:

* **in flight**: the union of the buckets' [launch, done] spans, i.e. time with communication
  under way. It overlaps backward compute, so it is an upper bound on what communication costs.
* **exposed**: from the launch of the step's last bucket (its gradients are the last that
  backward produces) to the completion of its all-reduce: time the step waits for communication
  after compute has finished. Collectives on one process group run in order, so the last
  bucket finishes last.

DDP allows one hook per model. When the plan chose a compression hook (``parallel.grad_compression``,
worker/compression.py), it registers it through :func:`register_hook`; the timer is handed that
:class:`ChosenHook` and wraps it instead of adding its own: both the compression and the timing stay on.

:class:`CommReport` (a worker hook) puts both figures into every report, as this rank's mean per
step over the report's span: ``perf/comm_s`` and ``perf/comm_exposed_s`` (rank 0's reach
metrics.jsonl, MLflow, the HTML report and ``trainforge bench scaling``; every rank's reach
Prometheus through ``local``).

On CPU (gloo) the completion callback runs when the all-reduce is done, and wall clock is exact.
On CUDA (NCCL) it runs as soon as the collective is enqueued, so both ends are CUDA events
recorded on the streams involved, read only at report time (when they have long completed).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at registration
# and wants the real ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainforge.protocol import Report

log = logging.getLogger("trainforge.worker")

# A communication hook as DDP calls it: (state, bucket) -> future of the bucket's reduced gradients.
HookFn = Callable[[Any, dist.GradBucket], "torch.futures.Future[torch.Tensor]"]


class CommTimer:
    """Collects (launch, done, is_last) per bucket; ``take`` turns them into per-step seconds."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: list[tuple[Any, Any, bool]] = []
        self.broken = False

    @classmethod
    def attach(cls, model: nn.Module, device: torch.device, chosen: "ChosenHook | None" = None) -> "CommTimer | None":
        """Register on a DDP model; None for a single worker (no gradient communication) or when
        another communication hook is already registered (DDP allows one)."""
        if not isinstance(model, DistributedDataParallel):
            return None
        timer = cls(cuda=device.type == "cuda")
        if chosen is not None:  # the plan's compression hook: time it rather than replace it
            chosen.timer = timer
            return timer
        try:
            model.register_comm_hook(None, timer.hook)
        except RuntimeError as err:
            log.info("gradient communication not timed: %s", err)
            return None
        return timer

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the one the collective or its callback runs on
        return event

    def hook(
        self, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's default all-reduce (as its ``allreduce_hook``: divide by the world size, then sum),
        timed. Timing never fails the collective: on any error it stops timing for the run."""
        group = process_group if process_group is not None else dist.group.WORLD

        def launch() -> torch.futures.Future[Any]:
            buffer = bucket.buffer()
            buffer.div_(group.size())  # type: ignore[union-attr]  # before the sum: no fp16 overflow
            return dist.all_reduce(buffer, group=group, async_op=True).get_future()

        return self.timed(bucket, launch)

    def timed(self, bucket: dist.GradBucket, launch: Callable[[], Any]) -> torch.futures.Future[torch.Tensor]:
        """``launch()``'s communication of ``bucket`` (a future of the tensor, or of a list holding
        it, as ``all_reduce`` gives), with its launch and completion times recorded."""
        launched = None if self.broken else self._safe_mark()
        is_last = bucket.is_last()
        future = launch()

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            if launched is not None and not self.broken:
                finished = self._safe_mark()
                if finished is not None:
                    self.spans.append((launched, finished, is_last))
            value = fut.value()
            return value[0] if isinstance(value, list) else value

        return future.then(done)

    def _safe_mark(self) -> Any:
        try:
            return self._mark()
        except Exception as err:  # timing is an observer: it must never break the all-reduce
            log.warning("gradient communication timing disabled: %s", err)
            self.broken = True
            return None

    def take(self, steps: float) -> tuple[float, float]:
        """Mean seconds per step (in flight, exposed) since the last call."""
        spans, self.spans = self.spans, []
        if not spans or steps <= 0:
            return 0.0, 0.0
        seconds = self._to_seconds(spans)
        exposed = sum(end - start for (start, end), (_, _, last) in zip(seconds, spans, strict=True) if last)
        return union_length(seconds) / steps, exposed / steps

    def _to_seconds(self, spans: list[tuple[Any, Any, bool]]) -> list[tuple[float, float]]:
        if not self.cuda:
            return [(start, end) for start, end, _ in spans]
        reference = spans[0][0]
        for _, end, _ in spans:
            end.synchronize()  # long done by now (the optimizer step waited for them); cheap
        return [(reference.elapsed_time(start) / 1e3, reference.elapsed_time(end) / 1e3) for start, end, _ in spans]


class CommReport:
    """Worker hook: this rank's gradient communication per step since the last report, into the
    report (``perf/comm_s``, ``perf/comm_exposed_s``) and into ``local`` (``comm_s``,
    ``comm_exposed_s``) for the hooks after it (Prometheus). Without a timer nothing is said,
    except with one worker, where 0 s is a measurement (there is no gradient communication)."""

    def __init__(self, timer: CommTimer | None) -> None:
        self.timer = timer

    def on_report(self, report: Report, local: dict[str, float]) -> None:
        steps = local.get("steps", 0.0)
        if not steps:
            return
        in_flight, exposed = self.timer.take(steps) if self.timer is not None else (0.0, 0.0)
        local["comm_s"], local["comm_exposed_s"] = in_flight, exposed
        report.figures["perf/comm_s"], report.figures["perf/comm_exposed_s"] = in_flight, exposed

    def on_save(self, outcome: Any) -> None:
        pass

    def close(self) -> None:
        pass


def comm_hooks(
    timing: bool, *, world: int, model: nn.Module, device: torch.device, chosen: "ChosenHook | None"
) -> list[CommReport]:
    """The communication figures' hook when ``metrics.comm_timing`` is on and there is something to
    say: a timer on the DDP model (wrapping ``chosen``, the plan's compression hook), or one worker."""
    if not timing:
        return []
    timer = CommTimer.attach(model, device, chosen)
    return [CommReport(timer)] if timer is not None or world == 1 else []


class ChosenHook:
    """The communication hook the plan chose (compression), registered on DDP through this object
    so that a :class:`CommTimer` attached later wraps it instead of being refused."""

    def __init__(self, state: Any, fn: HookFn) -> None:
        self.state = state
        self.fn = fn
        self.timer: CommTimer | None = None

    def hook(
        self, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        timer = self.timer
        if timer is None or timer.broken:
            return self.fn(self.state, bucket)
        return timer.timed(bucket, lambda: self.fn(self.state, bucket))


def register_hook(model: DistributedDataParallel, state: Any, fn: HookFn) -> ChosenHook:
    """Register ``fn`` (with its ``state``) as ``model``'s communication hook, timeable later."""
    chosen = ChosenHook(state, fn)
    model.register_comm_hook(None, chosen.hook)
    return chosen


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
