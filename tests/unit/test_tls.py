"""TLS for the cluster, without Ray: ``trainforge certs create`` (a CA and a node certificate that
real TLS handshakes accept and a foreign CA's do not), ``cluster.tls`` (checked files, Ray's
variables set before Ray is imported), and the Jobs API client over https with the CA, against a
loopback HTTPS server that answers as Ray's dashboard does. A TLS cluster of real Ray nodes:
tests/cluster/test_tls.py."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.helpers.console import without_startup
from tests.helpers.runs import tiny_run
from trainforge.cli import main
from trainforge.config import load_config
from trainforge.config.schema import TlsConfig
from trainforge.driver.certs import CertFiles, create_certs, default_hosts
from trainforge.driver.jobs import job_config
from trainforge.driver.tls import check_tls, dashboard_verify, open_dashboard, ray_tls_env, use_tls
from trainforge.driver.tls_files import TlsFiles, check_tls_files
from trainforge.errors import ClusterError, ConfigError

VERSION = {"version": "4", "ray_version": "2.60.0", "ray_commit": "0"}
JOB = {"type": "SUBMISSION", "submission_id": "raysubmit_x", "status": "RUNNING", "entrypoint": "x"}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return create_certs(tmp_path_factory.mktemp("tls") / "certs", ["localhost", "127.0.0.1", "node-1.example"])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """A CA and node certificate for the same hosts, made separately: another cluster's."""
    return create_certs(tmp_path_factory.mktemp("tls") / "other", ["localhost", "127.0.0.1"])


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


# certs create


def test_create_writes_a_ca_and_a_node_certificate_it_signed_for_the_hosts(certs: CertFiles) -> None:
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    node = x509.load_pem_x509_certificate(certs.cert.read_bytes())
    node.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not node.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "node-1.example"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]  # an IP SAN, not DNS
    usages = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}  # Ray's TLS is mutual
    now = datetime.datetime.now(datetime.timezone.utc)
    assert node.not_valid_before_utc < now < node.not_valid_after_utc
    assert 364 <= (node.not_valid_after_utc - now).days <= 365
    assert node.not_valid_after_utc < ca.not_valid_after_utc


def test_keys_are_0600_whatever_the_umask_and_certificates_0644(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        made = create_certs(tmp_path / "c", ["localhost"])
    finally:
        os.umask(old)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (made.ca, made.ca_key, made.cert, made.key)}
    assert modes == {"ca.crt": 0o644, "ca.key": 0o600, "node.crt": 0o644, "node.key": 0o600}
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700


