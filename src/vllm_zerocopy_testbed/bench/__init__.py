"""Benchmarks: figures measured as ratios within one run."""
