"""Pipeline parallelism in the worker's Session, in gloo ranks without Ray (CPU): a llama_tiny cut
into 2 stages x 2 data-parallel replicas on 4 workers has the losses of DDP on 2 workers (the same
global batch), with each stage replicated (ddp) or sharded over its replicas (fsdp), split over
tensor-parallel ranks, or all three on 8 workers; a run crashed
and restarted ends bit-identical to the uninterrupted one, and its checkpoints resume under FSDP
and DDP, and theirs under the pipeline.

The runs of one world size share one start-up of their processes (tests/helpers/sessions.py):
the uninterrupted (1f1b, gpipe, 1f1b over accumulated micro-batches, GPT-2), the crashed and
the restarted pipelines, the same three interleaved (2 workers x 2 stages each of a 4-block
model), bf16, EMA, sharded (fsdp) and tensor-parallel pipelines, in 4 ranks; the (pipeline x
data x tensor) mesh and HSDP stages in 8; DDP (llama and GPT-2), FSDP, and both from the pipelines' checkpoints in
2; then the pipelines from FSDP's and DDP's checkpoints in 4.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Outcome, sessions
from tests.unit.test_session import final_state

pytestmark = pytest.mark.slow  # 140-280 s: four start-ups of 2-8 gloo ranks, forty short runs

STEPS, CRASH, SAVED = 16, 12, 8


def lm_config(
    tmp: Path,
    workers: int,
    parallel: dict[str, Any],
    batch: int = 8,
    accum: int = 1,
    layers: int = 2,
    **checkpoint: Any,
) -> dict[str, Any]:
    return tiny_run(
        tmp,
        model={
            "name": "llama_tiny",
            "kwargs": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers},
        },
        data={"name": "synthetic", "kind": "tokens", "seq_len": 16, "vocab_size": 64, "num_samples": 1024},
        train={
            "max_steps": STEPS,
            "batch_size": batch,
            "grad_accum_steps": accum,
            "log_every_n_steps": 1,
            "eval_every_n_steps": 8,
            "grad_clip_norm": 0.5,  # below the gradients' norm: the clipping by the global norm is exercised
        },
        optim={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        scaling={"num_workers": workers},
        parallel=parallel,
        checkpoint={"every_n_steps": SAVED, "keep_last": 5, **checkpoint},
        seed=3,
    )


PIPELINE = {"pipeline": {"stages": 2, "schedule": "1f1b", "microbatches": 4}}
# The same pipeline with each stage sharded over its 2 replicas (pipeline x FSDP).
SHARDED = {**PIPELINE, "strategy": "fsdp"}
BF16_PARAMETERS = {"mixed_precision": "bf16"}  # FSDP's: bf16 compute, fp32 reductions
# Each stage split over a tensor-parallel group of 2: on 4 workers one pipeline (its micro-batch of
# 16 is DDP's global batch on 2), on 8 the (pipeline x data x tensor) mesh with FSDP over 2 replicas.
SPLIT = {**PIPELINE, "tensor_parallel": 2}
THREE_D = {**SHARDED, "tensor_parallel": 2}
# HSDP inside each stage on 8: 2 stages x (2 replica groups x 2 shards), a global batch of 32.
HYBRID = {**SHARDED, "fsdp": {"replicate": 2}}
# Two workers holding two stages each of a 4-block model: stages 0 and 2 on one, 1 and 3 on the other.
INTERLEAVED = {"pipeline": {"stages": 2, "schedule": "interleaved_1f1b", "microbatches": 4}}
# GPT-2 with its head untied (a pipeline's first and last stages are different ranks) and without
# dropout, whose draws a pipeline makes in another order than one process does.
GPT2 = {
    "name": "gpt2_small",
    "kwargs": {"n_layer": 2, "n_embd": 32, "n_head": 4, "tie_word_embeddings": False}
    | {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}


def gpt2_config(tmp: Path, workers: int, parallel: dict[str, Any]) -> dict[str, Any]:
    return {**lm_config(tmp, workers, parallel), "model": GPT2}


def crashed_and_restarted(straight: str, crashed: str, restarted: str) -> list[tuple[str, str, int | None]]:
    """The uninterrupted run, then its copy crashing after step ``CRASH`` and that copy run again."""
    return [(straight, straight, None), (crashed, crashed, CRASH), (restarted, crashed, None)]


def with_ema(config: dict[str, Any]) -> dict[str, Any]:
    """``train.ema`` every step, validated with the averaged weights too (val_ema/...)."""
    return {**config, "train": {**config["train"], "ema": {"decay": 0.9}}}


def run_all(world: int, runs: list[tuple[dict[str, Any], int | None]]) -> list[Outcome]:
    """The runs one after another in the same ``world`` ranks; rank 0's outcome of each."""
    return spawn_ranks(sessions, world, runs)[0]


