"""Image sources read from user files: CIFAR-10 in its standard layouts, and class-per-folder images.

User files are never unpickled with plain ``pickle.load``: the CIFAR-10 python batches go through
an unpickler that can rebuild numpy arrays and nothing else.
"""

from __future__ import annotations

import codecs
import importlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch

from trainforge.config import Cifar10Data, ImageFolderData
from trainforge.data.sources import Pair, PairDataset, Splits, require_path, split_indices, val_count
from trainforge.data.spec import DataSpec
from trainforge.errors import DataError, shown_names

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)  # per channel over the 50k training images
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"
CIFAR_LAYOUT = (
    "the folder holding cifar-10-batches-bin/ (data_batch_1.bin .. data_batch_5.bin, test_batch.bin) "
    "or cifar-10-batches-py/ (data_batch_1 .. data_batch_5, test_batch), or that folder itself"
)
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
FOLDER_LAYOUT = "a folder with train/<class>/*.png|jpg and optionally val/<class>/*.png|jpg"


# ---------------------------------------------------------------------------------------------
# CIFAR-10


class CifarImages(PairDataset):
    """CIFAR images kept as uint8 (a quarter of the float size), as float in [0, 1] per item.

    With ``normalize`` each item is also normalised by CIFAR-10's statistics; without, the batch
    augmenter (``data.augment``, data/augment.py) normalises after cropping and flipping, since a
    crop's padding is black in pixel space, not in normalised space.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, normalize: bool = True) -> None:
        self.images = images
        self.labels = labels
        self.normalize = normalize
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Pair:
        image = self.images[index].to(torch.float32).div_(255.0)
        if self.normalize:
            image = (image - self.mean) / self.std
        return image, self.labels[index]


def build_cifar10(cfg: Cifar10Data, seed: int) -> Splits:
    """The 50k training and 10k test images of CIFAR-10; the test batch is the validation set.

    ``seed`` and ``data.val_fraction`` are unused: the split is the data set's own. Items are
    normalised by CIFAR-10's mean and std, unless ``data.augment`` is set: then the augmenter
    normalises whole batches (with the same statistics by default, ``DataSpec.pixel_mean/std``).
    """
    folder, fmt = find_cifar_folder(require_path(cfg, CIFAR_LAYOUT))
    read = _read_cifar_bin if fmt == "bin" else _read_cifar_py
    suffix = ".bin" if fmt == "bin" else ""
    normalize = cfg.augment is None
    train = _concat([read(folder / f"{name}{suffix}") for name in CIFAR_TRAIN], normalize)
    val = _concat([read(folder / f"{CIFAR_TEST}{suffix}")], normalize)
    spec = DataSpec(
        kind="image",
        input_shape=(3, 32, 32),
        num_classes=10,
        train_size=len(train),
        val_size=len(val),
        pixel_mean=CIFAR_MEAN,
        pixel_std=CIFAR_STD,
    )
    return train, val, spec


def find_cifar_folder(root: Path) -> tuple[Path, str]:
    """The folder with a complete set of CIFAR-10 batches under ``root`` and its format."""
    candidates = [
        (root / "cifar-10-batches-bin", "bin"),
        (root / "cifar-10-batches-py", "py"),
        (root, "bin"),
        (root, "py"),
    ]
    closest: tuple[Path, list[str]] | None = None
    for folder, fmt in candidates:
        names = [f"{n}.bin" if fmt == "bin" else n for n in (*CIFAR_TRAIN, CIFAR_TEST)]
        missing = [n for n in names if not (folder / n).is_file()]
        if not missing:
            return folder, fmt
        if len(missing) < len(names) and (closest is None or len(missing) < len(closest[1])):
            closest = (folder, missing)
    if closest is not None:
        raise DataError(
            f"CIFAR-10 in {closest[0]} is incomplete, missing {', '.join(closest[1])}: data.path needs {CIFAR_LAYOUT}"
        )
    raise DataError(f"no CIFAR-10 files under {root}: data.path must be {CIFAR_LAYOUT}")


def _concat(parts: list[CifarImages], normalize: bool) -> CifarImages:
    return CifarImages(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]), normalize)


def _read_cifar_bin(path: Path) -> CifarImages:
    """Records of one label byte followed by 3072 image bytes in channel, row, column order."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % 3073:
        raise DataError(f"{path} is not a CIFAR-10 binary batch: its size is not a multiple of 3073-byte records")
    records = raw.reshape(-1, 3073)
    return _checked(path, records[:, 1:], records[:, 0])


