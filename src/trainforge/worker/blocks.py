"""Model structure for the parallel plan: the repeated blocks, and the switches applied per block.

FSDP2 shards, activation checkpointing recomputes and ``torch.compile`` compiles one repeated block
(a transformer layer, a ResNet stage) at a time. Every switch here changes a module in place and
keeps its parameter names, so ``model.state_dict()`` keys, checkpoints and FSDP's FQNs are the same
with a switch on or off. Apply them in the plan's order: activation checkpointing, channels-last,
compile, then ``fully_shard`` (its hooks then run outside the recomputed region, so the block's
parameters are unsharded before its forward runs again in backward).
"""

from __future__ import annotations

import difflib
import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainforge.config import Config
from trainforge.errors import ConfigError

CHECKPOINT_MODES = ("none", "full", "every_n")


def repeated_blocks(model: nn.Module, names: Sequence[str] | None = None) -> list[nn.Module]:
    """The model's repeated blocks in forward order; ``names`` are their class names, else auto-detect.

    With ``names``, every module whose class name is listed, outermost only (a match inside a match
    is part of it). Without, the children of the ``nn.ModuleList`` holding the most parameters whose
    children are at least two modules of one class; an empty list when there is none (an MLP).
    """
    if names is not None:
        return blocks_by_name(model, names)
    best: list[nn.Module] = []
    best_size = -1
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = list(module), size
    return best


def blocks_by_name(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    wanted = set(names)
    found: list[nn.Module] = []
    matched: set[str] = set()
    inside: set[int] = set()  # ids of every module under a match, so only outermost ones count
    for module in model.modules():
        if id(module) in inside:
            continue
        name = type(module).__name__
        if name in wanted:
            found.append(module)
            matched.add(name)
            inside.update(id(sub) for sub in module.modules())
    unknown = [n for n in names if n not in matched]
    if unknown:
        raise ConfigError(unknown_block_message(model, unknown[0]))
    return found


def unknown_block_message(model: nn.Module, name: str) -> str:
    counts = Counter(type(m).__name__ for m in model.modules())
    # classes that occur more than once are the likely blocks; a model with none lists every class
    candidates = sorted(n for n, c in counts.items() if c > 1) or sorted(counts)
    close = difflib.get_close_matches(name, list(counts), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"block class {name!r} (parallel.fsdp.wrap) matches no module of {type(model).__name__}; {hint}"
        f"repeated classes in this model: {', '.join(candidates[:30])}"
    )


# ---------------------------------------------------------------------------------------------
# Activation checkpointing


def checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # kwargs go in through partial so that none of them (HF blocks take a dozen) can collide
    # with checkpoint()'s own keywords; non-reentrant checkpointing accepts the captured tensors
    return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False)


def is_checkpointed(block: nn.Module) -> bool:
    patched = block.__dict__.get("forward")
    return isinstance(patched, functools.partial) and patched.func is checkpointed_forward


def apply_activation_checkpointing(blocks: Sequence[nn.Module], mode: str, every_n: int = 1) -> int:
    """Recompute the chosen blocks' forward in backward instead of keeping their activations.

    ``mode`` is "none", "full" (every block) or "every_n" (``blocks[i]`` for ``i % every_n == 0``).
    The block's own ``forward`` is replaced on the instance, not wrapped in a parent module, so
    parameter names stay as they are. Returns how many blocks are checkpointed.
    """
    if mode not in CHECKPOINT_MODES:
        raise ConfigError(f"activation checkpointing mode {mode!r} is not one of {', '.join(CHECKPOINT_MODES)}")
    if every_n < 1:
        raise ConfigError(f"activation checkpointing every_n must be >= 1, got {every_n}")
    if mode == "none":
        return 0
    step = 1 if mode == "full" else every_n
    chosen = [block for i, block in enumerate(blocks) if i % step == 0]
    for block in chosen:
        if not is_checkpointed(block):
            # the bound method, so a deepcopy of the model rebinds it to the copy (copy handles methods)
            block.forward = functools.partial(checkpointed_forward, block.forward)
    return len(chosen)


# ---------------------------------------------------------------------------------------------
# Compile and memory format


def require_compiler(device: torch.device) -> None:
    """Fail at build time, in one line, when inductor cannot generate code for ``device``."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as err:
            raise ConfigError(
                "parallel.compile needs a C++ compiler for torch.compile on CPU and none was found "
                f"({' '.join(str(err).split())[:200]}); install g++ (or set CXX) or set parallel.compile: false"
            ) from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError("parallel.compile on CUDA needs triton; install it or set parallel.compile: false")


def compile_blocks(blocks: Sequence[nn.Module], root: nn.Module) -> int:
    """``torch.compile`` each block in place (names unchanged), or ``root`` when there are none.

    Compiling happens lazily at the first forward; this checks up front that inductor has a
    compiler for the model's device. Returns how many modules were compiled.
    """
    first = next(root.parameters(), None)
    require_compiler(first.device if first is not None else torch.device("cpu"))
    targets = list(blocks) or [root]
    for module in targets:
        module.compile()
    return len(targets)


# Built-in models whose code runs on channels-last tensors and whose step is faster that way (a
# model's own code may ``.view`` a convolution's output, which fails on them: opt in with ``true``).
CHANNELS_LAST_MODELS = frozenset({"small_cnn"})


def channels_last_wanted(config: Config) -> bool:
    """``parallel.channels_last`` resolved: ``auto`` is on for the built-in CNNs above, under plain
    DDP (whole models, no shards or stages: the layout of FSDP's flat shards is its own)."""
    wanted = config.parallel.channels_last
    if wanted == "auto":
        return config.model.name in CHANNELS_LAST_MODELS and config.parallel.plain_ddp and config.model.lora is None
    return wanted


def to_channels_last(model: nn.Module) -> bool:
    """Convert a CNN to channels-last memory format; False (and nothing done) without 2-D convolutions."""
    has_conv = any(isinstance(m, nn.Conv2d) and m.weight.dim() == 4 for m in model.modules())
    if has_conv:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return has_conv
