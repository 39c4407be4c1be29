"""``train.anomaly``: an injected NaN and an injected loss spike, each once from the data (the
re-run agrees: ``data``) and once from the model (the re-run differs: ``not_data``), are
recorded with their step and samples, and skipped or rolled back; the run finishes with a finite
loss. Sessions run in gloo ranks without Ray (tests/helpers/anomalies.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.anomalies import BAD_INDEX, sessions
from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from trainforge.checkpoint.names import checkpoint_name
from trainforge.config import AnomalyConfig, load_config
from trainforge.driver.summary import Recovery, RunRecord, build_summary
from trainforge.errors import ConfigError
from trainforge.protocol import Anomaly, Report, event_from_json, event_to_json
from trainforge.worker.anomaly import AnomalyGuard

HELPERS = "tests.helpers.anomalies"
BATCH = 16
BAD_STEP = BAD_INDEX // BATCH + 1  # one rank, no shuffle: the step whose batch holds the bad sample
MAX_STEPS = 16


def anomaly_run(tmp_path: Path, name: str, data: str, model: dict[str, Any], **anomaly: Any) -> dict[str, Any]:
    return tiny_run(
        tmp_path,
        run={"name": name},
        model={"name": None, **model},
        data={"name": "factory", "factory": f"{HELPERS}:{data}", "shuffle": False},
        train={"max_steps": MAX_STEPS, "batch_size": BATCH, "anomaly": {"window": 5, **anomaly}},
        checkpoint={"every_n_steps": 5},
    )


CLEAN_MODEL = {"factory": f"{HELPERS}:digits_net"}


def nan_model(at: int, on_rank: int = 0) -> dict[str, Any]:
    return {"factory": f"{HELPERS}:nan_once", "kwargs": {"at": at, "on_rank": on_rank}}


def spike_model(at: int) -> dict[str, Any]:
    return {"factory": f"{HELPERS}:spike_once", "kwargs": {"at": at}}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Seven runs in one process: the faults under skip and rollback, a rollback limit of 0 (in a
    Session and through run_worker), and a spike under dropout and accumulation."""
    tmp = tmp_path_factory.mktemp("anomaly")
    configs = {
        "data_nan_skip": anomaly_run(tmp, "a", "digits_nan", CLEAN_MODEL),
        "model_nan_skip": anomaly_run(tmp, "b", "digits_clean", nan_model(7)),
        "data_spike_rollback": anomaly_run(tmp, "c", "digits_huge", CLEAN_MODEL, action="rollback"),
        "model_spike_rollback": anomaly_run(tmp, "d", "digits_clean", spike_model(8), action="rollback"),
        "no_rollbacks_left": anomaly_run(tmp, "e", "digits_nan", CLEAN_MODEL, action="rollback", max_rollbacks=0),
    }
    dropout = {"factory": "tests.helpers.user_models:dropout_net", "kwargs": {"hidden": 32, "dropout": 0.3}}
    accumulated = anomaly_run(tmp, "f", "digits_huge", dropout)
    accumulated["train"].update(batch_size=BATCH // 2, grad_accum_steps=2)  # the same 16 samples a step
    configs["data_spike_dropout_accumulated"] = accumulated
    configs["no_rollbacks_left_worker"] = anomaly_run(  # last: through run_worker
        tmp, "g", "digits_nan", CLEAN_MODEL, action="rollback", max_rollbacks=0
    )
    resolved = [load_config(config, env={}).to_dict() for config in configs.values()]
    (outcomes,) = spawn_ranks(sessions, 1, resolved, 1)
    return dict(zip(configs, outcomes, strict=True))


def anomalies(outcome: dict[str, Any]) -> list[Anomaly]:
    found = [event_from_json(json.loads(json.dumps(e))) for e in outcome["events"] if e["kind"] == "anomaly"]
    return [event for event in found if isinstance(event, Anomaly)]


def finished_finite(outcome: dict[str, Any]) -> None:
    assert outcome["step"] == MAX_STEPS and outcome["final"]["status"] == "finished"
    assert math.isfinite(outcome["final"]["train/loss"]) and outcome["weights_finite"]


def test_a_nan_from_the_data_is_attributed_to_the_data_and_skipped(one_rank: dict[str, dict[str, Any]]) -> None:
    outcome = one_rank["data_nan_skip"]
    (event,) = anomalies(outcome)
    assert (event.step, event.anomaly, event.attribution, event.action) == (BAD_STEP, "nonfinite", "data", "skipped")
    assert event.loss is None and event.rerun_loss is None
    first = (BAD_STEP - 1) * BATCH
    assert event.samples == tuple(range(first, first + BATCH)) and BAD_INDEX in event.samples
    assert outcome["counts"] == {
        "anomaly/skipped": 1,
        "anomaly/rolled_back": 0,
        "anomaly/data": 1,
        "anomaly/not_data": 0,
    }
    assert outcome["final"]["anomaly/skipped"] == 1  # in every report: what summary.json counts
    finished_finite(outcome)


def test_a_nan_of_one_forward_is_attributed_elsewhere_and_skipped(one_rank: dict[str, dict[str, Any]]) -> None:
    outcome = one_rank["model_nan_skip"]
    (event,) = anomalies(outcome)
    assert (event.step, event.anomaly, event.attribution, event.action) == (7, "nonfinite", "not_data", "skipped")
    assert event.loss is None and event.rerun_loss is not None and math.isfinite(event.rerun_loss)
    assert outcome["counts"]["anomaly/not_data"] == 1 and outcome["lr_scale"] == 1.0
    finished_finite(outcome)


def test_a_spike_from_the_data_rolls_back_past_its_batch_with_a_lower_lr(one_rank: dict[str, dict[str, Any]]) -> None:
    outcome = one_rank["data_spike_rollback"]
    (event,) = anomalies(outcome)
    assert (event.step, event.anomaly, event.attribution, event.action) == (BAD_STEP, "spike", "data", "rolled_back")
    assert event.loss is not None and event.rerun_loss is not None and event.loss > 10 and event.rerun_loss > 10
    assert event.checkpoint is not None and event.checkpoint.endswith(checkpoint_name(10))
    assert event.lr == pytest.approx(0.05 * 0.5) and outcome["lr"] == pytest.approx(0.05 * 0.5)
    # Back to step 10, on from the sample after the bad batch: steps 11..16 read 6 batches from there.
    assert outcome["position"] == (0, BAD_STEP * BATCH + (MAX_STEPS - 10) * BATCH)
    assert outcome["counts"]["anomaly/rolled_back"] == 1 and outcome["counts"]["anomaly/data"] == 1
    finished_finite(outcome)


def test_a_spike_of_one_forward_rolls_back_and_is_not_the_data(one_rank: dict[str, dict[str, Any]]) -> None:
    outcome = one_rank["model_spike_rollback"]
    (event,) = anomalies(outcome)
    assert (event.step, event.anomaly, event.attribution, event.action) == (8, "spike", "not_data", "rolled_back")
    assert event.checkpoint is not None and event.checkpoint.endswith(checkpoint_name(5))
    assert outcome["counts"]["anomaly/rolled_back"] == 1 and outcome["lr_scale"] == 0.5
    finished_finite(outcome)


def test_the_re_run_is_the_same_computation_under_dropout_and_accumulation(
    one_rank: dict[str, dict[str, Any]],
) -> None:
    """Two micro-batches and dropout: the re-run reads the kept micro-batches with the random state
    the step began with, so a data fault gives the very same loss again."""
    outcome = one_rank["data_spike_dropout_accumulated"]
    (event,) = anomalies(outcome)
    assert (event.step, event.anomaly, event.attribution, event.action) == (BAD_STEP, "spike", "data", "skipped")
    assert event.loss is not None and event.loss > 10 and event.rerun_loss == event.loss
    assert BAD_INDEX in event.samples and len(event.samples) == BATCH
    finished_finite(outcome)


def test_a_rollback_past_max_rollbacks_ends_the_run_in_one_line(one_rank: dict[str, dict[str, Any]]) -> None:
    error = one_rank["no_rollbacks_left"]["error"]
    assert "\n" not in error and f"step {BAD_STEP}" in error and "max_rollbacks 0" in error
    # A Ray Train worker returns it as the user's error (TrainingFailed), which Ray does not retry.
    returned = one_rank["no_rollbacks_left_worker"]
    assert (returned["returned"], returned["kind"]) == ("UserError", "TrainingFailed")
    assert returned["message"] == error


def test_the_summary_counts_what_the_final_report_says(one_rank: dict[str, dict[str, Any]]) -> None:
    """summary.json's ``anomalies``, from the final report as the driver reads it back."""
    counted = {}
    for name in ("data_nan_skip", "model_spike_rollback"):
        final = Report.from_json(json.loads(json.dumps(one_rank[name]["final"])))
        assert final is not None
        counted[name] = build_summary(RunRecord("finished", final, Recovery(), 1.0, None, {}, 1))["anomalies"]
    assert counted == {
        "data_nan_skip": {"skipped": 1, "rolled_back": 0, "attributed": {"data": 1, "not_data": 0}},
        "model_spike_rollback": {"skipped": 0, "rolled_back": 1, "attributed": {"data": 0, "not_data": 1}},
    }
    assert "anomalies" not in build_summary(RunRecord("finished", Report(step=5), Recovery(), 1.0, None, {}, 1))


def test_two_ranks_agree_on_a_nan_only_one_of_them_sees(tmp_path: Path) -> None:
    """The NaN is rank 1's alone, the bad sample rank 0's alone: both ranks drop the same steps,
    roll back together (also under fsdp) and end with the same weights."""
    configs = [
        anomaly_run(tmp_path, "two_nan", "digits_clean", nan_model(5, on_rank=1)),
        anomaly_run(tmp_path, "two_spike", "digits_huge", CLEAN_MODEL, action="rollback"),
        # Under fsdp the rollback reloads sharded checkpoints in the running ranks.
        {
            **anomaly_run(tmp_path, "two_fsdp", "digits_clean", nan_model(7, on_rank=1), action="rollback"),
            "parallel": {"strategy": "fsdp"},
        },
    ]
    resolved = [load_config({**c, "scaling": {"num_workers": 2}}, env={}).to_dict() for c in configs]
    rank0, rank1 = spawn_ranks(sessions, 2, resolved)
    for mine, theirs in zip(rank0, rank1, strict=True):
        finished_finite(mine)
        assert mine["counts"] == theirs["counts"] and mine["lr"] == theirs["lr"]
        assert mine["position"] == theirs["position"] and mine["step"] == theirs["step"]
    assert rank0[0]["weights_sum"] == rank1[0]["weights_sum"] and rank0[1]["weights_sum"] == rank1[1]["weights_sum"]
    (fsdp,) = anomalies(rank0[2])
    assert (fsdp.step, fsdp.attribution, fsdp.action) == (7, "not_data", "rolled_back")
    assert fsdp.checkpoint is not None and fsdp.checkpoint.endswith(checkpoint_name(5))
    (nan,) = anomalies(rank0[0])
    assert (nan.step, nan.attribution, nan.action) == (5, "not_data", "skipped") and len(nan.samples) == 2 * BATCH
    (spike,) = anomalies(rank0[1])
    # Sample i goes to rank i % 2 at position i // 2: the bad one is in rank 0's 7th batch.
    step = BAD_INDEX // 2 // BATCH + 1
    first = (step - 1) * 2 * BATCH
    expected = tuple(range(first, first + 2 * BATCH, 2)) + tuple(range(first + 1, first + 2 * BATCH, 2))
    assert (spike.step, spike.attribution, spike.action, spike.samples) == (step, "data", "rolled_back", expected)


def guard(window: int = 3, zscore: float = 2.0) -> AnomalyGuard:
    return AnomalyGuard(AnomalyConfig(window=window, spike_zscore=zscore), torch.device("cpu"))


def test_a_spike_is_judged_only_once_the_window_is_full_and_against_it() -> None:
    g = guard()
    rerun = lambda: (torch.tensor(1.0), torch.tensor(1.0))  # noqa: E731
    for loss in (1.0, 50.0, 1.2):  # filling the window: nothing is a spike yet
        assert g.check(torch.tensor(loss, dtype=torch.float64), torch.tensor(1.0), rerun) is None
    mean = (1.0 + 50.0 + 1.2) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in (1.0, 50.0, 1.2)) / 3)
    assert g.verdict(mean + 2.0 * std - 0.01, 1.0) is None
    assert g.verdict(mean + 2.0 * std + 0.01, 1.0) == "spike"
    assert g.verdict(float("inf"), 1.0) == "nonfinite" and g.verdict(1.0, float("nan")) == "nonfinite"
    found = g.check(torch.tensor(500.0), torch.tensor(1.0), rerun)  # the re-run's loss is no spike
    assert found is not None and found.anomaly == "spike" and found.attribution == "not_data"
    assert list(g.losses) == [1.0, 50.0, 1.2]  # an anomalous step's loss stays out of the window


