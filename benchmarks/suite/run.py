"""The benchmark suite: Brax, single-jit, hand-pipelined and rose-jax, one GPU.

    python -m benchmarks.suite.run --suite quick                # H200 headline rows, < 8 min with compilation
    python -m benchmarks.suite.run --suite full --part 3/32     # one part of every combination
    python -m benchmarks.suite.run --suite tiny                 # CPU smoke run (< 2 min), used by the tests
    python -m benchmarks.suite.run --suite epoch --part 1/2 --mps-client   # training epochs + evaluation
    python -m benchmarks.suite.run --suite full --list          # rows, parts and estimated device time

Every variant of a row (see :mod:`benchmarks.suite.workloads`) runs in this process on the same device with
the same hyperparameters, env count and initial state, except (a'): Brax's trainer with ``XLA_FLAGS`` +=
:data:`benchmarks.suite.workloads.PEER_XLA_FLAGS` must start its own process (XLA reads the flags at
process start), so it runs as ``python -m benchmarks.suite.run --suite S --child-brax ROW --result F``
right after (a), in the same device call; the child writes (a)'s record to ``F`` (atomically), and
its failure or timeout is that variant's ``error``. (b') is (b)'s program compiled with the option
set :data:`benchmarks.suite.workloads.PEER_OPTION_SET` (``compiler_options``; none on a CPU, where
the record says ``"options": {}``) and timed in turns with (b)-(d). Throughput is env-steps/s after warm-up:
the median over ``blocks`` timed calls of K iterations each, every call fenced with
``block_until_ready`` (compilation is in the first, untimed call); the device-resident variants
(b)-(d) are compiled first and then timed in turns, one call of each per round, so that drift
of the machine affects all of them alike. Brax's number is its own
``training/sps`` of the epochs after the first two (its first epoch compiles; on JAX >= 0.11 its
second recompiles for the donated layouts, a persistent-cache hit here). Where NVML can sample
the GPU, one more call per variant runs under :class:`rose_jax.profile.Sampler` for the mean SM
activity (so the sampler never perturbs the timed blocks). Results: ``benchmarks/results/suite/
<suite>/results.{json,md,png}`` (``part-i-of-n.*`` for a part, merged into ``results.*``).

Three phases (:func:`run_rows`): every row's setup and its (b)/(b')/(c) compiles, ``--compile-workers``
rows at a time (nothing is timed meanwhile); then row by row (d)'s search and the timed runs of
(b), (b'), (d), (c); then the Brax runs (a) and (a'), cheapest row first, so a budget cuts SAC's Brax
runs first. Every ratio of (d) is to the faster of each peer's pair ((a)/(a'), (b)/(b')): see
:func:`benchmarks.suite.report.summarize`.
A row's variants run in :data:`benchmarks.suite.workloads.RUN_ORDER`; with a time budget (``--budget-s``,
default the suite's) a variant whose estimated cost no longer fits is skipped and recorded as
``skipped``; an exception in one variant is recorded as ``error`` and the suite goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from rose_jax.io import atomic_write_json

from benchmarks import common
from benchmarks.suite import report
from benchmarks.suite import workloads as S


# ------------------------------------------------------------------------------ context


@dataclasses.dataclass
class Context:
    """What every variant of a run shares: the clock, the budget, the device facts, the log."""

    suite: str
    budget_s: float | None
    gpu: bool
    activity: tuple[bool, str]
    measure_threshold: bool
    plan_cache: str | None
    log: Callable[[str], None]
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    # (variant, actual s, estimated s) per finished variant
    observed: list = dataclasses.field(default_factory=list)
    # the persistent XLA compilation cache this run uses (handed to (a')'s child process)
    compile_cache: str | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def scale(self, variant: str | None = None) -> float:
        """Measured / estimated seconds so far (median, clamped to [0.3, 3]) of ``variant``'s runs,
        or of all variants when ``variant`` has none yet. Brax's whole train() is modelled apart
        (it shares no compile with the others): without a Brax run so far its scale is 1; (a')
        (the same train() in a child process) is scaled like (a) until it has runs of its own.

        Per variant because the model's errors are: a (d) search that takes 2x its estimate says
        nothing about Brax's train(), and must not scale it out of the budget."""
        ratios = [(v, a / e) for v, a, e in self.observed if e > 0]
        own = [r for v, r in ratios if v == variant]
        if variant == "brax_flags" and not own:
            own = [r for v, r in ratios if v == "brax"]
        pool = own or ([] if variant in S.BRAX_VARIANTS else [r for _, r in ratios])
        if not pool:
            return 1.0
        return min(3.0, max(0.3, statistics.median(pool)))

    def estimate(self, w: S.Workload, variant: str, precompiled: bool = False) -> float:
        return S.estimate_s(w, variant, self.gpu, precompiled) * self.scale(variant)

    def fits(self, estimate_s: float) -> bool:
        return self.budget_s is None or self.elapsed() + estimate_s <= self.budget_s


def _activity_available(gpu: bool) -> tuple[bool, str]:
    if not gpu:
        import jax

        return False, f"JAX runs on {jax.default_backend()}: no GPU to sample (no SM activity reported)"
    try:
        from rose_jax import profile

        return profile.available()
    except Exception as e:  # noqa: BLE001 - the profiler is optional for throughput numbers
        return False, f"rose_jax.profile unavailable: {type(e).__name__}: {e}"


def _enable_compile_cache(directory: str | None) -> tuple[tempfile.TemporaryDirectory | None, str]:
    """Turn on JAX's persistent compilation cache (a temp dir unless ``directory``).

    Identical programs compiled twice in one run (Brax's second epoch, the optimizer's final
    step) then load the first compile instead of compiling again: less device time, same code.
    """
    tmp = None
    if directory is None:
        tmp = tempfile.TemporaryDirectory(prefix="rose-jax-xla-cache-")
        directory = tmp.name
    common.enable_compile_cache(directory, min_compile_time_s=0.5)
    return tmp, directory


# ------------------------------------------------------------------------------ helpers


def _copy(state: Any) -> Any:
    """A fresh device copy (each variant donates its own)."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def _metric(metrics: Any, name: str) -> float | None:
    value = getattr(metrics, name, None) if not isinstance(metrics, dict) else metrics.get(name)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _params(algo: str, state: Any) -> Any:
    """The trained parameters of a state (host copy), for equality checks between variants."""
    import jax

    tree = state.params if algo == "ppo" else (state.actor_params, state.critic_params)
    return jax.device_get(tree)


def _max_abs_diff(a: Any, b: Any) -> float:
    import jax
    import numpy as np

    diffs = jax.tree.leaves(
        jax.tree.map(
            lambda x, y: (
                float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                if np.size(x)
                else 0.0
            ),
            a,
            b,
        )
    )
    return max(diffs) if diffs else 0.0


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _host_loop(step: Callable, iterations: int) -> Callable:
    """``state -> (state, last metrics)``: ``iterations`` dispatches of a compiled step (no host sync).

    A step that runs work in worker processes behind the caller (``step.drain()``, e.g. an
    offloaded evaluation) is drained before the call returns: a timed call includes all its work.
    """
    drain = getattr(step, "drain", None)

    def call(state):
        metrics = None
        for _ in range(iterations):
            state, metrics = step(state)
        if callable(drain):
            drain()
        return state, metrics

    return call


def _sm_activity(call: Callable, state: Any, ctx: Context, min_s: float = 0.5) -> tuple[Any, dict]:
    """Run ``call`` (at least once, at least ``min_s``) under the NVML sampler: mean SM activity."""
    import jax

    ok, reason = ctx.activity
    if not ok:
        return state, {"status": "unavailable", "reason": reason}
    from rose_jax import profile

    try:
        sampler = profile.Sampler(period_ms=10.0, window_ms=100.0).start()
    except Exception as e:  # noqa: BLE001
        return state, {"status": "unavailable", "reason": _one_line(e)}
    spans = []
    try:
        time.sleep(0.12)  # one GPM window before the first span
        stop = time.perf_counter() + min_s
        while True:
            a = time.perf_counter_ns()
            state, _ = call(state)
            jax.block_until_ready(state)
            spans.append((a, time.perf_counter_ns()))
            if time.perf_counter() >= stop:
                break
        time.sleep(0.07)
    finally:
        series = sampler.stop()
    util = profile.mean_activity(series, spans, "sm_util")
    occ = profile.mean_activity(series, spans, "sm_occupancy") if series.sm_occupancy is not None else None
    return state, {
        "status": "ok",
        "mean_sm_util": None if math.isnan(util) else util,
        "mean_sm_occupancy": None if occ is None or math.isnan(occ) else occ,
        "source": series.source,
        "seconds": sum(b - a for a, b in spans) * 1e-9,
        "calls": len(spans),
        "resolution_ms": series.resolution_ns * 1e-6,
    }


def _time_to_threshold(call: Callable, state: Any, steps_per_call: int, w: S.Workload) -> dict:
    """Training seconds (compiled, from the initial state) until the mean episode return >= threshold."""
    import jax

    t0 = time.perf_counter()
    steps, best = 0, -math.inf
    while True:
        state, metrics = call(state)
        jax.block_until_ready(state)
        steps += steps_per_call
        ret = _metric(metrics, "episode_return")
        elapsed = time.perf_counter() - t0
        if ret is not None:
            best = max(best, ret)
        reached = ret is not None and ret >= w.return_threshold
        if reached or elapsed >= w.threshold_max_s:
            out = {"reached": reached, "seconds": elapsed, "env_steps": steps}
            out["threshold"] = w.return_threshold
            out.update({"return": ret} if reached else {"best_return": None if best == -math.inf else best})
            return out


# ------------------------------------------------------------------------------ one row


@dataclasses.dataclass
class Row:
    """A row being measured: its workload, env, config, initial state and shared results."""

    w: S.Workload
    env: Any
    config: Any
    algo: Any
    state0: Any
    reference_params: Any = None  # (b)'s parameters after its first call
    # (b)'s compiled K-iteration loop, reused by (d) when its plan is empty
    single_jit_loop: Callable | None = None
    # ahead-of-time compiled loops of (b) / (c) (see precompile): variant -> callable, seconds, error
    compiled: dict = dataclasses.field(default_factory=dict)
    compile_s: dict = dataclasses.field(default_factory=dict)
    compile_error: dict = dataclasses.field(default_factory=dict)
    # stops worker processes of (d)'s plan (an offloaded component, env groups) when the row ends
    closers: list = dataclasses.field(default_factory=list)

    @property
    def steps_per_call(self) -> int:
        return self.w.env_steps_per_call


@dataclasses.dataclass
class Prepared:
    """A device-resident variant after its warm-up call: ``call(state) -> (state, metrics)`` and its state."""

    variant: str
    call: Callable
    state: Any
    record: dict
    metrics: Any = None


def _epoch_fn(row: Row) -> Callable:
    """An epoch row's pure ``state -> (state, metrics)``: K iterations in a scan, then the evaluation."""
    w = row.w
    if w.algo == "ppo":
        return row.algo.epoch(
            row.config, row.env, w.iterations_per_block,
            num_eval_envs=w.eval_envs, eval_length=w.episode_length,
        )
    return row.algo.epoch(row.config, row.env, iterations=w.iterations_per_block)  # config.num_eval_envs


def _loop(row: Row, variant: str) -> Callable:
    """The jitted (not yet compiled) K-iteration loop of (b) or (c); an epoch row: (b)'s jitted epoch.

    (b') is (b)'s program: its XLA options are given when it is compiled (:func:`peer_options`)."""
    import jax

    from benchmarks.suite import baselines

    if row.w.unit == "epoch":
        if variant not in ("single_jit", "single_jit_flags"):
            raise ValueError(f"{row.w.name}: variant {variant} is not built for epoch rows")
        return jax.jit(_epoch_fn(row), donate_argnums=(0,) if jax.default_backend() != "cpu" else ())
    if variant in ("single_jit", "single_jit_flags"):
        it = row.algo.iteration(row.config, row.env)
    else:
        it = baselines.pipelined_iteration(row.w.algo, row.config, row.env, row.w.groups)
    return baselines.single_jit_loop(it, row.w.iterations_per_block)


def peer_options(gpu: bool) -> dict:
    """(b')'s compiler options: the option set :data:`benchmarks.suite.workloads.PEER_OPTION_SET` on a
    GPU (XLA's GPU options); none on a CPU, where they do not apply."""
    if not gpu:
        return {}
    from rose_jax.optimize.xla_options import SETS

    return dict(SETS[S.PEER_OPTION_SET])


def _compile(row: Row, variant: str) -> Callable:
    """``jit(loop).lower(state0).compile(...)``: (b')'s with :func:`peer_options`, the others' plainly."""
    import jax

    lowered = _loop(row, variant).lower(row.state0)
    if variant == "single_jit_flags":
        return lowered.compile(compiler_options=peer_options(jax.default_backend() == "gpu") or None)
    return lowered.compile()


def precompile(row: Row, variant: str) -> None:
    """Compile (b)'s, (b')'s or (c)'s loop ahead of time for ``row.state0``
    (``jit(...).lower(...).compile()``).

    Stores the compiled callable (same program, same donation as the jitted loop) and the compile
    seconds in the row; on failure records why, and the variant compiles at its first call instead
    ((b'): again ahead of its first call, with its options).
    """
    t = time.perf_counter()
    try:
        row.compiled[variant] = _compile(row, variant)
    except Exception as e:  # noqa: BLE001 - the variant falls back to compiling at its first call
        row.compile_error[variant] = _one_line(e)
    row.compile_s[variant] = time.perf_counter() - t


def _warm(row: Row, variant: str, call: Callable, extra: dict | None = None) -> Prepared:
    """The first call (compiling unless compiled ahead) from a copy of the initial state; params vs (b)'s.

    ``warmup_s`` is compile + first call: an ahead-of-time compile's seconds are included (and
    also recorded as ``precompile_s``; they ran concurrently with other rows' compiles).
    """
    import jax

    extra = dict(extra or {})
    if variant in row.compile_s:
        extra["precompile_s"] = row.compile_s[variant]
        if variant in row.compile_error:
            extra["precompile_error"] = row.compile_error[variant]
    t = time.perf_counter()
    state, metrics = call(_copy(row.state0))
    jax.block_until_ready(state)
    record = {"status": "ok", "warmup_s": time.perf_counter() - t + extra.get("precompile_s", 0.0), **extra}
    first = _params(row.w.algo, state)
    if variant == "single_jit":
        row.reference_params = first
    elif row.reference_params is not None:
        record["max_abs_diff_vs_single_jit"] = _max_abs_diff(first, row.reference_params)
    return Prepared(variant, call, state, record, metrics)


def _unit_call(row: Row, compiled: Callable) -> Callable:
    """One timed call: the compiled K-iteration loop itself, or ``epochs_per_block`` epochs."""
    return _host_loop(compiled, row.w.epochs_per_block) if row.w.unit == "epoch" else compiled


def prepare_single_jit(row: Row, ctx: Context) -> Prepared:
    loop = _unit_call(row, row.compiled.get("single_jit") or _loop(row, "single_jit"))
    row.single_jit_loop = loop
    return _warm(row, "single_jit", loop)


def prepare_single_jit_flags(row: Row, ctx: Context) -> Prepared:
    """(b'): (b)'s program compiled with the peer's XLA options (never silently without them: a failed
    ahead-of-time compile is tried once more here, and a second failure is this variant's error)."""
    compiled = row.compiled.get("single_jit_flags") or _compile(row, "single_jit_flags")
    options = peer_options(ctx.gpu)
    return _warm(
        row,
        "single_jit_flags",
        _unit_call(row, compiled),
        {
            "option_set": S.PEER_OPTION_SET,
            "options": options,
            "note": (
                f"(b)'s program compiled with compiler_options {options}"
                if options
                else "(b)'s program; no GPU, so no XLA options: compiled with XLA's defaults (options {})"
            ),
        },
    )


def prepare_hand_pipelined(row: Row, ctx: Context) -> Prepared:
    loop = row.compiled.get("hand_pipelined") or _loop(row, "hand_pipelined")
    return _warm(row, "hand_pipelined", loop, {"groups": row.w.groups})


def _program(row: Row):
    import algos

    w = row.w
    make = algos.get(w.algo).program
    if w.env.startswith("brax:"):  # not in the registry: workers could not rebuild it
        return make(row.config, row.env)
    kwargs = (("episode_length", w.episode_length),) + ((("backend", w.backend),) if w.backend else ())
    return make(row.config, row.env, env_name=w.env, env_kwargs=kwargs)


def prepare_rose_jax(row: Row, ctx: Context) -> Prepared:
    """Search with ``rose_jax.optimize`` (timed: the search overhead), then warm up its plan."""
    from rose_jax import optimize as ro

    w, o = row.w, row.w.optimizer
    candidates = None
    if o.candidates is not None:
        candidates = [ro.transform_by_name(name, dict(params)) for name, params in o.candidates]
    epoch = w.unit == "epoch"
    t = time.perf_counter()
    step, plan_report = ro.optimize(
        _epoch_fn(row) if epoch else _program(row),
        row.state0,
        candidates=candidates,
        n_iters=o.n_iters,
        repeats=o.repeats,
        cache_dir=ctx.plan_cache,
        max_candidates=o.max_candidates,
        local=o.local,
        combine=o.combine,
        check_slower=o.check_slower,
        equality_iters=o.equality_iters,
        log=lambda line: ctx.log("      " + line),
    )
    search_s = time.perf_counter() - t
    if callable(getattr(step, "close", None)):
        row.closers.append(step.close)
    per_call = w.epochs_per_block if epoch else w.iterations_per_block
    rep = plan_report.to_json()
    plan = rep.get("plan", [])
    if not plan and row.single_jit_loop is not None:
        # Nothing kept: the optimizer hands back the untransformed iteration, i.e. (b)'s program.
        call, protocol = row.single_jit_loop, "empty plan: (b)'s compiled K-iteration loop, timed again"
    elif any(p.get("level") == "host" for p in plan):
        call, protocol = (
            _host_loop(step, per_call),
            "host loop over the plan's step (worker processes; drained at the end of each call)",
        )
    elif o.measure == "host" or epoch:
        call = _host_loop(step, per_call)
        protocol = "dispatches of the optimizer's compiled step per block (asynchronous, no host sync)"
    else:
        from benchmarks.suite import baselines

        call = baselines.single_jit_loop(step, w.iterations_per_block)
        protocol = "the plan's step, K iterations in one jitted lax.scan (as (b))"
    return _warm(
        row,
        "rose_jax",
        call,
        {
            # optimize() wall time: tracing, compiles, measurements (a plan-cache hit: the lookup)
            "search_overhead_s": search_s,
            "search_wall_s": search_s,
            "plan": [
                {
                    "name": p.get("name"),
                    "params": p.get("params"),
                    "label": p.get("label"),
                    "level": p.get("level"),
                }
                for p in plan
            ],
            "optimizer_speedup": rep.get("speedup"),
            "optimizer_equal": rep.get("equal"),
            "cache_hit": rep.get("cache_hit"),
            "report": rep,
            "note": protocol,
        },
    )


def time_in_turns(prepared: list[Prepared], row: Row, ctx: Context) -> None:
    """``blocks`` rounds; in each, one timed call of every variant (so drift hits all alike)."""
    import jax

    rates: dict[str, list[float]] = {p.variant: [] for p in prepared}
    for _ in range(row.w.blocks):
        for p in prepared:
            if p.record["status"] != "ok":
                continue
            try:
                t = time.perf_counter()
                p.state, p.metrics = p.call(p.state)
                jax.block_until_ready(p.state)
                rates[p.variant].append(row.steps_per_call / (time.perf_counter() - t))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                p.record.update(status="error", error=f"timed call: {_one_line(e)}")
    for p in prepared:
        if p.record["status"] == "ok":
            p.record.update(
                env_steps_per_s=statistics.median(rates[p.variant]),
                blocks=rates[p.variant],
                env_steps_per_block=row.steps_per_call,
                last_episode_return=_metric(p.metrics, "episode_return"),
            )


def finish(p: Prepared, row: Row, ctx: Context) -> dict:
    """SM activity (one more sampled call) and, if asked, time to the return threshold."""
    rec = p.record
    if rec["status"] != "ok":
        return rec
    w = row.w
    try:
        p.state, rec["sm_activity"] = _sm_activity(p.call, p.state, ctx)
        p.state = None  # free the device state before the threshold run
        if ctx.measure_threshold and w.return_threshold is not None:
            rec["time_to_threshold"] = _time_to_threshold(p.call, _copy(row.state0), row.steps_per_call, w)
    except Exception as e:  # noqa: BLE001 - the throughput number stands; say what failed after it
        traceback.print_exc(file=sys.stderr)
        rec["finish_error"] = _one_line(e)
    act = rec.get("sm_activity") or {}
    ttt = rec.get("time_to_threshold") or {}
    ctx.log(
        f"    {LABEL[p.variant]}: {rec['env_steps_per_s']:,.0f} env-steps/s "
        f"(blocks {', '.join(f'{r:,.0f}' for r in rec['blocks'])}; warm-up {rec['warmup_s']:.1f}s)"
        + (f"; SM {act['mean_sm_util']:.0f}%" if act.get("mean_sm_util") is not None else "")
        + (
            f"; max|Δ| vs (b) {rec['max_abs_diff_vs_single_jit']:.2g}"
            if "max_abs_diff_vs_single_jit" in rec
            else ""
        )
        + (
            f"; threshold {ttt['threshold']:g} {'reached' if ttt['reached'] else 'not reached'} in "
            f"{ttt['seconds']:.1f}s"
            if ttt
            else ""
        )
    )
    return rec


def run_brax(row: Row, ctx: Context, variant: str = "brax") -> dict:
    """Brax's own trainer on the row's workload in this process: its steady ``training/sps`` over the
    epochs after its two compiles, its whole ``train()`` seconds (``variant``: the label to log)."""
    from benchmarks.suite import baselines

    w = row.w
    warm = 2
    sample = ctx.activity[0]
    epochs = warm + w.blocks + (1 if sample else 0)
    activity: dict = {"status": "unavailable", "reason": ctx.activity[1]}
    sampler: dict = {}

    def on_epoch(i: int) -> None:
        if not sample:
            return
        from rose_jax import profile

        if i == warm + w.blocks - 1:  # the last timed epoch is done: sample the next one
            try:
                sampler["s"] = profile.Sampler(period_ms=10.0, window_ms=100.0).start()
                time.sleep(0.12)
                sampler["t0"] = time.perf_counter_ns()
            except Exception as e:  # noqa: BLE001
                activity.update(status="unavailable", reason=_one_line(e))
        elif i == warm + w.blocks and "s" in sampler:
            t1 = time.perf_counter_ns()
            series = sampler.pop("s").stop()
            util = profile.mean_activity(series, [(sampler["t0"], t1)], "sm_util")
            activity.clear()
            activity.update(
                status="ok",
                mean_sm_util=None if math.isnan(util) else util,
                source=series.source,
                seconds=(t1 - sampler["t0"]) * 1e-9,
                resolution_ms=series.resolution_ns * 1e-6,
                note="one extra Brax epoch under the sampler (host bookkeeping between epochs included)",
            )

    train = baselines.brax_ppo_train if w.algo == "ppo" else baselines.brax_sac_train
    epoch_unit = w.unit == "epoch"
    run = train(w, row.config, epochs, on_epoch, evaluate=epoch_unit)
    if epoch_unit:  # wall time between progress reports: the training epoch, its evaluation, metrics
        ends = run.epoch_end_ns
        timed = [run.epoch_env_steps / ((ends[i] - ends[i - 1]) * 1e-9) for i in range(warm, warm + w.blocks)]
        note = (
            f"Brax train() wall time of epochs {warm + 1}-{warm + w.blocks} (of {epochs}) between its "
            f"progress reports: training epoch + evaluation of {w.eval_envs} envs (deterministic policy)"
        )
    else:
        timed = run.sps[warm : warm + w.blocks]
        note = f"Brax training/sps of epochs {warm + 1}-{warm + w.blocks} (of {epochs})"
    record = {
        "status": "ok",
        "env_steps_per_s": statistics.median(timed),
        "blocks": timed,
        "env_steps_per_block": run.epoch_env_steps,
        "warmup_s": sum(run.epoch_env_steps / s for s in run.sps[:warm]),
        "all_epochs_sps": run.sps,
        "total_s": run.total_s,
        "sm_activity": activity,
        "note": note,
    }
    ctx.log(
        f"    {LABEL[variant]}: {record['env_steps_per_s']:,.0f} env-steps/s (timed "
        f"{', '.join(f'{r:,.0f}' for r in timed)}; training/sps of all epochs "
        f"{', '.join(f'{r:,.0f}' for r in run.sps)}); whole train() {run.total_s:.1f}s"
        + (f"; SM {activity['mean_sm_util']:.0f}%" if activity.get("mean_sm_util") is not None else "")
    )
    return record


def _child_timeout_s(estimate_s: float) -> float:
    """How long (a')'s child may run: 4x its estimate, at least 2 minutes (a hung child must not
    take the device call with it; a slow one is still waited for)."""
    return max(120.0, 4.0 * estimate_s)


def _tail(text: str | bytes | None, lines: int = 1) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    kept = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return " / ".join(kept[-lines:])[:300]


def run_brax_flags(row: Row, ctx: Context, timeout_s: float | None = None) -> dict:
    """(a'): :func:`run_brax` in a child process whose ``XLA_FLAGS`` add
    :data:`benchmarks.suite.workloads.PEER_XLA_FLAGS` (XLA reads them at process start only).

    The child (``--child-brax``) finds the row by name in ``ctx.suite``, uses this run's compile
    cache, and writes its record to a temp file (atomically); this returns that record with the
    command, the child's wall seconds and exit code. A child that fails, times out (``timeout_s``,
    default :func:`_child_timeout_s` of the estimate) or writes no record gives an ``error`` record;
    this never raises for the child.
    """
    w = row.w
    flags = f"{os.environ.get('XLA_FLAGS', '')} {S.PEER_XLA_FLAGS}".strip()
    fd, result = tempfile.mkstemp(prefix=f"suite-brax-flags-{w.name}-", suffix=".json")
    os.close(fd)
    os.unlink(result)
    args = ["--suite", ctx.suite, "--child-brax", w.name]
    args += ["--compile-cache", ctx.compile_cache] if ctx.compile_cache else []
    cmd = [sys.executable, "-m", "benchmarks.suite.run", *args, "--result", result]
    env = dict(os.environ, XLA_FLAGS=flags)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (common.REPO_DIR, os.environ.get("PYTHONPATH")) if p)
    timeout = timeout_s if timeout_s is not None else _child_timeout_s(ctx.estimate(w, "brax_flags"))
    base = {
        "xla_flags": flags,
        "command": f"XLA_FLAGS={shlex.quote(flags)} python -m benchmarks.suite.run {shlex.join(args)}",
    }
    t = time.perf_counter()
    rc: int | None = None
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=common.REPO_DIR, capture_output=True, text=True, timeout=timeout
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
        failure = None if rc == 0 else f"child process exited with {rc}: {_tail(err) or '(no output)'}"
    except subprocess.TimeoutExpired as e:
        out, err = e.stdout, e.stderr
        failure = f"child process timed out after {timeout:.0f}s (killed)"
    except OSError as e:
        out, err, failure = "", "", f"child process did not start: {_one_line(e)}"
    wall = time.perf_counter() - t
    for line in (out.decode(errors="replace") if isinstance(out, bytes) else out or "").splitlines():
        if line.strip():
            ctx.log("  " + line if line.startswith("    ") else "    [child] " + line)
    record: dict = {}
    try:
        with open(result) as f:
            record = json.load(f)
    except (OSError, ValueError):
        pass
    finally:
        if os.path.exists(result):
            os.unlink(result)
    if failure is None and record.get("status") is None:
        failure = "child process wrote no record"
    if failure is not None:
        if err:
            print(_tail(err, 20), file=sys.stderr)
        record = {"status": "error", "error": record.get("error") or failure, **(
            {"child_error": failure} if record.get("error") else {})}
    record.update(base, returncode=rc, process_wall_s=wall)
    return record


