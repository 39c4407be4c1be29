"""Building one worker's components from the config: data, model, task, parallel plan, optimizer, schedule."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import ray.train
import ray.train.torch
import torch
from torch import nn

from trainforge.checkpoint.state import capture_rng, restore_rng
from trainforge.config import Config, ParallelConfig
from trainforge.data import build_datasets, collate_of
from trainforge.data.augment import augment_of, build_augmenter
from trainforge.data.registry import source_of
from trainforge.data.stream import StreamFeed, StreamShape
from trainforge.errors import ConfigError
from trainforge.models import Task, build_model, build_task
from trainforge.models.lora import apply_lora
from trainforge.models.pretrained import (
    PeakMemory,
    check_pretrained,
    load_pretrained,
    materialize,
    parameters_on_meta,
)
from trainforge.models.task_registry import check_fits
from trainforge.models.tasks import to_device
from trainforge.protocol import ParameterCounts
from trainforge.worker import collectives
from trainforge.worker.allocator import apply as apply_allocator
from trainforge.worker.anomaly import AnomalyGuard
from trainforge.worker.blocks import channels_last_wanted, repeated_blocks
from trainforge.worker.components.base import Component
from trainforge.worker.components.data import DataSource
from trainforge.worker.components.training import Progress
from trainforge.worker.optim import build_optimizer, effective_lr, group_parameters
from trainforge.worker.params import freeze
from trainforge.worker.pipeline import PipelinePlan, check_pipeline
from trainforge.worker.plan import ParallelPlan, all_reduce_max, build_plan
from trainforge.worker.registry import build_components
from trainforge.worker.schedule import build_scheduler
from trainforge.worker.step import MetricSums, StepRunner
from trainforge.worker.tp import Layout, check_tensor_parallel

log = logging.getLogger("trainforge.worker")


@dataclass
class WorkerRun:
    """The components of one worker's run, each built from its config section."""

    config: Config
    rank: int
    world: int
    device: torch.device
    model: nn.Module
    task: Task
    runner: StepRunner
    data: DataSource
    total_steps: int
    plan: ParallelPlan = field(default_factory=lambda: ParallelPlan(ParallelConfig(), torch.device("cpu")))
    # Every stateful component by name (worker/registry.py): what a checkpoint saves and restores.
    components: dict[str, Component] = field(default_factory=dict)
    parameters: ParameterCounts | None = None  # trainable and frozen (model.freeze), for the reports

    @property
    def val_set(self) -> Any:
        return self.data.val_set

    @property
    def data_world(self) -> int:
        """How many different batches one step reads: the workers over the tensor-parallel size."""
        return self.plan.layout.dp

    @property
    def progress(self) -> Progress:
        return cast(Progress, self.components["progress"])

    def after_step(self, step: int) -> None:
        """Every component's part after an optimizer step (local SGD's sync, the weights' average)."""
        for component in self.components.values():
            component.after_step(step)

    def finish(self, step: int) -> bool:
        """Every component's part at the end of a finished run (local SGD's last sync); whether
        any changed the weights."""
        changed = [component.finish(step) for component in self.components.values()]
        return any(changed)


