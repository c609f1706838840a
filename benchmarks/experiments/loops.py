"""Loop restructuring on the GPU: MJX's solver while loop as a bounded masked scan, before / after.

    python -m benchmarks.experiments.loops                 # H200: stops within --budget-s (400 s), writes
                                                           # benchmarks/results/loops/; the 20 rows there took
                                                           # 10 runs (--only ... --merge, see results.md)
    python -m benchmarks.experiments.loops --smoke         # CPU plumbing check: 2 envs, 2 steps
    python -m benchmarks.experiments.loops --only physics/hopper ppo_iteration
    python -m benchmarks.experiments.loops --only sac_eval ppo_eval --merge   # more rows, same files

Rows (one workload each; env = Brax hopper / walker2d / halfcheetah / humanoidstandup on the MJX
backend, and the shipped ``mjx_swimmer``):

* ``physics/<env>``: ``jit`` of ``K`` steps (a ``lax.scan``) of ``vmap(env.step)`` over ``N`` envs;
* ``ppo_iteration/<env>``: one PPO training iteration (rollout, GAE, epochs of minibatches);
* ``sac_eval/<env>`` / ``ppo_eval/<env>``: the algorithms' evaluation (``E`` envs, ``L`` steps).

Each row compiles the original and :func:`rose_jax.optimize.loops.bound_while_loops` variants
(``where``, ``cond``, ``where`` fully unrolled), the original under two XLA command-buffer option
sets (``options_concurrent``, ``options_no_loops``: compiler options alone, for comparison) and the
``where`` variant under both option sets (``where+concurrent``, ``where+no_loops``) from the same inputs,
times ``--repeats`` calls of each (median), and checks one call's outputs bitwise against the
original's (on the GPU both compiled with ``xla_gpu_deterministic_ops``: MJX's scatter-adds use
atomics, so the original alone is not bitwise repeatable there; ``baseline_repeatable`` records
whether it was). The plan is the fastest variant that is faster than the original by more than
``--min-gain`` and equal (bitwise for the exact variants, within its declared tolerance for the
unrolled one), else ``"none"``: kept only where faster, as every plan. On the ``ppo_iteration``
rows of Brax envs, Brax's own ``ppo.train`` with the same hyperparameters is timed too (``--brax``,
on by default off ``--smoke``): its steady ``training/sps`` beside the original and the plan.

Rows that fail are reported with their error; a row that would not end within ``--budget-s``
(judged by the longest row so far) is skipped with that reason. Files are written after every row
(atomically).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from benchmarks import common
from benchmarks.common import elapsed, log

DEFAULT_OUT = os.path.join(common.RESULTS_DIR, "loops")
ENVS = ("hopper", "walker2d", "halfcheetah", "mjx_swimmer", "humanoidstandup")
# also accepted by --envs (not run by default): Brax's smallest env on MJX, for the CPU smoke
EXTRA_ENVS = ("inverted_pendulum",)
KINDS = ("physics", "ppo_iteration", "sac_eval", "ppo_eval")
# (variant name, bound_while_loops keywords or None for the original, XLA option set or None).
# The option sets are rose_jax.optimize.xla_options.SETS: on the H200 SAC hopper ran 1.35x faster
# with MJX's while loops captured as CUDA-graph conditionals (concurrent) but 1.49x without them
# (concurrent_no_loops), so a bounded scan (a fixed trip count, capturable without conditionals)
# under CONCURRENT command buffers is measured beside the options alone: the plan then says how much
# of a gain is the loop rewrite and how much the compiler options. Measured 2026-12-04 (results/loops):
# concurrent_no_loops alone: PPO iterations of hopper / walker2d / halfcheetah 1.34x / 1.27x / 1.26x,
# physics 1.11-1.30x, the 128-env evaluations 1.20-1.24x; the masked scan alone 1.01-1.05x at bound 4
# (1.04-1.06x unrolled), 0.96x at bound 8 (humanoidstandup), 0.036x at bound 100 (swimmer) and
# 0.50-0.69x on the evaluations; "where+no_loops" (both together) 0.04-1.17x: below the options alone.
VARIANTS = (
    ("where", {"variant": "where"}, None),
    ("cond", {"variant": "cond"}, None),
    ("where_unrolled", {"variant": "where", "unroll": True}, None),
    ("options_concurrent", None, "concurrent"),
    ("options_no_loops", None, "concurrent_no_loops"),
    ("where+concurrent", {"variant": "where"}, "concurrent"),
    ("where+no_loops", {"variant": "where"}, "concurrent_no_loops"),
)
TABLE_VARIANTS = tuple(name for name, _, _ in VARIANTS)
# XLA CPU options for --smoke (both sides compiled alike): compiling MJX takes minutes otherwise.
SMOKE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# Equality is checked on programs compiled with deterministic GPU ops (both sides): MJX's scatter-adds
# use atomics, so the untransformed program alone is not bitwise repeatable on the GPU (see the
# ``baseline_repeatable`` field); timing uses the default options.
DETERMINISTIC = {"xla_gpu_deterministic_ops": True}


def equality_options() -> dict | None:
    """The XLA options the equality programs are compiled with: :data:`DETERMINISTIC` on a GPU, None
    (the timed programs themselves) elsewhere. Where a compile under them fails, the variant is
    refused with that reason (all variants, if the original's fails): never checked without them."""
    import jax

    return DETERMINISTIC if jax.default_backend() == "gpu" else None


def workload_order(envs: tuple[str, ...]) -> list[str]:
    """Rows, most telling first (the budget cuts the tail): physics and PPO iterations of the
    three locomotion envs, hopper's evaluations, then the rest."""
    first = [e for e in ("hopper", "walker2d", "halfcheetah") if e in envs]
    rest = [e for e in envs if e not in first]
    rows = [f"physics/{e}" for e in first] + [f"ppo_iteration/{e}" for e in first]
    rows += [f"{k}/{e}" for e in first[:1] for k in ("sac_eval", "ppo_eval")]
    rows += [f"physics/{e}" for e in rest] + [f"ppo_iteration/{e}" for e in rest]
    rows += [f"{k}/{e}" for e in first[1:] + rest for k in ("sac_eval", "ppo_eval")]
    return rows


class Case(NamedTuple):
    """One workload: ``fn(*args)`` is timed; ``env_steps`` per call; ``chain(args, out)`` gives the
    next call's arguments (a training iteration continues from its output state); ``compared(out)``:
    the part of an output the equality check compares (None: all of it; a training iteration: its
    state, as the optimizer's check compares: its metrics are not state, and their ``episode_return``
    is NaN while no episode has finished)."""

    fn: Callable
    args: tuple
    env_steps: int
    chain: Callable[[tuple, Any], tuple] | None
    loops: list[str]
    compared: Callable[[Any], Any] | None = None


def make_env(name: str, **kw):
    import envs

    if name.startswith("mjx_"):
        return envs.make(name, **kw)
    return envs.make(name, backend="mjx", **kw)


def build_case(workload: str, args) -> Case:
    import jax

    from rose_jax.optimize import loops as L

    kind, env_name = workload.split("/")
    compared = None  # the whole output
    if kind == "physics":
        env = make_env(env_name)
        n, k = args.num_envs, args.steps
        state = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(args.seed), n))
        actions = jax.random.uniform(
            jax.random.PRNGKey(args.seed + 1), (k, n, env.action_size), minval=-1.0, maxval=1.0
        )

        def physics(state, actions):
            def step(s, a):
                return jax.vmap(env.step)(s, a), None

            return jax.lax.scan(step, state, actions)[0]

        fn, call_args, steps = physics, (state, actions), n * k
        chain = lambda a, out: (out, a[1])  # noqa: E731 - continue from the last state
    elif kind == "ppo_iteration":
        import algos

        env = make_env(env_name)
        config = common.algo_config("ppo", args.num_envs, args)
        algo = algos.get("ppo")
        state = algo.init(config, env, jax.random.PRNGKey(args.seed))
        fn, call_args, steps = algo.iteration(config, env), (state,), config.env_steps_per_iteration
        chain = lambda a, out: (out[0],)  # noqa: E731
        compared = lambda out: out[0]  # noqa: E731 - the state (its metrics hold NaN by design)
    elif kind in ("sac_eval", "ppo_eval"):
        import algos

        env = make_env(env_name, episode_length=args.eval_length)
        algo_name = kind.split("_")[0]
        config = common.algo_config(algo_name, args.eval_envs, args)
        key = jax.random.PRNGKey(args.seed + 2)
        if algo_name == "sac":
            from algos import sac

            state = sac.init(config, env, jax.random.PRNGKey(args.seed), prefill=False)
            fn = sac.make_evaluator(config, env, num_envs=args.eval_envs, deterministic=True)
            call_args = (state.actor_params, state.normalizer, key)
        else:
            from algos import ppo

            state = algos.get("ppo").init(config, env, jax.random.PRNGKey(args.seed))
            fn = ppo.make_evaluator(config, env, args.eval_envs, args.eval_length)
            call_args = (state.params, state.normalizer, key)
        steps, chain = args.eval_envs * args.eval_length, None
    else:
        raise ValueError(f"unknown workload kind {kind!r}; kinds: {', '.join(KINDS)}")
    # described with the bound the variants use (a loop above it is reported as left alone)
    loops = [
        p.reason
        for p in L.describe_loops(fn, *call_args, max_bound=getattr(args, "max_bound", None) or L.MAX_BOUND)
    ]
    return Case(fn, call_args, steps, chain, loops, compared)