def serve_tls_once(files: CertFiles) -> tuple[int, threading.Thread, list[str]]:
    """A mutual-TLS server as Ray's gRPC servers are (client certificate required, checked with
    the CA); answers one connection with 'ok'; what went wrong lands in the list."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.cert, files.key)
    context.load_verify_locations(files.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    listener = socket.create_server(("127.0.0.1", 0))
    problems: list[str] = []

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError) as err:
                problems.append(str(err))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return int(listener.getsockname()[1]), thread, problems


def client_context(trusted: CertFiles, presented: CertFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(trusted.ca))
    context.load_cert_chain(presented.cert, presented.key)
    return context


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1"])
def test_a_handshake_with_the_node_certificate_succeeds_both_ways_by_name_and_by_ip(
    certs: CertFiles, name: str
) -> None:
    port, thread, problems = serve_tls_once(certs)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        client_context(certs, certs).wrap_socket(raw, server_hostname=name) as tls,
    ):
        assert tls.recv(2) == b"ok"
    thread.join(timeout=10)
    assert problems == []


def test_a_peer_of_another_ca_is_refused_by_server_and_client(certs: CertFiles, foreign: CertFiles) -> None:
    # A client (a node or driver) that trusts our CA but holds another CA's certificate: refused.
    port, thread, problems = serve_tls_once(certs)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        pytest.raises((ssl.SSLError, ConnectionResetError)),
        client_context(certs, foreign).wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.recv(2)
    thread.join(timeout=10)
    assert problems and "CERTIFICATE_VERIFY_FAILED" in problems[0]
    # A client trusting only our CA refuses a server with another CA's certificate.
    port, thread, problems = serve_tls_once(foreign)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        client_context(certs, certs).wrap_socket(raw, server_hostname="localhost")
    thread.join(timeout=10)


def test_a_host_not_in_the_certificate_is_refused(certs: CertFiles) -> None:
    port, thread, _ = serve_tls_once(certs)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        pytest.raises(ssl.SSLCertVerificationError, match="match"),
    ):
        client_context(certs, certs).wrap_socket(raw, server_hostname="10.9.9.9")
    thread.join(timeout=10)


def test_the_cli_writes_the_files_for_the_default_hosts_and_prints_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["certs", "create", str(tmp_path / "c")])
    out = capsys.readouterr().out
    node = x509.load_pem_x509_certificate((tmp_path / "c" / "node.crt").read_bytes())
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    shown = [str(v) for v in names.get_values_for_type(x509.DNSName) + names.get_values_for_type(x509.IPAddress)]
    assert sorted(shown) == sorted(default_hosts())
    assert {"localhost", "127.0.0.1", socket.gethostname()} <= set(default_hosts())
    assert f"tls: {{ca: {tmp_path}/c/ca.crt, cert: {tmp_path}/c/node.crt, key: {tmp_path}/c/node.key}}" in out


def test_the_cli_takes_hosts_repeated_or_comma_separated(tmp_path: Path) -> None:
    main(["certs", "create", str(tmp_path / "c"), "--hosts", "10.213.0.1,head", "--hosts", "w1"])
    node = x509.load_pem_x509_certificate((tmp_path / "c" / "node.crt").read_bytes())
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["head", "w1"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.213.0.1")]


def test_existing_files_are_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "node.key").write_text("mine")
    err = one_error_line(capsys, ["certs", "create", str(folder)])
    assert f"{folder}/node.key already exist" in err and "never overwrites" in err
    assert sorted(p.name for p in folder.iterdir()) == ["node.key"]  # nothing written beside it
    assert (folder / "node.key").read_text() == "mine"


def test_ca_from_signs_a_node_certificate_with_an_existing_ca_and_copies_only_its_certificate(
    certs: CertFiles, foreign: CertFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["certs", "create", str(tmp_path / "pod"), "--ca-from", str(certs.ca.parent), "--hosts", "10.244.1.7"])
    assert "CA key" not in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "pod").iterdir()) == ["ca.crt", "node.crt", "node.key"]
    assert (tmp_path / "pod" / "ca.crt").read_bytes() == certs.ca.read_bytes()
    node = x509.load_pem_x509_certificate((tmp_path / "pod" / "node.crt").read_bytes())
    node.verify_directly_issued_by(x509.load_pem_x509_certificate(certs.ca.read_bytes()))
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.244.1.7")]
    # a folder without the CA's key, and a key that is not the certificate's: one line, nothing written
    err = one_error_line(capsys, ["certs", "create", str(tmp_path / "a"), "--ca-from", str(tmp_path / "pod")])
    assert f"--ca-from {tmp_path}/pod: No such file or directory ({tmp_path}/pod/ca.key)" in err
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "ca.crt").write_bytes(certs.ca.read_bytes())
    (mixed / "ca.key").write_bytes(foreign.ca_key.read_bytes())
    (mixed / "ca.key").chmod(0o600)
    err = one_error_line(capsys, ["certs", "create", str(tmp_path / "b"), "--ca-from", str(mixed)])
    assert "ca.key is not the key of the CA in ca.crt" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--hosts", "bad host"], "--hosts 'bad host': not an IP address or a DNS name"),
        (["--hosts", "-x.example"], "--hosts '-x.example': not an IP address or a DNS name"),
        (["--hosts", ","], "--hosts: give at least one host name or IP address"),
        (["--days", "0"], "--days 0: from 1 to 3650"),
    ],
)
def test_bad_flags_are_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    # "," is no host: the default list is for no --hosts at all, not for an empty one
    if argv == ["--hosts", ","]:
        with pytest.raises(ConfigError, match=said):
            create_certs(tmp_path / "c", [])
        return
    err = one_error_line(capsys, ["certs", "create", str(tmp_path / "c"), *argv])
    assert said in err
    assert not (tmp_path / "c").exists()


# cluster.tls


def tls_set(ca: Path, cert: Path, key: Path) -> str:
    return f"cluster.tls={{ca: {ca}, cert: {cert}, key: {key}}}"


def test_cluster_tls_is_taken_as_absolute_paths(
    certs: CertFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(certs.ca.parent)
    config = load_config(tiny_run(tmp_path), [tls_set(Path("ca.crt"), Path("node.crt"), Path("node.key"))])
    assert config.cluster.tls is not None
    assert ray_tls_env(config.cluster.tls) == {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(certs.cert),
        "RAY_TLS_SERVER_KEY": str(certs.key),
        "RAY_TLS_CA_CERT": str(certs.ca),
    }


def test_bad_tls_files_are_one_line_naming_the_key(
    certs: CertFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_run(tmp_path)))
    show = ["config", "show", str(tmp_path / "run.yaml"), "--set"]
    err = one_error_line(capsys, [*show, tls_set(tmp_path / "missing.crt", certs.cert, certs.key)])
    assert f"cluster.tls.ca {tmp_path}/missing.crt: No such file or directory" in err
    err = one_error_line(capsys, [*show, tls_set(certs.ca, tmp_path, certs.key)])
    assert f"cluster.tls.cert {tmp_path}: not a regular file" in err
    open_key = tmp_path / "open.key"
    open_key.write_bytes(certs.key.read_bytes())
    open_key.chmod(0o644)
    err = one_error_line(capsys, [*show, tls_set(certs.ca, certs.cert, open_key)])
    assert f"cluster.tls.key {open_key}: the private key is readable by every user (mode 0644)" in err
    err = one_error_line(capsys, [*show, f"cluster.tls={{ca: {certs.ca}}}"])
    assert "missing key cluster.tls.cert" in err and "missing key cluster.tls.key" in err


# Ray reads RAY_USE_TLS and the paths when ray._raylet loads, so use_tls must run before `import ray`.
USE_TLS_SCRIPT = """
import os, sys
from trainforge.config import load_config
from trainforge.driver.tls import use_tls
config = load_config(sys.argv[1], [])
if sys.argv[2] == "after":
    import ray
