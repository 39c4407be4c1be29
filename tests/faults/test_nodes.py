"""Losing a whole Ray node mid-run (its raylet and every process on it, SIGKILL).

A real multi-node cluster on one machine (``ray.cluster_utils.Cluster``): a head that runs no
training workers and two 1-CPU worker nodes, one training worker each. The GCS declares a
killed node dead within a second or two (short health checks below).

* fixed ``scaling.num_workers: 2``: the run waits for capacity; a node is added back and the run
  resumes from its newest checkpoint with 2 workers.
* elastic ``scaling.num_workers: [1, 2]`` resuming at once with the 1 worker that fits is tested
  where a node is cut off the network (tests/cluster/test_multinode.py): trainforge's side of it
  is the same whatever took the node away, and one Ray start-up is saved here.
* a preemption notice: the run checkpoints at once and continues on the node left.
* ``failure.straggler.action: exclude``: one worker slowed on a duty cycle is named, its node is
  drained and leaves the cluster, and the run finishes on the other node.

The node killed is one that hosts a training worker. trainforge's ``Mailbox`` actor is pinned to
the driver's node (observe.start_mailbox), so it is never on the killed node; the test asserts that.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster

import trainforge
from tests.helpers.faults import (
    checkpoints,
    duty_cycle,
    events,
    events_of,
    first_resumed_report,
    paced_run,
    patched_environ,
    recovery_s,
    reports,
    steps_after,
    wait_until,
    worker_pids,
)
from tests.helpers.timing import scaled
from trainforge.protocol import Resumed, Straggler

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# Node death is noticed by the GCS's health checks of each raylet: period x threshold.
FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


# Ray Train waits this long for a worker group's placement group before it retries the start
# (default 60 s). After a node loss an elastic run first asks again for the old size, because the
# dead node is still counted for a moment; each wrong guess costs one such wait.
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
START_TIMEOUT_S = "10"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Head (0 CPUs: no training worker lands there) + worker nodes added per test; one driver.

    The cluster lives in a private RAY_TMPDIR: Cluster records its address in
    ``$RAY_TMPDIR/ray/ray_current_cluster``, and with the shared default (/tmp/ray) every other
    ``ray.init()`` on the machine would try to join it.
    """
    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="tfray-", dir="/tmp")  # short: Ray's socket paths live under it
    with patched_environ(RAY_TMPDIR=temp_dir, OMP_NUM_THREADS="1", **{START_TIMEOUT_ENV: START_TIMEOUT_S}):
        made = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH},
        )
        try:
            ray.init(
                address=made.address,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
            )
            yield made
        finally:
            shut_down(made)
            shutil.rmtree(temp_dir, ignore_errors=True)


def shut_down(cluster: Cluster) -> None:
    """Disconnect and remove every node. A run thread left behind by a failed test may have
    reconnected the driver (Ray auto-initialises on use), which Cluster refuses: retry."""
    for _ in range(5):
        ray.shutdown()
        try:
            cluster.shutdown()
            return
        except ValueError:
            time.sleep(1)


@pytest.fixture
def two_nodes(cluster: Cluster) -> Cluster:
    """Exactly two live 1-CPU worker nodes, whatever the previous test left."""
    while len(cluster.worker_nodes) < 2:
        cluster.add_node(num_cpus=1)
    while len(cluster.worker_nodes) > 2:
        cluster.remove_node(next(iter(cluster.worker_nodes)))
    cluster.wait_for_nodes()
    wait_until(lambda: ray.cluster_resources().get("CPU", 0) == 2, 30, "2 CPUs in the cluster")
    # Free as well as present: the previous test's workers and placement group are released
    # asynchronously, and an elastic run started meanwhile begins with the 1 worker that fits.
    wait_until(lambda: ray.available_resources().get("CPU", 0) == 2, 60, "2 free CPUs in the cluster")
    return cluster


def processes_on(node: Any) -> list[str]:
    """Ray process titles (ray::RayTrainWorker, ray::Mailbox, ...) running under a node's raylet."""
    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    titles = []
    for proc in psutil.Process(raylet).children(recursive=True):
        try:
            titles.append(proc.cmdline()[0])
        except (psutil.Error, IndexError):
            continue
    return titles


