"""Benchmarks, GPU device scripts and diagnostics (a package so that `python -m bench.diag` finds its modules)."""
