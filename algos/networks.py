"""Flax networks and the tanh-squashed Gaussian used by PPO and SAC.

All modules are plain ``flax.linen`` modules; parameters live in the algorithms' TrainState.
Shapes: ``obs`` is ``(..., observation_size)``; actions are ``(..., action_size)`` in [-1, 1].
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

LOG_2 = 0.6931471805599453


class MLP(nn.Module):
    """A multilayer perceptron: ``hidden_sizes`` layers with ``activation``, then a linear output."""

    hidden_sizes: Sequence[int]
    output_size: int
    activation: str = "swish"
    final_scale: float = 1.0  # scale of the last layer's lecun init (small for policy heads)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = getattr(nn, self.activation)
        for i, size in enumerate(self.hidden_sizes):
            x = act(nn.Dense(size, kernel_init=nn.initializers.lecun_uniform(), name=f"hidden_{i}")(x))
        init = nn.initializers.variance_scaling(self.final_scale, "fan_in", "uniform")
        return nn.Dense(self.output_size, kernel_init=init, name="out")(x)


class TwinQ(nn.Module):
    """Two independent Q-networks ``Q_i(obs, action)``; returns ``(..., 2)``."""

    hidden_sizes: Sequence[int]
    activation: str = "swish"

    @nn.compact
    def __call__(self, obs: jax.Array, action: jax.Array) -> jax.Array:
        x = jnp.concatenate([obs, action], axis=-1)
        q = [MLP(self.hidden_sizes, 1, self.activation, name=f"q_{i}")(x)[..., 0] for i in range(2)]
        return jnp.stack(q, axis=-1)


class TanhGaussian(NamedTuple):
    """A diagonal Gaussian over pre-tanh actions; ``loc``/``scale`` are ``(..., action_size)``."""

    loc: jax.Array
    scale: jax.Array


def tanh_gaussian(logits: jax.Array, min_std: float = 1e-3) -> TanhGaussian:
    """Split a ``(..., 2 * action_size)`` head into loc and a softplus scale (Brax's normal_tanh)."""
    loc, raw_scale = jnp.split(logits, 2, axis=-1)
    return TanhGaussian(loc, jax.nn.softplus(raw_scale) + min_std)


def sample_raw(dist: TanhGaussian, key: jax.Array) -> jax.Array:
    """A pre-tanh sample ``u``; the action is ``tanh(u)``."""
    return dist.loc + dist.scale * jax.random.normal(key, dist.loc.shape, dist.loc.dtype)


def _log_det_jacobian(raw: jax.Array) -> jax.Array:
    # log |d tanh(u)/du| = 2 (log 2 - u - softplus(-2u)), numerically stable.
    return 2.0 * (LOG_2 - raw - jax.nn.softplus(-2.0 * raw))


def log_prob(dist: TanhGaussian, raw: jax.Array) -> jax.Array:
    """``log pi(tanh(u))`` summed over action dims, for a pre-tanh sample ``u``: shape ``(...)``."""
    z = (raw - dist.loc) / dist.scale
    normal = -0.5 * z**2 - jnp.log(dist.scale) - 0.5 * jnp.log(2.0 * jnp.pi)
    return jnp.sum(normal - _log_det_jacobian(raw), axis=-1)


def entropy(dist: TanhGaussian, key: jax.Array) -> jax.Array:
    """Single-sample entropy estimate of the squashed distribution (as Brax does): shape ``(...)``."""
    gaussian = jnp.sum(0.5 + 0.5 * jnp.log(2.0 * jnp.pi) + jnp.log(dist.scale), axis=-1)
    return gaussian + jnp.sum(_log_det_jacobian(sample_raw(dist, key)), axis=-1)


def mode(dist: TanhGaussian) -> jax.Array:
    """The deterministic action ``tanh(loc)``."""
    return jnp.tanh(dist.loc)
