"""Data sets by name or from the user's factory, the DataSpec models are built from, training
augmentation and the resumable distributed sampler."""

from trainforge.data.factory import UserData, check_data_factory, is_ray_dataset, load_user_data
from trainforge.data.registry import SOURCES, SourceBuilder, build_datasets
from trainforge.data.sampler import ResumableDistributedSampler, make_loader
from trainforge.data.sources import PairDataset
from trainforge.data.spec import DataSpec

__all__ = [
    "SOURCES",
    "DataSpec",
    "PairDataset",
    "ResumableDistributedSampler",
    "SourceBuilder",
    "UserData",
    "build_datasets",
    "check_data_factory",
    "is_ray_dataset",
    "load_user_data",
    "make_loader",
]