def child_brax(suite: str, name: str, result: str, compile_cache: str | None) -> int:
    """``--child-brax``: :func:`run_brax` on row ``name`` of ``suite`` under this process's
    ``XLA_FLAGS``; its record (or the error) written to ``result``."""
    t = time.perf_counter()
    try:
        rows = [w for w in S.get(suite).workloads if w.name == name]
        if not rows:
            raise ValueError(f"suite {suite!r} has no row named {name!r}")
        w = rows[0]
        import jax

        import algos

        if compile_cache:
            common.enable_compile_cache(compile_cache, min_compile_time_s=0.5)
        gpu = jax.default_backend() == "gpu"
        env = w.make_env()
        ctx = Context(
            suite=suite,
            budget_s=None,
            gpu=gpu,
            activity=_activity_available(gpu),
            measure_threshold=False,
            plan_cache=None,
            log=lambda line: print(line, flush=True),
            compile_cache=compile_cache,
        )
        record = run_brax(Row(w, env, w.config(env), algos.get(w.algo), None), ctx, "brax_flags")
        record.update(backend=jax.default_backend(), child_xla_flags=os.environ.get("XLA_FLAGS", ""))
        record["child_s"] = time.perf_counter() - t
        atomic_write_json(result, record)
        return 0
    except Exception as e:  # noqa: BLE001 - the parent records the error
        traceback.print_exc(file=sys.stderr)
        atomic_write_json(result, {"status": "error", "error": _one_line(e)})
        return 1