def kill_a_training_node(cluster: Cluster) -> dict[str, Any]:
    """SIGKILL every process of a worker node that hosts a training worker (never trainforge's
    Mailbox actor, which is pinned to the driver's node: asserted)."""
    hosting = {n: processes_on(n) for n in cluster.worker_nodes}
    training = [n for n, titles in hosting.items() if any("RayTrainWorker" in t for t in titles)]
    assert not any("Mailbox" in t for titles in hosting.values() for t in titles), hosting
    assert training, f"no worker node hosts a training worker: {list(hosting.values())}"
    at = time.time()
    cluster.remove_node(training[0], allow_graceful=False)
    return {"at": at, "killed_processes": hosting[training[0]]}


def node_config(tmp_path: Path, num_workers: Any) -> dict[str, Any]:
    return paced_run(
        tmp_path,
        scaling={"num_workers": num_workers},
        train={"max_steps": 80},
        failure={"max_failures": 3},
    )


def recovery_line(label: str, summary: dict[str, Any], run_dir: Path, fault: dict[str, Any]) -> str:
    first = first_resumed_report(run_dir)
    return (
        f"\n{label}: node killed (it ran {fault['killed_processes']}); first step after recovery: "
        f"step {first['step']} on {first['world_size']} worker(s), "
        f"{recovery_s(run_dir, fault['at']):.1f} s after the kill; "
        f"summary restarts {summary['restarts']} recovery_s {summary['recovery_s']}"
    )


