"""What ``trainforge submit`` sends (trainforge.driver.job_package), built in-process: the zip Ray
would upload, from a working directory full of key material, credentials and files that hold or
name a secret under innocuous names. Against a real Ray head: tests/integration/test_submit.py."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.runs import tiny_run
from trainforge.cli import main
from trainforge.config import Config, load_config
from trainforge.driver.certs import create_certs
from trainforge.driver.job_package import package_contents
from trainforge.driver.jobs import EXCLUDES, submission_contents, submit_run
from trainforge.errors import TrainforgeError

TOKEN = "RayClusterToken0x7F3aa91"
HF_TOKEN = "hf_SecretModelToken0x51"
PRIVATE_PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----\n"
OPENSSH = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
# Whatever the rule must keep here: these bytes are in no file of the package.
MARKERS = [TOKEN, HF_TOKEN, "PRIVATE KEY", "CredentialMarker"]

SENT = {
    "model.py": "def build():\n    return None\n",
    "auth.py": "def login():\n    pass\n",  # a module named like a secret: code the job imports
    "data/train.csv": "x,y\n1,2\n",
    "tokenizer/tokenizer_config.json": '{"eos_token": "</s>", "pad_token": "<pad>", "max_tokens": 8}',
    "docs/notes.md": "the token lives on the head\n",
    "settings.yaml": "lr: 0.1\ntoken_file: null\n",
}
WITHHELD = {
    # key and certificate material, and SSH keys, by name (content harmless: the name decides)
    "certs/ca.key": "CredentialMarker",
    "certs/node.key": "CredentialMarker",
    "certs/node.crt": "CredentialMarker",
    "server.PEM": "CredentialMarker",
    "bundle.p12": "CredentialMarker",
    "store.pfx": "CredentialMarker",
    "putty.ppk": "CredentialMarker",
    "deploy/id_ed25519": "CredentialMarker",
    "deploy/id_rsa.pub": "CredentialMarker",
    # credential files, by name
    ".env": "HF_TOKEN=CredentialMarker\n",
    ".env.production": "CredentialMarker",
    "deploy/prod.env": "CredentialMarker",
    ".envrc": "CredentialMarker",
    "ops/.netrc": "machine x login y password CredentialMarker",
    ".pgpass": "CredentialMarker",
    ".git-credentials": "CredentialMarker",
    ".aws/credentials": "[default]\naws_secret_access_key = CredentialMarker\n",
    ".aws/config": "CredentialMarker",
    ".azure/accessTokens.json": "CredentialMarker",
    "home/.config/gcloud/application_default_credentials.json": "CredentialMarker",
    ".docker/config.json": '{"auths": {"r": "CredentialMarker"}}',
    ".kube/config": "CredentialMarker",
    "vault.kdbx": "CredentialMarker",
    # secret-named files and folders
    "secrets/api_token": "CredentialMarker",
    "secrets/deeper/readme.txt": "CredentialMarker",
    "keys/hf_token.txt": "CredentialMarker",
    "credentials.json": "CredentialMarker",
    "db_password": "CredentialMarker",
    # content: a private key or the cluster's token under innocuous names, a YAML holding a secret
    "notes.txt": f"my key, for later:\n{PRIVATE_PEM}",
    "backup.bin": OPENSSH,
    "memo.md": f"the cluster token is {TOKEN}\n",
    "todo.txt": "ask for access; CredentialMarker ghp_abcdefghijklmnopqrstuvwxyz0123456789AB\n",
    "scripts/fetch.sh": "curl -H 'x: CredentialMarker' -u AKIAIOSFODNN7EXAMPLE https://x\n",
    "configs/prod.yaml": yaml.safe_dump({"model": {"kwargs": {"hf_token": HF_TOKEN}}}),
    "storage.json": '{"checkpoint": {"storage_path": "s3://KEY:CredentialMarker@bucket/ck"}}',
    # named by the config (below), innocuous names and harmless-looking content
    "conf/client_material": "CredentialMarker",
    "tok": f"{TOKEN}\n",  # the --token-file
}


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture(autouse=True)
def no_ray_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("RAY_ADDRESS", "RAY_JOBS_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home-dir"))


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding SENT, WITHHELD, a TLS key pair the config names under
    innocuous names (``tlsfiles/one``, ``two``, ``three``), and the run's config (run.yaml) with a
    token in its model's kwargs; the current directory."""
    root = tmp_path / "work"
    write(root, SENT)
    write(root, WITHHELD)
    made = create_certs(tmp_path / "made", ["localhost"])
    (root / "tlsfiles").mkdir()
    for source, name in [(made.ca, "one"), (made.cert, "two"), (made.key, "three")]:
        shutil.copy2(source, root / "tlsfiles" / name)
    outside = tmp_path / "outside" / ".ssh"
    outside.mkdir(parents=True)
    (outside / "id_ecdsa").write_text("CredentialMarker")
    (root / "weights.bin").symlink_to(outside / "id_ecdsa")  # a link to a key outside the directory
    (root / "results").mkdir()
    (root / "results" / "old.txt").write_text("a run's output: ignored")
    kwargs = {"hf_token": HF_TOKEN, "ssl_cert_file": "conf/client_material"}
    config = tiny_run(
        Path("results"),
        run={"name": "r"},
        model={"name": None, "factory": "model:build", "kwargs": kwargs},
        cluster={"tls": {"ca": "tlsfiles/one", "cert": "tlsfiles/two", "key": "tlsfiles/three"}},
    )
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(root)
    return root


