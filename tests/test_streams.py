"""rose_jax.optimize.stream_overlap, .split_compile and .isolate: stream regions, zipped loops,
per-component compilation and crash isolation. Every transformation is compared with the
untransformed function on random inputs and on real PPO / SAC iterations (pendulum, tiny sizes);
on a CPU the stream annotations are inert, so the transformed function must equal the original."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
import rose_jax
import rose_jax.trace as rtrace
from algos import ppo, sac
from helpers_optimize import fresh_interpreter_result, tiny_ppo_config
from rose_jax.compare import compare_trees
from rose_jax.optimize import isolate
from rose_jax.optimize import split_compile as SC
from rose_jax.optimize import stream_overlap as SO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compute_on_streams(fn, *args) -> list[str]:
    """The compute types of the compute_on equations in fn's jaxpr (any depth)."""
    found = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "compute_on":
                found.append(e.params["compute_type"])
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None and hasattr(inner, "eqns"):
                        walk(inner)
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sorted(found)


def _no_episode_nans(actual, expected):
    """Both trees with the NaNs of their ``episode_return`` leaves (an iteration's metrics: NaN while
    no episode has finished, by design) replaced by 0, after checking that they sit at the same
    places on both sides: a NaN is to equal nothing in compare_trees (not even a NaN), so a test
    that compares (state, metrics) says explicitly that "no episode finished" agrees."""
    la, da = jax.tree_util.tree_flatten_with_path(actual)
    le, de = jax.tree_util.tree_flatten_with_path(expected)
    if da != de:
        return actual, expected  # compare_trees reports the structures
    out_a, out_e = [], []
    for (path, x), (_, y) in zip(la, le, strict=True):
        if "episode_return" in jax.tree_util.keystr(path):
            nx, ny = np.isnan(np.asarray(x)), np.isnan(np.asarray(y))
            assert np.array_equal(nx, ny), f"{jax.tree_util.keystr(path)}: NaN on one side only"
            x, y = np.where(nx, 0.0, x), np.where(ny, 0.0, y)
        out_a.append(x)
        out_e.append(y)
    return jax.tree_util.tree_unflatten(da, out_a), jax.tree_util.tree_unflatten(de, out_e)


def _assert_same(actual, expected, tol=SO.STREAM_TOLERANCE):
    cmp = compare_trees(*_no_episode_nans(actual, expected), rtol=tol.rtol, atol=tol.atol)
    assert cmp.equal, cmp


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def env():
    return envs.make("pendulum")


@pytest.fixture(scope="module")
def sac_setup(env):
    config = sac.SACConfig(
        num_envs=4,
        batch_size=8,
        grad_updates_per_step=2,
        num_timesteps=10**6,
        min_replay_size=8,
        policy_hidden_sizes=(8,),
        q_hidden_sizes=(8,),
    )
    state = sac.init(config, env, jax.random.PRNGKey(1))
    fn = sac.iteration(config, env)
    return fn, state, rtrace.trace(fn, state, arg_names=["state"])


@pytest.fixture(scope="module")
def sac_reference(sac_setup):
    fn, state, _ = sac_setup
    return jax.jit(fn)(state)


def _ppo(env, max_grad_norm):
    config = tiny_ppo_config(num_envs=8, unroll_length=8, max_grad_norm=max_grad_norm)
    state = ppo.init(config, env, jax.random.PRNGKey(2))
    fn = ppo.iteration(config, env)
    return fn, state, rtrace.trace(fn, state, arg_names=["state"])


@pytest.fixture(scope="module")
def ppo_clipped(env):
    return _ppo(env, 1.0)


@pytest.fixture(scope="module")
def ppo_unclipped(env):
    return _ppo(env, None)


@pytest.fixture(scope="module")
def ppo_reference(ppo_unclipped):
    fn, state, _ = ppo_unclipped
    return jax.jit(fn)(state)


def _two_chains(dependent=False):
    def chains(state):
        a, b, w1, w2 = state
        with rose_jax.component("chain_a"):
            a, _ = jax.lax.scan(lambda x, _: (jnp.tanh(x @ w1), None), a, None, length=6)
        if dependent:
            b = b + a
        with rose_jax.component("chain_b"):
            b, ys = jax.lax.scan(lambda x, _: (jnp.tanh(x @ w2), x.sum()), b, None, length=6)
        return (a, b, w1, w2), {"a": a.sum(), "ys": ys}

    return chains


