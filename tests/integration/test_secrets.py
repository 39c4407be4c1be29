"""Credentials reach no file and no line of output of a real run (docs/security.md, table 5).

One real ``trainforge train`` (the CLI, its own local Ray, one worker) whose checkpoints go to an
S3 server on loopback (moto) through ``s3://KEY:SECRET@bucket/prefix?endpoint_override=...``: the
workers really use that URI. Its MLflow server is ``http://alice:SECRET2@127.0.0.1:<closed port>``,
so the tracker's warnings and MLflow's retries quote it. Its model factory takes credentials as
keyword arguments (``hf_token``, ``secretKey``, ``db_pass``, ``private_key``) and refuses a masked
one. Afterwards every byte the run left behind is searched: the run directory, every object in the
bucket (checkpoints' trainer_state.json included), the CLI's stdout and stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.faults import free_port
from tests.helpers.s3 import BUCKET, S3Server
from tests.helpers.timing import scaled

pytestmark = pytest.mark.slow

SECRET = "StorageSecret0x5EC7"
SECRET2 = "TrackingSecret0x7A1F"
SECRET3 = "ModelSecret0x3B9D"
CREDENTIAL_KWARGS = ("hf_token", "secretKey", "db_pass", "private_key")
FACTORY = """
from torch import nn


def keyed_net(hf_token, secretKey, db_pass, private_key):
    if "***" in (hf_token, secretKey, db_pass, private_key):
        raise ValueError("the model factory got a masked credential")
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
"""


def test_a_real_run_writes_and_prints_no_credential(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server_env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for name, value in server_env.items():
        monkeypatch.setenv(name, value)
    server = S3Server(free_port())
    server.start()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        storage = f"s3://ACCESSKEY:{SECRET}@{BUCKET}/secrets?endpoint_override=127.0.0.1:{server.port}&scheme=http"
        tracking = f"http://alice:{SECRET2}@127.0.0.1:{free_port()}"
        overrides = {
            "run.output_dir": str(tmp_path / "runs"),
            "run.name": "leak",
            "train.max_steps": "20",
            "scaling.num_workers": "1",
            "checkpoint.every_n_steps": "10",
            "checkpoint.storage_path": storage,
            "tracking.uri": tracking,
            "tracking.flush_timeout_s": "1",
            "model.name": "null",
            "model.factory": "keyed_model:keyed_net",
            **{f"model.kwargs.{key}": f"{SECRET3}-{key}" for key in CREDENTIAL_KWARGS},
        }
        (tmp_path / "keyed_model.py").write_text(FACTORY)
        command = [sys.executable, "-m", "trainforge", "train", "quickstart"]
        for key, value in overrides.items():
            command += ["--set", f"{key}={value}"]
        # The server's endpoint and credentials are only in the URI: the run must use them there
        # (workers' saves, the driver's copy of the final weights) while writing them nowhere.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(600))
        assert done.returncode == 0, done.stderr[-3000:]

        run_dir = tmp_path / "runs" / "leak"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["global_step"] == 20
        assert summary["model_weights_step"] == 20 and (run_dir / "model.safetensors").stat().st_size > 0
        # The secret went through the whole run: Ray Train wrote the checkpoints with it.
        objects = server.keys("secrets/")
        states = [key for key in objects if key.endswith("/trainer_state.json")]
        assert states, sorted(objects)
        recorded = json.loads(server.client().get_object(Bucket=BUCKET, Key=states[-1])["Body"].read())
        assert recorded["config"]["checkpoint"]["storage_path"] == storage.replace(SECRET, "***")
        assert summary["config"]["tracking"]["uri"] == tracking.replace(SECRET2, "***")
        assert summary["config"]["model"]["kwargs"] == dict.fromkeys(CREDENTIAL_KWARGS, "***")
        assert recorded["config"]["model"]["kwargs"] == dict.fromkeys(CREDENTIAL_KWARGS, "***")

        leaks = []
        for secret in (SECRET, SECRET2, SECRET3):
            leaks += [f"stdout has {secret}"] if secret in done.stdout else []
            leaks += [f"stderr has {secret}"] if secret in done.stderr else []
            leaks += [str(p) for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
            for key in objects:
                body = server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
                leaks += [f"s3://{BUCKET}/{key}"] if secret.encode() in body else []
        written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
        assert "runs/leak/config.yaml" in written and "runs/leak/ray.log" in written, written
        assert not leaks, leaks
        # The probes were live: the console did quote the tracking URI (redacted), the report the config.
        assert "alice:***@127.0.0.1" in done.stderr, done.stderr[-3000:]
        assert "ACCESSKEY:***@" in (run_dir / "report" / "report.html").read_text()
    finally:
        server.stop()
