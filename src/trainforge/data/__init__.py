"""Data sets by name, the DataSpec models are built from, and the resumable distributed sampler."""

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
    "build_datasets",
    "make_loader",
]
