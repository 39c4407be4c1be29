"""Which samples each rank reads, in which order, and from where to pick up after a restart.

The order is a pure function of (seed, epoch, rank, world size), so a resumed run that skips the
samples it already consumed reads exactly what the uninterrupted run would have read.
"""

from __future__ import annotations

import functools
import multiprocessing
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from trainforge.data.sources import mix_seed
from trainforge.errors import DataError

# Loader workers are started by a fork server: a fresh single-threaded process that imports torch
# once and forks each worker. Forking the training process itself is unsafe inside Ray workers
# (their gRPC and core-worker threads may hold locks at fork time), and plain spawn re-imports
# torch in every worker at every epoch (seconds each, since workers are not persistent).
# "__main__" (Python's default preload) spares each worker from re-running the main module.
LOADER_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
FORKSERVER_PRELOAD = ["__main__", "torch", "trainforge.data"]


class ResumableDistributedSampler(Sampler[int]):
    """Indices for one rank of ``num_replicas``: every ``num_replicas``-th chunk of ``chunk``
    consecutive samples of a per-epoch order, from chunk ``rank`` on (``perm[rank::num_replicas]``
    for chunks of 1).

    The epoch's order is ``torch.randperm(dataset_size)`` from a generator seeded with
    ``seed + epoch`` (``arange`` without shuffle). With ``even`` (training) the order is first cut
    to a multiple of ``num_replicas`` x ``chunk`` so all ranks run the same number of steps;
    without it (validation, chunks of 1) the ranks together cover every sample exactly once, some
    one sample more. ``set_start`` skips samples this rank already read in the current epoch.

    Whatever the number of ranks, the ranks' first k x ``chunk`` samples together are the order's
    first k x ``chunk`` x ``num_replicas``, so a global batch is a block of the order; with chunks
    of one micro-batch, its micro-batches are the same on any number of ranks too.
    """

    def __init__(
        self,
        dataset_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        *,
        even: bool = True,
        chunk: int = 1,
    ) -> None:
        if dataset_size < 0:
            raise ValueError(f"dataset_size must be >= 0, got {dataset_size}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank {rank} of {num_replicas}")
        if chunk < 1 or (chunk > 1 and not even):
            raise ValueError(f"chunk must be >= 1, and 1 without even, got {chunk}")
        if even and dataset_size < num_replicas:
            raise DataError(
                f"the training set has {dataset_size} samples, fewer than the {num_replicas} workers that "
                "each need one: use more data or fewer workers (scaling.num_workers)"
            )
        self.dataset_size = dataset_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.even = even
        self.chunk = chunk
        self._epoch = 0
        self._start = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def start(self) -> int:
        """How many of this rank's samples of the current epoch are skipped."""
        return self._start

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order and go back to its first sample."""
        self._epoch = epoch
        self._start = 0

    def set_start(self, position: int) -> None:
        """Skip this rank's first ``position`` samples of the current epoch (mid-epoch resume)."""
        if not 0 <= position <= self.per_rank_size():
            raise ValueError(f"start position {position} is outside 0..{self.per_rank_size()} for this rank")
        self._start = position

    def per_rank_size(self) -> int:
        """Samples this rank reads in a full epoch."""
        if self.even:
            return self.dataset_size // (self.num_replicas * self.chunk) * self.chunk
        return max(0, (self.dataset_size - self.rank + self.num_replicas - 1) // self.num_replicas)

    def epoch_indices(self) -> list[int]:
        """This rank's full order for the current epoch, ignoring the start position."""
        if self.shuffle:
            order = torch.randperm(self.dataset_size, generator=torch.Generator().manual_seed(self.seed + self._epoch))
        else:
            order = torch.arange(self.dataset_size)
        if not self.even:
            return order[self.rank :: self.num_replicas].tolist()
        chunks = order[: self.dataset_size - self.dataset_size % (self.num_replicas * self.chunk)].view(-1, self.chunk)
        return chunks[self.rank :: self.num_replicas].flatten().tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices()[self._start :])

    def __len__(self) -> int:
        return self.per_rank_size() - self._start


def make_loader(
    dataset: Dataset[Any],
    sampler: Sampler[int],
    batch_size: int,
    *,
    num_workers: int,
    pin_memory: bool,
    drop_last: bool,
    seed: int,
    epoch: int,
    rank: int,
) -> DataLoader[Any]:
    """A DataLoader over ``sampler`` whose randomness, in every worker, depends only on (seed, epoch, rank).

    Build one per epoch: workers are not persistent, so each epoch's workers are seeded afresh.
    The explicit generator also keeps the loader from drawing on the global torch RNG, whose
    state a checkpoint restores.
    """
    options: dict[str, Any] = {"collate_fn": collate_of(dataset)}
    if num_workers > 0:
        # In loader workers, reseed per sample: what a sample's augmentation draws then depends
        # on (seed, epoch, index) alone, not on which worker loads it or where a resumed epoch
        # starts. (Without workers, the dataset draws from the training process's RNG, which
        # checkpoints save and restore, so resume is exact there too.)
        dataset = SampleSeeded(dataset, seed, epoch)
        context = multiprocessing.get_context(LOADER_START_METHOD)
        if LOADER_START_METHOD == "forkserver":
            context.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
        options = {
            "multiprocessing_context": context,
            "worker_init_fn": functools.partial(seed_worker, seed, epoch, rank),
        }
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        persistent_workers=False,
        generator=torch.Generator().manual_seed(mix_seed(seed, epoch, rank)),
        **options,
    )


def collate_of(dataset: Any) -> Callable[[list[Any]], Any]:
    """How a batch of ``dataset``'s samples is made: its own ``collate`` (a factory's custom samples,
    data/factory.py), else torch's ``default_collate``."""
    return getattr(dataset, "collate", None) or default_collate


class SampleSeeded(Dataset[Any]):
    """A dataset view that seeds python, numpy and torch from (seed, epoch, index) before each item."""

    def __init__(self, dataset: Dataset[Any], seed: int, epoch: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        value = mix_seed(self.seed, self.epoch, index)
        random.seed(value)
        np.random.seed(value % 2**32)
        torch.manual_seed(value)
        return self.dataset[index]


def seed_worker(seed: int, epoch: int, rank: int, worker_id: int) -> None:
    """Seed python ``random``, numpy and torch in a loader worker from (seed, epoch, rank, worker id)."""
    value = mix_seed(seed, epoch, rank, worker_id)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
