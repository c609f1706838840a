"""Tests of rose_jax.profile: exact windows on synthetic timelines, Timeline I/O, phase timing of
real (small) programs on CPU with output equivalence, the sampler's no-GPU behaviour, and the
GPU-only checks (skipped on CPU with a reason)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rose_jax
from rose_jax import profile as rp
from rose_jax.profile import xplane

MS = 1_000_000
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(
    not ON_GPU, reason=f"needs an NVIDIA GPU (JAX backend is {jax.default_backend()!r})"
)


# ------------------------------------------------------------------------------------------------
# Synthetic timeline: ten 10 ms steps, two phases.
#   step k covers [10k, 10k+10) ms with activity VALUES[k] %
#   phase "a" [0, 45) ms weight 1 (level 1), phase "b" [45, 100) ms weight 0.5 (level 1)
VALUES = [90, 20, 20, 90, 10, 10, 10, 90, 30, 90]


def synthetic(values=VALUES, phases=None, occupancy=None) -> rp.Timeline:
    n = len(values)
    starts = [10 * k * MS for k in range(n)]
    ends = [(10 * k + 10) * MS for k in range(n)]
    centres = [(s + e) // 2 for s, e in zip(starts, ends, strict=True)]
    series = rp.make_series(centres, values, occupancy, "gpm", starts, ends, 10 * MS)
    if phases is None:
        phases = [rp.Phase("a", 0, 45 * MS, 1, 0, 1.0), rp.Phase("b", 45 * MS, 100 * MS, 1, 0, 0.5)]
    return rp.Timeline(tuple(phases), series, {"note": "synthetic"})


def test_windows_exact_threshold_paths_and_ranking():
    ws = rp.find_windows(synthetic(), threshold=50)
    assert [(w.start_ns, w.end_ns) for w in ws] == [
        (10 * MS, 30 * MS),
        (40 * MS, 70 * MS),
        (80 * MS, 90 * MS),
    ]
    w1, w2, w3 = ws
    assert (w1.path, w2.path, w3.path) == ("a", "b", "b")  # w2 spans a [40,45) and b [45,70): b has more
    assert w2.phases == ("a", "b")
    assert w1.duration_s == pytest.approx(0.020, abs=1e-15)
    assert w1.mean_idle_sm_share == pytest.approx(0.8, abs=1e-12)
    assert w2.mean_idle_sm_share == pytest.approx(0.9, abs=1e-12)
    assert w3.mean_idle_sm_share == pytest.approx(0.7, abs=1e-12)
    assert (w1.occurrences_per_iteration, w2.occurrences_per_iteration) == (1.0, 0.5)
    assert w1.idle_sm_seconds_per_iteration == pytest.approx(0.020 * 0.8 * 1.0, abs=1e-15)
    assert w2.idle_sm_seconds_per_iteration == pytest.approx(0.030 * 0.9 * 0.5, abs=1e-15)
    assert w3.idle_sm_seconds_per_iteration == pytest.approx(0.010 * 0.7 * 0.5, abs=1e-15)
    # a lower threshold keeps only the 10 % stretch; nothing is below 5 %
    assert [(w.start_ns, w.end_ns) for w in rp.find_windows(synthetic(), threshold=15)] == [
        (40 * MS, 70 * MS)
    ]
    assert rp.find_windows(synthetic(), threshold=5) == []
    # threshold is strict: 30 % is not below 30
    assert (80 * MS, 90 * MS) not in [
        (w.start_ns, w.end_ns) for w in rp.find_windows(synthetic(), threshold=30)
    ]


def test_windows_min_duration_and_merge_gap():
    ws = rp.find_windows(synthetic(), threshold=50, min_duration_ms=15)
    assert [(w.start_ns, w.end_ns) for w in ws] == [(10 * MS, 30 * MS), (40 * MS, 70 * MS)]
    # gaps of exactly 10 ms do not merge with merge_gap 10 ms (strictly closer only) ...
    assert len(rp.find_windows(synthetic(), threshold=50, merge_gap_ms=10)) == 3
    # ... but do with a hair more: one window [10, 90) ms including the busy gaps
    (w,) = rp.find_windows(synthetic(), threshold=50, merge_gap_ms=10.5)
    assert (w.start_ns, w.end_ns) == (10 * MS, 90 * MS)
    mean_act = (20 + 20 + 90 + 10 + 10 + 10 + 90 + 30) / 8  # 35 %
    assert w.mean_idle_sm_share == pytest.approx(1 - mean_act / 100, abs=1e-12)
    assert w.path == "b" and w.phases == ("a", "b")  # a: 35 ms of overlap, b: 45 ms
    assert w.idle_sm_seconds_per_iteration == pytest.approx(0.080 * 0.65 * 0.5, abs=1e-15)
    # merging happens before the duration filter
    assert len(rp.find_windows(synthetic(), threshold=50, merge_gap_ms=10.5, min_duration_ms=75)) == 1


def test_windows_edge_cases():
    # everything busy -> no window
    assert rp.find_windows(synthetic([90] * 10), threshold=50) == []
    # empty series / no phases -> no window
    empty = rp.Timeline((rp.Phase("a", 0, 10, 1, 0),), rp.make_series([], []), {})
    assert rp.find_windows(empty) == []
    assert rp.find_windows(synthetic(phases=[]), threshold=50) == []
    # time outside every phase does not count: only phase a [0, 45) -> windows clipped to it
    ws = rp.find_windows(synthetic(phases=[rp.Phase("a", 0, 45 * MS, 1, 0)]), threshold=50)
    assert [(w.start_ns, w.end_ns) for w in ws] == [(10 * MS, 30 * MS), (40 * MS, 45 * MS)]
    # nan samples are "not measured", never low
    ws = rp.find_windows(synthetic([90, np.nan, 20, 90, 90, 90, 90, 90, 90, 90]), threshold=50)
    assert [(w.start_ns, w.end_ns) for w in ws] == [(20 * MS, 30 * MS)]
    # a whole-program idle window spanning both phases
    (w,) = rp.find_windows(synthetic([0] * 10), threshold=50)
    assert (w.start_ns, w.end_ns, w.path, w.mean_idle_sm_share) == (0, 100 * MS, "b", 1.0)
    # levels filter
    tl = synthetic(phases=[rp.Phase("a", 0, 45 * MS, 1, 0), rp.Phase("x", 45 * MS, 100 * MS, 2, 0, 3.0)])
    assert {w.path for w in rp.find_windows(tl, threshold=50, levels=2)} == {"x"}
    assert {w.level for w in rp.find_windows(tl, threshold=50, levels=[2])} == {2}
    with pytest.raises(ValueError, match="no activity"):
        rp.find_windows(rp.Timeline((rp.Phase("a", 0, 1, 1, 0),)))
    with pytest.raises(ValueError, match="threshold"):
        rp.find_windows(synthetic(), threshold=-1)
    with pytest.raises(ValueError, match="sm_occupancy"):
        rp.find_windows(synthetic(), metric="sm_occupancy")  # this series has no occupancy


def test_windows_on_occupancy_metric():
    tl = synthetic(occupancy=[5.0] * 10)
    (w,) = rp.find_windows(tl, threshold=50, metric="sm_occupancy")
    assert (w.start_ns, w.end_ns) == (0, 100 * MS) and w.mean_idle_sm_share == pytest.approx(0.95, abs=1e-12)


def test_phase_idle_summary_exact():
    summary = rp.phase_idle_summary(synthetic())
    assert [(s.path, s.level) for s in summary] == [("a", 1), ("b", 1)]
    a, b = summary
    assert a.time_per_iteration_s == pytest.approx(0.045, abs=1e-15)
    assert a.mean_sm_activity == pytest.approx((900 + 200 + 200 + 900 + 50) / 45, abs=1e-12)  # 50 %
    assert a.idle_sm_seconds_per_iteration == pytest.approx(0.045 * 0.5, abs=1e-15)
    assert b.time_per_iteration_s == pytest.approx(0.055 * 0.5, abs=1e-15)
    b_act = (50 + 100 + 100 + 900 + 300 + 900) / 55
    assert b.mean_sm_activity == pytest.approx(b_act, abs=1e-12)
    assert b.idle_sm_seconds_per_iteration == pytest.approx(0.0275 * (1 - b_act / 100), abs=1e-15)
    assert a.covered_fraction == 1.0 and b.occurrences_per_iteration == 0.5
    # without activity: times only, nan activity, sorted by time
    s2 = rp.phase_idle_summary(synthetic().replace(activity=None))
    assert [s.path for s in s2] == ["a", "b"] and all(math.isnan(s.mean_sm_activity) for s in s2)
    assert rp.mean_activity(synthetic().activity, [(0, 20 * MS), (10 * MS, 30 * MS)]) == pytest.approx(
        (90 + 20 + 20) / 3, abs=1e-12
    )


def test_step_bounds_from_centres():
    s = rp.make_series([10, 20, 40], [1, 2, 3])
    start, end = rp.step_bounds(s)
    assert start.tolist() == [5, 15, 30] and end.tolist() == [15, 30, 50]
    with pytest.raises(ValueError, match="overlap"):
        rp.make_series([1, 2], [0, 0], None, "gpm", [0, 1], [2, 3])
    with pytest.raises(ValueError, match="source"):
        rp.make_series([1], [0], None, "nvml")


def test_timeline_json_round_trip(tmp_path):
    tl = synthetic([90, np.nan, 20, 90, 90, 90, 90, 90, 90, 90], occupancy=[1.0] * 10)
    tl = tl.replace(
        metadata={"n": np.int64(3), "x": np.float32(0.5), "nan": float("nan"), "l": [np.arange(2)]}
    )
    text = tl.to_json()
    json.loads(text)  # strict JSON: nan became null
    path = tl.save(tmp_path / "sub" / "t.json")
    assert not [f for f in os.listdir(tmp_path / "sub") if f.endswith(".tmp")]
    back = rp.load(path)
    assert back.phases == tl.phases
    assert np.array_equal(back.activity.t_ns, tl.activity.t_ns)
    assert np.array_equal(back.activity.sm_util, tl.activity.sm_util, equal_nan=True)
    assert np.array_equal(back.activity.t_start_ns, tl.activity.t_start_ns)
    assert back.activity.source == "gpm" and back.activity.resolution_ns == 10 * MS
    assert back.metadata == {
        "n": 3,
        "x": 0.5,
        "nan": None,
        "l": [[0, 1]],
    }
    assert [(w.start_ns, w.end_ns) for w in rp.find_windows(back)] == [
        (w.start_ns, w.end_ns) for w in rp.find_windows(tl)
    ]
    no_act = rp.Timeline((rp.Phase("a", 1, 2, 1, 0),)).save(tmp_path / "n.json")
    assert rp.Timeline.load(no_act).activity is None
    with pytest.raises(ValueError, match="not a Timeline"):
        rp.Timeline.from_dict({"x": 1})


# ------------------------------------------------------------------------------------------------
# Phase timing on CPU


def two_component_program(p, x, xs):
    """A scan whose body has two components, glue between top-level components, nested jit."""

    def body(c, x_t):
        with rose_jax.component("sim"):
            c = jnp.sin(c @ p) + x_t
        with rose_jax.component("policy"):
            c = jnp.tanh(c * 0.5)
        return c, jnp.sum(c)

    with rose_jax.component("rollout"):
        c, ys = jax.lax.scan(body, x, xs)
    z = jnp.cumsum(ys)  # glue
    with rose_jax.component("update"):
        c = c - 0.1 * jnp.mean(c) + z[-1]
    return {"c": c, "ys": ys}


def small_args():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return (jax.random.normal(k1, (8, 8)) * 0.3, jnp.ones((4, 8)), jax.random.normal(k2, (5, 4, 8)))


def test_time_phases_two_components_in_scan():
    args = small_args()
    tl = rp.time_phases(jax.jit(two_component_program), *args, repeats=2, max_loop_iterations=3)
    assert tl.metadata["outputs_match"] and tl.metadata["outputs_bitwise_equal"]
    assert tl.metadata["segments"] == ["rollout", "update"]  # tiny glue merged into rollout
    lvl0 = [p for p in tl.phases if p.level == 0]
    assert [p.path for p in lvl0] == ["(iteration)"] * 2
    lvl1 = [p for p in tl.phases if p.level == 1]
    assert [(p.path, p.iteration) for p in lvl1] == [
        ("rollout", 0),
        ("update", 0),
        ("rollout", 1),
        ("update", 1),
    ]
    assert all(p.weight == 0.5 for p in lvl1)
    lvl2 = [p for p in tl.phases if p.level == 2]
    one_pass = [
        ("rollout/sim", 0),
        ("rollout/policy", 0),
        ("rollout/sim", 1),
        ("rollout/policy", 1),
        ("rollout/sim", 2),
        ("rollout/policy", 2),
    ]
    assert [(p.path, p.iteration) for p in lvl2] == one_pass * 2  # one pass per repeat
    assert all(p.weight == pytest.approx(5 / 3 / 2) for p in lvl2)  # 5 trips, 3 measured, 2 passes
    summary = {(s.level, s.path): s for s in rp.phase_idle_summary(tl)}
    assert summary[(2, "rollout/sim")].occurrences_per_iteration == pytest.approx(5.0)
    (loop,) = tl.metadata["loops"]
    assert (loop["path"], loop["trip_count"], loop["measured_iterations"]) == ("rollout", 5, 3)
    starts = [p.start_ns for p in tl.phases]
    assert starts == sorted(starts) and all(p.end_ns > p.start_ns for p in tl.phases)
    # per-phase summary works without activity (times only)
    paths = {(s.level, s.path) for s in rp.phase_idle_summary(tl)}
    assert {(2, "rollout/sim"), (2, "rollout/policy"), (1, "rollout"), (0, "(iteration)")} <= paths


def nested_program(w, x, key):
    """A jit spanning two components (inlined), a transparent epoch loop around a minibatch loop,
    a reverse scan, a while loop with components, and a PRNG key output."""

    @jax.jit
    def act(w, x):
        with rose_jax.component("policy"):
            a = jnp.tanh(x @ w)
        with rose_jax.component("sim"):
            return x + 0.1 * a

    x = act(w, x)
    with rose_jax.component("collect"):  # straight-line sub-components (no loop)
        with rose_jax.component("act"):
            a = jnp.tanh(x)
        with rose_jax.component("env"):
            x = x + 0.5 * a

    def minibatch(w, mb):
        with rose_jax.component("loss"):
            g = jnp.mean(mb) * 0.01
        with rose_jax.component("optimizer"):
            return w - g, g

    def epoch(w, _):
        mbs = jnp.reshape(x, (2, -1))[::-1]  # glue of the epoch body
        return jax.lax.scan(minibatch, w, mbs)

    with rose_jax.component("update"):
        w, gs = jax.lax.scan(epoch, w, None, length=3)

    def back(c, g):
        with rose_jax.component("gae"):
            return c * 0.9 + g, c

    with rose_jax.component("advantage"):
        c, adv = jax.lax.scan(back, jnp.zeros(()), gs.reshape(-1), reverse=True)

    def cond(s):
        return s[0] < 4

    def body(s):
        with rose_jax.component("step"):
            return s[0] + 1, s[1] * 1.5

    with rose_jax.component("search"):
        n, v = jax.lax.while_loop(cond, body, (0, c))
    key, sub = jax.random.split(key)
    return w, x, adv, v, n, key, jax.random.normal(sub, (2,))


def test_segmented_program_matches_fn_and_times_nested_loops():
    args = (jnp.eye(4) * 0.5, jnp.arange(8.0).reshape(2, 4), jax.random.PRNGKey(3))
    prog = rp.SegmentedProgram(nested_program, *args)
    assert prog.labels == ["policy", "sim", "collect", "update", "advantage", "search"]  # jit inlined
    got, want = prog.run(*args), jax.jit(nested_program)(*args)
    cmp = rp.compare_outputs(got, want)
    assert cmp["match"] and cmp["num_leaves"] == 7
    assert not rp.compare_outputs(got, (want[0] + 1,) + tuple(want[1:]))["match"]

    tl = rp.time_phases(nested_program, *args, repeats=1, max_loop_iterations=2, time_fused=False)
    assert tl.metadata["outputs_match"]
    deep = [(p.path, p.iteration, round(p.weight, 6)) for p in tl.phases if p.level == 2]
    assert deep[:2] == [("collect/act", 0, 1.0), ("collect/env", 0, 1.0)]
    # update: transparent epoch loop (3 trips, 1 measured) around the minibatch loop (2 trips, 2 measured)
    assert deep[2:6] == [
        ("update/loss", 0, 3.0),
        ("update/optimizer", 0, 3.0),
        ("update/loss", 1, 3.0),
        ("update/optimizer", 1, 3.0),
    ]
    # a loop whose whole body is one component is that component: timed whole, weight 1
    assert deep[6] == ("advantage/gae", 0, 1.0)
    assert deep[7:] == [("search/step", 0, 2.0), ("search/step", 1, 2.0)]  # while: 4 trips, 2 measured
    loops = {
        (d["path"], d["kind"], d["trip_count"], d["measured_iterations"], d["transparent"])
        for d in tl.metadata["loops"]
    }
    assert loops == {
        ("update", "scan", 3, 1, True),
        ("update", "scan", 2, 2, False),
        ("search", "while", 4, 2, False),
    }
    assert all(p.level in (1, 2) for p in tl.phases)
    assert [
        p.path for p in rp.time_phases(nested_program, *args, levels=1, repeats=1).phases if p.level == 2
    ] == []


def test_a_long_fused_call_is_timed_without_a_second_warm_call(monkeypatch):
    """The fused program gets one more untimed call before its timed ones (the dispatch path)
    only when its first call is shorter than WARM_CALL_NEGLIGIBLE_S: a long epoch is not run once
    more for nothing. Calls counted by a host callback in the program (the segmented runs make
    the same calls either way)."""
    from jax.experimental import io_callback

    from rose_jax.profile import phases

    calls = []

    def cb(x):
        calls.append(1)
        time.sleep(0.05)
        return x

    def fn(x):
        y = io_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=True)
        return y * 2.0

    counts = {}
    for threshold in (10.0, 0.01):  # the 50 ms call is short, then long
        monkeypatch.setattr(phases, "WARM_CALL_NEGLIGIBLE_S", threshold)
        calls.clear()
        rp.time_phases(fn, jnp.ones(3), levels=1, repeats=1)
        counts[threshold] = len(calls)
    assert counts[10.0] == counts[0.01] + 1


def test_profile_builds_are_the_callers_cached_builds():
    """The profile compiles ``jax.jit(fn)`` (fn unjitted) and the caller's ``also_compile`` builds
    in its pool: afterwards both run from JAX's cache (no backend compile), counted by JAX's own
    compile events; a build that fails to lower is recorded, and the profile goes on. A jit of a
    jit is another program: it compiles again."""
    import jax.monitoring

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name.endswith("backend_compile_duration") else None
    )
    args = (jnp.eye(4) * 0.25, jnp.arange(8.0).reshape(2, 4), jax.random.PRNGKey(5))
    options = {"xla_cpu_enable_fast_math": False}  # any option: a build of its own
    bad = (jax.jit(nested_program), (jnp.ones(3),))  # wrong arguments: lowering fails
    also = [(jax.jit(nested_program, compiler_options=dict(options)), args), bad]
    tl = rp.time_phases(nested_program, *args, repeats=1, max_loop_iterations=2, also_compile=also)
    pre = tl.metadata["precompile"]
    assert pre["also"] == 2 and len(pre["also_errors"]) == 1
    before = len(compiles)
    jax.block_until_ready(jax.jit(nested_program)(*args))
    jax.block_until_ready(jax.jit(nested_program, compiler_options=dict(options))(*args))
    assert len(compiles) == before  # both found in the cache
    jax.block_until_ready(jax.jit(jax.jit(nested_program))(*args))
    assert len(compiles) == before + 1


def _made_then_used(w, x, key):
    """``nested_program`` after a component that reads nothing (its jit call's outputs are
    uncommitted) and one that reads it."""
    with rose_jax.component("make"):
        z = jnp.arange(8.0).reshape(2, 4)
    with rose_jax.component("use"):
        x = x + z
    return nested_program(w, x, key)


@pytest.mark.parametrize("program", [nested_program, _made_then_used])
@pytest.mark.parametrize("committed", [False, True])
def test_profile_compiles_none_of_its_pieces_after_its_pool(monkeypatch, committed, program):
    """Every piece the profile runs (segments, loop bodies, whole loops, a while loop's trip
    counter) is compiled in its up-front pool, so none compiles again while it runs and times them
    (JAX's compile log), whether the caller's arrays are committed to the device (a training state)
    or not. Eager indexing of a scan's inputs may still compile its tiny ops."""
    import logging
    import re

    seen: list[str] = []

    class Names(logging.Handler):
        def emit(self, record):
            m = re.search(r"Finished XLA compilation of jit\((\w+)\)", record.getMessage())
            if m:
                seen.append(m.group(1))

    pooled = {}
    original = rp.SegmentedProgram.precompile

    def precompile(self, *a, **k):
        out = original(self, *a, **k)
        pooled["n"] = len(seen)
        return out

    monkeypatch.setattr(rp.SegmentedProgram, "precompile", precompile)
    args = (jnp.eye(4) * 0.3, jnp.arange(8.0).reshape(2, 4) + 0.5, jax.random.PRNGKey(7))
    if committed:
        args = jax.device_put(args, jax.devices()[0])
    handler, logger = Names(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            tl = rp.time_phases(program, *args, repeats=1, max_loop_iterations=2)
    finally:
        logger.removeHandler(handler)
    assert tl.metadata["outputs_match"] and tl.metadata["precompile"]["programs"] > 5
    after = [n for n in seen[pooled["n"] :] if n in ("jaxpr_as_fun", "count")]
    assert not after, f"pieces compiled again after the pool: {after}"


def test_time_phases_bad_input():
    args = small_args()
    with pytest.raises(ValueError, match="levels"):
        rp.time_phases(two_component_program, *args, levels=0)
    with pytest.raises(ValueError, match="repeats"):
        rp.time_phases(two_component_program, *args, repeats=0)
    with pytest.raises(ValueError, match="callable"):
        rp.time_phases(3, *args)
    prog = rp.SegmentedProgram(two_component_program, *args)
    with pytest.raises(ValueError, match="structure"):
        prog.run(*args[:2])


# ------------------------------------------------------------------------------------------------
# The sampler: real behaviour on this machine, one mock unit test, real GPU tests


@pytest.mark.skipif(rp.available()[0], reason="this machine has an NVIDIA GPU with NVML")
def test_no_gpu_is_reported_clearly():
    ok, reason = rp.available()
    assert ok is False and reason.startswith("no NVIDIA GPU/NVML:")
    with pytest.raises(rp.NoGPUError, match="no NVIDIA GPU/NVML"):
        with rp.Sampler():  # process mode (the default): the child's failure comes back as is
            pass
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name == "rose-sm-sampler"]
    with pytest.raises(rp.NoGPUError, match="no NVIDIA GPU/NVML"):
        with rp.Sampler(mode="thread"):
            pass
    with pytest.raises(ValueError, match="mode"):
        rp.Sampler(mode="fiber")
    # profile() still times phases, but attaches no activity and says why
    tl = rp.profile(two_component_program, *small_args(), levels=1, repeats=1)
    assert tl.activity is None and tl.metadata["activity"].startswith("unavailable: no NVIDIA GPU/NVML")
    ia = rp.iteration_activity(two_component_program, *small_args(), iters=3, rounds=1)
    assert ia.mean_sm_util is None and ia.series is None and ia.overhead is None
    assert (
        ia.reason.startswith("no NVIDIA GPU/NVML")
        and len(ia.times_off_s) == 3
        and ia.iteration_time_off_s > 0
    )


class FakeNVML:
    """MOCK of the pynvml module (the only mock NVML in this suite): records when samples are
    taken and returns fixed metric values, to unit-test the sampler's thread and bookkeeping."""

    def __init__(self, gpm: bool = True):
        import pynvml

        self.NVMLError = pynvml.NVMLError
        self.c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
        self.NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
        self.NVML_GPM_METRIC_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL
        self.NVML_GPM_METRIC_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
        self._sample_t = pynvml.c_nvmlGpmSample_t
        self.gpm, self.inits, self.shutdowns, self.freed = gpm, 0, 0, 0
        self.buffers, self.stamp, self.pairs = [], {}, []

    @staticmethod
    def _key(ptr) -> int:
        return ctypes.cast(ptr, ctypes.c_void_p).value

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return "handle0"

    def nvmlDeviceGetName(self, h):
        return "FakeGPU"

    def nvmlGpmQueryDeviceSupport(self, h):
        return SimpleNamespace(isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self):
        buf = ctypes.create_string_buffer(16)
        self.buffers.append(buf)
        return ctypes.cast(buf, self._sample_t)

    def nvmlGpmSampleFree(self, s):
        self.freed += 1

    def nvmlGpmSampleGet(self, h, s):
        self.stamp[self._key(s)] = time.perf_counter_ns()
        return s

    def nvmlGpmMetricsGet(self, mg):
        t1, t2 = self.stamp[self._key(mg.sample1)], self.stamp[self._key(mg.sample2)]
        self.pairs.append((t1, t2))
        assert mg.numMetrics == 2 and mg.version == self.NVML_GPM_METRICS_GET_VERSION
        assert (mg.metrics[0].metricId, mg.metrics[1].metricId) == (
            self.NVML_GPM_METRIC_SM_UTIL,
            self.NVML_GPM_METRIC_SM_OCCUPANCY,
        )
        mg.metrics[0].nvmlReturn = mg.metrics[1].nvmlReturn = 0
        mg.metrics[0].value, mg.metrics[1].value = 40.0, 20.0
        return mg

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=37, memory=0)


