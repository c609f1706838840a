"""Baseline vs rose_jax.optimize search result, same run: env-steps/s, equality, SM activity.

For each algorithm (PPO, SAC) and env count (default 2048 and 8192) on ``ant`` (MJX backend):
  1. the untransformed iteration: compile, time ``--iters`` iterations x ``--repeats`` runs,
     env-steps/s; mean SM activity over a run (NVML sampler, when ``rose_jax.profile`` finds a GPU);
  2. ``rose_jax.optimize.optimize`` over the candidates (``--ppo-candidates`` / ``--sac-candidates``:
     a comma list of ``unroll:<where>:<factor>``, ``hoist:<where>``, ``group:<G>:<mode>``,
     ``fuse:<a>:<b>``, or ``auto`` = generated from the LoopTree, ``--max-candidates`` of them);
  3. the optimized iteration: env-steps/s, SM activity, and its state after ``--iters``
     iterations compared with the baseline's (leaf-scaled tolerance of the plan).
Writes ``optimize.json`` (machine, versions, command, every candidate of every search),
``optimize.md`` (tables) and ``optimize.png`` (env-steps/s, baseline vs optimized) into
``--out`` (default benchmarks/results/optimize/), atomically; a short table is printed last.

``--unit epoch`` times what Brax's train loop runs between two progress reports instead of one
iteration: ``--epoch-env-steps`` env steps of training (``ppo.epoch`` / ``sac.epoch``, a scan of
iterations) followed by an evaluation of ``--eval-envs`` envs for a whole episode; candidates
default to ``offload:evaluate`` (``rose_jax.optimize.offload_component``: the evaluation in a worker
process, behind the next epoch's training). ``--mps-client`` runs the whole benchmark as a client
of a fresh MPS daemon (needed for the worker's kernels to run concurrently with the driver's).

On the H200 (about 5-6 minutes; most of it compilation, shared through JAX's persistent cache):
    python -m benchmarks.experiments.optimizer_speedup
    python -m benchmarks.experiments.optimizer_speedup --algos ppo --num-envs 8192 \
        --ppo-candidates group:2:processes
    python -m benchmarks.experiments.optimizer_speedup --unit epoch --mps-client --num-envs 2048
Check the plumbing on a CPU (pendulum, tiny sizes; output in a temp dir unless --out):
    python -m benchmarks.experiments.optimizer_speedup --tiny
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from rose_jax.io import atomic_write_json, atomic_write_text
from rose_jax.program import Program

from benchmarks import common
from benchmarks.common import fmt, fmt_equal, log

# group_rollout(..., "processes") starts worker JAX processes on the same GPU: this driver must not
# grab 75% of the GPU memory at its first JAX call (read when JAX starts its GPU backend).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

DEFAULT_PPO = "group:2:processes,group:2:interleaved,unroll:rollout:4"
DEFAULT_SAC = "unroll:train_steps:4,hoist:train_steps"


def build(algo: str, num_envs: int, args):
    """(target: PPO's Program or SAC's iteration, or an epoch fn; state; env steps per call; config)."""
    from algos import ppo, sac

    epoch = args.unit == "epoch"
    extra = {} if algo == "ppo" else {"num_eval_envs": args.eval_envs if epoch else 0}
    env, config, state = common.algo_setup(algo, num_envs, args, args.hidden, **extra)
    per_iteration = config.env_steps_per_iteration
    k = max(1, math.ceil(args.epoch_env_steps / per_iteration))
    if algo == "ppo":
        if epoch:
            eval_length = args.eval_length or env.episode_length
            fn = ppo.epoch(config, env, k, num_eval_envs=args.eval_envs, eval_length=eval_length)
            return fn, state, k * per_iteration, config
        env_kw = () if args.backend in ("", "none") else (("backend", args.backend),)
        return ppo.program(config, env, env_name=args.env, env_kwargs=env_kw), state, per_iteration, config
    if epoch:
        return sac.epoch(config, env, iterations=k), state, k * per_iteration, config
    return sac.iteration(config, env), state, per_iteration, config


def parse_candidates(text: str):
    """``None`` for ``auto``, else Transforms from ``unroll:w:f, hoist:w, group:G:mode, fuse:a:b``."""
    from rose_jax import optimize as O

    if text.strip() == "auto":
        return None
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, *rest = item.split(":")
        try:
            if kind == "unroll":
                out.append(O.unroll_scans(True if rest[1] == "full" else int(rest[1]), rest[0] or None))
            elif kind == "hoist":
                out.append(O.hoist_invariants(rest[0] if rest and rest[0] else None))
            elif kind == "group":
                out.append(O.group_rollout(int(rest[0]), rest[1] if len(rest) > 1 else "interleaved"))
            elif kind == "fuse":
                out.append(O.overlap_independent(rest[0], rest[1]))
            elif kind == "offload":
                out.append(O.offload_component(rest[0] if rest and rest[0] else "evaluate"))
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except (IndexError, ValueError) as e:
            raise SystemExit(
                f"bad candidate {item!r}: {e} (use unroll:<where>:<f>, hoist:<where>, "
                "group:<G>:<mode>, fuse:<a>:<b>, offload:<component> or auto)"
            ) from None
    return out


def time_step(step, state, iters: int, repeats: int):
    """(median s/iter, final state of one run) after one warm-up (compile) call."""
    import numpy as np

    from rose_jax.optimize import measure

    final, timing = measure.time_repeats(step, state, iters, repeats)
    return float(np.median(timing.per_iter_s)), final


def sm_activity(step, state, iters: int, args):
    """Mean SM activity (%) over ``iters`` chained iterations, or (None, reason) without a GPU."""
    try:
        from rose_jax import profile as rp
    except ImportError as e:  # pragma: no cover - the profiler ships with rose_jax
        return None, f"rose_jax.profile unavailable: {e}"
    ok, reason = rp.available()
    if not ok:
        return None, reason
    import jax

    spans = []
    with rp.Sampler(period_ms=args.period_ms, window_ms=args.window_ms) as sampler:
        time.sleep((args.window_ms + 2 * args.period_ms) * 1e-3)
        s = state
        drain = getattr(step, "drain", lambda: None)  # offloaded work counts in its call's span
        for i in range(iters):
            t0 = time.perf_counter_ns()
            s, _ = step(s)
            jax.block_until_ready(s)
            if i == iters - 1:
                drain()
            spans.append((t0, time.perf_counter_ns()))
        time.sleep((args.window_ms / 2 + 2 * args.period_ms) * 1e-3)
    value = rp.mean_activity(sampler.series(), spans)
    return (None if not math.isfinite(value) else float(value)), reason


def run_config(algo: str, num_envs: int, args, cands_text: str) -> dict:
    import jax

    from rose_jax import optimize as O
    from rose_jax.optimize import measure, search

    name = f"{algo}_{args.env}_{num_envs}"
    log(f"{name}: building env, config, initial state")
    target, state, steps_per_iter, config = build(algo, num_envs, args)
    jax.block_until_ready(state)
    base_step = search.compile_step(target)
    log(f"{name}: baseline: compile + {args.repeats} x {args.iters} iterations")
    t = time.perf_counter()
    if args.unit == "epoch":  # epochs take seconds: one timed epoch here, the search times in turns
        first_s, _ = time_step(base_step, state, 1, 1)
    else:
        first_s, _ = time_step(base_step, state, args.iters, args.repeats)
    log(
        f"{name}: baseline {first_s * 1e3:.2f} ms/iter = {steps_per_iter / first_s:,.0f} env-steps/s "
        f"({time.perf_counter() - t:.1f}s incl. compile)"
    )
    base_act, act_reason = sm_activity(base_step, state, args.activity_iters, args)

    windows = None
    if args.windows:
        from rose_jax import profile as rp

        log(f"{name}: profiling windows (segments compile separately)")
        fn = target.iteration() if isinstance(target, Program) else target
        tl = rp.profile(jax.jit(fn), state, levels=2, repeats=2)
        windows = rp.find_windows(tl) if tl.activity is not None else None
    candidates = parse_candidates(cands_text)
    log(f"{name}: search over {'generated' if candidates is None else len(candidates)} candidates")
    t = time.perf_counter()
    step, report = O.optimize(
        target,
        state,
        windows=windows,
        candidates=candidates,
        n_iters=args.iters,
        repeats=args.repeats,
        cache_dir=args.plan_cache or None,
        max_candidates=args.max_candidates,
        local=args.local,
        log=lambda s: log(f"{name}: {s}"),
        equality_iters=args.equality_iters,
    )
    search_s = time.perf_counter() - t
    if args.unit == "epoch":
        return _epoch_row(
            name, algo, num_envs, args, config, state, steps_per_iter, base_act, report, step, search_s
        )
    try:
        log(f"{name}: baseline and optimized timed in turns ({args.repeats} x {args.iters} iterations each)")
        (base_final, tb), (opt_final, to) = measure.time_alternating(
            [base_step, step], state, args.iters, args.repeats
        )
        # processes mode keeps the env state in its workers: fetch it before later runs move it on
        opt_final = getattr(step, "sync_state", lambda s: s)(opt_final)
        transfers = getattr(step, "stats", lambda: None)()
        if transfers and transfers.get("last_iteration"):
            last = transfers["last_iteration"]
            log(
                f"{name}: processes collect ({transfers['mode']}): {last['sent_bytes']:,} B sent + "
                f"{last['received_bytes']:,} B received per iteration; env state "
                f"{transfers['env_state_bytes']:,} B uploaded {transfers['counts'].get('put', 0)}x"
            )
        base_s, opt_s = tb.median, to.median
        if not report.plan:  # nothing kept: the "optimized" step is the baseline program itself
            opt_s = base_s
        opt_act, _ = sm_activity(step, state, args.activity_iters, args)
    finally:
        getattr(step, "close", lambda: None)()
    plan = [p["label"] for p in report.plan]
    tol = max([p["tolerance"]["rtol"] for p in report.plan] or [0.0])
    cmp = measure.compare_trees(opt_final, base_final, rtol=tol)
    log(
        f"{name}: baseline {base_s * 1e3:.2f} / optimized {opt_s * 1e3:.2f} ms/iter = "
        f"{steps_per_iter / base_s:,.0f} / {steps_per_iter / opt_s:,.0f} env-steps/s; plan {plan or '-'}; "
        f"equal={cmp.equal} (max|d| {cmp.max_abs:.2g}, leaf-rel {cmp.max_rel:.2g}); search {search_s:.1f}s"
    )
    return {
        "name": name,
        "algo": algo,
        "env": args.env,
        "num_envs": num_envs,
        "config": repr(config),
        "steps_per_iteration": steps_per_iter,
        "baseline_ms": base_s * 1e3,
        "optimized_ms": opt_s * 1e3,
        "baseline_steps_per_s": steps_per_iter / base_s,
        "optimized_steps_per_s": steps_per_iter / opt_s,
        "speedup": base_s / opt_s,
        "plan": plan,
        "equal": cmp.equal,
        "max_abs_diff": cmp.max_abs,
        "max_rel_diff": cmp.max_rel,
        "tolerance_rtol": tol,
        "sm_activity_before": base_act,
        "sm_activity_after": opt_act,
        "activity": act_reason,
        "search_s": search_s,
        "process_transfers": _transfer_summary(transfers),
        "unit": args.unit,
        "cache_hit": report.cache_hit,
        "report": report.to_json(),
        "report_text": O.format_report(report),
    }


def _epoch_row(
    name, algo, num_envs, args, config, state, per_call, base_act, report, step, search_s
) -> dict:
    """Row of the epoch unit from the search's own measurements (timed in turns with the baseline,
    equality under deterministic XLA ops): the epochs are seconds long, so no second timing."""
    from rose_jax import optimize as O

    kept = [c for c in report.candidates if c.kept]
    best = min(kept, key=lambda c: c.e2e_time_s) if kept else None
    tried = [c for c in report.candidates if c.e2e_time_s]
    ref = best or (tried[0] if tried else None)
    base_s = ref.e2e_baseline_s if ref else report.baseline_s
    opt_s = best.e2e_time_s if best else base_s
    try:
        if best:  # a fresh step: its first call starts the worker and compiles there; not sampled
            import jax

            jax.block_until_ready(step(state))
        opt_act, _ = sm_activity(step, state, args.activity_iters, args) if best else (base_act, None)
        getattr(step, "drain", lambda: None)()
        stats = getattr(step, "stats", lambda: None)() if best else None
    finally:
        getattr(step, "close", lambda: None)()
    tried_s = ref.e2e_time_s if ref else None
    log(
        f"{name}: baseline {base_s:.3f} / optimized {opt_s:.3f} s/epoch = {per_call / base_s:,.0f} / "
        f"{per_call / opt_s:,.0f} env-steps/s; plan {[p['label'] for p in report.plan] or '-'}; "
        f"equal={report.equal}; search {search_s:.1f}s"
    )
    return {
        "name": name, "algo": algo, "env": args.env, "num_envs": num_envs, "unit": "epoch",
        "config": repr(config), "steps_per_iteration": per_call,
        "baseline_ms": base_s * 1e3, "optimized_ms": opt_s * 1e3, "candidate_ms": (tried_s or 0) * 1e3,
        "baseline_steps_per_s": per_call / base_s, "optimized_steps_per_s": per_call / opt_s,
        "speedup": base_s / opt_s, "plan": [p["label"] for p in report.plan],
        # equality of the kept plan; None ("not checked") when nothing was kept (a tried candidate's
        # comparison is not the row's)
        "equal": bool(best.equal) if best else None,
        "max_abs_diff": best.max_abs_diff if best else None,
        "max_rel_diff": best.max_rel_diff if best else None,
        "tolerance_rtol": 0.0, "sm_activity_before": base_act, "sm_activity_after": opt_act,
        "search_s": search_s, "offload": stats, "cache_hit": report.cache_hit,
        "report": report.to_json(), "report_text": O.format_report(report),
    }


def _transfer_summary(stats):
    """The processes collect's transfer counters without its per-iteration log (None otherwise)."""
    if not stats:
        return None
    return {k: v for k, v in stats.items() if k != "per_iteration"}