def _random_state(seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (
        jax.random.normal(k[0], (16, 8)),
        jax.random.normal(k[1], (16, 8)),
        0.4 * jax.random.normal(k[2], (8, 8)),
        0.4 * jax.random.normal(k[3], (8, 8)),
    )


# ------------------------------------------------------------------------------ compute_on


def test_on_stream_is_inert_on_cpu_and_lowers_to_an_annotated_call():
    x, w = jax.random.normal(jax.random.PRNGKey(0), (4, 3)), jax.random.normal(jax.random.PRNGKey(1), (3, 3))

    def f(x, w):
        return jnp.tanh(x @ w) * 2.0

    g = SO.on_stream(f, 2)
    np.testing.assert_array_equal(jax.jit(g)(x, w), jax.jit(f)(x, w))
    text = jax.jit(g).lower(x, w).as_text()
    assert '_xla_stream_annotation = "2"' in text and 'inlineable = "false"' in text
    with pytest.raises(ValueError, match="stream must be an int >= 1"):
        SO.on_stream(f, 0)


# ------------------------------------------------------------------------------ components


def test_sac_gradient_step_components_on_three_streams_equal(sac_setup, sac_reference):
    fn, state, tree = sac_setup
    t = SO.stream_overlap("alpha_update", "critic_update", "actor_update")
    ok, why = t.legal(tree)
    assert ok, why
    assert "alpha_update on stream 1, critic_update on stream 2, actor_update on stream 3" in why
    assert "train_steps/_grad_step" in why
    fast = t.apply(fn)
    assert _compute_on_streams(fast, state) == ["gpu_stream:1", "gpu_stream:2", "gpu_stream:3"]
    _assert_same(jax.jit(fast)(state), sac_reference)


def test_dependent_components_are_refused_with_what_couples_them(sac_setup):
    fn, state, tree = sac_setup
    ok, why = SO.stream_overlap("critic_update", "target_update").legal(tree)
    assert not ok
    assert "target_update reads the result of critic_update" in why and "dependent" in why
    ok, why = SO.stream_overlap("critic_update", "no_such_component").legal(tree)
    assert not ok and "no loop holds components" in why


def test_region_holding_a_loop_is_refused():
    def f(state):
        a, w = state

        def step(x, _):
            with rose_jax.component("inner"):
                y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=2)
            with rose_jax.component("other"):
                z = jnp.sin(x)
            return y + 0 * z, None

        a, _ = jax.lax.scan(step, a, None, length=3)
        return (a, w), a.sum()

    state = (jnp.ones((2, 2)), jnp.eye(2))
    tree = rtrace.trace(f, state, arg_names=["state"])
    ok, why = SO.stream_overlap("inner", "other").legal(tree)
    assert not ok and "holds a loop" in why


# ------------------------------------------------------------------------------ state groups


def test_ppo_policy_value_coupled_by_global_norm_clip_is_refused(ppo_clipped):
    fn, state, tree = ppo_clipped
    ok, why = SO.stream_overlap("policy", "value", mode="state", where="update/minibatch_step").legal(
        tree
    )
    assert not ok
    assert "coupled" in why and "clip_by_global_norm" in why and "global norm" in why


def test_ppo_policy_value_without_clip_on_two_streams_equal(ppo_unclipped, ppo_reference):
    fn, state, tree = ppo_unclipped
    t = SO.stream_overlap("policy", "value", mode="state", where="update/minibatch_step")
    ok, why = t.legal(tree)
    assert ok, why
    assert "policy on stream 1, value on stream 2" in why
    assert "shared prelude" in why and "optax" in why  # Adam's step count / bias correction, once
    fast = t.apply(fn)
    assert _compute_on_streams(fast, state) == ["gpu_stream:1", "gpu_stream:2"]
    _assert_same(jax.jit(fast)(state), ppo_reference)


def test_transform_params_round_trip_through_json(ppo_unclipped):
    _, _, tree = ppo_unclipped
    t = SO.stream_overlap("policy", "value", mode="state", where="update/minibatch_step")
    params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in t.to_json()["params"].items()}
    again = SO.stream_overlap(**params)
    assert again == t and again.legal(tree) == t.legal(tree)