def test_a_window_of_equal_losses_takes_a_rounding_for_no_spike() -> None:
    g = guard(zscore=6.0)
    g.losses.extend([2.0, 2.0, 2.0])
    assert g.verdict(2.0 * (1 + 1e-6), 1.0) is None and g.verdict(2.0 * (1 + 1e-5), 1.0) == "spike"


def test_an_event_read_back_without_its_numbers_still_has_a_text() -> None:
    event = event_from_json(
        {
            "kind": "anomaly",
            "step": 3,
            "anomaly": "spike",
            "attribution": "data",
            "action": "rolled_back",
            "loss": None,
            "rerun_loss": None,
            "grad_norm": None,
        }
    )
    assert isinstance(event, Anomaly) and event.text.startswith("step 3: a loss spike (?)")
    assert "LR now ?" in event.text


def test_under_fp16_a_non_finite_gradient_is_the_loss_scalers() -> None:
    fp16 = AnomalyGuard(AnomalyConfig(window=3), torch.device("cpu"), grads_count=False)
    assert fp16.verdict(1.0, float("inf")) is None and fp16.verdict(float("nan"), 1.0) == "nonfinite"


def test_an_anomaly_event_reads_back_from_metrics_jsonl() -> None:
    event = Anomaly(7, "spike", "data", "rolled_back", 31.5, 31.5, 2.0, (4, 5), "/ckpt/checkpoint_000005", 0.025)
    again = event_from_json(json.loads(json.dumps(event_to_json(event))))
    assert again == event
    assert "step 7: a loss spike (31.5), attributed to the data" in event.text
    wrong = event_from_json({**event_to_json(event), "samples": ["x"]})  # untrusted: a Note with its text
    assert not isinstance(wrong, Anomaly) and wrong is not None and wrong.text == event.text


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("action", "undo", "train.anomaly.action"),
        ("spike_zscore", 0, "train.anomaly.spike_zscore"),
        ("window", 1, "train.anomaly.window"),
        ("max_rollbacks", -1, "train.anomaly.max_rollbacks"),
        ("lr_factor", 1.5, "train.anomaly.lr_factor"),
        ("lr_factor", 0, "train.anomaly.lr_factor"),
        ("patience", 3, "train.anomaly.patience"),
        ("lr_factor", 0.25, "train.anomaly.lr_factor applies to action: rollback"),
        ("max_rollbacks", 5, "train.anomaly.max_rollbacks applies to action: rollback"),
    ],
)
def test_every_key_is_checked_in_one_line_naming_it(tmp_path: Path, key: str, value: Any, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tiny_run(tmp_path, train={"anomaly": {key: value}}), env={})
    assert said in str(err.value) and "\n" not in str(err.value)
