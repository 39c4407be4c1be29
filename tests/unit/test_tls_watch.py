"""The run's TLS certificates against the clock (driver/tls_watch.py), without Ray: refused before
the start when they expire within the margin, a stop asked for once the margin is reached, a
worker failure with files that no longer pass ends the run in one line. With Ray:
tests/integration/test_tls_local.py."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import yaml

from tests.helpers.certs import replace_cert
from tests.helpers.runs import tiny_run
from trainforge.config import Config, load_config
from trainforge.driver.certs import CertFiles, create_certs
from trainforge.driver.tls_watch import TlsWatch
from trainforge.errors import ConfigError

HOUR = datetime.timedelta(hours=1)


@pytest.fixture
def certs(tmp_path: Path) -> CertFiles:
    return create_certs(tmp_path / "certs", ["localhost", "127.0.0.1"])


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def config_of(tmp_path: Path, certs: CertFiles, **tls: float) -> Config:
    files = {"ca": str(certs.ca), "cert": str(certs.cert), "key": str(certs.key), **tls}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path, cluster={"tls": files})))
    return load_config(str(path), [])


def test_a_certificate_expiring_within_the_margin_is_refused_before_the_start(tmp_path: Path, certs: CertFiles) -> None:
    replace_cert(certs, now() - HOUR, now() + datetime.timedelta(minutes=10))
    with pytest.raises(ConfigError) as caught:
        TlsWatch.for_run(config_of(tmp_path, certs))  # the margin: 900 s by default
    message = str(caught.value)
    assert "\n" not in message
    assert "cluster.tls.cert" in message and "cluster.tls.stop_before_expiry_s (900 s)" in message
    # A smaller margin lets it run, and says when it will stop.
    watch = TlsWatch.for_run(config_of(tmp_path, certs, stop_before_expiry_s=60))
    assert watch is not None and watch.expiry.name == "cluster.tls.cert"
    assert abs((watch.stop_at - (watch.expiry.at - datetime.timedelta(seconds=60))).total_seconds()) < 1e-6


def test_the_stop_is_asked_once_when_the_margin_is_reached_and_recorded(tmp_path: Path, certs: CertFiles) -> None:
    replace_cert(certs, now() - HOUR, now() + 2 * HOUR)
    watch = TlsWatch.for_run(config_of(tmp_path, certs, stop_before_expiry_s=1800))
    assert watch is not None
    asked: list[int] = []
    stop_at = watch.expiry.at - datetime.timedelta(seconds=1800)
    assert (
        watch.poll(lambda: asked.append(1), awaiting_group=False, now=stop_at - datetime.timedelta(seconds=1)) is None
    )
    assert asked == [] and watch.stopped_by(5) is None
    for moment in (stop_at, stop_at + datetime.timedelta(seconds=30)):
        assert watch.poll(lambda: asked.append(1), awaiting_group=False, now=moment) is None
    assert asked == [1]
    stopped = watch.stopped_by(40)
    assert stopped is not None and stopped["source"] == "tls" and stopped["step"] == 40
    assert "cluster.tls.cert" in str(stopped["reason"])


def test_a_stop_that_does_not_come_by_the_expiry_ends_the_run_in_one_line(tmp_path: Path, certs: CertFiles) -> None:
    replace_cert(certs, now() - HOUR, now() + 2 * HOUR)
    watch = TlsWatch.for_run(config_of(tmp_path, certs, stop_before_expiry_s=600))
    assert watch is not None
    expiry = watch.expiry.at
    assert watch.poll(lambda: None, awaiting_group=False, now=expiry - datetime.timedelta(seconds=300)) is None
    grace = datetime.timedelta(seconds=watch.grace_s)
    assert watch.poll(lambda: None, awaiting_group=False, now=expiry + grace) is None
    ended = watch.poll(lambda: None, awaiting_group=False, now=expiry + grace + datetime.timedelta(seconds=1))
    assert ended is not None and "\n" not in ended and "did not stop" in ended and "--resume" in ended


def test_a_worker_failure_after_the_expiry_ends_the_run_instead_of_a_restart_that_cannot_start(
    tmp_path: Path, certs: CertFiles
) -> None:
    replace_cert(certs, now() - HOUR, now() + 2 * HOUR)
    watch = TlsWatch.for_run(config_of(tmp_path, certs, stop_before_expiry_s=0))
    assert watch is not None
    asked: list[int] = []
    # Before the expiry a failure is Ray Train's to recover: the files still pass.
    assert watch.poll(lambda: asked.append(1), awaiting_group=True, now=now()) is None
    # Margin 0: no stop is ever asked; past the expiry, training goes on until a restart is needed.
    later = watch.expiry.at + datetime.timedelta(seconds=5)
    assert watch.poll(lambda: asked.append(1), awaiting_group=False, now=later) is None
    ended = watch.poll(lambda: asked.append(1), awaiting_group=True, now=later)
    assert asked == []
    assert ended is not None and "\n" not in ended
    assert "cannot start" in ended and "cluster.tls.cert" in ended and "expired" in ended


def test_files_replaced_during_the_run_by_ones_that_do_not_match_end_it_at_the_next_failure(
    tmp_path: Path, certs: CertFiles
) -> None:
    watch = TlsWatch.for_run(config_of(tmp_path, certs))
    assert watch is not None
    other = create_certs(tmp_path / "other", ["localhost", "127.0.0.1"])
    certs.cert.write_bytes(other.cert.read_bytes())  # another CA's certificate, for another key
    ended = watch.poll(lambda: None, awaiting_group=True)
    assert ended is not None and "not signed by the CA" in ended


def test_no_tls_no_watch_and_a_bad_margin_is_one_line(tmp_path: Path, certs: CertFiles) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path)))
    assert TlsWatch.for_run(load_config(str(path), [])) is None
    with pytest.raises(ConfigError) as caught:
        config_of(tmp_path, certs, stop_before_expiry_s=-1)
    assert "cluster.tls.stop_before_expiry_s" in str(caught.value) and "\n" not in str(caught.value)
