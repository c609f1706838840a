"""Data-parallel training over several devices with ``jax.sharding`` (jit + sharding, not pmap).

The env batch (every leaf under ``env_path`` of the TrainState, leading axis = env) is split over
a 1-D device mesh axis ``"data"``; everything else (parameters, optimizer and normalizer state,
keys, counters) is replicated. The training iteration itself is unchanged: XLA's SPMD partitioner
runs the per-env rollout on each device's shard and inserts the all-reduces wherever the
iteration reduces over envs (normalizer statistics, advantages, minibatch gradients), so the
gradient is averaged over the global batch exactly as in one-device training, up to the order
of float additions::

    mesh = distributed.make_mesh()                      # all local devices on axis "data"
    state = distributed.shard_state(state, mesh)        # env batch split, rest replicated
    step = distributed.data_parallel(ppo.iteration(config, env), state, mesh)
    state, metrics = step(state)

Each GPU can additionally run its own rose-jax plan (worker processes under its own MPS daemon):
:func:`per_device_worker_specs` replicates a plan's :class:`~rose_jax.mps.WorkerSpec` s once per
GPU, pinning each copy to its device with ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def make_mesh(devices: Sequence[Any] | None = None) -> Mesh:
    """A 1-D mesh over ``devices`` (default: all local devices) with axis name ``"data"``."""
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: no devices")
    return Mesh(np.array(devices), (DATA_AXIS,))


def _leaf_path_strings(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def state_shardings(state: Any, mesh: Mesh, env_path: str = "env_state") -> Any:
    """A pytree of ``NamedSharding`` matching ``state``: env-batch leaves split, the rest replicated.

    A leaf is an env-batch leaf when its path starts with ``.{env_path}``. Every such leaf must
    have a leading axis divisible by the mesh size, else a ValueError names the leaf.
    """
    n = mesh.devices.size
    prefix = "." + env_path
    split, replicated = NamedSharding(mesh, PartitionSpec(DATA_AXIS)), NamedSharding(mesh, PartitionSpec())
    found = False
    specs = []
    for path, leaf in _leaf_path_strings(state):
        if path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "["):
            found = True
            shape = np.shape(leaf)
            if not shape or shape[0] % n:
                raise ValueError(
                    f"state{path}: leading (env) axis {shape[:1]} is not divisible by {n} devices"
                )
            specs.append(split)
        else:
            specs.append(replicated)
    if not found:
        raise ValueError(f"state has no leaves under {env_path!r}: nothing to split over devices")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), specs)


def shard_state(state: Any, mesh: Mesh, env_path: str = "env_state") -> Any:
    """Place ``state`` on ``mesh``: env-batch leaves split over ``"data"``, the rest replicated."""
    return jax.device_put(state, state_shardings(state, mesh, env_path))


def data_parallel(
    iteration: Callable[[Any], tuple[Any, Any]], example_state: Any, mesh: Mesh, env_path: str = "env_state"
) -> Callable[[Any], tuple[Any, Any]]:
    """Jit ``iteration`` so that its state stays sharded as :func:`state_shardings` says.

    The output state keeps the input's shardings (the env batch stays on its devices between
    iterations); metrics are replicated.
    """
    shardings = state_shardings(example_state, mesh, env_path)
    return jax.jit(iteration, in_shardings=(shardings,), out_shardings=(shardings, None))


def per_device_worker_specs(specs: Sequence[Any], num_devices: int) -> list[list[Any]]:
    """One copy of a plan's worker specs per GPU, pinned with ``CUDA_VISIBLE_DEVICES``.

    Returns ``[[spec.gpu0, ...], [spec.gpu1, ...], ...]``: start one MPS daemon and one worker pool
    per inner list (quotas are per GPU, so each copy keeps the plan's quotas).
    """
    if num_devices <= 0:
        raise ValueError(f"per_device_worker_specs: num_devices must be > 0, got {num_devices}")
    out = []
    for d in range(num_devices):
        group = []
        for spec in specs:
            env = tuple(kv for kv in spec.env if kv[0] != "CUDA_VISIBLE_DEVICES")
            group.append(
                dataclasses.replace(
                    spec, name=f"{spec.name}.gpu{d}", env=env + (("CUDA_VISIBLE_DEVICES", str(d)),)
                )
            )
        out.append(group)
    return out
