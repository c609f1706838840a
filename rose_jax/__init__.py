"""rose-jax: trace, profile and overlap GPU-resident RL training without changing its results.

Submodules load on first use (``rose_jax.trace``, ``rose_jax.profile``, ``rose_jax.optimize``,
``rose_jax.mps``, ``rose_jax.runtime``), so ``import rose_jax`` stays cheap.
"""

import importlib

from rose_jax.program import COMPONENT_PREFIX, component

__version__ = "0.1.0"

_SUBMODULES = ("trace", "profile", "optimize", "mps", "runtime", "io", "cli")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"rose_jax.{name}")
    raise AttributeError(f"module 'rose_jax' has no attribute {name!r}")


__all__ = ["COMPONENT_PREFIX", "component", "__version__", *_SUBMODULES]
