"""Data sources, the resumable sampler and loaders: real files, real worker processes, no mocks."""

from __future__ import annotations

import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from trainforge.config import DataConfig
from trainforge.data import MAP_STYLE as SOURCES
from trainforge.data import DataSpec, PairDataset, ResumableDistributedSampler, build_datasets, make_loader
from trainforge.data.images import CIFAR_MEAN, CIFAR_STD
from trainforge.data.sampler import seed_worker
from trainforge.data.sources import digits_arrays
from trainforge.errors import DataError

# ---------------------------------------------------------------------------------------------
# digits


@pytest.fixture(scope="module")
def digits() -> tuple[PairDataset, PairDataset | None, DataSpec]:
    return build_datasets(DataConfig(name="digits"), seed=0)


def test_digits_shapes_range_and_fixed_split(digits: tuple[PairDataset, PairDataset | None, DataSpec]) -> None:
    train, val, spec = digits
    assert val is not None
    assert (len(train), len(val)) == (1438, 359)
    assert spec == DataSpec(kind="image", input_shape=(1, 8, 8), num_classes=10, train_size=1438, val_size=359)
    x, y = train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    images = torch.stack([train[i][0] for i in range(len(train))])
    labels = torch.stack([train[i][1] for i in range(len(train))])
    assert images.min() >= 0.0 and images.max() == 1.0
    assert set(labels.tolist()) == set(range(10))


def test_digits_read_from_the_package_file_equal_load_digits() -> None:
    from sklearn.datasets import load_digits

    images, targets = digits_arrays()
    reference = load_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(targets, reference.target)
    assert targets.dtype == np.int64


def test_digits_split_ignores_seed_and_val_fraction(digits: tuple[PairDataset, PairDataset | None, DataSpec]) -> None:
    train, val, _ = digits
    other_train, other_val, _ = build_datasets(DataConfig(name="digits", val_fraction=0.5), seed=123)
    assert val is not None and other_val is not None
    for a, b in ((train, other_train), (val, other_val)):
        assert len(a) == len(b)
        assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(0, len(a), 7))


# ---------------------------------------------------------------------------------------------
# sampler


def all_ranks(
    size: int, world: int, *, even: bool, shuffle: bool = True, seed: int = 3, epoch: int = 0
) -> list[list[int]]:
    orders = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(size, world, rank, shuffle, seed, even=even)
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == len(sampler) == sampler.per_rank_size()
        orders.append(order)
    return orders


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("size", [0, 1, 2, 7, 10, 11, 100])
def test_uneven_sampler_covers_the_set_once(world: int, size: int) -> None:
    orders = all_ranks(size, world, even=False)
    flat = [i for order in orders for i in order]
    assert sorted(flat) == list(range(size))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("size", [3, 7, 10, 11, 100])
def test_even_sampler_gives_equal_disjoint_shares(world: int, size: int) -> None:
    orders = all_ranks(size, world, even=True)
    flat = [i for order in orders for i in order]
    assert {len(order) for order in orders} == {size // world}
    assert len(set(flat)) == len(flat)
    assert size - len(flat) <= world - 1


def test_order_is_the_documented_permutation() -> None:
    size, world, seed, epoch = 23, 3, 5, 4
    perm = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))[: size - size % world]
    for rank, order in enumerate(all_ranks(size, world, even=True, seed=seed, epoch=epoch)):
        assert order == perm[rank::world].tolist()
    assert all_ranks(7, 2, even=False, shuffle=False) == [[0, 2, 4, 6], [1, 3, 5]]


def test_epochs_and_seeds_change_the_order_deterministically() -> None:
    assert all_ranks(50, 2, even=True, epoch=0) != all_ranks(50, 2, even=True, epoch=1)
    assert all_ranks(50, 2, even=True, seed=1) != all_ranks(50, 2, even=True, seed=2)
    assert all_ranks(50, 2, even=True, seed=1, epoch=3) == all_ranks(50, 2, even=True, seed=1, epoch=3)
    dropped = [frozenset(range(10)) - {i for o in all_ranks(10, 3, even=True, epoch=e) for i in o} for e in range(5)]
    assert all(len(d) == 1 for d in dropped) and len(set(dropped)) > 1


