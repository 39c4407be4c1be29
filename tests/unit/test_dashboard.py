"""Waiting for a Ray dashboard that is still starting (trainforge.driver.dashboard), without Ray.

A small HTTP server on loopback answers as a starting head does (HTTP 500 with Ray's "No available
agent" text, then Ray's answers), or as something that is not a Ray dashboard; a port nobody
listens on stands for a head not started yet. Against a real head started late:
tests/integration/test_submit.py.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import tiny_run
from trainforge.cli import main
from trainforge.driver.dashboard import DashboardWait, check_dashboard
from trainforge.driver.jobs import Jobs
from trainforge.errors import ClusterError

NO_AGENT = "No available agent to submit job, please try again later."
VERSION = {"version": "4", "ray_version": "2.60.0", "ray_commit": "0"}


@dataclass
class Dashboard:
    """What the fake dashboard answers: ``version`` and ``submit`` are played in order, the last
    answer repeating; submitted jobs are kept by id, as Ray keeps them."""

    url: str = ""
    version: list[tuple[int, str]] = field(default_factory=lambda: [(200, json.dumps(VERSION))])
    submit: list[tuple[int, str]] = field(default_factory=lambda: [(200, "")])
    requests: list[str] = field(default_factory=list)
    jobs: dict[str, dict[str, str]] = field(default_factory=dict)
    refuse: int | None = None  # the status every request but /api/version gets (a token checked per route)
    tokens: list[str | None] = field(default_factory=list)  # the Authorization header of each request

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, str]:
        self.requests.append(f"{method} {path}")
        if self.refuse is not None and path != "/api/version":
            return self.refuse, "Unauthorized" if self.refuse == 401 else "Forbidden"
        if path == "/api/version":
            return self.version.pop(0) if len(self.version) > 1 else self.version[0]
        if method == "POST" and path == "/api/jobs/":
            status, text = self.submit.pop(0) if len(self.submit) > 1 else self.submit[0]
            if status != 500 or "lost" in text:  # a proxy's 5xx after the head took the job
                request = json.loads(body)
                self.jobs[request["submission_id"]] = request
            if status == 200:
                text = json.dumps({"job_id": None, "submission_id": request["submission_id"]})
            return status, text
        if method == "GET" and path.startswith("/api/jobs/"):
            job_id = path.removeprefix("/api/jobs/")
            if job_id not in self.jobs:
                return 404, f"Job {job_id} does not exist"
            details = {"type": "SUBMISSION", "submission_id": job_id, "status": "PENDING", "entrypoint": "x"}
            return 200, json.dumps(details)
        return 404, "Not Found"


@pytest.fixture(autouse=True)
def no_ray_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("RAY_ADDRESS", "RAY_JOBS_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture
def dashboard() -> Iterator[Dashboard]:
    state = Dashboard()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            state.tokens.append(self.headers.get("Authorization"))
            status, text = state.answer(self.command, self.path, body)
            payload = text.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _reply

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_head_without_its_job_agent_yet_is_asked_again_until_it_answers(dashboard: Dashboard) -> None:
    dashboard.version = [(500, NO_AGENT), (500, NO_AGENT), (200, json.dumps(VERSION))]
    progress = io.StringIO()
    wait = DashboardWait(dashboard.url, 30, progress)
    wait.run(lambda: check_dashboard(dashboard.url, None))
    assert dashboard.requests == ["GET /api/version"] * 3
    # Not a terminal: one line for the whole wait (a new one only every few seconds).
    assert progress.getvalue().splitlines() == [
        f"waiting for the Ray dashboard at {dashboard.url} "
        "(HTTP 500: No available agent to submit job, please try again later; 0 s of 30)"
    ]
    assert wait.waited >= 1.5  # the pauses 0.5 s, then 1 s


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ((401, "Unauthorized"), r"requires a token \(HTTP 401\) and none was sent"),
        ((403, "Forbidden"), r"requires a token \(HTTP 403\) and none was sent"),
        ((404, "Not Found"), "answered HTTP 404 to /api/version, not as Ray does"),
        ((200, "<html>a web server</html>"), "answered HTTP 200 to /api/version, not as Ray does"),
    ],
)
def test_what_waiting_will_not_change_is_told_at_once(
    dashboard: Dashboard, answer: tuple[int, str], expected: str
) -> None:
    dashboard.version = [answer]
    progress = io.StringIO()
    with pytest.raises(ClusterError, match=expected):
        DashboardWait(dashboard.url, 30, progress).run(lambda: check_dashboard(dashboard.url, None))
    assert dashboard.requests == ["GET /api/version"]
    assert progress.getvalue() == ""


def test_an_unresolvable_host_is_told_at_once() -> None:
    address = "http://no-such-host.invalid:8265"
    with pytest.raises(ClusterError, match=r"cannot resolve the host of http://no-such-host\.invalid:8265"):
        DashboardWait(address, 30).run(lambda: check_dashboard(address, None))


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_progress_line_is_rewritten_in_place_and_cleared(dashboard: Dashboard) -> None:
    dashboard.version = [(503, "Service Unavailable"), (503, "Service Unavailable"), (200, json.dumps(VERSION))]
    progress = Terminal()
    DashboardWait(dashboard.url, 30, progress).run(lambda: check_dashboard(dashboard.url, None))
    line = f"waiting for the Ray dashboard at {dashboard.url} (HTTP 503: Service Unavailable; "
    assert progress.getvalue().count(f"\r{line}") == 2
    assert "\n" not in progress.getvalue() and progress.getvalue().endswith("\r\033[K")


def test_a_submission_whose_answer_was_lost_is_found_not_submitted_twice(dashboard: Dashboard) -> None:
    # The head is starting (no agent yet), then takes the job but a proxy loses its answer.
    dashboard.submit = [(500, NO_AGENT), (502, "lost: Bad Gateway"), (200, "")]
    jobs = Jobs(dashboard.url, wait_s=30, progress=io.StringIO())
    job_id = jobs.submit(entrypoint="trainforge train run.yaml", runtime_env={}, metadata={})
    assert list(dashboard.jobs) == [job_id] and job_id.startswith("raysubmit_")
    posts = [r for r in dashboard.requests if r.startswith("POST")]
    assert posts == ["POST /api/jobs/", "POST /api/jobs/"]  # the third attempt asked, and found it
    assert dashboard.requests[-1] == f"GET /api/jobs/{job_id}"


def test_submit_to_no_head_fails_in_one_line_after_the_wait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_run(tmp_path / "runs")))
    url = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        main(["submit", "run.yaml", "--address", url, "--wait-for-cluster", "2"])
    assert exited.value.code == 2
    assert time.monotonic() - started >= 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: the Ray dashboard at {url} did not answer within 2 s (last: connection refused); "
        "is the head running? (--wait-for-cluster)"
    ], stderr
    assert f"waiting for the Ray dashboard at {url} (connection refused; 0 s of 2)" in stderr


def test_wait_0_tries_once(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(SystemExit) as exited:
        main(["jobs", "list", "--address", url, "--wait-for-cluster", "0"])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.splitlines() == [
        f"error: the Ray dashboard at {url} did not answer (connection refused); is the head running? "
        "(--wait-for-cluster SECONDS waits for one that is starting)"
    ]


@pytest.mark.parametrize("value", ["soon", "-1", "3601", "nan"])
def test_a_bad_wait_is_one_line_naming_the_flag(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["jobs", "status", "raysubmit_x", "--address", "http://127.0.0.1:1", "--wait-for-cluster", value])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --wait-for-cluster {value!r}: seconds from 0 (try once) to 3600"
    ]


REFUSED_TOKEN = "TokenTheClusterRefuses0x4D"


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("where", ["/api/version", "the Jobs API"])
def test_every_jobs_verb_tells_a_refused_token_from_a_missing_one(
    dashboard: Dashboard,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    status: int,
    where: str,
) -> None:
    """A 401 to a request that carried the token says the token was refused (it said "none was
    found"); the first check (/api/version) and Ray's SDK (every later request) say it alike."""
    if where == "/api/version":
        dashboard.version = [(status, "Unauthorized")]
    else:
        dashboard.refuse = status
    monkeypatch.chdir(tmp_path)
    # No token but the one given: not the environment's, not ~/.ray/auth_token (a token-auth Ray
    # head writes one there), not one Ray's loader cached for this process in an earlier test.
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    from ray._raylet import AuthenticationTokenLoader

    AuthenticationTokenLoader.instance().reset_cache()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_run(tmp_path / "runs")))
    (tmp_path / "token").write_text(REFUSED_TOKEN)
    verbs = [["jobs", "list"], *(["jobs", verb, "raysubmit_x"] for verb in ("status", "logs", "stop"))]
    verbs.append(["submit", "run.yaml", "--no-wait"])
    for verb in verbs:
        for token in (["--token-file", "token"], []):
            dashboard.tokens.clear()
            with pytest.raises(SystemExit) as exited:
                main([*verb, "--address", dashboard.url, "--wait-for-cluster", "0", *token])
            assert exited.value.code == 2, verb
            err = capsys.readouterr().err
            assert dashboard.tokens and set(dashboard.tokens) == {f"Bearer {REFUSED_TOKEN}" if token else None}
            if token:
                expected = (
                    f"error: the Ray cluster at {dashboard.url} refused the token from --token-file token "
                    f"(HTTP {status}): "
                )
            else:  # with the HTTP status, or without it where Ray's SDK says so before asking
                expected = f"error: the Ray cluster at {dashboard.url} requires a token"
                assert "and none was sent: " in err, (verb, err)
            assert err.startswith(expected) and len(err.splitlines()) == 1, (verb, err)
            assert REFUSED_TOKEN not in err
