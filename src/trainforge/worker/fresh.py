"""A warm worker's process as a fresh one: what a new worker process holds before its first run
(``Baseline.capture``), put back after each run (``Baseline.restore``), so that the next run on
the process observes exactly what it would on a new worker (docs/tune.md, "What a reused worker
resets").

Put back: the environment, the working directory, ``sys.path``, the umask, warning filters, the
levels and handlers of the loggers the process had,
torch's global settings (``TORCH_SETTINGS``), ``torch.nn.Module``'s global hooks, the RNGs
(Python, NumPy, torch CPU and CUDA) and compiled graphs; modules a run imported from outside the
libraries (stdlib, site-packages, trainforge) are dropped from ``sys.modules`` so the next run
imports their files as they are then. What cannot be put back makes the process unfit for another
run (``Baseline.unfit``): a C extension a run loaded from outside the libraries, a changed
inter-op thread count, inference mode left on, or a module the process keeps whose file changed.
"""

from __future__ import annotations

import gc
import importlib
import importlib.machinery
import logging
import os
import random
import site
import socket
import sys
import sysconfig
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.modules.module as module_hooks

Setting = tuple[Callable[[], Any], Callable[[Any], None]]


def _autocast(device: str) -> Setting:
    def read() -> tuple[bool, torch.dtype]:
        return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)

    def write(value: tuple[bool, torch.dtype]) -> None:
        torch.set_autocast_enabled(device, value[0])
        torch.set_autocast_dtype(device, value[1])

    return read, write


def _attribute(owner: Any, name: str) -> Setting:
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _set_grad_enabled(enabled: bool) -> None:
    torch.set_grad_enabled(enabled)  # this thread's: the one that runs every run of the worker


def _set_anomaly(value: tuple[bool, bool]) -> None:
    torch.set_anomaly_enabled(value[0], value[1])


# Where torch keeps float32 precision choices (torch.backends.<name>.fp32_precision), and the older
# switches over the same state, which torch refuses to read once the two kinds were mixed.
PRECISION_BACKENDS = (
    "",
    "cuda.matmul",
    "cudnn",
    "cudnn.conv",
    "cudnn.rnn",
    "mkldnn",
    "mkldnn.matmul",
    "mkldnn.conv",
    "mkldnn.rnn",
)
LEGACY_PRECISION: dict[str, Setting] = {
    "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "cuda.matmul.allow_tf32": _attribute(torch.backends.cuda.matmul, "allow_tf32"),
    "cudnn.allow_tf32": _attribute(torch.backends.cudnn, "allow_tf32"),
}


def _backend(name: str) -> Any:
    owner: Any = torch.backends
    for part in filter(None, name.split(".")):
        owner = getattr(owner, part, None)
    return owner


def _read_precision() -> tuple[dict[str, Any], dict[str, Any]]:
    legacy: dict[str, Any] = {}
    for name, (read, _) in LEGACY_PRECISION.items():
        try:
            legacy[name] = read()
        except RuntimeError:  # "a mix of the legacy and new APIs"
            legacy[name] = "mixed"
    current = {name: getattr(_backend(name), "fp32_precision", None) for name in PRECISION_BACKENDS}
    return legacy, current


