"""Data sets by name or from the user's factory, the DataSpec models are built from, training
augmentation and the resumable distributed sampler. ``registry.py`` holds every source."""

from trainforge.data.factory import UserData, check_data_factory, is_ray_dataset, load_user_data
from trainforge.data.registry import (
    MAP_STYLE,
    REGISTRY,
    Source,
    SourceBuilder,
    build_datasets,
    build_test_set,
    open_stream,
    source_of,
)
from trainforge.data.sampler import ResumableDistributedSampler, collate_of, make_loader
from trainforge.data.sources import PairDataset
from trainforge.data.spec import DataSpec

__all__ = [
    "MAP_STYLE",
    "REGISTRY",
    "DataSpec",
    "PairDataset",
    "ResumableDistributedSampler",
    "Source",
    "SourceBuilder",
    "UserData",
    "build_datasets",
    "build_test_set",
    "check_data_factory",
    "collate_of",
    "is_ray_dataset",
    "load_user_data",
    "make_loader",
    "open_stream",
    "source_of",
]
