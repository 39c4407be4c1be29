"""Stand-ins for a user's own model module, resolved through ``model.factory`` in tests."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

NOT_CALLABLE = 42


def tiny_net(hidden: int = 16) -> nn.Module:
    """A digits-sized classifier: (B, 1, 8, 8) -> (B, 10)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def not_a_module() -> dict[str, int]:
    return {"hidden": 16}


def failing(hidden: int = 16) -> nn.Module:
    raise ValueError(f"hidden={hidden} must be even")


class Paced(nn.Module):
    """Wraps a model and sleeps in each training forward: a step slow enough for a test to act
    mid-run (validation runs at full speed)."""

    def __init__(self, inner: nn.Module, delay_s: float) -> None:
        super().__init__()
        self.inner = inner
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.delay_s)
        return self.inner(x)


def paced_net(hidden: int = 32, delay_s: float = 0.02, dropout: float = 0.1) -> nn.Module:
    """A digits classifier with dropout (so RNG state matters) that takes at least ``delay_s`` a step."""
    return Paced(dropout_net(hidden, dropout), delay_s)


def dropout_net(hidden: int, dropout: float) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))


class Held(Paced):
    """Paced, and each training forward waits while ``hold_file`` exists, after writing
    ``<hold_file>.held`` to say so: a test holds a run's workers until it has done what must happen
    mid-run. A hold ends after ``max_hold_s`` whatever happens, so a test whose release never comes
    fails on its checks instead of hanging."""

    def __init__(self, inner: nn.Module, delay_s: float, hold_file: str, max_hold_s: float) -> None:
        super().__init__(inner, delay_s)
        self.hold_file = Path(hold_file)
        self.max_hold_s = max_hold_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.hold_file.exists():
            held_marker(self.hold_file).touch()
            given_up = time.monotonic() + self.max_hold_s
            while self.hold_file.exists() and time.monotonic() < given_up:
                time.sleep(0.01)
        return super().forward(x)


def held_marker(hold_file: str | Path) -> Path:
    """The file a Held model writes once a forward waits on ``hold_file``."""
    return Path(f"{hold_file}.held")


def held_net(
    hold_file: str, hidden: int = 32, delay_s: float = 0.02, dropout: float = 0.1, max_hold_s: float = 600
) -> nn.Module:
    """paced_net's model, held while ``hold_file`` exists (Held)."""
    return Held(dropout_net(hidden, dropout), delay_s, hold_file, max_hold_s)


def chatty_net(hidden: int = 16) -> nn.Module:
    """A tiny_net whose factory prints a line and logs a warning on every worker (log forwarding)."""
    import logging

    print(f"building chatty_net with hidden={hidden}")
    logging.getLogger("user.models").warning("chatty_net: hidden=%d is small", hidden)
    return tiny_net(hidden)


class NanOnce(nn.Module):
    """An MLP whose output is NaN on rank ``on_rank`` at its ``at``-th training forward, once: a
    non-finite step that only one rank sees (its gradient shard, under FSDP)."""

    def __init__(self, at: int, hidden: int, on_rank: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, hidden), nn.Linear(hidden, hidden)])
        self.head = nn.Linear(hidden, 10)
        self.at = at
        self.on_rank = on_rank
        self.calls = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = inputs.flatten(1)
        for block in self.blocks:
            hidden = torch.relu(block(hidden))
        out = self.head(hidden)
        if self.training:
            self.calls += 1
            if self.calls == self.at and torch.distributed.get_rank() == self.on_rank:
                out = out * float("nan")
        return out


def nan_once(at: int = 3, hidden: int = 32, on_rank: int = 1) -> nn.Module:
    return NanOnce(at, hidden, on_rank)


def paced_tp_plan(model: nn.Module) -> dict[str, str]:
    """A user's tensor-parallel plan for ``paced_net`` (parallel.tp_plan): the hidden layer split by
    its output units, the classifier by its inputs: one all-reduce per forward."""
    return {"inner.1": "colwise", "inner.4": "rowwise"}


