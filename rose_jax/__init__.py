"""rose-jax: trace, profile and overlap GPU-resident RL training without changing its results."""

from rose_jax.program import COMPONENT_PREFIX, component

__version__ = "0.1.0"

__all__ = ["COMPONENT_PREFIX", "component", "__version__"]
