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

import os
import stat
import sys
from pathlib import Path

from trainforge.config.schema import TlsConfig
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
    environment already says what the config says.
    """
    if tls is None:
        return
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
    return str(path)