def build(
    config: Config,
    ranks: tuple[int, int] | None = None,
    *,
    stream: dict[str, Any] | None = None,
    feed: StreamFeed | None = None,
    marks: dict[str, float] | None = None,
) -> WorkerRun:
    """One worker's run; ``ranks`` (rank, world) outside Ray Train (a test's own gloo group).

    A streamed source (data/stream.py) comes as the driver's ``stream`` shape, read through Ray
    Train's dataset shards, or (outside Ray Train) as a ready ``feed``. ``marks`` (rank 0's
    start-up, driver/startup.py) gets when the data and the model were ready.
    """
    if ranks is None:
        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
    else:
        rank, world = ranks
    torch.set_num_threads(config.train.threads_per_worker)
    allocator = apply_allocator(config.train.reuse_freed_memory)
    if allocator is not None and rank == 0:
        log.info("allocator: %s", allocator)
    device = torch.device("cpu")
    if config.scaling.use_gpu:  # Ray Train's device, or (outside Ray: a test's own NCCL group) the current one
        device = ray.train.torch.get_device() if ranks is None else torch.device("cuda", torch.cuda.current_device())
    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False

    layout = Layout(rank, world, config.parallel.tensor_parallel, pp=config.parallel.stages)
    # A tensor-parallel group reads one batch: the data is split over the data-parallel ranks.
    if stream is not None and feed is None:
        feed = StreamFeed(
            StreamShape.from_dict(stream),
            ray.train.get_dataset_shard("train"),
            ray.train.get_dataset_shard("val") if stream["val_rows"] else None,
            config.data,
            seed=config.seed,
            rank=rank,
            world=world,
        )
    data = DataSource.build(config, layout.dp_rank, layout.dp, pin_memory=pin_memory(config, device), feed=feed)
    if data.feed is not None and data.batch_from == "config":
        # Ray Data starts its reads now, while the model is built, not at the first step.
        data.feed.prime(data.micro_batch, pin_memory=data.pin_memory)
    if marks is not None:
        marks["data"] = time.time()
    # Same seed on every rank for the weights; DDP also broadcasts rank 0's copy.
    seed_all(config.seed)
    # FSDP with weights that fill every parameter: build on the meta device and give memory only
    # to each rank's shards (models/pretrained.py), not a whole random copy per rank first.
    deferred = defers_weights(config, world)
    with parameters_on_meta() if deferred else contextlib.nullcontext():
        plain = build_model(config.model, data.spec)
    task = build_task(config.model, data.spec, plain)
    if config.model.lora is not None:
        # The base weights first, by their own names; then the adapters (which rename the layers
        # they adapt to <layer>.base_layer), the only parameters that train and are saved.
        read_pretrained(plain, config, rank)
        adapted = apply_lora(plain, config.model.lora)
        log.info("rank %d: model.lora: adapters on %d layers", rank, adapted)
    parameters = freeze(plain, config.model.freeze)  # before wrapping: DDP and FSDP see what trains
    if data.feed is None:  # a map-style set: its first sample, read with every generator kept
        drawn = capture_rng()
        try:
            check_fits(plain, config.model, data.spec, data.train_set[0], task)
        finally:
            restore_rng(drawn)
    # parallel.channels_last: auto resolved for this model and layout
    parallel = config.parallel.model_copy(update={"channels_last": channels_last_wanted(config)})
    if parallel.pipeline is not None:
        plan: ParallelPlan = PipelinePlan(parallel, device, layout=layout)
    else:
        plan = build_plan(parallel, device, sync_batchnorm=config.train.sync_batchnorm, layout=layout)
    plan.adapters_only = config.model.lora is not None
    model = plan.wrap(plain)
    for note in plan.notes:  # how the model is spread: each rank's own (a pipeline's stages differ)
        log.info("%s: %s", plan.layout_name, note)
    if config.model.lora is None:
        # After wrapping: each rank reads only the shards it keeps. Before the components: the
        # weights' average (train.ema) starts from the pretrained weights.
        read_pretrained(plain, config, rank, materialize_on=device if deferred else None)
    # Per-replica streams from here on (dropout, augmentation), reproducible per data-parallel
    # rank; the ranks of a tensor-parallel group share theirs, so their replicated parts agree.
    seed_all(config.seed * 1000 + layout.dp_rank + 1)

    epochs_steps = (config.train.epochs or math.inf) * data.steps_per_epoch
    total_steps = int(min(config.train.max_steps or math.inf, epochs_steps))
    global_batch = data.samples_per_step * layout.dp
    # Over the module under the wrapper: the same parameters, by the plain model's names.
    optimizer = build_optimizer(config.optim, plan.eval_model(model), effective_lr(config.optim, global_batch))
    if config.schedule.monitor is not None and data.val_set is None:
        raise ConfigError(f"schedule.monitor {config.schedule.monitor} needs validation data; this run has none")
    scheduler = build_scheduler(config.schedule, optimizer, total_steps, data.steps_per_epoch)
    runner = StepRunner(
        model,
        task,
        optimizer,
        scheduler,
        device=device,
        precision=config.precision,
        grad_clip_norm=config.train.grad_clip_norm,
        plan=plan,
        channels_last=parallel.channels_last is True,
    )
    runner.augmenter = build_augmenter(augment_of(config.data), data.spec)
    run = WorkerRun(config, rank, world, device, model, task, runner, data, total_steps, plan, parameters=parameters)
    run.components = build_components(run)
    runner.guard = cast(AnomalyGuard | None, run.components.get(AnomalyGuard.name))  # train.anomaly
    if marks is not None:
        marks["model"] = time.time()
    return run


