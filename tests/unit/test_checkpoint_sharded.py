"""Sharded checkpoints (checkpoint/sharded.py): written by every rank with torch.distributed.checkpoint
(through the one save path, checkpoint/writer.py), hashed while written, verified by the one
verification, loaded (and resharded) without unpickling arbitrary objects. Real gloo process groups
on 127.0.0.1, no Ray."""

from __future__ import annotations

import json
import os
import pickle
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from trainforge.checkpoint import inspect as ckpt_inspect
from trainforge.checkpoint.names import checkpoint_name, staging_name
from trainforge.checkpoint.schema import MANIFEST, SHARDED, SHARDED_METADATA, STATE_FILE
from trainforge.checkpoint.sharded import load_sharded
from trainforge.checkpoint.staging import StagedSave
from trainforge.checkpoint.state import Record, Snapshot, State, capture_rng
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.checkpoint.writer import (
    Alone,
    CheckpointWriter,
    Collectives,
    RotationPolicy,
    SaveOutcome,
    save_group,
)
from trainforge.worker.registry import state_schemas

STEP = 100
NAME = checkpoint_name(STEP)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def full_state() -> dict[str, Any]:
    """The components' tensors, by component (non-tensor values too: DCP saves them as bytes)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(8, 4, generator=generator), "b": torch.arange(4.0)},
        "optimizer": {"step": torch.tensor(3.0), "lr": 0.125, "names": ["a", "b"]},
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optimizer": {"step": torch.tensor(0.0), "lr": 0.0, "names": []},
    }


def snapshot(tensors: dict[str, Any], step: int = STEP, rank: int = 0, world: int = 1, **parts: Any) -> Snapshot:
    """One rank's snapshot of a sharded run: ``tensors`` by component (whole, or this rank's
    DTensor shards) for DCP, the progress, and this rank's RNG; ``parts``: more of ``Snapshot``."""
    states = {"progress": State({"global_step": step, "samples_seen": 0})}
    states.update({name: State(tensors=tree) for name, tree in tensors.items()})
    states["rng"] = State(rank_values=capture_rng())
    record = Record(plan="fsdp") if rank == 0 else None
    return Snapshot(step, 0, SHARDED, states, rank, world, record, **parts)


def save(
    store: CheckpointStore, snapshots: list[Snapshot], group: Collectives | None = None, keep_last: int = 10
) -> list[SaveOutcome]:
    """Every save as a run's rank takes it (``CheckpointWriter.save_async``, one at a time); the
    outcomes (rank 0's; [] on the others)."""
    writer = CheckpointWriter(store, RotationPolicy(keep_last=keep_last), group or Alone(), schemas=state_schemas())
    try:
        for taken in snapshots:
            writer.save_async(taken)
            writer.wait()
        return writer.collect()
    finally:
        writer.close()


def save_world_1(store: CheckpointStore, tensors: dict[str, Any], step: int = STEP) -> str:
    """A save of ``tensors`` at world size 1; the checkpoint's URI."""
    [outcome] = save(store, [snapshot(tensors, step)])
    assert outcome.error is None and outcome.uri is not None, outcome.error
    return outcome.uri


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def sharded(tmp_path: Path, group: None) -> Path:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    return Path(save_world_1(store, full_state()))


def check(directory: Path) -> tuple[str, ...]:
    """What restore, rotation and ``ckpt verify`` find (with the components' schemas)."""
    store, name = CheckpointStore.for_checkpoint(str(directory))
    return store.verify(name, schemas=state_schemas()).problems


