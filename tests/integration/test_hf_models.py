"""Hugging Face models from their configs, unwrapped, on 2 workers: GPT-2 (causal LM), BERT
(masked LM), ViT and DistilBERT (classification), the last two also by ``model.task: hf`` on the
loss the model returns. The training runs are gloo ranks without Ray (tests/helpers/sessions.py:
the worker's own Session); Ray Train runs one of them, and a user's bug at the first step, which
ends the run after one attempt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trainforge
from tests.helpers import hf_models
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import train_each_once
from trainforge.errors import UserCodeError

TOKENS = {"name": "synthetic", "kind": "tokens", "vocab_size": 64, "seq_len": 16, "num_samples": 512}
DIGITS = {"name": "digits"}
SEQUENCES = {"name": "factory", "factory": "tests.helpers.hf_models:token_classes"}
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (factory, its kwargs and model.task, data)
    "gpt2": ("gpt2_lm", {"kwargs": {"vocab_size": 64}}, TOKENS),
    "bert": ("bert_mlm", {"kwargs": {"vocab_size": 65}, "task": "masked_lm"}, TOKENS),
    "vit": ("vit_classifier", {}, DIGITS),
    "vit_hf": ("vit_classifier", {"task": "hf"}, DIGITS),
    "distilbert": ("distilbert_classifier", {}, SEQUENCES),
    "distilbert_hf": ("distilbert_classifier", {"task": "hf"}, SEQUENCES),
}


def hf_run(tmp_path: Path, name: str, steps: int = 40) -> dict[str, Any]:
    factory, model, data = MODELS[name]
    return tiny_run(
        tmp_path,
        run={"name": name},
        model={"name": None, "factory": f"tests.helpers.hf_models:{factory}", **model},
        data=data,
        train={"max_steps": steps, "batch_size": 16, "log_every_n_steps": 5},
        optim={"name": "adamw", "lr": 0.003},
        scaling={"num_workers": 2},
    )


@pytest.mark.slow  # six runs of 40 steps in one pair of gloo ranks: about a minute
def test_transformers_models_train_unwrapped_on_two_workers(tmp_path: Path) -> None:
    trained = train_each_once({name: hf_run(tmp_path, name) for name in MODELS})
    for name, run in trained.items():
        losses = [run.outcome.losses[step] for step in sorted(run.outcome.losses)]
        assert len(losses) == 8, (name, losses)
        first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
        assert last < 0.9 * first, f"{name}: the loss did not fall: {losses}"
        assert run.outcome.final["status"] == "finished", (name, run.outcome.final)
    for name in ("vit", "vit_hf", "distilbert_hf"):  # validation: the task's loss and accuracy
        final = trained[name].outcome.final
        assert 0.0 <= final["val/accuracy"] <= 1.0 and final["val/loss"] > 0, (name, final)


@pytest.mark.slow  # a Ray Train run of 2 workers: over 10 s
@pytest.mark.usefixtures("ray_local")
def test_ray_train_runs_a_vit_on_its_own_loss(tmp_path: Path) -> None:
    summary = trainforge.fit(hf_run(tmp_path, "vit_hf", steps=30)).summary
    assert summary["status"] == "finished" and summary["num_workers"] == 2
    assert summary["final_metrics"]["train/loss"] < 2.0  # from ln(10) = 2.3 at the start
    assert summary["config"]["model"]["task"] == "hf"


@pytest.mark.usefixtures("ray_local")
def test_a_users_exception_at_the_first_step_ends_the_run_after_one_attempt(tmp_path: Path) -> None:
    config = tiny_run(
        tmp_path,
        model={"name": None, "factory": "tests.helpers.hf_models:raises_in_forward"},
        scaling={"num_workers": 2},
        failure={"max_failures": 3},
    )
    with pytest.raises(UserCodeError) as caught:
        trainforge.fit(config)
    message = str(caught.value)
    assert message.startswith("ValueError: the user's bug: features must be normalised at ")
    assert f"{Path(hf_models.__file__)}:" in message and "(in forward)" in message and "\n" not in message
    assert caught.value.exit_code == 2
    summary = (tmp_path / "t" / "summary.json").read_text()
    assert '"restarts": 0' in summary and '"status": "failed"' in summary