def _write_precision(value: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The older switches first (they set torch's record of which kind was used), then each
    backend's ``fp32_precision``."""
    legacy, current = value
    for name, (_, write) in LEGACY_PRECISION.items():
        if legacy.get(name) not in (None, "mixed"):
            write(legacy[name])
    for name, precision in current.items():
        if precision is not None:
            _backend(name).fp32_precision = precision


def _set_default_device(device: torch.device) -> None:
    if torch.get_default_device() != device:  # "cpu" set explicitly would add a torch function mode
        torch.set_default_device(None if device == torch.device("cpu") else device)


def _set_sdp_kernels(value: tuple[bool, bool, bool]) -> None:
    torch.backends.cuda.enable_flash_sdp(value[0])
    torch.backends.cuda.enable_mem_efficient_sdp(value[1])
    torch.backends.cuda.enable_math_sdp(value[2])


# torch's process-wide settings a run may change, each read at the start and written back after
# each run. The inter-op thread count is not among them: torch cannot change it once used (unfit).
TORCH_SETTINGS: dict[str, Setting] = {
    "fp32_precision": (_read_precision, _write_precision),
    "deterministic_algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        _set_deterministic,
    ),
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "default_device": (torch.get_default_device, _set_default_device),
    "num_threads": (torch.get_num_threads, torch.set_num_threads),
    "grad_enabled": (torch.is_grad_enabled, _set_grad_enabled),
    "anomaly_detection": (lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()), _set_anomaly),
    "autocast_cpu": _autocast("cpu"),
    "autocast_cuda": _autocast("cuda"),
    "autocast_cache": (torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
    "cudnn.enabled": _attribute(torch.backends.cudnn, "enabled"),
    "cudnn.deterministic": _attribute(torch.backends.cudnn, "deterministic"),
    "cudnn.benchmark": _attribute(torch.backends.cudnn, "benchmark"),
    "cuda.matmul.allow_fp16_reduced_precision_reduction": _attribute(
        torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"
    ),
    "cuda.matmul.allow_bf16_reduced_precision_reduction": _attribute(
        torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"
    ),
    "cuda.sdp_kernels": (
        lambda: (
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(),
        ),
        _set_sdp_kernels,
    ),
    "mkldnn.enabled": _attribute(torch.backends.mkldnn, "enabled"),
    "print_options": (
        lambda: dict(vars(torch._tensor_str.PRINT_OPTS)),
        lambda value: vars(torch._tensor_str.PRINT_OPTS).update(value),
    ),
}

# torch.nn.Module's process-wide hooks (register_module_forward_hook and its kind).
GLOBAL_HOOKS = [name for name in vars(module_hooks) if name.startswith("_global_") and name.endswith("_hooks")]


def library_roots() -> tuple[str, ...]:
    """Where the code every worker process shares lives: the standard library, site-packages and
    trainforge itself. A module imported from anywhere else is the user's."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.add(site.getusersitepackages())
    roots.add(str(Path(__file__).resolve().parents[1]))  # trainforge
    return tuple(sorted(os.path.realpath(root) + os.sep for root in roots if root))


def is_built_in(module: Any) -> bool:
    return getattr(getattr(module, "__spec__", None), "origin", None) in ("built-in", "frozen")


def origin_of(module: Any) -> str | None:
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    return origin if isinstance(origin, str) and os.path.isabs(origin) else None


def is_extension(module: Any) -> bool:
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    origin = origin_of(module) or ""
    return isinstance(loader, importlib.machinery.ExtensionFileLoader) or origin.endswith(
        tuple(importlib.machinery.EXTENSION_SUFFIXES)
    )


def stamp(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_size, info.st_mtime_ns


SYSTEM_LIBRARIES = ("/lib/", "/lib64/", "/usr/lib/", "/usr/lib64/", "/usr/local/lib/", "/opt/", "/nix/store/")


def mapped_shared_objects() -> frozenset[str]:
    """The shared objects this process has loaded (Linux: /proc/self/maps; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if ".so" in line}
    except OSError:
        return frozenset()
    return frozenset(path for path in paths if path.startswith("/") and ".so" in os.path.basename(path))


def logger_settings() -> dict[str, tuple[logging.Logger, int, list[logging.Handler], bool, bool]]:
    """Every logger's level, handlers and switches (the root's included)."""
    loggers = [
        logging.root,
        *(v for v in list(logging.root.manager.loggerDict.values()) if isinstance(v, logging.Logger)),
    ]
    return {
        logger.name: (logger, logger.level, list(logger.handlers), logger.propagate, logger.disabled)
        for logger in loggers
    }


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@dataclass
class Baseline:
    """The process-wide state of a worker before its first run."""

    environ: dict[str, str]
    cwd: str
    path: list[str]
    umask: int
    warning_filters: list[Any]
    socket_timeout: float | None
    recursion_limit: int
    torch_settings: dict[str, Any]
    interop_threads: int
    hooks: dict[str, dict[Any, Any]]
    rng: tuple[Any, Any, torch.Tensor, list[torch.Tensor] | None]
    modules: frozenset[str]
    roots: tuple[str, ...]
    shared_objects: frozenset[str]
    loggers: dict[str, tuple[logging.Logger, int, list[logging.Handler], bool, bool]]
    logging_disabled: int
    files: dict[str, tuple[str, tuple[int, int] | None]] = field(default_factory=dict)  # kept modules' files
    unfit: str | None = None  # why this process must not run again

    @classmethod
    def capture(cls) -> Baseline:
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else None
        baseline = cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            path=list(sys.path),
            umask=current_umask(),
            warning_filters=list(warnings.filters),
            socket_timeout=socket.getdefaulttimeout(),
            recursion_limit=sys.getrecursionlimit(),
            torch_settings={name: read() for name, (read, _) in TORCH_SETTINGS.items()},
            interop_threads=torch.get_num_interop_threads(),
            hooks={name: dict(getattr(module_hooks, name)) for name in GLOBAL_HOOKS},
            rng=(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda),
            modules=frozenset(sys.modules),
            roots=library_roots(),
            shared_objects=mapped_shared_objects(),
            loggers=logger_settings(),
            logging_disabled=logging.root.manager.disable,
        )
        baseline.files = baseline.module_files(sys.modules)
        return baseline

    def is_library(self, name: str, module: Any) -> bool:
        origin = origin_of(module)
        if is_built_in(module):
            return True
        if origin is None:  # a namespace package lists its folders; one made in memory is its parent's
            locations = list(getattr(getattr(module, "__spec__", None), "submodule_search_locations", None) or [])
            if locations:
                return all(os.path.realpath(p).startswith(self.roots) for p in locations)
            parent = name.rpartition(".")[0]
            return bool(parent) and parent in sys.modules and self.is_library(parent, sys.modules[parent])
        return os.path.realpath(origin).startswith(self.roots)

    def module_files(self, modules: dict[str, Any]) -> dict[str, tuple[str, tuple[int, int] | None]]:
        files = {}
        for name, module in list(modules.items()):
            origin = origin_of(module)
            if origin is not None:
                files[name] = (origin, stamp(origin))
        return files

    def restore(self) -> None:
        """Put the process back as it was before its first run; what cannot be put back is
        recorded in ``unfit`` (the first reason found stays)."""
        try:
            reason = self._restore()
        except Exception as err:  # a reset that failed vouches for nothing
            reason = f"resetting the process failed: {type(err).__name__}: {err}"
        if reason and self.unfit is None:
            self.unfit = " ".join(reason.split())[:300]

    def _restore(self) -> str | None:
        reason = self._drop_user_modules()
        os.chdir(self.cwd)
        for key in [k for k in os.environ if k not in self.environ]:
            del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        sys.path[:] = self.path
        os.umask(self.umask)
        cast(list, warnings.filters)[:] = self.warning_filters
        getattr(warnings, "_filters_mutated", lambda: None)()  # the filters' cache, keyed by a version
        socket.setdefaulttimeout(self.socket_timeout)
        for logger, level, handlers, propagate, disabled in self.loggers.values():
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled
        logging.disable(self.logging_disabled)
        sys.setrecursionlimit(self.recursion_limit)
        if "torch._dynamo" in sys.modules:  # compiled graphs hold the code they traced
            torch._dynamo.reset()
        for name, (read, write) in TORCH_SETTINGS.items():
            if read() != self.torch_settings[name]:  # a setter may import (deterministic: inductor)
                write(self.torch_settings[name])
        torch.set_flush_denormal(False)  # no getter; a new process starts with it off
        for name, hooks in self.hooks.items():
            getattr(module_hooks, name).clear()
            getattr(module_hooks, name).update(hooks)
        python, numpy, cpu, cuda = self.rng
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if torch.cuda.is_initialized():
            if cuda is not None and len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:  # CUDA started during a run: its generators as they start, from torch's default seed
                torch.cuda.manual_seed_all(torch.default_generator.initial_seed())
        importlib.invalidate_caches()
        if torch.get_num_interop_threads() != self.interop_threads:
            reason = reason or (
                f"a run set torch's inter-op threads to {torch.get_num_interop_threads()} "
                f"(a new process has {self.interop_threads}; torch cannot change them back)"
            )
        if torch.is_inference_mode_enabled():
            reason = reason or "a run left torch's inference mode on"
        loaded = sorted(mapped_shared_objects() - self.shared_objects)
        users = [p for p in loaded if not p.startswith(self.roots + SYSTEM_LIBRARIES) and "/torchinductor_" not in p]
        if users:  # ctypes.CDLL, torch.ops.load_library: code no reset unloads (inductor's kernels: unused after reset)
            reason = reason or f"a run loaded the shared library {users[0]}, which stays in the process"
        return reason or self.changed_file()

    def _drop_user_modules(self) -> str | None:
        """Forget the modules runs imported from outside the libraries; keep (and stamp) the
        libraries' own. A C extension of the user's cannot be imported again: unfit."""
        extension = None
        for name in [n for n in list(sys.modules) if n not in self.modules]:
            module = sys.modules.get(name)
            if module is None or self.is_library(name, module):
                origin = origin_of(module)
                if origin is not None and name not in self.files:
                    self.files[name] = (origin, stamp(origin))
                continue
            if is_extension(module):
                extension = (
                    extension
                    or f"a run loaded the C extension {name} ({origin_of(module)}), which a process cannot import again"
                )
                continue
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent and getattr(sys.modules.get(parent), child, None) is module:
                delattr(sys.modules[parent], child)
        return extension

    def problem(self) -> str | None:
        """Why this process must not run again (None: it is as a new one would be)."""
        return self.unfit or self.changed_file()

    def changed_file(self) -> str | None:
        """A module this process keeps whose file changed since it was imported: a new process
        would run the new code."""
        for name, (origin, then) in self.files.items():
            if name in sys.modules and stamp(origin) != then:
                return f"module {name} changed on disk since this worker imported it ({origin})"
        return None


def reset(baseline: Baseline) -> None:
    """What one run leaves in the process that the next must not inherit: the process-wide state
    goes back to ``baseline`` (worker/fresh.py: environment, working directory, torch's settings,
    RNGs, the user's modules), the run's objects are collected, and CUDA's cached blocks are given
    back. A warm group's process group stays (a rejoining worker destroys its own first)."""
    baseline.restore()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
