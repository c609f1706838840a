"""The benchmark suite: each row times Brax, our single-jit loop, a hand pipeline and rose-jax.

* :mod:`benchmarks.suite.workloads` -- rows (:class:`~benchmarks.suite.workloads.Workload`), the
  named suites (``tiny``, ``quick``, ``epoch``, ``full``) and the device-time cost model;
* :mod:`benchmarks.suite.baselines` -- the variants rose-jax is measured against: (a) Brax's own
  trainers, (b) the single-jit loop, (c) the hand-written env-group pipeline;
* :mod:`benchmarks.suite.run` -- the runner (``python -m benchmarks.suite.run --suite quick``);
* :mod:`benchmarks.suite.report` -- Markdown, plot and the README block from the results JSON
  (``python -m benchmarks.suite.report --readme``).
"""
