"""Ranks of a 2-rank gloo group (the worker's own build and step runner, without Ray) stay
bit-identical after every step and see disjoint data.

A property of the step's arithmetic, so it runs in local ranks (tests/helpers/ranks.spawn_ranks)
rather than Ray Train workers, which would add ~18 s of start-up and check nothing more here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from trainforge.config import load_config
from trainforge.data import build_datasets


def _param_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.parameters():  # BatchNorm running stats are buffers, broadcast at each forward
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _steps_and_digests(rank: int, world: int, config_dict: dict[str, Any]) -> dict[str, Any]:
    """Runs trainforge's own build and step runner; records this rank's digest after every step."""
    from trainforge.config import Config
    from trainforge.data import make_loader
    from trainforge.worker.build import build
    from trainforge.worker.step import MetricSums

    config = Config.model_validate(config_dict)
    run = build(config, ranks=(rank, world))
    run.data.sampler.set_epoch(0)
    seen = list(iter(run.data.sampler))
    loader = make_loader(
        run.data.train_set,
        run.data.sampler,
        config.train.batch_size,
        num_workers=0,
        pin_memory=False,
        drop_last=True,
        seed=config.seed,
        epoch=0,
        rank=run.rank,
    )
    batches, sums, digests = iter(loader), MetricSums(run.device), []
    for _ in range(6):
        run.runner.run(batches, config.train.grad_accum_steps, sums)
        digests.append(_param_digest(run.plan.eval_model(run.model)))
    return {"digests": digests, "seen": seen}


@pytest.mark.parametrize("model", ["mlp", "small_cnn"])
def test_parameters_identical_on_all_ranks_after_every_step(tmp_path: Path, model: str) -> None:
    config = tiny_run(
        tmp_path,
        model={"name": model},
        train={"max_steps": 6, "batch_size": 8, "grad_accum_steps": 2, "sync_batchnorm": False},
        optim={"name": "adamw", "lr": 0.01},
        scaling={"num_workers": 2},
    )
    out = spawn_ranks(_steps_and_digests, 2, config)
    rank0, rank1 = (o["digests"] for o in out)
    assert len(rank0) == 6
    assert rank0 == rank1, "parameters diverged between ranks"
    assert len(set(rank0)) == 6, "every step must change the parameters"

    seen0, seen1 = (set(o["seen"]) for o in out)
    assert not seen0 & seen1, "ranks share samples"
    assert len(seen0) == len(seen1)
    # An even split over 2 ranks leaves at most world_size - 1 = 1 sample out.
    total = len(build_datasets(load_config(config).data, 0)[0])
    assert total - 1 <= len(seen0 | seen1) <= total
    assert seen0 | seen1 <= set(range(total))
