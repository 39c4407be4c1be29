"""The Session (loop, reports, checkpoints, restore) in 2-rank gloo groups without Ray.

A sharded (FSDP) run that crashes mid-epoch and is restarted from its newest checkpoint ends
bit-identical to the same run uninterrupted; the checkpoint it resumes from holds every rank's
shards and verifies; a crash is a real exception out of the loop, as a killed worker group ends
in Ray, and the restart a new set of processes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.runs import tiny_run
from tests.helpers.sessions import assert_bit_identical, checkpoint_state, train

STEPS = 24


def config(tmp: Path, strategy: str, workers: int = 2, tp: int = 1) -> dict[str, Any]:
    return tiny_run(
        tmp,
        model={"name": "llama_tiny", "kwargs": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}},
        data={"name": "synthetic", "kind": "tokens", "seq_len": 16, "vocab_size": 64, "num_samples": 1024},
        train={"max_steps": STEPS, "batch_size": 8, "log_every_n_steps": 4, "eval_every_n_steps": 8},
        optim={"name": "adamw", "lr": 3e-3},
        scaling={"num_workers": workers},
        parallel={"strategy": strategy, "tensor_parallel": tp},
        checkpoint={"every_n_steps": 8, "keep_last": 5},
        seed=3,
    )


def final_state(run_dir: Path, tmp: Path) -> dict[str, Any]:
    """The last checkpoint's full weights and its shards (model and optimizer), flattened."""
    last = sorted(run_dir.glob("checkpoint_*"))[-1]
    tmp.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {f"full/{k}": v for k, v in load_file(str(last / "model.safetensors")).items()}
    dcp_to_torch_save(last / "sharded", tmp / "merged.pt")
    merged = torch.load(tmp / "merged.pt", weights_only=False)

    def flatten(prefix: str, tree: Any) -> None:
        if isinstance(tree, dict):
            for key, value in tree.items():
                flatten(f"{prefix}/{key}", value)
        elif isinstance(tree, (list, tuple)):
            for index, value in enumerate(tree):
                flatten(f"{prefix}/{index}", value)
        else:
            state[prefix] = tree

    flatten("sharded", merged)
    return state


# The same in-process pattern for 1 worker and tensor parallelism:
# tests/faults/test_exact_resume.py::test_session_crashed_mid_epoch_restarts_bit_identical;
# a real worker killed under Ray: test_worker_killed_mid_epoch_resumes_bit_identical there.
# This test is the FSDP variant of those.
@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
def test_fsdp_session_crashed_and_restarted_is_bit_identical(tmp_path: Path) -> None:
    strategy, tp = "fsdp", 1
    straight = train(config(tmp_path / "straight", strategy, tp=tp), 2)
    assert straight[0].final["status"] == "finished"
    crashed = train(config(tmp_path / "crashed", strategy, tp=tp), 2, crash_at=12)
    assert crashed[0].crashed
    run_dir = tmp_path / "crashed" / "t"
    assert [p.name for p in sorted(run_dir.glob("checkpoint_*"))] == ["checkpoint_000000008"]
    manifest = json.loads((run_dir / "checkpoint_000000008" / "manifest.json").read_text())
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 2
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/.metadata"} <= set(manifest["files"])

    resumed = train(config(tmp_path / "crashed", strategy, tp=tp), 2)
    assert resumed[0].final["status"] == "finished"
    assert any(e.startswith("resumed from") and "checkpoint_000000008" in e for e in resumed[0].events)
    a = final_state(tmp_path / "straight" / "t", tmp_path / "a")
    b = final_state(run_dir, tmp_path / "b")
    assert a.keys() == b.keys()
    differ = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    assert not differ, differ[:5]


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_under_ddp_and_with_one_worker_and_says_so(tmp_path: Path) -> None:
    train(config(tmp_path / "crashed", "fsdp"), 2, crash_at=12)
    for strategy, workers in (("ddp", 2), ("fsdp", 1)):
        # Each resume from a copy of the crashed run: the same sharded checkpoint at step 8.
        copy = tmp_path / f"{strategy}-{workers}"
        shutil.copytree(tmp_path / "crashed", copy)
        resumed = train(config(copy, strategy, workers), workers)
        events = resumed[0].events
        assert resumed[0].final["status"] == "finished", resumed[0]
        assert any(e.startswith("resumed from") and "checkpoint_000000008" in e for e in events), events
        if strategy != "fsdp":
            assert any("resharded: the checkpoint was written by fsdp, this run uses ddp" in e for e in events)
        if workers == 1:
            assert any(e.startswith("resumed with 1 workers from a checkpoint written by 2") for e in events), events


@pytest.mark.slow  # three 24-step runs in a pair of gloo ranks: about 30 s
def test_a_torch_optim_class_by_name_resumes_bit_identical(tmp_path: Path) -> None:
    """optim.name Adadelta with its own kwargs (not one of trainforge's three): its state is the
    optimizer component's like any other, so a crashed run resumes to the same weights and moments."""

    def run(tmp: Path) -> dict[str, Any]:
        return tiny_run(
            tmp,
            train={"max_steps": STEPS, "batch_size": 16, "log_every_n_steps": 4},
            optim={"name": "Adadelta", "lr": 1.0, "kwargs": {"rho": 0.95}},
            scaling={"num_workers": 2},
            checkpoint={"every_n_steps": 8, "keep_last": 5},
            seed=3,
        )

    straight = train(run(tmp_path / "straight"), 2)
    assert straight[0].final["status"] == "finished"
    assert train(run(tmp_path / "crashed"), 2, crash_at=12)[0].crashed
    resumed = train(run(tmp_path / "crashed"), 2)
    assert any(e.startswith("resumed from") and "checkpoint_000000008" in e for e in resumed[0].events)
    a = checkpoint_state(tmp_path / "straight" / "t", STEPS)
    b = checkpoint_state(tmp_path / "crashed" / "t", STEPS)
    assert any(key.startswith("optim/") for key in a)  # the moments compared too
    assert_bit_identical(a, b)
