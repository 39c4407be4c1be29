"""``model.pretrained``: the weights' sources (paths only), names matched across trainforge's wrapper
and transformers' own, one-line mismatches (or ``pretrained_strict: false``), tied weights, and
FSDP ranks that read only their own rows of the file. In this process and in 2 gloo ranks."""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file, save_model

from tests.helpers.ranks import spawn_ranks
from trainforge.checkpoint.state import model_snapshot
from trainforge.config import ModelConfig
from trainforge.data import DataSpec
from trainforge.errors import ModelError
from trainforge.models import build_model
from trainforge.models.pretrained import load_pretrained, materialize, parameters_on_meta, resolve

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def tokens(vocab: int = 257) -> DataSpec:
    return DataSpec(kind="tokens", input_shape=(16,), vocab_size=vocab, seq_len=16)


def llama(seed: int, vocab: int = 257) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(name="llama_tiny", kwargs={**TINY, "num_key_value_heads": 1}), tokens(vocab))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sources_are_paths_on_this_machine(tmp_path: Path) -> None:
    cases = [
        ("meta-llama/Llama-3.2-1B", "hub names are not fetched: download the model first"),
        ("s3://bucket/model", "a local path only"),
        (str(tmp_path / "absent"), "no such file or directory"),
    ]
    (tmp_path / "weights.bin").write_bytes(b"\x80\x04")
    cases.append((str(tmp_path / "weights.bin"), "trainforge loads no pickles"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    cases.append((str(tmp_path / "hf"), "pytorch_model.bin is a pickle and is not read"))
    (tmp_path / "empty").mkdir()
    cases.append((str(tmp_path / "empty"), "a directory with neither config.json"))
    os.mkfifo(tmp_path / "model.safetensors.fifo")
    cases.append((str(tmp_path / "model.safetensors.fifo"), "a FIFO, neither a .safetensors file nor a directory"))
    (tmp_path / "bad.safetensors").write_bytes(b"not a header")
    for given, expected in cases:
        with pytest.raises(ModelError, match=expected) as raised:
            resolve(given)
        assert "\n" not in str(raised.value) and str(raised.value).startswith(f"model.pretrained {given!r}")
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        load_pretrained(llama(0), str(tmp_path / "bad.safetensors"))


def test_a_hugging_face_directory_loads_into_the_built_in_and_a_built_in_into_bare_transformers(
    tmp_path: Path,
) -> None:
    source = llama(1)
    source.model.save_pretrained(tmp_path / "one")
    source.model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for folder in ("one", "sharded"):
        target = llama(2)
        assert not same_weights(source, target)
        loaded = load_pretrained(target, str(tmp_path / folder))
        assert same_weights(source, target) and loaded.left == ""
        assert loaded.tensors == len(source.state_dict()) and loaded.bytes_read == loaded.total_bytes
    # trainforge's names (model.safetensors of a run: "model." + transformers' names) into the bare model
    save_model(source, str(tmp_path / "run.safetensors"))
    bare = llama(3).model
    load_pretrained(bare, str(tmp_path / "run.safetensors"))
    assert same_weights(source.model, bare)


def test_a_mismatch_is_one_line_and_strict_false_loads_what_matches(tmp_path: Path) -> None:
    llama(1).model.save_pretrained(tmp_path / "hf")
    wider = llama(2, vocab=300)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(ModelError) as raised:
        load_pretrained(wider, str(tmp_path / "hf"))
    line = str(raised.value)
    assert "\n" not in line and "2 of another shape" in line and "pretrained_strict: false" in line
    assert "model.model.embed_tokens.weight: file (257, 32) vs model (300, 32)" in line
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())  # nothing written
    loaded = load_pretrained(wider, str(tmp_path / "hf"), strict=False)
    assert "2 of another shape" in loaded.left and loaded.tensors == len(before) - 2
    kept = llama(1).state_dict()
    for name, value in wider.state_dict().items():
        changed = name in ("model.model.embed_tokens.weight", "model.lm_head.weight")
        assert torch.equal(value, before[name] if changed else kept[name]), name
    deeper = build_model(ModelConfig(name="llama_tiny", kwargs={**TINY, "num_hidden_layers": 3}), tokens())
    with pytest.raises(ModelError, match=r"9 missing from the file \(model.model.layers.2"):
        load_pretrained(deeper, str(tmp_path / "hf"))


def test_tied_weights_load_from_a_file_that_keeps_them_once(tmp_path: Path) -> None:
    kwargs = {"n_layer": 1, "n_embd": 32, "n_head": 2}
    torch.manual_seed(0)
    source = build_model(ModelConfig(name="gpt2_small", kwargs=kwargs), tokens())
    source.model.save_pretrained(tmp_path / "gpt2")
    torch.manual_seed(1)
    target = build_model(ModelConfig(name="gpt2_small", kwargs=kwargs), tokens())
    load_pretrained(target, str(tmp_path / "gpt2"))
    assert same_weights(source, target)
    assert target.model.lm_head.weight is target.model.transformer.wte.weight  # still tied


def test_tied_weights_load_under_whichever_name_the_file_kept(tmp_path: Path) -> None:
    """A checkpoint keeps GPT-2's tied embedding as ``lm_head.weight`` (safetensors' choice), the
    model's first name for it is ``transformer.wte.weight``: both meet, strictly."""
    kwargs = {"n_layer": 1, "n_embd": 32, "n_head": 2}
    torch.manual_seed(0)
    source = build_model(ModelConfig(name="gpt2_small", kwargs=kwargs), tokens())
    kept = model_snapshot(source)
    assert "model.lm_head.weight" in kept and "model.transformer.wte.weight" not in kept
    save_file(kept, str(tmp_path / "weights.safetensors"))
    torch.manual_seed(1)
    target = build_model(ModelConfig(name="gpt2_small", kwargs=kwargs), tokens())
    load_pretrained(target, str(tmp_path / "weights.safetensors"))
    assert same_weights(source, target)
    assert target.model.lm_head.weight is target.model.transformer.wte.weight


def fsdp_rank(rank: int, world: int, folder: str, on_meta: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    with parameters_on_meta() if on_meta else contextlib.nullcontext():
        model = llama(rank + 10)
    assert all(p.is_meta for p in model.parameters()) == on_meta
    for layer in model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if on_meta:
        materialize(model, torch.device("cpu"))
    loaded = load_pretrained(model, folder)
    full = {name: param.full_tensor() for name, param in model.named_parameters()}
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    # The sharded model goes while the process group is alive, and no rank leaves before the
    # others are done with it: its teardown at interpreter exit aborted a rank now and then.
    del model
    gc.collect()
    dist.barrier()
    return {"read": loaded.bytes_read, "total": loaded.total_bytes, "full": full, "buffers": buffers}


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
@pytest.mark.parametrize("on_meta", [False, True], ids=["built-then-sharded", "built-on-meta"])
def test_fsdp_ranks_read_only_their_own_rows(tmp_path: Path, on_meta: bool) -> None:
    source = llama(1)
    source.model.save_pretrained(tmp_path / "hf")
    ranks = spawn_ranks(fsdp_rank, 2, str(tmp_path / "hf"), on_meta)
    total = ranks[0]["total"]
    assert total == sum(v.numel() * v.element_size() for v in source.state_dict().values())
    assert ranks[0]["read"] + ranks[1]["read"] == total  # every byte read once, by the rank that keeps it
    assert all(0.4 * total < r["read"] < 0.6 * total for r in ranks)
    expected = dict(source.named_parameters())
    expected_buffers = dict(source.named_buffers())  # rotary frequencies: in no file, computed at build
    for rank in ranks:
        assert rank["full"].keys() == expected.keys()
        assert all(torch.equal(value, expected[name]) for name, value in rank["full"].items())
        assert rank["buffers"].keys() == expected_buffers.keys()
        assert all(torch.equal(value, expected_buffers[name]) for name, value in rank["buffers"].items())
