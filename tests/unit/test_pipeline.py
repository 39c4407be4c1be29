"""parallel.pipeline without processes: the config's checks, the split rule, the ranks' places in
the (pipeline x data) grid, and stages whose forwards, one after another, are the whole model's.
Training in gloo ranks: tests/integration/test_pipeline.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.helpers.runs import tiny_run
from trainforge.config import Config, load_config
from trainforge.data import build_datasets
from trainforge.errors import ConfigError
from trainforge.models import build_model
from trainforge.worker.build import check_block_names
from trainforge.worker.pipeline import Stage, block_count, check_pipeline, held_by, split_blocks
from trainforge.worker.tp import Layout

TOKENS = {"name": "synthetic", "kind": "tokens", "seq_len": 16, "vocab_size": 64, "num_samples": 64}
LLAMA = {"name": "llama_tiny", "kwargs": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4}}
GPT2 = {"name": "gpt2_small", "kwargs": {"n_layer": 4, "n_embd": 32, "n_head": 4, "tie_word_embeddings": False}}


def config(tmp: Path, pipeline: dict[str, Any] | None, workers: int = 4, **sections: Any) -> dict[str, Any]:
    parallel = {"pipeline": pipeline, **sections.pop("parallel", {})}
    base = tiny_run(tmp, model=LLAMA, data=TOKENS, train={"batch_size": 8}, scaling={"num_workers": workers})
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
    return {**base, "parallel": parallel}


def error(cfg: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        Config.model_validate(cfg)
    return str(caught.value)


def test_pipeline_section_reads_with_its_defaults(tmp_path: Path) -> None:
    cut = Config.model_validate(config(tmp_path, {"stages": 2})).parallel.pipeline
    assert cut is not None and (cut.stages, cut.schedule, cut.microbatches, cut.split) == (2, "1f1b", 1, None)
    assert (cut.per_worker, cut.parts) == (1, 2)
    interleaved = Config.model_validate(config(tmp_path, {"stages": 2, "schedule": "interleaved_1f1b"}))
    assert interleaved.parallel.pipeline is not None and interleaved.parallel.pipeline.parts == 4
    three = {"stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": 3, "microbatches": 4}
    assert Config.model_validate(config(tmp_path, three)).parallel.pipeline.parts == 6  # type: ignore[union-attr]
    assert Config.model_validate(config(tmp_path, {"stages": 2}, precision="bf16")).precision == "bf16"
    assert Config.model_validate(config(tmp_path, None)).parallel.stages == 1


@pytest.mark.parametrize(
    ("pipeline", "extra", "says"),
    [
        ({"stages": 3}, {}, "parallel.pipeline.stages 3 must divide a fixed scaling.num_workers"),
        ({"stages": 2, "microbatches": 3}, {}, "parallel.pipeline.microbatches 3 must divide train.batch_size"),
        ({"stages": 2, "virtual_stages": 2}, {}, "virtual_stages 2 needs schedule interleaved_1f1b"),
        (
            {"stages": 2, "schedule": "interleaved_1f1b", "split": [2, 2]},
            {},
            "must give 4 block counts, one per stage (2 x virtual_stages 2)",
        ),
        (
            {"stages": 2, "schedule": "interleaved_1f1b", "microbatches": 5},
            {"train": {"batch_size": 10}},
            "microbatches 5 under interleaved_1f1b over 2 stages must be a multiple of 2",
        ),
        ({"stages": 2, "schedule": "zero_bubble"}, {}, "parallel.pipeline.schedule"),
        ({"stages": 2, "split": [1, 2, 1]}, {}, "must give 2 block counts"),
        ({"stages": 1}, {}, "parallel.pipeline.stages"),
        (
            {"stages": 2},
            {"parallel": {"tensor_parallel": 2}, "scaling": {"num_workers": 6}},
            "parallel.pipeline.stages 2 x parallel.tensor_parallel 2 must divide scaling.num_workers 6",
        ),
        (
            {"stages": 2},
            {"parallel": {"strategy": "fsdp", "fsdp": {"replicate": 3}}, "scaling": {"num_workers": 8}},
            "parallel.fsdp.replicate 3 must divide the data-parallel workers (scaling.num_workers 8 / pipeline.stages",
        ),
        (
            {"stages": 2},
            {
                "parallel": {"strategy": "fsdp", "fsdp": {"cpu_offload": True}},
                "scaling": {"num_workers": 4, "use_gpu": True},
            },
            "parallel.pipeline does not run with parallel.fsdp.cpu_offload",
        ),
        ({"stages": 2}, {"parallel": {"grad_compression": "bf16"}}, "does not run with parallel.grad_compression"),
        (
            {"stages": 2},
            {"model": {"name": "bert_small"}},
            "built-in decoders (llama_*, gpt2_*) only; model is bert_small",
        ),
        ({"stages": 2}, {"train": {"anomaly": {}}}, "parallel.pipeline does not run with train.anomaly"),
        (
            {"stages": 2},
            {"precision": "fp16", "scaling": {"num_workers": 4, "use_gpu": True}},
            "parallel.pipeline does not run with precision fp16",
        ),
        ({"stages": 2}, {"scaling": {"num_workers": [2, 4]}}, "must divide a fixed scaling.num_workers"),
    ],
)
def test_what_the_pipeline_does_not_run_with_is_refused_naming_the_key(
    tmp_path: Path, pipeline: dict[str, Any], extra: dict[str, Any], says: str
) -> None:
    assert says in error(config(tmp_path, pipeline, **extra))


def test_global_batch_counts_a_pipeline_as_one_replica(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"stages": 2, "microbatches": 4}, workers=4, train={"global_batch_size": 32})
    assert Config.model_validate(cfg).train.split(2, "") == (8, 2)  # 2 replicas x 8 x 2 accumulation steps
    cfg["train"]["global_batch_size"] = 24  # not a multiple of 2 replicas x 8
    assert "train.global_batch_size 24" in error(cfg)


def test_blocks_split_equally_or_as_given() -> None:
    assert split_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert split_blocks(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert split_blocks(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    with pytest.raises(ConfigError, match=r"parallel.pipeline.stages 3 must divide the model's 4 blocks"):
        split_blocks(4, 3)
    with pytest.raises(ConfigError, match=r"parallel.pipeline.split \[2, 3\] must give 2 stages"):
        split_blocks(4, 2, [2, 3])


def test_interleaved_stages_go_round_the_workers() -> None:
    parts = split_blocks(8, 4)
    assert held_by(0, 2, parts) == {0: range(0, 2), 2: range(4, 6)}
    assert held_by(1, 2, parts) == {1: range(2, 4), 3: range(6, 8)}
    assert held_by(1, 2, split_blocks(4, 2)) == {1: range(2, 4)}  # one stage each without interleaving
    with pytest.raises(
        ConfigError, match=r"the pipeline's 4 stages \(2 x virtual_stages 2\) must divide the model's 6"
    ):
        split_blocks(6, 4, per_worker=2)


def test_ranks_of_a_pipeline_are_a_data_parallel_width_apart() -> None:
    places = [(Layout(rank, 4, pp=2).pp_rank, Layout(rank, 4, pp=2).dp_rank) for rank in range(4)]
    assert places == [(0, 0), (0, 1), (1, 0), (1, 1)]  # a replica's stages: ranks 0 and 2, 1 and 3
    assert Layout(3, 4, pp=2).dp == 2 and Layout(5, 6, tp=2).dp_rank == 2  # without pp, as before


def built(tmp: Path, model: dict[str, Any]) -> torch.nn.Module:
    cfg = load_config(config(tmp, None, workers=1, model=model))
    _, _, spec = build_datasets(cfg.data, cfg.seed)
    torch.manual_seed(0)
    return build_model(cfg.model, spec).eval()


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("split", [None, [1, 3]], ids=["equal", "split"])
def test_stages_one_after_another_are_the_whole_model(
    tmp_path: Path, model: dict[str, Any], split: list[int] | None
) -> None:
    whole = built(tmp_path, model)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = whole(tokens)
        hidden = tokens
        names: list[str] = []
        for index, blocks in enumerate(split_blocks(block_count(whole), 2, split)):
            stage = Stage(copy.deepcopy(whole), {index: blocks}, 2).eval()
            names += list(stage.state_dict())
            hidden = stage(hidden)
    assert torch.equal(hidden, expected)
    # Each stage holds its part under the whole model's names; together, all of them once.
    assert sorted(names) == sorted(whole.state_dict())


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_interleaved_workers_stages_in_turn_are_the_whole_model(tmp_path: Path, model: dict[str, Any]) -> None:
    """Two workers, two stages each (of a 4-block model, a block per stage): stage 0 on worker 0,
    1 on worker 1, 2 on worker 0, 3 on worker 1. Each worker's Stage keeps only its blocks, and the
    Chunk of each stage has that stage's parameters and no other."""
    whole = built(tmp_path, model)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    parts = split_blocks(block_count(whole), 4)
    workers = [Stage(copy.deepcopy(whole), held_by(w, 2, parts), 4).eval() for w in range(2)]
    chunks = {chunk.index: chunk for worker in workers for chunk in worker.chunks()}
    with torch.no_grad():
        expected, hidden = whole(tokens), tokens
        for index in range(4):
            hidden = chunks[index](hidden)
    assert torch.equal(hidden, expected)
    names = [name for worker in workers for name in worker.state_dict()]
    assert sorted(names) == sorted(whole.state_dict())
    assert workers[0].first and not workers[0].last and workers[1].last and not workers[1].first
    owned = [{id(p) for p in chunks[index].parameters()} for index in range(4)]
    assert all(not (owned[a] & owned[b]) for a in range(4) for b in range(a + 1, 4))
    assert {id(p) for p in workers[0].parameters()} == owned[0] | owned[2]


def test_only_built_in_decoders_with_untied_heads_are_split(tmp_path: Path) -> None:
    check_pipeline(built(tmp_path, LLAMA), 2, None)
    with pytest.raises(ConfigError, match="tie_word_embeddings: false"):
        check_pipeline(built(tmp_path, {**GPT2, "kwargs": {"n_layer": 4, "n_embd": 32, "n_head": 4}}), 2, None)
    with pytest.raises(ConfigError, match="built-in decoders"):
        check_pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2, None)


def test_blocks_the_stages_do_not_divide_fail_before_ray_starts(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"stages": 2}, model={**LLAMA, "kwargs": {**LLAMA["kwargs"], "num_hidden_layers": 3}})
    with pytest.raises(ConfigError, match=r"parallel.pipeline.stages 2 must divide the model's 3 blocks"):
        check_block_names(load_config(cfg))