def compile_all(
    fns: dict[str, Callable],
    args: tuple,
    options: dict | None,
    per_fn: dict[str, dict] | None = None,
    option_sets: tuple[dict | None, ...] | None = None,
    failures: dict[tuple[int, str], str] | None = None,
) -> dict[str, tuple[Any, float]] | list[dict[str, tuple[Any, float]]]:
    """``{name: (compiled, seconds)}``: traced and lowered once here, compiled in parallel threads
    (XLA compiles release the GIL). ``per_fn[name]``: XLA options of that function on top of
    ``options``. ``option_sets``: compile every function under each of these (instead of
    ``options``) in the same parallel batch and return one dict per set (the timed programs and their
    deterministic twins compile side by side instead of one batch after the other). ``failures``:
    a compile of a set other than the first that fails is recorded there as ``{(set index, name):
    "Error: message"}`` and left out of that set's dict instead of raised."""
    import jax

    lowered = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        lowered[name] = (jax.jit(fn).lower(*args), time.perf_counter() - t0)
    sets = option_sets if option_sets is not None else (options,)

    def compile_one(item):
        k, (name, (low, trace_s)) = item
        t0 = time.perf_counter()
        opts = {**(sets[k] or {}), **((per_fn or {}).get(name) or {})} or None
        try:
            return k, name, low.compile(compiler_options=opts), trace_s + time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - recorded for the caller (failures), or raised
            if failures is None or k == 0:
                raise
            failures[(k, name)] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            return k, name, None, 0.0

    jobs = [(k, item) for k in range(len(sets)) for item in lowered.items()]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        done = list(pool.map(compile_one, jobs))
    out = [{name: (c, s) for k2, name, c, s in done if k2 == k and c is not None} for k in range(len(sets))]
    return out if option_sets is not None else out[0]