use_tls(config.cluster.tls)
print(os.environ["RAY_USE_TLS"], os.environ["RAY_TLS_CA_CERT"])
"""


def test_use_tls_sets_rays_variables_before_ray_and_refuses_after(certs: CertFiles, tmp_path: Path) -> None:
    run = tiny_run(tmp_path)
    run["cluster"] = {"tls": {"ca": str(certs.ca), "cert": str(certs.cert), "key": str(certs.key)}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_TLS") and k != "RAY_USE_TLS"}
    argv = [sys.executable, "-c", USE_TLS_SCRIPT, str(tmp_path / "run.yaml")]
    before = subprocess.run([*argv, "before"], capture_output=True, text=True, env=env, timeout=120)
    assert before.returncode == 0, before.stderr
    assert before.stdout.split() == ["1", str(certs.ca)]
    after = subprocess.run([*argv, "after"], capture_output=True, text=True, env=env, timeout=120)
    assert after.returncode != 0
    assert "Ray was imported before the config set its TLS variables" in after.stderr
    # Set in the environment before Python started, as on a TLS cluster's nodes: accepted after Ray.
    given = subprocess.run(
        [*argv, "after"], capture_output=True, text=True, env={**env, **ray_tls_env(load_tls(run))}, timeout=120
    )
    assert given.returncode == 0, given.stderr


def load_tls(run: dict[str, Any]) -> TlsConfig:
    return TlsConfig.model_validate(run["cluster"]["tls"])


def tls_of(files: CertFiles) -> TlsConfig:
    return TlsConfig(ca=str(files.ca), cert=str(files.cert), key=str(files.key))


def test_a_submitted_config_leaves_tls_to_the_cluster(certs: CertFiles, tmp_path: Path) -> None:
    config = load_config(tiny_run(tmp_path), [tls_set(certs.ca, certs.cert, certs.key)])
    assert job_config(config)["cluster"]["tls"] is None  # local paths; the nodes' Ray has RAY_TLS_* of its own


# the Jobs API over https


def test_dashboard_verify(certs: CertFiles, tmp_path: Path) -> None:
    assert dashboard_verify("https://head:8443", None) is True
    assert dashboard_verify("https://head:8443", str(certs.ca)) == str(certs.ca)
    with pytest.raises(ConfigError, match=r"--ca .* is for a TLS dashboard, but http://head:8265 is http://"):
        dashboard_verify("http://head:8265", str(certs.ca))
    with pytest.raises(ConfigError, match="not a regular file"):
        dashboard_verify("https://head:8443", str(tmp_path))
    # what is inside: certificates, not a key or garbage, none expired (#36)
    with pytest.raises(ConfigError, match=rf"^--ca {certs.key}: holds a private key \(a key, not a certificate\)"):
        dashboard_verify("https://head:8443", str(certs.key))
    old = signed(tmp_path, "old-ca", certs, key=certs.ca_key, start=-10 * DAY, end=-DAY, ca=True)
    with pytest.raises(ConfigError, match=rf"^cluster.tls.ca {old}: 'CN=old-ca' expired on"):
        dashboard_verify("https://head:8443", str(old), "cluster.tls.ca")
    (tmp_path / "garbage.crt").write_bytes(b"not PEM")
    with pytest.raises(ConfigError, match=r"garbage.crt: not a PEM certificate"):
        dashboard_verify("https://head:8443", str(tmp_path / "garbage.crt"))


@pytest.fixture
def https_dashboard(certs: CertFiles, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """A loopback HTTPS server with the node certificate that answers /api/version and a job as Ray does."""
    for name in ("RAY_ADDRESS", "RAY_JOBS_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = {"/api/version": VERSION, "/api/jobs/raysubmit_x": JOB}.get(self.path)
            payload = json.dumps(body).encode() if body else b"Not Found"
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://localhost:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_jobs_talk_https_with_the_ca(
    https_dashboard: str, certs: CertFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["jobs", "status", "raysubmit_x", "--address", https_dashboard, "--ca", str(certs.ca)])
    assert "RUNNING" in capsys.readouterr().out


def test_a_dashboard_the_ca_did_not_sign_is_refused_in_one_line(
    https_dashboard: str, foreign: CertFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    for ca in (["--ca", str(foreign.ca)], []):  # another CA's, and the system's (which never signed it)
        argv = ["jobs", "status", "raysubmit_x", "--address", https_dashboard, "--wait-for-cluster", "0", *ca]
        err = one_error_line(capsys, argv)
        assert f"error: TLS with the Ray dashboard at {https_dashboard} failed (certificate verify failed)" in err


def test_submit_with_cluster_tls_needs_an_https_address(
    certs: CertFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_run(tmp_path / "runs")))
    argv = ["submit", "run.yaml", "--address", "http://127.0.0.1:8265"]
    argv += ["--set", tls_set(certs.ca, certs.cert, certs.key)]
    err = one_error_line(capsys, argv)
    assert f"error: cluster.tls.ca {certs.ca} is for a TLS dashboard, but http://127.0.0.1:8265 is http://" in err


# the driver's handshake before ray.init (check_tls)


@pytest.fixture
def tls_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def serve_plain_once() -> tuple[int, threading.Thread]:
    """A server that speaks no TLS (as a plain Ray GCS): reads what comes and hangs up."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame, not TLS

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return int(listener.getsockname()[1]), thread


