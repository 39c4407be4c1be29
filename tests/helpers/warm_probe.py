"""User code for the warm-group tests (tests/integration/test_warm.py): a callback that leaves every
kind of process-wide state behind at the end of its run, and one that records what a run sees at
its start."""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
from typing import Any

import numpy as np
import torch

SECRET_KEY = "TRAINFORGE_PROBE_SECRET"


def torch_settings() -> dict[str, Any]:
    return {
        "matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": [
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ],
        "cudnn": [torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32],
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "default_dtype": str(torch.get_default_dtype()),
        "threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
        "grad": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "autocast_cpu": [torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu"))],
    }


class LeaveEverythingBehind:
    """At the end of its run: a secret and other environment changes, another working directory and
    ``sys.path``, torch's settings, seeded RNGs, and a user module imported (``warm_helper`` from
    ``helper_dir``); with ``interop_threads``, torch's inter-op thread count, which cannot go back."""

    def __init__(self, helper_dir: str, interop_threads: int = 0) -> None:
        self.helper_dir = helper_dir
        self.interop_threads = interop_threads

    def on_train_end(self, ctx: Any) -> None:
        sys.path.insert(0, self.helper_dir)
        importlib.import_module("warm_helper")
        os.environ[SECRET_KEY] = "s3cret-from-run-a"
        os.environ["OMP_NUM_THREADS"] = "7"
        del os.environ["RANK"]
        os.chdir(self.helper_dir)
        torch.set_float32_matmul_precision("medium")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(3)
        torch.set_grad_enabled(False)
        torch.set_anomaly_enabled(True)
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.float16)
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        torch.rand(3)
        if self.interop_threads:
            torch.set_num_interop_threads(self.interop_threads)


class RecordWhatTheRunSees:
    """At the start of its run (rank 0): the environment, working directory, torch's settings and
    ``warm_helper.VALUE`` (imported from ``helper_dir``), as JSON in ``path``."""

    def __init__(self, path: str, helper_dir: str) -> None:
        self.path = path
        self.helper_dir = helper_dir

    def on_train_start(self, ctx: Any) -> None:
        if ctx.rank != 0:
            return
        sys.path.insert(0, self.helper_dir)
        helper = importlib.import_module("warm_helper")
        seen = {
            "secret": os.environ.get(SECRET_KEY),
            "env": {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK")},
            "cwd": os.getcwd(),
            "torch": torch_settings(),
            "helper": helper.VALUE,
            "rng": [random.random(), float(np.random.rand()), torch.rand(1).item()],
        }
        with open(self.path, "w") as out:
            json.dump(seen, out, sort_keys=True)
