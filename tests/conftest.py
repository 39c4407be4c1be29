"""Shared fixtures: one local Ray per test module (never per test), gloo workers, 1 thread each."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import timing
from tests.helpers.timing import slowdown

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# pytest-xdist's workers set COLUMNS=80 (and LINES), which trainforge's consoles respect as a user's
# terminal width (trainforge/consoles.py): the suite reads tables as a pipe gets them, whole, with
# or without xdist.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
ROOT = Path(__file__).resolve().parent.parent

# Under pytest-xdist (the README's test command runs two workers), each worker's local Rays keep
# their sessions, sockets and Prometheus discovery file in a directory of their own: Ray's shared
# default (/tmp/ray) would let one worker's session_latest and discovery file stand for another's.
if "PYTEST_XDIST_WORKER" in os.environ and "RAY_TMPDIR" not in os.environ:
    _ray_tmp = Path("/tmp") / f"tfray-{os.environ['PYTEST_XDIST_WORKER']}-{os.getpid()}"
    _ray_tmp.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_TMPDIR"] = str(_ray_tmp)  # short: Ray's socket paths live under it

# Ray Train's own placement group cleaner (in the plain Ray Train runs that benchmarks and peers
# start: trainforge's runs have driver/cleaner.py's) asks Ray's state API whether its controller
# lives, and without a dashboard in its own Ray that API answers from http://127.0.0.1:8265: another
# test's Ray with a dashboard there (a plain script's ray.init, with this machine's token) says "no
# such actor" and the cleaner removes a live run's placement group. A port nobody serves instead:
# the cleaner's question fails, which it takes for "no answer".
os.environ.setdefault("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:9")

# Every process a worker starts (Ray nodes, servers, CLI runs) inherits this mark of its owner, so
# that if the worker itself dies mid-test, the controller can end what it left running (see
# pytest_testnodedown): orphaned Ray nodes would otherwise load the machine for the rest of the run.
OWNER_ENV = "TRAINFORGE_TEST_OWNER"
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault(OWNER_ENV, f"{os.getppid()}-{os.environ['PYTEST_XDIST_WORKER']}")


# Files that take minutes, longest first: seconds of test time (the longest tests' share) in a full
# run under `-n 2` on a fresh clone, 2-core machine, load average 6-7 (2026-11-29,
# `PYTEST_ADDOPTS=--durations=80`), or the figure of the run before (2026-11-28) where it was larger.
# With `--dist loadfile` xdist hands whole files out in this order, so the longest start first and
# the short files fill the gaps at the end: a long file that starts last runs alone and idles the
# other core (test_lm's one test, listed at 95 s, took 218 s and started late). xdist's own
# reordering (by number of tests, not time) is switched off for this.
LONGEST_FIRST = (
    "faults/test_exact_resume.py",  # 409
    "integration/test_stream.py",  # 239
    "cluster/test_multinode.py",  # 236
    "deploy/test_compose.py",  # 235
    "deploy/test_images.py",  # 131 (builds the image test_compose.py uses: kept beside it)
    "integration/test_lm.py",  # 218
    "integration/test_tune.py",  # 212
    "integration/test_s3.py",  # 202
    "integration/test_fsdp.py",  # 196
    "integration/test_bench_startup.py",  # 184
    "integration/test_ckpt_cli.py",  # 183
    "faults/test_nodes.py",  # 172
    "cluster/test_tls.py",  # 172
    "integration/test_warm.py",  # 167
    "integration/test_tune_faults.py",  # 166
    "integration/test_pipeline.py",  # 150 (its module set-up alone 73)
    "integration/test_tls_local.py",  # 142
    "integration/test_bench_recovery.py",  # 141
    "integration/test_bench_peers.py",  # 129
    "faults/test_pipeline_kill.py",  # 120
    "cluster/test_scaling.py",  # 117
    "integration/test_resume_modes.py",  # 110
    "faults/test_hang.py",  # 102
    "faults/test_mnist_example.py",  # 101
    "unit/test_session.py",  # 98
    "integration/test_mlflow.py",  # 93
    "integration/test_hf_models.py",  # 89
    "unit/test_hsdp.py",  # 66
    "integration/test_passed_objects.py",  # 64
    "unit/test_fsdp.py",  # 62
    "integration/test_cli.py",  # 62
    "integration/test_notebook.py",  # 61
    "integration/test_submit.py",  # 59
    "unit/test_communication.py",  # 55
    "faults/test_straggler.py",  # 52
    "integration/test_engine.py",  # 47
    "cluster/test_encrypted_network.py",  # 46
    "unit/test_blocks.py",  # 46
    "deploy/test_containers.py",  # 44
    "integration/test_bench_data.py",  # 40
    "faults/test_ray_start.py",  # 40 quiet, most of it Ray's 30 s wait
)


def pytest_configure(config: pytest.Config) -> None:
    missing = missing_packages()
    if missing:  # one line, not a collection error per test file
        raise pytest.UsageError(
            f"{', '.join(missing)} not importable by {sys.executable}: run the suite in the project's "
            'environment, as the README does (.venv/bin/pip install -e ".[dev]" && .venv/bin/python -m pytest)'
        )
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def missing_packages() -> list[str]:
    """What the suite imports everywhere that this Python cannot: the project and its test tools."""
    return [name for name in ("trainforge", "torch", "ray", "moto") if importlib.util.find_spec(name) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in its order; the rest after them as collected (a stable
    sort keeps each file's tests together and in their order). Every test's timeout (its own
    marker, or the configured default) is scaled by the machine's slowdown (tests/helpers/timing.py)."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
    factor = slowdown()
    if factor == 1:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        base = float(marker.args[0] if marker.args else marker.kwargs.get("timeout", default)) if marker else default
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * factor), append=False)


def pytest_testnodedown(node: Any, error: object | None) -> None:
    """pytest-xdist's controller, when a worker went down: after a crash, kill the processes the
    dead worker left behind (marked with its OWNER_ENV), before a replacement worker starts."""
    if error is None or not sys.platform.startswith("linux"):
        return
    import psutil

    mark = f"{OWNER_ENV}={os.getpid()}-{node.gateway.id}".encode()
    left = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if mark in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"):
                proc.kill()
                left.append(proc)
    psutil.wait_procs(left, timeout=10)
    if left:
        print(f"\n[{node.gateway.id}] killed {len(left)} process(es) the crashed worker left running", file=sys.stderr)


def pytest_report_header(config: pytest.Config) -> str:
    return f"timeouts x{slowdown():.2f} (tests/helpers/timing.py; {timing.ENV} sets it)"


@pytest.fixture(autouse=True)
def forget_remembered_secrets() -> Iterator[None]:
    """trainforge.redact masks the secret values of every config this process loaded, for the
    process' life (a driver's); each test is a life of its own, so one's values mask nothing in the next."""
    yield
    from trainforge import redact

    redact._REMEMBERED.clear()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A 4-logical-CPU Ray for the whole module; workers import tests.* from the repo root."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_process_outlives_its_module() -> Iterator[None]:
    """Processes a module started (Ray nodes, servers, CLI runs) end with it: a straggler would load
    the 2-core machine under the next module and turn its timing windows into failures. Those still
    alive 15 s after the module's own teardown are killed and named in a warning."""
    import warnings

    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = [p for p in me.children(recursive=True) if p.pid not in before and not _serves_the_whole_session(p)]
    _, alive = psutil.wait_procs(new, timeout=15)
    if not alive:
        return
    names = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            names.append(f"{proc.pid} {' '.join(proc.cmdline())[:80]}")
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    warnings.warn(f"{len(alive)} process(es) outlived their test module and were killed: {names}", stacklevel=1)


def _serves_the_whole_session(process: Any) -> bool:
    """multiprocessing's resource tracker and forkserver (started by loader workers) live as long
    as pytest by design, and are reused by later modules."""
    import psutil

    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.resource_tracker" in command or "multiprocessing.forkserver" in command


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Ray down before the interpreter exits: its core worker torn down by atexit, with other
    threads still running, is what a segmentation fault at pytest's exit points at."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if "_ray_tmp" in globals():
        import shutil

        shutil.rmtree(_ray_tmp, ignore_errors=True)
