"""The rules behind one-line errors for hostile input (issue 26): every read of a path a user names
refuses what is not a regular file and stops at a size; every storage URI is of a scheme trainforge
reads, checked before a file system is made, and every storage request gives up in bounded time;
no config number takes a bool; parsers of user text (dashboard URLs, JSONL lines, storage URIs)
give a value or a TrainforgeError, never another exception (hypothesis).

The CLI's side of the same probes: tests/integration/test_cli_hostile.py."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.silent import silent_endpoint
from tests.helpers.timing import scaled
from trainforge.checkpoint import uris
from trainforge.checkpoint.inspect import list_checkpoints, verify_checkpoint
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.checkpoint.uris import SCHEMES, TIMEOUT_ENV, open_uri, plain, storage_timeout_s
from trainforge.cli.common import json_text
from trainforge.config import load_config
from trainforge.data.documents import jsonl_text
from trainforge.driver.dashboard import dashboard_address, find_token
from trainforge.driver.runlock import LOCK_FILE, acquire
from trainforge.errors import CheckpointError, ConfigError, DataError, TrainforgeError
from trainforge.files import read_user_file
from trainforge.predict.links import measured_link

FUZZ = settings(max_examples=200, deadline=1000, database=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# Paths a user names: regular files only, bounded


def test_a_user_file_that_is_a_fifo_a_device_or_a_directory_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a device"), (tmp_path, "a directory")):
        with pytest.raises(TrainforgeError, match=f"^--flag {path}: {kind}, not a regular file$"):
            read_user_file(path, f"--flag {path}", 1 << 20)
    assert time.monotonic() - started < 1  # nothing waited for a writer, nothing read an endless device


def test_a_user_file_is_read_up_to_its_limit_and_through_links(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 1024)
    link = tmp_path / "link"
    link.symlink_to(path)  # a user's own link is followed (checkpoints refuse links; flags do not)
    assert read_user_file(link, "--flag", 1024) == b"x" * 1024
    with pytest.raises(TrainforgeError, match=r"^--flag: larger than 1023 bytes, the most read$"):
        read_user_file(path, "--flag", 1023)
    with pytest.raises(DataError, match=r"^--flag: no such file$"):
        read_user_file(tmp_path / "absent", "--flag", 10, DataError)


def test_a_user_file_that_cannot_be_read_is_one_line() -> None:
    """Root reads mode-0 files; /proc/sys refuses even root a write-only entry."""
    path = Path("/proc/sys/vm/drop_caches")
    if not path.exists() or (os.access(path, os.R_OK) and _readable(path)):
        pytest.skip("no write-only /proc/sys entry here")
    with pytest.raises(TrainforgeError, match=r"^--flag: cannot be read \(Permission denied\)$"):
        read_user_file(path, "--flag", 10)


def _readable(path: Path) -> bool:
    try:
        path.read_bytes()
    except OSError:
        return False
    return True


def test_token_and_collectives_files_go_through_the_bounded_reader(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=f"--token-file {fifo}: a FIFO, not a regular file"):
        find_token(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a device")):
        with pytest.raises(TrainforgeError, match=f"--collectives {path}: {kind}, not a regular file"):
            measured_link(path)


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_a_measured_link_with_a_number_that_is_not_finite_is_refused(tmp_path: Path, bad: str) -> None:
    report = tmp_path / "c.json"
    report.write_text(f'{{"workers": 2, "fits": {{"all_reduce": {{"alpha_s": {bad}, "beta_s_per_byte": 1e-9}}}}}}')
    with pytest.raises(TrainforgeError, match="must be finite numbers"):
        measured_link(report)
    report.write_text('{"workers": 2, "fits": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-320}}}')
    with pytest.raises(TrainforgeError, match="a link between"):
        measured_link(report)  # a bandwidth that overflows to inf


def test_json_output_has_no_bare_nan() -> None:
    text = json_text({"a": math.nan, "b": [math.inf, 1.5, -math.inf], "c": (2, "NaN")}, indent=1)
    assert json.loads(text) == {"a": None, "b": [None, 1.5, None], "c": [2, "NaN"]}
    assert "NaN" not in text.replace('"NaN"', "")


# ---------------------------------------------------------------------------------------------
# Storage URIs: schemes by name, bounded requests


class NoFileSystem:
    """pyarrow.fs as uris.py sees it, but any file system made from a URI fails the test: a refused
    URI must never get as far as one (pyarrow's own types cannot be patched)."""

    class FileSystem:
        @staticmethod
        def from_uri(uri: str) -> Any:
            raise AssertionError(f"a file system was created for {uri}")

    def __getattr__(self, name: str) -> Any:
        return getattr(pafs, name)


@pytest.fixture
def no_file_system(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uris, "pafs", NoFileSystem())


@pytest.mark.parametrize(
    "uri", ["ftp://h/x", "hdfs://nn:8020/x", "HDFS://nn/x", "http://h/x", "viewfs://x/y", "mock://x"]
)
def test_unknown_schemes_are_refused_by_name_before_a_file_system_is_made(uri: str, no_file_system: None) -> None:
    scheme = uri.partition("://")[0].lower()
    expected = f"{scheme}:// is not a storage trainforge reads; give a local path, or a URI of file://, s3://, gs://"
    for call in (CheckpointStore.from_uri, CheckpointStore.for_checkpoint, verify_checkpoint, list_checkpoints):
        with pytest.raises(CheckpointError, match=expected.replace("/", "/").replace(".", r"\.")):
            call(uri)


def test_file_uris_are_local_paths(tmp_path: Path, no_file_system: None) -> None:
    store = CheckpointStore.from_uri(f"file://{tmp_path}")
    assert store.is_local and store.root == str(tmp_path)
    store, name = CheckpointStore.for_checkpoint("file:///etc")
    assert store.path(name) == "/etc"  # was the working directory's etc
    assert plain(f"file://localhost{tmp_path}/a%20b") == f"{tmp_path}/a b"
    with pytest.raises(CheckpointError, match="a file:// URI names an absolute local path"):
        CheckpointStore.from_uri("file://otherhost/x")


@settings(max_examples=300, deadline=1000, database=None)
@given(scheme=st.text(min_size=1, max_size=8), rest=st.text(max_size=40))
def test_fuzz_a_uri_of_any_other_scheme_is_one_line_and_makes_no_file_system(scheme: str, rest: str) -> None:
    uri = f"{scheme}://{rest}"
    if "://" in scheme or scheme.lower() in SCHEMES:
        return
    with pytest.MonkeyPatch.context() as patch, pytest.raises(CheckpointError) as caught:
        patch.setattr(uris, "pafs", NoFileSystem())  # a hypothesis test takes no function-scoped fixture
        open_uri(uri)
    assert "\n" not in str(caught.value).strip() or "\n" in uri


def test_every_object_store_request_is_bounded_by_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "12")
    s3, _ = open_uri("s3://KEY:SECRET@bucket/run?endpoint_override=127.0.0.1:9&scheme=http")
    options = s3.__reduce__()[1][0]  # type: ignore[index]
    assert (options["connect_timeout"], options["request_timeout"]) == (4.0, 4.0)  # three attempts in 12 s
    assert (options["access_key"], options["endpoint_override"], options["scheme"]) == ("KEY", "127.0.0.1:9", "http")
    gcs, path = open_uri("gs://bucket/run")
    assert gcs.__reduce__()[1][0]["retry_time_limit"] == timedelta(seconds=12)  # type: ignore[index]
    assert path == "bucket/run"


