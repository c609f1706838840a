"""Plain MJX environments from an MJCF model (no Brax in between).

:func:`make_mjcf` loads an MJCF file or string with MuJoCo, puts it on the device with
``mujoco.mjx.put_model(..., impl='jax')`` (the JAX implementation, not Warp, so the tracer sees
the physics) and builds an :class:`envs.core.Env`:

  * ``pipeline_state`` is the ``mjx.Data`` itself (``pipeline_state.qpos``, ``.qvel``, ...);
  * one env step = ``n_substeps`` calls of ``mjx.step`` inside a ``jax.lax.fori_loop`` (a
    ``scan`` of length ``n_substeps`` in the jaxpr), control held constant;
  * action ``a`` in ``[-1, 1]^nu`` maps linearly onto each actuator's ``ctrlrange``
    (actuators without a ctrlrange get ``ctrl = a``);
  * obs = ``concat(qpos[skip_qpos:], qvel)``, float32, size ``nq - skip_qpos + nv``;
  * reward = ``reward(model, data_before, data_after, action) - ctrl_cost_weight * |action|^2``.

Shipped models live in ``envs/assets/`` (``mjx_cartpole``, ``mjx_swimmer`` in the registry).
Only APIs of mujoco-mjx 3.17.0 are used (``put_model``, ``make_data``, ``forward``, ``step``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import sys
from collections.abc import Iterator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import Dynamics, Env, build

ASSETS = pathlib.Path(__file__).resolve().parent / "assets"

# What ``mujoco.mjx.warp`` prints (a bare ``print``: no logger, no variable turns it off) the first
# time anything imports ``mujoco.mjx`` (MJX envs, Brax, Playground) without the optional Warp
# package. rose-jax runs MJX with ``impl="jax"``, so a missing Warp is expected, not an error.
_WARP_NOTICE = re.compile(r"Failed to import (warp|mujoco_warp): No module named 'warp'\n?")


@contextlib.contextmanager
def quiet_warp_notice() -> Iterator[None]:
    """Around the import of ``mujoco.mjx`` / ``brax`` / ``mujoco_playground``: drop exactly
    MJX's "Failed to import warp: No module named 'warp'" lines (and the ``mujoco_warp`` one);
    anything else printed meanwhile is passed on. Once ``mujoco.mjx.warp`` is imported it never
    prints again, so then this does nothing."""
    if "mujoco.mjx.warp" in sys.modules:
        yield
        return
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        lines = buffer.getvalue().splitlines(keepends=True)
        sys.stdout.write("".join(line for line in lines if not _WARP_NOTICE.fullmatch(line)))


# (mjx.Model, mjx.Data before the step, mjx.Data after it, action in [-1, 1]) -> () reward
RewardFn = Callable[[Any, Any, Any, jax.Array], jax.Array]
# (mjx.Model, mjx.Data after the step) -> () bool, True ends the episode
TerminateFn = Callable[[Any, Any], jax.Array]


def _load(xml: str | os.PathLike, name: str, from_string: Callable, from_path: Callable):
    try:
        if isinstance(xml, str) and xml.lstrip().startswith("<"):
            return from_string(xml)
        path = pathlib.Path(xml)
        if not path.is_file():
            raise ValueError(f"no such file: {str(path)!r} (pass an MJCF string or a path to one)")
        return from_path(str(path))
    except ValueError as e:  # MuJoCo's XML errors span lines: one line here
        raise ValueError(f"env {name!r}: cannot load MJCF: {' '.join(str(e).split())}") from None


def load_model(xml: str | os.PathLike, name: str = "mjcf"):
    """``mujoco.MjModel`` from an MJCF string (starts with ``<``) or a path to an .xml file."""
    import mujoco

    return _load(xml, name, mujoco.MjModel.from_xml_string, mujoco.MjModel.from_xml_path)


def load_spec(xml: str | os.PathLike, name: str = "mjcf"):
    """``mujoco.MjSpec`` (the editable model, e.g. to add scenery for rendering) from the same
    inputs as :func:`load_model`."""
    import mujoco

    def from_path(path: str):
        spec = mujoco.MjSpec.from_file(path)
        spec.compile()  # the errors of load_model (MjSpec.from_file only parses)
        return spec

    def from_string(text: str):
        spec = mujoco.MjSpec.from_string(text)
        spec.compile()
        return spec

    return _load(xml, name, from_string, from_path)


def forward_velocity(dt: float, body: int = 1) -> RewardFn:
    """Reward = x-velocity [m/s] of ``body`` (1 = the first body after the world) over one env step.

    Like Brax, it differences ``xpos`` as ``mjx.step`` leaves it (positions computed at the start
    of the last substep), over the env step's duration ``dt`` [s].
    """

    def reward(model, data_before, data_after, action):
        del model, action
        return (data_after.xpos[body, 0] - data_before.xpos[body, 0]) / dt

    return reward


def _check_scalar_fn(env_name: str, what: str, fn: Callable, *args) -> None:
    """Trace ``fn`` abstractly (runs nothing) and require a scalar output."""
    out = jax.eval_shape(fn, *args)
    shape = getattr(out, "shape", None)
    if shape != ():
        got = f"shape {shape}" if shape is not None else type(out).__name__
        raise ValueError(f"env {env_name!r}: {what} must return a scalar per env, got {got}")


def make_mjcf(
    xml: str | os.PathLike,
    *,
    name: str = "mjcf",
    reward: str | RewardFn = "forward_velocity",
    terminate: TerminateFn | None = None,
    n_substeps: int = 5,
    skip_qpos: int = 0,
    init_qpos: Any = None,
    ctrl_cost_weight: float = 0.0,
    episode_length: int = 1000,
    reset_mode: str = "first",
    reset_noise: float = 0.1,
) -> Env:
    """An MJX environment from an MJCF model.

    Args:
      xml: MJCF text, or a path to an MJCF file.
      name: env name (used in error messages).
      reward: ``'forward_velocity'`` (x-velocity of body 1, see :func:`forward_velocity`) or a
        callable ``(mjx.Model, data_before, data_after, action) -> ()``; ``action`` is the
        clipped action in [-1, 1].
      terminate: ``None`` (never terminates) or ``(mjx.Model, data_after) -> () bool``.
      n_substeps: physics steps of ``model.opt.timestep`` per env step (>= 1).
      skip_qpos: leading qpos entries left out of the observation (e.g. 1 or 2 for the root's
        global x, y).
      init_qpos: (nq,) initial joint positions; default the model's ``qpos0``.
      ctrl_cost_weight: subtracted ``ctrl_cost_weight * sum(action**2)`` from the reward.
      episode_length: time limit in env steps.
      reset_mode: ``'first'`` (restore the first state) or ``'sample'`` (fresh noise every reset).
      reset_noise: initial qpos and qvel get uniform noise in ``[-reset_noise, reset_noise]``.

    Returns:
      An ``Env``: obs ``(nq - skip_qpos + nv,)``, action ``(nu,)``, env step
      ``n_substeps * opt.timestep`` seconds.
    """
    with quiet_warp_notice():
        from mujoco import mjx

    if not isinstance(n_substeps, int) or n_substeps < 1:
        raise ValueError(f"env {name!r}: n_substeps must be an int >= 1, got {n_substeps!r}")
    if reset_noise < 0:
        raise ValueError(f"env {name!r}: reset_noise must be >= 0, got {reset_noise}")
    if isinstance(reward, str):
        if reward != "forward_velocity":
            raise ValueError(f"env {name!r}: unknown reward {reward!r}; use 'forward_velocity' or a callable")
    elif not callable(reward):
        raise ValueError(f"env {name!r}: reward must be 'forward_velocity' or a callable, got {reward!r}")
    if terminate is not None and not callable(terminate):
        raise ValueError(f"env {name!r}: terminate must be None or a callable, got {terminate!r}")

    mj = load_model(xml, name)
    nq, nv, nu = mj.nq, mj.nv, mj.nu
    if nu == 0:
        raise ValueError(f"env {name!r}: the model has no actuators (nu = 0), so nothing to control")
    if not 0 <= skip_qpos <= nq:
        raise ValueError(f"env {name!r}: skip_qpos must be in [0, nq={nq}], got {skip_qpos}")
    qpos0 = np.asarray(mj.qpos0 if init_qpos is None else init_qpos, np.float32)
    if qpos0.shape != (nq,):
        raise ValueError(f"env {name!r}: init_qpos must have shape ({nq},), got {qpos0.shape}")
    try:
        model = mjx.put_model(mj, impl="jax")
        data0 = mjx.make_data(model, impl="jax")
    except NotImplementedError as e:
        raise ValueError(f"env {name!r}: the model uses a feature MJX (JAX) does not support: {e}") from None

    limited = np.asarray(mj.actuator_ctrllimited, bool)
    ctrl_lo = np.where(limited, mj.actuator_ctrlrange[:, 0], -1.0).astype(np.float32)
    ctrl_hi = np.where(limited, mj.actuator_ctrlrange[:, 1], 1.0).astype(np.float32)
    dt = float(mj.opt.timestep) * n_substeps
    reward_fn = forward_velocity(dt) if isinstance(reward, str) else reward
    _check_scalar_fn(name, "reward", reward_fn, model, data0, data0, jnp.zeros(nu))
    if terminate is not None:
        _check_scalar_fn(name, "terminate", terminate, model, data0)

    def observe(data):
        return jnp.concatenate([data.qpos[skip_qpos:], data.qvel]).astype(jnp.float32)

    def init(key):
        qpos_key, qvel_key = jax.random.split(key)
        qpos = qpos0 + jax.random.uniform(qpos_key, (nq,), minval=-reset_noise, maxval=reset_noise)
        qvel = jax.random.uniform(qvel_key, (nv,), minval=-reset_noise, maxval=reset_noise)
        data = mjx.forward(model, data0.replace(qpos=qpos, qvel=qvel))
        return data, observe(data)

    def physics_substep(_, data):
        return mjx.step(model, data)

    def transition(data, action):
        action = jnp.clip(action, -1.0, 1.0)
        ctrl = ctrl_lo + (action + 1.0) * 0.5 * (ctrl_hi - ctrl_lo)
        data_after = jax.lax.fori_loop(0, n_substeps, physics_substep, data.replace(ctrl=ctrl))
        r = reward_fn(model, data, data_after, action) - ctrl_cost_weight * jnp.sum(jnp.square(action))
        if terminate is None:
            terminal = jnp.zeros((), jnp.bool_)
        else:
            terminal = jnp.asarray(terminate(model, data_after), jnp.bool_)
        return data_after, observe(data_after), r, terminal

    return build(name, Dynamics(nq - skip_qpos + nv, nu, init, transition), episode_length, reset_mode)


def cartpole_upright(model, data_before, data_after, action) -> jax.Array:
    """dm_control-style smooth cart-pole reward in [0, 1]: upright * centered * small control * slow.

    upright = (1 + cos(angle)) / 2; centered = (1 + exp(-x^2)) / 2; small control =
    (4 + exp(-a^2)) / 5; slow = (1 + exp(-(angular velocity / 5)^2)) / 2.
    """
    del model, data_before
    x, angle, ang_vel = data_after.qpos[0], data_after.qpos[1], data_after.qvel[1]
    upright = (1.0 + jnp.cos(angle)) / 2.0
    centered = (1.0 + jnp.exp(-jnp.square(x))) / 2.0
    small_control = (4.0 + jnp.exp(-jnp.square(action[0]))) / 5.0
    slow = (1.0 + jnp.exp(-jnp.square(ang_vel / 5.0))) / 2.0
    return upright * centered * small_control * slow


def make_mjx_cartpole(swingup: bool = False, **kw) -> Env:
    """MJX cart-pole (``assets/cartpole.xml``): balance, or swing up from hanging down.

    obs (x [m], angle [rad], x_dot, angle_dot), angle 0 = upright; action pushes the cart with
    10 N * a; env step 0.02 s (2 substeps of 0.01 s); reward :func:`cartpole_upright` per step
    (about 1 when balanced, near 0 hanging down); no termination. Keywords go to
    :func:`make_mjcf`.
    """
    options = dict(
        name="mjx_cartpole_swingup" if swingup else "mjx_cartpole",
        reward=cartpole_upright,
        n_substeps=2,
        init_qpos=[0.0, np.pi] if swingup else None,
        reset_noise=0.05,
    )
    return make_mjcf(ASSETS / "cartpole.xml", **(options | kw))


def make_mjx_swimmer(**kw) -> Env:
    """MJX three-link swimmer (``assets/swimmer.xml``) in a viscous fluid: swim along +x.

    obs 8 (heading, 2 joint angles, 5 velocities; global x, y left out); action 2 joint torques
    (150 N m * a); env step 0.04 s (4 substeps); reward forward velocity [m/s] - 1e-4 |a|^2;
    no termination. Keywords go to :func:`make_mjcf`.
    """
    options = dict(name="mjx_swimmer", n_substeps=4, skip_qpos=2, ctrl_cost_weight=1e-4)
    return make_mjcf(ASSETS / "swimmer.xml", **(options | kw))