# ------------------------------------------------------------------------------ zipped loops


@pytest.mark.parametrize("seed", [0, 1])
def test_two_independent_loops_zipped_on_two_streams_equal(seed):
    fn, state = _two_chains(), _random_state(seed)
    tree = rtrace.trace(fn, state, arg_names=["state"])
    t = SO.stream_overlap("chain_a", "chain_b", mode="loops")
    ok, why = t.legal(tree)
    assert ok, why
    fast = t.apply(fn)
    assert _compute_on_streams(fast, state) == ["gpu_stream:1", "gpu_stream:2"]
    jaxpr = jax.make_jaxpr(fast)(state)
    assert sum(e.primitive.name == "scan" for e in jaxpr.jaxpr.eqns) == 1  # one zipped loop
    _assert_same(jax.jit(fast)(state), jax.jit(fn)(state))


def test_dependent_loops_are_refused():
    fn, state = _two_chains(dependent=True), _random_state(0)
    tree = rtrace.trace(fn, state, arg_names=["state"])
    ok, why = SO.stream_overlap("chain_a", "chain_b", mode="loops").legal(tree)
    assert not ok and "dependent" in why


# ------------------------------------------------------------------------------ split_compile


def test_split_compile_ppo_equals_the_fused_iteration(ppo_unclipped, ppo_reference):
    fn, state, tree = ppo_unclipped
    t = SC.split_compile()
    ok, why = t.legal(tree)
    assert ok and "rollout | normalizer+advantage+update" in why
    step = t.apply(fn)
    out, ref = step(state), ppo_reference
    _assert_same(out, ref, SC.SPLIT_TOLERANCE)
    assert step.stats()["stages"] == ["rollout", "normalizer+advantage+update"]
    assert step.stats()["options"] == ["default", "default"]  # a CPU: XLA's defaults
    _assert_same(step(out[0])[0], jax.jit(fn)(ref[0])[0], SC.SPLIT_TOLERANCE)  # chained again


def test_split_compile_sac_with_donation_and_named_options(sac_setup, sac_reference):
    fn, state, _ = sac_setup
    ref = sac_reference
    step = SC.ChainedStep(fn, None, ("default", "concurrent"), donate=True)
    mine = jax.tree.map(jnp.copy, state)
    out = step(mine)
    _assert_same(out, ref, SC.SPLIT_TOLERANCE)
    assert step.stats()["stages"] == ["collect", "train_steps"]
    det = step.with_compiler_options({"xla_gpu_deterministic_ops": True})
    assert det.options == ("default", "concurrent") and det.extra_options == {
        "xla_gpu_deterministic_ops": True
    }
    with pytest.raises(ValueError, match="unknown option set"):
        SC.ChainedStep(fn, None, ("default", "fastest"))
    ok, why = SC.split_compile(("no_such",)).legal(rtrace.trace(fn, state, arg_names=["state"]))
    assert not ok and "not a top-level component" in why


# ------------------------------------------------------------------------------ candidates


def test_candidates_for_sac_and_ppo(sac_setup, ppo_clipped):
    _, _, tree = sac_setup
    labels = [t.label for t in SO.transforms(tree) + SC.transforms(tree)]
    assert any("'alpha_update', 'critic_update', 'actor_update'" in lab for lab in labels)
    assert any(lab.startswith("split_compile") for lab in labels)
    _, _, ptree = ppo_clipped
    cands = SO.transforms(ptree)
    state = [t for t in cands if dict(t.params).get("mode") == "state"]
    assert state and dict(state[0].params)["groups"] == ("policy", "value")
    ok, why = state[0].legal(ptree)
    assert not ok and "global norm" in why  # kept as a candidate: the search logs the refusal
    fn, st = _two_chains(), _random_state(0)
    ctree = rtrace.trace(fn, st, arg_names=["state"])
    assert any(dict(t.params).get("mode") == "loops" and t.legal(ctree)[0] for t in SO.transforms(ctree))


