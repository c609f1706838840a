"""Worker entry points: the functions ``rose_jax.runtime`` workers run, named by import path.

A worker process imports this module (the pool resolves ``"rose_jax.optimize.process_worker:<fn>"``)
and runs one of:

* :func:`worker_collect` / :func:`worker_rollout`: env group ``g``'s rollout of a program the
  worker rebuilds from its :class:`rose_jax.program.ProgramSpec` (:func:`build_program`), whole
  states or on the env slice resident in the worker (:class:`ResidentLayout`); called with
  ``jit=False``: each builds its program eagerly, outside any trace, and jits the rollout itself
  (with XLA compiler options if given, e.g. the search's deterministic ops), once per (spec,
  group, layout, options);
* :func:`worker_restore`: the resident env slice back to its last upload;
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
    (cached per spec: a worker rebuilds each program once).

    Call it outside any trace: building an env may create device arrays (a Brax MJX env's model,
    ``mjx.put_model``); built under a trace they would be tracers, kept in this cache and leaked
    into the next trace (``UnexpectedTracerError``)."""
    kwargs = dict(spec.kwargs)
    if spec.env is not None:
        env_factory, env_name, env_kwargs = spec.env
        kwargs["env"] = _resolve(env_factory)(env_name, **dict(env_kwargs))
    program = _resolve(spec.factory)(**kwargs)
    for t_name, t_params in spec.transforms:
        program = transform_by_name(t_name, dict(t_params)).apply(program)
    return program


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


def collect_fn(program: Any, g: int, groups: int) -> Callable:
    """The pure ``state_g -> (state_g, data)`` of env group ``g`` of ``groups`` (to jit)."""
    return functools.partial(collect_group, program, g=g, groups=groups)


def rollout_fn(program: Any, g: int, groups: int, layout: ResidentLayout) -> Callable:
    """The pure ``(env_g, sent) -> ((new env_g,), (changed, data_used))`` of env group ``g`` on
    its resident env slice (to jit; see :func:`worker_rollout`)."""

    def rollout(env_g, sent):
        leaves: list[Any] = [None] * layout.treedef.num_leaves
        for i, x in zip(layout.sent, sent, strict=True):
            leaves[i] = x
        for i, shape, dtype in layout.zeros:
            leaves[i] = jnp.zeros(shape, dtype)
        for i, x in zip(layout.env, env_g, strict=True):
            leaves[i] = x
        state_g = jax.tree_util.tree_unflatten(layout.treedef, leaves)
        out_state, data = collect_group(program, state_g, g, groups)
        out_leaves, data_leaves = jax.tree.leaves(out_state), jax.tree.leaves(data)
        new_env = tuple(out_leaves[i] for i in layout.env)
        return (new_env,), (
            tuple(out_leaves[i] for i in layout.changed),
            tuple(data_leaves[i] for i in layout.data_used),
        )

    return rollout


@functools.lru_cache(maxsize=64)
def jitted_rollout(
    spec: Any, g: int, groups: int, layout: ResidentLayout | None, compiler_options: tuple = ()
) -> Callable:
    """Group ``g``'s rollout of the program ``spec`` names, jitted (``compiler_options``: sorted
    ``(name, value)`` pairs): :func:`rollout_fn` with a ``layout``, else :func:`collect_fn`.

    The program is built here, eagerly (see :func:`build_program`); each distinct argument
    tuple is jitted once and compiles at its first call."""
    program = build_program(spec)
    fn = collect_fn(program, g, groups) if layout is None else rollout_fn(program, g, groups, layout)
    return jax.jit(fn, compiler_options=dict(compiler_options) or None)


def forget_programs() -> None:
    """Drop the programs and jitted rollouts built so far (a fresh worker's state; for tests)."""
    jitted_rollout.cache_clear()
    build_program.cache_clear()


def _outside_trace(name: str, args: Any) -> None:
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        raise TypeError(
            f"{name} builds its program outside any trace and jits itself: call it with jit=False, "
            "not under jax.jit"
        )


def worker_collect(
    state_g: Any, *, spec: Any, g: int, groups: int, compiler_options: tuple = ()
) -> tuple[Any, Any]:
    """Run in a worker (``jit=False``): the rollout of env group ``g`` of ``groups`` on a state
    holding only that group's envs (:func:`jitted_rollout` without a layout)."""
    _outside_trace("worker_collect", state_g)
    return jitted_rollout(spec, g, groups, None, compiler_options)(state_g)


def worker_rollout(
    env_g,
    sent,
    *,
    spec: Any,
    g: int,
    groups: int,
    layout: ResidentLayout,
    compiler_options: tuple = (),
):
    """Run in a worker (``jit=False``, ``reads=writes=(ENV,)``): group ``g``'s rollout on its
    resident env, jitted once per (spec, g, groups, layout, compiler options).

    env_g: tuple of the group's env leaves (each ``(num_envs / groups, ...)``); sent: tuple of
    the non-env leaves in ``layout.sent``. Returns ``((new env_g,), (changed, data_used))``.
    """
    _outside_trace("worker_rollout", (env_g, sent))
    return jitted_rollout(spec, g, groups, layout, compiler_options)(env_g, sent)


def worker_restore(origin):
    """Run in a worker (``jit=False``, ``reads=(ORIGIN,)``, ``writes=(ENV,)``): ENV := ORIGIN, no copy."""
    return (origin,), None


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
