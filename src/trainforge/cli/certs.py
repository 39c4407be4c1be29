"""``trainforge certs create``: a CA and a node certificate for a Ray cluster's TLS (``cluster.tls``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Certificates for the cluster's TLS (cluster.tls).", no_args_is_help=True)


@app.command("create")
def certs_create(
    folder: Annotated[Path, typer.Argument(help="Folder to write ca.crt, ca.key, node.crt, node.key into.")],
    hosts: Annotated[
        list[str] | None,
        typer.Option(
            "--hosts",
            help="Host names and IP addresses every node and driver is dialled by (repeatable, or comma-separated); "
            "default: localhost, 127.0.0.1, this machine's host name and its address on the default route.",
        ),
    ] = None,
    days: Annotated[int, typer.Option(help="Days the node certificate is valid (the CA: 10 years).")] = 365,
    ca_from: Annotated[
        Path | None,
        typer.Option(
            "--ca-from",
            help="Sign with the CA in this folder (ca.crt, ca.key) instead of making one: a node certificate for "
            "an address known only at start (a pod's or container's IP). FOLDER gets ca.crt, node.crt, node.key.",
        ),
    ] = None,
) -> None:
    """Make a CA and a node certificate it signs (ECDSA P-256; keys 0600), for Ray's mutual TLS.

    Every node and every driver gets ca.crt, node.crt and node.key (cluster.tls, or Ray's
    RAY_TLS_* variables); ca.key stays with you. Existing files are never overwritten.
    """
    from trainforge.errors import ConfigError
    from trainforge.files import check_output_path

    check_output_path(folder, "FOLDER", "folder", ConfigError)
    from trainforge.driver.certs import create_certs, default_hosts

    names = [part.strip() for given in hosts or [] for part in given.split(",") if part.strip()]
    made = create_certs(folder, names or default_hosts(), days=days, ca_from=ca_from)
    typer.echo(f"CA certificate:   {made.ca}")
    if ca_from is None:
        typer.echo(f"CA key:           {made.ca_key} (keep it off the nodes: it signs new certificates)")
    typer.echo(f"node certificate: {made.cert} (for: {', '.join(names or default_hosts())})")
    typer.echo(f"node key:         {made.key}")
    typer.echo("in a run config:")
    typer.echo(f"  cluster:\n    tls: {{ca: {made.ca}, cert: {made.cert}, key: {made.key}}}")
