"""The env-group processes path (issue 18) on a Brax MJX env, in process (InlineExecutor).

The workers rebuild their program from its :class:`rose_jax.program.ProgramSpec`. Building a
Brax MJX env creates device arrays (brax's ``mjcf.load_model``); built inside the traced
rollout (the worker jitted its entry point), those arrays were tracers that the worker's
program cache kept, and the next trace (another group, or the same rollout under the search's
compiler options) read a tracer of a finished trace (``UnexpectedTracerError`` on the H200).
The worker functions now build the program eagerly and jit the rollout themselves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from rose_jax import optimize as O
from rose_jax.optimize import measure, process_worker, processes, search

GROUPS = 2


@pytest.fixture(scope="module")
def brax_ppo():
    import envs
    from algos import ppo

    env_kw = (("backend", "mjx"), ("episode_length", 5))
    env = envs.make("inverted_pendulum", **dict(env_kw))
    config = ppo.PPOConfig(
        num_envs=4,
        unroll_length=2,
        num_minibatches=2,
        num_epochs=1,
        policy_hidden_sizes=(4,),
        value_hidden_sizes=(4,),
    )
    program = ppo.program(config, env, env_name="inverted_pendulum", env_kwargs=env_kw)
    state = ppo.init(config, env, jax.random.PRNGKey(0))
    assert program.spec is not None and program.spec.env is not None
    return program, state


@pytest.mark.slow
def test_brax_mjx_env_groups_in_worker_functions(brax_ppo):
    """Each group's rollout traced in turn in one process (a worker that starts with no programs
    built): no tracer leaks from the Brax env's construction; equal to the fused iteration; no
    trace or compile after the first iteration; the same rollouts under XLA options (the search's
    equality check) are traced again without a leak."""
    program, state = brax_ppo
    process_worker.forget_programs()
    iterate = jax.jit(program.iteration())
    ref, _ = iterate(state)
    ref2, _ = iterate(ref)
    pc = processes.ProcessCollect(program, GROUPS, executor=processes.InlineExecutor())
    try:
        step = search.compile_step(program._replace(collect=pc, host=True, groups=GROUPS, mode="processes"))
        out, _ = step(state)
        assert pc.stats()["mode"] == "resident", pc.stats()["reason"]
        tol = O.group_rollout(GROUPS).tolerance.rtol
        cmp = measure.compare_trees(step.sync_state(out), ref, tol)
        assert cmp.equal, cmp.reason
        before = process_worker.compile_events()
        out2, _ = step(out)
        jax.block_until_ready(out2)
        assert process_worker.compile_events() == before  # zero traces and compiles
        cmp = measure.compare_trees(step.sync_state(out2), ref2, tol)
        assert cmp.equal, cmp.reason
        with_options = pc.with_compiler_options({"xla_llvm_disable_expensive_passes": True})
        jax.block_until_ready(with_options(out2))
    finally:
        pc.close()


@pytest.mark.slow
def test_brax_mjx_env_groups_whole_states(brax_ppo):
    """The non-resident path (whole group states both ways, ``worker_collect``) on the Brax env."""
    program, state = brax_ppo
    process_worker.forget_programs()
    ref, _ = jax.jit(program.collect)(state)
    pc = processes.ProcessCollect(program, GROUPS, executor=processes.InlineExecutor(), resident=False)
    try:
        out, _ = pc(state)
        assert pc.stats()["mode"] == "full"
        cmp = measure.compare_trees(out, ref, O.group_rollout(GROUPS).tolerance.rtol)
        assert cmp.equal, cmp.reason
    finally:
        pc.close()


@pytest.mark.parametrize("entry", ["worker_collect", "worker_rollout"])
def test_worker_entry_points_refuse_to_be_traced(entry):
    """They build a program, so they must run outside any trace: jitting one is a clear error."""
    fn = functools.partial(getattr(process_worker, entry), spec=None, g=0, groups=GROUPS)
    args = (jnp.zeros(2),) if entry == "worker_collect" else ((jnp.zeros(2),), ())
    if entry == "worker_rollout":
        fn = functools.partial(fn, layout=None)
    with pytest.raises(TypeError, match="call it with jit=False"):
        jax.jit(fn)(*args)


def test_commit_keeps_placed_arrays_and_places_the_others_on_the_default_device():
    """processes._commit: an array already committed to the default device in its default memory is
    returned as is (no device_put per leaf per iteration); uncommitted arrays, numpy arrays and a
    1-device NamedSharding all end up with the one SingleDeviceSharding jit sees every iteration."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rose_jax.jaxpr import compat
    from rose_jax.optimize import processes

    device = jax.devices()[0]
    placed = jax.device_put(jnp.ones(3), device)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    named = jax.device_put(jnp.ones(4), NamedSharding(mesh, PartitionSpec("data")))
    out = processes._commit(
        {"placed": placed, "loose": jnp.ones(2) * 2, "np": np.ones(2), "named": named, "n": 3}
    )
    assert out["placed"] is placed and out["n"] == 3
    for k in ("loose", "np", "named"):
        assert out[k].committed and out[k].sharding == compat.single_device_sharding(device), k
