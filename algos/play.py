"""Roll out a saved policy and render it to a video: ``rose-jax play RUN_DIR --episodes K --out v.mp4``.

:func:`play` loads the run's policy (:func:`algos.policy.load_policy`), rebuilds its env from
the registry, runs ``episodes`` episodes of one env with the deterministic policy (one jitted
step per env step), prints each episode's return, and (with ``out``) renders every step with
MuJoCo's renderer and writes an mp4 (imageio with the ffmpeg binary of ``imageio-ffmpeg``).

Rendering needs an MJCF model: Brax envs (any backend: the model of ``brax.envs``' system),
the MJCF envs (``mjx_cartpole``, ``mjx_swimmer``, ``mjcf`` with ``xml=``) and Playground envs
have one; the pure-JAX classics, gymnax envs and envs added with ``envs.register`` do not (their
returns are still printed); :func:`can_render` tells which, without loading anything. MJCF
models that lack them get a sky, a checkered floor and a light for the video
(:func:`with_scenery`: without them a bare model is a dim object on black). It runs headless:
``MUJOCO_GL`` defaults to ``egl`` when a GPU is visible, else ``osmesa`` (Debian package
``libosmesa6``, which ``scripts/setup.sh`` installs where apt is available). Set ``MUJOCO_GL``
yourself to override; it must be set before MuJoCo's renderer is first created.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from collections.abc import Iterator
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


# the shipped MJCF envs' models (envs/assets/), by factory
_MJCF_ASSETS = {"envs.mjcf:make_mjx_cartpole": "cartpole.xml", "envs.mjcf:make_mjx_swimmer": "swimmer.xml"}


def _model_source(env_name: str) -> str | None:
    """Where :func:`mj_model_for` finds the env's MuJoCo model: "playground", "brax", "mjcf"
    (``xml=`` of ``envs.mjcf:make_mjcf``), "asset" (envs/assets/), or None (it has none)."""
    import envs

    target = envs.factory_path(env_name)
    if not target and env_name.startswith("playground:"):
        return "playground"
    if target.startswith("envs.brax_envs:"):
        return "brax"
    if target == "envs.mjcf:make_mjcf":
        return "mjcf"
    if target in _MJCF_ASSETS:
        return "asset"
    return None


def can_render(env: Any) -> bool:
    """Whether ``rose-jax play RUN --out video.mp4`` can render the env: a registry name (or an
    ``Env``, by its ``name``) whose MuJoCo model :func:`mj_model_for` knows. Cheap: loads nothing."""
    name = env if isinstance(env, str) else getattr(env, "name", None)
    return isinstance(name, str) and _model_source(name) is not None


def suggest_play(run_dir: str | os.PathLike, env: Any) -> str:
    """The ``rose-jax play`` command to suggest after training on ``env`` (a registry name or an
    ``Env``): with ``--out video.mp4`` when :func:`can_render`, else returns only (``--episodes 3``)."""
    command = f"rose-jax play {shlex.quote(os.fspath(run_dir))}"
    return f"{command} --out video.mp4" if can_render(env) else f"{command} --episodes 3"


def mj_model_for(env_name: str, env_kwargs: dict[str, Any] | None = None):
    """The ``mujoco.MjModel`` of a registered env, or None if it has none (see :func:`can_render`).

    MJCF envs' models come through :func:`with_scenery`; Brax and Playground models already have
    a floor and lights.
    """
    import envs
    from envs import mjcf

    kwargs = dict(env_kwargs or {})
    target = envs.factory_path(env_name)
    source = _model_source(env_name)
    if source == "playground":
        with mjcf.quiet_warp_notice():
            from mujoco_playground import registry

        return registry.load(env_name.split(":", 1)[1], config_overrides={"impl": "jax"}).mj_model
    if source == "brax":
        with mjcf.quiet_warp_notice():
            import brax.envs

        brax_name = target.split(":")[1].removeprefix("make_")
        extra = {
            k: v
            for k, v in kwargs.items()
            if k not in ("backend", "episode_length", "reset_mode", "carry_info")
        }
        return brax.envs.get_environment(brax_name, backend="mjx", **extra).sys.mj_model
    if source in ("mjcf", "asset"):
        if source == "mjcf" and "xml" not in kwargs:
            raise ValueError(f"env {env_name!r}: no xml= among its arguments, so no model to render")
        xml = kwargs["xml"] if source == "mjcf" else mjcf.ASSETS / _MJCF_ASSETS[target]
        return with_scenery(mjcf.load_spec(xml, env_name))
    return None


# dm_control's suite look (its common/skybox.xml and materials.xml): a blue gradient sky and a
# dark blue checkered floor
_SKY = {"rgb1": [0.4, 0.6, 0.8], "rgb2": [0.0, 0.0, 0.0], "width": 256, "height": 256}
_GRID = {"rgb1": [0.1, 0.2, 0.3], "rgb2": [0.2, 0.3, 0.4], "width": 300, "height": 300}


def with_scenery(spec):
    """Compile an ``mujoco.MjSpec`` for rendering, adding what it lacks of: a sky (gradient
    skybox), a floor (an infinite checkered plane below the model at ``qpos0``, visual only:
    ``contype = conaffinity = 0``) and a directional light from above.

    Only worldbody geoms, a light and assets are added: ``nq``, the bodies and the kinematics are
    the env's, so its ``qpos`` renders as it is. Returns the ``mujoco.MjModel``.
    """
    import mujoco

    model = spec.compile()
    has_sky = any(t.type == mujoco.mjtTexture.mjTEXTURE_SKYBOX for t in spec.textures)
    has_floor = any(g.type == mujoco.mjtGeom.mjGEOM_PLANE for g in spec.geoms)
    if has_sky and has_floor and spec.lights:
        return model
    extent = float(model.stat.extent)
    if not has_sky:
        spec.add_texture(name="rose_jax_sky", type=mujoco.mjtTexture.mjTEXTURE_SKYBOX,
                         builtin=mujoco.mjtBuiltin.mjBUILTIN_GRADIENT, **_SKY)
    if not has_floor:
        data = mujoco.MjData(model)
        mujoco.mj_forward(model, data)
        solid = model.geom_type != mujoco.mjtGeom.mjGEOM_PLANE
        # lowest point of each geom's bounding box (geom frame: centre, half sizes) in the world
        rot_z = data.geom_xmat.reshape(-1, 3, 3)[:, 2, :]
        center, half = model.geom_aabb[:, :3], model.geom_aabb[:, 3:]
        low = data.geom_xpos[:, 2] + np.sum(rot_z * center, 1) - np.sum(np.abs(rot_z) * half, 1)
        z = min(0.0, float(low[solid].min()) if solid.any() else 0.0) - 0.05 * extent
        spec.add_texture(name="rose_jax_grid", type=mujoco.mjtTexture.mjTEXTURE_2D,
                         builtin=mujoco.mjtBuiltin.mjBUILTIN_CHECKER, mark=mujoco.mjtMark.mjMARK_EDGE,
                         markrgb=_GRID["rgb2"], **_GRID)
        material = spec.add_material(name="rose_jax_grid", texrepeat=[1, 1], texuniform=True,
                                     reflectance=0.2)
        material.textures[mujoco.mjtTextureRole.mjTEXROLE_RGB] = "rose_jax_grid"
        spec.worldbody.add_geom(name="rose_jax_floor", type=mujoco.mjtGeom.mjGEOM_PLANE,
                                size=[0, 0, 0.05], pos=[0, 0, z], material="rose_jax_grid",
                                contype=0, conaffinity=0)
    if not spec.lights:
        spec.worldbody.add_light(name="rose_jax_light", type=mujoco.mjtLightType.mjLIGHT_DIRECTIONAL,
                                 pos=[0, 0, 2 * extent], dir=[0.2, 0.3, -1], diffuse=[0.6, 0.6, 0.6],
                                 specular=[0.2, 0.2, 0.2], castshadow=False)
    return spec.compile()


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
        """Free the GL context now (once); dropping it here lets its ``__del__`` run while
        PyOpenGL is still loaded, not at interpreter exit, where OSMesa's raises."""
        if self._context is not None:
            self._context.free()
            self._context = None
        if self._gl is not None:
            self._gl.free()
            self._gl = None


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
    import envs

    # an env added with envs.register in the training process: its "module:function" is in
    # policy.json (the module must be importable here, as it was there)
    envs.ensure_registered(act.meta["env"], act.meta.get("env_factory"))
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
    try:
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
    finally:
        if renderer is not None:
            renderer.close()
    print_fn(f"mean return {float(np.mean(returns)):.2f} over {episodes} episode(s)")

    if renderer is not None:
        rate = fps or 30
        _write_mp4(os.fspath(out), frames, rate)
        print_fn(f"wrote {out} ({len(frames)} frames, {rate} fps)")
    return PlayResult(returns, lengths, len(frames), None if out is None else os.fspath(out))


