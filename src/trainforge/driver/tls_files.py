"""What Ray's TLS files must be, checked with ``cryptography`` before Ray starts.

Ray (its C++ core and gRPC) reads ``RAY_TLS_CA_CERT``, ``RAY_TLS_SERVER_CERT`` and
``RAY_TLS_SERVER_KEY`` without judging them: an expired certificate, one of another CA, a key that
is not the certificate's or a certificate that does not name the node's address all let Ray start
its processes, whose handshakes then fail and are retried for minutes. So each is checked here,
where the files are named by the key that gave them (``cluster.tls.cert``, or the variable), and
a problem is one line before Ray is imported.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from trainforge.config.schema import TlsConfig, unsafe_mode
from trainforge.errors import ConfigError

MAX_BYTES = 1 << 20  # a CA bundle with a few hundred certificates; read no further
_PEM_LABEL = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----")
_KEY_LABEL = re.compile(r"PRIVATE KEY$")


@dataclass(frozen=True)
class TlsFiles:
    """The three files and the names they were given by (what an error says)."""

    ca: str
    cert: str
    key: str
    names: tuple[str, str, str]  # of ca, cert, key

    @classmethod
    def of_config(cls, tls: TlsConfig) -> TlsFiles:
        return cls(tls.ca, tls.cert, tls.key, ("cluster.tls.ca", "cluster.tls.cert", "cluster.tls.key"))


def check_tls_files(files: TlsFiles, now: datetime.datetime | None = None) -> None:
    """Each file readable and of its kind; the certificate in its validity period, signed by a CA
    of the CA file (a CA, in its period), and the key's; a ConfigError naming the key otherwise."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca_name, cert_name, key_name = files.names
    cas = _certificates(files.ca, ca_name)
    usable = _usable(cas, files.ca, ca_name, now, anchors_only=True)
    chain = _certificates(files.cert, cert_name)
    for cert in chain:
        _check_period(cert, files.cert, cert_name, now)
    signer = _signer(chain, cas, files)
    if signer not in usable:
        raise ConfigError(f"{ca_name} {files.ca}: {_problem(signer, now, anchors_only=True)}")
    key = _private_key(files.key, key_name)
    unsigned = _handshake_key_problem(key)
    if unsigned is not None:
        raise ConfigError(f"{key_name} {files.key}: {unsigned}")
    if _public_der(key.public_key()) != _public_der(chain[0].public_key()):
        raise ConfigError(
            f"{key_name} {files.key}: not the key of the certificate in {cert_name} {files.cert} "
            "(certs create writes them as a pair: node.crt and node.key)"
        )


@dataclass(frozen=True)
class Expiry:
    """When the first of the files' certificates (the node's chain and the CA that signed it)
    stops being valid, and which one that is (what a message names)."""

    at: datetime.datetime
    name: str  # the key that gave the file
    path: str
    subject: str


def earliest_expiry(files: TlsFiles) -> Expiry:
    """The first certificate to expire among those a handshake of ``files`` uses (the files were
    checked by ``check_tls_files``)."""
    cas = _certificates(files.ca, files.names[0])
    chain = _certificates(files.cert, files.names[1])
    used = [(cert, files.names[1], files.cert) for cert in chain]
    used.append((_signer(chain, cas, files), files.names[0], files.ca))
    cert, name, path = min(used, key=lambda entry: entry[0].not_valid_after_utc)
    return Expiry(cert.not_valid_after_utc, name, path, _subject(cert))