def time_calls(compiled, args: tuple, chain, repeats: int) -> tuple[float, list[float]]:
    """Median seconds of ``repeats`` calls after one warm-up call (each call waited for)."""
    import jax

    out = compiled(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        if chain is not None:
            args = chain(args, out)
        t0 = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def compare(a, b, rtol: float) -> tuple[bool, float, bool]:
    """``(bitwise equal, max abs diff, within rtol of each leaf's largest finite magnitude)`` of two
    pytrees. A NaN equals nothing, not even a NaN: its diff counts as infinite (never within)."""
    import jax

    equal, worst, within = True, 0.0, True
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        same = x.shape == y.shape and bool(np.array_equal(x, y))  # (NaN != NaN)
        equal &= same
        if not same:
            if x.shape != y.shape:
                worst, within = float("inf"), False
                continue
            x64, y64 = x.astype(np.float64), y.astype(np.float64)
            with np.errstate(invalid="ignore"):  # inf - inf (equal infinities: 0)
                d = np.where(x64 == y64, 0.0, np.abs(x64 - y64))
            d = np.where(np.isnan(d), np.inf, d)  # a NaN on either side
            diff = float(d.max()) if d.size else 0.0
            worst = max(worst, diff)
            finite = np.abs(y64[np.isfinite(y64)])
            scale = float(finite.max()) if finite.size else 0.0
            within &= x.dtype.kind == "f" and diff <= rtol * scale
    return equal, worst, within


# Brax's ppo.train compiles its training epoch twice (its first two progress reports): the epochs
# after those are its steady rate
BRAX_EPOCHS, BRAX_WARMUP_EPOCHS = 4, 2


def has_brax_trainer(workload: str) -> bool:
    """Whether Brax's own trainer runs this row's workload: a ``ppo_iteration`` row of a Brax env
    (the shipped ``mjx_*`` envs are not Brax's)."""
    kind, env_name = workload.split("/")
    return kind == "ppo_iteration" and not env_name.startswith("mjx_")


def brax_baseline(env_name: str, args) -> dict:
    """Brax's own ``ppo.train`` on Brax's ``env_name`` (MJX backend) with this row's PPO
    hyperparameters (:func:`benchmarks.suite.baselines.brax_ppo_train`: one Brax training step = one
    of our iterations), ``--brax-iterations`` training steps per epoch, no evaluation: its steady
    ``training/sps``. It runs the same physics (the solver's while loop included). A failure is
    returned as ``brax_error``, never raised (the row keeps its measurements)."""
    from types import SimpleNamespace

    from benchmarks.suite import baselines

    config = common.algo_config("ppo", args.num_envs, args)
    workload = SimpleNamespace(
        brax_env=env_name,
        backend="mjx",
        iterations_per_block=args.brax_iterations,
        eval_envs=1,  # no evaluation runs (evaluate=False)
        episode_length=1000,  # make_env's default, as the rows' envs
        seed=args.seed,
    )
    t0 = time.perf_counter()
    try:
        run = baselines.brax_ppo_train(workload, config, epochs=BRAX_EPOCHS)
    except Exception as e:  # noqa: BLE001 - the baseline is reported as failed, the row stays
        log(f"  brax ppo.train on {env_name}: FAILED: {type(e).__name__}: {e}")
        return {"brax_error": f"{type(e).__name__}: {str(e)[:300]}", "brax_s": time.perf_counter() - t0}
    steady = statistics.median(run.sps[BRAX_WARMUP_EPOCHS:])
    log(f"  brax ppo.train on {env_name}: {steady:,.0f} env steps/s (epochs: {[round(x) for x in run.sps]})")
    return {"brax_env_steps_per_s": steady, "brax_sps_per_epoch": list(run.sps), "brax_s": run.total_s}


def against_brax(brax: dict, baseline_rate: float, rose_rate: float) -> dict:
    """:func:`brax_baseline`'s fields plus the row's original and plan rates over Brax's (none when
    Brax's run failed)."""
    if brax.get("brax_env_steps_per_s"):
        brax = {
            **brax,
            "rose_vs_brax": rose_rate / brax["brax_env_steps_per_s"],
            "baseline_vs_brax": baseline_rate / brax["brax_env_steps_per_s"],
        }
    return brax


def run_row(workload: str, args) -> dict:
    import jax

    from rose_jax.optimize import loops as L

    t0 = time.perf_counter()
    case = build_case(workload, args)
    from rose_jax.optimize.base import EXACT
    from rose_jax.optimize.xla_options import SETS

    chosen_variants = [(n, kw, o) for n, kw, o in VARIANTS if n in args.variants]
    # masked-scan variants whose loops are all above --max-bound are not compiled (the search's own
    # limit: loops.SEARCH_MAX_BOUND); their reason is kept
    tree = None
    if any(kw is not None for _, kw, _ in chosen_variants):
        from rose_jax import trace as rtrace

        tree = rtrace.trace(case.fn, *case.args)
    # each variant's (function, tolerance, XLA options); an options-only variant is the original
    # program compiled differently: exact
    built, refused = {}, {}
    for name, kw, option_set in chosen_variants:
        t = L.bound_while_loops(**kw, max_bound=args.max_bound) if kw is not None else None
        if t is not None:
            legal, why = t.legal(tree)
            if not legal:
                refused[name] = {"not_run": why, "options": option_set or "default"}
                log(f"  {workload} {name}: not run ({why})")
                continue
        built[name] = (
            t.apply(case.fn) if t else case.fn,
            t.tolerance if t else EXACT,
            SETS[option_set] if option_set else {},
            option_set or "default",
        )
    fns = {"original": case.fn, **{name: b[0] for name, b in built.items()}}
    per_fn = {name: b[2] for name, b in built.items()}
    options = SMOKE_COMPILER_OPTIONS if args.smoke else None
    eq_options = equality_options()
    # equality programs: the same functions (and options) under deterministic ops (GPU), else the
    # timed ones; both compiled in one parallel batch (a failed equality compile: in failed)
    failed: dict[tuple[int, str], str] = {}
    if eq_options:
        compiled, checked = compile_all(
            fns, case.args, None, per_fn, option_sets=(options, eq_options), failures=failed
        )
    else:
        compiled = checked = compile_all(fns, case.args, options, per_fn)
    pick = case.compared or (lambda out: out)  # what the equality check compares
    ref = None
    if "original" in checked:
        ref = pick(checked["original"][0](*case.args))
        jax.block_until_ready(ref)
    again = pick(compiled["original"][0](*case.args))
    repeatable, _, _ = compare(again, pick(compiled["original"][0](*case.args)), 0.0)
    base_s, base_times = time_calls(compiled["original"][0], case.args, case.chain, args.repeats)
    base_rate = case.env_steps / base_s
    variants: dict[str, dict] = dict(refused)
    for name, (_, tolerance, _, option_set) in built.items():
        if ref is None or name not in checked:  # refused: never checked without the options
            whose, key = ("the original", "original") if ref is None else ("this variant", name)
            why = f"refused: compile under {eq_options} for the equality check failed for {whose}"
            variants[name] = {"not_run": f"{why} ({failed.get((1, key), '?')})", "options": option_set}
            log(f"  {workload} {name}: {variants[name]['not_run']}")
            continue
        c, compile_s = compiled[name]
        out = pick(checked[name][0](*case.args))
        equal, diff, within = compare(out, ref, tolerance.rtol)
        sec, times = time_calls(c, case.args, case.chain, args.repeats)
        variants[name] = {
            "env_steps_per_s": case.env_steps / sec,
            "speedup": base_s / sec,
            "equal": equal,
            "max_abs_diff": diff,
            "within_tolerance": equal or within,
            "tolerance": tolerance.to_json(),
            "options": option_set,
            "compile_s": compile_s,
            "call_s": times,
        }
        log(
            f"  {workload} {name}: {case.env_steps / sec:,.0f} env steps/s ({base_s / sec:.3f}x), "
            f"equal={equal}{'' if equal else f' max|diff|={diff:.3g}'}"
        )
    ok = [
        (v["speedup"], n)
        for n, v in variants.items()
        if "speedup" in v
        and v["speedup"] > 1.0 + args.min_gain
        and (v["equal"] if v["tolerance"]["rtol"] == 0 else v["within_tolerance"])
    ]
    plan = max(ok)[1] if ok else "none"
    chosen = variants[plan] if plan != "none" else None
    brax = {}
    if getattr(args, "brax", False) and has_brax_trainer(workload):
        brax = against_brax(
            brax_baseline(workload.split("/")[1], args),
            base_rate,
            chosen["env_steps_per_s"] if chosen else base_rate,
        )
    return {
        "workload": workload,
        "env_steps_per_call": case.env_steps,
        "baseline_env_steps_per_s": base_rate,
        "rose_env_steps_per_s": chosen["env_steps_per_s"] if chosen else base_rate,
        "speedup": chosen["speedup"] if chosen else 1.0,
        # the plan's equality; plan none: None (not checked: the plan is the original itself)
        "equal": chosen["equal"] if chosen else None,
        "plan": plan,
        "variants": variants,
        "baseline_compile_s": compiled["original"][1],
        "baseline_call_s": base_times,
        "loops": case.loops,
        "equality_ops": ", ".join(eq_options) if eq_options else "default",
        "baseline_repeatable": repeatable,
        **brax,
        "row_s": time.perf_counter() - t0,
        "error": None,
    }


def _cell(variant: dict | None) -> str:
    if variant is None:
        return "not run"
    if "not_run" in variant:
        return "refused (bound)" if "max_bound" in variant["not_run"] else "refused"
    return f"{variant['speedup']:.3f}x{'' if variant['equal'] else ' (≠)'}"


def markdown(result: dict) -> str:
    rows, machine = result["rows"], result["machine"]
    header = (
        "| workload | baseline env steps/s | rose env steps/s | speedup | equal | plan | "
        + " | ".join(TABLE_VARIANTS)
        + " |"
    )
    lines = [
        "# Loop restructuring: MJX solver while loop -> bounded masked scan",
        "",
        f"{machine.get('date')} on {machine.get('gpu') or machine.get('backend')}; "
        f"jax {machine.get('jax')}; command: `{result['command']}`",
        "",
        f"Sizes: {result['sizes']}. Plan: the fastest variant faster than the original by more than "
        f"{result['sizes']['min_gain']:.0%} and equal (bitwise; the unrolled variant within its declared "
        "tolerance), else none. `equal`: the plan's outputs (a PPO iteration's: its state) bitwise equal to "
        "the original's from the same inputs (plan none: not checked, nothing was kept; each variant's own "
        "check is in its cell, "
        "`(≠)` where unequal; on the GPU both compiled with "
        "`xla_gpu_deterministic_ops`; `baseline_repeatable`: two default-option calls of the original "
        "gave bitwise the same outputs).",
        "",
        *(
            [f"Rows from earlier runs (--merge): {', '.join(result['merged_from_earlier_runs'])}.", ""]
            if result.get("merged_from_earlier_runs")
            else []
        ),
        header,
        "|---|---:|---:|---:|---|---|" + "---:|" * len(TABLE_VARIANTS),
    ]
    for r in rows:
        if r.get("error") or r.get("skipped"):
            why = r.get("skipped") or r.get("error")
            lines.append(f"| {r['workload']} | {why} |" + " |" * (4 + len(TABLE_VARIANTS)))
            continue
        v = r["variants"]
        lines.append(
            f"| {r['workload']} | {r['baseline_env_steps_per_s']:,.0f} | {r['rose_env_steps_per_s']:,.0f} | "
            f"{r['speedup']:.3f}x | {common.fmt_equal(r['equal'])} | {r['plan']} | "
            + " | ".join(_cell(v.get(name)) for name in TABLE_VARIANTS)
            + " |"
        )
    braxed = [r for r in rows if r.get("brax_env_steps_per_s") or r.get("brax_error")]
    if braxed:
        lines += [
            "",
            "Brax's own `ppo.train` on the same env (MJX backend) and PPO hyperparameters, steady "
            "`training/sps` (its epochs after the two that compile), against this row's original and plan:",
            "",
            "| workload | Brax train env steps/s | original / Brax | plan / Brax |",
            "|---|---:|---:|---:|",
        ]
        for r in braxed:
            if r.get("brax_error"):
                lines.append(f"| {r['workload']} | failed: {r['brax_error'][:80]} | | |")
            else:
                lines.append(
                    f"| {r['workload']} | {r['brax_env_steps_per_s']:,.0f} | {r['baseline_vs_brax']:.3f}x | "
                    f"{r['rose_vs_brax']:.3f}x |"
                )
    commands: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r.get("command"):
            commands.setdefault((str(r.get("date")), r["command"]), []).append(r["workload"])
        if r.get("brax_command") and r["brax_command"] != r.get("command"):
            # a Brax baseline added later (--brax-only) is its own run
            commands.setdefault((str(r.get("brax_date")), r["brax_command"]), []).append(
                f"{r['workload']} (Brax baseline)"
            )
    if len(commands) > 1:
        lines += ["", "Rows by the run that wrote them (measured, or skipped with the reason), oldest first:"]
        lines += [""]
        lines += [f"- {date}: `{cmd}`: {', '.join(ws)}" for (date, cmd), ws in sorted(commands.items())]
    lines += ["", "Loops found (per workload, first row of each env):", ""]
    seen = set()
    for r in rows:
        env = r["workload"].split("/")[1]
        if r.get("loops") and env not in seen:
            seen.add(env)
            lines.append(f"- {env}: " + "; ".join(r["loops"]))
    lines += [
        "",
        (
            "Brax's own trainer is timed on the ppo_iteration rows of Brax envs (the table above; "
            "`--brax`); physics and evaluation rows have no Brax trainer to compare with."
            if braxed
            else "Brax's own trainer is not timed in these rows (`--brax off`, or no ppo_iteration row "
            "of a Brax env): its PPO/SAC run the same MJX physics (the same while loop); the suite's "
            "Brax rows (benchmarks/suite) time it for ant."
        ),
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r.get("error") and not r.get("skipped")]
    names = [name for name in TABLE_VARIANTS if any(name in r.get("variants", {}) for r in rows)]
    rows = rows if names else []
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.0))
    if rows:
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))]
            ys = [r["variants"].get(name, {}).get("speedup", 0.0) for r in rows]
            bars = ax.bar(xs, ys, width, label=name)
            for b, r in zip(bars, rows, strict=True):
                if r["variants"].get(name, {}).get("equal") is False:
                    b.set_hatch("//")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["workload"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no row measured", ha="center", va="center", transform=ax.transAxes)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel("speedup over the while loop (x)")
    ax.set_title("bounded masked scan vs MJX solver while loop (hatched: not bitwise equal)")
    common.save_plot(fig, path)


def write(result: dict, out: str) -> None:
    from rose_jax.io import atomic_write_text

    atomic_write_text(os.path.join(out, "results.json"), json.dumps(result, indent=1))
    atomic_write_text(os.path.join(out, "results.md"), markdown(result))
    plot(result, os.path.join(out, "results.png"))


def parse(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.experiments.loops", description=__doc__.split("\n")[0]
    )
    p.add_argument("--envs", nargs="+", default=list(ENVS))
    p.add_argument(
        "--only", nargs="+", default=None, help="workload prefixes to run (e.g. physics/hopper ppo_)"
    )
    p.add_argument("--num-envs", type=int, default=2048, help="envs of the physics and PPO rows")
    p.add_argument("--steps", type=int, default=50, help="env steps per physics call")
    p.add_argument("--eval-envs", type=int, default=128)
    p.add_argument("--eval-length", type=int, default=200, help="steps of an evaluation call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-gain", type=float, default=0.02, help="a plan must be this much faster")
    p.add_argument(
        "--brax",
        choices=["on", "off"],
        default=None,
        help="time Brax's own ppo.train on the ppo_iteration rows of Brax envs "
        "(default: on, off with --smoke)",
    )
    p.add_argument("--brax-iterations", type=int, default=10, help="Brax training steps per timed epoch")
    p.add_argument(
        "--brax-only",
        action="store_true",
        help="measure only Brax's ppo.train for the selected ppo_iteration rows already in --out's "
        "results.json and add it to them (the rows' own measurements and commands stay)",
    )
    p.add_argument(
        "--max-bound",
        type=int,
        default=None,
        help="masked-scan variants only for while loops with at most this bound (default: the "
        "search's loops.SEARCH_MAX_BOUND); larger ones are reported as refused, not compiled",
    )
    p.add_argument(
        "--budget-s", type=float, default=400.0, help="start no row that would end after this (longest row)"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(TABLE_VARIANTS),
        default=list(TABLE_VARIANTS),
        help="variants to compile and time (the plumbing test compiles one)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check: 2 envs, 2 steps, 1 repeat")
    p.add_argument("--out", default=None, help=f"output dir (default {DEFAULT_OUT}; --smoke: a temp dir)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of an existing results.json in --out that this run does not measure",
    )
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="RESULTS_JSON",
        default=None,
        help="measure nothing: combine these results.json files (later files win per workload; a "
        "skipped or failed row never replaces a measured one) into --out, each row keeping its command",
    )
    p.add_argument(
        "--compile-cache",
        default=os.path.join(tempfile.gettempdir(), "rose_jax_jit_cache"),
        help="JAX persistent compilation cache dir ('' to disable)",
    )
    common.add_algo_args(p)
    args = p.parse_args(argv)
    args.brax = (not args.smoke) if args.brax is None else args.brax == "on"
    if args.max_bound is None:
        from rose_jax.optimize.loops import SEARCH_MAX_BOUND

        args.max_bound = SEARCH_MAX_BOUND
    unknown = sorted(set(args.envs) - set(ENVS) - set(EXTRA_ENVS))
    if unknown:
        p.error(f"unknown env(s) {', '.join(unknown)}; choose from {', '.join(ENVS + EXTRA_ENVS)}")
    if args.smoke:
        args.num_envs, args.steps, args.eval_envs, args.eval_length, args.repeats = 2, 2, 2, 2, 1
        common.shrink_algo_args(args)
        args.ppo_unroll, args.ppo_minibatches = 2, 1
        args.compile_cache = ""
    return args


