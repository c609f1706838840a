"""Several processes on one GPU (issue 18): env groups in worker processes vs the fused iteration,
the exchange's round trips, and the offloaded evaluation with slack-aware SM quotas vs without.

    python -m benchmarks.experiments.env_groups --mps-client   # the H200 run (< 8 min; --budget-s guards it)
    python -m benchmarks.experiments.env_groups --smoke        # CPU plumbing check (pendulum, tiny; temp dir)

Workload: PPO on MJX ant (``envs.make("ant", backend="mjx")``), the suite's PPO hyperparameters
(unroll 10, 16 minibatches, 4 epochs, value 5x256). Rows, in order; each is contained (a failing
row is reported, the next one runs) and a row whose estimated cost no longer fits ``--budget-s``
is skipped with that reason:

1. ``groups_4x32`` / ``groups_3x1024`` (2048 envs, policy 4x32 or 3x1024): the fused iteration
   (one jitted program) and ``group_rollout(G, "processes")`` (G worker processes, env state
   resident in them), timed in turns. Per iteration: the driver's overhead (the collect's wall
   time outside the workers' round trip), the exchange's overhead (the round trip outside the
   workers' rollouts), the learn step; traces/compiles after the first iteration, in the driver
   and in every worker (must be 0); equality after one iteration from the same state.
2. ``exchange``: one worker, round trips of 1 MB and 64 MB (jax GPU arrays: CUDA IPC where the
   runtime chose it) through the persistent staging buffers vs a new buffer per message.
3. ``offload_2048`` / ``offload_8192``: Brax's train loop unit (``ppo.epoch``: ``--epoch-env-steps``
   of training, then an evaluation of ``--eval-envs`` envs for a whole episode), as in
   ``optimizer_speedup --unit epoch``: the untransformed epoch, the evaluation offloaded to a
   worker without a quota, and with the quota the slack-aware search chose (branches timed alone
   at ``--quota-grid``), all timed in turns; the search's points and choice are kept.
4. ``search_4x32``: ``rose_jax.optimize.optimize`` over ``group:G:processes`` for the 4x32 row: its
   verdict and reason (refused quickly with the measured times when not faster, never an exception).

Results: ``benchmarks/results/multiprocess/env_groups.{json,md,png}`` (machine, versions, command,
date), written atomically after every row; a short table is printed last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common
from benchmarks.common import fmt, log

# worker processes share the GPU with this driver: it must not grab 75% of the memory at its
# first JAX call (read when JAX starts its GPU backend)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

DEFAULT_OUT = os.path.join(common.RESULTS_DIR, "multiprocess")
POLICIES = {"4x32": (32,) * 4, "3x1024": (1024,) * 3}
SMOKE_POLICIES = {"4x32": (8,), "3x1024": (32, 32)}
MB = 1 << 20
# seconds a row takes on the H200 (compiles included, from a cold compilation cache): what the
# budget check adds to the elapsed time before starting a row
# (groups: ~75 s measured on 2026-12-04, plus the deterministic-ops check's extra compiles, unmeasured)
ESTIMATE_S = {"groups": 120.0, "exchange": 15.0, "offload": 240.0, "search": 70.0}
# An offload row's estimate grows with its envs: the H200's 2048-env row took 216 s with 3 epochs per
# timed run (2026-12-04 11:27; nearly all of it the quota step: probes at 30/50/70 % plus the end-to-end
# turns); an epoch is --epoch-env-steps of training whatever the envs, but compiles and the
# evaluation (all of --eval-envs for an episode) grow with them.
OFFLOAD_S_PER_2048_ENVS = 40.0


def estimate_s(name: str, kind: str) -> float:
    """Seconds the budget check expects row ``name`` of ``kind`` to take on the H200."""
    if kind == "offload":
        n = int(name.rsplit("_", 1)[1])
        return ESTIMATE_S["offload"] + OFFLOAD_S_PER_2048_ENVS * (n / 2048 - 1)
    return ESTIMATE_S[kind]


# ----------------------------------------------------------------------------------- workloads


def ppo_setup(args, num_envs: int, policy: tuple[int, ...]):
    """``(ppo, env, config, program, state)`` of this run's PPO workload."""
    import jax

    import envs
    from algos import ppo
    from benchmarks.suite import workloads as S

    if args.smoke:
        env_name, env_kw = "pendulum", ()
        over = dict(unroll_length=4, num_minibatches=2, num_epochs=1, value_hidden_sizes=(8,))
    else:
        env_name, env_kw = "ant", (("backend", "mjx"),)
        over = dict(S.PPO_HP, reward_scaling=S.REWARD_SCALING["ant"])
    config = ppo.PPOConfig(**{**over, "num_envs": num_envs, "policy_hidden_sizes": policy, "seed": args.seed})
    env = envs.make(env_name, **dict(env_kw))
    program = ppo.program(config, env, env_name=env_name, env_kwargs=env_kw)
    state = ppo.init(config, env, jax.random.PRNGKey(args.seed))
    return ppo, env, config, program, state


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _median(xs) -> float | None:
    import numpy as np

    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


