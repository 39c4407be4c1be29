"""Checkpoints encrypted at rest (``checkpoint.encryption: {key_env: NAME}``).

Every file of an encrypted checkpoint but the manifest is AES-256-GCM ciphertext with a fresh
random 96-bit nonce per file:

    b"TFENC1\\n\\0" | nonce (12 bytes) | ciphertext (as long as the plaintext) | tag (16 bytes)

The file's name inside the checkpoint is the associated data, so a file moved to another name
(one component's file swapped with another's) fails authentication like a flipped byte. The
manifest stays plaintext: it hashes the ciphertext (so ``trainforge ckpt verify`` checks every
byte without the key) and names the scheme and the key's id, a one-way fingerprint of the key
that tells a wrong key from a tampered file without decrypting anything.

The key is 32 random bytes, given base64 (or hex) in the environment variable the config names;
it is read from there by each process that needs it and never written to any file or record.
Files are encrypted while written (:class:`Sealer`, driven by ``hashing.HashingWriter``) and
decrypted whole before use: into memory (``trainer_state.json``) or into anonymous files that no
directory names (``checkpoint/opened.py``), so no plaintext outlives the process that reads it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass
from typing import IO, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from trainforge.checkpoint.problems import KeyProblem
from trainforge.errors import CheckpointError

SCHEME = "aes-256-gcm"
MAGIC = b"TFENC1\n\0"
NONCE_BYTES = 12
TAG_BYTES = 16
HEADER_BYTES = len(MAGIC) + NONCE_BYTES
OVERHEAD = HEADER_BYTES + TAG_BYTES
KEY_BYTES = 32
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_CHUNK = 8 << 20
_KEY_ID_CONTEXT = b"trainforge checkpoint key id\0"
ENCRYPTED_HINT = "its contents need the key (checkpoint.encryption.key_env, or --key-env NAME)"
WRONG_KEY = "(the wrong key)"


def key_id(key: bytes) -> str:
    """A fingerprint of ``key`` (16 hex digits) that names it in manifests and errors."""
    return hashlib.sha256(_KEY_ID_CONTEXT + key).hexdigest()[:16]


def parse_key(text: str, origin: str) -> bytes:
    """The 32 bytes of a key given as base64 or 64 hex digits; a one-line CheckpointError otherwise."""
    value = text.strip()
    try:
        key = (
            bytes.fromhex(value) if re.fullmatch(r"[0-9a-fA-F]{64}", value) else base64.b64decode(value, validate=True)
        )
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise CheckpointError(
            f"{origin}: not a key of {KEY_BYTES} bytes in base64 or hex (make one with: "
            'python -c "import base64, os; print(base64.b64encode(os.urandom(32)).decode())")'
        )
    return key


@dataclass(frozen=True)
class FileCipher:
    """The key of a run's checkpoints: seals files as they are written and opens them to be read."""

    key: bytes
    origin: str  # where the key came from, for errors: "checkpoint.encryption.key_env (NAME)"

    def __repr__(self) -> str:  # never the key
        return f"FileCipher(key_id={self.key_id}, origin={self.origin!r})"

    @classmethod
    def from_env(cls, name: str, env: Any = None) -> FileCipher:
        """The key in environment variable ``name``; one line when it is unset or not a key."""
        origin = f"checkpoint.encryption.key_env ({name})"  # not "NAME:", which reads as a secret's label
        value = (os.environ if env is None else env).get(name)
        if not value:
            raise CheckpointError(f"{origin}: the environment variable is not set on this machine")
        return cls(parse_key(value, origin), origin)

    @property
    def key_id(self) -> str:
        return key_id(self.key)

    def record(self) -> dict[str, str]:
        """What the manifest says of the encryption."""
        return {"scheme": SCHEME, "key_id": self.key_id}

    def sealer(self, rel: str) -> Sealer:
        return Sealer(self.key, rel)

    def check_key(self, encryption: Any, what: str) -> None:
        """A checkpoint's manifest ``encryption`` record names this key; one line otherwise."""
        wanted = getattr(encryption, "key_id", None)
        if wanted != self.key_id:
            raise KeyProblem(
                f"{what} is encrypted with key {wanted}; {self.origin} holds key {self.key_id} {WRONG_KEY}"
            )

    def open_bytes(self, rel: str, data: bytes) -> bytes:
        """The plaintext of file ``rel`` of an encrypted checkpoint, authenticated."""
        if len(data) < OVERHEAD or not data.startswith(MAGIC):
            raise CheckpointError(f"{rel} is not a file trainforge encrypted")
        nonce, body, tag = data[len(MAGIC) : HEADER_BYTES], data[HEADER_BYTES:-TAG_BYTES], data[-TAG_BYTES:]
        decryptor = _decryptor(self.key, nonce, tag, rel)
        try:
            return decryptor.update(body) + decryptor.finalize()
        except InvalidTag:
            raise _tampered(rel) from None

    def open_stream(self, rel: str, source: IO[bytes], size: int, target: IO[bytes]) -> None:
        """Decrypt file ``rel`` (``size`` bytes from the seekable ``source``) into ``target``.
        ``target`` holds unauthenticated bytes until this returns: use it only if it returns."""
        if size < OVERHEAD or source.read(len(MAGIC)) != MAGIC:
            raise CheckpointError(f"{rel} is not a file trainforge encrypted")
        nonce = source.read(NONCE_BYTES)
        left = size - OVERHEAD
        body_start = source.tell()
        source.seek(body_start + left)  # the tag is last: read it first, then the body in chunks
        tag = source.read(TAG_BYTES)
        source.seek(body_start)
        decryptor = _decryptor(self.key, nonce, tag, rel)
        while left > 0:
            chunk = source.read(min(_CHUNK, left))
            if not chunk:
                raise CheckpointError(f"{rel} is shorter than its manifest says")
            target.write(decryptor.update(chunk))
            left -= len(chunk)
        try:
            target.write(decryptor.finalize())
        except InvalidTag:
            raise _tampered(rel) from None


def cipher_of(encryption: Any) -> FileCipher | None:
    """The key a config's ``checkpoint.encryption`` section names (None: checkpoints in plaintext)."""
    return FileCipher.from_env(encryption.key_env) if encryption is not None else None


class Sealer:
    """One file's encryption while it is written: ``header`` first, then ``update`` per chunk,
    then ``finalize`` (the last bytes and the tag)."""

    def __init__(self, key: bytes, rel: str) -> None:
        nonce = os.urandom(NONCE_BYTES)
        self._encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        self._encryptor.authenticate_additional_data(rel.encode())
        self.header = MAGIC + nonce

    def update(self, data: Any) -> bytes:
        return self._encryptor.update(data)

    def finalize(self) -> bytes:
        return self._encryptor.finalize() + self._encryptor.tag


def _decryptor(key: bytes, nonce: bytes, tag: bytes, rel: str) -> Any:
    decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
    decryptor.authenticate_additional_data(rel.encode())
    return decryptor


def _tampered(rel: str) -> CheckpointError:
    return CheckpointError(f"{rel} fails authentication (changed after it was encrypted, or under another name)")


def is_sealed(data: bytes) -> bool:
    return data.startswith(MAGIC)


__all__ = [
    "ENCRYPTED_HINT",
    "KEY_BYTES",
    "OVERHEAD",
    "SCHEME",
    "FileCipher",
    "Sealer",
    "cipher_of",
    "is_sealed",
    "key_id",
    "parse_key",
]
