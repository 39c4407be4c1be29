"""Checkpoints in format 2, written by trainforge at d0d294b: restore refuses them with one line
that says to run ``trainforge ckpt upgrade``, and the upgrade keeps every value and tensor.

The fixtures under tests/fixtures/format2 (written by tests/fixtures/make_format2.py, which says
how) are one checkpoint per case, saved at step 4 of an 8-step run: DDP with accumulation (full
layout), FSDP (sharded layout) and DiLoCo between sync points (full layout with ``sync.pt``), all
on 2 workers. The fixtures' steps were computed on another machine (another CPU's kernels), so no
test here compares a run with numbers computed there: the upgraded checkpoint holds exactly the
fixture's tensors and state, and two runs resumed from it here end bit-identical to each other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.sessions import Trained, final_weights, run_dir_of, train_all
from tests.unit.test_data_sections import cli
from trainforge.checkpoint.reader import read_whole
from trainforge.checkpoint.saved import read_saved
from trainforge.checkpoint.sharded import read_sharded_whole
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name
from trainforge.checkpoint.upgrade import upgrade
from trainforge.errors import CheckpointError
from trainforge.worker.registry import state_schemas
from trainforge.worker.saving import Candidates

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "format2"
CASES = ("ddp2", "fsdp2", "localsgd2")
SAVED_AT, END = 4, 8
SAVED = checkpoint_name(SAVED_AT)
SCHEMAS = state_schemas()


def config(case: str, output_dir: Path) -> dict[str, Any]:
    """The config that wrote the fixture of ``case``, writing under ``output_dir``."""
    recorded = json.loads((FIXTURES / case / "config.json").read_text())
    recorded["run"]["output_dir"] = str(output_dir)
    return recorded


def store_of(run_config: dict[str, Any]) -> CheckpointStore:
    return CheckpointStore.for_run(str(run_dir_of(run_config).parent), run_config["run"]["name"])


def upgraded_copy(case: str, into: Path) -> Path:
    """The fixture of ``case`` copied to ``into`` and upgraded there."""
    shutil.copytree(FIXTURES / case / SAVED, into)
    upgrade(into, SCHEMAS)
    return into


def equal_trees(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(equal_trees, a, b))
    return bool(a == b)


@pytest.mark.parametrize("case", CASES)
def test_restore_refuses_format_2_with_one_line_that_says_to_upgrade(case: str) -> None:
    store = CheckpointStore.from_uri(str(FIXTURES / case))
    manifest, why = store.read_manifest(SAVED)
    assert manifest is not None, why
    assert (manifest["format_version"], manifest["global_step"], manifest["world_size"]) == (2, SAVED_AT, 2)
    check = store.verify(SAVED, schemas=SCHEMAS)
    assert check.kinds == {"outdated"}
    [problem] = check.problems
    assert "trainforge ckpt upgrade" in problem and "\n" not in problem
    # Restore stops on it rather than start afresh over it (or resume from an older one).
    proposal = Candidates(store, "auto", SCHEMAS).propose()
    assert proposal[0] == "error" and "trainforge ckpt upgrade" in proposal[1], proposal


@pytest.mark.parametrize("case", CASES)
def test_upgrade_keeps_every_value_and_tensor(case: str, tmp_path: Path) -> None:
    fixture = FIXTURES / case / SAVED
    path = upgraded_copy(case, tmp_path / SAVED)
    store = CheckpointStore.from_uri(str(tmp_path))
    assert store.verify(SAVED, schemas=SCHEMAS).ok
    assert (tmp_path / f".format2-{SAVED}" / "trainer_state.json").is_file()  # the original, kept
    manifest, _ = store.read_manifest(SAVED)
    assert manifest is not None and manifest["format_version"] == 3

    old = json.loads((fixture / "trainer_state.json").read_text())
    saved = read_saved(path, SCHEMAS)
    assert (saved.step, saved.world) == (SAVED_AT, 2)
    assert saved.components["progress"]["global_step"] == old["progress"]["global_step"]
    assert saved.components["data"]["position"] == old["progress"]["epoch_position"]
    assert saved.components["schedule"] == {k: v for k, v in old["scheduler"].items() if k != "lr_lambdas"}
    assert [mine["rng"] for mine in saved.ranks] == old["rng"]
    if case == "fsdp2":
        assert equal_trees(read_whole(path, "model"), read_sharded_whole(fixture, "model"))
        assert equal_trees(read_whole(path, "optimizer"), read_sharded_whole(fixture, "optim"))
        return
    assert equal_trees(load_file(str(path / "model.safetensors")), load_file(str(fixture / "model.safetensors")))
    assert (path / "optimizer.pt").read_bytes() == (fixture / "optimizer.pt").read_bytes()
    if case == "localsgd2":
        sync = torch.load(fixture / "sync.pt", weights_only=True)
        assert saved.components["sync"] == {k: sync[k] for k in ("last_sync", "every_n_steps")}
        shared = torch.load(path / "sync.pt", weights_only=True)
        assert equal_trees(shared, {"anchor": sync["anchor"], "outer": sync["outer"]})
        for rank in range(2):
            assert equal_trees(torch.load(path / f"ranks/{rank}/sync.pt", weights_only=True), sync["ranks"][rank])


def test_upgrade_refuses_a_current_or_a_corrupt_checkpoint(tmp_path: Path) -> None:
    path = upgraded_copy("ddp2", tmp_path / "current" / SAVED)
    with pytest.raises(CheckpointError, match="already of format 3: nothing to upgrade"):
        upgrade(path, SCHEMAS)
    corrupt = tmp_path / "corrupt" / SAVED
    shutil.copytree(FIXTURES / "ddp2" / SAVED, corrupt)
    data = bytearray((corrupt / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (corrupt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"does not verify, so it is not upgraded: model\.safetensors fails"):
        upgrade(corrupt, SCHEMAS)
    assert sorted(p.name for p in corrupt.parent.iterdir()) == [SAVED]  # nothing written beside it


def test_ckpt_upgrade_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / SAVED
    shutil.copytree(FIXTURES / "localsgd2" / SAVED, path)
    code, out, _ = cli(capsys, "ckpt", "upgrade", str(path))
    assert code == 0 and out.startswith(f"upgraded: {path} (format 2 -> 3"), out
    code, _, err = cli(capsys, "ckpt", "upgrade", str(path))
    assert code == 2 and "nothing to upgrade" in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Trained, Trained]]:
    """Each case resumed twice, here, from the same upgraded fixture to step 8: the six runs in
    one start-up of 2 ranks. By case: (first, second)."""
    tmp = tmp_path_factory.mktemp("format2")
    configs = []
    for case in CASES:
        upgraded = upgraded_copy(case, tmp / "upgraded" / case / SAVED)
        first, second = config(case, tmp / "first" / case), config(case, tmp / "second" / case)
        for resumed in (first, second):
            shutil.copytree(upgraded, store_of(resumed).path(SAVED))
        configs += [first, second]
    trained = [Trained(c, outcome) for c, outcome in zip(configs, train_all(configs, workers=2), strict=True)]
    return {case: (trained[2 * i], trained[2 * i + 1]) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES)
def test_resume_from_upgraded_format_2_is_deterministic(case: str, runs: dict[str, tuple[Trained, Trained]]) -> None:
    first, second = (run.outcome for run in runs[case])
    assert first.final["status"] == second.final["status"] == "finished"
    assert first.final["step"] == second.final["step"] == END
    # Only steps 5-8 trained: the runs started from the upgraded fixture, not afresh.
    assert sorted(first.losses) == list(range(SAVED_AT + 1, END + 1))
    assert first.losses == second.losses
    a, b = (final_weights(run.config) for run in runs[case])
    assert a.keys() == b.keys()
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, f"{case}: two resumes from the same upgraded checkpoint differ: {differ}"
