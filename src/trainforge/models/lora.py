"""``model.lora``: low-rank adapters (LoRA, Hu et al. 2021) injected by PEFT into the built model.

PEFT puts an adapter pair (``lora_A``, ``lora_B``) beside each targeted linear layer and marks
only the adapters trainable, so the optimizer holds only them and a checkpoint saves only them
(``ParallelPlan.adapters_only``); the base weights come from ``model.pretrained`` (or the seeded
initialisation) again at every start. Targeted layers keep their weight as ``<layer>.base_layer``;
``merge`` folds each adapter into its base weight and puts the plain layer back, so the merged
model has the base model's names again (``trainforge export --merge-lora``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainforge.config import LoraConfig
from trainforge.errors import ModelError
from trainforge.models.registry import HFLogits

ADAPTER_MARK = ".lora_"  # in the name of every adapter parameter


def lora_target(model: nn.Module) -> nn.Module:
    """What PEFT adapts: the transformers model inside a built-in (PEFT knows its layer names by
    model type), or the module as the factory returned it."""
    return model.model if isinstance(model, HFLogits) else model


def apply_lora(model: nn.Module, cfg: LoraConfig) -> int:
    """Inject adapters into ``model`` in place; the number of layers adapted. One line when the
    targets match nothing or PEFT cannot tell which layers to adapt."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    target = lora_target(model)
    peft_config = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules) if cfg.target_modules else None,
    )
    try:
        inject_adapter_in_model(peft_config, target)
    except ValueError as err:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in target.named_modules() if isinstance(m, nn.Linear)})
        raise ModelError(
            f"model.lora.target_modules {cfg.target_modules or '(PEFT default)'} cannot be applied: "
            f"{' '.join(str(err).split())[:200]}; the model's linear layers are named "
            f"{', '.join(linear[:12]) or 'nothing'}"
        ) from None
    return sum(isinstance(m, LoraLayer) for m in target.modules())


def has_adapters(model: nn.Module) -> bool:
    return any(ADAPTER_MARK in name for name, _ in model.named_parameters())


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W + B A * alpha / r``) and put the plain layer
    back in its place: the base model's names, no PEFT layer left."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    return model


def adapter_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for n, t in state.items() if ADAPTER_MARK in n)