def run_config() -> Config:
    return load_config("run.yaml")


class RecordingJobs:
    """The Jobs API's client as submit_run uses it: the zip it would upload, read while it exists."""

    address = "http://127.0.0.1:8265"

    def submit(self, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]) -> str:
        with zipfile.ZipFile(runtime_env["working_dir"]) as archive:
            self.files = {name: archive.read(name) for name in archive.namelist()}
        self.package = Path(runtime_env["working_dir"])
        self.entrypoint = entrypoint
        return "raysubmit_test"


def submitted(project: Path, **options: Any) -> RecordingJobs:
    jobs = RecordingJobs()
    contents = submission_contents(run_config(), project, token_file=project / "tok", **options)
    submit_run(run_config(), jobs, contents)  # type: ignore[arg-type]
    assert not jobs.package.exists()  # the zip lives only while it is uploaded
    return jobs


def test_the_package_leaves_out_key_material_credentials_and_whatever_holds_or_names_a_secret(
    project: Path,
) -> None:
    jobs = submitted(project)
    config_file = jobs.entrypoint.split()[-1]
    assert set(jobs.files) == {*SENT, config_file}, sorted(jobs.files)
    leaked = [(name, marker) for name, data in jobs.files.items() for marker in MARKERS if marker.encode() in data]
    assert not leaked
    tls_bytes = [(project / "tlsfiles" / name).read_bytes() for name in ("one", "two", "three")]
    assert not [name for name, data in jobs.files.items() if any(data == tls for tls in tls_bytes)]
    # The job's config says where the files were (paths on this machine): the cluster's nodes have their own.
    shipped = yaml.safe_load(jobs.files[config_file])
    assert shipped["model"]["kwargs"]["hf_token"] == "***" and shipped["cluster"]["tls"] is None


def test_every_reason_is_recorded_and_nothing_is_both_sent_and_left_out(project: Path) -> None:
    contents = submission_contents(run_config(), project, token_file=project / "tok")
    reasons = {left.path: left.reason for left in contents.withheld}
    assert reasons["tok"] == "the token file (--token-file)"
    assert reasons["memo.md"] == "holds the cluster's token"
    assert reasons["notes.txt"] == reasons["backup.bin"] == "holds a private key"
    assert (
        reasons["todo.txt"] == reasons["scripts/fetch.sh"] == "holds a token in a known format (as the records mask it)"
    )
    assert reasons["conf/client_material"] == "named by the config's model.kwargs.ssl_cert_file"
    assert reasons["tlsfiles/two"] == "named by the config's cluster.tls.cert"
    assert reasons["configs/prod.yaml"] == "holds a secret (model.kwargs.hf_token)"
    assert reasons["run.yaml"] == "holds a secret (model.kwargs.hf_token)"
    assert reasons["storage.json"] == "holds a secret (checkpoint.storage_path)"
    assert reasons["secrets/"].startswith("a secret-named folder")  # the folder once, with all it holds
    assert reasons["weights.bin"].startswith("a link to ")
    assert reasons["certs/ca.key"] == "key or certificate material (*.key)"
    assert [left.path for left in contents.ignored] == ["results/"]
    assert not set(reasons) & set(contents.sent)