def table(rows: list[dict]) -> str:
    columns = [("config", "l"), ("baseline steps/s", "r"), ("optimized steps/s", "r"), ("speedup", "r"),
               ("equal", "l"), ("SM % before", "r"), ("SM % after", "r"), ("search s", "r"), ("plan", "l")]
    return common.config_table(columns, rows, lambda r: [
        f"{r['baseline_steps_per_s']:,.0f}", f"{r['optimized_steps_per_s']:,.0f}", f"{r['speedup']:.3f}x",
        fmt_equal(r["equal"]), fmt(r["sm_activity_before"]), fmt(r["sm_activity_after"]),
        f"{r['search_s']:.1f}", ", ".join(r["plan"]) or "-",
    ])


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "skipped" not in r]
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(done) + 1), 3.2))
    xs = range(len(done))
    ax.bar([x - 0.2 for x in xs], [r["baseline_steps_per_s"] for r in done], 0.4, label="baseline")
    ax.bar([x + 0.2 for x in xs], [r["optimized_steps_per_s"] for r in done], 0.4, label="rose_jax.optimize")
    for x, r in zip(xs, done, strict=True):
        ax.text(
            x + 0.2, r["optimized_steps_per_s"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8
        )
    ax.set_xticks(list(xs), [r["name"] for r in done], rotation=20, fontsize=8)
    ax.set_ylabel("env steps / s")
    ax.legend(fontsize=8)
    ax.set_title("baseline vs optimized iteration (same run)", fontsize=9)
    common.save_plot(fig, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(
        p, num_envs=(2048, 8192), budget_s=330.0, default_out="benchmarks/results/optimize[_epoch]"
    )
    p.add_argument(
        "--iters", type=int, default=3, help="iterations per timed run and before the equality check"
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--activity-iters", type=int, default=5)
    p.add_argument("--ppo-candidates", default=None, help=f"default {DEFAULT_PPO} (epoch: offload:evaluate)")
    p.add_argument("--sac-candidates", default=None, help=f"default {DEFAULT_SAC} (epoch: offload:evaluate)")
    p.add_argument("--unit", choices=["iteration", "epoch"], default="iteration",
                   help="what one timed call is: one iteration, or a training epoch + evaluation")
    p.add_argument("--epoch-env-steps", type=int, default=1_000_000, help="training env steps per epoch")
    p.add_argument("--eval-envs", type=int, default=128)
    p.add_argument("--eval-length", type=int, default=0, help="eval steps (0: the env's episode length)")
    p.add_argument("--equality-iters", type=int, default=None, help="calls checked for equality")
    p.add_argument("--mps-client", action="store_true",
                   help="run as a client of a fresh MPS daemon (started and stopped by a parent process)")
    p.add_argument("--max-candidates", type=int, default=3)
    p.add_argument(
        "--local",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="time the affected piece alone first (costs extra compiles)",
    )
    p.add_argument("--windows", action="store_true", help="profile the baseline and pass its windows (slow)")
    p.add_argument("--plan-cache", default="", help="plan cache dir ('' = no cache: always search)")
    p.add_argument("--period-ms", type=float, default=10.0)
    p.add_argument("--window-ms", type=float, default=100.0)
    common.add_algo_args(p, hidden=(256, 256))
    args = p.parse_args(argv)
    epoch_default = "offload:evaluate"
    if args.ppo_candidates is None:
        args.ppo_candidates = epoch_default if args.unit == "epoch" else DEFAULT_PPO
    if args.sac_candidates is None:
        args.sac_candidates = epoch_default if args.unit == "epoch" else DEFAULT_SAC
    if args.tiny:
        common.make_tiny(args)
        args.repeats, args.iters, args.activity_iters = 5, 3, 2
        args.epoch_env_steps, args.eval_envs, args.eval_length = 256, 8, 50
    if args.unit == "epoch" and not args.tiny:
        args.activity_iters = min(args.activity_iters, 2)
    return args


def write_results(rows: list[dict], args, out_dir: str) -> str:
    """JSON + Markdown (+ PNG) of the rows so far, atomically; returns the table."""
    text = table(rows)
    notes = (
        "steps/s = env steps per second of whole iterations (median over repeats, after compile). "
        "equal = optimized state after --iters iterations within the plan's leaf-scaled tolerance of the "
        "baseline's. SM % = time-weighted NVML GPM SM_UTIL over chained iterations (~100 ms resolution). "
        "One JAX process runs its programs on one compute stream: 'interleaved' groups only change XLA's "
        "scheduling/fusion; 'processes' groups run the rollouts in separate MPS clients (real concurrency, "
        "plus array transfers); unrolling saves per-iteration loop overhead."
    )
    if args.unit == "epoch":
        notes += (
            f" Unit: one epoch = training for {args.epoch_env_steps:,} env steps (a scan of iterations) "
            f"then an evaluation of {args.eval_envs} envs x {args.eval_length or 'episode length'} steps; "
            "steps/s counts training env steps over the wall time of whole epochs, evaluation included "
            "(Brax's train loop). Equality: the state after the epoch, under xla_gpu_deterministic_ops."
        )
    md = [f"# optimizer_speedup\n\n{notes}\n\n{text}\n"]
    for r in rows:
        if "report_text" in r:
            md.append(f"## {r['name']}\n\n```\n{r['report_text']}\n```\n")
    meta = common.machine_info()
    atomic_write_json(
        os.path.join(out_dir, "optimize.json"),
        {"machine": meta, "argv": sys.argv[1:], "wall_s": common.elapsed(), "rows": rows},
    )
    atomic_write_text(
        os.path.join(out_dir, "optimize.md"), f"command: `{meta.get('command')}`\n\n" + "\n".join(md)
    )
    if any("skipped" not in r for r in rows):
        plot(rows, os.path.join(out_dir, "optimize.png"))
    return text


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.mps_client and not os.environ.get("ROSE_MPS_CLIENT"):
        from rose_jax.mps import run_as_client

        raise SystemExit(run_as_client([sys.executable, "-m", __spec__.name, *sys.argv[1:]], log=log))
    import jax

    common.enable_compile_cache(args.compile_cache)
    if args.compile_cache:  # worker processes (offload, env groups) inherit the cache through the environment
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", args.compile_cache)
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")

    default_out = os.path.join(common.RESULTS_DIR, "optimize_epoch" if args.unit == "epoch" else "optimize")
    out_dir = common.output_dir(args, default_out, "rose_optimize_tiny_")
    log(f"JAX {jax.__version__} backend={jax.default_backend()} devices={jax.devices()}; output {out_dir}")
    text = ""

    def write(rows):
        nonlocal text
        text = write_results(rows, args, out_dir)  # after every config: a cut run keeps its rows

    candidates = {"ppo": args.ppo_candidates, "sac": args.sac_candidates}
    configs = common.algo_configs(args, lambda algo, n: run_config(algo, n, args, candidates[algo]))
    rows = common.run_configs(configs, args.budget_s, after_each=write)
    log(f"done in {common.elapsed():.1f}s; results in {out_dir}")
    print("\n" + text + "\n", flush=True)
    return rows


if __name__ == "__main__":
    main()
