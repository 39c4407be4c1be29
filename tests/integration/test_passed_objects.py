"""``trainforge.fit(config, model=Net(), data=...)`` with ``Net`` and the data set defined in a
script's ``__main__``: a real process that starts its own local Ray and trains on 2 gloo workers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers.timing import scaled
from trainforge.config.factories import PASSED_DATA, PASSED_MODEL

SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    import torch
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import Dataset

    import trainforge
    from trainforge.data import UserData


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU())
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(self.body(x))


    class Digits(Dataset):
        def __init__(self, images, labels):
            self.images = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
            self.labels = torch.tensor(labels)

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, index):
            return self.images[index], self.labels[index]


    if __name__ == "__main__":
        images, labels = load_digits(return_X_y=True)
        net = Net()
        with torch.no_grad():  # logits of zeros: the first loss is ln(10) only if the workers train these weights
            net.head.weight.zero_()
            net.head.bias.zero_()
        config = {
            "run": {"name": "objects", "output_dir": sys.argv[1]},
            "train": {"max_steps": 40, "batch_size": 32, "log_every_n_steps": 1, "report_min_interval_s": 0},
            "optim": {"name": "adamw", "lr": 0.01},
            "scaling": {"num_workers": 2},
            "failure": {"max_failures": 0},
        }
        data = UserData(
            train=Digits(images[:1400], labels[:1400]), val=Digits(images[1400:], labels[1400:]), num_classes=10
        )
        result = trainforge.fit(config, model=net, data=data)
        print(json.dumps({"status": result.status, "run_dir": str(result.run_dir)}))
    """
)


@pytest.mark.slow  # a process of its own: Ray's start, 2 workers, 40 steps (about 45 s on 2 cores)
def test_a_model_defined_in_main_trains_on_2_workers(tmp_path: Path) -> None:
    script = tmp_path / "train_net.py"
    script.write_text(SCRIPT)
    elsewhere = tmp_path / "cwd"  # neither the script's folder nor the repository: nothing to import Net from
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "runs")],
        cwd=elsewhere,
        env={**env, "TERM": "dumb"},
        capture_output=True,
        text=True,
        timeout=scaled(240),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "finished"
    run_dir = Path(result["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 40 and summary["num_workers"] == 2
    losses = [
        record["train/loss"]
        for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in record
    ]
    assert losses[0] == pytest.approx(math.log(10), abs=1e-5)  # the instance's own weights, on both ranks
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]
    assert summary["final_metrics"]["val/accuracy"] > 0.5  # chance: 0.1
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert recorded["model"]["factory"] == PASSED_MODEL and recorded["data"]["factory"] == PASSED_DATA
