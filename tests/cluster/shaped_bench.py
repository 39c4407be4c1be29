"""Time to a target validation loss over a shaped link: DDP, compressed DDP and local SGD / DiLoCo.

A benchmark, not a test (it asserts nothing and CI does not run it): the namespace cluster of
tests/cluster (two 1-CPU worker nodes, one training worker each), worker w2's cable shaped to
``--rate`` (tbf), and one ``trainforge train`` per variant from the head's namespace. Every variant
trains the same model on the same data with the same inner optimizer; the figure is the wall
time from the run's start to its first validation at or below ``--target``. Needs root and
iproute2::

    python -m tests.cluster.shaped_bench [--rate 100mbit] [--target 0.25] [--steps 600]

Prints a Markdown table (docs/benchmarks.md records it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.netns import network
from tests.cluster.raycluster import FAST_HEALTH_CHECKS, NodeSpec, ray_cluster
from trainforge.report.data import load_run

TRAINFORGE = str(Path(sys.executable).parent / "trainforge")
SPECS = [NodeSpec("head", num_cpus=0, head=True), NodeSpec("w1", num_cpus=1), NodeSpec("w2", num_cpus=1)]
VARIANTS: dict[str, dict[str, Any]] = {
    "DDP": {},
    "DDP, bf16 gradients": {"grad_compression": "bf16"},
    "DDP, PowerSGD rank 2": {"grad_compression": "powersgd", "powersgd": {"rank": 2, "warmup_steps": 20}},
    "local SGD, H = 8": {"sync": {"every_n_steps": 8}},
    "local SGD, H = 32": {"sync": {"every_n_steps": 32}},
    "DiLoCo, H = 32 (Nesterov 0.7)": {"sync": {"every_n_steps": 32, "outer_optimizer": "nesterov", "outer_lr": 0.7}},
}


def config(folder: Path, name: str, parallel: dict[str, Any], steps: int) -> dict[str, Any]:
    return {
        "run": {"name": name, "output_dir": str(folder)},
        # 64 -> 512 -> 512 -> 10 on digits: 301 k parameters, 1.2 MB of float32 gradients a step
        "model": {"name": "mlp", "kwargs": {"hidden_sizes": [512, 512]}},
        "data": {"name": "digits"},
        "train": {"max_steps": steps, "batch_size": 32, "eval_every_n_steps": 16, "log_every_n_steps": 16},
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "scaling": {"num_workers": 2},
        "parallel": parallel,
        "tracking": {"enabled": False},
        "metrics": {"enabled": False},
        "failure": {"max_failures": 0},
    }


def time_to_target(run_dir: Path, target: float) -> tuple[float | None, int | None, float, float]:
    """(seconds to the first validation <= target, its step, the best validation loss, the run's wall time)."""
    run = load_run(run_dir)
    reached, step, best = None, None, float("inf")
    for report in run.reports:
        loss = report.get("val/loss")
        if isinstance(loss, (int, float)):
            best = min(best, loss)
            if reached is None and loss <= target:
                reached, step = float(report["time/elapsed_s"]), int(report["step"])
    best = min(best, float(run.summary.get("final_metrics", {}).get("val/loss", best)))
    return reached, step, best, float(run.summary["wall_time_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--target", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch, network([spec.name for spec in SPECS]) as net:
        folder = Path(scratch)
        with ray_cluster(net, SPECS, system_config=FAST_HEALTH_CHECKS) as cluster:
            net.shape("w2", rate=args.rate)
            for index, (label, parallel) in enumerate(VARIANTS.items()):
                name = f"v{index}"
                path = folder / f"{name}.yaml"
                path.write_text(yaml.safe_dump(config(folder, name, parallel, args.steps)))
                log_path = folder / f"{name}.log"
                print(f"{label} ...", flush=True)
                argv = [TRAINFORGE, "train", str(path), "--address", cluster.gcs_address]
                with open(log_path, "wb") as log:
                    code = cluster.driver(argv, log).wait()
                if code != 0:
                    print(log_path.read_text(errors="replace")[-3000:])
                    raise SystemExit(f"{label}: exit {code}")
                reached, step, best, wall = time_to_target(folder / name, args.target)
                rows.append((label, reached, step, best, wall))
                print(f"  {reached} s at step {step}; best val/loss {best:.3f}; wall {wall:.1f} s", flush=True)
    print(f"\n{args.rate}, target val/loss <= {args.target}, 2 workers, {args.steps} steps at most\n")
    print("| variant | time to target | step reached | best val/loss | wall time of the run |")
    print("|---|---|---|---|---|")
    for label, reached, step, best, wall in rows:
        shown = f"{reached:.1f} s" if reached is not None else "not reached"
        print(f"| {label} | {shown} | {step if step is not None else '-'} | {best:.3f} | {wall:.1f} s |")


if __name__ == "__main__":
    main()