@pytest.mark.parametrize("even", [True, False])
def test_set_start_yields_the_tail_until_the_next_epoch(even: bool) -> None:
    sampler = ResumableDistributedSampler(37, 3, 2, True, 11, even=even)
    sampler.set_epoch(2)
    full = list(sampler)
    for position in (0, 1, 5, len(full)):
        sampler.set_start(position)
        assert list(sampler) == full[position:] and len(sampler) == len(full) - position
    sampler.set_epoch(3)
    assert sampler.start == 0 and len(list(sampler)) == sampler.per_rank_size()
    with pytest.raises(ValueError):
        sampler.set_start(sampler.per_rank_size() + 1)


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(DataError, match="fewer than the 4 workers"):
        ResumableDistributedSampler(3, 4, 0, True, 0, even=True)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, 2, 2, True, 0)


# ---------------------------------------------------------------------------------------------
# synthetic


def test_synthetic_images_are_deterministic_and_shaped() -> None:
    cfg = DataConfig(name="synthetic", input_shape=[3, 4, 5], num_classes=3, num_samples=40, val_fraction=0.25)
    train, val, spec = build_datasets(cfg, seed=0)
    again, _, _ = build_datasets(cfg, seed=99)
    assert val is not None and (len(train), len(val)) == (30, 10)
    assert spec == DataSpec(kind="image", input_shape=(3, 4, 5), num_classes=3, train_size=30, val_size=10)
    x, y = train[4]
    assert x.shape == (3, 4, 5) and x.dtype == torch.float32 and y.dtype == torch.int64 and 0 <= int(y) < 3
    assert torch.equal(x, again[4][0]) and int(y) == int(again[4][1])
    assert not torch.equal(val[0][0], train[0][0])
    with pytest.raises(IndexError):
        train[30]


def test_synthetic_images_are_learnable() -> None:
    cfg = DataConfig(name="synthetic", input_shape=[1, 8, 8], num_classes=5, num_samples=600, val_fraction=0.5)
    train, val, _ = build_datasets(cfg, seed=0)
    assert val is not None
    xs, ys = (torch.stack(t) for t in zip(*[train[i] for i in range(len(train))], strict=True))
    centroids = torch.stack([xs[ys == c].mean(0).flatten() for c in range(5)])
    vx, vy = (torch.stack(t) for t in zip(*[val[i] for i in range(len(val))], strict=True))
    predicted = torch.cdist(vx.flatten(1), centroids).argmin(1)
    assert (predicted == vy).float().mean() > 0.9


def test_synthetic_tokens_are_shifted_pairs_and_learnable() -> None:
    cfg = DataConfig(name="synthetic", kind="tokens", seq_len=16, vocab_size=20, num_samples=300, val_fraction=0.1)
    train, val, spec = build_datasets(cfg, seed=0)
    assert val is not None and spec.input_shape == (16,) and (spec.vocab_size, spec.seq_len) == (20, 16)
    assert (spec.train_size, spec.val_size) == (270, 30)
    x, y = train[0]
    assert x.shape == y.shape == (16,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1]) and int(x.max()) < 20
    assert torch.equal(x, build_datasets(cfg, seed=7)[0][0][0])
    counts = torch.zeros(20, 20)
    for i in range(len(train)):
        a, b = train[i]
        counts.index_put_((a, b), torch.ones(16), accumulate=True)
    best_next = counts.argmax(1)
    hits = [(best_next[a] == b).float().mean() for a, b in (val[i] for i in range(len(val)))]
    assert torch.stack(hits).mean() > 0.8


def test_synthetic_without_validation() -> None:
    train, val, spec = build_datasets(DataConfig(name="synthetic", num_samples=10, val_fraction=0.0), seed=0)
    assert val is None and len(train) == 10 and spec.val_size == 0


# ---------------------------------------------------------------------------------------------
# cifar10


