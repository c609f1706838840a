"""Which levers move an MJX training iteration on this GPU? One run, same process, same state.

For each (algo, num_envs) on ``ant`` (MJX) this compiles the untransformed iteration and a few
variants, times them in turns (A B C A B C ...), and checks that one iteration of each variant
from the same state gives the same state as the baseline's (max |diff| over float leaves; integer
leaves must match). Variants:

  base          jax.jit(iteration)
  cb_loops      jax.jit(iteration, compiler_options=...): XLA command buffers (CUDA graphs) that
                also capture while loops and conditionals (+WHILE,+CONDITIONAL), so a whole
                scan runs as one graph launch instead of one host-side launch per kernel
  cb_loops_min1 the same with xla_gpu_graph_min_graph_size=1
  unroll_sim    the physics substep / solver scans inside the rollout fully unrolled (jaxpr rewrite)

Writes ``levers.json`` and ``levers.md`` into --out (default benchmarks/results/levers/) and
prints a short table last.

    python -m benchmarks.experiments.iteration_levers          # H200, about 4-5 minutes
    python -m benchmarks.experiments.iteration_levers --tiny   # CPU plumbing check (pendulum)
"""

from __future__ import annotations

import argparse
import os
import time

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common
from benchmarks.common import log

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
DEFAULT_OUT = os.path.join(common.RESULTS_DIR, "levers")
CB_LOOPS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"


def variants(algo: str):
    import jax

    from rose_jax import optimize as O

    sim = "rollout/sim" if algo == "ppo" else "collect/sim"
    return {
        "base": lambda fn: jax.jit(fn),
        "cb_loops": lambda fn: jax.jit(fn, compiler_options={"xla_gpu_enable_command_buffer": CB_LOOPS}),
        "cb_loops_min1": lambda fn: jax.jit(
            fn,
            compiler_options={"xla_gpu_enable_command_buffer": CB_LOOPS, "xla_gpu_graph_min_graph_size": 1},
        ),
        "unroll_sim": lambda fn: jax.jit(O.unroll_scans(True, sim).apply(fn)),
    }


def run_config(algo: str, num_envs: int, args) -> list[dict]:
    import jax

    import algos
    from rose_jax.optimize import measure

    extra = {"num_eval_envs": 0} if algo == "sac" else {}
    env, config, state = common.algo_setup(algo, num_envs, args, args.hidden, **extra)
    fn = algos.get(algo).iteration(config, env)
    per_iter = config.env_steps_per_iteration
    names = [v for v in variants(algo) if v in args.variants]
    steps = {}
    for v in names:
        t = time.perf_counter()
        step = variants(algo)[v](fn)
        try:
            jax.block_until_ready(step(state))
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
            log(f"{algo}-{num_envs} {v}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        steps[v] = step
        log(f"{algo}-{num_envs} {v}: compiled in {time.perf_counter() - t:.1f}s")
    # a state a few iterations in (replay filled / normalizer moving), then equality from it
    s = state
    for _ in range(2):
        s, _ = steps["base"](s)
    ref, _ = steps["base"](s)
    again, _ = steps["base"](s)
    rerun = measure.compare_trees(again, ref)
    timed = measure.time_alternating(list(steps.values()), s, args.iters, args.repeats)
    rows = []
    base_ms = timed[0][1].median * 1e3
    for (v, step), (_, timing) in zip(steps.items(), timed, strict=True):
        out, _ = step(s)
        cmp = measure.compare_trees(out, ref)
        ms = timing.median * 1e3
        rows.append({
            "algo": algo, "num_envs": num_envs, "variant": v, "ms_per_iter": ms,
            "mad_ms": timing.mad * 1e3, "env_steps_per_s": per_iter / timing.median,
            "speedup": base_ms / ms, "equal_bitwise": bool(cmp.equal), "max_abs_diff": cmp.max_abs,
            "baseline_rerun_max_abs_diff": rerun.max_abs,
        })
        log(f"{algo}-{num_envs} {v}: {ms:.2f} ms/iter (mad {timing.mad * 1e3:.2f}), "
            f"{per_iter / timing.median:,.0f} env-steps/s, {base_ms / ms:.3f}x; one-iteration max|d| "
            f"{cmp.max_abs:.3g} (baseline vs itself {rerun.max_abs:.3g})")
    return rows


def table(rows) -> str:
    out = ["| config | variant | ms/iter | env-steps/s | vs base | max abs diff (1 iter) | base vs itself |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['algo']}-{r['num_envs']} | {r['variant']} | {r['ms_per_iter']:.2f} | "
                   f"{r['env_steps_per_s']:,.0f} | {r['speedup']:.3f}x | {r['max_abs_diff']:.3g} | "
                   f"{r['baseline_rerun_max_abs_diff']:.3g} |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["ppo:2048", "ppo:8192", "sac:2048", "sac:8192"])
    p.add_argument("--variants", nargs="+", default=["base", "cb_loops", "cb_loops_min1", "unroll_sim"])
    p.add_argument("--env", default="ant")
    p.add_argument("--backend", default="mjx")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--out", default=None, help=f"output dir (default {DEFAULT_OUT}; --tiny: a temp dir)")
    p.add_argument("--tiny", action="store_true")
    common.add_algo_args(p, hidden=(256, 256))
    args = p.parse_args(argv)
    if args.tiny:
        args.env, args.backend, args.configs, args.hidden = "pendulum", "none", ["ppo:8", "sac:8"], [16]
        common.shrink_algo_args(args)
        args.iters, args.repeats, args.budget_s = 2, 2, max(args.budget_s, 1e9)
    import jax

    log(f"jax {jax.__version__} {jax.devices()}")
    start = time.perf_counter()
    rows = []
    for c in args.configs:
        algo, n = c.split(":")
        if time.perf_counter() - start > args.budget_s:
            log(f"{c}: skipped (budget)")
            continue
        try:
            rows += run_config(algo, int(n), args)
        except Exception as e:  # noqa: BLE001
            log(f"{c}: FAILED {type(e).__name__}: {str(e)[:300]}")
    meta = common.machine_info()
    out = common.output_dir(args, DEFAULT_OUT, "rose_levers_")
    atomic_write_json(os.path.join(out, "levers.json"), {"machine": meta, "rows": rows})
    text = table(rows)
    atomic_write_text(
        os.path.join(out, "levers.md"),
        f"# iteration_levers\n\n{meta.get('date')} on {meta.get('gpu', meta['devices'])}; jax {meta['jax']}\n"
        f"command: `{meta['command']}`\n\n{text}\n",
    )
    print("\n" + text, flush=True)
    return rows


if __name__ == "__main__":
    main()
