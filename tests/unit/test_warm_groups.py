"""Which runs a warm worker group takes, what makes two runs' groups interchangeable, and what a
warm worker resets between runs (driver/warm.py, worker/warm.py), without Ray."""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import random
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.runs import tiny_run
from trainforge.config import validate
from trainforge.driver.warm import Shape, why_not
from trainforge.worker.fresh import TORCH_SETTINGS, Baseline


def config_of(tmp_path: Path, **sections: Any) -> Any:
    return validate(tiny_run(tmp_path, **sections))


@pytest.mark.parametrize(
    ("sections", "reason"),
    [
        ({"scaling": {"num_workers": [1, 2]}}, "scaling.num_workers is elastic"),
        ({"scaling": {"use_gpu": True}}, "scaling.use_gpu"),
        ({"parallel": {"strategy": "fsdp"}}, "parallel.strategy fsdp"),
        ({"scaling": {"num_workers": 2}, "parallel": {"tensor_parallel": 2}}, "parallel.tensor_parallel"),
    ],
)
def test_runs_that_need_ray_trains_own_group_say_why(tmp_path: Path, sections: dict, reason: str) -> None:
    assert reason in (why_not(config_of(tmp_path, **sections)) or "")


def test_a_plain_data_parallel_run_takes_a_warm_group(tmp_path: Path) -> None:
    assert why_not(config_of(tmp_path, scaling={"num_workers": 2})) is None


def test_streamed_data_needs_ray_trains_dataset_shards(tmp_path: Path) -> None:
    config = config_of(tmp_path, data={"name": "jsonl", "path": str(tmp_path / "rows")})
    assert "streams through Ray Data" in (why_not(config) or "")


def test_groups_are_shared_only_by_runs_of_the_same_shape_and_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "my_models.py"
    module.write_text("def net(**kwargs):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    factory = {"name": None, "factory": "my_models:net"}
    env = {"OMP_NUM_THREADS": "1"}

    def key(**sections: Any) -> str:
        return Shape.of(config_of(tmp_path, model=factory, **sections), env).key

    base = key()
    assert key(optim={"lr": 0.5}, seed=3, train={"max_steps": 7}) == base  # what a run trains is not the shape
    assert key(scaling={"num_workers": 2}) != base
    assert key(scaling={"resources_per_worker": {"CPU": 2}}) != base
    assert key(failure={"collective_timeout_s": 60}) != base
    assert Shape.of(config_of(tmp_path, model=factory), {**env, "NCCL_DEBUG": "INFO"}).key != base
    # A worker keeps the modules it imported: an edited factory module needs new workers.
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert key() != base


def process_state() -> dict[str, Any]:
    """What a run may change in its process, as comparable values."""
    hooks = torch.nn.modules.module._global_forward_hooks
    return {
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "path": list(sys.path),
        "warnings": list(warnings.filters),
        "torch": {name: read() for name, (read, _) in TORCH_SETTINGS.items()},
        "hooks": list(hooks),
        "logging": [
            (logger.level, list(logger.handlers), logger.propagate)
            for logger in (logging.root, logging.getLogger("trainforge.probe"))
        ]
        + [logging.root.manager.disable],
        "rng": (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()),
    }


def test_a_used_process_is_put_back_as_it_was_before_its_first_run(tmp_path: Path) -> None:
    """Everything a run changed goes back; a user module it imported is imported again, as its file
    is now."""
    (tmp_path / "user_helper.py").write_text("VALUE = 1\n")
    os.environ["TRAINFORGE_PROBE_KEPT"] = "as it was"
    logging.getLogger("trainforge.probe")  # a logger the process has before its first run
    baseline = Baseline.capture()
    before = process_state()
    try:
        os.environ["TRAINFORGE_PROBE_SECRET"] = "s3cret"
        os.environ["TRAINFORGE_PROBE_KEPT"] = "changed"
        del os.environ["TRAINFORGE_PROBE_KEPT"]
        os.chdir(tmp_path)
        sys.path.insert(0, str(tmp_path))
        warnings.simplefilter("ignore")
        logging.getLogger("trainforge.probe").setLevel(logging.DEBUG)
        logging.getLogger("trainforge.probe").addHandler(logging.NullHandler())
        logging.root.addHandler(logging.NullHandler())
        logging.disable(logging.WARNING)
        torch.set_float32_matmul_precision("medium")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(torch.get_num_threads() + 1)
        torch.set_grad_enabled(False)
        torch.set_anomaly_enabled(True, True)
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.float16)
        torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        import user_helper  # type: ignore[import-not-found]

        assert user_helper.VALUE == 1
        assert process_state() != before
        baseline.restore()
        assert baseline.problem() is None
        assert process_state() == before
        assert "user_helper" not in sys.modules

        (tmp_path / "user_helper.py").write_text("VALUE = 'edited'\n")
        sys.path.insert(0, str(tmp_path))
        assert importlib.import_module("user_helper").VALUE == "edited"
    finally:
        baseline.restore()
        os.environ.pop("TRAINFORGE_PROBE_KEPT", None)
    assert process_state()["torch"] == before["torch"]


def test_what_cannot_be_put_back_makes_the_process_unfit(tmp_path: Path) -> None:
    """A user's C extension or shared library, inference mode left on, a module the process keeps
    whose file changed: each is one line saying why the process must not run again."""
    (tmp_path / "kept_before.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("kept_before")  # in the process before its first run: kept
        baseline = Baseline.capture()
        assert baseline.problem() is None
        with open(tmp_path / "kept_before.py", "a") as module:
            module.write("VALUE = 2\n")
        assert "module kept_before changed on disk" in (baseline.problem() or "")

        extension = next(Path(sysconfig.get_paths()["stdlib"], "lib-dynload").glob("xxlimited_35.*"))
        shutil.copy(extension, tmp_path / extension.name)
        baseline = Baseline.capture()
        importlib.import_module("xxlimited_35")
        baseline.restore()
        assert "C extension xxlimited_35" in (baseline.problem() or "")

        baseline = Baseline.capture()
        shutil.copy(extension, tmp_path / "libuser_kernels.so")
        ctypes.CDLL(str(tmp_path / "libuser_kernels.so"))  # as torch.ops.load_library does
        baseline.restore()
        assert f"shared library {tmp_path / 'libuser_kernels.so'}" in (baseline.problem() or "")

        baseline = Baseline.capture()
        guard = torch.inference_mode()
        guard.__enter__()
        try:
            baseline.restore()
        finally:
            guard.__exit__(None, None, None)
        assert baseline.problem() == "a run left torch's inference mode on"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kept_before", None)