def saved_at(config: dict[str, Any], step: int) -> str:
    return str(Path(config["run"]["output_dir"]) / "t" / f"checkpoint_{step:09d}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pipeline")
    configs = {
        "pipeline": lm_config(tmp / "pipeline", 4, PIPELINE),
        "crashed": lm_config(tmp / "crashed", 4, PIPELINE),
        "gpipe": lm_config(tmp / "gpipe", 4, {"pipeline": {**PIPELINE["pipeline"], "schedule": "gpipe"}}),
        "gpt2-pipeline": gpt2_config(
            tmp / "gpt2-pipeline", 4, {"pipeline": {**PIPELINE["pipeline"], "schedule": "gpipe"}}
        ),
        "gpt2-ddp": gpt2_config(tmp / "gpt2-ddp", 2, {"strategy": "ddp"}),
        # The same global batch of 16 as two accumulated micro-batches of 4 per replica.
        "accumulated": lm_config(tmp / "accumulated", 4, PIPELINE, batch=4, accum=2),
        "ddp": lm_config(tmp / "ddp", 2, {"strategy": "ddp"}),
        "fsdp": lm_config(tmp / "fsdp", 2, {"strategy": "fsdp"}),
        "interleaved": lm_config(tmp / "interleaved", 4, INTERLEAVED, layers=4),
        "interleaved-crashed": lm_config(tmp / "interleaved-crashed", 4, INTERLEAVED, layers=4),
        "ddp4": lm_config(tmp / "ddp4", 2, {"strategy": "ddp"}, layers=4),
        "pipeline-bf16": {**lm_config(tmp / "pipeline-bf16", 4, PIPELINE), "precision": "bf16"},
        "pipeline-ema": with_ema(lm_config(tmp / "pipeline-ema", 4, PIPELINE)),
        "pipeline-ema-crashed": with_ema(lm_config(tmp / "pipeline-ema-crashed", 4, PIPELINE)),
        "ddp-ema": with_ema(lm_config(tmp / "ddp-ema", 2, {"strategy": "ddp"})),
        "ddp-bf16": {**lm_config(tmp / "ddp-bf16", 2, {"strategy": "ddp"}), "precision": "bf16"},
        "pipeline-fsdp": lm_config(tmp / "pipeline-fsdp", 4, SHARDED),
        "pipeline-fsdp-crashed": lm_config(tmp / "pipeline-fsdp-crashed", 4, SHARDED),
        "interleaved-fsdp": lm_config(tmp / "interleaved-fsdp", 4, {**INTERLEAVED, "strategy": "fsdp"}, layers=4),
        "pipeline-fsdp-bf16": lm_config(tmp / "pipeline-fsdp-bf16", 4, {**SHARDED, "fsdp": BF16_PARAMETERS}),
        "fsdp-bf16": lm_config(tmp / "fsdp-bf16", 2, {"strategy": "fsdp", "fsdp": BF16_PARAMETERS}),
        "pipeline-tp": lm_config(tmp / "pipeline-tp", 4, SPLIT, batch=16),
        "pipeline-tp-crashed": lm_config(tmp / "pipeline-tp-crashed", 4, SPLIT, batch=16),
        "three-d": lm_config(tmp / "three-d", 8, THREE_D),
        "pipeline-hsdp": lm_config(tmp / "pipeline-hsdp", 8, HYBRID),
        "ddp-32": lm_config(tmp / "ddp-32", 2, {"strategy": "ddp"}, batch=16),
    }
    configs["ddp4-from-interleaved"] = lm_config(
        tmp / "ddp4-from-interleaved", 2, {"strategy": "ddp"}, layers=4, resume=saved_at(configs["interleaved"], SAVED)
    )
    configs["fsdp-from-pipeline"] = lm_config(
        tmp / "fsdp-from-pipeline", 2, {"strategy": "fsdp"}, resume=saved_at(configs["pipeline"], SAVED)
    )
    configs["pipeline-from-fsdp"] = lm_config(
        tmp / "pipeline-from-fsdp", 4, PIPELINE, resume=saved_at(configs["fsdp"], SAVED)
    )
    # DDP writes whole tensors (model.safetensors, optimizer.pt keyed by position), not shards.
    configs["ddp-from-pipeline"] = lm_config(
        tmp / "ddp-from-pipeline", 2, {"strategy": "ddp"}, resume=saved_at(configs["pipeline"], SAVED)
    )
    configs["pipeline-from-ddp"] = lm_config(
        tmp / "pipeline-from-ddp", 4, PIPELINE, resume=saved_at(configs["ddp"], SAVED)
    )
    configs["fsdp-from-pipeline-fsdp"] = lm_config(
        tmp / "fsdp-from-pipeline-fsdp", 2, {"strategy": "fsdp"}, resume=saved_at(configs["pipeline-fsdp"], SAVED)
    )
    configs["fsdp-from-three-d"] = lm_config(
        tmp / "fsdp-from-three-d", 2, {"strategy": "fsdp"}, resume=saved_at(configs["three-d"], SAVED)
    )
    configs["fsdp-from-pipeline-hsdp"] = lm_config(
        tmp / "fsdp-from-pipeline-hsdp",
        2,
        {"strategy": "fsdp"},
        batch=16,
        resume=saved_at(configs["pipeline-hsdp"], SAVED),
    )
    # DDP's whole tensors into shards of stages: the full-state load of both the weights and the moments.
    configs["pipeline-fsdp-from-ddp"] = lm_config(
        tmp / "pipeline-fsdp-from-ddp", 4, SHARDED, resume=saved_at(configs["ddp"], SAVED)
    )
    # (outcome's name, config's name, the step it crashes at): in 4 ranks, then 2, then 4 again
    in_four = [
        *crashed_and_restarted("pipeline", "crashed", "restarted"),
        *((name, name, None) for name in ("gpipe", "accumulated", "gpt2-pipeline")),
        *crashed_and_restarted("interleaved", "interleaved-crashed", "interleaved-restarted"),
        ("pipeline-bf16", "pipeline-bf16", None),
        *crashed_and_restarted("pipeline-ema", "pipeline-ema-crashed", "pipeline-ema-restarted"),
        *crashed_and_restarted("pipeline-fsdp", "pipeline-fsdp-crashed", "pipeline-fsdp-restarted"),
        ("interleaved-fsdp", "interleaved-fsdp", None),
        ("pipeline-fsdp-bf16", "pipeline-fsdp-bf16", None),
        *crashed_and_restarted("pipeline-tp", "pipeline-tp-crashed", "pipeline-tp-restarted"),
    ]
    in_eight = [(name, name, None) for name in ("three-d", "pipeline-hsdp")]
    in_two = [
        (name, name, None)
        for name in (
            "ddp",
            "fsdp",
            "fsdp-from-pipeline",
            "ddp-from-pipeline",
            "gpt2-ddp",
            "ddp4",
            "ddp4-from-interleaved",
            "ddp-bf16",
            "ddp-ema",
            "fsdp-from-pipeline-fsdp",
            "fsdp-bf16",
            "fsdp-from-three-d",
            "ddp-32",
            "fsdp-from-pipeline-hsdp",
        )
    ]
    in_four_again = [
        (name, name, None) for name in ("pipeline-from-fsdp", "pipeline-from-ddp", "pipeline-fsdp-from-ddp")
    ]
    outcomes = {}
    for world, runs in ((4, in_four), (8, in_eight), (2, in_two), (4, in_four_again)):
        found = run_all(world, [(configs[config], crash) for _, config, crash in runs])
        outcomes.update(zip((name for name, _, _ in runs), found, strict=True))
    return {"configs": configs, "outcomes": outcomes, "tmp": tmp}


