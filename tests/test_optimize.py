"""rose_jax.optimize: every transform computes the same function, illegal ones are rejected,
the search keeps only faster-and-equal candidates, and plans are cached."""

from __future__ import annotations

import dataclasses

import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import helpers_optimize as H
import rose_jax
import toy_program as toy
from helpers_optimize import children as _children
from helpers_optimize import run as _run
from rose_jax import optimize as O
from rose_jax import trace as rtrace
from rose_jax.jaxpr import compat as C
from rose_jax.optimize import base as T
from rose_jax.optimize import candidates, measure, predict, process_worker, processes, search
from rose_jax.optimize import report as plan_report
from rose_jax.optimize.candidates import Candidate
from rose_jax.optimize import interpret as I

# ------------------------------------------------------------------------ synthetic programs


def nested(params, xs):
    """Scan over xs (component outer) with a loop-invariant matmul, an inner scan, a cond, a while."""
    with rose_jax.component("outer"):

        def body(carry, x):
            h, acc = carry
            with rose_jax.component("cell"):
                w2 = jnp.tanh(params["w"]) @ params["w"].T  # invariant: reads only params
                h = jnp.tanh(h @ w2 + x + params["b"])

            def decay(c, _):
                return c * 0.5 + jnp.sum(h), None

            acc, _ = jax.lax.scan(decay, acc, None, length=3)
            acc = jax.lax.cond(acc > 0, lambda a: a * 0.9, lambda a: a + 0.1, acc)
            acc = jax.lax.while_loop(lambda t: t[0] < 2, lambda t: (t[0] + 1, t[1] * 1.01), (0, acc))[1]
            return (h, acc), jnp.sum(h * x)

        (h, acc), ys = jax.lax.scan(body, (jnp.zeros(4), jnp.float32(0.0)), xs)
    return h, acc, ys


def nested_no_while(params, xs):
    """``nested`` without the while loop (reverse-mode differentiable)."""

    def body(carry, x):
        h, acc = carry
        with rose_jax.component("cell"):
            w2 = jnp.tanh(params["w"]) @ params["w"].T
            h = jnp.tanh(h @ w2 + x + params["b"])
        acc, _ = jax.lax.scan(lambda c, _: (c * 0.5 + jnp.sum(h), None), acc, None, length=3)
        return (h, acc), jnp.sum(h * x)

    with rose_jax.component("outer"):
        (h, acc), ys = jax.lax.scan(body, (jnp.zeros(4), jnp.float32(0.0)), xs)
    return jnp.sum(h) + acc + jnp.sum(ys)


def random_inputs(seed=0, t=6):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {"w": 0.5 * jax.random.normal(k1, (4, 4)), "b": 0.1 * jax.random.normal(k2, (4,))}
    return params, jax.random.normal(k3, (t, 4))


def scan_sites(fn, *args):
    return I.sites(jax.make_jaxpr(fn)(*args), kinds=("scan",))


def assert_close(actual, expected, tol: T.Tolerance):
    chex.assert_trees_all_close(actual, expected, rtol=tol.rtol, atol=max(tol.atol, 1e-6))


# ----------------------------------------------------------------------------- unroll_scans


@pytest.mark.parametrize("factor", [2, 3, True])
def test_unroll_same_function_and_really_unrolled(factor):
    params, xs = random_inputs(1)
    t = O.unroll_scans(factor)
    out = jax.jit(t.apply(nested))(params, xs)
    assert_close(out, nested(params, xs), t.tolerance)
    unrolls = [C.scan_params(s.eqn.params).unroll for s in scan_sites(t.apply(nested), params, xs)]
    want = [6, 3] if factor is True else [min(factor, 6), min(factor, 3)]  # jax stores True as the length
    assert unrolls == want
    assert [C.scan_params(s.eqn.params).unroll for s in scan_sites(nested, params, xs)] == [1, 1]


def test_unroll_where_picks_one_loop_and_legality_reads_the_tree():
    params, xs = random_inputs(2)
    t = O.unroll_scans(2, where="outer/decay")
    sites = scan_sites(t.apply(nested), params, xs)
    assert [(s.name, C.scan_params(s.eqn.params).unroll) for s in sites] == [("body", 1), ("decay", 2)]
    tree = rtrace.trace(nested, params, xs)
    assert t.legal(tree)[0]
    ok, why = O.unroll_scans(2, where="no_such_loop").legal(tree)
    assert not ok and "no scan matches" in why
    with pytest.raises(ValueError, match="factor"):
        O.unroll_scans(1)


def test_transforms_compose_with_grad_vmap_jit():
    params, xs = random_inputs(3)
    for t in (O.unroll_scans(2), O.hoist_invariants()):
        g = t.apply(nested_no_while)
        chex.assert_trees_all_close(
            jax.jit(jax.grad(g))(params, xs), jax.grad(nested_no_while)(params, xs), rtol=1e-5, atol=1e-6
        )
        batch = jnp.stack([xs, 2 * xs, -xs])
        chex.assert_trees_all_close(
            jax.vmap(g, in_axes=(None, 0))(params, batch),
            jax.vmap(nested_no_while, in_axes=(None, 0))(params, batch),
            rtol=1e-5,
            atol=1e-6,
        )
        # a transform of a transform is still the same function
        chex.assert_trees_all_close(
            jax.jit(t.apply(g))(params, xs), nested_no_while(params, xs), rtol=1e-5, atol=1e-6
        )


def test_no_recompiles_on_repeated_calls():
    params, xs = random_inputs(4)
    traced_once = chex.assert_max_traces(nested, n=1)
    step = jax.jit(O.unroll_scans(2).apply(traced_once))
    for i in range(4):
        step(params, xs + i)
    chex.clear_trace_counter()


def test_rewrite_keeps_component_names():
    params, xs = random_inputs(5)
    before = rtrace.trace(nested, params, xs)
    after = rtrace.trace(O.unroll_scans(2).apply(nested), params, xs)
    assert rtrace.format_tree(after) == rtrace.format_tree(before)  # same tree: names, loops, costs
    hoisted = rtrace.trace(O.hoist_invariants().apply(nested), params, xs)
    cells = [(len(n.index), n.name) for n in hoisted.walk() if n.kind == "component" and n.name == "cell"]
    assert cells == [(2, "cell"), (3, "cell")]  # part of "cell" now runs before the loop, named as before
    assert hoisted.root.cost.flops < before.root.cost.flops


# ------------------------------------------------------------------------- hoist_invariants


def test_hoist_moves_the_invariant_matmul_out_of_the_loop():
    params, xs = random_inputs(6)
    t = O.hoist_invariants(where="outer")
    assert_close(jax.jit(t.apply(nested))(params, xs), nested(params, xs), t.tolerance)

    def body_prims(fn):
        site = scan_sites(fn, params, xs)[0]
        return [e.primitive.name for e in C.scan_params(site.eqn.params).body.eqns]

    before, after = body_prims(nested), body_prims(t.apply(nested))
    assert before.count("dot_general") == 2 and after.count("dot_general") == 1
    assert before.count("tanh") == 2 and after.count("tanh") == 1
    top = [e.primitive.name for e in jax.make_jaxpr(t.apply(nested))(params, xs).eqns]
    assert "dot_general" in top and "tanh" in top  # computed once, before the loop
    ok, why = t.legal(rtrace.trace(nested, params, xs))
    assert ok and "outer/body" in why


def test_hoist_rejects_loops_without_invariants():
    def pure_carry(c, xs):
        return jax.lax.scan(lambda c, x: (jnp.sin(c) + x, c), c, xs)

    c, xs = jnp.ones(3), jnp.ones((5, 3))
    ok, why = O.hoist_invariants().legal(rtrace.trace(pure_carry, c, xs))
    assert not ok and "nothing to hoist" in why
    scan = C.scan_params(jax.make_jaxpr(pure_carry)(c, xs).eqns[0].params)
    assert O.invariant_eqns(scan) == frozenset()


# ---------------------------------------------------------------------- overlap_independent


def two_loops(s, dependent=False):
    with rose_jax.component("left"):
        a, ya = jax.lax.scan(lambda c, x: (c + jnp.sin(x), c * x), s["a"], s["xs"])
    mid = (a if dependent else s["b"]) * 2.0  # between the loops; the second loop needs it
    with rose_jax.component("right"):
        b, yb = jax.lax.scan(lambda c, x: (c * 0.5 + x, c), mid, s["xs"])
    return {"a": a, "b": b, "ya": ya, "yb": yb}


def test_overlap_fuses_independent_sibling_scans():
    s = {"a": jnp.ones(3), "b": jnp.arange(3.0), "xs": jax.random.normal(jax.random.PRNGKey(0), (7, 3))}
    t = O.overlap_independent("left", "right")
    ok, why = t.legal(rtrace.trace(two_loops, s))
    assert ok, why
    fused = t.apply(two_loops)
    assert_close(jax.jit(fused)(s), two_loops(s), t.tolerance)
    top = [e.primitive.name for e in jax.make_jaxpr(fused)(s).eqns]
    original = [e.primitive.name for e in jax.make_jaxpr(two_loops)(s).eqns]
    assert original.count("scan") == 2 and top.count("scan") == 1  # one loop instead of two


def test_overlap_rejects_dependent_nodes_with_the_reason():
    s = {"a": jnp.ones(3), "b": jnp.arange(3.0), "xs": jnp.ones((7, 3))}

    def dependent(s):
        return two_loops(s, dependent=True)

    t = O.overlap_independent("left", "right")
    ok, why = t.legal(rtrace.trace(dependent, s))
    assert not ok and "dependent" in why and "dataflow" in why
    with pytest.raises(ValueError, match="depends on the first"):
        jax.jit(t.apply(dependent))(s)

    def unequal(s):
        a, _ = jax.lax.scan(lambda c, x: (c + x, None), s["a"], s["xs"])
        b, _ = jax.lax.scan(lambda c, x: (c + x, None), s["b"], s["xs"][:3])
        return a, b

    ok, why = O.overlap_independent("scan", "scan").legal(rtrace.trace(unequal, s))
    assert not ok


# ---------------------------------------------------------------------- group_rollout (toy)


@pytest.fixture(scope="module")
def toy_setup():
    program = toy.toy_program(num_envs=8, unroll_length=5)
    state = toy.init(8)
    ref = jax.jit(program.iteration())
    ref_state = state
    for _ in range(3):
        ref_state, _ = ref(ref_state)
    return program, state, ref_state


@pytest.mark.parametrize("mode,groups", [("sequential", 2), ("interleaved", 2), ("interleaved", 4)])
def test_group_rollout_equals_single_batch(toy_setup, mode, groups):
    program, state, ref_state = toy_setup
    t = O.group_rollout(groups, mode)
    ok, why = t.legal(O.trace_program(program, state))
    assert ok, why
    grouped = t.apply(program)
    assert grouped.groups == groups and grouped.mode == mode
    out = _run(jax.jit(grouped.iteration()), state, 3)
    assert measure.compare_trees(out, ref_state, t.tolerance.rtol, t.tolerance.atol).equal


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "full"])
def test_group_rollout_in_worker_function_path(toy_setup, resident):
    """The processes data path (per-group worker functions rebuilt from the spec, merge), in process."""
    program, state, ref_state = toy_setup
    collect = processes.ProcessCollect(program, 4, executor=processes.InlineExecutor(), resident=resident)
    host_program = program._replace(collect=collect, host=True, groups=4, mode="processes")
    step = search.compile_step(host_program)
    out = _run(step, state, 3)
    assert isinstance(out.x, processes.ResidentEnv) == resident  # the env batch stayed in the "workers"
    cmp = measure.compare_trees(step.sync_state(out), ref_state, O.group_rollout(2).tolerance.rtol)
    assert cmp.equal, cmp.reason
    st = collect.stats()
    assert st["mode"] == ("resident" if resident else "full") and st["counts"]["iteration"] == 3
    iters = [r for r in st["per_iteration"] if r["kind"] == "iteration"]
    x_bytes = state.x.nbytes
    if resident:
        # sent: w, mean, key to each of 4 workers (not x, not steps); back: the data (obs, action)
        assert [r["sent_bytes"] for r in iters] == [
            4 * (state.w.nbytes + state.mean.nbytes + state.key.nbytes)
        ] * 3
        assert [r["received_bytes"] for r in iters] == [2 * 5 * x_bytes] * 3
        assert [r["upload_bytes"] for r in iters] == [x_bytes, 0, 0] and st["counts"]["put"] == 1
    else:
        assert all(r["sent_bytes"] >= x_bytes and r["upload_bytes"] == 0 for r in iters)


