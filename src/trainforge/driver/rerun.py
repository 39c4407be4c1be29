"""Running a run directory again: the same config continues the run; a changed one is refused in
one line naming the changed keys, unless the user says to continue (``--resume auto``, ``fit(...,
resume="auto")``), in which case the change is recorded in the run's metrics.jsonl.

Which keys count is config/changes.py's. Only a run with checkpoints is guarded: without one the
run starts over, and nothing of the old one survives to be mixed with the new.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from trainforge.config import Config
from trainforge.config.changes import Change, config_changes, describe
from trainforge.config.loading import read_yaml
from trainforge.errors import ConfigError

log = logging.getLogger("trainforge")

CONFIG_FILE = "config.yaml"  # the resolved config of the run's last start (driver/run.py writes it)
CONFIG_CHANGED = "config_changed"  # metrics.jsonl's ``event`` when a run continues with a changed config


def check_rerun(config: Config, *, resume: bool) -> list[Change]:
    """The changes between the run directory's recorded config and ``config`` that continuing the
    run would take on; raises ConfigError (exit 2) when there are some and ``resume`` is not set.

    Nothing is written here: the CLI asks before Ray starts, and the driver again under the run lock."""
    recorded = config.run_dir / CONFIG_FILE
    if not recorded.is_file():
        return []
    try:
        changes = config_changes(read_yaml(recorded), config)
    except ConfigError as err:  # a record this version cannot read does not block the run
        log.warning("could not compare with %s: %s", recorded, err)
        return []
    if not changes or not has_checkpoints(config):
        return []
    if not resume:
        raise ConfigError(
            f"{shown_run_dir(config)} was trained with a different config: {describe(changes)}; "
            'pass --resume auto (trainforge.fit: resume="auto") to continue it with the new values, '
            "or choose another run.name"
        )
    return changes


def record_changes(run_dir: Path, changes: list[Change]) -> None:
    """One ``config_changed`` line in the run's metrics.jsonl (beside its reports), and a warning."""
    if not changes:
        return
    text = f"continuing with a changed config: {describe(changes)}"
    record = {
        "event": CONFIG_CHANGED,
        "time": time.time(),
        "changes": {change.key: change.to_json() for change in changes},
        "text": text,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps(record, default=str) + "\n")
    log.warning("%s: %s", run_dir.name, text)


def has_checkpoints(config: Config) -> bool:
    """Whether the run has a checkpoint to continue from; True when its storage cannot be listed
    from here (the refusal then errs on the side of the old run)."""
    from trainforge.checkpoint.storage import CheckpointStore  # pyarrow: only when a config changed

    try:
        return bool(CheckpointStore.for_run(config.storage_path, config.run.name).entries())
    except OSError as err:
        log.debug("could not list the run's checkpoints: %s", err)
        return True


def shown_run_dir(config: Config) -> str:
    """The run directory as the user's config spells it (``runs/x``)."""
    return str(Path(config.run.output_dir) / config.run.name)
