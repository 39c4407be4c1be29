"""What encrypting the node network costs a training run on a shaped link: ``trainforge bench
scaling`` on the namespace cluster of tests/cluster, once on the plain network and once with every
node behind WireGuard (tests/cluster/wireguard.py: wireguard-go, userspace), worker w2's cable
shaped to ``--rate`` (tbf), the cluster's processes prioritised as in test_scaling. Ray's TLS is
off in both, so the difference is the tunnel's alone (tls_bench measures Ray's TLS).

A benchmark, not a test (it asserts nothing and CI does not run it). Needs root, iproute2,
wireguard-go and wg::

    python -m tests.cluster.wireguard_bench [--rate 400mbit] [--steps 40] [--repeat 2] [--objects-mb 256]

``--objects-mb N`` also times Ray object transfers of N MB from a task on w1 to a task on w2 over
the unshaped cable, where the encryption's CPU cost is not hidden by the link.

Prints a Markdown table (docs/benchmarks.md records it).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from tests.cluster import wireguard
from tests.cluster.netns import network
from tests.cluster.raycluster import FAST_HEALTH_CHECKS, ray_cluster
from tests.cluster.tls_bench import SPECS, bench, print_tables, transfer_mb_per_s

LABELS = ("plain", "WireGuard")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="400mbit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--objects-mb", type=int, default=0)
    args = parser.parse_args()
    reason = wireguard.unavailable()
    if reason:
        raise SystemExit(f"WireGuard unavailable: {reason}")
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in LABELS}
    transfers: dict[str, list[float]] = {label: [] for label in LABELS}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for label in LABELS:
            with network([spec.name for spec in SPECS]) as net:
                if label == "WireGuard":
                    wireguard.encrypt(net)
                with ray_cluster(net, SPECS, system_config=FAST_HEALTH_CHECKS) as cluster:
                    if args.objects_mb:
                        with cluster.prioritised():
                            transfers[label] = transfer_mb_per_s(cluster, args.objects_mb)
                        print(f"{label}: object transfers {[round(x) for x in transfers[label]]} MB/s", flush=True)
                    net.shape("w2", rate=args.rate)
                    with cluster.prioritised():
                        for attempt in range(args.repeat):
                            print(f"{label} #{attempt + 1} ...", flush=True)
                            run = bench(cluster, folder / f"{label}-{attempt}", args.rate, args.steps)
                            results[label].append({p["workers"]: p for p in run["points"]}[2])
    print_tables("node network", args, transfers, results)


if __name__ == "__main__":
    main()