def _measured(row: dict) -> bool:
    return not row.get("error") and not row.get("skipped")


def stamp(rows: list[dict], result: dict) -> list[dict]:
    """Rows with the command and date they were measured by (rows that already carry theirs keep
    them): merged and combined files stay traceable row by row."""
    return [
        {"command": result.get("command"), "date": result.get("date"), "sizes": result.get("sizes"), **r}
        for r in rows
    ]


def file_rows(result: dict) -> tuple[list[dict], set[str]]:
    """One results.json's rows in its order, each stamped with the file's command and date except
    those it only carried over from an earlier file with ``--merge`` without a command of their own
    (files from before per-row commands: that earlier file has their command), and the workloads of
    those carried rows."""
    merged = set(result.get("merged_from_earlier_runs") or ())
    carried = {
        r["workload"] for r in result.get("rows", []) if r["workload"] in merged and "command" not in r
    }
    rows = [r if r["workload"] in carried else stamp([r], result)[0] for r in result.get("rows", [])]
    return rows, carried


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """:func:`benchmarks.common.merge_records` by workload: a skipped or failed row never replaces a
    measured one."""
    return common.merge_records(old, new, key=lambda r: r["workload"], measured=_measured)


def combine(paths: list[str], envs: tuple[str, ...] = ENVS) -> dict:
    """One result from several ``results.json`` files of this experiment: per workload the last
    measured row wins (a skipped or failed row only where no file measured it), rows in
    :func:`workload_order`, each stamped with its own command and date (give the files oldest
    first: a row a file only carried over with ``--merge`` keeps the older file's command)."""
    rows: list[dict] = []
    last = None
    for path in paths:
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--combine: cannot read {path}: {e}") from None
        if result.get("experiment") != "loops":
            raise SystemExit(f"--combine: {path} is not a loops results.json")
        last = result
        new, carried = file_rows(result)
        # a carried-over row only fills a gap: the earlier file, given first, has it with its command
        known = {r["workload"] for r in rows}
        rows = merge_rows(
            rows, [r for r in new if r["workload"] not in carried or r["workload"] not in known]
        )
    order = workload_order(envs)
    rows = sorted(rows, key=lambda r: order.index(r["workload"]) if r["workload"] in order else len(order))
    dated = sorted((r.get("date") or "", r["command"]) for r in rows if r.get("command"))
    commands = list(dict.fromkeys(c for _, c in dated))  # oldest first
    return {
        **last,
        "command": " ; ".join(commands),
        "combined_from": [
            os.path.basename(os.path.dirname(os.path.abspath(p))) + "/" + os.path.basename(p) for p in paths
        ],
        "merged_from_earlier_runs": [],
        "rows": rows,
    }