@contextlib.contextmanager
def fit_in_background(config: dict[str, Any]) -> Iterator[Future[trainforge.RunResult]]:
    """Run ``trainforge.fit`` on a thread: the test's main thread must add and remove nodes, since a
    Ray node object installs signal handlers, which Python allows only on the main thread.

    A test that fails while the run goes on must not leave it running: the next test would share
    the cluster with it, and the module's teardown would shut Ray down under the thread's feet
    (which can abort this whole process). So the run's controller and workers are killed, and the
    thread is waited for."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fit")
    running = pool.submit(trainforge.fit, config)
    try:
        yield running
    finally:
        if not running.done():
            for proc in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if any("TrainController" in part or "RayTrainWorker" in part for part in proc.cmdline()):
                        proc.kill()
            with contextlib.suppress(Exception):
                running.result(timeout=scaled(120))
        pool.shutdown(wait=False)


def test_fixed_size_run_waits_for_a_node_then_resumes(two_nodes: Cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "t"
    with fit_in_background(node_config(tmp_path, 2)) as running:
        wait_until(lambda: checkpoints(run_dir) or running.done(), 240, "the first checkpoint")
        killed = kill_a_training_node(two_nodes)
        # One node short, the run cannot place 2 workers: it must wait, neither fail nor train on.
        wait_until(lambda: any(r.get("event") == "worker_error" for r in reports(run_dir)), 60, "the worker error")
        time.sleep(5)
        assert not running.done(), "the run ended with a node missing"
        assert not steps_after(run_dir, killed["at"] + 1), "trained on with a missing worker"
        added_at = time.time()
        two_nodes.add_node(num_cpus=1)
        result = running.result(timeout=scaled(300))

    summary = result.summary
    assert summary["status"] == "finished" and summary["global_step"] == 80
    assert summary["num_workers"] == 2
    assert summary["restarts"] >= 1
    assert summary["recovery_s"], summary
    first = first_resumed_report(run_dir)
    assert first["world_size"] == 2
    print(recovery_line("fixed [2]", summary, run_dir, killed))
    print(f"fixed [2]: first step {first['time/unix'] - added_at:.1f} s after the replacement node was added")


class SpotEndpoints:
    """Each node's AWS metadata endpoint, on one local server under ``/<node id>/``: 404 until
    ``notify`` gives a node its spot instance-action (a 2-minute notice on AWS)."""

    def __init__(self) -> None:
        self.actions: dict[str, dict[str, str]] = {}
        endpoints = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                node_id, _, rest = self.path.lstrip("/").partition("/")
                action = endpoints.actions.get(node_id)
                if rest == "latest/meta-data/spot/instance-action" and action is not None:
                    body, status = json.dumps(action).encode(), 200
                else:
                    body, status = b"not found", 404
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/{{node_id}}"

    def notify(self, node_id: str, deadline: float) -> None:
        when = datetime.datetime.fromtimestamp(deadline, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.actions[node_id] = {"action": "terminate", "time": when}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_preemption_notice_checkpoints_at_once_and_the_run_continues_on_the_node_left(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    """Issue 37 §5: the notice on a node's metadata endpoint (AWS's form) becomes Ray's preemption
    drain of that node; the workers checkpoint within the notice's window and train on (elastic);
    when the node goes at its deadline the run continues on the node left and finishes."""
    endpoints = SpotEndpoints()
    run_dir = tmp_path / "t"
    config = node_config(tmp_path, [1, 2])
    config["train"] = {**config["train"], "max_steps": 200}
    config["checkpoint"] = {**config["checkpoint"], "every_n_steps": 10_000}  # the notice's is the only one
    config["failure"] = {**config["failure"], "preemption": {"notice": "aws", "url": endpoints.base, "poll_s": 0.2}}
    try:
        with fit_in_background(config) as running:
            wait_until(lambda: steps_after(run_dir, 0) or running.done(), 240, "the first report")
            hosting = [n for n in two_nodes.worker_nodes if any("RayTrainWorker" in t for t in processes_on(n))]
            assert len(hosting) == 2, "the elastic run did not start on both nodes"
            noticed_at = time.time()
            window_s = 60.0
            endpoints.notify(hosting[0].node_id, noticed_at + window_s)

            def preemption_checkpoint() -> Path | None:
                said = [e for e in events(run_dir) if "notice of preemption" in e]
                return checkpoints(run_dir)[0] if said and checkpoints(run_dir) else None

            saved = wait_until(preemption_checkpoint, window_s, "the checkpoint the notice asks for")
            saved_after_s = saved.stat().st_mtime - noticed_at
            assert not running.done()
            two_nodes.remove_node(hosting[0], allow_graceful=False)  # the cloud takes the node back
            removed_at = time.time()
            result = running.result(timeout=scaled(300))
    finally:
        endpoints.close()
    summary = result.summary
    assert summary["status"] == "finished" and summary["global_step"] == 200
    first = first_resumed_report(run_dir)
    assert first["world_size"] == 1 and summary["num_workers"] == 1
    resumed = [e for e in events(run_dir) if e.startswith("resumed from")]
    assert resumed and resumed[0].startswith(f"resumed from {saved} "), resumed
    assert saved_after_s < window_s
    print(
        f"\npreemption: checkpoint {saved.name} {saved_after_s:.1f} s after the notice (window {window_s:.0f} s); "
        f"first step on the node left {first['time/unix'] - removed_at:.1f} s after the node went"
    )


def raylet_pid(node: Any) -> int:
    return int(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)


def node_hosting(cluster: Cluster, pid: int) -> Any:
    """The worker node whose raylet started process ``pid``."""
    for node in cluster.worker_nodes:
        with contextlib.suppress(psutil.Error):
            if pid in {proc.pid for proc in psutil.Process(raylet_pid(node)).children(recursive=True)}:
                return node
    raise AssertionError(f"process {pid} runs on no worker node")


def test_exclude_drains_the_stragglers_node_and_the_run_finishes_on_the_other(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    """Issue 37 §3: a worker slowed on a duty cycle is named; under ``exclude`` the run checkpoints,
    its node is drained (it leaves the cluster once its worker is gone) and the group restarts on
    the other node, from that checkpoint."""
    run_dir = tmp_path / "t"
    config = node_config(tmp_path, [1, 2])
    config["train"] = {**config["train"], "max_steps": 60}
    config["model"]["kwargs"] = {"delay_s": 0.02}
    config["checkpoint"] = {**config["checkpoint"], "every_n_steps": 10_000}  # exclude's is the only one
    config["failure"] = {**config["failure"], "straggler": {"threshold": 1.5, "window_steps": 10, "action": "exclude"}}
    excluded = None
    try:
        with fit_in_background(config) as running:
            wait_until(lambda: steps_after(run_dir, 0) or running.done(), 240, "the first report")
            pids = worker_pids()
            assert len(pids) == 2, "the elastic run did not start 2 workers"
            pid = max(pids)
            excluded = node_hosting(two_nodes, pid)
            other = next(node for node in two_nodes.worker_nodes if node is not excluded)
            slowed = duty_cycle(pid)  # until the group restarts without it

            def restarted() -> bool:
                return running.done() or any(isinstance(e, Resumed) for r in reports(run_dir) for e in events_of(r))

            wait_until(restarted, 120, "the restarted group")
            if not running.done():
                # The new group's workers: the old group's may not have exited yet (a CI run under
                # load found the excluded node's old worker still under its raylet after the resume).
                new = [worker for worker in worker_pids() if worker not in pids]
                hosts = {node_hosting(two_nodes, worker).node_id for worker in new}
                assert hosts == {other.node_id}, "the restarted group is not on the other node alone"
            result = running.result(timeout=scaled(300))
    finally:
        if excluded is not None:
            two_nodes.remove_node(excluded, allow_graceful=False)  # gone already: its processes are reaped

    summary = result.summary
    assert summary["status"] == "finished" and summary["global_step"] == 60
    named = [e for r in reports(run_dir) for e in events_of(r) if isinstance(e, Straggler)]
    assert len(named) == 1 and named[0].action == "exclude", [e.text for e in named]
    assert named[0].pid == slowed["pid"] and named[0].node_id == excluded.node_id, named[0].text
    assert summary["excluded_nodes"] == [
        {
            "node_id": excluded.node_id,
            "node": named[0].node,
            "rank": named[0].rank,
            "step": named[0].step,
            "score": named[0].score,
        }
    ]
    first = first_resumed_report(run_dir)
    assert first["world_size"] == 1 and summary["num_workers"] == 1
    resumed = [e for r in reports(run_dir) for e in events_of(r) if isinstance(e, Resumed)]
    assert resumed and resumed[0].step == named[0].step, [e.text for e in resumed]  # exclude's checkpoint
    gone = {node["NodeID"]: node["Alive"] for node in ray.nodes()}
    assert gone[excluded.node_id] is False, "the excluded node did not leave the cluster"
    print(
        f"\nexclude: {named[0].text}; first step on the node left {first['time/unix'] - slowed['at']:.1f} s "
        f"after the duty cycle began; restarts {summary['restarts']}, recovery_s {summary['recovery_s']}"
    )


def test_an_elastic_restart_sees_a_lost_node_gone_at_once(two_nodes: Cluster) -> None:
    """Ray Train's elastic policy sizes a new group from Ray Data's AutoscalingCoordinator, whose
    view of the nodes is refreshed every 20 s; driver/elastic.FreshNodesCallback refreshes it as
    the controller restarts, so the node just lost no longer counts (the preemption test above
    measures the restart it makes: the next step on the node left)."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    from trainforge.driver.elastic import FreshNodesCallback, answers_knock

    coordinator = get_or_create_autoscaling_coordinator()
    requester = "trainforge-test-elastic"
    ray.get(coordinator.request_resources.remote(requester, [{"CPU": 1}] * 2, expire_after_s=120))

    def reserved() -> set[str]:
        return set(ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True)))

    # (An earlier run's request, until it is cancelled or expires, may hold one of the nodes.)
    held = wait_until(reserved, 30, "a worker node reserved")
    lost = next(n for n in two_nodes.worker_nodes if n.node_id in held)
    listed = {n["NodeID"]: n for n in ray.nodes()}
    two_nodes.remove_node(lost)
    # A killed raylet refuses the knock at once, before the GCS has noticed; a live one answers.
    assert not answers_knock(listed[lost.node_id])
    assert all(answers_knock(listed[n.node_id]) for n in two_nodes.worker_nodes)
    wait_until(lambda: not any(n["NodeID"] == lost.node_id and n["Alive"] for n in ray.nodes()), 30, "the node dead")
    refresh = FreshNodesCallback()
    refresh.requester = requester
    refresh.refresh()
    assert not refresh.warned
    now = set(ray.get(coordinator.get_reserved_resources.remote(requester)))  # no recompute: what the policy reads
    assert lost.node_id not in now, now
    ray.get(coordinator.cancel_request.remote(requester))
