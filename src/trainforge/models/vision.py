"""Built-in image classifiers: ``(B, C, H, W) -> (B, num_classes)`` logits; with float targets
(regression) ``(B, values per sample)``.

``mlp`` and ``small_cnn`` are small enough to define here; the standard architectures come from
transformers' model classes with random init, shaped by the data spec.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainforge.data.spec import DataSpec
from trainforge.errors import ModelError
from trainforge.models.registry import HFLogits, hf_config, register


def require_classes(spec: DataSpec, name: str) -> int:
    """Check that ``spec`` is labelled image data and return the outputs per sample: its number of
    classes, or with float targets (regression) the values per sample (1 for one target)."""
    if spec.kind != "image":
        raise ModelError(
            f"built-in {name!r} is an image classifier but data.kind is {spec.kind!r}; "
            "pick a language model (llama_*, gpt2_small, gpt2_base, bert_small, bert_base) or image data"
        )
    if spec.target_shape is not None:
        return math.prod(spec.target_shape)
    if spec.num_classes is None or spec.num_classes < 2:
        raise ModelError(f"built-in {name!r} needs data with num_classes >= 2, got {spec.num_classes}")
    return spec.num_classes


def require_chw(spec: DataSpec, name: str) -> tuple[int, int, int]:
    """Check that samples are ``(C, H, W)`` images and return that shape."""
    if len(spec.input_shape) != 3:
        raise ModelError(
            f"built-in {name!r} needs images shaped [C, H, W], got data.input_shape {list(spec.input_shape)}; "
            "add a channel dimension (e.g. [1, 8, 8]) or use model.name: mlp"
        )
    channels, height, width = spec.input_shape
    return channels, height, width


@register("mlp")
def mlp(spec: DataSpec, *, hidden_sizes: Sequence[int] = (256, 128), dropout: float = 0.0) -> nn.Module:
    """Flatten -> (Linear, ReLU, Dropout) per hidden size -> Linear; no batch norm, so any batch size works."""
    num_classes = require_classes(spec, "mlp")
    width = math.prod(spec.input_shape)
    layers: list[nn.Module] = [nn.Flatten()]
    for size in hidden_sizes:
        layers += [nn.Linear(width, int(size)), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = int(size)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


@register("small_cnn")
def small_cnn(spec: DataSpec, *, channels: Sequence[int] = (32, 64, 128), dropout: float = 0.0) -> nn.Module:
    """(Conv3x3, BatchNorm, ReLU, MaxPool/2) blocks, then global average pooling, so any image size works."""
    num_classes = require_classes(spec, "small_cnn")
    in_channels, _, _ = require_chw(spec, "small_cnn")
    if not channels:
        raise ModelError("model.kwargs.channels for 'small_cnn' needs at least one conv width, e.g. [32, 64]")
    layers: list[nn.Module] = []
    for width in channels:
        layers += [
            nn.Conv2d(in_channels, int(width), kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(int(width)),
            nn.ReLU(inplace=True),
            # ceil_mode keeps a 1-pixel map alive, so 8x8 inputs survive three blocks
            nn.MaxPool2d(2, ceil_mode=True),
        ]
        in_channels = int(width)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(in_channels, num_classes))
    return nn.Sequential(*layers)


def hf_resnet(name: str, spec: DataSpec, arch: dict[str, Any], overrides: dict[str, Any]) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    num_classes = require_classes(spec, name)
    in_channels, _, _ = require_chw(spec, name)
    fixed = {"num_channels": in_channels, "num_labels": num_classes}
    config = hf_config(name, ResNetConfig, arch, fixed, overrides)
    return HFLogits(ResNetForImageClassification(config))


@register("resnet18")
def resnet18(spec: DataSpec, **overrides: Any) -> nn.Module:
    """ResNet-18 (basic blocks, 11M parameters); ``overrides`` are ResNetConfig fields."""
    arch = {"layer_type": "basic", "depths": [2, 2, 2, 2], "hidden_sizes": [64, 128, 256, 512]}
    return hf_resnet("resnet18", spec, arch, overrides)


@register("resnet50")
def resnet50(spec: DataSpec, **overrides: Any) -> nn.Module:
    """ResNet-50 (bottleneck blocks, 24M parameters); ``overrides`` are ResNetConfig fields."""
    arch = {"layer_type": "bottleneck", "depths": [3, 4, 6, 3], "hidden_sizes": [256, 512, 1024, 2048]}
    return hf_resnet("resnet50", spec, arch, overrides)


@register("resnet152")
def resnet152(spec: DataSpec, **overrides: Any) -> nn.Module:
    """ResNet-152 (bottleneck blocks, 58M parameters); ``overrides`` are ResNetConfig fields."""
    arch = {"layer_type": "bottleneck", "depths": [3, 8, 36, 3], "hidden_sizes": [256, 512, 1024, 2048]}
    return hf_resnet("resnet152", spec, arch, overrides)


class ViTLogits(HFLogits):
    """ViT wrapper that interpolates position embeddings when an input's size differs from the built one."""

    def __init__(self, model: nn.Module, image_size: tuple[int, int]) -> None:
        super().__init__(model)
        self.image_size = image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers interpolates on a square grid only, so a non-square build takes its own size only
        resized = tuple(x.shape[-2:]) != self.image_size
        return self.model(x, interpolate_pos_encoding=resized).logits


@register("vit_b_16")
def vit_b_16(spec: DataSpec, **overrides: Any) -> nn.Module:
    """ViT-B/16 (86M parameters) sized for the data's images; ``overrides`` are ViTConfig fields."""
    from transformers import ViTConfig, ViTForImageClassification

    num_classes = require_classes(spec, "vit_b_16")
    in_channels, height, width = require_chw(spec, "vit_b_16")
    arch = {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "patch_size": 16,
    }
    image_size = height if height == width else (height, width)
    fixed = {
        "num_channels": in_channels,
        "image_size": image_size,
        "num_labels": num_classes,
        "attn_implementation": "sdpa",
    }
    config = hf_config("vit_b_16", ViTConfig, arch, fixed, overrides)
    patch = config.patch_size if isinstance(config.patch_size, Sequence) else (config.patch_size,) * 2
    if patch[0] > height or patch[1] > width:
        raise ModelError(
            f"vit_b_16 patch size {list(patch)} is larger than the {height}x{width} images; "
            "set model.kwargs.patch_size to at most the image side or resize the data (data.image_size)"
        )
    return ViTLogits(ViTForImageClassification(config), (height, width))
