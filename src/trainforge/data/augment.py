"""Training augmentation of image batches from a maintained library: ``data.augment`` (docs/data.md).

An :class:`Augmenter` takes a batch ``(N, C, H, W)`` of float images on any device and returns the
batch cropped (random resized, or padded and randomly cropped back to ``H x W``), flipped left to
right at random, and normalised per channel; evaluation batches are only normalised. Augmentation
runs in the training process on whole batches, after they reach the device, rather than per sample
in loader workers: one vectorised call per batch instead of ``N`` small ones on the CPU.

The backends are kornia (``kornia.augmentation``: every sample of a batch gets its own crop and
flip from one vectorised draw) and torchvision's ``transforms.v2`` (which draws one set of
parameters per call, so it is called per sample of the batch). ``backend: auto`` takes torchvision
where it imports, else kornia.

Randomness: both draw from torch's global CPU generator (kornia samples its parameters on the CPU
unless the module is moved, which is never done here), the generator the run's checkpoints save and
restore (``worker/components.RngState``), so a resumed run draws the same crops as one that never
stopped.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor, nn

from trainforge.config import AugmentConfig, DataConfig
from trainforge.data.spec import DataSpec
from trainforge.errors import ConfigError, DataError

DEFAULT_MEAN = 0.5  # per channel, for sources that publish no statistics: [0, 1] pixels to [-1, 1]
DEFAULT_STD = 0.5
Transform = Callable[[Tensor], Tensor]


class Augmenter:
    """Training augmentation (``__call__``) and evaluation normalisation (:meth:`evaluate`) of image batches."""

    def __init__(
        self, backend: str, random: Transform | None, normalize: Transform | None, channels: int, description: str
    ) -> None:
        self.backend = backend
        self.random = random
        self.normalize = normalize
        self.channels = channels
        self.description = description

    @torch.no_grad()
    def __call__(self, images: Tensor) -> Tensor:
        """A training batch: random crop and flip, each sample its own, then normalisation."""
        self.check(images)
        if self.random is not None:
            images = self.random(images)
        return self.normalize(images) if self.normalize is not None else images

    @torch.no_grad()
    def evaluate(self, images: Tensor) -> Tensor:
        """A validation batch: normalisation only, no random draws."""
        self.check(images)
        return self.normalize(images) if self.normalize is not None else images

    def check(self, images: Tensor) -> None:
        if images.ndim != 4 or images.shape[1] != self.channels or not images.is_floating_point():
            raise DataError(
                f"data.augment works on float image batches (N, {self.channels}, H, W); "
                f"got a {str(images.dtype).removeprefix('torch.')} batch of shape {tuple(images.shape)}"
            )

    def __repr__(self) -> str:
        return f"Augmenter({self.backend}: {self.description})"


def augment_of(data: DataConfig) -> AugmentConfig | None:
    """``data.augment`` of a data section; None for a source whose section has no such key (tokens)."""
    augment = getattr(data, "augment", None)
    return augment if isinstance(augment, AugmentConfig) else None


def build_augmenter(cfg: AugmentConfig | None, spec: DataSpec) -> Augmenter | None:
    """The augmenter ``data.augment`` asks for, shaped for ``spec``; None when augmentation is off."""
    if cfg is None:
        return None
    channels, height, width = image_shape(spec)
    mean, std = statistics(cfg, spec, channels)
    backend, library = import_backend(cfg.backend)
    size = (height, width)
    if backend == "kornia":
        random, normalize = kornia_transforms(library, cfg, size, mean, std)
    else:
        random, normalize = torchvision_transforms(library, cfg, size, mean, std)
    steps = [
        {"random_resized": f"random resized crop {cfg.crop_scale}", "pad": f"pad {cfg.pad} + random crop"}.get(
            cfg.crop, ""
        ),
        "horizontal flip" if cfg.flip else "",
        f"normalize mean {mean} std {std}" if cfg.normalize else "",
    ]
    description = ", ".join(step for step in steps if step) or "nothing"
    return Augmenter(backend, random, normalize, channels, description)


def check_augment(cfg: AugmentConfig | None) -> None:
    """Driver-side check before Ray starts (local Ray only: workers elsewhere have their own
    packages): the chosen backend imports. The data-dependent checks run where the data is built."""
    if cfg is not None:
        import_backend(cfg.backend)


def image_shape(spec: DataSpec) -> tuple[int, int, int]:
    if spec.kind != "image" or len(spec.input_shape) != 3:
        what = "token sequences" if spec.kind == "tokens" else f"inputs of shape {spec.input_shape}"
        raise ConfigError(f"data.augment applies to images (C, H, W); this data has {what}: remove data.augment")
    channels, height, width = spec.input_shape
    return channels, height, width


def statistics(cfg: AugmentConfig, spec: DataSpec, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel (mean, std): data.augment's own, else the source's published ones, else 0.5."""

    def per_channel(
        key: str, given: list[float] | None, published: tuple[float, ...] | None, default: float
    ) -> tuple[float, ...]:
        values = tuple(given) if given is not None else published or (default,)
        if len(values) == 1:
            return values * channels
        if len(values) != channels:
            raise ConfigError(
                f"data.augment.{key} has {len(values)} values for images with {channels} channels: give 1 or {channels}"
            )
        return values

    mean = per_channel("mean", cfg.mean, spec.pixel_mean, DEFAULT_MEAN)
    std = per_channel("std", cfg.std, spec.pixel_std, DEFAULT_STD)
    return mean, std


