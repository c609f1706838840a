"""rose_jax.trace on small synthetic programs: exact trees, read/write sets, deps, costs, rendering.

Only jax is needed (no flax/brax), so the file also runs against other JAX versions.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import rose_jax
from rose_jax import trace as rt
from rose_jax.jaxpr import compat
from rose_jax.trace import Cost, LoopTree, Node, dependency, find, format_tree, independent, trace


def shape(node: Node):
    """(kind, name, trip_count, component_path, part, children) recursively."""
    return (node.kind, node.name, node.trip_count, node.component_path, node.part,
            tuple(shape(c) for c in node.children))


class Params(NamedTuple):
    w: jax.Array
    b: jax.Array


class TrainState(NamedTuple):
    params: Params
    opt: dict
    env: dict


def make_state() -> TrainState:
    return TrainState(
        params=Params(w=jnp.ones((3, 3)), b=jnp.zeros(3)),
        opt={"mu": jnp.zeros((3, 3)), "count": jnp.zeros((), jnp.int32)},
        env={"pos": jnp.ones((4, 3)), "vel": jnp.zeros((4, 3))},
    )


def iteration(train_state: TrainState):
    """rollout (scan: policy, sim) -> update (scan of scans: loss, optimizer)."""
    with rose_jax.component("rollout"):
        def env_step(env, _):
            with rose_jax.component("policy"):
                action = jnp.tanh(env["pos"] @ train_state.params.w + train_state.params.b)
            with rose_jax.component("sim"):
                vel = env["vel"] + 0.1 * action
                env = {"pos": env["pos"] + 0.1 * vel, "vel": vel}
            return env, action

        env, actions = jax.lax.scan(env_step, train_state.env, None, length=5)

    with rose_jax.component("update"):
        def minibatch_step(carry, batch):
            params, opt = carry
            with rose_jax.component("loss"):
                grads = jax.grad(lambda p: jnp.mean((batch @ p.w + p.b) ** 2))(params)
            with rose_jax.component("optimizer"):
                mu = 0.9 * opt["mu"] + grads.w
                params = Params(params.w - 0.01 * mu, params.b - 0.01 * grads.b)
                opt = {"mu": mu, "count": opt["count"] + 1}
            return (params, opt), None

        def epoch_step(carry, _):
            carry, _ = jax.lax.scan(minibatch_step, carry, actions)
            return carry, None

        (params, opt), _ = jax.lax.scan(epoch_step, (train_state.params, train_state.opt), None, length=2)
    return TrainState(params, opt, env), actions.mean()


@jax.custom_jvp
def smooth(x):
    return jax.lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c), x)  # static bounds -> scan


smooth.defjvp(lambda primals, tangents: (smooth(primals[0]), tangents[0]))


def control(x, n):
    """jit > cond > scan; custom_jvp > scan; dynamic fori (while); static while; opaque."""
    @jax.jit
    def inner(x):
        return jax.lax.cond(x.sum() > 0, lambda x: x * 2.0,
                            lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=4)[0], x)

    with rose_jax.component("body"):
        y = inner(x)
        y = smooth(y)
        y = jax.lax.fori_loop(0, n, lambda i, c: c * 1.5, y)  # traced bound -> while, unknown trips
        _, y = jax.lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 2, c[1] + 1.0), (0, y))
    y = jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(y.shape, y.dtype), y)
    return jax.nn.relu(y)  # a trivial custom_jvp/jit: folded into the root


# ------------------------------------------------------------------------------ structure


def test_rl_iteration_tree_is_exact():
    tree = trace(iteration, make_state())
    assert isinstance(tree, LoopTree)
    expected = ("root", "iteration", 1, (), None, (
        ("component", "rollout", 1, ("rollout",), None, (
            ("scan", "env_step", 5, ("rollout",), None, (
                ("component", "policy", 1, ("rollout", "policy"), None, ()),
                ("component", "sim", 1, ("rollout", "sim"), None, ()),
            )),
        )),
        ("component", "update", 1, ("update",), None, (
            ("scan", "epoch_step", 2, ("update",), None, (
                ("scan", "minibatch_step", 5, ("update",), None, (
                    ("component", "loss", 1, ("update", "loss"), None, ()),
                    ("component", "optimizer", 1, ("update", "optimizer"), None, ()),
                )),
            )),
        )),
    ))
    assert shape(tree.root) == expected
    assert [n.primitive for n in tree.nodes("scan")] == ["scan", "scan", "scan"]


def test_control_flow_tree_is_exact():
    tree = trace(control, jnp.ones(3), 3)
    expected = ("root", "control", 1, (), None, (
        ("component", "body", 1, ("body",), None, (
            ("call", "inner", 1, ("body",), None, (
                ("cond", "cond", 1, ("body",), None, (
                    ("scan", "<lambda>", 4, ("body",), "branch0", ()),  # branch 0 = false branch
                )),
            )),
            ("custom", "smooth", 1, ("body",), None, (
                ("scan", "<lambda>", 2, ("body",), None, ()),
            )),
            ("while", "<lambda>", None, ("body",), None, ()),
            ("while", "<lambda>", 5, ("body",), None, ()),
        )),
        ("opaque", "pure_callback", 1, (), None, ()),
    ))
    assert shape(tree.root) == expected
    assert find(tree, "call/cond").primitive == "cond"
    assert find(tree, "custom:smooth").primitive == "custom_jvp_call"
    assert tree.find("inner").primitive in ("jit", "pjit")


def test_keep_trivial_calls_shows_folded_calls():
    tree = trace(control, jnp.ones(3), 3, keep_trivial_calls=True)
    last = tree.root.children[-1]
    assert (last.kind, last.name, last.primitive) == ("custom", "relu", "custom_jvp_call")
    assert [c.kind for c in last.children] == ["call"]


def test_while_trip_counts():
    def loops(x):
        a = jax.lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 3, c[1] * 2.0), (0, x))   # 4
        b = jax.lax.while_loop(lambda c: c[0] <= 10, lambda c: (c[0] + 2, c[1] * 2.0), (0, x))  # 6
        c = jax.lax.while_loop(lambda c: c[0] > 0, lambda c: (c[0] - 1, c[1] * 2.0), (7, x))    # 7
        d = jax.lax.while_loop(lambda c: c[1].sum() < 10.0, lambda c: (c[0], c[1] * 2.0), (0, x))  # ?
        return a[1] + b[1] + c[1] + d[1]

    tree = trace(loops, jnp.ones(3))
    assert [(n.kind, n.trip_count) for n in tree.root.children] == [
        ("while", 4), ("while", 6), ("while", 7), ("while", None)]
    # cost of a static while = trips * (body + cond) + one last cond
    w = tree.root.children[0]
    body_flops = 1 + 3  # i + 3, c * 2 (3 elements)
    assert w.cost.flops == 4 * (body_flops + 1) + 1


def test_fori_loop_static_is_scan_dynamic_is_while():
    def f(x, n):
        x = jax.lax.fori_loop(0, 6, lambda i, c: c + 1.0, x)
        return jax.lax.fori_loop(0, n, lambda i, c: c + 1.0, x)

    tree = trace(f, jnp.ones(2), 6)
    assert [(n.kind, n.trip_count) for n in tree.root.children] == [("scan", 6), ("while", None)]


def test_component_inside_jit_and_grad():
    @jax.jit
    def policy(w, x):
        with rose_jax.component("policy"):
            return jnp.tanh(x @ w).sum()

    def f(w, x):
        with rose_jax.component("update"):
            return jax.grad(policy)(w, x)

    tree = trace(f, jnp.ones((3, 3)), jnp.ones((2, 3)))
    comps = [n.component_path for n in tree.walk() if n.kind == "component"]
    assert ("update",) in comps and ("update", "policy") in comps
    pol = find(tree, "update/policy")
    assert pol.reads == {"w", "x"}


# ------------------------------------------------------------------------- read/write sets


def test_read_and_write_sets():
    tree = trace(iteration, make_state())
    assert tree.input_paths == ("train_state.params.w", "train_state.params.b", "train_state.opt.count",
                                "train_state.opt.mu", "train_state.env.pos", "train_state.env.vel")
    assert tree.output_paths[:6] == tree.input_paths and tree.output_paths[6] == "out[1]"
    params = {"train_state.params.w", "train_state.params.b"}
    opt = {"train_state.opt.mu", "train_state.opt.count"}
    env = {"train_state.env.pos", "train_state.env.vel"}

    policy, sim = find(tree, "rollout/policy"), find(tree, "rollout/sim")
    assert policy.reads == params | {"train_state.env.pos"}
    assert policy.writes == frozenset()
    assert sim.reads == env and sim.writes == env
    assert not (sim.reads & opt)  # the env step does not read the optimizer state

    loss, optimizer = find(tree, "update/loss"), find(tree, "update/optimizer")
    assert loss.reads == params and loss.writes == frozenset()
    assert optimizer.reads == params | opt
    assert optimizer.writes == params | opt
    assert optimizer.out_writes == params | opt
    assert find(tree, "update").writes == params | opt
    assert find(tree, "rollout").out_writes == env  # out[1] = actions.mean() is computed outside
    assert tree.root.out_writes == env | params | opt | {"out[1]"}
    assert tree.root.reads == params | opt | env and tree.root.writes == params | opt | env


def test_unchanged_output_is_not_written_and_paths_are_formatted():
    def f(state, xs, *, scale):
        return {"a": state["a"] * scale, "nested": state["nested"]}, [x + 1.0 for x in xs]

    state = {"a": jnp.ones(2), "nested": {"k": [jnp.ones(2), jnp.zeros(2)]}}
    tree = trace(f, state, [jnp.ones(1), jnp.ones(1)], scale=2.0, arg_names=["state", "xs"])
    assert tree.input_paths == ("state.a", "state.nested.k[0]", "state.nested.k[1]", "xs[0]", "xs[1]",
                                "scale")
    assert tree.output_paths == ("state.a", "state.nested.k[0]", "state.nested.k[1]", "xs[0]", "xs[1]")
    assert tree.root.writes == {"state.a", "xs[0]", "xs[1]"}  # nested.k is returned unchanged
    assert tree.root.reads == {"state.a", "scale", "xs[0]", "xs[1]"}

    named = trace(f, state, [jnp.ones(1), jnp.ones(1)], scale=2.0, out_names=["new", "ys"])
    assert named.output_paths[0] == "new.a" and named.root.writes == frozenset()


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="callable"):
        trace(3, jnp.ones(2))
    with pytest.raises(ValueError, match="arg_names"):
        trace(lambda a, b: a + b, jnp.ones(2), jnp.ones(2), arg_names=["a"])
    with pytest.raises(ValueError, match="not an array"):
        trace(lambda d: d["x"], {"x": jnp.ones(2), "tag": "hello"})
    with pytest.raises(ValueError, match="out_names"):
        trace(lambda a: (a, a), jnp.ones(2), out_names=["only_one"])


# ----------------------------------------------------------------------------- dependencies


def carried(x, y):
    x, y = x * 1.0, y * 1.0  # computed carries: no argument labels inside the loop

    def body(carry, _):
        a, b, z, d = carry
        with rose_jax.component("a"):
            a = a * 2.0
        with rose_jax.component("b"):
            b = b + z  # reads the slot that "c" writes: a dependency across iterations
        with rose_jax.component("c"):
            z = a.sum() * jnp.ones_like(z)  # reads a's result: same-iteration dataflow
        with rose_jax.component("d"):
            d = d + 1.0  # its own slot only
        return (a, b, z, d), None

    (a, b, z, d), _ = jax.lax.scan(body, (x, y, jnp.zeros_like(y), y), None, length=3)
    return a + b + z + d


def test_loop_carried_dependency_and_independence():
    tree = trace(carried, jnp.ones(2), jnp.ones(2))
    a, b, c, d = (find(tree, n) for n in ("a", "b", "c", "d"))
    # no argument paths reach inside (carries are computed), so only dataflow / carries decide
    assert a.reads == b.reads == c.reads == d.reads == frozenset()
    why = dependency(b, c, tree)
    assert why is not None and "loop-carried" in why and "dataflow" not in why
    why = dependency(a, c, tree)
    assert why is not None and "dataflow" in why
    why = dependency(a, b, tree)  # a -> c -> z (next iteration) -> b
    assert why is not None and "loop-carried" in why and "dataflow" not in why
    assert all(independent(x, d, tree) for x in (a, b, c))
    assert not independent(find(tree, "scan"), a, tree)  # a node and its descendant


def test_read_write_conflict_makes_root_siblings_dependent():
    def f(state):
        with rose_jax.component("writer"):
            new_x = state["x"] + 1.0
        with rose_jax.component("reader"):
            y = state["x"] * 2.0
        with rose_jax.component("other"):
            z = state["z"] * 3.0
        return {"x": new_x, "z": state["z"]}, (y, z)

    tree = trace(f, {"x": jnp.ones(2), "z": jnp.ones(2)})
    writer, reader, other = find(tree, "writer"), find(tree, "reader"), find(tree, "other")
    assert writer.writes == {"state.x"} and reader.reads == {"state.x"}
    why = dependency(writer, reader, tree)
    assert why is not None and "writes state.x" in why
    assert independent(writer, other, tree) and independent(reader, other, tree)


def test_cond_branches_are_independent_of_each_other():
    def f(x):
        def yes(x):
            with rose_jax.component("yes"):
                return jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=2)[0]

        def no(x):
            with rose_jax.component("no"):
                return x - 1.0

        return jax.lax.cond(x.sum() > 0, yes, no, x)

    tree = trace(f, jnp.ones(2))
    yes, no = find(tree, "yes"), find(tree, "no")
    assert (yes.part, no.part) == ("branch1", "branch0")
    assert independent(yes, no, tree)
    with pytest.raises(ValueError, match="tree"):
        dependency(yes, no)


# ---------------------------------------------------------------------------------- opaque


def test_unknown_primitives_become_opaque_nodes():
    mystery = jex.Primitive("mystery_op")
    mystery.def_abstract_eval(lambda x, **_: x)
    holder = jex.Primitive("holds_a_jaxpr")  # an unknown higher-order primitive
    holder.def_abstract_eval(lambda x, **_: x)
    inner = jax.make_jaxpr(lambda x: x @ x)(jnp.ones((2, 2)))

    def f(x):
        with rose_jax.component("c"):
            y = mystery.bind(x)
        return holder.bind(y, body=inner)

    tree = trace(f, jnp.ones((2, 2)))
    assert shape(tree.root) == ("root", "f", 1, (), None, (
        ("component", "c", 1, ("c",), None, (("opaque", "mystery_op", 1, ("c",), None, ()),)),
        ("opaque", "holds_a_jaxpr", 1, (), None, ()),
    ))
    assert tree.find("mystery_op").reads == {"x"}
    assert tree.find("holds_a_jaxpr").cost.flops == 2 * 2 * 2 * 2  # its sub-jaxpr, counted once


# ------------------------------------------------------------------------------------ cost


def _xla_flops(fn, *args) -> float:
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return float(analysis.get("flops", 0.0))


def test_matmul_cost_in_a_scan():
    m, k, n = 8, 16, 4
    x, w = jnp.ones((m, k)), jnp.ones((k, n))

    def f(x, w):
        return jax.lax.scan(lambda c, _: (c, x @ w), 0.0, None, length=5)[1]

    tree = trace(f, x, w)
    scan = find(tree, "scan")
    assert scan.trip_count == 5
    bytes_per_matmul = 4 * (m * k + k * n + m * n)
    assert scan.cost == Cost(flops=5 * 2 * m * n * k, bytes=5 * bytes_per_matmul, transcendentals=0)
    assert tree.root.cost == scan.cost
    # XLA counts the matmul itself the same way, but a loop body only once
    assert _xla_flops(lambda x, w: x @ w, x, w) == 2 * m * n * k
    assert _xla_flops(f, x, w) < scan.cost.flops


def test_elementwise_reduction_and_transcendental_costs():
    def f(x):
        return jnp.exp(x).sum() + 1.0

    c = trace(f, jnp.ones((10, 10))).root.cost
    assert (c.flops, c.transcendentals) == (100 + 1, 100)


def test_nested_loop_costs_multiply_by_trip_counts():
    tree = trace(iteration, make_state())
    mb = find(tree, "minibatch_step")
    epoch = find(tree, "epoch_step")
    assert epoch.cost.flops == 2 * mb.cost.flops
    body = mb.children
    assert mb.cost.flops >= 5 * sum(c.cost.flops for c in body)
    rollout = find(tree, "env_step")
    policy_flops = 2 * 4 * 3 * 3 + 4 * 3  # matmul + bias add (tanh is a transcendental)
    assert find(tree, "policy").cost.flops == policy_flops
    assert rollout.cost.flops == 5 * (policy_flops + find(tree, "sim").cost.flops)


# --------------------------------------------------------------------- jaxpr references


def test_nodes_keep_references_to_runnable_sub_jaxprs():
    tree = trace(iteration, make_state())
    scan = find(tree, "env_step")
    (eqn,) = scan.eqns()
    assert eqn.primitive.name == "scan" and scan.level is tree.root.bodies[0]
    body = scan.bodies[0].jaxpr
    assert len(scan.bodies[0].carry) == 2  # env pos, vel
    args = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in body.invars]
    outs = jex.jaxpr_as_fun(body)(*args)
    assert len(outs) == len(body.outvars)
    policy = find(tree, "policy")
    assert policy.level is scan.bodies[0]
    assert all(scan.bodies[0].eqns[i] is e for i, e in zip(policy.eqn_indices, policy.eqns(), strict=True))


# -------------------------------------------------------------------------------- render


def test_format_tree_collapses_runs_of_equal_leaves():
    """MJX's physics step holds dozens of opaque scatter-adds in a row: printed as one line each
    run (summed cost), unless collapse=False."""

    def body(x, i):
        for k in range(4):
            x = x.at[i].add(float(k + 1))
        return x, None

    def fn(state):
        x, _ = jax.lax.scan(body, state["x"], jnp.arange(3))
        return {"x": x}

    tree = trace(fn, {"x": jnp.zeros(5)})
    full = format_tree(tree, collapse=False)
    short = format_tree(tree)
    assert len(full.splitlines()) == len(tree.nodes())
    assert sum("opaque scatter-add" in line for line in full.splitlines()) == 4
    (run,) = [line for line in short.splitlines() if "scatter-add" in line]
    assert run.strip().startswith("4 x opaque scatter-add") and "FLOP" in run
    assert len(short.splitlines()) == len(full.splitlines()) - 3

    def loops(state):  # sibling leaf loops keep their own lines: their trip counts differ
        x = state["x"]
        for n in (2, 5, 7):
            x = jax.lax.fori_loop(0, n, lambda i, v: v * 1.5, x)
        return {"x": x}

    text = format_tree(trace(loops, {"x": jnp.ones(3)}))
    assert all(f"x{n}" in text for n in (2, 5, 7)) and " x scan" not in text


def test_format_tree_and_json(tmp_path):
    tree = trace(iteration, make_state())
    text = format_tree(tree)
    lines = text.splitlines()
    assert len(lines) == len(tree.nodes())
    assert lines[0].startswith("root iteration")
    assert "  scan env_step x5 [rollout]" in text
    assert "+3 more" in lines[0]  # 6 paths read, 3 shown
    assert "FLOP" in lines[0] and "KiB" in text
    assert len(format_tree(tree, max_depth=1).splitlines()) == 1 + 2 + 2  # root, 2 comps, 2 "..."

    data = rt.to_json(tree)
    assert json.loads(json.dumps(data)) == data
    assert data["root"]["children"][0]["children"][0]["trip_count"] == 5
    path = rt.save_json(tree, tmp_path / "sub" / "tree.json")
    assert json.load(open(path)) == data
    assert os.listdir(tmp_path / "sub") == ["tree.json"]


def test_plot_tree_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    tree = trace(control, jnp.ones(3), 3)
    out = rt.plot_tree(tree, tmp_path / "tree.png")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_trees_are_immutable_and_comparable():
    t1, t2 = trace(iteration, make_state()), trace(iteration, make_state())
    assert t1 == t2 and hash(t1.root) == hash(t2.root)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t1.root.name = "x"


# ------------------------------------------------------------------- more higher-order forms


def grow(x):
    def cond(c):
        with rose_jax.component("check"):
            return c[1].sum() < 100.0

    def body(c):
        with rose_jax.component("grow"):
            return (c[0] + 1, c[1] * 2.0)

    return jax.lax.while_loop(cond, body, (0, x))[1]


def test_while_condition_children_and_their_dependency():
    tree = trace(grow, jnp.ones(3))
    assert shape(tree.root) == ("root", "grow", 1, (), None, (
        ("while", "body", None, (), None, (
            ("component", "check", 1, ("check",), "cond", ()),
            ("component", "grow", 1, ("grow",), None, ()),
        )),
    ))
    assert "one after the other" in dependency(find(tree, "check"), find(tree, "grow"), tree)
    # unknown trip count: the cost is one pass of condition + body
    assert tree.find("while").cost.flops == (3 + 1) + (1 + 3)


def test_a_jitted_function_is_described_by_its_body():
    assert trace(jax.jit(grow), jnp.ones(3)) == trace(grow, jnp.ones(3))
    wrapped = trace(jax.jit(grow), jnp.ones(3), unwrap_jit=False)
    assert [(c.kind, c.name) for c in wrapped.root.children] == [("call", "grow")]


def test_shard_map_is_a_call():
    from jax.sharding import Mesh, PartitionSpec

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def f(x):
        def local(x):
            with rose_jax.component("local"):
                return jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=3)[0]

        return shard_map(local, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d"))(x)

    tree = trace(f, jnp.ones(4))
    call = tree.root.children[0]
    assert (call.kind, call.primitive) == ("call", "shard_map")
    assert [(n.kind, n.trip_count) for n in call.walk()][1:] == [("component", 1), ("scan", 3)]
    assert call.reads == {"x"}


def test_transposed_scopes_stay_in_one_component():
    def f(w, x):
        with rose_jax.component("upd"):  # relu's transpose is named 'rose:upd/transpose(rose:upd)/jvp()'
            return jax.grad(lambda w: jax.nn.relu(x @ w).sum())(w)

    tree = trace(f, jnp.ones((3, 3)), jnp.ones((2, 3)))
    assert shape(tree.root) == ("root", "f", 1, (), None, (("component", "upd", 1, ("upd",), None, ()),))
    assert tree.output_paths == ("out",) and tree.root.writes == frozenset()  # a bare array: no match
    assert compat.collapse_repeats(["a", "a", "b", "a", "b", "c"]) == ("a", "b", "c")
