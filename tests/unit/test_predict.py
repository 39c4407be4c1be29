"""``trainforge predict``: the cost model against hand-computed cases, its monotonic behaviour, the
inputs it reads from a config, the JSON's schema and one line with exit code 2 for bad flags.

Everything runs in this process: the CLI through ``main(argv)``, the model built on the meta device,
compute measured on the small MLP of a digits config (a few milliseconds a step)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.runs import tiny_run
from trainforge.config import Config, ParallelConfig
from trainforge.errors import TrainforgeError
from trainforge.predict.inputs import model_bytes, workload_of
from trainforge.predict.links import PRESETS, Link, measured_link, resolve_link
from trainforge.predict.model import (
    Topology,
    Workload,
    buckets,
    collective_time,
    ddp_step,
    fsdp_step,
    local_sgd_step,
    predict_points,
    ring_time,
)

FAST = Link("fast", 0.0, 1e8, "test")
SLOW = Link("slow", 0.0, 1e7, "test")


def flat(link: Link) -> Topology:
    """One GPU per node: every collective runs over ``link`` alone."""
    return Topology(gpus_per_node=1, intra=PRESETS["nvlink"], inter=link)


# ---------------------------------------------------------------------------------------------
# The arithmetic, by hand


def test_a_ring_makes_2_n_minus_1_steps_for_all_reduce_and_n_minus_1_for_the_others() -> None:
    link = Link("l", 1e-5, 1e9, "test")
    # all-reduce of 8 MB over 4 ranks: 6 steps of (10 us + 2 MB at 1 GB/s)
    assert ring_time("all_reduce", 8e6, 4, link) == pytest.approx(6 * (1e-5 + 2e-3))
    assert ring_time("reduce_scatter", 8e6, 4, link) == pytest.approx(3 * (1e-5 + 2e-3))
    assert ring_time("all_gather", 8e6, 4, link, links=2) == pytest.approx(3 * (1e-5 + 1e-3))
    assert ring_time("all_reduce", 8e6, 1, link) == 0.0


def test_across_nodes_a_ring_inside_each_node_then_one_across_the_nodes() -> None:
    intra, inter = Link("in", 1e-6, 100e9, "test"), Link("out", 1e-5, 10e9, "test")
    topology = Topology(gpus_per_node=8, intra=intra, inter=inter, nics_per_node=2)
    inside = 14 * (1e-6 + 80e6 / (8 * 100e9))
    across = 2 * (1e-5 + 80e6 / (2 * 10e9 * 2))  # 16 GPUs: 2 nodes, 2 NICs each
    assert collective_time("all_reduce", 80e6, 16, topology) == pytest.approx(inside + across)
    assert collective_time("all_reduce", 80e6, 8, topology) == pytest.approx(inside)  # one node: no link


def test_ddp_buckets_overlap_the_backward_and_the_last_one_is_exposed() -> None:
    # 0.3 s of compute: backward 0.2 s from t=0.1; two buckets of 1 MB, ready at 0.2 and 0.3.
    work = Workload("ddp", compute_s=0.3, samples_per_gpu=8, grad_bytes=2_000_000, bucket_bytes=1_000_000)
    # 2 ranks at 1e7 B/s: a bucket's all-reduce is 2 x 0.5 MB / 1e7 = 0.1 s; the second waits for the first.
    step, comm = ddp_step(work, 2, flat(SLOW))
    assert (step, comm) == pytest.approx((0.4, 0.2))
    # at 1e8 B/s (0.01 s a bucket) the first hides behind the backward, the last is exposed
    step, comm = ddp_step(work, 2, flat(FAST))
    assert (step, comm) == pytest.approx((0.31, 0.02))
    assert buckets(2_500_000, 1_000_000) == [1_000_000, 1_000_000, 500_000]


def test_ddp_with_accumulation_communicates_in_the_last_micro_batch_only() -> None:
    work = Workload(
        "ddp", compute_s=0.6, samples_per_gpu=16, grad_bytes=1_000_000, micro_batches=2, bucket_bytes=1_000_000
    )
    # the bucket is full when the last micro-batch's backward ends (0.6 s), then 2 x 0.5 MB / 1e7 = 0.1 s
    assert ddp_step(work, 2, flat(SLOW)) == pytest.approx((0.7, 0.1))


def test_fsdp_gathers_before_each_pass_and_scatters_after_the_backward() -> None:
    # one unit, 2 ranks at 1e7 B/s: a gather or scatter of 1 MB is 1 x 0.5 MB / 1e7 = 0.05 s.
    # forward: gather 0-0.05, compute 0.05-0.15; backward: gather 0.15-0.2, compute 0.2-0.4, scatter 0.4-0.45
    work = Workload("fsdp", compute_s=0.3, samples_per_gpu=8, grad_bytes=1_000_000, param_bytes=1_000_000)
    assert fsdp_step(work, 2, flat(SLOW)) == pytest.approx((0.45, 0.15))
    kept = Workload(
        "fsdp",
        compute_s=0.3,
        samples_per_gpu=8,
        grad_bytes=1_000_000,
        param_bytes=1_000_000,
        reshard_after_forward=False,
    )
    assert fsdp_step(kept, 2, flat(SLOW)) == pytest.approx((0.4, 0.1))  # no second gather


def test_hsdp_keeps_fsdp_collectives_inside_a_group_and_all_reduces_shards_across_groups() -> None:
    intra, inter = Link("in", 1e-6, 100e9, "test"), Link("out", 1e-5, 10e9, "test")
    topology = Topology(gpus_per_node=8, intra=intra, inter=inter)
    sizes = {"compute_s": 0.3, "samples_per_gpu": 8, "grad_bytes": 80_000_000, "param_bytes": 80_000_000}
    fsdp, hsdp = Workload("fsdp", **sizes), Workload("fsdp", **sizes, shard_group=8)
    assert fsdp_step(hsdp, 8, topology) == fsdp_step(fsdp, 8, topology)  # one group: plain FSDP
    # 16 GPUs: gathers and the reduce-scatter inside a node; then each GPU's 10 MB shard all-reduced
    # with its replica on the other node, the node's 8 GPUs sharing its one NIC.
    gather = ring_time("all_gather", 80e6, 8, intra)
    scatter = ring_time("reduce_scatter", 80e6, 8, intra) + 2 * (1e-5 + 10e6 / (2 * 10e9 / 8))
    assert fsdp_step(hsdp, 16, topology)[1] == pytest.approx(2 * gather + scatter)
    assert fsdp_step(hsdp, 16, topology)[1] < fsdp_step(fsdp, 16, topology)[1]  # less crosses the slow link


def test_local_sgd_pays_one_parameter_all_reduce_every_h_steps() -> None:
    # 2 ranks at 1e7 B/s: all-reducing 1 MB of parameters takes 0.1 s, once every 4 steps
    work = Workload("ddp", compute_s=0.3, samples_per_gpu=8, grad_bytes=1_000_000, sync_every_n_steps=4)
    assert local_sgd_step(work, 2, flat(SLOW)) == pytest.approx((0.325, 0.025))
    (point,) = predict_points(work, [2], flat(SLOW))
    assert point.comm_exposed_s == pytest.approx(0.025)


def test_points_report_throughput_efficiency_and_exposed_communication() -> None:
    work = Workload("ddp", compute_s=0.3, samples_per_gpu=8, grad_bytes=2_000_000, bucket_bytes=1_000_000)
    one, two = predict_points(work, [1, 2], flat(SLOW))
    assert (one.step_time_s, one.efficiency, one.comm_exposed_s) == (0.3, 1.0, 0.0)
    assert one.samples_per_s == pytest.approx(8 / 0.3)
    assert two.samples_per_s == pytest.approx(16 / 0.4)
    assert two.efficiency == pytest.approx(0.75)
    assert two.comm_exposed_s == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------
# Monotonic behaviour


def efficiencies(work: Workload, link: Link, counts: list[int]) -> list[float]:
    return [p.efficiency for p in predict_points(work, counts, Topology(8, PRESETS["nvlink"], link))]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_efficiency_falls_with_gpus_and_rises_with_bandwidth_and_compute(strategy: Any) -> None:
    counts = [1, 2, 8, 16, 64, 512]
    work = Workload(strategy, compute_s=0.1, samples_per_gpu=32, grad_bytes=400_000_000, param_bytes=400_000_000)
    slow = efficiencies(work, PRESETS["eth25"], counts)
    assert slow == sorted(slow, reverse=True) and slow[-1] < slow[0] == 1.0
    fast = efficiencies(work, PRESETS["ib400"], counts)
    assert all(f >= s for f, s in zip(fast, slow, strict=True)) and fast[-1] > slow[-1]
    longer = Workload(strategy, compute_s=1.0, samples_per_gpu=32, grad_bytes=400_000_000, param_bytes=400_000_000)
    assert efficiencies(longer, PRESETS["eth25"], counts)[-1] > slow[-1]


# ---------------------------------------------------------------------------------------------
# Inputs: links and the config's model


def test_a_measured_link_is_derived_from_the_all_reduce_fit(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {"workers": 2, "backend": "gloo", "fits": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}}}
        )
    )
    link = measured_link(path)
    # 2 ranks: 2 ring steps, each moving half the buffer: alpha 50 us a step, 1e9 B/s
    assert link.alpha_s == pytest.approx(5e-5) and link.bandwidth_Bps == pytest.approx(1e9)
    assert resolve_link("measured", path) == link
    path.write_text("{}")
    with pytest.raises(TrainforgeError, match=r"fits\.all_reduce"):
        measured_link(path)


@pytest.mark.parametrize(
    ("text", "alpha_s", "bandwidth_Bps"),
    [
        ("100mbit", 50e-6, 12.5e6),
        ("1gbit", 50e-6, 125e6),
        ("10gbit@30us", 30e-6, 1.25e9),
        ("2.5Gbit@1ms", 1e-3, 312.5e6),
    ],
)
def test_a_link_given_by_its_rate_as_tc_writes_it(text: str, alpha_s: float, bandwidth_Bps: float) -> None:
    link = resolve_link(text, None)
    assert link.alpha_s == pytest.approx(alpha_s) and link.bandwidth_Bps == pytest.approx(bandwidth_Bps)
    assert ("assumed" in link.source) == ("@" not in text)


def test_model_bytes_count_trainable_parameters_of_the_config_model(tmp_path: Path) -> None:
    import torch

    from trainforge.data import build_datasets
    from trainforge.models import build_model

    config = Config.model_validate(tiny_run(tmp_path))
    _, _, spec = build_datasets(config.data, config.seed)
    expected = sum(p.numel() for p in build_model(config.model, spec).parameters())
    found = model_bytes(config, None)
    assert found.parameters == expected and found.grad_bytes == 4 * expected and found.units == 1
    if "grad_compression" in ParallelConfig.model_fields:  # parallel.grad_compression (#14 section 3)
        bf16 = Config.model_validate(tiny_run(tmp_path, parallel={"grad_compression": "bf16"}))
        assert model_bytes(bf16, None).grad_bytes == 2 * expected  # the hook sends bf16 gradients
    fsdp = Config.model_validate(tiny_run(tmp_path, parallel={"strategy": "fsdp", "fsdp": {"mixed_precision": "bf16"}}))
    assert model_bytes(fsdp, None).param_bytes == 2 * expected  # bf16 parameters gathered
    assert model_bytes(config, 1_000_000).grad_bytes == 4_000_000
    if "sync" in ParallelConfig.model_fields:  # parallel.sync (#14 section 3)
        synced = Config.model_validate(tiny_run(tmp_path, parallel={"sync": {"every_n_steps": 8}}))
        assert workload_of(synced, found, 0.1).sync_every_n_steps == 8
    assert torch.get_default_device().type == "cpu"  # the meta device did not leak


# ---------------------------------------------------------------------------------------------
# The command


def write_config(tmp_path: Path, **sections: Any) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path, **sections)))
    return str(path)


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest-xdist's workers set COLUMNS=80, which the CLI's consoles respect as a user's would
    (trainforge/consoles.py); the tables here are read as a pipe gets them, at their natural width."""
    monkeypatch.delenv("COLUMNS", raising=False)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    from trainforge.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, re.sub(r"\x1b\[[0-9;]*m", "", err))


