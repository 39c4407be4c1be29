"""A real tmpfs for tests of full and read-only disks: root with CAP_SYS_ADMIN can mount one here;
anywhere else the test is skipped, never faked."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``mount_point`` (created if missing) with mount ``options`` such as
    ``size=2m`` or ``ro``, unmounted afterwards."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount command here")
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)
