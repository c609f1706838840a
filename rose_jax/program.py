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

:class:`Program` describes one iteration ``state -> (state, metrics)`` as pieces the optimizer
can regroup:

* ``collect(state) -> (state, data)``: the rollout over a batch of ``num_envs`` environments,
  whose per-env computations are independent across envs;
* ``learn(state, data) -> (state, metrics)``: everything that mixes envs (normalizer update,
  advantages, the update, metrics);
* lenses: ``env`` picks the state leaves that are the env batch (leading axis = env);
  ``data_env_axis`` (a pytree prefix of ``data``) says which axis of each data leaf is the env
  axis (``None``: not per env);
* optionally ``rollout``: collect as ``start`` / per-step ``step`` / ``finish`` functions, so that
  the env groups can be interleaved inside one loop;
* optionally ``spec``: how a worker process rebuilds the same program (an import path and
  picklable arguments), for the multi-process mode.

Each algorithm provides its own adapter (``algos.ppo.program(config, env)``,
``algos.sac.program(config, env)``); the optimizer (:mod:`rose_jax.optimize`) transforms it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

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


# ------------------------------------------------------------------------------ programs

State = Any
Data = Any


class Lens(NamedTuple):
    """A view of part of a state: ``get(state) -> part``, ``set(state, part) -> state``."""

    get: Callable[[State], Any]
    set: Callable[[State, Any], State]
    name: str = ""


def attr_lens(name: str) -> Lens:
    """The lens of a dataclass field ``name`` (``state.<name>``, replaced with ``.replace``)."""
    return Lens(lambda s: getattr(s, name), lambda s, v: s.replace(**{name: v}), name)


class RolloutParts(NamedTuple):
    """``collect`` as one loop, so env groups can share its body.

    collect(state) == finish(state, carry_T, ys) where ``consts, carry_0, xs = start(state)``
    and ``carry_T, ys = lax.scan(lambda c, x: step(consts, c, x, 0, 1), carry_0, xs)``.

    ``carry`` leaves have a leading env axis; ``xs`` are shared by all envs (e.g. per-step
    keys); ``step(consts, carry_g, x, g, G)`` steps the envs of group ``g`` of ``G`` (``g``, ``G``
    static ints) and returns ``(carry_g, y_g)`` with ``y_g`` leaves env-batched on axis 0; it
    must draw exactly the random numbers the full batch draws for those envs.
    """

    length: int
    start: Callable[[State], tuple[Any, Any, Any]]
    step: Callable[[Any, Any, Any, int, int], tuple[Any, Any]]
    finish: Callable[[State, Any, Any], tuple[State, Data]]


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """How a worker process rebuilds a program: ``import_module(module).<factory>(**kwargs)``.

    ``kwargs`` must be picklable (configs are frozen dataclasses). ``env``: ``(env factory
    "module:function", name, ((key, value), ...))``: the worker builds the environment with
    ``factory(name, **kwargs)`` and passes it as the keyword ``env`` (an environment is
    rebuilt by name, not pickled). ``transforms`` are ``(name, params)`` of fn-level transforms
    the worker re-applies. :func:`rose_jax.optimize.process_worker.build_program` builds it.
    """

    factory: str  # "package.module:function"
    kwargs: tuple[tuple[str, Any], ...] = ()
    transforms: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    env: tuple[str, str, tuple[tuple[str, Any], ...]] | None = None

    def __post_init__(self):
        for target in (self.factory,) + ((self.env[0],) if self.env else ()):
            module, sep, name = target.partition(":")
            if not (module and sep and name):
                raise ValueError(
                    f"ProgramSpec: factories must look like 'package.module:function', got {target!r}"
                )


class Program(NamedTuple):
    """One RL iteration as ``collect`` + ``learn`` with env lenses (see the module docstring)."""

    name: str
    num_envs: int
    collect: Callable[[State], tuple[State, Data]]
    learn: Callable[[State, Data], tuple[State, Any]]
    env: Lens
    data_env_axis: Any
    rollout: RolloutParts | None = None
    spec: ProgramSpec | None = None
    env_name: str = ""
    host: bool = False  # True: collect runs in worker processes (the iteration is not jittable)
    groups: int = 1
    mode: str = "single"

    def iteration(self) -> Callable[[State], tuple[State, Any]]:
        """``state -> (state, metrics)``: collect then learn (jittable unless ``host``; a host
        program's ``learn`` is jitted here, so that only the collect runs outside XLA)."""
        collect, learn = self.collect, jax.jit(self.learn) if self.host else self.learn

        def iterate(state):
            state, data = collect(state)
            return learn(state, data)

        iterate.__name__ = f"{self.name}_iteration"
        return iterate

    def map_pieces(self, f: Callable[[Callable], Callable]) -> "Program":
        """This program with ``f`` applied to ``collect`` and ``learn`` (fn-level transforms)."""
        if self.host:
            return self._replace(learn=f(self.learn))  # collect lives in the workers
        return self._replace(collect=f(self.collect), learn=f(self.learn))