def test_json_has_a_point_per_gpu_count_and_the_inputs_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path)
    done = run(capsys, "predict", config, "--gpus", "1,2,16", "--json", "--link", "eth25")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [p["gpus"] for p in report["points"]] == [1, 2, 16]
    for point in report["points"]:
        assert isinstance(point["gpus"], int)
        for key in ("step_time_s", "samples_per_s", "efficiency", "comm_exposed_s"):
            assert isinstance(point[key], float) and point[key] >= 0
    assert report["points"][0]["efficiency"] == 1.0
    given = report["inputs"]
    assert given["compute_source"].startswith("measured here") and given["compute_s"] > 0
    assert given["link"]["name"] == "eth25" and given["micro_batch"] == 16 and given["strategy"] == "ddp"
    assert "cost" not in report


def test_given_step_time_model_params_and_price_give_cost_per_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, cost={"price_per_gpu_hour": 2.0, "currency": "EUR"})
    args = ["--gpus", "1,8,64", "--step-time", "0.2", "--model-params", "25557032", "--json"]
    report = json.loads(run(capsys, "predict", config, *args).stdout)
    assert report["inputs"]["compute_s"] == 0.2 and report["inputs"]["grad_bytes"] == 4 * 25557032
    samples = report["cost"]["train_samples"]
    assert report["cost"]["currency"] == "EUR" and samples > 0
    for point in report["points"]:
        assert point["epoch_s"] == pytest.approx(samples / point["samples_per_s"])
        assert point["cost_per_epoch"] == pytest.approx(point["epoch_s"] / 3600 * point["gpus"] * 2.0)
    table = run(capsys, "predict", config, *args[:-1])
    assert table.returncode == 0 and "cost/epoch (EUR)" in table.stdout and "efficiency" in table.stdout


