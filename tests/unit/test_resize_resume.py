"""A resume on another number of workers continues exactly (issue 37, section 6).

``train.global_batch_size`` holds the global batch whatever the worker count: each start derives
its accumulation steps from the workers it got, and rank r reads ``perm[r::W]`` of the epoch's
order, so step s reads the block ``perm[s*G:(s+1)*G]`` on any W. A run of 2 workers stopped
mid-epoch and resumed on 1 (and one of 1 resumed on 2) reads the same samples in the same global
batches as the uninterrupted 2-worker run, none twice or never in an epoch, and its losses
match within float rounding (the sums run in another order, so not bit-identical).

The runs are the worker's Session in gloo ranks without Ray (tests/helpers/sessions.py); the
model records the index of every sample of every training forward (user_models.IdRecorder).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Outcome, final_weights, sessions
from trainforge.config import load_config
from trainforge.data import ResumableDistributedSampler
from trainforge.errors import ConfigError
from trainforge.worker.components.data import configured_split

MICRO, GLOBAL = 8, 32  # 2 workers: 2 accumulation steps each; 1 worker: 4
STEPS_PER_EPOCH = 251 // GLOBAL  # 7, on any worker count
EPOCHS = 2
SAVED, CRASH = 5, 6  # a checkpoint at step 5 (mid-epoch 1), the stop at step 6's report
RTOL = 1e-5


def config(
    tmp: Path, workers: int, strategy: str = "ddp", batch: int | str = MICRO, batch_norm: bool = False
) -> dict[str, Any]:
    ids = tmp / "ids"
    ids.mkdir(parents=True, exist_ok=True)
    run = tiny_run(
        tmp,
        model={
            "name": None,
            "factory": "tests.helpers.user_models:id_recorder",
            "kwargs": {"record_to": str(ids), "delay_s": 0.0, "hidden": 16, "batch_norm": batch_norm},
        },
        train={
            "max_steps": None,
            "epochs": EPOCHS,
            "batch_size": batch,
            "global_batch_size": GLOBAL,
            "log_every_n_steps": 1,
        },
        optim={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        scaling={"num_workers": workers},
        parallel={"strategy": strategy},
        checkpoint={"every_n_steps": SAVED, "keep_last": 3},
        seed=3,
    )
    run["data"] = {"factory": "tests.helpers.user_data:indexed_digits"}
    return run


def recorded(tmp: Path) -> dict[str, list[list[int]]]:
    """Each recording process's forwards (``rank<r>-<pid>``: one list of sample indices per
    micro-batch, in order)."""
    return {
        path.stem: [[int(i) for i in line.split()] for line in path.read_text().splitlines()]
        for path in sorted((tmp / "ids").glob("*.ids"))
    }


def by_step(forwards: dict[str, list[list[int]]], accum: int, first: int, last: int) -> dict[int, list[list[int]]]:
    """Steps ``first``..``last`` of processes that started at step ``first``: each rank's ``accum``
    micro-batches of a step, over the ranks, each sorted, in sorted order (the step's global batch
    as the micro-batches it was cut into)."""
    steps: dict[int, list[list[int]]] = {}
    for micro_batches in forwards.values():
        for step in range(first, last + 1):
            taken = micro_batches[(step - first) * accum : (step - first + 1) * accum]
            assert len(taken) == accum, (step, len(micro_batches))
            steps.setdefault(step, []).extend(sorted(batch) for batch in taken)
    return {step: sorted(batches) for step, batches in steps.items()}


def samples(micro_batches: list[list[int]]) -> list[int]:
    return sorted(i for batch in micro_batches for i in batch)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run once: the uninterrupted 2-worker runs (DDP, FSDP) and, from the same spawned ranks,
    2-worker runs stopped after step 6 (checkpoint at 5: DDP, FSDP, batch size auto); those resumed
    on 1 worker, with a 1-worker run stopped the same way; that one resumed on 2. Three process
    start-ups in all."""
    root = tmp_path_factory.mktemp("resize")
    names = (
        *("straight", "fsdp-straight", "bn-straight"),
        *("two-to-one", "fsdp-two-to-one", "one-to-two", "auto-two-to-one", "bn-two-to-one"),
    )
    dirs = {name: root / name for name in names}
    first = spawn_ranks(
        sessions,
        2,
        [
            (config(dirs["straight"], 2), None),
            (config(dirs["fsdp-straight"], 2, "fsdp"), None),
            (config(dirs["bn-straight"], 2, batch_norm=True), None),
            (config(dirs["two-to-one"], 2), CRASH),
            (config(dirs["fsdp-two-to-one"], 2, "fsdp"), CRASH),
            (config(dirs["auto-two-to-one"], 2, batch="auto"), CRASH),
            (config(dirs["bn-two-to-one"], 2, batch_norm=True), CRASH),
        ],
    )[0]
    stopped = {name: recorded(dirs[name]) for name in ("two-to-one", "fsdp-two-to-one", "bn-two-to-one")}
    second = spawn_ranks(
        sessions,
        1,
        [
            (config(dirs["two-to-one"], 1), None),
            (config(dirs["fsdp-two-to-one"], 1, "fsdp"), None),
            (config(dirs["one-to-two"], 1), CRASH),
            (config(dirs["auto-two-to-one"], 1, batch="auto"), None),
            (config(dirs["bn-two-to-one"], 1, batch_norm=True), None),
        ],
    )[0]
    stopped["one-to-two"] = recorded(dirs["one-to-two"])
    third = spawn_ranks(sessions, 2, [(config(dirs["one-to-two"], 2), None)])[0]
    outcomes: dict[str, list[Outcome]] = {
        "straight": [first[0]],
        "fsdp-straight": [first[1]],
        "bn-straight": [first[2]],
        "two-to-one": [first[3], second[0]],
        "fsdp-two-to-one": [first[4], second[1]],
        "one-to-two": [second[2], third[0]],
        "bn-two-to-one": [first[6], second[4]],
        # Batch size auto searches again for the new share (its trial forwards are recorded too,
        # so only its losses are compared): 16 x 1 per worker on 2, 32 x 1 on 1.
        "auto-two-to-one": [first[5], second[3]],
    }
    return {"dirs": dirs, "outcomes": outcomes, "stopped": stopped}


