"""Running observation statistics (Welford), as Brax's ``acme.running_statistics``.

Three pure functions over a :class:`NormalizerState`, in float32::

    state = normalize.init(observation_size)
    state = normalize.update(state, obs_batch)   # obs_batch: (..., observation_size)
    obs_n = normalize.apply(state, obs)          # (obs - mean) / std

``update`` merges a whole batch at once (Chan et al.'s parallel Welford update), so the result
depends only on the data seen, not on how it was split into batches (up to float rounding).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

STD_MIN, STD_MAX = 1e-6, 1e6  # clip of the std, as Brax's running_statistics.update


@struct.dataclass
class NormalizerState:
    """Running mean / variance of vectors of shape ``shape``.

    ``count`` is an int32 sample count (exact up to 2**31 - 1 samples); ``summed_variance`` is
    the sum of squared deviations from the running mean (Welford's M2); ``std`` is cached so
    that ``apply`` costs one subtract and one divide.
    """

    count: jax.Array  # () int32
    mean: jax.Array  # shape, float32
    summed_variance: jax.Array  # shape, float32
    std: jax.Array  # shape, float32


def init(size: int | Sequence[int]) -> NormalizerState:
    """Statistics of nothing yet: mean 0, std 1 (so ``apply`` is the identity)."""
    shape = (size,) if isinstance(size, int) else tuple(size)
    if any((not isinstance(d, int)) or d <= 0 for d in shape):
        raise ValueError(f"normalize.init: size must be a positive int (or tuple of them), got {size!r}")
    zeros = jnp.zeros(shape, jnp.float32)
    return NormalizerState(
        count=jnp.zeros((), jnp.int32), mean=zeros, summed_variance=zeros, std=jnp.ones(shape, jnp.float32)
    )


def update(state: NormalizerState, batch_obs: jax.Array) -> NormalizerState:
    """Fold ``batch_obs`` (any leading axes, trailing axes = ``state.mean.shape``) into the statistics."""
    shape = state.mean.shape
    batch_obs = jnp.asarray(batch_obs, jnp.float32)
    if batch_obs.ndim < len(shape) or batch_obs.shape[batch_obs.ndim - len(shape) :] != shape:
        raise ValueError(
            f"normalize.update: batch_obs has shape {batch_obs.shape}, "
            f"expected (..., {', '.join(map(str, shape))})"
        )
    batch_axes = tuple(range(batch_obs.ndim - len(shape)))
    n = 1
    for d in batch_obs.shape[: len(batch_axes)]:
        n *= d
    count = state.count + n
    count_f = count.astype(jnp.float32)

    diff_old = batch_obs - state.mean
    mean = state.mean + jnp.sum(diff_old, axis=batch_axes) / count_f
    summed_variance = state.summed_variance + jnp.sum(diff_old * (batch_obs - mean), axis=batch_axes)
    summed_variance = jnp.maximum(summed_variance, 0.0)  # rounding can make it slightly negative
    std = jnp.clip(jnp.sqrt(summed_variance / count_f), STD_MIN, STD_MAX)
    return NormalizerState(count=count, mean=mean, summed_variance=summed_variance, std=std)


def apply(state: NormalizerState, obs: jax.Array, max_abs_value: float | None = None) -> jax.Array:
    """``(obs - mean) / std`` for ``obs`` of shape ``(..., *shape)``; clipped to ``±max_abs_value`` if set."""
    out = (obs - state.mean) / state.std
    if max_abs_value is not None:
        out = jnp.clip(out, -max_abs_value, max_abs_value)
    return out


__all__ = ["NormalizerState", "apply", "init", "update"]