def cifar_arrays(count: int, offset: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(offset)
    return rng.integers(0, 256, size=(count, 3072), dtype=np.uint8), [(offset + i) % 10 for i in range(count)]


def write_cifar(root: Path, fmt: str, protocol: int = 2) -> Path:
    folder = root / ("cifar-10-batches-bin" if fmt == "bin" else "cifar-10-batches-py")
    folder.mkdir(parents=True)
    batches = {f"data_batch_{i}": cifar_arrays(4, 4 * (i - 1)) for i in range(1, 6)}
    batches["test_batch"] = cifar_arrays(10, 100)
    for name, (data, labels) in batches.items():
        if fmt == "bin":
            records = np.concatenate([np.array(labels, dtype=np.uint8)[:, None], data], axis=1)
            records.tofile(folder / f"{name}.bin")
        else:
            batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data}
            (folder / name).write_bytes(pickle.dumps(batch, protocol=protocol))
    return folder


@pytest.mark.parametrize("fmt", ["bin", "py"])
@pytest.mark.parametrize("point_at", ["parent", "folder"])
def test_cifar10_reads_both_formats(tmp_path: Path, fmt: str, point_at: str) -> None:
    folder = write_cifar(tmp_path, fmt)
    path = tmp_path if point_at == "parent" else folder
    train, val, spec = build_datasets(DataConfig(name="cifar10", path=str(path)), seed=0)
    assert val is not None and (len(train), len(val)) == (20, 10)
    assert spec == DataSpec(
        kind="image",
        input_shape=(3, 32, 32),
        num_classes=10,
        train_size=20,
        val_size=10,
        pixel_mean=CIFAR_MEAN,
        pixel_std=CIFAR_STD,
    )
    data, labels = cifar_arrays(4, 8)  # data_batch_3
    x, y = train[9]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and int(y) == labels[1]
    raw = torch.from_numpy(data[1].reshape(3, 32, 32).astype(np.float32)) / 255.0
    expected = (raw - torch.tensor(CIFAR_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR_STD).view(3, 1, 1)
    assert torch.allclose(x, expected)
    assert int(val[9][1]) == cifar_arrays(10, 100)[1][9]


def test_cifar10_python_batches_of_any_protocol(tmp_path: Path) -> None:
    write_cifar(tmp_path, "py", protocol=pickle.HIGHEST_PROTOCOL)
    train, _, _ = build_datasets(DataConfig(name="cifar10", path=str(tmp_path)), seed=0)
    assert len(train) == 20


def test_cifar10_refuses_pickles_that_run_code(tmp_path: Path) -> None:
    folder = write_cifar(tmp_path, "py")

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("echo pwned",))

    (folder / "data_batch_2").write_bytes(pickle.dumps({b"data": Exploit(), b"labels": []}))
    with pytest.raises(DataError, match=r"refusing to load posix\.system"):
        build_datasets(DataConfig(name="cifar10", path=str(tmp_path)), seed=0)


def test_cifar10_errors_name_the_path_and_layout(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"needs data\.path"):
        build_datasets(DataConfig(name="cifar10"), seed=0)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'nope'} does not exist")):
        build_datasets(DataConfig(name="cifar10", path=str(tmp_path / "nope")), seed=0)
    with pytest.raises(DataError, match="no CIFAR-10 files under"):
        build_datasets(DataConfig(name="cifar10", path=str(tmp_path)), seed=0)
    folder = write_cifar(tmp_path, "bin")
    (folder / "data_batch_4.bin").unlink()
    with pytest.raises(DataError, match=r"incomplete, missing data_batch_4\.bin"):
        build_datasets(DataConfig(name="cifar10", path=str(tmp_path)), seed=0)
    (folder / "data_batch_4.bin").write_bytes(b"\x01" * 3000)
    with pytest.raises(DataError, match="not a CIFAR-10 binary batch"):
        build_datasets(DataConfig(name="cifar10", path=str(tmp_path)), seed=0)


# ---------------------------------------------------------------------------------------------
# imagefolder


