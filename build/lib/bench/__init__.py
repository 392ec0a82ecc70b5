"""Benchmarks (shared BENCH.md): commands that print and save figures; never timed tests."""