def test_a_measured_link_from_bench_collectives_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    measured = tmp_path / "c.json"
    measured.write_text(json.dumps({"workers": 2, "fits": {"all_reduce": {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9}}}))
    config = write_config(tmp_path)
    args = ["--link", "measured", "--collectives", str(measured), "--step-time", "0.1", "--json"]
    report = json.loads(run(capsys, "predict", config, *args).stdout)
    assert report["inputs"]["link"]["name"] == "measured"
    assert report["inputs"]["link"]["bandwidth_GBps"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--gpus", "1,x"], "--gpus '1,x': expected comma-separated integers"),
        (["--gpus", "0,2"], "--gpus '0,2': counts from 1 to 1000000"),
        (["--link", "carrier-pigeon"], "--link 'carrier-pigeon': one of nvlink, ib200, ib400, eth25, eth50, eth100"),
        (["--link", "0.1kbit"], "--link '0.1kbit': a rate from 1kbit to 10000gbit"),
        (["--link", "measured"], "--link measured needs --collectives"),
        (["--collectives", "x.json"], "--collectives x.json: only with --link measured"),
        (["--link", "measured", "--collectives", "absent.json"], "--collectives absent.json: no such file"),
        (["--step-time", "-1"], "--step-time -1.0: seconds > 0"),
        (["--model-params", "1000"], "--model-params needs --step-time"),
        (["--gpus-per-node", "0"], "--gpus-per-node 0: from 1 to 1024"),
        (["--set", "train.batch_size=auto", "--set", "train.global_batch_size=64"], "train.batch_size: auto"),
        (["--set", "train.global_batch_size=64"], "predict models a fixed batch per GPU"),
        (
            ["--set", "data.name=imagefolder", "--set", "data.path=/absent"],
            "data.path /absent does not exist",
        ),
    ],
)
def test_bad_flags_are_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    done = run(capsys, "predict", write_config(tmp_path), *args)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    if "data.path" in expected:
        assert "--model-params N and --step-time S" in errors[0]  # what works without the data


