"""``checkpoint.s3_sse`` (#26): every object a checkpoint save writes to S3 asks for server-side
encryption (``AES256`` or ``aws:kms`` with a key id), through the real writer against moto's S3
server on loopback; pyarrow alone sends no such header (the control case below)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.checkpoints import snapshot
from tests.helpers.faults import free_port
from tests.helpers.s3 import BUCKET, S3Server, serving
from tests.unit.test_checkpoint import SCHEMAS, save_all, small_model, trained
from tests.unit.test_checkpoint_hostile import writer
from trainforge.checkpoint.sse import ServerSide
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name
from trainforge.config import load_config
from trainforge.errors import ConfigError


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with serving(free_port()) as (server, _):
        yield server


def encryption_of(server: S3Server, prefix: str) -> dict[str, tuple[str | None, str | None]]:
    """Every object under ``prefix``: (ServerSideEncryption, SSEKMSKeyId) as S3 reports them."""
    client = server.client()
    found = {}
    for key in server.keys(prefix):
        if key.endswith("/"):  # a folder marker, no object of the checkpoint's
            continue
        head = client.head_object(Bucket=BUCKET, Key=key)
        found[key[len(prefix) :]] = (head.get("ServerSideEncryption"), head.get("SSEKMSKeyId"))
    return found


def save_to_s3(tmp_path: Path, prefix: str, sse: ServerSide | None) -> CheckpointStore:
    store = CheckpointStore.from_uri(f"s3://{BUCKET}/{prefix}")
    store.encrypt_on_server(sse)
    model = small_model()
    outcomes = save_all(writer(tmp_path, store), [snapshot(model, trained(model), step) for step in (5, 10)])
    assert [o.error for o in outcomes] == [None, None]
    return store


@pytest.mark.parametrize(
    ("sse", "expected"),
    [
        (ServerSide("AES256"), ("AES256", None)),
        (ServerSide("aws:kms", "arn:aws:kms:us-east-1:123456789012:key/trainforge-test"), ("aws:kms", "x")),
    ],
    ids=["AES256", "aws-kms"],
)
def test_every_object_of_a_save_asks_for_server_side_encryption(
    s3: S3Server, tmp_path: Path, sse: ServerSide, expected: tuple[str, Any]
) -> None:
    prefix = f"sse-{sse.mode.replace(':', '-')}/run/"
    store = save_to_s3(tmp_path, prefix.rstrip("/"), sse)
    found = encryption_of(s3, prefix)
    committed = {k: v for k, v in found.items() if k.startswith(checkpoint_name(10) + "/")}
    assert committed and {"manifest.json", "trainer_state.json", "model.safetensors"} <= {
        k.split("/", 1)[1] for k in committed
    }, found
    for key, (mode, kms_key) in found.items():  # staged, copied and committed objects alike
        assert mode == expected[0], (key, mode)
        if sse.kms_key_id:
            assert kms_key is not None and kms_key.endswith("trainforge-test"), (key, kms_key)
    assert store.verify(checkpoint_name(10), schemas=SCHEMAS).ok  # reads need nothing


def test_without_s3_sse_pyarrow_sends_no_encryption_header(s3: S3Server, tmp_path: Path) -> None:
    save_to_s3(tmp_path, "plain/run", None)
    assert {mode for mode, _ in encryption_of(s3, "plain/run/").values()} == {None}


def test_s3_sse_is_checked_against_the_storage_path() -> None:
    base: dict[str, Any] = {"model": {"name": "mlp"}, "train": {"max_steps": 1}}
    for checkpoint, expected in [
        ({"s3_sse": "AES256"}, "checkpoint.s3_sse needs an s3:// checkpoint.storage_path"),
        ({"s3_sse": "aws:kms", "s3_sse_kms_key_id": "k", "storage_path": "/tmp/x"}, "needs an s3://"),
        (
            {"s3_sse": "AES256", "s3_sse_kms_key_id": "k", "storage_path": "s3://b/p"},
            "needs checkpoint.s3_sse: aws:kms",
        ),
        ({"s3_sse": "aes256", "storage_path": "s3://b/p"}, "checkpoint.s3_sse = 'aes256': Input should be"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_config({**base, "checkpoint": checkpoint})
        assert expected in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    chosen = load_config({**base, "checkpoint": {"s3_sse": "aws:kms", "storage_path": "s3://b/p"}})
    assert chosen.checkpoint.s3_sse == "aws:kms"
