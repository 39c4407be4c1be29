"""train.batch_size: auto in 2-rank gloo groups without Ray (worker/autobatch.py, the step's retry).

The model (tests/helpers/oom_models.py) raises ``torch.OutOfMemoryError`` above a micro-batch that
differs by rank, or once at given forwards, as the CUDA allocator would: every rank must take the
smallest fit, the global batch must hold, and the run must equal the one configured by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import Config
from trainforge.errors import ConfigError
from trainforge.protocol import Note, Report
from trainforge.worker.autobatch import choose_batch, divisors, largest_divisor_at_most

STEPS = 12
GLOBAL = 32  # 16 samples per rank and step


class Crash(Exception):
    pass


class ListChannel:
    """Reports kept in a list; raises at the first report at or past step ``crash_at``."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.reports: list[Report] = []
        self.crash_at = crash_at

    def report(self, report: Report) -> None:
        self.reports.append(report)
        if self.crash_at is not None and report.step >= self.crash_at:
            raise Crash(f"crashed at step {report.step}")

    def preempted(self) -> bool:
        return False


def config(tmp: Path, train: dict[str, Any], limits: list[int] | None = None, late: dict[str, list[int]] | None = None):
    return tiny_run(
        tmp,
        model={"name": None, "factory": "tests.helpers.oom_models:oom_net", "kwargs": {"limits": limits, "late": late}},
        train={"max_steps": STEPS, "log_every_n_steps": 3, "eval_every_n_steps": 6, **train},
        optim={"name": "adamw", "lr": 0.01},
        scaling={"num_workers": 2},
        checkpoint={"every_n_steps": 6},
        seed=5,
    )


AUTO = {"batch_size": "auto", "global_batch_size": GLOBAL}


def session(rank: int, world: int, config_dict: dict[str, Any], crash_at: int | None = None) -> dict[str, Any]:
    """One rank's run as run_worker does it (build, restore, choose the batch, train), without Ray."""
    from trainforge.worker.build import build
    from trainforge.worker.loop import Session
    from trainforge.worker.saving import Checkpointing, restore

    cfg = Config.model_validate(config_dict)
    run = build(cfg, ranks=(rank, world))
    checkpointing = Checkpointing(run, CheckpointStore.for_run(cfg.storage_path, cfg.run.name))
    restored = restore(run, checkpointing.store)
    event = choose_batch(run)
    channel = ListChannel(crash_at)
    final: dict[str, Any]
    try:
        final = (
            Session(run, checkpointing, restored, channel=channel, events=[Note(event)] if event else [])
            .train()
            .to_json()
        )
    except Crash as err:
        final = {"crashed": str(err)}
    finally:
        checkpointing.close()
    return {
        "final": {k: v for k, v in final.items() if isinstance(v, (int, float, str))},
        "events": [e.text for r in channel.reports for e in r.events],
        "split": (run.data.micro_batch, run.data.accum),
        "weights": {k: v.clone() for k, v in run.plan.eval_model(run.model).state_dict().items()},
    }


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


@pytest.mark.slow
def test_auto_takes_every_ranks_smallest_fit_equals_the_run_by_hand_and_a_resume_keeps_it(tmp_path: Path) -> None:
    # Rank 0 fits 16 samples, rank 1 only 6: of the divisors of 16, both take 4, with 4 steps of accumulation.
    auto = spawn_ranks(session, 2, config(tmp_path / "auto", AUTO, limits=[16, 6]))
    for rank in auto:
        assert rank["split"] == (4, 4)
        assert rank["final"]["status"] == "finished"
        assert rank["final"]["batch/micro_batch_size"] == 4 and rank["final"]["batch/grad_accum_steps"] == 4
        assert rank["final"]["samples_seen"] == STEPS * GLOBAL
    chosen = "batch size auto: micro-batch 4 x 4 accumulation steps x 2 workers = global batch 32 (trial steps)"
    assert chosen in auto[0]["events"], auto[0]["events"]

    # The search left no trace (weights, batch-norm statistics, random numbers): the run is the one by hand.
    by_hand = spawn_ranks(session, 2, config(tmp_path / "hand", {"batch_size": 4, "grad_accum_steps": 4}))
    assert "batch/micro_batch_size" not in by_hand[0]["final"]
    assert_same_weights(auto[0]["weights"], by_hand[0]["weights"])
    assert_same_weights(auto[1]["weights"], by_hand[1]["weights"])

    # Crashed after the checkpoint at step 6 and resumed where a new search would pick 16: the
    # checkpoint's split is kept, and the run ends as the uninterrupted one.
    spawn_ranks(session, 2, config(tmp_path / "resumed", AUTO, limits=[16, 6]), 9)
    resumed = spawn_ranks(session, 2, config(tmp_path / "resumed", AUTO, limits=[16, 16]))
    assert [r["split"] for r in resumed] == [(4, 4), (4, 4)]
    assert "batch size auto: micro-batch 4 x 4 accumulation steps, from the checkpoint" in resumed[0]["events"]
    assert_same_weights(auto[0]["weights"], resumed[0]["weights"])


def test_a_late_out_of_memory_on_one_rank_is_retried_with_smaller_micro_batches_on_every_rank(
    tmp_path: Path,
) -> None:
    # Rank 1's forwards: 1 is the trial (16 fits), step k's is k + 1 while the split is 16 x 1.
    # Forward 5 (step 4, its only micro-batch: DDP's synchronised forward) runs out of memory:
    # step 4 again as 8 x 2 (forwards 6, 7); forward 8 (step 5's first micro-batch) too: 4 x 4.
    ranks = spawn_ranks(session, 2, config(tmp_path, AUTO, late={"1": [5, 8]}))
    for rank in ranks:
        assert rank["final"]["status"] == "finished"
        assert rank["split"] == (4, 4)
        assert rank["final"]["step"] == STEPS and rank["final"]["samples_seen"] == STEPS * GLOBAL
        assert rank["final"]["batch/oom_retries"] == 2
    retried = (
        "out of memory with micro-batch {}: step retried with micro-batch {} accumulation steps "
        "(global batch unchanged)"
    )
    assert retried.format(16, "8 x 2") in ranks[0]["events"]
    assert retried.format(8, "4 x 4") in ranks[0]["events"]
    # Every rank retried the same steps: the replicas' parameters are still identical (batch-norm
    # statistics are each rank's own since rank 0's last broadcast, as under DDP without retries).
    params = [{k: v for k, v in r["weights"].items() if "running_" not in k and "num_batches" not in k} for r in ranks]
    assert_same_weights(*params)


def test_no_micro_batch_that_fits_is_a_config_error(tmp_path: Path) -> None:
    from trainforge.worker.build import build

    cfg = Config.model_validate({**config(tmp_path, AUTO, limits=[0]), "scaling": {"num_workers": 1}})
    run = build(cfg, ranks=(0, 1))
    with pytest.raises(ConfigError, match=r"not even a micro-batch of 1 fits in train\.memory_limit_gb"):
        choose_batch(run)


def test_splits_are_divisors_of_the_ranks_share() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
    assert largest_divisor_at_most(12, 5) == 4
    assert largest_divisor_at_most(12, 0.9 * 6) == 4
    assert largest_divisor_at_most(12, 0.5) == 0
