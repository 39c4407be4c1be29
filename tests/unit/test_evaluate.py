"""``trainforge evaluate``: a checkpoint's metrics on a split of the run's data, in this process.

A 2-rank gloo run without Ray (the validation set of 300 split 150/150 over the ranks, in
micro-batches of 16, all-reduced; ``train.ema`` adds ``val_ema/...``; early stopping names the
best; a user's callback with state) is evaluated in one process:
its final and its step-10 checkpoints give the figures the run reported for them, and its data
factory's held-out ``test`` split the figures its model gives when computed directly. Then the
refusals: one line and exit code 2 each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Outcome, run_dir_of, train
from tests.helpers.user_callbacks import records
from tests.helpers.user_data import NumpyDigits
from trainforge.cli import main
from trainforge.config import load_config, to_yaml
from trainforge.data import build_datasets, build_test_set
from trainforge.errors import DataError
from trainforge.models import build_model

REL = 1e-6  # the run's all-reduce adds the ranks' float64 sums in another order


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Outcome]:
    tmp = tmp_path_factory.mktemp("evaluate")
    config = tiny_run(
        tmp,
        data={"name": "factory", "factory": "tests.helpers.user_data:digits_with_test"},
        train={
            "max_steps": 20,
            "batch_size": 16,
            "eval_every_n_steps": 10,
            "ema": {"decay": 0.9},
            "early_stopping": {"metric": "val_ema/accuracy", "mode": "max", "patience": 10},
        },
        checkpoint={"every_n_steps": 10},
        scaling={"num_workers": 2},
        callbacks=[{"path": "tests.helpers.user_callbacks:Recorder", "kwargs": {"log": str(tmp / "hooks")}}],
    )
    outcome = train(config, 2)[0]
    # The resolved config beside the checkpoints, as the driver writes it.
    (run_dir_of(config) / "config.yaml").write_text(to_yaml(load_config(config)))
    return config, outcome


def evaluate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``trainforge evaluate ARGS`` in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    code = 0
    try:
        main(["evaluate", *args])
    except SystemExit as exited:
        code = int(exited.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def evaluated(capsys: pytest.CaptureFixture[str], output: Path, *args: str) -> dict[str, Any]:
    code, out, err = evaluate(capsys, *args, "--trust-run-config", "--output", str(output))
    assert code == 0, err
    found: dict[str, Any] = json.loads(output.read_text())
    assert f"step {found['step']}" in out and all(name in out for name in found["metrics"])
    return found


def assert_same(found: dict[str, float], reported: dict[str, Any], prefixes: tuple[str, ...]) -> None:
    expected = {k: float(v) for k, v in reported.items() if k.startswith(prefixes)}
    assert set(found) == set(expected)
    for name, value in expected.items():
        assert found[name] == pytest.approx(value, rel=REL), name


@pytest.mark.slow
def test_val_gives_the_metrics_the_run_reported_for_each_checkpoint(
    trained: tuple[dict[str, Any], Outcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, outcome = trained
    run_dir = run_dir_of(config)
    hooks = records(Path(config["callbacks"][0]["kwargs"]["log"]), 0)
    last = evaluated(capsys, tmp_path / "last.json", str(run_dir))
    assert last.keys() == {"run", "checkpoint", "step", "split", "samples", "metrics", "reported"}
    assert (last["step"], last["split"], last["samples"]) == (20, "val", 300)
    assert last["checkpoint"].endswith("checkpoint_000000020")
    assert_same(last["metrics"], outcome.final, ("val/", "val_ema/"))
    assert {"val/loss", "val/accuracy", "val_ema/loss", "val_ema/accuracy"} <= last["metrics"].keys()

    # Step 10 validated and then saved: its manifest records that pass.
    path = run_dir / "checkpoint_000000010"
    earlier = evaluated(capsys, tmp_path / "earlier.json", str(run_dir), "--checkpoint", str(path))
    recorded = json.loads((path / "manifest.json").read_text())["metrics"]
    assert earlier["step"] == 10
    assert_same(earlier["metrics"], recorded, ("val/", "val_ema/"))
    assert earlier["metrics"]["val/loss"] != last["metrics"]["val/loss"]

    # best: by train.early_stopping's metric and mode, the earlier of equals.
    best = evaluated(capsys, tmp_path / "best.json", str(run_dir), "--checkpoint", "best")
    higher = max((earlier, last), key=lambda found: found["metrics"]["val_ema/accuracy"])
    assert best["step"] == higher["step"] and best["metrics"] == higher["metrics"]
    # The run's callbacks are left out: none of their hooks runs in an evaluation.
    assert records(Path(config["callbacks"][0]["kwargs"]["log"]), 0) == hooks


@pytest.mark.slow
def test_the_factorys_test_split_is_evaluated(
    trained: tuple[dict[str, Any], Outcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = trained
    run_dir = run_dir_of(config)
    found = evaluated(capsys, tmp_path / "test.json", str(run_dir), "--split", "test")
    assert (found["split"], found["samples"], found["reported"]) == ("test", 297, {})
    assert found["metrics"].keys() == {"test/loss", "test/accuracy", "test_ema/loss", "test_ema/accuracy"}
    # The same figures from the checkpoint's weights, computed here over the 297 held-out digits.
    resolved = load_config(config)
    model = build_model(resolved.model, build_datasets(resolved.data, resolved.seed)[2])
    model.load_state_dict(load_file(str(run_dir / "checkpoint_000000020" / "model.safetensors")))
    model.eval()
    held_out = NumpyDigits(slice(1500, None))
    inputs = torch.as_tensor(held_out.images)
    targets = torch.as_tensor(held_out.labels)
    with torch.no_grad():
        logits = model(inputs)
    assert found["metrics"]["test/accuracy"] == pytest.approx((logits.argmax(1) == targets).float().mean().item())
    assert found["metrics"]["test/loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-5)


@pytest.mark.slow
def test_refusals_and_the_newest_valid_checkpoint(
    trained: tuple[dict[str, Any], Outcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = trained
    run_dir = tmp_path / "copy"
    shutil.copytree(run_dir_of(config), run_dir)
    # A run whose config names code to import is data until the user vouches for it.
    code, _, err = evaluate(capsys, str(run_dir))
    assert code == 2 and "--trust-run-config" in err and err.count("\n") == 1
    # A corrupt newest checkpoint: named, refused; as last, skipped for the one before.
    weights = run_dir / "checkpoint_000000020" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, _, err = evaluate(capsys, str(run_dir), "--checkpoint", str(weights.parent), "--trust-run-config")
    assert code == 2 and "is not valid" in err and err.count("\n") == 1
    found = evaluated(capsys, tmp_path / "last.json", str(run_dir))
    assert found["step"] == 10


@pytest.mark.slow
def test_best_and_reported_come_from_the_passes_at_each_checkpoints_step(
    trained: tuple[dict[str, Any], Outcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A driver's run has metrics.jsonl: a checkpoint is scored by the pass at its own step (its
    manifest may hold an earlier pass), and that pass is shown beside the computed figures."""
    config, _ = trained
    run_dir = tmp_path / "copy"
    shutil.copytree(run_dir_of(config), run_dir)
    points = [{"step": 10, "val_ema/accuracy": 0.99, "val/loss": 0.5}, {"step": 15, "train/loss": 1.0}]
    lines = [{"step": 15, "history": points}, {"step": 20, "history": [{"step": 20, "train/loss": 0.9}]}, "junk"]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n{not json\n")
    best = evaluated(capsys, tmp_path / "best.json", str(run_dir), "--checkpoint", "best")
    assert best["step"] == 10  # step 20 has no pass at its step in this file
    assert best["reported"] == {"val_ema/accuracy": 0.99, "val/loss": 0.5}
    assert evaluated(capsys, tmp_path / "last.json", str(run_dir))["reported"] == {}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["{missing}"], "no such directory"),
        (["{run}", "--split", "train"], "--split 'train': one of val, test"),
        (["{run}", "--checkpoint", "{missing}"], "not a checkpoint directory"),
        (["{run}"], "no checkpoint to evaluate"),
        (["{run}", "--output", "{missing}/out.json"], "does not exist"),
        (["{run}", "--key-env", "NO SUCH"], "--key-env 'NO SUCH': the name of an environment variable"),
        (["{run}", "--key-env", "TRAINFORGE_TEST_UNSET_KEY"], "the environment variable is not set"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    args: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    names = {"run": str(run_dir), "missing": str(tmp_path / "absent")}
    code, out, err = evaluate(capsys, *(arg.format(**names) for arg in args))
    assert code == 2 and expected in err and err.startswith("error:") and err.count("\n") == 1, err
    assert out == ""


def test_test_splits_of_the_sources(tmp_path: Path) -> None:
    """Synthetic data holds out the samples after the validation ones; digits' fixed split and a
    factory without ``test`` have none and say so."""
    synthetic = load_config(tiny_run(tmp_path, data={"name": "synthetic", "kind": "regression", "input_shape": [3]}))
    _, val, _ = build_datasets(synthetic.data, synthetic.seed)
    test = build_test_set(synthetic.data, synthetic.seed)
    assert val is not None and len(test) == len(val) == 205
    assert not any(torch.equal(test[i][0], val[j][0]) for i in range(3) for j in range(len(val)))
    with pytest.raises(DataError, match=r"data\.name digits has no test split"):
        build_test_set(load_config(tiny_run(tmp_path)).data, 0)
    bare = load_config(tiny_run(tmp_path, data={"name": "factory", "factory": "tests.helpers.user_data:digits"}))
    with pytest.raises(DataError, match="returned no test set: return UserData"):
        build_test_set(bare.data, 0)
    given = load_config(
        tiny_run(tmp_path, data={"name": "factory", "factory": "tests.helpers.user_data:digits_with_test"})
    )
    assert len(build_test_set(given.data, 0)) == 297


def test_help_tells_evaluate_from_predict(capsys: pytest.CaptureFixture[str]) -> None:
    """``evaluate`` measures a model on data; ``predict`` predicts a run's speed: the listing says which."""
    main(["--help"])
    listing = " ".join(capsys.readouterr().out.split())
    assert "evaluate Evaluate a run's model" in listing
    assert "predict Predict how fast" in listing