# ------------------------------------------------------------------------------- env groups


def envs_differing(a: Any, b: Any, rtol: float) -> int:
    """How many envs (leading axis of every leaf) differ beyond ``rtol`` of the leaf's largest
    magnitude in any leaf: a few envs = chaotic divergence (another termination), all = a bug."""
    import jax
    import numpy as np

    bad = None
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.ndim == 0:
            continue
        scale = max(float(np.nanmax(np.abs(y))) if y.size else 0.0, 1e-12)
        d = (np.abs(x - y) > rtol * scale).reshape(x.shape[0], -1).any(axis=1)
        bad = d if bad is None else bad | d
    return int(bad.sum()) if bad is not None else 0


def inline_iteration(program, groups: int, state, compiler_options: dict | None = None):
    """One iteration from ``state`` with the workers' functions run in this process, one group after
    the other (the inline executor): the workers' computation without the exchange, which tells a
    transport fault from the groups' own divergence. Returns the state with its env part synced."""
    from rose_jax.optimize import processes, search

    inline = processes.ProcessCollect(program, groups, executor=processes.InlineExecutor())
    try:
        step = search.compile_step(
            program._replace(collect=inline, host=True, groups=groups), compiler_options=compiler_options
        )
        return step.sync_state(step(state)[0])
    finally:
        inline.close()


