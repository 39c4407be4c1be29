"""HSDP (``parallel.fsdp.replicate``): its checks before Ray starts, and, in 4 gloo ranks without
Ray, a 2 x 2 run (replicate 2 x shard 2) against plain FSDP over 4: the same losses, an exact
resume, and checkpoints that move between HSDP, FSDP and DDP.

The runs go through the worker's Session (tests/helpers/sessions.py), two process start-ups in
all: the uninterrupted and crashed runs in one set of ranks, every resume in a fresh set (a
restarted worker group is new processes).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Outcome, assert_bit_identical, checkpoint_state, sessions, train_all
from trainforge.config import load_config
from trainforge.errors import ConfigError

STEPS, CRASH, SAVED = 16, 12, 8  # a crash at step 12 resumes from the checkpoint at step 8
LLAMA = {"name": "llama_tiny", "kwargs": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}}
TOKENS = {"name": "synthetic", "kind": "tokens", "seq_len": 16, "vocab_size": 64, "num_samples": 1024}


def config(out: Path, strategy: str = "fsdp", replicate: int = 1, tp: int = 1, workers: int = 4) -> dict[str, Any]:
    return tiny_run(
        out,
        model=LLAMA,
        data=TOKENS,
        train={
            "max_steps": STEPS,
            "batch_size": 4,
            "log_every_n_steps": 1,
            "eval_every_n_steps": SAVED,
            "grad_clip_norm": 1.0,
        },
        optim={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        scaling={"num_workers": workers},
        parallel={"strategy": strategy, "tensor_parallel": tp, "fsdp": {"replicate": replicate}},
        checkpoint={"every_n_steps": SAVED, "keep_last": 5},
        seed=3,
    )


@pytest.mark.parametrize(
    ("workers", "parallel", "expected"),
    [
        (
            4,
            {"strategy": "fsdp", "fsdp": {"replicate": 3}},
            "parallel.fsdp.replicate 3 must divide scaling.num_workers 4",
        ),
        (4, {"strategy": "ddp", "fsdp": {"replicate": 2}}, "parallel.fsdp.replicate needs parallel.strategy: fsdp"),
        ([2, 4], {"strategy": "fsdp", "fsdp": {"replicate": 2}}, "parallel.fsdp.replicate needs a fixed scaling"),
        (
            4,
            {"strategy": "fsdp", "tensor_parallel": 2, "fsdp": {"replicate": 4}},
            "replicate 4 must divide the data-parallel workers (scaling.num_workers 4 / tensor_parallel 2)",
        ),
        (4, {"strategy": "fsdp", "fsdp": {"replicate": 0}}, "parallel.fsdp.replicate"),
    ],
    ids=["not-a-divisor", "ddp", "elastic", "not-a-divisor-of-dp", "zero"],
)
def test_bad_replicate_settings_are_one_line_config_errors(
    tmp_path: Path, workers: Any, parallel: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)) as raised:
        load_config(tiny_run(tmp_path, scaling={"num_workers": workers}, parallel=parallel))
    assert "\n" not in str(raised.value)


def test_replicate_defaults_to_plain_fsdp_and_accepts_a_divisor(tmp_path: Path) -> None:
    assert load_config(tiny_run(tmp_path, parallel={"strategy": "fsdp"})).parallel.fsdp.replicate == 1
    for workers, tp, replicate in ((4, 1, 2), (4, 1, 4), (8, 2, 2)):
        parallel = {"strategy": "fsdp", "tensor_parallel": tp, "fsdp": {"replicate": replicate}}
        loaded = load_config(
            tiny_run(tmp_path, model=LLAMA, data=TOKENS, scaling={"num_workers": workers}, parallel=parallel)
        )
        assert loaded.parallel.fsdp.replicate == replicate


# name -> (strategy, replicate, tensor_parallel, crash_at); all on 4 workers. "hsdp-tp2" is
# replicate 2 x shard 1 x tp 2, the 3-D mesh, against FSDP x TP (data-parallel 2 x tp 2).
FIRST = {
    "fsdp": ("fsdp", 1, 1, None),
    "hsdp": ("fsdp", 2, 1, None),
    "hsdp-crashed": ("fsdp", 2, 1, CRASH),
    "fsdp-crashed": ("fsdp", 1, 1, CRASH),
    "fsdp-tp2": ("fsdp", 1, 2, None),
    "hsdp-tp2": ("fsdp", 2, 2, None),
}
# name -> (strategy, replicate, the run whose crashed checkpoints it resumes from)
RESUMED = {
    "hsdp-crashed": ("fsdp", 2, "hsdp-crashed"),  # in place: the same layout
    "fsdp-from-hsdp": ("fsdp", 1, "hsdp-crashed"),
    "ddp-from-hsdp": ("ddp", 1, "hsdp-crashed"),
    "hsdp-from-fsdp": ("fsdp", 2, "fsdp-crashed"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Outcome]]:
    """Every run of FIRST in one set of 4 ranks, then every resume of RESUMED in a fresh set;
    name -> (output directory, rank 0's outcome). A resume in another layout resumes a copy."""
    root = tmp_path_factory.mktemp("hsdp")
    first = {name: config(root / name, s, r, tp) for name, (s, r, tp, _) in FIRST.items()}
    crashes = [crash for *_, crash in FIRST.values()]
    outcomes = spawn_ranks(sessions, 4, list(zip(first.values(), crashes, strict=True)))[0]
    done = {name: (root / name, outcome) for name, outcome in zip(first, outcomes, strict=True)}
    resumed = {}
    for name, (strategy, replicate, source) in RESUMED.items():
        if name != source:
            shutil.copytree(root / source, root / name)
        resumed[name] = config(root / name, strategy, replicate)
    for name, outcome in zip(resumed, train_all(list(resumed.values()), 4), strict=True):
        done[f"{name} resumed"] = (root / name, outcome)
    return done


def relative_gap(a: dict[int, float], b: dict[int, float]) -> float:
    assert a and sorted(a) == sorted(b)
    return max(abs(a[step] - b[step]) / abs(a[step]) for step in a)


def after(losses: dict[int, float], step: int) -> dict[int, float]:
    return {s: loss for s, loss in losses.items() if s > step}


@pytest.mark.slow  # two 4-rank start-ups and ten short runs: about a minute on 2 cores
@pytest.mark.parametrize(("layout", "reference"), [("hsdp", "fsdp"), ("hsdp-tp2", "fsdp-tp2")])
def test_hsdp_trains_with_the_losses_of_fsdp(
    runs: dict[str, tuple[Path, Outcome]], layout: str, reference: str
) -> None:
    ours, theirs = runs[layout][1], runs[reference][1]
    assert ours.final["status"] == theirs.final["status"] == "finished"
    assert sorted(ours.losses) == list(range(1, STEPS + 1))
    gap = relative_gap(theirs.losses, ours.losses)
    print(f"\nllama_tiny, 4 gloo ranks: largest relative loss gap {layout}/{reference} in {STEPS} steps {gap:.2e}")
    assert gap <= 1e-5
    assert ours.losses[STEPS] < ours.losses[1]  # it trained
    assert sorted(ours.val_losses) == [SAVED, STEPS]  # evaluation in lockstep over the sharded model
    assert relative_gap(theirs.val_losses, ours.val_losses) <= 1e-5


@pytest.mark.slow
def test_an_hsdp_checkpoint_evaluates_in_one_process(runs: dict[str, tuple[Path, Outcome]]) -> None:
    """``trainforge evaluate`` reads the shards whole in a process without a process group."""
    from trainforge.worker.evaluation import evaluate_run

    hsdp, fsdp = (evaluate_run(runs[name][0] / "t") for name in ("hsdp", "fsdp"))
    assert hsdp.step == fsdp.step == STEPS
    assert abs(hsdp.metrics["val/loss"] - fsdp.metrics["val/loss"]) <= 1e-5 * fsdp.metrics["val/loss"]


@pytest.mark.slow
def test_hsdp_crashed_and_restarted_is_bit_identical(runs: dict[str, tuple[Path, Outcome]]) -> None:
    crashed = runs["hsdp-crashed"][1]
    out, resumed = runs["hsdp-crashed resumed"]
    straight_out, straight = runs["hsdp"]
    assert crashed.crashed and resumed.final["status"] == "finished"
    assert any(e.startswith("resumed from") and f"checkpoint_{SAVED:09d}" in e for e in resumed.events)
    assert not any("resharded" in e for e in resumed.events), resumed.events
    assert resumed.losses == after(straight.losses, SAVED)  # bit for bit, every step after the resume
    assert_bit_identical(checkpoint_state(straight_out / "t", STEPS), checkpoint_state(out / "t", STEPS))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "source", "written_by", "uses"),
    [
        ("fsdp-from-hsdp", "hsdp", "hsdp 2x2", "fsdp"),
        ("ddp-from-hsdp", "hsdp", "hsdp 2x2", "ddp"),
        ("hsdp-from-fsdp", "fsdp", "fsdp", "hsdp 2x2"),
    ],
)
def test_a_checkpoint_moves_between_hsdp_and_fsdp_or_ddp(
    runs: dict[str, tuple[Path, Outcome]], name: str, source: str, written_by: str, uses: str
) -> None:
    """Resharded by torch.distributed.checkpoint: the same data-parallel width reads on from the
    same position, so the continued losses are the uninterrupted source run's (not bit for bit)."""
    resumed = runs[f"{name} resumed"][1]
    assert resumed.final["status"] == "finished" and resumed.final["step"] == STEPS
    said = resumed.events
    assert any(e.startswith("resumed from") and f"checkpoint_{SAVED:09d}" in e for e in said), said
    assert any(f"resharded: the checkpoint was written by {written_by}, this run uses {uses}" in e for e in said), said
    assert relative_gap(after(runs[source][1].losses, SAVED), resumed.losses) <= 1e-5