def import_backend(choice: str) -> tuple[str, ModuleType]:
    """(name, module) of the backend ``data.augment.backend`` names, or a one-line ConfigError."""
    order = ["torchvision", "kornia"] if choice == "auto" else [choice]
    problems = []
    for name in order:
        try:
            module = "torchvision.transforms.v2" if name == "torchvision" else "kornia.augmentation"
            return name, importlib.import_module(module)
        except Exception as err:  # a torchvision built for another torch fails with RuntimeError, not ImportError
            problems.append(f"{name} does not import ({type(err).__name__}: {' '.join(str(err).split())[:120]})")
    hint = "set data.augment.backend: kornia or auto" if choice == "torchvision" else "pip install kornia"
    raise ConfigError(f"data.augment.backend {choice}: {'; '.join(problems)}; {hint}")


def kornia_transforms(
    augmentation: ModuleType, cfg: AugmentConfig, size: tuple[int, int], mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[Transform | None, Transform | None]:
    ops: list[nn.Module] = []
    if cfg.crop == "random_resized":
        ops.append(augmentation.RandomResizedCrop(size, scale=cfg.crop_scale))
    elif cfg.crop == "pad" and cfg.pad > 0:
        ops.append(augmentation.RandomCrop(size, padding=cfg.pad))
    if cfg.flip:
        ops.append(augmentation.RandomHorizontalFlip())
    random = nn.Sequential(*ops) if ops else None
    if not cfg.normalize:
        return random, None
    enhance = importlib.import_module("kornia.enhance")
    stats = torch.tensor([mean, std])

    def normalize(images: Tensor) -> Tensor:
        mean_on, std_on = stats.to(images.device, images.dtype)
        return enhance.normalize(images, mean_on, std_on)

    return random, normalize


def torchvision_transforms(
    v2: ModuleType, cfg: AugmentConfig, size: tuple[int, int], mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[Transform | None, Transform | None]:
    ops: list[nn.Module] = []
    if cfg.crop == "random_resized":
        ops.append(v2.RandomResizedCrop(size, scale=cfg.crop_scale, antialias=True))
    elif cfg.crop == "pad" and cfg.pad > 0:
        ops.append(v2.RandomCrop(size, padding=cfg.pad))
    if cfg.flip:
        ops.append(v2.RandomHorizontalFlip())
    random: Transform | None = None
    if ops:
        pipeline = v2.Compose(ops)

        def random(images: Tensor) -> Tensor:
            # v2 draws one set of parameters per call: per sample, so each image gets its own.
            return torch.stack([pipeline(image) for image in images])

    normalize = v2.Normalize(list(mean), list(std)) if cfg.normalize else None
    return random, normalize
