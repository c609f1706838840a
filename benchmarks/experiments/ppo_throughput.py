"""PPO training throughput: rose-jax's PPO vs Brax's own ``ppo.train``, same hyperparameters, same run.

    python -m benchmarks.experiments.ppo_throughput           # ant (MJX), 4096 envs (the H200 run)
    python -m benchmarks.experiments.ppo_throughput --tiny    # a CPU smoke run (plumbing only)

Both trainers use the same environment (Brax's ant on the MJX backend, episode length 1000,
first-state auto-reset), network sizes (policy 4x32, value 5x256, swish), and PPO hyperparameters:
the suite's PPO row (:func:`benchmarks.suite.workloads.ppo_row`), with Brax's
``batch_size * num_minibatches == num_envs`` so that each Brax training step collects one unroll of
every env, like one rose-jax iteration; Brax runs through :func:`benchmarks.suite.baselines.brax_ppo_train`.
Env-steps/s excludes compilation: for Brax it is its own ``training/sps`` metric of the epochs
after the first two, for rose-jax the median over timed blocks of iterations after a warm-up (a
host loop over the jitted iteration, as ``algos.ppo.train`` runs it; the suite's (b) scans K
iterations in one jit instead). Results: benchmarks/results/train_throughput.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common
from benchmarks.suite import workloads as S


def workload(args) -> S.Workload:
    """The measured row: PPO on ``args.env`` with the suite's hyperparameters and this run's shape."""
    hp = dict(
        S.PPO_HP,
        unroll_length=args.unroll_length,
        num_minibatches=args.num_minibatches,
        num_epochs=args.num_epochs,
        reward_scaling=S.REWARD_SCALING.get(args.env, 1.0),
    )
    return S.ppo_row(
        args.env,
        args.num_envs,
        (32,) * 4,
        backend=args.backend,
        brax_env=args.env,
        episode_length=args.episode_length,
        hyperparameters=tuple(hp.items()),
        iterations_per_block=max(1, args.iters // args.blocks),
        blocks=args.blocks,
        variants=("brax", "single_jit"),
        return_threshold=None,
    )


def run_rose(w: S.Workload, warmup: int) -> dict:
    """``warmup`` iterations (compile), then ``w.blocks`` timed blocks of K iterations, host loop."""
    import jax

    import algos

    env = w.make_env()
    config = w.config(env)
    algo = algos.get("ppo")
    state = algo.init(config, env, jax.random.PRNGKey(w.seed))
    step = jax.jit(algo.iteration(config, env), donate_argnums=0)
    t0 = time.perf_counter()
    for _ in range(warmup):
        state, _ = step(state)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    rates = []
    for b in range(w.blocks):
        t0 = time.perf_counter()
        for _ in range(w.iterations_per_block):
            state, _ = step(state)
        jax.block_until_ready(state)
        rates.append(w.env_steps_per_call / (time.perf_counter() - t0))
        print(f"  rose-jax block {b + 1}/{w.blocks}: {rates[-1]:,.0f} env-steps/s", flush=True)
    return {"env_steps_per_s": statistics.median(rates), "blocks": rates, "warmup_s": compile_s}


def run_brax(w: S.Workload) -> dict:
    """Brax's ``ppo.train`` for ``w.blocks + 1`` epochs of K training steps; its first two epochs compile."""
    from benchmarks.suite import baselines

    run = baselines.brax_ppo_train(w, w.config(w.make_env()), epochs=w.blocks + 1)
    for i, sps in enumerate(run.sps):
        print(f"  brax epoch {i + 1}: {sps:,.0f} env-steps/s", flush=True)
    timed = run.sps[2:] if len(run.sps) > 3 else run.sps[-1:]
    return {"env_steps_per_s": statistics.median(timed), "blocks": run.sps, "total_s": run.total_s}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_env_args(p, num_envs=4096)
    p.add_argument("--unroll-length", type=int, default=10)
    p.add_argument("--num-minibatches", type=int, default=16)
    p.add_argument("--num-epochs", type=int, default=4)
    p.add_argument("--episode-length", type=int, default=1000)
    p.add_argument("--iters", type=int, default=60, help="timed iterations (Brax: training steps)")
    p.add_argument("--blocks", type=int, default=4, help="timed blocks (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: 16 envs, few iterations")
    p.add_argument("--out", default=os.path.join(common.RESULTS_DIR, "train_throughput"), help="file stem")
    args = p.parse_args(argv)
    if args.tiny:
        args.num_envs, args.num_minibatches, args.iters, args.blocks, args.unroll_length = 16, 4, 4, 2, 5
        args.episode_length = 100
    w = workload(args)
    print(f"PPO throughput on {args.env} ({args.backend}), {args.num_envs} envs, hp={w.hp}", flush=True)
    print("rose-jax PPO:", flush=True)
    rose = run_rose(w, args.warmup)
    print("Brax ppo.train:", flush=True)
    brax = run_brax(w)
    ratio = rose["env_steps_per_s"] / brax["env_steps_per_s"]
    info = common.machine_info()
    result = {
        "machine": info,
        "env": args.env,
        "backend": args.backend,
        "hyperparameters": w.to_json()["hyperparameters"],
        "rose_jax": rose,
        "brax": brax,
        "ratio_rose_over_brax": ratio,
    }
    table = common.markdown_table(
        ["trainer", "env-steps/s (median)", "blocks"],
        [
            ["rose-jax PPO", rose["env_steps_per_s"], ", ".join(f"{r:,.0f}" for r in rose["blocks"])],
            ["Brax ppo.train", brax["env_steps_per_s"], ", ".join(f"{r:,.0f}" for r in brax["blocks"])],
            ["ratio rose/brax", ratio, ""],
        ],
    )
    md = (
        f"# PPO training throughput: {args.env} ({args.backend}), {args.num_envs} envs\n\n"
        f"{info['date']} on {info.get('gpu', info['devices'])}; jax {info['jax']}, brax {info.get('brax')}, "
        f"mujoco {info.get('mujoco')}.\nCommand: `{info['command']}`\n\n{table}\n"
    )
    if not args.tiny:
        atomic_write_json(args.out + ".json", result)
        atomic_write_text(args.out + ".md", md)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(
            ["rose-jax PPO", "Brax ppo.train"],
            [rose["env_steps_per_s"], brax["env_steps_per_s"]],
            color=["tab:red", "tab:gray"],
        )
        ax.set_ylabel("env-steps/s")
        ax.set_title(f"PPO {args.env} ({args.backend}) {args.num_envs} envs")
        common.save_plot(fig, args.out + ".png")
    print(md)


if __name__ == "__main__":
    main()
