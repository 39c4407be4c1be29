"""Tasks: what one training or validation step of a model computes, and the metrics it reports.

A task takes the model (as the parallel plan wrapped it) and a batch, and gives the loss to
backpropagate with the step's metric sums; metrics go through sums so they can be all-reduced
across ranks before dividing (``loss_sum = loss * count`` and the like), and ``finalize`` turns
the reduced totals into averages.

* Built-in supervised tasks (``classification``, ``causal_lm``) see ``(inputs, targets)`` batches:
  cross-entropy over the last dimension of ``model(inputs)``.
* ``regression``: float targets, mean squared (``model.loss: mse``) or absolute (``l1``) error;
  mse, mae and r2 from sums.
* The model's output may be the logits, a transformers ``ModelOutput``, a dict or a tuple
  (models/outputs.py reads the logits out of it); ``hf`` (models/hf_task.py) trains on the loss
  the model itself returns when given ``labels``; models/task_registry.py names every task.
* ``custom``: the model owns its step. Its ``training_step(batch)`` returns the loss, or
  ``(loss, {name: value})``, or ``{"loss": loss, name: value}``; its optional
  ``validation_step(batch)`` returns ``{name: value}`` (without it, validation is the training
  step's loss and values under ``no_grad``). A batch is whatever the data yields (tensors, tuples,
  dicts). The step runs through the wrapped model's ``forward``, so DDP and FSDP see it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.errors import ModelError
from trainforge.models.outputs import logits_of

IGNORE_INDEX = -100
"""Targets equal to this are left out of the loss and the counts (PyTorch's cross-entropy default)."""

MAX_LOG_PERPLEXITY = 50.0
"""Perplexity is reported as exp(min(loss, this)), so an untrained or diverged model gives a finite number."""

Stats = dict[str, torch.Tensor]


def top_is_target(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Where the target's score is the largest of its row (a tie with another class counts as
    correct). A gather and a max: on a language model's (B, T, vocabulary) output every step, a
    fifth of ``argmax``'s time (which keeps an index beside each running maximum). Targets outside
    the classes (IGNORE_INDEX) are read as class 0; the caller masks them."""
    picked = output.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked >= output.amax(dim=-1)


class Task:
    """Cross-entropy over the last dimension of the logits of ``(inputs, targets)`` batches;
    subclasses name the task and its metrics.

    Classification sees ``(B, C)`` logits and ``(B,)`` targets, a causal LM ``(B, T, V)`` logits and
    ``(B, T)`` targets already shifted by the data, so both reduce to one prediction per target.
    """

    name: str = ""
    supervised: bool = True  # batches are (inputs, targets): augmentation and memory format apply to inputs

    def train_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Stats]:
        """The loss to backpropagate (mean over the batch) and the batch's metric sums."""
        inputs, targets = batch
        output = logits_of(model(inputs), self.name)
        loss = self.loss(output, targets)
        return loss, self.sums(loss, output, targets)

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Any) -> Stats:
        """The batch's metric sums for validation."""
        inputs, targets = batch
        output = logits_of(model(inputs), self.name)
        return self.sums(self.loss(output, targets), output, targets)

    def sums(self, loss: torch.Tensor, output: torch.Tensor, targets: torch.Tensor) -> Stats:
        stats = self.stats(output.detach(), targets)
        return {"loss_sum": loss.detach().float() * stats["count"], **stats}

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all predictions whose target is not IGNORE_INDEX."""
        self._check_shapes(output, target)
        logits = output.reshape(-1, output.shape[-1])
        return F.cross_entropy(logits.float(), target.reshape(-1), ignore_index=IGNORE_INDEX)

    @torch.no_grad()
    def stats(self, output: torch.Tensor, target: torch.Tensor) -> Stats:
        """float32 scalar sums for all-reduce: correct predictions and counted predictions."""
        self._check_shapes(output, target)
        counted = target != IGNORE_INDEX
        correct = top_is_target(output, target) & counted
        return {"correct": correct.sum().float(), "count": counted.sum().float()}

    def finalize(self, sums: Mapping[str, float]) -> dict[str, float]:
        """Mean loss and accuracy from reduced sums (``loss_sum``, ``correct``, ``count``); NaN if nothing counted."""
        count = float(sums["count"])
        if count <= 0:
            return {"loss": math.nan, "accuracy": math.nan}
        return {"loss": float(sums["loss_sum"]) / count, "accuracy": float(sums["correct"]) / count}

    def _check_shapes(self, output: torch.Tensor, target: torch.Tensor) -> None:
        if output.shape[:-1] != target.shape:
            raise ModelError(
                f"{self.name} task got model output {tuple(output.shape)} for targets {tuple(target.shape)}; "
                "the model must return logits shaped like the targets plus one class dimension"
            )


class ClassificationTask(Task):
    """One label per sample: reports loss and accuracy."""

    name = "classification"


class CausalLMTask(Task):
    """Next-token prediction: reports per-token loss, accuracy and perplexity."""

    name = "causal_lm"

    def finalize(self, sums: Mapping[str, float]) -> dict[str, float]:
        metrics = super().finalize(sums)
        loss = metrics["loss"]
        metrics["perplexity"] = loss if math.isnan(loss) else math.exp(min(loss, MAX_LOG_PERPLEXITY))
        return metrics


MASK_RATE = 0.15  # BERT's: of the tokens, this share is predicted ...
MASK_SPLIT = (0.8, 0.1)  # ... of which 80% shown as [MASK], 10% as a random token, 10% as they are


class MaskedLMTask(Task):
    """BERT's objective on token windows: 15% of the tokens are chosen, of those 80% replaced by
    the mask token (the id after the data's vocabulary), 10% by a random token, 10% left; the
    model predicts the chosen ones. Reports the masked tokens' loss, accuracy and perplexity.

    Training draws the mask from torch's generator of the batch's device, which a checkpoint saves
    with every rank's RNG, so a resumed run masks as the uninterrupted one did. Validation masks
    each batch with a generator seeded by its content: the same tokens every pass, no draw on the
    training's generator."""

    name = "masked_lm"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.mask_id = vocab_size  # one id past the data's: the model's vocabulary is one larger

    def train_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Stats]:
        inputs, labels = self.mask(batch[0], None)
        output = logits_of(model(inputs), self.name)
        loss = self.loss(output, labels)
        return loss, self.sums(loss, output, labels)

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Any) -> Stats:
        tokens = batch[0]
        generator = torch.Generator(tokens.device).manual_seed(int(tokens.sum()) % 2**31)
        inputs, labels = self.mask(tokens, generator)
        output = logits_of(model(inputs), self.name)
        return self.sums(self.loss(output, labels), output, labels)

    def mask(self, tokens: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the inputs with the chosen tokens replaced, labels: the chosen tokens, IGNORE_INDEX elsewhere)."""
        chosen = torch.rand(tokens.shape, generator=generator, device=tokens.device) < MASK_RATE
        labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE_INDEX))
        how = torch.rand(tokens.shape, generator=generator, device=tokens.device)
        masked, randomised = how < MASK_SPLIT[0], (how >= MASK_SPLIT[0]) & (how < sum(MASK_SPLIT))
        others = torch.randint(self.vocab_size, tokens.shape, generator=generator, device=tokens.device)
        inputs = torch.where(chosen & masked, torch.full_like(tokens, self.mask_id), tokens)
        return torch.where(chosen & randomised, others.to(tokens.dtype), inputs), labels

    def finalize(self, sums: Mapping[str, float]) -> dict[str, float]:
        metrics = super().finalize(sums)
        loss = metrics["loss"]
        metrics["perplexity"] = loss if math.isnan(loss) else math.exp(min(loss, MAX_LOG_PERPLEXITY))
        return metrics


R2_MAX_OUTPUTS = 64  # r2 needs a sum per target value per sample: reported up to this many


class RegressionTask(Task):
    """Float targets ``(B,)`` or ``(B, *shape)``: the mean squared error (``mse``) or mean absolute
    error (``l1``) over every target value is the loss. Reports the loss, ``mse`` and ``mae`` (over
    every value) and ``r2`` (1 - squared error / the targets' variance around each output's mean,
    summed over outputs: scikit-learn's variance-weighted r2), all from sums, computed in float64.

    A model output with as many values per sample as the targets is read in the targets' shape:
    ``(B, 1)`` for ``(B,)`` targets, ``(B, 6)`` for ``(B, 2, 3)``."""

    name = "regression"

    def __init__(self, loss: str = "mse", target_shape: tuple[int, ...] = ()) -> None:
        self.loss_name = loss
        self.target_shape = target_shape
        self.outputs = math.prod(target_shape)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        error = self.prediction(output, target).float() - target.float()
        return error.abs().mean() if self.loss_name == "l1" else error.square().mean()

    def prediction(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``output`` in the targets' shape, or a one-line ModelError."""
        if output.shape == target.shape:
            return output
        if output.ndim >= 1 and output.shape[0] == target.shape[0] and output[0].numel() == target[0].numel():
            return output.reshape(target.shape)
        raise ModelError(
            f"regression task got model output {tuple(output.shape)} for targets {tuple(target.shape)}; "
            f"the model must return {max(self.outputs, 1)} value(s) per sample"
        )

    @torch.no_grad()
    def stats(self, output: torch.Tensor, target: torch.Tensor) -> Stats:
        """float64 sums: samples, squared and absolute errors and, for r2, the targets' squares and
        their sum per output."""
        values = target.double()
        error = self.prediction(output, target).double() - values
        stats = {
            "count": torch.tensor(float(target.shape[0]), dtype=torch.float64, device=target.device),
            "squared_error": error.square().sum(),
            "absolute_error": error.abs().sum(),
        }
        if self.outputs <= R2_MAX_OUTPUTS:
            per_output = values.reshape(target.shape[0], -1)
            stats["target_squares"] = per_output.square().sum()
            for index, total in enumerate(per_output.sum(dim=0).unbind()):
                stats[f"target_sum/{index}"] = total
        return stats

    def finalize(self, sums: Mapping[str, float]) -> dict[str, float]:
        count = float(sums["count"])
        if count <= 0:
            return {"loss": math.nan, "mse": math.nan, "mae": math.nan}
        values = count * self.outputs
        squared = float(sums["squared_error"])
        metrics = {"loss": float(sums["loss_sum"]) / count, "mse": squared / values}
        metrics["mae"] = float(sums["absolute_error"]) / values
        if "target_squares" in sums:
            totals = [float(v) for k, v in sums.items() if k.startswith("target_sum/")]
            variance = float(sums["target_squares"]) - sum(total * total for total in totals) / count
            metrics["r2"] = 1.0 - squared / variance if variance > 0 else math.nan
        return metrics


VALUE_PREFIX = "value/"  # a custom step's own values, summed weighted by the batch's samples


class CustomTask(Task):
    """The model's own ``training_step`` (and ``validation_step``): losses and values averaged over
    samples (a batch counts as many samples as its tensors' leading dimension)."""

    name = "custom"
    supervised = False

    def __init__(self, module: nn.Module) -> None:
        if not callable(getattr(module, "training_step", None)):
            raise ModelError(
                f"model.task custom needs the model to define training_step(batch) -> loss; "
                f"{type(module).__name__} has none (or leave model.task out for a built-in task)"
            )
        self.has_validation_step = callable(getattr(module, "validation_step", None))

    def train_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Stats]:
        loss, values = split_result(call_step(model, "training_step", batch), "training_step")
        return loss, self._sums(loss, values, batch)

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Any) -> Stats:
        if not self.has_validation_step:
            loss, values = split_result(call_step(model, "training_step", batch), "training_step")
            return self._sums(loss, values, batch)
        result = call_step(model, "validation_step", batch)
        if not isinstance(result, Mapping):
            raise ModelError(
                f"model.task custom: validation_step returned {type(result).__name__}; it must return "
                "{name: value} (scalar tensors or numbers)"
            )
        values = {str(k): scalar(v, f"validation_step's {k!r}") for k, v in result.items()}
        return self._sums(values.pop("loss") if "loss" in values else None, values, batch)

    def _sums(self, loss: torch.Tensor | None, values: dict[str, torch.Tensor], batch: Any) -> Stats:
        """Sums weighted by the batch's samples, on the loss's device (no host sync per step)."""
        device = loss.device if loss is not None else torch.device("cpu")
        count = torch.tensor(float(batch_size(batch)), device=device)
        sums: Stats = {"count": count}
        if loss is not None:
            sums["loss_sum"] = loss.detach().float() * count
        for name, value in values.items():
            sums[VALUE_PREFIX + name] = value.detach().float().to(device) * count
        return sums

    def finalize(self, sums: Mapping[str, float]) -> dict[str, float]:
        count = float(sums.get("count", 0.0))
        if count <= 0:
            return {"loss": math.nan}
        metrics = {"loss": float(sums["loss_sum"]) / count} if "loss_sum" in sums else {}
        for key, total in sums.items():
            if key.startswith(VALUE_PREFIX):
                metrics[key[len(VALUE_PREFIX) :]] = float(total) / count
        return metrics


