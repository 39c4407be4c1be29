"""What Ray's TLS costs a training run on a shaped link: ``trainforge bench scaling`` on the
namespace cluster of tests/cluster, once without TLS and once with it (every node and the driver
with ``RAY_USE_TLS`` and certificates from ``trainforge certs create``), worker w2's cable shaped
to ``--rate`` (tbf), the cluster's processes prioritised as in test_scaling.

A benchmark, not a test (it asserts nothing and CI does not run it). Needs root and iproute2::

    python -m tests.cluster.tls_bench [--rate 100mbit] [--steps 40] [--repeat 2] [--objects-mb 256]

``--objects-mb N`` also times Ray object transfers of N MB from a task on w1 to a task on w2 over
the unshaped cable, where TLS's own cost (encryption on the two shared cores) is not hidden by
the link (``--objects-only``: only that).

Prints a Markdown table (docs/benchmarks.md records it). Ray's TLS covers Ray's own gRPC (the
GCS, raylets, object transfers, task and actor calls, the reports); the gradients travel on
torch.distributed's gloo connections, which it does not cover (docs/security.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.netns import SUBNET, network
from tests.cluster.raycluster import BIN, FAST_HEALTH_CHECKS, NodeSpec, RayCluster, ray_cluster
from tests.cluster.test_scaling import CONFIG
from trainforge.config.schema import TlsConfig
from trainforge.driver.certs import create_certs
from trainforge.driver.tls import ray_tls_env

SPECS = [NodeSpec("head", num_cpus=0, head=True), NodeSpec("w1", num_cpus=1), NodeSpec("w2", num_cpus=1)]


def bench(cluster: RayCluster, folder: Path, rate: str, steps: int) -> dict[str, Any]:
    folder.mkdir(parents=True)
    config_path = folder / "run.yaml"
    config_path.write_text(yaml.safe_dump({**CONFIG, "run": {**CONFIG["run"], "output_dir": str(folder)}}))
    output = folder / "scaling.json"
    argv = [str(BIN / "trainforge"), "bench", "scaling", str(config_path), "--workers", "1,2", "--steps", str(steps)]
    argv += ["--link", rate, "--dir", str(folder / "bench"), "--output", str(output), "--address", cluster.gcs_address]
    with open(folder / "bench.log", "wb") as log:
        code = cluster.driver(argv, log).wait()
    if code != 0:
        raise SystemExit(f"bench scaling exited {code}: {(folder / 'bench.log').read_text()[-3000:]}")
    return dict(json.loads(output.read_text()))


TRANSFER = """
import sys, time
import numpy as np
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
size = int(sys.argv[2]) << 20

@ray.remote(resources={"w1": 1}, num_cpus=0)
def make(seed):
    return np.full(size, seed % 251, dtype=np.uint8)

@ray.remote(resources={"w2": 1}, num_cpus=0)
def take(array):
    return int(array.nbytes)

for seed in range(4):
    ref = make.remote(seed)
    ray.wait([ref], fetch_local=False)
    started = time.perf_counter()
    assert ray.get(take.remote(ref)) == size
    print(time.perf_counter() - started, flush=True)
"""


def transfer_mb_per_s(cluster: RayCluster, megabytes: int) -> list[float]:
    """MB/s of Ray object transfers from w1 to w2 (the first of four dropped: connections warm)."""
    argv = [sys.executable, "-c", TRANSFER, cluster.gcs_address, str(megabytes)]
    done = subprocess.run(cluster.net.exec_argv("head", argv), env=cluster.env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"object transfer failed: {done.stderr[-3000:]}")
    return [megabytes / float(line) for line in done.stdout.split()[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--objects-mb", type=int, default=0)
    parser.add_argument("--objects-only", action="store_true")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"plain": [], "TLS": []}
    transfers: dict[str, list[float]] = {"plain": [], "TLS": []}
    with tempfile.TemporaryDirectory() as scratch, network([spec.name for spec in SPECS]) as net:
        folder = Path(scratch)
        hosts = ["localhost", "127.0.0.1", *(f"{SUBNET}.{i}" for i in range(1, len(SPECS) + 1))]
        files = create_certs(folder / "certs", hosts)
        tls = ray_tls_env(TlsConfig(ca=str(files.ca), cert=str(files.cert), key=str(files.key)))
        for label, env in (("plain", {}), ("TLS", tls)):
            with ray_cluster(net, SPECS, system_config=FAST_HEALTH_CHECKS, env=env) as cluster:
                if args.objects_mb:
                    with cluster.prioritised():
                        transfers[label] = transfer_mb_per_s(cluster, args.objects_mb)
                    print(f"{label}: object transfers {[round(x) for x in transfers[label]]} MB/s", flush=True)
                if args.objects_only:
                    continue
                net.shape("w2", rate=args.rate)
                with cluster.prioritised():
                    for attempt in range(args.repeat):
                        print(f"{label} #{attempt + 1} ...", flush=True)
                        run = bench(cluster, folder / f"{label}-{attempt}", args.rate, args.steps)
                        results[label].append({p["workers"]: p for p in run["points"]}[2])
                net.unshape("w2")
    print_tables("Ray's gRPC", args, transfers, {} if args.objects_only else results)


def print_tables(
    column: str, args: argparse.Namespace, transfers: dict[str, list[float]], results: dict[str, list[dict[str, Any]]]
) -> None:
    """The markdown tables docs/benchmarks.md records: object transfers (``--objects-mb``) and the
    two-worker point of each variant (``column`` names what differs between the rows)."""
    if args.objects_mb:
        print(f"\nRay object transfer w1 -> w2, {args.objects_mb} MB, unshaped cable (median of 3)\n")
        print(f"| {column} | MB/s |")
        print("|---|---|")
        for label, rates in transfers.items():
            print(f"| {label} | {statistics.median(rates):,.0f} |")
    if not results:
        return
    print(f"\n{args.rate} on w2's cable, 2 workers (one per node), {args.steps} steps, median of {args.repeat}\n")
    print(f"| {column} | samples/s | step time | exposed communication | efficiency vs 1 worker |")
    print("|---|---|---|---|---|")
    for label, points in results.items():

        def median(key: str, points: list[dict[str, Any]] = points) -> float:
            return float(statistics.median(p[key] for p in points))

        print(
            f"| {label} | {median('samples_per_s'):,.0f} | {median('step_time_s') * 1e3:.1f} ms | "
            f"{median('comm_exposed_s') * 1e3:.1f} ms | {median('efficiency'):.1%} |"
        )
    print("\nevery run:", json.dumps({k: [round(p["samples_per_s"]) for p in v] for k, v in results.items()}))


if __name__ == "__main__":
    main()
