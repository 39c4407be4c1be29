"""What the verbs share: the config argument and --set, the consoles, logging set-up, and flag checks."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from trainforge.consoles import make_console
from trainforge.errors import TrainforgeError
from trainforge.files import check_output_path
from trainforge.redact import redacting

err_console = make_console(stderr=True)


ConfigArg = Annotated[str, typer.Argument(help="A run config YAML, or the name of a bundled one (e.g. quickstart).")]


SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override a key: --set train.batch_size=64 (repeatable).")
]


def resolve_config_path(name: str) -> str:
    """A path as given, or a config bundled with the package (``quickstart`` -> configs/quickstart.yaml)."""
    if Path(name).exists() or (name.endswith((".yaml", ".yml")) and "/" in name):
        return name
    bundled = Path(__file__).parent.parent / "configs" / f"{Path(name).stem}.yaml"
    return str(bundled) if bundled.is_file() else name


def check_output_folder(output: Path | None, flag: str = "--output") -> None:
    """``--output FILE``: a file that may be written there, in a folder that exists, and no link
    (``files.check_output_path``); checked before any work starts."""
    if output is not None:
        check_output_path(output, flag, "file")


def write_output(output: Path, text: str, flag: str = "--output") -> None:
    """``text`` into the ``--output`` file: a failure to write (the disk full, the folder gone) is one line."""
    try:
        output.write_text(text)
    except OSError as err:
        raise TrainforgeError(f"{flag} {output}: cannot be written ({err.strerror or err})") from None


def parse_counts(flag: str, text: str, most: int, example: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TrainforgeError(f"{flag} {text!r}: expected comma-separated integers such as {example}") from None
    if not counts or not all(1 <= count <= most for count in counts):
        raise TrainforgeError(f"{flag} {text!r}: counts from 1 to {most}")
    return counts


def json_text(value: Any, **options: Any) -> str:
    """``--json`` output that every JSON parser reads: a number that is not finite (NaN, an
    infinity) becomes null, never Python's bare ``NaN``."""
    return json.dumps(_finite(value), allow_nan=False, **options)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def wide_console() -> Console:
    """Rich's console on stdout; on a file or pipe as wide as its widest table (consoles.make_console)."""
    return make_console()


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:  # Ray's, MLflow's and ours on the console
        redacting(handler)
    logging.getLogger("trainforge").setLevel(logging.INFO)