def _read_cifar_py(path: Path) -> CifarImages:
    """A pickled dict with ``data`` (N x 3072 uint8) and ``labels`` (N ints), read safely."""
    try:
        with path.open("rb") as file:
            batch = ArrayUnpickler(file).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, LookupError, AttributeError) as err:
        raise DataError(f"{path} is not a CIFAR-10 python batch: {err}") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path} is not a CIFAR-10 python batch: it holds a {type(batch).__name__}, not a dict")
    data = batch.get("data", batch.get(b"data"))
    labels = batch.get("labels", batch.get(b"labels"))
    if not isinstance(data, np.ndarray) or labels is None:
        raise DataError(f"{path} is not a CIFAR-10 python batch: it has no 'data' array and 'labels' list")
    return _checked(path, data, np.asarray(labels))


def _checked(path: Path, data: np.ndarray, labels: np.ndarray) -> CifarImages:
    shape_ok = data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072
    if not shape_ok or labels.ndim != 1 or len(labels) != len(data) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"{path} is not a CIFAR-10 batch: expected N x 3072 uint8 images and N integer labels, "
            f"got {data.dtype} {tuple(data.shape)} images and {labels.dtype} {tuple(labels.shape)} labels"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path} has labels outside 0-9: is it CIFAR-100? Only CIFAR-10 is supported")
    images = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, 3, 32, 32).copy())
    return CifarImages(images, torch.from_numpy(labels.astype(np.int64)))


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """How protocol-2 pickles from Python 3 rebuild bytes; any other codec is refused."""
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"codec {encoding!r} is not allowed")
    return codecs.encode(text, "latin1")


