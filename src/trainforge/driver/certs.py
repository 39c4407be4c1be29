"""Certificates for a Ray cluster's TLS (``trainforge certs create``): a CA and one node
certificate it signs, for every host that serves or connects.

Ray's TLS is mutual: every process (GCS, raylet, workers, drivers) presents
``RAY_TLS_SERVER_CERT`` both as a server and as a client, and accepts only peers whose
certificate the CA at ``RAY_TLS_CA_CERT`` signed. The node certificate therefore has both
``serverAuth`` and ``clientAuth`` and names, in its subjectAltName, every host name and IP address
a peer dials (gRPC checks the name it dialled against it). Keys are ECDSA P-256, written 0600 and
never overwritten; the CA's key stays with whoever makes certificates, never on the nodes.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from trainforge.config.schema import unsafe_mode
from trainforge.errors import ConfigError
from trainforge.files import read_user_file

PEM_MAX = 1 << 20  # a CA's certificate or key in PEM: a few KiB

CA_DAYS = 3650  # the CA outlives a few rounds of node certificates
NODE_DAYS = 365
CLOCK_SKEW = datetime.timedelta(minutes=5)  # valid a little before now: nodes' clocks differ
NAMES = ("ca.crt", "ca.key", "node.crt", "node.key")
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


@dataclass(frozen=True)
class CertFiles:
    """What ``create_certs`` wrote: the CA's certificate and key (not written with ``ca_from``),
    the node's certificate and key."""

    ca: Path
    ca_key: Path
    cert: Path
    key: Path


def default_hosts() -> list[str]:
    """``localhost``, ``127.0.0.1``, this machine's host name and its address on the default route
    (the node address Ray takes when it does not listen on loopback only)."""
    return list(dict.fromkeys(["localhost", "127.0.0.1", socket.gethostname(), *routable_address()]))


def routable_address() -> list[str]:
    """This machine's address on its default route, as Ray finds its node address (a UDP socket
    "connected" to a public address sends nothing); none without a route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("8.8.8.8", 53))
            return [str(probe.getsockname()[0])]
    except OSError:
        return []


def check_host(host: str) -> str:
    """An IP address or a DNS name (``*.`` in front allowed); a ConfigError otherwise."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host[2:] if host.startswith("*.") else host
    labels = name.rstrip(".").split(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(f"--hosts {host!r}: not an IP address or a DNS name (letters, digits, '-', '.')")
    return host


def create_certs(
    folder: Path, hosts: Sequence[str], *, days: int = NODE_DAYS, ca_from: Path | None = None
) -> CertFiles:
    """Write a new CA and a node certificate for ``hosts`` into ``folder`` (made 0700 if missing).

    ``ca_from``: a folder holding ca.crt and ca.key (what an earlier call wrote): sign with that CA
    instead, and write its certificate beside the node's, but not its key. That is how a node whose
    address is known only when it starts (a pod, a container) gets a certificate for it.

    Refuses, before anything is written, when any file it would write exists already: a CA that is
    replaced leaves every node holding the old one unable to talk to the others.
    """
    if not hosts:
        raise ConfigError("--hosts: give at least one host name or IP address")
    if not 1 <= days <= CA_DAYS:
        raise ConfigError(f"--days {days}: from 1 to {CA_DAYS}")
    hosts = [check_host(host) for host in hosts]
    files = CertFiles(*(folder / name for name in NAMES))
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder} exists and is not a folder")
    paths = (files.ca, files.cert, files.key, *([files.ca_key] if ca_from is None else []))
    taken = [str(path) for path in paths if path.exists() or path.is_symlink()]
    if taken:
        raise ConfigError(f"{', '.join(taken)} already exist: certs create never overwrites; choose another folder")
    ca_cert, ca_key = _new_ca() if ca_from is None else _load_ca(ca_from)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {folder}: {err.strerror or err}") from None
    node_key = ec.generate_private_key(ec.SECP256R1())
    node_cert = _node_certificate(node_key, ca_cert, ca_key, hosts, days)
    if ca_from is None:
        _write(files.ca_key, _key_pem(ca_key), 0o600)
    _write(files.ca, _cert_pem(ca_cert), 0o644)
    _write(files.key, _key_pem(node_key), 0o600)
    _write(files.cert, _cert_pem(node_cert), 0o644)
    return files


def _new_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    # A name of its own, so that two clusters' CAs can be told apart (openssl x509 -noout -subject).
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"trainforge cluster CA {secrets.token_hex(4)}")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_cert, ca_key


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA ``certs create`` wrote into ``folder`` (ca.crt, ca.key), checked to be one: its key
    held as ``cluster.tls.key`` must be (config/schema.py's unsafe_mode), its certificate in its period."""
    where = f"--ca-from {folder}"
    try:
        problem = unsafe_mode((folder / "ca.key").stat().st_mode, private=True)
        if problem is not None:
            raise ConfigError(f"--ca-from {folder}: ca.key: {problem}")
        # Regular files only, and bounded: a FIFO named ca.key would block the read for ever.
        cert = x509.load_pem_x509_certificate(
            read_user_file(folder / "ca.crt", f"{where}: ca.crt", PEM_MAX, ConfigError)
        )
        pem_key = read_user_file(folder / "ca.key", f"{where}: ca.key", PEM_MAX, ConfigError)
        key = serialization.load_pem_private_key(pem_key, password=None)
    except OSError as err:
        raise ConfigError(f"--ca-from {folder}: {err.strerror or err} ({getattr(err, 'filename', '')})") from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"--ca-from {folder}: ca.crt and ca.key are not a PEM certificate and key ({err})") from None
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not is_ca or key.public_key() != cert.public_key():
        raise ConfigError(f"--ca-from {folder}: ca.key is not the key of the CA in ca.crt (certs create writes both)")
    if datetime.datetime.now(datetime.timezone.utc) > cert.not_valid_after_utc:
        expired = cert.not_valid_after_utc.strftime("%Y-%m-%d %H:%M UTC")
        raise ConfigError(f"--ca-from {folder}: the CA in ca.crt expired on {expired}; make a new CA (certs create)")
    return cert, key


def _node_certificate(
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    hosts: Sequence[str],
    days: int,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0][:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName([_general_name(host) for host in hosts]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (a key is never readable by others, not even
    for an instant), refusing one that appeared meanwhile."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        raise ConfigError(f"{path} already exists: certs create never overwrites; choose another folder") from None
    except OSError as err:
        raise ConfigError(f"cannot write {path}: {err.strerror or err}") from None
    with os.fdopen(descriptor, "wb") as file:
        os.fchmod(file.fileno(), mode)  # the umask may have narrowed the mode open used
        file.write(data)
