"""rose-jax benchmarks: the suite (:mod:`benchmarks.suite`) and the experiments (``benchmarks.experiments``).

Run everything from the repository root as ``python -m benchmarks....``; benchmarks/README.md lists
the commands and every committed result with the command that wrote it.
"""