def groups_row(args, label: str) -> dict:
    import jax

    from rose_jax import optimize as O
    from rose_jax.optimize import measure, process_worker, search

    policy = (SMOKE_POLICIES if args.smoke else POLICIES)[label]
    _, _, config, program, state = ppo_setup(args, args.num_envs, policy)
    steps = config.num_envs * config.unroll_length
    name = f"groups_{label}"
    fused = jax.jit(program.iteration())
    sequential = jax.jit(O.group_rollout(args.groups, "sequential").apply(program).iteration())
    t = O.group_rollout(args.groups, "processes")
    grouped = t.apply(program)
    pc, step = grouped.collect, search.compile_step(grouped)
    try:
        log(f"{name}: fused vs {args.groups} env groups in processes (compiles, workers start)")
        ref_one, _ = fused(state)
        seq_one, _ = sequential(state)
        inline_one = inline_iteration(program, args.groups, state)
        one = step.sync_state(step(state)[0])  # starts the workers, compiles everywhere
        pool = pc.executor.pool
        worker_events = {w: pool.call(w, process_worker.COMPILE_EVENTS, jit=False) for w in pool.names}
        driver_events = process_worker.compile_events()
        n_before = len(pc.stats()["per_iteration"])
        (_, tf), (_, tp) = measure.time_alternating([fused, step], state, args.iters, args.repeats)
        records = [r for r in pc.stats()["per_iteration"][n_before:] if r["kind"] == "iteration"]
        driver_after = process_worker.compile_events()
        worker_after = {w: pool.call(w, process_worker.COMPILE_EVENTS, jit=False) for w in pool.names}
        st = pc.stats()
        try:  # a failure here must not lose the row measured above
            det = deterministic_check(args, program, grouped, state)
        except Exception as e:  # noqa: BLE001 - reported in the row
            log(f"{name}: deterministic-ops check FAILED: {type(e).__name__}: {e}")
            det = {"deterministic_options": None, "det_error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        step.close()
    tol = t.tolerance
    cmp = measure.compare_trees(one, ref_one, tol.rtol, tol.atol)
    cmp_seq = measure.compare_trees(one, seq_one, tol.rtol, tol.atol)
    collect_s = _median([r["wall_s"] for r in records])
    workers_s = _median([r["workers_s"] for r in records])
    run_s = _median([r.get("worker_run_s") for r in records])
    wait_s = _median([r.get("input_wait_s") for r in records]) or 0.0
    decode_s = _median([r.get("worker_decode_s") for r in records])
    encode_s = _median([r.get("worker_encode_s") for r in records])
    row = {
        "name": name,
        "kind": "groups",
        "policy": label,
        "num_envs": config.num_envs,
        "groups": args.groups,
        "steps_per_iteration": steps,
        "fused_ms": tf.median * 1e3,
        "processes_ms": tp.median * 1e3,
        "speedup": tf.median / tp.median,
        "fused_turns_ms": [x * 1e3 for x in tf.per_iter_s],
        "processes_turns_ms": [x * 1e3 for x in tp.per_iter_s],
        "collect_ms": collect_s * 1e3,
        "workers_round_trip_ms": workers_s * 1e3,
        "worker_rollout_ms": run_s * 1e3 if run_s is not None else None,
        # the collect waits for the previous learn's parameters (dispatched asynchronously) before
        # sending them: that wait is the learn's device time, not the driver's or the exchange's
        "input_wait_ms": wait_s * 1e3,
        "driver_before_ms": _ms(_median([r.get("driver_before_s") for r in records])),
        "driver_after_ms": _ms(_median([r.get("driver_after_s") for r in records])),
        "driver_overhead_ms": (collect_s - workers_s - wait_s) * 1e3,
        "exchange_overhead_ms": (workers_s - run_s) * 1e3 if run_s is not None else None,
        "worker_decode_ms": _ms(decode_s),
        "worker_encode_ms": _ms(encode_s),
        "learn_ms": (tp.median - collect_s + wait_s) * 1e3,
        "driver_compiles_after_first": sum(driver_after[k] - driver_events[k] for k in driver_events),
        "worker_compiles_after_first": sum(
            worker_after[w][k] - worker_events[w][k] for w in worker_events for k in worker_events[w]
        ),
        "equal": cmp.equal,
        "max_abs_diff": cmp.max_abs,
        "max_rel_diff": cmp.max_rel,
        "worst_leaf": cmp.worst,
        "envs_differing": envs_differing(one.env_state, ref_one.env_state, 1e-3),
        "equal_to_sequential_groups": cmp_seq.equal,
        "max_abs_diff_sequential": cmp_seq.max_abs,
        "envs_differing_sequential": envs_differing(one.env_state, seq_one.env_state, 1e-3),
        "envs_differing_inline": envs_differing(one.env_state, inline_one.env_state, 1e-3),
        "envs_differing_fused_vs_sequential": envs_differing(seq_one.env_state, ref_one.env_state, 1e-3),
        "max_abs_diff_inline": measure.compare_trees(one, inline_one).max_abs,
        # the same comparisons with every part compiled under xla_gpu_deterministic_ops (driver and
        # workers): MJX's scatter-adds use atomics on the GPU, so the default-option rows above
        # differ even between two runs of one program; these tell a transport fault from that
        **det,
        "tolerance_rtol": tol.rtol,
        "mode": st["mode"],
        "reason": st["reason"],
        "transport": st["transport"],
        "sent_bytes_per_iteration": records[-1]["sent_bytes"] if records else None,
        "received_bytes_per_iteration": records[-1]["received_bytes"] if records else None,
    }
    log(
        f"{name}: fused {row['fused_ms']:.1f} / processes {row['processes_ms']:.1f} ms/iter "
        f"({row['speedup']:.3f}x); driver {row['driver_overhead_ms']:.2f} ms (before sending "
        f"{fmt(row['driver_before_ms'], '.2f')}, merging {fmt(row['driver_after_ms'], '.2f')}), exchange "
        f"{fmt(row['exchange_overhead_ms'], '.2f')} ms (worker decode {fmt(row['worker_decode_ms'], '.2f')}, "
        f"encode {fmt(row['worker_encode_ms'], '.2f')}), waiting for the learn "
        f"{row['input_wait_ms']:.2f} ms, rollout {fmt(row['worker_rollout_ms'])} ms, learn "
        f"{row['learn_ms']:.1f} ms; compiles after the first: driver {row['driver_compiles_after_first']}, "
        f"workers {row['worker_compiles_after_first']}; vs fused: equal={cmp.equal} "
        f"(max|d| {cmp.max_abs:.2g}, "
        f"{row['envs_differing']} envs differ); vs sequential groups: equal={cmp_seq.equal} "
        f"({row['envs_differing_sequential']} envs differ); vs the same worker functions in this process: "
        f"{row['envs_differing_inline']} envs differ; fused vs sequential groups: "
        f"{row['envs_differing_fused_vs_sequential']} envs differ"
    )
    if det.get("deterministic_options"):
        log(
            f"{name}: under {det['deterministic_options']}: processes vs in-process workers "
            f"bitwise={det['det_equal_inline']} ({det['det_envs_differing_inline']} envs differ); vs "
            f"sequential groups {det['det_envs_differing_sequential']}, vs fused "
            f"{det['det_envs_differing_fused']}, fused vs fused (repeat) "
            f"{det['det_envs_differing_fused_repeat']}"
        )
    return row


def deterministic_check(args, program, grouped, state) -> dict:
    """One iteration from ``state`` of the fused program, the sequential groups, the worker functions
    in this process and the worker processes, every part compiled under the search's equality options
    (``xla_gpu_deterministic_ops``; ``--equality-options off`` skips it): ``det_equal_inline`` (processes
    vs the same functions in this process, bitwise) checks the transport; the other counts say how far
    the groups' own computation (other batch shapes) diverges from the fused one."""
    import jax

    from rose_jax import optimize as O
    from rose_jax.optimize import measure, search

    if args.equality_options == "off":
        return {"deterministic_options": None}
    opts = search.DETERMINISTIC
    fused = jax.jit(program.iteration(), compiler_options=opts)
    sequential = jax.jit(
        O.group_rollout(args.groups, "sequential").apply(program).iteration(), compiler_options=opts
    )
    ref = fused(state)[0]
    ref2 = fused(state)[0]
    seq = sequential(state)[0]
    inline_one = inline_iteration(program, args.groups, state, opts)
    proc_step = search.compile_step(grouped, compiler_options=opts)  # the running workers, recompiled
    proc_one = proc_step.sync_state(proc_step(state)[0])
    cmp_inline = measure.compare_trees(proc_one, inline_one)
    return {
        "deterministic_options": sorted(opts),
        "det_equal_inline": cmp_inline.equal,
        "det_max_abs_diff_inline": cmp_inline.max_abs,
        "det_envs_differing_inline": envs_differing(proc_one.env_state, inline_one.env_state, 1e-3),
        "det_equal_fused": measure.compare_trees(proc_one, ref).equal,
        "det_envs_differing_fused": envs_differing(proc_one.env_state, ref.env_state, 1e-3),
        "det_envs_differing_sequential": envs_differing(proc_one.env_state, seq.env_state, 1e-3),
        "det_fused_repeatable": measure.compare_trees(ref, ref2).equal,
        "det_envs_differing_fused_repeat": envs_differing(ref.env_state, ref2.env_state, 1e-3),
    }


def search_row(args) -> dict:
    from rose_jax import optimize as O
    from rose_jax.optimize import base

    _, _, config, program, state = ppo_setup(
        args, args.num_envs, (SMOKE_POLICIES if args.smoke else POLICIES)["4x32"]
    )
    t0 = time.perf_counter()
    step, report = O.optimize(
        program,
        state,
        candidates=[O.group_rollout(args.groups, "processes")],
        n_iters=2,
        repeats=2,
        local=False,
        max_candidates=1,
        log=lambda s: log(f"search_4x32: {s}"),
    )
    base.close(step)
    (rec,) = report.candidates
    return {
        "name": "search_4x32",
        "kind": "search",
        "num_envs": config.num_envs,
        "candidate": rec.label,
        "kept": rec.kept,
        "reason": rec.reason,
        "equal": rec.equal,
        "speedup": rec.speedup,
        "e2e_ms": (rec.e2e_time_s or 0) * 1e3,
        "baseline_ms": (rec.e2e_baseline_s or 0) * 1e3,
        "search_s": time.perf_counter() - t0,
        "plan": [p["label"] for p in report.plan],
        "report_text": O.format_report(report),
    }


# --------------------------------------------------------------------------------- exchange


def exchange_row(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rose_jax.mps import WorkerSpec
    from rose_jax.runtime import start_workers

    sizes = (256 << 10, MB) if args.smoke else (MB, 64 * MB)
    env = {} if jax.default_backend() == "gpu" else {"JAX_PLATFORMS": "cpu"}
    out: dict[str, Any] = {
        "name": "exchange",
        "kind": "exchange",
        "sizes_bytes": list(sizes),
        "round_trips": [],
    }
    with start_workers([WorkerSpec("x", env=env)], transport="auto") as pool:
        out["transport"] = f"{pool.transport.kind}: {pool.transport.reason}"
        for size in sizes:
            x = jnp.arange(size // 4, dtype=jnp.float32)
            for staging in (True, False):
                pool.staging = staging
                n = args.round_trips if size <= MB else max(3, args.round_trips // 4)
                back = pool.call("x", "rose_jax.runtime.probes:identity", x)  # warm (compile, map)
                assert bool(np.array_equal(np.asarray(back), np.asarray(x)))
                times = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    jax.block_until_ready(pool.call("x", "rose_jax.runtime.probes:identity", x))
                    times.append(time.perf_counter() - t0)
                rec = {
                    "bytes": size,
                    "staging": staging,
                    "n": n,
                    "median_ms": float(np.median(times)) * 1e3,
                    "min_ms": float(np.min(times)) * 1e3,
                }
                out["round_trips"].append(rec)
                log(
                    f"exchange: {size / MB:g} MB round trip, {'staged' if staging else 'one-off'}: "
                    f"{rec['median_ms']:.3f} ms (median of {n})"
                )
        out["driver_channel"] = pool.channel_stats()["x"]
    return out


# ---------------------------------------------------------------------------------- offload


def offload_row(args, num_envs: int) -> dict:
    import jax

    from rose_jax import optimize as O
    from rose_jax.optimize import base, measure, quotas, search

    ppo, env, config, _, state = ppo_setup(
        args, num_envs, (SMOKE_POLICIES if args.smoke else POLICIES)["4x32"]
    )
    per_iteration = config.num_envs * config.unroll_length
    k = max(1, math.ceil(args.epoch_env_steps / per_iteration))
    eval_length = args.eval_length or env.episode_length
    fn = ppo.epoch(config, env, k, num_eval_envs=args.eval_envs, eval_length=eval_length)
    name = f"offload_{num_envs}"
    base_step = jax.jit(fn)
    timings: dict[str, Any] = {}

    def timed(plan_a, plan_b):  # the quota step's end-to-end timing, with the baseline in the turns
        steps = [search.compile_step(search.apply_plan(fn, p), host=True) for p in (plan_a, plan_b)]
        try:
            (_, tb), (_, ta), (_, tq) = measure.time_alternating(
                [base_step, *steps], state, args.offload_epochs, args.offload_repeats
            )
            timings.update(base=tb, none=ta, quota=tq)
            return ta, tq
        finally:
            for s in steps:
                base.close(s)

    log(
        f"{name}: epoch = {k} iterations ({k * per_iteration:,} env steps) + eval "
        f"{args.eval_envs} x {eval_length}"
    )
    t0 = time.perf_counter()
    _, (rec,) = quotas.choose_plan_quotas(
        [O.offload_component("evaluate")],
        fn,
        state,
        mode=args.quotas,
        timed=timed,
        noise=0.0,
        grid=tuple(args.quota_grid),
        refine_rounds=args.quota_refine_rounds,
        say=lambda s: log(f"{name}: {s}"),
    )
    quota_s = time.perf_counter() - t0
    if "none" not in timings:  # no quota step (no MPS): the plan without quotas against the baseline
        step = search.compile_step(search.apply_plan(fn, [O.offload_component("evaluate")]), host=True)
        try:
            (_, tb), (_, ta) = measure.time_alternating(
                [base_step, step], state, args.offload_epochs, args.offload_repeats
            )
            timings.update(base=tb, none=ta)
        finally:
            base.close(step)
    tb, ta, tq = timings["base"], timings["none"], timings.get("quota")
    row = {
        "name": name,
        "kind": "offload",
        "num_envs": num_envs,
        "iterations_per_epoch": k,
        "env_steps_per_epoch": k * per_iteration,
        "eval_envs": args.eval_envs,
        "eval_length": eval_length,
        "epochs_per_timed_run": args.offload_epochs,
        "baseline_s": tb.median,
        "offload_s": ta.median,
        "offload_quota_s": tq.median if tq else None,
        "baseline_steps_per_s": k * per_iteration / tb.median,
        "offload_steps_per_s": k * per_iteration / ta.median,
        "offload_quota_steps_per_s": k * per_iteration / tq.median if tq else None,
        "speedup_no_quota": tb.median / ta.median,
        "speedup_quota": tb.median / tq.median if tq else None,
        "quota_status": rec.status,
        "quota_reason": rec.reason,
        "quotas": rec.quotas,
        "worker_quota": rec.applied.get("quota"),
        "branches": rec.branches,
        "points": rec.points,
        "predicted_join_s": rec.predicted_join_s,
        "predicted_even_join_s": rec.predicted_even_join_s,
        "quota_step_s": quota_s,
    }
    log(
        f"{name}: baseline {tb.median:.3f} / offload {ta.median:.3f} / offload+quota "
        f"{fmt(tq.median if tq else None, '.3f')} s/epoch; quotas {rec.status}: {rec.reason}"
    )
    return row


# ----------------------------------------------------------------------------------- output


def measured(rows: list[dict], kind: str) -> list[dict]:
    """The rows of ``kind`` that ran to the end (a skipped or failed row has no measurements)."""
    return [r for r in rows if r.get("kind") == kind and "skipped" not in r]


def failed_row(name: str, kind: str, error: BaseException) -> dict:
    """The record of a row that raised ``error`` (the other rows are measured and reported)."""
    return {"name": name, "kind": kind, "skipped": f"failed: {type(error).__name__}: {str(error)[:300]}"}


def table(rows: list[dict]) -> str:
    """The results as markdown: one table per kind of the rows that ran, then the rows that were
    skipped (time budget) or failed, each with its reason or error."""
    lines = []
    g = measured(rows, "groups")
    if g:
        lines.append(
            common.markdown_table(
                [
                    "row",
                    "fused ms/iter",
                    "processes ms/iter",
                    "speedup",
                    "driver ms",
                    "exchange ms",
                    "rollout ms",
                    "learn ms",
                    "recompiles (driver/workers)",
                    "equal (envs differing) vs fused / vs groups / vs in-process workers",
                    "deterministic ops: vs in-process workers bitwise (envs differing); vs fused; "
                    "fused repeat",
                ],
                [
                    [
                        r["name"],
                        r["fused_ms"],
                        r["processes_ms"],
                        f"{r['speedup']:.3f}x",
                        r["driver_overhead_ms"],
                        fmt(r["exchange_overhead_ms"], ".2f"),
                        fmt(r["worker_rollout_ms"]),
                        r["learn_ms"],
                        f"{r['driver_compiles_after_first']}/{r['worker_compiles_after_first']}",
                        f"{r['equal']} ({r['envs_differing']}) / {r['equal_to_sequential_groups']} "
                        f"({r['envs_differing_sequential']}) / ({r['envs_differing_inline']})",
                        (
                            f"{r['det_equal_inline']} ({r['det_envs_differing_inline']}); "
                            f"({r['det_envs_differing_fused']}); {r['det_fused_repeatable']}"
                            if r.get("deterministic_options")
                            else (f"failed: {r['det_error'][:60]}" if r.get("det_error") else "not run")
                        ),
                    ]
                    for r in g
                ],
            )
        )
    x = measured(rows, "exchange")
    for r in x:
        lines.append(f"\nexchange ({r['transport']}):\n")
        lines.append(
            common.markdown_table(
                ["bytes", "staged ms", "one-off ms"],
                [
                    [
                        f"{size / MB:g} MB",
                        next(t["median_ms"] for t in r["round_trips"] if t["bytes"] == size and t["staging"]),
                        next(
                            t["median_ms"]
                            for t in r["round_trips"]
                            if t["bytes"] == size and not t["staging"]
                        ),
                    ]
                    for size in r["sizes_bytes"]
                ],
            )
        )
    o = measured(rows, "offload")
    if o:
        lines.append("")
        lines.append(
            common.markdown_table(
                [
                    "row",
                    "baseline s/epoch",
                    "offload s/epoch",
                    "offload+quota s/epoch",
                    "quotas (driver, worker)",
                    "quota step",
                ],
                [
                    [
                        r["name"],
                        r["baseline_s"],
                        r["offload_s"],
                        fmt(r["offload_quota_s"], ".3f"),
                        str(r["quotas"] or "-"),
                        r["quota_status"],
                    ]
                    for r in o
                ],
            )
        )
    s = measured(rows, "search")
    for r in s:
        lines.append(
            f"\nsearch over {r['candidate']}: {'KEPT' if r['kept'] else 'refused'} in "
            f"{r['search_s']:.1f}s: {r['reason']}"
        )
    for r in rows:
        if "skipped" in r:
            why = r["skipped"]
            if why.startswith("failed: "):
                lines.append(f"\n{r['name']}: FAILED: {why.removeprefix('failed: ')}")
            else:
                lines.append(f"\n{r['name']}: skipped: {why}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("groups", "exchange", "offload") if measured(rows, k)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, kind in zip(axes[0], panels, strict=True):
        rs = measured(rows, kind)
        if kind == "groups":
            xs = range(len(rs))
            ax.bar([i - 0.2 for i in xs], [r["fused_ms"] for r in rs], 0.4, label="fused")
            ax.bar(
                [i + 0.2 for i in xs], [r["processes_ms"] for r in rs], 0.4, label="env groups in processes"
            )
            ax.set_xticks(list(xs), [r["policy"] for r in rs])
            ax.set_ylabel("ms / iteration")
        elif kind == "exchange":
            r = rs[0]
            sizes = r["sizes_bytes"]
            for j, staging in enumerate((True, False)):
                ms = [
                    next(
                        t["median_ms"]
                        for t in r["round_trips"]
                        if t["bytes"] == s and t["staging"] == staging
                    )
                    for s in sizes
                ]
                ax.bar(
                    [i + 0.4 * j - 0.2 for i in range(len(sizes))],
                    ms,
                    0.4,
                    label="staged" if staging else "one-off",
                )
            ax.set_xticks(range(len(sizes)), [f"{s / MB:g} MB" for s in sizes])
            ax.set_ylabel("ms / round trip")
        else:
            xs = range(len(rs))
            for j, (key, lab) in enumerate(
                (("baseline_s", "epoch"), ("offload_s", "offload"), ("offload_quota_s", "offload + quota"))
            ):
                ax.bar([i + 0.27 * (j - 1) for i in xs], [r.get(key) or 0 for r in rs], 0.27, label=lab)
            ax.set_xticks(list(xs), [str(r["num_envs"]) for r in rs])
            ax.set_ylabel("s / epoch")
        ax.set_title(kind, fontsize=9)
        ax.legend(fontsize=7)
    common.save_plot(fig, path)


def merged_rows(old_rows: list[dict], rows: list[dict]) -> list[dict]:
    """``old_rows`` (a previous run's, for ``--merge``) updated by this run's ``rows`` by name
    (:func:`benchmarks.common.merge_records`: a skipped or failed row never replaces a measured one)."""
    return common.merge_records(
        old_rows, rows, key=lambda r: r["name"], measured=lambda r: "skipped" not in r and not r.get("error")
    )


def write_results(rows: list[dict], args, out_dir: str, old_rows: list[dict] | None = None) -> str:
    meta = common.machine_info()
    # each row keeps the command and date that measured it (merged files stay traceable)
    rows = [{"command": meta.get("command"), "date": meta.get("date"), **r} for r in rows]
    if old_rows:
        rows = merged_rows(old_rows, rows)
    text = table(rows)
    atomic_write_json(
        os.path.join(out_dir, "env_groups.json"),
        {"machine": meta, "argv": sys.argv[1:], "wall_s": common.elapsed(), "rows": rows},
    )
    notes = (
        "Env groups: the same PPO iteration fused (one jitted program) and with its rollout in "
        f"{args.groups} worker processes (env state resident), timed in turns; driver = collect wall time "
        "outside the workers' round trip and the wait for the learn's parameters (rows measured before "
        "2026-12-04 09:00 count that wait in the exchange, and not in the learn), exchange = round trip "
        "outside the rollouts. Offload: Brax's "
        "train loop epoch (training, then an evaluation) with the evaluation in a worker, with and "
        "without the SM quota the slack-aware search chose (branches timed alone at the grid's quotas)."
    )
    detail = "\n".join(
        f"\n## {r['name']}\n\n```\n{r['report_text']}\n```" for r in rows if "report_text" in r
    )
    runs: dict[str, list[str]] = {}
    for r in rows:
        runs.setdefault(f"{r.get('date')}: `{r.get('command')}`", []).append(r["name"])
    provenance = "".join(f"- {run}: {', '.join(names)}\n" for run, names in runs.items())
    atomic_write_text(
        os.path.join(out_dir, "env_groups.md"),
        f"# env_groups\n\ncommand: `{meta.get('command')}` ({meta.get('date')})\n\n{notes}\n\n"
        f"Rows by the run that wrote them:\n\n{provenance}\n{text}\n{detail}\n",
    )
    if any("skipped" not in r for r in rows):
        plot(rows, os.path.join(out_dir, "env_groups.png"))
    return text


# ------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check: pendulum, tiny sizes, temp dir")
    p.add_argument("--out", default=None, help=f"output dir (default {DEFAULT_OUT}; --smoke: a temp dir)")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip rows whose estimate no longer fits")
    p.add_argument(
        "--mps-client",
        action="store_true",
        help="run as a client of a fresh MPS daemon (started and stopped by a parent process)",
    )
    p.add_argument("--num-envs", type=int, default=2048, help="envs of the env-group rows")
    p.add_argument("--offload-envs", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--offload-repeats", type=int, default=2, help="timed runs per variant (in turns)")
    p.add_argument(
        "--offload-epochs",
        type=int,
        default=3,
        help="chained epochs per timed run: the offloaded evaluation runs behind the next epoch's "
        "training, so one epoch per run cannot show an overlap (rows before 2026-12-04 09:30 timed 1)",
    )
    p.add_argument("--round-trips", type=int, default=20)
    p.add_argument("--epoch-env-steps", type=int, default=500_000)
    p.add_argument("--eval-envs", type=int, default=128)
    p.add_argument("--eval-length", type=int, default=0, help="eval steps (0: the env's episode length)")
    p.add_argument("--quotas", choices=["auto", "search", "off"], default="auto")
    p.add_argument("--quota-grid", type=int, nargs="+", default=[30, 70])
    p.add_argument("--quota-refine-rounds", type=int, default=0)
    p.add_argument(
        "--rows", nargs="+", default=["groups_4x32", "exchange", "groups_3x1024", "offload", "search"]
    )
    p.add_argument(
        "--equality-options",
        choices=["deterministic", "off"],
        default="deterministic",
        help="also compare the env-group rows with every part under xla_gpu_deterministic_ops",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of an existing env_groups.json in --out that this run does not measure",
    )
    p.add_argument(
        "--compile-cache",
        default=os.path.join(tempfile.gettempdir(), "rose_jax_jit_cache"),
        help="JAX persistent compilation cache dir, shared with the workers ('' to disable)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.num_envs, args.offload_envs, args.iters, args.repeats = 8, [8], 2, 2
        args.round_trips, args.epoch_env_steps, args.eval_envs, args.eval_length = 5, 64, 4, 20
        args.budget_s = max(args.budget_s, 1e9)
    return args


def plan_rows(args) -> list[tuple[str, str, Callable[[], dict]]]:
    """``(name, kind, run)`` of the selected rows, in order."""
    out = []
    for sel in args.rows:
        if sel.startswith("groups_"):
            label = sel.removeprefix("groups_")
            out.append((sel, "groups", lambda label=label: groups_row(args, label)))
        elif sel == "exchange":
            out.append(("exchange", "exchange", lambda: exchange_row(args)))
        elif sel == "offload":
            out += [(f"offload_{n}", "offload", lambda n=n: offload_row(args, n)) for n in args.offload_envs]
        elif sel == "search":
            out.append(("search_4x32", "search", lambda: search_row(args)))
        else:
            raise SystemExit(f"unknown row {sel!r} (groups_4x32, groups_3x1024, exchange, offload, search)")
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.mps_client and not os.environ.get("ROSE_MPS_CLIENT"):
        from rose_jax.mps import run_as_client

        raise SystemExit(run_as_client([sys.executable, "-m", __spec__.name, *sys.argv[1:]], log=log))
    import jax

    if args.compile_cache:  # worker processes inherit the cache through the environment
        common.enable_compile_cache(args.compile_cache)
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", args.compile_cache)
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    out_dir = args.out or (tempfile.mkdtemp(prefix="rose_env_groups_") if args.smoke else DEFAULT_OUT)
    os.makedirs(out_dir, exist_ok=True)
    log(f"JAX {jax.__version__} backend={jax.default_backend()} devices={jax.devices()}; output {out_dir}")
    rows: list[dict] = []
    old_rows = (
        common.previous_records(os.path.join(out_dir, "env_groups.json"), "rows") if args.merge else None
    )
    start = time.perf_counter()
    text = ""
    for name, kind, run in plan_rows(args):
        spent = time.perf_counter() - start
        estimate = 0.0 if args.smoke else estimate_s(name, kind)
        if spent + estimate > args.budget_s:
            log(f"{name}: skipped (budget: {spent:.0f}s spent + ~{estimate:.0f}s > {args.budget_s:.0f}s)")
            rows.append(
                {
                    "name": name,
                    "kind": kind,
                    "skipped": f"time budget ({spent:.0f}s spent, ~{estimate:.0f}s needed)",
                }
            )
        else:
            try:
                rows.append(run())
            except Exception as e:  # noqa: BLE001 - one failing row is reported, the next one runs
                log(f"{name}: FAILED: {type(e).__name__}: {e}")
                rows.append(failed_row(name, kind, e))
        text = write_results(rows, args, out_dir, old_rows)
    log(f"done in {common.elapsed():.1f}s; results in {out_dir}")
    print("\n" + text + "\n", flush=True)
    return rows


if __name__ == "__main__":
    main()
