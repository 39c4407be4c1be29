"""data.augment: per-batch training augmentation from kornia (or torchvision where it imports)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainforge.checkpoint.state import capture_rng, restore_rng
from trainforge.config import AugmentConfig, DataConfig
from trainforge.data import build_datasets
from trainforge.data.augment import Augmenter, build_augmenter
from trainforge.data.images import CIFAR_MEAN, CIFAR_STD
from trainforge.data.spec import DataSpec
from trainforge.errors import ConfigError, DataError

SPEC = DataSpec(kind="image", input_shape=(3, 32, 32), num_classes=10)
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def augmenter(**options: object) -> Augmenter:
    built = build_augmenter(AugmentConfig.model_validate({"backend": "kornia", **options}), SPEC)
    assert built is not None
    return built


def images(count: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.rand(count, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("crop", ["none", "pad", "random_resized"])
def test_shape_dtype_and_device_are_kept(crop: str) -> None:
    batch = images()
    out = augmenter(crop=crop)(batch)
    assert out.shape == batch.shape and out.dtype == batch.dtype and out.device == batch.device
    assert torch.isfinite(out).all()


def test_draws_come_from_the_checkpointed_global_generator() -> None:
    """Restoring the RNG state a checkpoint saves gives the same crops and flips: exact resume."""
    aug, batch = augmenter(crop="random_resized"), images()
    torch.manual_seed(11)
    saved, before = capture_rng(), torch.get_rng_state()
    first = aug(batch)
    assert not torch.equal(torch.get_rng_state(), before)  # it drew from the global generator
    restore_rng(saved)
    assert torch.equal(aug(batch), first)
    torch.manual_seed(12)
    assert not torch.equal(aug(batch), first)


def test_flip_mirrors_some_samples_and_not_others() -> None:
    batch = images(64)
    torch.manual_seed(0)
    out = augmenter(crop="none", flip=True, normalize=False)(batch)
    flipped = [torch.equal(o, b.flip(-1)) for o, b in zip(out, batch, strict=True)]
    kept = [torch.equal(o, b) for o, b in zip(out, batch, strict=True)]
    assert all(f != k for f, k in zip(flipped, kept, strict=True))  # each sample one or the other
    assert 10 < sum(flipped) < 54


def test_pad_crop_takes_a_window_of_the_zero_padded_image() -> None:
    batch = images(16)
    torch.manual_seed(1)
    out = augmenter(crop="pad", pad=4, flip=False, normalize=False)(batch)
    padded = F.pad(batch, (4, 4, 4, 4))
    offsets = []
    for o, p in zip(out, padded, strict=True):
        found = [(dy, dx) for dy in range(9) for dx in range(9) if torch.equal(p[:, dy : dy + 32, dx : dx + 32], o)]
        assert found, "an output that is no window of the padded image"
        offsets.append(found[0])
    assert len(set(offsets)) > 4  # samples get their own offsets


def test_random_resized_crop_changes_every_sample_differently() -> None:
    batch = images(16)
    torch.manual_seed(2)
    out = augmenter(crop="random_resized", crop_scale=(0.2, 0.5), flip=False, normalize=False)(batch)
    assert all(not torch.allclose(o, b) for o, b in zip(out, batch, strict=True))
    # the same image cropped twice in one batch: two different crops
    twice = augmenter(crop="random_resized", crop_scale=(0.2, 0.5), flip=False, normalize=False)(
        batch[:1].repeat(2, 1, 1, 1)
    )
    assert not torch.allclose(twice[0], twice[1])


def test_evaluation_only_normalises_and_draws_nothing() -> None:
    aug, batch = augmenter(mean=[0.4, 0.5, 0.6], std=[0.2]), images()
    state = torch.get_rng_state()
    out = aug.evaluate(batch)
    assert torch.equal(state, torch.get_rng_state())
    expected = (batch - torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1)) / 0.2
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.equal(augmenter(normalize=False).evaluate(batch), batch)
    # training batches are normalised the same way after cropping: crop none, flip off is normalise only
    assert torch.allclose(
        augmenter(crop="none", flip=False, mean=[0.4, 0.5, 0.6], std=[0.2])(batch), expected, atol=1e-6
    )


def test_normalisation_defaults_per_source() -> None:
    """CIFAR-10 publishes its statistics (DataSpec.pixel_mean/std); other sources get 0.5."""
    plain = augmenter(crop="none", flip=False)
    batch = images()
    assert torch.allclose(plain.evaluate(batch), (batch - 0.5) / 0.5, atol=1e-6)
    cifar_spec = DataSpec(**{**SPEC.__dict__, "pixel_mean": CIFAR_MEAN, "pixel_std": CIFAR_STD})
    cifar = build_augmenter(AugmentConfig(backend="kornia"), cifar_spec)
    assert cifar is not None
    mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    assert torch.allclose(cifar.evaluate(batch), (batch - mean) / std, atol=1e-5)


def test_cifar10_items_stay_in_pixel_space_when_the_augmenter_normalises(tmp_path: Path) -> None:
    from tests.unit.test_data import write_cifar

    write_cifar(tmp_path, "bin")
    plain_train, _, _ = build_datasets(DataConfig(name="cifar10", path=str(tmp_path)), seed=0)
    cfg = DataConfig.model_validate({"name": "cifar10", "path": str(tmp_path), "augment": True})
    train, val, spec = build_datasets(cfg, seed=0)
    assert val is not None and float(train[3][0].min()) >= 0 and float(train[3][0].max()) <= 1
    aug = build_augmenter(cfg.augment, spec)
    assert aug is not None
    batch = torch.stack([train[i][0] for i in range(4)])
    assert torch.allclose(aug.evaluate(batch), torch.stack([plain_train[i][0] for i in range(4)]), atol=1e-5)


def test_off_and_errors() -> None:
    assert build_augmenter(None, SPEC) is None
    assert DataConfig.model_validate({"augment": False}).augment is None
    assert DataConfig.model_validate({"augment": True}).augment == AugmentConfig()
    tokens = DataSpec(kind="tokens", input_shape=(16,), vocab_size=50, seq_len=16)
    with pytest.raises(ConfigError, match=r"data.augment applies to images \(C, H, W\); this data has token"):
        build_augmenter(AugmentConfig(), tokens)
    with pytest.raises(ConfigError, match=r"data\.augment\.mean has 2 values for images with 3 channels: give 1 or 3"):
        build_augmenter(AugmentConfig(mean=[0.1, 0.2]), SPEC)
    aug = augmenter()
    with pytest.raises(DataError, match=r"float image batches \(N, 3, H, W\); got a uint8 batch"):
        aug((images() * 255).to(torch.uint8))
    with pytest.raises(DataError, match=r"got a float32 batch of shape \(3, 32, 32\)"):
        aug(images()[0])


@pytest.mark.skipif(HAS_TORCHVISION, reason="torchvision imports here")
def test_torchvision_backend_where_it_does_not_import_is_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        build_augmenter(AugmentConfig(backend="torchvision"), SPEC)
    message = str(caught.value)
    assert message.startswith("data.augment.backend torchvision: torchvision does not import (")
    assert message.endswith("set data.augment.backend: kornia or auto") and "\n" not in message
    auto = build_augmenter(AugmentConfig(), SPEC)
    assert auto is not None and auto.backend == "kornia"


@pytest.mark.skipif(not HAS_TORCHVISION, reason="torchvision does not import here")
def test_torchvision_backend() -> None:
    aug = build_augmenter(AugmentConfig(backend="torchvision", crop="pad"), SPEC)
    assert aug is not None and aug.backend == "torchvision"
    batch = images()
    torch.manual_seed(3)
    first = aug(batch)
    torch.manual_seed(3)
    assert first.shape == batch.shape and torch.equal(aug(batch), first)
    assert torch.allclose(aug.evaluate(batch), (batch - 0.5) / 0.5, atol=1e-6)


def test_time_per_batch() -> None:
    """A print, not an assertion (docs/benchmarks.md): kornia per batch vs batch size, and one
    sample at a time for 256. Run: pytest -s tests/unit/test_augment.py -k time_per_batch"""
    torch.manual_seed(0)
    for crop in ("pad", "random_resized"):
        aug = augmenter(crop=crop)
        line = []
        for size in (32, 64, 128, 256):
            batch = images(size)
            aug(batch)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                aug(batch)
                times.append(time.perf_counter() - start)
            line.append(f"{size}: {min(times) * 1e3:.1f} ms")  # the best of 5: the least disturbed by other load
        print(f"\naugment kornia {crop}, {torch.get_num_threads()} thread(s), per batch: {', '.join(line)}", end="")
    batch = images(256)
    start = time.perf_counter()
    torch.cat([aug(batch[i : i + 1]) for i in range(256)])
    print(f"\naugment kornia random_resized, 256 one sample at a time: {(time.perf_counter() - start) * 1e3:.0f} ms")


def test_the_worker_augments_each_training_micro_batch_and_only_normalises_validation(tmp_path: Path) -> None:
    """The step runner applies the augmenter to every micro-batch once it is on the device; the
    validation pass calls its evaluate (normalisation only)."""
    from tests.helpers.runs import tiny_run
    from trainforge.config import Config
    from trainforge.worker.build import build, evaluate
    from trainforge.worker.step import MetricSums

    cfg = Config.model_validate(
        tiny_run(
            tmp_path,
            data={"name": "synthetic", "input_shape": [3, 8, 8], "num_samples": 64, "augment": {"pad": 2}},
            train={"batch_size": 4, "grad_accum_steps": 2},
        )
    )
    run = build(cfg, ranks=(0, 1))
    augmenter = run.runner.augmenter
    assert augmenter is not None
    calls = {"train": 0, "eval": 0}

    def counted(kind: str, apply: Any) -> Any:
        def wrapped(images: torch.Tensor) -> torch.Tensor:
            calls[kind] += 1
            return apply(images)

        return wrapped

    run.runner.augmenter = type(
        "Counted",
        (),
        {
            "__call__": staticmethod(counted("train", augmenter)),
            "evaluate": staticmethod(counted("eval", augmenter.evaluate)),
        },
    )()
    assert run.runner.run(run.data.batches(), run.data.accum, MetricSums(run.device)) is not None
    assert calls == {"train": 2, "eval": 0}
    evaluate(run)
    assert calls["train"] == 2 and calls["eval"] == len(run.data.val_batches())
