"""Profile PPO and SAC iterations on the GPU: phase times, SM activity, low-activity windows.

For each algorithm (PPO, SAC) and env count (default 1024 and 8192) on ``ant`` (MJX backend):
  1. ``rose_jax.profile.profile``: the iteration split into component segments (level 1) and the
     component segments of its loop bodies (level 2), fenced and timed, with NVML GPM
     ``SM_UTIL``/``SM_OCCUPANCY`` sampled around it;
  2. writes ``<algo>_<env>_<n>.timeline.json``, ``.windows.md``/``.windows.json`` (ranked
     low-activity windows and per-phase idle summary) and ``.png`` into ``--out``;
  3. ``iteration_activity``: the fused jitted iteration in a loop, sampler off vs on in
     alternating blocks (same process): mean SM activity per iteration and the sampler overhead
     (:mod:`benchmarks.experiments.sampler_overhead` measures only that, with longer blocks);
  4. optionally (default on a GPU) a ``jax.profiler`` kernel trace of one iteration: kernel busy
     time per component and the longest gaps between kernels (``<config>.kernels.md``; the same
     report from a stored trace: :mod:`benchmarks.experiments.kernels_from_trace`).
Prints progress lines and a summary table; ``summary.json``/``summary.md`` hold the table.

Run on the H200 (about 3-4 minutes, most of it compilation):
    python -m benchmarks.experiments.activity_profile --num-envs 1024 8192
    python -m benchmarks.experiments.activity_profile --algos ppo --num-envs 4096      # one config
Check the plumbing on a CPU (no GPU activity data, tiny sizes, pendulum, output in a temp dir):
    python -m benchmarks.experiments.activity_profile --tiny
"""

from __future__ import annotations

import argparse
import math
import os

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common
from benchmarks.common import fmt, log

DEFAULT_OUT = os.path.join(common.RESULTS_DIR, "profile")


def build(algo: str, num_envs: int, args):
    """(iteration fn, train state, config) of ``algo`` with the shared algorithm flags."""
    import algos

    env, config, state = common.algo_setup(algo, num_envs, args)
    return algos.get(algo).iteration(config, env), state, config


def sampling(args) -> dict:
    """The NVML sampler's keywords from ``--period-ms`` / ``--window-ms``."""
    return {"sample_period_ms": args.period_ms, "window_ms": args.window_ms}


def start(args, default_out: str, tiny_prefix: str) -> tuple[str, str]:
    """Compilation cache on, output dir made, JAX devices and NVML logged: (output dir, NVML status)."""
    import jax

    from rose_jax import profile as rp

    common.enable_compile_cache(args.compile_cache)
    out_dir = common.output_dir(args, default_out, tiny_prefix)
    _, reason = rp.available()
    log(f"JAX {jax.__version__} backend={jax.default_backend()} devices={jax.devices()}; NVML: {reason}")
    log(f"output: {out_dir}")
    return out_dir, reason


