"""batch_twins: two same-shaped independent networks in a scan body (SAC's twin critics) run as one
vmap compute the same function (random inputs, reverse scans, a real SAC iteration), their matrix
products become batched ones and their carried weights are carried stacked; bodies without twins,
or whose same-shaped products depend on each other, are refused with the reason."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers_optimize as H
from rose_jax import trace as rtrace
from rose_jax.compare import compare_trees
from rose_jax.jaxpr import dataflow
from rose_jax.optimize import interpret, registry, twins
from rose_jax.optimize.predict import CandidateContext


def _mlp(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def twin_critics(params, xs, reverse=False):
    """A toy of SAC's critic step: two Q-networks on the same input, a loss through their
    minimum, momentum-SGD updates of both and a Polyak average of both targets."""

    def body(carry, x):
        q, mom, target = carry
        y = jnp.minimum(_mlp(target[0], x), _mlp(target[1], x)).sum(-1)

        def loss(q):
            return jnp.mean((jnp.minimum(_mlp(q[0], x), _mlp(q[1], x)).sum(-1) - 0.9 * y) ** 2)

        value, g = jax.value_and_grad(loss)(q)
        mom = jax.tree.map(lambda m, g: 0.9 * m + g, mom, g)
        q = jax.tree.map(lambda p, m: p - 0.01 * m, q, mom)
        target = jax.tree.map(lambda t, p: 0.95 * t + 0.05 * p, target, q)
        return (q, mom, target), value

    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.lax.scan(body, (params, zeros, params), xs, reverse=reverse)


def one_network(p, xs):
    def body(p, x):
        g = jax.grad(lambda p: jnp.sum(_mlp(p, x) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), x.sum()

    return jax.lax.scan(body, p, xs)


def chained(w, xs):
    """Same-shaped products that share an operand but depend on each other: no twins."""

    def body(w, x):
        h = jnp.tanh(x @ w)
        return w + 0.01 * jnp.tanh(h @ w).T @ x, h.sum()

    return jax.lax.scan(body, w, xs)


def _net(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (6, 16)) / 3,
        "b1": jax.random.normal(k2, (16,)) / 10,
        "w2": jax.random.normal(k3, (16, 1)) / 4,
    }


def _inputs(seed, t=5):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (_net(k1), _net(k2)), jax.random.normal(k3, (t, 12, 6))


def _body_dots(fn, *args) -> int:
    return sum(e.primitive.name == "dot_general" for e in H.first_scan(fn, *args).body.eqns)


def test_the_two_networks_are_paired_and_their_weights_carried_stacked():
    args = _inputs(0)
    scan = H.first_scan(twin_critics, *args)
    tw = twins.find_twins(scan)
    assert tw.moves, tw.why
    dots = sum(e.primitive.name == "dot_general" for e in scan.body.eqns)
    # every product of one network has its twin: targets' and the loss's forward passes and
    # the loss's backward pass
    assert 2 * tw.kernels >= dots - 2, (tw.kernels, dots)
    # the carry is (q, mom, target), each a pair of 3-leaf networks: all 9 pairs carried stacked
    assert len(tw.stacked_carry) == 9
    dot_pairs = sum(scan.body.eqns[a].primitive.name == "dot_general" for r in tw.regions for a, _ in r.pairs)
    after = _body_dots(twins.batch_twins().apply(twin_critics), *args)
    assert dot_pairs >= dots // 2 - 1 and after == dots - dot_pairs, (after, dots, dot_pairs)


@pytest.mark.parametrize("reverse", [False, True])
def test_same_function_on_random_inputs(reverse):
    t = twins.batch_twins()
    ref_fn = jax.jit(lambda p, xs: twin_critics(p, xs, reverse))
    new_fn = jax.jit(t.apply(lambda p, xs: twin_critics(p, xs, reverse)))
    for seed in range(3):
        args = _inputs(seed)
        ref, out = ref_fn(*args), new_fn(*args)
        # far inside the stated tolerance: a wrong pairing moves results by O(1)
        cmp = compare_trees(out, ref, rtol=1e-5)
        assert cmp.equal, cmp
        assert t.tolerance.rtol >= 1e-5 and t.tolerance.learning_check


def test_refused_without_twins_or_when_the_products_depend_on_each_other():
    p, xs = _net(jax.random.PRNGKey(0)), jnp.ones((3, 12, 6))
    ok, why = twins.batch_twins().legal(rtrace.trace(one_network, p, xs))
    assert not ok and "no twins" in why, why
    w = jnp.eye(6)
    ok, why = twins.batch_twins().legal(rtrace.trace(chained, w, jnp.ones((3, 6, 6))))
    assert not ok and "no twins" in why, why


def test_registered_as_a_family():
    assert "rose_jax.optimize.twins" in registry.families()
    t = registry.transform_by_name("batch_twins", {"where": "_grad_step"})
    assert t.name == "batch_twins" and dict(t.params)["where"] == "_grad_step"


def test_real_sac_iteration_same_state_and_offered_on_gpu():
    it, state = H.real_iteration("sac")
    t = twins.batch_twins()
    tree = rtrace.trace(it, state)
    ok, why = t.legal(tree)
    assert ok and "_grad_step" in why, why
    cands = twins.candidates(CandidateContext(tree=tree, program=None, baseline_s=1e-3, platform="gpu"))
    assert any(c.window.endswith("_grad_step") for c in cands), [c.window for c in cands]
    assert all(c.predicted > 0 and "kernel pairs" in c.model for c in cands)
    # each region computed from the side that reads its operands as stacked (the tiny SAC's regions
    # as built read 3 operands reversed, a copy per step each)
    assert twins.find_twins(H.first_scan(it, state)).reverses == 0
    # the rebuilt loop keeps its name (where specs of later transforms and the trace read it)
    assert "_grad_step" in [n.name for n in rtrace.trace(t.apply(it), state).walk() if n.kind == "scan"]
    # compiled once each: the same state within the tolerance, and fewer matrix products in the
    # compiled program (each twin pair one batched product)
    ref_c = jax.jit(it).lower(state).compile()
    new_c = jax.jit(t.apply(it)).lower(state).compile()
    cmp = compare_trees(new_c(state)[0], ref_c(state)[0], rtol=t.tolerance.rtol)
    assert cmp.equal, cmp
    dots = [len(re.findall(r"= \S+ dot\(", c.as_text())) for c in (ref_c, new_c)]
    assert dots[1] < dots[0], dots


# ------------------------------------------------------- bodies that must not be batched wrongly
# (each found by review with a minimal repro; the transformed function must equal the original)


def _callbacks(c, xs):
    """Two different host callbacks on the two networks' activations: never one for both rows."""

    def body(c, x):
        h1, h2 = x @ c[0], x @ c[1]
        sd = jax.ShapeDtypeStruct(h1.shape, h1.dtype)
        u = jax.pure_callback(lambda h: np.asarray(h) * 2.0, sd, h1, vmap_method="sequential")
        v = jax.pure_callback(lambda h: np.asarray(h) + 100.0, sd, h2, vmap_method="sequential")
        return c, (u.sum(), v.sum())

    return jax.lax.scan(body, c, xs)


