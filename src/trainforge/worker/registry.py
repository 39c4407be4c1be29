"""Every stateful component a worker may have, in the order a restore loads them.

A checkpoint is ``{name: state}`` of the components a run has; saving, restore, inspection and
resharding go through ``Component``'s interface only. Adding a component is one class (with
``from_run``: its instance for a run, or None when the run's config leaves it out) and one line
here. The model comes before the optimizer (the optimizer's state is keyed by the model's
parameters), the optimizer before the schedule (which may put this run's hyperparameters on top),
local SGD after both (it overwrites them with each rank's own), the user's callbacks (whose
``load_state_dict`` is their code) before the RNG, the RNG last (nothing may draw
after it is restored).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainforge.checkpoint.schema import ComponentSchemas
from trainforge.worker.anomaly import AnomalyGuard
from trainforge.worker.callbacks import Callbacks
from trainforge.worker.components.base import Component
from trainforge.worker.components.data import DataSource
from trainforge.worker.components.training import Progress, Rng, Scaler, Schedule
from trainforge.worker.components.weights import ModelWeights, OptimizerState
from trainforge.worker.compression import PowerSGDComponent
from trainforge.worker.early_stopping import EarlyStopping
from trainforge.worker.ema import Ema
from trainforge.worker.sync import LocalSync

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun

COMPONENTS: tuple[type[Component], ...] = (
    Progress,
    DataSource,
    ModelWeights,
    OptimizerState,
    Schedule,
    Scaler,
    LocalSync,
    PowerSGDComponent,
    Ema,
    EarlyStopping,
    AnomalyGuard,
    Callbacks,
    Rng,
)


def build_components(run: WorkerRun) -> dict[str, Component]:
    """The run's components by name, in registry order: those its config asks for."""
    found = {}
    for kind in COMPONENTS:
        component = kind.from_run(run)
        if component is not None:
            found[kind.name] = component
    return found


def state_schemas() -> dict[str, ComponentSchemas]:
    """Every component's schemas, for verifying a checkpoint's ``trainer_state.json``."""
    return {kind.name: ComponentSchemas(kind.schema, kind.rank_schema) for kind in COMPONENTS}
