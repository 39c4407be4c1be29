"""What changed between the config a run was trained with (its ``config.yaml``) and the config it
is run with again: the keys that change what is trained, each with its recorded and its new value.

A re-run of a run directory continues that run from its checkpoints. A change of the model, the
data, the objective, the optimizer, the schedule or the length makes the result a mix of two
runs, so the driver refuses it unless told to continue (``--resume auto``; driver/rerun.py).
Keys that only say where and how the run executes or what it records (``OPERATIONAL``) may
change freely: a resume on another number of workers is elastic training, not another run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from trainforge.config.loading import validate
from trainforge.config.schema import Config
from trainforge.errors import ConfigError
from trainforge.redact import redact_config

# Sections and keys (a key covers everything under it) that leave what is trained the same: the
# run's place (run), the cluster and its resources (scaling, cluster, the parallel layout, which a
# resume reshards), records and sinks (tracking, metrics, cost, profile), the cadence of reports
# and checkpoints and how failures are handled (checkpoint, failure), a search's settings (tune)
# and the loader's processes.
OPERATIONAL: tuple[str, ...] = (
    "run",
    "scaling",
    "cluster",
    "parallel",
    "tracking",
    "metrics",
    "cost",
    "profile",
    "checkpoint",
    "failure",
    "tune",
    "train.log_every_n_steps",
    "train.report_min_interval_s",
    "train.threads_per_worker",
    "train.reuse_freed_memory",
    "train.memory_limit_gb",
    "data.num_workers",
    "data.pin_memory",
)
# Keys under an operational section that do change the arithmetic of training.
COUNTED: tuple[str, ...] = ("parallel.grad_compression", "parallel.powersgd", "parallel.sync")


class _Unset:
    """The value of a key one of the two configs does not have."""

    def __repr__(self) -> str:
        return "(unset)"


UNSET: Any = _Unset()
MAX_SHOWN = 6  # changes named in one line; the rest are counted


@dataclass(frozen=True)
class Change:
    """One key whose value differs; ``old``/``new`` is UNSET where that config lacks the key."""

    key: str
    old: Any
    new: Any

    @property
    def text(self) -> str:
        return f"{self.key} {shown(self.old)} -> {shown(self.new)}"

    def to_json(self) -> dict[str, Any]:
        """``{"old": ..., "new": ...}``, without the side that does not have the key."""
        return {side: value for side, value in (("old", self.old), ("new", self.new)) if value is not UNSET}


def config_changes(recorded: Mapping[str, Any], config: Config) -> list[Change]:
    """The keys that count whose values differ between ``recorded`` (a run's config.yaml as read)
    and ``config``, in the order of the config's keys.

    config.yaml holds the resolved config with its secrets masked: ``config`` is compared masked
    too. The record is validated first, so that keys added to the schema since it was written
    compare as their defaults; a record the schema no longer reads is compared as it stands."""
    new = redact_config(config.to_dict())
    try:
        old = redact_config(validate(recorded).to_dict())
    except ConfigError:
        old = dict(recorded)
    return [change for change in _differences(old, new, "") if counts(change.key)]


def counts(key: str) -> bool:
    """Whether a change of ``key`` changes what is trained (not OPERATIONAL, or COUNTED within it)."""
    return not _under(key, OPERATIONAL) or _under(key, COUNTED)


def describe(changes: list[Change]) -> str:
    """``optim.lr 0.01 -> 0.02, train.epochs 3 -> 5``: up to MAX_SHOWN changes, the rest counted."""
    text = ", ".join(change.text for change in changes[:MAX_SHOWN])
    rest = len(changes) - MAX_SHOWN
    return text + (f" and {rest} more key{'s' if rest > 1 else ''}" if rest > 0 else "")


def shown(value: Any) -> str:
    """A value as the config file would spell it, clipped to fit a line."""
    if value is UNSET or isinstance(value, str):
        text = repr(value) if value is UNSET else value
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)


def _differences(old: Any, new: Any, key: str) -> Iterator[Change]:
    """Walks both trees together: into mappings on both sides, else one change where they differ."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for name in [*new, *(name for name in old if name not in new)]:
            yield from _differences(old.get(name, UNSET), new.get(name, UNSET), f"{key}.{name}" if key else str(name))
    elif old != new:
        yield Change(key, old, new)
