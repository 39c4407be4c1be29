"""Model outputs as their libraries write them: a tensor, a transformers ``ModelOutput``, a dict or a
tuple. The built-in tasks read the logits out of any of them, and the ``hf`` task the loss, so a
model built by a library trains as that library returns it, unwrapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainforge.errors import ModelError

READABLE = (
    "a tensor of logits, a transformers ModelOutput or a dict with 'logits', or a tuple whose first element is the "
    "logits"
)


def logits_of(output: Any, task: str) -> torch.Tensor:
    """The logits in ``output`` (``.logits``, ``["logits"]``, the first element, or the tensor
    itself), or a one-line ModelError that says what the task needs."""
    found = find_logits(output)
    if found is None:
        raise ModelError(
            f"model.task {task} reads the model's predictions from its output, but forward returned "
            f"{describe(output)}; return {READABLE} (or set model.task: hf to train on the loss the model "
            "returns, or model.task: custom with a training_step)"
        )
    return found


def find_logits(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):  # transformers' ModelOutput is an OrderedDict of the fields that are set
        value = output.get("logits")
        return value if isinstance(value, torch.Tensor) else None
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss a model returned when given labels: ``.loss``, ``["loss"]``, or a tuple's first
    element (transformers' ``return_dict=False`` puts the loss first); None when there is none."""
    if isinstance(output, Mapping):
        value = output.get("loss")
        return value if isinstance(value, torch.Tensor) else None
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def describe(output: Any) -> str:
    """What a model returned, in a few words: its type and, for containers, their keys or length."""
    name = type(output).__name__
    if isinstance(output, torch.Tensor):
        return f"a tensor {tuple(output.shape)}"
    if isinstance(output, Mapping):
        keys = ", ".join(map(str, list(output)[:8])) or "none"
        return f"{name} with keys ({keys})"
    if isinstance(output, (tuple, list)):
        kinds = ", ".join(type(item).__name__ for item in list(output)[:4])
        return f"a {name} of {len(output)} ({kinds})"
    return name if output is not None else "None"
