"""``callbacks``: the user's own code at points of the training loop, on every worker.

Each entry of ``callbacks`` (``"pkg.mod:Class"``, or ``{path: "pkg.mod:Class", kwargs: {...}}``)
is instantiated on every worker (``Class(**kwargs)``) and may define any of these hooks, each
called with a :class:`CallbackContext` first (``rank``, ``world_size``, ``step``, ``model``,
``config``, ``request_stop``). The firing order, per rank:

1. ``on_train_start(ctx)``: once, after the restore, before the first step of this attempt.
2. After each optimizer step ``N`` (``N`` counted from 1 over the whole run):
   a. ``on_step_end(ctx, N, metrics)``: ``metrics`` holds this rank's own figures of step ``N``
      (not averaged over ranks): the task's training metrics (``train/loss``, ``train/accuracy``,
      ...) over this rank's micro-batches, and ``train/lr`` as the step used it. They are read from
      the device only when some callback defines ``on_step_end`` (one host sync per step).
   b. ``on_validation_end(ctx, metrics)`` when a validation pass ran at step ``N`` (the eval
      cadence; at the end of an epoch, after the epoch's last step's ``on_step_end``): ``metrics``
      is the pass's ``val/...`` figures, all-reduced, the same on every rank.
   c. The ranks agree on stop requests (below).
3. ``on_checkpoint(ctx, path)``: once per committed checkpoint, on every rank, at the first report
   after rank 0 learned of the commit (saves are written in the background), and for the final
   save at the end; ``path`` is the checkpoint's directory or URI.
4. At the end (a finished, early-stopped or stopped run): the final validation's
   ``on_validation_end`` (not repeated when a pass already ran at that step), the final save's
   ``on_checkpoint``, then ``on_train_end(ctx)``.

Several callbacks: each hook fires for each callback in the order of ``callbacks``.

``ctx.request_stop(reason)`` on any rank ends the run on every rank after the same step: the
ranks all-reduce a stop flag after each step's hooks (one small collective per step, only when
``callbacks`` is set), so a request in ``on_step_end`` or ``on_validation_end`` of step ``N`` ends
the run after step ``N``; one in ``on_train_start`` before the first step; one in
``on_checkpoint`` after the next step. The run then checkpoints and ends as finished (exit 0),
with ``stopped_by: {source: callback, reason, step}`` in summary.json; a re-run of its
directory does not train on (the stop is part of the run's checkpointed state).

A hook that raises is the user's error: at the first step of a fresh run (``on_train_start``
included) every rank ends the run with it, naming the callback and its ``file:line``, without a
retry; later, the worker group fails and Ray Train restarts it from the newest checkpoint, as for
an exception in the model's ``forward`` (worker/user_code.py).

State: a callback with ``state_dict()`` / ``load_state_dict(state)`` is checkpointed (component
``callbacks``): rank 0's ``state_dict()``, which must be JSON (numbers, strings, booleans, lists,
dicts), and every rank's ``load_state_dict`` gets it back on a resume, keyed by the entry's index
and path, so a resume is exact.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, Field, JsonValue
from torch import nn

from trainforge.checkpoint.schema import MAX_STEP
from trainforge.checkpoint.state import State
from trainforge.config import CallbackConfig, Config
from trainforge.config.factories import load_factory, raised_at
from trainforge.errors import ConfigError, UserCodeError
from trainforge.redact import redact_text
from trainforge.worker import collectives
from trainforge.worker.components.base import Component, Restore, StateSchema
from trainforge.worker.user_code import is_user_code_error

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun

log = logging.getLogger("trainforge.worker")

HOOKS = ("on_train_start", "on_step_end", "on_validation_end", "on_checkpoint", "on_train_end")
MAX_REASON = 500  # characters of a stop reason kept (it goes into events and summary.json)


class CallbackContext:
    """What every hook is handed: where it runs, the model, the config, and a way to end the run."""

    def __init__(self, rank: int, world_size: int, model: nn.Module, config: Config) -> None:
        self.rank = rank
        self.world_size = world_size
        self.model = model  # the module the model's factory built (under DDP, the one inside the wrapper)
        self.config = config
        self.step = 0  # optimizer steps the run has taken (over all its attempts)
        self.stop_reason: str | None = None  # this rank's first request since the ranks last agreed

    def request_stop(self, reason: str = "a callback asked to stop") -> None:
        """End the run on every rank after the current step (the first request's reason is kept)."""
        if self.stop_reason is None:
            self.stop_reason = " ".join(str(reason).split())[:MAX_REASON] or "a callback asked to stop"


class StopRecord(StateSchema):
    reason: Annotated[str, Field(max_length=MAX_REASON)]
    step: Annotated[int, Field(ge=0, le=MAX_STEP)]


class CallbacksState(StateSchema):
    """Rank 0's ``state_dict()`` of each callback that has one, by ``<index>:<path>``, and the stop
    the callbacks agreed on (None while the run goes on)."""

    states: Annotated[dict[str, JsonValue], Field(max_length=64)] = Field(default_factory=dict)
    stop: StopRecord | None = None


@dataclass
class CallbackFailed(Exception):
    """A callback raised on some rank: raised on every rank at the same point. ``retry``: whether
    Ray Train should restart the group (after steps of the run) rather than end the run."""

    error: UserCodeError
    retry: bool

    def __str__(self) -> str:
        return str(self.error)


class Callbacks(Component):
    """The user's callbacks of one worker, their checkpointed state and their stop requests."""

    name: ClassVar[str] = "callbacks"
    schema: ClassVar[type[BaseModel]] = CallbacksState

    def __init__(self, entries: list[tuple[str, Any]], context: CallbackContext) -> None:
        self.entries = entries  # (key, instance), in config order
        self.context = context
        self.failure: str | None = None  # this rank's first hook failure since the ranks last agreed
        self.stop: StopRecord | None = None

    @classmethod
    def from_run(cls, run: WorkerRun) -> Callbacks | None:
        if not run.config.callbacks:
            return None
        entries = [
            (key_of(index, entry), instantiate(index, entry)) for index, entry in enumerate(run.config.callbacks)
        ]
        context = CallbackContext(run.rank, run.world, run.plan.eval_model(run.model), run.config)
        return cls(entries, context)

    def defines(self, hook: str) -> bool:
        return any(callable(getattr(callback, hook, None)) for _, callback in self.entries)

    def fire(self, hook: str, step: int, *args: Any) -> None:
        """``hook`` of every callback that defines it, in config order, at ``step`` (``ctx.step``).
        An exception of the user's is kept (the first) for the ranks' next agreement; the other
        callbacks still run."""
        self.context.step = step
        for key, callback in self.entries:
            method = getattr(callback, hook, None)
            if not callable(method):
                continue
            try:
                method(self.context, *args)
            except Exception as err:
                if not is_user_code_error(err):
                    raise
                log.error(
                    "rank %d: callback %s.%s raised %s: %s", self.context.rank, key, hook, type(err).__name__, err
                )
                if self.failure is None:
                    lines = str(err).strip().splitlines()
                    what = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
                    self.failure = (
                        f"callback {path_of(key)}.{hook} raised {what}{raised_at(err)} on rank {self.context.rank}"
                    )

    def agree(self, device: torch.device, step: int, *, retry: bool) -> str | None:
        """Every rank: whether any rank's hook failed (then :class:`CallbackFailed` on every rank)
        or asked to stop (then the first asking rank's reason, recorded as this run's stop at
        ``step``). One all-reduce of two flags; the texts travel only when a flag is up."""
        flags = [1.0 if self.context.stop_reason is not None else 0.0, 1.0 if self.failure is not None else 0.0]
        # Sync point: the hooks' outcome on every rank, so that all take the same way out.
        summed = collectives.all_reduce_sum(flags, device).tolist() if collectives.world_size() > 1 else flags
        if summed[1] > 0:
            failures = [f for f in collectives.all_gather_objects(self.failure) if isinstance(f, str)]
            when = "after steps of the run" if retry else "at the first step"
            said = f"{failures[0]}, {when}"
            if not retry:
                said += "; fix it and run again (not retried: it would fail the same way)"
            raise CallbackFailed(UserCodeError(redact_text(said)), retry)
        if summed[0] > 0:
            reasons = [r for r in collectives.all_gather_objects(self.context.stop_reason) if isinstance(r, str)]
            self.stop = StopRecord(reason=reasons[0], step=step)
        self.context.stop_reason = None
        return self.stop.reason if self.stop is not None else None

    def state_dict(self) -> State:
        states = {}
        for key, callback in self.entries:
            if callable(getattr(callback, "state_dict", None)):
                states[key] = json_state(key, callback.state_dict())
        stop = self.stop.model_dump() if self.stop is not None else None
        return State({"states": states, "stop": stop})

    def load_state_dict(self, state: State, restore: Restore) -> None:
        saved = CallbacksState.model_validate(state.values)
        for key, callback in self.entries:
            if not callable(getattr(callback, "load_state_dict", None)):
                continue
            if key in saved.states:
                callback.load_state_dict(saved.states[key])
            else:
                restore.notes.append(f"callbacks: the checkpoint holds no state of {key}; it starts afresh")
        theirs = restore.config.get("run", {}).get("name") if restore.config else None
        # Another run's stop (a checkpoint named by checkpoint.resume) does not end this one.
        self.stop = saved.stop if theirs == self.context.config.run.name else None


def key_of(index: int, entry: CallbackConfig) -> str:
    """A callback's key in the checkpoint: its place in ``callbacks`` and its path."""
    return f"{index}:{entry.path}"


def path_of(key: str) -> str:
    return key.partition(":")[2]


def load_class(index: int, entry: CallbackConfig) -> Any:
    """The class ``callbacks[index]`` names, or ConfigError naming the key (one line)."""
    return load_factory(entry.path, f"callbacks[{index}]", "a callback object", ConfigError)


def instantiate(index: int, entry: CallbackConfig) -> Any:
    callback = load_class(index, entry)(**entry.kwargs)
    if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
        raise ConfigError(
            f"callbacks[{index}] {entry.path!r} defines none of the hooks {', '.join(HOOKS)}; "
            "give it at least one (each takes the context first)"
        )
    return callback


def check_callbacks(config: Config) -> None:
    """Each of ``callbacks`` imports and is a class (before Ray starts; one line naming the entry)."""
    for index, entry in enumerate(config.callbacks):
        target = load_class(index, entry)
        if not isinstance(target, type):
            raise ConfigError(
                f"callbacks[{index}] {entry.path!r} is a {type(target).__name__}, not a class; "
                "point it at a class whose instances define the hooks"
            )
        if not any(callable(getattr(target, hook, None)) for hook in HOOKS):
            raise ConfigError(
                f"callbacks[{index}] {entry.path!r} defines none of the hooks {', '.join(HOOKS)}; "
                "give it at least one (each takes the context first)"
            )


def json_state(key: str, state: Any) -> Any:
    """A callback's ``state_dict()`` as JSON (round-tripped, so a resume loads what was saved)."""
    try:
        text = json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"callback {path_of(key)}.state_dict() must return JSON (numbers, strings, booleans, lists, dicts "
            f"with string keys, no NaN): {err}"
        ) from None
    return json.loads(text)


def step_metrics(
    run: WorkerRun, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], lr: float
) -> dict[str, float]:
    """This rank's figures of one step, from the running sums before and after it (one host
    sync), and the learning rate the step used."""
    names = sorted(after)
    metrics: dict[str, float] = {}
    if names:
        zero = torch.zeros((), dtype=torch.float64, device=run.device)
        diffs = torch.stack([after[name] - before.get(name, zero) for name in names]).tolist()
        sums = dict(zip(names, diffs, strict=True))
        if sums.get("count"):
            metrics = {f"train/{name}": float(value) for name, value in run.task.finalize(sums).items()}
    metrics["train/lr"] = lr
    return metrics