def global_batches(runs: dict[str, Any], name: str, before: int, after: int) -> dict[int, list[list[int]]]:
    """Step -> its global batch's micro-batches (``by_step``), over a stop and a resume: the stopped
    processes' steps up to the checkpoint (their steps after it are read again), then the resumed
    ones'. ``before`` / ``after``: the worker counts."""
    stopped = runs["stopped"][name]
    resumed = {k: v for k, v in recorded(runs["dirs"][name]).items() if k not in stopped}
    assert len(stopped) == before and len(resumed) == after
    total = STEPS_PER_EPOCH * EPOCHS
    return {
        **by_step(stopped, GLOBAL // MICRO // before, 1, SAVED),
        **by_step(resumed, GLOBAL // MICRO // after, SAVED + 1, total),
    }


def assert_close(a: float, b: float) -> None:
    assert abs(a - b) <= RTOL * abs(b), (a, b)


@pytest.mark.slow  # the module's runs: three gloo process start-ups, 11-18 s in all on 2 busy cores
@pytest.mark.parametrize(("name", "reference", "before", "after"), [
    ("two-to-one", "straight", 2, 1),
    ("one-to-two", "straight", 1, 2),
    ("fsdp-two-to-one", "fsdp-straight", 2, 1),
    ("bn-two-to-one", "bn-straight", 2, 1),
])  # fmt: skip
def test_a_resumed_run_on_another_worker_count_reads_the_same_global_batches(
    runs: dict[str, Any], name: str, reference: str, before: int, after: int
) -> None:
    total = STEPS_PER_EPOCH * EPOCHS
    straight = by_step(recorded(runs["dirs"][reference]), GLOBAL // MICRO // 2, 1, total)
    assert len(straight) == total and all(len(samples(batches)) == GLOBAL for batches in straight.values())
    resized = global_batches(runs, name, before, after)
    # The same samples per step, cut into the same micro-batches (a rank reads whole micro-batches
    # of the epoch's order: data/sampler.py's chunks).
    assert resized == straight
    for epoch in range(EPOCHS):
        steps = range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
        seen = [i for step in steps for i in samples(resized[step])]
        assert len(seen) == len(set(seen)) == STEPS_PER_EPOCH * GLOBAL, "a sample was read twice in an epoch"
    # Another shuffle each epoch: the second epoch is not the first again.
    assert resized[1] != resized[STEPS_PER_EPOCH + 1]


@pytest.mark.slow  # the module's runs: three gloo process start-ups, 11-18 s in all on 2 busy cores
@pytest.mark.parametrize(("name", "reference"), [
    ("two-to-one", "straight"),
    ("one-to-two", "straight"),
    ("fsdp-two-to-one", "fsdp-straight"),
    ("auto-two-to-one", "straight"),
])  # fmt: skip
def test_a_resumed_run_on_another_worker_count_has_the_uninterrupted_losses(
    runs: dict[str, Any], name: str, reference: str
) -> None:
    straight = runs["outcomes"][reference][0]
    stopped, resumed = runs["outcomes"][name]
    assert stopped.crashed and resumed.final["status"] == "finished", resumed.final
    assert set(straight.losses) == set(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    losses = {**{s: v for s, v in stopped.losses.items() if s <= SAVED}, **resumed.losses}
    assert losses.keys() == straight.losses.keys()
    for step, loss in losses.items():
        assert_close(loss, straight.losses[step])
    assert straight.losses[STEPS_PER_EPOCH * EPOCHS] < straight.losses[1]  # it trains: the figures compared move
    assert resumed.val_losses.keys() == {s for s in straight.val_losses if s > SAVED}
    for step, loss in resumed.val_losses.items():
        assert_close(loss, straight.val_losses[step])
    a, b = final_weights(config(runs["dirs"][name], 1)), final_weights(config(runs["dirs"][reference], 2))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
    if name.startswith("auto"):
        split = (resumed.final["batch/micro_batch_size"], resumed.final["batch/grad_accum_steps"])
        assert split == (GLOBAL, 1), split  # the search ran again, for 1 worker's share


@pytest.mark.slow  # the module's runs: three gloo process start-ups, 11-18 s in all on 2 busy cores
def test_batch_norm_trains_the_same_after_a_resize(runs: dict[str, Any]) -> None:
    """The same micro-batches give BatchNorm the same batch statistics, so the training losses and
    the parameters are the uninterrupted run's. Its running statistics are not compared: DDP keeps
    rank 0's, which saw half the micro-batches (operations.md says so)."""
    straight = runs["outcomes"]["bn-straight"][0]
    stopped, resumed = runs["outcomes"]["bn-two-to-one"]
    assert stopped.crashed and resumed.final["status"] == "finished", resumed.final
    losses = {**{s: v for s, v in stopped.losses.items() if s <= SAVED}, **resumed.losses}
    assert losses.keys() == straight.losses.keys() == set(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    for step, loss in losses.items():
        assert_close(loss, straight.losses[step])
    a, b = (final_weights(config(runs["dirs"][name], 1)) for name in ("bn-two-to-one", "bn-straight"))
    assert any("running_mean" in key for key in a)
    parameters = [key for key in a if not key.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    for key in parameters:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # the module's runs: three gloo process start-ups, 11-18 s in all on 2 busy cores
def test_the_resumed_run_says_the_global_batch_held(runs: dict[str, Any]) -> None:
    for name, before, after, accum in (("two-to-one", 2, 1, 4), ("one-to-two", 1, 2, 2)):
        events = runs["outcomes"][name][1].events
        assert any(e.startswith("resumed from") and "checkpoint_000000005" in e for e in events), events
        said = (
            f"{before} -> {after} data-parallel workers: the global batch of {GLOBAL} samples holds "
            f"({accum} accumulation steps of {MICRO} per worker)"
        )
        assert any(said in e for e in events), events
        final = runs["outcomes"][name][1].final  # the split reaches summary.json's ``batch``
        assert (final["batch/micro_batch_size"], final["batch/grad_accum_steps"]) == (MICRO, accum)
    events = runs["outcomes"]["auto-two-to-one"][1].events
    said = f"2 -> 1 data-parallel workers: the global batch of {GLOBAL} samples holds ({GLOBAL} per worker, split by"
    assert any(said in e for e in events), events


def test_the_accumulation_follows_the_worker_count() -> None:
    cfg = load_config(
        {"model": {"name": "mlp"}, "train": {"max_steps": 1, "batch_size": 8, "global_batch_size": 96}}, env={}
    )
    assert [configured_split(cfg, world) for world in (1, 2, 3, 4, 12)] == [(8, 12), (8, 6), (8, 4), (8, 3), (8, 1)]
    with pytest.raises(ConfigError, match=re.escape("train.batch_size 8 x the 5 data-parallel workers = 40")):
        configured_split(cfg, 5)  # an elastic [min, max] is checked against the count a start gets
    auto = load_config(
        {"model": {"name": "mlp"}, "train": {"max_steps": 1, "batch_size": "auto", "global_batch_size": 96}}, env={}
    )
    assert configured_split(auto, 4) == (24, 1)
    plain = load_config({"model": {"name": "mlp"}, "train": {"max_steps": 1, "grad_accum_steps": 3}}, env={})
    assert configured_split(plain, 4) == (32, 3)  # without global_batch_size the global batch grows with W


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_steps_samples_and_micro_batches_do_not_depend_on_the_rank_count(chunk: int) -> None:
    """Global batch 16 of micro-batches of 4 over 1, 2 and 4 ranks (4, 2 and 1 accumulation steps):
    each step is the same block of the epoch's order on every count; with chunks of one
    micro-batch, cut into the same micro-batches too. The epoch has floor(N / 16) steps on each."""
    size, global_batch, micro = 70, 16, 4

    def steps(world: int) -> list[list[list[int]]]:
        orders = [
            ResumableDistributedSampler(size, world, r, True, 5, chunk=chunk).epoch_indices() for r in range(world)
        ]
        per_rank = global_batch // world
        assert {len(order) // per_rank for order in orders} == {size // global_batch}
        return [
            sorted(
                order[s * per_rank + m : s * per_rank + m + micro]
                for order in orders
                for m in range(0, per_rank, micro)
            )
            for s in range(size // global_batch)
        ]

    one, two, four = steps(1), steps(2), steps(4)
    blocks = [sorted(i for batch in step for i in batch) for step in one]
    assert [sorted(i for batch in step for i in batch) for step in two] == blocks
    assert [sorted(i for batch in step for i in batch) for step in four] == blocks
    assert (one == two == four) is (chunk == micro)
    with pytest.raises(ValueError, match="chunk must be >= 1, and 1 without even"):
        ResumableDistributedSampler(size, 2, 0, False, 5, even=False, chunk=4)


def test_a_run_keeps_the_sample_layout_of_its_first_start() -> None:
    """The checkpoint's chunk is kept while it splits a worker's step (a run started without
    train.global_batch_size stays interleaved; a changed batch_size keeps the old micro-batches as
    the unit); one that does not is said in one note."""
    from trainforge.checkpoint.state import State
    from trainforge.worker.components.base import Restore
    from trainforge.worker.components.data import DataSource

    def source(batch: int) -> DataSource:
        train = {"max_steps": 1, "batch_size": batch, "global_batch_size": 48}
        cfg = load_config({"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": train}, env={})
        return DataSource.build(cfg, 0, 1, pin_memory=False)

    def load(data: DataSource, **saved: int) -> list[str]:
        restore = Restore(step=3, world=1, plan="ddp", config={}, same_ranks=True)
        values = {"epoch": 0, "position": 96, "world_size": 1, "micro_batch_size": 8, "grad_accum_steps": 6}
        data.load_state_dict(State({**values, **saved}), restore)
        return restore.notes

    assert source(8).sampler.chunk == 8
    for saved, batch, kept in (({}, 8, 1), ({"chunk": 8}, 16, 8), ({"chunk": 16}, 8, 16)):
        data = source(batch)
        assert load(data, **saved) == [] and data.sampler.chunk == kept and data.position == 96
    data = source(16)
    notes = load(data, chunk=32)  # 32 does not split the 48 samples of a step
    assert data.sampler.chunk == 16 and notes == [
        "the checkpoint's samples were laid out in chunks of 32, which do not split this run's 48 samples per "
        "worker and step: the rest of epoch 0 may read samples twice or not at all"
    ]
