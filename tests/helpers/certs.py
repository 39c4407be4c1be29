"""Node certificates of a chosen validity period, signed by a CA that ``certs create`` wrote:
what the TLS tests put in place of the node's certificate (same key, same names)."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from trainforge.driver.certs import CertFiles


def reissue(files: CertFiles, not_before: datetime.datetime, not_after: datetime.datetime) -> bytes:
    """A PEM certificate for the node's key and names, valid from ``not_before`` to ``not_after``."""
    ca_cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    node = x509.load_pem_x509_certificate(files.cert.read_bytes())
    node_key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey) and isinstance(node_key, ec.EllipticCurvePrivateKey)
    builder = (
        x509.CertificateBuilder()
        .subject_name(node.subject)
        .issuer_name(ca_cert.subject)
        .public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )
    for extension in node.extensions:
        builder = builder.add_extension(extension.value, critical=extension.critical)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def replace_cert(files: CertFiles, not_before: datetime.datetime, not_after: datetime.datetime) -> None:
    """Put a reissued certificate in place of ``files.cert`` (a rename: a reader sees one or the other)."""
    staged = Path(f"{files.cert}.new")
    staged.write_bytes(reissue(files, not_before, not_after))
    staged.chmod(0o644)
    staged.replace(files.cert)
