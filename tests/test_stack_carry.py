"""stack_carries (rose_jax/optimize/stack_carry.py): a scan's small written carried values of one
dtype and shape carried as one stacked array. The same function as the original on random inputs
(MJX's line-search pattern under vmap, and a scan with xs, ys and reverse), bitwise; fewer copies
in the loop body as XLA compiles it here; scans without a group refused with the reason; a real
PPO iteration on MJX physics bitwise equal; the search offers none at the measured share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.experiments.sac_floor import loop_copies
from helpers_optimize import mjx_ppo_iteration, states_after
from rose_jax import trace as rtrace
from rose_jax.compare import compare_trees
from rose_jax.optimize import carry_groups, stack_carries
from rose_jax.optimize.predict import scan_of
from test_early_exit import BATCHED, while_loop_scan


def _bitwise(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(la, lb, strict=True))


def line_search(x, v, w):
    """Three f32 scalars and a counter per environment updated together (each new value reads
    several old ones, as MJX's line search does), 50 steps of ``cond(flag, iterate, no-op)``."""
    return while_loop_scan(
        lambda s: jnp.abs(s[0]) > 1e-3,
        lambda s: (s[0] * 0.5 + 0.1 * s[2], jnp.sin(s[1]) + s[0], s[2] * 0.9 - s[1], s[3] + 1),
        (x, v, w, jnp.int32(0)),
        50,
    )


SEARCH = jax.vmap(line_search)


def test_same_function_on_random_inputs_with_the_carry_stacked():
    """Within the stated tolerance (XLA may contract a multiply-add of the rewritten loop into one
    fused operation where it did not before: last bits, far inside it), and counters exact."""
    t = stack_carries()
    ref, new = jax.jit(SEARCH), jax.jit(t.apply(SEARCH))
    key = jax.random.PRNGKey(0)
    for scale in (1e-4, 1.0, 1e6):
        k1, k2, k3, key = jax.random.split(key, 4)
        args = [jax.random.normal(k, (16,)) * scale for k in (k1, k2, k3)]
        out, want = new(*args), ref(*args)
        cmp = compare_trees(out, want, rtol=t.tolerance.rtol)
        assert cmp.equal, (scale, cmp)
        assert np.array_equal(out[3], want[3])  # the step counter: exact
    # the rewritten loop carries one f32[3,16] where it carried three f32[16]
    scans = [e for e in jax.make_jaxpr(t.apply(SEARCH))(*args).jaxpr.eqns if e.primitive.name == "scan"]
    carried = [v.aval.shape for e in scans for v in e.outvars]
    assert (3, 16) in carried and carried.count((16,)) < 3


def test_xla_copies_the_stacked_carry_fewer_times_per_step():
    args = [jnp.linspace(-2.0, 2.0, 16) + i for i in range(3)]

    def copies(fn):
        c = loop_copies(jax.jit(fn).lower(*args).compile().as_text())
        (lp,) = [lp for lp in c["loops"] if lp["trips"] == 50]
        return lp["copies"]

    before, after = copies(SEARCH), copies(stack_carries().apply(SEARCH))
    assert after < before, (before, after)


def _xs_ys(c, xs):
    def step(carry, x):
        a, b, k = carry
        return (a * 0.5 + b * x, b - a * x, k + 1), a + b

    return jax.lax.scan(step, (c, 2.0 * c, jnp.int32(0)), xs, reverse=True)


def test_a_scan_with_xs_ys_and_reverse_is_the_same_function():
    c, xs = jnp.arange(4.0), jnp.linspace(0.0, 1.0, 7)[:, None] * jnp.ones((7, 4))
    t = stack_carries()
    ok, why = t.legal(rtrace.trace(_xs_ys, c, xs))
    assert ok and "2 x float32[4]" in why, why
    assert _bitwise(jax.jit(t.apply(_xs_ys))(c, xs), jax.jit(_xs_ys)(c, xs))


def _distinct(x):
    return jax.lax.scan(lambda c, _: ((c[0] * 2.0, c[1] + 1.0), None), (x, jnp.ones(5)), None, length=4)[0]


def _passed_through(x):  # the second value is carried unchanged: never written, never copied
    return jax.lax.scan(lambda c, _: ((c[0] * 2.0, c[1]), None), (x, x), None, length=4)[0]


def _with_effects(x):
    def step(c, _):
        jax.debug.callback(lambda v: None, c[0])
        return (c[0] * 2.0, c[1] + c[0]), None

    return jax.lax.scan(step, (x, x), None, length=4)[0]


@pytest.mark.parametrize(
    "fn,reason",
    [
        (_distinct, "no two written carried values of one dtype and shape"),
        (_passed_through, "no two written carried values"),
        (_with_effects, "its body has effects"),
    ],
)
def test_scans_without_a_group_are_refused_with_the_reason(fn, reason):
    x = jnp.arange(3.0)
    ok, why = stack_carries().legal(rtrace.trace(fn, x))
    assert not ok and reason in why, why
    if fn is not _with_effects:  # applied anyway, a refused scan is rebuilt as it was
        assert _bitwise(jax.jit(stack_carries().apply(fn))(x), jax.jit(fn)(x))


def test_large_or_higher_rank_values_are_left_alone_unless_asked():
    def mats(m):
        return jax.lax.scan(lambda c, _: ((c[0] @ c[1], c[1] - c[0]), None), (m, m), None, length=3)[0]

    m = jnp.eye(4)
    scan = scan_of(next(n for n in rtrace.trace(mats, m).walk() if n.kind == "scan"))
    assert carry_groups(scan) == []  # rank 2: left alone by default
    assert carry_groups(scan, max_rank=2) == [[0, 1]]
    assert carry_groups(scan, max_rank=2, max_elements=15) == []
    assert _bitwise(jax.jit(stack_carries(max_rank=2).apply(mats))(m), jax.jit(mats)(m))
    with pytest.raises(ValueError, match="max_rank must be an int >= 0"):
        stack_carries(max_rank=-1)
    with pytest.raises(ValueError, match="max_elements must be an int >= 1"):
        stack_carries(max_elements=0)


def two_flags(x, v):
    """The line-search pattern with a second boolean carried beside the loop's flag (MJX's line
    search carries two): the flags are not stacked, so exit_idle_loops still finds its flag."""
    return while_loop_scan(
        lambda s: jnp.abs(s[0]) > 1e-3,
        lambda s: (s[0] * 0.5, jnp.sin(s[1]) + s[0], s[2] | (s[0] < 0.1), s[3] + 1),
        (x, v, x < 0.0, jnp.int32(0)),
        50,
    )


def test_stacked_first_the_loop_still_stops_early_and_the_function_is_unchanged():
    from rose_jax.optimize import compose, exit_idle_loops

    x, v = jnp.linspace(-3.0, 3.0, 16), jnp.linspace(0.0, 1.0, 16)
    assert _bitwise(jax.jit(stack_carries().apply(BATCHED))(x, v), jax.jit(BATCHED)(x, v))
    fn = jax.vmap(two_flags)
    stacked = stack_carries().apply(fn)
    scan = scan_of(next(n for n in rtrace.trace(fn, x, v).walk() if n.kind == "scan"))
    assert [[scan.body.invars[scan.num_consts + k].aval.dtype for k in g] for g in carry_groups(scan)] == [
        [jnp.float32, jnp.float32]]  # the two f32 values; neither boolean
    ok, why = exit_idle_loops().legal(rtrace.trace(stacked, x, v))
    assert ok and "bool" in why, why
    both = compose([stack_carries(), exit_idle_loops()])(fn)
    assert "while" in {e.primitive.name for e in jax.make_jaxpr(both)(x, v).jaxpr.eqns}
    assert _bitwise(jax.jit(both)(x, v), jax.jit(fn)(x, v))


@pytest.mark.slow
def test_real_ppo_iteration_on_mjx_physics_is_bitwise_equal_and_offered_only_where_copies_pay(monkeypatch):
    """A real PPO iteration on MJX physics: the transform stacks the line search's carried values,
    the result is bitwise the original's after two iterations, and the search offers it only where
    a removed copy is worth its time."""
    pytest.importorskip("brax")
    from rose_jax.optimize.candidates import generate_candidates
    from test_early_exit import ENV

    fn, state, tree = mjx_ppo_iteration(ENV)
    t = stack_carries()
    ok, why = t.legal(tree)
    assert ok and "rollout/sim/_fun" in why and "float32[2]" in why, why
    ref, out = states_after([fn, t.apply(fn)], state)
    assert _bitwise(out, ref)
    # the search offers none at the measured share (the copies it removes ran beside the chain:
    # 0.95x on SAC hopper, H100), and offers this one where a removed copy is worth its time
    from rose_jax.optimize import stack_carry

    assert generate_candidates(tree, None, baseline_s=1.0, platform="gpu", families=("stack_carries",)) == []
    monkeypatch.setattr(stack_carry, "PARALLEL_COPY_SHARE", 1.0)
    cands = generate_candidates(tree, None, baseline_s=1.0, platform="gpu", families=("stack_carries",))
    assert any(c.transform.name == "stack_carries" and "rollout/sim/_fun" in c.window for c in cands), cands
