"""Issue 32's question: does a restructuring beat the best XLA flags alone on the same program?

    python -m benchmarks.experiments.beyond_flags --workloads sac-hopper,ppo-ant
    python -m benchmarks.experiments.beyond_flags --smoke          # CPU: tiny PPO, any machine

Per workload (informed_peer's: Brax's published configs through ``rose-jax train``'s own
config path, :func:`benchmarks.experiments.informed_peer.rose_argv`), one process builds the
iteration ``rose-jax train`` runs (``cli.train_job``) and compiles it under the best option set
(``--options``, default ``concurrent_scheduling``: the informed user's flag, per program):

- ``flags_only``: the iteration, jitted, under the options;
- ``hoist``: ``hoist_independent()`` (every scan's carry-independent work ahead of the loop, see
  ``rose_jax/optimize/hoist.py``) under the same options;
- ``hoist:WHERE``: the same, on the loops matching a where spec only (``update``: PPO's update loops);
- ``inplace`` / ``inplace:WHERE``: ``update_in_place()`` (every read of a loop's old carry ordered
  before the elementwise updates that overwrite it, so XLA stops copying the carry every step,
  see ``rose_jax/optimize/inplace.py``), on every scan or the matching ones;
- ``twins`` / ``twins:WHERE``: ``batch_twins()`` (two same-shaped independent networks of a loop
  body, SAC's twin critics, run as one vmap with their carried weights stacked, see
  ``rose_jax/optimize/twins.py``), on every scan or the matching ones;
- ``dense`` / ``dense:WHERE``: ``fuse_dense_chains()`` (each chain of two or three dense layers of
  a loop body, an MLP's forward pass or its input gradient, as one Pallas kernel per block of rows,
  see ``rose_jax/optimize/dense_chains.py``), on every scan or the matching ones;
- ``exit`` / ``exit:K``: ``exit_idle_loops()`` (a carry-only scan proven idle once a carried flag is
  all false, MJX's line search, run as a while loop that stops there, checking every K steps,
  default 5; see ``rose_jax/optimize/early_exit.py``);
- ``unroll:N``: the gradient-step (SAC) / minibatch (PPO) loops unrolled by N (``unroll_scans``),
  so that under CONCURRENT scheduling one step's tail may overlap the next one's head;
- ``set:NAME``: the plain iteration under another option set of ``xla_options.SETS`` (e.g. the
  sets for small latency-bound kernels: ``triton_gemm_any``, ``cublaslt``, ``latency_hiding``,
  ``concurrent_regions``).

Steady rates: each variant compiled and warmed, then timed in turns (``--blocks`` blocks of
``--calls`` calls, one variant after another in each turn, so drifts hit all alike), median
seconds per iteration and the blocks' min/max. Equality: ``--equal-iters`` iterations (default 1,
the search's stepwise rule: from the same state, so a rollout after an update that moved the last
bits is not compared) of each variant against ``flags_only`` under deterministic XLA ops (GPU),
compared within the transform's tolerance, with the max abs difference and the worst leaf. Where
the time goes (``--profile``, GPU): each variant's kernels per
iteration, GPU busy share, median kernel and gap (:func:`kernel_profile`). Learning check
(``--learning-check-steps N``): each variant whose transform's tolerance asks for one (e.g.
``twins``: reassociation) trains 5 seeds per side for N env steps with the workload's config
(``algos.equivalence.learning_check``, issue 32's rule: final returns not different at 5 %, means
within 5 %), recorded as the row's ``learning_check``. Writes
``results.json``, ``results.md`` and ``results.png`` into
``--out`` (default ``benchmarks/results/beyond_flags``); ``--merge`` adds to an earlier call's rows.

``--acceptance --merge --profile-missed --workloads ...`` runs nothing: each missed acceptance row
without a profile gets its plan's iteration traced on this GPU (rows of its GPU model; the plan
from ``--plan-cache`` or the committed copies in ``plans/``), marked as traced in this later call
(:func:`profile_missed`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

from benchmarks import common
from rose_jax.io import atomic_write_json

OUT_DIR = os.path.join(common.RESULTS_DIR, "beyond_flags")
VARIANTS = ("flags_only", "hoist")
# unroll:N variants unroll the gradient-step / minibatch loops (their steps then overlap under
# CONCURRENT scheduling: step i's tail beside step i+1's head)
UNROLL_LOOPS = ("_grad_step", "minibatch_step")


# the parameterised variant forms beside VARIANTS (what both unknown-variant errors list)
VARIANT_FORMS = (
    "hoist:WHERE, inplace, inplace:WHERE, twins, twins:WHERE, dense, dense:WHERE, exit, exit:K, "
    "stack, stack:WHERE, unroll:N, set:NAME"
)


def UNROLL_WHERE(site) -> bool:  # noqa: N802 - a where spec, named like the constants it replaces
    return getattr(site, "name", "") in UNROLL_LOOPS


def build(name: str, smoke: bool):
    """``(job, iteration, state, env steps per iteration)`` of workload ``name``."""
    import jax

    from benchmarks.experiments import informed_peer
    from rose_jax import cli

    w = informed_peer.workloads()[name]
    argv = informed_peer.rose_argv(w, w["steps"], smoke)
    job = cli.train_job(argv)
    fn = job.algo.iteration(job.config, job.algo.train_env(job.config, job.env))
    state = job.algo.init(job.config, job.env, jax.random.PRNGKey(job.config.seed))
    return job, fn, state, int(job.config.env_steps_per_iteration), argv


def transform_of(variant: str):
    """The Transform a variant applies (None: the plain iteration)."""
    from rose_jax.optimize import (
        batch_twins,
        exit_idle_loops,
        fuse_dense_chains,
        hoist_independent,
        stack_carries,
        unroll_scans,
        update_in_place,
    )

    if variant == "flags_only" or variant.startswith("set:"):
        return None
    if variant == "hoist":
        return hoist_independent()
    if variant.startswith("hoist:"):  # one loop (a where spec: "update", "train_steps/_grad_step")
        return hoist_independent(where=variant[6:])
    if variant == "inplace":
        return update_in_place()
    if variant.startswith("inplace:"):
        return update_in_place(where=variant[8:])
    if variant == "twins":
        return batch_twins()
    if variant.startswith("twins:"):
        return batch_twins(where=variant[6:])
    if variant == "dense":
        return fuse_dense_chains()
    if variant.startswith("dense:"):
        return fuse_dense_chains(where=variant[6:])
    if variant == "exit":
        return exit_idle_loops()
    if variant.startswith("exit:"):  # the flag checked every K steps
        return exit_idle_loops(check_every=int(variant[5:]))
    if variant == "stack":
        return stack_carries()
    if variant.startswith("stack:"):  # one loop's carry (a where spec: "collect/sim/_fun")
        return stack_carries(where=variant[6:])
    if variant.startswith("unroll:"):
        return unroll_scans(int(variant[7:]), where=UNROLL_WHERE)
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}, {VARIANT_FORMS}")


def variant_fn(variant: str, fn):
    t = transform_of(variant)
    return fn if t is None else t.apply(fn)


def variant_options(variant: str, options: dict[str, Any], on_gpu: bool) -> dict[str, Any]:
    """``set:NAME`` variants compile the plain iteration under xla_options.SETS[NAME] instead."""
    from rose_jax.optimize import xla_options

    if variant.startswith("set:"):
        return dict(xla_options.SETS[variant[4:]]) if on_gpu else {}
    return options


def _compile(fn, state, options: dict[str, Any]):
    import jax

    t0 = time.perf_counter()
    step = jax.jit(fn).lower(state).compile(compiler_options=options or None)
    return step, time.perf_counter() - t0


def _block(step, state, calls: int):
    import jax

    t0 = time.perf_counter()
    for _ in range(calls):
        state, m = step(state)
    jax.block_until_ready((state, m))
    return state, (time.perf_counter() - t0) / calls


def kernel_profile(step, state, calls: int) -> tuple[Any, dict[str, Any]]:
    """Where an iteration's time goes: ``calls`` calls under ``jax.profiler`` (xplane kernel events,
    :mod:`rose_jax.profile.xplane`), per iteration: kernels launched, GPU busy time (union of kernel
    intervals, all streams), the share of the wall it covers, the median kernel and gap lengths,
    and the longest kernels by total time. ``{"available": False, "reason": ...}`` without a GPU."""
    import tempfile

    import jax

    from rose_jax.profile import xplane

    if jax.default_backend() != "gpu":
        return state, {"available": False, "reason": f"no GPU: JAX backend is {jax.default_backend()!r}"}
    logdir = tempfile.mkdtemp(prefix="beyond-flags-trace-")
    since = time.time()
    t0 = time.perf_counter()
    with jax.profiler.trace(logdir):
        for _ in range(calls):
            state, m = step(state)
        jax.block_until_ready((state, m))
    wall = (time.perf_counter() - t0) / calls
    path = xplane.newest_xplane(logdir, since)
    if path is None:
        return state, {"available": False, "reason": "jax.profiler wrote no trace"}
    trace = xplane.trace_from_file(path, {}, min_gap_us=0.0)
    kern = [e for e in trace.events if e.kind == "kernel"]
    if not kern:
        return state, {"available": False, "reason": trace.reason or "no kernel events"}
    busy_by, gap_list, span = xplane.busy_and_gaps([e._replace(path="all") for e in kern])
    busy = busy_by.get("all", 0.0)  # the union of every kernel's interval, all streams
    durs = sorted(e.duration_ns for e in kern)
    gaps = sorted(g.duration_ns for g in gap_list)
    by_name: dict[str, float] = {}
    for e in kern:
        base = _kernel_kind(e.name)
        by_name[base] = by_name.get(base, 0.0) + e.duration_ns
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    by_component = component_split(kern, calls)
    # idle time (no kernel on any stream) inside each top-level component and between two of them:
    # where the iteration waits (host launches, loop predicates, the gaps of a dependent chain)
    tops = [e._replace(path=(e.path or "(glue)").split("/")[0] or "(glue)") for e in kern]
    idle: dict[str, float] = {}
    for g in xplane.busy_and_gaps(tops)[1]:
        key = g.path if g.before == g.after else "(between components)"
        idle[key] = idle.get(key, 0.0) + g.duration_ns
    for comp, ns in idle.items():
        rec = by_component.setdefault(comp, {"kernels": 0, "kernel_ms": 0.0})
        rec["idle_ms"] = round(ns / calls * 1e-6, 3)
    return state, {
        "available": True,
        "calls": calls,
        "wall_ms_per_iteration_profiled": round(wall * 1e3, 3),
        "kernels_per_iteration": len(kern) / calls,
        "busy_ms_per_iteration": round(busy / calls * 1e-6, 3),
        "busy_share_of_span": round(busy / span, 3) if span else None,
        "median_kernel_us": round(durs[len(durs) // 2] / 1e3, 2),
        "median_gap_us": round(gaps[len(gaps) // 2] / 1e3, 2) if gaps else None,
        "top_kernels_ms_per_iteration": {k: round(v / calls * 1e-6, 3) for k, v in top},
        "by_component": by_component,
    }


def _kernel_kind(name: str) -> str:
    """A kernel's name without XLA's numeric suffix: ``loop_add_fusion_12`` -> ``loop_add_fusion``."""
    return name.rstrip("0123456789_")


def component_split(kernels, calls: int) -> dict[str, dict[str, Any]]:
    """Per top-level component (``collect``, ``train_steps``, ``rollout``, ...; the kernel's
    component path from the trace's HLO, :mod:`rose_jax.profile.xplane`): kernels and kernel
    milliseconds per iteration, and that component's three longest kernel kinds."""
    out: dict[str, dict[str, Any]] = {}
    names: dict[str, dict[str, float]] = {}
    for e in kernels:
        comp = (e.path or "(glue)").split("/")[0] or "(glue)"
        ms = e.duration_ns * 1e-6
        rec = out.setdefault(comp, {"kernels": 0, "kernel_ms": 0.0})
        rec["kernels"] += 1
        rec["kernel_ms"] += ms
        by_kind = names.setdefault(comp, {})
        kind = _kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    for comp, rec in out.items():
        rec["kernels"] = round(rec["kernels"] / calls, 1)
        rec["kernel_ms"] = round(rec["kernel_ms"] / calls, 3)
        top = sorted(names[comp].items(), key=lambda kv: -kv[1])[:3]
        rec["top_ms"] = {k: round(v / calls, 3) for k, v in top}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["kernel_ms"]))


