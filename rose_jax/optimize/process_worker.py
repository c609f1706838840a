"""Worker entry points: the functions ``rose_jax.runtime`` workers run, named by import path.

A worker process imports this module (the pool resolves ``"rose_jax.optimize.process_worker:<fn>"``)
and runs one of:

* :func:`worker_collect` / :func:`worker_rollout`: env group ``g``'s rollout of a program the
  worker rebuilds from its :class:`rose_jax.program.ProgramSpec` (:func:`build_program`), whole
  states or on the env slice resident in the worker (:class:`ResidentLayout`);
* :func:`worker_restore`: the resident env slice back to its last upload;
* :func:`run_compiled`: one of the above jitted with XLA compiler options (the search's equality
  check under deterministic ops), compiled once per (function, options, static arguments);
* :func:`run_exported`: a ``jax.export``-serialized computation (an offloaded component);
* :func:`time_exported`: seconds per call of one (a branch timed alone at this worker's SM quota);
* :func:`compile_events`: how many times this process traced and compiled (recompile checks).

The driver side is :mod:`rose_jax.optimize.processes` and :mod:`rose_jax.optimize.offload`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from rose_jax.optimize.env_groups import collect_group
from rose_jax.optimize.registry import transform_by_name

WORKER_COLLECT = "rose_jax.optimize.process_worker:worker_collect"
WORKER_ROLLOUT = "rose_jax.optimize.process_worker:worker_rollout"
WORKER_RESTORE = "rose_jax.optimize.process_worker:worker_restore"
TIME_EXPORTED = "rose_jax.optimize.process_worker:time_exported"
WORKER_COMPILED = "rose_jax.optimize.process_worker:run_compiled"
COMPILE_EVENTS = "rose_jax.optimize.process_worker:compile_events"
RUN_EXPORTED = "rose_jax.optimize.process_worker:run_exported"
ENV = "rose.env"  # resident name of a worker's env slice
ORIGIN = "rose.env.origin"  # the env slice as last uploaded (restarts without a transfer)


def _resolve(target: str) -> Callable:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


@functools.lru_cache(maxsize=8)
def build_program(spec: Any) -> Any:
    """The program a :class:`rose_jax.program.ProgramSpec` names, with its fn-level transforms
    (cached per spec: a worker rebuilds each program once)."""
    kwargs = dict(spec.kwargs)
    if spec.env is not None:
        env_factory, env_name, env_kwargs = spec.env
        kwargs["env"] = _resolve(env_factory)(env_name, **dict(env_kwargs))
    program = _resolve(spec.factory)(**kwargs)
    for t_name, t_params in spec.transforms:
        program = transform_by_name(t_name, dict(t_params)).apply(program)
    return program


def worker_collect(state_g: Any, *, spec: Any, g: int, groups: int) -> tuple[Any, Any]:
    """Run in a worker: the rollout of env group ``g`` of ``groups`` (jit this with static kwargs)."""
    return collect_group(build_program(spec), state_g, g, groups)


@dataclasses.dataclass(frozen=True)
class ResidentLayout:
    """How a worker rebuilds group ``g``'s state and what it sends back (static: hashable, picklable).

    Positions are indices into the flattened full state (``treedef``) or the flattened data.
    ``env``: the env-batch leaves (resident); ``sent``: the non-env leaves the rollout reads
    (sent every iteration, in this order); ``zeros``: ``(position, shape, dtype)`` of the non-env
    leaves it does not read (zeros in the worker, which XLA removes); ``changed``: the non-env
    leaves the collect writes (sent back); ``data_used``: the data leaves ``learn`` reads (sent
    back; the others are never transferred).
    """

    treedef: Any
    env: tuple[int, ...]
    sent: tuple[int, ...]
    zeros: tuple[tuple[int, tuple[int, ...], str], ...]
    changed: tuple[int, ...]
    data_used: tuple[int, ...]


def worker_rollout(env_g, sent, *, spec: Any, g: int, groups: int, layout: ResidentLayout):
    """Run in a worker (jitted, ``reads=writes=(ENV,)``): group ``g``'s rollout on its resident env.

    env_g: tuple of the group's env leaves (each ``(num_envs / groups, ...)``); sent: tuple of
    the non-env leaves in ``layout.sent``. Returns ``((new env_g,), (changed, data_used))``.
    """
    leaves: list[Any] = [None] * layout.treedef.num_leaves
    for i, x in zip(layout.sent, sent, strict=True):
        leaves[i] = x
    for i, shape, dtype in layout.zeros:
        leaves[i] = jnp.zeros(shape, dtype)
    for i, x in zip(layout.env, env_g, strict=True):
        leaves[i] = x
    state_g = jax.tree_util.tree_unflatten(layout.treedef, leaves)
    out_state, data = collect_group(build_program(spec), state_g, g, groups)
    out_leaves, data_leaves = jax.tree.leaves(out_state), jax.tree.leaves(data)
    new_env = tuple(out_leaves[i] for i in layout.env)
    return (new_env,), (
        tuple(out_leaves[i] for i in layout.changed),
        tuple(data_leaves[i] for i in layout.data_used),
    )


def worker_restore(origin):
    """Run in a worker (``jit=False``, ``reads=(ORIGIN,)``, ``writes=(ENV,)``): ENV := ORIGIN, no copy."""
    return (origin,), None


_COMPILED: dict[Any, Callable] = {}


def run_compiled(*args: Any, fn: str, compiler_options: tuple, **static: Any) -> Any:
    """In a worker (``jit=False``): ``fn`` (an entry point of this module, by import path) with
    ``static`` bound, jitted with ``compiler_options`` (sorted ``(name, value)`` pairs) once."""
    key = (fn, compiler_options, tuple(sorted(static.items())))
    jitted = _COMPILED.get(key)
    if jitted is None:
        jitted = jax.jit(
            functools.partial(_resolve(fn), **static), compiler_options=dict(compiler_options) or None
        )
        _COMPILED[key] = jitted
    return jitted(*args)


_EVENTS: dict[str, int] | None = None
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/backend_compile_duration",
)


def compile_events() -> dict[str, int]:
    """In a worker (``jit=False``) or here: counts of JAX's trace and backend-compile events in
    this process since the first call (which starts counting, through ``jax.monitoring``)."""
    global _EVENTS
    if _EVENTS is None:
        _EVENTS = {name: 0 for name in _COMPILE_EVENTS}

        def listen(name: str, duration: float, **kwargs: Any) -> None:
            if name in _EVENTS:
                _EVENTS[name] += 1

        jax.monitoring.register_event_duration_secs_listener(listen)
    return {name.rsplit("/", 1)[-1]: n for name, n in _EVENTS.items()}


_LOADED: dict[str, Callable] = {}


def _loaded(blob: Any, digest: str, compiler_options: tuple = ()) -> Callable:
    """The serialized computation ``blob``, deserialized and jitted once per ``digest``."""
    fn = _LOADED.get(digest)
    if fn is None:
        exported = jax_export.deserialize(bytearray(np.asarray(blob, dtype=np.uint8).tobytes()))
        fn = jax.jit(exported.call, compiler_options=dict(compiler_options) or None)
        _LOADED[digest] = fn
    return fn


def run_exported(blob: Any, *args: Any, digest: str, compiler_options: tuple = ()) -> tuple:
    """In a worker (``jit=False``, ``reads=(blob name,)``): run the serialized ``part`` on ``args``.

    The ``jax.export`` blob is deserialized and jitted once per ``digest``; later calls reuse it.
    """
    return tuple(_loaded(blob, digest, compiler_options)(*args))


def time_exported(blob: Any, *args: Any, digest: str, repeats: int = 2) -> np.ndarray:
    """In a worker (``jit=False``, ``reads=(blob name,)``): median seconds of one call of the
    serialized computation on ``args`` (after one untimed call that compiles), as a () float64."""
    fn = _loaded(blob, digest)
    args = jax.device_put(args)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return np.asarray(np.median(times), np.float64)
