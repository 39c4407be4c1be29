"""Fuzzing the readers of a checkpoint's JSON metadata: any bytes give a parsed value or a
CheckpointError, never another exception, and quickly (hypothesis deadline: one second).
``trainer_state.json`` is read as restore reads it too: as components, each checked by its schema."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.checkpoints import MODEL_FILE, OPTIMIZER_FILE
from trainforge.checkpoint.problems import OutdatedCheckpoint
from trainforge.checkpoint.saved import saved_from
from trainforge.checkpoint.schema import (
    FULL,
    MAX_STATE_BYTES,
    STATE_FILE,
    Manifest,
    StateFile,
    parse_json,
    parse_manifest,
    parse_trainer_state,
)
from trainforge.checkpoint.upgrade import OldStateFile
from trainforge.errors import CheckpointError
from trainforge.worker.registry import state_schemas

FUZZ = settings(max_examples=200, deadline=1000, database=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)

VALID_MANIFEST: dict[str, Any] = {
    "format_version": 1,
    "files": {
        name: {"size": 10, "sha256": "0" * 64} for name in ("model.safetensors", "optimizer.pt", "trainer_state.json")
    },
    "global_step": 5,
    "metrics": {"train/loss": 0.5},
}
RNG = {"python": [3, [1] * 625, None], "numpy": ["MT19937", [2] * 624, 624, 0, 0.0], "torch": "AAAA"}
# Format 2: the fixed fields of the engine before components.
VALID_STATE: dict[str, Any] = {
    "progress": {"epoch": 0, "global_step": 5, "samples_seen": 40, "epoch_position": 40, "world_size": 1},
    "scheduler": {"last_epoch": 5, "_last_lr": [0.01]},
    "scaler": {},
    "rng": [RNG],
    "metrics": {},
    "config": {},
    "versions": {"torch": "2"},
}
# Format 3: {component: state}, as the writer writes it for a one-worker ddp run.
VALID_STATE_3: dict[str, Any] = {
    "format_version": 3,
    "global_step": 5,
    "epoch": 0,
    "world_size": 1,
    "layout": "full",
    "plan": "ddp",
    "tensor_parallel": 1,
    "components": {
        "progress": {"global_step": 5, "samples_seen": 40},
        "data": {"epoch": 0, "position": 40, "world_size": 1, "micro_batch_size": 8, "grad_accum_steps": 1},
        "model": {},
        "optimizer": {"name": "adam"},
        "schedule": {"last_epoch": 5, "base_lrs": [0.01], "_step_count": 6, "_last_lr": [0.01]},
        "scaler": {},
        "rng": {},
    },
    "ranks": [{"rng": RNG}],
    "files": {"model": {"tensors": MODEL_FILE}, "optimizer": {"tensors": OPTIMIZER_FILE}},
    "exports": {MODEL_FILE: MODEL_FILE},
    "metrics": {"train/loss": 0.5},
    "config": {},
    "versions": {"torch": "2"},
}
FILES = {MODEL_FILE, OPTIMIZER_FILE, STATE_FILE}
SCHEMAS = state_schemas()


def as_components(raw: bytes) -> None:
    """``trainer_state.json`` read as restore reads it: components, each checked by its own schema."""
    saved_from(raw, FULL, FILES, SCHEMAS)


def parse_old_state(raw: bytes) -> tuple[OldStateFile, dict[str, Any]]:
    """``trainer_state.json`` of formats 1 and 2, as ``trainforge ckpt upgrade`` reads it."""
    return parse_json(raw, STATE_FILE, MAX_STATE_BYTES, OldStateFile)


def parse_both(raw: bytes) -> None:
    for parse in (parse_manifest, parse_trainer_state, parse_old_state, as_components):
        started = time.perf_counter()
        try:
            parse(raw)
        except CheckpointError as err:
            assert "\n" not in str(err) and str(err)
        assert time.perf_counter() - started < 1.0


def test_the_valid_documents_parse() -> None:
    assert isinstance(parse_manifest(json.dumps(VALID_MANIFEST).encode())[0], Manifest)
    with pytest.raises(OutdatedCheckpoint, match="trainforge ckpt upgrade"):
        parse_trainer_state(json.dumps(VALID_STATE).encode())
    assert isinstance(parse_old_state(json.dumps(VALID_STATE).encode())[0], OldStateFile)
    assert isinstance(parse_trainer_state(json.dumps(VALID_STATE_3).encode())[0], StateFile)
    as_components(json.dumps(VALID_STATE_3).encode())


@FUZZ
@given(st.binary(max_size=4096))
def test_any_bytes(raw: bytes) -> None:
    parse_both(raw)


@FUZZ
@given(json_values)
def test_any_json(value: Any) -> None:
    parse_both(json.dumps(value).encode())


@FUZZ
@given(st.data())
def test_valid_documents_with_one_value_replaced(data: st.DataObject) -> None:
    for document in (VALID_MANIFEST, VALID_STATE, VALID_STATE_3):
        copy = json.loads(json.dumps(document))
        key = data.draw(st.sampled_from(sorted(copy)))
        target = copy
        if isinstance(copy[key], dict) and copy[key] and data.draw(st.booleans()):
            target, key = copy[key], data.draw(st.sampled_from(sorted(copy[key])))
        target[key] = data.draw(json_values)
        parse_both(json.dumps(copy).encode())


def test_deep_nesting_and_huge_numbers_are_problems() -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a": ' + b"9" * 100_000 + b"}", b"NaN", b'{"files": 1e999}'):
        parse_both(raw)
