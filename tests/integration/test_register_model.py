"""``tracking.register_model``: real finished runs (the worker Session in a gloo rank, no Ray) handed
to the driver's MLflow tracker as a run ends; real MLflow (the local sqlite store) holds versions 1
and 2, tagged with the runs' metrics; a fresh Python process loads ``models:/NAME/2`` through MLflow
alone and predicts the logits trainforge's module gives. An unreachable store is a note in
summary.json, and an error only with ``tracking.required``. The Ray path is test_mlflow.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import save_file

from tests.helpers.faults import free_port
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Trained, final_weights, train_each_once
from tests.helpers.timing import scaled
from trainforge.cli import main
from trainforge.config import load_config, to_yaml
from trainforge.models.export import run_model
from trainforge.models.pretrained import load_pretrained
from trainforge.observers.mlflow import make_tracker
from trainforge.protocol import RunInfo
from trainforge.tracking import TrackingError
from trainforge.tracking.runs import RESUME_FILE

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
TOKENS = {"name": "synthetic", "kind": "tokens", "seq_len": 16, "vocab_size": 40, "num_samples": 96}


def lm_run(tmp: Path, name: str, steps: int, **tracking: Any) -> dict[str, Any]:
    return tiny_run(
        tmp,
        run={"name": name, "output_dir": str(tmp)},
        model={"name": "llama_tiny", "kwargs": LLAMA},
        data=TOKENS,
        train={"max_steps": steps, "batch_size": 8, "eval_every_n_steps": steps},
        optim={"name": "adamw", "lr": 3e-3},
        checkpoint={"every_n_steps": steps},
        tracking={"register_model": "tiny-llama", **tracking},
    )


def end_run(config_dict: dict[str, Any], final: dict[str, Any], *, weights: bool = True) -> tuple[dict[str, Any], Any]:
    """What the driver does as a run ends: model.safetensors and summary.json in the run directory,
    then the tracker's on_start ... on_end; summary.json as it is afterwards, and the tracker."""
    config = load_config(config_dict)
    run_dir = config.run_dir
    (run_dir / "config.yaml").write_text(to_yaml(config))
    if weights:
        save_file(final_weights(config_dict), str(run_dir / "model.safetensors"))
    step = config.train.max_steps
    numbers = {k: v for k, v in final.items() if isinstance(v, float) and "/" in k}
    summary = {"status": "finished", "global_step": step, "model_weights_step": step, "final_metrics": numbers}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    tracker = make_tracker(config, run_dir)
    assert tracker is not None
    tracker.on_start(RunInfo(config.run.name, 1, "local", str(run_dir)))
    tracker.on_end(summary)
    return json.loads((run_dir / "summary.json").read_text()), tracker


def copy_run(trained: Trained, root: Path, **tracking: Any) -> dict[str, Any]:
    """The config of a copy of ``trained``'s run directory under ``root``, tracking settings changed."""
    shutil.copytree(trained.run_dir, root / trained.run_dir.name)
    (root / trained.run_dir.name / RESUME_FILE).unlink()  # a new MLflow run, not the original's continued
    config = trained.config
    return {
        **config,
        "run": {**config["run"], "output_dir": str(root)},
        "tracking": {**config["tracking"], **tracking},
    }


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("register")
    mlp = tiny_run(tmp, run={"name": "mlp", "output_dir": str(tmp)}, tracking={"register_model": "tiny-mlp"})
    trained = train_each_once({"first": lm_run(tmp, "first", 6), "second": lm_run(tmp, "second", 12), "mlp": mlp})
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        ended = {name: end_run(run.config, run.outcome.final) for name, run in trained.items()}  # in this order
    return {"tmp": tmp, "trained": trained, "ended": ended, "store": f"sqlite:///{tmp.resolve()}/mlflow.db"}


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
def test_two_runs_register_versions_1_and_2_tagged_with_their_metrics(registered: dict[str, Any]) -> None:
    client = MlflowClient(registered["store"])
    for name, version in (("first", 1), ("second", 2)):
        summary, _ = registered["ended"][name]
        trained: Trained = registered["trained"][name]
        run_id = json.loads((trained.run_dir / RESUME_FILE).read_text())["run_id"]
        record = summary["registered_model"]
        assert record == {
            "name": "tiny-llama",
            "version": version,
            "uri": f"models:/tiny-llama/{version}",
            "flavour": "python_function (transformers)",
            "run_id": run_id,
            "step": summary["global_step"],
        }
        found = client.get_model_version("tiny-llama", str(version))
        assert found.run_id == run_id and found.source.endswith("/model")
        assert found.tags["trainforge.step"] == str(summary["global_step"])
        assert float(found.tags["metric.val/loss"]) == summary["final_metrics"]["val/loss"]
        assert float(found.tags["metric.train/loss"]) == summary["final_metrics"]["train/loss"]
        assert not [tag for tag in found.tags if tag.startswith(("metric.perf/", "metric.time/", "metric.train/lr"))]
        assert f"step {summary['global_step']}: " in found.description and "val/loss" in found.description
        assert "model/MLmodel" in {a.path for a in client.list_artifacts(run_id, "model")}
        # the summary.json MLflow holds is the one with the record
        uploaded = Path(client.download_artifacts(run_id, "summary.json", str(trained.run_dir / "down")))
        assert json.loads(uploaded.read_text())["registered_model"]["version"] == version
    model = client.get_registered_model("tiny-llama")
    assert "llama_tiny trained by trainforge" in model.description and "models:/tiny-llama/" in model.description
    assert sorted(int(v.version) for v in client.search_model_versions("name='tiny-llama'")) == [1, 2]
    mlp_record = registered["ended"]["mlp"][0]["registered_model"]
    assert mlp_record["version"] == 1 and mlp_record["flavour"] == "pytorch (pt2)"


