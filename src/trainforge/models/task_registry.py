"""Which task a run trains with, and the check before the first step that the model fits it.

``TASKS`` names every task (``model.task``); ``build_task`` picks one from the config and the data.
``check_fits`` traces one sample through the model on fake tensors: on the driver before Ray
starts (the model on the meta device) and on each worker before its first step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainforge.config import ModelConfig
from trainforge.data.spec import DataSpec
from trainforge.errors import ModelError
from trainforge.models.hf_task import HFTask
from trainforge.models.outputs import logits_of
from trainforge.models.tasks import (
    CausalLMTask,
    ClassificationTask,
    CustomTask,
    MaskedLMTask,
    RegressionTask,
    Task,
    first_input,
    traced_output,
)


def check_fits(model: nn.Module, cfg: ModelConfig, spec: DataSpec, sample: Any, task: Task | None = None) -> None:
    """Before the first step, one line instead of an IndexError deep in a worker: the model's output
    is one the task reads, the model's input embedding fits the data's vocabulary, and its outputs
    per prediction the classes (or the vocabulary), from one forward of one ``sample`` traced on
    fake tensors (eval mode, no gradients, no compute). A custom step reads its batches its own way;
    the ``hf`` task checks that the model returns a loss (models/hf_task.py)."""
    if cfg.task == "custom":
        return
    if task is None and spec.kind != "custom":
        task = build_task(cfg, spec, model)
    if task is not None and task.name == "hf":
        task.check_output(model, sample)  # type: ignore[attr-defined]
        return
    if spec.kind == "custom":
        return
    if spec.target_shape is not None:
        check_regression_fits(model, cfg, spec, sample)
        return
    size, key = (spec.vocab_size, "vocab_size") if spec.kind == "tokens" else (spec.num_classes, "num_classes")
    if not size:
        output_shape(model, first_input(sample), cfg.task or "classification")  # the output is readable
        return
    size += 1 if cfg.task == "masked_lm" else 0  # the mask token, after the data's ids
    setting = (
        f"set model.kwargs.{key}: {size}"
        if cfg.factory is None or key in cfg.kwargs
        else (f"build the model with the data's {key} ({size}: your factory gets it as spec.{key})")
    )
    embedding = input_embedding(model) if spec.kind == "tokens" else None
    if embedding is not None and embedding.num_embeddings < size:
        raise ModelError(
            f"the model's input embedding has {embedding.num_embeddings} token ids but the data's vocabulary "
            f"has {size} (ids up to {size - 1}): {setting}"
        )
    output = output_shape(model, first_input(sample), task.name if task is not None else "classification")
    if output is not None and len(output) >= 1 and output[-1] < size:
        raise ModelError(
            f"the model gives {output[-1]} outputs per prediction but the data has {size} "
            f"{'tokens' if spec.kind == 'tokens' else 'classes'}: {setting}"
        )


def check_regression_fits(model: nn.Module, cfg: ModelConfig, spec: DataSpec, sample: Any) -> None:
    """The model's values per sample against the float targets' (one forward on fake tensors)."""
    output = output_shape(model, first_input(sample), "regression")
    if output is None or len(output) < 1:
        return
    given, wanted = math.prod(output[1:]), math.prod(spec.target_shape or ())
    if given != wanted:
        setting = (
            "a built-in sizes its output from the data: leave model.kwargs' output size out"
            if cfg.factory is None
            else f"build the model with {wanted} output(s) per sample"
        )
        raise ModelError(
            f"the model gives {given} output(s) per sample but the data's float targets (data.target) hold "
            f"{wanted} value(s) per sample {list(spec.target_shape or ())}: {setting}"
        )


def output_shape(model: nn.Module, inputs: torch.Tensor | None, task: str) -> tuple[int, ...] | None:
    """The shape of the logits ``model(inputs)`` would give, traced on fake tensors (None when the
    model does not trace); a ModelError when the output holds nothing the task can read."""
    if inputs is None:
        return None
    traced = traced_output(model, (inputs,), {})
    if traced is None:
        return None
    return tuple(logits_of(traced, task).shape)


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding the input ids go through: transformers' ``get_input_embeddings``, else the first."""
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        with contextlib.suppress(NotImplementedError, AttributeError):
            found = getter()
            if isinstance(found, nn.Embedding):
                return found
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


TaskBuilder = Callable[[ModelConfig, DataSpec, "nn.Module | None"], Task]


def build_custom(cfg: ModelConfig, spec: DataSpec, model: nn.Module | None) -> Task:
    if model is None:
        raise ModelError("model.task custom: the task is built with the model it calls")
    return CustomTask(model)


def build_hf(cfg: ModelConfig, spec: DataSpec, model: nn.Module | None) -> Task:
    if cfg.name is not None:
        raise ModelError(
            f"model.task hf trains on the loss a model.factory's model returns; the built-in {cfg.name!r} returns "
            "logits: leave model.task out (its task computes the loss from them)"
        )
    return HFTask(spec, model)


def build_regression(cfg: ModelConfig, spec: DataSpec, model: nn.Module | None) -> Task:
    if spec.target_shape is None:
        raise ModelError(
            "model.task regression needs float targets, but the data's targets are classes or token ids: "
            "set data.target (parquet, jsonl), data.kind: regression (synthetic) or give a data.factory "
            "float targets"
        )
    return RegressionTask(cfg.loss or "mse", spec.target_shape)


def build_masked_lm(cfg: ModelConfig, spec: DataSpec, model: nn.Module | None) -> Task:
    return MaskedLMTask(int(spec.vocab_size or 0))


TASKS: dict[str, TaskBuilder] = {
    "classification": lambda cfg, spec, model: ClassificationTask(),
    "causal_lm": lambda cfg, spec, model: CausalLMTask(),
    "masked_lm": build_masked_lm,
    "regression": build_regression,
    "custom": build_custom,
    "hf": build_hf,
}
"""Every task by its ``model.task`` name: a new task is one class and one line here."""

OWN_BATCHES = ("custom", "hf")  # tasks that take batches of any shape (dicts, tuples), not only (input, target)


def build_task(cfg: ModelConfig, spec: DataSpec, model: nn.Module | None = None) -> Task:
    """``model.task`` if set, else classification for image data, regression for float targets and
    causal_lm for token data. ``custom`` and ``hf`` use the (plain) model: its ``training_step``,
    or its forward's arguments."""
    floats = spec.target_shape is not None
    name = cfg.task or ("causal_lm" if spec.kind == "tokens" else "regression" if floats else "classification")
    if spec.kind == "custom" and name not in OWN_BATCHES:
        raise ModelError(
            "the data yields batches of its own shape (not (input, target) pairs): set model.task: custom "
            "and give the model a training_step(batch) -> loss, or model.task: hf for a model that takes the "
            "batch's keys as arguments and returns its loss"
        )
    if cfg.loss is not None and name != "regression":
        raise ModelError(f"model.loss needs model.task: regression (model.task {name} has its own loss)")
    if floats and name not in ("regression", *OWN_BATCHES):
        raise ModelError(
            f"the data's targets are floats, which model.task {name} cannot learn: set model.task: regression"
        )
    if name in ("causal_lm", "masked_lm") and spec.kind != "tokens":
        raise ModelError(f"model.task {name} needs token data, but data.kind is {spec.kind!r}")
    return TASKS[name](cfg, spec, model)