def brax_only(workloads: list[str], args, out: str, argv) -> int:
    """``--brax-only``: Brax's ``ppo.train`` for the measured ``ppo_iteration`` rows of Brax envs
    among ``workloads`` in ``out``'s results.json, added to those rows (with the command and date of
    this measurement); everything else in the file is kept."""
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        raise SystemExit(f"--brax-only: no {path} to add Brax's baseline to (run the rows first)")
    with open(path) as f:
        result = json.load(f)
    command = " ".join(
        ["python -m benchmarks.experiments.loops", *(argv if argv is not None else sys.argv[1:])]
    )
    date = common.machine_info().get("date")
    todo = [
        r
        for r in result.get("rows", [])
        if r["workload"] in workloads and has_brax_trainer(r["workload"]) and _measured(r)
    ]
    if not todo:
        raise SystemExit(
            "--brax-only: none of the selected rows is a measured ppo_iteration row of a Brax env"
        )
    start = elapsed()  # this call's budget (elapsed() counts from the process's start)
    for r in todo:
        env_name = r["workload"].split("/")[1]
        if elapsed() - start > args.budget_s:
            log(f"{r['workload']}: Brax baseline skipped (time budget {args.budget_s:.0f}s)")
            continue
        # the sizes the row was measured with (stamped per row; else the file's), not this call's
        sizes = r.get("sizes") or result.get("sizes") or {}
        same = {
            k: sizes[k] for k in ("num_envs", "ppo_unroll", "ppo_minibatches", "ppo_epochs") if k in sizes
        }
        log(f"{r['workload']}: Brax's ppo.train with the row's sizes {same}")
        brax = against_brax(
            brax_baseline(env_name, argparse.Namespace(**{**vars(args), **same})),
            r["baseline_env_steps_per_s"],
            r["rose_env_steps_per_s"],
        )
        r.update(brax, brax_command=command, brax_date=date)
        write(result, out)
    print(markdown(result))
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    out = args.out or (tempfile.mkdtemp(prefix="loops_smoke_") if args.smoke else DEFAULT_OUT)
    os.makedirs(out, exist_ok=True)
    if args.combine:
        result = combine(args.combine)
        write(result, out)
        print(markdown(result))
        print(f"combined {len(args.combine)} file(s) into {out}/results.json, results.md, results.png")
        return 0
    if not args.smoke:
        common.enable_compile_cache(args.compile_cache)
    workloads = workload_order(tuple(args.envs))
    if args.only:
        workloads = [w for w in workloads if any(w.startswith(o) for o in args.only)]
    if args.brax_only:
        return brax_only(workloads, args, out, argv)
    result = {
        "experiment": "loops",
        "command": " ".join(
            ["python -m benchmarks.experiments.loops", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": common.machine_info(),
        "sizes": {
            "num_envs": args.num_envs,
            "steps": args.steps,
            "eval_envs": args.eval_envs,
            "eval_length": args.eval_length,
            "repeats": args.repeats,
            "min_gain": args.min_gain,
            "max_bound": args.max_bound,
            "brax": args.brax,
            "brax_iterations": args.brax_iterations,
            "ppo_unroll": args.ppo_unroll,
            "ppo_minibatches": args.ppo_minibatches,
            "ppo_epochs": args.ppo_epochs,
            "smoke": args.smoke,
        },
        "rows": [],
    }
    kept = []  # the old file's rows (--merge); this run's rows replace them by merge_rows' rule
    old_path = os.path.join(out, "results.json")
    if args.merge and os.path.exists(old_path):
        with open(old_path) as f:
            kept, _ = file_rows(json.load(f))
        result["merged_from_earlier_runs"] = [r["workload"] for r in kept if r["workload"] not in workloads]
    result["versions"] = {
        k: result["machine"].get(k) for k in ("jax", *common.PACKAGES) if result["machine"].get(k)
    }
    result["date"] = result["machine"]["date"]
    longest = 0.0  # the longest row so far: a row that would not end within the budget is skipped
    for w in workloads:
        if elapsed() + longest > args.budget_s:
            why = f"time budget {args.budget_s:.0f}s: {elapsed():.0f}s spent, rows take up to {longest:.0f}s"
            log(f"{w}: skipped ({why})")
            result["rows"].append({"workload": w, "skipped": why, "error": None})
        else:
            log(f"{w}: start")
            t_row = elapsed()
            try:
                result["rows"].append(run_row(w, args))
                longest = max(longest, elapsed() - t_row)
            except Exception as e:  # noqa: BLE001 - one failing row is reported, the others run
                log(f"{w}: FAILED: {type(e).__name__}: {e}")
                result["rows"].append({"workload": w, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        result["total_s"] = elapsed()
        write({**result, "rows": merge_rows(kept, stamp(result["rows"], result))}, out)
    result["rows"] = merge_rows(kept, stamp(result["rows"], result))
    print(markdown(result))
    print(f"wrote {out}/results.json, results.md, results.png ({elapsed():.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