def _paths(tree, prefix=""):
    return [prefix + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _uploads(pc):
    return [(r["upload"], r["upload_bytes"]) for r in pc.stats()["per_iteration"] if r["kind"] == "iteration"]


def test_resident_state_rules(toy_setup):
    """Versions and identity: a state from an earlier iteration cannot continue; a real env part is
    uploaded (a changed env state re-initialises the workers); the same start state again restores
    the workers' copy without a transfer; put_env is the explicit upload."""
    program, state, ref_state = toy_setup
    tol = O.group_rollout(2).tolerance.rtol
    pc = processes.ProcessCollect(program, 2, executor=processes.InlineExecutor())
    learn = jax.jit(program.learn)

    def run(s, n):
        for _ in range(n):
            s = learn(*pc(s))[0]
        return s

    s1 = run(state, 1)
    s3 = run(s1, 2)
    with pytest.raises(ValueError, match="earlier iteration cannot continue"):
        pc(s1)
    with pytest.raises(ValueError, match="another ProcessCollect"):
        processes.ProcessCollect(program, 2, executor=processes.InlineExecutor()).sync_state(s3)
    assert measure.compare_trees(pc.sync_state(s3), ref_state, tol).equal
    assert _uploads(pc) == [("put", state.x.nbytes), (None, 0), (None, 0)]

    assert measure.compare_trees(pc.sync_state(run(state, 3)), ref_state, tol).equal
    assert _uploads(pc)[3:] == [("restore", 0), (None, 0), (None, 0)]

    moved = state.replace(x=state.x[::-1] + 0.5)  # e.g. restored from elsewhere
    ref_moved = _run(jax.jit(program.iteration()), moved, 3)
    assert measure.compare_trees(pc.sync_state(run(moved, 3)), ref_moved, tol).equal
    assert _uploads(pc)[6:] == [("put", state.x.nbytes), (None, 0), (None, 0)]

    marked = pc.put_env(state)
    assert isinstance(marked.x, processes.ResidentEnv)
    chex.assert_trees_all_equal(pc.sync_state(marked), state)
    assert measure.compare_trees(pc.sync_state(run(marked, 3)), ref_state, tol).equal
    pc.close()
    with pytest.raises(ValueError, match="no longer hold this state's env state"):
        pc(marked)


def test_resident_falls_back_when_learn_reads_the_env_part(toy_setup):
    program, state, ref_state = toy_setup

    def learn(s, data):
        new, metrics = program.learn(s, data)
        return new, {**metrics, "x_mean": jnp.mean(s.x)}

    variant = program._replace(learn=learn)
    plan = processes.plan_resident(variant, state, 2)
    assert not plan.resident and "learn reads the state's env part (.x)" in plan.reason
    pc = processes.ProcessCollect(variant, 2, executor=processes.InlineExecutor())
    out = _run(search.compile_step(variant._replace(collect=pc, host=True, groups=2)), state, 3)
    assert not isinstance(out.x, processes.ResidentEnv)
    assert measure.compare_trees(out, ref_state, O.group_rollout(2).tolerance.rtol).equal
    st = pc.stats()
    assert st["mode"] == "full" and "learn reads" in st["reason"]


def test_resident_plan_of_ppo_sends_only_what_the_rollout_reads(ppo_setup):
    ppo, config, env, state, _ = ppo_setup
    program = ppo.program(config, env, env_name="pendulum")
    plan = processes.plan_resident(program, state, 2)
    assert plan.resident, plan.reason
    sent = {plan.paths[i] for i in plan.layout.sent}
    assert sent == set(_paths(state.params.policy, ".params.policy")) | {
        ".normalizer.mean",
        ".normalizer.std",
        ".key",
    }
    zeros = {plan.paths[i] for i, _, _ in plan.layout.zeros}
    assert (
        set(_paths(state.opt_state, ".opt_state")) | set(_paths(state.params.value, ".params.value")) <= zeros
    )
    assert not plan.layout.changed
    names = _paths(jax.eval_shape(program.collect, state)[1])
    used = {names[j] for j in plan.layout.data_used}
    transitions = {f"[0].{f}" for f in ppo.Transition._fields}
    assert used == transitions | {"[1].obs", "[1].last_episode_return", "[1].episodes"}  # no physics state
    assert plan.env_bytes == sum(x.nbytes for x in jax.tree.leaves(state.env_state))


# ---------------------------------------------------- processes mode in real worker processes


def _our_segments() -> set[str]:
    import os

    prefix = f"rose{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def ppo16():
    import envs
    from algos import ppo

    env = envs.make("pendulum")
    config = H.tiny_ppo_config(num_envs=16)
    program = ppo.program(config, env, env_name="pendulum")
    state = ppo.init(config, env, jax.random.PRNGKey(0))
    moved = state.replace(env_state=ppo.init(config, env, jax.random.PRNGKey(1)).env_state)
    iterate = jax.jit(program.iteration())
    return program, state, _run(iterate, state, 3), moved, _run(iterate, moved, 3)


@pytest.mark.slow
def test_resident_ppo_in_real_workers_equal_and_env_state_stays(ppo16):
    """2 spawned CPU workers: equal after 3 iterations; only the first iteration moves the env state,
    and the runtime's own byte counts agree; an env state changed on the driver is re-uploaded."""
    program, state, ref, moved, ref_moved = ppo16
    tol = O.group_rollout(2).tolerance.rtol
    grouped = O.group_rollout(2, "processes").apply(program)
    pc, step = grouped.collect, search.compile_step(grouped)
    try:
        out = _run(step, state, 3)
        assert isinstance(out.env_state, processes.ResidentEnv)
        pool = pc.executor.pool
        per_worker_in = {
            w: sum(st[f"in_{k}_bytes"] for k in ("shm", "ipc", "inline")) for w, st in pool.last_stats.items()
        }
        iters = [r for r in pc.stats()["per_iteration"] if r["kind"] == "iteration"]
        cmp = measure.compare_trees(step.sync_state(out), ref, tol)
        assert cmp.equal, cmp.reason

        env_bytes = sum(x.nbytes for x in jax.tree.leaves(state.env_state))
        rollout_reads = sum(
            x.nbytes
            for x in jax.tree.leaves(
                (state.params.policy, state.normalizer.mean, state.normalizer.std, state.key)
            )
        )
        transitions, final = jax.eval_shape(program.collect, state)[1]
        learn_reads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(transitions))
        learn_reads += sum(
            x.size * x.dtype.itemsize for x in (final.obs, final.last_episode_return, final.episodes)
        )
        assert [r["upload_bytes"] for r in iters] == [env_bytes, 0, 0]
        assert [r["sent_bytes"] for r in iters] == [2 * rollout_reads] * 3
        assert [r["received_bytes"] for r in iters] == [learn_reads] * 3
        assert per_worker_in == {"group0": rollout_reads, "group1": rollout_reads}  # what really moved
        # where an iteration's time goes: the wait for the learn's outputs, the round trip, and in
        # the slowest worker its input decoding, function and output encoding (each inside the round trip)
        for r in iters:
            assert r["input_wait_s"] >= 0 and r["driver_before_s"] >= 0 and r["driver_after_s"] > 0
            assert 0 < r["worker_decode_s"] + r["worker_run_s"] + r["worker_encode_s"] <= r["workers_s"]
        assert env_bytes > 0 and rollout_reads < pc.stats()["state_bytes"]

        out = _run(step, moved, 3)
        assert measure.compare_trees(step.sync_state(out), ref_moved, tol).equal
        assert [u for u, _ in _uploads(pc)[3:]] == ["put", None, None]
        assert pc.executor.pool is pool  # the same workers

        # steady state: no worker traces or compiles, no staging buffer made or mapped again
        events = {w: pool.call(w, process_worker.COMPILE_EVENTS, jit=False) for w in pool.names}
        channels = (pool.channel_stats(), {w: st["channel"] for w, st in pool.last_stats.items()})
        out = _run(step, out, 3)
        assert {w: pool.call(w, process_worker.COMPILE_EVENTS, jit=False) for w in pool.names} == events
        assert channels == (pool.channel_stats(), {w: st["channel"] for w, st in pool.last_stats.items()})
    finally:
        step.close()


def test_resident_worker_killed_mid_iteration(toy_setup):
    import os
    import signal
    import threading

    from rose_jax.runtime import WorkerDied

    program, state, _ = toy_setup
    segments, children = _our_segments(), _children()
    pc = processes.ProcessCollect(program, 2)
    killed: dict = {}

    def kill_when_the_rollout_runs():
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            pool = pc.executor.pool
            if pool is not None and any(fn == process_worker.WORKER_ROLLOUT for _, fn in pool.in_flight()):
                killed["pid"] = pool.pids["group1"]
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.002)

    killer = threading.Thread(target=kill_when_the_rollout_runs, daemon=True)
    killer.start()
    try:
        with pytest.raises(WorkerDied) as ei:
            pc(state)  # upload, then the rollout (compiling in the workers) is cut short
        killer.join(10)
        e = ei.value
        assert e.name == "group1" and e.pid == killed["pid"] and e.signal == signal.SIGKILL
        assert process_worker.WORKER_ROLLOUT in str(e)
        assert _children() == children and _our_segments() == segments
        with pytest.raises(ValueError, match="no longer hold"):
            pc.sync_state(program.env.set(state, processes.ResidentEnv(np.int32(2), pc.owner)))
        # a state with its real env part starts fresh workers and uploads again
        out, _ = pc(state)
        assert (
            isinstance(out.x, processes.ResidentEnv) and killed["pid"] not in pc.executor.pool.pids.values()
        )
        chex.assert_trees_all_close(pc.sync_state(out), jax.jit(program.collect)(state)[0], rtol=1e-4)
    finally:
        pc.close()
    assert _children() == children and _our_segments() == segments


@pytest.mark.slow
def test_search_over_processes_candidates_in_real_workers(ppo16):
    """Issue 18's search: group_rollout(G, "processes") candidates in real worker processes, with
    equality options (as on a GPU), end with a measured verdict, never an exception; nothing is
    left behind (processes, /dev/shm)."""
    program, state, _, _, _ = ppo16
    segments, children = _our_segments(), _children()
    cands = [O.group_rollout(2, "processes"), O.group_rollout(4, "processes")]
    step, report = O.optimize(
        program, state, candidates=cands, n_iters=2, repeats=2, local=False, equality_options=CPU_OPTIONS
    )
    T.close(step)
    for rec in report.candidates:
        assert rec.legal and not rec.reason.startswith("failed"), rec.reason
        assert rec.e2e_time_s > 0 and rec.e2e_baseline_s > 0  # measured
        if not rec.kept:
            assert "not faster" in rec.reason or "unequal" in rec.reason
        else:
            assert rec.equal
    assert _children() == children and _our_segments() == segments


@pytest.mark.slow
def test_group_rollout_in_real_worker_processes(toy_setup):
    """mode='processes': two spawned rose_jax.runtime workers (CPU JAX here, MPS clients on a GPU)."""
    program, state, ref_state = toy_setup
    grouped = O.group_rollout(2, "processes").apply(program)
    assert grouped.host and grouped.groups == 2
    step = search.compile_step(grouped)
    try:
        out = step.sync_state(_run(step, state, 3))
        pids = grouped.collect.executor.pool.pids
        assert len(pids) == 2 and all(pid > 0 for pid in pids.values())
    finally:
        step.close()
    cmp = measure.compare_trees(out, ref_state, O.group_rollout(2).tolerance.rtol)
    assert cmp.equal, cmp.reason


def test_group_rollout_rejects_a_collect_that_reduces_over_envs():
    program = toy.toy_program(8, 5, variant="normalizer_in_collect")
    ok, why = O.group_rollout(2, "sequential").legal(O.trace_program(program, toy.init(8)))
    assert not ok and "reduces over envs" in why and "state.mean" in why
    ok, why = O.group_rollout(3).legal(O.trace_program(toy.toy_program(8, 5), toy.init(8)))
    assert not ok and "divisible" in why


# ------------------------------------------------------------------------------- the search


def _sleep(seconds):
    def cb():
        time.sleep(seconds)
        return np.zeros((), np.float32)

    return io_callback(cb, jax.ShapeDtypeStruct((), jnp.float32), ordered=True)


core = H.core


def slow_iteration(state):
    new, metrics = core(state)
    return {"w": new["w"] + _sleep(0.03), "n": new["n"]}, metrics


def synthetic(name, make_fn, tolerance=T.FUSION_TOLERANCE):
    return T.Transform(name, (), tolerance, "fn", lambda tree: (True, "synthetic"), lambda fn: make_fn(fn))


def drop_sleep():
    return synthetic("toy_drop_sleep", lambda fn: core)


def _sleepier(fn):
    def slower(state):
        new, metrics = fn(state)
        return {"w": new["w"] + _sleep(0.06), "n": new["n"]}, metrics

    return slower


def _wrong(fn):
    def wrong(state):
        new, metrics = core(state)
        return {"w": new["w"] * 1.01, "n": new["n"]}, metrics

    return wrong


EXAMPLE = H.example_state()


def test_search_keeps_faster_equal_and_rejects_slower_and_unequal():
    cands = [drop_sleep(), synthetic("toy_slower", _sleepier), synthetic("toy_wrong", _wrong)]
    step, report = O.optimize(slow_iteration, EXAMPLE, candidates=cands, n_iters=2, repeats=3)
    by = {c.label.split("(")[0]: c for c in report.candidates}
    assert by["toy_drop_sleep"].kept and by["toy_drop_sleep"].equal
    assert not by["toy_slower"].kept and "not faster" in by["toy_slower"].reason
    assert not by["toy_wrong"].kept and by["toy_wrong"].equal is False and "unequal" in by["toy_wrong"].reason
    assert by["toy_wrong"].speedup > 1.0  # rejected although faster: the equality check decided
    assert [p["name"] for p in report.plan] == ["toy_drop_sleep"]
    # the plan's equal is its own comparison with the baseline (the kept candidate's)
    assert report.speedup > 1.5 and report.equal is True
    assert report.max_abs_diff == by["toy_drop_sleep"].max_abs_diff is not None
    t0 = time.perf_counter()
    jax.block_until_ready(step(EXAMPLE))
    assert time.perf_counter() - t0 < 0.03  # the optimized step no longer sleeps
    text = O.format_report(report)
    assert "toy_wrong" in text and "unequal" in text
    import json

    json.dumps(report.to_json())  # JSON-able


