"""The MPS experiment: SM-quota rates, driver <-> worker transfers and the quota search on one GPU.

Run it as ``python -m benchmarks.experiments.mps`` (see :mod:`benchmarks.experiments.mps.__main__`).
Modules: ``harness`` (sizes, clock, budget, pools, daemons), one module per phase (``rates``,
``transfer``, ``quota_search``), each with its measurement, its Markdown section and its summary.
"""
