"""``cluster.tls`` for Ray: the environment Ray reads its TLS settings from.

Ray 2.60 reads ``RAY_USE_TLS``, ``RAY_TLS_SERVER_CERT``, ``RAY_TLS_SERVER_KEY`` and
``RAY_TLS_CA_CERT`` in two places: its C++ core reads them once, when ``ray._raylet`` is loaded
(``import ray``), and its Python gRPC helpers at each channel. Every process a local Ray starts
(GCS, raylet, workers) inherits the driver's environment. So the variables must be in this
process's environment before Ray is imported; ``use_tls`` puts them there, and refuses (one line)
when Ray was imported first without them: a driver speaking plain gRPC to a TLS cluster only
times out.

Ray's dashboard (the Jobs API) serves plain HTTP whatever these say; ``dashboard_verify`` is how
``submit`` and ``jobs`` check the certificate of a TLS proxy in front of it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import ssl
import stat
import sys
from pathlib import Path
from urllib.parse import urlparse

from trainforge.config.schema import TlsConfig
from trainforge.driver.tls_files import (
    TlsFiles,
    check_handshake,
    check_node_address,
    check_tls_files,
    check_trust_file,
    env_files,
)
from trainforge.errors import ClusterError, ConfigError

USE_TLS = "RAY_USE_TLS"
CERT = "RAY_TLS_SERVER_CERT"
KEY = "RAY_TLS_SERVER_KEY"
CA = "RAY_TLS_CA_CERT"


def ray_tls_env(tls: TlsConfig) -> dict[str, str]:
    """The four variables for ``tls`` (its paths are absolute: the config made them so)."""
    return {USE_TLS: "1", CERT: tls.cert, KEY: tls.key, CA: tls.ca}


def tls_in_environment() -> bool:
    """Whether Ray in this process uses TLS by its environment (``RAY_USE_TLS`` 1 or true)."""
    return os.environ.get(USE_TLS, "0").lower() in ("1", "true")


def use_tls(tls: TlsConfig | None) -> None:
    """Put ``cluster.tls`` into this process's environment for Ray (nothing for None).

    Called by ``trainforge train``/``tune`` before they import Ray, and again where the run's Ray
    starts or connects (``ray_session``), where Ray is imported: there it only checks that the
    environment already says what the config says. Each time, the files themselves are checked
    (driver/tls_files.py), those of ``cluster.tls`` or, without it, those of ``RAY_TLS_*``: what
    Ray would otherwise retry for minutes is one line, exit 2, before Ray starts.
    """
    if tls is None:
        if tls_in_environment():
            check_tls_files(env_files(os.environ))
        return
    check_tls_files(TlsFiles.of_config(tls))
    wanted = ray_tls_env(tls)
    if all(os.environ.get(name) == value for name, value in wanted.items()):
        return
    if "ray._raylet" in sys.modules:
        raise ClusterError(
            "cluster.tls: Ray was imported before the config set its TLS variables, and Ray reads them "
            f"when it is imported; set {USE_TLS}=1, {CERT}, {KEY} and {CA} in the environment before "
            "starting Python (docs/security.md, TLS)"
        )
    os.environ.update(wanted)


def check_node_tls(tls: TlsConfig | None, node_address: str) -> None:
    """With Ray's TLS on: the certificate names ``node_address``, where this node's Ray listens
    and its peers dial it, and a handshake of the files with themselves there succeeds (nothing
    with TLS off)."""
    if tls is None and not tls_in_environment():
        return
    files = TlsFiles.of_config(tls) if tls is not None else env_files(os.environ)
    check_node_address(files, node_address)
    check_handshake(files, node_address)


def dashboard_verify(address: str, ca: str | None, source: str = "--ca") -> str | bool:
    """How ``submit`` and ``jobs`` check the dashboard's certificate: against ``ca`` (``--ca`` or
    ``cluster.tls.ca``), else against the system's CAs. A CA with an ``http://`` address is refused
    rather than ignored: the token and the job would cross the network in clear."""
    if ca is None:
        return True
    if not address.startswith("https://"):
        raise ConfigError(
            f"{source} {ca} is for a TLS dashboard, but {address} is http://: give its https:// address "
            "(the TLS proxy in front of the dashboard, docs/deploy.md)"
        )
    path = Path(ca).expanduser().absolute()
    try:
        regular = stat.S_ISREG(path.stat().st_mode)
    except OSError as err:
        raise ConfigError(f"{source} {ca}: {err.strerror or err}") from None
    if not regular:
        raise ConfigError(f"{source} {ca}: not a regular file")
    check_trust_file(str(path), source)
    return str(path)


def open_dashboard(recorded: bytes | None) -> str | None:
    """The dashboard's address as the head records it in the GCS for the nodes (``host:port``,
    ``http://`` optional) when it is not on loopback, else None (none recorded: no dashboard).

    Ray's TLS covers its gRPC, not the dashboard's HTTP, and every node's dashboard agent sends the
    node's events (a worker that died, a task killed for memory) to this address over plain HTTP
    with the cluster's token in the request. A head started with ``--dashboard-host=127.0.0.1``
    records 127.0.0.1, where no other node reaches it: those reports then never leave a node."""
    if not recorded:
        return None
    text = recorded.decode(errors="replace")
    try:
        host = urlparse(text if "://" in text else f"http://{text}").hostname
    except ValueError:
        return text
    if host is None:
        return text
    if host == "localhost":
        return None
    with contextlib.suppress(ValueError):  # a host name: taken to be reachable
        if ipaddress.ip_address(host).is_loopback:
            return None
    return text


def check_tls(address: str, timeout_s: float = 5.0) -> None:
    """Before ``ray.init`` connects to ``address``: a TLS handshake with the cluster's GCS (or Ray
    client server), as this process's Ray would make it, so that a mismatch is one line in seconds.
    Ray itself would retry a refused handshake for minutes and then time out without saying why.

    With TLS on here: the cluster's certificate must verify against the CA (for the host dialled)
    and the cluster must accept ours. With TLS off: a cluster that answers a TLS handshake is
    refused, since it would refuse this driver's plain gRPC. Nothing is said when the address
    cannot be reached (``check_reachable`` said it first) or for ``auto``."""
    if address == "auto":
        return
    try:
        parsed = urlparse(address if "://" in address else f"tcp://{address}")
        host, port = parsed.hostname, parsed.port or (10001 if parsed.scheme == "ray" else 6379)
    except ValueError:
        return
    if host is None:
        return
    if tls_in_environment():
        _check_mutual(address, host, port, timeout_s)
    elif speaks_tls(host, port, timeout_s):
        raise ClusterError(
            f"the Ray cluster at {address} uses TLS and this driver does not: set cluster.tls (the cluster's "
            f"CA, a certificate it signed and its key; trainforge certs create), or {USE_TLS}=1 and {CERT}, {KEY}, {CA}"
        )


def _check_mutual(address: str, host: str, port: int, timeout_s: float) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(os.environ[CA])
        context.load_cert_chain(os.environ[CERT], os.environ[KEY])
    except (KeyError, OSError, ssl.SSLError) as err:
        raise ClusterError(f"{USE_TLS} is set but {CA}, {CERT} and {KEY} do not load ({err})") from None
    context.set_alpn_protocols(["h2"])  # as gRPC offers
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            # TLS 1.3: the server checks our certificate after our side of the handshake is done,
            # and says so with an alert; a server that took it waits for HTTP/2 instead.
            tls.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                tls.recv(1)
    except ssl.SSLCertVerificationError as err:
        raise ClusterError(
            f"TLS handshake with the Ray cluster at {address} failed: its certificate does not verify against "
            f"{os.environ[CA]} ({err.verify_message}); is cluster.tls.ca this cluster's CA?"
        ) from None
    except ssl.SSLError as err:
        if not _is_alert(err):
            raise ClusterError(
                f"the Ray cluster at {address} does not use TLS ({USE_TLS} or cluster.tls is set)"
            ) from None
        raise ClusterError(
            f"TLS handshake with the Ray cluster at {address} failed: it refused this driver's certificate "
            f"{os.environ[CERT]} ({err.reason}); cluster.tls.cert must be signed by the cluster's CA"
        ) from None
    except OSError:
        return  # not reachable now: Ray's own connect says so


def speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether the server at host:port completes (or alerts in) a TLS handshake: it speaks TLS."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asking whether it speaks TLS
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, context.wrap_socket(raw):
            return True
    except ssl.SSLError as err:
        return _is_alert(err)
    except OSError:
        return False


def _is_alert(err: ssl.SSLError) -> bool:
    """An alert the peer sent mid-handshake (so it speaks TLS), not garbage or a hang-up in its place."""
    return "ALERT" in str(err.reason or "").upper()
