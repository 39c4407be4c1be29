"""Rich consoles for what trainforge prints: a table written to a file or a pipe keeps its natural width.

Rich takes 80 columns (or the width of a terminal on stdin) for output that is no terminal, and
fits every table into them: cells cut to "…", columns folded. A log or a pipe has no width to
respect, so there the console is as wide as the widest table needs (``PIPE_WIDTH`` is only a
bound); a table is never wider than its columns' contents, so nothing is padded. A terminal keeps
its own width, and so does a user's ``COLUMNS``.
"""

from __future__ import annotations

import os
from typing import IO, Any

from rich.console import Console
from rich.text import Text

from trainforge.errors import printable_lines

PIPE_WIDTH = 10_000  # columns of a console that writes to a file or pipe: more than any table needs


def wide_when_piped(console: Console) -> Console:
    """``console``, made ``PIPE_WIDTH`` columns wide when its output is no terminal (nor a notebook,
    whose cells have a width of their own) and the environment sets no ``COLUMNS``."""
    if not (console.is_terminal or console.is_jupyter or "COLUMNS" in os.environ):
        console.width = PIPE_WIDTH
    return console


class DataConsole(Console):
    """A console that prints text as data: every string it renders (a line, a table's cell or
    header) has its control characters other than line breaks escaped (``errors.printable``), so a
    name read from a checkpoint, a manifest or a run directory cannot move the cursor, recolour or
    clear the terminal, or reverse what follows it. Rich's own styling is added after, untouched."""

    def render_str(self, text: str, **options: Any) -> Text:
        return super().render_str(printable_lines(text), **options)


def make_console(*, stderr: bool = False, file: IO[str] | None = None) -> Console:
    """A rich console on stdout (``stderr``: on stderr; ``file``: on that file) whose tables keep
    their natural width when it writes to a file or pipe, and which prints text as data."""
    return wide_when_piped(DataConsole(stderr=stderr, file=file))
