"""Hostile input at the command line (issue 26, hangs and tracebacks): each probe is one line on
stderr and exit code 2, in bounded time, before Ray starts, nothing on disk changed.

Through main(argv) in this process (test_cli.in_process, which fails a command that starts Ray);
``trainforge train``'s early local Ray is switched off here (``no_early_ray``) because every probe
fails before the run would take it. The probes that hung before (a FIFO or /dev/zero read to the
end) run as real processes, so that a regression is a timeout, not a stuck or exhausted test run.
The rules behind them: tests/unit/test_hostile_input.py."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.console import without_startup
from tests.helpers.faults import free_port
from tests.helpers.runs import tiny_run
from tests.helpers.s3 import BUCKET, S3Server
from tests.helpers.silent import silent_endpoint
from tests.helpers.timing import scaled
from tests.integration.test_cli import assert_user_error, in_process, trainforge
from tests.unit.test_checkpoint import flip_byte
from trainforge.checkpoint.uris import TIMEOUT_ENV

UNREACHABLE_RAY = "127.0.0.1:9"  # had a command got as far as Ray, its error would say so instead


def one_line(result: subprocess.CompletedProcess[str], expected: str, code: int = 2) -> None:
    """Exit ``code``, and stderr exactly one ``error:`` line holding ``expected``."""
    assert result.returncode == code, result.stderr
    lines = without_startup(result.stderr)  # train's first line and start-up phases come before a check fails
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr


@pytest.fixture
def no_early_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trainforge train`` without the local Ray it starts on a thread while it imports."""
    from trainforge.driver import ray_session

    monkeypatch.setattr(ray_session, "start_early", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """moto's S3 with one bucket; its credentials in the environment while the module runs."""
    server = S3Server(free_port())
    server.start()
    with pytest.MonkeyPatch.context() as patch:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            patch.setenv(name, "testing")
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    server.stop()


def write_config(tmp_path: Path, **sections: object) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path, **sections)))  # type: ignore[arg-type]
    return path


# ---------------------------------------------------------------------------------------------
# Storage: schemes, buckets, endpoints that never answer


