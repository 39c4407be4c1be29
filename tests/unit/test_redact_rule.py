"""One rule masks secrets everywhere (#36): key names, token formats, and every text that leaves.

The rule is ``trainforge.redact.is_secret_key`` for names and ``redact_text`` for text; these tests
check it with names and formats the issue did not list, in the shapes text takes when it leaves
(a dict's repr, JSON, YAML, ``name=value``), and end to end through the CLI's error line and
``config show``.
"""

from __future__ import annotations

import sys
import textwrap
import typing
from pathlib import Path

import pydantic
import pytest
import yaml

from trainforge.cli import main
from trainforge.config import schema
from trainforge.redact import MASK, is_secret_key, redact_config, redact_text, remember_secrets

SECRET = "Zq7-notAFormat-w9"  # no known token format: only the name can tell it is a secret

# Names the issue listed (authorization ... session_id) and many it did not: every separator, case
# and position, a value's encoding after the name (_pem, _value, _b64, _header).
SECRET_NAMES = [
    "authorization", "Authorization", "bearer", "cookie", "private_key_pem", "client_secret_value", "session_id",
    "X-Api-Key", "clientSecret", "db_password", "refresh_token", "SESSION_COOKIE", "my.private.key", "set-cookie",
    "sessionId", "SESSIONID", "hmac_key", "ssh_key", "license_key", "webhook_secret", "password_hash", "oauth",
    "basicAuth", "auth_header", "proxy-authorization", "jwt", "otp", "sentry_dsn", "salt", "pem", "id_token",
    "bot_token", "AWS_SECRET_ACCESS_KEY", "aws_session_token", "GOOGLE_APPLICATION_CREDENTIALS", "api_key_b64",
    "signing_key_hex", "cookie_jar", "secrets", "passphrase", "MLFLOW_TRACKING_PASSWORD", "deployKey",
    "Private-Key", "privkey", "encryption_key_material", "client_secret2", "key_pem", "keyB64",
]  # fmt: skip
# Names that are not secrets: the config's own keys, counts, paths and names of where a secret is.
HARMLESS_NAMES = [
    "keep_last", "num_workers", "learning_rate", "max_steps", "key_env", "sort_keys", "keys", "key", "token_file",
    "private_key_path", "secret_name", "access_key_id", "s3_sse_kms_key_id", "eos_token", "pad_token_id",
    "max_tokens", "tokenizer", "monkey", "keyboard", "author", "public_key", "label_key", "text_key",
    "password_length", "session_timeout", "tokens_per_step", "token_embedding_dim", "cert", "ca", "client_id",
    "checkpoint_sha256", "passes", "bypass", "secretary", "signal", "cookie_file", "auth_enabled",
]  # fmt: skip


def token_formats() -> list[str]:
    """One value of each published token format; built here so no literal in the repository looks
    like a live credential to a scanner."""
    body = "a1B2c3D4e5" * 5
    return [
        "hf_" + body[:34],
        "gh" + "p_" + body[:36],
        "github_" + "pat_" + "11ABCDEFG0" + body[:40],
        "gl" + "pat-" + body[:20],
        "sk-" + "proj-" + body[:40],
        "sk-" + "ant-api03-" + body[:40],
        "sk_" + "live_" + body[:24],
        "xo" + "xb-" + "1234-5678-" + body[:24],
        "AK" + "IA" + "ABCDEFGH23456789",
        "AI" + "za" + body[:35],
        "ey" + "JhbGciOiJIUzI1NiJ9.ey" + "JzdWIiOiIxMjM0In0." + body[:20],
        "T0ABC/B0DEF/" + body[:24],  # a Slack webhook's path (after hooks.slack.com/services/)
    ]


