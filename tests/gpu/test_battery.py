"""The GPU battery (#25): every CUDA path trainforge has, on one GPU, in one command:

    pytest -m gpu            # skipped without CUDA; about 5 minutes on one H100

Each test runs the worker's real Session (build, restore, auto batch, train, checkpoint) in a
process joined to an NCCL group of its own (world size 1 still initialises NCCL), as a Ray Train
worker does, minus Ray's start-up. What it covers: NCCL DDP; bf16 and fp16 with the grad scaler
(clipping, a non-finite step skipped); SyncBatchNorm; FSDP with the bf16 policy and CPU offload;
pinned host memory for the loader; CUDA RNG state in checkpoints and an exact resume on the GPU;
gradient communication timed with CUDA events; NVML readings; a real CUDA out-of-memory caught by
``train.batch_size: auto``; the planner against ``torch.cuda.max_memory_allocated``. ``trainforge
bench gpu`` is tests/unit/test_bench_gpu.py (also marked ``gpu``).

None of this has run yet: the machine it was written on has no GPU (docs/gpu.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Crash, ListChannel, assert_bit_identical, checkpoint_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU = {"scaling": {"num_workers": 1, "use_gpu": True}}


def gpu_run(rank: int, world: int, config_dict: dict[str, Any], crash_at: int | None = None) -> dict[str, Any]:
    """One rank's run as ``run_worker`` does it (build, restore, auto batch, Session) in an NCCL
    group without Ray; what a test needs to see of it."""
    import torch.distributed as dist

    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.config import Config
    from trainforge.protocol import Note
    from trainforge.worker.autobatch import choose_batch
    from trainforge.worker.build import build
    from trainforge.worker.loop import Session
    from trainforge.worker.saving import Checkpointing, restore

    cfg = Config.model_validate(config_dict)
    run = build(cfg, ranks=(rank, world))
    checkpointing = Checkpointing(run, CheckpointStore.for_run(cfg.storage_path, cfg.run.name))
    restored = restore(run, checkpointing.store)
    event = choose_batch(run)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    channel = ListChannel(crash_at)
    final: dict[str, Any]
    crashed = False
    try:
        session = Session(run, checkpointing, restored, channel=channel, events=[Note(event)] if event else [])
        final = session.train().to_json()
    except Crash as err:
        final, crashed = {"crashed": str(err)}, True
    finally:
        checkpointing.close()
    return {
        "backend": dist.get_backend(),
        "device": str(run.device),
        "sync_batchnorm": any(isinstance(m, torch.nn.SyncBatchNorm) for m in run.model.modules()),
        "pinned": run.data.pin_memory,
        "split": (run.data.micro_batch, run.data.accum),
        "final": {k: v for k, v in final.items() if isinstance(v, (int, float, str))},
        # Every report's own numbers and every log interval's point (train/loss, skipped steps).
        "reports": [r.scalars() for r in channel.reports] + [dict(p) for r in channel.reports for p in r.history],
        "events": [e.text for r in channel.reports for e in r.events],
        "crashed": crashed,
        "peak_allocated": torch.cuda.max_memory_allocated(),
    }


def one_gpu(config: dict[str, Any], crash_at: int | None = None) -> dict[str, Any]:
    return dict(spawn_ranks(gpu_run, 1, config, crash_at, backend="nccl")[0])


def finished(result: dict[str, Any]) -> None:
    assert not result["crashed"] and result["final"].get("status", "finished") == "finished", result["final"]
    losses = [r["train/loss"] for r in result["reports"] if "train/loss" in r]
    assert losses and all(math.isfinite(x) for x in losses), losses


def test_nccl_ddp_on_one_gpu_trains_with_pinned_batches(tmp_path: Path) -> None:
    result = one_gpu(tiny_run(tmp_path, **GPU, train={"max_steps": 60, "log_every_n_steps": 10}))
    finished(result)
    assert result["backend"] == "nccl" and result["device"].startswith("cuda")
    assert result["pinned"], "data.pin_memory defaults to on for a CUDA device"
    losses = [r["train/loss"] for r in result["reports"] if "train/loss" in r]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_with_clipping_skips_a_non_finite_step(tmp_path: Path, precision: str) -> None:
    model = {"name": None, "factory": "tests.helpers.user_models:nan_once", "kwargs": {"at": 5, "on_rank": 0}}
    config = tiny_run(
        tmp_path,
        **GPU,
        model=model,
        precision=precision,
        train={"max_steps": 30, "log_every_n_steps": 5, "grad_clip_norm": 1.0},
    )
    result = one_gpu(config)
    finished(result)
    skipped = max(r.get("train/skipped_steps", 0.0) for r in result["reports"])
    assert skipped >= 1, "the NaN forward's step was applied"


def test_sync_batchnorm_replaces_batch_norm_and_trains(tmp_path: Path) -> None:
    config = tiny_run(tmp_path, **GPU, model={"name": "small_cnn"}, train={"max_steps": 20, "sync_batchnorm": True})
    result = one_gpu(config)
    finished(result)
    assert result["sync_batchnorm"]


def test_fsdp_with_the_bf16_policy_and_cpu_offload(tmp_path: Path) -> None:
    parallel = {"strategy": "fsdp", "fsdp": {"mixed_precision": "bf16", "cpu_offload": True}}
    result = one_gpu(tiny_run(tmp_path, **GPU, parallel=parallel, train={"max_steps": 20}))
    finished(result)


def test_cuda_rng_state_is_checkpointed_and_a_crashed_run_resumes_bit_identical(tmp_path: Path) -> None:
    def config(where: str) -> dict[str, Any]:
        return tiny_run(
            tmp_path / where,
            **GPU,
            model={"name": None, "factory": "tests.helpers.user_models:paced_net", "kwargs": {"delay_s": 0.0}},
            train={"max_steps": 40, "log_every_n_steps": 5},
            checkpoint={"every_n_steps": 20},
        )

    straight = one_gpu(config("straight"))
    crashed = one_gpu(config("crashed"), crash_at=21)
    resumed = one_gpu(config("crashed"))
    finished(straight)
    assert crashed["crashed"]
    finished(resumed)
    assert any(e.startswith("resumed from") for e in resumed["events"]), resumed["events"]
    state = json.loads((tmp_path / "crashed" / "t" / "checkpoint_000000020" / "trainer_state.json").read_text())
    assert state["ranks"][0]["rng"]["cuda"], "no CUDA generator state in the checkpoint"
    assert_bit_identical(
        checkpoint_state(tmp_path / "straight" / "t", 40), checkpoint_state(tmp_path / "crashed" / "t", 40)
    )


def timed_all_reduce(rank: int, world: int) -> tuple[float, float]:
    """A DDP model on the GPU whose gradient all-reduce ``CommTimer`` times with CUDA events (a run
    of one worker has no DDP wrapper, so the timer is attached here as the plan attaches it)."""
    from torch.nn.parallel import DistributedDataParallel

    from trainforge.metrics.worker.comm import CommTimer

    device = torch.device("cuda", torch.cuda.current_device())
    model = DistributedDataParallel(torch.nn.Linear(1024, 1024).to(device), device_ids=[device.index])
    timer = CommTimer.attach(model, device)
    assert timer is not None and timer.cuda
    for _ in range(3):
        model(torch.randn(64, 1024, device=device)).sum().backward()
    torch.cuda.synchronize()
    return timer.take(steps=3)


def test_gradient_communication_is_timed_with_cuda_events() -> None:
    in_flight, exposed = spawn_ranks(timed_all_reduce, 1, backend="nccl")[0]
    assert in_flight > 0 and 0 <= exposed <= in_flight, (in_flight, exposed)


def test_nvml_reads_the_gpu() -> None:
    from trainforge.metrics.nvml import Gpus

    sample = Gpus().sample()
    assert sample, "NVML found no GPU on a machine with CUDA"
    assert sample.get("gpu0_memory_used_gb", 0) > 0 and "gpu0_temperature_c" in sample, sample


def test_auto_batch_size_catches_a_real_cuda_out_of_memory(tmp_path: Path) -> None:
    # 1 GiB of activations per sample: a micro-batch of 256 cannot fit on any GPU made today.
    total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    model = {"name": None, "factory": "tests.helpers.oom_models:cuda_hog", "kwargs": {"gb_per_sample": 1.0}}
    config = tiny_run(
        tmp_path,
        **GPU,
        model=model,
        train={"max_steps": 4, "batch_size": "auto", "global_batch_size": 256},
    )
    result = one_gpu(config)
    finished(result)
    micro, accum = result["split"]
    assert micro * accum == 256 and micro < 256 and micro <= total_gb, result["split"]
    assert any(e.startswith("batch size auto: micro-batch") for e in result["events"]), result["events"]


def test_the_planner_is_within_5_percent_of_the_cuda_allocators_peak(tmp_path: Path) -> None:
    from trainforge.config import Config
    from trainforge.worker.capacity.estimate import rank_breakdown

    config = tiny_run(
        tmp_path,
        **GPU,
        model={"name": "llama_tiny", "kwargs": {"hidden_size": 1024, "intermediate_size": 4096}},
        data={"name": "synthetic", "kind": "tokens", "seq_len": 256, "vocab_size": 32000, "num_samples": 512},
        train={"max_steps": 3, "batch_size": 8},
        optim={"name": "adamw", "lr": 1e-4},
    )
    result = one_gpu(config)
    finished(result)
    planned = rank_breakdown(Config.model_validate(config), 1).total
    peak = result["peak_allocated"]
    print(f"\nplanned {planned / 2**20:.1f} MiB, torch.cuda.max_memory_allocated {peak / 2**20:.1f} MiB")
    assert abs(planned - peak) <= 0.05 * peak, (planned, peak)