def largest_gap(a: dict[int, float], b: dict[int, float], steps: range) -> float:
    return max(abs(a[step] - b[step]) / abs(a[step]) for step in steps)


@pytest.mark.parametrize(
    "schedule",
    [
        "1f1b",
        "gpipe",
        "accumulated",
        "gpt2",
        "interleaved",
        "1f1b-fsdp",
        "interleaved-fsdp",
        "1f1b-tp",
        "3-d",
        "1f1b-hsdp",
    ],
)
def test_pipelined_losses_equal_ddp_for_the_same_global_batch(trained: dict[str, Any], schedule: str) -> None:
    named = {
        "1f1b": ("pipeline", "ddp"),
        "gpt2": ("gpt2-pipeline", "gpt2-ddp"),
        "interleaved": ("interleaved", "ddp4"),
        "1f1b-fsdp": ("pipeline-fsdp", "ddp"),  # each stage sharded over its 2 replicas
        "interleaved-fsdp": ("interleaved-fsdp", "ddp4"),
        "1f1b-tp": ("pipeline-tp", "ddp"),  # each stage split over 2 tensor-parallel ranks, one replica
        "3-d": ("three-d", "ddp"),  # 2 stages x FSDP over 2 replicas x 2 tensor-parallel ranks on 8
        "1f1b-hsdp": ("pipeline-hsdp", "ddp-32"),  # 2 stages x HSDP (2 groups x 2 shards) on 8
    }
    names = named.get(schedule, (schedule, "ddp"))
    pipeline, ddp = (trained["outcomes"][name] for name in names)
    assert pipeline.final["status"] == "finished"
    assert sorted(pipeline.losses) == sorted(ddp.losses) == list(range(1, STEPS + 1))
    gap = largest_gap(ddp.losses, pipeline.losses, range(1, STEPS + 1))
    print(f"\n{names[0]} ({schedule}) vs {names[1]}, the same global batch: largest relative gap {gap:.2e}")
    assert gap <= 1e-5
    # Validation runs through the stages too: the same figures.
    assert sorted(pipeline.val_losses) == sorted(ddp.val_losses) == [8, 16]
    assert largest_gap(ddp.val_losses, pipeline.val_losses, range(8, 17, 8)) <= 1e-5


