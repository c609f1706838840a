"""Helpers shared by the optimizer's tests (test_optimize, test_offload, test_streams): tiny PPO and
SAC configurations, running an iteration, and the live child processes of this test process."""

from __future__ import annotations

import jax
import psutil


def core(state):
    """A toy iteration's work under one component (``update``), for the search's tests."""
    import jax.numpy as jnp

    import rose_jax

    with rose_jax.component("update"):
        w = state["w"] * 0.99 + 0.01 * jnp.tanh(state["w"])
    return {"w": w, "n": state["n"] + 1}, {"norm": jnp.sum(w * w)}


def example_state():
    """The toy iteration's state: 16 floats and a step counter."""
    import jax.numpy as jnp

    return {"w": jnp.linspace(-1.0, 1.0, 16), "n": jnp.zeros((), jnp.int32)}


def tiny_ppo_config(num_envs: int = 4, unroll_length: int = 4, **overrides):
    """A PPO configuration small enough for a CPU test: 2 minibatches, 1 epoch, 8 hidden units."""
    from algos import ppo

    fields = dict(
        num_envs=num_envs,
        unroll_length=unroll_length,
        num_minibatches=2,
        num_epochs=1,
        policy_hidden_sizes=(8,),
        value_hidden_sizes=(8,),
    )
    return ppo.PPOConfig(**{**fields, **overrides})


def tiny_sac_config(**overrides):
    """A SAC configuration small enough for a CPU test: 4 envs, batch 8, 2 gradient steps per env
    step, 8 hidden units, no evaluation envs."""
    from algos import sac

    fields = dict(
        num_envs=4,
        batch_size=8,
        grad_updates_per_step=2,
        num_timesteps=10**6,
        min_replay_size=8,
        max_replay_size=64,
        policy_hidden_sizes=(8,),
        q_hidden_sizes=(8,),
        num_eval_envs=0,
    )
    return sac.SACConfig(**{**fields, **overrides})


def real_iteration(name: str):
    """``(iteration, initial state)`` of a tiny real SAC (pendulum, 4 gradient steps per env step)
    or PPO (cartpole, 2 epochs) iteration, for the loop families' tests."""
    import envs
    from algos import ppo, sac

    if name == "sac":
        mod, cfg, env = sac, tiny_sac_config(grad_updates_per_step=4), envs.make("pendulum")
    else:
        mod, cfg, env = ppo, tiny_ppo_config(num_epochs=2), envs.make("cartpole")
    return mod.iteration(cfg, env), mod.init(cfg, env, jax.random.PRNGKey(0))


def mjx_ppo_iteration(env_name: str = "inverted_pendulum"):
    """``(iteration, initial state, LoopTree)`` of a tiny real PPO iteration on Brax's MJX
    ``env_name`` (2 envs, unroll 2, one minibatch): MJX's line search runs inside its rollout."""
    import envs
    from algos import ppo
    from rose_jax import trace as rtrace

    env = envs.make(env_name, backend="mjx")
    cfg = tiny_ppo_config(num_envs=2, unroll_length=2, num_minibatches=1)
    fn = ppo.iteration(cfg, env)
    state = ppo.init(cfg, env, jax.random.PRNGKey(0))
    return fn, state, rtrace.trace(fn, state)


def fast_compile(fn, *args):
    """``jax.jit(fn)`` compiled for ``args`` with XLA's cheapest optimisation level (a test's
    compile of an MJX program; the same backend and numerics, minutes less on 2 cores)."""
    options = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    return jax.jit(fn).lower(*args).compile(compiler_options=options)


def states_after(fns, state, n: int = 2) -> list:
    """The state after ``n`` calls of each of ``fns`` (``state -> (state, metrics)``) from ``state``,
    each compiled by :func:`fast_compile`."""
    return [run(fast_compile(f, state), state, n) for f in fns]


def first_scan(fn, *args):
    """The decoded params (``compat.ScanParams``) of the first top-level scan of ``fn(*args)``'s jaxpr."""
    from rose_jax.jaxpr import compat as C

    eqn = next(e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "scan")
    return C.scan_params(eqn.params)


def assert_same_state(transform, iteration, state) -> None:
    """``transform.apply(iteration)`` and ``iteration``, jitted, give states equal within the
    transform's tolerance from ``state``."""
    from rose_jax.compare import compare_trees

    ref, _ = jax.jit(iteration)(state)
    out, _ = jax.jit(transform.apply(iteration))(state)
    cmp = compare_trees(out, ref, rtol=transform.tolerance.rtol, atol=transform.tolerance.atol)
    assert cmp.equal, cmp


def run(step, state, n: int):
    """``state`` after ``n`` calls of ``step`` (``state -> (state, metrics)``)."""
    for _ in range(n):
        state, _ = step(state)
    return jax.block_until_ready(state)


def children() -> set[int]:
    """Live child processes of this process (multiprocessing's resource tracker aside)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def fresh_interpreter_result(script: str, *args: str) -> dict:
    """Run ``script`` (``python -c``) in a fresh interpreter on the CPU, with the repository and
    tests/ importable, and return the JSON of its ``RESULT {...}`` line (a test whose setting, e.g.
    JAX's persistent compilation cache, is configured once per process); asserts it printed one."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=root,
        env={**os.environ, "JAX_PLATFORMS": "cpu",
             "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])
