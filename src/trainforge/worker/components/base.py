"""What a stateful component of a worker is, and what restoring one is handed.

A component owns one piece of a worker's state (the model's weights, the optimizer's moments, where
the data stands, the random generators, ...) under a name. ``state_dict()`` gives it as a
``checkpoint.state.State`` of up to four parts (shared JSON, shared or sharded tensors, this rank's
JSON, this rank's tensors) and ``load_state_dict(state, restore)`` takes it back; checkpointing
saves ``{name: state}`` and never reaches inside. Each JSON part is checked by the component's own
schema (strict: an unknown key or a wrong type is refused) before anything is applied.

Besides its state a component may act at three points of the loop, called for every component in
registry order: ``after_step(step)`` after each optimizer step, ``finish(step)`` when a run ends,
and ``evaluations()``, extra evaluation passes (``val_<name>/...``, ``test_<name>/...`` under
``trainforge evaluate --split test``) run in a context it provides.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from trainforge.checkpoint.state import State

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun

__all__ = ["Component", "Restore", "State", "StateSchema"]


class StateSchema(BaseModel):
    """A component's JSON state: strict types, no unknown keys, so that what verifies also loads."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


@dataclass
class Restore:
    """What a component's load sees besides its own state: the checkpoint's writers and what the
    load changed on purpose (``notes``, shown as the run's events)."""

    step: int  # the checkpoint's global step
    world: int  # the workers that wrote it
    plan: str  # their layout: ddp, fsdp, ddp x tp2
    config: dict[str, Any]  # their config (a record: credentials masked)
    same_ranks: bool  # this run's ranks wrote it (same workers, same tensor-parallel layout)
    sharded: bool = False  # its tensors come from DCP's shards (filled into ``template``), not whole
    notes: list[str] = field(default_factory=list)


class Component:
    """Base of every stateful component: the defaults of the optional parts.

    ``schema`` / ``rank_schema``: the schemas of ``State.values`` / ``State.rank_values``.
    ``export``: the run directory's weights file of the component's full weights at the end of a
    run (``model.safetensors``), for components whose tensors are weights by parameter name.
    """

    name: ClassVar[str]
    schema: ClassVar[type[BaseModel] | None] = None
    rank_schema: ClassVar[type[BaseModel] | None] = None
    export: ClassVar[str | None] = None

    @classmethod
    def from_run(cls, run: WorkerRun) -> Component | None:
        """This component of ``run`` (built from its config section), or None when the run has none."""
        raise NotImplementedError

    def state_dict(self) -> State:
        raise NotImplementedError

    def load_state_dict(self, state: State, restore: Restore) -> None:
        raise NotImplementedError

    def missing(self, restore: Restore) -> None:
        """The checkpoint holds no state of this component (written without it): keep the fresh one."""

    def template(self, state: State, restore: Restore) -> Any:
        """What a sharded checkpoint's tensors are loaded into (DCP fills it in place, resharded):
        this component's own tensors; None to leave them out (they cannot be used)."""
        return self.state_dict().tensors

    def full_weights(self) -> dict[str, torch.Tensor]:
        """For ``export``: the full weights by name, gathered to rank 0 under a sharded plan
        (every rank calls it: a collective there); empty on the other ranks."""
        return {}

    def after_step(self, step: int) -> None:
        """After each optimizer step (every rank, ``step`` already counted)."""

    def finish(self, step: int) -> bool:
        """At the end of a finished run, before the final evaluation and checkpoint; whether it
        changed the weights (else a validation at this step stands as the final one)."""
        return False

    def evaluations(self) -> Iterator[tuple[str, contextlib.AbstractContextManager[object]]]:
        """Extra evaluation passes: (name, context to evaluate in), reported as ``<split>_<name>/...``;
        none by default."""
        return iter(())