def test_search_without_check_slower_skips_equality_of_slower_candidates_only():
    """check_slower=False: the slower candidate is rejected on time without an equality check;
    the faster wrong one is still checked and rejected; with only slower candidates no equality
    reference is built at all (no reproducibility result)."""
    cands = [drop_sleep(), synthetic("toy_slower", _sleepier), synthetic("toy_wrong", _wrong)]
    _, report = O.optimize(
        slow_iteration, EXAMPLE, candidates=cands, n_iters=2, repeats=3, check_slower=False
    )
    by = {c.label.split("(")[0]: c for c in report.candidates}
    assert by["toy_drop_sleep"].kept and by["toy_drop_sleep"].equal
    assert by["toy_slower"].equal is None and "equality not checked" in by["toy_slower"].reason
    assert not by["toy_wrong"].kept and by["toy_wrong"].equal is False and "unequal" in by["toy_wrong"].reason
    assert report.baseline_reproducible is True and [p["name"] for p in report.plan] == ["toy_drop_sleep"]

    _, only_slow = O.optimize(
        slow_iteration, EXAMPLE, candidates=[synthetic("toy_slower", _sleepier)], n_iters=1, repeats=2,
        local=False, check_slower=False,
    )
    (rec,) = only_slow.candidates
    assert not rec.kept and rec.equal is None and rec.speedup < 1.0
    # the reason lists each timed turn (2 repeats each), so an outlier turn is visible
    turns = rec.reason.split("turns: ")[1]
    assert turns.count("baseline") == 1 and turns.count(",") == 3 and turns.endswith("ms/iter")
    assert only_slow.baseline_reproducible is None and not only_slow.plan
    # no plan kept: nothing was compared, so the report's equal is None ("not checked"), never True
    assert only_slow.equal is None and only_slow.max_abs_diff is None
    assert any("equality not checked" in n for n in only_slow.notes)
    assert "equality not checked" in O.format_report(only_slow)
    assert "equal=not checked" in O.format_report(only_slow)
    assert plan_report.PlanReport.from_json(only_slow.to_json()).equal is None


def test_search_stops_early_when_its_budget_is_spent():
    """budget_s (or budget_share of a run of run_units at the baseline's speed): once spent, no
    further candidate is measured, the best plan so far is kept and the report says so; a run
    whose share is under MIN_SEARCH_UNITS units gets no search at all (nothing measured after the
    baseline's compile and first run); a long enough run gives the search room to keep the faster
    candidate."""
    cands = [drop_sleep(), synthetic("toy_slower", _sleepier)]
    logged: list[str] = []
    _, report = O.optimize(slow_iteration, EXAMPLE, candidates=cands, n_iters=1, repeats=2, budget_s=0.0,
                           log=logged.append)
    assert not report.plan and report.measurements == 4  # the baseline only
    assert all("budget is spent" in c.reason for c in report.candidates)
    assert any("stopped early" in n for n in report.notes) and any("stopped early" in m for m in logged)
    # a 2-iteration run at ~20 ms/iter leaves 10 % of 40 ms: too little for a candidate
    _, short = O.optimize(slow_iteration, EXAMPLE, candidates=cands, n_iters=1, repeats=2, run_units=2)
    assert not short.plan and short.skipped and "search skipped" in short.skipped
    assert short.measurements == 0 and not short.candidates and short.baseline_s is None
    # an explicit budget below the run's share is the user's: the search runs and stops early
    _, capped = O.optimize(slow_iteration, EXAMPLE, candidates=cands, n_iters=1, repeats=2, run_units=1000,
                           budget_s=0.0)
    assert capped.skipped is None and any("stopped early" in n for n in capped.notes)
    _, long = O.optimize(slow_iteration, EXAMPLE, candidates=cands, n_iters=1, repeats=2, run_units=10**6)
    assert [p["name"] for p in long.plan] == ["toy_drop_sleep"]
    assert not any("stopped" in n for n in long.notes)
    for bad in (dict(budget_s=-1.0), dict(run_units=0), dict(budget_share=0.0)):
        with pytest.raises(ValueError, match="optimize: "):
            O.optimize(slow_iteration, EXAMPLE, candidates=cands, **bad)


def test_windows_profile_without_a_gpu_falls_back_to_the_looptree_with_the_reason():
    """windows="profile" profiles first where NVML can sample a GPU; on this CPU it says why not
    (in the report and the log) and searches the LoopTree's loops, the same candidates as None."""
    logged: list[str] = []
    _, report = O.optimize(
        slow_iteration, EXAMPLE, windows="profile", candidates=[drop_sleep()], n_iters=1, repeats=2,
        log=logged.append,
    )
    w = report.windows
    assert w["source"] == "looptree" and "no SM activity can be sampled" in w["reason"]
    assert any("LoopTree-only search" in line for line in logged)
    assert logged and all(line.startswith("[optimize +") and "s] " in line for line in logged)  # elapsed
    assert "windows: looptree" in O.format_report(report) and report.plan  # the search still ran
    with pytest.raises(ValueError, match="windows must be None, 'profile' or a list of Windows"):
        O.optimize(slow_iteration, EXAMPLE, windows="nvml")


def test_a_long_iteration_is_timed_one_at_a_time(monkeypatch):
    """An iteration at least LONG_ITERATION_S long (here the 30 ms sleep against a lowered
    threshold) is timed one per run: the report says so, and the search still keeps the faster
    equal candidate; a short one keeps n_iters."""
    monkeypatch.setattr(search, "LONG_ITERATION_S", 0.02)
    _, report = O.optimize(slow_iteration, EXAMPLE, candidates=[drop_sleep()], n_iters=3, repeats=2)
    assert report.n_iters == 1 and any("one iteration per timed run" in n for n in report.notes)
    assert report.plan and report.candidates[0].kept and report.candidates[0].equal
    monkeypatch.setattr(search, "LONG_ITERATION_S", 10.0)
    _, report = O.optimize(slow_iteration, EXAMPLE, candidates=[drop_sleep()], n_iters=3, repeats=2)
    assert report.n_iters == 3 and not any("one iteration per timed run" in n for n in report.notes)


def test_measured_component_times_set_the_predicted_shares():
    """With the profile's component times (``phases``), a node's share is its component's measured
    share times its flops-and-bytes share within it; without them, flops and bytes alone. The
    offloaded evaluation's predicted gain follows its measured time."""
    from rose_jax.optimize import predict

    program = toy.toy_program(8, 5)
    state = toy.init(8)
    tree = rtrace.trace(program.iteration(), state, arg_names=["state"])
    comps = [n for n in tree.walk() if n.kind == "component" and len(n.component_path) == 1]
    assert len(comps) >= 2
    a, b = comps[0], comps[1]
    phases = [
        {"path": "(iteration)", "level": 0, "time_s": 1.0},
        {"path": a.name, "level": 1, "time_s": 0.7},
        {"path": "(glue)", "level": 1, "time_s": 0.05},
    ]
    ctx = predict.CandidateContext(tree, program, 1.0, phases=phases)
    assert ctx.time_share(a) == pytest.approx(0.7)
    inner = [n for n in a.walk() if n.kind != "component" and tuple(n.component_path) == (a.name,)]
    assert inner
    for n in inner:  # within a: its flops-and-bytes share of a, times a's measured share
        w = predict._weight(tree, n) / predict._weight(tree, a)
        assert ctx.time_share(n) == pytest.approx(0.7 * min(1.0, w))
    # b was not timed: flops and bytes, as without phases
    assert ctx.time_share(b) == predict.time_share(tree, b)
    assert predict.CandidateContext(tree, program, 1.0).time_share(a) == predict.time_share(tree, a)
    assert predict.phase_times(phases) == ({a.name: 0.7}, 1.0)


def test_offloaded_evaluation_is_predicted_from_its_measured_time():
    """PPO's unit (iterations, then the evaluation), traced: with the evaluation timed at 60 % of
    the unit, offloading it is predicted to save 60 % of the baseline (without the profile, its
    flops-and-bytes share)."""
    import envs
    from algos import registry

    config = H.tiny_ppo_config(num_envs=8, unroll_length=8, num_evals=3, num_timesteps=8 * 8 * 6)
    env = envs.make("pendulum")
    fn = registry.get("ppo").unit_program(config, env)
    state = jax.eval_shape(lambda k: registry.get("ppo").init(config, env, k), jax.random.PRNGKey(0))
    tree = rtrace.trace(fn, state, arg_names=["state"])
    phases = [
        {"path": "(iteration)", "level": 0, "time_s": 2.0},
        {"path": "evaluate", "level": 1, "time_s": 1.2},
    ]

    def offload(cands):
        return next(c for c in cands if c.transform.name == "offload_component")

    timed = offload(candidates.generate_candidates(tree, None, 2.0, platform="gpu", phases=phases))
    assert timed.predicted == pytest.approx(1.2) and "(60%)" in timed.model
    modelled = offload(candidates.generate_candidates(tree, None, 2.0, platform="gpu"))
    assert modelled.predicted != pytest.approx(1.2)
    # time-sliced processes (not an MPS client): only a small share overlaps; an MPS client's
    # worker runs concurrently (the whole share); off the GPU the flag does not apply
    sliced = offload(candidates.generate_candidates(
        tree, None, 2.0, platform="gpu", phases=phases, concurrent_processes=False))
    assert sliced.predicted == pytest.approx(1.2 * predict.TIME_SLICED_OVERLAP)
    assert "time-sliced" in sliced.model
    client = offload(candidates.generate_candidates(
        tree, None, 2.0, platform="gpu", phases=phases, concurrent_processes=True))
    assert client.predicted == pytest.approx(1.2) and "time-sliced" not in client.model
    cpu = offload(candidates.generate_candidates(
        tree, None, 2.0, platform="cpu", phases=phases, concurrent_processes=False))
    assert cpu.predicted == pytest.approx(1.2)
    if jax.default_backend() != "gpu":  # the search asks only on a GPU
        assert search.concurrent_processes() is None


def test_search_rejects_illegal_and_mixing_group_candidates():
    program = toy.toy_program(8, 5, variant="mixing")
    cands = [O.group_rollout(2, "interleaved"), O.unroll_scans(2, where="no_such_loop")]
    _, report = O.optimize(program, toy.init(8), candidates=cands, n_iters=1, repeats=1)
    group, unroll = report.candidates
    assert group.legal and not group.kept and "differs from the full batch" in group.reason
    assert not unroll.legal and "illegal" in unroll.reason
    assert report.plan == []


def test_generated_candidates_cover_the_loops_and_groups():
    program = toy.toy_program(8, 5)
    state = toy.init(8)
    tree = rtrace.trace(program.iteration(), state, arg_names=["state"])
    cands = candidates.generate_candidates(tree, program, 1e-3, platform="cpu")
    labels = [c.transform.label for c in cands]
    assert any(x.startswith("unroll_scans(factor=2") for x in labels)
    assert any(x.startswith("group_rollout(groups=2, mode='interleaved'") for x in labels)
    assert all(c.predicted is not None and c.model for c in cands)


def test_plan_cache_round_trip(tmp_path, monkeypatch):
    O.register_transform("toy_drop_sleep", drop_sleep)
    step, first = O.optimize(
        slow_iteration,
        EXAMPLE,
        candidates=[drop_sleep()],
        n_iters=1,
        repeats=2,
        cache_dir=str(tmp_path),
        env_name="synthetic",
        batch_size=16,
    )
    assert not first.cache_hit and first.measurements > 0 and first.plan
    assert (tmp_path / "plans.json").exists()

    def no_measuring(*a, **k):
        raise AssertionError("a cache hit must not measure")

    monkeypatch.setattr(measure, "time_repeats", no_measuring)
    monkeypatch.setattr(measure, "time_call", no_measuring)
    step2, second = O.optimize(
        slow_iteration, EXAMPLE, cache_dir=str(tmp_path), env_name="synthetic", batch_size=16
    )
    assert second.cache_hit and second.measurements == 0
    assert [p["name"] for p in second.plan] == ["toy_drop_sleep"]
    chex.assert_trees_all_close(step2(EXAMPLE)[0], step(EXAMPLE)[0])
    # another batch size is another key: a miss (which would measure)
    with pytest.raises(AssertionError, match="must not measure"):
        O.optimize(slow_iteration, EXAMPLE, cache_dir=str(tmp_path), env_name="synthetic", batch_size=32)


def _pending_record(t):
    rec = plan_report.CandidateRecord(t.label, t.to_json(), "given", None, "given", None, "",
                                      reason=search.BUDGET_SPENT)
    return dataclasses.asdict(rec)


def _edit_entry(tmp_path, edit):
    """Rewrite the one plan-cache entry under tmp_path with ``edit(entry)``."""
    import json

    path = tmp_path / "plans.json"
    data = json.loads(path.read_text())
    (key,) = [k for k, e in data.items() if "plan" in e]
    edit(data[key])
    path.write_text(json.dumps(data))


def _register_toys():
    O.register_transform("toy_drop_sleep", drop_sleep)
    O.register_transform("toy_drop_sleep_too", lambda: synthetic("toy_drop_sleep_too", lambda fn: core))
    O.register_transform("toy_slower", lambda: synthetic("toy_slower", _sleepier))


