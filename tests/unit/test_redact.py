"""Credentials in URIs: masked in every record of a run, kept in the config the run uses."""

from __future__ import annotations

import logging

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from trainforge.config import load_config, to_yaml
from trainforge.redact import MASK, RedactFilter, is_secret_key, redact_config, redact_text, redacting
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
        (
            f"https://h/v1?key={SECRET}&hf_token={SECRET}&apiKey={SECRET}",
            "https://h/v1?key=***&hf_token=***&apiKey=***",
        ),
        (f"https://h/x?refresh-token={SECRET}&db_pass={SECRET}", "https://h/x?refresh-token=***&db_pass=***"),
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
        "https://h/p?monkey=1&max_tokens=5&token_file=/t&AWSAccessKeyId=AK&sort_key=a",
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


# The names the issue found unmasked (issue 26), and names that only look alike.
LEAKED_KEYS = ["token", "hf_token", "github_token", "refresh_token", "private_key", "passphrase", "db_pass"]
LEAKED_KEYS += ["secretKey", "api-key", "APIKey", "HF_TOKEN", "x-api-key", "dbpassword", "SECRETKEY", "password2"]
HARMLESS_KEYS = ["max_tokens", "tokenizer", "num_tokens", "vocab_size", "key_env", "passes", "bypass", "keep_last"]
HARMLESS_KEYS += ["token_file", "private_key_path", "eos_token", "pad_token", "pad_token_id", "key", "secret_name"]
HARMLESS_KEYS += ["access_key_id", "monkey", "author", "tokenizer_name"]


@pytest.mark.parametrize("key", LEAKED_KEYS)
def test_values_under_every_secret_named_key_are_masked(key: str) -> None:
    assert redact_config({"model": {"kwargs": {key: SECRET}}}) == {"model": {"kwargs": {key: MASK}}}


@pytest.mark.parametrize("key", HARMLESS_KEYS)
def test_names_that_only_look_alike_keep_their_values(key: str) -> None:
    assert redact_config({key: "value"}) == {key: "value"}


def test_everything_under_a_secret_named_key_is_masked_however_deep() -> None:
    tree = {"credentials": {"aws": f"AK:{SECRET}", "extra": [SECRET, None]}, "api_keys": [SECRET, ""], "auth": None}
    assert redact_config(tree) == {
        "credentials": {"aws": MASK, "extra": [MASK, None]},
        "api_keys": [MASK, ""],
        "auth": None,
    }


# A key name is the words of a secret phrase after any prefix words, in any separator style.
SECRET_PHRASES = [
    ["token"], ["password"], ["passwd"], ["pass"], ["pwd"], ["passphrase"], ["secret"], ["credential"],
    ["credentials"], ["auth"], ["signature"], ["secret", "key"], ["private", "key"], ["api", "key"],
    ["apikey"], ["access", "key"], ["secret", "access", "key"], ["access", "token"], ["refresh", "token"],
    ["auth", "tokens"], ["client", "secret"], ["api", "keys"], ["passwords"], ["encryption", "key"],
]  # fmt: skip
PREFIX_WORDS = ["hf", "github", "db", "model", "client", "aws", "my", "user", "service", "mlflow", "remote", "x"]
# Words of no secret: any name made of them keeps its value, and so does a secret phrase followed
# by one of the last words (the name says where a secret is, or something about it).
HARMLESS_WORDS = ["max", "num", "tokens", "tokenizer", "vocab", "size", "env", "file", "path"]
HARMLESS_WORDS += ["passes", "bypass", "keep", "last", "learning", "rate", "batch", "name", "model", "kwargs"]
HARMLESS_WORDS += ["hidden", "dim", "seed", "monkey", "author", "compass", "keyboard", "signal", "secretary"]
LOCATION_WORDS = ["file", "path", "env", "dir", "name", "id", "url", "length", "kind"]
STYLES = ["snake", "kebab", "dot", "space", "camel", "pascal", "upper", "train"]


def styled(words: list[str], style: str) -> str:
    if style == "camel":
        return words[0] + "".join(word.capitalize() for word in words[1:])
    if style == "pascal":
        return "".join(word.capitalize() for word in words)
    if style == "train":  # X-Api-Key
        return "-".join(word.capitalize() for word in words)
    separator = {"snake": "_", "kebab": "-", "dot": ".", "space": " ", "upper": "_"}[style]
    text = separator.join(words)
    return text.upper() if style == "upper" else text


prefixes = st.lists(st.sampled_from(PREFIX_WORDS), max_size=3)
styles = st.sampled_from(STYLES)
numbered = st.sampled_from(["", "2"])
secret_names = st.builds(
    lambda pre, phrase, style, n: styled(pre + phrase, style) + n,
    prefixes,
    st.sampled_from(SECRET_PHRASES),
    styles,
    numbered,
)
harmless_names = st.builds(styled, st.lists(st.sampled_from(HARMLESS_WORDS), min_size=1, max_size=4), styles)
located_names = st.builds(
    lambda pre, phrase, last, style: styled([*pre, *phrase, last], style),
    prefixes, st.sampled_from(SECRET_PHRASES), st.sampled_from(LOCATION_WORDS), styles,
)  # fmt: skip
NAMES = settings(max_examples=300, deadline=None, database=None)


@NAMES
@given(secret_names)
def test_fuzz_a_secret_phrase_in_any_style_after_any_prefix_is_masked(name: str) -> None:
    assert is_secret_key(name), name
    assert redact_config({"kwargs": {name: SECRET}}) == {"kwargs": {name: MASK}}
    if " " not in name:
        assert redact_text(f"https://h/p?a=1&{name}={SECRET}&b=2") == f"https://h/p?a=1&{name}={MASK}&b=2"


@NAMES
@given(st.one_of(harmless_names, located_names))
def test_fuzz_names_without_a_secret_phrase_at_their_end_keep_their_values(name: str) -> None:
    assert not is_secret_key(name), name
    assert redact_config({"kwargs": {name: "value"}}) == {"kwargs": {name: "value"}}
    if " " not in name and name.lower() != "key":  # ?key= is Google's API key: masked in a query only
        assert redact_text(f"https://h/p?{name}=value") == f"https://h/p?{name}=value"


def secret_config() -> object:
    return load_config(
        {
            "model": {"name": "mlp", "kwargs": {"hf_token": SECRET, "secretKey": SECRET, "api-key": SECRET}},
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
    assert yaml.safe_load(text)["model"]["kwargs"] == {"hf_token": MASK, "secretKey": MASK, "api-key": MASK}
    assert params["model.kwargs.hf_token"] == MASK
    # The run itself (Ray's RunConfig, the workers) gets the credentials.
    assert SECRET in config.storage_path and SECRET in config.tracking.uri  # type: ignore[attr-defined]
    assert config.model.kwargs["hf_token"] == SECRET  # type: ignore[attr-defined]


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
