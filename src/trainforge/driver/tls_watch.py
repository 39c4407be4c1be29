"""A run under Ray's TLS ends before its certificates do, and a TLS failure while it runs is one line.

Ray reads its certificate files when each process starts, and a handshake checks their validity
period. Connections made before a certificate expires go on working after it; a new one fails,
and gRPC retries it without end. So an expired certificate does not stop a run that is training:
it stops the next worker group from starting. A worker that dies after the expiry leaves Ray
Train waiting for a group that never comes up, printing ``CERTIFICATE_VERIFY_FAILED`` forever.

The driver therefore watches the clock against the first of the run's certificates to expire
(the node's chain and the CA that signed it, ``tls_files.earliest_expiry``):

- ``cluster.tls.stop_before_expiry_s`` (900 s) before it, the workers checkpoint and stop at their
  next report, as on a first Ctrl-C: the run ends ``stopped`` (exit 3), resumable with new files.
  A run whose certificate expires sooner than that is refused before Ray starts.
- While the run waits for a worker group (from the start to the first report, and from a worker
  failure to the next report), files that no longer pass ``check_tls_files`` (expired, or replaced
  by ones that do not match) end the run at once as ``failed``, naming the file: no group that
  cannot start is waited for.
- A stop that was asked for and has not come by the expiry plus the collective timeout ends the
  run as ``failed`` too.

With ``RAY_TLS_*`` set without ``cluster.tls``, the files are those of the variables and the
margin is the default.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from trainforge.config import Config
from trainforge.config.schema import TlsConfig
from trainforge.driver.tls import tls_in_environment
from trainforge.driver.tls_files import Expiry, TlsFiles, check_tls_files, earliest_expiry, env_files
from trainforge.errors import ConfigError, TrainforgeError

log = logging.getLogger("trainforge")

DEFAULT_MARGIN_S = float(TlsConfig.model_fields["stop_before_expiry_s"].default)
WARN_WITHIN = datetime.timedelta(days=7)  # a start-up line says when the run will stop


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _when(at: datetime.datetime) -> str:
    return at.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass
class TlsWatch:
    """The expiry the run is watched against, and what the driver did about it."""

    files: TlsFiles
    expiry: Expiry
    margin_s: float
    grace_s: float  # after the expiry, how long an asked-for stop may still take
    stop_asked_at: datetime.datetime | None = None

    @classmethod
    def for_run(cls, config: Config, now: datetime.datetime | None = None) -> TlsWatch | None:
        """The watch of a run with TLS on (None without), its files checked; a ConfigError when the
        first certificate expires within the margin (the run would stop at once)."""
        tls = config.cluster.tls
        if tls is not None:
            files, margin = TlsFiles.of_config(tls), tls.stop_before_expiry_s
        elif tls_in_environment():
            files, margin = env_files(os.environ), DEFAULT_MARGIN_S
        else:
            return None
        now = now or _utc_now()
        check_tls_files(files, now)
        watch = cls(files, earliest_expiry(files), margin, config.failure.collective_timeout_s)
        left = (watch.expiry.at - now).total_seconds()
        if left <= margin:
            raise ConfigError(
                f"{watch.expiry.name} {watch.expiry.path}: {watch.expiry.subject} expires at "
                f"{_when(watch.expiry.at)}, in {left:.0f} s, within cluster.tls.stop_before_expiry_s "
                f"({margin:g} s): the run would stop at once; make new certificates (trainforge certs create) "
                "or lower cluster.tls.stop_before_expiry_s"
            )
        if watch.expiry.at - now < WARN_WITHIN and margin > 0:
            log.warning("%s: the run checkpoints and stops at %s", watch.describe(), _when(watch.stop_at))
        return watch

    @property
    def stop_at(self) -> datetime.datetime:
        return self.expiry.at - datetime.timedelta(seconds=self.margin_s)

    def describe(self) -> str:
        return f"{self.expiry.name} {self.expiry.path} ({self.expiry.subject}) expires at {_when(self.expiry.at)}"

    def poll(
        self, request_stop: Callable[[], None], *, awaiting_group: bool, now: datetime.datetime | None = None
    ) -> str | None:
        """What the clock says now: None to carry on (after asking the workers to stop, once, when
        the margin is reached), or the line the run fails with."""
        now = now or _utc_now()
        if self.margin_s > 0 and self.stop_asked_at is None and now >= self.stop_at:
            self.stop_asked_at = now
            log.warning(
                "%s: the workers checkpoint and stop at their next report (cluster.tls.stop_before_expiry_s "
                "%g s); make new certificates and resume the run with --resume",
                self.describe(),
                self.margin_s,
            )
            request_stop()
        if awaiting_group:
            problem = self.problem(now)
            if problem is not None:
                return (
                    f"the worker group cannot start: {problem}; Ray's processes would retry the handshake "
                    "without end. Make new certificates and resume the run with --resume"
                )
        if self.stop_asked_at is not None and now > self.expiry.at + datetime.timedelta(seconds=self.grace_s):
            return (
                f"{self.describe()} and the run did not stop by then (asked at {_when(self.stop_asked_at)}, "
                f"waited failure.collective_timeout_s {self.grace_s:g} s more); resume it with --resume"
            )
        return None

    def stopped_by(self, step: int) -> dict[str, object] | None:
        """summary.json's ``stopped_by`` of a run this watch stopped (None if it asked nothing)."""
        if self.stop_asked_at is None:
            return None
        reason = f"{self.describe()}; stopped cluster.tls.stop_before_expiry_s ({self.margin_s:g} s) before"
        return {"source": "tls", "reason": reason, "step": step}

    def problem(self, now: datetime.datetime) -> str | None:
        """What is wrong with the files now (expired, replaced by ones that do not match), or None."""
        try:
            check_tls_files(self.files, now)
        except TrainforgeError as err:
            return str(err)
        return None
