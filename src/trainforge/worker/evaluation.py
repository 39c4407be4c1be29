"""``trainforge evaluate RUN_DIR``: a checkpoint's model evaluated on a split of the run's data, in
this process, as the run's workers evaluated it.

The checkpoint (``last``: the newest that verifies; ``best``: the best by the run's early-stopping
metric, else the lowest ``val/loss``, its manifest records; or a checkpoint's path) is verified
and loaded through the one restore path into the run's components, built on this process's CPU
as data-parallel rank 0 of the run's workers, with no process group. The split is read as those
workers read it: every rank's share in that rank's micro-batches, one share after another, their
sums added as the all-reduce adds them; so ``val`` gives what the run reported at that step, up to
float rounding (and to the precision of the run's device, when it trained on a GPU). Map-style
data only: a source that Ray Data streams is read by a run's workers, not here.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from trainforge.checkpoint.crypto import FileCipher, cipher_of
from trainforge.checkpoint.problems import KEY, OUTDATED, KeyProblem, OutdatedCheckpoint, ProblemKind
from trainforge.checkpoint.saved import read_saved
from trainforge.checkpoint.schema import MANIFEST
from trainforge.checkpoint.storage import CheckpointStore, join_uri
from trainforge.config import Config, checkpoint_run_config, load_config
from trainforge.data import build_test_set, source_of
from trainforge.errors import CheckpointError, ConfigError, DataError
from trainforge.worker.build import build, evaluate
from trainforge.worker.registry import state_schemas
from trainforge.worker.saving import load_into

log = logging.getLogger("trainforge.evaluate")

SPLITS = ("val", "test")
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
BEST_METRIC, BEST_MODE = "val/loss", "min"  # ``best`` without early stopping


@dataclass(frozen=True)
class Evaluation:
    """What ``trainforge evaluate`` found: the checkpoint, its step, the split and the task's metrics
    (``<split>/<name>``, and ``<split>_ema/<name>`` under ``train.ema``); ``reported``: the run's
    own validation figures at that step (its metrics.jsonl), when it holds them."""

    run_dir: Path
    checkpoint: str
    step: int
    split: str
    samples: int
    metrics: dict[str, float]
    reported: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """``--output``'s contract: run, checkpoint, step, split, samples, metrics, reported."""
        return {
            "run": str(self.run_dir),
            "checkpoint": self.checkpoint,
            "step": self.step,
            "split": self.split,
            "samples": self.samples,
            "metrics": self.metrics,
            "reported": self.reported,
        }