class IdRecorder(nn.Module):
    """A digits classifier for rows whose first value is the sample's id (tests.helpers.tables):
    each training forward appends the batch's ids to ``<record_to>/<pid>.ids`` (one line per
    forward), then classifies the other 64 values at no less than ``delay_s`` a step (``batch_norm``:
    with a BatchNorm1d after the hidden layer, whose training forward depends on the whole batch)."""

    def __init__(self, record_to: str, delay_s: float, hidden: int, batch_norm: bool = False) -> None:
        super().__init__()
        self.record_to = record_to
        self.delay_s = delay_s
        norm = [nn.BatchNorm1d(hidden)] if batch_norm else []
        self.inner = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), *norm, nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            import os

            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            ids = " ".join(str(int(i)) for i in x[:, 0].tolist())
            with open(os.path.join(self.record_to, f"rank{rank}-{os.getpid()}.ids"), "a") as out:
                out.write(ids + "\n")
            time.sleep(self.delay_s)
        return self.inner(x[:, 1:])


def id_recorder(record_to: str, delay_s: float = 0.05, hidden: int = 32, batch_norm: bool = False) -> nn.Module:
    return IdRecorder(record_to, delay_s, hidden, batch_norm)


class OwnStep(nn.Module):
    """A digits classifier that owns its step (model.task: custom): dict batches {"image", "label"},
    its loss and an accuracy of its own, and a validation step."""

    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(64, hidden), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        self.net = nn.Sequential(*layers, nn.Linear(hidden, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self(batch["image"])
        loss = nn.functional.cross_entropy(logits, batch["label"])
        return loss, {"accuracy": (logits.argmax(1) == batch["label"]).float().mean()}

    def validation_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss, values = self.training_step(batch)
        return {"loss": loss, **values}


def own_step(hidden: int = 32, dropout: float = 0.0) -> nn.Module:
    return OwnStep(hidden, dropout)


class Returns(nn.Module):
    """A model whose training_step returns ``what`` (for the checks on what a step may return)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.weight = nn.Parameter(torch.ones(3))

    def training_step(self, batch: object) -> object:
        loss = self.weight.sum()
        return {"vector": self.weight * 2, "number": 1.5, "dict": {"total": loss}}[self.what]


def tiny_lm(vocab_size: int = 256) -> nn.Module:
    """An embedding and a head over ``vocab_size`` token ids: (B, T) -> (B, T, vocab_size)."""
    return nn.Sequential(nn.Embedding(vocab_size, 16), nn.Linear(16, vocab_size))


class PacedOwnStep(OwnStep):
    """OwnStep whose training steps take at least ``delay_s``: slow enough for a test to act mid-run."""

    def __init__(self, hidden: int, dropout: float, delay_s: float) -> None:
        super().__init__(hidden, dropout)
        self.delay_s = delay_s

    def training_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.training:
            time.sleep(self.delay_s)
        return super().training_step(batch)


def paced_own_step(hidden: int = 32, dropout: float = 0.1, delay_s: float = 0.03) -> nn.Module:
    return PacedOwnStep(hidden, dropout, delay_s)


WIRE_MARK = 0.0123456  # float32 bytes of this, repeated, are what a capture looks for


def marked_net(hidden: tuple[int, ...] = (256, 128)) -> nn.Module:
    """A digits classifier the shape of the built-in ``mlp`` (64 -> 256 -> 128 -> 10, the same
    traffic a step) whose first layer's weights all start at WIRE_MARK: DDP's broadcast of rank
    0's parameters when it wraps the model carries 16,384 copies of it, a pattern a packet capture
    recognises wherever the tensors cross in clear."""
    layers: list[nn.Module] = [nn.Flatten()]
    for size_in, size_out in zip((64, *hidden), hidden, strict=False):
        layers += [nn.Linear(size_in, size_out), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(hidden[-1], 10))
    with torch.no_grad():
        net[1].weight.fill_(WIRE_MARK)
    return net


def adadelta(groups: list[dict], lr: float, rho: float = 0.9) -> torch.optim.Optimizer:
    """A user's optimizer factory (optim.factory): Adadelta over trainforge's parameter groups."""
    return torch.optim.Adadelta(groups, lr=lr, rho=rho)


def not_an_optimizer(groups: list[dict], lr: float) -> dict:
    return {"lr": lr}
