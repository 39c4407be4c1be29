"""parallel.channels_last: which runs lay their convolution weights out channels-last (``auto``: the
built-in CNN under plain DDP), and that such a run trains like the contiguous one and resumes
bit-identically (in-process gloo ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import assert_bit_identical, checkpoint_state, sessions
from trainforge.config import load_config
from trainforge.worker.blocks import channels_last_wanted

STEPS = 24


def cnn_run(tmp: Path, **parallel: Any) -> dict[str, Any]:
    return tiny_run(
        tmp,
        model={"name": "small_cnn", "kwargs": {"channels": [8, 16]}},
        parallel=parallel,
        train={"max_steps": STEPS, "batch_size": 16, "log_every_n_steps": 4},
        optim={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        checkpoint={"every_n_steps": 8, "keep_last": 5},
        seed=3,
    )


@pytest.mark.parametrize(
    ("model", "parallel", "expected"),
    [
        ("small_cnn", {}, True),
        ("small_cnn", {"channels_last": False}, False),
        ("small_cnn", {"strategy": "fsdp"}, False),
        ("small_cnn", {"tensor_parallel": 2}, False),
        ("mlp", {}, False),
        ("resnet18", {}, False),
        ("mlp", {"channels_last": True}, True),
    ],
)
def test_auto_is_on_for_the_built_in_cnn_under_plain_ddp_only(
    tmp_path: Path, model: str, parallel: dict[str, Any], expected: bool
) -> None:
    config = load_config(tiny_run(tmp_path, model={"name": model}, parallel=parallel, scaling={"num_workers": 2}))
    assert config.parallel.channels_last == parallel.get("channels_last", "auto")
    assert channels_last_wanted(config) is expected


@pytest.mark.slow  # six 24-step runs in one gloo rank: about 15 s
def test_a_channels_last_run_trains_like_the_contiguous_one_and_resumes_bit_identical(tmp_path: Path) -> None:
    runs = [
        (cnn_run(tmp_path / "straight"), None),
        (cnn_run(tmp_path / "crashed"), 12),
        (cnn_run(tmp_path / "crashed"), None),
        (cnn_run(tmp_path / "contiguous", channels_last=False), None),
        # A contiguous run's checkpoint resumed channels-last: the values load into either layout.
        (cnn_run(tmp_path / "switched", channels_last=False), 12),
        (cnn_run(tmp_path / "switched"), None),
    ]
    straight, crashed, resumed, contiguous, _, switched = spawn_ranks(sessions, 1, runs)[0]
    assert "channels-last memory format" in straight.notes and "channels-last memory format" in resumed.notes
    assert "channels-last memory format" not in contiguous.notes
    assert crashed.crashed and resumed.final["status"] == "finished"
    assert any(e.startswith("resumed from") and "checkpoint_000000008" in e for e in resumed.events)
    a = checkpoint_state(tmp_path / "straight" / "t", STEPS)
    assert_bit_identical(a, checkpoint_state(tmp_path / "crashed" / "t", STEPS))
    # Other kernels, the same arithmetic: the contiguous run's weights and losses agree to rounding.
    c = checkpoint_state(tmp_path / "contiguous" / "t", STEPS)
    assert a.keys() == c.keys()
    for key in a:
        torch.testing.assert_close(a[key], c[key], rtol=1e-4, atol=1e-5, msg=key)
    assert any(e.startswith("resumed from") and "checkpoint_000000008" in e for e in switched.events)
    assert "channels-last memory format" in switched.notes
    s = checkpoint_state(tmp_path / "switched" / "t", STEPS)
    for key in a:
        torch.testing.assert_close(s[key], c[key], rtol=1e-4, atol=1e-5, msg=key)
    assert straight.losses.keys() == contiguous.losses.keys()
    for step, loss in straight.losses.items():
        assert loss == pytest.approx(contiguous.losses[step], rel=1e-5)