def measure(name: str, args, options: dict[str, Any]) -> dict[str, Any]:
    import jax

    job, fn, state0, env_steps, argv = build(name, args.smoke)
    machine = common.machine_info(jax_devices=True)
    call = machine.get("date")
    device = machine.get("gpu") or machine.get("platform")
    on_gpu = jax.default_backend() == "gpu"
    steps, states, compile_s, legal = {}, {}, {}, {}
    for v in args.variants:
        try:
            f = variant_fn(v, fn)
            t = transform_of(v)
            if t is not None:
                from rose_jax import trace as rtrace

                legal[v] = t.legal(rtrace.trace(fn, state0))[1]
            steps[v], compile_s[v] = _compile(f, state0, variant_options(v, options, on_gpu))
            states[v], _ = _block(steps[v], state0, 2)  # warm
            common.log(f"{name} {v}: compiled in {compile_s[v]:.1f}s")
        except Exception as e:  # noqa: BLE001 - one variant's failure is reported, the rest go on
            common.log(f"{name} {v}: failed: {type(e).__name__}: {e}")
            legal[v] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    per: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(args.blocks):
        for v in steps:
            states[v], s = _block(steps[v], states[v], args.calls)
            per[v].append(s)
    profiles = {}
    if args.profile:
        for v in steps:
            try:
                states[v], profiles[v] = kernel_profile(steps[v], states[v], args.profile_calls)
            except Exception as e:  # noqa: BLE001 - a failed trace is a note, never lost timings
                profiles[v] = {"available": False, "reason": f"{type(e).__name__}: {e}"[:300]}
    rows = []
    base = statistics.median(per["flags_only"]) if per.get("flags_only") else None
    for v in args.variants:
        rec: dict[str, Any] = {
            "workload": name,
            "variant": v,
            "options": variant_options(v, options, on_gpu),
            "legal": legal.get(v),
        }
        if v in per and per[v]:
            med = statistics.median(per[v])
            rec.update(
                seconds_per_iteration=med,
                env_steps_per_s=env_steps / med,
                spread_env_steps_per_s=[env_steps / max(per[v]), env_steps / min(per[v])],
                blocks=len(per[v]),
                calls_per_block=args.calls,
                compile_s=round(compile_s[v], 2),
                speedup_vs_flags_only=(base / med) if base else None,
            )
        if v in profiles:
            rec["profile"] = profiles[v]
        rows.append(rec)
    # equality under deterministic ops: --equal-iters iterations of each variant from the same state
    det = {**options, "xla_gpu_deterministic_ops": True} if on_gpu else dict(options)
    try:
        ref_step, _ = _compile(fn, state0, det)
        ref = common.state_after(ref_step, state0, args.equal_iters)
        for rec in rows:
            v = rec["variant"]
            if v == "flags_only" or v not in steps or v.split(":")[0] not in args.check_equal:
                continue
            v_det = {
                **variant_options(v, options, on_gpu),
                **({"xla_gpu_deterministic_ops": True} if on_gpu else {}),
            }
            from rose_jax.optimize.base import EXACT

            t = transform_of(v)  # option sets change launches, not arithmetic: bitwise
            st, _ = _compile(variant_fn(v, fn), state0, v_det)
            out = common.state_after(st, state0, args.equal_iters)
            rec.update(
                common.equality_fields(out, ref, EXACT if t is None else t.tolerance),
                equality_deterministic_ops=on_gpu,
                equality_iterations=args.equal_iters,
            )
    except Exception as e:  # noqa: BLE001
        common.log(f"{name} equality failed: {type(e).__name__}: {e}")
    if args.learning_check_steps:
        for rec in rows:
            rec.update(learning_check_fields(job, transform_of(rec["variant"]), args.learning_check_steps))
    for rec in rows:
        rec["command"] = "python -m rose_jax.cli train " + " ".join(argv)
        rec["env_steps_per_iteration"] = env_steps
        rec["call"] = call
        rec["device"] = device
    return {"rows": rows}


# ----------------------------------------------------------------------------------------------
# --acceptance: issue 32's table, one row per workload, every number from one device call

# issue 32's targets: speedup over the informed peer (the faster of Brax's trainer as shipped and
# with the best global flag)
TARGETS = {"sac": 1.5, "ppo": 1.15}
PEERS = ("peer_default", "peer_flags")  # Brax's trainer as shipped and with the flag
PEER_NAMES = {"peer_default": "Brax as shipped", "peer_flags": "Brax + flag"}
# env steps per acceptance run (whole runs; steady rates between progress reports, >= 3 of them)
ACCEPTANCE_STEPS = {"sac": 100_000, "ppo": 10_000_000}


def acceptance(name: str, args, on_progress=None) -> dict[str, Any]:
    """Issue 32's row for workload ``name``: Brax's trainer (``args.peer_variants``), ``rose-jax
    train`` with its option trial (``flags_only``: our program with the best options alone) and
    ``rose-jax train --optimize`` (``rose``: the plan ``rose_jax.optimize.optimize`` finds with
    default candidate generation, on empty caches), each a whole run in its own process, steady
    env-steps/s between progress reports (:mod:`benchmarks.experiments.informed_peer`'s rule); the
    plan, its equality, tolerance and learning check from the search's report (the plan cache).
    ``on_progress(row)``: called with the row so far after each run (``"partial": True``), so a
    call cut short keeps what it measured."""
    import contextlib
    import tempfile

    from benchmarks.experiments import informed_peer as ip

    w = ip.workloads()[name]
    default = w.get("acceptance_steps") or ACCEPTANCE_STEPS[w["algo"]]
    steps = int(w["steps"] if args.smoke else (args.acceptance_steps or default))
    runs: dict[str, dict[str, Any]] = {}
    for v in args.peer_variants:
        common.log(f"{name}: {v} ({steps:,} env steps)")
        runs[v] = ip.peer_run(name, v, steps, args.smoke, args.run_timeout_s, _log_path(args, name, v))
        if on_progress:
            on_progress({**acceptance_row(name, w["algo"], steps, runs), "partial": True})
    kept_plans = getattr(args, "plan_cache", None)
    # the runs' temporary caches, removed when the runs end, also when one raises (a timeout, ^C)
    with contextlib.ExitStack() as temporary:

        def tempdir(prefix: str) -> str:
            made = tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True)
            return temporary.enter_context(made)

        first_caches: dict[str, str] = {}  # flags_only's, which flags_only_cached runs on again
        cached_argv = getattr(args, "cached_argv", None)
        cached_argv = args.optimize_argv if cached_argv is None else cached_argv  # "" = no flags
        for v, variant, extra in (
            ("flags_only", "rose_first", ()),
            ("flags_only_cached", "rose_cached", ()),
            ("rose_plan", "rose_optimize_plan", tuple(args.optimize_argv)),
            ("rose", "rose_optimize_first", tuple(args.optimize_argv)),
            ("rose_cached", "rose_optimize_cached", tuple(cached_argv)),
        ):
            if v not in args.rose_variants:
                continue
            if v == "flags_only_cached":  # the user's second run: the trial's decision is cached
                caches = dict(first_caches)
            else:
                caches = {"compile": tempdir(f"bf-{name}-{v}-compile-")}
                if kept_plans and v != "flags_only":  # --plan-cache: the search's plan outlives the call
                    os.makedirs(kept_plans, exist_ok=True)
                    caches["plans"] = kept_plans
                else:
                    caches["plans"] = tempdir(f"bf-{name}-{v}-plans-")
            common.log(f"{name}: {v} ({steps:,} env steps{', ' + ' '.join(extra) if extra else ''})")
            before = _plan_cache(caches["plans"])
            runs[v] = ip.rose_run(
                name, variant, steps, args.smoke, caches, args.run_timeout_s, extra, _log_path(args, name, v)
            )
            after = _plan_cache(caches["plans"])
            runs[v]["plan_cache"] = run_plan_entry(before, after, runs[v].get("optimize"))
            if v == "flags_only":
                first_caches = dict(caches)
            if on_progress:  # (a call's own limit can end it in the next run: 2026-12-07 08:44)
                on_progress({**acceptance_row(name, w["algo"], steps, runs), "partial": True})
    return acceptance_row(name, w["algo"], steps, runs)