def check_block_names(config: Config) -> None:
    """``parallel.fsdp.wrap`` names classes of the model, ``parallel.tensor_parallel`` needs a
    plan and heads it divides: build the model on the meta device (no memory, no weights) and
    look, so that a mistake fails before Ray starts. One-line errors naming what exists."""
    parallel = config.parallel
    if not parallel.fsdp.wrap and parallel.tensor_parallel == 1 and parallel.pipeline is None:
        return
    _, _, spec = build_datasets(config.data, config.seed)
    with torch.device("meta"):
        model = build_model(config.model, spec)
    if parallel.fsdp.wrap:
        repeated_blocks(model, parallel.fsdp.wrap)
    if parallel.tensor_parallel > 1:
        check_tensor_parallel(model, parallel.tensor_parallel, parallel.tp_plan)
    if parallel.pipeline is not None:
        check_pipeline(model, parallel.pipeline.parts, parallel.pipeline.split, parallel.pipeline.per_worker)


def check_model_output(config: Config) -> None:
    """The model, built on the meta device, traced on one training sample: an output the task
    cannot read, a model without the loss ``model.task: hf`` needs, or one that does not fit the
    data is one line before Ray starts (models/tasks.check_fits). Only for a factory's model (the
    built-ins return logits) or ``model.task: hf``; a streamed source has no sample here: its
    workers check before their first step."""
    if config.model.factory is None and config.model.task != "hf":
        return
    if config.model.task == "custom" or source_of(config.data).streamed:
        return
    train_set, _, spec = build_datasets(config.data, config.seed)
    if len(train_set) == 0:
        return
    with torch.device("meta"):
        model = build_model(config.model, spec)
    check_fits(model, config.model, spec, train_set[0])


def check_parameter_names(config: Config) -> None:
    """``model.freeze`` and ``optim.param_groups`` name parameters: match them against the model
    built on the meta device, so that a glob that matches nothing fails before Ray starts."""
    if not config.model.freeze and not config.optim.param_groups:
        return
    _, _, spec = build_datasets(config.data, config.seed)
    with torch.device("meta"):
        model = build_model(config.model, spec)
    if config.model.lora is not None:  # the names the workers match: adapters and their base layers
        apply_lora(model, config.model.lora)
    freeze(model, config.model.freeze)
    group_parameters(config.optim, model.named_parameters(remove_duplicate=False))


def read_pretrained(plain: nn.Module, config: Config, rank: int, materialize_on: torch.device | None = None) -> None:
    """``model.pretrained`` into ``plain`` (wrapped or not), logging what this rank read and the
    host memory it took at peak; ``materialize_on``: first give a model built on the meta device
    its shards' memory there (their pages are touched as the file is read into them)."""
    if config.model.pretrained is None:
        return
    with PeakMemory() as memory:
        if materialize_on is not None:
            materialize(plain, materialize_on)
        loaded = load_pretrained(plain, config.model.pretrained, strict=config.model.pretrained_strict)
    log.info("rank %d: %s", rank, loaded.line(memory.added))


def defers_weights(config: Config, world: int) -> bool:
    """Whether the model is built without weights: FSDP over several ranks (no tensor
    parallelism) whose every parameter ``model.pretrained`` fills (strict), so a random init
    would only be overwritten."""
    parallel = config.parallel
    return (
        config.model.pretrained is not None
        and config.model.lora is None
        and config.model.pretrained_strict
        and parallel.strategy == "fsdp"
        and parallel.tensor_parallel == 1
        and world > 1
    )


