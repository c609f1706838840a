"""fuse_dense_chains: dense-layer chains of a scan body as one Pallas kernel each.

On the CPU the kernel runs in Pallas's interpret mode: these tests check what it computes (the
same function as the equations it replaces, within the reassociation tolerance), which chains are
found and which are refused; its speed is the GPU's (benchmarks/experiments/fused_mlp.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers_optimize as H
from rose_jax import trace as rtrace
from rose_jax.compare import compare_trees
from rose_jax.optimize import dense_chains as dc
from rose_jax.optimize import registry
from rose_jax.optimize.predict import CandidateContext


def _mlp(p, x):
    for w, b in p[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = p[-1]
    return x @ w + b


def _params(key, dims):
    ks = jax.random.split(key, 2 * len(dims))
    return [
        (
            jax.random.normal(ks[i], (dims[i], dims[i + 1])) / np.sqrt(dims[i]),
            jax.random.normal(ks[i + len(dims)], (dims[i + 1],)) * 0.1,
        )
        for i in range(len(dims) - 1)
    ]


def training(state, xs):
    """A toy of SAC's gradient step: an MLP's loss gradient (forward, backward with ReLU masks,
    weight gradients), the input gradient of another loss, an SGD update."""

    def body(c, x):
        p, acc = c
        g = jax.grad(lambda p: jnp.sum(_mlp(p, x) ** 2))(p)
        gx = jax.grad(lambda x: jnp.sum(jnp.tanh(_mlp(p, x))))(x)
        p = jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)
        return (p, acc + jnp.sum(gx)), jnp.mean(_mlp(p, x))

    return jax.lax.scan(body, state, xs)


def _inputs(seed, dims=(9, 128, 128, 3), rows=48, steps=4):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return (_params(k1, dims), jnp.float32(0)), jax.random.normal(k2, (steps, rows, dims[0]))


def _pallas_calls(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


@pytest.mark.parametrize("seed", [0, 1])
def test_same_function_on_random_inputs(seed):
    state, xs = _inputs(seed)
    t = dc.fuse_dense_chains()
    found = dc.find_chains(H.first_scan(training, state, xs))
    # the loss's forward pass (3 layers), its input gradient back to the first layer's output
    # (2 layers: the weight gradients read it), the second loss's forward and its input gradient
    # to x (3 layers), the metric's forward pass
    assert [len(c.layers) for c in found.chains] == [3, 2, 3, 3, 3], dc.describe(found, None)
    assert found.chains[1].widths == (3, 128, 128)
    # the ReLU derivatives' predicates (z > 0) are compared in the kernel from z
    assert found.chains[1].describe().count("positive") == 2, found.chains[1].describe()
    ref = jax.jit(training)(state, xs)
    out = jax.jit(t.apply(training))(state, xs)
    cmp = compare_trees(out, ref, rtol=1e-5, atol=1e-6)
    assert cmp.equal, cmp
    assert _pallas_calls(t.apply(training), state, xs) == 5


def test_widths_padded_and_rows_not_a_multiple_of_the_block():
    state, xs = _inputs(2, dims=(5, 96, 80, 1), rows=37)
    t = dc.fuse_dense_chains(block_rows=16, chunk=16)
    assert dc.find_chains(H.first_scan(training, state, xs)).moves
    cmp = compare_trees(
        jax.jit(t.apply(training))(state, xs), jax.jit(training)(state, xs), rtol=1e-5, atol=1e-6
    )
    assert cmp.equal, cmp


def _masked(w, xs):
    """A mask that is not a ReLU's derivative (its predicate another comparison), kept where false."""

    def body(w, x):
        m = jnp.sin(x @ w[0]) < 0.3
        h = jax.nn.relu(x @ w[0])
        y = jnp.where(m, 0.0, h @ w[1])
        return w, (y @ w[2]).sum(-1)

    return jax.lax.scan(body, w, xs)


def test_other_masks_are_loaded():
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    w = (
        jax.random.normal(k[0], (8, 128)),
        jax.random.normal(k[1], (128, 128)) / 11,
        jax.random.normal(k[2], (128, 4)),
    )
    xs = jax.random.normal(k[3], (3, 32, 8))
    found = dc.find_chains(H.first_scan(_masked, w, xs))
    assert [o.kind for L in found.chains[0].layers for o in L.ops] == ["relu", "mask"], dc.describe(
        found, None
    )
    t = dc.fuse_dense_chains()
    cmp = compare_trees(jax.jit(t.apply(_masked))(w, xs), jax.jit(_masked)(w, xs), rtol=1e-5, atol=1e-5)
    assert cmp.equal, cmp


def _self_reading(w, xs):
    """A residual: layer B's epilogue adds layer A's output, which two equations continue: the
    chain ends at that value, one layer long."""

    def body(w, x):
        h = jax.nn.relu(x @ w[0])
        y = jax.nn.relu(h @ w[1] + h)
        return w, (y @ w[2]).sum()

    return jax.lax.scan(body, w, xs)


def _non_convex(w, xs):
    """An equation outside the chain reads its first layer and feeds its second layer's epilogue."""

    def body(w, x):
        h = jax.nn.relu(x @ w[0])
        y = jax.nn.relu(h @ w[1] + jnp.sin(h))
        return w, (y @ w[2]).sum()

    return jax.lax.scan(body, w, xs)


