"""FSDP2 and tensor parallelism in real Ray Train workers (gloo on CPU): the same losses as DDP,
a final ``model.safetensors`` that loads into the plain module, and a corrupt shard detected at
restore.

Each run (a layout) is trained once per module, when a test first asks for it, and shared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import trainforge
from tests.helpers.faults import checkpoints, events, reports
from tests.helpers.runs import tiny_run
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import load_config
from trainforge.data import build_datasets
from trainforge.models import build_model

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]

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


def step_losses(run_dir: Path) -> dict[int, float]:
    """train/loss at every step, from the history points of the run's reports."""
    found = {}
    for report in reports(run_dir):
        for point in report.get("history", []):
            if "train/loss" in point:
                found[int(point["step"])] = float(point["train/loss"])
    return found


# name -> (strategy, workers, tensor_parallel). A tensor-parallel pair reads one batch of 8, as one
# worker does ("tp2" vs "ddp-1"); two pairs read two, as two workers do ("fsdp-tp2" vs "ddp").
LAYOUTS = {
    "ddp": ("ddp", 2, 1),
    "fsdp": ("fsdp", 2, 1),
    "ddp-1": ("ddp", 1, 1),
    "tp2": ("ddp", 2, 2),
    "fsdp-tp2": ("fsdp", 4, 2),
}


class Runs(dict[str, trainforge.RunResult]):
    """Trains a layout the first time a test asks for it."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, name: str) -> trainforge.RunResult:
        strategy, workers, tp = LAYOUTS[name]
        self[name] = trainforge.fit(lm_config(self.factory.mktemp(name), strategy, workers, tp))
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)


def largest_gap(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    return max(abs(a[step] - b[step]) / abs(a[step]) for step in a)


@pytest.mark.parametrize(
    ("layout", "reference"),
    [("fsdp", "ddp"), ("tp2", "ddp-1"), ("fsdp-tp2", "ddp")],
    ids=["fsdp-2-vs-ddp-2", "tp2-2-vs-ddp-1", "fsdp-x-tp2-4-vs-ddp-2"],
)
def test_sharded_losses_equal_the_reference_losses(runs: Runs, layout: str, reference: str) -> None:
    gap = largest_gap(step_losses(runs[reference].run_dir), step_losses(runs[layout].run_dir))
    print(f"\nllama_tiny in Ray workers: largest relative loss gap {layout}/{reference} in {STEPS} steps {gap:.2e}")
    assert gap <= 1e-5
    assert runs[layout].summary["status"] == "finished"


@pytest.mark.parametrize("layout", ["fsdp", "fsdp-tp2"])
def test_sharded_final_weights_load_into_the_plain_module(runs: Runs, tmp_path: Path, layout: str) -> None:
    result = runs[layout]
    final = checkpoints(result.run_dir)[-1]
    assert (final / "sharded" / "__1_0.distcp").is_file()
    # The shards of the last checkpoint, merged on one process, and the exported full weights.
    dcp_to_torch_save(final / "sharded", tmp_path / "merged.pt")
    sharded = torch.load(tmp_path / "merged.pt", weights_only=False)["model"]
    full = load_file(str(result.model_path))
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


def test_corrupt_shard_is_skipped_and_the_previous_checkpoint_used(runs: Runs, tmp_path: Path) -> None:
    run_dir = runs["fsdp"].run_dir
    newest = checkpoints(run_dir)[-1]
    shard = newest / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    store = CheckpointStore.from_uri(str(run_dir))
    check = store.verify(newest.name)
    assert not check.ok and any("__1_0.distcp" in p for p in check.problems), check.problems

    config = lm_config(run_dir.parent, "fsdp", max_steps=STEPS + 5)
    resumed = trainforge.fit(config)
    assert resumed.summary["status"] == "finished" and resumed.summary["global_step"] == STEPS + 5
    said = events(run_dir)
    assert any(e.startswith(f"skipped checkpoint {newest.name}") for e in said), said
    assert any(e.startswith("resumed from") and "checkpoint_000000020" in e for e in said), said


def test_tensor_parallel_run_continues_on_one_worker_without_it(runs: Runs) -> None:
    run_dir = runs["tp2"].run_dir
    resumed = trainforge.fit(lm_config(run_dir.parent, "ddp", workers=1, max_steps=STEPS + 5))
    assert resumed.summary["status"] == "finished" and resumed.summary["global_step"] == STEPS + 5
    said = events(run_dir)
    assert any(e.startswith("resumed from") and f"checkpoint_{STEPS:09d}" in e for e in said), said
    assert any("resharded: the checkpoint was written by ddp x tp2, this run uses ddp" in e for e in said), said
