"""Models as their libraries write them: the built-in tasks read logits out of a ModelOutput, a
dict or a tuple; ``model.task: hf`` trains on the loss the model returns; an output no task reads,
and a user's exception before the first step, are one line (models/outputs.py, models/hf_task.py,
worker/user_code.py). In one process: the models are tiny, built from their configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.modeling_outputs import SequenceClassifierOutput

from tests.helpers import hf_models
from tests.helpers.runs import tiny_run
from tests.integration.test_cli import assert_user_error, in_process, write_config
from trainforge.config import ModelConfig
from trainforge.config.factories import raised_at
from trainforge.data.spec import DataSpec
from trainforge.errors import ModelError
from trainforge.models import build_task
from trainforge.models.hf_task import HFTask
from trainforge.models.outputs import logits_of
from trainforge.models.task_registry import check_fits
from trainforge.worker.user_code import is_user_code_error, user_code_error

DIGITS = DataSpec(kind="image", input_shape=(1, 8, 8), num_classes=10)
TOKENS = DataSpec(kind="tokens", input_shape=(16,), vocab_size=64, seq_len=16)
SEQUENCES = DataSpec(kind="image", input_shape=(12,), num_classes=2)
FACTORY = ModelConfig(factory="tests.helpers.hf_models:gpt2_lm")


def test_logits_are_read_from_model_outputs_dicts_and_tuples() -> None:
    logits = torch.randn(3, 5)
    for output in (logits, SequenceClassifierOutput(logits=logits), {"logits": logits}, (logits, torch.zeros(1))):
        assert logits_of(output, "classification") is logits


@pytest.mark.parametrize(
    ("output", "shown"),
    [({"hidden": torch.zeros(2)}, "dict with keys (hidden)"), ("text", "str"), ((), "a tuple of 0 ()")],
)
def test_an_output_no_task_reads_is_one_line_saying_what_to_return(output: object, shown: str) -> None:
    with pytest.raises(ModelError) as caught:
        logits_of(output, "classification")
    message = str(caught.value)
    assert f"forward returned {shown}" in message and "'logits'" in message and "\n" not in message


def test_the_check_before_the_first_step_reads_the_output_on_fake_tensors() -> None:
    sample = (torch.zeros(1, 8, 8), 3)
    with pytest.raises(ModelError, match=r"forward returned dict with keys \(hidden\)"):
        check_fits(hf_models.unreadable(), ModelConfig(factory="m:f"), DIGITS, sample)
    check_fits(hf_models.vit_classifier(), ModelConfig(factory="m:f"), DIGITS, sample)  # a ModelOutput: read
    with torch.device("meta"):  # as the driver builds it, before Ray starts
        on_meta = hf_models.vit_classifier(num_labels=4)
    with pytest.raises(ModelError, match="the model gives 4 outputs per prediction but the data has 10 classes"):
        check_fits(on_meta, ModelConfig(factory="m:f"), DIGITS, sample)


def test_builtin_tasks_train_unwrapped_transformers_models() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(64, (2, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    gpt2 = hf_models.gpt2_lm().eval()  # no dropout: the same logits twice
    loss, sums = build_task(FACTORY, TOKENS).train_step(gpt2, batch)
    expected = gpt2(tokens[:, :-1]).logits.reshape(-1, 64)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(expected, tokens[:, 1:].reshape(-1)))
    assert sums["count"] == 32
    masked = build_task(ModelConfig(factory="m:f", task="masked_lm"), TOKENS)
    loss, _ = masked.train_step(hf_models.bert_mlm(), batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    vit_loss, vit_sums = build_task(ModelConfig(factory="m:f"), DIGITS).train_step(
        hf_models.vit_classifier(), (torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]))
    )
    assert torch.isfinite(vit_loss) and vit_sums["count"] == 4


def test_the_hf_task_optimises_the_models_own_loss_and_reports_accuracy_for_classes() -> None:
    torch.manual_seed(0)
    model = hf_models.distilbert_classifier().eval()
    inputs, labels = torch.randint(20, (4, 12)), torch.tensor([0, 1, 1, 0])
    task = build_task(ModelConfig(factory="m:f", task="hf"), SEQUENCES, model)
    assert isinstance(task, HFTask)
    loss, sums = task.train_step(model, (inputs, labels))
    own = model(input_ids=inputs, labels=labels)
    assert torch.equal(loss, own.loss)
    predicted = own.logits.argmax(dim=-1)
    assert sums["correct"] == (predicted == labels).sum() and sums["counted"] == 4
    metrics = task.finalize({k: float(v) for k, v in task.eval_step(model, (inputs, labels)).items()})
    assert metrics["loss"] == pytest.approx(float(own.loss.detach()), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(float((predicted == labels).float().mean()))


def test_the_hf_task_gives_a_causal_lm_its_input_ids_as_labels_and_a_dict_batch_as_it_is() -> None:
    torch.manual_seed(0)
    model = hf_models.gpt2_lm().eval()
    tokens = torch.randint(64, (2, 17))
    task = build_task(ModelConfig(factory="m:f", task="hf"), TOKENS, model)
    loss, sums = task.train_step(model, (tokens[:, :-1], tokens[:, 1:]))
    assert torch.equal(loss, model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss)
    assert "counted" not in sums  # token labels are not one class per sample: no accuracy
    custom = DataSpec(kind="custom", input_shape=())
    as_dict = build_task(ModelConfig(factory="m:f", task="hf"), custom, model)
    loss, _ = as_dict.train_step(model, {"input_ids": tokens, "labels": tokens})
    assert torch.equal(loss, model(input_ids=tokens, labels=tokens).loss)


def test_the_hf_task_refuses_a_model_that_takes_no_labels_or_returns_no_loss() -> None:
    with pytest.raises(ModelError, match=r"the built-in 'mlp' returns logits: leave model\.task out"):
        build_task(ModelConfig(name="mlp", task="hf"), DIGITS)
    with pytest.raises(ModelError, match=r"Linear.forward takes no labels"):
        build_task(ModelConfig(factory="m:f", task="hf"), DIGITS, torch.nn.Linear(64, 10))
    task = build_task(ModelConfig(factory="m:f", task="hf"), DIGITS, hf_models.vit_classifier())
    with pytest.raises(ModelError, match="returned a tensor"):
        task.model_loss(hf_models.vit_classifier(), torch.zeros(2, 10))


def bad_forward() -> None:
    raise ValueError("features must be normalised")


def test_a_users_exception_names_the_users_own_line() -> None:
    try:
        torch.nn.Module.__call__(hf_models.raises_in_forward(), torch.zeros(1, 64))  # through torch's frames
    except ValueError as err:
        error = user_code_error(err, "at the first step")
        assert is_user_code_error(err)
    message = str(error)
    assert message.startswith("ValueError: the user's bug: features must be normalised at ")
    assert f"{Path(hf_models.__file__)}:" in message and "(in forward)" in message and "\n" not in message
    try:
        bad_forward()
    except ValueError as err:
        assert raised_at(err).startswith(f" at {__file__}:")


def test_failures_of_the_process_group_or_memory_are_not_the_users() -> None:
    assert not is_user_code_error(torch.distributed.DistBackendError("NCCL error"))
    assert not is_user_code_error(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert not is_user_code_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_user_code_error(KeyError("input_ids"))


def test_train_refuses_an_unreadable_output_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, model={"name": None, "factory": "tests.helpers.hf_models:unreadable"})
    result = in_process("train", str(config), capsys=capsys)  # fails the test if Ray started
    assert_user_error(result, "model.task classification reads the model's predictions from its output")
    assert "forward returned dict with keys (hidden)" in result.stderr
    assert not (tmp_path / "t" / "summary.json").exists()


def test_a_sequence_classifier_reads_token_ids_with_a_class_each(tmp_path: Path) -> None:
    from trainforge.config import Config
    from trainforge.data import build_datasets

    data = {"name": "factory", "factory": "tests.helpers.hf_models:token_classes"}
    config = Config.model_validate(tiny_run(tmp_path, data=data))
    train, _, spec = build_datasets(config.data, config.seed)
    inputs, label = train[0]
    assert inputs.dtype == torch.long and inputs.shape == (12,) and label.ndim == 0
    assert spec.kind == "image" and spec.num_classes == 2