def rewrite_manifest(directory: Path) -> None:
    """Hashes that match again (an attacker's rewrite): only the safe-load check can tell."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for rel in manifest["files"]:
        data = (directory / rel).read_bytes()
        manifest["files"][rel] = {"size": len(data), "digest": blake3.blake3(data).hexdigest()}
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_a_world_1_sharded_checkpoint_round_trips(sharded: Path) -> None:
    assert sharded.name == NAME and not check(sharded)
    manifest = json.loads((sharded / MANIFEST).read_text())
    assert (manifest["format_version"], manifest["layout"], manifest["hash"]) == (3, "sharded", "blake3")
    assert manifest["world_size"] == 1 and manifest["global_step"] == STEP
    assert set(manifest["files"]) == {STATE_FILE, SHARDED_METADATA, "sharded/__0_0.distcp"}
    for rel, entry in manifest["files"].items():  # the digests taken while writing are the files'
        assert entry["digest"] == blake3.blake3((sharded / rel).read_bytes()).hexdigest()
    state = zeros_like(full_state())
    load_sharded(sharded, state)
    expected = full_state()
    assert all(torch.equal(state["model"][k], expected["model"][k]) for k in expected["model"])
    assert torch.equal(state["optimizer"]["step"], torch.tensor(3.0)) and state["optimizer"]["lr"] == 0.125
    assert state["optimizer"]["names"] == ["a", "b"]
    assert not list(sharded.parent.glob(".tmp-*")), "the staging directory was renamed, not left"


def test_inspect_and_list_show_the_sharding(sharded: Path) -> None:
    report = ckpt_inspect.inspect_checkpoint(str(sharded))
    assert report["sharding"]["layout"] == "sharded" and report["sharding"]["world_size"] == 1
    assert report["sharding"]["ranks"] == {
        "0": {"files": 1, "bytes": (sharded / "sharded/__0_0.distcp").stat().st_size}
    }
    assert report["problems"] == []
    [row] = ckpt_inspect.list_checkpoints(str(sharded.parent))
    assert row.valid and row.step == STEP


@pytest.mark.parametrize(
    ("spoil", "problem"),
    [
        (lambda d: (d / "sharded/extra.bin").write_bytes(b"x"), "sharded/extra.bin is not listed in the manifest"),
        (lambda d: (d / "sharded/sub").mkdir(), "sharded/sub/ is not listed in the manifest (unexpected directory)"),
        (lambda d: (d / "other").mkdir(), "other/ is not listed in the manifest (unexpected directory)"),
        (lambda d: (d / "sharded/__0_0.distcp").unlink(), "sharded/__0_0.distcp is missing"),
    ],
    ids=["extra file", "subdirectory in sharded", "other directory", "missing shard"],
)
def test_a_sharded_checkpoint_holds_exactly_its_files(sharded: Path, spoil: Any, problem: str) -> None:
    spoil(sharded)
    assert any(p.startswith(problem) for p in check(sharded)), check(sharded)


def test_a_symbolic_link_for_sharded_or_a_shard_is_refused(sharded: Path, tmp_path: Path) -> None:
    shard = sharded / "sharded/__0_0.distcp"
    outside = tmp_path / "elsewhere.distcp"
    shard.rename(outside)
    shard.symlink_to(outside)  # same bytes: the digest would match through the link
    assert "sharded/__0_0.distcp is a symbolic link, not a regular file" in check(sharded)
    shard.unlink()
    outside.rename(shard)
    (sharded / "sharded").rename(tmp_path / "shards")
    (sharded / "sharded").symlink_to(tmp_path / "shards", target_is_directory=True)
    assert "sharded/ is a symbolic link, not a directory" in check(sharded)


def test_sharded_manifests_name_only_the_layouts_files(sharded: Path) -> None:
    manifest = json.loads((sharded / MANIFEST).read_text())
    for change, message in [
        (lambda m: m["files"].update({"../x": {"size": 0, "digest": "0" * 64}}), "not a plain relative file name"),
        (lambda m: m["files"].update({"sharded/x.bin": {"size": 0, "digest": "0" * 64}}), "not a file of the sharded"),
        (lambda m: m["files"].pop(SHARDED_METADATA), "does not list sharded/.metadata"),
        (lambda m: m.pop("world_size"), "needs its world_size"),
        (lambda m: m.update(world_size=0), "world_size"),
        (lambda m: m["files"].update({"sharded/__3_0.distcp": m["files"]["sharded/__0_0.distcp"]}), "rank 3, but"),
        (lambda m: m.update(world_size=10**30), "world_size"),
        (lambda m: m.update(layout="diagonal"), "layout"),
    ]:
        edited = json.loads(json.dumps(manifest))
        change(edited)
        (sharded / MANIFEST).write_text(json.dumps(edited))
        [problem] = check(sharded)
        assert problem.startswith("manifest.json is malformed") and message in problem, problem


def test_metadata_that_would_unpickle_code_is_refused(sharded: Path) -> None:
    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("echo pwned",))

    (sharded / SHARDED_METADATA).write_bytes(pickle.dumps(Payload()))
    rewrite_manifest(sharded)
    [problem] = check(sharded)
    assert problem.startswith("refused to load: sharded/.metadata holds pickled objects"), problem
    assert "posix.system" in problem or "os.system" in problem


def test_a_sharded_checkpoint_through_an_object_store_layout(tmp_path: Path, group: None) -> None:
    # A file system that is not LocalFileSystem takes the object-store path: local scratch, uploads
    # to the staging prefix, server-side copies to the checkpoint's prefix, the manifest last.
    (tmp_path / "bucket").mkdir()
    remote = CheckpointStore(pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem()), "run")
    save_world_1(remote, full_state())
    assert [e.name for e in remote.entries()] == [NAME] and remote.verify(NAME).ok
    assert not [c.name for c in remote.children() if c.name.startswith(".tmp-")]
    fetched = remote.fetch(NAME, tmp_path / "scratch")
    assert (fetched / "sharded/__0_0.distcp").is_file() and not check(fetched)
    state = zeros_like(full_state())
    load_sharded(fetched, state)
    assert torch.equal(state["model"]["w"], full_state()["model"]["w"])


def test_an_encrypted_sharded_checkpoint_verifies_and_loads_through_its_key(tmp_path: Path, group: None) -> None:
    # checkpoint.encryption under the sharded layout: DCP's shards and .metadata are sealed too.
    from trainforge.checkpoint.crypto import MAGIC, FileCipher

    key = FileCipher.from_env("K", {"K": "ab" * 32})
    store = CheckpointStore.from_uri(str(tmp_path / "run"), key)
    writer = CheckpointWriter(store, RotationPolicy(keep_last=1), Alone(), schemas=state_schemas(), cipher=key)
    try:
        writer.save_async(snapshot(full_state()))
        writer.wait()
        [outcome] = writer.collect()
    finally:
        writer.close()
    assert outcome.error is None, outcome.error
    directory = tmp_path / "run" / NAME
    for rel in (STATE_FILE, SHARDED_METADATA, "sharded/__0_0.distcp"):
        assert (directory / rel).read_bytes().startswith(MAGIC), rel
    assert store.verify(NAME, schemas=state_schemas()).ok
    assert CheckpointStore.from_uri(str(tmp_path / "run")).verify(NAME, contents=False).ok
    with store.opened(directory) as plain:
        state = zeros_like(full_state())
        load_sharded(plain, state)
    assert torch.equal(state["model"]["w"], full_state()["model"]["w"])
    assert plain.closed  # the decrypted files are gone once loaded


def test_sharded_saves_are_recorded_and_rotated_like_full_ones(tmp_path: Path, group: None) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    (tmp_path / "run" / ".tmp-checkpoint_000000001-0badc0de").mkdir(parents=True)  # a crashed save
    os.utime(tmp_path / "run" / ".tmp-checkpoint_000000001-0badc0de", (1.0, 1.0))
    # A run's final save also writes the full weights, after the shards: safetensors has no complex128.
    unwritable = {"model": {"w": torch.zeros(2, dtype=torch.complex128)}}
    saves = [
        snapshot(full_state(), 100),
        snapshot(full_state(), 200),
        snapshot(full_state(), 300, full_weights=unwritable),
    ]
    outcomes = save(store, saves, keep_last=1)
    failed = "ValueError: w: safetensors cannot store torch.complex128"
    assert [(o.step, o.error) for o in outcomes] == [(100, None), (200, None), (300, failed)]
    assert [e.name for e in store.entries()] == [checkpoint_name(200)]  # 100 rotated away once 200 counted
    assert store.leftovers() == []  # the crashed save's, and the failed one's with its shards


def test_an_aborted_save_leaves_nothing(tmp_path: Path, group: None) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "run"))
    staged = StagedSave(store, staging_name(NAME), rank=0, scratch=tmp_path / "scratch")
    dcp.save(full_state(), storage_writer=staged.storage_writer())
    assert staged.shard_files()
    staged.abort()
    assert store.leftovers() == [] and store.entries() == []


# ---------------------------------------------------------------------------------------------
# Two ranks: a real DCP save of a DTensor sharded over both


def save_two_ranks(rank: int, world: int, port: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = full_state()
        tensors = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full["model"].items()}}
        # The writers' own gloo group, created collectively, as a run's ranks create it.
        outcomes = save(CheckpointStore.from_uri(root), [snapshot(tensors, rank=rank, world=world)], save_group(60))
        if rank == 0:
            assert [o.error for o in outcomes] == [None], outcomes
    finally:
        dist.destroy_process_group()


def test_two_ranks_write_one_checkpoint_that_verifies_and_reshards(tmp_path: Path) -> None:
    root = tmp_path / "run"
    mp.spawn(save_two_ranks, args=(2, free_port(), str(root)), nprocs=2, join=True)
    checkpoint = root / NAME
    assert not check(checkpoint)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert manifest["world_size"] == 2
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", SHARDED_METADATA} <= set(manifest["files"])
    report = ckpt_inspect.inspect_checkpoint(str(checkpoint))
    assert set(report["sharding"]["ranks"]) == {"0", "1"}
    # Loaded in one process, unsharded: DCP reshards the two halves into the whole tensors.
    state = zeros_like(full_state())
    del state["optimizer"]
    load_sharded(checkpoint, state)
    assert torch.equal(state["model"]["w"], full_state()["model"]["w"])
    # A flipped byte in rank 1's shard fails verification, naming the file.
    shard = checkpoint / "sharded/__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert check(checkpoint) == ("sharded/__1_0.distcp fails its BLAKE3 check (corrupted)",)
