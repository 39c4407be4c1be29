"""``model.task: hf``: the Hugging Face convention. The batch goes to the model as keyword
arguments with ``labels``, and the run optimises the loss the model returns.

An ``(inputs, targets)`` batch becomes ``{first argument of forward: inputs, "labels": ...}``
(``input_ids`` for a text model, ``pixel_values`` for a vision one); a dict batch (a data factory's)
goes as it is. A causal LM (``*ForCausalLM``, ``*LMHeadModel``) gets its input ids as the labels,
because transformers shifts them itself; any other model gets the data's targets. Validation
reports the model's loss and, where the output has logits and the labels are one class per
sample, accuracy.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainforge.data.spec import DataSpec
from trainforge.errors import ModelError
from trainforge.models.outputs import describe, find_logits, logits_of, loss_of
from trainforge.models.tasks import IGNORE_INDEX, Stats, Task, batch_size, first_input, top_is_target, traced_output

CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


class HFTask(Task):
    """The model's own loss, given ``labels``: reports that loss and, for one class label per
    sample, accuracy."""

    name = "hf"

    def __init__(self, spec: DataSpec, model: nn.Module | None = None) -> None:
        self.supervised = spec.kind != "custom"  # (input, target) pairs: augmentation applies to inputs
        self.tokens = spec.kind == "tokens"
        if model is not None:
            check_takes_labels(model)

    def arguments(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        """The keyword arguments of the model's forward for ``batch``."""
        if isinstance(batch, Mapping):
            return dict(batch)
        inputs, targets = batch
        module = plain_module(model)
        labels = inputs if self.tokens and is_causal_lm(module) else targets
        return {input_name(module): inputs, "labels": labels}

    def train_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Stats]:
        arguments = self.arguments(model, batch)
        output = model(**arguments)
        loss = self.model_loss(model, output)
        return loss, self.hf_sums(loss, output, arguments.get("labels"), batch)

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Any) -> Stats:
        arguments = self.arguments(model, batch)
        output = model(**arguments)
        return self.hf_sums(self.model_loss(model, output), output, arguments.get("labels"), batch)

    def model_loss(self, model: nn.Module, output: Any) -> torch.Tensor:
        loss = loss_of(output)
        if loss is None or loss.numel() != 1:
            raise ModelError(
                f"model.task hf trains on the loss the model returns, but {type(plain_module(model)).__name__}"
                f".forward returned {describe(output)} given labels; return a ModelOutput with .loss (or a dict "
                "with 'loss'), or leave model.task out to have trainforge compute the loss from the logits"
            )
        return loss.reshape(())

    def hf_sums(self, loss: torch.Tensor, output: Any, labels: Any, batch: Any) -> Stats:
        """Sums weighted by the batch's samples; accuracy where the labels are one class per sample."""
        count = torch.tensor(float(batch_size(batch)), device=loss.device)
        sums: Stats = {"count": count, "loss_sum": loss.detach().float() * count}
        logits = find_logits(output) if not isinstance(output, (tuple, list)) else None
        if classes(labels, logits):
            assert isinstance(labels, torch.Tensor) and logits is not None
            counted = labels != IGNORE_INDEX
            sums["correct"] = (top_is_target(logits.detach(), labels) & counted).sum().float()
            sums["counted"] = counted.sum().float()
        return sums

    def finalize(self, sums: Mapping[str, float]) -> dict[str, float]:
        count = float(sums.get("count", 0.0))
        if count <= 0:
            return {"loss": math.nan}
        metrics = {"loss": float(sums["loss_sum"]) / count}
        if "counted" in sums:
            counted = float(sums["counted"])
            metrics["accuracy"] = float(sums["correct"]) / counted if counted > 0 else math.nan
        return metrics

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """A stand-in loss over the logits of ``model(inputs)`` (no labels), for tracing memory
        (worker/capacity): the same activations are kept for backward as the model's own loss keeps."""
        return logits_of(output, self.name).float().logsumexp(dim=-1).mean()

    def check_output(self, model: nn.Module, sample: Any) -> None:
        """One sample through the model on fake tensors: it returns a loss, or one line that says
        what to return."""
        check_takes_labels(model)
        batch: Any
        if isinstance(sample, Mapping):
            batch = {key: torch.as_tensor(value).unsqueeze(0) for key, value in sample.items()}
        elif isinstance(sample, (tuple, list)) and len(sample) == 2:
            inputs = first_input(sample)
            if inputs is None:
                return
            batch = (inputs, torch.as_tensor(sample[1]).unsqueeze(0))
        else:
            return
        output = traced_output(model, (), self.arguments(model, batch))
        if output is not None:
            self.model_loss(model, output)


def classes(labels: Any, logits: torch.Tensor | None) -> bool:
    """Whether ``labels`` are one class id per sample that ``logits`` score."""
    return (
        isinstance(labels, torch.Tensor)
        and logits is not None
        and labels.ndim == 1
        and not labels.is_floating_point()
        and logits.ndim == 2
        and logits.shape[0] == labels.shape[0]
    )


def plain_module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def forward_parameters(module: nn.Module) -> list[inspect.Parameter]:
    return list(inspect.signature(module.forward).parameters.values())


def input_name(module: nn.Module) -> str:
    """The name of the forward's first argument: where an (inputs, targets) batch's inputs go."""
    for parameter in forward_parameters(module):
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            return parameter.name
    raise ModelError(
        f"model.task hf passes the inputs by name, but {type(module).__name__}.forward has no named argument"
    )


def check_takes_labels(model: nn.Module) -> None:
    module = plain_module(model)
    parameters = forward_parameters(module)
    if any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    raise ModelError(
        f"model.task hf passes labels= to the model, but {type(module).__name__}.forward takes no labels: use a "
        "transformers *For* model (e.g. GPT2LMHeadModel, ViTForImageClassification), or leave model.task out to "
        "have trainforge compute the loss from the logits"
    )


def is_causal_lm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(CAUSAL_LM_SUFFIXES)
