"""rose_jax.trace.depth: the longest dependency chain of a jaxpr, counted on known programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rose_jax import trace as rtrace
from rose_jax.trace import depth


def _mlp(ws, x):
    for w in ws[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ ws[-1]


WS = [jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.ones((8, 2))]
X = jnp.ones((16, 4))


def test_an_mlp_forward_is_its_layers_in_series():
    c = depth.chain(jax.make_jaxpr(_mlp)(WS, X))
    assert (c.matmuls, c.longest_matmuls) == (3, 3)
    assert c.longest_ops == c.ops  # a forward pass is one chain: every operation waits for the one before


def test_a_gradient_step_chain_is_forward_then_the_input_gradients_then_one_weight_gradient():
    """d loss / d (all weights) of a 3-layer MLP: 3 forward products, 2 input-gradient products
    and 3 weight-gradient products; on one path: the forward, the 2 input gradients, then the
    first layer's weight gradient (the other weight gradients branch off)."""
    loss = lambda ws, x: jnp.sum(_mlp(ws, x) ** 2)  # noqa: E731
    c = depth.chain(jax.make_jaxpr(jax.grad(loss))(WS, X))
    assert (c.matmuls, c.longest_matmuls) == (8, 6)
    assert c.longest_ops < c.ops


def test_independent_products_are_side_by_side_and_loops_in_series():
    two = depth.chain(jax.make_jaxpr(lambda a, b: (a @ b, b @ a))(jnp.ones((3, 3)), jnp.ones((3, 3))))
    assert (two.matmuls, two.longest_matmuls, two.longest_ops) == (2, 1, 1)

    def loop(w, x):
        return jax.lax.scan(lambda x, _: (jnp.tanh(x @ w) @ w, None), x, None, length=5)[0]

    closed = jax.make_jaxpr(loop)(jnp.ones((3, 3)), jnp.ones((2, 3)))
    c = depth.chain(closed)
    assert (c.matmuls, c.longest_matmuls) == (10, 10)  # 5 trips of 2 products, one after another
    (path, trips, body), = depth.loop_chains(rtrace.trace(loop, jnp.ones((3, 3)), jnp.ones((2, 3))))
    assert trips == 5 and (body.matmuls, body.longest_matmuls, body.ops, body.longest_ops) == (2, 2, 3, 3)
    assert "2 of its 2 matrix products and 2 of its 2 kernels in series" in body.describe()


def test_kernels_count_the_operations_that_end_a_fusion_not_the_elementwise_work_between():
    """relu(x @ w) * 2 summed: the product and the sum are kernels of their own; the max and the
    multiply fuse into them. Two reductions of one input are two kernels side by side; a softmax's
    max then sum are two in series."""
    w, x = jnp.ones((4, 4)), jnp.ones((8, 4))
    c = depth.chain(jax.make_jaxpr(lambda w, x: jnp.sum(jax.nn.relu(x @ w) * 2.0))(w, x))
    assert (c.kernels, c.longest_kernels, c.matmuls) == (2, 2, 1)
    assert c.ops > c.kernels  # the elementwise equations are counted as operations only
    side = depth.chain(jax.make_jaxpr(lambda x: (x.sum(0), x.max(1)))(x))
    assert (side.kernels, side.longest_kernels) == (2, 1)
    soft = depth.chain(jax.make_jaxpr(lambda x: jax.nn.softmax(x, axis=-1))(x))
    assert soft.longest_kernels == 2 and soft.matmuls == 0

    def loop(x):
        return jax.lax.scan(lambda x, _: (x - x.sum(0, keepdims=True), None), x, None, length=3)[0]

    assert depth.chain(jax.make_jaxpr(loop)(x))[4:] == (3, 3)  # one reduction per trip, in series


def test_a_cond_counts_its_longest_branch_and_a_call_its_equations_inline():
    def f(p, w, x):
        inner = jax.jit(lambda x: (x @ w) @ w)
        return jax.lax.cond(p, lambda x: inner(x) @ w, lambda x: x, x)

    c = depth.chain(jax.make_jaxpr(f)(True, jnp.ones((3, 3)), jnp.ones((2, 3))))
    assert (c.matmuls, c.longest_matmuls) == (3, 3)


def test_the_sac_gradient_step_is_hottest_and_longest_in_series():
    """On a tiny SAC iteration the gradient-step loop is the hottest loop, and its body (critic,
    actor and temperature losses with their gradients and Adam) has more matrix products than any
    one path holds: the independent losses run side by side, the chain is what is left."""
    import envs
    from algos import sac

    env = envs.make("pendulum")
    config = sac.SACConfig(num_timesteps=1200, num_envs=8, grad_updates_per_step=3, batch_size=32,
                           min_replay_size=64, policy_hidden_sizes=(16, 16), q_hidden_sizes=(16, 16),
                           num_evals=4, num_eval_envs=0)
    state = sac.init(config, env, jax.random.PRNGKey(0))
    tree = rtrace.trace(sac.iteration(config, env), state, arg_names=["state"])
    path, trips, body = depth.loop_chains(tree)[0]
    assert trips == 3 and path.endswith("_grad_step")
    assert 0 < body.longest_matmuls < body.matmuls and body.longest_ops < body.ops
    # the losses' reductions add to the path
    assert body.longest_matmuls < body.longest_kernels < body.kernels
