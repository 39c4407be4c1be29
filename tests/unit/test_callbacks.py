"""User callbacks and train.early_stopping in the worker's Session, on gloo ranks without Ray.

A callback's request_stop on one rank ends every rank after the same step; early stopping ends
the run where its metric stalls, and restore_best's weights are the best pass's; a callback's state
and early stopping's count survive a crash and the resumed run is bit-identical to a straight one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import assert_bit_identical, checkpoint_state, train
from tests.helpers.user_callbacks import records
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import load_config
from trainforge.driver.summary import Recovery, RunRecord, finish_run_dir
from trainforge.errors import ConfigError
from trainforge.protocol import Report
from trainforge.worker.callbacks import check_callbacks

HELPERS = "tests.helpers.user_callbacks"


def callback(name: str, **kwargs: Any) -> dict[str, Any]:
    return {"path": f"{HELPERS}:{name}", "kwargs": kwargs}


def checkpoints(run_dir: Path) -> list[int]:
    return [int(p.name.rpartition("_")[2]) for p in sorted(run_dir.glob("checkpoint_*"))]


def summary_of(final: dict[str, Any], config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """What the driver writes at the end of this run (summary.json, model.safetensors)."""
    report = Report.from_json(final)
    assert report is not None
    record = RunRecord("finished", report, Recovery(), 1.0, report.checkpoint, config, 2)
    store = CheckpointStore.for_run(str(run_dir.parent), run_dir.name)
    return finish_run_dir(run_dir, record, store)


@pytest.mark.slow  # two ranks, ~10 s
def test_request_stop_on_rank_1_at_step_n_stops_both_ranks_at_n(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    config = tiny_run(
        tmp_path,
        train={"max_steps": 20, "eval_every_n_steps": 4},
        checkpoint={"every_n_steps": 5},
        scaling={"num_workers": 2},
        callbacks=[callback("StopAt", step=7, rank=1), callback("Recorder", log=str(log))],
    )
    ranks = train(config, 2)
    assert [r.final["step"] for r in ranks] == [7, 7]
    assert [r.final["status"] for r in ranks] == ["finished", "finished"]
    assert "ended at step 7: rank 1 asked at step 7" in ranks[0].events
    run_dir = tmp_path / "t"
    assert checkpoints(run_dir) == [5, 7]
    for rank in (0, 1):
        seen = records(log, rank)
        hooks = [r["hook"] for r in seen]
        assert hooks[0] == "on_train_start" and hooks[-1] == "on_train_end"
        assert [r["step"] for r in seen if r["hook"] == "on_step_end"] == list(range(1, 8))
        # step 4: its on_step_end, then its validation's on_validation_end
        assert hooks[hooks.index("on_validation_end") - 1] == "on_step_end"
        assert [r for r in seen if r["hook"] == "on_step_end"][3]["step"] == 4
        paths = [r["path"] for r in seen if r["hook"] == "on_checkpoint"]
        assert [Path(p).name for p in paths] == ["checkpoint_000000005", "checkpoint_000000007"]
        metrics = seen[1]["metrics"]
        assert set(metrics) >= {"train/loss", "train/accuracy", "train/lr"} and metrics["train/lr"] == 0.05
    summary = summary_of(ranks[0].report, config, run_dir)
    assert summary["stopped_by"] == {"source": "callback", "reason": "rank 1 asked at step 7", "step": 7}
    assert summary["stopped_early"] is None


def early_config(tmp: Path, **early: Any) -> dict[str, Any]:
    # mode max on val/loss: the loss falls from the first pass on, so only the first pass is best
    return tiny_run(
        tmp,
        train={
            "max_steps": 40,
            "eval_every_n_steps": 3,
            "early_stopping": {"metric": "val/loss", "mode": "max", "patience": 2, **early},
        },
        checkpoint={"every_n_steps": 4, "keep_last": 1},
    )


@pytest.mark.slow  # two runs, ~8 s a layout
@pytest.mark.parametrize(("strategy", "workers"), [("ddp", 1), ("fsdp", 2)])
def test_early_stopping_ends_where_the_metric_stalls_and_restore_best_exports_the_best(
    tmp_path: Path, strategy: str, workers: int
) -> None:
    config = early_config(tmp_path, restore_best=True)
    config["parallel"] = {"strategy": strategy}
    config["scaling"] = {"num_workers": workers}
    rank0 = train(config, workers)[0]
    # passes at 3 (best), 6 (1 without improvement), 9 (2: patience runs out)
    assert rank0.final["step"] == 9 and rank0.final["status"] == "finished"
    run_dir = tmp_path / "t"
    assert checkpoints(run_dir) == [3, 9]  # the best pass's checkpoint outlives keep_last: 1
    summary = summary_of(rank0.report, config, run_dir)
    assert summary["stopped_early"]["step"] == 9 and summary["stopped_early"]["best_step"] == 3
    assert summary["stopped_early"]["best"] == pytest.approx(rank0.val_losses[3])
    assert summary["stopped_by"]["source"] == "early_stopping"
    assert summary["model_weights_step"] == 3
    exported = load_file(str(run_dir / "model.safetensors"))
    assert_bit_identical(exported, load_file(str(run_dir / "checkpoint_000000003" / "model.safetensors")))
    last = load_file(str(run_dir / "checkpoint_000000009" / "model.safetensors"))
    assert any(not (exported[k] == last[k]).all() for k in exported)

    # A re-run of the directory trains no further: the stop is in the checkpoint's state.
    again = train(config, workers)[0]
    assert again.final["step"] == 9 and checkpoints(run_dir) == [3, 9]


@pytest.mark.slow  # one rank, two runs, ~6 s
def test_a_stop_at_a_best_pass_is_in_the_checkpoint_of_that_step(tmp_path: Path) -> None:
    """restore_best checkpoints a pass that improves; a callback's stop asked at that pass must be in
    that step's checkpoint too (a checkpoint is never written twice), or a re-run would train on."""
    config = early_config(tmp_path, mode="min", restore_best=True)  # every pass improves
    config["callbacks"] = [callback("StopAtValidation", step=6)]
    (rank0,) = train(config, 1)
    assert rank0.final["step"] == 6
    run_dir = tmp_path / "t"
    assert checkpoints(run_dir) == [6]  # the best pass's and the last: keep_last 1
    state = json.loads((run_dir / "checkpoint_000000006" / "trainer_state.json").read_text())
    assert state["components"]["callbacks"]["stop"] == {"reason": "validated at step 6", "step": 6}
    assert summary_of(rank0.report, config, run_dir)["model_weights_step"] == 6
    (again,) = train(config, 1)
    assert again.final["step"] == 6 and checkpoints(run_dir) == [6]


