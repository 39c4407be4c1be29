"""The workload every peer trains, the step loop the hand-written peers share, and their clock.

Two kinds (:data:`KINDS`): ``cnn``, a small CNN on synthetic images (samples/s), and ``lm``, the
Llama-style ``llama_tiny`` on synthetic token sequences (tokens/s). Peers (a), (b), (c) and (g)
run :func:`run_steps`, and (f) Lightning's own loop, with the same model, data set type, optimizer
and :class:`StepClock`; only the distribution layer around it differs. Peer (d) is trainforge
itself, configured by :func:`Workload.trainforge_config` and measured by trainforge's own ``Throughput``.

``python -m trainforge.bench.workload --workload JSON --threads K --out PATH`` runs peer (a), plain
PyTorch in one process, and writes its figure to PATH as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainforge.config import DataConfig, ModelConfig, parse_override, set_dotted

WARMUP_STEPS = 5  # the same as trainforge.worker.metrics.WARMUP_STEPS: these steps are not timed

AfterStep = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class Kind:
    """One workload kind: the model, the synthetic data, the optimizer (as trainforge's ``optim``
    section) and the unit its throughput is quoted in."""

    model: str
    model_kwargs: dict[str, Any]
    data: dict[str, Any]  # data.name synthetic's keys, less num_samples and val_fraction
    optim: dict[str, Any]
    batch_size: int  # per worker, the default
    steps: int  # timed steps, the default
    unit: str
    per_sample: int  # how many of ``unit``'s items one sample holds
    what: str


SEQ_LEN = 128
KINDS: dict[str, Kind] = {
    # small_cnn narrower than its default (32, 64, 128): about 80 ms of forward+backward per batch
    # of 64 on one core, so compute dominates per-step framework overhead without making runs long.
    "cnn": Kind(
        model="small_cnn",
        model_kwargs={"channels": [16, 32, 64]},
        data={"kind": "image", "input_shape": [3, 32, 32], "num_classes": 10},
        optim={"name": "sgd", "lr": 0.01, "momentum": 0.9},
        batch_size=64,
        steps=100,
        unit="samples/s",
        per_sample=1,
        what="synthetic 3x32x32 images",
    ),
    # configs/lm_stdlib.yaml's model, vocabulary size, window and optimizer, on synthetic token
    # sequences (data/synthetic.py: generated per index, nothing to prepare or download).
    "lm": Kind(
        model="llama_tiny",
        model_kwargs={},
        data={"kind": "tokens", "vocab_size": 4096, "seq_len": SEQ_LEN},
        optim={"name": "adamw", "lr": 0.003, "weight_decay": 0.1},
        batch_size=16,
        steps=40,
        unit="tokens/s",
        per_sample=SEQ_LEN,
        what=f"synthetic token sequences of {SEQ_LEN} (vocabulary 4096)",
    ),
}


@dataclass(frozen=True)
class Workload:
    """What every peer trains: the kind, per-worker batch, timed steps, data set size and seed."""

    batch_size: int = 64
    steps: int = 150
    num_samples: int = 20_000
    seed: int = 0
    kind: str = "cnn"
    overrides: tuple[str, ...] = ()  # ``--set key=value`` for trainforge's runs, (d) and (e)
    # The other peers' processes keep freed memory as trainforge's workers do (train.reuse_freed_memory):
    # the allocator held equal, so that a comparison shows the training loops alone.
    peers_reuse_freed_memory: bool = False

    @property
    def total_steps(self) -> int:
        return WARMUP_STEPS + self.steps

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]

    @classmethod
    def sized_for(cls, steps: int, batch_size: int, max_workers: int, kind: str = "cnn") -> Workload:
        """A workload whose data set holds exactly one epoch at the largest worker count, so no
        peer crosses an epoch boundary inside the timed window."""
        samples = (WARMUP_STEPS + steps) * batch_size * max_workers
        return cls(batch_size=batch_size, steps=steps, num_samples=samples, kind=kind)

    def data_config(self) -> DataConfig:
        return DataConfig(name="synthetic", **self.spec.data, num_samples=self.num_samples, val_fraction=0.0)

    def model_config(self) -> ModelConfig:
        return ModelConfig(name=self.spec.model, kwargs=dict(self.spec.model_kwargs))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        fields = json.loads(text)
        return cls(**{**fields, "overrides": tuple(fields.get("overrides", ()))})

    def trainforge_config(
        self, workers: int, name: str, output_dir: str, *, observed: bool | None = None
    ) -> dict[str, Any]:
        """The trainforge run that trains this workload: no validation, default reporting and
        checkpointing (one checkpoint, at the end); ``observed``: MLflow tracking and Prometheus
        metrics both on or both off (None: the config's defaults); then the ``--set`` overrides."""
        config: dict[str, Any] = {
            "run": {"name": name, "output_dir": output_dir},
            "model": self.model_config().model_dump(mode="json"),
            "data": self.data_config().model_dump(mode="json"),
            "train": {"max_steps": self.total_steps, "batch_size": self.batch_size},
            "optim": dict(self.spec.optim),
            "scaling": {"num_workers": workers},
            "failure": {"max_failures": 0},
            "seed": self.seed,
        }
        if observed is not None:
            config["tracking"] = {"enabled": observed}
            config["metrics"] = {"enabled": observed, "comm_timing": observed}
        for item in self.overrides:  # last: a --set wins over everything above
            key, value = parse_override(item)
            set_dotted(config, key, value, origin=f"--set {item}")
        return config


def build(workload: Workload) -> tuple[Dataset[Any], nn.Module]:
    """The training set and a freshly initialised model, both from trainforge's own builders; every
    peer but trainforge's own runs builds through here, in the process that trains."""
    from trainforge.data import build_datasets
    from trainforge.models import build_model

    if workload.peers_reuse_freed_memory:
        from trainforge.worker.allocator import apply

        apply(True)

    train_set, _, spec = build_datasets(workload.data_config(), workload.seed)
    torch.manual_seed(workload.seed)
    return train_set, build_model(workload.model_config(), spec)


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def make_optimizer(model: nn.Module, kind: str = "cnn") -> torch.optim.Optimizer:
    """The kind's optimizer as trainforge builds it from the same ``optim`` section: weight decay on
    matrices and kernels, none on biases and norms."""
    settings = dict(KINDS[kind].optim)
    optimizer = OPTIMIZERS[settings.pop("name")]
    decay = settings.pop("weight_decay", 0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return optimizer([group for group in groups if group["params"]], **settings)


def loss_of(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every prediction: one per image, or one per token position (B, T, V)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), targets.reshape(-1))


class StepClock:
    """Samples per second over all workers, from the end of warm-up step 5 to the end of the last
    step: the definition trainforge's ``Throughput`` uses, so every peer's figure means the same."""

    def __init__(self, global_batch: int, warmup: int = WARMUP_STEPS) -> None:
        self.global_batch = global_batch
        self.warmup = warmup
        self.steps = 0
        self.started: float | None = None
        self.last = 0.0
        self.first_at = 0.0  # unix time at the end of the first step (bench startup)

    def step_done(self) -> None:
        now = time.perf_counter()
        self.steps += 1
        if self.steps == 1:
            self.first_at = time.time()
        if self.steps == self.warmup:
            self.started = now
        self.last = now

    @property
    def timed_steps(self) -> int:
        return max(self.steps - self.warmup, 0)

    @property
    def timed_s(self) -> float:
        return self.last - self.started if self.started is not None else 0.0

    def result(self) -> dict[str, float]:
        rate = self.timed_steps * self.global_batch / self.timed_s if self.timed_s > 0 else 0.0
        return {
            "samples_per_s": rate,
            "timed_steps": self.timed_steps,
            "timed_s": self.timed_s,
            "first_step_unix": self.first_at,
        }


def run_steps(
    model: nn.Module,
    loader: Iterable[Sequence[torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    clock: StepClock,
    *,
    set_epoch: Callable[[int], None] | None = None,
    after_step: AfterStep | None = None,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    parts: Callable[[float, float, float], None] | None = None,
) -> None:
    """An ordinary training loop: epochs of shuffled batches, cross-entropy, backward, step.
    ``parts``: given each step's seconds waiting for data, in forward and backward, in the optimizer."""
    model.train()
    step = epoch = 0
    while step < total_steps:
        if set_epoch is not None:
            set_epoch(epoch)
        mark = time.perf_counter()
        for inputs, targets in loader:
            fetched = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model(inputs), targets)
            backward(loss)  # under DDP, gradients are all-reduced here
            computed = time.perf_counter()
            optimizer.step()
            if parts is not None:
                parts(fetched - mark, computed - fetched, time.perf_counter() - computed)
            step += 1
            clock.step_done()
            if after_step is not None:
                after_step(step, loss)
            if step >= total_steps:
                break
            mark = time.perf_counter()
        epoch += 1


def run_plain(workload: Workload, threads: int) -> dict[str, float]:
    """Peer (a): no distribution at all; k "workers" are k intra-op threads and a batch of k*b."""
    torch.set_num_threads(threads)
    dataset, model = build(workload)
    batch = workload.batch_size * threads
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True)
    clock = StepClock(batch)
    run_steps(model, loader, make_optimizer(model, workload.kind), workload.total_steps, clock)
    return clock.result()


def ray_train_loop(config: dict[str, Any]) -> dict[str, float] | None:
    """Peer (c): an idiomatic Ray Train loop; rank 0 returns its figure as the run's return value."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    workload = Workload.from_json(config["workload"])
    ctx = ray.train.get_context()
    dataset, model = build(workload)
    model = ray.train.torch.prepare_model(model)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(dataset, batch_size=workload.batch_size, shuffle=True, drop_last=True)
    )
    sampler = loader.sampler

    def set_epoch(epoch: int) -> None:
        if hasattr(sampler, "set_epoch"):  # a DistributedSampler once there is more than one worker
            sampler.set_epoch(epoch)

    def report(step: int, loss: torch.Tensor) -> None:
        if step % 100 == 0:
            ray.train.report({"step": step, "loss": loss.item()})

    clock = StepClock(workload.batch_size * ctx.get_world_size())
    optimizer = make_optimizer(model, workload.kind)
    run_steps(model, loader, optimizer, workload.total_steps, clock, set_epoch=set_epoch, after_step=report)
    return clock.result() if ctx.get_world_rank() == 0 else None


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result))


def parse_args(argv: Sequence[str] | None, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", required=True, help="The Workload as JSON.")
    parser.add_argument("--out", required=True, help="Where to write the measured figure as JSON.")
    parser.add_argument("--threads", type=int, default=1, help="Intra-op threads (peer a only).")
    parser.add_argument("--devices", type=int, default=1, help="Lightning's DDP processes (peer f only).")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv, "Peer (a): plain PyTorch in one process.")
    write_result(args.out, run_plain(Workload.from_json(args.workload), args.threads))


if __name__ == "__main__":
    main()
