"""Experiments: one module per measurement, each run as ``python -m benchmarks.experiments.<name>``.

See benchmarks/README.md for what each one measures, its command and its results.
"""