@pytest.mark.slow  # one rank, three runs, ~12 s
def test_callback_state_and_early_stopping_resume_bit_identical(tmp_path: Path) -> None:
    def config(tmp: Path) -> dict[str, Any]:
        cfg = early_config(tmp, patience=3)
        cfg["train"]["log_every_n_steps"] = 2
        cfg["checkpoint"]["keep_last"] = 5
        cfg["callbacks"] = [callback("Recorder", log=str(tmp / "calls"))]
        return cfg

    (straight,) = train(config(tmp_path / "a"), 1)
    crashed = train(config(tmp_path / "b"), 1, crash_at=7)[0]
    assert crashed.crashed
    assert checkpoints(tmp_path / "b" / "t") == [4]
    (resumed,) = train(config(tmp_path / "b"), 1)
    assert straight.final["step"] == resumed.final["step"] == 12  # passes 3 (best), 6, 9, 12
    assert_bit_identical(checkpoint_state(tmp_path / "a" / "t", 12), checkpoint_state(tmp_path / "b" / "t", 12))
    states = [
        json.loads((tmp_path / x / "t" / "checkpoint_000000012" / "trainer_state.json").read_text()) for x in "ab"
    ]
    assert states[0]["components"]["callbacks"] == states[1]["components"]["callbacks"]
    assert states[0]["components"]["early_stopping"] == states[1]["components"]["early_stopping"]
    assert states[0]["components"]["callbacks"]["states"][f"0:{HELPERS}:Recorder"]["steps"] == 12
    ends = [r for r in records(tmp_path / "b" / "calls", 0) if r["hook"] == "on_train_end"]
    straight_end = [r for r in records(tmp_path / "a" / "calls", 0) if r["hook"] == "on_train_end"]
    assert ends[-1] == straight_end[-1]  # the same steps and the same sum of losses, to the bit


