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
checkpoint, counted against ``failure.max_failures``) or ``exclude`` (every rank checkpoints and
waits for it to commit, rank 0 asks Ray to drain the straggler's node, and every rank raises
``StragglerExcluded``: a drained node takes no new work and leaves the cluster once its workers
are gone, so Ray Train's elastic policy restarts the group on the other nodes, from that
checkpoint). A node is excluded only when the ranks on the other nodes are at least
``scaling.num_workers``' minimum; otherwise the event says ``report`` and a note says why. A rank
that recovers and slows down again is named again. A node's score is the highest of its ranks'.
"""

from __future__ import annotations

import bisect
import logging
import os
import socket
from collections.abc import Callable
from typing import cast

from trainforge.config.schema import StragglerConfig
from trainforge.protocol import Event, Note, Straggler
from trainforge.worker import collectives
from trainforge.worker.preemption import drain_node

log = logging.getLogger("trainforge.worker")


class StragglerRestart(RuntimeError):
    """Raised on every rank at the same report under ``failure.straggler.action: restart``: a worker
    failure to Ray Train, which restarts the group from the newest checkpoint."""


class StragglerExcluded(StragglerRestart):
    """Raised on every rank at the same report under ``failure.straggler.action: exclude``, once
    the checkpoint is committed and the straggler's node is draining: Ray Train restarts the group
    on the nodes left."""


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


def ray_node_id() -> str | None:
    """This worker's Ray node id (what Ray's scheduler and GCS name a node by; nodes on one host
    share an address); None outside Ray."""
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None
    except Exception:  # no Ray, or no node: nothing to drain
        return None


class StragglerWatch:
    """The scores and the window rule, the same on every rank (fed the same all-reduced figures)."""

    def __init__(self, rule: StragglerConfig | None, world: int, *, min_workers: int = 1) -> None:
        self.rule = rule
        self.world = world
        self.min_workers = min_workers  # exclude leaves at least this many ranks, or excludes nothing
        self.slow_steps = [0] * world  # consecutive steps above the threshold, per rank
        self.named: set[int] = set()  # ranks named and not yet recovered
        self.nodes: list[str] | None = None
        self.pids: list[int] = []
        self.node_ids: list[str | None] = []
        self.last: list[float] = [1.0] * world
        self.own_s: list[float] = [0.0] * world

    def rank_nodes(self) -> list[str]:
        """Every rank's node (its Ray node id, and process), gathered once (a collective: every rank
        calls it at the same report)."""
        if self.nodes is None:
            mine = (node_address(), os.getpid(), ray_node_id())
            gathered = cast(list[tuple[str, int, str | None]], collectives.all_gather_objects(mine))
            self.nodes = [str(node) for node, _, _ in gathered]
            self.pids = [int(pid) for _, pid, _ in gathered]
            self.node_ids = [node_id for _, _, node_id in gathered]
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

    def event(self, rank: int, step: int, *, excluding: bool = False) -> Straggler:
        """The event that names ``rank``, with its node (rule set: ``observe`` named it); its action
        is the rule's, but ``report`` for an ``exclude`` that is not ``excluding`` (``events`` decides)."""
        assert self.rule is not None
        action = self.rule.action if self.rule.action != "exclude" or excluding else "report"
        return Straggler(
            step=step,
            rank=rank,
            node=self.rank_nodes()[rank],
            score=self.last[rank],
            own_s=self.own_s[rank],
            steps=self.slow_steps[rank],
            threshold=self.rule.threshold,
            action=action,
            pid=self.pids[rank] if rank < len(self.pids) else None,
            node_id=self.node_ids[rank] if rank < len(self.node_ids) else None,
        )

    def events(self, ranks: list[int], step: int) -> list[Event]:
        """The events that name ``ranks``; under ``exclude``, each node excluded in rank order while
        the ranks left suffice, and a note for each straggler whose node stays in."""
        said: list[Event] = []
        leaving: set[str] = set()
        for rank in ranks:
            problem = None
            if self.rule is not None and self.rule.action == "exclude":
                problem = self.exclusion_problem(rank, leaving)
            event = self.event(rank, step, excluding=problem is None)
            said.append(event)
            if problem is not None:
                said.append(Note(f"step {step}: rank {rank}'s node {event.node} is not excluded: {problem}", "warning"))
            elif event.node_id is not None:
                leaving.add(event.node_id)
        return said

    def exclusion_problem(self, rank: int, leaving: set[str] | None = None) -> str | None:
        """Why ``rank``'s node cannot be excluded (besides the nodes ``leaving``), or None: a node
        Ray does not name, the only node, or one whose loss leaves fewer ranks than the run's minimum."""
        node_id = self.node_ids[rank] if rank < len(self.node_ids) else None
        if node_id is None:
            return "its Ray node is not known (not under Ray)"
        gone = (leaving or set()) | {node_id}
        left = sum(1 for other in self.node_ids if other not in gone)
        if left == 0:
            return "every rank runs on it" if not leaving else "no rank would be left"
        if left < self.min_workers:
            return f"the other nodes run {left} rank(s), fewer than scaling.num_workers' minimum {self.min_workers}"
        return None

    def act(self, named: list[Event], rank: int, checkpoint: Callable[[], None]) -> None:
        """What ``restart`` and ``exclude`` do once the events are reported, the same on every rank:
        nothing for ``report``; else raise, after (``exclude``) a committed ``checkpoint`` and rank
        0's drain of each straggler's node."""
        acting = [e for e in named if isinstance(e, Straggler) and e.action != "report"]
        if not acting:
            return
        excluded = {e.node_id: e for e in acting if e.action == "exclude" and e.node_id is not None}
        if not excluded:
            raise StragglerRestart("; ".join(e.text for e in acting))
        checkpoint()  # every rank (a collective): the restart resumes from here
        if rank == 0:
            for node_id, event in excluded.items():
                why = f"trainforge: rank {event.rank} is a straggler ({event.score:.3g}x the others' time per step)"
                done = "draining" if drain_node(node_id, why) else "Ray refused to drain it"
                log.warning("excluding node %s (%s): %s; %s", node_id, event.node, why, done)
        raise StragglerExcluded("; ".join(e.text for e in acting))

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