def test_candidates_predict_nothing_under_concurrent_command_buffers(sac_setup):
    """On a GPU the three SAC update regions are predicted to hide idle time under XLA's defaults,
    and nothing (ranked last) under a base set that schedules command buffers CONCURRENT, where
    they measured 0.73-0.81x (stream_overlap.CONCURRENT_STREAM_SHARE)."""
    from rose_jax.optimize.predict import CandidateContext
    from rose_jax.optimize.xla_options import schedules_concurrently

    _, _, tree = sac_setup

    def predicted(base):
        ctx = CandidateContext(tree, None, 1.0, platform="gpu", base_options=base)
        return {c.transform.label: c for c in SO.candidates(ctx)}

    plain, concurrent = predicted(None), predicted("concurrent_scheduling")
    assert plain.keys() == concurrent.keys() and plain
    assert all(c.predicted > 0 for c in plain.values())
    assert all(c.predicted == 0 for c in concurrent.values())
    assert all("under concurrent_scheduling" in c.model for c in concurrent.values())
    assert schedules_concurrently("concurrent_no_loops") and not schedules_concurrently("default")
    assert not schedules_concurrently(None) and not schedules_concurrently("no_such_set")
    assert all(c.predicted > 0 for c in predicted("no_command_buffers").values())


# ------------------------------------------------------------------------------ isolation


def test_child_that_aborts_is_refused_remembered_and_the_driver_lives(tmp_path):
    def f(x, w):
        return jnp.tanh(x @ w)

    args = (jnp.ones((4, 3)), jnp.ones((3, 2)))
    # a deliberate crash: the child calls os.abort() before compiling (standing in for XLA's abort)
    out = isolate.check(
        f,
        args,
        label="crashy",
        cache_dir=str(tmp_path),
        fingerprint="fp0",
        env={isolate.DELIBERATE_ABORT_VAR: "1"},
    )
    assert not out.ok and out.reason.startswith("XLA aborted: ")
    assert "deliberate abort" in out.reason and "SIGABRT" in out.reason
    assert isolate.remembered(str(tmp_path), "fp0") == {"crashy": out.reason}
    again = isolate.check(f, args, label="crashy", cache_dir=str(tmp_path), fingerprint="fp0")
    assert again.cached and not again.ok and again.reason == out.reason
    # this process is alive and still computes
    np.testing.assert_allclose(jax.jit(f)(*args), np.tanh(np.full((4, 2), 3.0)), rtol=1e-6)
    ok = isolate.check(f, args, label="fine", cache_dir=str(tmp_path), fingerprint="fp0")
    assert ok.ok, ok.reason
    bad = isolate.check(f, args, compiler_options={"xla_no_such_option": 1}, label="bad")
    assert not bad.ok and bad.reason.startswith("XLA compile failed:")


_LOADED_FROM_CHILD = r"""
import json
import sys
import jax
import jax.numpy as jnp
from jax._src import monitoring

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
import envs
from algos import ppo
from helpers_optimize import tiny_ppo_config
from rose_jax.compare import compare_trees
from rose_jax.optimize import split_compile as SC


def fill(m):
    return m._replace(episode_return=jnp.where(jnp.isnan(m.episode_return), 0.0, m.episode_return))


def same(a, b):
    # (state, metrics) bitwise; the metrics' episode_return is NaN while no episode has finished (a NaN
    # is to equal nothing in compare_trees): its NaNs must sit at the same places, then count as 0
    nan_a, nan_b = jnp.isnan(a[1].episode_return), jnp.isnan(b[1].episode_return)
    return bool((nan_a == nan_b).all()) and compare_trees((a[0], fill(a[1])), (b[0], fill(b[1]))).equal


env, config = envs.make("pendulum"), tiny_ppo_config()
state = ppo.init(config, env, jax.random.PRNGKey(0))
fn = ppo.iteration(config, env)
step = SC.ChainedStep(fn, None, "measure", isolate=True)
before = events.count("/jax/compilation_cache/cache_hits")
out = step(state)
hits = events.count("/jax/compilation_cache/cache_hits") - before
direct = SC.ChainedStep(fn, None, "measure", isolate=False)(state)  # the stages compiled here
again = step(out[0])  # the measured executables run again
fixed = SC.ChainedStep(fn, None, ("default", "default"))(out[0])
print("RESULT " + json.dumps({
    "loaded": step.from_children,
    "hits": hits,
    "bitwise_vs_direct": same(out, direct),
    "again_vs_direct": same(again, fixed),
}))
"""


