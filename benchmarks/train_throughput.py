"""PPO training throughput: rose-jax's PPO vs Brax's own ``ppo.train``, same hyperparameters, same run.

    python -m benchmarks.train_throughput                       # ant (MJX), 4096 envs (the H200 run)
    python -m benchmarks.train_throughput --tiny                # a CPU smoke run (plumbing only)

Both trainers use the same environment (Brax's ant on the MJX backend, episode length 1000,
first-state auto-reset), network sizes (policy 4x32, value 5x256, swish), and PPO hyperparameters,
with Brax's ``batch_size * num_minibatches == num_envs`` so that each Brax training step collects one
unroll of every env, like one rose-jax iteration. Env-steps/s excludes compilation: for Brax it is its
own ``training/sps`` metric of the epochs after the first, for rose-jax the median over timed blocks
of iterations after a warm-up (host loop over the jitted iteration, as ``algos.ppo.train`` runs it).
Results: benchmarks/results/train_throughput.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks import common


def hyperparameters(args) -> dict:
    return dict(
        num_envs=args.num_envs,
        unroll_length=args.unroll_length,
        num_minibatches=args.num_minibatches,
        num_epochs=args.num_epochs,
        learning_rate=3e-4,
        entropy_cost=1e-2,
        discounting=0.97,
        gae_lambda=0.95,
        clipping_epsilon=0.3,
        reward_scaling=10.0,
        normalize_observations=True,
        max_grad_norm=None,
    )


def run_rose(args, hp: dict) -> dict:
    import jax

    import envs
    from algos import ppo

    env = envs.make(args.env, backend=args.backend, episode_length=args.episode_length)
    config = ppo.PPOConfig(
        **hp,
        policy_hidden_sizes=(32,) * 4,
        value_hidden_sizes=(256,) * 5,
        activation="swish",
        num_timesteps=args.num_envs * args.unroll_length * (args.iters + args.warmup),
        seed=0,
    )
    state = ppo.init(config, env, jax.random.PRNGKey(0))
    step = jax.jit(ppo.iteration(config, env), donate_argnums=0)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        state, metrics = step(state)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    per_block = max(1, args.iters // args.blocks)
    rates = []
    for b in range(args.blocks):
        t0 = time.perf_counter()
        for _ in range(per_block):
            state, metrics = step(state)
        jax.block_until_ready(state)
        dt = time.perf_counter() - t0
        rates.append(per_block * args.num_envs * args.unroll_length / dt)
        print(f"  rose-jax block {b + 1}/{args.blocks}: {rates[-1]:,.0f} env-steps/s", flush=True)
    return {"env_steps_per_s": statistics.median(rates), "blocks": rates, "warmup_s": compile_s}


def run_brax(args, hp: dict) -> dict:
    from benchmarks import brax_shim

    brax_shim.install()
    import functools

    from brax import envs as brax_envs
    from brax.training.agents.ppo import networks as ppo_networks
    from brax.training.agents.ppo import train as brax_ppo

    env = brax_envs.get_environment(args.env, backend=args.backend)
    per_epoch = args.num_envs * args.unroll_length * max(1, args.iters // args.blocks)
    rates = []

    def progress(step, metrics):
        if "training/sps" in metrics:
            rates.append(float(metrics["training/sps"]))
            print(f"  brax epoch at step {step:,}: {rates[-1]:,.0f} env-steps/s", flush=True)

    t0 = time.perf_counter()
    brax_ppo.train(
        env,
        num_timesteps=per_epoch * (args.blocks + 1),
        num_evals=args.blocks + 2,
        run_evals=False,
        episode_length=args.episode_length,
        num_envs=hp["num_envs"],
        batch_size=hp["num_envs"] // hp["num_minibatches"],
        num_minibatches=hp["num_minibatches"],
        unroll_length=hp["unroll_length"],
        num_updates_per_batch=hp["num_epochs"],
        learning_rate=hp["learning_rate"],
        entropy_cost=hp["entropy_cost"],
        discounting=hp["discounting"],
        gae_lambda=hp["gae_lambda"],
        clipping_epsilon=hp["clipping_epsilon"],
        reward_scaling=hp["reward_scaling"],
        normalize_observations=hp["normalize_observations"],
        network_factory=functools.partial(
            ppo_networks.make_ppo_networks,
            policy_hidden_layer_sizes=(32,) * 4,
            value_hidden_layer_sizes=(256,) * 5,
        ),
        progress_fn=progress,
        seed=0,
    )
    total_s = time.perf_counter() - t0
    # Brax's first two epochs include compilation (its first call and a recompile): skip them.
    timed = rates[2:] if len(rates) > 3 else rates[-1:]
    return {"env_steps_per_s": statistics.median(timed), "blocks": rates, "total_s": total_s}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="ant")
    p.add_argument("--backend", default="mjx")
    p.add_argument("--num-envs", type=int, default=4096)
    p.add_argument("--unroll-length", type=int, default=10)
    p.add_argument("--num-minibatches", type=int, default=16)
    p.add_argument("--num-epochs", type=int, default=4)
    p.add_argument("--episode-length", type=int, default=1000)
    p.add_argument("--iters", type=int, default=60, help="timed iterations (Brax: training steps)")
    p.add_argument("--blocks", type=int, default=4, help="timed blocks (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: 16 envs, few iterations")
    p.add_argument("--out", default=os.path.join(common.RESULTS_DIR, "train_throughput"))
    args = p.parse_args(argv)
    if args.tiny:
        args.num_envs, args.num_minibatches, args.iters, args.blocks, args.unroll_length = 16, 4, 4, 2, 5
        args.episode_length = 100
    hp = hyperparameters(args)
    print(f"PPO throughput on {args.env} ({args.backend}), {args.num_envs} envs, hp={hp}", flush=True)
    print("rose-jax PPO:", flush=True)
    rose = run_rose(args, hp)
    print("Brax ppo.train:", flush=True)
    brax = run_brax(args, hp)
    ratio = rose["env_steps_per_s"] / brax["env_steps_per_s"]
    info = common.machine_info()
    result = {
        "machine": info,
        "env": args.env,
        "backend": args.backend,
        "hyperparameters": hp,
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
        common.write_json(args.out + ".json", result)
        common.atomic_write(args.out + ".md", md)
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