# the acceptance runs in the order they run (and are shown); rose_cached: `rose-jax train --optimize`
# again on the plan cache an earlier rose run left (--plan-cache): the user's second run
# rose_plan: `rose-jax train --optimize --plan-only`, the first run's search alone (its plan into
# --plan-cache, no training): with rose_cached after it, a first run split in two where the search and
# the training do not fit one call
RUN_ORDER = (
    "peer_default", "peer_flags", "flags_only", "flags_only_cached", "rose_plan", "rose", "rose_cached"
)


def _log_path(args, name: str, variant: str) -> str:
    """Where a run's output is streamed (``<out>/logs/<workload>-<variant>.log``: a call cut short
    still shows how far each run got)."""
    return os.path.join(args.out, "logs", f"{name}-{variant}.log")


def _plan_file(path: str) -> dict[str, dict[str, Any]]:
    """The plan entries by key of one file of the plan cache's format (``{}`` where there is none):
    a cache's ``plans.json`` or a committed copy (``plans/*.json``)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return {k: e for k, e in data.items() if isinstance(e, dict) and "plan" in e}


def _plan_cache(cache_dir: str) -> dict[str, dict[str, Any]]:
    """The plan cache's entries by key (``{}`` where there is none)."""
    return _plan_file(os.path.join(cache_dir, "plans.json"))


