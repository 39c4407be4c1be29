"""Tensor parallelism's checks and plans, on the meta device (no ranks, no memory).

What a tensor-parallel run trains and resumes is tested in gloo ranks (tests/unit/test_session.py)
and in Ray workers (tests/integration/test_fsdp.py, tests/faults/test_exact_resume.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from tests.helpers.runs import tiny_run
from trainforge.config import load_config
from trainforge.errors import ConfigError, ModelError
from trainforge.worker.build import check_block_names
from trainforge.worker.tp import Layout, tp_styles

LLAMA = {"name": "llama_tiny", "kwargs": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}}
TOKENS = {"name": "synthetic", "kind": "tokens", "seq_len": 16, "vocab_size": 64, "num_samples": 64}


def lm(tmp: Path, model: dict[str, Any], workers: int, **parallel: Any) -> dict[str, Any]:
    return tiny_run(tmp, model=model, data=TOKENS, scaling={"num_workers": workers}, parallel=parallel)


def test_layout_puts_a_tensor_parallel_group_on_consecutive_ranks() -> None:
    grid = [Layout(rank, 8, 2) for rank in range(8)]
    assert [(g.dp_rank, g.tp_rank) for g in grid[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {g.dp for g in grid} == {4}


def test_llama_plan_splits_attention_and_mlp_of_every_layer(tmp_path: Path) -> None:
    import torch

    from trainforge.data import build_datasets
    from trainforge.models import build_model

    config = load_config(lm(tmp_path, LLAMA, 2, tensor_parallel=2))
    _, _, spec = build_datasets(config.data, config.seed)
    with torch.device("meta"):
        model = build_model(config.model, spec)
    styles = tp_styles(model)
    assert len(styles) == 2 * 7
    assert {name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]: s for name, s in styles.items()} == {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
    # Embeddings, norms and the head are not split.
    assert not any("embed" in n or "norm" in n or "lm_head" in n for n in styles)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"num_workers": 3, "tp": 2}, "parallel.tensor_parallel 2 must divide scaling.num_workers 3"),
        ({"num_workers": [2, 4], "tp": 2}, "parallel.tensor_parallel needs a fixed scaling.num_workers"),
        ({"num_workers": 2, "tp": 1, "plan": "pkg.mod:fn"}, "parallel.tp_plan needs parallel.tensor_parallel > 1"),
        ({"num_workers": 2, "tp": 2, "plan": "not a path"}, "parallel.tp_plan"),
        ({"num_workers": 2, "tp": 0}, "parallel.tensor_parallel"),
    ],
)
def test_bad_tensor_parallel_settings_are_config_errors(tmp_path: Path, section: dict[str, Any], expected: str) -> None:
    parallel: dict[str, Any] = {"tensor_parallel": section["tp"]}
    if "plan" in section:
        parallel["tp_plan"] = section["plan"]
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(lm(tmp_path, LLAMA, section["num_workers"], **parallel))


@pytest.mark.parametrize(
    ("model", "tp", "plan", "error", "expected"),
    [
        (LLAMA, 4, None, ConfigError, r"parallel\.tensor_parallel 4 must divide the model's num_key_value_heads \(2\)"),
        ({"name": "gpt2_small"}, 2, None, ModelError, r"GPT2LMHeadModel has no tensor-parallel plan"),
        (
            {"name": None, "factory": "tests.helpers.user_models:paced_net"},
            2,
            "tests.unit.test_tp:wrong_plan",
            ConfigError,
            r"names modules the model does not have: inner\.9",
        ),
        (
            {"name": None, "factory": "tests.helpers.user_models:paced_net"},
            2,
            "tests.unit.test_tp:no_such_plan",
            ModelError,
            r"parallel\.tp_plan 'tests\.unit\.test_tp:no_such_plan': 'tests\.unit\.test_tp' has no attribute",
        ),
    ],
    ids=["heads", "gpt2-fused-qkv", "plan-names-a-missing-module", "plan-not-found"],
)
def test_model_checks_before_ray_starts(
    tmp_path: Path, model: dict[str, Any], tp: int, plan: str | None, error: type[Exception], expected: str
) -> None:
    parallel: dict[str, Any] = {"tensor_parallel": tp, "tp_plan": plan}
    data = TOKENS if model.get("name") else {"name": "digits"}
    config = load_config(tiny_run(tmp_path, model=model, data=data, scaling={"num_workers": 4}, parallel=parallel))
    with pytest.raises(error, match=expected):
        check_block_names(config)


def test_a_user_plan_is_checked_and_accepted(tmp_path: Path) -> None:
    model = {"name": None, "factory": "tests.helpers.user_models:paced_net"}
    parallel = {"tensor_parallel": 2, "tp_plan": "tests.helpers.user_models:paced_tp_plan"}
    config = load_config(tiny_run(tmp_path, model=model, scaling={"num_workers": 2}, parallel=parallel))
    check_block_names(config)


def wrong_plan(model: nn.Module) -> dict[str, str]:
    return {"inner.1": "colwise", "inner.9": "rowwise"}
