"""``train.reuse_freed_memory``: the page faults a step's large tensors cost, counted by the kernel."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainforge.worker.allocator import _libc

needs_glibc = pytest.mark.skipif(_libc() is None, reason="mallopt is glibc's")

# Training steps whose activations (2048 x 8192 floats, 64 MiB) are above glibc's largest dynamic
# mmap threshold, as a language model's logits are; the minor faults per step, in each setting.
STEPS = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from trainforge.worker.allocator import set_reuse

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2048, 64)

    def step():
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def faults_per_step(steps=8):
        # The fewest faults of any step: the heap takes a few steps to settle on a step's blocks.
        counts = []
        for _ in range(steps):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step()
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return min(counts)

    out = {}
    for setting in sys.argv[1:]:
        said = None if setting == "glibc" else set_reuse(setting == "reuse")
        out[setting] = {"faults": faults_per_step(), "said": said}
    print(json.dumps(out))
    """
)
PAGES = 2048 * 8192 * 4 // 4096  # one activation's pages


def faults(*settings: str) -> dict[str, dict[str, object]]:
    result = subprocess.run(
        [sys.executable, "-c", STEPS, *settings], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(result.stdout)


@needs_glibc
def test_a_steps_blocks_are_reused_instead_of_faulted_in_again_and_false_hands_them_back() -> None:
    """glibc's own thresholds, then those ``false`` sets (what a warm worker's next run with
    ``reuse_freed_memory: false`` gets: glibc cannot go back to its dynamic ones), then ``true``'s,
    in one process."""
    out = faults("glibc", "return", "reuse")
    glibc, returned, reuse = out["glibc"], out["return"], out["reuse"]
    assert glibc["faults"] > PAGES, glibc  # each large block mapped, zeroed and unmapped every step
    assert returned["faults"] > PAGES and "returns freed blocks" in str(returned["said"]), returned
    assert reuse["faults"] < PAGES / 4, reuse  # the same heap pages every step
    assert "keeps freed blocks" in str(reuse["said"])


def test_apply_sets_once_per_setting_and_leaves_glibcs_own_alone() -> None:
    code = textwrap.dedent(
        """
        import json
        from trainforge.worker import allocator
        allocator.set_reuse = lambda reuse: f"set {reuse}"
        print(json.dumps([allocator.apply(r) for r in (False, True, True, False, False, True)]))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(result.stdout) == [None, "set True", None, "set False", None, "set True"]


@pytest.mark.slow  # a benchmark's smoke run: two processes that build the CNN
@needs_glibc
def test_the_benchmark_prints_both_settings_for_the_cnn() -> None:
    """``python -m trainforge.bench.allocator``, CI-sized: a line per setting with its figures."""
    command = [
        sys.executable,
        "-m",
        "trainforge.bench.allocator",
        "--workload",
        "cnn",
        "--steps",
        "2",
        "--repeats",
        "1",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if "faults/step" in line]
    assert len(lines) == 2 and "glibc's defaults" in lines[0] and "thresholds raised" in lines[1], result.stdout
    assert all("peak RSS" in line and "CPU" in line for line in lines)


@pytest.mark.slow  # two processes that import the worker and build a run
def test_build_applies_train_reuse_freed_memory() -> None:
    """The key reaches the worker: ``build`` raises the thresholds by default and leaves glibc's own
    with ``false`` (each in a new process: the setting is the process's)."""
    code = textwrap.dedent(
        """
        import sys, tempfile
        from pathlib import Path
        from tests.helpers.runs import tiny_run
        from trainforge.config import Config
        from trainforge.worker import allocator
        from trainforge.worker.build import build

        reuse = sys.argv[1] == "true"
        config = tiny_run(Path(tempfile.mkdtemp()), train={"reuse_freed_memory": reuse})
        build(Config.model_validate(config), ranks=(0, 1))
        print(allocator._applied)
        """
    )
    root = str(Path(__file__).resolve().parents[2])
    seen = {}
    for value in ("true", "false"):
        done = subprocess.run(
            [sys.executable, "-c", code, value], capture_output=True, text=True, check=True, timeout=300, cwd=root
        )
        seen[value] = done.stdout.strip().splitlines()[-1]
    assert seen == {"true": "True", "false": "None"}, seen


@pytest.mark.slow  # a process that imports torch and builds the bench's CNN twice
def test_bench_peers_reuse_freed_memory_reaches_the_peers_build() -> None:
    """``bench peers --peers-reuse-freed-memory``: the flag travels with the workload's JSON (as the
    script peers read it) and the peers' common ``build`` raises the thresholds in the process that
    trains; without it the peer keeps glibc's own."""
    code = textwrap.dedent(
        """
        import dataclasses, json
        from trainforge.bench.workload import Workload, build
        from trainforge.worker import allocator

        plain = Workload.sized_for(10, 8, 1)
        equal = Workload.from_json(dataclasses.replace(plain, peers_reuse_freed_memory=True).to_json())
        build(plain)
        seen = [allocator._applied]
        build(equal)
        seen.append(allocator._applied)
        print(json.dumps({"seen": seen, "flag": equal.peers_reuse_freed_memory}))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"seen": [None, True], "flag": True}