LOAD = """
import sys, numpy as np, mlflow.pyfunc
llama = mlflow.pyfunc.load_model("models:/tiny-llama/2")
np.save(sys.argv[1] + "/llama.npy", llama.predict(np.load(sys.argv[1] + "/ids.npy")))
mlp = mlflow.pyfunc.load_model("models:/tiny-mlp/1")
np.save(sys.argv[1] + "/mlp.npy", mlp.predict(np.load(sys.argv[1] + "/pixels.npy")))
print("trainforge imported:", any(m.split(".")[0] == "trainforge" for m in sys.modules))
"""


def trainforge_logits(trained: Trained, inputs: torch.Tensor) -> np.ndarray:
    model = run_model(load_config(trained.config))
    load_pretrained(model, str(trained.run_dir / "model.safetensors"))
    with torch.no_grad():
        return model.eval()(inputs).numpy()


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
def test_a_fresh_process_loads_the_registered_models_through_mlflow_and_predicts_the_same_logits(
    registered: dict[str, Any], tmp_path: Path
) -> None:
    ids = torch.randint(0, 40, (3, 16), generator=torch.Generator().manual_seed(0))
    pixels = torch.rand((4, 1, 8, 8), generator=torch.Generator().manual_seed(1))
    np.save(tmp_path / "ids.npy", ids.numpy())
    np.save(tmp_path / "pixels.npy", pixels.numpy())
    env = {**os.environ, "MLFLOW_TRACKING_URI": registered["store"]}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(tmp_path)], env=env, capture_output=True, text=True, timeout=scaled(300)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainforge imported: False" in done.stdout  # neither model needs trainforge's code
    trained = registered["trained"]
    np.testing.assert_allclose(np.load(tmp_path / "llama.npy"), trainforge_logits(trained["second"], ids), atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "mlp.npy"), trainforge_logits(trained["mlp"], pixels), atol=1e-5)


def test_an_unreachable_registry_is_a_note_in_summary_json_and_the_run_stands(
    registered: dict[str, Any], tmp_path: Path
) -> None:
    trained: Trained = registered["trained"]["first"]
    away = copy_run(trained, tmp_path, uri=f"http://127.0.0.1:{free_port()}", flush_timeout_s=2)
    summary, tracker = end_run(away, trained.outcome.final)
    record = summary["registered_model"]
    assert record["name"] == "tiny-llama" and record["version"] is None and "did not answer" in record["error"]
    tracker.check_complete()  # tracking.required is false: the run stands


def test_with_tracking_required_a_run_without_a_registered_version_fails(
    registered: dict[str, Any], tmp_path: Path
) -> None:
    trained: Trained = registered["trained"]["first"]
    strict = copy_run(trained, tmp_path, uri=registered["store"], required=True)
    (tmp_path / trained.run_dir.name / "model.safetensors").unlink()  # the final weights could not be copied
    summary, tracker = end_run(strict, trained.outcome.final, weights=False)
    assert summary["registered_model"]["error"] == "not registered: the run has no model.safetensors"
    with pytest.raises(TrackingError, match=r"tracking.required is set .* a version of model tiny-llama"):
        tracker.check_complete()


@pytest.mark.parametrize(
    ("name", "says"),
    [("a/b", "may not contain '/'"), ("team:model", "may not contain '/', ':'"), ("..up", "start with '..'")],
)
def test_a_name_mlflow_would_refuse_is_one_line_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, says: str
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(tiny_run(tmp_path)))
    with pytest.raises(SystemExit) as exited:
        main(["train", str(config), "--set", f"tracking.register_model={name}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: tracking.register_model = '{name}'") and says in err and "\n" not in err
