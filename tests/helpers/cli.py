"""The trainforge command of the interpreter that runs the tests, wherever that is installed."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import trainforge


def trainforge_command() -> list[str]:
    """The console script beside this interpreter, or ``python -m trainforge`` without one."""
    script = Path(sys.executable).parent / "trainforge"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "trainforge"]


def trainforge_on_path(directory: Path) -> Path:
    """``directory``, holding a ``trainforge`` that runs the trainforge these tests import with this
    interpreter, for commands that find it on PATH (a container's or a pod's command run here)."""
    source = Path(trainforge.__file__).resolve().parents[1]
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "trainforge"
    python_path = f"{shlex.quote(str(source))}${{PYTHONPATH:+:$PYTHONPATH}}"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH={python_path} exec {shlex.quote(sys.executable)} -m trainforge "$@"\n')
    shim.chmod(0o755)
    return directory
