"""rose_jax.optimize.offload: a metrics-only component cut out of an epoch and run in a real
worker process computes exactly what the untransformed epoch computes; illegal cuts are refused."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
import rose_jax
from helpers_optimize import children as _children
from algos import driver, ppo, sac
from rose_jax import optimize as O
from rose_jax import trace as rtrace
from rose_jax.jaxpr import compat, cut
from rose_jax.optimize import base, measure, offload, search

# ------------------------------------------------------------------------ synthetic epochs


def epoch(state):
    """state -> (state, metrics): a training scan, then an 'evaluate' reading the new params."""

    def train(carry, x):
        w, b = carry
        g = jnp.tanh(w @ x + b)
        return (w - 0.1 * jnp.outer(g, x), b - 0.1 * g), jnp.sum(g)

    (w, b), losses = jax.lax.scan(train, (state["w"], state["b"]), state["xs"])
    new = {"w": w, "b": b, "xs": state["xs"] * 0.5}
    with rose_jax.component("evaluate"):
        ev = jnp.sum(jnp.sin(state["xs"] @ w.T + b)) + state["k"]
    return new | {"k": state["k"] + 1.0}, {"loss": jnp.mean(losses), "eval": ev}


def random_state(key):
    kw, kb, kx = jax.random.split(key, 3)
    return {
        "w": jax.random.normal(kw, (4, 3)),
        "b": jax.random.normal(kb, (4,)),
        "xs": jax.random.normal(kx, (6, 3)),
        "k": jnp.float32(2.0),
    }


def _split(fn, state, component="evaluate"):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(state)
    return cut.split_component(closed, component, offload.state_output_count(out_shape)), out_shape


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_halves_compose_to_the_same_function(seed):
    state = random_state(jax.random.PRNGKey(seed))
    split, out_shape = _split(epoch, state)
    assert split.positions == (len(jax.tree.leaves(out_shape)) - 1,) or len(split.positions) == 1
    kept = jax.jit(compat.as_fun(split.kept))(*jax.tree.leaves(state))
    n_kept = split.n_outputs - len(split.positions)
    part = jax.jit(compat.as_fun(split.part))(*kept[n_kept:])
    flat, it = [], iter(kept[:n_kept])
    for k in range(split.n_outputs):
        flat.append(part[split.positions.index(k)] if k in split.positions else next(it))
    got = jax.tree.unflatten(jax.tree.structure(out_shape), flat)
    want = jax.jit(epoch)(state)
    assert measure.compare_trees(got, want).equal


def test_illegal_cuts_are_refused_with_the_reason():
    state = random_state(jax.random.PRNGKey(0))

    def writes_state(s):
        s2, m = epoch(s)
        with rose_jax.component("evaluate"):
            k = s2["k"] + jnp.sum(s2["w"])  # the component's result IS a state leaf
        return s2 | {"k": k}, m

    def read_by_rest(s):
        s2, m = epoch(s)
        return s2, m | {"twice": m["eval"] * 2}

    def inside_loop(s):
        def body(c, _):
            with rose_jax.component("evaluate"):
                c = c + 1.0
            return c, None

        k, _ = jax.lax.scan(body, s["k"], None, length=2)
        return s, {"k": k}

    def with_callback(s):
        s2, m = epoch(s)
        with rose_jax.component("evaluate"):
            jax.debug.callback(lambda x: None, s2["k"])
        return s2, m

    for fn, why in (
        (writes_state, "carried state"),
        (read_by_rest, "reads its result"),
        (inside_loop, "top level"),
        (with_callback, "side effects"),
    ):
        with pytest.raises(ValueError, match=why):
            _split(fn, state)
    with pytest.raises(ValueError, match="no top-level equation"):
        _split(epoch, state, "no_such_component")
    t = O.offload_component("evaluate")
    ok, reason = t.legal(rtrace.trace(writes_state, state, arg_names=["state"]))
    assert not ok and "carried state" in reason
    ok, reason = t.legal(rtrace.trace(epoch, state, arg_names=["state"]))
    assert ok, reason


def test_deferred_waits_and_converts():
    import concurrent.futures

    fut = concurrent.futures.Future()
    d = offload.Deferred(fut, 1)
    assert not d.done() and "pending" in repr(d)
    fut.set_result((np.float32(1.0), np.float32(2.5)))
    assert float(d) == 2.5 and np.asarray(d) == np.float32(2.5)
    host = driver.metrics_to_host({"eval_episode_return": d, "x": jnp.float32(3.0)})
    assert host == {"eval_episode_return": 2.5, "x": 3.0}
    assert offload.resolve({"a": d})["a"] == np.float32(2.5)


# ---------------------------------------------------------------- real epochs, real worker


@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_offloaded_epoch_in_a_worker_equals_the_epoch(algo):
    """Three epochs with the evaluation in a real worker process (CPU JAX): the states and every
    evaluation return are bitwise those of the jitted epoch; closing leaves no process behind."""
    env = envs.make("pendulum")
    key = jax.random.PRNGKey(3)
    if algo == "ppo":
        c = ppo.PPOConfig(num_envs=8, unroll_length=8, num_minibatches=2, num_epochs=1,
                          policy_hidden_sizes=(16,), value_hidden_sizes=(16,))
        fn, state = ppo.epoch(c, env, 2, num_eval_envs=4, eval_length=30), ppo.init(c, env, key)
    else:
        c = sac.SACConfig(num_envs=4, batch_size=8, grad_updates_per_step=1, num_timesteps=10**6,
                          min_replay_size=8, max_replay_size=256, num_eval_envs=3,
                          policy_hidden_sizes=(8,), q_hidden_sizes=(8,))
        fn, state = sac.epoch(c, env, iterations=5), sac.init(c, env, key)
    before = _children()
    ref = jax.jit(fn)
    step = O.offload_component("evaluate").apply(fn)
    assert step.host
    s_ref, s_off, evals_ref, evals_off = state, state, [], []
    try:
        for _ in range(3):
            s_ref, m_ref = ref(s_ref)
            s_off, m_off = step(s_off)
            evals_ref.append(m_ref["eval_episode_return"])
            evals_off.append(m_off["eval_episode_return"])
        assert all(isinstance(e, offload.Deferred) for e in evals_off)
        step.drain()
        assert all(e.done() for e in evals_off)
        assert step.stats()["calls"] == 3 and step.stats()["cut_bytes"] > 0
    finally:
        step.close()
    cmp = measure.compare_trees(s_off, s_ref)
    assert cmp.equal, cmp.reason
    np.testing.assert_array_equal(np.asarray([float(e) for e in evals_off]), np.asarray(evals_ref))
    assert _children() <= before, "the worker process outlived close()"


def test_pipelined_timing_of_a_real_offloaded_epoch_ends_where_the_epoch_does():
    """measure.run_pipelined on a real OffloadedStep (CPU worker process): one untimed call ahead,
    then n timed calls from the same state; the final state is bitwise the jitted epoch's after n
    calls, nothing is left in flight, and drain(keep_last=1) leaves only the newest call's work."""
    env = envs.make("pendulum")
    c = ppo.PPOConfig(num_envs=8, unroll_length=8, num_minibatches=2, num_epochs=1,
                      policy_hidden_sizes=(16,), value_hidden_sizes=(16,))
    fn, state = ppo.epoch(c, env, 2, num_eval_envs=4, eval_length=30), ppo.init(c, env, jax.random.PRNGKey(1))
    step = O.offload_component("evaluate").apply(fn)
    assert step.pipelined and not getattr(jax.jit(fn), "pipelined", False)
    try:
        final, dt = measure.run_pipelined(step, state, 2)
        assert dt > 0 and not step._pending
        ref = jax.jit(fn)
        s = state
        for _ in range(2):
            s, _ = ref(s)
        assert measure.compare_trees(final, s).equal
        _, m1 = step(state)
        _, m2 = step(state)
        step.drain(keep_last=1)
        assert m1["eval_episode_return"].done() and len(step._pending) <= 1
        (_, t), = measure.time_alternating([step], state, 1, 2, warmup=False)
        assert len(t.per_iter_s) == 2 and all(x > 0 for x in t.per_iter_s)
    finally:
        step.close()


