"""``failure.straggler``: the scores and the window rule in one process, then two gloo ranks
without Ray whose rank 1 runs its forwards five times slower (tests/helpers/slow_rank.py): it is
named with its node, its score is in the report's figures, and under ``action: restart`` every
rank raises at the same report; ``action: exclude``'s rules (an elastic run, a node that leaves
enough ranks), and its record in summary.json."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import ListChannel, train
from trainforge.config import load_config
from trainforge.config.schema import StragglerConfig
from trainforge.driver.summary import Recovery
from trainforge.errors import ConfigError
from trainforge.protocol import Note, Report, Straggler, event_from_json, event_to_json
from trainforge.worker.straggler import StragglerRestart, StragglerWatch, node_scores, scores

SLOW = "tests.helpers.slow_rank:slow_rank_net"


def test_a_score_is_the_ranks_own_time_over_the_median_of_the_others() -> None:
    assert scores([1.0, 1.0, 3.0]) == [0.5, 0.5, 3.0]  # the others of a typical rank hold the slow one
    assert scores([0.1, 0.4]) == pytest.approx([0.25, 4.0])
    assert scores([0.0, 0.0]) == [1.0, 1.0]  # nothing measured: no rank stands out
    assert scores([0.3]) == [1.0]
    own = [0.5, 0.1, 0.9, 0.1, 0.4, 0.7]
    by_definition = [v / statistics.median(own[:r] + own[r + 1 :]) for r, v in enumerate(own)]
    assert scores(own) == pytest.approx(by_definition)
    assert node_scores([1.0, 3.0, 0.5], ["a", "b", "b"]) == {"a": 1.0, "b": 3.0}


def watch(threshold: float = 1.5, window_steps: int = 10, world: int = 3) -> StragglerWatch:
    found = StragglerWatch(StragglerConfig(threshold=threshold, window_steps=window_steps), world)
    found.nodes = ["10.0.0.1", "10.0.0.1", "10.0.0.2"]  # what the first report's gather gives
    found.pids = [101, 102, 103]
    return found


def test_a_rank_is_named_once_after_window_steps_above_the_threshold() -> None:
    rule = watch()
    slow = [1.0, 1.0, 2.0]
    assert rule.observe(slow, 5) == []  # 5 of 10 steps
    assert rule.observe(slow, 5) == [2]  # 10 consecutive steps above 1.5
    assert rule.observe(slow, 5) == []  # named once while it stays slow
    event = rule.event(2, 15)
    assert (event.rank, event.node, event.score, event.steps) == (2, "10.0.0.2", 2.0, 15)
    assert event.pid == 103 and "rank 2 (node 10.0.0.2, pid 103) is a straggler" in event.text
    assert rule.observe([1.0, 1.0, 1.0], 5) == []  # recovered
    assert rule.observe(slow, 10) == [2]  # slow again: named again


def test_a_report_under_the_threshold_starts_the_count_again() -> None:
    rule = watch()
    assert rule.observe([1.0, 1.0, 2.0], 9) == []
    assert rule.observe([1.0, 1.0, 1.4], 5) == []
    assert rule.observe([1.0, 1.0, 2.0], 9) == []
    assert rule.observe([1.0, 1.0, 2.0], 1) == [2]


def test_without_a_rule_the_scores_are_kept_and_nobody_is_named() -> None:
    rule = StragglerWatch(None, 2)
    rule.nodes = ["a", "b"]
    assert rule.observe([1.0, 5.0], 100) == []
    assert rule.figures()["straggler/rank1/score"] == 5.0
    assert rule.figures()["straggler/node/b/score"] == 5.0
    assert rule.figures()["straggler/max_score"] == 5.0
    assert StragglerWatch(None, 1).figures() == {}  # one rank: no others to compare with


def test_the_event_survives_metrics_jsonl() -> None:
    event = Straggler(40, 1, "10.0.0.2", 2.5, 0.05, 30, 1.5, "restart", pid=4242)
    assert event_from_json(event_to_json(event)) == event
    assert event.text.endswith("restarting the worker group")


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("threshold", 1.0, "failure.straggler.threshold"),
        ("threshold", "fast", "failure.straggler.threshold"),
        ("window_steps", 0, "failure.straggler.window_steps"),
        ("action", "kill", "failure.straggler.action"),
        ("action", "exclude", "failure.straggler.action exclude needs an elastic scaling.num_workers [min, max]"),
        ("patience", 3, "failure.straggler.patience"),
    ],
)
def test_every_key_is_checked_in_one_line_naming_it(tmp_path: Path, key: str, value: Any, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tiny_run(tmp_path, failure={"straggler": {key: value}}), env={})
    assert said in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2


def test_exclude_is_taken_by_an_elastic_run(tmp_path: Path) -> None:
    config = tiny_run(tmp_path, scaling={"num_workers": [1, 2]}, failure={"straggler": {"action": "exclude"}})
    loaded = load_config(config, env={})
    assert loaded.failure.straggler is not None and loaded.failure.straggler.action == "exclude"
    assert loaded.scaling.min_workers == 1


def excluding(node_ids: list[str | None], min_workers: int = 1) -> StragglerWatch:
    found = StragglerWatch(StragglerConfig(window_steps=5, action="exclude"), len(node_ids), min_workers=min_workers)
    found.nodes = ["10.0.0.1"] * len(node_ids)  # nodes on one host share an address: Ray's id tells them apart
    found.pids = list(range(100, 100 + len(node_ids)))
    found.node_ids = node_ids
    return found


def test_exclude_names_the_node_by_its_ray_id_where_the_other_nodes_hold_enough_ranks() -> None:
    rule = excluding(["node-a", "node-a", "node-b"])
    assert rule.observe([2.0, 1.0, 1.0], 5) == [0]
    said = rule.events([0], 5)
    assert len(said) == 1 and isinstance(said[0], Straggler)
    assert (said[0].action, said[0].node_id) == ("exclude", "node-a")
    assert "excluding its node (Ray node node-a)" in said[0].text
    assert event_from_json(event_to_json(said[0])) == said[0]


@pytest.mark.parametrize(
    ("node_ids", "min_workers", "why"),
    [
        (["node-a", "node-a"], 1, "every rank runs on it"),
        ([None, None], 1, "its Ray node is not known"),
        (["node-a", "node-a", "node-b"], 2, "the other nodes run 1 rank(s), fewer than scaling.num_workers' minimum 2"),
    ],
)
def test_a_node_that_cannot_be_excluded_is_reported_with_the_reason(
    node_ids: list[str | None], min_workers: int, why: str
) -> None:
    rule = excluding(node_ids, min_workers)
    assert rule.observe([2.0] + [1.0] * (len(node_ids) - 1), 5) == [0]
    event, note = rule.events([0], 5)
    assert isinstance(event, Straggler) and event.action == "report"
    assert isinstance(note, Note) and why in note.text and "rank 0's node 10.0.0.1 is not excluded" in note.text
    rule.act([event, note], 0, checkpoint=lambda: pytest.fail("a report saves nothing"))  # and raises nothing


def test_two_stragglers_named_at_once_leave_the_run_its_minimum() -> None:
    rule = excluding(["node-a", "node-b", "node-c"], min_workers=2)
    said = rule.events([0, 1], 5)  # each alone could go; both would leave 1 rank of the minimum 2
    assert [(e.rank, e.action) for e in said if isinstance(e, Straggler)] == [(0, "exclude"), (1, "report")]
    assert [e.text for e in said if isinstance(e, Note)] == [
        "step 5: rank 1's node 10.0.0.1 is not excluded: the other nodes run 1 rank(s), "
        "fewer than scaling.num_workers' minimum 2"
    ]


def test_restart_raises_without_a_checkpoint_of_its_own() -> None:
    rule = watch()
    rule.rule = StragglerConfig(window_steps=10, action="restart")
    rule.observe([1.0, 1.0, 2.0], 10)
    with pytest.raises(StragglerRestart, match="restarting the worker group"):
        rule.act(rule.events([2], 10), 0, checkpoint=lambda: pytest.fail("restart resumes from the newest checkpoint"))


def test_summary_records_the_excluded_nodes() -> None:
    recovery = Recovery()
    excluded = Straggler(30, 1, "10.0.0.1", 3.0, 0.2, 20, 1.5, "exclude", pid=7, node_id="node-b")
    reported = Straggler(60, 0, "10.0.0.1", 2.0, 0.2, 20, 1.5, "report", pid=8, node_id="node-a")
    recovery.reported(Report(step=30, events=(excluded,)))
    recovery.reported(Report(step=60, events=(reported,)))
    assert recovery.excluded_nodes == [{"node_id": "node-b", "node": "10.0.0.1", "rank": 1, "step": 30, "score": 3.0}]


def slow_config(tmp: Path, action: str) -> dict[str, Any]:
    config = tiny_run(
        tmp,
        train={"max_steps": 40, "batch_size": 8, "log_every_n_steps": 5},
        scaling={"num_workers": 2},
        failure={"max_failures": 0, "straggler": {"threshold": 1.5, "window_steps": 10, "action": action}},
    )
    config["model"] = {"factory": SLOW, "kwargs": {"delay_s": 0.005, "factor": 6.0}}
    return config


def test_two_ranks_name_the_slow_one_with_its_node(tmp_path: Path) -> None:
    outcomes = train(slow_config(tmp_path, "report"), 2)
    rank0 = outcomes[0]
    named = [text for text in rank0.events if "is a straggler" in text]
    assert len(named) == 1 and "rank 1 (node " in named[0], rank0.events
    figures = rank0.final
    assert figures["straggler/rank1/score"] > 1.5 > figures["straggler/rank0/score"]
    assert figures["straggler/rank1/own_s"] > figures["straggler/rank0/own_s"]
    assert figures["straggler/max_score"] == figures["straggler/rank1/score"]
    assert rank0.final["status"] == "finished"
    assert outcomes[1].final["straggler/rank1/score"] == figures["straggler/rank1/score"]  # agreed


def _restarting(rank: int, world: int, config_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank's Session under ``action: restart``: where it raised, and what it had reported."""
    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.config import Config
    from trainforge.worker.build import build
    from trainforge.worker.loop import Session
    from trainforge.worker.saving import Checkpointing, restore

    cfg = Config.model_validate(config_dict)
    run = build(cfg, ranks=(rank, world))
    checkpointing = Checkpointing(run, CheckpointStore.for_run(cfg.storage_path, cfg.run.name))
    channel = ListChannel()
    try:
        Session(run, checkpointing, restore(run, checkpointing.store), channel=channel).train()
        raised = None
    except StragglerRestart as err:
        raised = str(err)
    finally:
        checkpointing.close()
    return {
        "raised": raised,
        "step": channel.reports[-1].step,
        "events": [event_to_json(e) for r in channel.reports for e in r.events],
    }


def test_restart_raises_on_every_rank_at_the_same_report(tmp_path: Path) -> None:
    results = spawn_ranks(_restarting, 2, slow_config(tmp_path, "restart"))
    assert all(r["raised"] and "rank 1 (node " in r["raised"] for r in results), results
    assert results[0]["step"] == results[1]["step"] < 40  # the same report, before the end
    named = [e for e in results[0]["events"] if e["kind"] == "straggler"]
    assert [(e["rank"], e["action"]) for e in named] == [(1, "restart")]  # reported before the raise


@pytest.mark.slow  # real processes start torch: out of the fast subset
def test_exclude_in_ranks_without_ray_names_the_straggler_keeps_its_node_and_finishes(tmp_path: Path) -> None:
    config = slow_config(tmp_path, "exclude")
    config["scaling"] = {"num_workers": [1, 2]}
    rank0 = train(config, 2)[0]
    named = [text for text in rank0.events if "is a straggler" in text]
    assert len(named) == 1 and "rank 1 (node " in named[0] and "excluding" not in named[0], rank0.events
    assert any("is not excluded: its Ray node is not known" in text for text in rank0.events), rank0.events
    assert rank0.final["status"] == "finished" and rank0.final["step"] == 40
