"""Peer (f): the workload as a LightningModule, trained by ``Trainer(strategy="ddp", accelerator="cpu")``.

Launched by ``bench peers`` as Lightning's docs launch a script on one machine, ``python -m
trainforge.bench._lightning_worker --workload JSON --out PATH --devices K``: Lightning starts the
other K-1 processes itself, with the same command. Its own defaults otherwise (logger,
end-of-training checkpoint, DistributedSampler); the progress bar and model summary are off, since
nobody reads them. Rank 0 writes its figure to PATH as JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from trainforge.bench.workload import StepClock, Workload, build, loss_of, make_optimizer, parse_args, write_result


class WorkloadModule(L.LightningModule):
    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model = model
        self.kind = kind

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = loss_of(self.model(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.model, self.kind)


class ClockCallback(L.Callback):
    """Ends a step on the StepClock after Lightning's optimizer step, as the other peers do."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.clock.step_done()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv, "Peer (f): Lightning's DDP strategy on CPU.")
    workload = Workload.from_json(args.workload)
    devices = args.devices
    torch.set_num_threads(1)
    dataset, model = build(workload)
    # shuffle=True: Lightning puts a DistributedSampler in (use_distributed_sampler), shuffling by epoch
    loader = DataLoader(dataset, batch_size=workload.batch_size, shuffle=True, drop_last=True)
    clock = StepClock(workload.batch_size * devices)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=devices,
        max_steps=workload.total_steps,
        callbacks=[ClockCallback(clock)],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(Path(args.out).parent / "lightning"),
    )
    trainer.fit(WorkloadModule(model, workload.kind), train_dataloaders=loader)
    if trainer.is_global_zero:
        write_result(args.out, clock.result())


if __name__ == "__main__":
    main()
