"""Repeated-block detection and the per-block switches (activation checkpointing, compile,
channels-last) on real built-in models, in one process."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainforge.config import ModelConfig
from trainforge.data.spec import DataSpec
from trainforge.errors import ConfigError
from trainforge.models import build_model, build_task
from trainforge.worker.blocks import (
    apply_activation_checkpointing,
    compile_blocks,
    repeated_blocks,
    to_channels_last,
)

TOKENS = DataSpec(kind="tokens", input_shape=(32,), vocab_size=97, seq_len=32)
DIGITS = DataSpec(kind="image", input_shape=(1, 8, 8), num_classes=10)
CIFAR = DataSpec(kind="image", input_shape=(3, 32, 32), num_classes=10)

# small shapes of the built-ins: name -> (kwargs, block class, number of blocks)
TINY: dict[str, tuple[dict[str, Any], str, int]] = {
    "gpt2_small": ({"n_layer": 3, "n_embd": 64, "n_head": 4}, "GPT2Block", 3),
    "llama_tiny": ({}, "LlamaDecoderLayer", 4),
    "bert_small": (
        {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128},
        "BertLayer",
        2,
    ),
}


def build(name: str, spec: DataSpec = TOKENS, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(name=name, kwargs=kwargs), spec)


def tiny(name: str) -> nn.Module:
    return build(name, **TINY[name][0])


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class UserNet(nn.Module):
    """A user's own model: a stem, a ModuleList of blocks and a small ModuleList of heads of mixed class."""

    def __init__(self, width: int = 16, depth: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.heads = nn.ModuleList([nn.Linear(width, 2), nn.Identity()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.heads[1](self.heads[0](x))


# ---------------------------------------------------------------------------------------------
# Detection


@pytest.mark.parametrize("name", list(TINY))
def test_detects_transformer_layers(name: str) -> None:
    model = tiny(name)
    _, block_class, count = TINY[name]
    found = repeated_blocks(model)
    assert [type(b).__name__ for b in found] == [block_class] * count
    assert repeated_blocks(model, [block_class]) == found


def test_detects_a_users_module_list_and_vit_layers() -> None:
    net = UserNet()
    assert repeated_blocks(net) == list(net.blocks)
    vit = build("vit_b_16", CIFAR, num_hidden_layers=2, patch_size=8, hidden_size=32, intermediate_size=64)
    assert [type(b).__name__ for b in repeated_blocks(vit)] == ["ViTLayer", "ViTLayer"]


def test_mlp_has_no_blocks() -> None:
    assert repeated_blocks(build("mlp", DIGITS)) == []
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []


def test_names_match_outermost_modules_only() -> None:
    net = UserNet()
    # Linear is inside every Block: naming both gives the blocks, plus the Linears outside any block
    found = repeated_blocks(net, ["Block", "Linear"])
    assert found == [net.stem, *net.blocks, net.heads[0]]


def test_unknown_block_name_lists_the_candidates() -> None:
    model = tiny("llama_tiny")
    with pytest.raises(ConfigError) as info:
        repeated_blocks(model, ["LlamaDecoderLayer", "LlamaLayer"])
    message = str(info.value)
    assert "block class 'LlamaLayer' (parallel.fsdp.wrap) matches no module of HFLogits" in message
    assert "did you mean 'LlamaDecoderLayer'?" in message
    assert "LlamaDecoderLayer" in message.split("repeated classes in this model: ")[1]
    assert "\n" not in message


# ---------------------------------------------------------------------------------------------
# Activation checkpointing: same loss, same gradients, same names, and the forward really runs twice


def loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    task = build_task(ModelConfig(name="llama_tiny"), TOKENS)
    torch.manual_seed(1)  # the same dropout masks in both runs; checkpoint() replays the RNG state
    loss = task.loss(model(x), x.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def count_calls(modules: list[nn.Module]) -> list[int]:
    calls = [0] * len(modules)

    def hook(index: int) -> Any:
        def count(*_: Any) -> None:
            calls[index] += 1

        return count

    for i, module in enumerate(modules):
        module.register_forward_pre_hook(hook(i))
    return calls


@pytest.mark.parametrize("name", ["llama_tiny", "gpt2_small"])
def test_checkpointing_gives_the_same_loss_and_gradients(name: str) -> None:
    plain, checkpointed = tiny(name), tiny(name)
    keys = list(checkpointed.state_dict())
    blocks = repeated_blocks(checkpointed)
    assert apply_activation_checkpointing(blocks, "full") == len(blocks)
    assert list(checkpointed.state_dict()) == keys
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    # a module inside each block: it runs once in forward and once more when backward recomputes
    calls = count_calls([next(block.children()) for block in blocks])
    x = torch.randint(0, 97, (2, 32))
    loss, grads = loss_and_grads(plain, x)
    loss_ac, grads_ac = loss_and_grads(checkpointed, x)
    assert calls == [2] * len(blocks)
    # bit-identical on CPU: recomputation runs the same kernels on the same inputs and RNG state
    assert torch.equal(loss, loss_ac)
    assert grads.keys() == grads_ac.keys() and len(grads) == len(list(plain.parameters()))
    for key, grad in grads.items():
        assert torch.equal(grad, grads_ac[key]), key


def test_every_n_checkpoints_every_nth_block() -> None:
    net = UserNet(depth=5)
    assert apply_activation_checkpointing(list(net.blocks), "every_n", every_n=2) == 3
    calls = count_calls([block.linear for block in net.blocks])
    net(torch.randn(4, 8)).sum().backward()
    assert calls == [2, 1, 2, 1, 2]
    assert apply_activation_checkpointing(list(net.blocks), "none") == 0
    # applying again does not nest a second checkpoint
    assert apply_activation_checkpointing(list(net.blocks), "full") == 5
    calls[:] = [0] * 5
    net(torch.randn(4, 8)).sum().backward()
    assert calls == [2] * 5


def test_checkpointing_saves_fewer_activations() -> None:
    def saved_bytes(model: nn.Module) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 97, (2, 32)))
        return total

    plain, checkpointed = tiny("llama_tiny"), tiny("llama_tiny")
    apply_activation_checkpointing(repeated_blocks(checkpointed), "full")
    assert saved_bytes(checkpointed) < saved_bytes(plain) / 2


def test_checkpointed_model_deep_copies_onto_the_copy() -> None:
    net = UserNet()
    apply_activation_checkpointing(list(net.blocks), "full")
    twin = copy.deepcopy(net)
    with torch.no_grad():
        for block in twin.blocks:
            block.linear.weight.zero_()
            block.linear.bias.zero_()
    x = torch.randn(3, 8)
    torch.testing.assert_close(twin(x), twin.heads[0](twin.stem(x)))
    assert not torch.allclose(net(x), twin(x))


def test_checkpointing_then_fully_shard(tmp_path: Path) -> None:
    """The plan's order (checkpoint, then FSDP2 per block and root) in a one-rank gloo group:
    FSDP's unshard hooks wrap the recomputed forward, names stay, gradients match the plain model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    plain, sharded = tiny("llama_tiny"), tiny("llama_tiny")
    keys = list(sharded.state_dict())
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        blocks = repeated_blocks(sharded)
        apply_activation_checkpointing(blocks, "full")
        calls = count_calls([next(block.children()) for block in blocks])
        for block in blocks:
            fully_shard(block)
        fully_shard(sharded)
        assert list(sharded.state_dict()) == keys
        x = torch.randint(0, 97, (2, 32))
        loss, grads = loss_and_grads(plain, x)
        loss_s, grads_s = loss_and_grads(sharded, x)
        assert calls == [2] * len(blocks)
        torch.testing.assert_close(loss_s, loss, rtol=0, atol=0)
        for key, grad in grads.items():
            torch.testing.assert_close(grads_s[key].full_tensor(), grad, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("mode", "every_n"), [("sometimes", 1), ("every_n", 0)])
def test_checkpointing_arguments(mode: str, every_n: int) -> None:
    with pytest.raises(ConfigError):
        apply_activation_checkpointing(list(UserNet().blocks), mode, every_n)


# ---------------------------------------------------------------------------------------------
# Channels-last and compile


def test_channels_last_on_cnns_only() -> None:
    cnn = build("small_cnn", DIGITS)
    assert to_channels_last(cnn)
    conv = next(m for m in cnn.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not to_channels_last(build("mlp", DIGITS))
    assert not to_channels_last(tiny("llama_tiny"))


def test_compile_without_a_compiler_fails_at_build_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import cpp_builder

    def missing() -> str:
        raise RuntimeError("Failed to find a working C++ compiler.\nTried: g++, clang++")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    net = UserNet()
    with pytest.raises(ConfigError) as info:
        compile_blocks(list(net.blocks), net)
    assert str(info.value).startswith("parallel.compile needs a C++ compiler for torch.compile on CPU")
    assert "Tried: g++, clang++" in str(info.value) and "\n" not in str(info.value)
    assert "_compiled_call_impl" not in vars(net.blocks[0])  # nothing was compiled


@pytest.mark.slow
def test_compile_keeps_names_and_outputs() -> None:
    plain, compiled = build("llama_tiny", num_hidden_layers=2), build("llama_tiny", num_hidden_layers=2)
    keys = list(compiled.state_dict())
    blocks = repeated_blocks(compiled)
    apply_activation_checkpointing(blocks, "every_n", every_n=2)
    assert compile_blocks(blocks, compiled) == 2
    assert list(compiled.state_dict()) == keys
    x = torch.randint(0, 97, (2, 32))
    loss, grads = loss_and_grads(plain, x)
    loss_c, grads_c = loss_and_grads(compiled, x)
    # inductor fuses and reorders float arithmetic, so equal only to rounding
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)
    for key, grad in grads.items():
        torch.testing.assert_close(grads_c[key], grad, rtol=1e-4, atol=1e-5)
    net = UserNet()
    assert compile_blocks([], net) == 1
    torch.testing.assert_close(net(torch.ones(2, 8)), UserNet.forward(net, torch.ones(2, 8)))


# ---------------------------------------------------------------------------------------------
# bench switches (one subprocess per configuration)


def test_bench_measures_a_case_in_process() -> None:
    from trainforge.bench.switches import Case, measure

    threads = torch.get_num_threads()
    try:
        case = Case("activation_checkpointing", False, "llama_tiny", batch=2, seq_len=128, vocab=97, steps=1)
        off, on = measure(case), measure(dataclasses.replace(case, on=True))
    finally:
        torch.set_num_threads(threads)
    assert 0 < on.peak_mb < off.peak_mb
    assert len(off.step_times_s) == 1 and off.step_times_s[0] > 0 and off.first_step_s > 0


@pytest.mark.slow
def test_bench_switches_sees_checkpointing_save_memory(capsys: pytest.CaptureFixture[str]) -> None:
    from trainforge.bench import switches

    argv = ["--switch", "activation_checkpointing", "--seq-len", "256", "--batch", "2", "--steps", "2", "--json"]
    report = switches.main(argv)
    assert report is not None
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
    off, on = report["results"]
    assert (off["on"], on["on"], off["model"]) == (False, True, "llama_tiny")
    assert on["peak_mb"] < off["peak_mb"] / 2
    assert all(row["step_s"] > 0 for row in report["results"])
