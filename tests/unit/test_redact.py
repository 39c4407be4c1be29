"""Credentials in URIs: masked in every record of a run, kept in the config the run uses."""

from __future__ import annotations

import logging

import pytest
import yaml

from trainforge.config import load_config, to_yaml
from trainforge.redact import MASK, RedactFilter, redact_config, redact_text, redacting
from trainforge.tracking.records import config_params

SECRET = "s3cr3tValue"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            f"s3://AKIAKEY:{SECRET}@bucket/p?endpoint_override=127.0.0.1:9000&scheme=http",
            "s3://AKIAKEY:***@bucket/p?endpoint_override=127.0.0.1:9000&scheme=http",
        ),
        (f"https://alice:{SECRET}@mlflow.example.com:5000", "https://alice:***@mlflow.example.com:5000"),
        (f"https://{SECRET}@github.com/org/repo.git", "https://***@github.com/org/repo.git"),
        (f"http://u:p@ss{SECRET}@host/x", "http://u:***@host/x"),  # an unencoded '@' in the password
        (
            f"https://b.s3.amazonaws.com/k?X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}&X-Amz-Expires=60",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60",
        ),
        (
            f"https://a.blob.core.windows.net/c?sv=2024&sig={SECRET}",
            "https://a.blob.core.windows.net/c?sv=2024&sig=***",
        ),
        (f"http://h/?token={SECRET};password={SECRET}", "http://h/?token=***;password=***"),
        (f"s3://b?access_key=AK&secret_key={SECRET}&region=us", "s3://b?access_key=***&secret_key=***&region=us"),
        (f"http://h/api?X-Amz-Security-Token={SECRET}#frag", "http://h/api?X-Amz-Security-Token=***#frag"),
        (f"failed to open s3://k:{SECRET}@b/x: denied", "failed to open s3://k:***@b/x: denied"),
    ],
)
def test_redact_text_masks_userinfo_and_secret_query_parameters(text: str, expected: str) -> None:
    assert redact_text(text) == expected
    assert SECRET not in redact_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "/data/runs/a@b/x",
        "mail alice@example.com",
        "s3://bucket/prefix?endpoint_override=h:1&scheme=http",
        "lr=0.1 step=3",
        "http://host/a@b",
        "sqlite:////tmp/runs/mlflow.db",
    ],
)
def test_redact_text_leaves_text_without_credentials_alone(text: str) -> None:
    assert redact_text(text) == text


def test_redact_config_masks_strings_anywhere_and_values_under_secret_keys() -> None:
    tree = {
        "checkpoint": {"storage_path": f"s3://k:{SECRET}@b/p"},
        "model": {
            "kwargs": {"api_token": SECRET, "password": 1234, "eos_token": "</s>", "hosts": [f"http://{SECRET}@h"]}
        },
        "optim": {"lr": 0.1, "betas": [0.9, 0.99]},
        "tracking": {"uri": None},
    }
    clean = redact_config(tree)
    assert SECRET not in repr(clean) and "1234" not in repr(clean)
    assert clean["model"]["kwargs"] == {
        "api_token": MASK,
        "password": MASK,
        "eos_token": "</s>",
        "hosts": ["http://***@h"],
    }
    assert clean["optim"] == tree["optim"] and clean["tracking"] == {"uri": None}
    assert tree["checkpoint"]["storage_path"] == f"s3://k:{SECRET}@b/p"  # a copy: the input is untouched


def secret_config() -> object:
    return load_config(
        {
            "model": {"name": "mlp"},
            "train": {"max_steps": 1},
            "checkpoint": {"storage_path": f"s3://key:{SECRET}@bucket/runs?endpoint_override=h:9&scheme=http"},
            "tracking": {"uri": f"https://alice:{SECRET}@mlflow.example.com"},
        }
    )


def test_config_yaml_and_mlflow_params_are_redacted_while_the_config_keeps_the_real_values() -> None:
    config = secret_config()
    text = to_yaml(config)  # type: ignore[arg-type]
    assert SECRET not in text
    assert yaml.safe_load(text)["tracking"]["uri"] == "https://alice:***@mlflow.example.com"
    params = config_params(config.to_dict())  # type: ignore[attr-defined]
    assert not [k for k, v in params.items() if SECRET in v]
    assert params["checkpoint.storage_path"] == "s3://key:***@bucket/runs?endpoint_override=h:9&scheme=http"
    # The run itself (Ray's RunConfig, the workers) gets the credentials.
    assert SECRET in config.storage_path and SECRET in config.tracking.uri  # type: ignore[attr-defined]


def test_the_log_filter_redacts_message_arguments_and_tracebacks() -> None:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = redacting(redacting(Keep()))
    assert sum(isinstance(f, RedactFilter) for f in handler.filters) == 1
    logger = logging.getLogger("trainforge.test_redact")
    logger.addHandler(handler)
    try:
        logger.warning("MLflow at %s is unreachable", f"https://u:{SECRET}@h")
        try:
            raise OSError(f"cannot open s3://k:{SECRET}@b/x")
        except OSError:
            logger.exception("save failed")
    finally:
        logger.removeHandler(handler)
    assert records[0] == "MLflow at https://u:***@h is unreachable"
    assert "s3://k:***@b/x" in records[1] and all(SECRET not in r for r in records)