def test_sampler_thread_with_mock_nvml():
    """Uses the MOCK NVML above (no GPU here): checks GPM sample pairing over the window, the
    step bookkeeping, clean shutdown, and the utilization fallback."""
    fake = FakeNVML(gpm=True)
    assert rp.available(_nvml=fake) == (True, "device 0: FakeGPU; source gpm")
    with rp.Sampler(period_ms=2, window_ms=10, _nvml=fake) as s:
        time.sleep(0.25)
    series = s.series()
    assert series.source == "gpm" and s.lag == 5 and series.num_samples > 20
    assert np.all(series.sm_util == 40.0) and np.all(series.sm_occupancy == 20.0)
    start, end = rp.step_bounds(series)
    assert np.array_equal(start[1:], end[:-1]) and np.all(end > start)
    assert np.all(np.diff(series.t_ns) > 0)
    gaps = np.array([b - a for a, b in fake.pairs])
    assert np.median(gaps) >= 9.5 * MS and np.all(gaps >= 5 * MS), gaps.min()  # ~lag periods (10 ms window)
    assert 8 * MS <= series.resolution_ns <= 40 * MS
    assert fake.inits == fake.shutdowns == 2 and fake.freed == 6  # available() + sampler; lag + 1 buffers

    util = FakeNVML(gpm=False)
    with rp.Sampler(period_ms=2, _nvml=util) as s2:
        time.sleep(0.05)
    u = s2.series()
    assert u.source == "utilization" and u.sm_occupancy is None and np.all(u.sm_util == 37.0)
    with pytest.raises(rp.NoGPUError, match="GPM"):
        rp.Sampler(source="gpm", _nvml=FakeNVML(gpm=False)).start()
    with pytest.raises(ValueError, match="period_ms"):
        rp.Sampler(period_ms=0)