def test_more_nics_per_node_shorten_the_inter_node_collectives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path)
    args = ["--gpus", "64", "--step-time", "0.1", "--model-params", "100000000", "--link", "eth25", "--json"]
    one = json.loads(run(capsys, "predict", config, *args).stdout)
    eight = json.loads(run(capsys, "predict", config, *args, "--nics-per-node", "8").stdout)
    assert (one["inputs"]["nics_per_node"], eight["inputs"]["nics_per_node"]) == (1, 8)
    assert eight["points"][0]["comm_total_s"] < one["points"][0]["comm_total_s"]
    assert eight["points"][0]["efficiency"] > one["points"][0]["efficiency"]


def test_only_the_runs_own_strategy_is_listed_among_the_assumptions() -> None:
    from trainforge.predict.render import assumptions_for

    ddp, fsdp, sync = assumptions_for("ddp", None), assumptions_for("fsdp", None), assumptions_for("ddp", 8)
    assert any(line.startswith("DDP:") for line in ddp)
    assert not any(line.startswith(("FSDP:", "parallel.sync")) for line in ddp)
    assert any(line.startswith("FSDP:") for line in fsdp) and not any(line.startswith("DDP:") for line in fsdp)
    assert any(line.startswith("parallel.sync") for line in sync) and not any(line.startswith("DDP:") for line in sync)
    assert ddp[0].startswith("per-GPU batch fixed") and ddp[-1].startswith("no data loading")
    hsdp = assumptions_for("fsdp", None, 8)
    assert any(line.startswith("HSDP") and "shard groups of 8 GPUs" in line for line in hsdp)
    assert not any(line.startswith("HSDP") for line in fsdp)