def test_pipelined_timing_is_the_longer_of_the_main_calls_and_the_deferred_work():
    """A stand-in pipelined step (a unit test of the rule, beside the real step above): each call
    returns at once and leaves 0.05 s of deferred work; the cadence of 3 calls is 3 x 0.05 s, not
    the near-zero clock of the calls themselves."""
    import concurrent.futures
    import time

    class Stub(base.HostStep):  # stands in for OffloadedStep: a thread does the deferred work
        pipelined = True

        def __init__(self):
            self.pool = concurrent.futures.ThreadPoolExecutor(1)
            self.pending = []

        def __call__(self, state):
            self.pending.append(self.pool.submit(time.sleep, 0.05))
            return state + 1, {}

        def drain(self, keep_last=0):
            cut = max(len(self.pending) - keep_last, 0)
            done, self.pending = self.pending[:cut], self.pending[cut:]
            for f in done:
                f.result()

    stub = Stub()
    final, dt = measure.run_pipelined(stub, jnp.float32(0.0), 3)
    stub.pool.shutdown()
    assert float(final) == 3.0 and not stub.pending
    # the last call's work is timed from after the clock stops, so it shows a few ms less than its
    # 0.05 s on a loaded machine (3 x 0.0466 s on the 2-core CI); the calls' own clock is ~0
    assert 0.12 <= dt < 0.6, dt


