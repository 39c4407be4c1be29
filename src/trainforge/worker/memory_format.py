"""How a model's 4-D weights lie in memory: ``model.memory_format``.

PyTorch's convolutions (oneDNN on the CPU, cuDNN on GPUs) run faster on channels-last weights
(NHWC) than on the contiguous layout (NCHW) a model is built in: the same arithmetic, other
kernels. The CNN of ``bench peers`` steps about 40 % faster on one CPU core that way. A model's
code can depend on the layout (``.view`` on a convolution's output fails on channels-last
tensors), so ``auto`` converts only the built-in models known to run either way; a user model is
converted when its config says ``channels_last``. Checkpoints and exports hold the values, not the
layout (they are written contiguous), so a run resumes into either layout; a resume in the same
layout is bit-identical.
"""

from __future__ import annotations

import torch
from torch import nn

from trainforge.config import Config

# Built-in models whose code runs with channels-last weights and whose step is faster that way.
CHANNELS_LAST_MODELS = frozenset({"small_cnn"})


def chosen_format(config: Config) -> torch.memory_format:
    """``model.memory_format`` resolved: ``auto`` is channels_last for the models above under plain DDP."""
    wanted = config.model.memory_format
    if wanted == "auto":
        wanted = (
            "channels_last"
            if config.model.name in CHANNELS_LAST_MODELS and config.parallel.plain_ddp and config.model.lora is None
            else "contiguous"
        )
    return torch.channels_last if wanted == "channels_last" else torch.contiguous_format


def apply_memory_format(model: nn.Module, config: Config) -> str | None:
    """Lay ``model``'s 4-D weights out as ``model.memory_format`` says, in place (the same
    parameter objects); what was done, for the log, or None when nothing changed."""
    chosen = chosen_format(config)
    if chosen is torch.contiguous_format:
        return None
    four_d = sum(1 for p in model.parameters() if p.dim() == 4)
    if not four_d:
        return None
    model.to(memory_format=chosen)
    return f"{four_d} convolution weight(s) channels_last (model.memory_format {config.model.memory_format})"