PRIVATE_KEY = "-----BEGIN " + "EC PRIVATE KEY-----\nMHcCAQEEIB" + "x" * 40 + "\n-----END EC PRIVATE KEY-----"


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_every_spelling_of_a_secret_name_is_masked_in_configs_and_in_text(name: str) -> None:
    assert is_secret_key(name), name
    assert redact_config({"model": {"kwargs": {name: SECRET}}}) == {"model": {"kwargs": {name: MASK}}}
    for text in (
        f"{name}={SECRET}",
        f"kwargs {{'{name}': '{SECRET}', 'hidden': 64}}",
        f'{{"{name}": "{SECRET}"}}',
        f"{name}: {SECRET}",
        f"f({name}={SECRET!r}, n=3)",
        f"{{'outer': {{'inner': [{{'{name}': {{'deeper': '{SECRET}'}}}}]}}}}",
    ):
        shown = redact_text(text)
        assert SECRET not in shown, (text, shown)
        assert MASK in shown


@pytest.mark.parametrize("name", HARMLESS_NAMES)
def test_ordinary_names_keep_their_values(name: str) -> None:
    assert not is_secret_key(name), name
    assert redact_config({"train": {name: 1000}}) == {"train": {name: 1000}}
    assert redact_text(f"{name}=1000 {{'{name}': 'value'}}") == f"{name}=1000 {{'{name}': 'value'}}"


def schema_keys() -> set[str]:
    names: set[str] = set()
    seen: set[type] = set()

    def walk(cls: type[pydantic.BaseModel]) -> None:
        if cls in seen:
            return
        seen.add(cls)
        for name, field in cls.model_fields.items():
            names.add(name)
            for arg in (field.annotation, *typing.get_args(field.annotation)):
                for inner in (arg, *typing.get_args(arg)):
                    if isinstance(inner, type) and issubclass(inner, pydantic.BaseModel):
                        walk(inner)

    for value in vars(schema).values():
        if isinstance(value, type) and issubclass(value, pydantic.BaseModel) and value is not pydantic.BaseModel:
            walk(value)
    return names


def test_no_key_of_the_config_itself_is_masked() -> None:
    """``config show`` keeps every value of trainforge's own keys (cluster.tls.key is a path,
    checkpoint.encryption.key_env a variable's name, checkpoint.s3_sse_kms_key_id an id)."""
    keys = schema_keys()
    assert {"key", "key_env", "s3_sse_kms_key_id", "keep_last", "tokenizer"} <= keys
    assert sorted(k for k in keys if is_secret_key(k)) == []


@pytest.mark.parametrize("token", token_formats())
def test_values_in_a_known_token_format_are_masked_whatever_names_them(token: str) -> None:
    if token.startswith("T0ABC/"):
        token = "https://hooks.slack.com/services/" + token
    for text in (token, f"note: {token} next", f"{{'comment': '{token}'}}", f"retry={token}&x=1"):
        shown = redact_text(text)
        assert token not in shown and "a1B2c3D4e5" not in shown and MASK in shown, text
    shown = str(redact_config({"data": {"comment": token}}))
    assert token not in shown and "a1B2c3D4e5" not in shown


