"""The C allocator's thresholds in a worker process (``train.reuse_freed_memory``).

glibc's ``malloc`` serves a block of more than its mmap threshold (128 KiB, raised as the process
frees such blocks, to at most 32 MiB) with a fresh ``mmap`` and hands it back to the kernel when it is
freed; it also trims the top of its heap when more than twice that lies free there. A training step
allocates and frees the same large tensors every step (a language model's logits, 16 x 128 x 4096
floats, are 32 MiB and more), so each step the kernel maps, zeroes and unmaps them again: on
llama_tiny, up to 36,000 page faults and 60 ms of system time in a 290-320 ms step
(``python -m trainforge.bench.allocator``; docs/benchmarks.md, "The allocator"). With both
thresholds raised the freed blocks stay in the heap and the next step reuses them: no faults, and
the step's CPU time 20 % lower.

The cost is that memory freed inside the process is kept for it, not returned to the system: the
worker's resident size stays at its peak (what the training step needs anyway; a one-off peak, such
as a large checkpoint read into host memory, stays too). ``train.reuse_freed_memory: false`` keeps
glibc's own behaviour. Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import platform
from functools import cache

M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEPT = 1 << 30  # blocks up to 1 GiB come from the heap; up to 1 GiB free at its top is kept
# glibc's dynamic thresholds at their largest: what a long-running process converges to.
GLIBC_MMAP_MAX = 32 << 20
GLIBC_TRIM_MAX = 64 << 20


@cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def set_reuse(reuse: bool) -> str:
    """Raise (``reuse``) or restore the thresholds in this process; what was done, for the log.

    Restoring matters in a warm worker (driver/warm.py) that ran a run with reuse before: glibc
    cannot go back to its dynamic thresholds, so they are set to the values those converge to."""
    libc = _libc()
    if libc is None:
        return "system allocator (not glibc)"
    mmap, trim = (KEPT, KEPT) if reuse else (GLIBC_MMAP_MAX, GLIBC_TRIM_MAX)
    # The mmap threshold first: a trim threshold set alone would stop the mmap threshold's growth at
    # 128 KiB, and every block above that would be mapped anew (far worse than either).
    if not libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap)):
        return "glibc malloc (thresholds unchanged: mallopt refused)"
    libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim))
    if reuse:
        return f"glibc malloc keeps freed blocks (mmap and trim thresholds {KEPT >> 20} MiB)"
    return "glibc malloc returns freed blocks (mmap threshold 32 MiB, trim 64 MiB)"


_applied: bool | None = None  # what this process last set; None: glibc's own dynamic thresholds


def apply(reuse: bool) -> str | None:
    """``set_reuse`` once per process and setting; None when nothing changed (glibc's own behaviour
    asked for in a process that never changed it, or the same setting again)."""
    global _applied
    if (_applied is None and not reuse) or _applied == reuse:
        return None
    _applied = reuse
    return set_reuse(reuse)