def test_ignore_files_cannot_bring_a_secret_back_and_the_package_matches_rays_own_for_the_rest(
    tmp_path: Path,
) -> None:
    """Where the secret rule has nothing to say, the package holds what Ray's own packer sends
    (the same .gitignore and .rayignore reading, Ray's default excludes, empty folders)."""
    from ray._private.runtime_env.packaging import create_package

    root = tmp_path / "work"
    write(root, {"a.py": "", "pkg/b.py": "", "pkg/data.bin": "x", "big/blob": "x", "keep/x.log": "x", "c.log": "x"})
    write(root, {".gitignore": "*.log\n!keep/x.log\n!certs/ca.key\n", "pkg/.rayignore": "data.bin\n"})
    write(root, {".git/HEAD": "x", "__pycache__/m.pyc": "x", ".rayignore": "big/\n"})
    (root / "empty").mkdir()
    ray_zip = tmp_path / "ray.zip"
    create_package(str(root), ray_zip, include_gitignore=True, excludes=list(EXCLUDES))
    with zipfile.ZipFile(ray_zip) as archive:
        rays = {name for name in archive.namelist()}
    ours = package_contents(root, config={}, ignore=list(EXCLUDES))
    assert set(ours.sent) == rays and ours.withheld == []
    write(root, {"certs/ca.key": "CredentialMarker"})  # the .gitignore's "!certs/ca.key" does not send it
    assert "certs/ca.key" not in package_contents(root, config={}, ignore=list(EXCLUDES)).sent


def test_include_sends_a_path_the_rule_left_out_and_only_that(project: Path) -> None:
    jobs = submitted(project, includes=[Path("certs/node.crt"), project / "secrets"])
    assert jobs.files["certs/node.crt"] == b"CredentialMarker"
    assert {"secrets/api_token", "secrets/deeper/readme.txt"} <= set(jobs.files)
    assert "certs/ca.key" not in jobs.files and "tok" not in jobs.files
    ignored = package_contents(project, config={}, ignore=["/results"], includes=[Path("results/old.txt")])
    assert "results/old.txt" in ignored.sent  # under an ignored folder: that file, not its siblings
    for wrong, problem in [(Path("/etc/passwd"), "not a path inside the working directory"), (Path("nope"), "no such")]:
        with pytest.raises(TrainforgeError, match=problem):
            submission_contents(run_config(), project, includes=[wrong])


def test_dry_run_lists_what_would_be_sent_and_what_is_left_out_and_why_without_a_cluster(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No --address and none in the environment: contacting a cluster would fail ("no cluster").
    (project / "odd\nname\x1b[31m.txt").write_text("x")
    main(["submit", "run.yaml", "--dry-run", "--token-file", "tok", "--include", "certs/node.crt"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"would send {len(SENT) + 3} from {project}:"
    assert "  certs/node.crt  (--include, although key or certificate material (*.crt))" in lines
    assert "  model.py" in lines and "  trainforge-submit-r-<id>.yaml  (the resolved config, secrets masked)" in lines
    assert "  certs/ca.key  (key or certificate material (*.key))" in lines
    assert "  tok  (the token file (--token-file))" in lines
    assert "  notes.txt  (holds a private key)" in lines
    assert "  results/" in lines
    assert "  odd\\nname\\x1b[31m.txt" in lines  # a file name is data: one line, no terminal escape
    assert not [marker for marker in MARKERS if marker in out]


def test_submit_says_in_one_line_what_it_left_out(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = RecordingJobs()
    monkeypatch.setattr("trainforge.cli.jobs._jobs", lambda *args: jobs)
    main(["submit", "run.yaml", "--no-wait", "--token-file", "tok"])
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("left out of the package as secrets: ")]
    assert len(said) == 1 and "--dry-run" in said[0], err
    assert "certs/ca.key" not in jobs.files and "tok" not in jobs.files


def test_a_private_key_past_the_first_bytes_of_a_small_file_is_found(tmp_path: Path) -> None:
    root = tmp_path / "work"
    write(root, {"log.txt": "line\n" * 20000 + PRIVATE_PEM, "ok.txt": "-----BEGIN CERTIFICATE-----\n"})
    os.chmod(root / "ok.txt", 0o644)
    contents = package_contents(root, config={}, ignore=[])
    assert [left.path for left in contents.withheld] == ["log.txt"] and contents.sent == ["ok.txt"]


def der_material() -> dict[str, bytes]:
    """Key material in binary forms under innocuous names, made here with ``cryptography``."""
    from datetime import datetime, timedelta, timezone

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.hazmat.primitives.serialization import pkcs12

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    der, none = serialization.Encoding.DER, serialization.NoEncryption()
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "x")])
    now = datetime.now(timezone.utc)
    cert = x509.CertificateBuilder(name, name, ec_key.public_key(), 1, now, now + timedelta(days=1)).sign(
        ec_key, hashes.SHA256()
    )
    pkcs1 = serialization.PrivateFormat.TraditionalOpenSSL
    return {
        "keydata.bin": rsa_key.private_bytes(der, pkcs1, none),
        "pk8data": rsa_key.private_bytes(der, serialization.PrivateFormat.PKCS8, none),
        "sealed.dat": ec_key.private_bytes(
            der, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
        ),
        "ec.raw": ec_key.private_bytes(der, pkcs1, none),
        "bundle.bin": pkcs12.serialize_key_and_certificates(
            b"n", ec_key, cert, None, serialization.BestAvailableEncryption(b"pw")
        ),
        "plain_bundle": pkcs12.serialize_key_and_certificates(b"n", ec_key, cert, None, none),
        "store.dat": b"\xfe\xed\xfe\xed\x00\x00\x00\x02" + b"\x00" * 40,
        "cert.bin": cert.public_bytes(der),  # a certificate is public: sent
    }