@pytest.mark.gpu
@gpu_only
def test_gpu_sampler_real_nvml_and_gpm():
    ok, reason = rp.available()
    assert ok, reason
    x = jnp.ones((4096, 4096), jnp.float32)
    f = jax.jit(lambda x: jnp.tanh(x @ x) * 1e-3)
    jax.block_until_ready(f(x))
    with rp.Sampler(period_ms=10) as s:
        time.sleep(0.3)
        # Keep the GPU busy for ~1.5 s: far longer than GPM's ~100 ms averaging window, so the
        # middle of the busy span is not diluted by the idle time around it.
        t_start = time.perf_counter_ns()
        y = x
        while time.perf_counter_ns() - t_start < 1.5e9:
            for _ in range(20):
                y = f(x)
            jax.block_until_ready(y)
        t_end = time.perf_counter_ns()
        time.sleep(0.3)
    series = s.series()
    assert series.num_samples > 30 and np.isfinite(series.sm_util).mean() > 0.8
    if "H100" in reason or "H200" in reason or "GH200" in reason:
        assert series.source == "gpm" and series.sm_occupancy is not None
    margin = series.resolution_ns or 200_000_000
    t0, t1 = t_start + 2 * margin, t_end - margin
    busy = rp.mean_activity(series, [(t0, t1)])
    assert busy > 50.0, f"SM activity during back-to-back matmuls was {busy:.1f} %"


