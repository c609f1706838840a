"""Roll out a saved policy and render it to a video: ``rose-jax play RUN_DIR --episodes K --out v.mp4``.

:func:`play` loads the run's policy (:func:`algos.policy.load_policy`), rebuilds its env from
the registry, runs ``episodes`` episodes of one env with the deterministic policy (one jitted
step per env step), prints each episode's return, and (with ``out``) renders every step with
MuJoCo's renderer and writes an mp4 (imageio with the ffmpeg binary of ``imageio-ffmpeg``).

Rendering needs an MJCF model: Brax envs (any backend: the model of ``brax.envs``' system),
the MJCF envs (``mjx_cartpole``, ``mjx_swimmer``, ``mjcf`` with ``xml=``) and Playground envs
have one; the pure-JAX classics do not (their returns are still printed). It runs headless:
``MUJOCO_GL`` defaults to ``egl`` when a GPU is visible, else ``osmesa`` (Debian package
``libosmesa6``, which ``scripts/setup.sh`` installs where apt is available). Set ``MUJOCO_GL``
yourself to override; it must be set before MuJoCo's renderer is first created.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, NamedTuple

import jax
import numpy as np


class PlayResult(NamedTuple):
    returns: list[float]  # one per episode
    lengths: list[int]  # env steps per episode
    frames: int  # frames written (0 without ``out``)
    out: str | None


def default_gl_backend() -> str:
    """``egl`` when an NVIDIA GPU is visible, else ``osmesa`` (software, works on any CPU)."""
    return "egl" if os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") else "osmesa"


def _set_gl() -> str:
    """``MUJOCO_GL`` (default :func:`default_gl_backend`), and PyOpenGL's platform to match."""
    backend = os.environ.setdefault("MUJOCO_GL", default_gl_backend()).lower()
    if backend in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", backend)
    return backend


def mj_model_for(env_name: str, env_kwargs: dict[str, Any] | None = None):
    """The ``mujoco.MjModel`` of a registered env, or None if it has none (pure-JAX envs)."""
    import envs

    kwargs = dict(env_kwargs or {})
    target = envs.factory_path(env_name)
    if env_name.startswith("playground:"):
        from mujoco_playground import registry

        return registry.load(env_name.split(":", 1)[1], config_overrides={"impl": "jax"}).mj_model
    if target.startswith("envs.brax_envs:"):
        import brax.envs

        brax_name = target.split(":")[1].removeprefix("make_")
        extra = {
            k: v
            for k, v in kwargs.items()
            if k not in ("backend", "episode_length", "reset_mode", "carry_info")
        }
        return brax.envs.get_environment(brax_name, backend="mjx", **extra).sys.mj_model
    if target.startswith("envs.mjcf:"):
        from envs import mjcf

        if env_name == "mjcf":
            return mjcf.load_model(kwargs["xml"])
        asset = {"mjx_cartpole": "cartpole.xml", "mjx_swimmer": "swimmer.xml"}.get(env_name)
        return mjcf.load_model(mjcf.ASSETS / asset) if asset else None
    return None


def _qpos(pipeline_state: Any) -> np.ndarray | None:
    """Generalised positions from a pipeline state (mjx.Data, Brax State, Playground State, carries)."""
    for path in (("qpos",), ("q",), ("data", "qpos"), ("data", "q"), ("pipeline_state", "qpos")):
        x = pipeline_state
        for attr in path:
            x = getattr(x, attr, None)
            if x is None:
                break
        if x is not None:
            return np.asarray(x)
    return None