def _near_constants(c, xs):
    """Constants that print alike (0.000123451, 0.000123453) are different constants."""

    def body(c, x):
        return c, ((x @ c[0] * np.float32(0.000123451)).sum(), (x @ c[1] * np.float32(0.000123453)).sum())

    return jax.lax.scan(body, c, xs)


def _recomputed(c, xs):
    """Side b reads a recomputed copy of a value the region makes on side a."""

    def body(c, x):
        x1, x2, y = x @ c[0], x @ c[1], x @ c[0]
        return c, (x2.sum(), (x1 * c[3]) @ c[2], (y * c[4]) @ c[2])

    return jax.lax.scan(body, c, xs)


def _constant_carry(c, xs):
    """A carried pair whose new values are constants (literals in the body)."""

    def body(c, x):
        k1, k2 = (x @ c[0]) * c[3], (x @ c[1]) * c[4]
        return (c[0], c[1], c[2], jnp.float32(1.0), jnp.float32(1.0)), (k1.sum(), k2.sum())

    return jax.lax.scan(body, c, xs)


def _swapped_region(c, xs):
    """A region computed from its other side (net 1's equations come first in the body), reading a
    shared bias computed twice, and writing a carried pair."""

    def body(c, x):
        w0, w1, v0, v1 = c[0], c[1], c[2], c[2] * 0.5
        h0, h1 = x @ w0, x @ w1
        s = jnp.tanh(h0 + h1)  # reads both: the regions before and after it
        r1 = jnp.reshape(c[3] * jnp.ones(4), (1, 4)) * 2.0
        u1 = ((h1 * s) + r1) @ v1
        r0 = jnp.reshape(c[3] * jnp.ones(4), (1, 4)) * 2.0
        u0 = ((h0 * s) + r0) @ v0
        w1n, w0n = w1 - 0.01 * x.T @ (h1 * s), w0 - 0.01 * x.T @ (h0 * s)
        return (w0n, w1n, c[2], c[3], c[4]), (u0.sum(), u1.sum())

    return jax.lax.scan(body, c, xs)


def _odd_inputs():
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    c = (jax.random.normal(k[0], (3, 4)), jax.random.normal(k[1], (3, 4)), jax.random.normal(k[2], (4, 2)),
         jnp.float32(3.0), jnp.float32(4.0))  # fmt: skip
    return c, jax.random.normal(k[3], (2, 5, 3))


