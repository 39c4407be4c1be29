"""The checkpoint format, storage, state files and background writer, on real files.

No mocks: failures are produced by real file systems (a path under a regular file, a file-size
limit, and, where the test may mount, a full or read-only tmpfs), hostile files are real pickles.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import torch
from rich.console import Console
from torch import nn

from tests.helpers import checkpoints
from tests.helpers.checkpoints import MODEL_FILE, OPTIMIZER_FILE, load_optimizer, load_weights, snapshot
from tests.helpers.mounts import tmpfs
from tests.helpers.timing import scaled
from trainforge.checkpoint import inspect as ckpt_inspect
from trainforge.checkpoint.format import MANIFEST, write_manifest
from trainforge.checkpoint.saved import read_saved
from trainforge.checkpoint.state import (
    STATE_FILE,
    Snapshot,
    State,
    capture_rng,
    model_snapshot,
    restore_rng,
    tensor_file,
    write_tensors,
)
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name
from trainforge.checkpoint.verify import Verification
from trainforge.checkpoint.writer import CheckpointWriter, RotationPolicy, SaveOutcome
from trainforge.worker.registry import COMPONENTS, state_schemas

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = state_schemas()  # the components' own, as restore, rotation and `ckpt verify` pass them


# ---------------------------------------------------------------------------------------------
# Helpers: a small trained model and real checkpoints


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def trained(model: nn.Module) -> torch.optim.Optimizer:
    """An Adam optimizer with state after two real steps."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        optimizer.step()
    return optimizer


def write_checkpoint(directory: Path, step: int = 7, **metrics: Any) -> dict[str, Any]:
    """A complete checkpoint directory of ``small_model`` after two steps, written as the writer
    lays one out (``tests/helpers/checkpoints.py``); returns its manifest."""
    model = small_model()
    return checkpoints.write_checkpoint(directory, model, trained(model), step, metrics)


def save_all(writer: CheckpointWriter, snapshots: list[Snapshot]) -> list[SaveOutcome]:
    outcomes = []
    for snap in snapshots:
        writer.save_async(snap)
        writer.wait()
        outcomes.extend(writer.collect())
    return outcomes


def verify(directory: Path) -> Verification:
    """The one verification, of a checkpoint directory given by its path, with the components'
    schemas."""
    store, name = CheckpointStore.for_checkpoint(str(directory))
    return store.verify(name, schemas=SCHEMAS)