def test_check_tls_passes_a_cluster_of_the_same_ca(certs: CertFiles, tls_environment: pytest.MonkeyPatch) -> None:
    for name, value in ray_tls_env(tls_of(certs)).items():
        tls_environment.setenv(name, value)
    port, thread, problems = serve_tls_once(certs)
    check_tls(f"127.0.0.1:{port}")
    thread.join(timeout=10)
    assert problems == []


def test_check_tls_refuses_in_one_line_what_ray_would_retry_for_minutes(
    certs: CertFiles, foreign: CertFiles, tls_environment: pytest.MonkeyPatch
) -> None:
    # This driver's certificate is another CA's: the cluster refuses it.
    for name, value in {**ray_tls_env(tls_of(certs)), "RAY_TLS_SERVER_CERT": str(foreign.cert)}.items():
        tls_environment.setenv(name, value)
    tls_environment.setenv("RAY_TLS_SERVER_KEY", str(foreign.key))
    port, thread, _ = serve_tls_once(certs)
    with pytest.raises(
        ClusterError, match=r"it refused this driver's certificate .*must be signed by the cluster's CA"
    ):
        check_tls(f"127.0.0.1:{port}")
    thread.join(timeout=10)
    # The cluster's certificate is another CA's.
    for name, value in ray_tls_env(tls_of(certs)).items():
        tls_environment.setenv(name, value)
    port, thread, _ = serve_tls_once(foreign)
    with pytest.raises(ClusterError, match=r"does not verify against .*ca.crt .*is cluster.tls.ca this cluster's CA"):
        check_tls(f"127.0.0.1:{port}")
    thread.join(timeout=10)
    # TLS here, none there.
    port, plain = serve_plain_once()
    with pytest.raises(ClusterError, match=rf"the Ray cluster at 127.0.0.1:{port} does not use TLS"):
        check_tls(f"127.0.0.1:{port}")
    plain.join(timeout=10)


def test_check_tls_without_tls_refuses_a_tls_cluster_and_passes_a_plain_one(
    certs: CertFiles, tls_environment: pytest.MonkeyPatch
) -> None:
    port, thread, _ = serve_tls_once(certs)
    with pytest.raises(ClusterError, match=rf"the Ray cluster at 127.0.0.1:{port} uses TLS and this driver does not"):
        check_tls(f"127.0.0.1:{port}")
    thread.join(timeout=10)
    port, plain = serve_plain_once()
    check_tls(f"127.0.0.1:{port}")
    plain.join(timeout=10)
    check_tls("auto")  # nothing to dial


# the files' contents, checked before Ray starts (driver/tls_files.py)

DAY = datetime.timedelta(days=1)


