"""Fuzzing the readers of a checkpoint's JSON metadata: any bytes give a parsed value or a
CheckpointError, never another exception, and quickly (hypothesis deadline: one second)."""

from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainforge.checkpoint.schema import Manifest, TrainerStateFile, parse_manifest, parse_trainer_state
from trainforge.errors import CheckpointError

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
VALID_STATE: dict[str, Any] = {
    "progress": {"epoch": 0, "global_step": 5, "samples_seen": 40, "epoch_position": 40, "world_size": 1},
    "scheduler": {"last_epoch": 5, "_last_lr": [0.01]},
    "scaler": {},
    "rng": [{"python": [3, [1] * 625, None], "numpy": ["MT19937", [2] * 624, 624, 0, 0.0], "torch": "AAAA"}],
    "metrics": {},
    "config": {},
    "versions": {"torch": "2"},
}


def parse_both(raw: bytes) -> None:
    for parse in (parse_manifest, parse_trainer_state):
        started = time.perf_counter()
        try:
            parse(raw)
        except CheckpointError as err:
            assert "\n" not in str(err) and str(err)
        assert time.perf_counter() - started < 1.0


def test_the_valid_documents_parse() -> None:
    assert isinstance(parse_manifest(json.dumps(VALID_MANIFEST).encode())[0], Manifest)
    assert isinstance(parse_trainer_state(json.dumps(VALID_STATE).encode())[0], TrainerStateFile)


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
    for document in (VALID_MANIFEST, VALID_STATE):
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