def read_manifest(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    store, name = CheckpointStore.for_checkpoint(str(directory))
    return store.read_manifest(name)


def names(store: CheckpointStore) -> list[str]:
    return [e.name for e in store.entries()]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "run" / checkpoint_name(7)
    write_checkpoint(directory, **{"train/loss": 0.5})
    return directory


# ---------------------------------------------------------------------------------------------
# format: manifest and verification


def test_manifest_round_trip(checkpoint: Path) -> None:
    manifest, problem = read_manifest(checkpoint)
    assert problem is None and manifest is not None
    assert set(manifest["files"]) == {MODEL_FILE, OPTIMIZER_FILE, STATE_FILE}
    for rel, entry in manifest["files"].items():
        data = (checkpoint / rel).read_bytes()
        assert entry == {"size": len(data), "digest": blake3.blake3(data).hexdigest()}
    assert manifest["global_step"] == 7 and manifest["metrics"] == {"train/loss": 0.5}
    assert (manifest["format_version"], manifest["hash"], manifest["layout"]) == (3, "blake3", "full")
    store, name = CheckpointStore.for_checkpoint(str(checkpoint))
    assert store.read_manifest(name) == (manifest, None)
    assert verify(checkpoint).ok and store.verify(name).ok
    assert ckpt_inspect.verify_checkpoint(str(checkpoint)).ok
    # Hidden files (temp files of an atomic write) never enter the manifest.
    (checkpoint / ".scratch").write_text("x")
    assert ".scratch" not in write_manifest(checkpoint, {})["files"]


def truncate(directory: Path) -> None:
    path = directory / OPTIMIZER_FILE
    path.write_bytes(path.read_bytes()[:-100])


def flip_byte(directory: Path) -> None:
    path = directory / MODEL_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def remove_optimizer(directory: Path) -> None:
    (directory / OPTIMIZER_FILE).unlink()


def remove_manifest(directory: Path) -> None:
    (directory / MANIFEST).unlink()


def malform_manifest(directory: Path) -> None:
    path = directory / MANIFEST
    path.write_text(path.read_text()[:-40])


CORRUPTIONS = {
    "truncated": (truncate, "optimizer.pt has"),
    "flipped byte": (flip_byte, "model.safetensors fails its BLAKE3 check"),
    "missing file": (remove_optimizer, "optimizer.pt is missing"),
    "missing manifest": (remove_manifest, "manifest.json is missing"),
    "malformed manifest": (malform_manifest, "manifest.json is malformed"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_verify_detects_corruption(checkpoint: Path, kind: str) -> None:
    corrupt, reason = CORRUPTIONS[kind]
    corrupt(checkpoint)
    store, name = CheckpointStore.for_checkpoint(str(checkpoint))
    for check in (verify(checkpoint), store.verify(name), ckpt_inspect.verify_checkpoint(str(checkpoint))):
        assert not check.ok
        assert any(reason in problem for problem in check.problems), check.problems
    if kind == "truncated":
        assert "truncated" in store.verify(name).problems[0]


def test_verify_reports_a_malformed_manifest_entry_instead_of_crashing(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][OPTIMIZER_FILE] = "deadbeef"
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    expected = "manifest.json is malformed: files.optimizer.pt: Input should be a valid dictionary"
    assert ckpt_inspect.verify_checkpoint(str(checkpoint)).problems == (expected,)
    assert verify(checkpoint).problems == (expected,)


def test_checkpoint_modules_name_no_component_outside_the_upgrade() -> None:
    """Adding a component touches no module under checkpoint/: none names one or its files."""
    package = Path(ckpt_inspect.__file__).parent
    names = [kind.name for kind in COMPONENTS] + [MODEL_FILE, OPTIMIZER_FILE, "sync.pt"]
    found = []
    for module in sorted(package.glob("*.py")):
        if module.name == "upgrade.py":  # the one module of the old fixed-field format
            continue
        text = module.read_text()
        found += [f"{module.name}: {n}" for n in names if f'"{n}"' in text or f"'{n}'" in text or f"``{n}``" in text]
    assert not found, found


def test_inspect_reads_the_safetensors_header_without_loading(checkpoint: Path) -> None:
    report = ckpt_inspect.inspect_checkpoint(str(checkpoint))
    model = small_model()
    weights = report["components"]["model"]["weights"]
    assert report["components"]["model"]["tensors"] == MODEL_FILE
    assert weights["tensors"] == len(model.state_dict())
    assert weights["parameters"] == sum(p.numel() for p in model.parameters())
    assert weights["dtypes"] == {"F32": {"tensors": 4, "parameters": weights["parameters"]}}
    assert report["step"] == 7 and report["components"]["progress"]["values"]["global_step"] == 7
    assert report["components"]["rng"]["rank_values"] == 1
    assert report["components"]["optimizer"]["size_bytes"] == (checkpoint / OPTIMIZER_FILE).stat().st_size
    assert report["problems"] == [] and report["sizes_match_manifest"]
    json.dumps(report)  # --json prints it


# ---------------------------------------------------------------------------------------------
# storage: layout, staging, commit


def test_a_writer_on_a_local_store_leaves_nothing_in_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local store stages beside its checkpoints: no scratch directory is made (every rank of every
    run used to leave an empty one behind in /tmp)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    writer = CheckpointWriter(CheckpointStore.from_uri(str(tmp_path / "run")), RotationPolicy(keep_last=1))
    model = small_model()
    [outcome] = save_all(writer, [snapshot(model, trained(model), 5)])
    assert outcome.error is None and writer.scratch is None
    writer.close()
    assert not [p.name for p in temp.iterdir() if p.name.startswith("trainforge")]


def test_inspect_shows_every_component_from_the_checkpoints_own_record(tmp_path: Path) -> None:
    """An EMA run's ``ema`` component, its values and its weights, with no line of inspect naming it."""
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    writer = CheckpointWriter(store, RotationPolicy(keep_last=3), schemas=SCHEMAS, scratch=tmp_path / "scratch")
    model = small_model()
    snap = snapshot(model, trained(model), 5)
    snap.states["ema"] = State({"updates": 5}, model_snapshot(small_model(seed=3)))
    snap.exports["model_ema.safetensors"] = "ema"
    [outcome] = save_all(writer, [snap])
    report = ckpt_inspect.inspect_checkpoint(outcome.uri)
    assert report["problems"] == [] and list(report["components"]) == list(snap.states)
    ema = report["components"]["ema"]
    assert ema["values"] == {"updates": 5} and ema["tensors"] == "ema.safetensors"
    assert ema["weights"]["tensors"] == len(model.state_dict()) and report["exports"]["model_ema.safetensors"]
    shown = io.StringIO()
    Console(file=shown, width=200).print(ckpt_inspect.inspection_view(report))
    assert "│ ema " in shown.getvalue() and "updates=5" in shown.getvalue(), shown.getvalue()


def test_staging_dir_is_never_listed_as_a_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    staging = store.staging_dir(checkpoint_name(5), tmp_path / "scratch")
    assert staging.parent == Path(store.root) and staging.name.startswith(".tmp-checkpoint_000000005-")
    write_checkpoint(staging, step=5)  # complete, manifest included, but not committed
    assert store.entries() == [] and store.leftovers() == [staging.name]
    assert [r.kind for r in ckpt_inspect.list_checkpoints(store.root)] == ["incomplete"]
    store.commit(staging, checkpoint_name(5))
    assert names(store) == ["checkpoint_000000005"] and store.leftovers() == []
    assert store.verify("checkpoint_000000005").ok


def test_list_checkpoints_shows_each_with_its_status(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_checkpoint(run / checkpoint_name(5), step=5, **{"val/loss": 0.25})
    write_checkpoint(run / checkpoint_name(10), step=10)
    flip_byte(run / checkpoint_name(10))
    (run / ".tmp-checkpoint_000000015-0123abcd").mkdir()
    rows = ckpt_inspect.list_checkpoints(str(run))
    assert [(r.name, r.valid) for r in rows] == [
        ("checkpoint_000000005", True),
        ("checkpoint_000000010", False),
        (".tmp-checkpoint_000000015-0123abcd", False),
    ]
    assert rows[0].metrics == {"val/loss": 0.25} and rows[0].size_bytes > 0 and rows[0].status == "valid"
    assert "fails its BLAKE3 check" in rows[1].status and rows[2].status == "incomplete save"
    # A storage folder holding runs lists every run's checkpoints.
    assert ckpt_inspect.list_checkpoints(str(tmp_path))[0].name == "run/checkpoint_000000005"


def test_list_and_verify_of_nothing_are_user_errors(tmp_path: Path) -> None:
    from trainforge.errors import CheckpointError

    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt_inspect.list_checkpoints(str(tmp_path / "absent"))
    with pytest.raises(CheckpointError, match="holds no checkpoints"):
        ckpt_inspect.list_checkpoints(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt_inspect.verify_checkpoint(str(tmp_path / "absent" / checkpoint_name(1)))


# ---------------------------------------------------------------------------------------------
# state: weights, optimizer, RNG


def test_tied_weights_are_stored_once_and_load_back(tmp_path: Path) -> None:
    from trainforge.config import ModelConfig
    from trainforge.data.spec import DataSpec
    from trainforge.models import build_model

    config = ModelConfig(name="gpt2_small", kwargs={"n_layer": 1, "n_embd": 32, "n_head": 2})
    spec = DataSpec(kind="tokens", input_shape=(16,), vocab_size=100, seq_len=16)
    torch.manual_seed(1)
    source = build_model(config, spec)
    torch.manual_seed(2)
    target = build_model(config, spec)
    tied = "model.lm_head.weight", "model.transformer.wte.weight"
    assert source.state_dict()[tied[0]].data_ptr() == source.state_dict()[tied[1]].data_ptr()

    state = model_snapshot(source)
    assert len([k for k in tied if k in state]) == 1  # one entry per storage
    assert tensor_file("model", state) == MODEL_FILE
    write_tensors(tmp_path / MODEL_FILE, state)
    load_weights(tmp_path, target)
    for key, value in source.state_dict().items():
        assert torch.equal(value, target.state_dict()[key]), key
    assert target.state_dict()[tied[0]].data_ptr() == target.state_dict()[tied[1]].data_ptr()


def draws() -> tuple[float, list[float], list[float]]:
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_rng_capture_and_restore_reproduce_the_same_draws() -> None:
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    draws()
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    state = json.loads(json.dumps(capture_rng()))  # as it travels through trainer_state.json
    expected = draws()
    draws()
    restore_rng(state)
    assert draws() == expected


def test_trainer_state_and_optimizer_round_trip(checkpoint: Path) -> None:
    saved = read_saved(checkpoint, SCHEMAS)
    assert (saved.step, saved.epoch, saved.world) == (7, 0, 1)
    assert saved.components["progress"] == {"global_step": 7, "samples_seen": 56}
    data = saved.components["data"]
    assert (data["epoch"], data["position"], data["world_size"]) == (0, 8, 1)
    assert saved.config["train"] == {"batch_size": 8}
    model = small_model(seed=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    load_weights(checkpoint, model)
    load_optimizer(checkpoint, optimizer)
    reference = trained(small_model())
    for index, slots in reference.state_dict()["state"].items():
        for key, value in slots.items():
            assert torch.equal(optimizer.state_dict()["state"][index][key], value)


class Payload:
    """Unpickling this runs a shell command: what a hostile optimizer.pt would carry."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.sentinel}",)


def test_hostile_optimizer_file_is_refused_and_its_payload_never_runs(checkpoint: Path, tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    state = torch.load(checkpoint / OPTIMIZER_FILE, weights_only=True)
    state["param_groups"][0]["hook"] = Payload(sentinel)
    torch.save(state, checkpoint / OPTIMIZER_FILE)
    write_manifest(checkpoint, {"global_step": 7})  # the attacker recomputes the hashes
    store, name = CheckpointStore.for_checkpoint(str(checkpoint))
    assert store.verify(name, safe_load=False).ok  # every file is the one the manifest names

    optimizer = torch.optim.Adam(small_model().parameters(), lr=0.01)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_optimizer(checkpoint, optimizer)
    assert not sentinel.exists()
    # `ckpt verify` says what restore would: refused, although every hash matches.
    [problem] = ckpt_inspect.verify_checkpoint(str(checkpoint)).problems
    assert problem.startswith("refused to load: optimizer.pt holds pickled objects")
    assert not sentinel.exists()

    # The payload is live: a plain unpickling would have run it.
    torch.load(checkpoint / OPTIMIZER_FILE, weights_only=False)
    assert sentinel.exists()


# ---------------------------------------------------------------------------------------------
# writer: async save, rotation, failures


def test_async_save_commits_and_collect_reports_it(tmp_path: Path) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    writer = CheckpointWriter(store, RotationPolicy(keep_last=3), schemas=SCHEMAS, scratch=tmp_path / "scratch")
    model = small_model()
    optimizer = trained(model)
    waited = writer.save_async(snapshot(model, optimizer, 5, {"train/loss": 0.7}))
    assert waited < 0.05  # nothing was in flight
    writer.wait()
    [outcome] = writer.collect()
    assert writer.collect() == []
    assert outcome.error is None and outcome.name == "checkpoint_000000005"
    assert outcome.uri == str(tmp_path / "run" / "checkpoint_000000005")
    manifest, _ = store.read_manifest(outcome.name)
    assert manifest is not None
    assert outcome.size_bytes == sum(f["size"] for f in manifest["files"].values())
    assert manifest["global_step"] == 5 and manifest["metrics"] == {"train/loss": 0.7}
    assert manifest["world_size"] == 1 and manifest["created_at"] <= time.time()
    assert store.verify(outcome.name).ok and store.leftovers() == []
    # The snapshot is a copy: training on does not change what was written.
    fresh = small_model(seed=5)
    load_weights(Path(outcome.uri), fresh)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_a_second_save_waits_for_the_first(tmp_path: Path) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    writer = CheckpointWriter(store, RotationPolicy(keep_last=5), schemas=SCHEMAS, scratch=tmp_path / "scratch")
    model = small_model()
    optimizer = trained(model)
    writer.save_async(snapshot(model, optimizer, 1))
    writer.save_async(snapshot(model, optimizer, 2))
    writer.close()
    assert [o.step for o in writer.collect()] == [1, 2]
    assert names(store) == ["checkpoint_000000001", "checkpoint_000000002"]


def test_rotation_keeps_exactly_keep_last(tmp_path: Path) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    writer = CheckpointWriter(store, RotationPolicy(keep_last=2), schemas=SCHEMAS, scratch=tmp_path / "scratch")
    model = small_model()
    optimizer = trained(model)
    outcomes = save_all(writer, [snapshot(model, optimizer, s) for s in (10, 20, 30, 40, 50)])
    assert all(o.error is None for o in outcomes)
    assert names(store) == ["checkpoint_000000040", "checkpoint_000000050"]


@pytest.mark.parametrize(
    ("mode", "losses", "best"),
    [
        ("min", [0.9, 0.2, 0.5, 0.6, 0.7], 20),
        ("max", [0.3, 0.2, 0.9, 0.1, 0.05], 30),
    ],
)
def test_rotation_keeps_the_best_by_metric(tmp_path: Path, mode: str, losses: list[float], best: int) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    policy = RotationPolicy(keep_last=2, metric="val/loss", mode=mode)
    writer = CheckpointWriter(store, policy, schemas=SCHEMAS, scratch=tmp_path / "scratch")
    model = small_model()
    optimizer = trained(model)
    steps = [10, 20, 30, 40, 50]
    save_all(writer, [snapshot(model, optimizer, s, {"val/loss": x}) for s, x in zip(steps, losses, strict=True)])
    assert names(store) == sorted([checkpoint_name(best), "checkpoint_000000040", "checkpoint_000000050"])


def test_rotation_never_deletes_the_checkpoint_just_written_nor_one_of_a_later_step(tmp_path: Path) -> None:
    # Newer checkpoints from another line (an abandoned timeline, a foreign copy): not this run's
    # history, so neither counted nor deleted; the one just written is always kept.
    run = tmp_path / "run"
    for step in (80, 90):
        write_checkpoint(run / checkpoint_name(step), step=step)
    store = CheckpointStore.from_uri(str(run))
    writer = CheckpointWriter(store, RotationPolicy(keep_last=1), schemas=SCHEMAS, scratch=tmp_path / "scratch")
    model = small_model()
    [outcome] = save_all(writer, [snapshot(model, trained(model), 40)])
    assert outcome.error is None
    assert names(store) == ["checkpoint_000000040", "checkpoint_000000080", "checkpoint_000000090"]
    # Directories without a readable manifest are never rotated out.
    (run / checkpoint_name(35)).mkdir()
    save_all(writer, [snapshot(model, trained(model), 41)])
    assert names(store) == [checkpoint_name(s) for s in (35, 41, 80, 90)]


def test_save_into_a_path_under_a_regular_file_is_reported_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    store = CheckpointStore.from_uri(str(blocker / "run"))
    writer = CheckpointWriter(store, RotationPolicy(keep_last=2), schemas=SCHEMAS, scratch=tmp_path / "scratch")
    model = small_model()
    [outcome] = save_all(writer, [snapshot(model, trained(model), 5)])
    assert outcome.uri is None and outcome.error is not None
    assert outcome.error.startswith(("NotADirectoryError", "FileExistsError")), outcome.error
    assert blocker.read_text() == "a regular file"


FSIZE_SCRIPT = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    import torch
    from torch import nn
    from tests.helpers.checkpoints import MODEL_FILE, OPTIMIZER_FILE, load_optimizer, load_weights, snapshot
    from tests.unit.test_checkpoint import small_model, trained
    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.checkpoint.writer import CheckpointWriter, RotationPolicy

    root, scratch = sys.argv[1], Path(sys.argv[2])
    writer = CheckpointWriter(CheckpointStore.from_uri(root), RotationPolicy(keep_last=1), scratch=scratch)
    model = small_model()
    optimizer = trained(model)
    outcomes = []
    writer.save_async(snapshot(model, optimizer, 5))
    writer.wait()
    outcomes += writer.collect()
    # From here on no file of this process may grow past 64 kB: the next model is about 4 MB.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    big = nn.Linear(1000, 1000)
    writer.save_async(snapshot(big, torch.optim.SGD(big.parameters(), lr=0.1), 10))
    writer.wait()
    outcomes += writer.collect()
    print(json.dumps([[o.step, o.error] for o in outcomes]))
    """
)


def test_a_failed_write_is_reported_and_leaves_the_previous_checkpoint_valid(tmp_path: Path) -> None:
    """A real write failure (EFBIG from a file-size limit, as a quota or full disk would give) mid-save."""
    root = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", FSIZE_SCRIPT, str(root), str(tmp_path / "scratch")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=scaled(300),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (first_step, first_error), (second_step, second_error) = json.loads(result.stdout.strip().splitlines()[-1])
    assert (first_step, first_error) == (5, None)
    assert second_step == 10 and second_error is not None and "File too large" in second_error
    store = CheckpointStore.from_uri(str(root))
    assert names(store) == ["checkpoint_000000005"]
    assert store.verify("checkpoint_000000005").ok
    assert store.leftovers() == []  # the failed save's staging dir was removed


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs, where this test may mount one (root with CAP_SYS_ADMIN); skipped otherwise."""
    with tmpfs(tmp_path / "tmpfs", "size=1m") as mount_point:
        yield mount_point


@pytest.mark.parametrize("failure", ["read-only", "full"])
def test_save_to_a_read_only_or_full_file_system(small_tmpfs: Path, tmp_path: Path, failure: str) -> None:
    store = CheckpointStore.from_uri(str(small_tmpfs / "run"))
    writer = CheckpointWriter(store, RotationPolicy(keep_last=1), schemas=SCHEMAS, scratch=tmp_path / "scratch")
    model = small_model()
    optimizer = trained(model)
    [first] = save_all(writer, [snapshot(model, optimizer, 5)])
    assert first.error is None
    if failure == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
        following = snapshot(model, optimizer, 10)
        expected = "Read-only file system"
    else:
        big = nn.Linear(600, 600)  # 1.4 MB of weights: more than the file system holds
        following = snapshot(big, torch.optim.SGD(big.parameters(), lr=0.1), 10)
        expected = "No space left on device"
    [second] = save_all(writer, [following])
    assert second.uri is None and second.error is not None and expected in second.error
    assert names(store) == ["checkpoint_000000005"] and store.verify("checkpoint_000000005").ok
    if failure == "full":
        assert store.leftovers() == []


def test_run_and_checkpoint_uris_keep_the_query_that_carries_endpoint_and_credentials() -> None:
    from trainforge.checkpoint.storage import join_uri

    base = "s3://k:s@bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    assert join_uri(base, "demo") == "s3://k:s@bucket/runs/demo?endpoint_override=127.0.0.1:9000&scheme=http"
    assert join_uri("/data/runs/", "demo", "checkpoint_000000010") == "/data/runs/demo/checkpoint_000000010"
    store, name = CheckpointStore.for_checkpoint("s3://bucket/runs/demo/checkpoint_000000010?region=us-east-1")
    assert name == "checkpoint_000000010" and store.root == "bucket/runs/demo"
