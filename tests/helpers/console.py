"""Reading what ``trainforge train`` prints on stderr (observers/console.py)."""

from __future__ import annotations

import re

# The command's first line and a line per start-up phase ("   11.7 s  torch and Ray imported"),
# printed before a check can fail.
STARTUP_LINE = re.compile(r"^(trainforge: training .* \.\.\.|\s*\d+\.\d s  \S.*)$")


def without_startup(stderr: str) -> list[str]:
    """The non-blank lines of ``stderr`` but the start-up's: what a one-line error test reads."""
    return [line for line in stderr.splitlines() if line.strip() and not STARTUP_LINE.match(line)]
