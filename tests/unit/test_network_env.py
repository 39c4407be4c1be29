"""``scaling.env`` and ``scaling.network_profile`` (#25): validated names and values, the profile's
NCCL variables under the user's, both in the workers' runtime environment, secrets masked in the
records, and each worker's line saying what it got."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from trainforge.config import load_config
from trainforge.config.network import NETWORK_PROFILES
from trainforge.errors import ConfigError
from trainforge.redact import redact_config

BASE: dict[str, Any] = {"model": {"name": "mlp"}, "train": {"max_steps": 1}}


def config(**scaling: Any) -> Any:
    return load_config({**BASE, "scaling": scaling})


def test_the_profile_fills_nccl_variables_and_scaling_env_wins() -> None:
    chosen = config(network_profile="ethernet", env={"NCCL_SOCKET_NTHREADS": 2, "NCCL_DEBUG": "INFO", "ON": True})
    assert chosen.scaling.worker_env == {
        **NETWORK_PROFILES["ethernet"],
        "NCCL_SOCKET_NTHREADS": "2",
        "NCCL_DEBUG": "INFO",
        "ON": "1",
    }
    assert config().scaling.worker_env == {}
    for profile, variables in NETWORK_PROFILES.items():
        assert config(network_profile=profile).scaling.worker_env == variables
        assert all(name.startswith("NCCL_") for name in variables)  # interface names are never guessed


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [
        ({"env": {"RAY_ADDRESS": "x"}}, "scaling.env: RAY_ADDRESS is set by Ray or trainforge"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "scaling.env: CUDA_VISIBLE_DEVICES is set by Ray or trainforge"),
        ({"env": {"PYTHONPATH": "/x"}}, "scaling.env: PYTHONPATH is set by Ray or trainforge"),
        ({"env": {"9LIVES": "x"}}, "scaling.env: 9LIVES is not an environment variable name"),
        ({"env": {"A-B": "x"}}, "scaling.env: A-B is not an environment variable name"),
        ({"env": {"A": [1]}}, "scaling.env: A: a string or a number, not list"),
        ({"env": {"A": "x\0y"}}, "scaling.env: A: at most 4096 characters and no NUL"),
        ({"env": "NCCL_DEBUG=INFO"}, "scaling.env = 'NCCL_DEBUG=INFO': Input should be a valid dictionary"),
        ({"network_profile": "wifi"}, "scaling.network_profile = 'wifi': Input should be 'nvlink'"),
    ],
)
def test_bad_names_and_values_are_one_line(scaling: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(**scaling)
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value), str(caught.value)


def test_the_workers_runtime_environment_carries_them_over_the_nodes_own() -> None:
    from trainforge.driver.run import build_trainer

    chosen = config(network_profile="infiniband", env={"NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "eth1"})
    trainer = build_trainer(chosen, mailbox=None)
    env_vars = trainer.run_config.worker_runtime_env["env_vars"]
    assert env_vars["NCCL_IB_DISABLE"] == "1" and env_vars["GLOO_SOCKET_IFNAME"] == "eth1"
    assert env_vars["NCCL_NET_GDR_LEVEL"] == "PHB" and env_vars["OMP_NUM_THREADS"] == "1"


def test_secret_values_are_masked_in_records_and_in_the_workers_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from trainforge.worker.loop import log_environment

    chosen = config(env={"HF_TOKEN": "hf_secret", "WANDB_API_KEY": "wandb_secret", "NCCL_DEBUG": "WARN"})
    dumped = str(redact_config(chosen.to_dict()))
    assert "hf_secret" not in dumped and "wandb_secret" not in dumped and "'NCCL_DEBUG': 'WARN'" in dumped
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # a node that overrides the config shows as such
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with caplog.at_level(logging.INFO, logger="trainforge.worker"):
        log_environment(chosen, 1)
    [line] = [r.getMessage() for r in caplog.records if "worker environment" in r.getMessage()]
    # An unset secret-named variable says so, or *** where the one masking rule (trainforge.redact,
    # on every handler once the driver installed it) reads "NAME=(unset)" as a value: neither leaks.
    assert line.startswith("rank 1 on ") and "HF_TOKEN=*** NCCL_DEBUG=INFO WANDB_API_KEY=" in line
    assert line.endswith(("WANDB_API_KEY=(unset)", "WANDB_API_KEY=***"))