def run_config(algo: str, num_envs: int, args, out_dir: str) -> dict:
    """Profile one config; writes its timeline, windows, PNG (and kernel report); its summary row."""
    import jax

    from rose_jax import profile as rp
    from rose_jax.profile import xplane

    env_name = args.env
    name = f"{algo}_{env_name}_{num_envs}"
    log(f"{name}: building env, config and initial state")
    fn, state, config = build(algo, num_envs, args)
    jax.block_until_ready(state)
    fn = jax.jit(fn)  # one jitted object shared by every measurement below (one fused compile)
    log(f"{name}: profile (levels={args.levels}, repeats={args.repeats}, compiles segments)")
    tl = rp.profile(
        fn, state, levels=args.levels, repeats=args.repeats, max_loop_iterations=args.loop_iterations,
        **sampling(args),
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
        f"resolution {fmt(md.get('resolution_ms'), '.0f')} ms",
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
    atomic_write_json(os.path.join(out_dir, f"{name}.windows.json"), windows_json)
    png = rp.plot_timeline(
        tl, os.path.join(out_dir, f"{name}.png"), f"{name}: SM activity and phases", threshold=args.threshold
    )
    log(f"{name}: wrote {name}.timeline.json, .windows.md/.json, {os.path.basename(png)}")

    log(
        f"{name}: iteration activity + sampler overhead ({args.overhead_iters} iterations x "
        f"{args.overhead_rounds} rounds, off/on)"
    )
    ia = rp.iteration_activity(
        fn, state, iters=args.overhead_iters, rounds=args.overhead_rounds, **sampling(args)
    )
    over = None if ia.overhead is None else 100 * ia.overhead
    log(
        f"{name}: mean SM util {fmt(ia.mean_sm_util)} %, occupancy {fmt(ia.mean_sm_occupancy)} %, "
        f"iteration {ia.iteration_time_off_s * 1e3:.2f} ms (sampler off) / "
        f"{fmt(None if ia.iteration_time_s is None else ia.iteration_time_s * 1e3, '.2f')} ms (on), "
        f"overhead {fmt(over, '+.2f')} %" + (f"  [{ia.reason}]" if ia.reason else "")
    )

    kt = None
    if args.kernel_trace and jax.default_backend() == "gpu":
        log(f"{name}: kernel trace of {args.trace_iters} iteration(s)")
        kt = xplane.kernel_trace(
            fn, state, logdir=os.path.join(out_dir, "traces", name), repeats=args.trace_iters
        )
        atomic_write_text(os.path.join(out_dir, f"{name}.kernels.md"), xplane.kernels_markdown(name, kt))
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


def table(rows: list[dict]) -> str:
    f = fmt
    columns = [("config", "l"), ("fused ms/iter", "r"), ("mean SM %", "r"), ("occupancy %", "r"),
               ("sampler overhead %", "r"), ("top idle phase", "l"), ("idle ms/iter", "r"),
               ("windows", "r"), ("outputs match", "l")]
    return common.config_table(columns, rows, lambda r: [
        f(r["fused_iteration_ms"], ".2f"), f(r["mean_sm_util"]), f(r["mean_sm_occupancy"]),
        f(r["sampler_overhead_pct"], "+.2f"), r["top_idle_phase"] or "-",
        f(r["top_idle_ms_per_iteration"], ".3f"), str(r["windows"]), str(r["outputs_match"]),
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(p, num_envs=(1024, 8192), budget_s=230.0, default_out=DEFAULT_OUT)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loop-iterations", type=int, default=4, help="loop iterations timed per loop at level 2")
    p.add_argument("--period-ms", type=float, default=10.0)
    p.add_argument("--window-ms", type=float, default=100.0, help="GPM averaging window")
    p.add_argument("--threshold", type=float, default=50.0, help="SM activity %% below which time is 'low'")
    p.add_argument("--min-window-ms", type=float, default=0.0)
    p.add_argument("--merge-gap-ms", type=float, default=1.0)
    p.add_argument("--overhead-iters", type=int, default=15)
    p.add_argument("--overhead-rounds", type=int, default=2, help="sampler off/on block pairs")
    p.add_argument("--kernel-trace", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--trace-iters", type=int, default=1)
    common.add_algo_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        common.make_tiny(args, ppo_epochs=2)
        args.repeats, args.overhead_iters, args.loop_iterations = 2, 3, 2
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out_dir, reason = start(args, DEFAULT_OUT, "rose_profile_tiny_")
    configs = common.algo_configs(args, lambda algo, n: run_config(algo, n, args, out_dir))
    rows = common.run_configs(configs, args.budget_s)
    text = table(rows)
    print("\n" + text + "\n", flush=True)
    note = (
        "mean SM % = time-weighted GPM SM_UTIL over fused iterations (sampler on); overhead = median "
        "iteration time with sampler on / off - 1; idle ms/iter = ms of whole-GPU SM idleness per "
        "iteration in that phase (segmented run); GPM resolution ~100 ms."
    )
    atomic_write_text(
        os.path.join(out_dir, "summary.md"), f"# profile summary\n\n{reason}\n\n{text}\n\n{note}\n"
    )
    summary = {"rows": rows, "nvml": reason, "machine": common.machine_info(), "wall_s": common.elapsed()}
    atomic_write_json(os.path.join(out_dir, "summary.json"), summary)
    log(f"done in {common.elapsed():.1f}s; summary in {out_dir}/summary.md")
    return rows


if __name__ == "__main__":
    main()