def run_plan_entry(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], optimize: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The plan-cache entry a ``rose-jax train --optimize`` run used, as a one-element list (empty
    where it cannot be told): the key the run names (``run.json``'s ``optimize.cache_key``; a
    ``--plan-only`` search prints it), else the one entry the run wrote or changed (``before`` ->
    ``after``: a run cut before it said). Never a guess: the cache is written with sorted keys, so
    its last entry is the one whose hash sorts last (2026-12-07 08:54: ppo-ant-6ep's row took the
    H200 ppo-ant search's record that way), and an only entry may be another program's, carried in."""
    key = (optimize or {}).get("cache_key")
    if key in after:
        return [after[key]]
    changed = [k for k, e in after.items() if before.get(k) != e]
    return [after[changed[0]]] if len(changed) == 1 else []


def _verdict(
    rose: float | None, peers: dict[str, float | None], target: float
) -> tuple[float | None, bool | None]:
    """``(speedup over the faster peer, target met)``: met only against both peers (as shipped and
    with the flag: the faster one is the informed peer); a miss against either is a miss (the other
    can only be faster); None where there is no ratio or only one peer cleared it."""
    best_peer = max((x for x in peers.values() if x), default=None)
    speedup = round(rose / best_peer, 3) if rose and best_peer else None
    both = all(peers.get(v) for v in PEERS)
    met = None if not speedup else (False if speedup < target else (True if both else None))
    return speedup, met


def acceptance_row(name: str, algo: str, steps: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The row from the runs (pure: the table's rules, tested on the CPU without training)."""

    def rate(v):
        r = runs.get(v) or {}
        return r.get("steady_env_steps_per_s") if r.get("returncode") == 0 else None

    peers = {v: rate(v) for v in PEERS if v in runs}
    # the optimized program's rate: the first (searching) run's, else the cached run's (same plan);
    # a plan-only search (no rate) gives the row its plan where neither ran
    if rate("rose") or not {"rose_cached", "rose_plan"} & set(runs):
        rose_from = "rose"
    else:
        rose_from = "rose_cached" if "rose_cached" in runs else "rose_plan"
    # flags only: the first run's rate, else its second run's (on the caches the first left, the
    # option trial's decision cached: every interval after the compile is under the kept set)
    # (only after a first run that finished: one cut before its trial decided cached nothing)
    first_done = (runs.get("flags_only") or {}).get("returncode") == 0
    cached_flags = "flags_only_cached" in runs and first_done and not rate("flags_only")
    flags_from = "flags_only_cached" if cached_flags else "flags_only"
    flags_only, rose = rate(flags_from), rate(rose_from)
    rose_run = runs.get(rose_from) or {}
    entries = rose_run.get("plan_cache") or []  # the entry the run used (run_plan_entry)
    fields = plan_fields(entries[0] if entries else None, rose_run.get("returncode") == 0, rose_from in runs)
    speedup, met = _verdict(rose, peers, TARGETS[algo])
    return {
        "workload": name,
        "num_timesteps": steps,
        "peer_default_env_steps_per_s": peers.get("peer_default"),
        "peer_flags_env_steps_per_s": peers.get("peer_flags"),
        "flags_only_env_steps_per_s": flags_only,
        "rose_env_steps_per_s": rose,
        "rose_run": rose_from if rose_from in runs else None,
        "flags_only_run": flags_from if flags_from in runs else None,
        "speedup_vs_informed_peer": speedup,
        "speedup_vs_flags_only": round(rose / flags_only, 3) if rose and flags_only else None,
        "target": TARGETS[algo],
        "target_met": met,
        **fields,
        "interval_rates": {v: r.get("interval_rates") for v, r in runs.items()},
        "end_to_end_s": {v: r.get("end_to_end_s") for v, r in runs.items()},
        "errors": {v: r.get("error") for v, r in runs.items() if r.get("error")},
        "command": {v: r.get("command") for v, r in runs.items()},
        "_plan": (entries[0].get("plan") if entries else None) or [],  # for plan_profile (not written)
    }


def plan_fields(entry: dict[str, Any] | None, finished: bool, ran: bool) -> dict[str, Any]:
    """A row's plan columns from the plan-cache entry our run used (None: none known): the plan's
    labels (or why there is none: ``finished``, the run ended well; ``ran``, this call ran one),
    the option set, equality, the widest tolerance of its transforms, the learning check of a
    tolerance-kept one, and the search's time, speedup and candidates."""
    report = ((entry or {}).get("report")) or {}
    plan = ((entry or {}).get("plan")) or []
    kept = [c for c in report.get("candidates", []) if c.get("kept")]
    checks = [c["learning_check"] for c in kept if c.get("learning_check")]
    tol = [t.get("tolerance") or {} for t in plan]
    exact = {"rtol": 0.0, "atol": 0.0, "reason": "the program itself: nothing kept"}
    tolerance = max(tol, key=lambda t: (t.get("rtol", 0.0), t.get("atol", 0.0))) if tol else exact
    if not tol and not finished:
        tolerance = None
    if plan:
        labels = [t.get("label") for t in plan]
    elif finished:
        labels = ["baseline (no candidate kept)"]
    elif ran:
        labels = ["not known: the run did not finish"]
    else:
        labels = ["- (no --optimize run in this call)"]
    return {
        "plan": labels,
        # the XLA option set the search's baseline, every candidate and the run ran under (None: a
        # search before the baseline was timed under option sets)
        "base_options": (report.get("base_options") or {}).get("name"),
        # an empty plan runs the program itself; a kept plan was compared by the search
        "equal": (True if finished else None) if not plan else report.get("equal"),
        "max_abs_diff": report.get("max_abs_diff"),
        "tolerance": tolerance,
        "learning_check": checks[0] if len(checks) == 1 else (checks or None),
        "search_s": report.get("search_time_s"),
        "search_speedup_on_unit": report.get("speedup"),
        "candidates": [
            {k: c.get(k) for k in ("label", "stage", "speedup", "equal", "max_abs_diff", "kept", "reason")}
            for c in report.get("candidates", [])
        ],
    }


def fold_first_run(row: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """A cached run's row (``rose_cached`` and no ``rose`` in this call) with the whole wall time of
    the first, searching run that left its plan: the newest earlier row of the workload whose
    ``rose`` run finished with the same plan, named by its date (``first_run``; where that row is
    itself a cached run's, the first run it names). A first run split in two (``rose_plan``: the
    search alone, where search and training do not fit one call), in this row or an earlier one,
    counts as its search's wall time plus this cached run's (``first_run["split"]``). Pure; the row
    is returned unchanged when there is no such run. The first run is the one whose search left the
    plan the cached run read (the same ``search_s`` from the same plan-cache entry): the same plan
    label found by another search (another machine, an older search unit) is not its first run
    (2026-12-07 10:17: a 19:18 search of the day before was taken for it)."""
    e2e = row.get("end_to_end_s") or {}
    cached = e2e.get("rose_cached")
    if e2e.get("rose") is not None or cached is None:
        return row
    for r in [row, *reversed(earlier)]:
        r_e2e, errors = r.get("end_to_end_s") or {}, r.get("errors") or {}
        same = (
            r.get("workload") == row.get("workload")
            and r.get("plan") == row.get("plan")
            and r.get("num_timesteps") == row.get("num_timesteps")
            and _same_search(r, row)
        )
        if not same:
            continue
        # the call that ran it: a row that took our runs from another call (fold_rose) names it
        ran_in = (r.get("rose_from") or {}).get("date") or r.get("date")
        if r is not row and r_e2e.get("rose") is not None and "rose" not in errors:
            first = r_e2e["rose"]
            origin = r.get("first_run") or {
                "date": ran_in, "device": r.get("device"), "end_to_end_s": first,
                "search_s": r.get("search_s"), "command": (r.get("command") or {}).get("rose"),
            }
            return {**row, "end_to_end_s": {**e2e, "rose": first}, "first_run": origin}
        if r_e2e.get("rose_plan") is not None and "rose_plan" not in errors:
            first = round(r_e2e["rose_plan"] + cached, 2)
            origin = {
                "date": ran_in, "device": r.get("device"), "end_to_end_s": first,
                "search_s": r.get("search_s"), "command": (r.get("command") or {}).get("rose_plan"),
                "split": f"the search alone (rose_plan, {r_e2e['rose_plan']:.1f} s) plus this cached run "
                f"({cached:.1f} s)",
            }
            return {**row, "end_to_end_s": {**e2e, "rose": first}, "first_run": origin}
    return row


def _same_search(r: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether rows ``r`` and ``row`` read their plan from one search: its ``search_s`` (from the
    plan-cache entry both runs read) is the same (both None: neither read a search record)."""
    return r.get("search_s") == row.get("search_s")


# a machine is held at most 30 minutes (the device tool's lease), so two calls on one GPU (gpu_uuid)
# this close together ran on one warm machine
SAME_MACHINE_S = 30 * 60


def _minutes(date: str | None) -> float | None:
    """``"2026-12-06 19:02 UTC"`` (``common.machine_info``'s date) as minutes since the epoch."""
    try:
        t = datetime.datetime.strptime((date or "").removesuffix(" UTC"), "%Y-%m-%d %H:%M")
    except ValueError:
        return None
    return t.replace(tzinfo=datetime.timezone.utc).timestamp() / 60


def fold_peers(row: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """A row with our rate and a peer missing (a call too short for every run) takes the missing
    peers from earlier rows of the same workload and length on the same GPU (``gpu_uuid``) at most
    ``SAME_MACHINE_S`` before: the same warm machine, the device tool's rule for timings compared
    across calls. The newest call that ran every missing peer is taken; where none did (on an H100
    each of Brax's SAC runs of the published epochs fills a call), each peer from the newest call
    that ran it. The ratio and the target are then against the faster of the two, and
    ``peers_from`` names the call(s) (``peers``: each folded peer's call). Pure; the row is returned
    unchanged when a missing peer was not run on that machine (or the row ran both)."""
    missing = [v for v in PEERS if not row.get(f"{v}_env_steps_per_s")]
    if not row.get("rose_env_steps_per_s") or not missing:
        return row
    same = [r for r in reversed(earlier) if _same_hold(row, r)]  # newest first
    ran = _ran_peer_itself
    one = next((r for r in same if all(ran(r, v) for v in missing)), None)
    src = {v: one or next((r for r in same if ran(r, v)), None) for v in missing}
    if any(r is None for r in src.values()):
        return row
    rates = {v: row.get(f"{v}_env_steps_per_s") or src[v][f"{v}_env_steps_per_s"] for v in PEERS}
    speedup, met = _verdict(row["rose_env_steps_per_s"], rates, row["target"])
    calls = list({id(r): r for r in src.values()}.values())  # each source call once, in PEERS order
    return {
        **row,
        **{f"{v}_env_steps_per_s": rates[v] for v in PEERS},
        "speedup_vs_informed_peer": speedup,
        "target_met": met,
        **_borrowed_runs(row, src),
        "peers_from": {
            "date": ", ".join(r.get("date") or "-" for r in calls),
            "gpu_uuid": row.get("gpu_uuid"),
            "call_command": (
                calls[0].get("call_command") if len(calls) == 1 else [r.get("call_command") for r in calls]
            ),
            # which call each peer came from, where not both from one call
            **({"peers": {v: src[v].get("date") for v in missing}}
               if missing != list(PEERS) or len(calls) > 1 else {}),
        },
    }


def fold_all(
    row: dict[str, Any], accepted: list[dict[str, Any]], before: list[dict[str, Any]]
) -> dict[str, Any]:
    """Every fold of a new row, in order: our run from an earlier call of the hold where this call
    ran only peers (:func:`fold_rose`), the first run's wall time (:func:`fold_first_run`, from
    ``accepted``: the rows before this call), then the missing peers and the flags-only run from the
    hold's earlier calls (``before``: those rows and this call's earlier ones)."""
    return fold_flags_only(fold_peers(fold_first_run(fold_rose(row, before), accepted), before), before)


def _borrowed_runs(row: dict[str, Any], sources: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``row``'s per-run fields (rates between reports, wall time, command) with each variant of
    ``sources`` (``{variant: the earlier row that ran it}``) beside this call's runs."""
    return {
        key: {**(row.get(key) or {}), **{v: (r.get(key) or {}).get(v) for v, r in sources.items()}}
        for key in ("interval_rates", "end_to_end_s", "command")
    }


def _ran_peer_itself(r: dict[str, Any], v: str) -> bool:
    """Whether row ``r``'s call ran peer ``v`` itself (a rate it took from another call by
    :func:`fold_peers` does not count: that call may be outside this row's hold)."""
    folded = r.get("peers_from")
    if not r.get(f"{v}_env_steps_per_s"):
        return False
    return not folded or ("peers" in folded and v not in folded["peers"])


def _same_hold(row: dict[str, Any], r: dict[str, Any]) -> bool:
    """``r`` is an earlier call of ``row``'s workload and length on the same GPU (``gpu_uuid``)
    at most ``SAME_MACHINE_S`` before: the same warm machine."""
    when, gpu, t = _minutes(row.get("date")), row.get("gpu_uuid"), _minutes(r.get("date"))
    return (
        bool(gpu) and when is not None and t is not None
        and r.get("workload") == row.get("workload")
        and r.get("num_timesteps") == row.get("num_timesteps")
        and r.get("gpu_uuid") == gpu
        # the same machine where both rows name it (rows before 2026-12-07 11:00 UTC do not)
        and (r.get("host") is None or row.get("host") is None or r.get("host") == row.get("host"))
        and 0 <= (when - t) * 60 <= SAME_MACHINE_S
    )


def fold_flags_only(row: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """A row with our ``--optimize`` rate but no flags-only run (on an H100 a SAC run of the
    published epochs fills a call by itself) takes the flags-only rate from the newest earlier call
    of the same workload and length on the same GPU within the machine's hold, as
    :func:`fold_peers` takes the peers: ``speedup_vs_flags_only`` is then against it and
    ``flags_only_from`` names that call. Pure; the row is returned unchanged when there is no such
    call (or it ran flags only itself)."""
    if not row.get("rose_env_steps_per_s") or row.get("flags_only_env_steps_per_s"):
        return row
    for r in reversed(earlier):
        rate, run = r.get("flags_only_env_steps_per_s"), r.get("flags_only_run") or "flags_only"
        if not rate or r.get("flags_only_from") or not _same_hold(row, r):  # only a call that ran it
            continue
        return {
            **row,
            "flags_only_env_steps_per_s": rate,
            "flags_only_run": run,
            "speedup_vs_flags_only": round(row["rose_env_steps_per_s"] / rate, 3),
            **_borrowed_runs(row, {run: r}),
            "flags_only_from": {"date": r.get("date"), "gpu_uuid": row.get("gpu_uuid"),
                                "call_command": r.get("call_command")},
        }
    return row


# what a row says about our --optimize run (its rate, plan and search), taken together by fold_rose
ROSE_FIELDS = (
    "rose_env_steps_per_s", "rose_run", "plan", "base_options", "equal", "max_abs_diff", "tolerance",
    "learning_check", "search_s", "search_speedup_on_unit", "candidates", "first_run", "profile",
)
ROSE_RUNS = ("rose_plan", "rose", "rose_cached")


def fold_rose(row: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """A row whose call ran a peer but no ``--optimize`` run takes ours (its rate, plan, search,
    first run and per-run fields) from the newest earlier call of the same workload and length on
    the same GPU within the machine's hold that ran it itself, so that the last call of a hold
    carries every column also where our run had to come first (SAC on an H100: the plan's search,
    then the cached run, then each of Brax's runs, each filling a call; 2026-12-07 10:12-10:32).
    The ratio and the target are then recomputed against this row's peers (and :func:`fold_peers`
    adds the peers it lacks); ``rose_from`` names that call. Pure; the row is returned unchanged
    when it has our rate already, ran no peer, or the machine ran no such call."""
    ran_ours = row.get("rose_run") is not None or any(
        v in (row.get("end_to_end_s") or {}) or v in (row.get("errors") or {}) for v in ROSE_RUNS)
    if ran_ours or not any(_ran_peer_itself(row, v) for v in PEERS):  # (a failed run of ours is ours too)
        return row
    for r in reversed(earlier):
        if not r.get("rose_env_steps_per_s") or r.get("rose_from") or not _same_hold(row, r):
            continue
        rose = r["rose_env_steps_per_s"]
        speedup, met = _verdict(rose, {v: row.get(f"{v}_env_steps_per_s") for v in PEERS}, row["target"])
        flags = row.get("flags_only_env_steps_per_s")
        runs = [v for v in ROSE_RUNS if (r.get("end_to_end_s") or {}).get(v) is not None]
        failed = {v: e for v, e in (r.get("errors") or {}).items() if v in ROSE_RUNS}
        return {
            **row,
            **{k: r.get(k) for k in ROSE_FIELDS if k in r},
            "speedup_vs_informed_peer": speedup,
            "target_met": met,
            "speedup_vs_flags_only": round(rose / flags, 3) if flags else None,
            **_borrowed_runs(row, {v: r for v in runs}),
            # a borrowed run that failed stays failed (fold_first_run refuses a cut search)
            "errors": {**(row.get("errors") or {}), **failed},
            "rose_from": {"date": r.get("date"), "gpu_uuid": row.get("gpu_uuid"),
                          "call_command": r.get("call_command")},
        }
    return row


def plan_on(tree, plan: list[dict[str, Any]]) -> tuple[list[Any], list[str]]:
    """``(the plan's transforms legal on the program traced as tree, "label: why not" for the
    others)``: a transform of the search's unit that the program lacks (the offloaded evaluation:
    the unit evaluates, one training iteration does not) is left out and named, so a profile of the
    program runs what of the plan runs on this GPU each iteration."""
    from rose_jax.optimize.registry import transform_by_name

    ts = [transform_by_name(t["name"], t.get("params") or {}) for t in plan]
    legal = [(t, *t.legal(tree)) for t in ts]
    return [t for t, ok, _ in legal if ok], [f"{t.label}: {why[:100]}" for t, ok, why in legal if not ok]


def plan_profile(
    name: str,
    args,
    plan: list[dict[str, Any]],
    base_options: str | None = None,
    memo: dict | None = None,
) -> dict[str, Any]:
    """Where the optimized program's time goes: the plan's transforms (from the plan cache) applied
    to one iteration (those legal on it; the plan was found on ``train``'s unit, and the others are
    named), compiled under the option set the plan's search ran under (``base_options``, the row's;
    else ``args.options``; on a CPU none), its unprofiled seconds per iteration (``args.blocks``
    blocks) and its kernel trace (:func:`kernel_profile`), and the floor that trace names.
    ``memo``: traces by (workload, transforms applied, option set), so two plans that leave the same
    program on one iteration (an offload not in it, and no candidate) are traced once."""
    import jax

    from rose_jax.optimize import search, xla_options

    from rose_jax import trace as rtrace

    options_name = base_options if base_options in xla_options.SETS else args.options
    options = xla_options.SETS[options_name] if jax.default_backend() == "gpu" else {}
    job, fn, state0, env_steps, _ = build(name, args.smoke)
    tree = rtrace.trace(fn, state0, arg_names=["state"])  # for the plan's legality and the chains
    program, apply = f"one iteration under {options_name}", []
    if plan:
        try:
            apply, skipped = plan_on(tree, plan)
            note = f"; not on one iteration: {'; '.join(skipped)}" if skipped else ""
            if apply:
                labels = ", ".join(t.label for t in apply)
                program = f"one iteration with the plan ({labels}) under {options_name}{note}"
            else:
                program += f" (no transform of the plan applies to one iteration{note})"
        except Exception as e:  # noqa: BLE001 - the plan may not apply to one iteration: say so
            program += f" (the plan did not apply to one iteration: {type(e).__name__}: {str(e)[:120]})"
            apply = []
    key = (name, tuple(t.label for t in apply), options_name)
    if memo is not None and key in memo:
        return {**memo[key], "program": program}
    step = None
    if apply:
        try:
            host = any(t.level == "host" for t in apply)
            step = search.compile_step(
                search.apply_plan(fn, apply), host=host, compiler_options=options or None
            )
        except Exception as e:  # noqa: BLE001 - the plan may not apply to one iteration: say so
            why = f"{type(e).__name__}: {str(e)[:120]}"
            program = f"one iteration under {options_name} (the plan did not apply to one iteration: {why})"
            key = (name, (), options_name)
    if step is None:
        step, _ = _compile(fn, state0, options)
    state, _ = _block(step, state0, 2)
    per = []
    for _ in range(args.blocks):
        state, s = _block(step, state, args.calls)
        per.append(s)
    state, prof = kernel_profile(step, state, args.profile_calls)
    ms = statistics.median(per) * 1e3
    prof.update(program=program, ms_per_iteration=round(ms, 3), env_steps_per_s=env_steps / (ms / 1e3))
    prof["chains"] = hottest_chains(tree)
    prof["floor"] = floor_of(prof)
    if memo is not None:
        memo[key] = prof
    return prof


def hottest_chains(tree, n: int = 2) -> list[dict[str, Any]]:
    """The ``n`` hottest loops of the program traced as ``tree`` (by flops) with their body's
    longest dependency chain (:mod:`rose_jax.trace.depth`): where a loop is latency-bound, its floor."""
    from rose_jax.trace import depth

    return [{"loop": path, "trips": trips, **c._asdict(), "describe": c.describe()}
            for path, trips, c in depth.loop_chains(tree)[:n]]


def floor_of(prof: dict[str, Any]) -> str:
    """The floor a kernel trace names: kernel time where the GPU is busy most of the unprofiled
    iteration, else the launches and the gaps between kernels."""
    if not prof.get("available"):
        return f"not traced ({prof.get('reason')})"
    ms, busy = prof.get("ms_per_iteration"), prof["busy_ms_per_iteration"]
    kernels = prof["kernels_per_iteration"]
    share = busy / ms if ms else None
    tops = list(prof.get("top_kernels_ms_per_iteration", {}).items())[:3]
    top = ", ".join(f"{k} {v:.1f} ms" for k, v in tops)
    if share is not None and share >= 0.8:
        return f"kernel time: the GPU is busy {busy:.1f} of {ms:.1f} ms per iteration; largest: {top}"
    idle = sorted(
        ((c, r["idle_ms"]) for c, r in (prof.get("by_component") or {}).items() if r.get("idle_ms")),
        key=lambda cr: -cr[1],
    )
    where = "; idle under the tracer: " + ", ".join(f"{c} {v:.1f} ms" for c, v in idle[:3]) if idle else ""
    chains = prof.get("chains") or []
    if chains:  # the hottest loop's dependency chain: what no fusion or overlap beside it can shorten
        c = chains[0]
        trips = f" x{c['trips']}" if c.get("trips") else ""
        where += f"; the hottest loop ({c['loop']}{trips}) runs {c['describe']} per trip"
    return (
        f"launches and gaps: the GPU is busy {busy:.1f} of {ms:.1f} ms per iteration{where} "
        f"({kernels:,.0f} kernels, median {prof['median_kernel_us']} us, median gap "
        f"{prof.get('median_gap_us')} us under the tracer); fewer, larger kernels or a shorter "
        "chain of dependent ones would move it, not faster kernels"
    )


def learning_check_fields(job, t, steps: int) -> dict[str, Any]:
    """``{"learning_check": ...}`` for a transform whose tolerance asks for one (trained here: 5
    seeds per side of ``steps`` env steps), ``{}`` for one that does not; a failed check's error is
    recorded, never raised."""
    if t is None or not t.tolerance.learning_check:
        return {}
    from algos import equivalence

    try:
        verdict = equivalence.checker(job.config, job.env, steps=steps)(t)
        common.log(f"learning check {t.label}: {verdict.reason}")
        return {"learning_check": verdict.to_json()}
    except Exception as e:  # noqa: BLE001 - one check's failure is a row's note, not the run's end
        return {"learning_check": {"passed": None, "reason": f"failed: {type(e).__name__}: {e}"[:300]}}


def _learning_cell(check: dict | None) -> str:
    if not check:
        return "-"
    if check.get("passed") is None:
        return f"not run ({check.get('reason')})"
    word = "passed" if check["passed"] else "failed"
    means = f"{check['mean_reference']:.1f} vs {check['mean_candidate']:.1f}"
    return f"{word}: p={check['p_value']:.2f}, means {means}"


def write(
    out: str,
    rows: list[dict[str, Any]],
    command: str,
    acceptance: list[dict[str, Any]] | None = None,
    jax_devices: bool = True,
    machine: dict[str, Any] | None = None,
) -> None:
    """``jax_devices=False`` while child processes still need the GPU (no CUDA context here);
    ``machine``: the last call's machine record (when files are rewritten from stored results)."""
    os.makedirs(out, exist_ok=True)
    info = machine or common.machine_info(jax_devices=jax_devices)
    atomic_write_json(
        os.path.join(out, "results.json"),
        {"machine": info, "command": command, "rows": rows, "acceptance": list(acceptance or [])},
    )
    lines = [
        "# Beyond the flag: restructurings vs the best XLA options alone (issue 32)",
        "",
        *acceptance_lines(acceptance or []),
        f"Each row names its call (date and device). The last call: {info.get('date')} on "
        f"{info.get('gpu') or info.get('platform')}, `{command}`.",
        "Same process, same option set for every variant; steady seconds per iteration = median of "
        "the timed blocks (taken in turns); equality: `equality_iterations` iterations from the same "
        "state under deterministic ops vs flags_only. Generated by `benchmarks/experiments/beyond_flags.py`.",
        "",
        common.markdown_table(
            [
                "workload",
                "call",
                "variant",
                "env-steps/s (median, min-max)",
                "vs flags_only",
                "compile s",
                "equal",
                "max abs diff",
                "learning check",
                "kernels/iter, busy share, median kernel us",
                "what moved",
            ],
            [
                [
                    r["workload"],
                    (r.get("call") or "-") + (f" ({_short_device(r['device'])})" if r.get("device") else ""),
                    r["variant"],
                    f"{common.fmt(r.get('env_steps_per_s'), ',.0f')} ("
                    + "-".join(
                        common.fmt(x, ",.0f") for x in (r.get("spread_env_steps_per_s") or [None, None])
                    )
                    + ")",
                    common.fmt(r.get("speedup_vs_flags_only"), ".3f"),
                    common.fmt(r.get("compile_s")),
                    common.fmt_equal(r.get("equal")),
                    common.fmt(r.get("max_abs_diff"), ".2e"),
                    _learning_cell(r.get("learning_check")),
                    _profile_cell(r.get("profile")),
                    (r.get("legal") or "-")[:160],
                ]
                for r in rows
            ],
        ),
    ]
    common.write_markdown_and_plot(out, lines, _plot, rows, acceptance or [])


def _spread(xs: list[float], fmt: str) -> str:
    """``"1.480"`` for one value, ``"1.697 (1.697-1.735)"`` (median, min-max) for several."""
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:{fmt}}" if len(xs) == 1 else f"{med:{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def _wall(r: dict[str, Any], v: str) -> float | None:
    """Run ``v``'s whole wall time in row ``r`` (None where it did not run)."""
    return (r.get("end_to_end_s") or {}).get(v)


def _informed_peer_s(r: dict[str, Any]) -> float | None:
    """The wall time of the row's faster Brax run (the informed peer)."""
    return _wall(r, max(PEERS, key=lambda v: r.get(f"{v}_env_steps_per_s") or 0))


def standing(acc: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where each workload stands, per run length, GPU model and plan: its complete rows (both peers and
    our rate, from one call or folded from one warm machine's calls) counted once per run of ours
    (rows that fold the same run, named by the call that ran it, count as one: the newest), with
    the ratios' median and range, how many met the target, and the wall times of the informed peer
    (the faster Brax run of each row), our cached run and our first run. A workload with no
    complete row shows its ratios against one peer and says so."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in acc:
        if r.get("error") or r.get("partial") or not r.get("rose_env_steps_per_s"):
            continue
        plan = "; ".join(r.get("plan") or []) or "-"
        key = (r["workload"], r.get("num_timesteps"), _short_device(r.get("device") or "-"), plan)
        groups.setdefault(key, []).append(r)
    out = []
    for (name, steps, gpu, plan), rows in groups.items():
        ours: dict[str, dict[str, Any]] = {}
        for r in rows:  # newest last: the last row of a run of ours is its most complete
            ours[((r.get("rose_from") or {}).get("date") or r.get("date"), r.get("gpu_uuid"))] = r
        complete = [r for r in ours.values() if all(r.get(f"{v}_env_steps_per_s") for v in PEERS)]
        partial = [r for r in ours.values() if r not in complete and r.get("speedup_vs_informed_peer")]
        ratios = [r["speedup_vs_informed_peer"] for r in complete]
        met = sum(bool(r.get("target_met")) for r in complete)
        # a miss against one peer is a miss (the other can only be faster): _verdict says so
        out.append({
            "workload": name, "num_timesteps": steps, "device": gpu, "plan": plan,
            "target": rows[-1].get("target"),
            "runs": len(complete), "ratios": ratios, "met": met,
            "partial": sorted(r["speedup_vs_informed_peer"] for r in partial),
            "partial_misses": sum(r.get("target_met") is False for r in partial),
            "rose": [r["rose_env_steps_per_s"] for r in complete],
            "peer_s": [x for x in map(_informed_peer_s, complete) if x is not None],
            "cached_s": [x for r in complete if (x := _wall(r, "rose_cached")) is not None],
            "first_s": sorted({x for r in complete if (x := _wall(r, "rose")) is not None}),
            "dates": [r.get("date") for r in complete],
        })
    return out


def standing_lines(acc: list[dict[str, Any]]) -> list[str]:
    """The standing as a table: per workload and GPU model, the complete rows' ratios (median and
    range over runs of ours), the target's verdict, and the wall times."""
    st = standing(acc)
    if not st:
        return []

    def verdict(x):
        # a miss against one peer is a miss against the faster one too: it counts; a ratio over one
        # peer that clears the target establishes nothing (the other peer may be faster)
        part, one = x["partial"], x["partial_misses"]
        span = (f"{part[0]:.3f}" + (f"-{part[-1]:.3f}" if len(part) > 1 else "")) if part else ""
        misses, of = x["runs"] - x["met"] + one, x["runs"] + one
        if misses:
            return f"missed in {misses} of {of}" + (f" ({one} against one peer only: {span})" if one else "")
        if x["runs"]:
            return f"met in {x['runs']} of {x['runs']}"
        return "not established" + (f" (vs one peer only: {span})" if part else "")

    body = [[x["workload"], f"{x['num_timesteps']:,}" if x["num_timesteps"] else "-", x["device"],
             x["plan"], f"{x['target']}x", str(x["runs"]), _spread(x["ratios"], ".3f"),
             verdict(x), _spread(x["rose"], ",.0f"), _spread(x["peer_s"], ".0f"),
             _spread(x["cached_s"], ".0f"), _spread(x["first_s"], ".0f")] for x in st]
    return [
        "### Where each workload stands",
        "",
        "Per workload, run length, GPU model and plan, from the rows below that have both peers and our rate "
        "(one device call, or one warm machine's calls folded together), by the plan our run trained "
        "with; each run of ours counted once. Ratio: over "
        "the faster peer, median (min-max) over those runs; wall times: the faster peer's whole run, our "
        "cached `--optimize` run, and our first run (its search included).",
        "",
        common.markdown_table(
            ["workload", "steps", "GPU", "plan", "target", "runs", "vs informed peer", "verdict",
             "rose env-steps/s", "peer s", "cached run s", "first run s"],
            body,
        ),
        "",
    ]


def acceptance_lines(acc: list[dict[str, Any]]) -> list[str]:
    """Issue 32's table (``--acceptance`` rows), newest last, and each row's floor."""
    if not acc:
        return []
    lines = [
        "## Issue 32's table: against the informed peer, through `rose-jax train --optimize`",
        "",
        *standing_lines(acc),
        "### Every call",
        "",
        "Every number of a row comes from one device call (its `date`), or from an earlier call on the "
        "same warm machine (same GPU, same hold) where the notes below the table say so. "
        "Peer = Brax's own trainer with "
        "Brax's published keywords, as shipped and with `XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode"
        "=CONCURRENT`; flags only = `rose-jax train` (its option trial: our program with the best options "
        "alone; flags_only_cached: the same command again on the caches it left, its trial's decision "
        "cached, its rate the column where the first run's trial leaves fewer than 3 intervals); rose = "
        "`rose-jax train --optimize` on empty caches (the plan `rose_jax.optimize.optimize` "
        "finds with default candidate generation; rose_cached: the same command again on the plan cache "
        "that run left, its rate then the rose column, and the first run's wall time from its own call). "
        "Whole runs, each its own process; steady env-steps/s = "
        "median rate between progress reports after the compiles (Brax: after its first two epochs). "
        f"Targets: SAC >= {TARGETS['sac']}x, PPO >= {TARGETS['ppo']}x over the faster peer.",
        "",
        common.markdown_table(
            [
                "workload",
                "date (device)",
                "steps",
                "peer default",
                "peer flags",
                "flags only",
                "rose",
                "vs informed peer",
                "vs flags only",
                "target met",
                "plan",
                "equal",
                "tolerance",
                "learning check",
                "search s",
                "end to end s",
            ],
            [
                [
                    r["workload"] + (" (partial: the call ended first)" if r.get("partial") else ""),
                    f"{r.get('date') or '-'} ({_short_device(r.get('device') or '-')})",
                    common.fmt(r.get("num_timesteps"), ",.0f"),
                    common.fmt(r.get("peer_default_env_steps_per_s"), ",.0f"),
                    common.fmt(r.get("peer_flags_env_steps_per_s"), ",.0f"),
                    common.fmt(r.get("flags_only_env_steps_per_s"), ",.0f"),
                    common.fmt(r.get("rose_env_steps_per_s"), ",.0f"),
                    vs_peer_cell(r),
                    common.fmt(r.get("speedup_vs_flags_only"), ".3f"),
                    "-" if r.get("target_met") is None else ("yes" if r["target_met"] else "no (miss)"),
                    ("; ".join(r.get("plan") or []) or r.get("error", "-"))
                    + (f" (under {r['base_options']})" if r.get("base_options") else ""),
                    common.fmt_equal(r.get("equal")),
                    f"rtol {r['tolerance'].get('rtol')}" if r.get("tolerance") else "-",
                    _learning_cell(r["learning_check"]) if isinstance(r.get("learning_check"), dict) else "-",
                    common.fmt(r.get("search_s")),
                    end_to_end_cell(r),
                ]
                for r in acc
            ],
        ),
        "",
    ]
    for r in acc:
        prof = r.get("profile") or {}
        if prof:
            later = prof.get("traced") or {}
            when = f" (traced later, {later.get('date')}, same GPU model)" if later else ""
            lines.append(f"- {r['workload']} ({r.get('date')}): profiled{when} {prof.get('program', '-')}: "
                         f"{prof.get('floor') or prof.get('reason')}.")
        if r.get("errors"):
            lines.append(f"- {r['workload']} ({r.get('date')}): errors: {r['errors']}")
        if r.get("first_run"):
            f = r["first_run"]
            lines.append(
                f"- {r['workload']} ({r.get('date')}): the rose column is the cached run (plan cache from "
                f"the first run of {f.get('date')} on {_short_device(f.get('device') or '-')}: "
                f"{common.fmt(f.get('end_to_end_s'))} s end to end, search {common.fmt(f.get('search_s'))} s"
                + (f"; split in two: {f['split']})" if f.get("split") else ")")
            )
        if r.get("peers_from"):
            folded = r["peers_from"].get("peers")
            where = (
                "; ".join(f"{PEER_NAMES.get(v, v)} ran in the call of {d}" for v, d in folded.items())
                if folded else f"both peers ran in the call of {r['peers_from'].get('date')}"
            )
            lines.append(
                f"- {r['workload']} ({r.get('date')}): {where} on the same warm machine (same GPU, "
                "same hold), this call's runs after them"
            )
        if r.get("rose_from"):
            lines.append(
                f"- {r['workload']} ({r.get('date')}): the rose column (our `--optimize` run) ran in the "
                f"call of {r['rose_from'].get('date')} on the same warm machine (same GPU, same hold), "
                "before this call's peer"
            )
        if r.get("flags_only_from"):
            lines.append(
                f"- {r['workload']} ({r.get('date')}): the flags-only column ran in the call of "
                f"{r['flags_only_from'].get('date')} on the same warm machine (same GPU, same hold)"
            )
        if r.get("flags_only_run") == "flags_only_cached" and r.get("flags_only_env_steps_per_s"):
            lines.append(
                f"- {r['workload']} ({r.get('date')}): the flags-only column is `rose-jax train`'s second "
                "run (flags_only_cached: on the caches the first left, its option trial's decision cached)"
            )
        if r.get("note"):
            lines.append(f"- {r['workload']} ({r.get('date')}): {r['note']}")
    return lines + ["", "## Variants of one iteration, same options (in-process)", ""]


def vs_peer_cell(row: dict[str, Any], fmt: str = ".3f", unit: str = "", missing: str = "-") -> str:
    """The ratio over the faster peer of the row's call, ``"1.503 (vs Brax as shipped only)"`` where
    the call ran one of the two peers (the other, measured elsewhere, may be the faster one: the
    ratio is then not against the informed peer); ``missing`` without a ratio."""
    v = row.get("speedup_vs_informed_peer")
    if v is None:
        return missing
    shipped, flag = row.get("peer_default_env_steps_per_s"), row.get("peer_flags_env_steps_per_s")
    only = "" if shipped and flag else (" (vs Brax as shipped only)" if shipped else " (vs Brax + flag only)")
    return f"{v:{fmt}}{unit}{only}"


def end_to_end_cell(row: dict[str, Any]) -> str:
    """Each run's whole wall time (compile, trial and search included), ``"peer_flags 144 / rose
    395"``; ``"-"`` where none finished."""
    e2e, failed = row.get("end_to_end_s") or {}, row.get("errors") or {}
    done = [v for v in RUN_ORDER if e2e.get(v) is not None and v not in failed]
    return " / ".join(f"{v} {e2e[v]:.0f}" for v in done) or "-"


def _short_device(device: str) -> str:
    """``'NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB'`` -> ``'H100'``."""
    for name in ("H200", "H100", "A100", "L4"):
        if name in device:
            return name
    return device.split(",")[0][:24]


def _profile_cell(p: dict | None) -> str:
    if not p:
        return "-"
    if not p.get("available"):
        return f"not traced ({p.get('reason')})"
    cell = (
        f"{p['kernels_per_iteration']:,.0f}, {common.fmt(p.get('busy_share_of_span'), '.2f')}, "
        f"{p['median_kernel_us']}"
    )
    split = p.get("by_component") or {}
    if split:
        cell += "; " + ", ".join(
            f"{c}: {r['kernels']:,.0f} kernels {r['kernel_ms']:.1f} ms"
            + (f", idle {r['idle_ms']:.1f} ms" if r.get("idle_ms") is not None else "")
            for c, r in list(split.items())[:3]
        )
    return cell


ACCEPTANCE_BARS = (
    ("peer_default_env_steps_per_s", "Brax as shipped"),
    ("peer_flags_env_steps_per_s", "Brax + flag"),
    ("flags_only_env_steps_per_s", "rose-jax train"),
    ("rose_env_steps_per_s", "rose-jax train --optimize"),
)


def _plot(rows, acceptance, path):  # pragma: no cover - drawing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # issue 32's table: each acceptance row holding a peer and our rate, its four steady rates side by side
    acc = [r for r in acceptance if r.get("rose_env_steps_per_s") and r.get("speedup_vs_informed_peer")]
    fig, axes = plt.subplots(1 + bool(acc), 1, figsize=(9, 3.5 * (1 + bool(acc))), squeeze=False)
    if acc:
        ax = axes[0][0]
        width = 0.8 / len(ACCEPTANCE_BARS)
        for i, (key, label) in enumerate(ACCEPTANCE_BARS):
            vals = [r.get(key) or 0.0 for r in acc]
            ax.bar([j + i * width for j in range(len(acc))], vals, width, label=label)
        names = [f"{r['workload']} {r['num_timesteps'] / 1e6:g}M\n{r['date'][5:16]}" for r in acc]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(acc))], names, fontsize=7)
        ax.set_ylabel("steady env-steps/s")
        ax.set_title("against the informed peer: whole runs, each in its own process")
        ax.legend(fontsize=7)
    ax = axes[-1][0]
    shown = [r for r in rows if r.get("speedup_vs_flags_only") and r.get("variant") != "flags_only"]
    names = [f"{r['workload']} {r['variant']}"[:40] for r in shown]
    vals = [r["speedup_vs_flags_only"] for r in shown]
    ax.bar(range(len(vals)), vals, color=["tab:green" if v > 1 else "tab:gray" for v in vals])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(vals)), names, fontsize=5, rotation=90)
    ax.set_ylabel("speedup vs flags only")
    ax.set_title("one iteration in-process: each restructuring under the same options as flags only")
    fig.tight_layout()
    common.save_plot(fig, path)


def _public(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "_plan"} for r in rows]


def run_acceptance(args, names: list[str], rows: list[dict], accepted: list[dict], command: str) -> int:
    """``--acceptance``: every workload's runs (child processes), then, with ``--profile``, each
    plan's iteration traced in this process (the GPU is this process's only after the runs)."""
    new: list[dict] = []
    last: dict[str, dict] = {}  # each workload's row so far (kept with the error if a run raises)

    def stamp(row: dict) -> dict:
        info = common.machine_info(jax_devices=False)
        row.update(date=info.get("date"), device=info.get("gpu") or info.get("platform"))
        row["gpu_uuid"] = info.get("gpu_uuid")  # which physical GPU (calls on one warm machine share it)
        row["host"] = info.get("hostname")  # which machine: a fresh one may get the same GPU
        row["call_command"] = command
        return row

    def progress(row: dict) -> None:
        last[row["workload"]] = stamp(row)
        write(args.out, rows, command, accepted + _public(new + [row]), jax_devices=False)

    for n in names:
        try:
            row = acceptance(n, args, progress)
        except Exception as e:  # noqa: BLE001 - a workload's failure is a row, the rest go on
            common.log(f"{n}: acceptance failed: {type(e).__name__}: {e}")
            row = {**last.get(n, {"workload": n}), "error": f"{type(e).__name__}: {e}"[:300]}
        # stamped first: a split in this call names its date, and the peers' call is found by GPU and date
        before = accepted + _public(new)
        new.append(fold_all(stamp(row), accepted, before))
        write(args.out, rows, command, accepted + _public(new), jax_devices=False)
    if args.profile:
        for row in new:
            if "error" in row or row.get("rose_from"):  # a borrowed run keeps its own call's profile
                continue
            try:
                plan = row.get("_plan") or []
                row["profile"] = plan_profile(row["workload"], args, plan, row.get("base_options"))
            except Exception as e:  # noqa: BLE001 - a failed trace is a note, never lost rows
                row["profile"] = {"available": False, "reason": f"{type(e).__name__}: {e}"[:300]}
            write(args.out, rows, command, accepted + _public(new))
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


def plan_entries(cache_dir: str | None, copies_dir: str) -> list[tuple[str, dict]]:
    """``(key, entry)`` of every plan entry in the plan cache ``cache_dir`` (its ``plans.json``)
    and in the committed copies under ``copies_dir`` (``benchmarks/results/beyond_flags/plans/``,
    each ``{key: entry}``); a copy that does not parse is skipped (a copy is not the run's record)."""
    import glob

    out = list(_plan_cache(cache_dir).items()) if cache_dir else []
    for path in sorted(glob.glob(os.path.join(copies_dir, "*.json"))):
        try:
            out += list(_plan_file(path).items())
        except (OSError, ValueError):
            continue
    return out


def plan_for_row(row: dict[str, Any], entries: list[tuple[str, dict]]) -> list[dict] | None:
    """The plan (transform records) a row's run trained with, from plan-cache entries: ``[]`` for
    a row whose search kept no candidate, else an entry of the row's environment and GPU model
    (its key: ``digest|env|envs|GPU model|jax...``) whose plan has the row's labels; ``None`` where
    none matches (the row's plan is then not known here)."""
    from benchmarks.experiments import informed_peer

    labels = list(row.get("plan") or [])
    if not labels or labels == ["baseline (no candidate kept)"]:
        return []
    env = (informed_peer.workloads().get(row.get("workload")) or {}).get("env")
    for key, e in entries:
        parts = key.split("|")
        if len(parts) < 4 or parts[1] != env or parts[3] not in (row.get("device") or ""):
            continue
        if [t.get("label") for t in e["plan"]] == labels:
            return list(e["plan"])
    return None


def missed_to_profile(
    accepted: list[dict[str, Any]], names: list[str], gpu_model: str, entries: list[tuple[str, dict]]
) -> tuple[list[tuple[str, list[dict], str | None, list[int]]], list[str]]:
    """The missed rows (``target_met`` False) of workloads ``names`` whose profile is missing or
    failed, measured on ``gpu_model`` (a profile is of the GPU model the row ran on), grouped by
    workload, plan and option set (one trace each), newest row's group first:
    ``([(workload, plan, base options, row indices)], "date workload: why skipped")``."""
    groups: dict[tuple, tuple[str, list[dict], str | None, list[int]]] = {}
    skipped: list[str] = []
    for i in sorted(range(len(accepted)), key=lambda i: accepted[i].get("date") or "", reverse=True):
        r = accepted[i]
        if r.get("workload") not in names or r.get("target_met") is not False:
            continue
        if (r.get("profile") or {}).get("available"):
            continue
        what = f"{r.get('date')} {r.get('workload')}"
        if not gpu_model or gpu_model not in (r.get("device") or ""):
            on = (r.get("device") or "?").split(",")[0]
            skipped.append(f"{what}: measured on {on}, not this {gpu_model or 'GPU'}")
            continue
        plan = plan_for_row(r, entries)
        if plan is None:
            skipped.append(f"{what}: no plan-cache entry of its GPU model has its plan {r.get('plan')}")
            continue
        key = (r["workload"], json.dumps(plan, sort_keys=True), r.get("base_options"))
        groups.setdefault(key, (r["workload"], plan, r.get("base_options"), []))[3].append(i)
    return list(groups.values()), skipped


def profile_missed(args, names: list[str], rows: list[dict], accepted: list[dict], command: str) -> int:
    """``--acceptance --profile-missed``: no runs; each missed row's plan (from ``--plan-cache`` and
    the committed plan copies) traced on this GPU, one iteration per group of rows
    (:func:`missed_to_profile`, :func:`plan_profile`), the profile marked as traced in this later
    call; rows are written after each trace, so a call cut short keeps the traces it finished."""
    import jax

    model = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else ""
    entries = plan_entries(args.plan_cache, os.path.join(OUT_DIR, "plans"))
    todo, skipped = missed_to_profile(accepted, names, model, entries)
    for s in skipped:
        common.log(f"not profiled: {s}")
    info = common.machine_info(jax_devices=False)
    memo: dict = {}  # one trace per program (two plans may leave the same one on an iteration)
    for workload, plan, base, idx in todo:
        common.log(f"{workload}: tracing the plan of {len(idx)} missed row(s)")
        try:
            prof = plan_profile(workload, args, plan, base, memo)
        except Exception as e:  # noqa: BLE001 - one failed trace is that row's note, never the others'
            prof = {"available": False, "reason": f"{type(e).__name__}: {e}"[:300]}
        prof["traced"] = {"date": info.get("date"), "gpu_uuid": info.get("gpu_uuid"), "call_command": command,
                          "why": "a later call: the row's plan, from the plan cache, on the same GPU model"}
        for i in idx:
            accepted[i] = {**accepted[i], "profile": prof}
        write(args.out, rows, command, accepted)
    common.log(f"profiled {sum(len(g[3]) for g in todo)} missed row(s) in {len(todo)} trace(s); "
               f"{len(skipped)} left as they were")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="sac-hopper,ppo-ant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--options", default="concurrent_scheduling", help="a name of xla_options.SETS")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="iterations per timed block")
    p.add_argument(
        "--check-equal", default="hoist", help="comma-separated variants whose equality is checked"
    )
    p.add_argument("--profile", action="store_true", help="kernel trace of each variant (GPU)")
    p.add_argument("--profile-calls", type=int, default=3)
    p.add_argument("--equal-iters", type=int, default=1, help="iterations compared (stepwise: 1)")
    p.add_argument(
        "--learning-check-steps",
        type=int,
        default=0,
        metavar="N",
        help="env steps per seed of the learning check for variants whose tolerance asks for one (0: none)",
    )
    p.add_argument(
        "--acceptance",
        action="store_true",
        help="issue 32's table: Brax's trainer, rose-jax train (flags only) and rose-jax train --optimize, "
        "whole runs in their own processes, then (with --profile) the plan's iteration traced",
    )
    p.add_argument(
        "--profile-missed",
        action="store_true",
        help="with --acceptance --merge: no runs; the plan of each missed row of --workloads whose profile "
        "is missing or failed, traced on this GPU (rows of its GPU model; plans from --plan-cache and "
        "the committed copies in plans/)",
    )
    p.add_argument("--peer-variants", default="peer_default,peer_flags", help="with --acceptance")
    p.add_argument(
        "--rose-variants",
        default="flags_only,rose",
        help="with --acceptance: flags_only (rose-jax train), flags_only_cached (the same again on the "
        "caches flags_only left: its option trial's decision cached), rose (rose-jax train --optimize) "
        "rose_plan (rose-jax train --optimize --plan-only: the search alone, its plan into --plan-cache) "
        "and/or rose_cached (the same again on --plan-cache's plan)",
    )
    p.add_argument(
        "--acceptance-steps",
        type=float,
        default=None,
        help="env steps per run (default: the workload's own, e.g. sac-hopper-5ep's 5 published "
        "epochs; else sac 100k, ppo 10M)",
    )
    p.add_argument("--run-timeout-s", type=float, default=420.0, help="with --acceptance: per run")
    p.add_argument(
        "--optimize-argv",
        default="--optimize-budget none",
        help="with --acceptance: more rose-jax train flags for the --optimize run",
    )
    p.add_argument(
        "--cached-argv",
        default=None,
        help="with --acceptance: the rose_cached run's flags in place of --optimize-argv (e.g. "
        "'--optimize-budget none' after a rose_plan search with a budget in the same call)",
    )
    p.add_argument(
        "--plan-cache",
        default=None,
        metavar="DIR",
        help="with --acceptance: the plan cache of the rose and rose_cached runs (kept after the call; "
        "default: a fresh one per run, removed)",
    )
    p.add_argument("--out", default=OUT_DIR)
    p.add_argument("--merge", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    args.peer_variants = [v.strip() for v in args.peer_variants.split(",") if v.strip()]
    args.optimize_argv = args.optimize_argv.split()
    args.cached_argv = args.cached_argv.split() if args.cached_argv is not None else None
    bad_peer = [v for v in args.peer_variants if v not in PEERS]
    if bad_peer:
        p.error(f"unknown peer variant(s) {bad_peer}; known: peer_default, peer_flags")
    args.rose_variants = [v.strip() for v in args.rose_variants.split(",") if v.strip()]
    known_rose = ("flags_only", "flags_only_cached", "rose_plan", "rose", "rose_cached")
    bad_rose = [v for v in args.rose_variants if v not in known_rose]
    if bad_rose:
        p.error(f"unknown rose variant(s) {bad_rose}; known: {', '.join(known_rose)}")
    if "flags_only_cached" in args.rose_variants and "flags_only" not in args.rose_variants:
        p.error("--rose-variants flags_only_cached runs on the caches flags_only leaves: give flags_only too")
    if "rose_plan" in args.rose_variants and not args.plan_cache:
        p.error("--rose-variants rose_plan (the search alone) needs --plan-cache DIR: its plan is its result")
    has_plans = bool(args.plan_cache) and (
        os.path.exists(os.path.join(args.plan_cache, "plans.json"))
        or bool({"rose", "rose_plan"} & set(args.rose_variants))
    )
    if "rose_cached" in args.rose_variants and not has_plans:
        p.error("--rose-variants rose_cached needs --plan-cache DIR with a plans.json (or a rose run first)")
    if args.profile_missed and not (args.acceptance and args.merge):
        p.error("--profile-missed traces the rows of an earlier --acceptance call: give --acceptance --merge")
    from benchmarks.experiments import informed_peer
    from rose_jax.optimize import xla_options

    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.check_equal = {v.strip() for v in args.check_equal.split(",") if v.strip()}
    for v in args.variants:
        if (
            v not in VARIANTS
            and not (v.startswith("set:") and v[4:] in xla_options.SETS)
            and not (v.startswith("unroll:") and v[7:].isdigit() and int(v[7:]) >= 2)
            and not (v.startswith("hoist:") and len(v) > 6)
            and not (v == "inplace" or (v.startswith("inplace:") and len(v) > 8))
            and not (v == "twins" or (v.startswith("twins:") and len(v) > 6))
            and not (v == "dense" or (v.startswith("dense:") and len(v) > 6))
            and not (v == "exit" or (v.startswith("exit:") and v[5:].isdigit() and int(v[5:]) >= 1))
            and not (v == "stack" or (v.startswith("stack:") and len(v) > 6))
        ):
            p.error(
                f"unknown variant {v!r}; known: {', '.join(VARIANTS)}, {VARIANT_FORMS} "
                f"(NAME of {', '.join(xla_options.SETS)})"
            )
    if "flags_only" not in args.variants:
        args.variants.insert(0, "flags_only")
    if args.options not in xla_options.SETS:
        p.error(f"unknown option set {args.options!r}; known: {', '.join(xla_options.SETS)}")
    if args.learning_check_steps < 0:
        p.error(f"--learning-check-steps must be >= 0, got {args.learning_check_steps}")
    if args.blocks < 3:
        p.error("--blocks must be >= 3 (steady rates over at least 3 timed blocks)")
    names = ["smoke"] if args.smoke else [w.strip() for w in args.workloads.split(",") if w.strip()]
    known = informed_peer.workloads()
    for n in names:
        if n not in known:
            p.error(f"unknown workload {n!r}; known: {', '.join(known)}")
    rows: list[dict[str, Any]] = []
    accepted: list[dict[str, Any]] = []
    if args.merge and os.path.exists(os.path.join(args.out, "results.json")):
        with open(os.path.join(args.out, "results.json")) as f:
            earlier = json.load(f)
        rows = list(earlier.get("rows", []))  # every earlier call's rows, each with its call
        accepted = list(earlier.get("acceptance", []))
    command = "python -m benchmarks.experiments.beyond_flags " + " ".join(argv)
    if args.profile_missed:
        return profile_missed(args, names, rows, accepted, command)
    if args.acceptance:  # children first: this process holds no GPU until every run has ended
        return run_acceptance(args, names, rows, accepted, command)
    import jax

    options = xla_options.SETS[args.options] if jax.default_backend() == "gpu" else {}
    for n in names:
        try:
            rows += measure(n, args, options)["rows"]
        except Exception as e:  # noqa: BLE001 - a workload's failure is a row, the rest go on
            common.log(f"{n}: failed: {type(e).__name__}: {e}")
            rows.append({"workload": n, "variant": "flags_only", "error": f"{type(e).__name__}: {e}"[:300]})
        write(args.out, rows, command, accepted)
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


if __name__ == "__main__":
    from benchmarks.experiments import informed_peer as ip

    with ip.sigterm_exits():  # a call's limit ends the runs' own sessions too
        sys.exit(main())