def test_a_search_its_budget_stopped_resumes_on_the_next_cache_hit(tmp_path, monkeypatch):
    """A cached search whose budget ran out before its candidates (their reason BUDGET_SPENT) goes
    on where it stopped on the next call with a finite budget (OptimizeOptions.resume): no profile
    or option trial again (the baseline compiled under the cached option decision), the pending
    candidates measured, the faster kept, the entry rewritten; then a plain cache hit. Without a
    finite budget, with a zero one, or with resume=False, the cached plan as is."""
    _register_toys()
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="resume", batch_size=16)
    _, first = O.optimize(slow_iteration, EXAMPLE, candidates=[drop_sleep()], budget_s=0.0, **kw)
    assert not first.plan and [c.reason for c in first.candidates] == [search.BUDGET_SPENT]
    o1 = {"xla_backend_optimization_level": 1}  # as if the first search had kept this set

    def with_options(entry):
        ms = {"default": 2.0, "o1": 1.0}
        entry["report"]["base_options"] = {"name": "o1", "options": o1, "ms_per_iter": ms,
                                           "speedup_vs_default": 2.0, "refused": {}, "seconds": 0.0}

    _edit_entry(tmp_path, with_options)

    real = measure.time_repeats

    def no_measuring(*a, **k):
        raise AssertionError("a plain cache hit must not measure")

    monkeypatch.setattr(measure, "time_repeats", no_measuring)
    for plain in (dict(), dict(budget_s=0.0), dict(budget_s=60.0, resume=False)):
        _, hit = O.optimize(slow_iteration, EXAMPLE, **plain, **kw)
        assert hit.cache_hit and not hit.plan and hit.measurements == 0
    monkeypatch.setattr(measure, "time_repeats", real)

    def never(*a, **k):
        raise AssertionError("a resumed search neither profiles nor runs the option trial again")

    compiled = []
    real_compile = search.compile_step

    def spy(target, host=False, compiler_options=None):
        compiled.append(compiler_options)
        return real_compile(target, host, compiler_options)

    monkeypatch.setattr(search, "resolve_windows", never)
    monkeypatch.setattr(search._Search, "_choose_options", never)
    monkeypatch.setattr(search, "compile_step", spy)
    logged: list[str] = []
    step, resumed = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, log=logged.append, **kw)
    assert compiled[0] == o1 and resumed.base_options["name"] == "o1"
    assert not resumed.cache_hit and resumed.measurements > 0
    assert [p["name"] for p in resumed.plan] == ["toy_drop_sleep"] and resumed.equal is True
    (rec,) = resumed.candidates
    assert rec.kept and rec.stage == "e2e" and resumed.speedup > 1.5
    assert resumed.notes[0].startswith("search resumed on a cache hit: 1 candidate(s)")
    assert search.STOPPED_EARLY not in resumed.notes
    assert any("resuming the cached search" in m for m in logged)
    chex.assert_trees_all_close(step(EXAMPLE)[0], core(EXAMPLE)[0])

    monkeypatch.setattr(measure, "time_repeats", no_measuring)  # nothing left: a plain hit
    _, done = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)
    assert done.cache_hit and [p["name"] for p in done.plan] == ["toy_drop_sleep"]


def test_a_resumed_search_combines_its_new_candidates_with_the_cached_plan(tmp_path):
    """The cached plan enters the resumed search's combination at its earlier measured speedup: a
    pending slower candidate is measured and refused, a pending faster one is kept and tried
    together with the cached plan (one combination record naming both)."""
    _register_toys()
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="resume2", batch_size=16)
    _, first = O.optimize(slow_iteration, EXAMPLE, candidates=[drop_sleep()], **kw)
    assert [p["name"] for p in first.plan] == ["toy_drop_sleep"]
    slower = synthetic("toy_slower", _sleepier)
    too = synthetic("toy_drop_sleep_too", lambda fn: core)
    _edit_entry(tmp_path, lambda e: e["report"]["candidates"].extend([_pending_record(slower),
                                                                         _pending_record(too)]))

    _, resumed = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)
    assert not resumed.cache_hit
    old, slow, fast, combined = resumed.candidates
    assert old.kept and old.label.startswith("toy_drop_sleep(")  # the earlier record, as it was
    assert slow.label.startswith("toy_slower") and slow.stage == "e2e" and not slow.kept
    assert fast.label.startswith("toy_drop_sleep_too") and fast.kept
    assert combined.stage == "combine"
    assert "toy_drop_sleep(" in combined.label and "toy_drop_sleep_too" in combined.label
    assert {p["name"] for p in resumed.plan} <= {"toy_drop_sleep", "toy_drop_sleep_too"} and resumed.plan
    assert resumed.speedup > 1.5 and resumed.equal is True


def test_a_resumed_search_combines_kept_candidates_its_budget_left_uncombined(tmp_path):
    """A search stopped in its combination phase (a kept candidate outside the plan that no
    combination tried) resumes too: that candidate is combined with the cached plan."""
    _register_toys()
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="resume3", batch_size=16)
    _, first = O.optimize(slow_iteration, EXAMPLE, candidates=[drop_sleep()], **kw)
    (kept,) = first.candidates
    too = synthetic("toy_drop_sleep_too", lambda fn: core)
    record = dict(dataclasses.asdict(kept), label=too.label, transform=too.to_json())
    _edit_entry(tmp_path, lambda e: e["report"]["candidates"].append(record))

    _, resumed = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)
    note = resumed.notes[0]
    assert not resumed.cache_hit and "0 candidate(s)" in note and "1 kept one(s)" in note
    combined = resumed.candidates[-1]
    assert combined.stage == "combine" and "toy_drop_sleep_too" in combined.label
    # a combination tried now is not tried again: the next call is a plain hit
    _, again = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)
    assert again.cache_hit


def test_a_resume_measures_one_candidate_whatever_its_budget_and_a_failing_one_keeps_the_plan(
    tmp_path, monkeypatch
):
    """Each resume makes progress: with a budget spent before its first candidate it still measures
    one (the rest stay pending); a resume that raises leaves the cached plan, with a note."""
    _register_toys()
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="resume4", batch_size=16)
    cands = [drop_sleep(), synthetic("toy_slower", _sleepier)]
    _, first = O.optimize(slow_iteration, EXAMPLE, candidates=cands, budget_s=0.0, **kw)
    assert [c.reason for c in first.candidates] == [search.BUDGET_SPENT] * 2
    _, once = O.optimize(slow_iteration, EXAMPLE, budget_s=1e-9, **kw)
    assert [c.reason == search.BUDGET_SPENT for c in once.candidates] == [False, True]
    assert once.candidates[0].kept and [p["name"] for p in once.plan] == ["toy_drop_sleep"]

    def broken(self, trial=True):
        raise RuntimeError("no device")

    monkeypatch.setattr(search._Search, "time_baseline", broken)
    _, hit = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)
    assert hit.cache_hit and [p["name"] for p in hit.plan] == ["toy_drop_sleep"]
    failed = "resuming the cached search failed (failed: RuntimeError: no device)"
    assert any(n.startswith(failed) for n in hit.notes)


def test_a_resumes_free_trial_is_used_by_a_measured_candidate_not_an_illegal_one(tmp_path):
    """The one candidate a resume measures whatever its budget is one that runs: an illegal pending
    candidate before it (refused by its analysis, no measurement) does not use it up (a reacher
    resume on the H100, 2026-12-06 17:29, measured nothing that way)."""
    _register_toys()
    O.register_transform(
        "toy_illegal", lambda: T.Transform("toy_illegal", (), T.FUSION_TOLERANCE, "fn",
                                           lambda tree: (False, "toy: never legal"), lambda fn: core))
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="resume5", batch_size=16)
    illegal = O.transform_by_name("toy_illegal", {})
    cands = [illegal, drop_sleep(), synthetic("toy_slower", _sleepier)]
    _, first = O.optimize(slow_iteration, EXAMPLE, candidates=cands, budget_s=0.0, **kw)
    assert [c.reason for c in first.candidates] == [search.BUDGET_SPENT] * 3
    _, once = O.optimize(slow_iteration, EXAMPLE, budget_s=1e-9, **kw)
    refused, measured, left = once.candidates
    assert refused.reason == "illegal: toy: never legal" and refused.stage == "legality"
    assert measured.stage == "e2e" and measured.kept and left.reason == search.BUDGET_SPENT
    assert [p["name"] for p in once.plan] == ["toy_drop_sleep"]


def test_the_budget_starts_no_trial_it_cannot_fit_and_keeps_room_for_the_combination(tmp_path, monkeypatch):
    """A trial starts only where the longest one so far would still end before the budget's end
    (``expected_trial_s``; stood in here by a fixed 100 s, a mock of the estimate only: the trials
    themselves run for real); with one candidate kept, twice that (its combination). A resume's free
    trial runs whatever the estimate; the rest stay pending."""
    _register_toys()
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="fit", batch_size=16)
    cands = [drop_sleep(), synthetic("toy_drop_sleep_too", lambda fn: core)]
    real = search._Search.expected_trial_s
    monkeypatch.setattr(search._Search, "expected_trial_s", lambda self: 100.0)
    _, first = O.optimize(slow_iteration, EXAMPLE, candidates=cands, budget_s=60.0, **kw)
    assert [c.reason for c in first.candidates] == [search.BUDGET_SPENT] * 2 and not first.plan
    _, resumed = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)  # free trial, then none fits
    one, left = resumed.candidates
    assert one.kept and one.stage == "e2e" and left.reason == search.BUDGET_SPENT
    # one kept: 150 s fit a 100 s trial but not a candidate and its combination (200 s); 250 s do
    for budget, measured in ((150.0, False), (250.0, True)):
        kw["env_name"] = f"fit-{budget}"
        O.optimize(slow_iteration, EXAMPLE, candidates=cands, budget_s=0.0, **kw)  # both pending
        _, rep = O.optimize(slow_iteration, EXAMPLE, budget_s=budget, **kw)
        free, second = rep.candidates[:2]
        assert free.kept and (second.reason != search.BUDGET_SPENT) == measured, (budget, second.reason)
        assert any(c.stage == "combine" for c in rep.candidates) == measured
    # the estimate itself: the longest trial so far, 0 before the first
    fake = object.__new__(search._Search)  # only the attribute the estimate reads
    fake.trial_walls = []
    assert real(fake) == 0.0
    fake.trial_walls = [3.0, 7.5, 2.0]
    assert real(fake) == 7.5


def test_an_isolated_compile_stops_at_the_budgets_end_and_stays_pending(tmp_path, monkeypatch):
    """With a budget, a candidate's isolated compile may run only until the budget's end (at least
    MIN_ISOLATE_S); one cut there is left pending (BUDGET_SPENT) for a later search, not refused.
    The child process is stood in by a stub of ``isolate.check`` that times out (a mock: the real
    child is tested in test_isolate_*)."""
    from rose_jax.optimize import isolate

    seen = []

    def timed_out(fn, args, *, timeout, **kw):
        seen.append(timeout)
        return isolate.Outcome(False, f"timed out: the isolated compile ran past {timeout:.0f} s", timeout)

    monkeypatch.setattr(isolate, "check", timed_out)
    _register_toys()
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="cap", batch_size=16, isolate=True)
    _, rep = O.optimize(slow_iteration, EXAMPLE, candidates=[drop_sleep()], budget_s=40.0, **kw)
    (rec,) = rep.candidates
    assert search.MIN_ISOLATE_S <= seen[0] <= 40.0
    assert rec.reason == search.BUDGET_SPENT and "budget's end" in rec.isolation and not rep.plan
    seen.clear()  # without a budget: isolate_timeout, and a timeout is a refusal
    _, rep = O.optimize(slow_iteration, EXAMPLE, candidates=[drop_sleep()], **{**kw, "env_name": "cap2"})
    assert seen == [900.0] and rep.candidates[0].reason.startswith("refused: timed out")


def test_a_search_cut_after_a_kept_candidate_leaves_it_in_the_cache(tmp_path, monkeypatch):
    """Each kept candidate is checkpointed into the plan cache: a run cut later in the search (here a
    ^C inside the next candidate's trial) leaves the kept one as the cached plan and the candidates
    after it pending, so the next run uses it (no budget: a plain hit, nothing measured) and a
    later one with a budget resumes the rest."""
    _register_toys()

    def interrupted(fn):
        raise KeyboardInterrupt  # the run's limit arriving during this candidate

    O.register_transform("toy_cut", lambda: synthetic("toy_cut", interrupted))
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="cut", batch_size=16, combine=False)
    cands = [drop_sleep(), O.transform_by_name("toy_cut", {}), synthetic("toy_slower", _sleepier)]
    with pytest.raises(KeyboardInterrupt):
        O.optimize(slow_iteration, EXAMPLE, candidates=cands, **kw)
    monkeypatch.setattr(measure, "time_repeats", lambda *a, **k: pytest.fail("a plain hit must not measure"))
    _, hit = O.optimize(slow_iteration, EXAMPLE, candidates=None, **kw)
    assert hit.cache_hit and [p["name"] for p in hit.plan] == ["toy_drop_sleep"] and hit.equal is True
    assert hit.speedup > 1.5
    assert any(n.startswith("checkpoint: written while the search ran") for n in hit.notes)
    kept, cut, slower = hit.candidates
    assert kept.kept and cut.reason == slower.reason == search.BUDGET_SPENT
    monkeypatch.undo()
    O.register_transform("toy_cut", lambda: synthetic("toy_cut", lambda fn: core))  # the limit is gone
    _, resumed = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)
    assert not resumed.cache_hit and all(c.reason != search.BUDGET_SPENT for c in resumed.candidates)
    assert resumed.candidates[1].stage == "e2e" and not any("checkpoint" in n for n in resumed.notes)


def _two_sleeps(state):
    new, metrics = core(state)
    return {"w": new["w"] + _sleep(0.03) + _sleep(0.03), "n": new["n"]}, metrics


def _one_sleep(state):
    new, metrics = core(state)
    return {"w": new["w"] + _sleep(0.03), "n": new["n"]}, metrics


