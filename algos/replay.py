"""A device-resident replay buffer: a pytree ring buffer with uniform sampling.

A factory returning a NamedTuple of pure functions, like optax's transforms::

    buffer = replay.uniform(capacity, example_transition)
    state = buffer.init()                          # BufferState, all zeros, size 0
    state = buffer.insert(state, batch)            # batch: example's pytree with a leading (B,) axis
    batch = buffer.sample(state, key, batch_size)  # (batch_size, ...) drawn uniformly from filled slots

Every leaf of ``state.data`` is ``(capacity, *leaf_shape)``. ``insert`` writes slot
``(position + i) % capacity`` for the ``i``-th element of the batch (the oldest entries are
overwritten once the buffer is full); ``sample`` draws indices uniformly with replacement from
``[0, size)``. All three functions are jittable and carry no hidden state, so a buffer lives in
a TrainState and is donated with it. Unlike Brax's queue (which rolls the whole array when it is
full), an insert touches only the written slots.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class BufferState:
    """The contents of a ring buffer.

    data: the example transition's pytree, every leaf with a leading ``(capacity,)`` axis.
    position: () int32, the slot the next insert writes first, in ``[0, capacity)``.
    size: () int32, the number of filled slots, in ``[0, capacity]``.
    """

    data: Any
    position: jax.Array
    size: jax.Array


class Buffer(NamedTuple):
    """Pure functions over a :class:`BufferState` (see the module docstring)."""

    init: Callable[[], BufferState]
    insert: Callable[[BufferState, Any], BufferState]
    sample: Callable[[BufferState, jax.Array, int], Any]
    capacity: int


def _leaf_specs(example: Any) -> tuple[Any, list[jax.ShapeDtypeStruct], list[str]]:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(example)
    specs = [jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype) for _, x in with_paths]
    names = [jax.tree_util.keystr(path) or "<root>" for path, _ in with_paths]
    return treedef, specs, names


def uniform(capacity: int, example_transition: Any) -> Buffer:
    """A FIFO ring buffer of ``capacity`` transitions shaped like ``example_transition``.

    Args:
      capacity: number of transitions kept (> 0).
      example_transition: one transition (any pytree of arrays or scalars, no batch axis); only
        its structure, shapes and dtypes are used.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
        raise ValueError(f"replay.uniform: capacity must be a positive int, got {capacity!r}")
    capacity = int(capacity)
    treedef, specs, names = _leaf_specs(example_transition)
    if not specs:
        raise ValueError("replay.uniform: example_transition has no array leaves")

    def init() -> BufferState:
        data = jax.tree.unflatten(treedef, [jnp.zeros((capacity, *s.shape), s.dtype) for s in specs])
        return BufferState(data=data, position=jnp.zeros((), jnp.int32), size=jnp.zeros((), jnp.int32))

    def _check_batch(batch: Any) -> tuple[list[jax.Array], int]:
        leaves, batch_treedef = jax.tree.flatten(batch)
        if batch_treedef != treedef:
            raise ValueError(
                f"replay.insert: batch structure {batch_treedef} does not match the example's {treedef}"
            )
        sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
        if None in sizes or len(sizes) != 1:
            raise ValueError(
                f"replay.insert: every leaf needs the same leading batch axis, got shapes "
                f"{[tuple(np.shape(x)) for x in leaves]}"
            )
        out = []
        for x, s, name in zip(leaves, specs, names, strict=True):
            if tuple(np.shape(x)[1:]) != s.shape:
                raise ValueError(
                    f"replay.insert: leaf {name} has shape {tuple(np.shape(x))}, expected (batch, "
                    f"{', '.join(map(str, s.shape))}) as in the example transition"
                )
            dtype = jnp.asarray(x).dtype
            if jnp.issubdtype(dtype, jnp.floating) != jnp.issubdtype(s.dtype, jnp.floating):
                raise ValueError(f"replay.insert: leaf {name} has dtype {dtype}, the example has {s.dtype}")
            out.append(jnp.asarray(x, s.dtype))
        return out, sizes.pop()

    def insert(state: BufferState, batch: Any) -> BufferState:
        """Append ``batch`` (leading axis B) at ``state.position``, wrapping around; returns the new state."""
        leaves, n = _check_batch(batch)
        if n == 0:
            return state
        start = state.position
        if n > capacity:  # only the last `capacity` elements survive a sequential insert
            leaves = [x[n - capacity :] for x in leaves]
            start = (start + (n - capacity)) % capacity
            n = capacity
        idx = (start + jnp.arange(n, dtype=jnp.int32)) % capacity
        data_leaves = jax.tree.leaves(state.data)
        new_leaves = [
            d.at[idx].set(x, indices_are_sorted=False, unique_indices=True, mode="promise_in_bounds")
            for d, x in zip(data_leaves, leaves, strict=True)
        ]
        return BufferState(
            data=jax.tree.unflatten(treedef, new_leaves),
            position=((start + n) % capacity).astype(jnp.int32),
            size=jnp.minimum(state.size + n, capacity).astype(jnp.int32),
        )

    def sample(state: BufferState, key: jax.Array, batch_size: int) -> Any:
        """``batch_size`` transitions drawn uniformly with replacement from the filled slots.

        Each leaf comes back as ``(batch_size, *leaf_shape)``. On an empty buffer it returns
        zeros (a jitted function cannot raise): insert before sampling.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ValueError(f"replay.sample: batch_size must be a positive int, got {batch_size!r}")
        idx = jax.random.randint(key, (int(batch_size),), 0, jnp.maximum(state.size, 1), dtype=jnp.int32)
        return jax.tree.map(lambda d: d.at[idx].get(mode="promise_in_bounds"), state.data)

    return Buffer(init=init, insert=insert, sample=sample, capacity=capacity)


__all__ = ["Buffer", "BufferState", "uniform"]
