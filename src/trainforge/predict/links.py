"""Links as alpha-beta pairs: ``alpha_s`` per ring step (latency) and ``bandwidth_Bps`` per direction.

A ring collective over n ranks makes ``2(n-1)`` steps (all-reduce) or ``n-1`` (reduce-scatter,
all-gather), each moving ``1/n`` of the buffer, so its time is ``steps * (alpha + bytes / (n *
bandwidth))``. Bandwidths of the presets are the links' specified line rates (what nccl-tests'
busbw approaches on a healthy fabric); the alphas are assumptions of the right order, not measured
here. docs/benchmarks.md lists each figure with its source and says which is which.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from trainforge.errors import TrainforgeError
from trainforge.files import read_user_file

GB = 1e9
MAX_REPORT_BYTES = 8 << 20  # a bench collectives report is a few KiB of JSON
MAX_MEASURED_WORKERS = 1 << 20
# The bounds of a given rate (1kbit to 10000gbit, rate_link) in bytes per second, and its latency.
MIN_BANDWIDTH_BPS, MAX_BANDWIDTH_BPS, MAX_ALPHA_S = 1e3 / 8, 1e13 / 8, 1.0


@dataclass(frozen=True)
class Link:
    name: str
    alpha_s: float  # per ring step
    bandwidth_Bps: float
    source: str


PRESETS: dict[str, Link] = {
    "nvlink": Link("nvlink", 3e-6, 450 * GB, "NVLink 4 (H100 SXM): 900 GB/s bidirectional = 450 GB/s per direction"),
    "ib200": Link("ib200", 5e-6, 25 * GB, "InfiniBand HDR: 200 Gbit/s = 25 GB/s per direction"),
    "ib400": Link("ib400", 5e-6, 50 * GB, "InfiniBand NDR: 400 Gbit/s = 50 GB/s per direction"),
    "eth25": Link("eth25", 25e-6, 3.125 * GB, "25 Gbit/s Ethernet = 3.125 GB/s per direction"),
    "eth50": Link("eth50", 20e-6, 6.25 * GB, "50 Gbit/s Ethernet = 6.25 GB/s per direction"),
    "eth100": Link("eth100", 15e-6, 12.5 * GB, "100 Gbit/s Ethernet = 12.5 GB/s per direction"),
}
LINK_CHOICES = (*PRESETS, "measured", "RATE[@LATENCY]")
INTRA_NODE = PRESETS["nvlink"]
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's units: decimal bits per second
LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3}
RATE_ALPHA_S = 50e-6  # per ring step over TCP when no latency is given: an assumption of the right order
RATE_LINK = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)(?:@(\d+(?:\.\d+)?)(us|ms))?")


def rate_link(text: str) -> Link | None:
    """A link given by its rate, as ``tc`` writes it, and optionally its latency per ring step:
    ``100mbit``, ``10gbit@30us``; None when ``text`` is not of that form."""
    match = RATE_LINK.fullmatch(text.strip().lower())
    if match is None:
        return None
    bits = float(match.group(1)) * RATE_UNITS[match.group(2)]
    latency = match.group(3)
    alpha = float(latency) * LATENCY_UNITS[match.group(4)] if latency else RATE_ALPHA_S
    if not (1e3 <= bits <= 1e13 and 0 <= alpha <= 1.0):
        raise TrainforgeError(f"--link {text!r}: a rate from 1kbit to 10000gbit and a latency up to 1000ms")
    assumed = "" if latency else f", {RATE_ALPHA_S * 1e6:g} µs per ring step assumed"
    return Link(text.strip().lower(), alpha, bits / 8, f"given: {bits / 8 / 1e6:g} MB/s per direction{assumed}")


def measured_link(path: Path) -> Link:
    """The link a ``bench collectives --output`` JSON measured, from its all-reduce fit.

    Its all-reduce over n ranks took ``alpha + bytes * beta``; a ring makes ``2(n-1)`` steps
    moving ``2(n-1)/n`` of the buffer, so ``alpha_step = alpha / 2(n-1)`` and ``bandwidth =
    2(n-1) / (n * beta)`` (the fitted busbw's asymptote).
    """
    where = f"--collectives {path}"
    if not path.exists():
        raise TrainforgeError(f"{where}: no such file (write one with trainforge bench collectives --output)")
    raw = read_user_file(path, where, MAX_REPORT_BYTES)  # a FIFO or /dev/zero: refused, not read
    try:
        report = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise TrainforgeError(f"{where}: not a readable JSON file ({type(err).__name__})") from None
    try:
        workers = int(report["workers"])
        fit = report["fits"]["all_reduce"]
        alpha, beta = float(fit["alpha_s"]), float(fit["beta_s_per_byte"])
    except (KeyError, TypeError, ValueError):
        raise TrainforgeError(
            f"{where}: expected the JSON of trainforge bench collectives --output (workers, fits.all_reduce)"
        ) from None
    if not (math.isfinite(alpha) and math.isfinite(beta) and workers <= MAX_MEASURED_WORKERS):
        raise TrainforgeError(
            f"{where}: fits.all_reduce's alpha_s and beta_s_per_byte must be finite numbers and workers at most "
            f"{MAX_MEASURED_WORKERS} (alpha_s={alpha}, beta_s_per_byte={beta}, workers={workers})"
        )
    if workers < 2 or beta <= 0:
        raise TrainforgeError(
            f"{where}: needs an all-reduce over >= 2 workers with a positive beta "
            "(a beta of 0: the timings did not separate bandwidth from noise; "
            "rerun with larger --sizes or more --iters)"
        )
    steps = 2 * (workers - 1)
    bandwidth = steps / (workers * beta)
    if not (MIN_BANDWIDTH_BPS <= bandwidth <= MAX_BANDWIDTH_BPS and alpha <= MAX_ALPHA_S):
        raise TrainforgeError(
            f"{where}: the fit gives {bandwidth:g} B/s and {alpha:g} s of latency; a link between "
            f"{MIN_BANDWIDTH_BPS:g} and {MAX_BANDWIDTH_BPS:g} B/s with at most {MAX_ALPHA_S:g} s is expected"
        )
    return Link(
        "measured",
        max(alpha, 0.0) / steps,
        bandwidth,
        f"bench collectives all-reduce fit over {workers} {report.get('backend', '?')} ranks "
        f"on {report.get('machine', {}).get('device', '?')} ({path.name})",
    )


def resolve_link(name: str, collectives: Path | None) -> Link:
    if name == "measured":
        if collectives is None:
            raise TrainforgeError(
                "--link measured needs --collectives F.json (from trainforge bench collectives --output)"
            )
        return measured_link(collectives)
    if collectives is not None:
        raise TrainforgeError(f"--collectives {collectives}: only with --link measured")
    if name in PRESETS:
        return PRESETS[name]
    given = rate_link(name)
    if given is None:
        raise TrainforgeError(
            f"--link {name!r}: one of {', '.join(PRESETS)}, measured, or a rate such as 100mbit or 10gbit@30us"
        )
    return given
