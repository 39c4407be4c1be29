"""Communicating less (docs/parallelism.md): DDP compression hooks, bucket size, static graph, and
local SGD / DiLoCo, each in 2-rank gloo groups without Ray (the worker's Session, as in
test_session.py). Several runs share one group of processes: one start-up for a batch of runs.

What is asserted, and why that much:

* bf16/fp16 hooks round each bucket to 16 bits: the final weights differ from fp32's (the hook ran,
  with the all-reduce timer wrapped around it) but stay within a stated tolerance;
* powersgd (rank 1) converges: its loss goes down, to within a margin of plain DDP's;
* bucket_cap_mb and static_graph change how DDP schedules the same sums: bit-identical weights;
* local SGD with H = 1 and plain SGD inside equals DDP (a mean of SGD steps is the SGD step of the
  mean gradient) within float rounding; DiLoCo with H = 8 reaches a loss within a margin of DDP's;
* crash between sync points (and inside PowerSGD's warm-up) and restart: bit-identical to the
  straight run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Crash, ListChannel
from trainforge.config import load_config
from trainforge.errors import ConfigError


def one_run(rank: int, world: int, config_dict: dict[str, Any], crash_at: int | None) -> dict[str, Any]:
    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.config import Config
    from trainforge.metrics.worker.comm import CommTimer
    from trainforge.worker.build import build
    from trainforge.worker.loop import Session
    from trainforge.worker.saving import Checkpointing, restore

    cfg = Config.model_validate(config_dict)
    run = build(cfg, ranks=(rank, world))
    compression = run.plan.compression  # as worker/hooks does: the timer wraps the plan's hook
    timer = CommTimer.attach(run.model, run.device, compression.hook if compression is not None else None)
    checkpointing = Checkpointing(run, CheckpointStore.for_run(cfg.storage_path, cfg.run.name))
    restored = restore(run, checkpointing.store)
    channel = ListChannel(crash_at)
    final: dict[str, Any]
    try:
        final = Session(run, checkpointing, restored, channel=channel).train().to_json()
    except Crash as err:
        final = {"crashed": str(err)}
    finally:
        checkpointing.close()
    comm_s = timer.take(1.0)[0] if timer is not None else None
    params = {k: v.detach().clone() for k, v in run.plan.eval_model(run.model).state_dict().items()}
    return {
        "final": {k: v for k, v in final.items() if isinstance(v, (int, float, str))},
        "first_loss": channel.reports[0].figures.get("train/loss") if channel.reports else None,
        "events": [e.text for r in channel.reports for e in r.events],
        "params": params,
        "comm_s": comm_s,
        "notes": list(run.plan.notes),
    }


def runs(rank: int, world: int, plans: list[tuple[dict[str, Any], int | None]]) -> list[dict[str, Any]]:
    """Each (config, crash_at) one after another, in this group of processes."""
    return [one_run(rank, world, config, crash_at) for config, crash_at in plans]


def config(tmp: Path, name: str, steps: int = 32, **parallel: Any) -> dict[str, Any]:
    return tiny_run(
        tmp,
        run={"name": name, "output_dir": str(tmp)},
        train={"max_steps": steps, "batch_size": 16, "log_every_n_steps": 4},
        optim={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        scaling={"num_workers": 2},
        parallel=parallel,
        checkpoint={"every_n_steps": 8, "keep_last": 5},
        seed=5,
    )


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# config


BASE = {"model": {"name": "mlp"}, "train": {"max_steps": 2, "batch_size": 4}}


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"strategy": "fsdp", "grad_compression": "bf16"}, "parallel.grad_compression needs parallel.strategy: ddp"),
        ({"tensor_parallel": 2, "grad_compression": "powersgd"}, "parallel.grad_compression needs parallel.tensor_"),
        ({"strategy": "fsdp", "bucket_cap_mb": 5}, "parallel.bucket_cap_mb needs parallel.strategy: ddp"),
        ({"strategy": "fsdp", "static_graph": True}, "parallel.static_graph needs parallel.strategy: ddp"),
        ({"strategy": "fsdp", "sync": {"every_n_steps": 8}}, "parallel.sync needs parallel.strategy: ddp"),
        ({"tensor_parallel": 2, "sync": {"every_n_steps": 8}}, "parallel.sync needs parallel.tensor_parallel: 1"),
        ({"sync": {"every_n_steps": 8}, "grad_compression": "bf16"}, "parallel.sync and parallel.grad_compression"),
        ({"sync": {"every_n_steps": 8}, "static_graph": True}, "parallel.sync does not use DDP"),
        ({"grad_compression": "int8"}, "parallel.grad_compression = 'int8'"),
        ({"powersgd": {"warmup_steps": 1}}, "parallel.powersgd.warmup_steps = 1"),
        ({"sync": {"every_n_steps": 0}}, "parallel.sync.every_n_steps = 0"),
        ({"sync": {"every_n_steps": 4, "outer_optimizer": "adam"}}, "parallel.sync.outer_optimizer = 'adam'"),
        ({"sync": {"every_n_steps": 4, "outer_lr": 0}}, "parallel.sync.outer_lr = 0"),
        ({"sync": {"outer_lr": 0.7}}, "missing key parallel.sync.every_n_steps"),
    ],
)
def test_communication_options_that_cannot_work_are_one_line_errors_naming_the_key(
    parallel: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({**BASE, "parallel": parallel})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_communication_options_and_their_defaults() -> None:
    par = load_config(BASE).parallel
    assert (par.grad_compression, par.bucket_cap_mb, par.static_graph, par.sync) == ("none", None, False, None)
    assert (par.powersgd.rank, par.powersgd.warmup_steps) == (1, 1000)
    par = load_config(
        {**BASE, "parallel": {"sync": {"every_n_steps": 32, "outer_optimizer": "nesterov", "outer_lr": 0.7}}}
    ).parallel
    assert par.sync is not None and (par.sync.every_n_steps, par.sync.momentum, par.sync.outer_lr) == (32, 0.9, 0.7)


def test_ddp_options_and_powersgd_state_follow_the_config() -> None:
    from trainforge.worker.compression import Compression, PowerSGDComponent, ddp_options

    par = load_config({**BASE, "parallel": {"bucket_cap_mb": 4, "static_graph": True}}).parallel
    assert ddp_options(par) == {"bucket_cap_mb": 4, "static_graph": True}
    assert ddp_options(load_config(BASE).parallel) == {}

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    from trainforge.metrics.worker.comm import ChosenHook
    from trainforge.worker.components.base import Restore

    state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=100)
    compression = PowerSGDComponent(Compression("powersgd", ChosenHook(state, powerSGD_hook), state, 100))
    # A checkpoint without PowerSGD's state (written before it was saved):
    compression.missing(Restore(40, 1, "ddp", {}, same_ranks=True))  # inside the warm-up: the counter continues
    assert (state.iter, state.start_powerSGD_iter) == (40, 100)
    compression.missing(Restore(99, 1, "ddp", {}, same_ranks=True))  # too late for the buckets: two plain steps
    assert (state.iter, state.start_powerSGD_iter) == (99, 101)


# ---------------------------------------------------------------------------------------------
# compression hooks (one group of processes for all of them)

# After 32 steps of SGD (lr 0.05, momentum 0.9) on the mlp, the largest weight difference to fp32
# was 3.1e-4 (fp16) and 7.5e-4 (bf16, 8 bits of mantissa); the bounds leave a factor of 3-4.
TOLERANCE = {"fp16": 1e-3, "bf16": 3e-3}


def test_compression_hooks_bucket_size_and_static_graph(tmp_path: Path) -> None:
    plans = [
        (config(tmp_path, "none"), None),
        (config(tmp_path, "bf16", grad_compression="bf16"), None),
        (config(tmp_path, "fp16", grad_compression="fp16"), None),
        (config(tmp_path, "powersgd", grad_compression="powersgd", powersgd={"rank": 1, "warmup_steps": 4}), None),
        (config(tmp_path, "buckets", bucket_cap_mb=0.01, static_graph=True), None),
        (two_buckets(config(tmp_path, "wide", steps=6, grad_compression="powersgd", powersgd=QUICK_POWERSGD)), None),
    ]
    none, bf16, fp16, powersgd, buckets, wide = spawn_ranks(runs, 2, plans)[0]
    print(
        f"\nlargest weight difference to fp32: bf16 {max_diff(bf16['params'], none['params']):.2e}, "
        f"fp16 {max_diff(fp16['params'], none['params']):.2e}; final loss none {none['final']['train/loss']:.4f}, "
        f"powersgd {powersgd['final']['train/loss']:.4f}"
    )
    for name, result in (("bf16", bf16), ("fp16", fp16)):
        assert any(note == f"gradient compression {name}" for note in result["notes"])
        assert not identical(result["params"], none["params"]), f"{name}: the hook did not run"
        assert max_diff(result["params"], none["params"]) < TOLERANCE[name], name
        assert result["comm_s"] > 0, f"{name}: the all-reduce timer did not see the compression hook"
    assert powersgd["comm_s"] > 0
    # Rank 1 on this small mlp after 32 steps (4 of them warm-up): 1.88 against plain DDP's 1.55,
    # down from about ln(10) = 2.3 at the start.
    loss = powersgd["final"]["train/loss"]
    assert loss < powersgd["first_loss"] - 0.2, (powersgd["first_loss"], loss)
    assert loss < none["final"]["train/loss"] + 0.5, (loss, none["final"]["train/loss"])
    assert identical(buckets["params"], none["params"])
    # Over 1 MiB of gradients, DDP's buckets are two (its first is 1 MiB); on gloo, torch's PowerSGD
    # hook with two buckets in flight deadlocked (found on the namespace cluster). Compressed steps ran:
    assert wide["final"]["step"] == 6 and wide["comm_s"] > 0


QUICK_POWERSGD = {"rank": 1, "warmup_steps": 2}


def two_buckets(run: dict[str, Any]) -> dict[str, Any]:
    """The mlp widened to 64-512-512-10: 1.2 MB of gradients, two DDP buckets."""
    return {**run, "model": {"name": "mlp", "kwargs": {"hidden_sizes": [512, 512]}}}


@pytest.mark.parametrize(
    ("warmup", "case"),
    [(16, "inside its warm-up"), (9, "at the last step of its warm-up"), (4, "with compression running")],
)
def test_powersgd_crashed_and_restarted_is_bit_identical(tmp_path: Path, warmup: int, case: str) -> None:
    # Checkpoints every 8 steps, a crash at 12, the restart from step 8: inside the warm-up (16),
    # one step before it ends (9: the restarted DDP's first step rebuilds its buckets, the second
    # compresses), and after it began (4: error feedback and P/Q matrices come back from the
    # checkpoint, keyed by the same buckets).
    parallel = {"grad_compression": "powersgd", "powersgd": {"rank": 1, "warmup_steps": warmup}}
    plans = [
        (config(tmp_path, "straight", steps=24, **parallel), None),
        (config(tmp_path, "crashed", steps=24, **parallel), 12),
        (config(tmp_path, "crashed", steps=24, **parallel), None),
    ]
    straight, crashed, resumed = spawn_ranks(runs, 2, plans)[0]
    assert "crashed" in crashed["final"]
    assert any("checkpoint_000000008" in e for e in resumed["events"])
    assert not any(e.startswith("powersgd:") for e in resumed["events"]), resumed["events"]  # none started over
    assert identical(straight["params"], resumed["params"]), case
    assert straight["final"]["train/loss"] == resumed["final"]["train/loss"]


# ---------------------------------------------------------------------------------------------
# local SGD / DiLoCo


def checkpoint_files(run_dir: Path) -> dict[str, Any]:
    """The last checkpoint's tensors (each rank's own included) and the sync component's values."""
    last = sorted(run_dir.glob("checkpoint_*"))[-1]
    state: dict[str, Any] = {f"model/{k}": v for k, v in load_file(str(last / "model.safetensors")).items()}
    for path in sorted(last.rglob("*.pt")):
        state[path.relative_to(last).as_posix()] = torch.load(path, weights_only=True)
    state["sync"] = json.loads((last / "trainer_state.json").read_text())["components"]["sync"]
    return state