@pytest.mark.parametrize(
    "text",
    [
        PRIVATE_KEY,
        repr(PRIVATE_KEY),  # its newlines escaped, as in a repr
        PRIVATE_KEY[:60],  # cut before its end line
        "-----BEGIN " + "OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
    ],
)
def test_a_private_key_block_is_masked(text: str) -> None:
    shown = redact_text(f"bad value {text} after")
    assert "MHcCAQEEIB" not in shown and "b3BlbnNzaC1rZXkt" not in shown


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Authorization: Bearer abc.def-123_456", "Authorization: ***"),
        ("sent Bearer abcdef12345678 to the head", "sent Bearer *** to the head"),
        ("header basic dXNlcjpwYXNzd29yZA==", "header basic ***"),
        ("postgresql://app:pw0rd@db:5432/x", "postgresql://app:***@db:5432/x"),
        ("redis://:pw0rd@cache:6379/0", "redis://***@cache:6379/0"),
        (
            "headers [('Authorization', 'Bearer x'), ('Accept', 'json')]",
            "headers [('Authorization', '***'), ('Accept', 'json')]",
        ),
        ("API Key: abc123def, Client Secret = xyz", "API Key: ***, Client Secret = ***"),
    ],
)
def test_auth_schemes_and_userinfo_are_masked(text: str, expected: str) -> None:
    assert redact_text(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855 of step-00000100",
        "run 4f9c2a7e-3b1d-4c8e-9f0a-1b2c3d4e5f60 step=100 lr=0.001 loss: 2.5",
        "the bearer of this; basic configuration; token sequences",
        "How to draw each token: ``temperature`` 0 is greedy",
        "keep_last: 3, num_workers: 2, key_env: TF_KEY, sort_keys=True",
        "cluster.tls.key /etc/certs/node.key: the private key is readable by every user (mode 0644)",
        "model.factory 'mod:build' returned a dict",
        "model.kwargs ['hf_token', 'hidden'] do not fit built-in 'mlp'; sort key: abc123def",
        "--set 'train.batch_size': expected key=value with a dotted key, e.g. train.batch_size=64",
        "left out of the package as secrets: certs/ca.key, ./node.key, .env (trainforge submit --dry-run says why)",
        "--ca-from /x/ca: ca.key: /x/ca/ca.key is readable by every user; driver session: 2 restarts",
    ],
)
def test_text_without_credentials_is_kept(text: str) -> None:
    assert redact_text(text) == text


def test_a_configs_secret_values_are_masked_wherever_they_are_quoted() -> None:
    """A factory that quotes its token in its own words: no name, no format; the value is known."""
    value = "hunter2-Quoted-X"
    assert value in redact_text(f"could not log in with {value}")
    remember_secrets({"model": {"kwargs": {"hf_token": value, "note": "ordinary-value-1"}}})
    assert redact_text(f"could not log in with {value}") == f"could not log in with {MASK}"
    assert redact_text("ordinary-value-1") == "ordinary-value-1"  # not under a secret name
    # A config cannot hide words of the output by naming them secret: a word is no credential.
    remember_secrets({"api_token": "checkpoint", "password": "12"})
    assert redact_text("checkpoint 12 saved") == "checkpoint 12 saved"


FACTORY = """
def build(hf_token, hidden=8, extra=None, **rest):
    raise ValueError("could not log in with " + hf_token)
"""