@pytest.mark.parametrize("fn", [_callbacks, _near_constants, _recomputed, _constant_carry, _swapped_region])
def test_odd_bodies_compute_the_same_function(fn):
    args = _odd_inputs()
    ref = jax.jit(fn)(*args)
    out = jax.jit(twins.batch_twins().apply(fn))(*args)
    cmp = compare_trees(out, ref, rtol=1e-6)
    assert cmp.equal, cmp


def test_effects_keep_their_order():
    """An ordered callback that reads a twin region runs before the one after it in the body."""
    from jax.experimental import io_callback

    log: list[str] = []

    def record(tag):
        def cb(_):
            log.append(tag)
            return np.zeros((), np.float32)

        return cb

    def fn(c, xs):
        def body(c, x):
            h1, h2 = x @ c[0], x @ c[1]
            io_callback(record("first"), jax.ShapeDtypeStruct((), jnp.float32), h1, ordered=True)
            io_callback(record("second"), jax.ShapeDtypeStruct((), jnp.float32), x, ordered=True)
            z = jnp.sin(x[:, :1])
            return c, ((h1 * z).sum(), (h2 * z).sum())

        return jax.lax.scan(body, c, xs)

    c, xs = (jnp.ones((3, 4)), 2 * jnp.ones((3, 4))), jnp.ones((1, 5, 3))
    assert twins.find_twins(H.first_scan(fn, c, xs)).moves  # the region is there to be misplaced
    jax.block_until_ready(jax.jit(twins.batch_twins().apply(fn))(c, xs))
    assert log == ["first", "second"]


def test_two_draws_of_xlas_generator_stay_two():
    """rng_uniform has no key and no effect in the jaxpr: two draws with the same operands are two
    values, never numbered as one (then both twins would read the first draw)."""

    def fn(c, xs):
        def body(c, x):
            u1, u2 = jax.lax.rng_uniform(0.0, 1.0, (5, 4)), jax.lax.rng_uniform(0.0, 1.0, (5, 4))
            return c, ((x @ c[0]) * u1, (x @ c[1]) * u2)

        return jax.lax.scan(body, c, xs)

    w = jax.random.normal(jax.random.PRNGKey(0), (3, 4))
    xs = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 3))
    _, (a, b) = jax.jit(twins.batch_twins().apply(fn))((w, w), xs)  # the same weights in both networks
    assert not bool(jnp.all(a == b))


def _order_by_ancestors(eqns, regions):
    """The reference ``twins.region_order`` is checked against: repeatedly place the first pending item
    whose transitive ancestors (``ancestors``' bit sets) are all placed."""
    anc = dataflow.ancestors(eqns)
    item_of = {i: ("region", r) for r, (sa, sb) in enumerate(regions) for i in sa | sb}
    items = list(dict.fromkeys(item_of.get(i, i) for i in range(len(eqns))))
    deps = {}
    for it in items:
        members = sorted(regions[it[1]][0] | regions[it[1]][1]) if isinstance(it, tuple) else [it]
        bits = 0
        for i in members:
            bits |= anc[i]
        deps[it] = {item_of.get(j, j) for j in range(len(eqns)) if bits >> j & 1} - {it}
    out, done, pending = [], set(), list(items)
    while pending:
        nxt = next((it for it in pending if deps[it] <= done), None)
        if nxt is None:
            return None
        out.append(nxt)
        done.add(nxt)
        pending.remove(nxt)
    return out


@pytest.mark.parametrize("fn,args", [(twin_critics, _inputs(0)), (_swapped_region, _odd_inputs()),
                                     (_callbacks, _odd_inputs())])  # fmt: skip
def test_order_is_the_ancestor_order_on_random_regions(fn, args):
    """The linear-time schedule places the same items in the same order as the ancestor walk, and
    finds the same cycles, for the body's own regions and for random pairs of equation sets."""
    eqns = list(interpret.inline_calls(H.first_scan(fn, *args)).body.eqns)
    prod = dataflow.producers(eqns)
    rng = np.random.default_rng(0)
    cycles = 0
    for trial in range(60):
        regions = []
        for _ in range(int(rng.integers(1, 4))):
            size = int(rng.integers(1, min(4, len(eqns) // 4) + 1))
            picked = rng.choice(len(eqns), size=2 * size, replace=False)
            if trial % 2:  # contiguous runs: mostly acyclic regions
                start = int(rng.integers(0, len(eqns) - 2 * size + 1))
                picked = np.arange(start, start + 2 * size)
            regions.append((set(int(i) for i in picked[:size]), set(int(i) for i in picked[size:])))
        flat = [i for sa, sb in regions for i in sa | sb]
        if len(flat) != len(set(flat)):
            continue
        got = dataflow.region_order(eqns, regions, prod)
        assert got == _order_by_ancestors(eqns, regions)
        cycles += got is None
    assert 0 < cycles < 60  # both outcomes were exercised
