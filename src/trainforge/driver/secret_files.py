"""What a file's first bytes say about it, for ``submit``'s secret rule (``job_package``): key
material in a binary form (a DER private key, encrypted or not; a PKCS#12 bundle; a Java
keystore; a KeePass database) and credential files by their syntax (a netrc's ``password``, a
pgpass line, a value after a secret name in any text file: ``_authToken=...`` in an npmrc, an
INI's ``aws_secret_access_key = ...``, a kubeconfig's ``token: ...``), whatever the file is named;
and a zip or tar archive by the names of its members (the caller's rule for names).

Certificates are public and are not material here (a name such as ``*.crt`` still withholds one).
"""

from __future__ import annotations

import re
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import load_der_private_key

from trainforge.redact import masked_values

DER_MAX_BYTES = 64 << 10  # a DER key or PKCS#12 bundle is one ASN.1 structure, far smaller
TEXT_SNIFF_BYTES = 64 << 10  # the first 64 KiB of a text file are read for a named secret
# A PKCS#12 PFX: SEQUENCE { INTEGER 3, SEQUENCE { OID pkcs7-data or pkcs7-signedData, ... } }
_PKCS12_VERSION = b"\x02\x01\x03\x30"
_PKCS7_OID = b"\x06\x09\x2a\x86\x48\x86\xf7\x0d\x01\x07"
_MAGIC = {
    b"\xfe\xed\xfe\xed": "a Java keystore",
    b"\xce\xce\xce\xce": "a Java keystore (JCEKS)",
    b"\x03\xd9\xa2\x9a": "a KeePass database",
}
# netrc: ``machine HOST login USER password PASS`` (any whitespace, newlines included, between).
_NETRC = re.compile(rb"(?:^|\s)(?:machine\s+\S+|default)(?:\s+(?:login|account)\s+\S+)*\s+password\s+\S")
# pgpass: ``host:port:database:user:password``, the port a number or '*'.
_PGPASS = re.compile(rb"(?m)^[^\s:#]+:(?:[0-9]+|\*):[^\s:]+:[^\s:]+:\S+\s*$")
CODE_SUFFIXES = (".py", ".pyi")  # code the job runs: judged by token formats and keys only
ARCHIVE_MAX_BYTES = 128 << 20  # past Ray's 100 MiB upload limit: a bigger archive is not sent anyway
ARCHIVE_MAX_MEMBERS = 10_000  # names read from one archive's listing
_GZIP, _BZIP2, _XZ = b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00"


def archived_secret(path: Path, head: bytes, size: int, judge: Callable[[list[str]], str | None]) -> str | None:
    """Why a zip or tar archive is left out: a member whose path ``judge`` (the rule for names)
    withholds (``backup.zip`` holding ``.ssh/id_ed25519``); names only, the first ``ARCHIVE_MAX_MEMBERS``."""
    tar = len(head) > 262 and head[257:262] == b"ustar"
    if size > ARCHIVE_MAX_BYTES or not (head.startswith((b"PK\x03\x04", _GZIP, _BZIP2, _XZ)) or tar):
        return None
    try:
        if head.startswith(b"PK\x03\x04"):
            with zipfile.ZipFile(path) as archive:
                names = [info.filename for info in archive.infolist()[:ARCHIVE_MAX_MEMBERS]]
        else:
            names = []
            with tarfile.open(path, "r:*") as archive:
                for member in archive:
                    names.append(member.name)
                    if len(names) >= ARCHIVE_MAX_MEMBERS:
                        break
    except (OSError, EOFError, zipfile.BadZipFile, tarfile.TarError, ValueError):
        return None  # not an archive after all (a gzip of one file, a damaged one): judged by the rest
    for name in names:
        reason = judge([part for part in name.split("/") if part not in ("", ".")])
        if reason is not None:
            return f"an archive holding {name}: {reason}"
    return None


def key_material(head: bytes, size: int) -> str | None:
    """What binary key material ``head`` (a file's first bytes; ``size``: the whole file's) is, or None."""
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return f"holds {what}"
    body = _der_body(head, size)
    if body is None:
        return None
    if head[body : body + 4] == _PKCS12_VERSION and _PKCS7_OID in head[body : body + 32]:
        return "holds a PKCS#12 bundle (a private key and its certificates)"
    try:
        load_der_private_key(head, password=None)
    except TypeError:  # "password was not given but private key is encrypted": a key all the same
        return "holds an encrypted private key (DER)"
    except (ValueError, UnsupportedAlgorithm):
        return None
    return "holds a private key (DER)"


def _der_body(head: bytes, size: int) -> int | None:
    """Where the contents of ``head``'s outer DER SEQUENCE begin, when that SEQUENCE is the whole file."""
    if size > DER_MAX_BYTES or len(head) != size or size < 2 or head[0] != 0x30:
        return None
    first = head[1]
    if first < 0x80:
        return 2 if 2 + first == size else None
    count = first & 0x7F
    if not 1 <= count <= 3 or size < 2 + count:
        return None
    length = int.from_bytes(head[2 : 2 + count], "big")
    return 2 + count if 2 + count + length == size else None


def credential_syntax(head: bytes, *, code: bool) -> str | None:
    """Why a text file's first bytes are a credential file's, or None: netrc and pgpass lines, and
    (in a file that is not code) a value the records mask after a secret name that looks like a
    credential rather than a reference to one (``$VAR``, ``${VAR}``, ``{{ var }}``, ``<your token>``)
    or a path (``/etc/tls/node.key``)."""
    if b"\0" in head:
        return None  # binary: no text syntax
    if _NETRC.search(head):
        return "holds a netrc password"
    if _PGPASS.search(head):
        return "holds a pgpass line (host:port:database:user:password)"
    if code:
        return None
    text = head[:TEXT_SNIFF_BYTES].decode("utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        if any(_a_credential(value) for value in masked_values(line)):
            return f"holds a credential (line {number}, as the records mask it)"
    return None


def _a_credential(value: str) -> bool:
    value = value.strip("'\" \t")
    if value.startswith(("$", "%", "{{", "<", "***", "/", "~/", "./", "../")):
        return False  # a reference to a credential, or the path of its file: not the credential
    return len(value) >= 16 or (len(value) >= 6 and any(not c.isalpha() for c in value))