def same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_local_sgd_every_step_equals_ddp_and_diloco_converges(tmp_path: Path) -> None:
    plans = [
        (config(tmp_path, "ddp"), None),
        (config(tmp_path, "local1", sync={"every_n_steps": 1}), None),
        (config(tmp_path, "diloco8", sync={"every_n_steps": 8, "outer_optimizer": "nesterov", "outer_lr": 0.7}), None),
    ]
    ddp, local1, diloco = spawn_ranks(runs, 2, plans)[0]
    print(
        f"\nlocal SGD H=1 vs DDP: {max_diff(local1['params'], ddp['params']):.2e}; final loss ddp "
        f"{ddp['final']['train/loss']:.4f}, diloco H=8 {diloco['final']['train/loss']:.4f}"
    )
    assert any("parameters synchronised every 1 steps" in n for n in local1["notes"])
    assert local1["comm_s"] is None  # no DDP: no gradient all-reduce to time
    assert max_diff(local1["params"], ddp["params"]) < 1e-5
    # DiLoCo: 4 sync points in 32 steps; its loss stays within a margin of DDP's.
    assert diloco["final"]["train/loss"] < ddp["final"]["train/loss"] + 0.2, (diloco["final"], ddp["final"])


def test_diloco_crashed_between_sync_points_and_restarted_is_bit_identical(tmp_path: Path) -> None:
    # Sync every 3 steps, checkpoints every 8: the one it resumes from (step 8) falls between the
    # sync points 6 and 9, where each worker's model and AdamW moments are its own.
    sync = {"every_n_steps": 3, "outer_optimizer": "nesterov", "outer_lr": 0.7}

    def cfg(name: str) -> dict[str, Any]:
        base = config(tmp_path, name, steps=20, sync=sync)
        base["optim"] = {"name": "adamw", "lr": 3e-3}
        return base

    plans = [(cfg("straight"), None), (cfg("crashed"), 12), (cfg("crashed"), None)]
    by_rank = spawn_ranks(runs, 2, plans)
    straight, crashed, resumed = ([r[i] for r in by_rank] for i in range(3))
    assert "crashed" in crashed[0]["final"]
    assert any("checkpoint_000000008" in e for e in resumed[0]["events"]), resumed[0]["events"]
    for rank in (0, 1):
        assert identical(straight[rank]["params"], resumed[rank]["params"]), rank
    # The final sync (20 is no sync point) left one model on both ranks; the final checkpoints
    # (model, optimizer, sync.pt with both ranks' state) are the same bytes' worth of tensors.
    assert identical(straight[0]["params"], straight[1]["params"])
    a, b = checkpoint_files(tmp_path / "straight"), checkpoint_files(tmp_path / "crashed")
    assert same_tree(a, b)
    assert a["sync"]["last_sync"] == 20 and {"ranks/0/sync.pt", "ranks/1/sync.pt"} <= a.keys()


