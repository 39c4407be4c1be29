"""A run directory is data, not code (#26): ``generate`` and ``export`` read a config that whoever
trained the run wrote, and a config that names code to import (``model.factory: os:system``) ran
it. Now such a config is refused in one line, before anything is imported, unless the user vouches
for it with ``--trust-run-config``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import checkpoints
from tests.unit.test_checkpoint import small_model, trained
from tests.unit.test_data_sections import cli
from trainforge.checkpoint.format import write_json_hashed, write_manifest
from trainforge.checkpoint.schema import MANIFEST, STATE_FILE
from trainforge.checkpoint.storage import checkpoint_name
from trainforge.config import code_keys, load_config, load_run_config
from trainforge.errors import ConfigError


def hostile_config(marker: Path) -> dict[str, Any]:
    """A run's config whose model factory runs a shell command that leaves ``marker``."""
    return {
        "model": {"factory": "os:system", "kwargs": {"command": f"touch {marker}"}},
        "data": {"name": "synthetic"},
        "train": {"max_steps": 1},
    }


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"model": {"factory": "os:system"}}, "model.factory"),
        ({"data": {"name": "factory", "factory": "subprocess:run"}}, "data.factory"),
        (
            {"parallel": {"tensor_parallel": 2, "tp_plan": "builtins:exec"}, "scaling": {"num_workers": 2}},
            "parallel.tp_plan",
        ),
        ({"optim": {"factory": "os:system"}}, "optim.factory"),
        ({"callbacks": ["os:system"]}, "callbacks[0]"),
    ],
)
def test_a_run_config_that_names_code_is_refused_unless_trusted(section: dict[str, Any], key: str) -> None:
    raw = {"model": {"name": "mlp"}, "data": {"name": "synthetic"}, "train": {"max_steps": 1}, **section}
    with pytest.raises(ConfigError) as caught:
        load_run_config(raw, "RUN_DIR r: config.yaml", trust=False)
    message = str(caught.value)
    assert message.startswith(f"RUN_DIR r: config.yaml names code to import ({key}: ")
    assert "--trust-run-config" in message and "\n" not in message
    assert [k for k, _ in code_keys(load_run_config(raw, "r", trust=True))] == [key]


def test_a_run_config_of_built_ins_needs_no_trust() -> None:
    config = load_run_config(
        {"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"max_steps": 1}}, "r", trust=False
    )
    assert code_keys(config) == []


def test_generate_refuses_a_run_directory_whose_config_names_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, marker = tmp_path / "downloaded", tmp_path / "ran"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(hostile_config(marker)))
    (run_dir / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    code, _, err = cli(capsys, "generate", str(run_dir), "--prompt", "x")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "names code to import (model.factory: os:system)" in err and "--trust-run-config" in err, err
    assert not marker.exists()  # nothing was imported or called
    # Vouched for: past the check, to the next one (this run trained no token corpus).
    code, _, err = cli(capsys, "generate", str(run_dir), "--prompt", "x", "--trust-run-config")
    assert code == 2 and "generate needs a run trained on data.name tokens" in err, err


def test_export_refuses_a_checkpoint_whose_recorded_config_names_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The checkpoint's own record of the config (what export prefers), the run's config.yaml benign.
    run_dir, marker = tmp_path / "run", tmp_path / "ran"
    directory = run_dir / checkpoint_name(4)
    model = small_model()
    manifest = checkpoints.write_checkpoint(directory, model, trained(model), 4)
    state = json.loads((directory / STATE_FILE).read_text())
    state["config"] = load_config(hostile_config(marker)).to_dict()
    write_json_hashed(directory / STATE_FILE, state)
    write_manifest(directory, {k: v for k, v in manifest.items() if k not in ("files", "format_version", "hash")})
    assert (directory / MANIFEST).is_file()
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump({"model": {"name": "mlp"}, "data": {"name": "synthetic"}, "train": {"max_steps": 1}})
    )
    output = tmp_path / "out"
    code, _, err = cli(capsys, "export", str(run_dir), "--format", "safetensors", "--output", str(output))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"checkpoint {directory} names code to import (model.factory: os:system)" in err, err
    assert not marker.exists() and not output.exists()