@pytest.mark.gpu
@gpu_only
def test_gpu_sampler_overhead_is_small():
    """A ~5 ms iteration (16 fused 4096^2 matmuls), 2 rounds x 200 iterations sampler off / on.

    Blocks of ~1 s (10 GPM windows of 100 ms): shorter blocks (30 iterations, 150 ms) left the
    mean-activity precondition at the mercy of the window edges (41.8 % on one H200)."""
    k = jax.random.PRNGKey(0)
    w = jax.random.normal(k, (4096, 4096)) * 0.01

    def step(w):
        for _ in range(16):
            w = w - 1e-3 * jnp.tanh(w @ w)
        return w, jnp.sum(w)

    ia = rp.iteration_activity(step, w, iters=200, rounds=2)
    assert ia.series is not None and ia.mean_sm_util is not None and ia.mean_sm_util > 50.0
    assert ia.overhead <= 0.03, f"sampler slowed iterations by {ia.overhead:.1%}"


@pytest.mark.gpu
@gpu_only
def test_gpu_kernel_trace_maps_components(tmp_path):
    args = (jnp.ones((256, 256)), jnp.ones((64, 256)), jnp.ones((5, 64, 256)))
    tr = rp.kernel_trace(two_component_program, *args, logdir=str(tmp_path))
    assert tr.available, tr.reason
    assert {"rollout/sim", "rollout/policy", "update"} <= set(tr.busy_ns), tr.busy_ns
    assert tr.busy_ns.get(xplane.UNKNOWN, 0.0) < 0.1 * sum(tr.busy_ns.values()), tr.busy_ns