def test_a_checkpoint_never_stands_for_a_plan_that_could_not_be_cached(tmp_path):
    """A kept (cacheable, checkpointed), then B kept and faster but with a callable parameter: the
    plan [B] is not cached, and the checkpoint of [A] is removed with it, so the next call searches
    again instead of hitting a part of the plan (found in review)."""
    O.register_transform("toy_half", lambda: synthetic("toy_half", lambda fn: _one_sleep))
    a = O.transform_by_name("toy_half", {})
    b = T.Transform("toy_fn", (("f", core),), T.FUSION_TOLERANCE, "fn", lambda tree: (True, "ok"),
                    lambda fn: core)
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="uncached", batch_size=16)
    _, rep = O.optimize(_two_sleeps, EXAMPLE, candidates=[a, b], **kw)
    assert [p["name"] for p in rep.plan] == ["toy_fn"] and any("plan not cached" in n for n in rep.notes)
    _, again = O.optimize(_two_sleeps, EXAMPLE, candidates=[a, b], **kw)
    assert not again.cache_hit


def test_a_resumes_checkpoint_keeps_every_part_of_the_cached_plan_for_later(tmp_path):
    """A resume of a cached combined plan [A, B] keeps a faster new candidate C and is cut in the
    next one: the checkpoint's plan is [C], and A and B both come back to be combined with it (the
    earlier A + B combination left pending), not only A (found in review)."""
    _register_toys()
    O.register_transform("toy_a", lambda: synthetic("toy_a", lambda fn: _one_sleep))
    O.register_transform("toy_b", lambda: synthetic("toy_b", lambda fn: _one_sleep))

    def interrupted(fn):
        raise KeyboardInterrupt

    O.register_transform("toy_cut", lambda: synthetic("toy_cut", interrupted))
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="parts", batch_size=16)
    ts = [O.transform_by_name(n, {}) for n in ("toy_a", "toy_b", "toy_drop_sleep", "toy_cut")]
    O.optimize(_two_sleeps, EXAMPLE, candidates=ts, budget_s=0.0, **kw)  # all four pending

    def as_combined(entry):  # as if an earlier search had kept A, B and their combination
        rep = entry["report"]
        ca, cb = rep["candidates"][0], rep["candidates"][1]
        for c, speedup in ((ca, 1.3), (cb, 1.2)):
            c.update(kept=True, speedup=speedup, reason="faster", stage="e2e", equal=True, legal=True)
        rep["candidates"].append(dict(ca, label=f"{ca['label']} + {cb['label']}", stage="combine",
                                      transform={"combination": [ca["transform"], cb["transform"]]},
                                      speedup=1.5, reason="faster than the current plan"))
        rep["speedup"], rep["equal"] = 1.5, True
        entry["plan"] = rep["plan"] = [ca["transform"], cb["transform"]]

    _edit_entry(tmp_path, as_combined)
    with pytest.raises(KeyboardInterrupt):
        O.optimize(_two_sleeps, EXAMPLE, budget_s=600.0, **kw)
    import json

    (entry,) = [e for e in json.loads((tmp_path / "plans.json").read_text()).values() if "plan" in e]
    left = search._left(entry, True)
    assert [t.name for t in left.plan] == ["toy_drop_sleep"]
    assert sorted(t.name for _, t in left.retry) == ["toy_a", "toy_b"]


def test_a_compile_cut_at_the_budgets_end_is_resumed_at_the_candidate_limit(tmp_path, monkeypatch):
    """A candidate whose isolated compile the budget's end cut is pending, not measured: with
    max_candidates=1 the next call with a budget still resumes it (found in review; the child is
    stood in by a stub that times out, a mock)."""
    from rose_jax.optimize import isolate

    def timed_out(fn, args, *, timeout, **kw):
        return isolate.Outcome(False, f"timed out: the isolated compile ran past {timeout:.0f} s", timeout)

    monkeypatch.setattr(isolate, "check", timed_out)
    _register_toys()
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="cap3", batch_size=16, isolate=True,
              max_candidates=1)
    _, first = O.optimize(slow_iteration, EXAMPLE, candidates=[drop_sleep()], budget_s=40.0, **kw)
    assert first.candidates[0].reason == search.BUDGET_SPENT
    monkeypatch.undo()
    _, again = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)
    assert not again.cache_hit and again.candidates[0].kept


def test_plan_cache_siblings_are_the_same_program_on_other_devices(tmp_path):
    """cache.siblings: entries whose key differs from this one in the device name only."""
    from rose_jax.optimize import cache as plan_cache

    mine = "fp|env|16|cpu|0.11.2|options=ab"
    entry = {"plan": [], "report": {"candidates": []}}
    for key in (mine, "fp|env|16|NVIDIA H100|0.11.2|options=ab", "fp|env|16|NVIDIA H200|0.11.2|options=ab",
                "fp|env|16|NVIDIA H100|0.12.0|options=ab", "fp|env|16|NVIDIA H100|0.11.2|options=cd",
                "fp|env|32|NVIDIA H100|0.11.2|options=ab", "other|env|16|NVIDIA H100|0.11.2|options=ab"):
        plan_cache.store(str(tmp_path), key, entry)
    plan_cache.store(str(tmp_path), "fp|env|16|NVIDIA B200|0.11.2|options=ab", {"options": {}})  # no plan
    assert sorted(plan_cache.siblings(str(tmp_path), mine)) == [
        "fp|env|16|NVIDIA H100|0.11.2|options=ab", "fp|env|16|NVIDIA H200|0.11.2|options=ab"]
    assert plan_cache.siblings(None, mine) == {} and plan_cache.siblings(str(tmp_path / "none"), mine) == {}


@pytest.mark.parametrize("part,value,why", [
    (3, "NVIDIA H100 80GB HBM3", "another device"),  # a sibling: the same program on another device
    (0, "another-length", "another program on this env"),  # a relative: e.g. PPO at another length
])
def test_a_search_measures_first_what_another_device_or_a_like_program_kept(tmp_path, monkeypatch,
                                                                            part, value, why):
    """Generated candidates (the generator stood in by a fixed list: only their order is under test;
    the trials are real) are measured in their predicted order, except that those a search of the
    same program kept on another device (a plan-cache entry whose key differs in the device name),
    or a search of another program on the same env and batch size (the key differs in the program
    fingerprint), come first, fastest there first; the report and the log say so. Each is still
    measured here."""
    _register_toys()
    gen = [Candidate(synthetic("toy_slower", _sleepier), "w", 2.0, "toy"),
           Candidate(drop_sleep(), "w", 1.0, "toy")]
    monkeypatch.setattr(search, "generate_candidates", lambda *a, **k: list(gen))
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="sib", batch_size=16, combine=False)
    _, alone = O.optimize(slow_iteration, EXAMPLE, **kw)
    assert [c.label.split("(")[0] for c in alone.candidates] == ["toy_slower", "toy_drop_sleep"]
    assert not any("measured first" in n for n in alone.notes)
    import json

    path = tmp_path / "plans.json"  # the entry moved to another device's or program's key
    data = json.loads(path.read_text())
    parts = alone.cache_key.split("|")
    parts[part] = value
    data["|".join(parts)] = data.pop(alone.cache_key)
    path.write_text(json.dumps(data))
    logged: list[str] = []
    _, ordered = O.optimize(slow_iteration, EXAMPLE, log=logged.append, **kw)
    assert not ordered.cache_hit and ordered.cache_key == alone.cache_key
    first, second = ordered.candidates
    assert first.label.startswith("toy_drop_sleep") and first.kept and first.stage == "e2e"
    assert second.label.startswith("toy_slower") and second.stage == "e2e"  # still measured
    note = next(n for n in ordered.notes if why in n)
    assert "toy_drop_sleep" in note and "toy_slower" not in note
    assert f"on {parts[3]})" in note
    assert any(why in line for line in logged)


def test_plan_cache_relatives_are_other_programs_on_the_same_env_and_batch(tmp_path):
    """cache.relatives: entries of another program fingerprint on this env, batch size, jax version
    and option sets, on any device; not this program's own entries (siblings) or other envs."""
    from rose_jax.optimize import cache as plan_cache

    mine = "fp|env|16|cpu|0.11.2|options=ab"
    entry = {"plan": [], "report": {"candidates": []}}
    for key in (mine, "fp|env|16|NVIDIA H100|0.11.2|options=ab", "fp2|env|16|cpu|0.11.2|options=ab",
                "fp3|env|16|NVIDIA H100|0.11.2|options=ab", "fp4|env|32|cpu|0.11.2|options=ab",
                "fp5|other|16|cpu|0.11.2|options=ab", "fp6|env|16|cpu|0.12.0|options=ab",
                "fp7|env|16|cpu|0.11.2|options=cd"):
        plan_cache.store(str(tmp_path), key, entry)
    plan_cache.store(str(tmp_path), "fp8|env|16|cpu|0.11.2|options=ab", {"options": {}})  # no plan
    assert sorted(plan_cache.relatives(str(tmp_path), mine)) == [
        "fp2|env|16|cpu|0.11.2|options=ab", "fp3|env|16|NVIDIA H100|0.11.2|options=ab"]
    assert plan_cache.relatives(None, mine) == {}


def test_relatives_need_a_named_env_and_batch(tmp_path):
    """optimize(fn) without env_name / batch_size keys its entry 'fp|-|-|dev|jax': other such programs
    in a shared plan cache are not relatives (nothing says they run the same env)."""
    from rose_jax.optimize import cache as plan_cache

    plan_cache.store(str(tmp_path), "unrelated|-|-|cpu|0.4", {"plan": [], "report": {"candidates": []}})
    plan_cache.store(str(tmp_path), "unrelated|env|-|cpu|0.4", {"plan": [], "report": {"candidates": []}})
    assert plan_cache.relatives(str(tmp_path), "mine|-|-|cpu|0.4") == {}
    assert plan_cache.relatives(str(tmp_path), "mine|env|-|cpu|0.4") == {}


def test_a_malformed_cache_record_never_drops_the_search_order(tmp_path):
    """A relative's malformed records (None, a string speedup, a report that is a list) are skipped
    one by one: the sibling device's kept candidate still goes first, and nothing raises."""
    from rose_jax.optimize import cache as plan_cache

    cands = [Candidate(synthetic(f"mal_{n}", _sleepier), "w", 1.0, "toy") for n in "ab"]
    lab = [c.transform.label for c in cands]
    kept = {"label": lab[1], "transform": {"name": "x"}, "kept": True, "speedup": 1.5}
    plan_cache.store(str(tmp_path), "fp|e|16|H100|v", {"report": {"candidates": [kept]}})  # a sibling
    plan_cache.store(str(tmp_path), "other|e|16|cpu|v", {"report": {"candidates": [
        None, dict(kept, label=lab[0], speedup="9"), dict(kept, label=None)]}})
    plan_cache.store(str(tmp_path), "third|e|16|cpu|v", {"report": ["not", "a", "dict"]})
    import types

    report = types.SimpleNamespace(notes=[])  # only its notes are written here
    logged: list[str] = []
    out = search._order_by_siblings(cands, search.OptimizeOptions(cache_dir=str(tmp_path)),
                                    "fp|e|16|cpu|v", report, logged.append)
    assert out[0] is cands[1] and out[1] is cands[0], logged
    assert not any("not read" in line for line in logged) and "1.500x on H100" in report.notes[-1]


def test_sibling_first_orders_siblings_then_relatives_each_candidate_once():
    """_sibling_first's tiers: kept on this program's other devices first, then kept by a like
    program (relatives), each tier fastest first; a label both kept moves once (with the first tier);
    never-kept, combined or absent labels leave the rest in their order."""
    cands = [Candidate(synthetic(f"toy_{n}", _sleepier), "w", 1.0, "toy") for n in "abcde"]
    label = {n: c.transform.label for n, c in zip("abcde", cands, strict=True)}

    def entry(*kept, rejected=()):
        rows = [{"label": label[n], "transform": {"name": "x"}, "kept": True, "speedup": s} for n, s in kept]
        rows += [{"label": label[n], "transform": {"name": "x"}, "kept": False, "speedup": 3.0}
                 for n in rejected]
        rows.append({"label": "combined", "transform": {"combination": []}, "kept": True, "speedup": 9.0})
        return {"report": {"candidates": rows}}

    siblings = {"fp|e|1|H100|v|o": entry(("d", 1.2))}
    relatives = {"fq|e|1|H200|v|o": entry(("b", 1.1), ("c", 1.5), ("d", 2.0), rejected=("a",))}
    ordered, note = search._sibling_first(cands, siblings, relatives)
    assert [c.transform.label for c in ordered] == [label[n] for n in "dcbae"]
    assert note.index("another device") < note.index("another program") and "1.200x on H100" in note
    assert "1.500x on H200" in note and label["a"] not in note
    assert search._sibling_first(cands, {}, {}) == (cands, None)
    assert search._sibling_first(cands, {}, relatives)[0][0] is cands[3]  # d: 2.0x there, first


def test_compare_trees_scales_per_leaf():
    ref = {"big": jnp.array([1000.0, 1.0]), "small": jnp.array([1e-5, 2e-5]), "i": jnp.arange(2)}
    close = {"big": jnp.array([1000.01, 1.0]), "small": jnp.array([1e-5, 2.0000001e-5]), "i": jnp.arange(2)}
    assert measure.compare_trees(close, ref, rtol=1e-4).equal
    assert not measure.compare_trees(close, ref, rtol=1e-6).equal
    off = dict(close, i=jnp.array([0, 2]))
    cmp = measure.compare_trees(off, ref, rtol=1.0)
    assert not cmp.equal and "non-float" in cmp.reason


