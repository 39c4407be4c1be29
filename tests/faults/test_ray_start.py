"""A local Ray whose node stalls at its start (driver/ray_session.init_local): Ray waits a fixed
30 s for the raylet to register with its GCS, which a busy machine can miss (it did, in a container
under CI's load). The stall here is real: Ray runs the raylet under ``valgrind`` when
``RAY_RAYLET_VALGRIND=1``, and the ``valgrind`` on PATH is a script that holds the first raylet
for longer than Ray waits, then runs it; the second start goes straight through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

ROOT = Path(__file__).resolve().parents[2]

# Ray's own valgrind command line is "valgrind --flag ... RAYLET ARGS": drop the flags, hold the first.
STALLING_VALGRIND = """#!/bin/sh
while [ "${1#--}" != "$1" ]; do shift; done
if [ ! -e "$STALL_MARK" ]; then
    touch "$STALL_MARK"
    sleep 45
fi
exec "$@"
"""

PROBE = """
import ray
from trainforge.driver.ray_session import init_local
init_local({"address": "local", "num_cpus": 1, "include_dashboard": False, "log_to_driver": False})
print("nodes alive:", sum(node["Alive"] for node in ray.nodes()), flush=True)
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)  # Ray's 30 s wait, then a second start: about 40 s on a quiet machine
def test_a_local_ray_whose_node_stalls_is_started_again(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    valgrind = bin_dir / "valgrind"
    valgrind.write_text(STALLING_VALGRIND)
    valgrind.chmod(0o755)
    mark = tmp_path / "stalled-once"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RAY_RAYLET_VALGRIND": "1",
        "STALL_MARK": str(mark),
        "PYTHONPATH": str(ROOT / "src"),
    }
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=scaled(200), check=False
    )
    assert mark.exists(), "the first raylet never went through the stalling valgrind"
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nodes alive: 1" in done.stdout, done.stdout
    assert "did not start within Ray's 30 s" in done.stderr, done.stderr[-3000:]
