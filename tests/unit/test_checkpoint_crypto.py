"""Checkpoints encrypted at rest (``checkpoint.encryption``, #26): every file but the manifest is
AES-256-GCM ciphertext, the manifest hashes the ciphertext and names the key's id; the key comes
from the environment and is never written. Written and read by the real writer and restore (one
process, no Ray): a wrong key, a missing key and a tampered file are one line each and restore
walks back past them; what loads is bit-identical to what was saved."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import MODEL_FILE, OPTIMIZER_FILE, snapshot
from tests.unit.test_checkpoint import SCHEMAS, flip_byte, save_all, small_model, trained
from tests.unit.test_checkpoint_hostile import worker_run, writer
from trainforge.checkpoint.crypto import MAGIC, OVERHEAD, FileCipher, key_id, parse_key
from trainforge.checkpoint.format import write_manifest
from trainforge.checkpoint.schema import MANIFEST, STATE_FILE
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name
from trainforge.errors import CheckpointError
from trainforge.worker.saving import restore

KEY_A = base64.b64encode(bytes(range(32))).decode()
KEY_B = bytes(range(1, 33)).hex()


def cipher(text: str = KEY_A) -> FileCipher:
    return FileCipher.from_env("TF_TEST_KEY", {"TF_TEST_KEY": text})


def save(tmp_path: Path, key: FileCipher | None, steps: tuple[int, ...]) -> CheckpointStore:
    """Checkpoints of ``small_model`` after two Adam steps at ``steps``, written by the run's writer."""
    store = CheckpointStore.from_uri(str(tmp_path / "run"), key)
    saver = writer(tmp_path, store, keep_last=5)
    saver.cipher = key
    model = small_model()
    outcomes = save_all(saver, [snapshot(model, trained(model), step) for step in steps])
    assert [o.error for o in outcomes] == [None] * len(steps)
    return store


def test_keys_parse_from_base64_or_hex_and_refuse_anything_else() -> None:
    assert parse_key(KEY_A, "k") == bytes(range(32)) and parse_key(KEY_B, "k") == bytes(range(1, 33))
    for bad in ("", "c2hvcnQ=", "z" * 64, KEY_A[:-4]):
        with pytest.raises(CheckpointError) as caught:
            parse_key(bad, "checkpoint.encryption.key_env K")
        assert str(caught.value).startswith("checkpoint.encryption.key_env K: not a key of 32 bytes")
    with pytest.raises(CheckpointError, match=r"\(TF_MISSING\): the environment variable is not set"):
        FileCipher.from_env("TF_MISSING", {})
    assert "0001" not in repr(cipher()) and key_id(bytes(range(32))) in repr(cipher())


def test_every_file_but_the_manifest_is_ciphertext_and_the_key_is_nowhere(tmp_path: Path) -> None:
    store = save(tmp_path, cipher(), (5,))
    directory = tmp_path / "run" / checkpoint_name(5)
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["encryption"] == {"scheme": "aes-256-gcm", "key_id": key_id(bytes(range(32)))}
    for rel, entry in manifest["files"].items():
        data = (directory / rel).read_bytes()
        assert data.startswith(MAGIC) and entry["size"] == len(data), rel
        assert b'"dtype"' not in data and b"global_step" not in data and b"PK\x03\x04" not in data, rel
    nonces = {(directory / rel).read_bytes()[len(MAGIC) : len(MAGIC) + 12] for rel in manifest["files"]}
    assert len(nonces) == len(manifest["files"])  # a fresh nonce per file
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert bytes(range(32)) not in data and KEY_A.encode() not in data, path
    assert store.verify(checkpoint_name(5), schemas=SCHEMAS).ok


def test_verify_checks_the_ciphertext_without_the_key_and_the_contents_with_it(tmp_path: Path) -> None:
    save(tmp_path, cipher(), (5,))
    keyless = CheckpointStore.from_uri(str(tmp_path / "run"))
    assert keyless.verify(checkpoint_name(5), schemas=SCHEMAS, contents=False).ok  # ckpt verify, no key
    check = keyless.verify(checkpoint_name(5), schemas=SCHEMAS)  # restore, no key
    [problem] = check.problems
    assert problem.startswith("encrypted (aes-256-gcm, key ") and "key_env" in problem
    assert check.kinds == {"key"}  # restore decides by the kind, never by the text
    check = CheckpointStore.from_uri(str(tmp_path / "run"), cipher(KEY_B)).verify(checkpoint_name(5))
    assert check.kinds == {"key"}
    [problem] = check.problems
    assert problem == (
        f"the checkpoint is encrypted with key {key_id(bytes(range(32)))}; checkpoint.encryption.key_env "
        f"(TF_TEST_KEY) holds key {key_id(bytes(range(1, 33)))} (the wrong key)"
    )
    flip_byte(tmp_path / "run" / checkpoint_name(5))  # a ciphertext byte: the hash tells, no key needed
    check = keyless.verify(checkpoint_name(5), contents=False)
    [problem] = check.problems
    assert problem.startswith(f"{MODEL_FILE} fails its") and check.kinds == {"invalid"}


