"""Who ``bench peers`` measures: each peer's letter, name and headers, and the packages it needs.

Light on purpose (no torch, no Ray): the CLI checks ``--peers`` and ``--workload`` with it before
anything heavy is imported. Peers (f) Lightning and (g) Accelerate need the ``bench`` extra
(``pip install 'trainforge[bench]'``); without it they are left out of the default set, with a note.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from trainforge.errors import TrainforgeError

PEERS: dict[str, str] = {
    "a": "(a) PyTorch, 1 process",
    "b": "(b) torchrun + DDP",
    "c": "(c) Ray Train",
    "d": "(d) trainforge",
    "e": "(e) trainforge, unobserved",
    "f": "(f) Lightning DDP",
    "g": "(g) Accelerate",
}
# What a user may type for each peer in --peers, beside its letter.
NAMES: dict[str, str] = {
    "pytorch": "a",
    "torchrun": "b",
    "ray_train": "c",
    "trainforge": "d",
    "unobserved": "e",
    "lightning": "f",
    "accelerate": "g",
}
HEADERS: dict[str, str] = {  # two-line table headers, so the table fits 80 columns
    "a": "(a) PyTorch\n1 process",
    "b": "(b) torchrun\n+ DDP",
    "c": "(c) Ray\nTrain",
    "d": "(d)\ntrainforge",
    "e": "(e) trainforge\nno tracking",
    "f": "(f) Lightning\nDDP",
    "g": "(g)\nAccelerate",
}
# Peers that need a package trainforge does not install: the module to look for, and its package.
EXTRAS: dict[str, tuple[str, str]] = {"f": ("lightning", "lightning"), "g": ("accelerate", "accelerate")}
INSTALL_HINT = "pip install 'trainforge[bench]'"
WORKLOADS = ("cnn", "lm")


def parse_peers(text: str | None) -> list[str]:
    """``--peers``: letters run together (``abcde``) or comma-separated letters and names
    (``d,lightning,g``), in the table's order; ``None``: :func:`default_peers`. A peer whose
    package is missing is refused, with the command that installs it."""
    if text is None:
        return default_peers()
    words = [word.strip().lower() for word in text.split(",")] if "," in text else list(text.strip().lower())
    if text.strip().lower() in NAMES:
        words = [text.strip().lower()]
    unknown = [word for word in words if word not in PEERS and word not in NAMES]
    if not words or not all(words) or unknown:
        raise TrainforgeError(
            f"--peers {text!r}: letters from {''.join(PEERS)} or names {', '.join(NAMES)}, "
            "comma-separated (e.g. --peers de or --peers d,lightning)"
        )
    chosen = {NAMES.get(word, word) for word in words}
    for peer in sorted(chosen & set(EXTRAS)):
        module, package = EXTRAS[peer]
        if not installed(module):
            raise TrainforgeError(f"--peers: {PEERS[peer]} needs {package}, which is not installed: {INSTALL_HINT}")
    return [peer for peer in PEERS if peer in chosen]


def default_peers() -> list[str]:
    """Every peer whose packages import here."""
    return [peer for peer in PEERS if peer not in EXTRAS or installed(EXTRAS[peer][0])]


def missing_note(peers: Sequence[str]) -> str | None:
    """One line naming the peers left out for want of their package, or None."""
    missing = [peer for peer in EXTRAS if peer not in peers and not installed(EXTRAS[peer][0])]
    if not missing:
        return None
    names = " and ".join(f"{PEERS[peer]} ({EXTRAS[peer][1]})" for peer in missing)
    return f"not measured: {names}, not installed here; {INSTALL_HINT} adds them"


def parse_workload(text: str) -> str:
    if text not in WORKLOADS:
        raise TrainforgeError(f"--workload {text!r}: {' or '.join(WORKLOADS)}")
    return text


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