# ---------------------------------------------------------------------------------------------
# bytes per step (docs/benchmarks.md): one process, a gloo group of one, all-reduce calls counted

BYTES_MODELS = {
    "mlp": {"model": {"name": "mlp"}, "data": {"name": "digits"}},
    "llama_tiny": {
        "model": {
            "name": "llama_tiny",
            "kwargs": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
        },
        "data": {"name": "synthetic", "kind": "tokens", "seq_len": 16, "vocab_size": 256, "num_samples": 64},
    },
}
BYTES_OPTIONS = {
    "none": {},
    "bf16": {"grad_compression": "bf16"},
    "fp16": {"grad_compression": "fp16"},
    "powersgd rank 1": {"grad_compression": "powersgd", "powersgd": {"rank": 1, "warmup_steps": 2}},
    "powersgd rank 4": {"grad_compression": "powersgd", "powersgd": {"rank": 4, "warmup_steps": 2}},
    "sync every 8": {"sync": {"every_n_steps": 8}},
    "sync every 32": {"sync": {"every_n_steps": 32}},
}


def count_bytes(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Bytes one rank hands to all-reduce per optimizer step under each option, after warm-up.
    A group of one still runs every hook (DDP all-reduces, PowerSGD factors); local sync is
    counted as a 2-worker sync would send (its all-reduce is skipped for one worker)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from trainforge.config import Config
    from trainforge.data import build_datasets
    from trainforge.models import build_model, build_task
    from trainforge.worker import sync as local_sync
    from trainforge.worker.compression import compress, ddp_options

    sizes: list[int] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]  # the hooks call dist.all_reduce
    local_sync.world_size = lambda: 2  # type: ignore[assignment]
    table: dict[str, dict[str, float]] = {}
    for label, sections in BYTES_MODELS.items():
        for option, parallel in BYTES_OPTIONS.items():
            cfg = Config.model_validate({**sections, "train": {"max_steps": 8, "batch_size": 8}, "parallel": parallel})
            train, _, spec = build_datasets(cfg.data, 0)
            torch.manual_seed(0)
            model = build_model(cfg.model, spec)
            task = build_task(cfg.model, spec)
            inputs, targets = (torch.stack([torch.as_tensor(train[i][j]) for i in range(8)]) for j in (0, 1))
            grads = sum(p.numel() * p.element_size() for p in model.parameters())
            if cfg.parallel.sync is not None:
                optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
                sizes.clear()
                local_sync.LocalSync(cfg.parallel.sync, model, optimizer, 0).sync(0)
                sent = sum(sizes) / cfg.parallel.sync.every_n_steps
            else:
                ddp = DistributedDataParallel(model, **ddp_options(cfg.parallel))
                if compress(ddp, cfg.parallel) is None:
                    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's own, in Python
                for _ in range(4):  # past PowerSGD's warm-up and DDP's bucket rebuild
                    sizes.clear()
                    task.loss(ddp(inputs), targets).backward()
                sent = float(sum(sizes))
            table.setdefault(label, {"gradients": float(grads)})[option] = sent
    return table