LABEL = S.LABELS
DEFAULT_WORKERS = 4  # concurrent row setups / compiles on a GPU host (the H200 host has 16 cores)
PREPARE = {
    "single_jit": prepare_single_jit,
    "single_jit_flags": prepare_single_jit_flags,
    "rose_jax": prepare_rose_jax,
    "hand_pipelined": prepare_hand_pipelined,
}


def _skip(out: dict, v: str, ctx: Context, estimate: float) -> bool:
    if ctx.fits(estimate):
        return False
    out["variants"][v] = {
        "status": "skipped",
        "reason": (
            f"time budget: {ctx.elapsed():.0f}s elapsed + ~{estimate:.0f}s estimated > {ctx.budget_s:.0f}s"
        ),
    }
    ctx.log(f"    {LABEL[v]}: skipped (budget: {ctx.elapsed():.0f}s elapsed, ~{estimate:.0f}s needed)")
    return True


def new_record(w: S.Workload) -> dict:
    """A row's JSON record before anything ran."""
    return {
        "name": w.name,
        "workload": w.to_json(),
        "env_steps_per_iteration": w.env_steps_per_iteration,
        "variants": {},
    }


def setup_row(
    w: S.Workload, out: dict, ctx: Context, precompiled: Sequence[str] = S.PRECOMPILED
) -> Row | None:
    """Phase 1 of a row (thread-safe): env, config, initial state, then (b)/(c) compiled ahead of time.

    Returns None (and records the error in ``out``) when the row cannot even start.
    """
    import jax

    import algos

    t = time.perf_counter()
    try:
        env = w.make_env()
        config = w.config(env)
        algo = algos.get(w.algo)
        state0 = algo.init(config, env, jax.random.PRNGKey(w.seed))
        jax.block_until_ready(state0)
    except Exception as e:  # noqa: BLE001 - a row that cannot even start is recorded
        traceback.print_exc(file=sys.stderr)
        out["error"] = _one_line(e)
        for v in w.variants:
            out["variants"][v] = {"status": "error", "error": f"setup failed: {out['error']}"}
        ctx.log(f"    {w.name}: setup failed: {out['error']}")
        return None
    out["setup_s"] = time.perf_counter() - t
    row = Row(w, env, config, algo, state0)
    for v in [v for v in S.RUN_ORDER if v in w.variants and v in precompiled]:
        precompile(row, v)
    ctx.log(
        f"    {w.name}: setup {out['setup_s']:.1f}s"
        + "".join(
            f"; {LABEL[v].split()[0]} compiled in {row.compile_s[v]:.1f}s"
            + (
                f" (failed, compiles at its first call: {row.compile_error[v]})"
                if v in row.compile_error
                else ""
            )
            for v in row.compile_s
        )
    )
    return row