def check_trust_file(path: str, name: str, now: datetime.datetime | None = None) -> None:
    """A CA file that ``submit`` and ``jobs`` check a dashboard's certificate with: PEM
    certificates, no private key, at least one in its validity period (a proxy's own self-signed
    certificate, no CA, is a trust anchor too: not refused for that)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    _usable(_certificates(path, name), path, name, now, anchors_only=False)


def _usable(
    cas: list[x509.Certificate], path: str, name: str, now: datetime.datetime, *, anchors_only: bool
) -> list[x509.Certificate]:
    """The certificates of a CA file that can vouch for a peer; a ConfigError when none can (a
    bundle may hold an expired one beside the one in use, as TLS libraries allow)."""
    usable = [ca for ca in cas if _problem(ca, now, anchors_only=anchors_only) is None]
    if not usable:
        raise ConfigError(f"{name} {path}: {_problem(cas[0], now, anchors_only=anchors_only)}")
    return usable


def _problem(cert: x509.Certificate, now: datetime.datetime, *, anchors_only: bool) -> str | None:
    if now > cert.not_valid_after_utc:
        return f"{_subject(cert)} expired on {_date(cert.not_valid_after_utc)} (now {_date(now)}); make a new one"
    if now < cert.not_valid_before_utc:
        return (
            f"{_subject(cert)} is not valid before {_date(cert.not_valid_before_utc)} "
            f"(now {_date(now)}: is this machine's clock right?)"
        )
    if anchors_only and not _is_ca(cert):
        return (
            f"{_subject(cert)} is not a CA certificate (no basicConstraints CA:TRUE); "
            "give the CA's certificate (certs create's ca.crt)"
        )
    return None


def check_node_address(files: TlsFiles, address: str) -> None:
    """The certificate names ``address`` (an IP address) in its subjectAltName, as gRPC requires
    of a peer dialled by IP: Ray's processes dial each other at the node's address."""
    cert = _certificates(files.cert, files.names[1])[0]
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        ips = names.get_values_for_type(x509.IPAddress)
    except x509.ExtensionNotFound:
        ips = []
    if ipaddress.ip_address(address) not in ips:
        shown = ", ".join(str(ip) for ip in ips) or "none"
        raise ConfigError(
            f"{files.names[1]} {files.cert}: does not name this node's address {address} (its IP addresses: "
            f"{shown}), and Ray's processes dial each other there; trainforge certs create --hosts {address},..."
        )


def check_handshake(files: TlsFiles, address: str) -> None:
    """A mutual TLS handshake of the files with themselves, in memory, as two of a local Ray's
    processes make it: the server presents ``cert`` and asks for the client's, the client dials
    ``address``; each checks the other's certificate with ``ca``. What the checks above did not
    foresee (an extension or algorithm TLS refuses, a usage that excludes client or server) fails
    here in a second, not in Ray's retries."""
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client_side = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        for context in (server_side, client_side):
            context.load_verify_locations(files.ca)
            context.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(
            f"{files.names[1]} {files.cert}: TLS does not load it with {files.names[2]} ({err})"
        ) from None
    server_side.verify_mode = ssl.CERT_REQUIRED
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_side.wrap_bio(to_server, to_client, server_side=True)
    client = client_side.wrap_bio(to_client, to_server, server_hostname=address)
    done = {"server": False, "client": False}
    for _ in range(16):  # TLS 1.3 takes three flights; each round moves one
        for side, end in (("client", client), ("server", server)):
            if done[side]:
                continue
            try:
                end.do_handshake()
                done[side] = True
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except ssl.SSLError as err:
                said = getattr(err, "verify_message", None) or err.reason or str(err)
                who = "the client refuses the server's" if side == "client" else "the server refuses the client's"
                raise ConfigError(
                    f"{files.names[1]} {files.cert}: in a TLS handshake of these files with themselves at {address}, "
                    f"as Ray's processes make it, {who} certificate ({said})"
                ) from None
        if all(done.values()):
            return
    raise ConfigError(f"{files.names[1]} {files.cert}: a TLS handshake of these files with themselves did not finish")


