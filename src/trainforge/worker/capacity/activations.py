"""Activation bytes of a model, measured on fake tensors: what autograd keeps for backward.

One forward and loss run under ``FakeTensorMode`` (no memory, no compute) with
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves is counted once by its
storage (views share one), parameters left out (they are counted as parameters). The bytes are
attributed to the repeated block that was running, or to what runs before the blocks (embeddings)
or after them (final norm, head, loss); each block's inputs are recorded (what activation
checkpointing keeps instead), and the largest tensor any module returns is noted (at the start of
backward its gradient exists beside the saved ones).
The same forward counts its floating-point operations (``FlopCounterMode``, from the shapes: fake
tensors compute nothing), which the planner's time estimate reads.
Measured at micro-batch 2 and 4 (not 1: batch norm cannot train on one sample), each figure
becomes a fixed part plus a per-sample part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from trainforge.data import DataSpec
from trainforge.models import Task

# The two micro-batches measured (fake tensors: no memory, whatever the size).
SMALL, LARGE = 2, 4


@dataclass(frozen=True)
class PerBatch:
    """Bytes as ``fixed + per_sample * micro_batch``."""

    fixed: float
    per_sample: float

    def at(self, batch: int) -> float:
        return self.fixed + self.per_sample * batch

    def __add__(self, other: PerBatch) -> PerBatch:
        return PerBatch(self.fixed + other.fixed, self.per_sample + other.per_sample)

    def scaled(self, factor: float) -> PerBatch:
        return PerBatch(self.fixed * factor, self.per_sample * factor)

    def max(self, other: PerBatch) -> PerBatch:
        """Part by part, so at least either one at every micro-batch."""
        return PerBatch(max(self.fixed, other.fixed), max(self.per_sample, other.per_sample))

    @classmethod
    def fit(cls, at_small: int, at_large: int) -> PerBatch:
        """From the bytes at micro-batches ``SMALL`` and ``LARGE``."""
        per_sample = max(0.0, (at_large - at_small) / (LARGE - SMALL))
        return cls(max(0.0, at_small - per_sample * SMALL), per_sample)


@dataclass
class Saved:
    """One measured forward: bytes saved before the blocks, after them, by each block, each block's
    inputs, and the largest single tensor a module returned."""

    before: int = 0
    after: int = 0
    blocks: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    largest: int = 0
    flops: int = 0  # of the forward and loss


@dataclass(frozen=True)
class ActivationProfile:
    before: PerBatch
    after: PerBatch
    largest: PerBatch
    blocks: tuple[PerBatch, ...]
    inputs: tuple[PerBatch, ...]
    flops: PerBatch = PerBatch(0.0, 0.0)  # of the forward and loss

    @property
    def total(self) -> PerBatch:
        """Everything without checkpointing."""
        result = self.before + self.after + self.largest
        for saved in self.blocks:
            result = result + saved
        return result


def measure_activations(
    mode: FakeTensorMode,
    model: nn.Module,
    blocks: Sequence[nn.Module],
    task: Task,
    spec: DataSpec,
    autocast: torch.dtype | None,
) -> ActivationProfile:
    """Fit the activation profile of ``model`` (built under ``mode``) from two micro-batches."""
    one, two = (saved_bytes(mode, model, blocks, task, spec, batch, autocast) for batch in (SMALL, LARGE))
    return ActivationProfile(
        before=PerBatch.fit(one.before, two.before),
        after=PerBatch.fit(one.after, two.after),
        largest=PerBatch.fit(one.largest, two.largest),
        blocks=tuple(PerBatch.fit(a, b) for a, b in zip(one.blocks, two.blocks, strict=True)),
        inputs=tuple(PerBatch.fit(a, b) for a, b in zip(one.inputs, two.inputs, strict=True)),
        flops=PerBatch.fit(one.flops, two.flops),
    )


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """transformers' masks as an eager run builds them, while fake tensors run.

    transformers treats a fake tensor as a graph being traced: it cannot read position ids, so it
    assumes packed sequences and materialises a (B, 1, T, T) mask, which in turn keeps SDPA from
    grouped-query attention (keys and values repeated per head). An eager run reads the position
    ids (0..T-1, what a built-in model always gets), skips the mask and uses ``is_causal``. So
    while measuring, "packed sequences?" answers no, as it would eagerly.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def storage_key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def fake_batch(spec: DataSpec, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets shaped like the data's (call under the fake mode)."""
    if spec.kind == "tokens":
        vocab = spec.vocab_size or 2
        shape = (batch, *spec.input_shape)
        return torch.randint(vocab, shape), torch.randint(vocab, shape)
    inputs = torch.randn(batch, *spec.input_shape)
    return inputs, torch.randint(spec.num_classes or 2, (batch,))


def saved_bytes(
    mode: FakeTensorMode,
    model: nn.Module,
    blocks: Sequence[nn.Module],
    task: Task,
    spec: DataSpec,
    batch: int,
    autocast: torch.dtype | None,
) -> Saved:
    record = Saved(blocks=[0] * len(blocks), inputs=[0] * len(blocks))
    seen = {storage_key(p) for p in model.parameters()}
    inputs_seen: set[int] = set()
    alive: list[torch.Tensor] = []  # keeps counted storages alive, so their keys stay unique
    current = [-1]
    entered = [False]  # has a block run yet

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            alive.append(tensor)
            nbytes = tensor.untyped_storage().nbytes()
            if current[0] >= 0:
                record.blocks[current[0]] += nbytes
            elif entered[0]:
                record.after += nbytes
            else:
                record.before += nbytes
        return tensor

    def enter(index: int) -> object:
        def hook(_: nn.Module, args: object, kwargs: object) -> None:
            current[0] = index
            entered[0] = True
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and storage_key(leaf) not in inputs_seen:
                    inputs_seen.add(storage_key(leaf))
                    alive.append(leaf)
                    record.inputs[index] += leaf.untyped_storage().nbytes()

        return hook

    def leave(*_: object) -> None:
        current[0] = -1

    def largest(_: nn.Module, __: object, output: object) -> None:
        sizes = [t.untyped_storage().nbytes() for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        record.largest = max([record.largest, *sizes])

    handles = [m.register_forward_hook(largest) for m in model.modules()]
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(index), with_kwargs=True))  # type: ignore[arg-type]
        handles.append(block.register_forward_hook(leave))
    try:
        counter = FlopCounterMode(display=False)
        with mode, unpacked_sequences(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inputs, targets = fake_batch(spec, batch)
            with (
                counter,
                torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None),
            ):
                task.loss(model(inputs), targets)
    finally:
        for handle in handles:
            handle.remove()
    record.flops = counter.get_total_flops()
    return record
