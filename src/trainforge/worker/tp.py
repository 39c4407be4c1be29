"""Tensor parallelism: the workers' (data-parallel x tensor-parallel) layout and the plans that
split a block's matrices over a tensor-parallel group.

Megatron-style: in each repeated block, the projections that fan out (attention q/k/v, the MLP's
input) are split by output features (``colwise``: each rank computes its share of the heads or of
the hidden units), and the projections that fan back in (attention output, MLP output) by input
features (``rowwise``: partial sums, all-reduced). One all-reduce per attention and per MLP in
forward, one each in backward. Embeddings, norms and the output head stay replicated (sequence
parallelism, which would shard the norms' activations too, is not applied: see
docs/parallelism.md).

A plan is a mapping from module names (relative to the block) to ``"colwise"`` or ``"rowwise"``.
Built-in plans exist for the transformers' decoder/encoder layers trainforge ships (Llama, BERT,
ViT); GPT-2 fuses q/k/v into one ``Conv1D`` and has none. A user's plan is a function
``(model) -> {module name: "colwise" | "rowwise" | ParallelStyle}`` named by ``parallel.tp_plan``,
with names relative to the model (patterns as ``parallelize_module`` takes them, e.g.
``"layers.*.attn.q"``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainforge.errors import ConfigError, ModelError
from trainforge.models.registry import load_factory

COLWISE, ROWWISE = "colwise", "rowwise"


@dataclass(frozen=True)
class BlockPlan:
    """How one kind of block splits: module name -> style, and the config fields that count heads."""

    styles: Mapping[str, str]
    heads: tuple[str, ...]  # e.g. num_attention_heads: each must divide by the tensor-parallel size


BLOCK_PLANS: dict[str, BlockPlan] = {
    "LlamaDecoderLayer": BlockPlan(
        {
            "self_attn.q_proj": COLWISE,
            "self_attn.k_proj": COLWISE,
            "self_attn.v_proj": COLWISE,
            "self_attn.o_proj": ROWWISE,
            "mlp.gate_proj": COLWISE,
            "mlp.up_proj": COLWISE,
            "mlp.down_proj": ROWWISE,
        },
        ("num_attention_heads", "num_key_value_heads"),
    ),
    "BertLayer": BlockPlan(
        {
            "attention.self.query": COLWISE,
            "attention.self.key": COLWISE,
            "attention.self.value": COLWISE,
            "attention.output.dense": ROWWISE,
            "intermediate.dense": COLWISE,
            "output.dense": ROWWISE,
        },
        ("num_attention_heads",),
    ),
    "ViTLayer": BlockPlan(
        {
            "attention.q_proj": COLWISE,
            "attention.k_proj": COLWISE,
            "attention.v_proj": COLWISE,
            "attention.o_proj": ROWWISE,
            "mlp.fc1": COLWISE,
            "mlp.fc2": ROWWISE,
        },
        ("num_attention_heads",),
    ),
}

UserPlan = Callable[[nn.Module], Mapping[str, Any]]


@dataclass(frozen=True)
class Layout:
    """Where a worker sits in the (pipeline x data-parallel x tensor-parallel) grid. Ranks of one
    tensor-parallel group are consecutive (on one node when Ray packs them), and read the same batch;
    so do the stages of one pipeline (``pp``), whose ranks are ``world / pp`` apart."""

    rank: int
    world: int
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel width: how many different batches one step reads."""
        return self.world // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.rank // (self.tp * self.dp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def device_mesh(self, device: torch.device, replicate: int = 1) -> Any:
        """The mesh over the default process group: ``("dp", "tp")``, or with ``replicate`` > 1
        (HSDP) the data-parallel dimension as ``("replicate", "shard")``, then ``"tp"`` when
        tensor parallel. Row-major: a shard group's ranks are consecutive, like a TP group's."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = {"replicate": replicate, "shard": self.dp // replicate} if replicate > 1 else {"dp": self.dp}
        if self.tp > 1 or replicate == 1:
            dims["tp"] = self.tp
        return init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def block_plan(block: nn.Module) -> BlockPlan | None:
    return BLOCK_PLANS.get(type(block).__name__)


def tp_styles(model: nn.Module, user_plan: str | None = None) -> dict[str, Any]:
    """Module name (relative to ``model``) -> ``"colwise"`` / ``"rowwise"`` (or the user's
    ParallelStyle) for every module tensor parallelism splits. Everything else is replicated.

    ModelError when the model has no plan: neither ``parallel.tp_plan`` nor a built-in block."""
    if user_plan is not None:
        plan = load_factory(user_plan, key="parallel.tp_plan", returns="a {module name: style} mapping")(model)
        if not isinstance(plan, Mapping) or not plan:
            raise ModelError(
                f"parallel.tp_plan {user_plan!r} returned {type(plan).__name__}; "
                "it must return a non-empty {module name: 'colwise' | 'rowwise' | ParallelStyle} mapping"
            )
        return dict(plan)
    styles: dict[str, Any] = {}
    for name, module in model.named_modules():
        found = block_plan(module)
        if found is not None:
            styles.update({f"{name}.{sub}" if name else sub: style for sub, style in found.styles.items()})
    if not styles:
        kinds = ", ".join(sorted(BLOCK_PLANS))
        raise ModelError(
            f"parallel.tensor_parallel: {model_kind(model)} has no tensor-parallel plan (built-in plans: {kinds}; "
            "GPT-2's fused q/k/v cannot be split by heads); give one with parallel.tp_plan: 'pkg.module:function'"
        )
    return styles


def check_tensor_parallel(model: nn.Module, tp: int, user_plan: str | None = None) -> None:
    """Before Ray starts: the model has a plan, its heads and split dimensions divide by ``tp``.
    ConfigError, one line, naming what does not divide."""
    styles = tp_styles(model, user_plan)
    config = model_config(model)
    kinds = {type(m).__name__ for m in model.modules()} & set(BLOCK_PLANS)
    for field in sorted({f for kind in kinds for f in BLOCK_PLANS[kind].heads}):
        count = getattr(config, field, None)
        if isinstance(count, int) and count % tp:
            raise ConfigError(
                f"parallel.tensor_parallel {tp} must divide the model's {field} ({count}): "
                "each rank computes whole attention heads"
            )
    modules = dict(model.named_modules())
    if user_plan is not None:
        missing = [name for name in styles if "*" not in name and name not in modules]
        if missing:
            raise ConfigError(
                f"parallel.tp_plan {user_plan!r} names modules the model does not have: {', '.join(missing[:5])}"
            )
        return
    for name, style in styles.items():
        linear = modules.get(name)
        if isinstance(linear, nn.Linear):
            size = linear.out_features if style == COLWISE else linear.in_features
            if size % tp:
                raise ConfigError(
                    f"parallel.tensor_parallel {tp} must divide {name}'s {size} "
                    f"{'output' if style == COLWISE else 'input'} features"
                )


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, user_plan: str | None = None) -> int:
    """Split the model's planned modules over ``tp_mesh`` in place; how many modules were split.
    Their parameters become DTensors sharded over the group; the rest stay plain and replicated
    (every rank of the group computes the same gradient for them)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    kinds = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    styles = tp_styles(model, user_plan)
    bad = [f"{name}: {style!r}" for name, style in styles.items() if isinstance(style, str) and style not in kinds]
    if bad:
        raise ModelError(
            f"parallel.tp_plan: unknown styles ({'; '.join(bad)}); use 'colwise', 'rowwise' or a ParallelStyle"
        )
    plan = {name: kinds[style]() if isinstance(style, str) else style for name, style in styles.items()}
    parallelize_module(model, tp_mesh, plan)
    return len(plan)


def model_config(model: nn.Module) -> Any:
    """The transformers config of a built-in model (None for others): it counts the heads."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "num_attention_heads"):
            return config
    return None


def model_kind(model: nn.Module) -> str:
    """The class users know a model by: the wrapped transformers model's, else the module's own."""
    inner = next((m for m in model.modules() if hasattr(m, "config")), model)
    return type(inner).__name__