def write_image(path: Path, color: tuple[int, int, int], size: tuple[int, int] = (6, 4), mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).convert(mode).save(path)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_image(tmp_path / "train" / "dog" / "a.png", (255, 0, 0))
    write_image(tmp_path / "train" / "dog" / "b.PNG", (0, 255, 0), mode="RGBA")
    write_image(tmp_path / "train" / "cat" / "c.png", (0, 0, 255))
    write_image(tmp_path / "train" / "cat" / "nested" / "d.png", (51, 51, 51), mode="L")
    write_image(tmp_path / "train" / "cat" / "e.jpg", (0, 0, 255))
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    write_image(tmp_path / "val" / "dog" / "f.png", (255, 255, 255))
    return tmp_path


def test_imagefolder_with_val_folder(folder: Path) -> None:
    train, val, spec = build_datasets(DataConfig(name="imagefolder", path=str(folder)), seed=0)
    assert val is not None and (len(train), len(val)) == (5, 1)
    assert spec == DataSpec(kind="image", input_shape=(3, 4, 6), num_classes=2, train_size=5, val_size=1)
    labels = [int(train[i][1]) for i in range(len(train))]
    assert labels == [0, 0, 0, 1, 1]  # cat before dog; c.png, e.jpg, nested/d.png sorted by path
    x, _ = train[3]
    assert x.shape == (3, 4, 6) and x.dtype == torch.float32
    assert torch.allclose(x[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(train[2][0], torch.full((3, 4, 6), 51 / 255))
    assert int(val[0][1]) == 1 and float(val[0][0].min()) == 1.0


def test_imagefolder_splits_and_resizes(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder / "val")
    cfg = DataConfig(name="imagefolder", path=str(folder), val_fraction=0.4, image_size=8)
    train, val, spec = build_datasets(cfg, seed=0)
    again, _, _ = build_datasets(cfg, seed=5)
    assert val is not None and (len(train), len(val)) == (3, 2) and spec.input_shape == (3, 8, 8)
    assert train[0][0].shape == (3, 8, 8)
    assert [int(train[i][1]) for i in range(3)] == [int(again[i][1]) for i in range(3)]
    assert all(torch.equal(train[i][0], again[i][0]) for i in range(3))


def test_imagefolder_errors(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    write_image(folder / "train" / "cat" / "z.png", (0, 0, 0), size=(9, 9))
    train, _, _ = build_datasets(DataConfig(name="imagefolder", path=str(folder)), seed=0)
    with pytest.raises(DataError, match=r"is 9x9 but the first image is 6x4: set data\.image_size"):
        [train[i] for i in range(len(train))]
    (folder / "val" / "bird").mkdir()
    with pytest.raises(DataError, match="class folders that train/ lacks: 'bird'"):
        build_datasets(DataConfig(name="imagefolder", path=str(folder)), seed=0)
    (folder / "train" / "bird").mkdir()
    with pytest.raises(DataError, match=r"without \.png/\.jpg images .*: 'bird'"):
        build_datasets(DataConfig(name="imagefolder", path=str(folder)), seed=0)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(DataError, match="train does not exist"):
        build_datasets(DataConfig(name="imagefolder", path=str(empty)), seed=0)
    (empty / "train").mkdir()
    with pytest.raises(DataError, match="has no class folders"):
        build_datasets(DataConfig(name="imagefolder", path=str(empty)), seed=0)


# ---------------------------------------------------------------------------------------------
# registry


@pytest.mark.parametrize(("name", "hint"), [("digit", "did you mean 'digits'"), ("cifar", "did you mean 'cifar10'")])
def test_unknown_source_suggests_the_closest(name: str, hint: str) -> None:
    with pytest.raises(DataError, match=hint):
        build_datasets(DataConfig(name=name), seed=0)
    with pytest.raises(DataError, match="choose one of cifar10, digits, factory, imagefolder, synthetic, tokens"):
        build_datasets(DataConfig(name="zzz"), seed=0)
    assert set(SOURCES) == {"synthetic", "digits", "cifar10", "imagefolder", "factory", "tokens"}


# ---------------------------------------------------------------------------------------------
# loaders


class RandomDraws(torch.utils.data.Dataset[torch.Tensor]):
    """Returns fresh random numbers from python, numpy and torch: shows how workers are seeded."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([random.random(), float(np.random.rand()), float(torch.rand(()))])


def batches(loader: torch.utils.data.DataLoader[Any]) -> list[Any]:
    return list(loader)


def test_loader_workers_yield_the_same_batches() -> None:
    train, _, _ = build_datasets(DataConfig(name="synthetic", input_shape=[2, 4, 4], num_samples=90), seed=0)
    sampler = ResumableDistributedSampler(len(train), 2, 1, True, 4)
    sampler.set_epoch(1)
    sampler.set_start(5)
    runs = []
    for workers in (0, 2):
        loader = make_loader(
            train, sampler, 8, num_workers=workers, pin_memory=False, drop_last=False, seed=4, epoch=1, rank=1
        )
        runs.append(batches(loader))
    assert len(runs[0]) == len(runs[1]) == 4  # 36 samples per rank, 31 after the start, batches of 8
    for (x0, y0), (x1, y1) in zip(*runs, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_loader_worker_randomness_is_reproducible() -> None:
    def draws(epoch: int) -> torch.Tensor:
        sampler = ResumableDistributedSampler(8, 1, 0, False, 0)
        loader = make_loader(
            RandomDraws(), sampler, 2, num_workers=2, pin_memory=False, drop_last=False, seed=1, epoch=epoch, rank=0
        )
        return torch.cat(batches(loader))

    first = draws(0)
    assert torch.equal(first, draws(0))
    assert not torch.equal(first, draws(1))
    assert not torch.equal(first[0:2], first[2:4])  # worker 0 and worker 1 draw different numbers


def test_loader_leaves_the_global_rng_alone() -> None:
    train, _, _ = build_datasets(DataConfig(name="synthetic", input_shape=[2], num_samples=20), seed=0)
    state = torch.get_rng_state()
    loader = make_loader(
        train,
        ResumableDistributedSampler(len(train), 1, 0, True, 0),
        4,
        num_workers=0,
        pin_memory=False,
        drop_last=True,
        seed=0,
        epoch=0,
        rank=0,
    )
    assert len(batches(loader)) == 4
    assert torch.equal(state, torch.get_rng_state())


def test_seed_worker_seeds_every_generator() -> None:
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        seed_worker(1, 2, 3, 0)
        first = (random.random(), np.random.rand(), float(torch.rand(())))
        seed_worker(1, 2, 3, 0)
        assert first == (random.random(), np.random.rand(), float(torch.rand(())))
        seed_worker(1, 2, 3, 1)
        assert first[0] != random.random()
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class NoisyAugment(PairDataset):
    """A dataset whose items draw random numbers, as augmentations do."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(3) + index, torch.tensor(index)


def test_random_augmentation_is_exact_across_worker_counts_and_resume() -> None:
    """With loader workers, a sample's random draws depend on (seed, epoch, index) only."""

    def items(num_workers: int, start: int) -> list[torch.Tensor]:
        sampler = ResumableDistributedSampler(40, 1, 0, True, seed=3)
        sampler.set_epoch(2)
        sampler.set_start(start)
        loader = make_loader(
            NoisyAugment(),
            sampler,
            4,
            num_workers=num_workers,
            pin_memory=False,
            drop_last=True,
            seed=3,
            epoch=2,
            rank=0,
        )
        return [x for batch, _ in loader for x in batch]

    straight = items(2, 0)
    assert all(torch.equal(a, b) for a, b in zip(items(1, 0), straight, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(items(2, 12), straight[12:], strict=True))


def test_relative_data_paths_reach_local_workers_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Train starts each worker in its own working directory, so a ``data.path`` relative to
    where ``trainforge train`` ran is made absolute before it is sent to a local Ray's workers."""
    from tests.helpers.runs import tiny_run
    from trainforge.config import Config
    from trainforge.driver.run import with_absolute_data_paths

    monkeypatch.chdir(tmp_path)
    config = tiny_run(tmp_path, data={"name": "imagefolder", "path": "pets", "val_path": "s3://b/val"})
    settings = Config.model_validate(config)
    data = with_absolute_data_paths(settings.to_dict())["data"]
    assert data["path"] == str(tmp_path / "pets")
    assert data["val_path"] == "s3://b/val"
    assert with_absolute_data_paths({"data": {"path": "/abs/x", "val_path": None}})["data"]["path"] == "/abs/x"