def run_worker_returns(rank: int, world: int, config: dict[str, Any]) -> tuple[str, str]:
    """One rank's run as a Ray Train worker runs it (run_worker): the type and message it returns."""
    from trainforge.protocol import Payload
    from trainforge.worker.loop import run_worker

    cfg = load_config(config, env={})
    returned = run_worker(Payload(cfg, None), ranks=(rank, world), channel=_Quiet())
    return type(returned).__name__, getattr(returned, "message", "")


class _Quiet:
    def report(self, report: Report) -> None:
        pass

    def preempted(self) -> bool:
        return False


@pytest.mark.slow  # two ranks, ~6 s
def test_a_callback_that_raises_at_the_first_step_ends_every_rank_without_a_retry(tmp_path: Path) -> None:
    config = tiny_run(tmp_path, scaling={"num_workers": 2}, callbacks=[callback("RaisesAt", step=1, rank=1)])
    returned = spawn_ranks(run_worker_returns, 2, config)
    for kind, message in returned:
        assert kind == "UserError"
        assert "callback tests.helpers.user_callbacks:RaisesAt.on_step_end raised ValueError" in message
        assert "user_callbacks.py:" in message and "on rank 1" in message and "not retried" in message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"callbacks": ["no colon"]}, "callbacks.0.path = 'no colon': must look like 'package.module:Class'"),
        ({"train": {"max_steps": 5, "early_stopping": {"mode": "min"}}}, "train.early_stopping.metric"),
        (
            {"train": {"max_steps": 5, "eval_every_n_steps": 2, "early_stopping": {"metric": "loss"}}},
            "must name a validation metric",
        ),
        (
            {
                "train": {
                    "max_steps": 5,
                    "eval_every_n_steps": 2,
                    "early_stopping": {"metric": "val/loss", "patience": 0},
                }
            },
            "train.early_stopping.patience = 0",
        ),
        (
            {
                "train": {
                    "max_steps": 5,
                    "eval_every_n_steps": 2,
                    "early_stopping": {"metric": "val/loss", "min_delta": -1},
                }
            },
            "train.early_stopping.min_delta = -1",
        ),
        (
            {"train": {"max_steps": 5, "early_stopping": {"metric": "val/loss", "mode": "up"}}},
            "train.early_stopping.mode = 'up'",
        ),
        ({"train": {"max_steps": 5, "early_stopping": {"metric": "val/loss"}}}, "set train.eval_every_n_steps"),
        (
            {
                "data": {"name": "synthetic", "val_fraction": 0},
                "train": {"max_steps": 5, "eval_every_n_steps": 2, "early_stopping": {"metric": "val/loss"}},
            },
            "train.early_stopping needs validation data",
        ),
    ],
)
def test_bad_callbacks_and_early_stopping_are_one_line_naming_the_key(change: dict, expected: str) -> None:
    raw = {"model": {"name": "mlp"}, "train": {"max_steps": 5}, **change}
    with pytest.raises(ConfigError) as err:
        load_config(raw, env={})
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (
            f"{HELPERS}:Missing",
            "callbacks[0] 'tests.helpers.user_callbacks:Missing': 'tests.helpers.user_callbacks' has no",
        ),
        ("tests.helpers.nowhere:C", "callbacks[0] 'tests.helpers.nowhere:C': cannot import module"),
        (f"{HELPERS}:NOT_A_CLASS", "is not callable"),
        (f"{HELPERS}:NoHooks", "defines none of the hooks on_train_start, on_step_end"),
    ],
)
def test_a_callback_that_does_not_import_is_one_line_before_ray(path: str, expected: str) -> None:
    cfg = load_config({"model": {"name": "mlp"}, "train": {"max_steps": 5}, "callbacks": [path]}, env={})
    with pytest.raises(ConfigError) as err:
        check_callbacks(cfg)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_fit_refuses_a_callback_that_does_not_import_before_ray_starts(tmp_path: Path) -> None:
    import ray

    import trainforge

    config = tiny_run(tmp_path, callbacks=[f"{HELPERS}:Missing"])
    with pytest.raises(ConfigError, match=r"callbacks\[0\] 'tests.helpers.user_callbacks:Missing'"):
        trainforge.fit(config)
    assert not ray.is_initialized()
    assert not (tmp_path / "t" / "summary.json").exists()