def test_bytes_each_option_sends_per_step() -> None:
    table = spawn_ranks(count_bytes, 1)[0]
    for label, sent in table.items():
        grads = sent["gradients"]
        print(f"\n{label}: fp32 gradients {grads:,.0f} bytes")
        for option in BYTES_OPTIONS:
            print(f"| {label} | `{option}` | {sent[option]:,.0f} | {sent[option] / grads:.3f} |")
        assert sent["none"] == grads
        assert sent["bf16"] == sent["fp16"] == grads / 2
        assert sent["powersgd rank 1"] < sent["powersgd rank 4"] < grads / 5
        # Parameters and floating-point buffers (llama's rotary frequencies), once every H steps.
        assert grads / 8 <= sent["sync every 8"] < grads / 8 * 1.01
        assert sent["sync every 32"] == sent["sync every 8"] / 4


def timer_around_compression(rank: int, world: int) -> dict[str, Any]:
    """A group of one: bf16 compression registered by the plan's code, then the all-reduce timer."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from trainforge.config import ParallelConfig
    from trainforge.metrics.worker.comm import CommTimer
    from trainforge.worker.compression import compress

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    compression = compress(ddp, ParallelConfig(grad_compression="bf16"))
    timer = CommTimer.attach(ddp, torch.device("cpu"), compression.hook if compression else None)
    ddp(torch.randn(8, 16)).square().sum().backward()
    grads = [p.grad for p in ddp.parameters() if p.grad is not None]
    in_flight, _ = timer.take(1.0) if timer is not None else (0.0, 0.0)
    return {
        "name": compression.name if compression else None,
        "timed": timer is not None,
        "in_flight": in_flight,
        # The bf16 hook's mark: every gradient is a bf16 value (rounded on the way through).
        "rounded": all(torch.equal(g, g.to(torch.bfloat16).float()) for g in grads),
    }


def test_the_all_reduce_timer_wraps_the_compression_hook_instead_of_dropping_it() -> None:
    result = spawn_ranks(timer_around_compression, 1)[0]
    assert result == {**result, "name": "bf16", "timed": True, "rounded": True}
    assert result["in_flight"] > 0


def test_outer_nesterov_step_and_a_restore_without_saved_state(tmp_path: Path) -> None:
    """One process (no group: the mean of one worker is its own model). The outer step is torch's
    SGD with Nesterov momentum on anchor - mean; a checkpoint without sync.pt makes the restored
    model the anchor and says so."""
    from torch import nn

    from trainforge.config import SyncConfig
    from trainforge.worker.components.base import Restore
    from trainforge.worker.sync import LocalSync

    model = nn.Linear(3, 2)
    start = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSync(SyncConfig(every_n_steps=4, outer_optimizer="nesterov", outer_lr=0.7), model, optimizer, 0)
    with torch.no_grad():
        model.weight.add_(1.0)  # what four local steps moved
    local.after_step(3)
    assert local.last_sync == 0  # not a sync point
    local.after_step(4)
    assert local.last_sync == 4
    # First step: momentum buffer = outer gradient g = -1, Nesterov update g + 0.9 g = -1.9 g.
    assert torch.allclose(model.weight, start + 0.7 * 1.9, atol=1e-6)
    assert torch.equal(local.anchor[0], model.weight)

    restore = Restore(12, 1, "ddp", {}, same_ranks=True)
    local.missing(restore)  # the checkpoint holds no local-sync state
    [note] = restore.notes
    assert "no local-sync state" in note
    assert local.last_sync == 12 and not local.outer.state  # type: ignore[union-attr]