@pytest.mark.parametrize("value", ["0", "2.9", "-1", "abc", "nan", "1e9"])
def test_the_storage_timeout_is_bounded(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(ConfigError, match=f"{TIMEOUT_ENV}='{value}': seconds from 3 to 3600"):
        storage_timeout_s()
    monkeypatch.delenv(TIMEOUT_ENV)
    assert storage_timeout_s() == 30.0


@pytest.fixture(name="silent_endpoint")
def silent_endpoint_fixture() -> Iterator[str]:
    with silent_endpoint() as endpoint:
        yield endpoint


def test_a_storage_that_never_answers_is_one_line_within_the_timeout(
    silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow's defaults wait about 99 s on such an endpoint (three attempts of curl's 3 s
    low-speed limit, over and over); here each attempt gets a third of 3 s."""
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    uri = f"s3://bucket/run/checkpoint_000000005?endpoint_override={silent_endpoint}&scheme=http"
    for call in (verify_checkpoint, list_checkpoints):
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"^cannot read s3://bucket/run.*Timeout was reached"):
            call(uri)
        assert time.monotonic() - started < scaled(10)


# ---------------------------------------------------------------------------------------------
# Other parsers and readers of user input


@pytest.mark.parametrize(
    ("address", "why"),
    [("http://[::1", "Invalid IPv6 URL"), ("http://127.0.0.1:99999", "Port out of range"), ("http://h:x", "Port")],
)
def test_a_dashboard_address_that_is_not_a_url_is_one_line(address: str, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"--address '{address.replace('[', '.')}': not a URL \({why}"):
        dashboard_address(address)


@FUZZ
@given(st.text(max_size=60) | st.builds(lambda rest: f"http://{rest}", st.text(max_size=40)))
def test_fuzz_any_dashboard_address_is_a_url_or_a_config_error(address: str) -> None:
    try:
        result = dashboard_address(address)
    except ConfigError:
        return
    assert result.startswith(("http://", "https://"))


def test_a_fifo_lock_file_is_refused_in_one_line_and_left_alone(tmp_path: Path) -> None:
    lock = tmp_path / LOCK_FILE
    os.mkfifo(lock)
    with pytest.raises(ConfigError, match=f"its lock file {lock} is a FIFO, not a regular file; remove it"):
        acquire(tmp_path, what="run directory", advice="")
    assert lock.is_fifo()


def test_a_jsonl_line_nested_100000_deep_is_one_line() -> None:
    line = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(DataError, match=r"^f\.jsonl line 1: not a JSON object \(nested too deeply\)"):
        jsonl_text(line, "f.jsonl line 1")


@FUZZ
@given(st.binary(max_size=200) | st.builds(lambda n: b"[" * n, st.integers(0, 200_000)))
def test_fuzz_any_jsonl_line_is_text_or_a_data_error(line: bytes) -> None:
    try:
        assert isinstance(jsonl_text(line, "f.jsonl line 1"), bytes)
    except DataError as err:
        assert "\n" not in str(err)


# ---------------------------------------------------------------------------------------------
# Config numbers take no bool


@pytest.mark.parametrize(
    "override",
    ["train.epochs=true", "train.max_steps=true", "train.batch_size=false", "optim.lr=true", "seed=true",
     "scaling.num_workers=[1, true]", "checkpoint.keep_last=true"],
)  # fmt: skip
def test_a_bool_is_not_a_number(override: str) -> None:
    with pytest.raises(ConfigError, match="Input should be a number, not true or false"):
        load_config({"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"max_steps": 1}}, [override])


def test_every_number_of_the_config_refuses_a_bool_and_bools_stay_bools() -> None:
    """The rule over every key: each number of the default config (digits, mlp) refuses true."""
    base = {"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"max_steps": 1}}
    defaults = load_config(base, []).to_dict()
    numbers = [
        key for key, value in _leaves(defaults) if isinstance(value, (int, float)) and not isinstance(value, bool)
    ]
    assert len(numbers) > 30, numbers
    for key in numbers:
        with pytest.raises(ConfigError, match="not true or false"):
            load_config(base, [f"{key}=true"])
    assert load_config(base, ["checkpoint.at_epoch_end=true", "model.kwargs={a: true}"]).model.kwargs == {"a": True}


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), value
