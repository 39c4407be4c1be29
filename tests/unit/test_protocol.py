"""What crosses between workers and driver (trainforge/protocol.py): events with fields and the words
people read, reports as metrics.jsonl holds them, read back from untrusted JSON without raising,
and a user's error by an explicit kind."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import pytest

from trainforge.config.safeyaml import YamlRefused
from trainforge.errors import ERROR_KINDS, CheckpointError, ConfigError, TrainforgeError, TrainingFailed
from trainforge.protocol import (
    BestValidation,
    CheckpointSkipped,
    EndedEarly,
    LogBatch,
    LogLine,
    Note,
    Report,
    Resumed,
    SaveFailed,
    Stopping,
    UserError,
    WorkerFailure,
    curve_points,
    event_from_json,
    event_to_json,
)

EVENTS = [
    (Resumed(20, "/runs/t/checkpoint_000000020"), "resumed from /runs/t/checkpoint_000000020 at step 20", "info"),
    (
        Resumed(8, "/r/checkpoint_000000008", resharded_from="fsdp", layout="ddp"),
        "resumed from /r/checkpoint_000000008 at step 8; "
        "resharded: the checkpoint was written by fsdp, this run uses ddp",
        "info",
    ),
    (
        CheckpointSkipped("checkpoint_000000020", "model.safetensors fails its BLAKE3 check (corrupted)"),
        "skipped checkpoint checkpoint_000000020: model.safetensors fails its BLAKE3 check (corrupted)",
        "warning",
    ),
    (
        SaveFailed(30, "[Errno 28] No space left on device"),
        "checkpoint save at step 30 failed: [Errno 28] No space left on device",
        "error",
    ),
    (SaveFailed(60, "disk full", final=True), "final checkpoint save at step 60 failed: disk full", "error"),
    (Stopping("the driver asked for a stop"), "stopping: the driver asked for a stop", "warning"),
    (Note("optimizer state not restored: the checkpoint used sgd, this run adamw"), None, "info"),
    (EndedEarly(7, "rank 1 asked at step 7", "callback"), "ended at step 7: rank 1 asked at step 7", "info"),
    (
        BestValidation("val/loss", 0.25, 40, stopped=True),
        "early stopping: best val/loss 0.25 at step 40",
        "info",
    ),
    (BestValidation("val/loss", None, None, stopped=False), "early stopping: no finite val/loss yet", "info"),
]


@pytest.mark.parametrize(("event", "text", "level"), EVENTS)
def test_events_say_todays_words_and_come_back_from_json_as_they_went(event: Any, text: str | None, level: str) -> None:
    assert event.text == (text if text is not None else event.text) and event.level == level
    as_json = json.loads(json.dumps(event_to_json(event)))
    assert as_json["kind"] == event.kind and as_json["text"] == event.text
    assert event_from_json(as_json) == event


@pytest.mark.parametrize(
    ("value", "read"),
    [
        (
            "resumed from /old/checkpoint_000000010 at step 10",
            Note("resumed from /old/checkpoint_000000010 at step 10"),
        ),
        ({"kind": "resumed", "step": "10", "path": "/p", "text": "resumed from /p"}, Note("resumed from /p")),
        ({"kind": "resumed", "step": True, "path": "/p", "text": "t"}, Note("t")),  # a bool is no step
        ({"kind": "resumed", "path": "/p", "text": "t"}, Note("t")),  # a field missing
        ({"kind": "from the future", "text": "something new"}, Note("something new")),
        ({"kind": "note", "text": "n", "level": "catastrophic"}, Note("n")),
        ({"kind": "resumed", "step": 1, "path": "/p"}, Resumed(1, "/p")),
        ({"kind": "resumed"}, None),
        ({"kind": "ended_early", "step": 3, "reason": "r", "source": "elsewhere", "text": "t"}, Note("t")),
        ({"text": 5}, None),
        (7, None),
        (None, None),
        (["a list"], None),
    ],
)
def test_events_read_back_from_untrusted_json_never_raise(value: Any, read: Any) -> None:
    assert event_from_json(value) == read


def report() -> Report:
    return Report(
        step=40,
        epoch=1,
        samples_seen=1280,
        total_steps=100,
        world_size=2,
        time=1_790_000_000.5,
        figures={"train/loss": 0.5, "perf/samples_per_s": 900.0, "val/loss": float("nan"), "batch/oom_retries": 0},
        history=[{"step": 30, "time/unix": 1_789_999_999.0, "train/loss": 0.6}, {"step": 40, "train/loss": 0.4}],
        events=(Resumed(30, "/c/checkpoint_000000030"), CheckpointSkipped("checkpoint_000000035", "no manifest")),
        checkpoint="/c/checkpoint_000000030",
        status="finished",
        final_save_error="disk full",
        currency="EUR",
    )


def test_a_report_is_a_metrics_jsonl_line_with_todays_keys_and_reads_back() -> None:
    line = report().to_json()
    assert line["step"] == 40 and line["epoch"] == 1 and line["world_size"] == 2 and line["total_steps"] == 100
    assert line["time/unix"] == 1_790_000_000.5 and line["train/loss"] == 0.5 and line["samples_seen"] == 1280
    assert line["checkpoint/path"] == "/c/checkpoint_000000030" and line["status"] == "finished"
    assert line["checkpoint/final_save_error"] == "disk full" and line["cost/currency"] == "EUR"
    assert [e["text"] for e in line["events"]] == [
        "resumed from /c/checkpoint_000000030 at step 30",
        "skipped checkpoint checkpoint_000000035: no manifest",
    ]
    assert line["history"][0] == {"step": 30, "time/unix": 1_789_999_999.0, "train/loss": 0.6}
    back = Report.from_json(json.loads(json.dumps(line)))
    assert back is not None and math.isnan(back.figures["val/loss"])
    assert back.to_json().keys() == line.keys()
    assert {k: v for k, v in back.figures.items() if k != "val/loss"} == {
        k: v for k, v in report().figures.items() if k != "val/loss"
    }
    assert (back.events, back.history, back.checkpoint, back.currency) == (
        report().events,
        report().history,
        report().checkpoint,
        report().currency,
    )
    assert Report(step=3).to_json() == {"step": 3, "history": []}  # nothing it does not have


def test_a_report_read_back_from_untrusted_json_never_raises() -> None:
    assert Report.from_json({"train/loss": 0.5}) is None  # no step: not a report
    assert Report.from_json({"step": "5"}) is None and Report.from_json(["step"]) is None
    odd = Report.from_json(
        {
            "step": 5.0,
            "epoch": "one",
            "flag/x": True,
            "note": "text",
            "checkpoint/path": 3,
            "history": [{"step": 5, "train/loss": "x", "val/loss": 1.0}, {"no": "step"}, "point"],
            "events": "not a list",
        }
    )
    assert odd is not None and odd.step == 5 and odd.epoch is None and odd.checkpoint is None
    assert odd.figures == {} and odd.history == [{"step": 5, "val/loss": 1.0}] and odd.events == ()


def test_a_report_crosses_ray_by_pickle_and_its_curve_points_are_its_lines() -> None:
    sent = report()
    sent.figures["val/loss"] = 0.7  # NaN is not equal to itself
    assert pickle.loads(pickle.dumps(sent)) == sent
    from_line = curve_points(sent.to_json())
    numbers = [{k: v for k, v in point.items() if isinstance(v, (int, float))} for point in from_line]
    assert curve_points(sent) == numbers  # the same points from the Report as from its metrics.jsonl line
    own = curve_points(sent)[-1]
    assert own["step"] == 40 and "train/loss" not in own  # the history covers it
    assert own["perf/samples_per_s"] == 900.0


def test_worker_failures_and_log_lines() -> None:
    failure = WorkerFailure({1: "ActorDiedError: gone"}, 1_790_000_000.0)
    line = json.loads(json.dumps(failure.to_json()))
    assert line == {"event": "worker_error", "errors": {"1": "ActorDiedError: gone"}, "time": 1_790_000_000.0}
    assert WorkerFailure.from_json(line) == failure
    assert WorkerFailure.from_json({"event": "worker_error", "errors": {"x": 1, "2": 3}, "time": "late"}) == (
        WorkerFailure({2: "3"}, None)
    )
    batch = LogBatch((LogLine(30, "WARNING rank=0 ..."),))
    assert pickle.loads(pickle.dumps(batch)) == batch


@pytest.mark.parametrize(
    ("error", "kind", "raised"),
    [
        (ConfigError("bad key"), "ConfigError", ConfigError),
        (YamlRefused("too deep"), "ConfigError", ConfigError),  # a subclass travels as its table kind
        (CheckpointError("refused"), "CheckpointError", CheckpointError),
        (TrainingFailed("save failed"), "TrainingFailed", TrainingFailed),
        (TrainforgeError("plain"), "TrainforgeError", TrainforgeError),
    ],
)
def test_a_users_error_crosses_by_kind_and_is_raised_as_its_class(
    error: TrainforgeError, kind: str, raised: type[TrainforgeError]
) -> None:
    sent = UserError.of(error)
    assert sent.kind == kind and sent.message == str(error)
    again = pickle.loads(pickle.dumps(sent)).error()
    assert type(again) is raised and str(again) == str(error)


def test_an_unknown_kind_is_a_plain_trainforge_error_never_a_lookup_on_the_module() -> None:
    assert set(ERROR_KINDS) >= {"ConfigError", "DataError", "ModelError", "CheckpointError", "TrainingFailed"}
    for kind in ("KeyboardInterrupt", "ERROR_KINDS", "error_for", "SystemExit"):
        error = UserError(kind, "m").error()
        assert type(error) is TrainforgeError and str(error) == "m"