def setup_rows(rows: Sequence[S.Workload], outs: list[dict], ctx: Context, workers: int) -> list[Row | None]:
    """Phase 1 for every row, ``workers`` rows at a time (threads: XLA compiles release the GIL).

    Nothing is timed while this runs; every compile has finished when it returns.
    """
    ctx.log(
        f"[{ctx.suite} precompile] setup and (b)/(c) compiles of {len(rows)} rows, "
        f"{workers} at a time; elapsed {ctx.elapsed():.0f}s"
    )
    t = time.perf_counter()
    if workers <= 1 or len(rows) <= 1:
        built = [setup_row(w, out, ctx) for w, out in zip(rows, outs, strict=True)]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(workers, len(rows)), thread_name_prefix="precompile") as pool:
            futures = [pool.submit(setup_row, w, out, ctx) for w, out in zip(rows, outs, strict=True)]
            built = [f.result() for f in futures]
    ctx.log(f"    precompile phase: {time.perf_counter() - t:.1f}s")
    return built


def measure_row(row: Row, out: dict, ctx: Context, index: str = "") -> dict:
    """Phase 2 of a row: (d)'s search, then (b), (d), (c) warmed up and timed in turns (no Brax)."""
    w = row.w
    ctx.log(
        f"[{ctx.suite} {index}] {w.name}: {w.algo} on {w.env}"
        + (f" ({w.backend})" if w.backend else "")
        + f", {w.num_envs} envs, {w.env_steps_per_iteration} "
        + (
            f"env-steps/iteration, {w.epochs_per_block} epochs (K={w.iterations_per_block} + evaluation) "
            if w.unit == "epoch"
            else f"env-steps/iteration, K={w.iterations_per_block} "
        )
        + f"x {w.blocks} blocks; elapsed {ctx.elapsed():.0f}s"
    )
    prepared: list[Prepared] = []
    for v in [v for v in S.RUN_ORDER if v in w.variants and v in PREPARE]:
        estimate = ctx.estimate(w, v, precompiled=v in row.compiled)
        if _skip(out, v, ctx, estimate):
            continue
        t = time.perf_counter()
        try:
            p = PREPARE[v](row, ctx)
            prepared.append(p)
            ctx.log(
                f"    {LABEL[v]}: compiled and warmed up in {p.record['warmup_s']:.1f}s"
                + (" (compiled ahead)" if "precompile_s" in p.record and v in row.compiled else "")
                + (f" (search {p.record['search_wall_s']:.1f}s)" if "search_wall_s" in p.record else "")
            )
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
            traceback.print_exc(file=sys.stderr)
            p = Prepared(v, None, None, {"status": "error", "error": _one_line(e)})
            ctx.log(f"    {LABEL[v]}: ERROR {p.record['error']}")
        p.record["prepare_wall_s"] = time.perf_counter() - t
        p.record["estimated_s"] = estimate
        if p.record["status"] == "ok" and v not in row.compiled:  # the model's compile part is testable
            ctx.observed.append((v, p.record["prepare_wall_s"], S.compile_s(w, v, ctx.gpu)))
        out["variants"][v] = p.record
    time_in_turns([p for p in prepared if p.record["status"] == "ok"], row, ctx)
    for p in prepared:
        out["variants"][p.variant] = finish(p, row, ctx)
    del prepared
    release(row)
    return finalize(out, ctx, log=not any(v in S.BRAX_VARIANTS for v in w.variants))