def _read(path: str, name: str, *, private: bool) -> bytes:
    try:
        # O_NONBLOCK: a FIFO's open would wait for a writer; the check below refuses it instead.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"{name} {path}: not a regular file")
            problem = unsafe_mode(info.st_mode, private=private)
            if problem is not None:
                raise ConfigError(f"{name} {path}: {problem}")
            data = file.read(MAX_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{name} {path}: {err.strerror or err}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{name} {path}: larger than {MAX_BYTES >> 20} MiB, not a PEM certificate or key")
    return data


def _labels(data: bytes) -> list[str]:
    return [label.decode() for label in _PEM_LABEL.findall(data)]


def _certificates(path: str, name: str) -> list[x509.Certificate]:
    data = _read(path, name, private=False)
    labels = _labels(data)
    if any(_KEY_LABEL.search(label) for label in labels):
        said = "beside its certificate" if "CERTIFICATE" in labels else "a key, not a certificate"
        raise ConfigError(
            f"{name} {path}: holds a private key ({said}); certificates are readable by every user: "
            "keep the key in its own file (cluster.tls.key, mode 0600)"
        )
    if "CERTIFICATE" not in labels:
        raise ConfigError(f"{name} {path}: not a PEM certificate (no BEGIN CERTIFICATE block)")
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as err:
        raise ConfigError(f"{name} {path}: not a readable PEM certificate ({_first_line(err)})") from None


def _private_key(path: str, name: str) -> PrivateKeyTypes:
    data = _read(path, name, private=True)
    labels = _labels(data)
    if not any(_KEY_LABEL.search(label) for label in labels):
        said = "a certificate, not a private key" if "CERTIFICATE" in labels else "not a PEM private key"
        raise ConfigError(f"{name} {path}: {said}; give the node's key (certs create's node.key)")
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise ConfigError(f"{name} {path}: the key is encrypted, and Ray reads keys without a password") from None
    except (ValueError, UnsupportedAlgorithm) as err:
        raise ConfigError(f"{name} {path}: not a readable PEM private key ({_first_line(err)})") from None


# Ray's gRPC (BoringSSL) signs TLS handshakes with RSA and ECDSA on these curves only, by default:
# Python's OpenSSL handshakes with Ed25519 or P-521 too, but Ray's peers then refuse every handshake
# (NO_COMMON_SIGNATURE_ALGORITHMS) and retry. A CA's own key type is free: only the node key signs.
_HANDSHAKE_CURVES = frozenset({"secp256r1", "secp384r1"})


def _handshake_key_problem(key: PrivateKeyTypes) -> str | None:
    if isinstance(key, rsa.RSAPrivateKey):
        return None
    if isinstance(key, ec.EllipticCurvePrivateKey):
        if key.curve.name in _HANDSHAKE_CURVES:
            return None
        what = f"an EC key on {key.curve.name}"
    else:
        kind = type(key).__name__.removeprefix("_").replace("PrivateKey", "")
        what = f"{'an' if kind[:1] in 'AEIOU' else 'a'} {kind} key"
    return (
        f"{what}: Ray's gRPC (BoringSSL) signs TLS handshakes with RSA or ECDSA P-256/P-384 keys only, and "
        "its processes would refuse each other's handshakes; make the node's key one of those "
        "(trainforge certs create makes P-256)"
    )


def _check_period(cert: x509.Certificate, path: str, name: str, now: datetime.datetime) -> None:
    problem = _problem(cert, now, anchors_only=False)
    if problem is not None:
        raise ConfigError(f"{name} {path}: {problem}")


def _signer(chain: list[x509.Certificate], cas: list[x509.Certificate], files: TlsFiles) -> x509.Certificate:
    """The certificate of the CA file that the certificate leads to: directly, or through the
    intermediates that follow it in its file (each checked for its issuer's name and signature)."""
    current, intermediates = chain[0], chain[1:]
    for _ in range(len(chain)):
        signer = next((ca for ca in cas if _issued_by(current, ca)), None)
        if signer is not None:
            return signer
        parent = next((cert for cert in intermediates if _is_ca(cert) and _issued_by(current, cert)), None)
        if parent is None:
            break
        current = parent
    raise ConfigError(
        f"{files.names[1]} {files.cert}: not signed by the CA in {files.names[0]} {files.ca} (issuer: "
        f"{current.issuer.rfc4514_string() or 'none'}; the CA: {', '.join(_subject(ca) for ca in cas)}); "
        "Ray's peers refuse it: sign it with the cluster's CA (trainforge certs create --ca-from)"
    )


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)  # the issuer's name, then the signature with its key
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _public_der(key: object) -> bytes:
    public_bytes = getattr(key, "public_bytes", None)
    if public_bytes is None:
        return b""
    data: bytes = public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return data


def _subject(cert: x509.Certificate) -> str:
    return repr(cert.subject.rfc4514_string() or "(no subject)")


def _date(when: datetime.datetime) -> str:
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def env_files(environ: dict[str, str] | os._Environ[str]) -> TlsFiles:
    """The files Ray's TLS variables name (set in the environment, not by ``cluster.tls``)."""
    names = ("RAY_TLS_CA_CERT", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY")
    missing = [name for name in names if not environ.get(name)]
    if missing:
        raise ConfigError(
            f"RAY_USE_TLS is set but {', '.join(missing)} not: Ray's TLS needs the CA, certificate and key"
        )
    ca, cert, key = (str(Path(environ[name]).expanduser()) for name in names)
    return TlsFiles(ca, cert, key, names)
