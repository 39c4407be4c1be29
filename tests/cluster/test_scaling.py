"""The scaling predictor against the namespace cluster (``netns_cluster``): two 1-CPU worker nodes
whose only link is a veth cable shaped to a known rate (tbf; netem where the kernel has it).

``trainforge bench scaling --workers 1,2 --link RATE`` trains the same small DDP model on one
worker and on two (one per node, so every gradient byte crosses the shaped cable), measures the
efficiency of the two against linear, and sets beside it the efficiency ``trainforge predict``'s
communication model gives: the two-worker run's own measured compute plus the predicted
all-reduce over that link (the two workers share this machine's two cores, which slows their
compute; that is not the link's doing). At two rates the prediction must be within 10 points of
the measurement. The figures are printed (docs/benchmarks.md records them). 400mbit rather than
1gbit: at 1 Gbit/s the all-reduce takes about 10 ms and gloo's own CPU time on the shared cores
moved the error by up to 7 points between runs.

The model is sized so that communication and compute are of the same order at the faster rate
and communication dominates at the slower one: where efficiency is middling, a prediction that
got the bytes, the ring or the overlap wrong misses by far more than 10 points.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.raycluster import RayCluster
from tests.helpers.timing import scaled

pytestmark = pytest.mark.slow

TRAINFORGE = str(Path(sys.executable).parent / "trainforge")
RATES = ("400mbit", "100mbit")
TOLERANCE_POINTS = 10.0

CONFIG: dict[str, Any] = {
    "run": {"name": "scaling"},
    # 64 -> 512 -> 512 -> 10: 301 k parameters, 1.2 MB of float32 gradients in one DDP bucket
    "model": {"name": "mlp", "kwargs": {"hidden_sizes": [512, 512]}},
    "data": {
        "name": "synthetic",
        "kind": "image",
        "input_shape": [64],
        "num_classes": 10,
        "num_samples": 8192,
        "val_fraction": 0.0,
    },
    "train": {"max_steps": 40, "batch_size": 256},
    "optim": {"name": "sgd", "lr": 0.01},
    "failure": {"max_failures": 0},
}


# CONFIG's MLP, layer by layer (weights and biases), in float32 bits; its all-reduce's time at 100mbit
# less at 400mbit: 72 ms.
_widths = [*CONFIG["data"]["input_shape"], *CONFIG["model"]["kwargs"]["hidden_sizes"], CONFIG["data"]["num_classes"]]
GRADIENT_BITS = 32 * sum(n_in * n_out + n_out for n_in, n_out in itertools.pairwise(_widths))
LINK_EXTRA_S = GRADIENT_BITS / 100e6 - GRADIENT_BITS / 400e6


def bench_scaling(cluster: RayCluster, tmp_path: Path, rate: str) -> dict[str, Any]:
    """``trainforge bench scaling`` from the head's namespace; its JSON."""
    folder = tmp_path / rate
    folder.mkdir()
    config_path = folder / "run.yaml"
    config_path.write_text(yaml.safe_dump({**CONFIG, "run": {**CONFIG["run"], "output_dir": str(folder)}}))
    output = folder / "scaling.out.json"
    argv = [TRAINFORGE, "bench", "scaling", str(config_path), "--workers", "1,2", "--steps", "40"]
    argv += ["--link", rate, "--dir", str(folder / "bench"), "--output", str(output), "--address", cluster.gcs_address]
    log_path = folder / "bench.log"
    with open(log_path, "wb") as log:
        code = cluster.driver(argv, log).wait(timeout=scaled(300))
    text = log_path.read_text(errors="replace")
    assert code == 0, f"bench scaling at {rate} exited {code}:\n{text[-3000:]}"
    print(text[text.find("Scaling") :])
    return dict(json.loads(output.read_text()))


def test_predicted_efficiency_is_within_10_points_of_the_measured_one_at_two_link_rates(
    netns_cluster: RayCluster, shaped_link: Callable[..., Any], tmp_path: Path
) -> None:
    netns_cluster.wait_whole()
    results = {}
    for rate in RATES:
        # The measurement is the cluster's own: load beside the suite (or the other xdist worker)
        # would otherwise slow one of the two workers and its peer's wait would count as link time.
        with shaped_link("w2", rate=rate), netns_cluster.prioritised():
            results[rate] = bench_scaling(netns_cluster, tmp_path, rate)
    lines = []
    for rate, result in results.items():
        one, two = sorted(result["points"], key=lambda p: p["workers"])
        assert (one["workers"], two["workers"]) == (1, 2)
        assert one["efficiency"] == 1.0 and one["comm_s"] == 0.0  # one worker sends nothing
        assert two["comm_exposed_s"] > 0 and two["comm_s"] >= two["comm_exposed_s"]
        for key in ("samples_per_s", "step_time_s", "compute_s", "data_wait_s", "optimizer_s", "run_dir"):
            assert key in two
        assert result["link"]["name"] == rate
        page = Path(result["points"][0]["run_dir"]).parent / "report.html"
        assert page.read_text().count("data:image/png;base64,") == 2
        lines.append(
            f"{rate}: measured {two['efficiency']:.1%}, predicted {two['predicted_efficiency']:.1%} "
            f"({two['error_points']:+.1f} points); step {two['step_time_s'] * 1e3:.1f} ms, exposed "
            f"communication {two['comm_exposed_s'] * 1e3:.1f} ms, one worker's step {one['step_time_s'] * 1e3:.1f} ms"
        )
    print("\n" + "\n".join(lines))
    fast, slow = (results[rate]["points"][1] for rate in RATES)
    # Not efficiency: a loaded machine slows the one-worker run too, and once made the 100mbit
    # run look the more efficient. The time the step waits for the link does not depend on that;
    # nor a ratio of the two waits: a loaded peer adds its delay to the faster link's small wait
    # (36 ms at 400mbit once, against 105 ms at 100mbit). The difference is the link's: each of two
    # ring ranks sends the gradients' bytes once, so 100mbit adds about their time at 100mbit
    # less their time at 400mbit; half of that is the margin.
    extra = slow["comm_exposed_s"] - fast["comm_exposed_s"]
    expected = f"expected {LINK_EXTRA_S * 1e3:.0f}"
    assert extra > LINK_EXTRA_S / 2, f"the slower link cost {extra * 1e3:.1f} ms more waiting, {expected}"
    for rate, result in results.items():
        two = result["points"][1]
        assert abs(two["error_points"]) <= TOLERANCE_POINTS, f"{rate}: {lines}"
