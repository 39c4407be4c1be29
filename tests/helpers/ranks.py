"""Local gloo ranks without Ray for tests (the same helper the benchmarks use)."""

from trainforge.bench.ranks import spawn_ranks

__all__ = ["spawn_ranks"]