def check_pretrained_fits(config: Config) -> None:
    """``model.pretrained`` resolves and its tensors fit the model, and ``model.lora`` finds the
    layers it adapts (the model built on the meta device), or one line before Ray starts."""
    if config.model.pretrained is None and config.model.lora is None:
        return
    _, _, spec = build_datasets(config.data, config.seed)
    with torch.device("meta"):
        model = build_model(config.model, spec)
    if config.model.pretrained is not None:
        check_pretrained(model, config.model.pretrained, strict=config.model.pretrained_strict)
    if config.model.lora is not None:
        apply_lora(model, config.model.lora)


def eval_batch(run: WorkerRun, batch: Any) -> Any:
    """A validation batch on the device: the inputs as evaluation sees them (data.augment's
    evaluation transform) for (input, target) pairs; a custom task's batch as it came."""
    if not run.task.supervised:
        return to_device(batch, run.device)
    inputs, targets = batch
    inputs = inputs.to(run.device)
    if run.runner.augmenter is not None:
        inputs = run.runner.augmenter.evaluate(inputs)
    return inputs, targets.to(run.device)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pin_memory(cfg: Config, device: torch.device) -> bool:
    return cfg.data.pin_memory if cfg.data.pin_memory is not None else device.type == "cuda"


def evaluate(run: WorkerRun, split: str = "val", shares: Callable[[], list[Any]] | None = None) -> dict[str, float]:
    """Validation (``val/...``), and the passes components ask for with their own weights swapped
    in (``train.ema``: ``val_ema/...``). ``shares`` (``trainforge evaluate``): the loaders of every
    data-parallel rank's share of ``split``, read one after another in this process; by default
    this rank's share of the validation set."""
    loaders = shares if shares is not None else lambda: [run.data.val_batches()]
    metrics = evaluate_model(run, split, loaders())
    for component in run.components.values():
        for name, weights in component.evaluations():
            with weights:
                metrics.update(evaluate_model(run, f"{split}_{name}", loaders()))
    return metrics


@torch.no_grad()
def evaluate_model(run: WorkerRun, prefix: str, loaders: list[Any]) -> dict[str, float]:
    """Evaluation over every rank's disjoint share; metrics averaged over all samples of all ranks
    (one process reading several shares adds their sums as the all-reduce adds the ranks')."""
    if any(loader is None for loader in loaders):
        return {}
    # DDP: the plain module (no hooks; ranks may see different numbers of batches). FSDP: the
    # sharded one, whose forwards are collectives: every rank runs as many as the busiest, and
    # the extra passes (over the rank's first batch again) are left out of the sums.
    model = run.plan.eval_model(run.model)
    model.eval()
    sums = MetricSums(run.device)
    for loader in loaders:
        passes = all_reduce_max(len(loader), run.device) if run.plan.eval_in_lockstep else len(loader)
        batches = iter(loader)
        first: Any = None
        for index in range(passes):
            batch = next(batches, None) if index < len(loader) else None
            if first is None:  # a rank with no samples of its own still joins each forward
                first = batch if batch is not None else collate_of(run.val_set)([run.val_set[0]])
            with run.runner.autocast():
                stats = run.plan.eval_step(model, run.task, eval_batch(run, batch if batch is not None else first))
            if batch is None:
                continue
            for name, value in stats.items():
                sums.add(name, value)
    # Every rank's names (a rank without validation samples has none): one table for the all-reduce.
    names = sorted(set().union(*cast(list[list[str]], collectives.all_gather_objects(sorted(sums.values)))))
    zero = torch.zeros((), dtype=torch.float64, device=run.device)
    values = [sums.values.get(n, zero) for n in names]
    totals = dict(zip(names, collectives.all_reduce_sum(torch.stack(values), run.device).tolist(), strict=True))
    model.train()
    if not totals.get("count"):
        return {}
    return {f"{prefix}/{k}": v for k, v in run.task.finalize(totals).items()}
