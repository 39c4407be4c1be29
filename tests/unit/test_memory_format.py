"""model.memory_format: which runs lay their convolution weights out channels-last, and that such a
run trains like the contiguous one and resumes bit-identically (in-process gloo ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import assert_bit_identical, checkpoint_state, sessions
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.models import build_model
from trainforge.worker.memory_format import apply_memory_format, chosen_format

STEPS = 24


def cnn_run(tmp: Path, **model: Any) -> dict[str, Any]:
    return tiny_run(
        tmp,
        model={"name": "small_cnn", "kwargs": {"channels": [8, 16]}, **model},
        train={"max_steps": STEPS, "batch_size": 16, "log_every_n_steps": 4},
        optim={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        checkpoint={"every_n_steps": 8, "keep_last": 5},
        seed=3,
    )


@pytest.mark.parametrize(
    ("model", "parallel", "expected"),
    [
        ({"name": "small_cnn"}, {}, torch.channels_last),
        ({"name": "small_cnn", "memory_format": "contiguous"}, {}, torch.contiguous_format),
        ({"name": "small_cnn"}, {"strategy": "fsdp"}, torch.contiguous_format),
        ({"name": "mlp"}, {}, torch.contiguous_format),
        ({"name": "mlp", "memory_format": "channels_last"}, {}, torch.channels_last),
    ],
)
def test_auto_lays_out_the_built_in_cnn_channels_last_under_ddp_only(
    tmp_path: Path, model: dict[str, Any], parallel: dict[str, Any], expected: torch.memory_format
) -> None:
    config = load_config(tiny_run(tmp_path, model=model, parallel=parallel, scaling={"num_workers": 2}))
    assert chosen_format(config) is expected


def test_channels_last_weights_are_the_same_parameters_and_a_model_without_4d_weights_is_left_alone(
    tmp_path: Path,
) -> None:
    config = load_config(cnn_run(tmp_path))
    from trainforge.data import build_datasets

    spec = build_datasets(config.data, 0)[2]
    model = build_model(config.model, spec)
    before = list(model.parameters())
    said = apply_memory_format(model, config)
    assert said is not None and said.startswith("2 convolution weight(s) channels_last")
    assert list(model.parameters()) == before  # the optimizer's and DDP's references stay valid
    convs = [p for p in model.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert not convs[1].is_contiguous()  # (the first, of one input channel, is both)
    mlp = load_config(tiny_run(tmp_path, model={"name": "mlp", "memory_format": "channels_last"}))
    assert apply_memory_format(build_model(mlp.model, spec), mlp) is None


def test_channels_last_with_sharded_or_split_models_is_refused_in_one_line(tmp_path: Path) -> None:
    for parallel in ({"strategy": "fsdp"}, {"tensor_parallel": 2}):
        config = tiny_run(
            tmp_path,
            model={"name": "small_cnn", "memory_format": "channels_last"},
            parallel=parallel,
            scaling={"num_workers": 2},
        )
        with pytest.raises(ConfigError, match=r"model\.memory_format channels_last needs plain data parallelism"):
            load_config(config)


@pytest.mark.slow  # four 24-step runs in one gloo rank: about 15 s
def test_a_channels_last_run_trains_like_the_contiguous_one_and_resumes_bit_identical(tmp_path: Path) -> None:
    runs = [
        (cnn_run(tmp_path / "straight"), None),
        (cnn_run(tmp_path / "crashed"), 12),
        (cnn_run(tmp_path / "crashed"), None),
        (cnn_run(tmp_path / "contiguous", memory_format="contiguous"), None),
    ]
    straight, crashed, resumed, contiguous = spawn_ranks(sessions, 1, runs)[0]
    assert crashed.crashed and resumed.final["status"] == "finished"
    assert any(e.startswith("resumed from") and "checkpoint_000000008" in e for e in resumed.events)
    a = checkpoint_state(tmp_path / "straight" / "t", STEPS)
    assert_bit_identical(a, checkpoint_state(tmp_path / "crashed" / "t", STEPS))
    # Other kernels, the same arithmetic: the contiguous run's weights and losses agree to rounding.
    c = checkpoint_state(tmp_path / "contiguous" / "t", STEPS)
    assert a.keys() == c.keys()
    for key in a:
        torch.testing.assert_close(a[key], c[key], rtol=1e-4, atol=1e-5, msg=key)
    assert straight.losses.keys() == contiguous.losses.keys()
    for step, loss in straight.losses.items():
        assert loss == pytest.approx(contiguous.losses[step], rel=1e-5)
