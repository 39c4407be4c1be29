"""``tracking.register_model: NAME``: the run's final model as an MLflow model, registered as a new
version of NAME in MLflow's model registry, tagged with the run's final metrics.

What is logged, and why:

* A zoo model (a transformers model inside trainforge's ``HFLogits``: gpt2_*, bert_*, llama_*,
  resnet*): the transformers folder ``save_pretrained`` writes (config.json, safetensors) with a
  pyfunc "model from code" (``pyfunc_logits.py``, copied into the model). Loading needs MLflow,
  torch and transformers, not trainforge, and unpickles nothing; ``predict`` takes ids or
  features and gives the logits. Not ``mlflow.transformers``: its pyfunc is a pipeline, which
  needs a tokenizer or image processor (trainforge's are its own, or bytes) and text in, text
  out. Not ``mlflow.pytorch`` of the transformers module: its pyfunc refuses a ModelOutput.
* Any other model (mlp, cnn, a user's factory): ``mlflow.pytorch`` in its pt2 format, the graph
  ``torch.export`` traces with the weights (loading needs MLflow and torch); a model that cannot
  be traced (data-dependent control flow) is pickled instead, by reference to its class, so
  loading it needs trainforge (or the user's factory) importable.

The model is rebuilt and filled on the driver at the end of the run, from the resolved config and
``<run dir>/model.safetensors`` (``models.export.final_model``; a LoRA run's adapters merged): the
workers are gone by then, and building the data section gives the shapes, as ``trainforge
export`` does. Registering is one call of the tracker's
``Outbox``, after the final metrics: retried while the store is away, its outcome recorded in
summary.json's ``registered_model`` (a version, or why there is none), and with
``tracking.required`` a missing version fails the run like any other missing record.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainforge.checkpoint.format import write_json_atomic
from trainforge.data.spec import DataSpec
from trainforge.models.export import final_model, run_spec, write_hf
from trainforge.models.registry import HFLogits
from trainforge.tracking.outbox import is_transient
from trainforge.tracking.records import clean_tags
from trainforge.tracking.store import first_line

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from trainforge.config import Config

log = logging.getLogger("trainforge")

MODEL_ARTIFACT = "model"  # the run's artifact folder the MLflow model goes to
SUMMARY_KEY = "registered_model"
WEIGHTS_FILE = "model.safetensors"
PYFUNC_LOADER = Path(__file__).with_name("pyfunc_logits.py")
ZOO_FLAVOUR = "python_function (transformers)"
PT2_FLAVOUR = "pytorch (pt2)"
PICKLE_FLAVOUR = "pytorch (pickle)"
TRAIN_QUALITY = frozenset(f"train/{name}" for name in ("loss", "accuracy", "perplexity", "mse", "mae", "r2"))
PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
TOKEN_TAG = "trainforge.registration"  # one registration's id: a retry finds the version it made


class ModelRegistration:
    """One registration of one run's final model under ``name``: ``package`` on the driver's main
    thread, ``call`` on the sender thread, ``finish`` once the outbox has closed."""

    def __init__(self, name: str, config: Config, run_dir: Path, summary: Mapping[str, Any]) -> None:
        self.name = name
        self.config = config
        self.run_dir = run_dir
        self.summary = summary
        self.token = uuid.uuid4().hex
        self.record: dict[str, Any] | None = None  # summary.json's registered_model, once decided
        self._workdir: Path | None = None
        self.flavour = ""

    def package(self) -> bool:
        """Build the MLflow model in a temporary folder; False (and the reason recorded) when the
        run has no model to register or it cannot be rebuilt."""
        status = self.summary.get("status")
        weights = self.run_dir / WEIGHTS_FILE
        if status != "finished" or not weights.is_file():
            why = f"the run ended {status}" if status != "finished" else f"the run has no {WEIGHTS_FILE}"
            self.fail(f"not registered: {why}")
            return False
        self._workdir = Path(tempfile.mkdtemp(prefix=".register-", dir=self.run_dir))
        try:
            self.flavour = save_mlflow_model(self.config, weights, self._workdir / MODEL_ARTIFACT)
        except Exception as err:  # a model that cannot be rebuilt here is the run's note, not a crash
            why = f"could not build the model to register from {weights}: {first_line(err)}"
            log.warning("tracking.register_model %s: %s", self.name, why)
            self.fail(why)
            return False
        return True

    def call(self, client: MlflowClient, run_id: str) -> None:
        """Log the model folder to the run and make (or, on a retry, find) the version."""
        assert self._workdir is not None
        try:
            version = self._find(client, run_id) or self._create(client, run_id)
        except Exception as err:
            if not is_transient(err):  # not retried: say why in summary.json before it is uploaded
                self.fail(f"MLflow refused the registration: {first_line(err)}")
            raise
        self.record = {
            "name": self.name,
            "version": int(version),
            "uri": f"models:/{self.name}/{version}",
            "flavour": self.flavour,
            "run_id": run_id,
            "step": self.step,
        }
        self._write_summary()

    def finish(self) -> dict[str, Any]:
        """After the outbox closed: the record (a note when the call never got through); the
        temporary model folder removed."""
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self.record is None:
            self.fail("not registered: MLflow did not answer before tracking.flush_timeout_s")
        assert self.record is not None
        return self.record

    @property
    def expected(self) -> bool:
        """A finished run registers its model; a failed or stopped one has nothing to register."""
        return self.summary.get("status") == "finished"

    @property
    def registered(self) -> bool:
        return bool(self.record and self.record.get("version"))

    @property
    def step(self) -> int:
        weights_step = self.summary.get("model_weights_step")
        return int(weights_step if weights_step is not None else self.summary.get("global_step", 0))

    def fail(self, why: str) -> None:
        self.record = {"name": self.name, "version": None, "error": why}
        self._write_summary()

    # ---- MLflow calls (sender thread) -----------------------------------------------------

    def _find(self, client: MlflowClient, run_id: str) -> str | None:
        """The version an earlier attempt of this registration made (its answer lost on the way)."""
        for found in client.search_model_versions(f"run_id='{run_id}'"):
            if found.name == self.name and found.tags.get(TOKEN_TAG) == self.token:
                return str(found.version)
        return None

    def _create(self, client: MlflowClient, run_id: str) -> str:
        from mlflow.exceptions import MlflowException

        assert self._workdir is not None
        client.log_artifacts(run_id, str(self._workdir / MODEL_ARTIFACT), MODEL_ARTIFACT)
        source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{MODEL_ARTIFACT}"
        try:
            client.create_registered_model(self.name, description=self._model_description())
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            if not client.get_registered_model(self.name).description:
                client.update_registered_model(self.name, description=self._model_description())
        created = client.create_model_version(
            self.name,
            source,
            run_id=run_id,
            tags=version_tags(self.summary, self.run_dir, self.step, self.flavour, self.token),
            description=self._version_description(),
        )
        return str(created.version)

    def _model_description(self) -> str:
        model = self.config.model.name or self.config.model.factory
        how = (
            "needs only MLflow, torch and transformers"
            if self.flavour == ZOO_FLAVOUR
            else "needs only MLflow and torch"
            if self.flavour == PT2_FLAVOUR
            else "needs trainforge (and a model.factory's code) importable"
        )
        return (
            f"{model} trained by trainforge on {self.config.data.name} (tracking.register_model). Each version "
            f"is one run's final weights, tagged with its final metrics (metric.*). Version N loads with "
            f"mlflow.pyfunc.load_model('models:/{self.name}/N'); its predict(array) gives the logits; loading {how}."
        )

    def _version_description(self) -> str:
        figures = ", ".join(f"{k} {v:.4g}" for k, v in final_numbers(self.summary).items())
        return f"run {self.config.run.name}, step {self.step}" + (f": {figures}" if figures else "")

    def _write_summary(self) -> None:
        path = self.run_dir / "summary.json"
        try:
            content = json.loads(path.read_text())
            content[SUMMARY_KEY] = self.record
            write_json_atomic(path, content)
        except (OSError, ValueError) as err:
            log.warning("could not record the registered model in %s: %s", path, err)


def final_numbers(summary: Mapping[str, Any]) -> dict[str, float]:
    """The final figures that say how good the model is: every validation figure (``val/*``,
    ``val_ema/*``) and training's loss and quality; the rest (lr, speeds, times) is on the run."""
    final = summary.get("final_metrics") or {}
    return {
        key: float(value)
        for key, value in final.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (key.startswith("val") or key in TRAIN_QUALITY)
    }


def version_tags(summary: Mapping[str, Any], run_dir: Path, step: int, flavour: str, token: str) -> dict[str, str]:
    """The version's record of where it came from and how good it was (``metric.<name>``)."""
    tags = {
        "trainforge.run_dir": str(run_dir),
        "trainforge.step": str(step),
        "trainforge.flavour": flavour,
        TOKEN_TAG: token,
        **{f"metric.{key}": repr(value) for key, value in final_numbers(summary).items()},
    }
    return clean_tags(tags)


# ---- the MLflow model (driver's main thread) ---------------------------------------------------


def save_mlflow_model(config: Config, weights: Path, dest: Path) -> str:
    """The run's model with its final weights, written as an MLflow model folder; its flavour."""
    os.environ.setdefault(PROGRESS_BAR_ENV, "false")  # MLflow's bars would cut into the console's last lines
    spec = run_spec(config)  # the shapes: the model's and the signature's
    model = final_model(config, weights, spec).eval()  # a LoRA run's: its base with the adapters merged
    example, signature = model_signature(model, spec)
    with warnings.catch_warnings():  # MLflow's advice on type hints and input examples, for the console
        warnings.simplefilter("ignore")
        if isinstance(model, HFLogits):
            save_zoo_model(model, dest, signature)
            return ZOO_FLAVOUR
        return save_torch_model(model, dest, example, signature)


def save_zoo_model(model: HFLogits, dest: Path, signature: Any) -> None:
    """The transformers folder and the pyfunc loader that reads it (no trainforge code in it)."""
    import mlflow.pyfunc
    from transformers.utils import logging as hf_logging

    hf_folder = dest.parent / "transformers"
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        write_hf(model.model, hf_folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    mlflow.pyfunc.save_model(
        str(dest),
        python_model=str(PYFUNC_LOADER),
        artifacts={"transformers": str(hf_folder)},
        signature=signature,
        pip_requirements=requirements("transformers", "numpy"),
    )


def save_torch_model(model: nn.Module, dest: Path, example: torch.Tensor | None, signature: Any) -> str:
    """``mlflow.pytorch``: the graph ``torch.export`` traces (pt2: torch alone loads it, nothing is
    unpickled), or where the model cannot be traced, the pickled module (loading imports its class:
    trainforge's, or the model.factory's)."""
    import mlflow.pytorch

    if example is not None and signature is not None:
        try:
            mlflow.pytorch.save_model(
                model,
                str(dest),
                signature=signature,
                input_example=example.numpy(),
                serialization_format="pt2",
                pip_requirements=requirements(),
            )
            return PT2_FLAVOUR
        except Exception as err:  # data-dependent control flow and the like: the pickled module instead
            log.info("torch.export could not trace the model to register (%s); pickling it", first_line(err))
            shutil.rmtree(dest, ignore_errors=True)
    mlflow.pytorch.save_model(
        model,
        str(dest),
        signature=signature,
        serialization_format="pickle",
        pip_requirements=requirements("trainforge"),
    )
    return PICKLE_FLAVOUR


def model_signature(model: nn.Module, spec: DataSpec) -> tuple[torch.Tensor | None, Any]:
    """An example input (zeros, a batch of 2) and the tensor shapes in and out, from one forward
    pass on it: any batch, and for token ids any length. None for data of a custom shape, or a
    forward that does not take one array."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    if spec.kind == "tokens":
        example = torch.zeros((2, min(spec.seq_len or 8, 8)), dtype=torch.int64)
    elif spec.kind == "image":
        example = torch.zeros((2, *spec.input_shape), dtype=torch.float32)
    else:
        return None, None
    try:
        with torch.no_grad():
            out = model(example)
    except Exception as err:  # the model is registered without a schema
        log.debug("no signature for the registered model: %s", err)
        return None, None
    if not isinstance(out, torch.Tensor):
        return None, None
    loose = 2 if spec.kind == "tokens" else 1  # dimensions that vary: the batch, and a sequence's length
    shape_in = (-1,) * loose + tuple(example.shape[loose:])
    shape_out = (-1,) * min(loose, out.dim()) + tuple(out.shape[loose:])
    signature = ModelSignature(
        inputs=Schema([TensorSpec(example.numpy().dtype, shape_in)]),
        outputs=Schema([TensorSpec(out.numpy().dtype, shape_out)]),
    )
    return example, signature


def requirements(*packages: str) -> list[str]:
    """pip lines for ``torch`` and ``packages`` as installed (a local version tag such as
    ``+cpu`` left out: pip finds no such release); MLflow adds itself."""
    lines = []
    for package in ("torch", *packages):
        try:
            version = importlib.metadata.version(package).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            lines.append(package)
            continue
        lines.append(f"{package}=={version}")
    return lines
