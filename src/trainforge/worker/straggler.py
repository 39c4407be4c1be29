"""Stragglers: a rank whose own work per step is slower than the other ranks' for a sustained window.

Under DDP the fast ranks wait for the slow one inside backward (the gradient all-reduce), so a
rank's step time or compute time says little: every rank's is about the same. A rank's *own* time
per step is what it spends without waiting for its peers: its data wait plus its forward passes
(``StepTimes.own_s``). Every rank puts its own time in a slot of the report's one all-reduce
(``worker/metrics.reduce_metrics``), so every rank has every rank's figure and computes the same
scores:

    score(r) = own(r) / median(own of the other ranks)

A rank whose score stays above ``failure.straggler.threshold`` for ``failure.straggler.window_steps``
consecutive steps (counted in the steps the reports cover; a report below the threshold starts
the count again) is a straggler: named once, with its node, in a ``Straggler`` event, and then
``action``: ``report`` (nothing more) or ``restart`` (every rank raises ``StragglerRestart`` at the
same report, which Ray Train treats as a worker failure: the group restarts from the newest
checkpoint, counted against ``failure.max_failures``). A rank that recovers and slows down again is
named again. A node's score is the highest of its ranks'.
"""

from __future__ import annotations

import bisect
import os
import socket
from typing import cast

from trainforge.config.schema import StragglerConfig
from trainforge.protocol import Straggler
from trainforge.worker import collectives


class StragglerRestart(RuntimeError):
    """Raised on every rank at the same report under ``failure.straggler.action: restart``: a worker
    failure to Ray Train, which restarts the group from the newest checkpoint."""


def scores(own_s: list[float]) -> list[float]:
    """Each rank's own time per step over the median of the other ranks'; 1.0 where the others'
    median is zero (no steps measured) and for a single rank. One sort, whatever the world size."""
    ordered = sorted(own_s)
    others = len(ordered) - 1

    def median_without(removed: int) -> float:
        def at(index: int) -> float:
            return ordered[index if index < removed else index + 1]

        if others % 2:
            return at(others // 2)
        return (at(others // 2 - 1) + at(others // 2)) / 2 if others else 0.0

    result = []
    for mine in own_s:
        typical = median_without(bisect.bisect_left(ordered, mine))
        result.append(mine / typical if typical > 0 else 1.0)
    return result


def node_scores(rank_scores: list[float], nodes: list[str]) -> dict[str, float]:
    """The highest score of each node's ranks."""
    by_node: dict[str, float] = {}
    for score, node in zip(rank_scores, nodes, strict=True):
        by_node[node] = max(by_node.get(node, score), score)
    return by_node


def node_address() -> str:
    """This worker's node as Ray names it (its IP address); the host name without Ray."""
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:  # no address to be had: the host name still tells nodes apart
        return socket.gethostname()


class StragglerWatch:
    """The scores and the window rule, the same on every rank (fed the same all-reduced figures)."""

    def __init__(self, rule: StragglerConfig | None, world: int) -> None:
        self.rule = rule
        self.world = world
        self.slow_steps = [0] * world  # consecutive steps above the threshold, per rank
        self.named: set[int] = set()  # ranks named and not yet recovered
        self.nodes: list[str] | None = None
        self.pids: list[int] = []
        self.last: list[float] = [1.0] * world
        self.own_s: list[float] = [0.0] * world

    @property
    def restarts(self) -> bool:
        """Whether naming a straggler restarts the worker group."""
        return self.rule is not None and self.rule.action == "restart"

    def rank_nodes(self) -> list[str]:
        """Every rank's node (and process), gathered once (a collective: every rank calls it at the
        same report)."""
        if self.nodes is None:
            gathered = cast(list[tuple[str, int]], collectives.all_gather_objects((node_address(), os.getpid())))
            self.nodes = [str(node) for node, _ in gathered]
            self.pids = [int(pid) for _, pid in gathered]
        return self.nodes

    def observe(self, own_s: list[float], steps: int) -> list[int]:
        """One report's own times per step (every rank's) over ``steps`` steps; the ranks that
        became stragglers at this report."""
        if self.world < 2 or steps <= 0:
            return []
        self.rank_nodes()
        self.own_s = list(own_s)
        self.last = scores(self.own_s)
        if self.rule is None:
            return []
        newly = []
        for rank, score in enumerate(self.last):
            if score > self.rule.threshold:
                self.slow_steps[rank] += steps
            else:
                self.slow_steps[rank] = 0
                self.named.discard(rank)
            if self.slow_steps[rank] >= self.rule.window_steps and rank not in self.named:
                self.named.add(rank)
                newly.append(rank)
        return newly

    def event(self, rank: int, step: int) -> Straggler:
        """The event that names ``rank``, with its node (rule set: ``observe`` named it)."""
        assert self.rule is not None
        return Straggler(
            step=step,
            rank=rank,
            node=self.rank_nodes()[rank],
            score=self.last[rank],
            own_s=self.own_s[rank],
            steps=self.slow_steps[rank],
            threshold=self.rule.threshold,
            action=self.rule.action,
            pid=self.pids[rank] if rank < len(self.pids) else None,
        )

    def figures(self) -> dict[str, float]:
        """The report's figures: each rank's score and own time per step, each node's score, the highest."""
        if self.world < 2:
            return {}
        figures = {"straggler/max_score": max(self.last)}
        for rank, (score, own) in enumerate(zip(self.last, self.own_s, strict=True)):
            figures[f"straggler/rank{rank}/score"] = score
            figures[f"straggler/rank{rank}/own_s"] = own
        for node, score in node_scores(self.last, self.rank_nodes()).items():
            figures[f"straggler/node/{node}/score"] = score
        return figures