# ------------------------------------------------------------------------------------------------
# Kernel traces and plots


def test_kernel_trace_on_cpu_says_no_gpu_and_maps_host_ops(tmp_path):
    args = small_args()
    if not ON_GPU:
        tr = rp.kernel_trace(two_component_program, *args, logdir=str(tmp_path / "a"))
        assert not tr.available and tr.reason.startswith("no GPU") and tr.events == ()
    # The host plane's XLA-op events exercise the same parsing and path mapping.
    tr = xplane.kernel_trace(two_component_program, *args, logdir=str(tmp_path / "b"), require_gpu=False)
    assert tr.available and tr.trace_file.endswith(".xplane.pb")
    paths = {e.path for e in tr.events}
    assert {"rollout/sim", "rollout/policy"} <= paths, paths
    assert all(v >= 0 for v in tr.busy_ns.values()) and tr.span_ns > 0
    assert "| path |" in xplane.busy_table(tr)


def test_busy_and_gaps_exact():
    ev = [
        xplane.KernelEvent("k1", 0.0, 10.0, "s0", "a", "op1"),
        xplane.KernelEvent("k2", 5.0, 10.0, "s1", "a", "op2"),
        xplane.KernelEvent("k3", 30.0, 5.0, "s0", "b", "op3"),
        xplane.KernelEvent("m", 16.0, 2.0, "s0", "b", "", "memcpy"),
        xplane.KernelEvent("k4", 36.0, 4.0, "s0", "b", "op4"),
    ]
    busy, gaps, span = xplane.busy_and_gaps(ev)
    assert busy == {"a": 15.0, "b": 9.0} and span == 40.0
    assert gaps == [xplane.Gap(15.0, 15.0, "a -> b", "a", "b"), xplane.Gap(35.0, 1.0, "b", "b", "b")]
    assert xplane.busy_and_gaps(ev, min_gap_ns=2.0)[1] == gaps[:1]