@pytest.mark.parametrize("uri", ["ftp://h/x", "hdfs://namenode:8020/ck", "http://h/ck"])
@pytest.mark.parametrize("verb", ["verify", "list", "inspect"])
def test_ckpt_refuses_a_scheme_it_does_not_read_by_name(
    verb: str, uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    scheme = uri.partition("://")[0]
    result = in_process("ckpt", verb, uri, capsys=capsys)
    one_line(result, f"{scheme}:// is not a storage trainforge reads; give a local path, or a URI of file://, s3://")


def test_ckpt_verify_of_a_file_uri_reads_that_local_directory(capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process("ckpt", "verify", "file:///etc", capsys=capsys)
    assert result.returncode == 1, result.stderr  # a verdict, not an error: /etc is no checkpoint
    assert result.stdout.splitlines()[:2] == [
        "invalid: file:///etc",
        "  manifest.json is missing (incomplete or interrupted save)",
    ]


def test_ckpt_verify_of_a_missing_bucket_is_one_line(s3: S3Server, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://no-such-bucket/run/checkpoint_000000005?endpoint_override=127.0.0.1:{s3.port}&scheme=http"
    one_line(in_process("ckpt", "verify", uri, capsys=capsys), "does not exist (no such bucket)")


@pytest.mark.parametrize("verb", ["verify", "list", "inspect"])
def test_ckpt_on_storage_that_never_answers_is_one_line_within_the_timeout(
    verb: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    with silent_endpoint() as endpoint:
        started = time.monotonic()
        result = in_process(
            "ckpt", verb, f"s3://b/run/checkpoint_000000005?endpoint_override={endpoint}&scheme=http", capsys=capsys
        )
        elapsed = time.monotonic() - started
    one_line(result, "cannot read s3://b/run")
    assert "Timeout was reached" in result.stderr
    assert elapsed < scaled(10), f"{elapsed:.1f} s"  # pyarrow's own defaults: about 99 s


def test_train_on_storage_that_never_answers_is_one_line_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_early_ray: None
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    with silent_endpoint() as endpoint:
        storage = f"s3://bucket/ck?endpoint_override={endpoint}&scheme=http"
        started = time.monotonic()
        result = in_process(
            "train", str(write_config(tmp_path)), "--set", f"checkpoint.storage_path={storage}", capsys=capsys
        )
        elapsed = time.monotonic() - started
    one_line(result, f"checkpoint.storage_path {storage} cannot be used: When getting information for bucket 'bucket'")
    assert elapsed < scaled(30), f"{elapsed:.1f} s"
    assert not (tmp_path / "t").exists()  # no run directory: nothing was written


@pytest.mark.parametrize(
    ("storage", "expected"),
    [
        ("hdfs://nn:8020/ck", "checkpoint.storage_path hdfs://nn:8020/ck: hdfs:// is not a storage trainforge reads"),
        ("s3://no-such-bucket/ck?endpoint_override=127.0.0.1:{port}&scheme=http", "cannot be used: no such bucket"),
    ],
)  # fmt: skip
def test_train_with_storage_it_cannot_use_is_one_line_before_ray(
    tmp_path: Path, storage: str, expected: str, s3: S3Server, capsys: pytest.CaptureFixture[str], no_early_ray: None
) -> None:
    given = storage.format(port=s3.port)
    result = in_process(
        "train", str(write_config(tmp_path)), "--set", f"checkpoint.storage_path={given}", capsys=capsys
    )
    one_line(result, expected)
    assert not (tmp_path / "t").exists()


def test_an_invalid_resume_checkpoint_is_refused_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_early_ray: None
) -> None:
    """Its manifest reads, one byte of its weights does not match: refused in seconds, where the
    workers refused it about 50 s later, after Ray started."""
    model = torch.nn.Linear(4, 2)
    checkpoint = tmp_path / "elsewhere" / "checkpoint_000000005"
    write_checkpoint(checkpoint, model, torch.optim.SGD(model.parameters(), lr=0.1), step=5)
    flip_byte(checkpoint)
    before = {p: p.read_bytes() for p in checkpoint.iterdir()}
    result = in_process("train", str(write_config(tmp_path)), "--resume", str(checkpoint), capsys=capsys)
    one_line(result, f"checkpoint.resume (--resume) {checkpoint} is not a checkpoint: model.safetensors")
    assert {p: p.read_bytes() for p in checkpoint.iterdir()} == before


def test_a_fifo_lock_file_in_the_run_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "t"
    run_dir.mkdir()
    os.mkfifo(run_dir / ".lock")
    monkeypatch.setenv("RAY_ADDRESS", UNREACHABLE_RAY)
    result = in_process("train", str(write_config(tmp_path)), capsys=capsys)
    one_line(result, f"run directory {run_dir}: its lock file {run_dir / '.lock'} is a FIFO, not a regular file")
    assert (run_dir / ".lock").is_fifo() and sorted(run_dir.iterdir()) == [run_dir / ".lock"]


# ---------------------------------------------------------------------------------------------
# Flags and config values


@pytest.mark.parametrize("value", ["true", "false"])
def test_a_bool_for_train_epochs_is_refused(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", UNREACHABLE_RAY)
    result = in_process("train", str(write_config(tmp_path)), "--set", f"train.epochs={value}", capsys=capsys)
    one_line(result, f"train.epochs = {value.title()}: Input should be a number, not true or false")


@pytest.mark.parametrize(
    ("address", "why"),
    [("http://[::1", "Invalid IPv6 URL"), ("http://127.0.0.1:99999", "Port out of range 0-65535")],
)
def test_jobs_list_with_an_address_that_is_not_a_url_is_one_line(
    address: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    one_line(
        in_process("jobs", "list", "--address", address, capsys=capsys), f"--address '{address}': not a URL ({why})"
    )


def test_a_ray_address_that_is_not_host_port_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process("train", str(write_config(tmp_path)), "--address", "127.0.0.1:99999", capsys=capsys)
    one_line(result, "Ray address '127.0.0.1:99999' is not host:port")


def test_a_fifo_token_file_is_refused_without_waiting(tmp_path: Path) -> None:
    """A real process: before, it waited forever for a writer."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    result = trainforge(
        "jobs", "list", "--address", "http://127.0.0.1:9", "--token-file", str(fifo), timeout=int(scaled(60))
    )
    one_line(result, f"--token-file {fifo}: a FIFO, not a regular file")


@pytest.mark.parametrize("collectives", ["/dev/zero", "fifo"])
def test_predict_refuses_collectives_that_are_not_a_regular_file(tmp_path: Path, collectives: str) -> None:
    """A real process: before, /dev/zero was read until memory ran out and a FIFO waited forever."""
    path = Path(collectives) if collectives.startswith("/") else tmp_path / collectives
    if not path.is_absolute() or not path.exists():
        os.mkfifo(path)
    result = trainforge(
        "predict", "quickstart", "--link", "measured", "--collectives", str(path), "--step-time", "0.1",
        "--model-params", "1000", timeout=int(scaled(60)),
    )  # fmt: skip
    kind = "a device" if collectives == "/dev/zero" else "a FIFO"
    one_line(result, f"--collectives {path}: {kind}, not a regular file")


def test_predict_json_never_prints_a_bare_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "collectives.json"
    report.write_text('{"workers": 2, "fits": {"all_reduce": {"alpha_s": NaN, "beta_s_per_byte": 1e-9}}}')
    args = ["--link", "measured", "--step-time", "0.1", "--model-params", "1000", "--json"]
    result = in_process("predict", "quickstart", "--collectives", str(report), *args, capsys=capsys)
    one_line(result, "fits.all_reduce's alpha_s and beta_s_per_byte must be finite numbers")
    report.write_text('{"workers": 2, "fits": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}}}')
    result = in_process("predict", "quickstart", "--collectives", str(report), *args, capsys=capsys)
    assert result.returncode == 0, result.stderr
    json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"bare {name} in --json output"))


# ---------------------------------------------------------------------------------------------
# data prepare


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "a.txt"
    path.write_text("some text to tokenize\n")
    return path


def test_data_prepare_of_an_input_that_cannot_be_read_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unreadable = Path("/proc/sys/vm/drop_caches")  # write-only, even for root
    if not unreadable.exists() or (os.access(unreadable, os.R_OK) and _reads(unreadable)):
        pytest.skip("no write-only /proc/sys entry here")
    result = in_process("data", "prepare", str(unreadable), "-o", str(tmp_path / "out"), capsys=capsys)
    one_line(result, f"{unreadable}: cannot be read (Permission denied)")
    assert list(tmp_path.iterdir()) == []


def _reads(path: Path) -> bool:
    try:
        path.read_bytes()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("output", "expected"),
    [("/proc/sys/vm/corpus", "folder /proc/sys/vm is not writable"),
     ("{text}/corpus", "{text} is a file, not a folder")],
)  # fmt: skip
def test_data_prepare_to_a_folder_that_cannot_be_made_is_one_line(
    text_file: Path, output: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    given = output.format(text=text_file)
    expected = expected.format(text=text_file)
    one_line(in_process("data", "prepare", str(text_file), "-o", given, capsys=capsys), f"--output {given}: {expected}")
    assert text_file.read_text() == "some text to tokenize\n"


def test_data_prepare_of_a_jsonl_line_nested_100000_deep_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    result = in_process("data", "prepare", str(deep), "-o", str(tmp_path / "out"), capsys=capsys)
    one_line(result, f"{deep} line 1: not a JSON object (nested too deeply)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.jsonl"]  # the staging folder removed


def test_data_prepare_with_a_fifo_tokenizer_file_is_one_line(
    text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = text_file.parent / "tokenizer.json"
    os.mkfifo(fifo)
    result = in_process(
        "data", "prepare", str(text_file), "--tokenizer", str(fifo), "-o", str(text_file.parent / "o"), capsys=capsys
    )
    assert_user_error(result, str(fifo))


def test_storage_a_remote_cluster_may_reach_is_a_warning_not_an_error(
    tmp_path: Path, s3: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """With --address the workers run elsewhere and may reach what this machine cannot: the
    preflight says so and goes on; a scheme trainforge does not read is an error everywhere."""
    from trainforge.config import load_config
    from trainforge.driver.run import check_storage
    from trainforge.errors import CheckpointError

    missing = f"s3://no-such-bucket/ck?endpoint_override=127.0.0.1:{s3.port}&scheme=http"
    config = load_config(tiny_run(tmp_path, checkpoint={"storage_path": missing}))
    check_storage(config, local=False)
    assert any("cannot be used: no such bucket (from this machine" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="no such bucket; check the URI"):
        check_storage(config, local=True)
    with pytest.raises(CheckpointError, match="hdfs:// is not a storage trainforge reads"):
        check_storage(load_config(tiny_run(tmp_path, checkpoint={"storage_path": "hdfs://nn/ck"})), local=False)
