"""The thin programmable interface: mark components so the tracer can find them in the jaxpr.

``component(name)`` is a ``jax.named_scope`` whose name carries the prefix ``rose:``; every
equation traced inside it has ``rose:<name>`` in ``eqn.source_info.name_stack``, also inside
scan / while / cond bodies and under jit, grad and vmap. It works as a context manager and as
a decorator::

    with rose_jax.component("sim"):
        env_state = jax.vmap(env.step)(env_state, action)

    @rose_jax.component("policy")
    def act(params, obs): ...

Marking changes nothing in the computation: it only names it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import jax

COMPONENT_PREFIX = "rose:"


class component(contextlib.ContextDecorator):  # noqa: N801 - reads like jax.named_scope
    """Mark the enclosed computation as the component ``name`` (context manager or decorator)."""

    def __init__(self, name: str):
        if not name or not isinstance(name, str) or "/" in name or ":" in name:
            raise ValueError(f"component name must be a non-empty string without '/' or ':', got {name!r}")
        self.name = name
        self._scope = None

    def __enter__(self):
        self._scope = jax.named_scope(COMPONENT_PREFIX + self.name)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc):
        scope, self._scope = self._scope, None
        return scope.__exit__(*exc)

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with component(self.name):
                return fn(*args, **kwargs)

        return wrapped