# A real kernel trace, cut down: tests/data/ppo_ant_1024_kernels.json holds the GPU kernel events of
# the PPO Ant (1024 envs) trace recorded on the H200 with jax 0.11.2, aggregated per (kernel, stream,
# hlo_op, name stat), and the HLO instructions of its module that those kernels name. Most kernels
# ran inside CUDA graphs, where ``hlo_op`` is only ``command_buffer_<n>``. The test writes them back
# as an XSpace in the layout jax writes (a ``/host:metadata`` plane whose ``Hlo Proto`` stat holds
# the module, a ``/device:GPU:0`` plane of kernel events) and maps it with the production code.
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ppo_ant_1024_kernels.json")
# busy us per path of the full trace (sum of kernel durations; kernels on one stream run one at a time)
PPO_ANT_1024_BUSY_US = {
    "rollout/sim": 18951.3,
    "update/loss": 3962.0,
    "update/optimizer": 1832.5,
    "update": 1015.7,
    "rollout": 750.6,
    "(glue)": 483.7,
    "rollout/policy": 100.0,
    "advantage": 32.7,
    "normalizer": 8.9,
}


def _pb(*fields) -> bytes:
    """Serialize ``(field_number, value)`` pairs: int -> varint, str/bytes -> length-delimited."""
    out = bytearray()

    def varint(n):
        while True:
            b, n = n & 0x7F, n >> 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return

    for num, v in fields:
        if isinstance(v, int):
            varint(num << 3)
            varint(v)
        else:
            v = v.encode() if isinstance(v, str) else v
            varint(num << 3 | 2)
            varint(len(v))
            out += v
    return bytes(out)


