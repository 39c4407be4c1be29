"""Small run configs for tests."""

from __future__ import annotations

from pathlib import Path


def tiny_run(tmp_path: Path, **sections: dict) -> dict:
    """A small, fast run config (digits, mlp) with sections overridden."""
    config: dict = {
        "run": {"name": "t", "output_dir": str(tmp_path)},
        "model": {"name": "mlp"},
        "data": {"name": "digits"},
        "train": {"max_steps": 20, "batch_size": 16, "log_every_n_steps": 5, "report_min_interval_s": 0},
        "optim": {"name": "sgd", "lr": 0.05},
        "scaling": {"num_workers": 1},
        "failure": {"max_failures": 0},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    return config
