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
from torch import nn

from trainforge.config import Config
from trainforge.data import DataSpec, PairDataset, build_datasets, collate_of
from trainforge.errors import TrainforgeError
from trainforge.models import build_model, build_task
from trainforge.models.tasks import to_device
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
    # the hidden states of one sample between pipeline stages (float32: pipelines run in fp32); 0 unknown
    stage_bytes_per_sample: int = 0


class TrainingSet:
    """The config's training set and its spec (the model's shapes), built at most once and only
    when something needs it: the model's bytes, the compute measure and the epoch's size share it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._built: tuple[PairDataset, DataSpec] | None = None
        self._error: TrainforgeError | None = None

    def get(self, otherwise: str) -> tuple[PairDataset, DataSpec]:
        """The set and its spec, or one line saying what works without it (``otherwise``)."""
        if self._built is None and self._error is None:
            try:
                train_set, _, spec = build_datasets(self.config.data, self.config.seed)
                self._built = (train_set, spec)
            except TrainforgeError as err:
                self._error = err
        if self._error is not None:
            raise TrainforgeError(f"{self._error} ({otherwise})") from None
        assert self._built is not None
        return self._built


def per_gpu_batch(config: Config) -> tuple[int, int]:
    """(micro-batch, micro-batches per step) of one GPU."""
    if config.train.batch_size == "auto":
        raise TrainforgeError(
            "train.batch_size: auto is chosen on the GPUs at run time; predict needs a number "
            "(--set train.batch_size=N)"
        )
    if config.train.global_batch_size is not None:
        raise TrainforgeError(
            "train.global_batch_size divides one batch over however many GPUs there are; predict models a "
            "fixed batch per GPU: --set train.global_batch_size=null and set train.grad_accum_steps"
        )
    return int(config.train.batch_size), config.train.grad_accum_steps


def model_bytes(config: Config, model_params: int | None, data: TrainingSet | None = None) -> ModelBytes:
    """Trainable parameters and the bytes DDP or FSDP exchange for them per step."""
    parallel = config.parallel
    # the bf16/fp16 hooks send 16-bit gradients
    halved = parallel.strategy == "ddp" and parallel.grad_compression in ("bf16", "fp16")
    gathered = 2 if parallel.strategy == "fsdp" and parallel.fsdp.mixed_precision == "bf16" else None
    if model_params is not None:
        if parallel.pipeline is not None:
            raise TrainforgeError(
                "parallel.pipeline: predict reads what a stage sends from the config's model (its width); "
                "drop --model-params"
            )
        grad = model_params * FP32_BYTES
        return ModelBytes(
            model_params,
            grad // 2 if halved else grad,
            model_params * (gathered or FP32_BYTES),
            max(1, math.ceil(grad / DDP_BUCKET_BYTES)),
            "--model-params (float32)",
        )
    _, spec = (data or TrainingSet(config)).get("or describe the model with --model-params N and --step-time S")
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
        stage_bytes(model, spec),
    )


def stage_bytes(model: nn.Module, spec: DataSpec) -> int:
    """A built-in decoder's hidden states for one sample (width x tokens, float32), what a
    pipeline stage sends to the next; 0 for another model."""
    width = int(getattr(getattr(getattr(model, "model", None), "config", None), "hidden_size", 0) or 0)
    tokens = spec.seq_len or (spec.input_shape[-1] if spec.input_shape else 0)
    return width * tokens * FP32_BYTES if spec.kind == "tokens" else 0


def measure_compute(config: Config, steps: int = 3, data: TrainingSet | None = None) -> float:
    """Median seconds of one optimizer step of the config's model on this machine, at the per-GPU batch."""
    micro, accumulate = per_gpu_batch(config)
    train_set, spec = (data or TrainingSet(config)).get("or give --step-time: predict then times nothing")
    use_cuda = config.scaling.use_gpu and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(config.model, spec).to(device)
        task = build_task(config.model, spec, model)
    optimizer = build_optimizer(config.optim, model, config.optim.lr)
    batch = to_device(collate_of(train_set)([train_set[i % len(train_set)] for i in range(micro)]), device)
    autocast = config.precision in ("bf16", "fp16")
    dtype = torch.bfloat16 if config.precision == "bf16" else torch.float16

    def one_step() -> None:
        for _ in range(accumulate):
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = task.train_step(model, batch)[0] / accumulate
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


def train_samples(config: Config, data: TrainingSet | None = None) -> int | None:
    """Samples in one epoch of the config's training set, or None when it cannot be built here."""
    try:
        train_set, _ = (data or TrainingSet(config)).get("")
    except TrainforgeError:
        return None
    return len(train_set)


def workload_of(config: Config, model: ModelBytes, compute_s: float) -> Workload:
    micro, accumulate = per_gpu_batch(config)
    cap_mb = config.parallel.bucket_cap_mb
    sync = config.parallel.sync
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
        shard_group=shard_group(config),
        **pipeline_of(config, model, micro),
    )


def pipeline_of(config: Config, model: ModelBytes, micro: int) -> dict[str, int]:
    """The Workload's pipeline fields: stages, pipeline micro-batches, the bytes of the hidden
    states one pipeline micro-batch sends to the next stage, and the stages each GPU holds."""
    pipeline = config.parallel.pipeline
    if pipeline is None:
        return {}
    sent = micro // pipeline.microbatches * model.stage_bytes_per_sample
    if config.parallel.strategy == "fsdp" and config.parallel.fsdp.mixed_precision == "bf16":
        sent //= 2  # the stages compute, and so send, in bf16
    return {
        "stages": pipeline.stages,
        "pipeline_microbatches": pipeline.microbatches,
        "p2p_bytes": sent,
        "virtual_stages": pipeline.per_worker,
    }


def shard_group(config: Config) -> int:
    """HSDP's GPUs per shard group (``scaling.num_workers / parallel.fsdp.replicate``, of a stage's
    under a pipeline); 0 without HSDP."""
    replicate = config.parallel.fsdp.replicate
    if config.parallel.strategy != "fsdp" or replicate == 1:
        return 0
    return config.scaling.max_workers // config.parallel.stages // replicate