def _xspace_from_fixture(fx: dict) -> bytes:
    ops = fx["op_names"]

    def instr(name, op, called):
        meta = [(7, _pb((2, ops[op])))] if op >= 0 else []
        return _pb((1, name), *meta, *[(38, c) for c in called])

    comps = [
        _pb((1, cname), *[(2, instr(*r)) for r in members], (5, cid))
        for cid, cname, members in fx["computations"]
    ]
    entry_id = 1 + max(c[0] for c in fx["computations"])
    comps.append(_pb((1, "main"), *[(2, instr(*r)) for r in fx["entry"]], (5, entry_id)))
    hlo_proto = _pb((1, _pb((1, fx["hlo_module"]), (2, "main"), *[(3, c) for c in comps])))
    meta_plane = _pb(
        (1, 0),
        (2, "/host:metadata"),
        (
            4,
            _pb(
                (1, 1),
                (
                    2,
                    _pb(
                        (1, 1),
                        (2, f"{fx['hlo_module']}({fx['program_id']})"),
                        (5, _pb((1, 1), (6, hlo_proto))),
                    ),
                ),
            ),
        ),
        (5, _pb((1, 1), (2, _pb((1, 1), (2, "Hlo Proto"))))),
    )
    stat_ids = {
        n: i
        for i, n in enumerate(
            ["hlo_op", "hlo_module", "program_id", "name", "memcpy_details", "kernel_details"], 1
        )
    }
    ev_ids: dict[str, int] = {}
    lines: dict[str, list[bytes]] = {}
    t_ps = 0
    for kname, stream, hlo_op, scope, memcpy, kernel, _count, total_ns in fx["events"]:
        stats = [
            (4, _pb((1, stat_ids["hlo_op"]), (5, hlo_op))),
            (4, _pb((1, stat_ids["hlo_module"]), (5, fx["hlo_module"]))),
        ]
        stats.append((4, _pb((1, stat_ids["program_id"]), (4, int(fx["program_id"])))))
        if scope:
            stats.append((4, _pb((1, stat_ids["name"]), (5, scope))))
        if memcpy:
            stats.append((4, _pb((1, stat_ids["memcpy_details"]), (5, "kind_src:device kind_dst:device"))))
        if kernel:
            stats.append((4, _pb((1, stat_ids["kernel_details"]), (5, "grid:1,1,1 block:1,1,1"))))
        mid = ev_ids.setdefault(kname, len(ev_ids) + 1)
        lines.setdefault(stream, []).append(_pb((1, mid), (2, t_ps), (3, total_ns * 1000), *stats))
        t_ps += total_ns * 1000 + 100_000  # laid end to end, 100 ns apart
    gpu_plane = _pb(
        (1, 1),
        (2, "/device:GPU:0"),
        *[
            (3, _pb((1, i), (2, name), (3, 0), *[(4, e) for e in evs]))
            for i, (name, evs) in enumerate(lines.items())
        ],
        *[(4, _pb((1, i), (2, _pb((1, i), (2, n))))) for n, i in ev_ids.items()],
        *[(5, _pb((1, i), (2, _pb((1, i), (2, n))))) for n, i in stat_ids.items()],
    )
    return _pb((1, meta_plane), (1, gpu_plane))


