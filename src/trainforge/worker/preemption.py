"""A cloud's notice that a node will be taken back, turned into Ray's own preemption signal.

Spot and preemptible instances get a short notice before they are reclaimed, on each node's
metadata endpoint: AWS (``/latest/meta-data/spot/instance-action``: ``{"action": "terminate",
"time": ...}``, a 2-minute notice), GCP (``/computeMetadata/v1/instance/preempted``: ``TRUE``,
about 30 s), Azure (Scheduled Events: an event of type ``Preempt`` with ``NotBefore``). With
``failure.preemption.notice`` set, every training worker polls its node's endpoint
(``failure.preemption.poll_s``; local ranks are not used to pick one, since nodes that share an
address, as containers behind one host may, get local ranks as one node) and, on a notice, asks
Ray to drain the node for preemption with the notice's deadline (a second request for a node
already draining changes nothing), as Ray does itself when a node's processes get SIGTERM.
Ray Train's preemption watcher then tells every worker (``ray.train.get_preemption_info``), and
the training loop checkpoints at once (worker/loop.py): an elastic run (``scaling.num_workers:
[min, max]``) trains on and continues on the nodes left when the node goes; a fixed-size run stops,
resumable.

``failure.preemption.url`` replaces the endpoint's base (a proxy, or a test's server);
``{node_id}`` and ``{node_ip}`` in it are filled in.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainforge.config import Config

log = logging.getLogger("trainforge.worker")

BASES = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
READ_TIMEOUT_S = 2.0
MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class Notice:
    """A notice: the node goes at ``deadline`` (unix seconds)."""

    provider: str
    deadline: float
    text: str


def read(url: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> str | None:
    """The body of a 200 answer, or None (404 and the like: no notice; unreachable: none either)."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=READ_TIMEOUT_S) as answer:
            if answer.status != 200:
                return None
            return str(answer.read(MAX_BYTES).decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def iso_time(text: str) -> float | None:
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def aws_notice(base: str, window_s: float, now: float) -> Notice | None:
    """IMDSv2 (a session token first), else IMDSv1."""
    token = read(f"{base}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    headers = {"X-aws-ec2-metadata-token": token.strip()} if token else {}
    body = read(f"{base}/latest/meta-data/spot/instance-action", headers=headers)
    if body is None:
        return None
    try:
        action = json.loads(body)
    except ValueError:
        return None
    if not isinstance(action, dict) or action.get("action") not in ("terminate", "stop", "hibernate"):
        return None
    deadline = iso_time(str(action.get("time", ""))) or now + window_s
    return Notice("aws", deadline, f"spot instance-action {action.get('action')} at {action.get('time')}")


def gcp_notice(base: str, window_s: float, now: float) -> Notice | None:
    body = read(f"{base}/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"})
    if body is None or body.strip().upper() != "TRUE":
        return None
    return Notice("gcp", now + window_s, "instance/preempted is TRUE")


def azure_notice(base: str, window_s: float, now: float) -> Notice | None:
    body = read(f"{base}/metadata/scheduledevents?api-version=2020-07-01", headers={"Metadata": "true"})
    if body is None:
        return None
    try:
        events = json.loads(body).get("Events", [])
    except (ValueError, AttributeError):
        return None
    for event in events if isinstance(events, list) else []:
        if isinstance(event, dict) and event.get("EventType") == "Preempt":
            deadline = parse_http_date(str(event.get("NotBefore", ""))) or now + window_s
            return Notice("azure", deadline, f"scheduled event Preempt, not before {event.get('NotBefore')}")
    return None


def parse_http_date(text: str) -> float | None:
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        return iso_time(text)


READERS: dict[str, Callable[[str, float, float], Notice | None]] = {
    "aws": aws_notice,
    "gcp": gcp_notice,
    "azure": azure_notice,
}


def endpoint(provider: str, url: str | None, node_id: str, node_ip: str) -> str:
    base = url if url is not None else BASES[provider]
    return base.replace("{node_id}", node_id).replace("{node_ip}", node_ip).rstrip("/")


def drain_node(node_id: str, message: str, deadline: float | None = None) -> bool:
    """Ask Ray's GCS to drain ``node_id`` (by ``deadline``, unix seconds; None: no deadline), as Ray
    does on a node's SIGTERM; whether it was accepted. The node takes no new work; once nothing
    runs there its raylet exits and the node leaves the cluster. Preemption is the reason Ray
    accepts for a busy node (an idle-termination drain is refused while work runs there)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    client: Any = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
    accepted, why = client.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION,  # type: ignore[attr-defined]
        message,
        int(deadline * 1000) if deadline is not None else 0,
    )
    if not accepted:
        log.warning("Ray did not accept draining node %s (%s): %s", node_id, message, why)
    return bool(accepted)


def drain_for_preemption(node_id: str, notice: Notice) -> bool:
    """Drain ``node_id`` by the notice's deadline; whether Ray accepted it."""
    return drain_node(node_id, f"trainforge: {notice.provider} notice ({notice.text})", notice.deadline)


class NoticeWatcher:
    """A thread that polls the node's endpoint and drains the node once, on the first notice."""

    def __init__(
        self,
        provider: str,
        base: str,
        poll_s: float,
        window_s: float,
        on_notice: Callable[[Notice], object],
    ) -> None:
        self.read = READERS[provider]
        self.base = base
        self.poll_s = poll_s
        self.window_s = window_s
        self.on_notice = on_notice
        self.notice: Notice | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainforge-preemption", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> Notice | None:
        notice = self.read(self.base, self.window_s, time.time())
        if notice is not None and self.notice is None:
            self.notice = notice
            log.warning("%s: this node gives notice of preemption (%s); draining it", notice.provider, notice.text)
            self.on_notice(notice)
        return notice

    def _watch(self) -> None:
        while self.notice is None and not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as err:  # the watcher must never take the worker down
                log.warning("preemption notice watcher: %s", err)


def for_worker(config: Config) -> NoticeWatcher | None:
    """This worker's watcher of its node's notices, when ``failure.preemption.notice`` is set."""
    import ray

    settings = config.failure.preemption
    if settings.notice == "off":
        return None
    context = ray.get_runtime_context()
    node_id, node_ip = context.get_node_id(), ray.util.get_node_ip_address()
    base = endpoint(settings.notice, settings.url, node_id, node_ip)
    return NoticeWatcher(
        settings.notice, base, settings.poll_s, settings.window_s, lambda notice: drain_for_preemption(node_id, notice)
    )