class Renderer:
    """MuJoCo's offscreen renderer (its own headless GL context: EGL or OSMesa) with a free
    camera that follows the first body."""

    def __init__(self, model, width: int = 320, height: int = 240):
        backend = _set_gl()
        import mujoco

        if backend == "osmesa":
            from mujoco.osmesa import GLContext
        elif backend == "egl":
            from mujoco.egl import GLContext
        else:
            from mujoco.glfw import GLContext
        self._mujoco = mujoco
        self.model = model
        self.width, self.height = width, height
        self.data = mujoco.MjData(model)
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, height)
        self._gl = GLContext(width, height)
        self._gl.make_current()
        self._context = mujoco.MjrContext(model, mujoco.mjtFontScale.mjFONTSCALE_150)
        mujoco.mjr_setBuffer(mujoco.mjtFramebuffer.mjFB_OFFSCREEN, self._context)
        self._scene = mujoco.MjvScene(model, maxgeom=1000)
        self._option = mujoco.MjvOption()
        self._perturb = mujoco.MjvPerturb()
        self.camera = mujoco.MjvCamera()
        self.camera.distance = float(max(model.stat.extent, 0.5) * 2.0)
        self.camera.elevation = -20.0
        self.camera.azimuth = 90.0
        self._pixels = np.zeros((height, width, 3), np.uint8)

    def frame(self, qpos: np.ndarray) -> np.ndarray:
        """An ``(height, width, 3)`` uint8 image of the model at ``qpos``."""
        mujoco = self._mujoco
        self.data.qpos[:] = qpos[: self.model.nq]
        mujoco.mj_forward(self.model, self.data)
        body = 1 if self.model.nbody > 1 else 0
        self.camera.lookat[:] = self.data.xpos[body]
        self._gl.make_current()
        mujoco.mjv_updateScene(
            self.model,
            self.data,
            self._option,
            self._perturb,
            self.camera,
            mujoco.mjtCatBit.mjCAT_ALL,
            self._scene,
        )
        viewport = mujoco.MjrRect(0, 0, self.width, self.height)
        mujoco.mjr_render(viewport, self._scene, self._context)
        mujoco.mjr_readPixels(self._pixels, None, viewport, self._context)
        return np.flipud(self._pixels).copy()

    def close(self) -> None:
        self._context.free()
        self._gl.free()


def play(
    run_dir: str | os.PathLike,
    *,
    episodes: int = 1,
    out: str | os.PathLike | None = None,
    width: int = 320,
    height: int = 240,
    fps: int | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    print_fn: Any = print,
) -> PlayResult:
    """Run ``episodes`` episodes of the run's deterministic policy; render them into ``out``.

    Each episode ends at its first ``done`` or after ``max_steps`` (default the env's episode
    length); ``fps`` defaults to 30.
    Returns the episode returns and lengths and the number of frames written.
    """
    from algos.policy import load_policy

    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"play: episodes must be a positive int, got {episodes!r}")
    act = load_policy(run_dir)
    env = act.make_env()
    limit = env.episode_length if max_steps is None else int(max_steps)
    renderer = None
    if out is not None:
        model = mj_model_for(act.meta["env"], act.meta.get("env_kwargs"))
        if model is None:
            raise ValueError(f"play: env {act.meta['env']!r} has no MuJoCo model to render; leave out --out")
        renderer = Renderer(model, width, height)

    reset = jax.jit(env.reset)
    step = jax.jit(lambda s: env.step(s, act(s.obs)))
    frames: list[np.ndarray] = []
    returns, lengths = [], []
    key = jax.random.PRNGKey(seed)
    for episode in range(episodes):
        key, reset_key = jax.random.split(key)
        state = reset(reset_key)
        total, n = 0.0, 0
        if renderer is not None:
            frames.append(renderer.frame(_qpos(state.pipeline_state)))
        while n < limit:
            prev = state
            state = step(state)
            total += float(state.reward)
            n += 1
            done = bool(state.done > 0)
            if renderer is not None:
                # after a done the env already shows the next episode: draw the step before it
                frames.append(renderer.frame(_qpos((prev if done else state).pipeline_state)))
            if done:
                break
        returns.append(total)
        lengths.append(n)
        print_fn(f"episode {episode + 1}/{episodes}: return {total:.2f} over {n} steps")
    print_fn(f"mean return {float(np.mean(returns)):.2f} over {episodes} episode(s)")

    if renderer is not None:
        renderer.close()
        rate = fps or 30
        _write_mp4(os.fspath(out), frames, rate)
        print_fn(f"wrote {out} ({len(frames)} frames, {rate} fps)")
    return PlayResult(returns, lengths, len(frames), None if out is None else os.fspath(out))


def _write_mp4(path: str, frames: list[np.ndarray], fps: int) -> None:
    """Write ``frames`` as an H.264 mp4, atomically (a temporary file, then rename)."""
    import imageio.v2 as imageio

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        with imageio.get_writer(
            tmp,
            format="FFMPEG",
            mode="I",
            fps=fps,
            codec="libx264",
            macro_block_size=8,
            ffmpeg_log_level="error",
        ) as writer:
            for frame in frames:
                writer.append_data(frame)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_frames(path: str | os.PathLike) -> np.ndarray:
    """Decode an mp4 back to ``(frames, height, width, 3)`` uint8 (for checks and tests)."""
    import imageio.v2 as imageio

    with imageio.get_reader(os.fspath(path), format="FFMPEG") as reader:
        return np.stack([np.asarray(f) for f in reader])


__all__ = ["PlayResult", "Renderer", "default_gl_backend", "mj_model_for", "play", "read_frames"]