def test_compare_trees_never_counts_nan_as_equal():
    """A NaN equals nothing, not even a NaN, whatever the tolerance: a tree with a NaN leaf is not
    equal (to itself either); equal infinities still are."""
    nan = {"x": jnp.array([1.0, jnp.nan]), "i": jnp.arange(2)}
    for rtol, atol in ((0.0, 0.0), (1.0, 1e30)):
        cmp = measure.compare_trees(nan, nan, rtol, atol)
        assert not cmp.equal and cmp.max_abs == float("inf") and cmp.worst == "['x']", cmp
        assert "['x']: NaN in 1 element(s)" in cmp.reason, cmp.reason
    finite = {"x": jnp.array([1.0, 2.0]), "i": jnp.arange(2)}
    assert not measure.compare_trees(nan, finite, 1.0, 1e30).equal
    assert not measure.compare_trees(finite, nan, 1.0, 1e30).equal
    assert not measure.compare_each([finite, nan], [finite, nan]).equal
    assert not measure.compare_trees(jnp.float32(jnp.nan), jnp.float32(jnp.nan)).equal  # a scalar leaf
    inf = {"x": jnp.array([1.0, jnp.inf]), "i": jnp.arange(2)}
    assert measure.compare_trees(inf, inf).equal


# ------------------------------------------------------------------- stepwise equality


def _seq_sum(x, reverse=False):
    """A strictly ordered float32 sum (a scan): the order decides the last bits."""
    return jax.lax.scan(lambda c, v: (c + v, None), jnp.float32(0.0), x, reverse=reverse)[0]


def chaotic(reverse=False, k=7.3):
    """A coupled chaotic map (x <- frac(k x + mean x / 2), Lyapunov ~ ln k per iteration) and an
    integer counter of the x above 1/2: last-bit differences flip the counter within ~8 iterations."""

    def iteration(state):
        x = state["x"]
        m = _seq_sum(x, reverse) / x.shape[0]
        x = jnp.mod(k * x + 0.5 * m, 1.0)
        return {"x": x, "n": state["n"] + jnp.sum(x > 0.5).astype(jnp.int32)}, {"m": m}

    return iteration


CHAOS = {"x": jax.random.uniform(jax.random.PRNGKey(0), (64,)), "n": jnp.zeros((), jnp.int32)}
CHAOS_TOL = T.Tolerance(1e-5, 1e-6, "float32 reassociation of one sum")


def reorder_sum():  # the same function, another float summation order
    return T.Transform("toy_reorder_sum", (), CHAOS_TOL, "fn", lambda tree: (True, "synthetic"),
                       lambda fn: chaotic(reverse=True))


def wrong_map():  # another function (k = 7.31)
    return T.Transform("toy_wrong_map", (), CHAOS_TOL, "fn", lambda tree: (True, "synthetic"),
                       lambda fn: chaotic(k=7.31))


def test_stepwise_equality_separates_reordering_from_a_wrong_function():
    base, reord, wrong = (jax.jit(f) for f in (chaotic(), chaotic(reverse=True), chaotic(k=7.31)))
    n = 10
    traj = measure.trajectory(base, CHAOS, n)
    assert len(traj) == n + 1 and traj[0] is CHAOS
    for step, same_fn in ((reord, True), (wrong, False)):
        end = _run(step, CHAOS, n)
        cmp = measure.compare_trees(end, traj[-1], CHAOS_TOL.rtol, CHAOS_TOL.atol)
        assert not cmp.equal and "['n']: non-float leaf differs" in cmp.reason  # chaos: trajectories part
        outs = measure.step_outputs(step, traj[:-1])
        each = measure.compare_each(outs, traj[1:], CHAOS_TOL.rtol, CHAOS_TOL.atol)
        assert each.equal == same_fn, each.reason
        if same_fn:
            assert 0.0 < each.max_abs < 1e-5  # really another order: last bits differ at every state
        else:
            assert each.reason.startswith("from s_0: ['x']")
    with pytest.raises(ValueError, match="equally long"):
        measure.compare_each([CHAOS], [])


@pytest.mark.parametrize("equality", ["stepwise", "trajectory"])
def test_search_equality_modes_on_a_chaotic_iteration(equality):
    _, report = O.optimize(
        chaotic(), CHAOS, candidates=[reorder_sum(), wrong_map()], n_iters=10, repeats=1, equality=equality
    )
    by = {c.label.split("(")[0]: c for c in report.candidates}
    reord, wrong = by["toy_reorder_sum"], by["toy_wrong_map"]
    assert report.equality == equality and reord.equality == wrong.equality == equality
    assert reord.equal is (equality == "stepwise"), reord.reason
    assert wrong.equal is False and "unequal" in wrong.reason
    if equality == "stepwise":
        assert "unequal stepwise" in wrong.reason and 0.0 < reord.max_abs_diff < 1e-5
    else:
        assert "unequal after 10 iterations" in reord.reason and "non-float leaf differs" in reord.reason
    # the baseline against itself (CPU, deterministic): bitwise
    assert report.baseline_reproducible is True and report.baseline_max_abs_diff == 0.0
    assert f"({equality}; baseline reproducible=True" in O.format_report(report)
    import json

    data = json.loads(json.dumps(report.to_json()))
    assert data["equality"] == equality and data["candidates"][0]["equality"] == equality
    assert plan_report.PlanReport.from_json(data).equality == equality


def test_search_rejects_an_unknown_equality_mode():
    with pytest.raises(ValueError, match="equality must be one of"):
        O.optimize(chaotic(), CHAOS, candidates=[], equality="final")


def test_stepwise_equality_syncs_a_host_candidate(toy_setup):
    """A processes-mode candidate (env state resident in its "workers"): stepwise, each baseline
    state's env part is uploaded, one iteration run and the result synced back before comparing."""
    program, state, _ = toy_setup
    made = []

    def to_host(p):
        pc = processes.ProcessCollect(p, 2, executor=processes.InlineExecutor())
        made.append(pc)
        return p._replace(collect=pc, host=True, groups=2, mode="processes")

    host = T.Transform("toy_inline_processes", (), O.group_rollout(2).tolerance, "host",
                       lambda tree: (True, "synthetic"), to_host)
    _, report = O.optimize(program, state, candidates=[host], n_iters=2, repeats=1, local=False)
    (rec,) = report.candidates
    assert rec.equality == "stepwise" and rec.equal, rec.reason
    # the equality check's instance (a candidate faster than the spread is kept and applied once
    # more for the plan, an instance that never runs here: which one is last depends on timing)
    resident = [pc.stats() for pc in made if pc.stats()["mode"] == "resident"]
    assert resident and resident[0]["counts"]["sync"] == 2  # one sync per baseline state
    assert report.baseline_reproducible is True


class _RecordingExecutor(processes.InlineExecutor):
    """The InlineExecutor, remembering the compiler options of every resident rollout it ran."""

    def __init__(self):
        super().__init__()
        self.options_seen: set = set()

    def run_resident(self, spec, sent, groups, layout, options=()):
        self.options_seen.add(options)
        return super().run_resident(spec, sent, groups, layout, options)


def _inline_processes(made: list, name: str = "toy_inline_processes", params: tuple = (), **traits):
    """A host-level transform: env groups in processes, run by the InlineExecutor (in process);
    ``traits``: what it declares to the search (e.g. ``regroups_envs``, as group_rollout does)."""

    def to_host(p):
        pc = processes.ProcessCollect(p, 2, executor=_RecordingExecutor())
        made.append(pc)
        return p._replace(collect=pc, host=True, groups=2, mode="processes")

    return T.Transform(name, params, O.group_rollout(2).tolerance, "host",
                       lambda tree: (True, "synthetic"), to_host, **traits)


# what group_rollout(G, "processes") declares to the search and the quota step
GROUPS_IN_PROCESSES = dict(needs_program_tree=True, regroups_envs=True, worker_quotas="even")


CPU_OPTIONS = {"xla_llvm_disable_expensive_passes": True}  # any option the CPU compiler takes


@pytest.mark.parametrize("fails_for", ["the baseline", "the candidate"])
def test_a_failing_equality_options_compile_refuses_the_candidate(monkeypatch, fails_for):
    """When compiling under the equality options (deterministic ops on a GPU) fails, for the
    baseline or for the candidate, the candidate is refused with that reason in the report; it is
    never checked without the options (no comparison recorded, nothing kept). Stand-in for an op
    without a deterministic GPU kernel: search.compile_step raises when given compiler options (for
    the baseline, or for every other target)."""
    real = search.compile_step

    def compile_step(target, host=False, compiler_options=None):
        if compiler_options and (target is slow_iteration) == (fails_for == "the baseline"):
            raise RuntimeError("stand-in: no deterministic kernel for this op")
        return real(target, host=host, compiler_options=compiler_options)

    monkeypatch.setattr(search, "compile_step", compile_step)
    _, report = O.optimize(
        slow_iteration, EXAMPLE, candidates=[drop_sleep()], n_iters=1, repeats=2, local=False,
        equality_options=CPU_OPTIONS,
    )
    (rec,) = report.candidates
    why = f"equality options {CPU_OPTIONS} failed for {fails_for} (RuntimeError: stand-in: no deterministic"
    assert rec.reason.startswith(f"refused: {why}"), rec.reason
    assert not rec.kept and rec.equal is None and rec.max_abs_diff is None
    assert rec.speedup > 1.0 and rec.e2e_time_s is not None  # faster: only the check refused it
    assert not report.plan and report.equal is None and "equal=not checked" in O.format_report(report)
    if fails_for == "the baseline":  # no reference at all, said once in the notes
        assert report.baseline_reproducible is None
        assert any(n.startswith(why) and "refused" in n for n in report.notes), report.notes
        assert not any("equality not checked: no candidate" in n for n in report.notes)
    else:  # the reference under the options was built; the candidate's own compile failed
        assert report.baseline_reproducible is True


def test_search_checks_a_processes_candidate_under_equality_options(toy_setup):
    """The search compiles candidates for its equality check with XLA options (deterministic ops
    on a GPU): a processes-mode candidate takes them (its workers' rollouts and the driver's learn)
    instead of failing with "Program cannot be compiled with compiler options"; the options
    view shares the collect's workers and resident env state."""
    program, state, _ = toy_setup

    def slow_collect(s):  # the baseline sleeps; the workers rebuild the program from its spec
        out, data = program.collect(s)
        return out.replace(x=out.x + _sleep(0.05)), data

    made: list = []
    params = (("groups", 2), ("mode", "processes"))
    cand = _inline_processes(made, "group_rollout", params, **GROUPS_IN_PROCESSES)
    _, report = O.optimize(
        program._replace(collect=slow_collect), state, candidates=[cand],
        n_iters=2, repeats=1, local=False, equality_options=CPU_OPTIONS,
    )
    (rec,) = report.candidates
    assert "failed" not in rec.reason and rec.equal and rec.kept, rec.reason
    # timed as compiled plainly, checked compiled with the options
    assert made[0].executor.options_seen == {(), tuple(sorted(CPU_OPTIONS.items()))}
    st = made[0].stats()
    assert st["mode"] == "resident" and st["counts"]["sync"] == 2
    # the kept multi-process plan: no MPS on this CPU, so its quota step is skipped, with the reason
    (q,) = report.quotas
    assert q["status"] == "skipped" and "SM quotas need MPS" in q["reason"] and q["quotas"] is None
    assert "quotas for group_rollout(groups=2, mode='processes'): skipped" in O.format_report(report)


def test_search_refuses_a_slower_processes_candidate_on_its_measured_time(toy_setup):
    """Env groups in processes that are not faster are refused with their measured times, without
    an equality check under the equality options (which would recompile the workers' rollouts),
    also with check_slower=True."""
    program, state, _ = toy_setup
    made: list = []

    def slow_host(p):
        host = _inline_processes(made).apply(p)
        collect = host.collect

        class Slow(processes.ProcessCollect):  # the same collect, 0.2 s slower per call
            def __call__(self, s):
                time.sleep(0.2)
                return collect(s)

        slow = Slow.__new__(Slow)
        slow.__dict__.update(collect.__dict__)
        return host._replace(collect=slow)

    t = T.Transform("group_rollout", (("groups", 2), ("mode", "processes")), O.group_rollout(2).tolerance,
                    "host", lambda tree: (True, "synthetic"), slow_host, **GROUPS_IN_PROCESSES)
    _, report = O.optimize(
        program, state, candidates=[t], n_iters=1, repeats=2, local=False, equality_options=CPU_OPTIONS
    )
    (rec,) = report.candidates
    assert not rec.kept and rec.equal is None and rec.speedup < 1.0
    assert "not faster" in rec.reason
    assert "in processes are checked under the equality options only if faster" in rec.reason


