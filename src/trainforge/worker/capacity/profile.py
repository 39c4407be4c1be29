"""What the memory planner needs from a model, measured once per config on fake tensors.

The model is built under ``FakeTensorMode`` (meta storage: shapes and dtypes, no bytes): its
parameter shapes by FSDP unit and the dims tensor parallelism splits, why each tensor-parallel size
does not apply, which parameters a pipeline's first stage holds, and the activation profile (saved
bytes and forward FLOPs, ``activations.py``). ``estimate.py`` turns this into bytes per rank.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from trainforge.config import Config
from trainforge.data import build_datasets
from trainforge.errors import ModelError, TrainforgeError
from trainforge.models import build_model, build_task
from trainforge.worker.blocks import repeated_blocks
from trainforge.worker.capacity.activations import ActivationProfile, measure_activations
from trainforge.worker.pipeline import DECODERS, causal_lm_of
from trainforge.worker.tp import COLWISE, ROWWISE, check_tensor_parallel, tp_styles


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    unit: int  # FSDP unit: -1 the root, i the i-th repeated block
    split_dim: int | None  # the dim tensor parallelism splits; None: replicated


TP_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class ModelProfile:
    """What the estimate needs from the model: parameter shapes by FSDP unit, why tensor
    parallelism of each size does not apply (None where it does), the activation profile, and
    for pipelining the parameters outside the blocks that sit on the first stage (the rest sit on
    the last) or why the model cannot be pipelined."""

    params: tuple[ParamShape, ...]
    blocks: int
    tp_problems: dict[int, str | None]
    activations: ActivationProfile
    sample_shape: tuple[int, ...]  # one sample's input, e.g. (seq_len,)
    first_stage: frozenset[str] = frozenset()
    pipeline_problem: str | None = "not profiled for pipelining"

    @property
    def parameters(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    def tp_problem(self, tp: int) -> str | None:
        """Why ``tp``-way tensor parallelism does not apply to this model, or None."""
        return None if tp == 1 else self.tp_problems.get(tp, f"tensor parallelism {tp} was not checked")


def split_dims(model: nn.Module, styles: dict[str, Any]) -> dict[str, int]:
    """Parameter name -> the dim tensor parallelism splits (``worker/tp.py``'s plan): column-wise
    modules split weight and bias by output features (dim 0), row-wise ones the weight by input
    features (dim 1; the bias is added after the reduce, replicated). Names may be patterns."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dims: dict[str, int] = {}
    for pattern, style in styles.items():
        colwise = style == COLWISE or isinstance(style, ColwiseParallel)
        rowwise = style == ROWWISE or isinstance(style, RowwiseParallel)
        for name, module in model.named_modules():
            if (colwise or rowwise) and fnmatch.fnmatchcase(name, pattern):
                for leaf, _ in module.named_parameters(recurse=False):
                    if colwise:
                        dims[f"{name}.{leaf}"] = 0
                    elif leaf == "weight":
                        dims[f"{name}.{leaf}"] = 1
    return dims


def tp_problems(model: nn.Module, config: Config) -> tuple[dict[int, str | None], dict[str, Any]]:
    """The model's tensor-parallel styles, and for each size why it does not apply (the checks
    ``trainforge train`` makes before Ray starts)."""
    user_plan = getattr(config.parallel, "tp_plan", None)
    sizes = sorted({*TP_SIZES, int(getattr(config.parallel, "tensor_parallel", 1) or 1)} - {1})
    try:
        styles = tp_styles(model, user_plan)
    except TrainforgeError as err:
        return {tp: str(err) for tp in sizes}, {}
    problems: dict[int, str | None] = {}
    for tp in sizes:
        try:
            check_tensor_parallel(model, tp, user_plan)
            problems[tp] = None
        except TrainforgeError as err:
            problems[tp] = str(err)
    return problems, styles


def profile_model(config: Config) -> ModelProfile:
    """Build the model under FakeTensorMode and measure it; the global RNG is left as it was."""
    _, _, spec = build_datasets(config.data, config.seed)
    if config.model.task == "custom" or spec.kind == "custom":
        raise ModelError(
            "the memory planner measures activations on (input, target) batches; a model.task custom model "
            "steps on batches of its own shape, which it cannot fake: set train.batch_size (trainforge plan "
            "has no estimate for it)"
        )
    with torch.random.fork_rng(devices=[]), FakeTensorMode() as mode:
        model = build_model(config.model, spec)
        task = build_task(config.model, spec)
        blocks = repeated_blocks(model, config.parallel.fsdp.wrap)
        problems, styles = tp_problems(model, config)
        dims = split_dims(model, styles)
        unit_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
        params = tuple(
            ParamShape(name, tuple(p.shape), p.element_size(), unit_of.get(id(p), -1), dims.get(name))
            for name, p in model.named_parameters()
            if p.requires_grad
        )
        if compute_mode(config) == "bf16_params":
            cast_parameters(model, torch.bfloat16)  # FSDP's bf16 policy computes with bf16 parameters
        profile = measure_activations(mode, model, blocks, task, spec, autocast_dtype(config))
        first, pipeline_problem = first_stage_names(model)
    return ModelProfile(params, len(blocks), problems, profile, tuple(spec.input_shape), first, pipeline_problem)


def first_stage_names(model: nn.Module) -> tuple[frozenset[str], str | None]:
    """The parameters a pipeline's first stage holds outside the blocks (the embeddings), and why
    the model cannot be pipelined (``worker/pipeline.py``'s checks), or None."""
    try:
        lm = causal_lm_of(model)
    except TrainforgeError as err:
        return frozenset(), str(err)
    decoder = DECODERS[type(lm).__name__]
    prefixes = tuple(f"model.{decoder.base}.{name}." for name in decoder.first)
    return frozenset(name for name, _ in model.named_parameters() if name.startswith(prefixes)), None


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """New parameters of ``dtype`` in place of the floating ones (ties kept); ``Module.to`` cannot
    swap fake tensors."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point():
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]


def compute_mode(config: Config) -> Literal["fp32", "autocast", "bf16_params"]:
    if config.parallel.fsdp.mixed_precision == "bf16":
        return "bf16_params"
    return "fp32" if config.precision == "fp32" else "autocast"


def autocast_dtype(config: Config) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
