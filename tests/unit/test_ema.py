"""``train.ema``: the weights' moving average, a stateful component added through the registry alone.

Its arithmetic in one process; then in 2-rank gloo groups without Ray, under ddp (whole tensors,
``ema.safetensors``) and fsdp (shards, resharded like the model): a run that crashes after its
step-8 checkpoint and restarts from it ends with weights and averages bit-identical to the same
run uninterrupted, and validates with the averaged weights as well (``val_ema/...``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Outcome, assert_bit_identical, final_weights, run_dir_of, sessions
from trainforge.config import EmaConfig, ParallelConfig
from trainforge.worker.components.base import Restore
from trainforge.worker.ema import Ema
from trainforge.worker.plan import ParallelPlan


def test_the_average_moves_toward_the_weights_every_n_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = Ema(EmaConfig(decay=0.9, every_n_steps=2), ParallelPlan(ParallelConfig(), torch.device("cpu")), model)
    start = {k: v.clone() for k, v in ema.average.items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
    model[1].num_batches_tracked += 5
    ema.after_step(1)  # not an averaging step
    assert torch.equal(ema.average["0.weight"], start["0.weight"]) and ema.updates == 0
    ema.after_step(2)
    expected = 0.9 * start["0.weight"] + 0.1 * model[0].weight
    assert torch.allclose(ema.average["0.weight"], expected, atol=1e-7)
    assert int(ema.average["1.num_batches_tracked"]) == 5  # integer buffers are copied, not averaged
    assert ema.updates == 1
    # Evaluating with the average swaps it in and the trained weights back afterwards.
    trained = model[0].weight.detach().clone()
    with ema.swapped():
        assert torch.equal(model[0].weight, ema.average["0.weight"])
    assert torch.equal(model[0].weight, trained)
    # A checkpoint without an average (the run had no train.ema): it starts at the restored weights.
    restore = Restore(8, 1, "ddp", {}, same_ranks=True)
    ema.missing(restore)
    assert torch.equal(ema.average["0.weight"], model[0].weight) and "train.ema" in restore.notes[0]


def config(tmp: Path, name: str, strategy: str) -> dict[str, Any]:
    return tiny_run(
        tmp,
        run={"name": name, "output_dir": str(tmp)},
        model={"name": "mlp", "kwargs": {"hidden_sizes": [32, 32], "dropout": 0.1}},
        train={
            "max_steps": 20,
            "batch_size": 16,
            "log_every_n_steps": 4,
            "eval_every_n_steps": 10,
            "ema": {"decay": 0.8, "every_n_steps": 1},
        },
        optim={"name": "adamw", "lr": 3e-3},
        scaling={"num_workers": 2},
        parallel={"strategy": strategy},
        checkpoint={"every_n_steps": 8, "keep_last": 5},
        seed=11,
    )


def averaged_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The last checkpoint's averaged weights: what the driver copies to ``model_ema.safetensors``."""
    last = sorted(run_dir_of(config).glob("checkpoint_*"))[-1]
    exports = json.loads((last / "trainer_state.json").read_text())["exports"]
    assert exports == {"model.safetensors": "model.safetensors", "model_ema.safetensors": "ema.safetensors"}
    return load_file(str(last / "ema.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], list[Outcome]]]:
    """Per strategy: a straight run, then the same run crashed after its step-8 checkpoint and
    restarted; all six in one start-up of 2 ranks."""
    tmp = tmp_path_factory.mktemp("ema")
    plans, names = [], []
    for strategy in ("ddp", "fsdp"):
        straight, crashed = config(tmp, f"{strategy}-straight", strategy), config(tmp, f"{strategy}-crashed", strategy)
        plans += [(straight, None), (crashed, 12), (crashed, None)]
        names += [f"{strategy}-straight", f"{strategy}-crashed", f"{strategy}-resumed"]
    outcomes = spawn_ranks(sessions, 2, plans)[0]
    return {name: (plan[0], [outcome]) for name, plan, outcome in zip(names, plans, outcomes, strict=True)}


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_with_ema_resumes_bit_identical(runs: dict, strategy: str) -> None:
    straight_cfg, [straight] = runs[f"{strategy}-straight"]
    crashed_cfg, [crashed] = runs[f"{strategy}-crashed"]
    _, [resumed] = runs[f"{strategy}-resumed"]
    assert crashed.crashed and straight.final["status"] == resumed.final["status"] == "finished"
    assert any("checkpoint_000000008" in event for event in resumed.events), resumed.events
    assert_bit_identical(final_weights(straight_cfg), final_weights(crashed_cfg))
    assert_bit_identical(averaged_weights(straight_cfg), averaged_weights(crashed_cfg))
    # The average is not the weights, and it was validated too, as often as the weights were.
    weights, average = final_weights(straight_cfg), averaged_weights(straight_cfg)
    assert weights.keys() == average.keys() and not all(torch.equal(weights[k], average[k]) for k in weights)
    assert straight.final["val_ema/loss"] == resumed.final["val_ema/loss"]
    assert straight.final["val_ema/loss"] != straight.final["val/loss"]
