"""FSDP2 and tensor parallelism in the worker's Session, in gloo ranks without Ray (CPU): the same
losses as DDP, final full weights that load into the plain module, a corrupt shard detected at
restore, a tensor-parallel run resumed on one worker.

These are properties of the loop, the plans and the checkpoints, not of Ray: the runs go through
tests/helpers/sessions (the Session a Ray Train worker runs, restored the same way) and save the
~18 s of Ray start-up per run. One FSDP run goes through Ray Train workers, to show that the
Session in gloo ranks stands for them: the same losses, and sharded checkpoints saved through Ray
Train's storage that verify. A sharded run resumed after a crash, bit-identical, is
tests/unit/test_session.py; a real worker killed under Ray is tests/faults/test_exact_resume.py.

Each layout is trained once per module and shared.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import trainforge
from tests.helpers.faults import checkpoints, reports
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Trained, final_weights, train, train_each_once
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import load_config
from trainforge.data import build_datasets
from trainforge.models import build_model

pytestmark = pytest.mark.slow

STEPS = 30
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def lm_config(tmp: Path, strategy: str, workers: int = 2, tp: int = 1, **train: Any) -> dict[str, Any]:
    return tiny_run(
        tmp,
        model={"name": "llama_tiny", "kwargs": LLAMA},
        data={"name": "synthetic", "kind": "tokens", "seq_len": 32, "vocab_size": 128, "num_samples": 2048},
        train={"max_steps": STEPS, "batch_size": 8, "log_every_n_steps": 1, "grad_clip_norm": 1.0, **train},
        optim={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        scaling={"num_workers": workers},
        parallel={"strategy": strategy, "tensor_parallel": tp},
        checkpoint={"every_n_steps": 10, "keep_last": 5},
        seed=11,
    )


# name -> (strategy, workers, tensor_parallel). A tensor-parallel pair reads one batch of 8, as one
# worker does ("tp2" vs "ddp-1"); two pairs read two, as two workers do ("fsdp-tp2" vs "ddp").
LAYOUTS = {
    "ddp": ("ddp", 2, 1),
    "fsdp": ("fsdp", 2, 1),
    "ddp-1": ("ddp", 1, 1),
    "tp2": ("ddp", 2, 2),
    "fsdp-tp2": ("fsdp", 4, 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trained]:
    """Every layout once per module, shared; the reference and sharded runs of one world size in
    the same ranks (one process start-up)."""
    return train_each_once(
        {
            name: lm_config(tmp_path_factory.mktemp(name), strategy, workers, tp)
            for name, (strategy, workers, tp) in LAYOUTS.items()
        }
    )


def largest_gap(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    return max(abs(a[step] - b[step]) / abs(a[step]) for step in a)


@pytest.mark.parametrize(
    ("layout", "reference"),
    [("fsdp", "ddp"), ("tp2", "ddp-1"), ("fsdp-tp2", "ddp")],
    ids=["fsdp-2-vs-ddp-2", "tp2-2-vs-ddp-1", "fsdp-x-tp2-4-vs-ddp-2"],
)
def test_sharded_losses_equal_the_reference_losses(runs: dict[str, Trained], layout: str, reference: str) -> None:
    gap = largest_gap(runs[reference].outcome.losses, runs[layout].outcome.losses)
    print(f"\nllama_tiny in gloo ranks: largest relative loss gap {layout}/{reference} in {STEPS} steps {gap:.2e}")
    assert gap <= 1e-5
    assert runs[layout].outcome.final["status"] == "finished"


@pytest.mark.parametrize("layout", ["fsdp", "fsdp-tp2"])
def test_sharded_final_weights_load_into_the_plain_module(
    runs: dict[str, Trained], tmp_path: Path, layout: str
) -> None:
    trained = runs[layout]
    final = checkpoints(trained.run_dir)[-1]
    assert (final / "sharded" / "__1_0.distcp").is_file()
    # The shards of the last checkpoint, merged on one process, and the exported full weights.
    dcp_to_torch_save(final / "sharded", tmp_path / "merged.pt")
    sharded = torch.load(tmp_path / "merged.pt", weights_only=False)["model"]
    full = final_weights(trained.config)  # what the driver copies to model.safetensors
    config = load_config(lm_config(tmp_path, "fsdp"))
    _, _, spec = build_datasets(config.data, config.seed)
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    outputs = []
    for weights in (full, sharded):
        model = build_model(config.model, spec)
        model.load_state_dict(weights, strict=True)
        model.eval()
        with torch.no_grad():
            outputs.append(model(tokens))
    assert torch.equal(outputs[0], outputs[1])


def copy_of(trained: Trained, tmp_path: Path) -> Path:
    """A copy of a trained layout's output directory: the module's runs stay as trained."""
    shutil.copytree(trained.run_dir.parent, tmp_path / "copy")
    return tmp_path / "copy"


def test_corrupt_shard_is_skipped_and_the_previous_checkpoint_used(runs: dict[str, Trained], tmp_path: Path) -> None:
    output = copy_of(runs["fsdp"], tmp_path)
    run_dir = output / "t"
    newest = checkpoints(run_dir)[-1]
    shard = newest / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    store = CheckpointStore.from_uri(str(run_dir))
    check = store.verify(newest.name)
    assert not check.ok and any("__1_0.distcp" in p for p in check.problems), check.problems

    resumed = train(lm_config(output, "fsdp", max_steps=STEPS + 5), 2)[0]
    assert resumed.final["status"] == "finished" and resumed.final["step"] == STEPS + 5
    said = resumed.events
    assert any(e.startswith(f"skipped checkpoint {newest.name}") for e in said), said
    assert any(e.startswith("resumed from") and "checkpoint_000000020" in e for e in said), said


def test_tensor_parallel_run_continues_on_one_worker_without_it(runs: dict[str, Trained], tmp_path: Path) -> None:
    output = copy_of(runs["tp2"], tmp_path)
    resumed = train(lm_config(output, "ddp", workers=1, max_steps=STEPS + 5), 1)[0]
    assert resumed.final["status"] == "finished" and resumed.final["step"] == STEPS + 5
    said = resumed.events
    assert any(e.startswith("resumed from") and f"checkpoint_{STEPS:09d}" in e for e in said), said
    assert any("resharded: the checkpoint was written by ddp x tp2, this run uses ddp" in e for e in said), said


@pytest.mark.usefixtures("ray_local")
def test_fsdp_in_ray_train_workers_has_the_losses_of_the_session_in_gloo_ranks(
    runs: dict[str, Trained], tmp_path: Path
) -> None:
    result = trainforge.fit(lm_config(tmp_path, "fsdp"))
    assert result.status == "finished"

    run_dir = tmp_path / "t"
    points = [point for report in reports(run_dir) for point in report.get("history", [report])]
    in_ray = {int(p["step"]): float(p["train/loss"]) for p in points if "train/loss" in p}
    assert largest_gap(runs["fsdp"].outcome.losses, in_ray) == 0.0
    saved = checkpoints(run_dir)
    assert [c.name for c in saved] == [f"checkpoint_{step:09d}" for step in (10, 20, 30)]
    store = CheckpointStore.from_uri(str(run_dir))
    for checkpoint in saved:
        check = store.verify(checkpoint.name)
        assert check.ok, check.problems
        assert (checkpoint / "sharded" / "__1_0.distcp").is_file()
