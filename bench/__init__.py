"""Benchmarks: plain scripts that print figures (they never assert timings).

Run one with ``python -m bench.<name> [--device cpu|cuda] [--quick]`` from the
repository root, or all of them with ``python -m bench.run_all``. Results and the
commands that produced them are in ``docs/benchmarks.md``.
"""
