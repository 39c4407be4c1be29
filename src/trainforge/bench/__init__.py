"""Benchmarks behind ``trainforge bench``: ``peers`` compares trainforge with the tools it builds on."""