@pytest.mark.parametrize(
    "names",
    [("pipeline-bf16", "ddp-bf16", "ddp"), ("pipeline-fsdp-bf16", "fsdp-bf16", "fsdp")],
    ids=["precision-bf16", "fsdp-mixed-precision-bf16"],
)
def test_a_bf16_pipeline_has_the_losses_of_its_bf16_peer(trained: dict[str, Any], names: tuple[str, str, str]) -> None:
    """precision: bf16 (autocast over the schedule's forwards and the loss) against DDP on 2
    workers, and FSDP's bf16 parameters (parallel.fsdp.mixed_precision) in stages against FSDP on
    2: the same global batch. Not to 1e-5: a pipeline micro-batch of 2 rounds its bf16 products
    apart from the peer's batch of 8: the gap is held to twice what bf16 itself moves the peer's
    losses from fp32."""
    pipeline, peer, fp32 = (trained["outcomes"][name] for name in names)
    assert pipeline.final["status"] == "finished"
    assert sorted(pipeline.losses) == sorted(peer.losses) == list(range(1, STEPS + 1))
    gap = largest_gap(peer.losses, pipeline.losses, range(1, STEPS + 1))
    bf16_itself = largest_gap(fp32.losses, peer.losses, range(1, STEPS + 1))
    print(f"\n{names[0]} vs {names[1]}: largest relative gap {gap:.2e} ({names[1]} vs {names[2]}: {bf16_itself:.2e})")
    assert bf16_itself > 0 and gap <= 2 * bf16_itself  # a wrong scale or order would be 1e-2 or more
    assert pipeline.losses[STEPS] < pipeline.losses[1]


def test_a_pipelines_ema_is_ddps_and_resumes_bit_identical(trained: dict[str, Any]) -> None:
    """train.ema under the pipeline: each stage averages its own weights; the final checkpoint's
    whole average (the run's model_ema.safetensors) gathers every stage's and is DDP's; a crashed
    run restarted from step 8 ends with the same average, bit for bit."""
    from safetensors.torch import load_file

    outcomes, configs = trained["outcomes"], trained["configs"]

    def averaged(name: str) -> dict[str, torch.Tensor]:
        final = Path(configs[name]["run"]["output_dir"]) / "t" / f"checkpoint_{STEPS:09d}"
        return load_file(str(final / "ema.safetensors"))  # what the driver exports as model_ema.safetensors

    pipeline, ddp = averaged("pipeline-ema"), averaged("ddp-ema")
    assert pipeline.keys() == ddp.keys() and "model.lm_head.weight" in pipeline
    gap = max(float((pipeline[k] - ddp[k]).norm() / ddp[k].norm()) for k in ddp)  # per tensor, relative
    val = largest_gap(*({0: outcomes[name].final["val_ema/loss"]} for name in ("ddp-ema", "pipeline-ema")), range(1))
    print(f"\nema: pipeline vs ddp, largest relative weight gap {gap:.2e}, val_ema/loss gap {val:.2e}")
    assert gap <= 1e-5 and val <= 1e-5
    assert outcomes["pipeline-ema-crashed"].crashed and outcomes["pipeline-ema-restarted"].final["status"] == "finished"
    restarted = averaged("pipeline-ema-crashed")
    assert all(torch.equal(restarted[k], pipeline[k]) for k in pipeline)


