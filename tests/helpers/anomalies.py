"""Faults for ``train.anomaly``'s tests, as a user's modules would bring them: a data set with one
bad sample (the batch itself is at fault: a re-run of the step gives the same result) and a model
that goes wrong once, at one training forward (a re-run differs, as after a hardware fault).

``sessions(rank, world, configs)`` runs Sessions in gloo ranks (``tests/helpers/ranks.py``) and
returns what the tests look at: the run's events, the final report, the guard's counts, the LR,
a digest of the weights, or the error that ended the run; the last ``workers`` configs run
through ``run_worker`` instead, for what a Ray Train worker would return.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from tests.helpers.user_data import NumpyDigits
from trainforge.config import DataConfig
from trainforge.data import UserData

BAD_INDEX = 200  # the sample that is bad, in every faulty data set here


class BadDigits(NumpyDigits):
    """The digits with sample ``BAD_INDEX``'s image filled with ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(slice(0, 1437))
        self.images = self.images.copy()
        self.images[BAD_INDEX] = np.float32(value)


def digits_nan(data: DataConfig, seed: int) -> UserData:
    return UserData(train=BadDigits(float("nan")), val=NumpyDigits(slice(1437, None)), num_classes=10)


def digits_huge(data: DataConfig, seed: int) -> UserData:
    """A sample 1000 times brighter than any other: a loss spike, finite."""
    return UserData(train=BadDigits(1000.0), val=NumpyDigits(slice(1437, None)), num_classes=10)


def digits_clean(data: DataConfig, seed: int) -> UserData:
    return UserData(train=NumpyDigits(slice(0, 1437)), val=NumpyDigits(slice(1437, None)), num_classes=10)


class OnceOff(nn.Module):
    """A digits classifier whose output is multiplied by ``factor`` (NaN, or a large number) at its
    ``at``-th training forward on rank ``on_rank``, once: a fault the step's re-run does not see."""

    def __init__(self, at: int, factor: float, on_rank: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.at, self.factor, self.on_rank = at, factor, on_rank
        self.calls = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(inputs)
        if self.training:
            self.calls += 1
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if self.calls == self.at and rank == self.on_rank:
                out = out * self.factor
        return out


def nan_once(at: int, on_rank: int = 0) -> nn.Module:
    return OnceOff(at, float("nan"), on_rank)


def spike_once(at: int, on_rank: int = 0) -> nn.Module:
    return OnceOff(at, 1000.0, on_rank)


def digits_net() -> nn.Module:
    """OnceOff's shape, without the fault."""
    return OnceOff(0, 1.0, 0)


def session(rank: int, world: int, config_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank's Session, built and restored as ``run_worker`` does; what it ended with."""
    from tests.helpers.sessions import ListChannel
    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.config import Config
    from trainforge.protocol import event_to_json
    from trainforge.worker.anomaly import AnomalyGuard, AnomalyLimit
    from trainforge.worker.build import build
    from trainforge.worker.loop import Session
    from trainforge.worker.saving import Checkpointing, restore

    cfg = Config.model_validate(config_dict)
    run = build(cfg, ranks=(rank, world))
    checkpointing = Checkpointing(run, CheckpointStore.for_run(cfg.storage_path, cfg.run.name))
    channel = ListChannel()
    outcome: dict[str, Any] = {}
    try:
        final = Session(run, checkpointing, restore(run, checkpointing.store), channel=channel).train()
        outcome["final"] = final.to_json()
    except AnomalyLimit as err:
        outcome["error"] = str(err)
    finally:
        checkpointing.close()
    guard = run.components[AnomalyGuard.name]
    assert isinstance(guard, AnomalyGuard)
    outcome["events"] = [event_to_json(event) for report in channel.reports for event in report.events]
    outcome["counts"] = guard.figures()
    outcome["lr_scale"] = guard.lr_scale
    outcome["lr"] = run.runner.lr
    outcome["step"] = run.progress.global_step
    outcome["position"] = (run.data.epoch, run.data.position)
    weights = run.plan.full_model_state(run.model)  # a collective; under fsdp only rank 0's is full
    params = [p.detach().double() for p in weights.values()]
    outcome["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in params) if params else None
    outcome["weights_sum"] = float(sum(p.sum() for p in params)) if params else None
    return outcome


def worker(rank: int, world: int, config_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank's run as a Ray Train worker runs it (``run_worker``): what it returned."""
    from tests.helpers.sessions import ListChannel
    from trainforge.config import Config
    from trainforge.protocol import Payload, UserError
    from trainforge.worker.loop import run_worker

    returned = run_worker(Payload(Config.model_validate(config_dict)), ranks=(rank, world), channel=ListChannel())
    if isinstance(returned, UserError):
        return {"returned": "UserError", "kind": returned.kind, "message": returned.message}
    return {"returned": type(returned).__name__}


def sessions(rank: int, world: int, configs: list[dict[str, Any]], workers: int = 0) -> list[dict[str, Any]]:
    """``session`` for each config, then ``worker`` for the last ``workers`` of them."""
    cut = len(configs) - workers
    return [session(rank, world, c) for c in configs[:cut]] + [worker(rank, world, c) for c in configs[cut:]]
