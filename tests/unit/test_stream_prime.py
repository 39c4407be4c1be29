"""``StreamFeed.prime``: the first epoch's stream starts while the model is built, and a run that
starts elsewhere gets exactly the batches it would have got unprimed. Real Ray Data iterators."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trainforge.config import ParquetData
from trainforge.data.spec import DataSpec
from trainforge.data.stream import StreamFeed, StreamShape

ROWS = 96
MICRO = 8


@pytest.fixture(scope="module")
def dataset(ray_local: None) -> Any:
    import ray.data

    # In order, as the driver's datasets are (data/stream.py's ordered_split_config): each epoch
    # streams the same sequence.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    return ray.data.from_items([{"input": [float(i), float(-i)], "target": i} for i in range(ROWS)])


def feed(dataset: Any, shuffle_buffer: int = 0) -> StreamFeed:
    spec = DataSpec("image", (2,), num_classes=ROWS)
    cfg = ParquetData(path="unused", shuffle=shuffle_buffer > 0, shuffle_buffer=shuffle_buffer or 1000)
    shape = StreamShape("test", ROWS, 0, spec)
    return StreamFeed(shape, dataset.iterator(), None, cfg, seed=3, rank=0, world=1)


def targets(batches: Iterator[list[Any]]) -> list[list[int]]:
    return [batch[1].tolist() for batch in batches]


@pytest.mark.parametrize("shuffle_buffer", [0, 32])
@pytest.mark.parametrize(("epoch", "position"), [(0, 0), (0, 24), (1, 0), (2, 40)])
def test_a_primed_feed_gives_the_batches_an_unprimed_one_gives(
    dataset: Any, shuffle_buffer: int, epoch: int, position: int
) -> None:
    expected = targets(feed(dataset, shuffle_buffer).train_batches(epoch, position, MICRO, pin_memory=False))
    primed = feed(dataset, shuffle_buffer)
    primed.prime(MICRO, pin_memory=False)
    got = targets(primed.train_batches(epoch, position, MICRO, pin_memory=False))
    assert got == expected
    assert len(got) == (ROWS - position) // MICRO
    assert primed.primed is None  # taken (epoch 0) or dropped (a later epoch): never reused
    if shuffle_buffer:
        assert got != [list(range(i, i + MICRO)) for i in range(position, ROWS, MICRO)]  # it did shuffle


def test_the_primed_epoch_is_fetching_before_the_batches_are_asked_for(dataset: Any) -> None:
    primed = feed(dataset)
    primed.prime(MICRO, pin_memory=False)
    assert primed.primed is not None
    primed.primed.thread.join(timeout=120)  # the first batch arrives without anyone asking for it
    assert not primed.primed.thread.is_alive()
    (first,) = primed.primed.first
    assert first[1].tolist() == list(range(MICRO)) and first[0].dtype == torch.float64
    assert targets(primed.train_batches(0, 0, MICRO, pin_memory=False))[0] == list(range(MICRO))


def test_a_failure_while_priming_is_raised_where_the_batches_are_taken(dataset: Any) -> None:
    broken = dataset.map(lambda row: {"input": row["input"], "target": 1 // (row["target"] - row["target"])})
    primed = feed(broken)
    primed.prime(MICRO, pin_memory=False)
    with pytest.raises(Exception, match=r"ZeroDivisionError|division by zero"):
        next(primed.train_batches(0, 0, MICRO, pin_memory=False))