def test_processes_iteration_compiles_once(ppo16):
    """The driver's per-iteration work in processes mode: after the first iteration nothing is
    traced or compiled again, neither by ``Program.iteration()`` (whose learn is jitted, not run
    op by op) nor by the search's step; the results equal the single-process iteration."""
    program, state, ref, moved, _ = ppo16
    tol = O.group_rollout(2).tolerance.rtol
    for make in (lambda p: p.iteration(), search.compile_step):
        pc = processes.ProcessCollect(program, 2, executor=processes.InlineExecutor())
        host = program._replace(collect=pc, host=True, groups=2, mode="processes")
        step = make(host)
        s, _ = step(state)  # compiles
        jax.block_until_ready(s)
        before = process_worker.compile_events()
        t0 = time.perf_counter()
        s = _run(step, s, 2)
        jax.block_until_ready(s)
        per_iteration = (time.perf_counter() - t0) / 2
        assert process_worker.compile_events() == before  # zero traces and compiles
        cmp = measure.compare_trees(pc.sync_state(s), ref, tol)  # (compiles the env fetch's concat)
        assert cmp.equal, cmp.reason
        # a start state placed otherwise (committed to the device, as states that came back over
        # CUDA IPC are; the first one was not) runs the same executables too
        before = process_worker.compile_events()
        jax.block_until_ready(step(jax.device_put(moved, jax.devices()[0]))[0])
        assert process_worker.compile_events() == before
        assert per_iteration < 2.0  # op-by-op learn took ~8 s per iteration here
        pc.close()


# --------------------------------------------------------------------------- PPO and SAC


@pytest.fixture(scope="module")
def ppo_setup():
    import envs
    from algos import ppo

    env = envs.make("pendulum")
    config = H.tiny_ppo_config()
    state = ppo.init(config, env, jax.random.PRNGKey(0))
    ref_state = _run(jax.jit(ppo.iteration(config, env)), state, 2)
    return ppo, config, env, state, ref_state


@pytest.mark.slow
def test_ppo_program_equals_ppo_iteration(ppo_setup):
    ppo, config, env, state, ref_state = ppo_setup
    program = ppo.program(config, env)
    out = _run(jax.jit(program.iteration()), state, 2)
    cmp = measure.compare_trees(out, ref_state)
    assert cmp.equal and cmp.max_abs == 0.0, cmp.reason  # bitwise: the adapter is ppo's own code


@pytest.mark.slow
@pytest.mark.parametrize(
    "make", [lambda: O.unroll_scans(2), lambda: O.hoist_invariants()], ids=["unroll", "hoist"]
)
def test_ppo_fn_transforms_equal_after_iterations(ppo_setup, make):
    ppo, config, env, state, ref_state = ppo_setup
    t = make()
    assert t.legal(rtrace.trace(ppo.iteration(config, env), state, arg_names=["state"]))[0]
    out = _run(jax.jit(t.apply(ppo.iteration(config, env))), state, 2)
    cmp = measure.compare_trees(out, ref_state, t.tolerance.rtol, t.tolerance.atol)
    assert cmp.equal, cmp.reason


@pytest.mark.slow
def test_ppo_group_rollout_interleaved_equal(ppo_setup):
    ppo, config, env, state, ref_state = ppo_setup
    program = ppo.program(config, env)
    t = O.group_rollout(2, "interleaved")
    ok, why = t.legal(O.trace_program(program, state))
    assert ok, why
    out = _run(jax.jit(t.apply(program).iteration()), state, 2)
    cmp = measure.compare_trees(out, ref_state, t.tolerance.rtol, t.tolerance.atol)
    assert cmp.equal, cmp.reason


def test_ppo_dependent_components_rejected(ppo_setup):
    ppo, config, env, state, _ = ppo_setup
    tree = rtrace.trace(ppo.iteration(config, env), state, arg_names=["state"])
    ok, why = O.overlap_independent("advantage", "update", mode="processes").legal(tree)
    assert not ok and "dataflow" in why
    ok, why = O.overlap_independent("rollout/step", "update/epoch_step").legal(tree)
    assert not ok


@pytest.mark.slow
def test_sac_unroll_equal_and_group_rollout_illegal():
    import envs
    from algos import sac

    env = envs.make("pendulum")
    config = H.tiny_sac_config(
        num_timesteps=1000, min_replay_size=16, max_replay_size=256, normalize_observations=True
    )
    state = sac.init(config, env, jax.random.PRNGKey(0))
    ref_state = _run(jax.jit(sac.iteration(config, env)), state, 2)
    t = O.unroll_scans(2, where="train_steps")
    assert t.legal(rtrace.trace(sac.iteration(config, env), state, arg_names=["state"]))[0]
    out = _run(jax.jit(t.apply(sac.iteration(config, env))), state, 2)
    cmp = measure.compare_trees(out, ref_state, t.tolerance.rtol, t.tolerance.atol)
    assert cmp.equal, cmp.reason
    program = sac.program(config, env)
    ok, why = O.group_rollout(2).legal(O.trace_program(program, state))
    assert not ok and "reduces over envs" in why and "normalizer" in why


@pytest.mark.gpu
def test_processes_mode_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU with MPS (rose_jax.runtime workers); run on the H200")
    ok, why = processes.available()
    if not ok:
        pytest.skip(why)
    program, state = toy.toy_program(8, 5), toy.init(8)
    ref = _run(jax.jit(program.iteration()), state, 2)
    grouped = O.group_rollout(2, "processes").apply(program)
    step = search.compile_step(grouped)
    try:
        out = step.sync_state(_run(step, state, 2))
        st = grouped.collect.stats()
    finally:
        grouped.collect.close()
    assert measure.compare_trees(out, ref, 1e-4).equal
    assert st["mode"] == "resident", st["reason"]
    iters = [r for r in st["per_iteration"] if r["kind"] == "iteration"]
    assert [r["upload_bytes"] for r in iters] == [state.x.nbytes, 0]


@pytest.mark.slow
def test_env_groups_experiment_smoke_on_cpu(tmp_path):
    """benchmarks.experiments.env_groups --smoke: every row runs on this CPU (pendulum, tiny) and
    the results are written; env groups equal the fused iteration with no recompile after the
    first; the quota step says why it was skipped; nothing is left behind."""
    import json

    from benchmarks.experiments import env_groups

    segments, children = _our_segments(), _children()
    rows = env_groups.main(["--smoke", "--out", str(tmp_path)])
    assert not [r for r in rows if "skipped" in r], rows
    data = json.loads((tmp_path / "env_groups.json").read_text())
    assert [r["name"] for r in data["rows"]] == [
        "groups_4x32", "exchange", "groups_3x1024", "offload_8", "search_4x32"
    ] and data["machine"]["command"]
    for r in (r for r in rows if r["kind"] == "groups"):
        assert r["equal"] and r["driver_compiles_after_first"] == 0 and r["worker_compiles_after_first"] == 0
        assert r["envs_differing"] == 0 and r["equal_to_sequential_groups"] and r["worker_rollout_ms"] > 0
        assert r["envs_differing_inline"] == 0 and r["max_abs_diff_inline"] == 0.0  # the exchange is exact
        assert r["mode"] == "resident" and r["processes_ms"] > 0 and r["fused_ms"] > 0
        # under deterministic ops: the worker processes equal the same functions run here, bitwise
        assert r["deterministic_options"] and r["det_equal_inline"] is True
        assert r["det_fused_repeatable"] is True
        assert r["det_envs_differing_fused"] == 0 and "det_error" not in r
        # the time split: every part measured
        assert all(r[k] is not None and r[k] >= 0 for k in (
            "input_wait_ms", "driver_before_ms", "driver_after_ms", "worker_decode_ms", "worker_encode_ms"))
    (x,) = (r for r in rows if r["kind"] == "exchange")
    assert {(t["bytes"], t["staging"]) for t in x["round_trips"]} == {
        (b, s) for b in x["sizes_bytes"] for s in (True, False)
    }
    assert x["driver_channel"]["segments_created"] == len(x["sizes_bytes"])  # one per size, then reused
    (o,) = (r for r in rows if r["kind"] == "offload")
    assert o["quota_status"] == "skipped" and "SM quotas need MPS" in o["quota_reason"] and o["offload_s"] > 0
    assert o["epochs_per_timed_run"] == 3
    (s,) = (r for r in rows if r["kind"] == "search")
    assert not s["reason"].startswith("failed") and s["e2e_ms"] > 0
    assert (tmp_path / "env_groups.md").exists() and (tmp_path / "env_groups.png").exists()
    assert _children() == children and _our_segments() == segments


# ------------------------------------------- generated stream / split-compile candidates, isolation

NEW_FAMILIES = ("stream_overlap", "split_compile", "bound_while_loops")


def _new_family_records(report, families=NEW_FAMILIES) -> dict:
    """The report's records of ``families``: each refused with its reason or measured and equal."""
    recs = {c.label: c for c in report.candidates if c.transform["name"] in families}
    for c in recs.values():
        if c.legal:
            measured = c.equality == "stepwise" and c.e2e_time_s is not None
            assert measured and c.equal is True, (c.label, c.reason)
        else:
            assert c.reason.startswith("illegal: ") and c.legal_reason, (c.label, c.reason)
    return recs


def test_search_generates_stream_and_split_candidates_for_ppo(ppo_setup):
    """PPO (global-norm clipping): the policy/value stream regions are generated and refused naming
    the clip; the split iteration and the whole iteration with its own options are measured, equal."""
    ppo, config, env, state, _ = ppo_setup
    opts = dict(families=NEW_FAMILIES, n_iters=1, repeats=1, local=False, combine=False)
    _, report = O.optimize(ppo.program(config, env), state, **opts)
    recs = _new_family_records(report)
    assert {c.transform["name"] for c in recs.values()} == {"stream_overlap", "split_compile"}
    state_mode = [c for c in recs.values() if c.transform["params"].get("mode") == "state"]
    assert state_mode and not state_mode[0].legal and "global norm" in state_mode[0].reason
    split = sorted(c.legal_reason for c in recs.values() if c.transform["name"] == "split_compile")
    assert split and all(c.legal for c in recs.values() if c.transform["name"] == "split_compile")
    assert any("stages rollout | normalizer+advantage+update" in r for r in split), split
    assert "stages rollout | " in O.format_report(report)


def test_a_kept_split_records_its_measured_options_and_a_cache_hit_measures_nothing(
    ppo_setup, tmp_path, monkeypatch
):
    """split_compile(options="measure") picks each stage's XLA option set on its first call; once
    kept, the plan (and the plan cache) holds the chosen sets, so applying it again compiles each stage
    once instead of measuring every set again (on the H200 that re-measuring was most of a PPO
    plan's 37-62 s warm-up after the search).

    Labelled stand-in: on a CPU the split is rarely faster than the fused iteration, so this test
    replaces the search's verdict with one that keeps every equal candidate; what happens after the
    verdict (the recorded options, the cache, the returned step) is the real code."""
    from rose_jax.optimize import search as S
    from rose_jax.optimize import split_compile as SC

    ppo, config, env, state, _ = ppo_setup

    def keep_if_equal(self, rec, res, gain, *, versus_plan):
        rec.kept = res.cmp is not None and res.cmp.equal
        rec.reason = "kept by the test's stand-in verdict" if rec.kept else "not equal"
        return rec.kept

    monkeypatch.setattr(S._Search, "verdict", keep_if_equal)
    opts = dict(candidates=[SC.split_compile()], n_iters=1, repeats=1, local=False, check_slower=True)
    step, report = O.optimize(ppo.program(config, env), state, cache_dir=str(tmp_path), **opts)
    assert [p["params"]["options"] for p in report.plan] == [["default", "default"]]  # a CPU: XLA's defaults
    assert isinstance(step, SC.ChainedStep) and step.options == ("default", "default")
    out = step(state)
    assert step.measured_params() == {} and step.timings == {}  # compiled, not measured
    chex.assert_trees_all_close(out[0], jax.jit(ppo.iteration(config, env))(state)[0], rtol=1e-4)
    again, cached = O.optimize(ppo.program(config, env), state, cache_dir=str(tmp_path), **opts)
    assert cached.cache_hit and again.options == ("default", "default")
    # the measuring step itself reports what it chose
    measuring = SC.split_compile().apply(ppo.program(config, env))
    measuring(state)
    assert measuring.measured_params() == {"options": ("default", "default")}


@pytest.mark.slow
def test_search_generates_stream_candidates_for_sac():
    """SAC's gradient step: alpha, critic and actor updates on three streams, generated, measured and
    equal (annotations are inert on a CPU); the report says which update runs on which stream."""
    import envs
    from algos import sac

    config, env = H.tiny_sac_config(), envs.make("pendulum")
    state = sac.init(config, env, jax.random.PRNGKey(1))
    _, report = O.optimize(
        sac.program(config, env), state, families=("stream_overlap",), n_iters=1, repeats=1, local=False,
        combine=False,
    )
    recs = _new_family_records(report)
    three = [c for c in recs.values() if len(c.transform["params"]["groups"]) == 3]
    assert three and three[0].legal and three[0].e2e_time_s is not None
    where = "alpha_update on stream 1, critic_update on stream 2, actor_update on stream 3"
    assert where in O.format_report(report)


def test_search_isolation_refuses_an_aborting_candidate_remembers_it_and_continues(tmp_path, monkeypatch):
    """isolate=True: each candidate's first compile runs in a child; a child that aborts (deliberately,
    standing in for an XLA abort) refuses its candidate, the search goes on with the next one, and
    the refusal is remembered for this program (another search answers it from the plan cache)."""
    from rose_jax.optimize import isolate

    assert not search.OptimizeOptions().isolating  # CPU default: off
    assert search.OptimizeOptions(isolate=True).isolating
    with pytest.raises(ValueError, match="isolate"):
        search.OptimizeOptions(isolate="yes")
    monkeypatch.setenv(isolate.DELIBERATE_ABORT_VAR, "factor=2")  # only the factor-2 child aborts
    opts = dict(isolate=True, cache_dir=str(tmp_path), n_iters=1, repeats=1, combine=False)
    _, report = O.optimize(chaotic(), CHAOS, candidates=[O.unroll_scans(2), O.unroll_scans(4)], **opts)
    crashed, fine = report.candidates
    assert not crashed.kept and crashed.stage == "isolate" and crashed.e2e_time_s is None
    assert crashed.reason.startswith("refused: XLA aborted: ") and "deliberate abort" in crashed.reason
    assert fine.isolation.startswith("compiled and ran in a child process")
    assert fine.e2e_time_s is not None and fine.equal is True
    assert isolate.remembered(str(tmp_path), report.fingerprint) == {crashed.label: crashed.isolation}
    monkeypatch.delenv(isolate.DELIBERATE_ABORT_VAR)
    _, again = O.optimize(chaotic(), CHAOS, candidates=[O.unroll_scans(2)], env_name="other", **opts)
    (rec,) = again.candidates
    assert rec.reason.startswith("refused: XLA aborted: ")
    assert rec.isolation.endswith("(remembered in the plan cache)")