def signed(
    folder: Path,
    name: str,
    issuer: CertFiles,
    *,
    key: Path | None = None,
    start: datetime.timedelta = -DAY,
    end: datetime.timedelta = DAY,
    ca: bool = False,
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
    signer: Path | None = None,
    usages: tuple[x509.ObjectIdentifier, ...] = (),
) -> Path:
    """A certificate for ``key`` (the issuer's node key by default) in the name of ``issuer``'s CA,
    signed with ``signer`` (the CA's key by default), valid from now+start to now+end."""
    ca_cert = x509.load_pem_x509_certificate(issuer.ca.read_bytes())
    ca_key = serialization.load_pem_private_key((signer or issuer.ca_key).read_bytes(), None)
    subject_key = serialization.load_pem_private_key((key or issuer.key).read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey) and isinstance(subject_key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.timezone.utc)
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(subject_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + start)
        .not_valid_after(now + end)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    path = folder / f"{name}.crt"
    path.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return path


def material_cases(certs: CertFiles, foreign: CertFiles, folder: Path) -> dict[str, tuple[Path, Path, Path, str]]:
    """(ca, cert, key, what the one line says) for each kind of bad TLS material."""
    garbage = folder / "garbage.pem"
    garbage.write_bytes(b"\x00\x01 not PEM at all \xff" * 10)
    garbage.chmod(0o600)
    both = folder / "both.pem"
    both.write_bytes(certs.cert.read_bytes() + certs.key.read_bytes())
    both.chmod(0o600)  # the config's mode rule passes it: the contents are refused
    encrypted = folder / "encrypted.key"
    node_key = serialization.load_pem_private_key(certs.key.read_bytes(), None)
    encrypted.write_bytes(
        node_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    encrypted.chmod(0o600)
    cert_as_key = folder / "cert-as.key"
    cert_as_key.write_bytes(certs.cert.read_bytes())
    cert_as_key.chmod(0o600)
    ca_file = folder / "ca-with-key.pem"
    ca_file.write_bytes(certs.ca_key.read_bytes())
    year = r"\d{4}-\d\d-\d\d \d\d:\d\d UTC"
    return {
        "expired": (
            certs.ca,
            signed(folder, "expired", certs, start=-10 * DAY, end=-DAY),
            certs.key,
            rf"cluster.tls.cert \S+/expired.crt: 'CN=expired' expired on {year} \(now {year}\)",
        ),
        "not yet valid": (
            certs.ca,
            signed(folder, "future", certs, start=DAY, end=10 * DAY),
            certs.key,
            rf"cluster.tls.cert \S+/future.crt: 'CN=future' is not valid before {year}",
        ),
        "another CA's certificate": (
            certs.ca,
            foreign.cert,
            foreign.key,
            r"cluster.tls.cert \S+/other/node.crt: not signed by the CA in cluster.tls.ca \S+/certs/ca.crt",
        ),
        "the CA's name, another key's signature": (
            certs.ca,
            signed(folder, "forged", certs, signer=foreign.ca_key),
            certs.key,
            r"cluster.tls.cert \S+/forged.crt: not signed by the CA in cluster.tls.ca",
        ),
        "a key as the certificate": (
            certs.ca,
            certs.key,
            certs.key,
            r"cluster.tls.cert \S+/node.key: holds a private key \(a key, not a certificate\)",
        ),
        "a certificate and its key in one file": (
            certs.ca,
            both,
            certs.key,
            r"cluster.tls.cert \S+/both.pem: holds a private key \(beside its certificate\)",
        ),
        "a certificate as the key": (
            certs.ca,
            certs.cert,
            cert_as_key,
            r"cluster.tls.key \S+/cert-as.key: a certificate, not a private key",
        ),
        "another certificate's key": (
            certs.ca,
            certs.cert,
            foreign.key,
            r"cluster.tls.key \S+/other/node.key: not the key of the certificate in cluster.tls.cert",
        ),
        "an encrypted key": (certs.ca, certs.cert, encrypted, r"cluster.tls.key \S+: the key is encrypted"),
        "a node certificate as the CA": (
            certs.cert,
            certs.cert,
            certs.key,
            r"cluster.tls.ca \S+/node.crt: 'CN=localhost' is not a CA certificate",
        ),
        "the CA's key as the CA": (
            ca_file,
            certs.cert,
            certs.key,
            r"cluster.tls.ca \S+/ca-with-key.pem: holds a private key",
        ),
        "an expired CA": (
            signed(folder, "old-ca", certs, start=-10 * DAY, end=-DAY, ca=True),
            certs.cert,
            certs.key,
            r"cluster.tls.ca \S+/old-ca.crt: 'CN=old-ca' expired on",
        ),
        "garbage as the certificate": (
            certs.ca,
            garbage,
            certs.key,
            r"cluster.tls.cert \S+/garbage.pem: not a PEM certificate",
        ),
        "garbage as the key": (
            certs.ca,
            certs.cert,
            garbage,
            r"cluster.tls.key \S+/garbage.pem: not a PEM private key",
        ),
    }


CASES = [
    "expired",
    "not yet valid",
    "another CA's certificate",
    "the CA's name, another key's signature",
    "a key as the certificate",
    "a certificate and its key in one file",
    "a certificate as the key",
    "another certificate's key",
    "an encrypted key",
    "a node certificate as the CA",
    "the CA's key as the CA",
    "an expired CA",
    "garbage as the certificate",
    "garbage as the key",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_tls_material_is_one_line_naming_the_key_before_ray(
    certs: CertFiles, foreign: CertFiles, tmp_path: Path, tls_environment: pytest.MonkeyPatch, case: str
) -> None:
    ca, cert, key, said = material_cases(certs, foreign, tmp_path)[case]
    tls = TlsConfig(ca=str(ca), cert=str(cert), key=str(key))
    with pytest.raises(ConfigError, match=said) as raised:
        use_tls(tls)
    assert "\n" not in str(raised.value)
    assert "RAY_USE_TLS" not in os.environ  # refused before Ray's variables are set (and so before Ray)


@pytest.mark.parametrize("kind", ["ed25519", "p521", "secp256k1", "dsa"])
def test_a_node_key_rays_grpc_cannot_sign_handshakes_with_is_one_line(
    certs: CertFiles, tmp_path: Path, tls_environment: pytest.MonkeyPatch, kind: str
) -> None:
    """Python's TLS (OpenSSL) handshakes with an Ed25519 or P-521 node key; Ray's gRPC (BoringSSL)
    does not (NO_COMMON_SIGNATURE_ALGORITHMS: retried without end), nor with DSA or secp256k1.
    The key's type is checked against what BoringSSL signs handshakes with, for local and remote Ray."""
    from cryptography.hazmat.primitives.asymmetric import dsa, ed25519

    key = {
        "ed25519": lambda: ed25519.Ed25519PrivateKey.generate(),
        "p521": lambda: ec.generate_private_key(ec.SECP521R1()),
        "secp256k1": lambda: ec.generate_private_key(ec.SECP256K1()),
        "dsa": lambda: dsa.generate_private_key(2048),
    }[kind]()
    ca_cert = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - DAY)
        .not_valid_after(now + DAY)
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (tmp_path / "node.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp_path / "node.key").write_bytes(pem)
    (tmp_path / "node.key").chmod(0o600)
    tls = TlsConfig(ca=str(certs.ca), cert=str(tmp_path / "node.crt"), key=str(tmp_path / "node.key"))
    said = r"^cluster.tls.key \S+/node.key: an? .*: Ray's gRPC \(BoringSSL\) signs TLS handshakes with RSA or "
    said += "ECDSA P-256/P-384 keys only"
    with pytest.raises(ConfigError, match=said):
        use_tls(tls)
    with pytest.raises(ConfigError, match=said):
        check_tls_files(TlsFiles.of_config(tls))  # also for a remote cluster's files


def test_good_tls_material_passes_with_a_chain_and_a_bundle(
    certs: CertFiles, foreign: CertFiles, tmp_path: Path
) -> None:
    check_tls_files(TlsFiles.of_config(tls_of(certs)))
    # the node certificate followed by an intermediate CA the cluster's CA signed; a CA file of two CAs
    inter_key = tmp_path / "inter.key"
    inter_key.write_bytes(foreign.ca_key.read_bytes())
    intermediate = signed(tmp_path, "intermediate", certs, key=inter_key, ca=True)
    as_issuer = CertFiles(ca=intermediate, ca_key=inter_key, cert=certs.cert, key=certs.key)
    leaf = signed(tmp_path, "leaf", as_issuer)
    chain = tmp_path / "chain.crt"
    chain.write_bytes(leaf.read_bytes() + intermediate.read_bytes())
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(foreign.ca.read_bytes() + certs.ca.read_bytes())
    check_tls_files(TlsFiles(str(bundle), str(chain), str(certs.key), ("ca", "cert", "key")))
    with pytest.raises(ConfigError, match=r"cert .*/leaf.crt: not signed by the CA"):
        check_tls_files(TlsFiles(str(certs.ca), str(leaf), str(certs.key), ("ca", "cert", "key")))
    # an expired CA beside the one in use is let be, as TLS lets it be; the one that signed must be valid
    old_key = tmp_path / "old.key"
    old_key.write_bytes(foreign.key.read_bytes())
    old = signed(tmp_path, "old-ca", certs, key=old_key, start=-10 * DAY, end=-DAY, ca=True)
    mixed = tmp_path / "mixed.crt"
    mixed.write_bytes(old.read_bytes() + certs.ca.read_bytes())
    check_tls_files(TlsFiles(str(mixed), str(certs.cert), str(certs.key), ("ca", "cert", "key")))
    by_old = signed(tmp_path, "by-old", CertFiles(ca=old, ca_key=old_key, cert=certs.cert, key=certs.key))
    with pytest.raises(ConfigError, match=r"^ca \S+/mixed.crt: 'CN=old-ca' expired on"):
        check_tls_files(TlsFiles(str(mixed), str(by_old), str(certs.key), ("ca", "cert", "key")))


def test_a_file_gone_or_unreadable_at_the_check_is_one_line(
    certs: CertFiles, tmp_path: Path, tls_environment: pytest.MonkeyPatch
) -> None:
    key = tmp_path / "node.key"
    key.write_bytes(certs.key.read_bytes())
    key.chmod(0o600)
    tls = TlsConfig(ca=str(certs.ca), cert=str(certs.cert), key=str(key))
    if os.geteuid() != 0:  # root reads a file of mode 0000
        key.chmod(0)
        with pytest.raises(ConfigError, match=rf"^cluster.tls.key {key}: Permission denied$"):
            use_tls(tls)
    key.unlink()  # the config was loaded; the file went before Ray would read it
    with pytest.raises(ConfigError, match=rf"^cluster.tls.key {key}: No such file or directory$"):
        use_tls(tls)


def test_ray_tls_variables_set_outside_the_config_are_checked_and_named(
    certs: CertFiles, foreign: CertFiles, tmp_path: Path, tls_environment: pytest.MonkeyPatch
) -> None:
    for name, value in {**ray_tls_env(tls_of(certs)), "RAY_TLS_SERVER_KEY": str(foreign.key)}.items():
        tls_environment.setenv(name, value)
    with pytest.raises(ConfigError, match=r"^RAY_TLS_SERVER_KEY \S+/other/node.key: not the key of the certificate"):
        use_tls(None)
    open_key = tmp_path / "open.key"
    open_key.write_bytes(certs.key.read_bytes())
    open_key.chmod(0o644)
    tls_environment.setenv("RAY_TLS_SERVER_KEY", str(open_key))
    with pytest.raises(ConfigError, match=r"^RAY_TLS_SERVER_KEY \S+: the private key is readable by every user"):
        use_tls(None)
    tls_environment.delenv("RAY_TLS_CA_CERT")
    with pytest.raises(ConfigError, match="RAY_USE_TLS is set but RAY_TLS_CA_CERT not"):
        use_tls(None)
    tls_environment.setenv("RAY_USE_TLS", "0")
    use_tls(None)  # TLS off: nothing to check


def test_a_fifo_named_by_a_ray_tls_variable_is_one_line_not_a_wait(certs: CertFiles, tmp_path: Path) -> None:
    """``RAY_TLS_CA_CERT`` naming a FIFO: the check's open blocked for ever waiting for a writer
    (cluster.tls is refused earlier, by the config's own check). Run in a child, bounded."""
    fifo = tmp_path / "ca.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, **ray_tls_env(tls_of(certs)), "RAY_TLS_CA_CERT": str(fifo)}
    script = "from trainforge.driver.tls import use_tls\nuse_tls(None)"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"ConfigError: RAY_TLS_CA_CERT {fifo}: not a regular file" in done.stderr


def test_train_with_an_expired_certificate_exits_2_in_one_line_and_starts_no_ray(
    certs: CertFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str], tls_environment: pytest.MonkeyPatch
) -> None:
    import ray

    from trainforge.driver import ray_session

    expired = signed(tmp_path, "expired", certs, start=-10 * DAY, end=-DAY)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_run(tmp_path / "runs")))
    argv = ["train", str(tmp_path / "run.yaml"), "--set", tls_set(certs.ca, expired, certs.key)]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = without_startup(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"error: cluster.tls.cert {expired}: 'CN=expired' expired on")
    assert not ray.is_initialized() and "ray" not in ray_session._early
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_local_ray_needs_a_certificate_naming_its_node_address(
    certs: CertFiles, tmp_path: Path, tls_environment: pytest.MonkeyPatch
) -> None:
    from trainforge.driver.ray_session import check_local_tls

    elsewhere = signed(tmp_path, "elsewhere", certs, hosts=("localhost", "10.1.2.3"))  # a name is not an address
    config = load_config(tiny_run(tmp_path), [tls_set(certs.ca, elsewhere, certs.key)])
    with pytest.raises(
        ConfigError,
        match=rf"^cluster.tls.cert {elsewhere}: does not name this node's address 127.0.0.1 "
        r"\(its IP addresses: 10.1.2.3\)",
    ):
        check_local_tls(config)  # before start_early or start_local starts Ray
    check_local_tls(load_config(tiny_run(tmp_path), [tls_set(certs.ca, certs.cert, certs.key)]))
    # What the file checks do not judge, a real handshake of the files with themselves does:
    # a certificate for servers only is refused when it acts as a client, as Ray's processes all do.
    server_only = signed(tmp_path, "server-only", certs, usages=(ExtendedKeyUsageOID.SERVER_AUTH,))
    config = load_config(tiny_run(tmp_path), [tls_set(certs.ca, server_only, certs.key)])
    with pytest.raises(
        ConfigError,
        match=rf"^cluster.tls.cert {server_only}: in a TLS handshake of these files with themselves at 127.0.0.1, "
        r"as Ray's processes make it, the server refuses the client's certificate \(unsuitable certificate purpose\)$",
    ):
        check_local_tls(config)
    check_local_tls(load_config(tiny_run(tmp_path)))  # no TLS: nothing to check