@pytest.mark.slow
def test_split_stages_load_what_their_isolated_children_compiled(tmp_path):
    """With JAX's persistent compilation cache on, each isolated child writes its stage's executable
    there and the driver loads it (a cache hit) instead of compiling the stage again; the result is
    bitwise the stages compiled in the driver. Run in a fresh interpreter: the persistent cache is
    configured once per process."""
    r = fresh_interpreter_result(_LOADED_FROM_CHILD, str(tmp_path / "cache"))
    assert r["loaded"] == ["rollout:default", "normalizer+advantage+update:default"]
    assert r["hits"] >= 2 and r["bitwise_vs_direct"] and r["again_vs_direct"]


def test_without_a_persistent_cache_nothing_is_loaded(monkeypatch):
    monkeypatch.setattr(isolate, "persistent_cache_dir", lambda: None)
    assert isolate.compile_exported(isolate.Outcome(True, "ran", exported=object()), [], None) is None
    assert isolate.compile_exported(isolate.Outcome(False, "refused"), [], None) is None


# ------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
def test_stream_regions_become_async_calls_on_gpu(sac_setup):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU: stream annotations are inert on a CPU")
    fn, state, _ = sac_setup
    fast = SO.stream_overlap("alpha_update", "critic_update", "actor_update").apply(fn)
    text = jax.jit(fast).lower(state).compile().as_text()
    assert "call-start" in text and '_xla_stream_annotation="2"' in text


# ------------------------------------------------------------------------------ the benchmark


@pytest.mark.slow
def test_overlap_benchmark_smoke(tmp_path):
    out = tmp_path / "overlap"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.experiments.overlap", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    data = json.loads((out / "results.json").read_text())
    rows = {r["workload"]: r for r in data["rows"]}
    assert "components on streams (two MLP chains)" in rows
    for r in data["rows"]:
        assert {
            "workload",
            "baseline_env_steps_per_s",
            "rose_env_steps_per_s",
            "speedup",
            "equal",
            "max_abs_diff",
            "plan",
            "search_s",
        } <= set(r)
        assert r.get("error") is None, r
        if r["plan"] == "none":  # nothing kept: nothing compared, "not checked" (never True by default)
            assert r["equal"] is None and r["max_abs_diff"] is None, r
        else:  # the kept plan was compared with the baseline (annotations are inert on a CPU)
            assert r["equal"] is True and r["max_abs_diff"] is not None, r
        # every candidate that was compared is equal (annotations are inert on a CPU); the micro row
        # keeps its one candidate's comparison beside an unkept plan as candidate_equal
        checked = [c for c in r.get("candidates") or [] if c.get("equal") is not None]
        assert all(c["equal"] is True and c["max_abs_diff"] is not None for c in checked), r
        if r["workload"] == "components on streams (two MLP chains)" and r["plan"] == "none":
            assert r["candidate_equal"] is True and r["candidate_max_abs_diff"] is not None, r
    md = (out / "results.md").read_text()
    assert ("| not checked |" in md) == any(r["equal"] is None for r in data["rows"]), md
    assert (out / "results.md").exists() and (out / "results.png").exists()
    assert "workload" in proc.stdout.splitlines()[-len(data["rows"]) - 2]


# ------------------------------------------------------------------------------ in the search


def test_search_generates_zipped_loops_on_streams_measured_equal_and_refuses_dependent_loops():
    """optimize() generates stream_overlap for two independent sibling loops: measured, equal (inert
    annotations on a CPU) and described per stream; dependent loops are refused with the reason."""
    from rose_jax import optimize as O

    opts = dict(families=("stream_overlap",), n_iters=2, repeats=1, combine=False)
    _, report = O.optimize(_two_chains(), _random_state(0), **opts)
    (rec,) = report.candidates
    assert rec.legal and rec.transform["params"]["mode"] == "loops"
    assert rec.equality == "stepwise" and rec.equal is True and rec.e2e_time_s is not None, rec.reason
    assert "on stream 1" in O.format_report(report) and "on stream 2" in O.format_report(report)
    _, report = O.optimize(_two_chains(dependent=True), _random_state(0), **opts)
    (rec,) = report.candidates
    assert not rec.legal and rec.reason.startswith("illegal: ") and "reads what" in rec.reason
