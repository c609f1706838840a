"""rose-jax benchmarks: each script measures a baseline and rose-jax in the same run and prints ratios."""
