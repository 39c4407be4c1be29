"""Preemption notices read from a node's metadata endpoint (worker/preemption.py), served here by a
real HTTP server in each cloud's form: AWS (IMDSv2 token, then the spot instance-action), GCP
(``preempted``), Azure (Scheduled Events). The drain it asks of Ray, and the loop's checkpoint,
run on a cluster: tests/faults/test_nodes.py."""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import tiny_run
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.worker.preemption import Notice, NoticeWatcher, aws_notice, azure_notice, endpoint, gcp_notice


class Metadata:
    """What the endpoint answers: path -> (status, body), and the requests it saw."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, str]] = {}
        self.seen: list[tuple[str, str, dict[str, str]]] = []


@pytest.fixture
def metadata() -> Iterator[tuple[Metadata, str]]:
    state = Metadata()

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            state.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
            status, body = state.answers.get(self.path, (404, "not found"))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = answer

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_aws_no_notice_until_the_instance_action_appears_then_its_time_is_the_deadline(
    metadata: tuple[Metadata, str],
) -> None:
    state, base = metadata
    state.answers["/latest/api/token"] = (200, "a-session-token")
    now = time.time()
    assert aws_notice(base, 30, now) is None  # 404: no notice
    when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=2)
    action = {"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
    state.answers["/latest/meta-data/spot/instance-action"] = (200, json.dumps(action))
    notice = aws_notice(base, 30, now)
    assert notice is not None and notice.provider == "aws"
    assert notice.deadline == pytest.approx(when.replace(microsecond=0).timestamp())
    token_put = [s for s in state.seen if s[0] == "PUT" and s[1] == "/latest/api/token"]
    reads = [s for s in state.seen if s[1] == "/latest/meta-data/spot/instance-action"]
    assert token_put and reads[-1][2].get("x-aws-ec2-metadata-token") == "a-session-token"  # IMDSv2


def test_aws_without_imdsv2_and_with_a_body_that_is_not_a_notice(metadata: tuple[Metadata, str]) -> None:
    state, base = metadata
    state.answers["/latest/meta-data/spot/instance-action"] = (200, '{"action": "none"}')
    assert aws_notice(base, 30, time.time()) is None
    state.answers["/latest/meta-data/spot/instance-action"] = (200, "<html>captive portal</html>")
    assert aws_notice(base, 30, time.time()) is None
    state.answers["/latest/meta-data/spot/instance-action"] = (200, '{"action": "stop", "time": "garbage"}')
    now = time.time()
    notice = aws_notice(base, 45, now)  # no token endpoint (IMDSv1) and no readable time: the window
    assert notice is not None and notice.deadline == pytest.approx(now + 45)


def test_gcp_and_azure_notices(metadata: tuple[Metadata, str]) -> None:
    state, base = metadata
    now = time.time()
    state.answers["/computeMetadata/v1/instance/preempted"] = (200, "FALSE")
    assert gcp_notice(base, 30, now) is None
    state.answers["/computeMetadata/v1/instance/preempted"] = (200, "TRUE")
    gcp = gcp_notice(base, 30, now)
    assert gcp is not None and gcp.deadline == pytest.approx(now + 30)
    assert any(s[2].get("metadata-flavor") == "Google" for s in state.seen)
    path = "/metadata/scheduledevents?api-version=2020-07-01"
    state.answers[path] = (200, json.dumps({"Events": [{"EventType": "Reboot"}]}))
    assert azure_notice(base, 30, now) is None
    not_before = "Mon, 19 Sep 2016 18:29:47 GMT"
    state.answers[path] = (200, json.dumps({"Events": [{"EventType": "Preempt", "NotBefore": not_before}]}))
    azure = azure_notice(base, 30, now)
    assert (
        azure is not None
        and azure.deadline == datetime.datetime(2016, 9, 19, 18, 29, 47, tzinfo=datetime.UTC).timestamp()
    )


def test_an_unreachable_endpoint_is_no_notice() -> None:
    assert aws_notice("http://127.0.0.1:9", 30, time.time()) is None  # the discard port: refused


def test_the_watcher_acts_once_on_the_first_notice(metadata: tuple[Metadata, str]) -> None:
    state, base = metadata
    seen: list[Notice] = []
    got = threading.Event()

    def on_notice(notice: Notice) -> None:
        seen.append(notice)
        got.set()

    watcher = NoticeWatcher("gcp", base, 0.05, 30, on_notice)
    watcher.start()
    try:
        assert not got.wait(0.3)
        state.answers["/computeMetadata/v1/instance/preempted"] = (200, "TRUE")
        assert got.wait(30)
        time.sleep(0.2)  # further polls find the same notice: no second drain
        assert len(seen) == 1
    finally:
        watcher.stop()


def test_the_endpoint_and_its_settings(tmp_path: Path) -> None:
    assert endpoint("aws", None, "n1", "10.0.0.1") == "http://169.254.169.254"
    assert endpoint("gcp", "http://127.0.0.1:8/{node_id}/x/", "n1", "10.0.0.1") == "http://127.0.0.1:8/n1/x"
    assert endpoint("aws", "http://meta/{node_ip}", "n1", "10.0.0.1") == "http://meta/10.0.0.1"
    for bad, key in (
        ({"notice": "oracle"}, "failure.preemption.notice"),
        ({"url": "ftp://x"}, "failure.preemption.url"),
    ):
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(tiny_run(tmp_path, failure={"preemption": bad})))
        with pytest.raises(ConfigError) as caught:
            load_config(str(path), [])
        assert key in str(caught.value) and "\n" not in str(caught.value)
