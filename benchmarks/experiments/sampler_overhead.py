"""The NVML sampler's overhead: PPO / SAC iterations with the sampler off and on, same process.

For each algorithm and env count on ``ant`` (MJX backend) the fused jitted iteration runs in
blocks that alternate sampler off / on (``rose_jax.profile.iteration_activity``; process-mode
sampler, GPM ``SM_UTIL``/``SM_OCCUPANCY``), every iteration fenced with ``block_until_ready``;
overhead = median iteration time on / off - 1. A block lasts at least ``--overhead-block-s``
(several GPM windows), and ``--overhead-rounds`` off/on pairs are interleaved: SAC's iteration
times spread +-10 % between blocks, so 2-3 pairs measure that spread, not the sampler (see
``benchmarks/results/profile/sampler_overhead/README.md``). Writes ``<name>.md`` / ``<name>.json``
into ``--out`` (default ``benchmarks/results/profile/sampler_overhead``, name ``sampler_overhead``).

    python -m benchmarks.experiments.sampler_overhead --algos sac ppo --num-envs 8192 --name 8192_8rounds
    python -m benchmarks.experiments.sampler_overhead --tiny          # CPU plumbing check (no NVML)
"""

from __future__ import annotations

import argparse
import math
import os
import time

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common
from benchmarks.common import fmt, log
from benchmarks.experiments.activity_profile import build, sampling, start

DEFAULT_OUT = os.path.join(common.RESULTS_DIR, "profile", "sampler_overhead")


def overhead_iters(fn, state, args) -> tuple[int, float | None]:
    """``(iterations per sampler-off/on block, the calibration's seconds per iteration or None)``:
    ``--overhead-iters``, raised so that one block lasts at least ``--overhead-block-s`` (several
    GPM windows; per-iteration timing noise averages out)."""
    import jax

    if args.overhead_block_s <= 0:
        return args.overhead_iters, None

    def chain(s):  # one iteration; its state goes on (an iteration returns (state, metrics))
        out = jax.block_until_ready(fn(s))
        return out[0] if isinstance(out, tuple) else s

    # two untimed calls: the compile, then the first call on the iteration's own output (its
    # arrays can take the dispatch slow path once); then the median of 3 timed iterations, so
    # that one slow call does not shrink the block
    s = chain(chain(state))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        s = chain(s)
        times.append(time.perf_counter() - t)
    per_iter = sorted(times)[1]
    return max(args.overhead_iters, math.ceil(args.overhead_block_s / max(per_iter, 1e-6))), per_iter


def run_overhead(algo: str, num_envs: int, args) -> dict:
    """Sampler overhead only: the fused iteration in blocks with the sampler off / on (same process)."""
    import jax

    from rose_jax import profile as rp

    env_name = args.env
    name = f"{algo}_{env_name}_{num_envs}"
    log(f"{name}: building env, config and initial state")
    it, state, _ = build(algo, num_envs, args)
    fn = jax.jit(it)
    iters, calib_s = overhead_iters(fn, jax.block_until_ready(state), args)
    log(f"{name}: sampler overhead, {iters} iterations x {args.overhead_rounds} rounds, off/on")
    ia = rp.iteration_activity(fn, state, iters=iters, rounds=args.overhead_rounds, **sampling(args))
    over = None if ia.overhead is None else 100 * ia.overhead
    on_ms = None if ia.iteration_time_s is None else ia.iteration_time_s * 1e3
    log(
        f"{name}: iteration {ia.iteration_time_off_s * 1e3:.3f} ms (sampler off) / {fmt(on_ms, '.3f')} ms "
        f"(on): overhead {fmt(over, '+.2f')} %; mean SM {fmt(ia.mean_sm_util)} %; quantiles off "
        f"{_quantiles(ia.times_off_s)} on {_quantiles(ia.times_on_s)}"
        + (f"  [{ia.reason}]" if ia.reason else "")
    )
    return {
        "name": name, "algo": algo, "env": env_name, "num_envs": num_envs,
        "iterations_per_block": iters, "rounds": args.overhead_rounds,
        "calibration_iteration_ms": None if calib_s is None else calib_s * 1e3,
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
    columns = [("config", "l"), ("iterations x rounds", "r"), ("ms/iter sampler off", "r"),
               ("ms/iter sampler on", "r"), ("overhead %", "r"), ("mean SM %", "r")]
    return common.config_table(columns, rows, lambda r: [
        f"{r['iterations_per_block']} x {r['rounds']}", f"{r['iteration_ms_sampler_off']:.3f}",
        fmt(r["iteration_ms_sampler_on"], ".3f"), fmt(r["sampler_overhead_pct"], "+.2f"),
        fmt(r["mean_sm_util"]),
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(p, num_envs=(1024,), budget_s=230.0, default_out=DEFAULT_OUT)
    p.add_argument("--name", default="sampler_overhead", help="file stem of the .md / .json in --out")
    p.add_argument("--period-ms", type=float, default=10.0, help="sampling period")
    p.add_argument("--window-ms", type=float, default=100.0, help="GPM averaging window")
    p.add_argument("--overhead-iters", type=int, default=15, help="iterations per block, at least")
    p.add_argument("--overhead-rounds", type=int, default=None, help="off/on pairs (default 8; --tiny 2)")
    p.add_argument(
        "--overhead-block-s", type=float, default=None,
        help="raise iterations per block to last this long (default 0.5; --tiny 0 = off)",
    )
    common.add_algo_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        common.make_tiny(args, ppo_epochs=2)
        args.overhead_iters = 3
    if args.overhead_block_s is None:
        args.overhead_block_s = 0.0 if args.tiny else 0.5
    if args.overhead_rounds is None:
        args.overhead_rounds = 2 if args.tiny else 8
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out_dir, reason = start(args, DEFAULT_OUT, "rose_sampler_overhead_tiny_")
    configs = common.algo_configs(args, lambda algo, n: run_overhead(algo, n, args))
    rows = common.run_configs(configs, args.budget_s)
    text = overhead_table(rows)
    print("\n" + text + "\n", flush=True)
    m = common.machine_info()
    head = f"{m['date']} on {m.get('gpu', m.get('backend'))}; jax {m['jax']}; `{m['command']}`"
    note = (
        "overhead = median iteration time with the NVML sampler (process mode, 10 ms period, GPM "
        "SM_UTIL/SM_OCCUPANCY) running / stopped - 1; blocks alternate off/on in one process, each "
        "iteration fenced with block_until_ready."
    )
    stem = os.path.join(out_dir, args.name)
    atomic_write_text(stem + ".md", f"# Sampler overhead\n\n{head}\n\nNVML: {reason}\n\n{text}\n\n{note}\n")
    doc = {"rows": rows, "nvml": reason, "machine": m, "wall_s": common.elapsed()}
    atomic_write_json(stem + ".json", doc)
    log(f"done in {common.elapsed():.1f}s; {stem}.md")
    return rows


if __name__ == "__main__":
    main()