@pytest.mark.slow
def test_search_measures_the_offload_candidate_and_checks_equality():
    """optimize() on an epoch: the generated offload candidate is legal, measured end to end and
    equal (whether it is kept depends on this machine's speed); the plan's step works."""
    env = envs.make("pendulum")
    c = ppo.PPOConfig(num_envs=8, unroll_length=8, num_minibatches=2, num_epochs=1,
                      policy_hidden_sizes=(16,), value_hidden_sizes=(16,))
    fn = ppo.epoch(c, env, 2, num_eval_envs=64, eval_length=200)
    state = ppo.init(c, env, jax.random.PRNGKey(0))
    step, report = O.optimize(fn, state, n_iters=2, repeats=1, max_candidates=1, equality_iters=1,
                              equality_options={"xla_gpu_deterministic_ops": True})
    rec = next(r for r in report.candidates if r.label.startswith("offload_component"))
    assert rec.legal and rec.stage == "e2e" and rec.equal, rec.reason
    assert rec.kept or "not faster" in rec.reason
    try:
        s, m = step(state)
        assert np.isfinite(float(m["eval_episode_return"]))
    finally:
        base.close(step)


@pytest.mark.gpu
def test_offload_on_gpu_under_mps_is_exact_and_overlaps():
    """On the H200, as an MPS client (benchmarks: --mps-client): the offloaded epoch equals the
    epoch under deterministic XLA ops, and 3 epochs take less time than 3 untransformed ones."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU with MPS; run on the H200 (python -m pytest -m gpu)")
    from rose_jax.mps import inherited_daemon

    if inherited_daemon() is None:
        pytest.skip("not an MPS client: run under rose_jax.mps.run_as_client (see benchmarks/README.md)")
    env = envs.make("ant", backend="mjx")
    c = ppo.PPOConfig(num_envs=512, unroll_length=10, num_minibatches=8, num_epochs=2)
    fn = ppo.epoch(c, env, 5, num_eval_envs=64, eval_length=200)
    state = ppo.init(c, env, jax.random.PRNGKey(0))
    det = search.DETERMINISTIC
    ref = jax.jit(fn, compiler_options=det)
    step = offload.OffloadedStep(fn, "evaluate", compiler_options=det)
    try:
        s_ref, m_ref = ref(state)
        s_off, m_off = step(state)
        assert measure.compare_trees(s_off, s_ref).equal
        assert float(m_off["eval_episode_return"]) == float(m_ref["eval_episode_return"])
    finally:
        step.close()
    fast = offload.OffloadedStep(fn, "evaluate")
    try:
        (_, tb), (_, to) = measure.time_alternating([jax.jit(fn), fast], state, 3, 1)
    finally:
        fast.close()
    assert to.median < tb.median, (to.median, tb.median)


def test_offload_with_mps_on_a_cpu_starts_and_stops_its_own_daemon(tmp_path, monkeypatch):
    """The MPS plumbing of OffloadedStep with a MOCK nvidia-cuda-mps-control on PATH (CPU JAX in
    the worker ignores the client variables; the real daemon runs in the GPU test above): not an
    MPS client -> a warning and a daemon of its own, results still bitwise, daemon gone on close."""
    from test_mps import _mock_processes

    _mock_mps_on_path(tmp_path, monkeypatch)
    env = envs.make("pendulum")
    c = ppo.PPOConfig(num_envs=8, unroll_length=8, num_minibatches=2, num_epochs=1,
                      policy_hidden_sizes=(16,), value_hidden_sizes=(16,))
    fn, state = ppo.epoch(c, env, 2, num_eval_envs=4, eval_length=20), ppo.init(c, env, jax.random.PRNGKey(5))
    step = offload.OffloadedStep(fn, "evaluate", use_mps=True, quota=40)
    with pytest.warns(UserWarning, match="not an MPS client"):
        s_off, m_off = step(state)
        step.drain()
    own = step._own_daemon
    try:
        assert own is not None and own.running and _mock_processes(own.run_dir)
        s_ref, m_ref = jax.jit(fn)(state)
        assert measure.compare_trees(s_off, s_ref).equal
        assert float(m_off["eval_episode_return"]) == float(m_ref["eval_episode_return"])
    finally:
        step.close()
    assert step._own_daemon is None and not own.running and not _mock_processes(own.run_dir)


# ----------------------------------------------------------------------- SM quotas in plans


def _mock_mps_on_path(tmp_path, monkeypatch):
    """MOCK nvidia-cuda-mps-control / -server on PATH (tests/test_mps.py); no real MPS here."""
    from test_mps import FAKE_CONTROL, FAKE_SERVER

    from rose_jax.mps.plan import MPS_PIPE_VAR

    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("nvidia-cuda-mps-control", FAKE_CONTROL), ("nvidia-cuda-mps-server", FAKE_SERVER)):
        (bindir / name).write_text(text.format(python=sys.executable))
        (bindir / name).chmod(0o755)
    monkeypatch.setenv("FAKE_MPS_MODE", "ok")
    monkeypatch.setenv("PATH", str(bindir) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv(MPS_PIPE_VAR, raising=False)


def _timed(target, state):
    """End-to-end timing of two plans in turns (what the search's quota step is given)."""

    def timed(plan_a, plan_b):
        steps = [search.compile_step(search.apply_plan(target, p), host=True) for p in (plan_a, plan_b)]
        try:
            (_, ta), (_, tb) = measure.time_alternating(steps, state, 1, 1)
            return ta, tb
        finally:
            for s in steps:
                base.close(s)

    return timed


@pytest.mark.slow
def test_quota_step_plumbing_with_a_mock_mps_daemon(tmp_path, monkeypatch):
    """MOCK daemon (CPU: the quota variables change nothing, only the plumbing is real): the
    offload plan's two branches are exported and timed alone in probe workers at each quota of
    the grid, the slack-aware search chooses a split, the plan is timed with and without it, and
    the chosen worker quota rides in the plan's params (so in the plan cache) into a worker that
    is born with it; no daemon or process is left behind."""
    from rose_jax.optimize import quotas
    from rose_jax.optimize.registry import transform_by_name
    from test_mps import _mock_processes

    _mock_mps_on_path(tmp_path, monkeypatch)
    children = _children()
    c = ppo.PPOConfig(num_envs=8, unroll_length=8, num_minibatches=2, num_epochs=1,
                      policy_hidden_sizes=(16,), value_hidden_sizes=(16,))
    env = envs.make("pendulum")
    fn, state = ppo.epoch(c, env, 2, num_eval_envs=4, eval_length=20), ppo.init(c, env, jax.random.PRNGKey(5))
    plan, records = quotas.choose_plan_quotas(
        [O.offload_component("evaluate")], fn, state, mode="search", timed=_timed(fn, state),
        noise=1e9, grid=(40, 60), refine_rounds=0,
    )
    (rec,) = records
    assert rec.status == "applied", rec.reason
    assert rec.branches == ["driver: the step without 'evaluate'", "worker: 'evaluate'"]
    tried = {(p["branch"], p["quota"]) for p in rec.points}
    assert tried == {(b, q) for b in (0, 1) for q in (40, 50, 60)}  # the grid and the even split
    assert all(p["seconds"] > 0 for p in rec.points)
    assert sum(rec.quotas) <= 100 and rec.applied == {"quota": rec.quotas[1]}
    assert rec.e2e_with_s > 0 and rec.e2e_without_s > 0 and "slack-aware split" in rec.reason
    (t,) = plan
    assert dict(t.params)["quota"] == rec.quotas[1]

    again = transform_by_name(t.name, t.to_json()["params"])  # what a cache hit rebuilds
    assert again.params == t.params
    step = offload.OffloadedStep(fn, "evaluate", use_mps=True, quota=dict(again.params)["quota"])
    with pytest.warns(UserWarning, match="not an MPS client"):
        step(state)
        step.drain()
    own = step._own_daemon
    try:
        (info,) = step._pool.info.values()
        assert info.birth_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(rec.quotas[1]) and info.mps
    finally:
        step.close()
    assert not _mock_processes(own.run_dir) and _children() == children


def test_quota_step_is_skipped_without_mps_with_the_reason():
    """The real path on this CPU: no GPU, so no MPS: a kept multi-process plan carries no quota
    and the report says why (inside the search, nothing measured for it)."""
    from rose_jax.optimize import quotas

    plan, records = quotas.choose_plan_quotas(
        [O.offload_component("evaluate")], epoch, None, mode="auto",
        timed=lambda a, b: pytest.fail("nothing may be timed without MPS"), noise=0.0,
    )
    (rec,) = records
    assert rec.status == "skipped" and "no GPU" in rec.reason and "SM quotas need MPS" in rec.reason
    assert dict(plan[0].params)["quota"] is None
    _, off = quotas.choose_plan_quotas([O.unroll_scans(2)], epoch, None, mode="auto", timed=None, noise=0.0)
    assert off == []  # nothing multi-process: no quota step
    # a spent search budget skips the step before anything runs, even where quotas are searched
    import time

    plan, (rec,) = quotas.choose_plan_quotas(
        [O.offload_component("evaluate")], epoch, None, mode="search",
        timed=lambda a, b: pytest.fail("nothing may be timed past the deadline"), noise=0.0,
        deadline=time.perf_counter() - 1.0,
    )
    assert rec.status == "skipped" and "search budget is spent" in rec.reason
    assert dict(plan[0].params)["quota"] is None
    # a transform that comes with its quota (a resumed search's cached plan) keeps it, unprobed
    plan, (rec,) = quotas.choose_plan_quotas(
        [O.offload_component("evaluate", quota=40)], epoch, None, mode="search",
        timed=lambda a, b: pytest.fail("a given quota is not timed again"), noise=0.0,
    )
    assert rec.status == "given" and dict(plan[0].params)["quota"] == 40


_SHARED_CACHE_SCRIPT = r"""
import json, os, sys
import jax
import envs
from algos import ppo
from rose_jax import optimize as O, startup

cache = startup.enable_compile_cache(sys.argv[1], min_compile_time_s=0.0)
env = envs.make("pendulum")
c = ppo.PPOConfig(num_envs=8, unroll_length=8, num_minibatches=2, num_epochs=1,
                  policy_hidden_sizes=(16,), value_hidden_sizes=(16,))
fn, state = ppo.epoch(c, env, 2, num_eval_envs=4, eval_length=30), ppo.init(c, env, jax.random.PRNGKey(1))
seen = []
for _ in range(2):  # the second step: a new worker process on the cache the first one filled
    step = O.offload_component("evaluate").apply(fn)
    try:
        _, m = step(state)
        step.drain()
        (info,) = step._pool.info.values()
        seen.append({"worker_cache": info.compile_cache, "entries": len(os.listdir(cache)),
                     "return": float(m["eval_episode_return"])})
    finally:
        step.close()
print(json.dumps({"cache": cache, "seen": seen}))
"""


def test_offload_worker_shares_the_drivers_compile_cache(tmp_path):
    """A real driver with JAX's persistent compilation cache on (its own process, so this test's
    JAX config is untouched) and two offloaded steps in turn: each worker process runs JAX on the
    driver's cache directory, and the second step, its worker new, adds no entry (driver and worker
    load what the first compiled) and computes the same evaluation."""
    import json
    import subprocess

    from rose_jax.optimize import isolate

    env = isolate.child_environment()
    out = subprocess.run([sys.executable, "-c", _SHARED_CACHE_SCRIPT, str(tmp_path / "cache")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    first, second = got["seen"]
    assert first["worker_cache"] == got["cache"] == second["worker_cache"]
    assert first["entries"] > 0 and second["entries"] == first["entries"]
    assert second["return"] == first["return"]