def test_restore_is_bit_identical_and_walks_back_past_a_wrong_key_or_a_tampered_file(tmp_path: Path) -> None:
    store = save(tmp_path, cipher(), (5, 10))
    expected = small_model()
    for _ in (5, 10):  # as save() trained it before each snapshot
        trained(expected)

    run = worker_run(tmp_path)
    restored = restore(run, store)
    assert restored.progress.global_step == 10 and restored.skipped == []
    for key, value in expected.state_dict().items():
        assert torch.equal(run.model.state_dict()[key], value), key

    # 10 tampered by someone who also rewrote the manifest's hashes: only authentication tells.
    directory = tmp_path / "run" / checkpoint_name(10)
    data = bytearray((directory / OPTIMIZER_FILE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (directory / OPTIMIZER_FILE).write_bytes(bytes(data))
    manifest = json.loads((directory / MANIFEST).read_text())
    write_manifest(directory, {k: v for k, v in manifest.items() if k not in ("files", "format_version", "hash")})
    run = worker_run(tmp_path)
    restored = restore(run, store)
    assert restored.progress.global_step == 5
    [(name, reason)] = restored.skipped
    assert name == checkpoint_name(10) and f"{OPTIMIZER_FILE} fails authentication" in reason and "\n" not in reason

    # The wrong key, or none: one line, and no fresh start over checkpoints the run cannot open.
    for key, expected_why in ((cipher(KEY_B), "(the wrong key)"), (None, "its contents need the key")):
        with pytest.raises(CheckpointError) as caught:
            restore(worker_run(tmp_path), CheckpointStore.from_uri(str(tmp_path / "run"), key))
        message = str(caught.value)
        assert message.startswith("no checkpoint of this run opens with this run's key (checkpoint_000000"), message
        assert expected_why in message and "\n" not in message


def test_a_file_renamed_inside_an_encrypted_checkpoint_fails_authentication() -> None:
    key = cipher()
    sealer = key.sealer(MODEL_FILE)
    sealed = sealer.header + sealer.update(b"weights") + sealer.finalize()
    assert len(sealed) == len(b"weights") + OVERHEAD and key.open_bytes(MODEL_FILE, sealed) == b"weights"
    with pytest.raises(CheckpointError, match=f"{STATE_FILE} fails authentication"):
        key.open_bytes(STATE_FILE, sealed)


def test_a_plaintext_checkpoint_still_loads_into_an_encrypted_run(tmp_path: Path) -> None:
    # Encryption turned on for a run that has plaintext checkpoints: they resume; new ones are sealed.
    save(tmp_path, None, (5,))
    run = worker_run(tmp_path)
    restored = restore(run, CheckpointStore.from_uri(str(tmp_path / "run"), cipher()))
    assert restored.progress.global_step == 5 and not restored.skipped
    assert os.environ.get("TF_TEST_KEY") is None  # the tests never put a key in the environment


def test_ckpt_verify_without_the_key_and_inspect_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.unit.test_data_sections import cli

    save(tmp_path, cipher(), (5,))
    path = str(tmp_path / "run" / checkpoint_name(5))
    code, out, _ = cli(capsys, "ckpt", "verify", path)
    assert code == 0 and out.startswith(f"valid: {path} (") and "contents not checked: --key-env" in out, out
    code, _, err = cli(capsys, "ckpt", "inspect", path)
    assert code == 2 and "is encrypted (aes-256-gcm, key " in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("TF_CLI_KEY", KEY_A)
    code, out, _ = cli(capsys, "ckpt", "verify", path, "--key-env", "TF_CLI_KEY")
    assert code == 0 and "contents checked with its key" in out, out
    code, out, _ = cli(capsys, "ckpt", "inspect", path, "--key-env", "TF_CLI_KEY", "--json")
    report = json.loads(out)
    assert code == 0 and report["step"] == 5 and report["problems"] == [], out
    assert report["components"]["model"]["weights"]["tensors"] == 4  # the header, read from the decrypted file
    monkeypatch.setenv("TF_CLI_KEY", KEY_B)
    code, out, _ = cli(capsys, "ckpt", "verify", path, "--key-env", "TF_CLI_KEY")
    assert code == 1 and "(the wrong key)" in out, out
    code, _, err = cli(capsys, "ckpt", "verify", path, "--key-env", "UNSET_KEY_VARIABLE")
    assert code == 2 and "(UNSET_KEY_VARIABLE): the environment variable is not set" in err, err
