"""Profile PPO and SAC iterations on the GPU: phase times, SM activity, low-activity windows.

For each algorithm (PPO, SAC) and env count (default 1024 and 8192) on ``ant`` (MJX backend):
  1. ``rose_jax.profile.profile``: the iteration split into component segments (level 1) and the
     component segments of its loop bodies (level 2), fenced and timed, with NVML GPM
     ``SM_UTIL``/``SM_OCCUPANCY`` sampled around it;
  2. writes ``<algo>_<env>_<n>.timeline.json``, ``.windows.md``/``.windows.json`` (ranked
     low-activity windows and per-phase idle summary) and ``.png`` into ``--out``;
  3. ``iteration_activity``: the fused jitted iteration in a loop, sampler off vs on in
     alternating blocks (same process): mean SM activity per iteration and the sampler overhead;
  4. optionally (default on a GPU) a ``jax.profiler`` kernel trace of one iteration: kernel busy
     time per component and the longest gaps between kernels.
Prints progress lines and a summary table; ``summary.json``/``summary.md`` hold the table.

Run on the H200 (about 3-4 minutes, most of it compilation):
    python benchmarks/profile_gpu.py
    python benchmarks/profile_gpu.py --algos ppo --num-envs 4096      # one config
Check the plumbing on a CPU (no GPU activity data, tiny sizes, pendulum, output in a temp dir):
    python benchmarks/profile_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def build(algo: str, env_name: str, num_envs: int, args):
    """(iteration fn, train state, config) for one algorithm."""
    import jax

    import envs

    env_kw = {} if args.backend in ("", "none") else {"backend": args.backend}
    env = envs.make(env_name, **env_kw)
    from algos import ppo, sac
    from benchmarks.common import algo_config

    config = algo_config(algo, num_envs, args)
    module = ppo if algo == "ppo" else sac
    return module.iteration(config, env), module.init(config, env, jax.random.PRNGKey(args.seed)), config


def atomic_write_text(path: str, text: str) -> None:
    from rose_jax.io import atomic_write_text as write

    write(path, text)


def _json(obj) -> str:
    return json.dumps(obj, indent=1, default=str) + "\n"


def _machine() -> dict:
    """benchmarks.common.machine_info() (versions, devices, command line), or the basics."""
    import jax

    try:
        from benchmarks import common

        return common.machine_info()
    except Exception:  # noqa: BLE001 - the summary must still be written
        return {"jax": jax.__version__, "backend": jax.default_backend(), "command": " ".join(sys.argv)}


def _fmt(x, spec=".1f", none="-"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def run_config(algo: str, env_name: str, num_envs: int, args, out_dir: str) -> dict:
    import jax

    from rose_jax import profile as rp
    from rose_jax.profile import xplane

    name = f"{algo}_{env_name}_{num_envs}"
    log(f"{name}: building env, config and initial state")
    it, state, config = build(algo, env_name, num_envs, args)
    jax.block_until_ready(state)
    fn = jax.jit(it)  # one jitted object shared by every measurement below (one fused compile)
    log(f"{name}: profile (levels={args.levels}, repeats={args.repeats}, compiles segments)")
    tl = rp.profile(
        fn,
        state,
        sample_period_ms=args.period_ms,
        window_ms=args.window_ms,
        levels=args.levels,
        repeats=args.repeats,
        max_loop_iterations=args.loop_iterations,
    )
    tl = tl.replace(
        metadata={**tl.metadata, "algo": algo, "env": env_name, "num_envs": num_envs, "config": repr(config)}
    )
    md = tl.metadata
    log(
        f"{name}: profiled in {md['wall_s']:.1f}s (compile {md['compile_s']:.1f}s); outputs_match="
        f"{md.get('outputs_match')}; fused {md.get('fused_iteration_s', float('nan')) * 1e3:.2f} ms, "
        f"segmented {md.get('segmented_iteration_s', float('nan')) * 1e3:.2f} ms per iteration"
    )
    tl.save(os.path.join(out_dir, f"{name}.timeline.json"))

    summary = rp.phase_idle_summary(tl)
    windows: dict[str, list] = {}
    if tl.activity is not None:
        for level in (1, 2):
            windows[str(level)] = rp.find_windows(
                tl,
                threshold=args.threshold,
                min_duration_ms=args.min_window_ms,
                merge_gap_ms=args.merge_gap_ms,
                levels=level,
            )
    lines = [
        f"# {name}: low-SM-activity windows",
        "",
        f"activity: {md.get('activity')}; threshold {args.threshold} %, "
        f"min duration {args.min_window_ms} ms, merge gap {args.merge_gap_ms} ms; "
        f"resolution {_fmt(md.get('resolution_ms'), '.0f')} ms",
        "",
    ]
    for level, ws in windows.items():
        lines += [
            f"## level {level} windows (ranked by idle SM-seconds per iteration)",
            "",
            rp.windows_table(ws, limit=15),
            "",
        ]
    lines += ["## per-phase idle summary", "", rp.summary_table(summary, limit=30), ""]
    atomic_write_text(os.path.join(out_dir, f"{name}.windows.md"), "\n".join(lines))
    windows_json = {
        "windows": {lvl: [w._asdict() for w in ws] for lvl, ws in windows.items()},
        "summary": [s._asdict() for s in summary],
        "metadata": md,
    }
    atomic_write_text(os.path.join(out_dir, f"{name}.windows.json"), _json(windows_json))
    png = rp.plot_timeline(
        tl, os.path.join(out_dir, f"{name}.png"), f"{name}: SM activity and phases", threshold=args.threshold
    )
    log(f"{name}: wrote {name}.timeline.json, .windows.md/.json, {os.path.basename(png)}")

    log(
        f"{name}: iteration activity + sampler overhead ({args.overhead_iters} iterations x "
        f"{args.overhead_rounds} rounds, off/on)"
    )
    ia = rp.iteration_activity(
        fn,
        state,
        iters=args.overhead_iters,
        rounds=args.overhead_rounds,
        sample_period_ms=args.period_ms,
        window_ms=args.window_ms,
    )
    over = None if ia.overhead is None else 100 * ia.overhead
    log(
        f"{name}: mean SM util {_fmt(ia.mean_sm_util)} %, occupancy {_fmt(ia.mean_sm_occupancy)} %, "
        f"iteration {ia.iteration_time_off_s * 1e3:.2f} ms (sampler off) / "
        f"{_fmt(None if ia.iteration_time_s is None else ia.iteration_time_s * 1e3, '.2f')} ms (on), "
        f"overhead {_fmt(over, '+.2f')} %" + (f"  [{ia.reason}]" if ia.reason else "")
    )

    kt = None
    if args.kernel_trace and jax.default_backend() == "gpu":
        log(f"{name}: kernel trace of {args.trace_iters} iteration(s)")
        kt = xplane.kernel_trace(
            fn, state, logdir=os.path.join(out_dir, "traces", name), repeats=args.trace_iters
        )
        atomic_write_text(
            os.path.join(out_dir, f"{name}.kernels.md"),
            f"# {name}: kernel busy time per component\n\ntrace: {kt.trace_file}\n\n"
            + xplane.busy_table(kt)
            + "\n\n## longest gaps between kernels\n\n| path | gap us |\n|---|---:|\n"
            + "\n".join(f"| {g.path} | {g.duration_ns / 1e3:.1f} |" for g in kt.gaps[:20])
            + "\n",
        )
        log(
            f"{name}: {len(kt.events)} kernel events, span {kt.span_ns * 1e-6:.2f} ms"
            + ("" if kt.available else f" ({kt.reason})")
        )

    top = [s for s in summary if math.isfinite(s.idle_sm_seconds_per_iteration)][:3]
    for s in top:
        log(
            f"{name}:   idle: level {s.level} {s.path}: "
            f"{s.idle_sm_seconds_per_iteration * 1e3:.3f} ms idle-GPU per iteration "
            f"({s.time_per_iteration_s * 1e3:.2f} ms at {s.mean_sm_activity:.0f} % SM)"
        )
    if not top:
        slow = sorted((s for s in summary if s.level >= 1), key=lambda s: -s.time_per_iteration_s)[:3]
        for s in slow:
            log(
                f"{name}:   time: level {s.level} {s.path}: "
                f"{s.time_per_iteration_s * 1e3:.3f} ms per iteration (no activity data)"
            )
    best = top[0] if top else None
    n_windows = sum(len(ws) for ws in windows.values())
    return {
        "name": name,
        "algo": algo,
        "env": env_name,
        "num_envs": num_envs,
        "fused_iteration_ms": md.get("fused_iteration_s", float("nan")) * 1e3,
        "segmented_iteration_ms": md.get("segmented_iteration_s", float("nan")) * 1e3,
        "outputs_match": md.get("outputs_match"),
        "mean_sm_util": ia.mean_sm_util,
        "mean_sm_occupancy": ia.mean_sm_occupancy,
        "source": ia.source,
        "iteration_ms_sampler_off": ia.iteration_time_off_s * 1e3,
        "iteration_ms_sampler_on": None if ia.iteration_time_s is None else ia.iteration_time_s * 1e3,
        "sampler_overhead_pct": over,
        "top_idle_phase": None if best is None else f"L{best.level} {best.path}",
        "top_idle_ms_per_iteration": None if best is None else best.idle_sm_seconds_per_iteration * 1e3,
        "windows": n_windows,
        "activity": md.get("activity"),
        "resolution_ms": md.get("resolution_ms"),
        "kernel_events": None if kt is None else len(kt.events),
        "profile_wall_s": md.get("wall_s"),
    }


def overhead_iters(fn, state, args) -> int:
    """Iterations per sampler-off/on block: ``--overhead-iters``, raised so that one block lasts at
    least ``--overhead-block-s`` (several GPM windows; per-iteration timing noise averages out)."""
    import jax

    if args.overhead_block_s <= 0:
        return args.overhead_iters
    out = jax.block_until_ready(fn(state))  # compile
    s = out[0] if isinstance(out, tuple) else state
    t = time.perf_counter()
    for _ in range(3):
        s = jax.block_until_ready(fn(s))[0]
    per_iter = (time.perf_counter() - t) / 3
    return max(args.overhead_iters, math.ceil(args.overhead_block_s / max(per_iter, 1e-6)))


def run_overhead(algo: str, env_name: str, num_envs: int, args) -> dict:
    """Sampler overhead only: the fused iteration in blocks with the sampler off / on (same process)."""
    import jax

    from rose_jax import profile as rp

    name = f"{algo}_{env_name}_{num_envs}"
    log(f"{name}: building env, config and initial state")
    it, state, _ = build(algo, env_name, num_envs, args)
    fn = jax.jit(it)
    iters = overhead_iters(fn, jax.block_until_ready(state), args)
    log(f"{name}: sampler overhead, {iters} iterations x {args.overhead_rounds} rounds, off/on")
    ia = rp.iteration_activity(
        fn, state, iters=iters, rounds=args.overhead_rounds,
        sample_period_ms=args.period_ms, window_ms=args.window_ms,
    )
    over = None if ia.overhead is None else 100 * ia.overhead
    on_ms = None if ia.iteration_time_s is None else ia.iteration_time_s * 1e3
    log(
        f"{name}: iteration {ia.iteration_time_off_s * 1e3:.3f} ms (sampler off) / {_fmt(on_ms, '.3f')} ms "
        f"(on): overhead {_fmt(over, '+.2f')} %; mean SM {_fmt(ia.mean_sm_util)} %; quantiles off "
        f"{_quantiles(ia.times_off_s)} on {_quantiles(ia.times_on_s)}"
        + (f"  [{ia.reason}]" if ia.reason else "")
    )
    return {
        "name": name, "algo": algo, "env": env_name, "num_envs": num_envs,
        "iterations_per_block": iters, "rounds": args.overhead_rounds,
        "iteration_ms_sampler_off": ia.iteration_time_off_s * 1e3, "iteration_ms_sampler_on": on_ms,
        "sampler_overhead_pct": over, "mean_sm_util": ia.mean_sm_util, "source": ia.source,
        "sampler_mode": "process", "reason": ia.reason,
        "quantiles_ms_off": _quantiles(ia.times_off_s), "quantiles_ms_on": _quantiles(ia.times_on_s),
        "mean_ms_off": _mean_ms(ia.times_off_s), "mean_ms_on": _mean_ms(ia.times_on_s),
    }


def _quantiles(times_s) -> list | None:
    """10/25/50/75/90 % quantiles of per-iteration times, ms (None without samples)."""
    import numpy as np

    if not len(times_s):
        return None
    return [float(q) for q in np.quantile(np.asarray(times_s) * 1e3, [0.1, 0.25, 0.5, 0.75, 0.9])]


def _mean_ms(times_s) -> float | None:
    return None if not len(times_s) else 1e3 * sum(times_s) / len(times_s)


def overhead_table(rows: list[dict]) -> str:
    from benchmarks.common import config_table

    columns = [("config", "l"), ("iterations x rounds", "r"), ("ms/iter sampler off", "r"),
               ("ms/iter sampler on", "r"), ("overhead %", "r"), ("mean SM %", "r")]
    return config_table(columns, rows, lambda r: [
        f"{r['iterations_per_block']} x {r['rounds']}", f"{r['iteration_ms_sampler_off']:.3f}",
        _fmt(r["iteration_ms_sampler_on"], ".3f"), _fmt(r["sampler_overhead_pct"], "+.2f"),
        _fmt(r["mean_sm_util"]),
    ])


def table(rows: list[dict]) -> str:
    from benchmarks.common import config_table

    columns = [("config", "l"), ("fused ms/iter", "r"), ("mean SM %", "r"), ("occupancy %", "r"),
               ("sampler overhead %", "r"), ("top idle phase", "l"), ("idle ms/iter", "r"),
               ("windows", "r"), ("outputs match", "l")]
    return config_table(columns, rows, lambda r: [
        _fmt(r["fused_iteration_ms"], ".2f"), _fmt(r["mean_sm_util"]), _fmt(r["mean_sm_occupancy"]),
        _fmt(r["sampler_overhead_pct"], "+.2f"), r["top_idle_phase"] or "-",
        _fmt(r["top_idle_ms_per_iteration"], ".3f"), str(r["windows"]), str(r["outputs_match"]),
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", nargs="+", default=["ppo", "sac"], choices=["ppo", "sac"])
    p.add_argument("--num-envs", nargs="+", type=int, default=[1024, 8192])
    p.add_argument("--env", default="ant")
    p.add_argument("--backend", default="mjx", help="env backend keyword ('none' for pure-JAX envs)")
    p.add_argument("--tiny", action="store_true", help="CPU plumbing check: pendulum, 8 envs, tiny configs")
    p.add_argument(
        "--out", default=None, help="output dir (default benchmarks/results/profile; --tiny: a temp dir)"
    )
    p.add_argument("--budget-s", type=float, default=230.0, help="skip configs that would start after this")
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loop-iterations", type=int, default=4, help="loop iterations timed per loop at level 2")
    p.add_argument("--period-ms", type=float, default=10.0)
    p.add_argument("--window-ms", type=float, default=100.0, help="GPM averaging window")
    p.add_argument("--threshold", type=float, default=50.0, help="SM activity %% below which time is 'low'")
    p.add_argument("--min-window-ms", type=float, default=0.0)
    p.add_argument("--merge-gap-ms", type=float, default=1.0)
    p.add_argument("--overhead-iters", type=int, default=15)
    p.add_argument(
        "--overhead-rounds", type=int, default=None,
        help="sampler off/on block pairs (default 8 with --overhead-only: SAC's iteration times spread "
        "+-10 %%, 2-3 pairs measured noise, see results/profile/sampler_overhead/; else 2)",
    )
    p.add_argument(
        "--overhead-block-s", type=float, default=None,
        help="raise iterations per block to last this long (default 0.5 with --overhead-only, else 0 = off)",
    )
    p.add_argument(
        "--overhead-only", action="store_true",
        help="only the sampler-overhead measurement; writes sampler_overhead.md/.json into --out",
    )
    p.add_argument("--kernel-trace", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--trace-iters", type=int, default=1)
    from benchmarks.common import add_algo_args  # noqa: PLC0415 - after the sys.path set-up

    add_algo_args(p)
    p.add_argument(
        "--compile-cache",
        default=os.path.join(tempfile.gettempdir(), "rose_jax_jit_cache"),
        help="JAX persistent compilation cache dir ('' to disable)",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.env, args.backend, args.num_envs = "pendulum", "none", [8]
        args.repeats, args.overhead_iters, args.loop_iterations = 2, 3, 2
        args.ppo_unroll, args.ppo_minibatches, args.ppo_epochs = 4, 2, 2
        args.sac_batch, args.sac_grad_updates, args.sac_replay = 16, 2, 1024
        args.budget_s = max(args.budget_s, 1e9)
    if args.overhead_block_s is None:
        args.overhead_block_s = 0.5 if args.overhead_only and not args.tiny else 0.0
    if args.overhead_rounds is None:
        args.overhead_rounds = 8 if args.overhead_only and not args.tiny else 2
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import jax

    from benchmarks.common import enable_compile_cache

    enable_compile_cache(args.compile_cache)
    from rose_jax import profile as rp

    out_dir = args.out or (
        tempfile.mkdtemp(prefix="rose_profile_tiny_")
        if args.tiny
        else os.path.join(HERE, "results", "profile")
    )
    os.makedirs(out_dir, exist_ok=True)
    ok, reason = rp.available()
    log(f"JAX {jax.__version__} backend={jax.default_backend()} devices={jax.devices()}; NVML: {reason}")
    log(f"output: {out_dir}")
    configs = [(a, n) for n in args.num_envs for a in args.algos]
    rows = []
    for algo, n in configs:
        name = f"{algo}_{args.env}_{n}"
        if time.perf_counter() - T0 > args.budget_s:
            log(f"{name}: skipped (time budget {args.budget_s:.0f}s spent)")
            rows.append({"name": name, "skipped": "time budget"})
            continue
        try:
            if args.overhead_only:
                rows.append(run_overhead(algo, args.env, n, args))
            else:
                rows.append(run_config(algo, args.env, n, args, out_dir))
        except Exception as e:  # noqa: BLE001 - report and go on with the next config
            log(f"{name}: FAILED: {type(e).__name__}: {e}")
            rows.append({"name": name, "skipped": f"failed: {type(e).__name__}: {str(e)[:120]}"})
    if args.overhead_only:
        text = overhead_table(rows)
        print("\n" + text + "\n", flush=True)
        m = _machine()
        head = (
            f"{m.get('date', '')} on {m.get('gpu', m.get('backend'))}; jax {m.get('jax')}; "
            f"`{m.get('command')}`"
        )
        note = (
            "overhead = median iteration time with the NVML sampler (process mode, 10 ms period, GPM "
            "SM_UTIL/SM_OCCUPANCY) running / stopped - 1; blocks alternate off/on in one process, each "
            "iteration fenced with block_until_ready."
        )
        atomic_write_text(
            os.path.join(out_dir, "sampler_overhead.md"),
            f"# Sampler overhead\n\n{head}\n\nNVML: {reason}\n\n{text}\n\n{note}\n",
        )
        doc = {"rows": rows, "nvml": reason, "machine": m, "wall_s": time.perf_counter() - T0}
        atomic_write_text(os.path.join(out_dir, "sampler_overhead.json"), _json(doc))
        log(f"done in {time.perf_counter() - T0:.1f}s; {out_dir}/sampler_overhead.md")
        return rows
    text = table(rows)
    print("\n" + text + "\n", flush=True)
    note = (
        "mean SM % = time-weighted GPM SM_UTIL over fused iterations (sampler on); overhead = median "
        "iteration time with sampler on / off - 1; idle ms/iter = ms of whole-GPU SM idleness per "
        "iteration in that phase (segmented run); GPM resolution ~100 ms."
    )
    atomic_write_text(
        os.path.join(out_dir, "summary.md"), f"# profile_gpu summary\n\n{reason}\n\n{text}\n\n{note}\n"
    )
    summary = {"rows": rows, "nvml": reason, "machine": _machine(), "wall_s": time.perf_counter() - T0}
    atomic_write_text(os.path.join(out_dir, "summary.json"), _json(summary))
    log(f"done in {time.perf_counter() - T0:.1f}s; summary in {out_dir}/summary.md")
    return rows


if __name__ == "__main__":
    main()
