"""The memory planner (worker/memory.py, ``trainforge plan``): its JSON, its figures against the
bytes each rank really holds, bad flags, and the documented 10B example.

The measurement is ``trainforge bench memory``'s own (``bench/memory.held_bytes``: trainforge's
worker build in local gloo ranks, one optimizer step, then a backward), so what is compared is what
a worker holds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.ranks import spawn_ranks

GIB = 1 << 30
SMALL = {
    "model": {"name": "llama_tiny"},
    "data": {"name": "synthetic", "kind": "tokens", "seq_len": 32, "vocab_size": 1000},
    "train": {"max_steps": 2, "batch_size": 2},
    "scaling": {"num_workers": 2},
}
LLAMA_10B = {
    "model": {"name": "llama_10b"},
    "data": {"name": "synthetic", "kind": "tokens", "seq_len": 2048, "vocab_size": 32000},
    "train": {"max_steps": 1000, "batch_size": 4},
    "parallel": {"strategy": "fsdp", "fsdp": {"mixed_precision": "bf16"}},
}


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    from trainforge.cli import main

    monkeypatch.setattr(sys, "argv", ["trainforge", *args])
    try:
        main()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def config_file(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_plan_json_has_every_strategy_its_terms_and_a_recommendation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch import nn

    from trainforge.config import load_config
    from trainforge.data import build_datasets
    from trainforge.models import build_model

    code = run_cli(monkeypatch, "plan", config_file(tmp_path, SMALL), "--gpus", "2", "--gpu-memory-gb", "2", "--json")
    assert code == 0
    report = json.loads(capsys.readouterr().out)

    config = load_config(SMALL)
    model: nn.Module = build_model(config.model, build_datasets(config.data, 0)[2])
    numel = sum(p.numel() for p in model.parameters())
    assert report["model"] == {"name": "llama_tiny", "parameters": numel}
    assert report["gpus"] == 2 and report["gpu_memory_gb"] == 2.0 and report["micro_batch"] == 2
    names = [row["name"] for row in report["strategies"]]
    assert names == ["ddp", "fsdp", "fsdp+ac", "fsdp+tp2", "fsdp+tp2+ac", "pp2+ddp", "pp2+ddp+ac"]
    assert [s["name"] for s in report["skipped"]] == ["fsdp+tp4", "fsdp+tp8"]  # 2 GPUs: no 4-way groups
    rows = {row["name"]: row for row in report["strategies"]}
    for row in report["strategies"]:
        assert set(row) >= {"name", "tensor_parallel", "activation_checkpointing", "per_gpu_gb", "fits"}
        assert set(row) >= {"mesh", "bytes_per_rank", "bubble", "crosses_nodes", "estimate", "runs", "settings"}
        assert row["mesh"]["pp"] * row["mesh"]["dp"] * row["mesh"]["tp"] == 2
        assert row["bytes_per_rank"] / GIB == pytest.approx(row["per_gpu_gb"]["total"], abs=1e-3)
        assert row["crosses_nodes"] == "nothing" and row["estimate"]["network_s"] == 0  # one node
        assert isinstance(row["max_micro_batch"], int) and row["max_micro_batch"] > 0
        parts = row["per_gpu_gb"]
        assert set(parts) >= {"params", "grads", "optimizer", "activations", "total"}
        assert all(isinstance(v, float) for v in parts.values())
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"), abs=0.01)
        assert row["fits"] == (parts["total"] <= report["gpu_memory_gb"])
        assert parts["grads"] == parts["params"]
    # fp32 weights, AdamW's two moments; fsdp halves them over 2 ranks; tp splits the blocks further
    assert rows["ddp"]["per_gpu_gb"]["params"] == pytest.approx(numel * 4 / GIB, abs=1e-3)
    assert rows["ddp"]["per_gpu_gb"]["optimizer"] == pytest.approx(2 * numel * 4 / GIB, abs=1e-3)
    assert rows["fsdp"]["per_gpu_gb"]["params"] == pytest.approx(numel * 2 / GIB, abs=1e-3)
    assert rows["fsdp+ac"]["per_gpu_gb"]["activations"] < rows["fsdp"]["per_gpu_gb"]["activations"]
    assert rows["fsdp+tp2"]["tensor_parallel"] == 2 and rows["fsdp+ac"]["activation_checkpointing"] is True
    assert report["recommended"] == "ddp" and report["settings"]["parallel.strategy"] == "ddp"
    assert report["why"].startswith("ddp fits") and "fsdp" in report["why"]  # against the next that fits
    assert rows["pp2+ddp"]["bubble"] == pytest.approx(1 / 3)  # (P - 1) / (M + P - 1): 2 stages, 2 micro-batches
    assert rows["pp2+ddp"]["settings"]["parallel.pipeline"] == {"stages": 2, "schedule": "1f1b", "microbatches": 2}
    assert rows["pp2+ddp"]["runs"] and rows["pp2+ddp"]["why_not"] is None


def test_max_micro_batch_is_the_boundary_of_the_estimate() -> None:
    from trainforge.config import load_config
    from trainforge.worker.capacity.estimate import GPU_RESERVE, max_micro_batch, profile_model, rank_breakdown

    config = load_config({**SMALL, "parallel": {"strategy": "fsdp", "activation_checkpointing": "full"}})
    profile = profile_model(config)
    memory = 2 * GIB
    largest = max_micro_batch(config, 2, memory, GPU_RESERVE, profile=profile)
    assert largest > 2

    def total(batch: int) -> int:
        return rank_breakdown(config, 2, micro_batch=batch, profile=profile).total + GPU_RESERVE.of(memory)

    assert total(largest) <= memory < total(largest + 1)
    # activations grow linearly with the micro-batch; nothing else does
    assert total(3) - total(2) == pytest.approx(total(2) - total(1), abs=2)
    assert max_micro_batch(config, 2, GIB, GPU_RESERVE, profile=profile) == 0  # the reserve alone is 1.05 GiB


# The parallel sections measured against the plan, one spawn of 2 ranks for all of them.
MEASURED = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"}, "tp2": {"strategy": "ddp", "tensor_parallel": 2}}
# A pipeline of 2 stages (one rank each: the embeddings and 2 blocks, then 2 blocks, the norm and the head),
# and the same 2 ranks interleaved: 4 stages of a block each, the embeddings and blocks 0 and 2 on rank 0,
# blocks 1 and 3, the norm and the head on rank 1.
PIPELINED = {
    "pp2": {"strategy": "ddp", "pipeline": {"stages": 2, "schedule": "1f1b", "microbatches": 2}},
    "pp2-interleaved": {
        "strategy": "ddp",
        "pipeline": {"stages": 2, "schedule": "interleaved_1f1b", "microbatches": 2},
    },
}


def held_under_each(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    from trainforge.bench.memory import held_bytes

    return {name: held_bytes(rank, world, config) for name, config in configs.items()}


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    from trainforge.bench.memory import bench_config

    configs = {}
    for name, parallel in {**MEASURED, **PIPELINED}.items():
        config = bench_config("llama_tiny", {}, "ddp", 2)
        configs[name] = {**config, "parallel": parallel}
    return {"configs": configs, "held": spawn_ranks(held_under_each, 2, configs)}


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
@pytest.mark.parametrize("name", list(MEASURED))
def test_planned_bytes_are_within_5_percent_of_what_each_rank_holds(name: str, measured: dict[str, Any]) -> None:
    from trainforge.config import Config
    from trainforge.worker.capacity.estimate import rank_breakdown

    planned = rank_breakdown(Config.model_validate(measured["configs"][name]), 2)
    for rank, by_name in enumerate(measured["held"]):
        held = by_name[name]
        for part in ("params", "grads", "optimizer"):
            estimate = getattr(planned, part)
            print(f"\n{name} rank {rank} {part}: planned {estimate} held {held[part]}")
            assert abs(estimate - held[part]) <= 0.05 * held[part], (name, rank, part, estimate, held)


@pytest.mark.slow  # 10-40 s: a spawn of 4 ranks
def test_planned_bytes_of_sharded_and_split_pipelines_are_within_5_percent_of_what_each_rank_holds() -> None:
    """2 stages on 4 ranks, each stage sharded by FSDP over 2 replicas, or split over 2
    tensor-parallel ranks: ranks 0 and 1 hold halves of the first stage, 2 and 3 of the second."""
    from trainforge.bench.memory import bench_config
    from trainforge.config import Config
    from trainforge.worker.capacity.estimate import stage_breakdowns

    cut = {"stages": 2, "schedule": "1f1b", "microbatches": 2}
    configs = {
        name: {**bench_config("llama_tiny", {}, "ddp", 4), "parallel": {"pipeline": cut, **parallel}}
        for name, parallel in {"pp2-fsdp": {"strategy": "fsdp"}, "pp2-tp2": {"tensor_parallel": 2}}.items()
    }
    held = spawn_ranks(held_under_each, 4, configs)
    unsharded = stage_breakdowns(Config.model_validate({**configs["pp2-fsdp"], "parallel": PIPELINED["pp2"]}), 2)
    for name, config in configs.items():
        stages = stage_breakdowns(Config.model_validate(config), 4)
        if name == "pp2-fsdp":
            assert stages[0].params == pytest.approx(unsharded[0].params / 2, rel=0.01)  # each stage's half
        for rank, by_name in enumerate(held):
            mine, planned = by_name[name], stages[rank // 2]
            for part in ("params", "grads", "optimizer"):
                estimate = getattr(planned, part)
                print(f"\n{name} rank {rank} {part}: planned {estimate} held {mine[part]}")
                assert abs(estimate - mine[part]) <= 0.05 * mine[part], (name, rank, part, estimate, mine)


@pytest.mark.slow  # shares the spawn above
@pytest.mark.parametrize("name", list(PIPELINED))
def test_planned_bytes_of_each_pipeline_stage_are_within_5_percent_of_what_its_rank_holds(
    measured: dict[str, Any], name: str
) -> None:
    from trainforge.config import Config
    from trainforge.worker.capacity.estimate import stage_breakdowns

    stages = stage_breakdowns(Config.model_validate(measured["configs"][name]), 2)
    assert (
        len(stages) == 2 and stages[0].params != stages[1].params
    )  # the embeddings on one, head and norm on the other
    for rank, by_name in enumerate(measured["held"]):
        held, planned = by_name[name], stages[rank]  # pipeline rank r: the stages rank r holds
        for part in ("params", "grads", "optimizer"):
            estimate = getattr(planned, part)
            print(f"\n{name} rank {rank} {part}: planned {estimate} held {held[part]}")
            assert abs(estimate - held[part]) <= 0.05 * held[part], (rank, part, estimate, held)


def test_interleaved_ranks_hold_more_micro_batches_for_a_smaller_bubble() -> None:
    """torch's interleaved 1F1B on 2 ranks x 2 stages over 4 micro-batches: rank 0 runs 4 forwards
    before its first backward (a round of 2 micro-batches through each of its stages), rank 1 two;
    every forward is undone by a backward of the same stage; the bubble is (P - 1) / (V M + P - 1)."""
    from trainforge.worker.capacity.estimate import Strategy, interleaved_in_flight, rank_stages

    interleaved = Strategy("pp2", False, pipeline=2, schedule="interleaved_1f1b", microbatches=4, virtual=2)
    assert interleaved.parts == 4 and rank_stages(interleaved, 1) == [1, 3]
    assert interleaved.bubble == pytest.approx(1 / 9)
    assert Strategy("pp2", False, pipeline=2, microbatches=4).bubble == pytest.approx(1 / 5)
    for rank, warmup in ((0, 4), (1, 2)):
        counts = interleaved_in_flight(interleaved, rank)
        assert len(counts) == 2 * 4 * 2  # a forward and a backward per micro-batch and stage
        assert max(sum(live) for live in counts) == warmup + 1 and counts[-1] == [0, 0]
        assert all(n >= 0 for live in counts for n in live)
        assert counts[warmup - 1] == [2, warmup - 2]  # a round through the first stage, then the second


@pytest.mark.slow
def test_planned_bytes_of_fsdp_x_tensor_parallel_and_hsdp_at_4_ranks_are_within_5_percent() -> None:
    from trainforge.bench.memory import bench_config
    from trainforge.config import Config
    from trainforge.worker.capacity.estimate import rank_breakdown

    layouts = {"fsdp+tp2": {"tensor_parallel": 2}, "hsdp 2x2": {"fsdp": {"replicate": 2}}}
    configs = {
        name: {**bench_config("llama_tiny", {}, "fsdp", 4), "parallel": {"strategy": "fsdp", **parallel}}
        for name, parallel in layouts.items()
    }
    planned = {name: rank_breakdown(Config.model_validate(config), 4) for name, config in configs.items()}
    # HSDP 2x2 holds what FSDP over 2 ranks holds: half of every parameter, not a quarter.
    fsdp_over_2 = Config.model_validate({**configs["hsdp 2x2"], "parallel": {"strategy": "fsdp"}})
    assert planned["hsdp 2x2"].params == rank_breakdown(fsdp_over_2, 2).params
    for rank, held in enumerate(spawn_ranks(held_under_each, 4, configs)):
        for name, part in ((name, part) for name in configs for part in ("params", "grads", "optimizer")):
            estimate, real = getattr(planned[name], part), held[name][part]
            print(f"\n{name} rank {rank} {part}: planned {estimate} held {real}")
            assert abs(estimate - real) <= 0.05 * real, (name, rank, part, estimate, held)


def test_plan_on_two_nodes_puts_hsdp_before_each_fsdp_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_cli(monkeypatch, "plan", config_file(tmp_path, SMALL), "--gpus", "16", "--gpu-memory-gb", "2", "--json")
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    names = [row["name"] for row in report["strategies"]]
    assert names[:5] == ["ddp", "hsdp", "fsdp", "hsdp+ac", "fsdp+ac"]
    assert "hsdp+tp8" not in names  # a node of 8 GPUs is one tp8 group: no second shard in it
    rows = {row["name"]: row for row in report["strategies"]}
    assert (rows["hsdp"]["replicate"], rows["hsdp"]["shards"]) == (2, 8)  # sharded within a node
    assert (rows["fsdp"]["replicate"], rows["fsdp"]["shards"]) == (1, 16)
    assert (rows["hsdp+tp2"]["replicate"], rows["hsdp+tp2"]["shards"]) == (2, 4)
    # Each GPU holds twice fsdp's share of the parameters (FSDP2's padding aside).
    assert rows["hsdp"]["per_gpu_gb"]["params"] == pytest.approx(2 * rows["fsdp"]["per_gpu_gb"]["params"], rel=0.05)


def test_hsdp_shards_over_the_smallest_group_of_nodes_that_fits() -> None:
    from trainforge.worker.capacity.estimate import Strategy
    from trainforge.worker.capacity.render import settings_of, with_hsdp

    fsdp = Strategy("fsdp", True)

    def chosen(fits: Any) -> Strategy:
        first, second = with_hsdp([fsdp], fits, gpus=64)
        assert second == fsdp and first.name == "hsdp"
        return first

    assert chosen(lambda s: True).replicate == 8  # one node of 8
    assert chosen(lambda s: s.replicate <= 4).replicate == 4  # two nodes
    assert chosen(lambda s: False).replicate == 2  # none fits: the largest group, half the GPUs
    assert with_hsdp([fsdp], lambda s: True, gpus=8) == [fsdp]  # one node: plain fsdp only
    assert settings_of(chosen(lambda s: True))["parallel.fsdp.replicate"] == 8


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--gpus", "0", "--gpus 0: from 1 to"),
        ("--gpu-memory-gb", "-1", "--gpu-memory-gb -1.0: must be"),
        ("--link", "fast", "--link 'fast': one of"),
        ("--link", "measured", "--link measured: trainforge predict's"),
        ("--nics-per-node", "0", "--nics-per-node 0: from 1 to"),
        ("--gpu-tflops", "0", "--gpu-tflops 0.0: must be"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    value: str,
    says: str,
) -> None:
    code = run_cli(monkeypatch, "plan", config_file(tmp_path, SMALL), flag, value)
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error:") and says in err, err


def test_a_bad_config_key_exits_2_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_cli(monkeypatch, "plan", config_file(tmp_path, SMALL), "--set", "parallel.strategy=zero3")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "parallel.strategy" in err, err


def test_a_10b_llama_on_8_x_80_gb_needs_fsdp_and_activation_checkpointing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainforge.config import load_config
    from trainforge.worker.capacity.render import plan_memory

    started = time.perf_counter()
    report = plan_memory(load_config(LLAMA_10B), gpus=8, gpu_memory_gb=80)
    took = time.perf_counter() - started
    print(f"\nllama_10b plan in {took:.1f} s")
    assert took < 30  # about 6 s on 2 shared CPU cores (docs/benchmarks.md)
    rows = {row["name"]: row for row in report["strategies"]}
    assert report["model"]["parameters"] == pytest.approx(10.24e9, rel=0.01)
    assert not rows["ddp"]["fits"] and not rows["fsdp"]["fits"]
    assert rows["fsdp+ac"]["fits"] and report["recommended"] == "fsdp+ac"
    # 16 bytes per parameter (weights, gradients, two moments) over 8 ranks
    state = sum(rows["fsdp"]["per_gpu_gb"][p] for p in ("params", "grads", "optimizer"))
    assert state == pytest.approx(16 * 10.24e9 / 8 / GIB, rel=0.01)
    assert {"fsdp+tp8", "fsdp+tp8+ac"} <= set(rows)

    code = run_cli(monkeypatch, "plan", config_file(tmp_path, LLAMA_10B), "--gpus", "8", "--gpu-memory-gb", "80")
    out = capsys.readouterr().out
    assert code == 0 and "recommended: fsdp+ac" in out and "llama_10b (10.24B parameters)" in out, out


# ---------------------------------------------------------------------------------------------
# Pipelined layouts


def pipelined(batch_size: int, stages: int, schedule: str) -> dict[str, Any]:
    return {
        **SMALL,
        "train": {"max_steps": 2, "batch_size": batch_size},
        "parallel": {"pipeline": {"stages": stages, "schedule": schedule, "microbatches": batch_size}},
    }


def test_a_stage_holds_its_blocks_and_the_embeddings_on_the_first_the_head_on_the_last() -> None:
    import torch

    from trainforge.config import load_config
    from trainforge.data import build_datasets
    from trainforge.models import build_model
    from trainforge.worker.capacity.estimate import profile_model, stage_breakdowns

    config = load_config(pipelined(2, 2, "1f1b"))
    spec = build_datasets(config.data, 0)[2]
    with torch.device("meta"):
        model = build_model(config.model, spec)
    numel = {name: p.numel() for name, p in model.named_parameters()}
    first = sum(
        n for name, n in numel.items() if "embed_tokens" in name or ".layers.0." in name or ".layers.1." in name
    )
    stages = stage_breakdowns(config, 2, profile=profile_model(config))
    assert [stage.params for stage in stages] == [4 * first, 4 * (sum(numel.values()) - first)]  # fp32
    for stage in stages:  # one rank per stage: no data-parallel buffer
        assert stage.grads == stage.params and stage.buffers == 0
        assert stage.optimizer >= 2 * stage.params  # AdamW's moments (and its step counters)


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_the_stages() -> None:
    from trainforge.config import load_config
    from trainforge.worker.capacity.estimate import Strategy, profile_model, stage_breakdowns

    gpipe, one_f_one_b = (load_config(pipelined(8, 2, schedule)) for schedule in ("gpipe", "1f1b"))
    profile = profile_model(gpipe)
    held = {
        name: [stage.activations for stage in stage_breakdowns(config, 2, profile=profile)]
        for name, config in (("gpipe", gpipe), ("1f1b", one_f_one_b))
    }
    # 8 micro-batches in flight under GPipe, 2 on 1F1B's first stage: a quarter of the block's share
    assert held["1f1b"][0] < held["gpipe"][0] / 2
    assert held["1f1b"][1] < held["gpipe"][1] / 4  # the last stage: one at a time, against 8
    strategy = Strategy("pp4", False, pipeline=4, microbatches=4)
    assert [strategy.in_flight(stage) for stage in range(4)] == [4, 3, 2, 1]
    assert strategy.bubble == pytest.approx(3 / 7)
    assert Strategy("pp4", False, pipeline=4, microbatches=4, schedule="gpipe").in_flight(3) == 4


def test_what_crosses_nodes_follows_the_mesh() -> None:
    from trainforge.config import load_config
    from trainforge.worker.capacity.estimate import Strategy, profile_model
    from trainforge.worker.capacity.layouts import CROSSING, traffic

    config = load_config(SMALL)
    profile = profile_model(config)

    def crossing(strategy: Strategy) -> str:
        return CROSSING[traffic(config, profile, strategy, 16, 2).crossing]

    assert crossing(Strategy("ddp", False)) == "replica all-reduces"
    assert crossing(Strategy("fsdp", True)) == "sharded all-gathers"
    assert crossing(Strategy("hsdp", True, replicate=2)) == "replica all-reduces"  # shard groups of one node
    assert crossing(Strategy("pp2+ddp", False, pipeline=2)) == "point-to-point activations"  # a stage per node
    assert traffic(config, profile, Strategy("ddp", False), 8, 2).bytes_per_step == 0  # one node
    # DDP all-reduces every gradient: 2 (nodes - 1) / nodes of them leave each node, shared by its 8 GPUs
    grads = 4 * profile.parameters
    assert traffic(config, profile, Strategy("ddp", False), 16, 2).bytes_per_step == pytest.approx(16 * grads / 8)


LLAMA_70B = {
    "model": {"name": "llama_70b"},
    "data": {"name": "synthetic", "kind": "tokens", "seq_len": 2048, "vocab_size": 128256},
    "train": {"max_steps": 1000, "batch_size": 4},
    "parallel": {"strategy": "fsdp", "fsdp": {"mixed_precision": "bf16"}},
}


def test_a_70b_llama_on_64_x_80_gb_gets_a_pipelined_or_hsdp_layout_that_fits_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainforge.config import Config

    code = run_cli(
        monkeypatch, "plan", config_file(tmp_path, LLAMA_70B), "--gpus", "64", "--gpu-memory-gb", "80", "--json"
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["parameters"] == 70_553_706_496
    rows = {row["name"]: row for row in report["strategies"]}
    assert not rows["ddp"]["fits"] and not rows["fsdp"]["fits"]  # 1.1 TB of state; activations of 80 blocks
    proposed = [row for row in rows.values() if row["fits"] and (row["pipeline"] > 1 or row["replicate"] > 1)]
    assert any(row["pipeline"] > 1 for row in proposed) and any(row["replicate"] > 1 for row in proposed)
    best = rows[report["recommended"]]
    assert best["fits"] and best["runs"] and (best["pipeline"] > 1 or best["replicate"] > 1)
    assert report["why"].startswith(f"{best['name']} fits") and "samples/s" in report["why"]
    # the best pipelined layout is weighed in the reason, and trainforge's own checks say why it does not run
    assert any(name in report["why"] for name, row in rows.items() if row["pipeline"] > 1 and row["fits"])
    if report["better_not_run"] is not None:
        better = rows[report["better_not_run"]]
        assert (
            better["fits"]
            and not better["runs"]
            and f"but trainforge does not run it: {better['why_not']}" in report["why"]
        )
    # what it recommends runs: the settings validate as a config for 64 workers
    raw = {**LLAMA_70B, "scaling": {"num_workers": 64}, "parallel": {"fsdp": {"mixed_precision": "bf16"}}}
    for key, value in report["settings"].items():
        *path, leaf = key.split(".")
        section = raw
        for part in path:
            section = section.setdefault(part, {})
        section[leaf] = value
    Config.model_validate(raw)

    def lost(row: dict[str, Any]) -> float:  # to the network and the bubble, per sample
        estimate = row["estimate"]
        return float((estimate["network_s"] + estimate["bubble_s"]) / estimate["samples"])

    assert lost(best) == pytest.approx(min(lost(row) for row in rows.values() if row["fits"] and row["runs"]), rel=1e-3)
    for row in rows.values():
        stages = row["pipeline"]
        assert row["bubble"] == pytest.approx((stages - 1) / (row["microbatches"] + stages - 1) if stages > 1 else 0)
        assert row["runs"] == (row["why_not"] is None)


def test_on_a_slow_network_a_pipeline_beats_data_parallel_and_says_so() -> None:
    from trainforge.config import load_config
    from trainforge.worker.capacity.layouts import Cluster
    from trainforge.worker.capacity.render import plan_memory

    report = plan_memory(load_config(SMALL), 16, 2, Cluster(link_Bps=100e6 / 8))
    rows = {row["name"]: row for row in report["strategies"]}
    best = rows[report["recommended"]]
    assert best["pipeline"] > 1 and best["crosses_nodes"] == "point-to-point activations"
    assert "pipeline bubble" in report["why"] and "unpipelined layout that fits" in report["why"]
    # it sends less between nodes per sample than the data-parallel layouts it beats
    assert best["cross_node_bytes_per_sample"] < rows["ddp"]["cross_node_bytes_per_sample"] / 4


def test_a_faster_link_and_more_nics_shorten_the_network_share_of_the_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config_file(tmp_path, SMALL)

    def network_s(*flags: str) -> float:
        assert run_cli(monkeypatch, "plan", path, "--gpus", "16", "--gpu-memory-gb", "2", "--json", *flags) == 0
        report = json.loads(capsys.readouterr().out)
        return float({row["name"]: row for row in report["strategies"]}["ddp"]["estimate"]["network_s"])

    slow, fast, wide = network_s("--link", "eth25"), network_s("--link", "ib400"), network_s("--nics-per-node", "8")
    assert fast == pytest.approx(slow * 3.125 / 50) and wide == pytest.approx(network_s() / 8)


def test_a_model_that_cannot_be_pipelined_gets_no_pipelined_rows_and_says_why(tmp_path: Path) -> None:
    from tests.helpers.runs import tiny_run
    from trainforge.config import load_config
    from trainforge.worker.capacity.render import plan_memory

    report = plan_memory(load_config(tiny_run(tmp_path)), 16, 2)
    assert not any(row["pipeline"] > 1 for row in report["strategies"])
    (skipped,) = [entry for entry in report["skipped"] if entry["name"] == "pp"]
    assert "built-in decoders" in skipped["reason"]
    assert report["forward_flops_per_sample"] > 0  # the MLP's matrix products, counted on fake tensors