@pytest.mark.parametrize(
    ("straight", "crashed", "restarted"),
    [
        ("pipeline", "crashed", "restarted"),
        ("interleaved", "interleaved-crashed", "interleaved-restarted"),
        ("pipeline-fsdp", "pipeline-fsdp-crashed", "pipeline-fsdp-restarted"),
        ("pipeline-tp", "pipeline-tp-crashed", "pipeline-tp-restarted"),
    ],
    ids=["1f1b", "interleaved", "1f1b-fsdp", "1f1b-tp"],
)
def test_pipelined_run_crashed_and_restarted_is_bit_identical(
    trained: dict[str, Any], straight: str, crashed: str, restarted: str
) -> None:
    outcomes, configs, tmp = trained["outcomes"], trained["configs"], trained["tmp"]
    assert outcomes[crashed].crashed
    assert outcomes[restarted].final["status"] == "finished"
    events = outcomes[restarted].events
    assert any(e.startswith("resumed from") and f"checkpoint_{SAVED:09d}" in e for e in events), events
    saved = Path(saved_at(configs[crashed], SAVED))
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 4
    # Every rank wrote its stage's state; the whole model's names are all there, once.
    a = final_state(Path(configs[straight]["run"]["output_dir"]) / "t", tmp / straight / "a")
    b = final_state(Path(configs[crashed]["run"]["output_dir"]) / "t", tmp / straight / "b")
    assert a.keys() == b.keys()
    differ = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    assert not differ, differ[:5]
    full = {k[len("full/") :] for k in a if k.startswith("full/")}
    sharded = {k[len("sharded/model/") :] for k in a if k.startswith("sharded/model/")}
    assert full == sharded and "model.model.embed_tokens.weight" in full and "model.lm_head.weight" in full


@pytest.mark.parametrize(
    ("resumed", "reference", "written_by", "uses"),
    [
        ("fsdp-from-pipeline", "pipeline", "ddp x pp2", "fsdp"),
        ("pipeline-from-fsdp", "fsdp", "fsdp", "ddp x pp2"),
        ("ddp-from-pipeline", "pipeline", "ddp x pp2", "ddp"),
        ("pipeline-from-ddp", "ddp", "ddp", "ddp x pp2"),
        ("ddp4-from-interleaved", "interleaved", "ddp x pp2", "ddp"),
        ("fsdp-from-pipeline-fsdp", "pipeline-fsdp", "fsdp x pp2", "fsdp"),
        ("pipeline-fsdp-from-ddp", "ddp", "ddp", "fsdp x pp2"),
        ("fsdp-from-three-d", "three-d", "fsdp x pp2 x tp2", "fsdp"),
        ("fsdp-from-pipeline-hsdp", "pipeline-hsdp", "hsdp 2x2 x pp2", "fsdp"),
    ],
    ids=[
        "pipeline-to-fsdp",
        "fsdp-to-pipeline",
        "pipeline-to-ddp",
        "ddp-to-pipeline",
        "interleaved-to-ddp",
        "sharded-pipeline-to-fsdp",
        "ddp-to-sharded-pipeline",
        "3-d-to-fsdp",
        "hsdp-pipeline-to-fsdp",
    ],
)
def test_checkpoint_resumes_across_pipelined_and_unpipelined_layouts(
    trained: dict[str, Any], resumed: str, reference: str, written_by: str, uses: str
) -> None:
    outcome, straight = trained["outcomes"][resumed], trained["outcomes"][reference]
    assert outcome.final["status"] == "finished" and outcome.final["step"] == STEPS
    events = outcome.events
    assert any(e.startswith("resumed from") and f"checkpoint_{SAVED:09d}" in e for e in events), events
    assert any(f"resharded: the checkpoint was written by {written_by}, this run uses {uses}" in e for e in events), (
        events
    )
    # The same weights, optimizer state and data position: the steps after the resume continue
    # the uninterrupted run (not bit for bit: the other layout adds in another order).
    gap = largest_gap(straight.losses, outcome.losses, range(SAVED + 1, STEPS + 1))
    print(f"\n{resumed}: largest relative loss gap to {reference} after the resume {gap:.2e}")
    assert gap <= 1e-5
