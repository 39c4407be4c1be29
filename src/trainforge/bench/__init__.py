"""Benchmarks behind ``trainforge bench``: ``peers`` compares trainforge with the tools it builds on,
``checkpoint`` measures checkpoint I/O against the disk's own bandwidth, ``scaling`` what more
workers buy, and the others as ``trainforge bench --help`` lists them."""
