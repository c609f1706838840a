"""PPO on MJX ant: 1 GPU vs all local GPUs (data parallel via jax.sharding), same global batch.

    python -m benchmarks.experiments.data_parallel --num-envs 8192     # on a machine with >= 2 GPUs

Prints env-steps/s for the single-device run and the data-parallel run (``rose_jax.distributed``)
and their ratio, and records whether parameters after a few iterations agree to float tolerance.
Results: benchmarks/results/data_parallel.{json,md}. (A per-GPU rose-jax plan is found by running
:mod:`benchmarks.experiments.optimizer_speedup` with ``CUDA_VISIBLE_DEVICES`` set to each GPU.)
"""

from __future__ import annotations

import argparse
import os
import time

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common


def _rate(step, state, iters, steps_per_iter):
    import jax

    state, _ = step(state)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(iters):
        state, _ = step(state)
    jax.block_until_ready(state)
    return iters * steps_per_iter / (time.perf_counter() - t0), state


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_env_args(p, num_envs=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.path.join(common.RESULTS_DIR, "data_parallel"), help="file stem")
    args = p.parse_args(argv)

    import chex
    import jax

    from algos import ppo
    from rose_jax import distributed

    if jax.device_count() < 2:
        raise SystemExit(f"data_parallel: needs >= 2 devices, found {jax.devices()}")
    env = common.make_env(args)
    config = ppo.PPOConfig(
        num_envs=args.num_envs,
        unroll_length=10,
        num_minibatches=16,
        num_epochs=4,
        policy_hidden_sizes=(32,) * 4,
        value_hidden_sizes=(256,) * 5,
        activation="swish",
    )
    it = ppo.iteration(config, env)
    state0 = ppo.init(config, env, jax.random.PRNGKey(0))
    per_iter = config.num_envs * config.unroll_length
    one_rate, one_state = _rate(jax.jit(it), state0, args.iters, per_iter)
    print(f"1 device: {one_rate:,.0f} env-steps/s", flush=True)
    mesh = distributed.make_mesh()
    par0 = distributed.shard_state(state0, mesh)
    dp_rate, dp_state = _rate(distributed.data_parallel(it, par0, mesh), par0, args.iters, per_iter)
    print(f"{jax.device_count()} devices: {dp_rate:,.0f} env-steps/s", flush=True)
    equal = True
    try:
        chex.assert_trees_all_close(
            jax.device_get(dp_state.params), jax.device_get(one_state.params), rtol=1e-3, atol=1e-5
        )
    except AssertionError:
        equal = False
    info = common.machine_info()
    result = {
        "machine": info,
        "num_envs": args.num_envs,
        "one_device": one_rate,
        "data_parallel": dp_rate,
        "devices": jax.device_count(),
        "ratio": dp_rate / one_rate,
        "params_equal": equal,
    }
    table = common.markdown_table(
        ["run", "env-steps/s"],
        [["1 GPU", one_rate], [f"{jax.device_count()} GPUs", dp_rate], ["ratio", dp_rate / one_rate]],
    )
    atomic_write_json(args.out + ".json", result)
    atomic_write_text(
        args.out + ".md",
        f"# PPO {args.env}: 1 vs {jax.device_count()} GPUs\n\n"
        f"{info['date']}, {info.get('gpu')}\n\n{table}\n\nparams equal: {equal}\n",
    )
    print(table)


if __name__ == "__main__":
    main()