def release(row: Row) -> None:
    """Drop a row's device state and compiled programs (its Brax run needs only the workload and config)."""
    while row.closers:
        try:
            row.closers.pop()()
        except Exception:  # noqa: BLE001 - a worker that will not stop must not end the suite
            traceback.print_exc(file=sys.stderr)
    row.single_jit_loop = None
    row.compiled.clear()
    row.state0 = None
    gc.collect()


def brax_row(row: Row, out: dict, ctx: Context, index: str = "") -> dict:
    """Phase 3 of a row: Brax's own trainer as shipped (a) in this process, then with the peer's XLA
    flag (a') in a child process, each if the budget still fits it."""
    w = row.w
    ctx.log(f"[{ctx.suite} brax {index}] {w.name}: Brax {w.algo}.train; elapsed {ctx.elapsed():.0f}s")
    for v in [v for v in S.BRAX_VARIANTS if v in w.variants]:
        estimate = ctx.estimate(w, v)
        if _skip(out, v, ctx, estimate):
            continue
        t = time.perf_counter()
        try:
            rec = run_brax(row, ctx) if v == "brax" else run_brax_flags(row, ctx)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            rec = {"status": "error", "error": _one_line(e)}
        if rec["status"] != "ok":
            ctx.log(f"    {LABEL[v]}: ERROR {rec['error']}")
        rec["wall_s"] = time.perf_counter() - t
        rec["estimated_s"] = estimate
        if rec["status"] == "ok":
            ctx.observed.append((v, rec["wall_s"], S.estimate_s(w, v, ctx.gpu)))
        out["variants"][v] = rec
        gc.collect()
    return finalize(out, ctx)


