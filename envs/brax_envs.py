"""Brax environments behind the rose-jax protocol (:mod:`envs.core`).

:func:`make_brax` wraps ``brax.envs.get_environment(env_name, backend=...)`` as a
:class:`envs.core.Dynamics` and hands it to :func:`envs.core.build`, which adds the time limit,
episode bookkeeping and auto-reset. With ``reset_mode='first'`` (the default) this is the same
computation as Brax's own training stack (``EpisodeWrapper`` + ``AutoResetWrapper`` + vmap,
``action_repeat=1``): one ``env.step`` plus one select against the episode's first state per
step, no reset computation.

``EnvState.pipeline_state`` is the physics data itself, so pytree paths such as
``pipeline_state.qpos`` / ``pipeline_state.qvel`` (``mjx`` backend: a ``brax.mjx.base.State``,
an ``mjx.Data``) or ``pipeline_state.q`` / ``pipeline_state.qd`` (every backend) exist.

Brax envs whose ``step`` needs its own ``obs``/``metrics``/``info`` from the previous step (Brax
keeps them in ``brax.envs.State``) get a :class:`BraxCarry` instead: ``pipeline_state.data`` is
the physics data and ``obs``/``metrics``/``info`` ride along. ``carry_info=None`` decides this
automatically: the registered MuJoCo-style envs (ant, halfcheetah, ...) read none of them
(checked against brax 0.14.2's source), so they get the plain physics data; any other Brax env
gets a :class:`BraxCarry` when its ``reset`` returns a non-empty ``info``.

``import brax`` is slow (tens of seconds on a small CPU), so it happens inside :func:`make_brax`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from envs.core import Dynamics, Env, build

BACKENDS = ("mjx", "generalized", "positional", "spring")

# Brax envs whose step() reads nothing of the previous brax State but pipeline_state (their
# metrics are written, never read; inverted_pendulum's info only echoes 'time_out' = done).
_STATELESS = frozenset(
    {
        "ant",
        "halfcheetah",
        "hopper",
        "humanoid",
        "humanoidstandup",
        "inverted_pendulum",
        "inverted_double_pendulum",
        "pusher",
        "reacher",
        "swimmer",
        "walker2d",
    }
)


class BraxCarry(NamedTuple):
    """``pipeline_state`` of a Brax env that needs its previous ``obs``/``metrics``/``info``.

    ``data`` is the physics state (``data.qpos`` on the mjx backend, ``data.q`` on every backend);
    the other fields are those of ``brax.envs.State`` (``obs`` duplicates ``EnvState.obs``).
    """

    data: Any
    obs: jax.Array
    metrics: dict
    info: dict


def make_brax(
    env_name: str,
    backend: str = "mjx",
    episode_length: int = 1000,
    reset_mode: str = "first",
    carry_info: bool | None = None,
    **brax_kwargs,
) -> Env:
    """A Brax environment as a rose-jax :class:`envs.core.Env`.

    Args:
      env_name: a name in Brax's registry (``ant``, ``halfcheetah``, ``hopper``, ...).
      backend: Brax physics pipeline: one of :data:`BACKENDS`.
      episode_length: time limit in env steps (Brax's ``EpisodeWrapper``; ``action_repeat=1``).
      reset_mode: ``'first'`` restores the episode's first state on reset (Brax's
        ``AutoResetWrapper``, no reset work per step); ``'sample'`` draws a fresh initial state
        from the state's key (runs the Brax reset, e.g. an MJX forward pass, every step).
      carry_info: keep Brax's ``obs``/``metrics``/``info`` between steps in a :class:`BraxCarry`;
        ``None`` decides automatically (see the module docstring).
      **brax_kwargs: passed to the Brax env's constructor (e.g. ``ctrl_cost_weight``).

    Returns:
      An ``Env`` with ``observation_size``/``action_size`` equal to Brax's; actions in [-1, 1].
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"env {env_name!r}: unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}"
        )
    from envs.mjcf import quiet_warp_notice

    with quiet_warp_notice():
        import brax.envs  # slow import: only when a Brax env is asked for

    known = sorted(getattr(brax.envs, "_envs", {}))
    if known and env_name not in known:
        raise ValueError(f"unknown Brax env {env_name!r}; Brax envs: {', '.join(known)}")
    brax_env = brax.envs.get_environment(env_name, backend=backend, **brax_kwargs)

    # Shapes without running anything: trace reset once.
    reset_shape = jax.eval_shape(brax_env.reset, jax.random.PRNGKey(0))
    if not isinstance(reset_shape.obs, jax.ShapeDtypeStruct) or len(reset_shape.obs.shape) != 1:
        raise ValueError(
            f"env {env_name!r}: only flat array observations are supported, got {reset_shape.obs}"
        )
    obs_size = int(reset_shape.obs.shape[0])
    act_size = int(brax_env.action_size)
    if carry_info is None:
        carry_info = env_name not in _STATELESS and bool(reset_shape.info)

    State = brax.envs.State  # noqa: N806 - a class
    zero = jnp.zeros((), jnp.float32)

    if carry_info:

        def init(key):
            s = brax_env.reset(key)
            return BraxCarry(s.pipeline_state, s.obs, s.metrics, s.info), s.obs

        def transition(carry: BraxCarry, action):
            s = brax_env.step(State(carry.data, carry.obs, zero, zero, carry.metrics, carry.info), action)
            return BraxCarry(s.pipeline_state, s.obs, s.metrics, s.info), s.obs, s.reward, s.done

    else:

        def init(key):
            s = brax_env.reset(key)
            return s.pipeline_state, s.obs

        def transition(data, action):
            # obs/metrics/info of the previous step are not read by these envs (see _STATELESS).
            prev_obs = jnp.zeros((obs_size,), reset_shape.obs.dtype)
            s = brax_env.step(State(data, prev_obs, zero, zero, {}, {}), action)
            return s.pipeline_state, s.obs, s.reward, s.done

    return build(env_name, Dynamics(obs_size, act_size, init, transition), episode_length, reset_mode)


# One factory per registered name (envs/__init__.py points at these).
def make_ant(**kw) -> Env:
    """Brax ``ant``: obs 27, action 8, reward forward velocity + 1 alive - 0.5|a|^2."""
    return make_brax("ant", **kw)


def make_halfcheetah(**kw) -> Env:
    """Brax ``halfcheetah``: obs 17, action 6."""
    return make_brax("halfcheetah", **kw)


def make_hopper(**kw) -> Env:
    """Brax ``hopper``: obs 11, action 3."""
    return make_brax("hopper", **kw)


def make_humanoid(**kw) -> Env:
    """Brax ``humanoid``: obs 244, action 17."""
    return make_brax("humanoid", **kw)


def make_humanoidstandup(**kw) -> Env:
    """Brax ``humanoidstandup``: obs 244, action 17."""
    return make_brax("humanoidstandup", **kw)


def make_reacher(**kw) -> Env:
    """Brax ``reacher``: obs 11, action 2."""
    return make_brax("reacher", **kw)


def make_walker2d(**kw) -> Env:
    """Brax ``walker2d``: obs 17, action 6."""
    return make_brax("walker2d", **kw)


def make_inverted_pendulum(**kw) -> Env:
    """Brax ``inverted_pendulum``: obs 4, action 1."""
    return make_brax("inverted_pendulum", **kw)
