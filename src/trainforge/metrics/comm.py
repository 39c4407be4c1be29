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

On CPU (gloo) the completion callback runs when the all-reduce is done, and wall clock is exact.
On CUDA (NCCL) it runs as soon as the collective is enqueued, so both ends are CUDA events
recorded on the streams involved, read only at report time (when they have long completed).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at registration
# and wants the real ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("trainforge.worker")


class CommTimer:
    """Collects (launch, done, is_last) per bucket; ``take`` turns them into per-step seconds."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: list[tuple[Any, Any, bool]] = []
        self.broken = False

    @classmethod
    def attach(cls, model: nn.Module, device: torch.device) -> "CommTimer | None":
        """Register on a DDP model; None for a single worker (no gradient communication) or when
        another communication hook is already registered (DDP allows one)."""
        if not isinstance(model, DistributedDataParallel):
            return None
        timer = cls(cuda=device.type == "cuda")
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
        launched = None if self.broken else self._safe_mark()
        is_last = bucket.is_last()
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        buffer.div_(group.size())  # type: ignore[union-attr]  # before the sum: no fp16 overflow
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            if launched is not None and not self.broken:
                finished = self._safe_mark()
                if finished is not None:
                    self.spans.append((launched, finished, is_last))
            return fut.value()[0]

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


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
