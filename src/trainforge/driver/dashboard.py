"""The Ray dashboard a command talks to: its address, the token, and waiting for a head that is starting.

A head started a moment ago first refuses connections, then serves ``/api/version`` before its
job agent has registered (meanwhile the Jobs API answers HTTP 500 "No available agent to submit
job, please try again later"). ``DashboardWait`` retries such answers with a short backoff, for up
to ``--wait-for-cluster`` seconds of waiting in all, with one progress line on stderr, then gives
up in one line. What waiting will not change is never retried: a missing or refused token
(401/403), an answer that is not Ray's (404, no ``ray_version``), a host name that does not
resolve, a failed TLS handshake.

The first contact is bounded: a TCP connect, then ``GET /api/version`` with the token, each with a
short timeout, before Ray's SDK (whose requests have no timeout) is used.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar
from urllib.parse import urlparse

from trainforge.errors import ClusterError, ConfigError
from trainforge.files import read_user_file
from trainforge.redact import redact_text

if TYPE_CHECKING:
    import requests

ADDRESS_ENV = "RAY_JOBS_ADDRESS"
CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 5.0
WAIT_S = 60.0  # --wait-for-cluster's default
MAX_TOKEN_FILE_BYTES = 8192  # a token is one line of at most 4096 characters
MAX_WAIT_S = 3600.0
FIRST_PAUSE_S = 0.5  # the pause between attempts doubles from this ...
LONGEST_PAUSE_S = 5.0  # ... up to this
PROGRESS_EVERY_S = 5.0  # a new progress line this often when stderr is not a terminal

T = TypeVar("T")


@dataclass(frozen=True)
class Token:
    """A Ray authentication token and where it was found (named in errors, never the value)."""

    value: str
    source: str


class NotReady(Exception):
    """The dashboard did not answer, or answered that it cannot serve yet: worth asking again."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DashboardWait:
    """Runs attempts on one dashboard, retrying those that raise ``NotReady`` while the command's
    waiting (failed attempts and the pauses between them, added up) stays within ``seconds``."""

    def __init__(self, address: str, seconds: float = WAIT_S, progress: IO[str] | None = None) -> None:
        self.address = address
        self.seconds = seconds
        self.progress = progress
        self.waited = 0.0
        self._last_line_at: float | None = None  # `waited` when a progress line was last written
        self._line_open = False  # a progress line on a terminal, to be cleared

    def run(self, attempt: Callable[[], T]) -> T:
        pause = FIRST_PAUSE_S
        while True:
            started = time.monotonic()
            try:
                result = attempt()
            except NotReady as err:
                reason = err.reason
            else:
                self._close_line()
                return result
            left = self.seconds - (self.waited + time.monotonic() - started)
            if left <= 0:
                self.waited += time.monotonic() - started
                self._close_line()
                raise ClusterError(self.gave_up(reason)) from None
            self._show(reason, self.waited + time.monotonic() - started)
            time.sleep(min(pause, left))
            pause = min(2 * pause, LONGEST_PAUSE_S)
            self.waited += time.monotonic() - started

    def gave_up(self, reason: str) -> str:
        if self.seconds <= 0:
            return (
                f"the Ray dashboard at {self.address} did not answer ({reason}); is the head running? "
                "(--wait-for-cluster SECONDS waits for one that is starting)"
            )
        return (
            f"the Ray dashboard at {self.address} did not answer within {self.seconds:g} s (last: {reason}); "
            "is the head running? (--wait-for-cluster)"
        )

    def _show(self, reason: str, waited: float) -> None:
        if self.progress is None:
            return
        line = redact_text(
            f"waiting for the Ray dashboard at {self.address} ({reason}; {waited:.0f} s of {self.seconds:g})"
        )
        if self.progress.isatty():
            self.progress.write(f"\r{line}\033[K")
            self._line_open = True
        elif self._last_line_at is None or waited - self._last_line_at >= PROGRESS_EVERY_S:
            self.progress.write(f"{line}\n")
            self._last_line_at = waited
        self.progress.flush()

    def _close_line(self) -> None:
        if self.progress is not None and self._line_open:
            self.progress.write("\r\033[K")
            self.progress.flush()
            self._line_open = False


