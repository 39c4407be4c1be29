"""``trainforge export RUN_DIR``: a trained model out of trainforge, loadable without it.

``--format hf`` writes the transformers model inside a built-in (``config.json`` and
``model.safetensors``: ``transformers.AutoModel*.from_pretrained(DIR)`` loads it);
``--format safetensors`` the weights by the model's own names with the resolved ``config.yaml``
(what ``model.pretrained`` and trainforge's factory read). Both add ``trainforge_export.json``:
the checkpoint, its step, its metrics and the files' digests.

The weights come from a checkpoint that verifies: the newest (``last``), the one with the lowest
``val/loss`` its record holds (``best``), or a checkpoint directory. The output is written beside
its final place and renamed into it, so an interrupted export leaves no half a model; a folder
that is not empty is never written into.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file, save_model
from torch import nn

from trainforge.checkpoint.hashing import SHA256, hash_file
from trainforge.checkpoint.saved import read_saved
from trainforge.checkpoint.schema import MANIFEST
from trainforge.config import Config, checkpoint_run_config, load_config, to_yaml
from trainforge.data import build_datasets
from trainforge.data.spec import DataSpec
from trainforge.errors import CheckpointError, ModelError
from trainforge.files import check_output_path
from trainforge.models.hub import corpus_hf_tokenizer, require_transformers_model, write_hf
from trainforge.models.lora import ADAPTER_MARK, apply_lora, lora_target, merge
from trainforge.models.pretrained import MODEL_FILE, Source, checkpoint_source, load_pretrained, load_weights
from trainforge.models.registry import build_model

log = logging.getLogger("trainforge.export")

FORMATS = ("hf", "safetensors")
CONFIG_FILE = "config.yaml"
EXPORT_RECORD = "trainforge_export.json"
# A run's own weights that do not fit the model its config rebuilds: the data that sizes it changed.
REBUILT_HINT = "the model is rebuilt from the run's config and data: was data.path prepared again since the run?"


@dataclass(frozen=True)
class Exported:
    """Where the export went and what it holds."""

    output: Path
    format: str
    checkpoint: str
    step: int
    files: list[str]


def export_run(
    run_dir: Path,
    fmt: str,
    output: Path,
    which: str = "last",
    *,
    merge_lora: bool = False,
    trust_run_config: bool = False,
) -> Exported:
    """Export the model of the run at ``run_dir`` from checkpoint ``which`` (last, best or a path).
    The run's config (the checkpoint's record of it, else config.yaml) is data: one that names code
    to import needs ``trust_run_config``."""
    if fmt not in FORMATS:
        raise ModelError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    check_output(output)
    config_path = run_dir / CONFIG_FILE
    run_config = load_config(config_path) if config_path.is_file() else None
    checkpoint = pick_checkpoint(run_dir, run_config, which)
    source = checkpoint_source(checkpoint, f"--checkpoint {which}")
    saved = read_saved(checkpoint)
    # The checkpoint's own record of the resolved config (verified with it); config.yaml where it has none.
    known = config_path if run_config is not None else None
    config = checkpoint_run_config(saved.config, str(checkpoint), run_dir, known, trust=trust_run_config)
    lora = config.model.lora
    if merge_lora and lora is None:
        raise ModelError("--merge-lora: this run trained no LoRA adapters (model.lora is not set in its config)")
    if lora is not None and fmt == "hf" and not merge_lora:
        raise ModelError(
            "this run trained LoRA adapters: add --merge-lora to fold them into the base weights "
            "(or --format safetensors for the adapters alone)"
        )
    model = run_model(config)
    if fmt == "hf":
        require_transformers_model(model)
    tokenizer = corpus_hf_tokenizer(config) if fmt == "hf" else None  # a prepared corpus's, else None
    if lora is None:
        load_weights(model, source, key=f"checkpoint {checkpoint}", hint=REBUILT_HINT)
    else:
        model = adapted_model(model, config, source, f"checkpoint {checkpoint}", merge_lora)
    staging = output.parent / f".tmp-export-{output.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if fmt == "hf":
            write_hf(model, staging, tokenizer)
        elif lora is not None and not merge_lora:  # the adapters alone, by the adapted model's names
            adapters = {n: p.detach().contiguous() for n, p in model.named_parameters() if ADAPTER_MARK in n}
            save_file(adapters, str(staging / MODEL_FILE))
            (staging / CONFIG_FILE).write_text(to_yaml(config))
        else:
            save_model(model, str(staging / MODEL_FILE))
            (staging / CONFIG_FILE).write_text(to_yaml(config))
        files = sorted(p.name for p in staging.iterdir())
        record: dict[str, Any] = {
            "format": fmt,
            "run_dir": str(run_dir.resolve()),
            "checkpoint": str(checkpoint.resolve()),
            "step": saved.step,
            "metrics": saved.metrics,
            "model": config.model.name or config.model.factory,
            "sha256": {name: hash_file(staging / name, SHA256).digest for name in files},
        }
        (staging / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if output.exists():
            output.rmdir()  # empty (check_output): replaced by the finished export
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Exported(output, fmt, str(checkpoint), saved.step, sorted([*files, EXPORT_RECORD]))


def check_output(output: Path) -> None:
    """``--output DIR``: new, or an empty folder; never one with files in it, nor a link."""
    check_output_path(output, "--output", "folder", ModelError)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ModelError(f"--output {output}: exists and is not an empty folder (nothing is overwritten)")
    if output.parent.exists() and not output.parent.is_dir():
        raise ModelError(f"--output {output}: {output.parent} is a file, not a folder")


def pick_checkpoint(run_dir: Path, config: Config | None, which: str) -> Path:
    """The checkpoint directory ``which`` names: a path, or the run's newest / best (in the run
    directory, or where its config stored them)."""
    if which not in ("last", "best"):
        path = Path(which).expanduser()
        if not (path / MANIFEST).is_file():
            raise CheckpointError(f"--checkpoint {which}: not a checkpoint directory (no {MANIFEST})")
        return path
    found = sorted(p for p in run_dir.glob("checkpoint_*") if (p / MANIFEST).is_file())
    if not found and config is None:
        raise CheckpointError(f"RUN_DIR {run_dir}: not a trainforge run directory (no {CONFIG_FILE}, no checkpoints)")
    if not found and config and config.checkpoint.storage_path and "://" not in config.checkpoint.storage_path:
        stored = Path(config.checkpoint.storage_path).expanduser() / config.run.name
        found = sorted(p for p in stored.glob("checkpoint_*") if (p / MANIFEST).is_file())
    if not found:
        raise CheckpointError(f"RUN_DIR {run_dir}: no checkpoint to export (the run saved none, or they were removed)")
    if which == "last":
        return found[-1]
    scored = []
    for path in found:
        loss = read_saved(path).metrics.get("val/loss")
        if loss is not None:
            scored.append((float(loss), path))
    if not scored:
        raise CheckpointError(f"--checkpoint best: no checkpoint of {run_dir} recorded a val/loss; use last or a path")
    return min(scored, key=lambda pair: pair[0])[1]


def run_spec(config: Config) -> DataSpec:
    """The shapes of the run's data (read through its data section): what sizes the model."""
    return build_datasets(config.data, config.seed)[2]