def test_ca_from_refuses_a_ca_key_others_may_read_or_an_expired_ca(
    certs: CertFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ca.crt").write_bytes(certs.ca.read_bytes())
    (shared / "ca.key").write_bytes(certs.ca_key.read_bytes())
    (shared / "ca.key").chmod(0o644)
    err = one_error_line(capsys, ["certs", "create", str(tmp_path / "a"), "--ca-from", str(shared)])
    assert f"--ca-from {shared}: ca.key: the private key is readable by every user (mode 0644); chmod 600 it" in err
    (shared / "ca.key").chmod(0o602)
    err = one_error_line(capsys, ["certs", "create", str(tmp_path / "a"), "--ca-from", str(shared)])
    assert "ca.key: writable by every user (mode 0602)" in err
    (shared / "ca.key").chmod(0o600)
    old_ca = signed(tmp_path, "old-ca", certs, key=certs.ca_key, start=-10 * DAY, end=-DAY, ca=True)
    (shared / "ca.crt").write_bytes(old_ca.read_bytes())
    err = one_error_line(capsys, ["certs", "create", str(tmp_path / "a"), "--ca-from", str(shared)])
    assert f"--ca-from {shared}: the CA in ca.crt expired on" in err
    assert not (tmp_path / "a").exists()


def test_ca_from_reads_regular_files_only(certs: CertFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO named ca.crt or ca.key blocked ``certs create --ca-from`` for ever; a folder there was
    an unexplained OSError: each is one line, nothing written."""
    for name, make in [("ca.crt", os.mkfifo), ("ca.key", os.mkfifo), ("ca.crt", os.mkdir)]:
        shared = tmp_path / f"shared-{name}-{make.__name__}"
        shared.mkdir()
        (shared / "ca.crt").write_bytes(certs.ca.read_bytes())
        (shared / "ca.key").write_bytes(certs.ca_key.read_bytes())
        (shared / "ca.key").chmod(0o600)
        (shared / name).unlink()
        make(shared / name)
        (shared / name).chmod(0o600)
        err = one_error_line(capsys, ["certs", "create", str(tmp_path / "a"), "--ca-from", str(shared)])
        assert f"--ca-from {shared}: {name}: " in err and "not a regular file" in err, err
    assert not (tmp_path / "a").exists()


def test_a_tls_file_every_user_may_replace_is_refused(certs: CertFiles, tmp_path: Path) -> None:
    open_ca = tmp_path / "ca.crt"
    open_ca.write_bytes(certs.ca.read_bytes())
    open_ca.chmod(0o666)
    with pytest.raises(ConfigError, match=rf"cluster.tls.ca {open_ca}: writable by every user \(mode 0666\)"):
        load_config(tiny_run(tmp_path), [tls_set(open_ca, certs.cert, certs.key)])


@pytest.mark.parametrize(
    ("recorded", "open_at"),
    [
        (None, None),  # no dashboard
        (b"127.0.0.1:8265", None),  # --dashboard-host=127.0.0.1 (Ray records loopback as given)
        (b"localhost:8265", None),
        (b"[::1]:8265", None),
        (b"10.213.0.1:8265", "10.213.0.1:8265"),  # --dashboard-host=0.0.0.0: the head's node address
        (b"http://10.213.0.1:8265", "http://10.213.0.1:8265"),
        (b"[fd00::1]:8265", "[fd00::1]:8265"),
        (b"ray-head:8265", "ray-head:8265"),  # a name: taken to be reachable
    ],
)
def test_a_dashboard_the_nodes_reach_is_told_from_one_on_loopback(recorded: bytes | None, open_at: str | None) -> None:
    """The address the head records for the nodes' event reports (tests/cluster/test_tls.py sends one)."""
    assert open_dashboard(recorded) == open_at
