"""Pipeline parallelism: a built-in decoder cut at block boundaries into stages, held by the
workers of a pipeline group and run by a ``torch.distributed.pipelining`` schedule.

The split (``split_blocks``): equal blocks per stage (``parallel.pipeline.split`` gives the
counts instead), the embeddings on the first stage, the final norm and the output head on the
last. Under gpipe and 1f1b each worker holds one stage; under interleaved_1f1b the model is cut
into ``stages x virtual_stages`` stages and worker ``r`` of the pipeline holds stages ``r``,
``r + stages``, ... (the placement torch's interleaved schedule runs). A worker's ``Stage`` keeps
the whole model's module tree with the parts of stages it does not hold removed, so its
parameters carry the whole model's names: its state is a slice of the unpipelined model's, and
checkpoints move between pipelined and unpipelined layouts (worker/plan.py's ``PipelinePlan``).
Each stage the worker holds runs as a ``Chunk``: a view of its blocks in the worker's Stage.
Under ``parallel.strategy: fsdp`` each block and each Chunk is an FSDP2 unit over the stage's
data-parallel replicas (``PipelinePlan._shard``).

Each training micro-batch (``train.batch_size`` samples) runs as one schedule step over
``parallel.pipeline.microbatches`` pipeline micro-batches; the loss of each is divided by their
count and by the accumulation steps, so the summed gradients are those of the unpipelined step.
Only the last stage sees the loss: it adds the batch's metric sums, the other stages add zeros
under the same names, and the report's all-reduce makes them known to every rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

# torch.distributed.pipelining and the checkpoint state-dict API are imported where they are used
# (as in worker/plan.py): every worker imports this module, few run a pipeline.
from trainforge.checkpoint.state import is_dtensor
from trainforge.config import PipelineConfig
from trainforge.errors import ConfigError
from trainforge.models import Task
from trainforge.worker import collectives
from trainforge.worker.blocks import apply_activation_checkpointing
from trainforge.worker.plan import ParallelPlan, local, mixed_grad_norm
from trainforge.worker.tp import apply_tensor_parallel

Stats = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Decoder:
    """Where a built-in causal LM keeps its parts: attribute paths under the transformers model."""

    base: str  # the stack: embeddings, blocks, final norm
    first: tuple[str, ...]  # under base, on the first stage
    blocks: str  # under base, the ModuleList of blocks
    norm: str  # under base, on the last stage (with the model's lm_head)


DECODERS = {
    "LlamaForCausalLM": Decoder("model", ("embed_tokens",), "layers", "norm"),
    "GPT2LMHeadModel": Decoder("transformer", ("wte", "wpe"), "h", "ln_f"),
}


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers model of a built-in decoder (``llama_*``, ``gpt2_*``); ConfigError for
    another model, or one whose output head shares its weight with the embeddings (which would
    live on the first and the last stage at once)."""
    inner = getattr(model, "model", None)
    if inner is None or type(inner).__name__ not in DECODERS:
        kind = type(inner if inner is not None else model).__name__
        raise ConfigError(
            f"parallel.pipeline splits the built-in decoders (llama_*, gpt2_*) only; this model is {kind}"
        )
    config = getattr(inner, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        raise ConfigError(
            "parallel.pipeline: the model ties its output head to its embeddings, which sit on different "
            "stages; set model.kwargs.tie_word_embeddings: false"
        )
    return inner


def block_count(model: nn.Module) -> int:
    lm = causal_lm_of(model)
    decoder = DECODERS[type(lm).__name__]
    return len(getattr(getattr(lm, decoder.base), decoder.blocks))


def split_blocks(blocks: int, stages: int, split: list[int] | None = None, per_worker: int = 1) -> list[range]:
    """The blocks of each of the model's ``stages``: ``split`` counts when given, else ``blocks /
    stages`` each. ``per_worker``: stages each worker holds (interleaved_1f1b), for the message."""
    named = (
        f"parallel.pipeline.stages {stages}"
        if per_worker == 1
        else f"the pipeline's {stages} stages ({stages // per_worker} x virtual_stages {per_worker})"
    )
    if split is not None:
        if len(split) != stages or sum(split) != blocks:
            raise ConfigError(
                f"parallel.pipeline.split {split} must give {stages} stages' block counts summing to the "
                f"model's {blocks} blocks"
            )
        counts = split
    else:
        if blocks % stages:
            raise ConfigError(
                f"{named} must divide the model's {blocks} blocks "
                "(or give parallel.pipeline.split, the blocks of each stage)"
            )
        counts = [blocks // stages] * stages
    starts = [sum(counts[:i]) for i in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def check_pipeline(model: nn.Module, stages: int, split: list[int] | None, per_worker: int = 1) -> None:
    """Before Ray starts: a built-in decoder whose blocks the model's ``stages`` (``parallel.pipeline
    .stages x virtual_stages``) divide. One-line ConfigError."""
    split_blocks(block_count(model), stages, split, per_worker)


def stages_of(worker: int, workers: int, stages: int) -> list[int]:
    """The stages worker ``worker`` of a pipeline of ``workers`` holds, of the model's ``stages``:
    ``worker``, ``worker + workers``, ... (one each unless the model has more stages than workers)."""
    return list(range(worker, stages, workers))


def held_by(worker: int, workers: int, parts: list[range]) -> dict[int, range]:
    """``stages_of`` with each stage's blocks (index: blocks)."""
    return {index: parts[index] for index in stages_of(worker, workers, len(parts))}


class Stage(nn.Module):
    """The stages of a built-in decoder one worker holds (``held``: index -> blocks, out of
    ``stages`` in all). ``model`` is the transformers model with the parts of the other stages
    removed, under the name the built-ins' wrapper (``HFLogits``) gives it: the parameter names
    are the whole model's."""

    def __init__(self, wrapped: nn.Module, held: dict[int, range], stages: int) -> None:
        super().__init__()
        self.model = causal_lm_of(wrapped)
        self.decoder = DECODERS[type(self.model).__name__]
        self.held, self.stages = dict(sorted(held.items())), stages
        self.index = next(iter(self.held))
        self.first, self.last = 0 in self.held, stages - 1 in self.held
        base = getattr(self.model, self.decoder.base)
        every = getattr(base, self.decoder.blocks)
        kept = sorted(i for blocks in self.held.values() for i in blocks)
        # A ModuleDict keyed by the block's index in the whole model keeps its parameters' names.
        setattr(base, self.decoder.blocks, nn.ModuleDict({str(i): every[i] for i in kept}))
        if not self.first:
            for name in self.decoder.first:
                setattr(base, name, None)
        if not self.last:
            setattr(base, self.decoder.norm, None)
            self.model.register_module("lm_head", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The worker's one stage (gpipe, 1f1b): see ``run``."""
        return self.run(x, self.index)

    def run(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Stage ``index`` (one this worker holds): token ids (the first stage) or the previous
        stage's hidden states -> hidden states, or the logits on the last stage."""
        base = getattr(self.model, self.decoder.base)
        first, last = index == 0, index == self.stages - 1
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        every = getattr(base, self.decoder.blocks)
        blocks = [every[str(i)] for i in self.held[index]]
        if self.decoder.base == "model":  # Llama: rotary positions in every block, causal attention
            hidden = base.embed_tokens(x) if first else x
            rotary = base.rotary_emb(hidden, position_ids=positions)
            for block in blocks:
                hidden = block(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions)
        else:  # GPT-2: learned positions added to the first stage's embeddings
            hidden = base.drop(base.wte(x) + base.wpe(positions)) if first else x
            for block in blocks:
                hidden = block(hidden, None, None)
        if not last:
            return hidden
        head = cast(nn.Module, self.model.lm_head)
        return cast(torch.Tensor, head(getattr(base, self.decoder.norm)(hidden)))

    def chunks(self) -> list[Chunk]:
        """A module per stage held, in order, for the schedule (built once: FSDP wraps them)."""
        if "_chunks" not in self.__dict__:
            object.__setattr__(self, "_chunks", [Chunk(self, index) for index in self.held])
        return cast(list[Chunk], self.__dict__["_chunks"])


class Chunk(nn.Module):
    """One stage of a worker's ``Stage``, as the schedule's ``PipelineStage`` wants it: its forward
    is that stage's, its parameters those of that stage's blocks (and the embeddings, or the norm
    and head, on the first and last). The modules are the Stage's own, shared, not copied; the
    Stage is kept outside this module's tree, so nothing is registered twice under it."""

    def __init__(self, stage: Stage, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "stage", stage)
        self.index = index
        base = getattr(stage.model, stage.decoder.base)
        every = getattr(base, stage.decoder.blocks)
        self.blocks = nn.ModuleList([every[str(i)] for i in stage.held[index]])
        ends: list[nn.Module] = []
        if index == 0:
            ends += [getattr(base, name) for name in stage.decoder.first]
        if index == stage.stages - 1:
            ends += [getattr(base, stage.decoder.norm), cast(nn.Module, stage.model.lm_head)]
        self.ends = nn.ModuleList(ends)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(Stage, self.__dict__["stage"]).run(x, self.index)


class Pipeline:
    """This worker's stage under its schedule: one call runs a training micro-batch's forward and
    backward over the pipeline micro-batches; the batch's metric sums on the last stage."""

    def __init__(
        self,
        stage: Stage,
        stages: int,
        schedule: str,
        microbatches: int,
        group: Any,
        device: torch.device,
        task: Task,
    ) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self.stage = stage
        self.microbatches = microbatches
        self.task = task
        # The names the last stage's sums have (the task's, from a one-token stand-in): the other
        # stages report zeros under them, so every rank's report vector has the same layout.
        one = torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)
        self.metric_names = sorted(task.sums(torch.zeros(()), *one))
        self.scale = 1.0  # 1 / (microbatches x accumulation steps), set per call
        self._stats: list[Stats] = []
        runners: list[Any] = [
            PipelineStage(chunk, chunk.index, stages, device, group=group) for chunk in stage.chunks()
        ]
        # scale_grads=False: the loss carries the scale, so accumulated gradients are not rescaled.
        if schedule == "interleaved_1f1b":
            self.schedule: Any = ScheduleInterleaved1F1B(runners, microbatches, loss_fn=self._loss, scale_grads=False)
        else:
            kinds: dict[str, Callable[..., Any]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
            (runner,) = runners
            self.schedule = kinds[schedule](runner, microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.task.loss(output, target)
        self._stats.append(self.task.sums(loss, output, target))
        return loss * self.scale

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], accum: int) -> Stats:
        """Forward and backward of one training micro-batch on this stage; its metric sums (zeros
        off the last stage)."""
        inputs, targets = batch
        self.scale = 1.0 / (self.microbatches * accum)
        self._stats = []
        if self.stage.first:
            self.schedule.step(inputs, target=targets if self.stage.last else None)
        elif self.stage.last:
            self.schedule.step(target=targets)
        else:
            self.schedule.step()
        if not self.stage.last:
            return {name: torch.zeros((), device=inputs.device) for name in self.metric_names}
        # The first step also calls the loss once while it infers the stages' shapes, before the
        # micro-batches: the last ``microbatches`` calls are the batch's.
        stats = self._stats[-self.microbatches :]
        return {name: torch.stack([s[name] for s in stats]).sum() for name in self.metric_names}


class PipelinePlan(ParallelPlan):
    """Pipeline stages x data parallel: the workers form a ``("pp", "dp")`` mesh, the ranks of a
    stages of a replica ``world / pp`` ranks apart; each rank holds one stage of one replica.
    Under ``strategy: ddp`` a stage's gradients are averaged over its data-parallel group after
    the last micro-batch's backward (one buffer per dtype, as for tensor-parallel replicas: the
    schedule drives the backward, not DDP). Under ``strategy: fsdp`` each stage is sharded over
    its data-parallel group (FSDP2: a unit per block, and each chunk the schedule runs for the
    embeddings, norm and head); the schedule's stage reduce-scatters the gradients after the
    last micro-batch. The gradient norm is summed over the stages. A stage's state is keyed by
    the whole model's names and written by every rank through torch.distributed.checkpoint, so
    it loads into any layout and any layout's checkpoint loads into it."""

    pipelined = True
    stage: Stage | None = None
    pipeline: Pipeline | None = None

    @property
    def sharded(self) -> bool:
        return True

    @property
    def fsdp(self) -> bool:
        """Whether each stage is sharded over its data-parallel group (``strategy: fsdp``)."""
        return self.cfg.strategy == "fsdp"

    @property
    def replicate(self) -> int:
        return self.cfg.fsdp.replicate if self.fsdp else 1

    @property
    def layout_name(self) -> str:
        data: str = self.cfg.strategy
        if self.replicate > 1:
            data = f"hsdp {self.replicate}x{self.layout.dp // self.replicate}"
        tp = f" x tp{self.layout.tp}" if self.layout.tp > 1 else ""
        return f"{data} x pp{self.layout.pp}{tp}"

    @property
    def cut(self) -> PipelineConfig:
        assert self.cfg.pipeline is not None  # a PipelinePlan is built for parallel.pipeline only
        return self.cfg.pipeline

    def wrap(self, model: nn.Module) -> nn.Module:
        """This rank's stage of ``model`` (the other stages' parts dropped), on the device."""
        from torch.distributed.device_mesh import init_device_mesh

        model = model.to(self.device)
        layout, cut = self.layout, self.cut
        # Row-major as Layout numbers the ranks: stages outermost, a tensor-parallel group's ranks consecutive.
        data = {"replicate": self.replicate, "shard": layout.dp // self.replicate} if self.replicate > 1 else {}
        dims = {"pp": layout.pp, **(data or {"dp": layout.dp}), **({"tp": layout.tp} if layout.tp > 1 else {})}
        self.mesh = init_device_mesh(self.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        parts = split_blocks(block_count(model), cut.parts, cut.split, cut.per_worker)
        held = held_by(layout.pp_rank, layout.pp, parts)
        stage = Stage(model, held, cut.parts)
        self.stage = stage
        said = ", ".join(f"{index + 1} (blocks {b.start}-{b.stop - 1})" for index, b in held.items())
        self.notes.append(
            f"pipeline: stage{'s' if len(held) > 1 else ''} {said} of {cut.parts}, "
            f"{cut.schedule} over {cut.microbatches} micro-batches; "
            + (f"{self.cfg.strategy} over {layout.dp} replicas" if layout.dp > 1 else "one replica of each stage")
        )
        if layout.tp > 1:  # the stage's blocks split over its tensor-parallel group first (worker/tp.py)
            count = apply_tensor_parallel(stage, self.mesh["tp"], self.cfg.tp_plan)
            self.notes.append(f"tensor parallel: {count} modules split over groups of {layout.tp}")
        found = list(getattr(getattr(stage.model, stage.decoder.base), stage.decoder.blocks).values())
        if self.cfg.activation_checkpointing != "none":
            count = apply_activation_checkpointing(
                found, self.cfg.activation_checkpointing, self.cfg.activation_checkpointing_every_n
            )
            self.notes.append(f"activation checkpointing on {count} of {len(found)} blocks")
        if self.fsdp and layout.dp > 1:
            self._shard(stage, found)
        return stage

    def _shard(self, stage: Stage, blocks: list[nn.Module]) -> None:
        """FSDP2 over the data-parallel group: a unit per block, then one per chunk (the schedule
        calls the chunks: the embeddings, norm and head are their own parameters). The same seed
        built the same weights on every replica; each keeps its slice."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # HSDP: shard within a replica group, all-reduce the shards across the groups.
        mesh = self.mesh["replicate", "shard"] if self.replicate > 1 else self.mesh["dp"]
        options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.cfg.fsdp.reshard_after_forward}
        if self.cfg.fsdp.mixed_precision == "bf16":  # bf16 compute and activations between stages
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in blocks:
            fully_shard(block, **options)
        for chunk in stage.chunks():
            fully_shard(chunk, **options)
        units = f"{len(blocks)} block units + {len(stage.held)} stage unit{'s' if len(stage.held) > 1 else ''}"
        over = f"{self.layout.dp} replicas"
        if self.replicate > 1:
            over = f"groups of {self.layout.dp // self.replicate} replicas, replicated {self.replicate} times"
        self.notes.append(f"fsdp: {units}, sharded over {over}")

    def forward_backward(self, model: nn.Module, task: Task, batch: Any, accum: int) -> Stats:
        if self.pipeline is None:
            cut = self.cut
            group = self.mesh["pp"].get_group()
            self.pipeline = Pipeline(
                cast(Stage, model), cut.parts, cut.schedule, cut.microbatches, group, self.device, task
            )
        return self.pipeline.step(batch, accum)

    def gradient_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[object]:
        # Under fsdp the schedule's stages reduce-scatter after every schedule step themselves.
        if sync and self.layout.dp > 1 and not self.fsdp:
            return self._all_reduce_after(model)
        return contextlib.nullcontext()

    def grad_norm(self, params: list[nn.Parameter], clip: float | None) -> torch.Tensor:
        """The norm over every stage's gradients, clipped by it. Under ddp each replica's stages
        hold the same after the data-parallel mean: the sum of squares is reduced over the
        pipeline group; under fsdp each rank holds its own shard of its stage's: over every rank.
        With tensor parallelism or HSDP each rank's squares count once per rank of its stage that
        holds the same piece (``copies`` within the stage's data x tensor ranks), summed over every rank."""
        if self.layout.tp > 1 or self.replicate > 1:  # the other stages hold other parameters
            stage_ranks = self.layout.dp * self.layout.tp
            return mixed_grad_norm([p.grad for p in params if p.grad is not None], clip, self.device, stage_ranks)
        grads = [local(p.grad) for p in params if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        if grads:
            squares = torch.stack(torch._foreach_norm(grads)).double().square().sum()
        sharded = self.fsdp and self.layout.dp > 1
        dist.all_reduce(squares, group=None if sharded else self.mesh["pp"].get_group())
        total = squares.sqrt().float()
        if clip is not None and grads:
            torch._foreach_mul_(grads, torch.clamp(clip / (total + 1e-6), max=1.0))
        return total

    @property
    def eval_in_lockstep(self) -> bool:
        return True  # a forward passes through every stage

    def eval_step(self, model: nn.Module, task: Task, batch: Any) -> Stats:
        """A validation batch through the stages one after another (whole, no micro-batches), each
        on the worker that holds it: the metric sums on the last stage's worker, none elsewhere.
        Each stage runs as its chunk, whose FSDP unit (under fsdp) gathers its parameters."""
        stage = cast(Stage, model)
        inputs, targets = batch
        group, pp = self.mesh["pp"].get_group(), self.layout.pp
        hidden = inputs
        for chunk in stage.chunks():
            index = chunk.index
            if index > 0:  # the previous stage is the previous worker's (stages go round the workers)
                width = int(cast(Any, stage.model).config.hidden_size)
                hidden = torch.empty((*inputs.shape, width), device=self.device)
                dist.recv(hidden, group=group, group_src=(index - 1) % pp)
            hidden = chunk(hidden)
            if index < stage.stages - 1:
                dist.send(hidden.float().contiguous(), group=group, group_dst=(index + 1) % pp)
        if not stage.last:
            return {}
        return task.sums(task.loss(hidden, targets), hidden, targets)

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every stage's weights gathered to rank 0 (empty elsewhere): the whole model."""
        return self.gathered(dict(model.state_dict()))

    def gathered(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's tensors (by the whole model's names) gathered to rank 0; empty elsewhere.
        Under fsdp a stage's shards are gathered within its data-parallel group first."""
        # FSDP over tensor-parallel shards gathers in two steps; torch warns so on every rank, every call.
        quiet = logging.getLogger("torch.distributed.tensor._redistribute")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            whole = {k: v.full_tensor() if is_dtensor(v) else v for k, v in tensors.items()}
        finally:
            quiet.setLevel(level)
        first = self.layout.dp_rank == 0 and self.layout.tp_rank == 0  # one rank of each stage sends
        mine = {k: v.detach().cpu() for k, v in whole.items()} if first else {}
        gathered: list[Any] = [None] * dist.get_world_size() if self.layout.rank == 0 else []
        dist.gather_object(mine, gathered if self.layout.rank == 0 else None, dst=0)
        return {k: v for part in gathered for k, v in part.items()}

    def load_full_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """The whole model's weights: this stage takes its own, strictly."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        own = model.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"the checkpoint's weights lack this stage's {missing[:3]}")
        mine = {name: state[name] for name in own}
        if any(is_dtensor(value) for value in own.values()):  # fsdp: each rank keeps its shards
            set_model_state_dict(model, cast(Any, mine), options=StateDictOptions(full_state_dict=True))
            return
        model.load_state_dict(mine, strict=True)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The stage's moments by the whole model's names, and parameter groups that list every
        stage's parameters: torch.distributed.checkpoint keeps one copy of the groups (they are
        keyed by position), which then reads as an unpipelined model's."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = cast(dict[str, Any], get_optimizer_state_dict(model, optimizer))
        state["param_groups"] = self._whole_groups(state["param_groups"])
        return state

    def _whole_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        every = cast(list[list[list[str]]], collectives.all_gather_objects([g["params"] for g in groups]))
        per_stage = self.layout.dp * self.layout.tp
        stages = [every[stage * per_stage] for stage in range(self.layout.pp)]  # each stage's first rank
        if any(len(names) != len(groups) for names in stages):
            raise ValueError(
                f"parallel.pipeline: the stages' optimizers have {[len(n) for n in stages]} parameter groups; "
                "a checkpoint needs the same groups on every stage"
            )
        return [{**g, "params": [name for names in stages for name in names[i]]} for i, g in enumerate(groups)]

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """A sharded checkpoint's optimizer state: this stage's moments and its part of each group."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        mine = {name for name, _ in model.named_parameters()}
        groups = [{**g, "params": [n for n in g["params"] if n in mine]} for g in state["param_groups"]]
        own = {"state": state["state"], "param_groups": [g for g in groups if g["params"]]}
        set_optimizer_state_dict(model, optimizer, cast(Any, own))

    def load_full_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """A whole model's optimizer state, keyed by position (group by group, each in the model's
        order, as the same config groups the whole model): this stage's part."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        current = cast(dict[str, Any], get_optimizer_state_dict(model, optimizer))
        whole = self._whole_groups(current["param_groups"])
        saved = [len(g["params"]) for g in state["param_groups"]]
        if saved != [len(g["params"]) for g in whole]:
            raise ValueError(
                f"the checkpoint's optimizer groups hold {saved} parameters, this model's "
                f"{[len(g['params']) for g in whole]}"
            )
        names = [name for group in whole for name in group["params"]]
        mine = {name for name, _ in model.named_parameters()}
        groups = [{**g, "params": [names[i] for i in g["params"] if names[i] in mine]} for g in state["param_groups"]]
        named = {
            "state": {names[int(i)]: s for i, s in state["state"].items() if names[int(i)] in mine},
            "param_groups": [g for g in groups if g["params"]],
        }
        set_optimizer_state_dict(model, optimizer, cast(Any, named), options=StateDictOptions(full_state_dict=True))