def test_an_hsdp_config_predicts_with_its_shard_group(tmp_path: Path) -> None:
    from trainforge.config import load_config
    from trainforge.predict.inputs import shard_group

    parallel = {"strategy": "fsdp", "fsdp": {"replicate": 2}}
    assert shard_group(load_config(tiny_run(tmp_path, scaling={"num_workers": 16}, parallel=parallel))) == 8
    assert shard_group(load_config(tiny_run(tmp_path, scaling={"num_workers": 16}, parallel={"strategy": "fsdp"}))) == 0


def test_the_training_set_is_built_once_and_a_missing_one_says_what_works_without_it(tmp_path: Path) -> None:
    from trainforge.config import load_config
    from trainforge.predict.inputs import TrainingSet, train_samples

    data = TrainingSet(load_config(tiny_run(tmp_path)))
    first = data.get("unused")
    assert data.get("unused") is first  # the same objects: built once for bytes, compute and cost
    assert train_samples(data.config, data) == len(first[0])

    missing = TrainingSet(load_config(tiny_run(tmp_path, data={"name": "cifar10", "path": str(tmp_path / "none")})))
    for otherwise in ("give --step-time", "use --model-params"):
        with pytest.raises(TrainforgeError, match=re.escape(f"({otherwise})")):
            missing.get(otherwise)
    assert train_samples(missing.config, missing) is None


# ---------------------------------------------------------------------------------------------
# Pipelines: the bubble and the point-to-point sends


def test_a_pipeline_idles_in_the_bubble_and_waits_for_each_send() -> None:
    from dataclasses import replace

    from trainforge.predict.model import pipeline_step

    # 2 stages over 2 pipeline micro-batches: 3 slots of 0.8 / 2 / 2 = 0.2 s of compute, each with two
    # sends of 1 MB at 1e7 B/s (one GPU per node: every send crosses nodes) = 0.2 s
    work = Workload("ddp", compute_s=0.8, samples_per_gpu=4, grad_bytes=1_000_000, stages=2, pipeline_microbatches=2)
    sending = replace(work, p2p_bytes=1_000_000)
    assert work.bubble == pytest.approx(1 / 3)
    assert pipeline_step(sending, 2, flat(SLOW)) == pytest.approx((1.2, 0.6, 0.2))
    # 4 GPUs: two replicas, whose stages all-reduce their 0.5 MB of gradients after the last backward
    assert pipeline_step(sending, 4, flat(SLOW))[0] == pytest.approx(1.2 + 2 * 0.25e6 / 1e7)
    two, four = predict_points(sending, [2, 3, 4], flat(SLOW))  # 3 GPUs: no whole pipeline, left out
    assert (two.gpus, four.gpus) == (2, 4)
    assert two.efficiency == pytest.approx(0.4 / 1.2) and two.samples_per_s == pytest.approx(4 / 1.2)
    assert (two.bubble_s, two.comm_exposed_s) == pytest.approx((0.2, 0.6))
    # without sends, on one replica, the efficiency is what the bubble leaves: M / (M + P - 1)
    longer = replace(work, stages=3, pipeline_microbatches=6)
    (point,) = predict_points(longer, [3], flat(SLOW))
    assert point.efficiency == pytest.approx(6 / 8) and point.comm_total_s == 0
    # interleaved, 2 stages per GPU: slots of half the compute, 2 x 2 + 2 - 1 = 5 of them; a bubble of one
    interleaved = replace(work, virtual_stages=2)
    assert interleaved.bubble == pytest.approx(1 / 5)
    assert pipeline_step(interleaved, 2, flat(SLOW)) == pytest.approx((0.5, 0.0, 0.1))
    assert pipeline_step(replace(interleaved, p2p_bytes=1_000_000), 2, flat(SLOW))[1] == pytest.approx(5 * 2 * 0.1)
    # fsdp stages on 4 GPUs: each stage's 0.5 MB sharded over its 2 replicas, gathered (0.025 s each) for
    # both pipeline micro-batches' forward and backward, its gradients reduce-scattered (0.025 s) once
    sharded = replace(sending, strategy="fsdp", param_bytes=1_000_000)
    assert pipeline_step(sharded, 4, flat(SLOW)) == pytest.approx((1.2 + 4 * 0.025 + 0.025, 0.6 + 0.125, 0.2))
    kept = replace(sharded, reshard_after_forward=False)  # gathered once, kept until the last backward
    assert pipeline_step(kept, 4, flat(SLOW))[0] == pytest.approx(1.2 + 0.025 + 0.025)
    assert pipeline_step(sharded, 2, flat(SLOW)) == pipeline_step(sending, 2, flat(SLOW))  # one replica: no shards
    # HSDP stages in shard groups of 1: nothing gathered, the stage's gradients all-reduced across the 2 groups
    hybrid = replace(sharded, shard_group=1)
    assert pipeline_step(hybrid, 4, flat(SLOW))[0] == pytest.approx(1.2 + 2 * 0.25e6 / 1e7)