def finalize(out: dict, ctx: Context, log: bool = True) -> dict:
    """Variants in :data:`VARIANTS` order and the row's summary (recomputed whenever a variant is added)."""
    out["variants"] = {v: out["variants"][v] for v in S.VARIANTS if v in out["variants"]}
    out["summary"] = report.summarize(out)
    out.update(report.peer_fields(out))  # the keys report.peer_cells reads
    s = out["summary"]
    if log and s["ratio"] is not None:
        ctx.log(
            f"    ratio (d) / best of {', '.join(s['baselines_measured'])} ({s['best_baseline']}): "
            f"{s['ratio']:.3f}; search overhead {s['search_overhead_s']:.1f}s"
            + "".join(
                f"; vs {p} pair {report.pair_cell(out, p)}"
                for p in S.INFORMED_PEERS
                if any(v in out["variants"] for v in (p, S.INFORMED_PEERS[p]))
            )
        )
    return out


def run_workload(w: S.Workload, ctx: Context, index: str = "", precompile_variants: bool = True) -> dict:
    """Every variant of one row, phase after phase; its JSON record (never raises for a variant)."""
    out = new_record(w)
    row = setup_row(w, out, ctx, S.PRECOMPILED if precompile_variants else ())
    if row is None:
        return out
    measure_row(row, out, ctx, index)
    if any(v in w.variants for v in S.BRAX_VARIANTS):
        brax_row(row, out, ctx, index)
    return out