@pytest.mark.slow  # one rank, ~4 s
def test_an_early_stopping_metric_the_task_does_not_give_ends_the_run_at_the_first_pass(tmp_path: Path) -> None:
    config = tiny_run(tmp_path, train={"eval_every_n_steps": 2, "early_stopping": {"metric": "val/f1"}})
    ((kind, message),) = spawn_ranks(run_worker_returns, 1, config)
    assert kind == "UserError"
    assert message == (
        "train.early_stopping.metric 'val/f1' is not one of this run's validation metrics (val/accuracy, val/loss)"
    )


def test_another_runs_stop_does_not_end_this_run_but_its_callback_states_load(tmp_path: Path) -> None:
    from torch import nn

    from tests.helpers.user_callbacks import Recorder
    from trainforge.checkpoint.state import State
    from trainforge.worker.callbacks import CallbackContext, Callbacks
    from trainforge.worker.components.base import Restore

    cfg = load_config(tiny_run(tmp_path, callbacks=[f"{HELPERS}:Recorder"]), env={})
    recorder = Recorder(str(tmp_path / "calls"))
    callbacks = Callbacks([(f"0:{HELPERS}:Recorder", recorder)], CallbackContext(0, 1, nn.Linear(1, 1), cfg))
    saved = State(
        {"states": {f"0:{HELPERS}:Recorder": {"steps": 5, "loss_total": 1.5}}, "stop": {"reason": "r", "step": 5}}
    )
    callbacks.load_state_dict(saved, Restore(5, 1, "ddp", {"run": {"name": "another"}}, True))
    assert callbacks.stop is None and (recorder.steps, recorder.loss_total) == (5, 1.5)
    callbacks.load_state_dict(saved, Restore(5, 1, "ddp", {"run": {"name": cfg.run.name}}, True))
    assert callbacks.stop is not None and (callbacks.stop.reason, callbacks.stop.step) == ("r", 5)


def test_a_run_that_ends_on_a_validation_step_validates_that_step_once(tmp_path: Path, monkeypatch: Any) -> None:
    """The loop's pass at the last step stands as the final one (no weights moved since); without
    it, or when local SGD's last sync moves the weights, finish() validates."""
    from tests.helpers.sessions import ListChannel
    from trainforge.config import Config
    from trainforge.worker import loop
    from trainforge.worker.build import build
    from trainforge.worker.saving import Checkpointing, restore

    passes: list[int] = []
    real = loop.evaluate

    def counted(run: Any) -> dict[str, float]:
        passes.append(session.progress.global_step)
        return real(run)

    monkeypatch.setattr(loop, "evaluate", counted)
    for every, expected in ((4, [4, 8]), (3, [3, 6, 8])):
        passes.clear()
        cfg_dict = tiny_run(
            tmp_path / str(every),
            train={"max_steps": 8, "batch_size": 8, "log_every_n_steps": 4, "eval_every_n_steps": every},
        )
        cfg = Config.model_validate(cfg_dict)
        run = build(cfg, ranks=(0, 1))
        checkpointing = Checkpointing(run, CheckpointStore.for_run(cfg.storage_path, cfg.run.name))
        try:
            session = loop.Session(run, checkpointing, restore(run, checkpointing.store), channel=ListChannel())
            final = session.train()
        finally:
            checkpointing.close()
        assert passes == expected
        assert "val/loss" in final.figures  # the final report carries the last pass's metrics
