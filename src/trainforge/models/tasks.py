"""Task heads: the loss a model trains on and the metrics it reports.

Metrics go through sums so they can be all-reduced across ranks before dividing: a rank reports
``stats`` (correct, count) per batch, the caller adds ``loss_sum = loss * count``, sums everything
over batches and ranks, and ``finalize`` turns the totals into averages.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainforge.config import ModelConfig
from trainforge.data.spec import DataSpec
from trainforge.errors import ModelError

IGNORE_INDEX = -100
"""Targets equal to this are left out of the loss and the counts (PyTorch's cross-entropy default)."""

MAX_LOG_PERPLEXITY = 50.0
"""Perplexity is reported as exp(min(loss, this)), so an untrained or diverged model gives a finite number."""


class Task:
    """Cross-entropy over the last dimension of the logits; subclasses name the task and its metrics.

    Classification sees ``(B, C)`` logits and ``(B,)`` targets, a causal LM ``(B, T, V)`` logits and
    ``(B, T)`` targets already shifted by the data, so both reduce to one prediction per target.
    """

    name: str = ""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all predictions whose target is not IGNORE_INDEX."""
        self._check_shapes(output, target)
        logits = output.reshape(-1, output.shape[-1])
        return F.cross_entropy(logits.float(), target.reshape(-1), ignore_index=IGNORE_INDEX)

    @torch.no_grad()
    def stats(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """float32 scalar sums for all-reduce: correct argmax predictions and counted predictions."""
        self._check_shapes(output, target)
        counted = target != IGNORE_INDEX
        correct = (output.argmax(dim=-1) == target) & counted
        return {"correct": correct.sum().float(), "count": counted.sum().float()}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
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

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        metrics = super().finalize(sums)
        loss = metrics["loss"]
        metrics["perplexity"] = loss if math.isnan(loss) else math.exp(min(loss, MAX_LOG_PERPLEXITY))
        return metrics


TASKS: dict[str, type[Task]] = {"classification": ClassificationTask, "causal_lm": CausalLMTask}


def build_task(cfg: ModelConfig, spec: DataSpec) -> Task:
    """``model.task`` if set, else classification for image data and causal_lm for token data."""
    name = cfg.task or ("causal_lm" if spec.kind == "tokens" else "classification")
    if name == "causal_lm" and spec.kind != "tokens":
        raise ModelError(f"model.task causal_lm needs token data, but data.kind is {spec.kind!r}")
    return TASKS[name]()
