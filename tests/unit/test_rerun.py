"""Re-running a run directory: which config changes count, the one-line refusal, the record of a
continued run's changes (config/changes.py, driver/rerun.py). In one process, no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainforge.config import load_config, to_yaml
from trainforge.config.changes import UNSET, config_changes, counts, describe
from trainforge.driver.rerun import CONFIG_CHANGED, check_rerun, record_changes
from trainforge.errors import ConfigError
from trainforge.report.data import load_run

ROOT = Path(__file__).resolve().parents[2]


def base(tmp_path: Path, **sections: dict) -> dict:
    raw = {
        "run": {"name": "x", "output_dir": str(tmp_path / "runs")},
        "model": {"name": "mlp"},
        "data": {"name": "digits"},
        "train": {"epochs": 3, "batch_size": 16},
        "optim": {"name": "adamw", "lr": 0.01},
        "scaling": {"num_workers": 2},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def trained(tmp_path: Path, *, checkpoint: bool = True, **sections: dict) -> Path:
    """A run directory as a run leaves it: config.yaml, and a checkpoint in its store."""
    config = load_config(base(tmp_path, **sections))
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "config.yaml").write_text(to_yaml(config))
    if checkpoint:
        (config.run_dir / "checkpoint_000000010").mkdir()
    return config.run_dir


def test_changed_training_keys_are_named_with_both_values(tmp_path: Path) -> None:
    old = load_config(base(tmp_path)).to_dict()
    new = load_config(base(tmp_path, optim={"lr": 0.02}, train={"epochs": 5}))
    changes = config_changes(old, new)
    assert [change.text for change in changes] == ["train.epochs 3 -> 5", "optim.lr 0.01 -> 0.02"]
    assert describe(changes) == "train.epochs 3 -> 5, optim.lr 0.01 -> 0.02"


def test_operational_keys_do_not_count_but_the_ones_that_change_arithmetic_do(tmp_path: Path) -> None:
    old = load_config(base(tmp_path)).to_dict()
    operational = {
        "scaling": {"num_workers": 4},  # an elastic resume
        "checkpoint": {"every_n_steps": 7, "keep_last": 5},
        "tracking": {"enabled": False},
        "failure": {"max_failures": 0},
        "train": {"log_every_n_steps": 3},
        "parallel": {"strategy": "fsdp"},  # a resume reshards
    }
    assert config_changes(old, load_config(base(tmp_path, **operational))) == []
    compressed = load_config(base(tmp_path, parallel={"grad_compression": "fp16"}))
    assert [c.key for c in config_changes(old, compressed)] == ["parallel.grad_compression"]
    assert counts("train.epochs") and counts("model.kwargs.width") and not counts("scaling.num_workers")


def test_a_section_that_appears_is_one_change_and_absent_keys_say_unset(tmp_path: Path) -> None:
    old = load_config(base(tmp_path)).to_dict()
    new = load_config(base(tmp_path, model={"kwargs": {"hidden_sizes": [8]}}, train={"ema": {"decay": 0.9}}))
    changes = {change.key: change for change in config_changes(old, new)}
    assert changes["model.kwargs.hidden_sizes"].old is UNSET
    assert changes["model.kwargs.hidden_sizes"].text == "model.kwargs.hidden_sizes (unset) -> [8]"
    assert changes["train.ema"].old is None and changes["train.ema"].new["decay"] == 0.9
    assert changes["model.kwargs.hidden_sizes"].to_json() == {"new": [8]}


def test_a_record_of_keys_the_schema_no_longer_has_still_compares(tmp_path: Path) -> None:
    old = load_config(base(tmp_path)).to_dict()
    old["train"]["retired_key"] = 1
    changes = config_changes(old, load_config(base(tmp_path)))
    assert [change.text for change in changes] == ["train.retired_key 1 -> (unset)"]


def test_many_changes_are_counted_past_the_first_six(tmp_path: Path) -> None:
    old = load_config(base(tmp_path)).to_dict()
    new = load_config(base(tmp_path, model={"kwargs": {f"k{i}": i for i in range(9)}}))
    assert describe(config_changes(old, new)).endswith("model.kwargs.k5 (unset) -> 5 and 3 more keys")


def test_a_changed_rerun_is_refused_naming_the_keys_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = trained(tmp_path)
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    changed = load_config(base(tmp_path, optim={"lr": 0.02}, train={"epochs": 5}))
    with pytest.raises(ConfigError) as refused:
        check_rerun(changed, resume=False)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'runs' / 'x'} was trained with a different config: ")
    assert "train.epochs 3 -> 5, optim.lr 0.01 -> 0.02" in message and "--resume auto" in message
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")} == before


def test_the_same_config_or_only_operational_changes_pass(tmp_path: Path) -> None:
    trained(tmp_path)
    assert check_rerun(load_config(base(tmp_path)), resume=False) == []
    assert check_rerun(load_config(base(tmp_path, scaling={"num_workers": 1})), resume=False) == []


def test_a_run_without_checkpoints_starts_over_unasked(tmp_path: Path) -> None:
    trained(tmp_path, checkpoint=False)
    assert check_rerun(load_config(base(tmp_path, optim={"lr": 0.5})), resume=False) == []


def test_resume_continues_and_the_changes_are_recorded_in_metrics_jsonl(tmp_path: Path) -> None:
    run_dir = trained(tmp_path)
    changes = check_rerun(load_config(base(tmp_path, optim={"lr": 0.02})), resume=True)
    record_changes(run_dir, changes)
    (line,) = (run_dir / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["event"] == CONFIG_CHANGED
    assert record["changes"] == {"optim.lr": {"old": 0.01, "new": 0.02}}
    assert "optim.lr 0.01 -> 0.02" in record["text"]
    # The report's event list says it in words.
    assert [row.text for row in load_run(run_dir).events] == [f"{CONFIG_CHANGED}: {record['text']}"]


def test_secrets_compare_masked_as_config_yaml_holds_them(tmp_path: Path) -> None:
    uri = "s3://key:secret@host/bucket"
    trained(tmp_path, tracking={"uri": uri}, model={"kwargs": {"api_token": "abc"}})
    recorded = yaml.safe_load((tmp_path / "runs" / "x" / "config.yaml").read_text())
    assert recorded["model"]["kwargs"]["api_token"] != "abc"  # masked on disk
    same = load_config(base(tmp_path, tracking={"uri": uri}, model={"kwargs": {"api_token": "abc"}}))
    assert check_rerun(same, resume=False) == []


def test_fit_refuses_a_changed_rerun_under_the_run_lock_before_ray(tmp_path: Path) -> None:
    import ray

    import trainforge

    run_dir = trained(tmp_path)
    changed = base(tmp_path, optim={"lr": 0.02}, tracking={"enabled": False}, metrics={"enabled": False})
    with pytest.raises(ConfigError, match=r"optim\.lr 0\.01 -> 0\.02"):
        trainforge.fit(changed)
    assert not ray.is_initialized()
    assert sorted(path.name for path in run_dir.iterdir()) == [".lock", "checkpoint_000000010", "config.yaml"]


def test_the_cli_refuses_a_changed_rerun_before_ray_with_exit_2(tmp_path: Path) -> None:
    run_dir = trained(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(base(tmp_path, optim={"lr": 0.02})))
    env = {**os.environ, "RAY_ADDRESS": ""}
    done = subprocess.run(
        [sys.executable, "-m", "trainforge", "train", str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "optim.lr 0.01 -> 0.02" in done.stderr and "Traceback" not in done.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "ray.log").exists()
