"""trainforge on a three-node Ray cluster whose nodes talk over veth links (``netns_cluster``):
a head (no CPUs, the drivers run in its namespace) and two 1-CPU worker nodes, one training
worker each, every byte between them crossing the bridge.

* A worker node whose cable is pulled mid-run (``ip link set ... down`` at the switch) is
  declared dead by the GCS's health checks and the run's worker group fails. Fixed size: the run
  waits; the cable is plugged back, the node's raylet (told it is dead) exits, the harness starts
  the node again (like a pod restart) and the run resumes from its newest checkpoint with 2
  workers. Elastic ``[1, 2]``: the run resumes on the node that is left.
* ``trainforge submit`` from the head's namespace to the head's Jobs API (token auth on) runs the
  config as a Ray job whose workers are on the two worker nodes, one each; it ends with the same
  weights, bit for bit, as the same config on one node (a local Ray): DDP with gloo sums the same
  two gradients in the same way.

Each partition test prints its detection and recovery times (docs/operations.md, "Network
partition (namespace cluster)"); they are measured, never asserted.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.cluster.raycluster import ROOT, RayCluster
from tests.helpers.faults import checkpoints, events, first_resumed_report, paced_run, reports, steps_after, wait_until
from tests.helpers.runs import tiny_run
from tests.helpers.timing import scaled

pytestmark = pytest.mark.slow

# Ray Train waits this long for a worker group's placement before it retries (default 60 s).
START_TIMEOUT = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
TRAINFORGE = str(Path(sys.executable).parent / "trainforge")
CUT = "w2"  # the node whose cable is pulled: it hosts a training worker, never the driver


@dataclass
class Run:
    """One ``trainforge train`` process and where its output goes."""

    process: subprocess.Popen[bytes]
    run_dir: Path
    log_path: Path

    def wait(self, timeout_s: float) -> dict[str, Any]:
        """The run's summary.json once the command ends (exit 0 asserted, with its output)."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the run did not end in {timeout_s:.0f} s:\n{self.output()}") from None
        assert code == 0, f"trainforge train exited {code}:\n{self.output()}"
        return dict(json.loads((self.run_dir / "summary.json").read_text()))

    def running(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def start_run(
    tmp_path: Path, config: dict[str, Any], cluster: RayCluster | None, env: dict[str, str] | None = None
) -> Run:
    """``trainforge train`` on the namespace cluster (in the head's namespace, ``--address``), or
    on a local Ray in this machine's own namespace when ``cluster`` is None."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))
    argv = [TRAINFORGE, "train", str(config_path)]
    log_path = tmp_path / "driver.log"
    with open(log_path, "wb") as log:  # the child writes to its own copy of the descriptor
        if cluster is not None:
            process = cluster.driver([*argv, "--address", cluster.gcs_address], log, env=env)
        else:
            local_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**local_env, "PYTHONPATH": str(ROOT), **(env or {})}
            )
    return Run(process, Path(config["run"]["output_dir"]) / config["run"]["name"], log_path)


@pytest.fixture
def whole(netns_cluster: RayCluster) -> Iterator[RayCluster]:
    """The cluster with every cable plugged and every node alive and idle, before and after."""
    netns_cluster.wait_whole()
    yield netns_cluster
    for node in netns_cluster.nodes:
        netns_cluster.net.set_link(node, True)


def nodes_of(run_dir: Path) -> set[str]:
    """Addresses of the nodes the run's workers reported system metrics from (``system/<node IP>/...``)."""
    return {key.split("/")[1] for report in reports(run_dir) for key in report if key.startswith("system/")}


@dataclass
class Cut:
    """A pulled cable: when, and what the GCS said about it."""

    at: float
    gcs_offset: int
    dead_at: float = 0.0
    up_at: float = 0.0


def pull_cable(cluster: RayCluster, node: str) -> Cut:
    cut = Cut(at=0.0, gcs_offset=cluster.gcs_log_size())
    cut.at = time.time()
    cluster.net.set_link(node, False)
    return cut


def gcs_declares_dead(cluster: RayCluster, cut: Cut, timeout_s: float = 60) -> float:
    """When the GCS logged the failed health check that made the node dead (its own timestamp)."""
    lines = wait_until(
        lambda: cluster.gcs_lines_since(cut.gcs_offset, r"Health check failed for node .*remaining checks 0\b"),
        timeout_s,
        "the GCS to declare the cut-off node dead (gcs_server.out: 'Health check failed ... remaining checks 0')",
        interval_s=0.2,
    )
    stamp = lines[0][1:24]  # "[2026-11-23 20:30:01,234 W ...": the GCS logs local time
    cut.dead_at = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return cut.dead_at


def failure_seen(run_dir: Path, timeout_s: float = 60) -> float:
    """When Ray Train's controller reported the worker group's failure (metrics.jsonl)."""
    errors = wait_until(
        lambda: [r for r in reports(run_dir) if r.get("event") == "worker_error"],
        timeout_s,
        "the run to report the worker group's failure",
    )
    return float(errors[0]["time"])


def partition_line(label: str, cut: Cut, run_dir: Path, failed_at: float, summary: dict[str, Any]) -> str:
    first = first_resumed_report(run_dir)
    line = (
        f"\n{label}: cable pulled; GCS declared the node dead after {cut.dead_at - cut.at:.1f} s, the run saw the "
        f"failure after {failed_at - cut.at:.1f} s; first step after recovery (step {first['step']} on "
        f"{first['world_size']} worker(s)) {first['time/unix'] - cut.at:.1f} s after the cut"
    )
    if cut.up_at:
        line += f", {first['time/unix'] - cut.up_at:.1f} s after the cable was plugged back"
    return line + f"; summary restarts {summary['restarts']} recovery_s {summary['recovery_s']}"


def partition_config(tmp_path: Path, num_workers: Any) -> dict[str, Any]:
    return paced_run(
        tmp_path, scaling={"num_workers": num_workers}, train={"max_steps": 80}, failure={"max_failures": 3}
    )


def test_fixed_size_run_waits_for_a_cut_off_node_then_resumes(whole: RayCluster, tmp_path: Path) -> None:
    run = start_run(tmp_path, partition_config(tmp_path, 2), whole, env=START_TIMEOUT)
    wait_until(lambda: checkpoints(run.run_dir) or not run.running(), 240, "the first checkpoint")
    assert run.running(), run.output()
    cut = pull_cable(whole, CUT)
    gcs_declares_dead(whole, cut)
    failed_at = failure_seen(run.run_dir)
    # One node short, 2 workers cannot be placed: the run must wait, neither fail nor train on.
    time.sleep(5)
    assert run.running(), f"the run ended with a node cut off:\n{run.output()}"
    assert not steps_after(run.run_dir, cut.at + 1), "trained on with a node cut off"
    restarts_before = len(whole.nodes[CUT].starts)
    cut.up_at = time.time()
    whole.net.set_link(CUT, True)
    summary = run.wait(300)

    assert summary["status"] == "finished" and summary["global_step"] == 80
    assert summary["num_workers"] == 2 and summary["restarts"] >= 1 and summary["recovery_s"], summary
    first = first_resumed_report(run.run_dir)
    assert first["world_size"] == 2
    node = whole.nodes[CUT]
    assert len(node.starts) > restarts_before, "the resumed run found the cut-off node without a restart"
    print(partition_line("fixed [2]", cut, run.run_dir, failed_at, summary))
    print(
        f"fixed [2]: the cut-off node's ray start exited {node.exits[-1][0] - cut.up_at:.1f} s after the cable "
        f"was plugged back (exit code {node.exits[-1][1]}); restarted, it was used by the run's next worker group"
    )


def test_elastic_run_continues_on_the_node_left(whole: RayCluster, tmp_path: Path) -> None:
    config = partition_config(tmp_path, [1, 2])
    config["train"]["global_batch_size"] = 16  # 8 per worker on 2; on the node left, 2 accumulation steps of 8
    run = start_run(tmp_path, config, whole, env=START_TIMEOUT)
    wait_until(lambda: checkpoints(run.run_dir) or not run.running(), 240, "the first checkpoint")
    assert run.running(), run.output()
    cut = pull_cable(whole, CUT)
    gcs_declares_dead(whole, cut)
    failed_at = failure_seen(run.run_dir)
    summary = run.wait(300)

    sizes = [r["world_size"] for r in reports(run.run_dir) if "world_size" in r]
    assert sizes[0] == 2 and sizes[-1] == 1, sizes
    assert summary["status"] == "finished" and summary["global_step"] == 80
    assert summary["num_workers"] == 1 and summary["restarts"] >= 1 and summary["recovery_s"], summary
    assert first_resumed_report(run.run_dir)["world_size"] == 1
    assert any(e.startswith("resumed with 1 workers from a checkpoint written by 2") for e in events(run.run_dir))
    # The global batch held over the resize: the run goes on through the same samples per step.
    held = "2 -> 1 data-parallel workers: the global batch of 16 samples holds (2 accumulation steps of 8 per worker)"
    assert any(held in e for e in events(run.run_dir)), events(run.run_dir)
    assert summary["batch"]["grad_accum_steps"] == 2, summary["batch"]
    print(partition_line("elastic [1, 2]", cut, run.run_dir, failed_at, summary))


def test_submitted_run_uses_both_worker_nodes_and_ends_with_the_weights_of_one_node(
    whole: RayCluster, tmp_path: Path
) -> None:
    """``trainforge submit`` from the head's namespace to its Jobs API; the same config on one node
    (a local Ray in this machine's namespace) runs at the same time and is compared bit for bit."""
    # scaling.env reaches every worker over the node's own environment (the harness sets the probe
    # to "from-the-node" and GLOO_SOCKET_IFNAME itself on every node).
    env = {"GLOO_SOCKET_IFNAME": "eth0", "TRAINFORGE_ENV_PROBE": "from-the-config"}
    sections: dict[str, Any] = {"scaling": {"num_workers": 2, "env": env}, "checkpoint": {"every_n_steps": 10}}
    project = tmp_path / "project"  # the working directory that travels with the job
    project.mkdir()
    (project / "run.yaml").write_text(yaml.safe_dump(tiny_run(tmp_path / "results", **sections)))
    local = start_run(tmp_path / "local", tiny_run(tmp_path / "local", **sections), None)
    argv = [TRAINFORGE, "submit", "run.yaml", "--address", whole.dashboard_url]
    env = {**whole.env, "RAY_ADDRESS": ""}
    done = subprocess.run(
        whole.net.exec_argv("head", argv), cwd=project, env=env, capture_output=True, text=True, timeout=scaled(300)
    )
    local_summary = local.wait(300)

    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp_path / "results" / "t"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["global_step"] == 20
    assert "step 20/20" in done.stderr or "finished" in done.stderr, done.stderr[-2000:]
    workers = {whole.nodes[n].address for n in ("w1", "w2")}
    assert nodes_of(run_dir) == workers, f"workers did not run one per worker node: {nodes_of(run_dir)}"
    seen = [line for line in (run_dir / "workers.log").read_text().splitlines() if "worker environment:" in line]
    assert len(seen) == 2 and all(
        line.endswith("GLOO_SOCKET_IFNAME=eth0 TRAINFORGE_ENV_PROBE=from-the-config") for line in seen
    ), seen
    assert summary["num_workers"] == local_summary["num_workers"] == 2
    assert local_summary["global_step"] == 20
    across = load_file(str(run_dir / "model.safetensors"))
    one_node = load_file(str(local.run_dir / "model.safetensors"))
    assert across.keys() == one_node.keys()
    different = [name for name in across if not torch.equal(across[name], one_node[name])]
    assert not different, f"tensors differ between two nodes and one: {different}"
    print(f"\nsame weights across the network and on one node: {sorted(across)}")
