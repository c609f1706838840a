"""The jaxpr layer shared by the tracer, the profiler and the optimizer (no execution here).

* :mod:`rose_jax.jaxpr.compat`: every read of ``eqn.params`` and of jaxpr internals (JAX version
  differences live here and nowhere else);
* :mod:`rose_jax.jaxpr.dataflow`: forward / backward dataflow over one level's equations;
* :mod:`rose_jax.jaxpr.cut`: component paths, call inlining and cutting a jaxpr at component
  boundaries.
"""
