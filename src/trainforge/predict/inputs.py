"""What ``trainforge predict`` needs from a config: the bytes each step exchanges and the compute it hides them behind.

Gradient and parameter bytes come from the config's model built on the meta device (shapes and
dtypes, no storage), or from ``--model-params`` for a model trainforge does not build. Compute
time per step is measured in this process (the config's model at its per-GPU micro-batch: one
warm-up and ``steps`` timed optimizer steps, the median), or given as ``--step-time``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.data import default_collate

from trainforge.config import Config
from trainforge.data import DataSpec, PairDataset, build_datasets
from trainforge.errors import TrainforgeError
from trainforge.models import build_model, build_task
from trainforge.predict.model import DDP_BUCKET_BYTES, Workload
from trainforge.worker.blocks import repeated_blocks
from trainforge.worker.optim import build_optimizer

FP32_BYTES = 4
MIB = 1024 * 1024


@dataclass(frozen=True)
class ModelBytes:
    parameters: int  # trainable
    grad_bytes: int  # reduced per step
    param_bytes: int  # FSDP: gathered per pass
    units: int  # FSDP units: repeated blocks plus the root
    source: str  # "config model <name>" or "--model-params"


def datasets(config: Config, otherwise: str) -> tuple[PairDataset, DataSpec]:
    """The training set and its spec (the model's shapes), or one line saying what else works."""
    try:
        train_set, _, spec = build_datasets(config.data, config.seed)
    except TrainforgeError as err:
        raise TrainforgeError(f"{err} ({otherwise})") from None
    return train_set, spec


def per_gpu_batch(config: Config) -> tuple[int, int]:
    """(micro-batch, micro-batches per step) of one GPU."""
    if config.train.batch_size == "auto":
        raise TrainforgeError(
            "train.batch_size: auto is chosen on the GPUs at run time; predict needs a number "
            "(--set train.batch_size=N)"
        )
    return int(config.train.batch_size), config.train.grad_accum_steps


def model_bytes(config: Config, model_params: int | None) -> ModelBytes:
    """Trainable parameters and the bytes DDP or FSDP exchange for them per step."""
    parallel = config.parallel
    compression = getattr(parallel, "grad_compression", "none")
    halved = parallel.strategy == "ddp" and compression in ("bf16", "fp16")  # the hook sends 16-bit gradients
    gathered = 2 if parallel.strategy == "fsdp" and parallel.fsdp.mixed_precision == "bf16" else None
    if model_params is not None:
        grad = model_params * FP32_BYTES
        return ModelBytes(
            model_params,
            grad // 2 if halved else grad,
            model_params * (gathered or FP32_BYTES),
            max(1, math.ceil(grad / DDP_BUCKET_BYTES)),
            "--model-params (float32)",
        )
    _, spec = datasets(config, "or describe the model with --model-params N and --step-time S")
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(config.model, spec)
    trainable = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    grad = sum(p.numel() * p.element_size() for p in trainable)
    units = len(repeated_blocks(model, parallel.fsdp.wrap)) + 1
    return ModelBytes(
        numel,
        grad // 2 if halved else grad,
        numel * gathered if gathered else grad,
        units,
        f"config model {config.model.name or config.model.factory}",
    )


def measure_compute(config: Config, steps: int = 3) -> float:
    """Median seconds of one optimizer step of the config's model on this machine, at the per-GPU batch."""
    micro, accumulate = per_gpu_batch(config)
    train_set, spec = datasets(config, "or give --step-time: predict then times nothing")
    use_cuda = config.scaling.use_gpu and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(config.model, spec).to(device)
        task = build_task(config.model, spec)
    optimizer = build_optimizer(config.optim, model, config.optim.lr)
    inputs, targets = (t.to(device) for t in default_collate([train_set[i % len(train_set)] for i in range(micro)]))
    autocast = config.precision in ("bf16", "fp16")
    dtype = torch.bfloat16 if config.precision == "bf16" else torch.float16

    def one_step() -> None:
        for _ in range(accumulate):
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = task.loss(model(inputs), targets) / accumulate
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if use_cuda:
            torch.cuda.synchronize(device)

    model.train()
    one_step()  # warm-up: allocations, lazy initialisation
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        one_step()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def train_samples(config: Config) -> int | None:
    """Samples in one epoch of the config's training set, or None when it cannot be built here."""
    try:
        train_set, _, _ = build_datasets(config.data, config.seed)
    except TrainforgeError:
        return None
    return len(train_set)


def workload_of(config: Config, model: ModelBytes, compute_s: float) -> Workload:
    micro, accumulate = per_gpu_batch(config)
    cap_mb = getattr(config.parallel, "bucket_cap_mb", None)
    sync = getattr(config.parallel, "sync", None)
    return Workload(
        strategy=config.parallel.strategy,
        compute_s=compute_s,
        samples_per_gpu=micro * accumulate,
        grad_bytes=model.grad_bytes,
        param_bytes=model.param_bytes,
        micro_batches=accumulate,
        bucket_bytes=int(cap_mb * MIB) if cap_mb else DDP_BUCKET_BYTES,
        units=model.units,
        reshard_after_forward=config.parallel.fsdp.reshard_after_forward,
        sync_every_n_steps=sync.every_n_steps if sync is not None else 0,
    )