@contextlib.contextmanager
def _ffmpeg_without_preexec() -> Iterator[None]:
    """imageio-ffmpeg starts ffmpeg with ``preexec_fn=os.setpgrp`` (so a Ctrl-C reaches only
    Python), which makes ``subprocess`` fork the whole multithreaded JAX process and run Python
    in the child before ``exec``: the unsafe kind of fork that JAX warns about ("os.fork() was
    called ... will likely lead to a deadlock"). ``IMAGEIO_FFMPEG_NO_PREVENT_SIGINT`` (honoured by
    imageio-ffmpeg's ``_popen_kwargs``) drops the ``preexec_fn``; ``subprocess`` then starts
    ffmpeg with its C fork+exec (no Python in the child, no fork handlers). The cost: a Ctrl-C
    also stops ffmpeg, which is what an interrupted ``play`` wants (the partial file is removed).
    """
    name = "IMAGEIO_FFMPEG_NO_PREVENT_SIGINT"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _write_mp4(path: str, frames: list[np.ndarray], fps: int) -> None:
    """Write ``frames`` as an H.264 mp4, atomically (a temporary file, then rename)."""
    import imageio.v2 as imageio

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        with _ffmpeg_without_preexec(), imageio.get_writer(
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

    with _ffmpeg_without_preexec(), imageio.get_reader(os.fspath(path), format="FFMPEG") as reader:
        return np.stack([np.asarray(f) for f in reader])


__all__ = [
    "PlayResult",
    "Renderer",
    "can_render",
    "default_gl_backend",
    "mj_model_for",
    "play",
    "read_frames",
    "suggest_play",
    "with_scenery",
]