def evaluate_run(
    run_dir: Path,
    which: str = "last",
    split: str = "val",
    *,
    trust_run_config: bool = False,
    cipher: FileCipher | None = None,
) -> Evaluation:
    """The metrics of the checkpoint ``which`` names (last, best or a path) on ``split`` (val or
    test) of the run at ``run_dir``. The run's config (the checkpoint's record of it, else
    config.yaml) is data: one that names code to import needs ``trust_run_config``. ``cipher``:
    the key of encrypted checkpoints (default: the one config.yaml's checkpoint.encryption names)."""
    if split not in SPLITS:
        raise ConfigError(f"--split {split!r}: one of {', '.join(SPLITS)}")
    config_path = run_dir / CONFIG_FILE
    # Where the checkpoints are and their key; nothing it names is imported.
    listed = load_config(config_path) if config_path.is_file() else None
    if cipher is None and listed is not None:
        cipher = cipher_of(listed.checkpoint.encryption)
    store, name = choose_checkpoint(run_dir, listed, which, cipher)
    with (
        tempfile.TemporaryDirectory(prefix="trainforge-evaluate-") as scratch,
        store.opened(store.fetch(name, Path(scratch))) as directory,  # decrypted when encrypted
    ):
        saved = read_saved(directory, state_schemas())
        known = config_path if listed is not None else None
        config = checkpoint_run_config(saved.config, store.uri(name), run_dir, known, trust=trust_run_config)
        local = in_this_process(config)
        if source_of(local.data).streamed:
            raise DataError(
                f"data.name {local.data.name} is streamed by Ray Data to a run's workers; evaluate reads "
                "map-style data sets in this process"
            )
        # The run's data-parallel ranks: their shares and micro-batches are what this process reads.
        ranks = max(saved.world // max(saved.tensor_parallel, 1), 1)
        run = build(local, ranks=(0, ranks))
        with warnings.catch_warnings():  # DCP's note that it reads the shards in one process: it is meant to
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load_into(run, directory)
        dataset = run.val_set if split == "val" else build_test_set(local.data, local.seed)
        if dataset is None:
            raise DataError("this run has no validation set (data.val_fraction is 0): nothing to evaluate")
        metrics = evaluate(run, split, lambda: [run.data.shard_batches(dataset, rank) for rank in range(ranks)])
    reported = validations(run_dir).get(saved.step, {}) if split == "val" else {}
    return Evaluation(run_dir, store.uri(name), saved.step, split, len(dataset), metrics, reported)


def in_this_process(config: Config) -> Config:
    """The run's config as one CPU process evaluates it: no GPU, no tensor parallelism (its
    checkpoint's shards are read whole), no compiled blocks, no loader processes, and no
    callbacks (no hook of theirs fires in an evaluation)."""
    scaling = config.scaling.model_copy(update={"use_gpu": False})
    parallel = config.parallel.model_copy(update={"tensor_parallel": 1, "compile": False})
    data = config.data.model_copy(update={"num_workers": 0})
    train = config.train.model_copy(update={"sync_batchnorm": False})
    changed = {"scaling": scaling, "parallel": parallel, "data": data, "train": train, "callbacks": []}
    return config.model_copy(update=changed)


def choose_checkpoint(
    run_dir: Path, listed: Config | None, which: str, cipher: FileCipher | None
) -> tuple[CheckpointStore, str]:
    """The store and name of the checkpoint ``which`` names, verified; a one-line CheckpointError
    (of the problem's kind) when it is not valid or there is none."""
    schemas = state_schemas()
    if which not in ("last", "best"):
        path = Path(which).expanduser()
        if not (path / MANIFEST).is_file():
            raise CheckpointError(
                f"--checkpoint {which}: not a checkpoint directory (no {MANIFEST}); last, best or a path"
            )
        store, name = CheckpointStore.for_checkpoint(str(path), cipher)
        check = store.verify(name, schemas=schemas)
        if not check.ok:
            refuse(f"--checkpoint {which} is not valid: {check.problems[0]}", check.kinds)
        return store, name
    store = run_store(run_dir, listed, cipher)
    entries = store.entries()
    if not entries:
        raise CheckpointError(
            f"RUN_DIR {run_dir}: no checkpoint to evaluate (the run saved none, or they were removed)"
        )
    metric, mode = best_by(listed)
    # A checkpoint's manifest holds the last validation before it was saved, which may have been
    # of earlier weights: where metrics.jsonl says which passes ran at a checkpoint's own step,
    # only those count.
    passes = validations(run_dir)
    scored: list[tuple[float, str]] = []
    refused: list[tuple[str, str, set[ProblemKind]]] = []
    for entry in reversed(entries):  # newest first
        check = store.verify(entry.name, schemas=schemas)
        if not check.ok:
            refused.append((entry.name, check.problems[0], set(check.kinds)))
            continue
        if which == "last":
            return store, skipping(entry.name, refused)
        recorded = passes.get(entry.step, {}) if passes else (check.manifest or {}).get("metrics") or {}
        value = recorded.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            scored.append((float(value), entry.name))
    if which == "best" and scored:
        sign = 1.0 if mode == "min" else -1.0
        # The earliest of equals: the step that first reached the best value.
        return store, skipping(min(reversed(scored), key=lambda pair: sign * pair[0])[1], refused)
    if which == "best" and len(refused) < len(entries):
        raise CheckpointError(
            f"--checkpoint best: no valid checkpoint of {run_dir} has a validation ({metric}) of its step; "
            "use last or a path"
        )
    name, problem, kinds = refused[0]
    refuse(f"RUN_DIR {run_dir}: none of its {len(entries)} checkpoints is valid ({name}: {problem})", kinds)


def skipping(chosen: str, refused: list[tuple[str, str, set[ProblemKind]]]) -> str:
    """``chosen``, once each checkpoint passed over for not being valid is logged."""
    for name, problem, _ in refused:
        log.warning("skipping checkpoint %s: %s", name, problem)
    return chosen


def refuse(text: str, kinds: set[ProblemKind]) -> NoReturn:
    """Raise the CheckpointError of the problem's kind: a missing key or an earlier format says so."""
    if KEY in kinds:
        raise KeyProblem(text)
    if OUTDATED in kinds:
        raise OutdatedCheckpoint(f"{text} (trainforge ckpt upgrade PATH converts it)")
    raise CheckpointError(text)


def run_store(run_dir: Path, listed: Config | None, cipher: FileCipher | None) -> CheckpointStore:
    """The run's checkpoints: in the run directory, or where its config stored them."""
    store = CheckpointStore.from_uri(str(run_dir), cipher)
    if store.entries() or listed is None or not listed.checkpoint.storage_path:
        return store
    return CheckpointStore.from_uri(join_uri(listed.checkpoint.storage_path, listed.run.name), cipher)


def best_by(config: Config | None) -> tuple[str, str]:
    """The metric and mode that make a checkpoint the best: early stopping's, else val/loss, lowest."""
    stopping = config.train.early_stopping if config is not None else None
    if stopping is None:
        return BEST_METRIC, BEST_MODE
    return stopping.metric, stopping.mode


def validations(run_dir: Path) -> dict[int, dict[str, float]]:
    """The validation figures the run reported, by the step each pass ran at (the points of the
    reports' histories in metrics.jsonl); empty without the file. It is not trusted: nothing here
    raises, and what is not a number is left out."""
    path = run_dir / METRICS_FILE
    found: dict[int, dict[str, float]] = {}
    try:
        lines = path.read_text().splitlines() if path.is_file() else []
    except (OSError, UnicodeDecodeError):
        return found
    for line in lines:
        try:
            report = json.loads(line)
        except ValueError:
            continue
        history = report.get("history") if isinstance(report, dict) else None
        for point in history if isinstance(history, list) else []:
            step = point.get("step") if isinstance(point, dict) else None
            if not isinstance(step, int):
                continue
            for key, value in point.items():
                if key.startswith("val") and "/" in key and isinstance(value, (int, float)):
                    found.setdefault(step, {})[key] = float(value)
    return found