def run_model(config: Config, spec: DataSpec | None = None) -> nn.Module:
    """The run's model, shaped by its data (``spec``, else read through the run's data section),
    with the weights its workers started from before any pretrained file: seeded as they seed them."""
    spec = spec if spec is not None else run_spec(config)
    torch.manual_seed(config.seed)
    return build_model(config.model, spec)


def final_model(config: Config, weights: Path, spec: DataSpec | None = None) -> nn.Module:
    """A finished run's model from its ``model.safetensors`` (``weights``): the weights loaded, or
    for a LoRA run (whose file holds the adapters) its base with the adapters merged in."""
    model = run_model(config, spec)
    source = Source(f"{weights}", (weights,))
    if config.model.lora is not None:
        return adapted_model(model, config, source, str(weights), merge_lora=True)
    load_weights(model, source, key=str(weights), hint=REBUILT_HINT)
    return model


def adapted_model(model: nn.Module, config: Config, source: Source, key: str, merge_lora: bool) -> nn.Module:
    """A LoRA run's model: the base as the workers built it (``model.pretrained``, else the
    seeded initialisation), the checkpoint's adapters, and with ``merge_lora`` the adapters folded
    into the base weights (the base model's names again)."""
    assert config.model.lora is not None
    if config.model.pretrained is not None:
        load_pretrained(model, config.model.pretrained, strict=config.model.pretrained_strict)
    apply_lora(model, config.model.lora)
    loaded = load_weights(model, source, strict=False, key=key)
    adapters = [n for n, _ in model.named_parameters() if ADAPTER_MARK in n]
    if loaded.tensors != len(adapters):
        raise CheckpointError(f"{key}: holds {loaded.tensors} tensors for the model's {len(adapters)} LoRA adapters")
    if merge_lora:
        merge(lora_target(model))
    return model


def describe(exported: Exported) -> str:
    return (
        f"exported step {exported.step} ({exported.checkpoint}) as {exported.format} to {exported.output}: "
        f"{', '.join(exported.files)}"
    )
