"""The data component (``data``): where a rank's batches come from and where it stands in them.

Its state is the position in the data (epoch, samples this rank consumed in the epoch), re-split
when the number of workers changed (exactly when ``train.global_batch_size`` holds the global
batch: ``DataSource.resized``), and the micro-batch size and accumulation steps it hands out
(chosen at the start of the run under ``train.batch_size: auto``, and lowered after an
out-of-memory step: ``worker/autobatch.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, Field
from torch.utils.data import DataLoader

from trainforge.checkpoint.schema import MAX_RANKS, MAX_STEP
from trainforge.checkpoint.state import State
from trainforge.config import MAX_BATCH, Config
from trainforge.data import ResumableDistributedSampler, build_datasets, make_loader
from trainforge.data.spec import DataSpec
from trainforge.data.stream import StreamEpoch, StreamFeed
from trainforge.errors import ConfigError, DataError
from trainforge.worker.components.base import Component, Restore, StateSchema

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun


class DataPosition(StateSchema):
    epoch: Annotated[int, Field(ge=0, le=MAX_STEP)]
    position: Annotated[int, Field(ge=0, le=2**62)]  # samples each rank consumed in the epoch
    world_size: Annotated[int, Field(ge=1, le=MAX_RANKS)]  # the data-parallel ranks it was split over
    micro_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] | None = None
    grad_accum_steps: Annotated[int, Field(ge=1, le=MAX_BATCH)] | None = None
    chunk: Annotated[int, Field(ge=1, le=MAX_BATCH)] | None = None  # the sampler's (left out: 1)


@dataclass
class DataSource(Component):
    """One rank's training and validation data. The same (epoch, position) gives the same next
    batch, on any restart: the position is all a checkpoint needs to resume mid-epoch."""

    name: ClassVar[str] = "data"
    schema: ClassVar[type[BaseModel]] = DataPosition

    train_set: Any  # a map-style data set, or the rank's Ray Data shard of a streamed one
    val_set: Any
    spec: DataSpec
    sampler: ResumableDistributedSampler | None  # map-style sets only
    steps_per_epoch: int
    config: Config
    rank: int
    world: int
    pin_memory: bool
    # The micro-batch a step is made of, ``accum`` of them: micro_batch x accum is this rank's share
    # of the global batch, fixed for the run; auto batch size changes the split, never the product.
    micro_batch: int = 0
    accum: int = 1
    # Where the split came from: config, or under auto batch size pending (not chosen yet), search,
    # checkpoint (a resume reuses the choice).
    batch_from: str = "config"
    # Where the source stands: the epoch and the samples this rank consumed in it.
    epoch: int = 0
    position: int = 0
    # Streamed sources (data/stream.py: parquet, images, jsonl): the rank's Ray Data shards.
    feed: StreamFeed | None = None

    @classmethod
    def build(
        cls, config: Config, rank: int, world: int, *, pin_memory: bool, feed: StreamFeed | None = None
    ) -> DataSource:
        sampler: ResumableDistributedSampler | None = None
        if feed is not None:
            train_set, val_set, spec = feed.train, feed.val, feed.shape.spec
            per_rank = feed.per_rank_size()
        else:
            train_set, val_set, spec = build_datasets(config.data, config.seed)
            sampler = ResumableDistributedSampler(
                len(train_set), world, rank, config.data.shuffle, config.seed, even=True, chunk=sample_chunk(config)
            )
            per_rank = sampler.per_rank_size()
        micro, accum = configured_split(config, world)
        per_step = micro * accum
        steps_per_epoch = per_rank // per_step
        if steps_per_epoch == 0:
            what = (
                "train.global_batch_size / workers"
                if config.train.global_batch_size is not None
                else "train.batch_size x train.grad_accum_steps"
            )
            raise DataError(
                f"{what} = {per_step} exceeds the {per_rank} "
                f"training samples each of {world} workers gets; lower the batch size or use fewer workers"
            )
        batch_from = "pending" if config.train.auto_batch else "config"
        return cls(
            train_set,
            val_set,
            spec,
            sampler,
            steps_per_epoch,
            config,
            rank,
            world,
            pin_memory,
            micro,
            accum,
            batch_from,
            feed=feed,
        )

    @classmethod
    def from_run(cls, run: WorkerRun) -> DataSource:
        return run.data

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch * self.accum

    def split(self, micro_batch: int) -> None:
        """Steps of ``micro_batch`` samples, as many as this rank's share of the global batch needs
        (a divisor of it: the global batch never changes)."""
        per_step = self.samples_per_step
        if micro_batch < 1 or per_step % micro_batch:
            raise ValueError(f"micro-batch {micro_batch} does not divide the {per_step} samples of a step")
        self.micro_batch, self.accum = micro_batch, per_step // micro_batch

    @property
    def epoch_samples(self) -> int:
        """Samples this rank consumes in a full epoch (whole steps only)."""
        return self.steps_per_epoch * self.samples_per_step

    def batches(self) -> Iterator[Sequence[torch.Tensor]]:
        """The training batches from the current position to the end of the epoch."""
        if self.feed is not None:
            return self.feed.train_batches(self.epoch, self.position, self.micro_batch, pin_memory=self.pin_memory)
        assert self.sampler is not None
        self.sampler.set_epoch(self.epoch)
        self.sampler.set_start(self.position)
        cfg = self.config
        loader = make_loader(
            self.train_set,
            self.sampler,
            self.micro_batch,
            num_workers=cfg.data.num_workers,
            pin_memory=self.pin_memory,
            drop_last=True,
            seed=cfg.seed,
            epoch=self.epoch,
            rank=self.rank,
        )
        return iter(loader)

    def val_batches(self) -> DataLoader[Any] | StreamEpoch | None:
        """This rank's disjoint share of the validation set, every sample once over all ranks
        (streamed: an equal share each, the remainder of fewer rows than ranks left out)."""
        if self.feed is not None:
            return self.feed.val_batches(self.micro_batch)
        if self.val_set is None:
            return None
        return self.shard_batches(self.val_set, self.rank)

    def shard_batches(self, dataset: Any, rank: int) -> DataLoader[Any]:
        """Data-parallel rank ``rank``'s disjoint share of a map-style evaluation set, in this
        rank's micro-batches: what that rank's validation reads (``trainforge evaluate`` reads
        every rank's in one process, so its sums are the run's)."""
        cfg = self.config
        sampler = ResumableDistributedSampler(len(dataset), self.world, rank, False, cfg.seed, even=False)
        return make_loader(
            dataset,
            sampler,
            self.micro_batch,
            num_workers=cfg.data.num_workers,
            pin_memory=self.pin_memory,
            drop_last=False,
            seed=cfg.seed,
            epoch=0,
            rank=rank,
        )

    def advance(self) -> None:
        """One optimizer step's samples consumed."""
        self.position += self.samples_per_step

    @property
    def epoch_done(self) -> bool:
        return self.position >= self.epoch_samples

    def finish_epoch(self) -> None:
        """The rest of the epoch is skipped (a loader that ran dry early)."""
        self.position = self.epoch_samples

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> State:
        chunk = self.sampler.chunk if self.sampler is not None else 1
        return State(
            {
                "epoch": self.epoch,
                "position": self.position,
                "world_size": self.world,
                "micro_batch_size": self.micro_batch,
                "grad_accum_steps": self.accum,
                **({"chunk": chunk} if chunk > 1 else {}),
            }
        )

    def load_state_dict(self, state: State, restore: Restore) -> None:
        """Where the checkpoint stood; written by another number of data-parallel ranks, the same
        global position split over this many, in whole steps: exact when the global batch held
        (``train.global_batch_size``), else rounded down (see ``resized``). Under auto batch size,
        the checkpoint's micro-batch when it still splits this rank's step."""
        saved = DataPosition.model_validate(state.values)
        position, writers = saved.position, saved.world_size
        self.keep_chunk(saved.chunk or 1, saved.epoch, restore)
        if writers != self.world:
            position = position * writers // self.world // self.samples_per_step * self.samples_per_step
            restore.notes.append(self.resized(saved))
        self.epoch, self.position = saved.epoch, position
        micro = saved.micro_batch_size
        if self.config.train.auto_batch and micro and writers == self.world and self.samples_per_step % micro == 0:
            self.split(micro)
            self.batch_from = "checkpoint"

    def keep_chunk(self, chunk: int, epoch: int, restore: Restore) -> None:
        """The sampler's chunk the checkpoint's run read by: the layout of a run's samples stays
        its first start's (a changed ``train.batch_size`` too) while it still splits a step."""
        sampler = self.sampler
        if sampler is None or chunk == sampler.chunk:
            return
        if self.samples_per_step % chunk == 0:
            sampler.chunk = chunk
            steps = sampler.per_rank_size() // self.samples_per_step
            assert steps == self.steps_per_epoch, (steps, self.steps_per_epoch)  # floor(N / global batch) for both
        else:
            restore.notes.append(
                f"the checkpoint's samples were laid out in chunks of {chunk}, which do not split this run's "
                f"{self.samples_per_step} samples per worker and step: the rest of epoch {epoch} may read "
                "samples twice or not at all"
            )

    def resized(self, saved: DataPosition) -> str:
        """What a resume on another number of data-parallel ranks keeps of the epoch's samples.

        Rank r reads chunks r, r + world, ... of the epoch's order (data/sampler.py), so step s of
        any world size reads the block ``perm[s*G:(s+1)*G]`` of the global batch G: with G
        unchanged the steps read the same samples. A changed G rounds the position down to whole steps: up to one step's
        samples are read again, none is skipped. A streamed source deals its rows to the ranks by
        their number, so the rest of the epoch is not the uninterrupted run's."""
        now, had = self.samples_per_step * self.world, None
        if saved.micro_batch_size and saved.grad_accum_steps:
            had = saved.micro_batch_size * saved.grad_accum_steps * saved.world_size
        ranks = f"{saved.world_size} -> {self.world} data-parallel workers"
        if self.feed is not None:
            return (
                f"{ranks}: data.name {self.config.data.name} deals its rows to the workers by their number, so "
                f"the rest of epoch {saved.epoch} may read rows twice or not at all; later epochs are whole"
            )
        if had == now:
            split = (
                f"{self.samples_per_step} per worker, split by batch size auto"
                if self.config.train.auto_batch
                else f"{self.accum} accumulation steps of {self.micro_batch} per worker"
            )
            return (
                f"{ranks}: the global batch of {now} samples holds ({split}), so every step reads the samples "
                "the uninterrupted run reads"
            )
        return (
            f"{ranks}: the global batch changed from {had or 'an unknown size'} to {now} samples (set "
            f"train.global_batch_size to hold it), so the rest of epoch {saved.epoch} may read up to one step's "
            "samples again"
        )


def sample_chunk(config: Config) -> int:
    """How many consecutive samples of the epoch's order a rank reads at a time: one micro-batch
    when ``train.global_batch_size`` holds a fixed ``train.batch_size``'s global batch, so a
    resize keeps the micro-batches too (BatchNorm's batch statistics, per-micro-batch means);
    else 1 (auto batch size changes its micro-batch during a run)."""
    train = config.train
    if train.global_batch_size is None or train.batch_size == "auto":
        return 1
    return train.batch_size


def configured_split(config: Config, world: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for ``world`` data-parallel ranks, as configured or derived
    from ``train.global_batch_size`` (config/schema.py ``TrainConfig.split``): re-derived at every
    start, so a resume on fewer ranks accumulates more and the global batch holds. Under auto batch
    size, this rank's whole share in one micro-batch until the search (``worker/autobatch.py``)
    splits it."""
    try:
        return config.train.split(world, f"the {world} data-parallel workers")
    except ValueError as err:
        raise ConfigError(str(err)) from None
