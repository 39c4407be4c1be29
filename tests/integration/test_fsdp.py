"""FSDP2 in real Ray Train workers (gloo on CPU): the same losses as DDP, a final
``model.safetensors`` that loads into the plain module, and a corrupt shard detected at restore.

One FSDP run and one DDP run are trained once per module and shared by the tests.
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


def lm_config(tmp: Path, strategy: str, **train: Any) -> dict[str, Any]:
    return tiny_run(
        tmp,
        model={"name": "llama_tiny", "kwargs": LLAMA},
        data={"name": "synthetic", "kind": "tokens", "seq_len": 32, "vocab_size": 128, "num_samples": 2048},
        train={"max_steps": STEPS, "batch_size": 8, "log_every_n_steps": 1, "grad_clip_norm": 1.0, **train},
        optim={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        scaling={"num_workers": 2},
        parallel={"strategy": strategy},
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, trainforge.RunResult]:
    return {
        strategy: trainforge.fit(lm_config(tmp_path_factory.mktemp(strategy), strategy)) for strategy in ("ddp", "fsdp")
    }


def test_fsdp_losses_equal_ddp_losses(runs: dict[str, trainforge.RunResult]) -> None:
    ddp, fsdp = step_losses(runs["ddp"].run_dir), step_losses(runs["fsdp"].run_dir)
    assert sorted(ddp) == sorted(fsdp) == list(range(1, STEPS + 1))
    gaps = {step: abs(ddp[step] - fsdp[step]) / abs(ddp[step]) for step in ddp}
    print(f"\nllama_tiny, 2 Ray workers: largest relative loss gap fsdp/ddp in {STEPS} steps {max(gaps.values()):.2e}")
    assert max(gaps.values()) <= 1e-5, gaps
    assert runs["fsdp"].summary["status"] == "finished"


def test_fsdp_final_weights_load_into_the_plain_module(runs: dict[str, trainforge.RunResult], tmp_path: Path) -> None:
    result = runs["fsdp"]
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


def test_corrupt_shard_is_skipped_and_the_previous_checkpoint_used(
    runs: dict[str, trainforge.RunResult], tmp_path: Path
) -> None:
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
