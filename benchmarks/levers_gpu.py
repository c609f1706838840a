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

    python benchmarks/levers_gpu.py                       # H200, about 4-5 minutes
    python benchmarks/levers_gpu.py --tiny                # CPU plumbing check (pendulum)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

T0 = time.perf_counter()
CB_LOOPS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


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

    from algos import ppo, sac
    from benchmarks.common import algo_config
    from rose_jax.optimize import measure

    import envs

    env = envs.make(args.env, **({} if args.backend == "none" else {"backend": args.backend}))
    key = jax.random.PRNGKey(0)
    hidden = tuple(args.hidden)
    if algo == "ppo":
        config = algo_config(algo, num_envs, args, policy_hidden_sizes=hidden, value_hidden_sizes=hidden)
        fn, state = ppo.iteration(config, env), ppo.init(config, env, key)
        per_iter = config.steps_per_iteration
    else:
        config = algo_config(algo, num_envs, args, policy_hidden_sizes=hidden, q_hidden_sizes=hidden,
                             num_eval_envs=0)
        fn, state = sac.iteration(config, env), sac.init(config, env, key)
        per_iter = num_envs * config.steps_per_iteration
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["ppo:2048", "ppo:8192", "sac:2048", "sac:8192"])
    p.add_argument("--variants", nargs="+", default=["base", "cb_loops", "cb_loops_min1", "unroll_sim"])
    p.add_argument("--env", default="ant")
    p.add_argument("--backend", default="mjx")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "levers"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    from benchmarks.common import add_algo_args  # noqa: PLC0415 - after the sys.path set-up

    add_algo_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.env, args.backend, args.configs, args.hidden = "pendulum", "none", ["ppo:8", "sac:8"], [16]
        args.ppo_unroll, args.ppo_minibatches, args.ppo_epochs = 4, 2, 1
        args.sac_batch, args.sac_grad_updates, args.sac_replay = 16, 2, 1024
        args.iters, args.repeats = 2, 2
        args.out = tempfile.mkdtemp(prefix="rose_levers_")
    import jax

    from benchmarks.common import atomic_write, machine_info, write_json

    log(f"jax {jax.__version__} {jax.devices()}")
    rows = []
    for c in args.configs:
        algo, n = c.split(":")
        if time.perf_counter() - T0 > args.budget_s:
            log(f"{c}: skipped (budget)")
            continue
        try:
            rows += run_config(algo, int(n), args)
        except Exception as e:  # noqa: BLE001
            log(f"{c}: FAILED {type(e).__name__}: {str(e)[:300]}")
    os.makedirs(args.out, exist_ok=True)
    meta = machine_info()
    write_json(os.path.join(args.out, "levers.json"), {"machine": meta, "rows": rows})
    text = table(rows)
    atomic_write(os.path.join(args.out, "levers.md"),
                 f"# levers_gpu\n\n{meta.get('date')} on {meta.get('gpu', meta['devices'])}; "
                 f"jax {meta['jax']}\n"
                 f"command: `{meta['command']}`\n\n{text}\n")
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