def test_a_pipeline_sends_over_nvlink_inside_a_node_and_over_the_link_across_nodes() -> None:
    from trainforge.predict.model import point_to_point_time

    intra, inter = Link("in", 1e-6, 100e9, "test"), Link("out", 1e-5, 10e9, "test")
    topology = Topology(gpus_per_node=8, intra=intra, inter=inter, nics_per_node=2)
    assert point_to_point_time(1e6, 4, 8, topology) == pytest.approx(1e-6 + 1e6 / 100e9)  # 4 stages in a node
    # 4 stages of 4 replicas on 16 GPUs: stages 4 ranks apart cross nodes; 4 GPUs of a node send at once on 2 NICs
    assert point_to_point_time(1e6, 4, 16, topology) == pytest.approx(1e-5 + 1e6 / (10e9 * 2 / 4))


def test_a_pipelined_config_predicts_with_its_stages_and_what_they_send(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pipelined = {
        "model": {"name": "llama_tiny"},
        "data": {"name": "synthetic", "kind": "tokens", "seq_len": 32, "vocab_size": 1000},
        "train": {"max_steps": 2, "batch_size": 4},
        "scaling": {"num_workers": 2},
        "parallel": {"pipeline": {"stages": 2, "microbatches": 4, "schedule": "gpipe"}},
    }
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(pipelined))
    done = run(capsys, "predict", str(path), "--gpus", "1,2,16", "--step-time", "0.2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    given = report["inputs"]["pipeline"]
    # one sample per pipeline micro-batch: 32 tokens x llama_tiny's 128 wide hidden states in float32
    sent = 32 * 128 * 4
    assert given == {
        "stages": 2,
        "microbatches": 4,
        "bubble": 0.2,
        "p2p_bytes": sent,
        "schedule": "gpipe",
        "virtual_stages": 1,
    }
    assert [p["gpus"] for p in report["points"]] == [2, 16] and report["left_out_gpus"] == [1]
    assert report["points"][0]["bubble_s"] == pytest.approx(0.2 / 2 / 4)  # one of 5 slots of 0.025 s idle
    assert any(line.startswith("pipeline (parallel.pipeline): 2 stages") for line in report["assumptions"])
    assert not any(line.startswith("DDP:") for line in report["assumptions"])
    table = run(capsys, "predict", str(path), "--gpus", "1,2", "--step-time", "0.2")
    assert "bubble (ms)" in table.stdout and "left out: 1 GPUs" in table.stdout, table.stdout
    refused = run(capsys, "predict", str(path), "--gpus", "2", "--step-time", "0.2", "--model-params", "1000000")
    assert refused.returncode == 2 and "drop --model-params" in refused.stderr, refused.stderr
    odd = run(capsys, "predict", str(path), "--gpus", "3", "--step-time", "0.2")
    assert odd.returncode == 2 and "multiples of 2 GPUs" in odd.stderr, odd.stderr
