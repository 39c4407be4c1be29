"""Hashing while writing (checkpoint/hashing.py), the full layout's writers that use it, and the one
place checkpoint names are formatted and parsed (checkpoint/names.py)."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file, save_file

from trainforge.checkpoint.hashing import (
    HashingWriter,
    hash_file,
    in_parallel,
    new_digest,
    open_hashing,
)
from trainforge.checkpoint.names import (
    checkpoint_name,
    name_of_uri,
    parse_checkpoint_name,
    retired_name,
    staging_name,
    step_of_hidden,
    step_of_uri,
)
from trainforge.checkpoint.state import write_safetensors, write_torch


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_a_hashing_writer_records_what_reaches_the_file(tmp_path: Path, algorithm: str) -> None:
    big = os.urandom(3 << 20)  # hashed beside the write, on a helper thread
    path = tmp_path / "f.bin"
    writer = open_hashing(path, algorithm)
    assert writer.write(b"head") == 4 and writer.tell() == 4
    assert writer.seek(0, io.SEEK_CUR) == 4 and writer.seek(4) == 4
    with pytest.raises(io.UnsupportedOperation):
        writer.seek(0)  # a digest cannot take bytes back
    writer.write(memoryview(big))
    record = writer.finish()
    data = path.read_bytes()
    expected = hashlib.sha256(data) if algorithm == "sha256" else blake3.blake3(data)
    assert data == b"head" + big and record.size == len(data) and record.digest == expected.hexdigest()
    assert hash_file(path, algorithm) == record


def test_fileno_flushes_so_that_an_fsync_covers_every_byte(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    writer = HashingWriter(path.open("wb"))  # buffered underneath
    writer.write(b"x" * 10)
    os.fsync(writer.fileno())
    assert path.read_bytes() == b"x" * 10
    writer.close()


def test_unknown_algorithms_and_failed_jobs_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown hash 'md5'"):
        new_digest("md5")
    assert in_parallel([lambda: 1, lambda: 2]) == [1, 2]

    def fails() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        in_parallel([lambda: 1, fails])


def test_safetensors_written_while_hashed_load_as_safetensors_wrote_them(tmp_path: Path) -> None:
    tensors = {
        "w": torch.randn(5, 3),
        "ids": torch.arange(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "flag": torch.tensor(True),
        "strided": torch.randn(4, 6).t(),  # not contiguous: written in logical order
    }
    record = write_safetensors(tmp_path / "ours.safetensors", tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"))
    ours, theirs = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "theirs.safetensors"))
    assert ours.keys() == tensors.keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in tensors)
    assert record == hash_file(tmp_path / "ours.safetensors")


def test_torch_save_through_a_hashing_writer_loads_weights_only(tmp_path: Path) -> None:
    state = {"state": {0: {"exp_avg": torch.randn(1 << 18)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    record = write_torch(tmp_path / "optimizer.pt", state, "sha256")
    loaded = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert torch.equal(loaded["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert record.digest == hashlib.sha256((tmp_path / "optimizer.pt").read_bytes()).hexdigest()


def test_checkpoint_names_are_formatted_and_parsed_in_one_place() -> None:
    assert checkpoint_name(100) == "checkpoint_000000100"
    assert parse_checkpoint_name("checkpoint_000000100") == 100
    assert parse_checkpoint_name("checkpoint_1234567890") == 1234567890  # more than 9 digits still sorts
    for other in ("checkpoint_", "checkpoint_12a", "checkpoint_000000100/", ".tmp-checkpoint_000000100-ab", "x"):
        assert parse_checkpoint_name(other) is None
    with pytest.raises(ValueError):
        checkpoint_name(-1)
    assert step_of_uri("s3://bucket/run/checkpoint_000000020/?endpoint_override=x") == 20
    assert step_of_uri("/runs/a/checkpoint_000000030") == 30 and step_of_uri("/runs/a") is None
    assert name_of_uri("s3://b/run/checkpoint_000000020/?region=x") == "checkpoint_000000020"
    staging, retired = staging_name("checkpoint_000000040"), retired_name("checkpoint_000000040")
    assert staging.startswith(".tmp-checkpoint_000000040-") and staging != staging_name("checkpoint_000000040")
    assert retired.startswith(".invalid-checkpoint_000000040-")
    assert step_of_hidden(staging) == 40 and step_of_hidden(retired) == 40 and step_of_hidden("checkpoint_1") is None