def dashboard_address(address: str | None) -> str:
    """``--address``, else ``RAY_JOBS_ADDRESS``, else ``RAY_ADDRESS`` when it is a dashboard URL."""
    given = address or os.environ.get(ADDRESS_ENV) or None
    ray_address = os.environ.get("RAY_ADDRESS", "")
    if given is None and ray_address.startswith(("http://", "https://")):
        given = ray_address
    if given is None:
        raise ConfigError(f"no cluster: give --address http://HEAD:8265 (the Ray dashboard), or set {ADDRESS_ENV}")
    expected = "the Ray dashboard's URL, http://HEAD:8265 (not the GCS HEAD:6379 or ray://)"
    try:
        parsed = urlparse(given)
        parsed.port  # noqa: B018 (a port out of 0-65535 raises only when read)
    except ValueError as err:  # 'http://[::1' (an unclosed IPv6 bracket), a port such as 99999 or 'x'
        raise ConfigError(f"--address {given!r}: not a URL ({err}); {expected}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"--address {given!r}: {expected}")
    return given.rstrip("/")


def find_token(token_file: Path | None) -> Token | None:
    """The token to send: ``--token-file``, else Ray's own sources in Ray's order
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``); None when there is none."""
    if token_file is not None:
        return _read_token(token_file, f"--token-file {token_file}", required=True)
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return Token(os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN")
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        return _read_token(path, f"RAY_AUTH_TOKEN_PATH {path}", required=True)
    return _read_token(Path.home() / ".ray" / "auth_token", "~/.ray/auth_token", required=False)


def _read_token(path: Path, source: str, *, required: bool) -> Token | None:
    if not required and not path.exists():
        return None
    raw = read_user_file(path, source, MAX_TOKEN_FILE_BYTES, ConfigError)  # a FIFO or /dev/zero: refused, not read
    try:
        value = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not a Ray token (not UTF-8 text)") from None
    if not value or len(value) > 4096 or any(c.isspace() for c in value):
        raise ConfigError(f"{source}: not a Ray token (one line; `ray get-auth-token` prints the cluster's)")
    return Token(value, source)


def auth_headers(token: Token | None) -> dict[str, str]:
    """Ray's dashboard reads ``Authorization: Bearer <token>`` (ray/_private/authentication)."""
    return {"Authorization": f"Bearer {token.value}"} if token else {}


def check_dashboard(address: str, token: Token | None, verify: str | bool = True) -> None:
    """One bounded attempt: the dashboard answers as Ray's and takes the token. ``NotReady`` when
    it cannot be reached or answers 5xx; a ClusterError for what waiting will not change.
    ``verify``: a CA file for an https:// address (driver/tls.dashboard_verify), or True."""
    import requests

    parsed = urlparse(address)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=CONNECT_TIMEOUT_S):
            pass
        answer = requests.get(
            f"{address}/api/version", headers=auth_headers(token), timeout=REQUEST_TIMEOUT_S, verify=verify
        )
    except socket.gaierror as err:
        raise ClusterError(
            f"cannot resolve the host of {address} ({err.strerror or err}); check the address (http://HEAD:8265)"
        ) from None
    except requests.exceptions.SSLError as err:
        said = "certificate verify failed" if "CERTIFICATE_VERIFY_FAILED" in str(err) else type(err).__name__
        raise ClusterError(
            f"TLS with the Ray dashboard at {address} failed ({said}); --ca (or cluster.tls.ca) names the CA "
            "that signed its certificate"
        ) from None
    except (OSError, requests.ConnectionError, requests.Timeout) as err:
        raise NotReady(connection_reason(err)) from None
    except requests.RequestException as err:
        raise ClusterError(f"cannot reach the Ray dashboard at {address} ({type(err).__name__})") from None
    if answer.status_code >= 500:
        raise NotReady(answer_reason(answer.status_code, answer.text))
    if answer.status_code in (401, 403):
        raise refused(address, token, answer.status_code)
    if answer.status_code != 200 or not _is_ray_version(answer):
        raise ClusterError(
            f"{address} answered HTTP {answer.status_code} to /api/version, not as Ray does: "
            "is it a Ray dashboard (port 8265)?"
        )


def refused(address: str, token: Token | None, status: int | None) -> ClusterError:
    """The one error for a dashboard that refuses a request (HTTP 401 or 403, or Ray's SDK saying
    so): whether a token was sent decides what it says, never the status alone."""
    answered = f" (HTTP {status})" if status else ""
    if token is None:
        return ClusterError(
            f"the Ray cluster at {address} requires a token{answered} and none was sent: set RAY_AUTH_TOKEN or "
            "RAY_AUTH_TOKEN_PATH, or give --token-file (`ray get-auth-token` on the head prints it)"
        )
    return ClusterError(
        f"the Ray cluster at {address} refused the token from {token.source}{answered}: it is not this "
        "cluster's token (`ray get-auth-token` on the head prints it)"
    )


def _is_ray_version(answer: requests.Response) -> bool:
    try:
        body = answer.json()
    except ValueError:
        return False
    return isinstance(body, dict) and bool(body.get("ray_version"))


def connection_reason(err: BaseException) -> str:
    """A lost or refused connection in a few words: what ``requests`` and urllib3 wrap, unwrapped."""
    seen: list[BaseException] = []
    found: BaseException | None = err
    while found is not None and found not in seen and len(seen) < 8:
        seen.append(found)
        if isinstance(found, ConnectionRefusedError):
            return "connection refused"
        if isinstance(found, ConnectionResetError):
            return "connection reset"
        if isinstance(found, TimeoutError) or "Timeout" in type(found).__name__:
            return "timed out"
        inner = found.__cause__ or found.__context__ or getattr(found, "reason", None)
        if not isinstance(inner, BaseException):
            inner = next((arg for arg in found.args if isinstance(arg, BaseException)), None)
        found = inner
    text = str(err).lower()
    for words in ("connection refused", "connection reset", "timed out"):
        if words in text:
            return words
    return (err.strerror or type(err).__name__) if isinstance(err, OSError) else type(err).__name__


def answer_reason(status: int, body: str) -> str:
    """``HTTP 500: No available agent to submit job, please try again later``: the status and what the
    server said (a traceback's last line), shortened."""
    lines = [line.strip() for line in body.strip().splitlines() if line.strip()]
    said = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else ""
    said = said.rstrip(".")
    return f"HTTP {status}: {said[:120]}" if said else f"HTTP {status}"