_TRIAL_LOADS_THE_CHILD = r"""
import json
import sys

import jax
import jax.numpy as jnp
from jax._src import monitoring

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
from rose_jax import optimize as O  # noqa: E402
from rose_jax.optimize import isolate, search  # noqa: E402

HITS = "/jax/compilation_cache/cache_hits"


def iteration(state):
    def body(c, x):
        c = jnp.tanh(c * 1.7 + x)
        return c, c.sum()

    c, ys = jax.lax.scan(body, state["c"], state["xs"])
    return {"c": c, "xs": state["xs"] + 0.01}, {"m": ys.mean()}


state = {"c": jnp.linspace(0.0, 1.0, 32), "xs": jax.random.normal(jax.random.PRNGKey(0), (16, 32))}
_, report = O.optimize(iteration, state, candidates=[O.unroll_scans(2)], isolate=True, n_iters=1,
                       repeats=1, combine=False, cache_dir=sys.argv[2])
(rec,) = report.candidates
fn = search.apply_plan(iteration, [O.unroll_scans(2)])
out = isolate.check(fn, (state,), label="u2", share_cache=True)
before = events.count(HITS)
step = isolate.loaded_step(out, (state,), None)
loaded_hits = events.count(HITS) - before
a, b = step(state), jax.jit(fn)(state)
same = jax.tree.structure(a) == jax.tree.structure(b) and all(
    bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
print("RESULT " + json.dumps({"isolation": rec.isolation, "equal": rec.equal,
                              "timed": rec.e2e_time_s is not None, "loaded_hits": loaded_hits,
                              "bitwise": same}))
"""


@pytest.mark.slow
def test_search_trial_loads_what_its_isolated_child_compiled(tmp_path):
    """isolate=True with JAX's persistent compilation cache on: the candidate's child writes its
    executable there and the trial loads it (a cache hit) instead of compiling the candidate a
    second time; the loaded step computes bitwise what ``jax.jit`` of the transformed function
    does, and the trial times it and checks it equal. A fresh interpreter: the persistent cache is
    configured once per process (without one, the trial compiles here: the test above)."""
    r = H.fresh_interpreter_result(_TRIAL_LOADS_THE_CHILD, str(tmp_path / "cache"), str(tmp_path / "plans"))
    assert r["isolation"].endswith("its executable loaded here from the shared compilation cache"), r
    assert r["equal"] is True and r["timed"] and r["loaded_hits"] >= 1 and r["bitwise"], r


def test_a_loaded_step_needs_an_output_structure_and_the_default_device(monkeypatch):
    """isolate.loaded_step gives None (the trial compiles the candidate here) without an output
    structure or without a persistent cache; on_default_device accepts device and host arrays."""
    from rose_jax.optimize import isolate

    ok = isolate.Outcome(True, "ran", exported=object())
    assert isolate.loaded_step(ok, (jnp.zeros(2),), None) is None  # no out_tree
    monkeypatch.setattr(isolate, "persistent_cache_dir", lambda: None)
    tree = jax.tree.structure((1, 2))
    assert isolate.loaded_step(ok._replace(out_tree=tree), (jnp.zeros(2),), None) is None
    assert isolate.on_default_device((jnp.zeros(2), {"a": np.zeros(3)}))


def test_profile_is_given_the_function_and_the_reference_build(monkeypatch):
    """The search's profile gets ``fn`` itself (its fused build is then the baseline's cached
    build; tests/test_profile.py checks the cache) and the builds of the option sets and the
    equality reference to compile beside its pieces, only for a plain function with profile
    windows. The profiler here is this unit test's stand-in (no NVML on a CPU); the real profile
    runs in test_profile.py and, with NVML, on the GPU."""
    from rose_jax import profile as rp

    seen = {}

    def fake_profile(fn, state, **kw):
        seen.update(fn=fn, **kw)
        return rp.Timeline((), None, {"activity": "stand-in"})

    monkeypatch.setattr(rp, "available", lambda: (True, "stand-in"))
    monkeypatch.setattr(rp, "profile", fake_profile)
    fn, state = toy.toy_program(8, 5).iteration(), toy.init(8)
    eq = {"xla_cpu_enable_fast_math": False}
    opts = search.OptimizeOptions(windows="profile", equality_options=eq, option_sets=None)
    also = search._also_builds(None, fn, state, opts)
    assert len(also) == 1 and also[0][1] == (state,)
    sets = {"o1": {"xla_backend_optimization_level": 1}}
    with_sets = search._also_builds(None, fn, state, dataclasses.replace(opts, option_sets=sets))
    assert len(with_sets) == 2  # the option set's build, then the reference's
    windows, record = search.resolve_windows("profile", fn, state, lambda s: None, also_compile=also)
    assert windows is None and "no activity series" in record["reason"]
    assert seen["fn"] is fn and seen["also_compile"] is also and seen["levels"] == 2 and seen["repeats"] == 2
    # the search profiles a long iteration (>= LONG_ITERATION_S) in one pass
    monkeypatch.setattr(search, "LONG_ITERATION_S", 0.0)
    seen.clear()
    search.optimize(fn, state, windows="profile", candidates=[], option_sets=None, equality_options=eq)
    assert seen["repeats"] == 1 and seen["fn"] is fn
    program = toy.toy_program(8, 5)
    # a Program's build is found later only by its HLO in JAX's persistent compilation cache
    # (rose-jax train turns it on; an earlier test of this process may have: both settings here)
    monkeypatch.setattr(search.isolate, "persistent_cache_dir", lambda: None)
    assert search._also_builds(program, fn, state, opts) == []
    monkeypatch.setattr(search.isolate, "persistent_cache_dir", lambda: "/stand-in/cache")
    assert len(search._also_builds(program, fn, state, opts)) == 1
    no_profile = search.OptimizeOptions(windows=None, equality_options=eq)
    assert search._also_builds(None, fn, state, no_profile) == []  # nothing profiled: nothing to share
    if jax.default_backend() != "gpu":  # "auto" equality options and option sets are none on a CPU
        assert search._also_builds(None, fn, state, search.OptimizeOptions(windows="profile")) == []


def test_a_trial_records_where_its_time_goes():
    """Each measured candidate's record (and the search's log) says how long its steps took:
    timing in turns and, for one that won on time, the equality check."""
    lines = []
    t = O.unroll_scans(2)
    params, xs = random_inputs(3)

    def step(state):
        p, x = state
        out = nested(p, x)
        return (jax.tree_util.tree_map(lambda a: a * 0.5, p), x), out

    _, report = O.optimize(step, (params, xs), candidates=[t], windows=None, n_iters=2, repeats=2,
                           check_slower=True, isolate=False, log=lines.append)
    (rec,) = [c for c in report.candidates if c.label == t.label]
    assert set(rec.phase_s) >= {"time", "equality"} and all(v >= 0 for v in rec.phase_s.values())
    assert any(line.endswith(f"{t.label}: " + ", ".join(f"{k} {v:.0f} s" for k, v in rec.phase_s.items()))
               for line in lines)
    assert any("traced the unit for the candidates' analyses in" in line for line in lines)


def _drop_sleep_where(where=None):
    return T.Transform("toy_drop_sleep_where", (("where", where),), T.FUSION_TOLERANCE, "fn",
                       lambda tree: (True, "synthetic"), lambda fn: core)


def test_a_candidate_the_plan_already_covers_everywhere_is_not_measured(tmp_path):
    """A pending candidate that narrows a kept transform (same parameters, ``where`` a part of
    what the kept one rewrites everywhere) is recorded as subsumed, not measured: on a resume
    against the cached plan, and within one search against what it kept; others are measured."""
    _register_toys()
    O.register_transform("toy_drop_sleep_where", _drop_sleep_where)
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="subsumed", batch_size=16)
    _, first = O.optimize(slow_iteration, EXAMPLE, candidates=[_drop_sleep_where()], **kw)
    assert [p["name"] for p in first.plan] == ["toy_drop_sleep_where"]
    narrow, slower = _drop_sleep_where("evaluate/_fun"), synthetic("toy_slower", _sleepier)
    _edit_entry(tmp_path, lambda e: e["report"]["candidates"].extend([_pending_record(narrow),
                                                                         _pending_record(slower)]))
    _, resumed = O.optimize(slow_iteration, EXAMPLE, budget_s=60.0, **kw)
    by_label = {c.label: c for c in resumed.candidates}
    skipped = by_label[narrow.label]
    assert skipped.reason.startswith("not measured: subsumed by the kept toy_drop_sleep_where(where=None")
    assert skipped.e2e_time_s is None and skipped.reason != search.BUDGET_SPENT
    assert by_label[slower.label].stage == "e2e" and by_label[slower.label].e2e_time_s is not None
    # within one search: the narrower one after the kept one everywhere is not measured either
    _, one = O.optimize(slow_iteration, EXAMPLE, candidates=[_drop_sleep_where(), narrow],
                        n_iters=1, repeats=2)
    assert one.candidates[0].kept and one.candidates[1].reason.startswith("not measured: subsumed")
    assert search._subsumed(_drop_sleep_where("a"), [_drop_sleep_where("b")]) is None  # not everywhere
    assert search._subsumed(_drop_sleep_where(None), [_drop_sleep_where(None)]) is None


@pytest.mark.parametrize("budget_s", [None, 600.0])
def test_a_profiled_search_measures_what_a_like_program_kept_before_its_profile(tmp_path, monkeypatch,
                                                                               budget_s):
    """With windows="profile" and a like program's kept candidate in the plan cache, that candidate
    is measured before the profile; then the profile runs where the budget holds its estimate (no
    budget), and only its candidates not measured yet follow, or it is skipped with the reason
    (a budget under the estimate) and the LoopTree's other candidates follow. Stand-ins, said here:
    the generator (a fixed list, as in the test above), the profile (resolve_windows: this CPU has
    no NVML; it records when it ran) and NVML's availability; the trials are real."""
    _register_toys()
    gen = [Candidate(synthetic("toy_slower", _sleepier), "w", 2.0, "toy"),
           Candidate(drop_sleep(), "w", 1.0, "toy")]
    generated: list = []

    def generate(tree, program, baseline, windows, *a, **k):
        generated.append(windows)
        return list(gen)

    monkeypatch.setattr(search, "generate_candidates", generate)
    kw = dict(n_iters=1, repeats=2, cache_dir=str(tmp_path), env_name="sib", batch_size=16, combine=False)
    _, alone = O.optimize(slow_iteration, EXAMPLE, **kw)  # the like program's search (no profile)
    import json

    path = tmp_path / "plans.json"
    data = json.loads(path.read_text())
    data["another-length|" + alone.cache_key.split("|", 1)[1]] = data.pop(alone.cache_key)
    path.write_text(json.dumps(data))
    logged: list[str] = []

    def profile(windows, fn, state, say, also_compile=(), repeats=2):
        logged.append("PROFILE")
        return ["a window"], {"source": "profile", "reason": "stand-in profile", "phases": []}

    monkeypatch.setattr(search, "resolve_windows", profile)
    monkeypatch.setattr(search.rp, "available", lambda: (True, "stand-in"))
    monkeypatch.setattr(search, "PROFILE_UNITS_PER_PASS", 1e6)  # an estimate no finite budget here holds
    generated.clear()
    _, rep = O.optimize(slow_iteration, EXAMPLE, log=logged.append, windows="profile", budget_s=budget_s,
                        **kw)
    labels = [c.label.split("(")[0] for c in rep.candidates]
    assert labels[0] == "toy_drop_sleep" and rep.candidates[0].kept
    assert any("measured first" in n and "before the profile" in n for n in rep.notes)
    measured_first = next(i for i, line in enumerate(logged) if "measured first" in line)
    if budget_s is None:  # the profile after the measured-first trial; its list without that one
        assert generated == [None, ["a window"]] and rep.windows["source"] == "profile"
        trial = [i for i, line in enumerate(logged) if "toy_drop_sleep" in line and i > measured_first]
        assert trial[0] < logged.index("PROFILE"), logged
        assert min(i for i, line in enumerate(logged) if "toy_slower" in line) > logged.index("PROFILE")
        assert labels == ["toy_drop_sleep", "toy_slower"] and rep.candidates[1].stage == "e2e"
        assert rep.windows["profile_estimate_s"] > 1e3
    else:  # skipped: the LoopTree's other candidate follows (the budget holds its trial)
        assert "PROFILE" not in logged and generated == [None]
        assert rep.windows["source"] == "looptree" and rep.windows["reason"].startswith("profile skipped")
        assert labels == ["toy_drop_sleep", "toy_slower"]
    assert search._profile_estimate_s(2.0, 0.5, 2) == pytest.approx(2.5 * 2.0 + 1e6 * 2 * 0.5)
