"""Checkpoints in manifest format 2, written by trainforge at d0d294b, still verify and resume.

The fixtures under tests/fixtures/format2 (written by tests/fixtures/make_format2.py, which says
how) are one checkpoint per case, saved at step 4 of an 8-step run: DDP with accumulation (full
layout), FSDP (sharded layout) and DiLoCo between sync points (full layout with ``sync.pt``), all
on 2 workers. Each is copied into a fresh run's checkpoint store and resumed to step 8; the run
ends bit-identical to the same config trained straight to step 8 now, with the same losses at
steps 5-8. The test reaches the format only through the run (the session helper, config dicts),
``CheckpointStore`` and safetensors, so that it outlives a rewrite of the format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.sessions import Trained, final_weights, run_dir_of, train_all
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "format2"
CASES = ("ddp2", "fsdp2", "localsgd2")
SAVED_AT, END = 4, 8
SAVED = checkpoint_name(SAVED_AT)


def config(case: str, output_dir: Path) -> dict[str, Any]:
    """The config that wrote the fixture of ``case``, writing under ``output_dir``."""
    recorded = json.loads((FIXTURES / case / "config.json").read_text())
    recorded["run"]["output_dir"] = str(output_dir)
    return recorded


def store_of(run_config: dict[str, Any]) -> CheckpointStore:
    return CheckpointStore.for_run(str(run_dir_of(run_config).parent), run_config["run"]["name"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Trained, Trained]]:
    """Each case straight to step 8, and resumed from its fixture (a copy) to step 8: the six
    runs in one start-up of 2 ranks. By case: (straight, resumed)."""
    tmp = tmp_path_factory.mktemp("format2")
    configs = []
    for case in CASES:
        straight, resumed = config(case, tmp / "straight" / case), config(case, tmp / "resumed" / case)
        shutil.copytree(FIXTURES / case / SAVED, store_of(resumed).path(SAVED))
        configs += [straight, resumed]
    trained = [Trained(c, outcome) for c, outcome in zip(configs, train_all(configs, workers=2), strict=True)]
    return {case: (trained[2 * i], trained[2 * i + 1]) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES)
def test_fixture_verifies_and_is_format_2(case: str) -> None:
    store = CheckpointStore.from_uri(str(FIXTURES / case))
    assert [entry.name for entry in store.entries()] == [SAVED]
    check = store.verify(SAVED)
    assert check.ok, check.problems
    manifest, why = store.read_manifest(SAVED)
    assert manifest is not None, why
    assert manifest["format_version"] == 2
    assert (manifest["global_step"], manifest["world_size"]) == (SAVED_AT, 2)
    assert manifest["layout"] == ("sharded" if case == "fsdp2" else "full")


@pytest.mark.parametrize("case", CASES)
def test_resume_from_format_2_is_bit_identical(case: str, runs: dict[str, tuple[Trained, Trained]]) -> None:
    straight, resumed = (run.outcome for run in runs[case])
    assert straight.final["status"] == resumed.final["status"] == "finished"
    assert straight.final["step"] == resumed.final["step"] == END
    assert sorted(straight.losses) == list(range(1, END + 1))
    # Only steps 5-8 trained: the run started from the fixture, not afresh.
    assert sorted(resumed.losses) == list(range(SAVED_AT + 1, END + 1))
    assert resumed.losses == {step: loss for step, loss in straight.losses.items() if step > SAVED_AT}

    expected, got = (final_weights(run.config) for run in runs[case])
    assert expected.keys() == got.keys()
    differ = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert not differ, f"{case}: differs after resuming from the format 2 fixture: {differ}"