def test_key_material_and_credential_files_under_innocuous_names_are_found_by_content(tmp_path: Path) -> None:
    """The rule for names holds for content: DER and PKCS#12 keys, keystores, and netrc, pgpass,
    npmrc, AWS, kubeconfig and git-credentials syntax, whatever the file is called or wherever it lies."""
    root = tmp_path / "work"
    binary = der_material()
    for rel, data in binary.items():
        (root / "nested" / "deep").mkdir(parents=True, exist_ok=True)
        (root / "nested" / "deep" / rel).write_bytes(data)
    write(
        root,
        {
            "hosts": "machine example.com\n  login u\n  password p4ss-CredentialMarker\n",
            "db_access": "db.internal:5432:*:app:CredentialMarker9\n",
            "registry.cfg": "//registry.npmjs.org/:_authToken=CredentialMarker0123\n",
            "profiles/default.ini": "[default]\naws_secret_access_key = wJalrXUtnFEMI/CredentialMarker\n",
            "clusterconf": "users:\n- name: admin\n  user:\n    token: CredentialMarker0123456789\n",
            "remotes": "https://me:CredentialMarker42@github.com\n",
            # sent: references to a credential, paths, code, public material
            "run.sh": 'export HF_TOKEN="$HF_TOKEN"\nTOKEN=${TOKEN}\npassword: <your password>\n',
            "doc.md": "export RAY_TLS_SERVER_KEY=/etc/ray/tls/node.key\nssh://git@github.com/o/r\n",
            "requirements.txt": "mylib @ git+ssh://git@github.com/o/mylib.git\n",
            "loader.py": 'password = os.environ["DB_PASSWORD"]\n',
            "data.csv": "time,value\n12:30:01,3\n",
        },
    )
    contents = package_contents(root, config={}, ignore=[])
    reasons = {left.path: left.reason for left in contents.withheld}
    for rel in set(binary) - {"cert.bin"}:
        assert f"nested/deep/{rel}" in reasons, (rel, contents.sent)
    assert reasons["nested/deep/sealed.dat"] == "holds an encrypted private key (DER)"
    assert reasons["nested/deep/bundle.bin"].startswith("holds a PKCS#12 bundle")
    assert reasons["hosts"] == "holds a netrc password"
    assert reasons["db_access"].startswith("holds a pgpass line")
    for rel in ("registry.cfg", "profiles/default.ini", "clusterconf", "remotes"):
        assert reasons[rel].startswith("holds a credential (line "), rel
    assert set(contents.sent) == {
        "nested/deep/cert.bin",
        "run.sh",
        "doc.md",
        "requirements.txt",
        "loader.py",
        "data.csv",
    }
    assert not [reason for reason in reasons.values() if "CredentialMarker" in reason]


def test_an_archive_holding_key_material_or_credentials_by_name_is_withheld(tmp_path: Path) -> None:
    """``backup.zip`` with ``home/.ssh/id_ed25519``, ``old.tgz`` with ``.aws/credentials``: an archive
    is judged by its members' names as a folder would be; one of data and code is sent."""
    import io
    import tarfile

    root = tmp_path / "work"
    root.mkdir()
    with zipfile.ZipFile(root / "backup.zip", "w") as archive:
        archive.writestr("home/readme.txt", "x")
        archive.writestr("home/.ssh/id_ed25519", "CredentialMarker")
    with tarfile.open(root / "old.tgz", "w:gz") as tar:
        data = b"CredentialMarker"
        info = tarfile.TarInfo(".aws/credentials")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with zipfile.ZipFile(root / "dataset.zip", "w") as archive:
        archive.writestr("images/cat/1.png", "x")
        archive.writestr("auth.py", "def login(): pass")
    contents = package_contents(root, config={}, ignore=[])
    reasons = {left.path: left.reason for left in contents.withheld}
    assert reasons["backup.zip"] == "an archive holding home/.ssh/id_ed25519: key or certificate material (id_ed25519*)"
    assert reasons["old.tgz"].startswith("an archive holding .aws/credentials: a credentials file")
    assert contents.sent == ["dataset.zip"]
