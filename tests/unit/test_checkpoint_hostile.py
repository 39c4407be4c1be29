"""Hostile and damaged checkpoints (issue 9, sections 2 and 3): the one verification refuses them
quickly and in one line, restore walks past what verifies but does not load, rotation counts only
verified checkpoints, commits never set aside a valid one.

Real files throughout: symbolic links, FIFOs, sparse files, undecodable names, real models.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn

from tests.helpers import checkpoints
from tests.helpers.checkpoints import MODEL_FILE, OPTIMIZER_FILE, snapshot
from tests.helpers.timing import scaled
from tests.unit.test_checkpoint import (
    flip_byte,
    names,
    save_all,
    small_model,
    trained,
    write_checkpoint,
)
from trainforge.checkpoint import inspect as ckpt_inspect
from trainforge.checkpoint.format import MANIFEST, sha256_file, write_manifest
from trainforge.checkpoint.saved import read_saved
from trainforge.checkpoint.state import STATE_FILE
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name
from trainforge.checkpoint.upgrade import upgrade
from trainforge.checkpoint.verify import Verification
from trainforge.checkpoint.writer import CheckpointWriter, RotationPolicy
from trainforge.config import Config
from trainforge.errors import CheckpointError
from trainforge.worker.build import WorkerRun
from trainforge.worker.components.data import DataSource
from trainforge.worker.registry import build_components, state_schemas
from trainforge.worker.saving import restore
from trainforge.worker.schedule import build_scheduler
from trainforge.worker.step import StepRunner


def check(directory: Path) -> Verification:
    """What restore, rotation and ``ckpt verify`` all use (with the components' schemas)."""
    store, name = CheckpointStore.for_checkpoint(str(directory))
    return store.verify(name, schemas=state_schemas())


def edit_manifest(directory: Path, change: Any) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    change(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "run" / checkpoint_name(7)
    write_checkpoint(directory)
    return directory


# ---------------------------------------------------------------------------------------------
# Section 2: verification


def test_a_manifest_listing_no_files_does_not_verify(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda m: m.update(files={}))
    [problem] = check(ckpt).problems
    assert problem == "manifest.json is malformed: top level: Value error, does not list trainer_state.json"


def test_files_the_manifest_does_not_list_or_that_are_missing_do_not_verify(ckpt: Path) -> None:
    (ckpt / "extra.bin").write_bytes(b"x")
    assert check(ckpt).problems == ("extra.bin is not listed in the manifest (unexpected file)",)
    (ckpt / "extra.bin").unlink()
    (ckpt / OPTIMIZER_FILE).unlink()
    edit_manifest(ckpt, lambda m: m["files"].pop(OPTIMIZER_FILE))
    # The checkpoint's own record names each component's files: one it lists and the manifest does not is missing.
    assert check(ckpt).problems == ("trainer_state.json names optimizer.pt, which the checkpoint does not hold",)


def test_a_symbolic_link_out_of_the_checkpoint_is_refused(ckpt: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.pt"
    (ckpt / OPTIMIZER_FILE).rename(outside)  # same bytes: the hash would match through the link
    (ckpt / OPTIMIZER_FILE).symlink_to(outside)
    assert check(ckpt).problems == ("optimizer.pt is a symbolic link, not a regular file",)
    assert "optimizer.pt is a symbolic link" in " ".join(ckpt_inspect.inspect_checkpoint(str(ckpt))["problems"])


@pytest.mark.parametrize("name", ["../outside.pt", "/etc/hostname", "sub/../../outside.pt", "a\\..\\b", ".hidden"])
def test_manifest_names_outside_the_checkpoint_are_refused_before_anything_is_read(
    ckpt: Path, tmp_path: Path, name: str
) -> None:
    outside = tmp_path / "run" / "outside.pt"
    outside.write_bytes(b"secret")
    entry = {"size": 6, "sha256": sha256_file(outside)}
    edit_manifest(ckpt, lambda m: m["files"].update({name: entry}))
    [problem] = check(ckpt).problems
    assert problem.startswith("manifest.json is malformed: files: Value error, ")
    assert "is not a plain relative file name inside the checkpoint" in problem


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", [STATE_FILE, MANIFEST, MODEL_FILE])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(ckpt: Path, name: str) -> None:
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    [problem] = check(ckpt).problems
    assert f"{name} is a FIFO, not a regular file" in problem
    report = ckpt_inspect.inspect_checkpoint(str(ckpt))
    assert any(f"{name} is a FIFO" in p for p in report["problems"])
    assert not ckpt_inspect.list_checkpoints(str(ckpt.parent))[0].valid


@pytest.mark.timeout(30)
def test_a_manifest_linked_to_dev_zero_is_a_problem_not_a_memory_error(ckpt: Path) -> None:
    (ckpt / MANIFEST).unlink()
    (ckpt / MANIFEST).symlink_to("/dev/zero")
    assert check(ckpt).problems == ("manifest.json is a symbolic link, not a regular file",)
    store, name = CheckpointStore.for_checkpoint(str(ckpt))
    assert store.read_manifest(name) == (None, "manifest.json is a symbolic link, not a regular file")


@pytest.mark.timeout(30)
def test_an_oversized_manifest_is_refused_unread(ckpt: Path) -> None:
    with (ckpt / MANIFEST).open("r+b") as handle:
        handle.truncate(1 << 40)  # 1 TB, sparse
    started = time.perf_counter()
    assert check(ckpt).problems == ("manifest.json is larger than 8 MB: not a file trainforge wrote",)
    assert time.perf_counter() - started < 5


@pytest.mark.timeout(30)
def test_a_huge_file_declared_small_is_never_hashed(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda m: m["files"][OPTIMIZER_FILE].update(size=0))
    with (ckpt / OPTIMIZER_FILE).open("r+b") as handle:
        handle.truncate(1 << 40)  # 1 TB, sparse: hashing it would take hours
    started = time.perf_counter()
    assert check(ckpt).problems == (f"optimizer.pt has {1 << 40} bytes, manifest says 0 (truncated or overwritten)",)
    assert time.perf_counter() - started < 5


def fixed_fields(state: dict[str, Any]) -> dict[str, Any]:
    """A ``trainer_state.json`` of components (format 3) as trainforge wrote the same state before
    components: formats 1 and 2, fixed fields, still read."""
    components, data = state["components"], state["components"]["data"]
    return {
        "progress": {
            **components["progress"],
            "epoch": data["epoch"],
            "epoch_position": data["position"],
            "world_size": state["world_size"],
            **{key: data[key] for key in ("micro_batch_size", "grad_accum_steps") if key in data},
        },
        "scheduler": components["schedule"],
        "scaler": components["scaler"],
        "rng": [mine["rng"] for mine in state["ranks"]],
        **{key: state[key] for key in ("metrics", "config", "versions")},
    }


def format_2(change: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    """``change`` made to the same state in format 2's fixed fields (the state is replaced in place)."""

    def edit(state: dict[str, Any]) -> None:
        fixed = fixed_fields(state)
        change(fixed)
        state.clear()
        state.update(fixed)

    return edit


def progress(state: dict[str, Any]) -> dict[str, Any]:
    return state["components"]["progress"]


def rng(state: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return state["ranks"][rank]["rng"]


WRONG_TYPES = {
    "progress as a list": (
        STATE_FILE,
        lambda s: s["components"].update(progress=[1, 2]),
        "components.progress: Input should be a valid",
    ),
    "rng as a number": (STATE_FILE, lambda s: s["ranks"][0].update(rng=7), "ranks.0.rng: Input should be a valid"),
    "step as a string": (STATE_FILE, lambda s: progress(s).update(global_step="7"), "components.progress.global_step"),
    "rng of another rank count": (STATE_FILE, lambda s: s["ranks"].append(s["ranks"][0]), "holds 2 rank states for 1"),
    "python rng cut short": (STATE_FILE, lambda s: rng(s)["python"][1].pop(), "ranks.0.rng.python.1"),
    # Verified and loaded, then crashed every restart, before components had their own schemas:
    "a key the schedule does not hold": (
        STATE_FILE,
        lambda s: s["components"]["schedule"].update(optimizer=0),
        "components.schedule.optimizer: Extra inputs are not permitted",
    ),
    "a component this trainforge does not know": (
        STATE_FILE,
        lambda s: s["components"].update(warp_drive={}),
        "components.warp_drive: a component this trainforge does not know",
    ),
    # Format 2: restore says to upgrade it, and `trainforge ckpt upgrade` refuses what does not check.
    "format 2 progress as a list": (
        STATE_FILE,
        format_2(lambda s: s.update(progress=[1, 2])),
        "progress: Input should be a valid",
    ),
    "format 2 rng as a number": (STATE_FILE, format_2(lambda s: s.update(rng=7)), "rng: Input should be a valid list"),
    "format 2 step as a string": (
        STATE_FILE,
        format_2(lambda s: s["progress"].update(global_step="7")),
        "progress.global_step",
    ),
    "format 2 rng of another rank count": (
        STATE_FILE,
        format_2(lambda s: s["rng"].append(s["rng"][0])),
        "holds 2 RNG states for 1",
    ),
    "format 2 python rng cut short": (STATE_FILE, format_2(lambda s: s["rng"][0]["python"][1].pop()), "rng.python.1"),
    "format 2 optim config not a table": (
        STATE_FILE,
        format_2(lambda s: s["config"].update(optim="adam")),
        "config.optim",
    ),
    "format 2 key the schedule does not hold": (
        STATE_FILE,
        format_2(lambda s: s["scheduler"].update(optimizer=0)),
        "components.schedule.optimizer: Extra inputs are not permitted",
    ),
    # Every number read back is bounded: a step of 10**30 verified, then the run "finished" at once.
    "step beyond any run": (STATE_FILE, lambda s: s.update(global_step=10**30), "global_step"),
    "progress step beyond any run": (
        STATE_FILE,
        lambda s: progress(s).update(global_step=10**30),
        "components.progress.global_step",
    ),
    "format 2 step beyond any run": (
        STATE_FILE,
        format_2(lambda s: s["progress"].update(global_step=10**30)),
        "progress.global_step",
    ),
    "format 2 epoch beyond any run": (
        STATE_FILE,
        format_2(lambda s: s["progress"].update(epoch=10**30)),
        "progress.epoch",
    ),
    "format 2 ranks beyond any cluster": (
        STATE_FILE,
        format_2(lambda s: s["progress"].update(world_size=10**30)),
        "progress.world_size",
    ),
    "a learning rate that is not a number": (
        STATE_FILE,
        lambda s: s["components"]["schedule"].update(base_lrs=[math.nan]),
        "components.schedule.base_lrs.0",
    ),
    "an infinite loss scale": (
        STATE_FILE,
        lambda s: s["components"]["scaler"].update(scale=math.inf),
        "components.scaler.scale",
    ),
    "manifest step beyond any run": (MANIFEST, lambda m: m.update(global_step=10**30), "global_step"),
    "manifest ranks beyond any cluster": (MANIFEST, lambda m: m.update(world_size=10**30), "world_size"),
    "manifest date beyond any clock": (MANIFEST, lambda m: m.update(created_at=1e300), "created_at"),
    "date as a string": (MANIFEST, lambda m: m.update(created_at="2026-11-23"), "created_at"),
    "unknown format": (MANIFEST, lambda m: m.update(format_version=4), "format_version 4 is not one"),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_json_metadata_of_the_wrong_types_does_not_verify(ckpt: Path, case: str) -> None:
    rel, change, expected = WRONG_TYPES[case]
    data = json.loads((ckpt / rel).read_text())
    change(data)
    (ckpt / rel).write_text(json.dumps(data))
    if rel != MANIFEST:
        write_manifest(ckpt, {"global_step": 7})  # hashes that match: only the schema can tell
    if case.startswith("format 2 "):
        assert check(ckpt).kinds == {"outdated"}
        with pytest.raises(CheckpointError) as refused:
            upgrade(ckpt, state_schemas())
        assert f"{rel} is malformed: " in str(refused.value) and expected in str(refused.value), refused.value
        return
    [problem] = check(ckpt).problems
    assert problem.startswith(f"{rel} is malformed: ") and expected in problem, problem
    if rel == STATE_FILE:
        with pytest.raises(CheckpointError, match=r"trainer_state\.json is malformed"):
            read_saved(ckpt, state_schemas())


def test_an_undecodable_file_name_is_a_problem_not_a_traceback(ckpt: Path) -> None:
    odd = os.fsencode(ckpt) + b"/\xff\xfe.bin"
    with open(odd, "wb") as handle:
        handle.write(b"x")
    [problem] = check(ckpt).problems
    assert problem == "\\udcff\\udcfe.bin has a name that is not a plain file name (unexpected file)"
    report = ckpt_inspect.inspect_checkpoint(str(ckpt))
    json.dumps(report)
    Console(file=io.StringIO(), width=200).print(ckpt_inspect.inspection_view(report))
    assert problem in report["problems"]
    with open(os.fsencode(ckpt.parent) + b"/\xff-run", "wb"):
        pass
    assert [row.name for row in ckpt_inspect.list_checkpoints(str(ckpt.parent))] == [ckpt.name]


def write_format_1_manifest(directory: Path, meta: dict[str, Any]) -> None:
    """The manifest as trainforge wrote it before format 2: files read back, {size, sha256} each."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST and not path.name.startswith("."):
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    (directory / MANIFEST).write_text(json.dumps({"format_version": 1, "files": files, **meta}, indent=1))


def test_old_checkpoints_of_format_1_are_upgraded(ckpt: Path) -> None:
    # trainer_state.json as format 1 held it (the fixed fields); the tensor files are the same.
    state = json.loads((ckpt / STATE_FILE).read_text())
    (ckpt / STATE_FILE).write_text(json.dumps(fixed_fields(state), indent=1))
    # Only the keys format 1 always had: files and format_version.
    write_format_1_manifest(ckpt, {})
    assert check(ckpt).kinds == {"outdated"}
    write_format_1_manifest(ckpt, {"global_step": 7, "epoch": 0, "metrics": {}, "created_at": 1.0, "world_size": 1})
    assert check(ckpt).kinds == {"outdated"}
    flip = bytearray((ckpt / MODEL_FILE).read_bytes())
    flip[-1] ^= 1
    (ckpt / MODEL_FILE).write_bytes(bytes(flip))
    assert check(ckpt).problems == ("model.safetensors fails its SHA-256 check (corrupted)",)
    flip[-1] ^= 1
    (ckpt / MODEL_FILE).write_bytes(bytes(flip))
    assert upgrade(ckpt, state_schemas()).old_format == 1
    assert check(ckpt).ok
    # Format 1 kept the optimizer's name only in the config (this test's records none).
    upgraded = read_saved(ckpt, state_schemas()).components
    assert upgraded == {**state["components"], "optimizer": {}}


def test_format_1_keys_in_a_format_2_manifest_and_the_reverse_do_not_verify(ckpt: Path) -> None:
    write_format_1_manifest(ckpt, {"hash": "blake3"})
    assert "format 1 has no hash or layout keys" in check(ckpt).problems[0]
    write_manifest(ckpt, {})
    edit_manifest(ckpt, lambda m: m.update(format_version=1))
    assert "format 1 has no hash or layout keys" in check(ckpt).problems[0]
    for version in (2, 3):
        write_manifest(ckpt, {})
        edit_manifest(ckpt, lambda m: m.update(format_version=version))  # noqa: B023 (called at once)
        edit_manifest(ckpt, lambda m: m["files"][MODEL_FILE].update(sha256=m["files"][MODEL_FILE].pop("digest")))
        assert f"format {version} gives each file a digest" in check(ckpt).problems[0]


# ---------------------------------------------------------------------------------------------
# Section 2: restore falls back past a checkpoint that verifies but does not load


def write_wide_checkpoint(directory: Path, step: int) -> None:
    """A valid checkpoint of another model shape (hidden width 32 instead of 16)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    checkpoints.write_checkpoint(directory, model, trained(model), step)


def worker_run(tmp_path: Path, resume: str = "auto") -> WorkerRun:
    """A world-size-1 worker run of ``small_model`` built without Ray (restore needs no collective)."""
    config = Config.model_validate(
        {
            "run": {"name": "t", "output_dir": str(tmp_path)},
            "model": {"name": "mlp"},
            "data": {"name": "synthetic"},
            "optim": {"name": "adam", "lr": 0.01},
            "train": {"max_steps": 100, "batch_size": 8},
            "checkpoint": {"resume": resume},
        }
    )
    model = small_model(seed=9)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = build_scheduler(config.schedule, optimizer, 100)
    runner = StepRunner(
        model, None, optimizer, scheduler, device=torch.device("cpu"), precision="fp32", grad_clip_norm=None
    )  # type: ignore[arg-type]
    data = DataSource.build(config, 0, 1, pin_memory=False)
    run = WorkerRun(config, 0, 1, torch.device("cpu"), model, None, runner, data, 100)  # type: ignore[arg-type]
    run.components = build_components(run)
    return run


def test_restore_walks_past_a_checkpoint_that_verifies_but_does_not_load(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / checkpoint_name(5), step=5)
    write_wide_checkpoint(run_dir / checkpoint_name(10), step=10)
    store = CheckpointStore.from_uri(str(run_dir))
    assert store.verify(checkpoint_name(10)).ok  # valid: it is only the model that differs

    run = worker_run(tmp_path)
    restored = restore(run, store)

    assert restored.source == str(run_dir / checkpoint_name(5)) and restored.progress.global_step == 5
    [(skipped, reason)] = restored.skipped
    assert skipped == "checkpoint_000000010" and reason.startswith("does not load into this run's model: ")
    assert "size mismatch" in reason and "\n" not in reason
    expected = small_model()
    trained(expected)
    for key, value in expected.state_dict().items():  # fully the older checkpoint's weights
        assert torch.equal(run.model.state_dict()[key], value), key


def test_restore_with_no_loadable_checkpoint_stops_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_wide_checkpoint(run_dir / checkpoint_name(10), step=10)
    write_checkpoint(run_dir / checkpoint_name(5), step=5)
    flip_byte(run_dir / checkpoint_name(5))  # the only one of the right shape does not verify
    with pytest.raises(CheckpointError) as caught:
        restore(worker_run(tmp_path), CheckpointStore.from_uri(str(run_dir)))
    message = str(caught.value)
    assert message.startswith("no checkpoint of this run loads into the model as configured (checkpoint_000000010")
    assert "\n" not in message and "another run.name" in message


def test_an_explicit_resume_that_does_not_load_is_a_one_line_error(tmp_path: Path) -> None:
    other = tmp_path / "other" / checkpoint_name(10)
    write_wide_checkpoint(other, step=10)
    with pytest.raises(CheckpointError) as caught:
        restore(worker_run(tmp_path, resume=str(other)), CheckpointStore.from_uri(str(tmp_path / "run")))
    assert str(caught.value).startswith(f"checkpoint {other} does not load into this run: checkpoint_000000010 ")
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------------------------------
# Section 3: rotation, staging, commit


def writer(tmp_path: Path, store: CheckpointStore, **policy: Any) -> CheckpointWriter:
    """Rank 0's writer of a one-worker run, verifying for rotation as a run's does."""
    rotation = RotationPolicy(**{"keep_last": 2, **policy})
    return CheckpointWriter(store, rotation, schemas=state_schemas(), scratch=tmp_path / "scratch")


def test_rotation_counts_only_verified_checkpoints(tmp_path: Path) -> None:
    # A walk-back: 20 is corrupt, the run resumed from 10 and now saves 15.
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / checkpoint_name(10), step=10)
    write_checkpoint(run_dir / checkpoint_name(20), step=20)
    flip_byte(run_dir / checkpoint_name(20))
    store = CheckpointStore.from_uri(str(run_dir))
    model = small_model()
    [outcome] = save_all(writer(tmp_path, store), [snapshot(model, trained(model), 15)])
    assert outcome.error is None
    # Two valid copies kept; the corrupt one is not deleted (evidence) but does not count.
    assert names(store) == [checkpoint_name(10), checkpoint_name(15), checkpoint_name(20)]


def test_rotation_counts_only_the_run_s_own_line_not_a_foreign_checkpoint_that_verifies(tmp_path: Path) -> None:
    # The probe: keep_last 2, a foreign (valid, unloadable) checkpoint_000000440 in the run's folder;
    # the run resumes from 22 and saves 40, 60, 66. It used to delete 20, 22, 40 and 60.
    run_dir = tmp_path / "run"
    for step in (20, 22):
        write_checkpoint(run_dir / checkpoint_name(step), step=step)
    write_wide_checkpoint(run_dir / checkpoint_name(440), step=440)
    store = CheckpointStore.from_uri(str(run_dir))
    restored = restore(worker_run(tmp_path), store)
    assert restored.progress.global_step == 22 and [n for n, _ in restored.skipped] == [checkpoint_name(440)]
    saver = writer(tmp_path, store)
    saver.passed_over.update(n for n, _ in restored.skipped)  # as the worker loop hands it on
    model = small_model()
    outcomes = save_all(saver, [snapshot(model, trained(model), step) for step in (40, 60, 66)])
    assert [o.error for o in outcomes] == [None, None, None]
    assert names(store) == [checkpoint_name(60), checkpoint_name(66), checkpoint_name(440)]


def test_a_passed_over_checkpoint_written_again_by_the_run_counts_again(tmp_path: Path) -> None:
    # Restore walked past a corrupt 20; the run saves 20 anew (the corrupt one set aside): the new 20
    # is the run's own and counts, so keep_last 2 keeps 20 and 30 and deletes 10.
    run_dir = tmp_path / "run"
    for step in (10, 20):
        write_checkpoint(run_dir / checkpoint_name(step), step=step)
    flip_byte(run_dir / checkpoint_name(20))
    store = CheckpointStore.from_uri(str(run_dir))
    restored = restore(worker_run(tmp_path), store)
    assert [n for n, _ in restored.skipped] == [checkpoint_name(20)]
    saver = writer(tmp_path, store)
    saver.passed_over.update(n for n, _ in restored.skipped)
    model = small_model()
    outcomes = save_all(saver, [snapshot(model, trained(model), step) for step in (20, 30)])
    assert [o.error for o in outcomes] == [None, None]
    assert names(store) == [checkpoint_name(20), checkpoint_name(30)]


def test_rotation_leaves_alone_a_checkpoint_of_a_later_step_than_the_one_written(tmp_path: Path) -> None:
    # A foreign checkpoint copied in after the run restored: not passed over, still not the run's.
    run_dir = tmp_path / "run"
    store = CheckpointStore.from_uri(str(run_dir))
    saver = writer(tmp_path, store)
    model = small_model()
    save_all(saver, [snapshot(model, trained(model), 10)])
    write_wide_checkpoint(run_dir / checkpoint_name(900), step=900)
    outcomes = save_all(saver, [snapshot(model, trained(model), step) for step in (20, 30)])
    assert [o.error for o in outcomes] == [None, None]
    assert names(store) == [checkpoint_name(20), checkpoint_name(30), checkpoint_name(900)]


def test_rotation_verifies_again_a_checkpoint_corrupted_after_its_save(tmp_path: Path) -> None:
    # 20 was verified when written; a byte flipped since must not let it push 10 (valid) out.
    run_dir = tmp_path / "run"
    store = CheckpointStore.from_uri(str(run_dir))
    saver = writer(tmp_path, store)
    model = small_model()
    save_all(saver, [snapshot(model, trained(model), step) for step in (10, 20)])
    flip_byte(run_dir / checkpoint_name(20))
    later = time.time() + 5  # a coarse file-system clock must not hide the rewrite
    os.utime(run_dir / checkpoint_name(20) / MODEL_FILE, (later, later))
    [outcome] = save_all(saver, [snapshot(model, trained(model), 30)])
    assert outcome.error is None
    # Two valid copies (10 and 30); the corrupt 20 kept as evidence, not counted.
    assert names(store) == [checkpoint_name(10), checkpoint_name(20), checkpoint_name(30)]
    assert store.verify(checkpoint_name(10)).ok and not store.verify(checkpoint_name(20)).ok


@pytest.mark.parametrize("odd", [math.nan, "not a number", True])
def test_a_best_metric_that_is_not_a_finite_number_never_wins(tmp_path: Path, odd: Any) -> None:
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / checkpoint_name(10), step=10, **{"val/loss": odd})
    write_checkpoint(run_dir / checkpoint_name(20), step=20, **{"val/loss": 0.1})
    write_checkpoint(run_dir / checkpoint_name(30), step=30, **{"val/loss": 0.5})
    store = CheckpointStore.from_uri(str(run_dir))
    model = small_model()
    saves = [snapshot(model, trained(model), step, {"val/loss": 0.9}) for step in (40, 50)]
    outcomes = save_all(writer(tmp_path, store, keep_last=1, metric="val/loss", mode="min"), saves)
    assert [o.error for o in outcomes] == [None, None]
    assert names(store) == [checkpoint_name(20), checkpoint_name(50)]


def test_a_rotation_failure_does_not_fail_the_committed_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    write_checkpoint(tmp_path / "run" / checkpoint_name(1), step=1)

    def refuse(name: str) -> None:
        raise PermissionError(f"cannot delete {name}")

    monkeypatch.setattr(store, "delete", refuse)
    model = small_model()
    [outcome] = save_all(writer(tmp_path, store, keep_last=1), [snapshot(model, trained(model), 5)])
    assert outcome.error is None and outcome.uri == store.uri(checkpoint_name(5))
    assert store.verify(checkpoint_name(5)).ok


def test_staging_dirs_of_crashed_saves_are_removed_but_not_one_in_flight(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    crashed = run_dir / ".tmp-checkpoint_000000003-deadbeef"
    crashed.mkdir(parents=True)
    (crashed / MODEL_FILE).write_bytes(b"\x00" * 100)
    os.utime(crashed, (time.time() - 600, time.time() - 600))
    store = CheckpointStore.from_uri(str(run_dir))
    saver = writer(tmp_path, store)
    in_flight = run_dir / ".tmp-checkpoint_000000004-0badf00d"  # another process, started after us
    in_flight.mkdir()
    model = small_model()
    save_all(saver, [snapshot(model, trained(model), 5)])
    assert store.leftovers() == [in_flight.name]


def test_commit_fsyncs_the_staging_directory_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(descriptor: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def rename(source: Any, target: Any) -> None:
        events.append(("rename", str(source)))
        real_rename(source, target)

    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    staging = store.staging_dir(checkpoint_name(5), tmp_path / "scratch")
    write_checkpoint(staging, step=5)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    store.commit(staging, checkpoint_name(5))
    assert events.index(("fsync", str(staging))) < events.index(("rename", str(staging)))
    assert events[-1] == ("fsync", store.root)


def test_commit_never_sets_aside_a_checkpoint_that_verifies(tmp_path: Path) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    name = checkpoint_name(5)
    write_checkpoint(Path(store.path(name)), step=5)
    before = sha256_file(Path(store.path(name)) / MODEL_FILE)
    staging = store.staging_dir(name, tmp_path / "scratch")
    write_checkpoint(staging, step=5)
    with pytest.raises(CheckpointError, match="already exists and verifies; it was not replaced"):
        store.commit(staging, name)
    assert sha256_file(Path(store.path(name)) / MODEL_FILE) == before and store.verify(name).ok
    assert not [p for p in Path(store.root).iterdir() if p.name.startswith(".invalid-")]


def test_invalid_checkpoints_set_aside_in_the_same_second_do_not_collide(tmp_path: Path) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    name = checkpoint_name(5)
    for _ in range(3):
        write_checkpoint(Path(store.path(name)), step=5)
        flip_byte(Path(store.path(name)))
        staging = store.staging_dir(name, tmp_path / "scratch")
        write_checkpoint(staging, step=5)
        store.commit(staging, name)
        assert store.verify(name).ok
        store.delete(name)
    retired = [p.name for p in Path(store.root).iterdir() if p.name.startswith(".invalid-checkpoint_000000005-")]
    assert len(retired) == 3


TWO_RANKS = """
import json, sys
from pathlib import Path
import torch.distributed as dist
from torch import nn
import tests.unit.test_checkpoint_hostile as h
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.errors import CheckpointError
from trainforge.worker.saving import restore

rank, tmp = int(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 2), rank=rank, world_size=2)
run = h.worker_run(tmp)
run.rank, run.world = rank, 2
if rank == 1:  # this rank's model has the other shape: it loads what rank 0 cannot, and not what rank 0 can
    run.model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    run.runner.optimizer = h.torch.optim.Adam(run.model.parameters(), lr=0.01)
    run.runner.scheduler = h.build_scheduler(run.config.schedule, run.runner.optimizer, 100)
run.components = h.build_components(run)  # of this rank's model and optimizer
try:
    restored = restore(run, CheckpointStore.from_uri(str(tmp / "run")))
    print(json.dumps({"source": restored.source}))
except CheckpointError as err:
    print(json.dumps({"error": str(err)}))
dist.destroy_process_group()
"""


def test_ranks_that_disagree_on_loadability_move_on_and_stop_together(tmp_path: Path) -> None:
    """Two gloo ranks in two processes: each candidate fails on one of them, so both skip both and
    both stop with the same one-line error (no rank trains on a checkpoint another refused)."""
    root = Path(__file__).resolve().parents[2]
    write_wide_checkpoint(tmp_path / "run" / checkpoint_name(5), step=5)
    write_checkpoint(tmp_path / "run" / checkpoint_name(10), step=10)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(rank), str(tmp_path)],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=scaled(240)) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert results[0] == results[1], results
    assert results[0]["error"].startswith("no checkpoint of this run loads into the model as configured")
