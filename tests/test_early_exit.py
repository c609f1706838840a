"""exit_idle_loops (rose_jax/optimize/early_exit.py): a carry-only scan proven idle once a boolean
carry is all false runs as a while loop that stops there. The same function as the original on
random inputs (MJX's line-search pattern under vmap) and on a real PPO iteration with MJX physics,
bitwise; scans that are not idle are refused with the reason."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_optimize import first_scan, mjx_ppo_iteration, states_after
from rose_jax import trace as rtrace
from rose_jax.optimize import exit_idle_loops, idle_flag
from rose_jax.optimize.early_exit import _every


def while_loop_scan(cond_fun, body_fun, init_val, max_iter):
    """MuJoCo MJX's ``solver._while_loop_scan`` (mujoco 3.17), the pattern this family exists for:
    a scan of ``max_iter`` steps, each ``lax.cond(flag, iterate, no-op)``."""

    def _iter(val):
        next_val = body_fun(val)
        return next_val, cond_fun(next_val)

    def _fun(tup, it):
        val, cond = tup
        return jax.lax.cond(cond, _iter, lambda x: (x, False), val), it

    init = (init_val, cond_fun(init_val))
    return jax.lax.scan(_fun, init, None, length=max_iter)[0][0]


def halve_until_small(x, v):
    """Per environment: halve ``x`` (and mix ``v``) until ``|x| < 1e-3``, at most 50 steps."""
    return while_loop_scan(
        lambda s: jnp.abs(s[0]) > 1e-3,
        lambda s: (s[0] * 0.5, jnp.sin(s[1]) + s[0], s[2] + 1),
        (x, v, jnp.int32(0)),
        50,
    )


BATCHED = jax.vmap(halve_until_small)


def _bitwise(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return False
    return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(la, lb, strict=True))


@pytest.mark.parametrize("check_every", [1, 5, 7, 50])
def test_same_function_on_random_inputs_bitwise(check_every):
    t = exit_idle_loops(check_every=check_every)
    ref, new = jax.jit(BATCHED), jax.jit(t.apply(BATCHED))
    key = jax.random.PRNGKey(0)
    for scale in (1e-4, 1.0, 1e12):  # all idle from the start, a few steps, every one of the 50
        k1, k2, key = jax.random.split(key, 3)
        x = jax.random.normal(k1, (16,)) * scale
        v = jax.random.normal(k2, (16,))
        assert _bitwise(new(x, v), ref(x, v)), (check_every, scale)
    # the rewrite is a while loop where the 50-step scan was
    jx = jax.make_jaxpr(t.apply(BATCHED))(x, v).jaxpr
    assert "while" in {e.primitive.name for e in jx.eqns}
    assert not [e for e in jx.eqns if e.primitive.name == "scan" and e.params["length"] == 50]


def test_idle_flag_finds_the_flag_and_the_check_interval_divides_the_length():
    x = jnp.ones(4)
    scan = first_scan(BATCHED, x, x)
    k, why = idle_flag(scan)
    assert k is not None and "bool[4]" in why and "all false" in why
    assert [_every(50, c) for c in (1, 5, 7, 50, 64)] == [1, 5, 5, 50, 50]
    with pytest.raises(ValueError, match="check_every"):
        exit_idle_loops(check_every=0)


def _counting(x):  # the counter moves even when the flag is off: not idle
    def step(c, _):
        v, n, flag = c
        return (jnp.where(flag, v * 0.5, v), n + 1, flag & (v > 1.0)), None

    return jax.lax.scan(step, (x, jnp.int32(0), x > 0), None, length=8)[0]


def _with_ys(x):
    def step(c, _):
        v, flag = c
        return (jnp.where(flag, v * 0.5, v), flag & (v > 1.0)), v

    return jax.lax.scan(step, (x, x > 0), None, length=8)


def _no_flag(x):
    return jax.lax.scan(lambda c, _: (c * 0.5, None), x, None, length=8)[0]


@pytest.mark.parametrize(
    "fn,reason",
    [
        (_counting, "no boolean carry makes the body the identity"),
        (_with_ys, "0 xs and 1 ys"),
        (_no_flag, "no boolean carry to stop on"),
    ],
)
def test_loops_that_are_not_idle_are_refused_with_the_reason(fn, reason):
    x = jnp.ones(3) * 4.0
    ok, why = exit_idle_loops().legal(rtrace.trace(fn, x))
    assert not ok and reason in why, why
    assert idle_flag(first_scan(fn, x))[0] is None
    # applied anyway, a refused scan is rebuilt as it was
    assert _bitwise(jax.jit(exit_idle_loops().apply(fn))(x), jax.jit(fn)(x))


# Brax's smallest MJX env (its line search runs: joint limits); hopper's contacts are covered, on
# env steps, beside the loops family's rewrites (tests/test_loops.py, one reference compile)
ENV = "inverted_pendulum"


@pytest.mark.slow
def test_real_ppo_iteration_on_mjx_physics_is_bitwise_equal_and_a_candidate():
    """A real PPO iteration on MJX physics (MJX's line search inside the rollout's physics): the
    transform finds the line search, the result is bitwise the original's after two iterations,
    and the search's candidate generation offers it."""
    pytest.importorskip("brax")
    from rose_jax.optimize.candidates import generate_candidates

    fn, state, tree = mjx_ppo_iteration(ENV)
    t = exit_idle_loops()
    ok, why = t.legal(tree)
    assert ok and "rollout/sim/_fun" in why and "bool[2]" in why, why
    ref, out = states_after([fn, t.apply(fn)], state)
    assert _bitwise(out, ref)
    (cand,) = generate_candidates(tree, None, baseline_s=1.0, platform="gpu", families=("exit_idle_loops",))
    assert cand.transform.name == "exit_idle_loops" and cand.window == "rollout/sim/_fun"
    # the model: on a GPU the body's equations set a skipped step's time (latency-bound kernels),
    # at most the profiled component's time; on a CPU the flops share alone
    from rose_jax.optimize import early_exit
    from rose_jax.optimize.predict import LOOP_OVERHEAD_S, outer_trips, scan_of

    node = next(n for n in tree.walk() if n.kind == "scan" and "/".join(n.component_path + (n.name,))
                == "rollout/sim/_fun")
    scan = scan_of(node)
    steps = outer_trips(tree, node) * scan.length
    body_s = steps * len(scan.body.eqns) * early_exit.BODY_EQN_S["gpu"]
    half = early_exit.ASSUMED_IDLE_STEPS
    assert cand.predicted >= half * body_s - steps * LOOP_OVERHEAD_S["gpu"]
    timed = [
        {"path": "(iteration)", "level": 0, "time_s": 1.0},
        {"path": "rollout", "level": 1, "time_s": 1e-9},
    ]
    (capped,) = generate_candidates(tree, None, baseline_s=1.0, platform="gpu", phases=timed,
                                    families=("exit_idle_loops",))
    assert capped.predicted <= half * (1e-9 + steps * LOOP_OVERHEAD_S["gpu"]) < cand.predicted
    (cpu,) = generate_candidates(tree, None, baseline_s=1.0, platform="cpu", families=("exit_idle_loops",))
    assert "0.00us per step" in cpu.model