def split_result(result: Any, method: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A training step's loss and values from what it returned, or a one-line ModelError."""
    values: dict[str, Any] = {}
    if isinstance(result, Mapping):
        if "loss" not in result:
            keys = ", ".join(sorted(map(str, result))) or "none"
            raise ModelError(f"model.task custom: {method} returned a dict without 'loss' (keys: {keys})")
        loss, values = result["loss"], {str(k): v for k, v in result.items() if k != "loss"}
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        loss, values = result[0], {str(k): v for k, v in result[1].items()}
    else:
        loss = result
    if not isinstance(loss, torch.Tensor):
        raise ModelError(
            f"model.task custom: {method} returned {type(loss).__name__} as its loss; it must return a scalar "
            "tensor (or (loss, {name: value}), or {'loss': loss, ...})"
        )
    if loss.numel() != 1 or loss.ndim > 1:
        raise ModelError(
            f"model.task custom: {method} returned a loss of shape {tuple(loss.shape)}; it must be a scalar "
            "(reduce it, e.g. .mean())"
        )
    return loss.reshape(()), {name: scalar(value, f"{method}'s {name!r}") for name, value in values.items()}


def scalar(value: Any, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    raise ModelError(f"model.task custom: {what} is not a number or a one-element tensor")


def batch_size(batch: Any) -> int:
    """The samples in a batch: the leading dimension of its first tensor (tensors, tuples, dicts)."""
    for tensor in tensors_of(batch):
        if tensor.ndim > 0:
            return int(tensor.shape[0])
    return 1


def tensors_of(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors_of(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from tensors_of(value)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of a batch (tensors, tuples, lists, dicts) on ``device``, the structure kept."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device, non_blocking) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def call_step(model: nn.Module, method: str, batch: Any) -> Any:
    """``method(batch)`` of the user's module, called through ``model`` (DDP or FSDP around it, or
    the module itself) as its forward, so that the wrapper's hooks run around it as around any
    forward. Inside the step, ``self(x)`` is the module's own forward again."""
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    with routed_forward(module, getattr(module, method)):
        return model(batch)


@contextlib.contextmanager
def routed_forward(module: nn.Module, step: Any) -> Iterator[None]:
    """For one call: ``module``'s forward is ``step``; the first call puts the real one back."""

    def routed(*args: Any, **kwargs: Any) -> Any:
        module.__dict__.pop("forward", None)
        return step(*args, **kwargs)

    module.forward = routed
    try:
        yield
    finally:
        module.__dict__.pop("forward", None)


def first_input(sample: Any) -> torch.Tensor | None:
    """A sample's input as a batch of one (None when it is not a tensor)."""
    inputs = sample[0] if isinstance(sample, (tuple, list)) else sample
    return inputs.unsqueeze(0) if isinstance(inputs, torch.Tensor) else None


def traced_output(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``model(*args, **kwargs)`` on fake tensors: no compute, no memory for activations. On a
    model built on the meta device, the inputs go there too. None when the model does not trace
    (the first step will say what is wrong)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":
        args, kwargs = to_device(args, device), to_device(kwargs, device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            return model(*args, **kwargs)
    except Exception:  # a model fake tensors cannot run: the first step will say what is wrong
        return None
    finally:
        model.train(training)