def _allowed_globals() -> dict[tuple[str, str], Callable[..., Any]]:
    """The callables a pickled numpy array refers to, under numpy 1 and numpy 2 module names."""
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")  # numpy 2
        numeric = importlib.import_module("numpy._core.numeric")
    except ImportError:
        multiarray = importlib.import_module("numpy.core.multiarray")
        numeric = importlib.import_module("numpy.core.numeric")
    allowed: dict[tuple[str, str], Callable[..., Any]] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }
    for package in ("numpy.core", "numpy._core"):
        allowed[(f"{package}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{package}.numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


class ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays; any other global is an UnpicklingError."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, encoding="latin1")  # latin1 rebuilds arrays pickled by Python 2
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only numpy arrays are allowed") from None


# ---------------------------------------------------------------------------------------------
# Image folders


class FolderImages(PairDataset):
    """Image files decoded on access to float32 RGB (3, H, W) in [0, 1].

    ``size`` is (width, height). With ``resize`` every image is resized to it; without, every
    image must already have it.
    """

    def __init__(self, paths: list[str], labels: list[int], size: tuple[int, int], resize: bool) -> None:
        self.paths = paths
        self.labels = labels
        self.size = size
        self.resize = resize

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Pair:
        from PIL import Image, UnidentifiedImageError

        path = self.paths[index]
        try:
            with Image.open(path) as img:
                if img.size != self.size and not self.resize:
                    raise DataError(
                        f"{path} is {img.size[0]}x{img.size[1]} but the first image is {self.size[0]}x{self.size[1]}: "
                        "set data.image_size to resize all images to one size"
                    )
                rgb = img.convert("RGB")
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"cannot read image {path}: {err}") from None
        if rgb.size != self.size:
            rgb = rgb.resize(self.size, Image.Resampling.BILINEAR)
        pixels = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
        return pixels.to(torch.float32).div_(255.0), torch.tensor(self.labels[index], dtype=torch.int64)


def build_imagefolder(cfg: ImageFolderData, seed: int) -> Splits:
    """Images under ``data.path/train/<class>/`` (classes sorted by name) and ``val/`` if present.

    Without a ``val`` folder, ``data.val_fraction`` of the training images validate, chosen by a
    fixed permutation (not ``seed``) so the split is the same in every run.
    """
    try:
        from PIL import Image
    except ImportError:
        raise DataError("data.name imagefolder needs Pillow: pip install pillow") from None
    root = require_path(cfg, FOLDER_LAYOUT)
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise DataError(f"{train_dir} does not exist: data.path must be {FOLDER_LAYOUT}")
    classes = sorted(d.name for d in train_dir.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"{train_dir} has no class folders: data.path must be {FOLDER_LAYOUT}")
    paths, labels = _scan(train_dir, classes)
    present = set(labels)
    empty = [name for label, name in enumerate(classes) if label not in present]
    if empty:
        raise DataError(
            f"class folders without .png/.jpg images in {train_dir}: {shown_names(empty)}; add images or remove them"
        )

    if cfg.image_size is not None:
        size, resize = (cfg.image_size, cfg.image_size), True
    else:
        with Image.open(paths[0]) as first:
            size, resize = first.size, False

    val_dir = root / "val"
    if val_dir.is_dir():
        val_paths, val_labels = _scan(val_dir, classes)
        if not val_paths:
            raise DataError(
                f"{val_dir} has no images: add val/<class>/ images or remove {val_dir} to split off data.val_fraction"
            )
        train = FolderImages(paths, labels, size, resize)
        val: FolderImages | None = FolderImages(val_paths, val_labels, size, resize)
    else:
        train_idx, val_idx = split_indices(len(paths), val_count(len(paths), cfg.val_fraction, str(train_dir)))
        train = FolderImages([paths[i] for i in train_idx], [labels[i] for i in train_idx], size, resize)
        val = (
            FolderImages([paths[i] for i in val_idx], [labels[i] for i in val_idx], size, resize)
            if len(val_idx)
            else None
        )
    spec = DataSpec(
        kind="image",
        input_shape=(3, size[1], size[0]),
        num_classes=len(classes),
        train_size=len(train),
        val_size=len(val) if val is not None else 0,
    )
    return train, val, spec


def imagefolder_test(cfg: ImageFolderData, seed: int) -> PairDataset:
    """The held-out images under ``data.path/test/<class>/``, by the training folder's classes and
    at its image size (neither training nor validation reads them)."""
    train = cast(FolderImages, build_imagefolder(cfg, seed)[0])
    root = require_path(cfg, FOLDER_LAYOUT)
    test_dir = root / "test"
    if not test_dir.is_dir():
        raise DataError(f"data.name imagefolder has no test split: add {test_dir}/<class>/ images to evaluate one")
    classes = sorted(d.name for d in (root / "train").iterdir() if d.is_dir() and not d.name.startswith("."))
    paths, labels = _scan(test_dir, classes)
    if not paths:
        raise DataError(f"{test_dir} has no images: add test/<class>/ images")
    return FolderImages(paths, labels, train.size, train.resize)


def _scan(split_dir: Path, classes: list[str]) -> tuple[list[str], list[int]]:
    """Sorted image paths under ``split_dir/<class>/`` (recursively) and their class numbers."""
    extra = sorted(
        d.name for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name not in classes
    )
    if extra:
        raise DataError(f"{split_dir} has class folders that train/ lacks: {shown_names(extra)}")
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        found = sorted(p for p in (split_dir / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        paths.extend(str(p) for p in found)
        labels.extend([label] * len(found))
    return paths, labels