def _wide_in(w, xs):
    """Wide -> wide -> wide: no narrow first layer."""

    def body(w, x):
        return w, (jax.nn.relu(jax.nn.relu(x @ w[1]) @ w[1]) @ w[2]).sum()

    return jax.lax.scan(body, w, xs)


@pytest.mark.parametrize(
    "fn, xdim, why",
    [
        (_self_reading, 8, "no chain of two or three dense layers"),
        (_non_convex, 8, "reads what depends on it"),
        (_wide_in, 128, "no chain of two or three dense layers"),
    ],
)
def test_refused_with_the_reason(fn, xdim, why):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    w = (
        jax.random.normal(k[0], (8, 128)),
        jax.random.normal(k[1], (128, 128)),
        jax.random.normal(k[2], (128, 4)),
    )
    xs = jax.random.normal(k[3], (3, 32, xdim))
    found = dc.find_chains(H.first_scan(fn, w, xs))
    assert not found.moves and why in found.why, found.why
    ok, reason = dc.fuse_dense_chains().legal(rtrace.trace(fn, w, xs))
    assert not ok and why in reason, reason
    # applied anyway, the body is rebuilt unchanged
    t = dc.fuse_dense_chains()
    assert _pallas_calls(t.apply(fn), w, xs) == 0
    np.testing.assert_array_equal(jax.jit(t.apply(fn))(w, xs)[1], jax.jit(fn)(w, xs)[1])


def test_bad_kernel_parameters_are_one_line_errors():
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        dc.fuse_dense_chains(block_rows=24)
    with pytest.raises(ValueError, match="at least 16"):
        dc.fuse_dense_chains(chunk=8)


def test_registered_as_a_family():
    assert "rose_jax.optimize.dense_chains" in registry.families()
    t = registry.transform_by_name("fuse_dense_chains", {"where": "_grad_step"})
    assert t.name == "fuse_dense_chains" and dict(t.params) == {"where": "_grad_step"}
    t = registry.transform_by_name(
        "fuse_dense_chains", {"where": None, "block_rows": 16, "chunk": 32, "num_warps": 8}
    )
    assert dict(t.params)["chunk"] == 32


def test_real_sac_iteration_same_state_and_offered_on_gpu_only_where_the_model_gains(monkeypatch):
    import envs
    from algos import sac

    cfg = H.tiny_sac_config(batch_size=32, policy_hidden_sizes=(128, 128), q_hidden_sizes=(128, 128))
    env = envs.make("pendulum")
    it, state = sac.iteration(cfg, env), sac.init(cfg, env, jax.random.PRNGKey(0))
    tree = rtrace.trace(it, state)
    t = dc.fuse_dense_chains("_grad_step")
    ok, why = t.legal(tree)
    assert ok and "_grad_step" in why, why
    # the actor's forward passes (alpha, critic target, actor losses), the twin critics' and
    # target critics' forward passes, the critics' input gradients to the action and the actor's
    # back to its first layer
    found = dc.find_chains(H.first_scan(it, state))
    assert len(found.chains) >= 8, dc.describe(found, None)
    ctx = dict(tree=tree, program=None, baseline_s=1e-3)
    assert dc.candidates(CandidateContext(**ctx, platform="cpu")) == []
    # at the fused kernel's measured cost (slower than XLA's chain, H100) none is offered ...
    assert dc.candidates(CandidateContext(**ctx, platform="gpu")) == []
    # ... and a kernel that cost less than the launches it saves would be (the model, not a timing)
    monkeypatch.setattr(dc, "FUSED_S", dc.KERNEL_S)
    cands = dc.candidates(CandidateContext(**ctx, platform="gpu"))
    assert [c.window for c in cands if c.window.endswith("_grad_step")], [c.window for c in cands]
    ref, _ = jax.jit(it)(state)
    out, _ = jax.jit(t.apply(it))(state)
    cmp = compare_trees(out, ref, rtol=t.tolerance.rtol, atol=t.tolerance.atol)
    assert cmp.equal, cmp
    assert "_grad_step" in [n.name for n in rtrace.trace(t.apply(it), state).walk() if n.kind == "scan"]


def test_the_kernels_lower_to_triton_for_an_h100():
    """The kernels as a GPU compiles them (Triton, not the interpreter), lowered on this CPU for an
    H100 (sm_90): every operation of the kernel has a Triton lowering at these shapes. Whether it
    is fast is the GPU's to say (benchmarks/experiments/beyond_flags.py --variants dense)."""
    try:
        from jax._src import gpu_info
        from jax._src.pallas.triton import pallas_call_registration as registration

        h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    except (ImportError, AttributeError) as e:  # private modules of this jax: the check needs them
        pytest.skip(f"this jax has no way to name an H100 without one: {e}")
    state, xs = _inputs(0, dims=(11, 256, 256, 6), rows=512, steps=2)

    class _H100:  # the GPU the lowering asks about (a CPU has none)
        @staticmethod
        def get_gpu_info():
            return h100

    real = dc.fused_chain
    old = registration.gpu_info_lib
    registration.gpu_info_lib = _H100
    dc.fused_chain = lambda chain, env, **kw: real(chain, env, **{**kw, "interpret": False})
    try:
        lowered = (
            jax.jit(dc.fuse_dense_chains().apply(training))
            .trace(state, xs)
            .lower(lowering_platforms=("cuda",))
        )
    finally:
        registration.gpu_info_lib = old
        dc.fused_chain = real
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 5
