"""Stand-ins for a user's callbacks, named in tests' ``callbacks`` as ``tests.helpers.user_callbacks:...``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class StopAt:
    """Asks for a stop at ``step`` on rank ``rank`` only."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step = step
        self.rank = rank

    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        if ctx.rank == self.rank and step == self.step:
            ctx.request_stop(f"rank {ctx.rank} asked at step {step}")


class StopAtValidation:
    """Asks for a stop in ``on_validation_end`` at ``step`` (every rank)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_end(self, ctx: Any, metrics: dict[str, float]) -> None:
        if ctx.step == self.step:
            ctx.request_stop(f"validated at step {ctx.step}")


class Recorder:
    """Writes every hook it sees to ``<log>-<rank>.jsonl`` and keeps a state: the steps it saw and
    the sum of their losses (checkpointed through state_dict/load_state_dict)."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.steps = 0
        self.loss_total = 0.0

    def write(self, ctx: Any, hook: str, **fields: Any) -> None:
        path = Path(f"{self.log}-{ctx.rank}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(json.dumps({"hook": hook, **fields}) + "\n")

    def on_train_start(self, ctx: Any) -> None:
        self.write(ctx, "on_train_start", world=ctx.world_size, steps=self.steps)

    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        self.steps += 1
        self.loss_total += metrics["train/loss"]
        self.write(ctx, "on_step_end", step=step, metrics=metrics)

    def on_validation_end(self, ctx: Any, metrics: dict[str, float]) -> None:
        self.write(ctx, "on_validation_end", metrics=metrics)

    def on_checkpoint(self, ctx: Any, path: str) -> None:
        self.write(ctx, "on_checkpoint", path=path)

    def on_train_end(self, ctx: Any) -> None:
        self.write(ctx, "on_train_end", steps=self.steps, loss_total=self.loss_total)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "loss_total": self.loss_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.loss_total = state["loss_total"]


class RaisesAt:
    """Raises in ``on_step_end`` at ``step`` on rank ``rank``."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step = step
        self.rank = rank

    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        if ctx.rank == self.rank and step == self.step:
            raise ValueError(f"the callback's own bug at step {step}")


class NoHooks:
    pass


NOT_A_CLASS = 3


def records(log: Path, rank: int) -> list[dict[str, Any]]:
    """What a Recorder wrote on ``rank``."""
    path = Path(f"{log}-{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