def run_rows(
    rows: Sequence[S.Workload], ctx: Context, workers: int, on_update: Callable[[list[dict]], None]
) -> list[dict]:
    """The three phases over ``rows``; ``on_update(records)`` after each row and each Brax run.

    1. every row's setup and (b)/(c) compiles, ``workers`` at a time (nothing timed meanwhile);
    2. row by row: (d)'s search, (b), (b'), (d), (c) timed in turns, SM activity;
    3. the Brax runs ((a), then (a') in a child process), cheapest row first
       (:func:`benchmarks.suite.workloads.brax_order`), so that a budget cuts
       the most expensive (SAC's) first.
    """
    outs = [new_record(w) for w in rows]
    built = setup_rows(rows, outs, ctx, workers)
    records: list[dict] = []
    for i, (row, out) in enumerate(zip(built, outs, strict=True)):
        if row is not None:
            measure_row(row, out, ctx, f"{i + 1}/{len(rows)}")
        records.append(out)
        on_update(records)
    by_name = {w.name: i for i, w in enumerate(rows)}
    for j, name in enumerate(S.brax_order(tuple(rows), ctx.gpu)):
        i = by_name[name]
        if built[i] is not None:
            brax_row(built[i], outs[i], ctx, f"{j + 1}/{len(S.brax_order(tuple(rows), ctx.gpu))}")
            on_update(records)
    return records


# ------------------------------------------------------------------------------ the suite