@pytest.fixture
def leaky_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model factory that raises, quoting its token, in a module beside a config that gives it
    secrets under three names and one known format."""
    (tmp_path / "leaky_factory36.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    config = {
        "model": {
            "factory": "leaky_factory36:build",
            "kwargs": {
                "hf_token": "tok-" + SECRET,
                "hidden": 16,
                "extra": {"session_id": "sid-" + SECRET, "Authorization": "Bearer b-" + SECRET},
                "note": token_formats()[0],
            },
        },
        "data": {"name": "synthetic"},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "leaky.yaml"
    path.write_text(yaml.safe_dump(config))
    yield path
    sys.modules.pop("leaky_factory36", None)


def test_a_factory_that_raises_prints_one_line_without_its_secrets(
    leaky_factory: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(leaky_factory)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "leaky_factory36:build' raised ValueError" in err and "'hidden': 16" in err
    assert SECRET not in err and token_formats()[0] not in err
    assert len(err.strip().splitlines()) == 1


def test_config_show_masks_every_secret(leaky_factory: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["config", "show", str(leaky_factory)])
    out = capsys.readouterr().out
    assert SECRET not in out and token_formats()[0] not in out
    kwargs = yaml.safe_load(out)["model"]["kwargs"]
    assert kwargs == {
        "hf_token": MASK,
        "hidden": 16,
        "extra": {"session_id": MASK, "Authorization": MASK},
        "note": MASK,
    }


def test_the_runs_logs_and_records_of_worker_errors_are_masked(tmp_path: Path) -> None:
    """workers.log (also what a worker print()ed) and metrics.jsonl's worker errors, which MLflow
    uploads as artifacts, go through the rule on the driver too."""
    from trainforge.observers.metrics_log import MetricsLog
    from trainforge.observers.worker_log import WorkerLog
    from trainforge.protocol import LogLine, WorkerFailure

    token = token_formats()[1]
    said = f"ValueError: login failed for {{'api_key': '{SECRET}'}} with {token}"
    WorkerLog(tmp_path).on_log([LogLine(level=20, text=f"[rank 0] {said}")])
    MetricsLog(tmp_path).on_worker_error(WorkerFailure(errors={0: said}, time=1.0))
    for name in ("workers.log", "metrics.jsonl"):
        text = (tmp_path / name).read_text()
        assert "login failed" in text and SECRET not in text and token not in text, name


def test_ckpt_inspect_masks_a_config_recorded_under_an_older_rule() -> None:
    from trainforge.checkpoint.inspect import _config_sections

    recorded = {"model": {"kwargs": {"authorization": SECRET, "hidden": 8}}, "seed": 0, "profile": None}
    assert _config_sections(recorded) == {"model": {"kwargs": {"authorization": MASK, "hidden": 8}}, "seed": 0}


def test_an_errors_own_text_holds_no_secret_for_an_api_caller(leaky_factory: Path) -> None:
    """``trainforge.fit`` raises the error itself: its ``str`` and ``repr`` are masked as it is made."""
    from trainforge.config import load_config
    from trainforge.errors import ModelError
    from trainforge.models.registry import build_from_factory

    config = load_config(leaky_factory)  # the config's secret values are known from here on
    with pytest.raises(ModelError) as raised:
        build_from_factory(config.model.factory or "", config.model.kwargs)
    assert "raised ValueError" in str(raised.value)
    for text in (str(raised.value), repr(raised.value), repr(raised.value.args)):
        assert SECRET not in text and token_formats()[0] not in text
    assert SECRET not in str(ModelError(f"refused {{'client_secret': '{SECRET}'}}"))


def more_token_formats() -> list[str]:
    """Published formats beyond the first list (#36 asked for "known token formats"), built here so
    no literal looks like a live credential to a scanner."""
    body = "a1B2c3D4e5" * 8
    return [
        "ya" + "29." + body[:60],  # a Google OAuth access token (gcloud's application default credentials)
        "dckr" + "_pat_" + body[:27],  # Docker Hub
        "hv" + "s." + body[:90],  # HashiCorp Vault
        "gl" + "sa_" + body[:32] + "_0a1b2c3d",  # Grafana service account
        "S" + "G." + body[:22] + "." + body[:43],  # SendGrid
        "shp" + "at_" + "0123456789abcdef" * 2,  # Shopify
        "xa" + "pp-1-A0123ABC-0123456789-" + body[:20],  # Slack app-level
        "lin" + "_api_" + body[:40],  # Linear
        "da" + "pi" + "0123456789abcdef" * 2,  # Databricks
        "AGE-" + "SECRET-KEY-1" + "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L" * 2,  # age
        "ATA" + "TT3x" + body[:60],  # Atlassian API token
        "gl" + "rt-" + body[:20],  # GitLab runner
        "r8" + "_" + body[:37],  # Replicate
        "gs" + "k_" + body[:52],  # Groq
    ]


@pytest.mark.parametrize("token", more_token_formats())
def test_more_published_token_formats_are_masked_whatever_names_them(token: str) -> None:
    for text in (token, f"note: {token} next", f"{{'comment': '{token}'}}", f"retry={token}&x=1"):
        shown = redact_text(text)
        assert token not in shown and "a1B2c3D4e5" not in shown and MASK in shown, (text, shown)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a command line quoted in an exception text (subprocess's CalledProcessError, a usage line)
        ("tool --password Zq7-notAFormat-w9 --verbose", "tool --password *** --verbose"),
        (
            "Command '['curl', '--api-key', 'Zq7-notAFormat-w9', 'x']' returned 1",
            "Command '['curl', '--api-key', '***', 'x']' returned 1",
        ),
        ("login -token Zq7notAFormatw9xyzzy", "login -token ***"),
        # a list of name/value pairs: HTTP headers, Kubernetes env entries, Postman variables
        ("{'name': 'Authorization', 'value': 'Zq7-notAFormat-w9'}", "{'name': 'Authorization', 'value': '***'}"),
        ('[{"key": "api_key", "value": "Zq7-notAFormat-w9"}]', '[{"key": "api_key", "value": "***"}]'),
        ("- name: HF_TOKEN\n  value: Zq7-notAFormat-w9\n", "- name: HF_TOKEN\n  value: ***\n"),
        # names the first list did not have
        ("passcode=Zq7-notAFormat-w9 github_pat: Zq7-notAFormat-w9", "passcode=*** github_pat: ***"),
        # other languages' assignments, and XML (a settings file, a SOAP fault quoted in an error)
        (
            'api_key := "Zq7-notAFormat-w9"; {"password" => "Zq7-notAFormat-w9"}',
            'api_key := "***"; {"password" => "***"}',
        ),
        (
            "<server><password>Zq7-notAFormat-w9</password><ns:ApiKey a='1'>Zq7</ns:ApiKey></server>",
            "<server><password>***</password><ns:ApiKey a='1'>***</ns:ApiKey></server>",
        ),
    ],
)
def test_flags_and_name_value_pairs_are_masked(text: str, expected: str) -> None:
    assert redact_text(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "--token is required; pass --password-file PATH", "run --num-workers 4 --key-env TF_KEY",
        "{'name': 'learning_rate', 'value': 0.001}", "- name: PATH\n  value: /usr/bin\n",
        "<name>token</name><count>3</count>", "x := 3; {'lr' => 0.1}",
    ],
)  # fmt: skip
def test_flags_and_pairs_without_a_secret_are_kept(text: str) -> None:
    assert redact_text(text) == text


def test_a_config_list_of_name_value_pairs_masks_the_secret_ones() -> None:
    """``env: [{name: HF_TOKEN, value: ...}]`` in a factory's kwargs: the value is masked in every
    record, and remembered for text that quotes it with no name."""
    value = "Zq7-pairValue-w9"
    tree = {"model": {"kwargs": {"env": [{"name": "HF_TOKEN", "value": value}, {"name": "MODE", "value": "fast"}]}}}
    shown = redact_config(tree)
    assert shown["model"]["kwargs"]["env"] == [{"name": "HF_TOKEN", "value": MASK}, {"name": "MODE", "value": "fast"}]
    remember_secrets(tree)
    assert redact_text(f"login failed for {value}") == f"login failed for {MASK}"


def test_a_token_used_as_a_configs_key_is_masked() -> None:
    """``acl: {hf_...: read}``: config show, config.yaml and MLflow params print keys too."""
    token = token_formats()[0]
    shown = redact_config({"model": {"kwargs": {"acl": {token: "read", "team": "write"}}}})
    assert shown["model"]["kwargs"]["acl"] == {MASK: "read", "team": "write"}


def test_an_argument_list_in_a_config_masks_a_secret_flags_value() -> None:
    """``args: ["--password", V]``: the flag names the next item, whatever it looks like."""
    value = "Zq7-argValue-w9"
    tree = {"model": {"kwargs": {"args": ["--password", value, "--verbose", "--workers", "4", "-token", "short"]}}}
    args = redact_config(tree)["model"]["kwargs"]["args"]
    assert args == ["--password", MASK, "--verbose", "--workers", "4", "-token", MASK]
    remember_secrets(tree)
    assert redact_text(f"exit 1: {value}") == f"exit 1: {MASK}"
