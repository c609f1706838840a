"""Shim for Brax 0.14.2 on JAX >= 0.11, where ``jax.device_put_replicated`` was removed.

Used only by benchmarks that run Brax's own ``ppo.train`` / ``sac.train`` as a baseline. It restores
the removed function with its old meaning (a leading device axis, one copy per device), which is
what ``jax.pmap`` consumes; nothing else in Brax is changed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def install() -> None:
    if not hasattr(jax, "device_put_replicated"):

        def device_put_replicated(x, devices):
            n = len(devices)
            return jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a)[None], (n,) + jnp.shape(a)), x)

        jax.device_put_replicated = device_put_replicated