def _parse_part(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--part must look like i/n (e.g. 2/8), got {text!r}") from None
    if not (n >= 1 and 1 <= i <= n):
        raise ValueError(f"--part must be i/n with 1 <= i <= n, got {text!r}")
    return i, n


def select(suite: S.Suite, part: tuple[int, int] | None, only: str | None) -> tuple[S.Workload, ...]:
    rows = suite.workloads
    if part is not None:
        rows = S.split(rows, *part)
    if only:
        keep = [r for r in rows if only in r.name]
        if not keep:
            raise ValueError(
                f"--only {only!r} matches no row of suite {suite.name!r}: {', '.join(r.name for r in rows)}"
            )
        rows = tuple(keep)
    return rows


def print_plan(
    suite: S.Suite, rows: Sequence[S.Workload], gpu: bool, budget: float | None, workers: int = 1
) -> None:
    """Rows, variants and estimated seconds of each phase (:func:`benchmarks.suite.workloads.plan_s`)."""
    plan = S.plan_s(tuple(rows), gpu, workers)
    print(f"suite {suite.name}: {suite.description}")
    print(
        f"{len(rows)} rows, estimated {plan['total'] / 60:.1f} min ({plan['total']:.0f}s) on "
        f"{'the GPU' if gpu else 'this CPU'}"
        + (
            f" (budget {budget / 60:.1f} min per run; parts needed for the whole suite: "
            f"{S.parts_needed(suite, budget, workers, gpu)})"
            if budget
            else ""
        )
    )
    print(
        f"  start ~{plan['start']:.0f}s; precompile (setup + (b)/(c) compiles, {workers} at a time) "
        f"~{plan['precompile']:.0f}s (~{plan['precompile_serial']:.0f}s one after the other)"
    )
    brax_head = "(a,a')"
    print(f"  {'row':34s} {'variants':45s} {'setup+b/c':>9s} {'b,d,c':>6s} {brax_head:>6s}")
    for w in rows:
        r = plan["rows"][w.name]
        print(
            f"  {w.name:34s} {','.join(w.variants):45s} ~{r['precompile']:7.0f}s ~{r['measure']:4.0f}s "
            + (f"~{r['brax']:4.0f}s" if any(v in w.variants for v in S.BRAX_VARIANTS) else "     —")
        )
    if plan["brax_order"]:
        print(
            f"  Brax runs last, in this order (the budget cuts from the end): {', '.join(plan['brax_order'])}"
        )
    if budget and plan["total"] > budget:
        print(f"  estimate exceeds the budget by ~{plan['total'] - budget:.0f}s: the last Brax runs are cut")


def short_table(results: dict) -> str:
    headers = ["workload", *[report.SHORT[v] for v in S.VARIANTS], "ratio"]
    body = []
    for row in results["rows"]:
        ratio = (row.get("summary") or report.summarize(row))["ratio"]
        body.append(
            [
                row["name"],
                *[report.cell(row, v) for v in S.VARIANTS],
                "—" if ratio is None else f"{ratio:.3f}",
            ]
        )
    return common.markdown_table(headers, body)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Run a benchmark suite: Brax vs single-jit vs hand pipeline vs rose-jax."
    )
    p.add_argument("--suite", required=True, choices=sorted(S.SUITES))
    p.add_argument("--part", help="i/n: run part i of n of the suite's rows (balanced by estimated cost)")
    p.add_argument("--only", help="run only rows whose name contains this text")
    p.add_argument("--list", action="store_true", help="print the rows and estimated time, run nothing")
    p.add_argument(
        "--budget-s", type=float, help="wall-time budget of this run incl. compilation (default: suite's)"
    )
    p.add_argument("--no-budget", action="store_true", help="run every variant whatever the time")
    p.add_argument(
        "--threshold",
        dest="threshold",
        action="store_true",
        default=None,
        help="measure time to the return threshold (default: the suite's setting)",
    )
    p.add_argument("--no-threshold", dest="threshold", action="store_false")
    p.add_argument("--out", help=f"results root (default {report.SUITE_DIR})")
    p.add_argument(
        "--compile-cache", help="persistent XLA compilation cache dir (default: a temp dir per run)"
    )
    p.add_argument("--plan-cache", help="rose-jax plan cache dir (default: none, every run searches)")
    p.add_argument(
        "--mps-client",
        action="store_true",
        help="run as a client of a fresh MPS daemon (started and stopped by a parent process), so that "
        "plans with worker processes (an offloaded evaluation) share the GPU concurrently with this one",
    )
    p.add_argument(
        "--compile-workers",
        type=int,
        help="rows set up and (b)/(c)-compiled concurrently before anything is timed "
        f"(default: {DEFAULT_WORKERS} on a GPU, 1 on CPU; 1 = one after the other)",
    )
    p.add_argument("--child-brax", metavar="ROW", help=argparse.SUPPRESS)  # (a')'s child process
    p.add_argument("--result", help=argparse.SUPPRESS)  # where --child-brax writes its record
    args = p.parse_args(argv)
    if args.child_brax:
        if not args.result:
            raise SystemExit("benchmarks.suite.run: --child-brax needs --result FILE")
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        return child_brax(args.suite, args.child_brax, args.result, args.compile_cache)
    if args.mps_client and not os.environ.get("ROSE_MPS_CLIENT"):
        from rose_jax.mps import MPSError, run_as_client

        child = [sys.executable, "-m", "benchmarks.suite.run", *(sys.argv[1:] if argv is None else argv)]
        try:
            return run_as_client(child, log=lambda line: print(line, flush=True))
        except MPSError as e:
            raise SystemExit(f"benchmarks.suite.run: --mps-client: {e}") from None
    if args.compile_workers is not None and args.compile_workers < 1:
        raise SystemExit(f"benchmarks.suite.run: --compile-workers must be >= 1, got {args.compile_workers}")
    try:
        suite = S.get(args.suite)
        part = _parse_part(args.part)
        rows = select(suite, part, args.only)
    except ValueError as e:
        raise SystemExit(f"benchmarks.suite.run: {e}") from None
    budget = None if args.no_budget else (args.budget_s if args.budget_s is not None else suite.budget_s)

    # Before JAX starts: worker processes of rose-jax's multi-process plans need GPU memory too,
    # so this process must not grab 75% of it up front (the same setting for every variant).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    gpu = jax.default_backend() == "gpu"
    workers = args.compile_workers or (DEFAULT_WORKERS if gpu else 1)
    if args.list:
        plan_gpu = gpu or suite.name != "tiny"
        print_plan(
            suite, rows, plan_gpu, budget, args.compile_workers or (DEFAULT_WORKERS if plan_gpu else 1)
        )
        return 0
    tmp_cache, cache_dir = _enable_compile_cache(args.compile_cache)
    ctx = Context(
        suite=suite.name,
        budget_s=budget,
        gpu=gpu,
        activity=_activity_available(gpu),
        measure_threshold=suite.measure_threshold if args.threshold is None else args.threshold,
        plan_cache=args.plan_cache,
        log=lambda line: print(line, flush=True),
        compile_cache=cache_dir,
    )
    directory = report.suite_dir(suite.name, args.out)
    stem = "results" if part is None else f"part-{part[0]}-of-{part[1]}"
    info = common.machine_info()
    results: dict[str, Any] = {
        "suite": suite.name,
        "description": suite.description,
        "part": None if part is None else f"{part[0]}/{part[1]}",
        "command": info["command"],
        "machine": info,
        "settings": {
            "budget_s": budget,
            "measure_threshold": ctx.measure_threshold,
            "only": args.only,
            "sm_activity": {"available": ctx.activity[0], "reason": ctx.activity[1]},
            "plan_cache": args.plan_cache,
            "compile_workers": workers,
            "estimate_s": S.plan_s(tuple(rows), gpu, workers)["total"],
        },
        "rows": [],
    }
    ctx.log(
        f"benchmarks.suite.run: suite {suite.name}{'' if part is None else f' part {part[0]}/{part[1]}'}, "
        f"{len(rows)} rows on {info.get('gpu') or jax.default_backend()}; budget "
        f"{'none' if budget is None else f'{budget:.0f}s'}; SM activity: {ctx.activity[1]}"
    )

    def on_update(records: list[dict]) -> None:
        results["rows"] = records
        results["elapsed_s"] = ctx.elapsed()
        atomic_write_json(os.path.join(directory, stem + ".json"), results)  # partial results survive a kill

    try:
        run_rows(rows, ctx, workers, on_update)
        results["elapsed_s"] = ctx.elapsed()
        paths = report.write_outputs(results, directory, stem, png=part is None)
        if part is not None:
            merged = report.merge_parts(directory)
            if merged is not None:
                paths += report.write_outputs(merged, directory)
    finally:
        if tmp_cache is not None:
            tmp_cache.cleanup()
    print(f"\nsuite {suite.name}: {len(rows)} rows in {ctx.elapsed():.0f}s; wrote {', '.join(paths)}\n")
    print(short_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
