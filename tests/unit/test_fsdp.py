"""FSDP2 against DDP in 2-rank gloo groups without Ray: same losses, a fraction of the bytes.

Each test spawns its ranks once (tests/helpers/ranks.py) and runs trainforge's own build and
step runner in them, so what is compared is what a Ray worker runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run

STEPS = 30
MODELS = {
    "gpt2_small": {"n_layer": 2, "n_embd": 64, "n_head": 4},
    "llama_tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
}


def lm_config(tmp: str, model: str, strategy: str, **parallel: Any) -> dict[str, Any]:
    return tiny_run(
        Path(tmp),
        model={"name": model, "kwargs": MODELS[model]},
        data={"name": "synthetic", "kind": "tokens", "seq_len": 32, "vocab_size": 128, "num_samples": 2048},
        train={"max_steps": STEPS, "batch_size": 8, "grad_accum_steps": 2, "grad_clip_norm": 1.0},
        optim={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        scaling={"num_workers": 2},
        parallel={"strategy": strategy, **parallel},
        seed=7,
    )


def train_steps(rank: int, world: int, config_dict: dict[str, Any]) -> dict[str, Any]:
    """This rank's loss at every step, the global gradient norm, and the tensor bytes it holds."""
    from trainforge.config import Config
    from trainforge.data import make_loader
    from trainforge.worker.build import build
    from trainforge.worker.step import MetricSums

    run = build(Config.model_validate(config_dict), ranks=(rank, world))
    run.data.sampler.set_epoch(0)
    loader = make_loader(
        run.data.train_set,
        run.data.sampler,
        run.config.train.batch_size,
        num_workers=0,
        pin_memory=False,
        drop_last=True,
        seed=run.config.seed,
        epoch=0,
        rank=rank,
    )
    batches, losses, norms = iter(loader), [], []
    held: dict[str, int] = {}
    for step in range(STEPS):
        sums = MetricSums(run.device)
        if step == STEPS - 1:  # the bytes held while gradients exist, before the last update
            inputs, targets = next(iter(loader))
            run.task.loss(run.model(inputs), targets).backward()
            held = run.plan.tensor_bytes(run.model, run.runner.optimizer)
            run.runner.optimizer.zero_grad(set_to_none=True)
        run.runner.run(batches, run.config.train.grad_accum_steps, sums)
        losses.append(float(sums.values["loss_sum"] / sums.values["count"]))
        norms.append(float(sums.values["grad_norm_sum"]))
    return {"losses": losses, "norms": norms, "bytes": held, "notes": run.plan.notes}


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))


# llama_tiny: the same comparison runs in real Ray workers (tests/integration/test_fsdp.py).
@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
@pytest.mark.parametrize("model", ["gpt2_small"])
def test_fsdp_matches_ddp_and_holds_about_half_the_bytes(tmp_path: Path, model: str) -> None:
    ddp = spawn_ranks(train_steps, 2, lm_config(str(tmp_path), model, "ddp"))
    fsdp = spawn_ranks(train_steps, 2, lm_config(str(tmp_path), model, "fsdp"))
    for rank in range(2):
        gap = relative_gap(ddp[rank]["losses"], fsdp[rank]["losses"])
        print(f"\n{model} rank {rank}: largest relative loss gap fsdp vs ddp over {STEPS} steps {gap:.2e}")
        assert gap <= 1e-5, (rank, gap, ddp[rank]["losses"][-3:], fsdp[rank]["losses"][-3:])
        assert relative_gap(ddp[rank]["norms"], fsdp[rank]["norms"]) <= 1e-4
    assert ddp[0]["losses"][-1] < ddp[0]["losses"][0]  # it trained
    assert any("block units" in n for n in fsdp[0]["notes"]), fsdp[0]["notes"]
    # Per rank: parameters + gradients + optimizer state, FSDP over DDP (printed for the record).
    for rank in range(2):
        ddp_total, fsdp_total = sum(ddp[rank]["bytes"].values()), sum(fsdp[rank]["bytes"].values())
        print(
            f"\n{model} rank {rank}: ddp {ddp[rank]['bytes']} fsdp {fsdp[rank]['bytes']} "
            f"ratio {fsdp_total / ddp_total:.3f}"
        )
        assert fsdp_total <= 0.55 * ddp_total


def step_record(rank: int, world: int, config_dict: dict[str, Any], steps: int) -> dict[str, Any]:
    """This rank's loss and whether the step was skipped (non-finite), at every step."""
    from trainforge.config import Config
    from trainforge.data import make_loader
    from trainforge.worker.build import build
    from trainforge.worker.step import MetricSums

    run = build(Config.model_validate(config_dict), ranks=(rank, world))
    run.data.sampler.set_epoch(0)
    loader = make_loader(
        run.data.train_set,
        run.data.sampler,
        run.config.train.batch_size,
        num_workers=0,
        pin_memory=False,
        drop_last=True,
        seed=run.config.seed,
        epoch=0,
        rank=rank,
    )
    batches, losses, skipped = iter(loader), [], []
    for _ in range(steps):
        sums = MetricSums(run.device)
        run.runner.run(batches, run.config.train.grad_accum_steps, sums)
        losses.append(float(sums.values["loss_sum"] / sums.values["count"]))
        skipped.append(int(sums.values["skipped_steps"]))
    weights = run.plan.full_model_state(run.model)  # a collective: rank 0 gets the full weights
    finite = all(bool(t.isfinite().all()) for t in weights.values())
    return {"losses": losses, "skipped": skipped, "finite_weights": finite}


def test_a_non_finite_step_on_one_rank_is_skipped_on_every_rank_under_fsdp(tmp_path: Path) -> None:
    """Rank 1 alone produces NaN at its third step: the global gradient norm is NaN on both ranks
    (it is reduced over the shards), so both skip that update and the weights stay finite."""
    config = tiny_run(
        tmp_path,
        model={"name": None, "factory": "tests.helpers.user_models:nan_once", "kwargs": {"at": 3}},
        scaling={"num_workers": 2},
        parallel={"strategy": "fsdp"},
        train={"max_steps": 6, "batch_size": 16, "grad_clip_norm": 1.0},
    )
    ranks = spawn_ranks(step_record, 2, config, 6)
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [0, 0, 1, 0, 0, 0]
    assert ranks[0]["finite_weights"]
    assert all(math.isfinite(loss) for loss in ranks[0]["losses"])


OPTIONS = {
    "bf16 autocast": {"precision": "bf16"},
    "bf16 parameters, fp32 reduce": {"parallel": {"strategy": "fsdp", "fsdp": {"mixed_precision": "bf16"}}},
    "no reshard after forward": {"parallel": {"strategy": "fsdp", "fsdp": {"reshard_after_forward": False}}},
}


@pytest.mark.slow
def test_fsdp_options_train_like_the_plain_fsdp_run(tmp_path: Path) -> None:
    base = lm_config(str(tmp_path), "gpt2_small", "fsdp")
    base["train"]["max_steps"] = 10
    plain = spawn_ranks(step_record, 2, base, 10)
    for label, overrides in OPTIONS.items():
        varied = spawn_ranks(step_record, 2, {**base, **overrides}, 10)
        exact = label.startswith("no reshard")  # when parameters are gathered does not change the arithmetic
        for rank in range(2):
            gap = relative_gap(plain[rank]["losses"], varied[rank]["losses"])
            print(f"\n{label} rank {rank}: largest relative loss gap to plain fsdp over 10 steps {gap:.2e}")
            assert gap <= (1e-6 if exact else 3e-2), (label, rank, gap)
            assert varied[rank]["losses"][-1] < varied[rank]["losses"][0], label