def test_real_h200_trace_maps_kernels_to_components(tmp_path):
    with open(FIXTURE) as f:
        fx = json.load(f)
    path = tmp_path / "vm.xplane.pb"
    path.write_bytes(_xspace_from_fixture(fx))
    tr = xplane.trace_from_file(str(path))
    assert tr.available and len(tr.events) == len(fx["events"])
    in_graphs = sum(e.duration_ns for e in tr.events if e.hlo_op.startswith("command_buffer_"))
    total = sum(tr.busy_ns.values())
    assert in_graphs > 0.8 * total  # the case the old mapping could not resolve
    assert xplane.UNKNOWN not in tr.busy_ns
    assert {p: round(v / 1e3, 1) for p, v in tr.busy_ns.items()} == pytest.approx(
        PPO_ANT_1024_BUSY_US, abs=0.05
    )
    real = sum(v for p, v in tr.busy_ns.items() if p.startswith(("rollout/", "update/", "advantage")))
    assert real > 0.9 * total
    # the backward pass ``rose:loss/transpose(jvp())...;rose:update/...`` stays in update/loss
    assert not any("loss/update" in p for p in tr.busy_ns)
    # mapping by kernel name, by hlo_op, and through the command buffer's common path
    paths_of = {}
    for e in tr.events:
        paths_of.setdefault((e.name, e.hlo_op), set()).add(e.path)
    assert paths_of[("loop_add_fusion_33", "command_buffer_1")] == {"rollout"}  # by kernel name
    solver = "void trsm_batch_left_lower_kernel<float>(cublasTrsmBatchParams<float>, float const* const*, "
    assert paths_of[(solver + "float* const*, float const*, float)", "triangular-solve")] == {"rollout/sim"}
    # graph-added copy kernels name no instruction: their command buffer's common path
    assert paths_of[("memcpy32_post", "command_buffer_269")] == {"rollout/sim"}
    posts = {e.path for e in tr.events if e.name == "memcpy32_post"}
    assert (
        posts
        and xplane.UNKNOWN not in posts
        and all(e.kind == "kernel" for e in tr.events if e.name == "memcpy32_post")
    )
    md = xplane.kernels_markdown("ppo_ant_1024", tr, "label.xplane.pb")
    assert md.startswith("# ppo_ant_1024: kernel busy time per component\n\ntrace: label.xplane.pb\n")
    assert "| rollout/sim | 18.951 |" in md and "## longest gaps between kernels" in md


def test_hlo_paths_of_fusions_and_merged_op_names():
    text = """
%fused_computation.1 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %s = f32[4]{0} sine(%p), metadata={op_name="jit(f)/rose:rollout/while/body/rose:sim/sin"}
  ROOT %t = f32[4]{0} tanh(%s), metadata={op_name="jit(f)/rose:rollout/while/body/rose:policy/tanh"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %g = f32[4] negate(%x), metadata={op_name="jit(f)/rose:upd/rose:loss/transpose(jvp())/n;rose:upd/rose:loss"}
  %b = f32[4]{0} abs(%g), metadata={op_name="jit(f)/rose:upd/rose:actor/transpose(rose:actor)/jvp(MLP)/abs"}
  ROOT %loop_sine_fusion.3 = f32[4]{0} fusion(%b), kind=kLoop, calls=%fused_computation.1
}
"""
    paths = xplane.hlo_component_paths(text)
    assert paths["s"] == "rollout/sim" and paths["loop_sine_fusion.3"] == "rollout"
    assert paths["g"] == "upd/loss" and paths["b"] == "upd/actor" and paths["x"] == ""


def test_plot_timeline_writes_png(tmp_path):
    tl = synthetic(occupancy=[30.0] * 10)
    tl = tl.replace(phases=tl.phases + (rp.Phase("a/sim", 120 * MS, 130 * MS, 2, 0, 2.0),))
    out = rp.plot_timeline(tl, tmp_path / "p.png", "synthetic")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    out2 = rp.plot_timeline(
        tl.replace(activity=None, metadata={"activity": "unavailable: test"}), tmp_path / "q.png"
    )
    assert os.path.getsize(out2) > 1000
    with pytest.raises(ValueError, match="no phases"):
        rp.plot_timeline(rp.Timeline(()), tmp_path / "r.png")


def test_components_hidden_in_one_jit_are_found():
    """A program that is one jit whose body is all inside one component still gets its
    sub-components and its loop bodies timed (the call is inlined at every depth)."""

    @jax.jit
    def inner(x):
        def body(c, _):
            with rose_jax.component("sim"):
                c = jnp.sin(c)
            with rose_jax.component("policy"):
                c = c * 0.5
            return c, None

        with rose_jax.component("prep"):
            x = x + 1.0
        return jax.lax.scan(body, x, None, length=3)[0]

    def program(x):
        with rose_jax.component("train"):
            return inner(x)

    tl = rp.time_phases(jax.jit(program), jnp.ones(4), repeats=1, time_fused=False)
    assert tl.metadata["outputs_match"] and tl.metadata["segments"] == ["train"]
    deep = [p.path for p in tl.phases if p.level == 2]
    assert deep[0] == "train/prep"
    assert deep[1:] == ["train/sim", "train/policy"] * 3


_PLACEMENT_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
import numpy as np
sys.path.insert(0, "tests")
from test_profile import nested_program
from rose_jax import profile as rp
from rose_jax.profile import phases

d0, d1 = jax.devices()[:2]
args = (jnp.eye(4) * 0.3, jnp.arange(8.0).reshape(2, 4) + 0.5, jax.random.PRNGKey(7))
on_d1 = jax.device_put(args, d1)
mesh = jax.sharding.Mesh(np.array([d0, d1]), ("x",))
split = jax.device_put(args[1], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
prog = rp.SegmentedProgram(nested_program, *on_d1)
out = {
    "plain": str(phases._target_device(args)),
    "on_d1": str(phases._target_device(on_d1)),
    "sharded": str(phases._target_device((args[0], split, args[2]))),
    "ran_on": sorted({str(d) for leaf in jax.tree.leaves(prog.run(*on_d1)) for d in leaf.devices()}),
    "d0": str(d0), "d1": str(d1),
}
print(json.dumps(out))
"""


def test_profile_commits_to_the_arguments_device_and_leaves_sharded_states_alone():
    """Two forced CPU devices (own process): arguments committed to the second device are profiled
    there, uncommitted ones on JAX's default device, and a state sharded over both devices is left
    as given (nothing committed, no gather onto one device)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _PLACEMENT_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["plain"] == got["d0"] and got["on_d1"] == got["d1"] and got["sharded"] == "None"
    assert got["ran_on"] == [got["d1"]]
