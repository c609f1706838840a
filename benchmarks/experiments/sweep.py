"""Many runs on one GPU: 4 seeds of PPO ant as one vmapped program, as 4 MPS processes, one after another.

    python -m benchmarks.experiments.sweep                 # the H200 run (< 7 min; --budget-s guards it)
    python -m benchmarks.experiments.sweep --smoke --out D # CPU plumbing check: pendulum, tiny, 2 seeds

Workload: PPO on MJX ant (``envs.make("ant", backend="mjx")``), 2048 envs, policy 4x32, value
5x256, the suite's PPO hyperparameters; K = 4 seeds, ``--iterations`` iterations per run. This
driver never creates a CUDA context: every phase runs in child processes.

Phases, in order (each contained: a failing phase is reported, the next one still runs; a phase
whose estimated cost no longer fits in ``--budget-s`` is skipped with that reason):

1. ``sequential``: one process trains the K seeds one after another (``algos.sweep.train_many``
   with one seed, the solo program). Aggregate env-steps/s = all timed env steps / the time they
   took (compilation excluded: the first ``--warmup`` iterations of each run are not timed).
2. ``vmapped``: one process trains the K seeds as one vmapped program (``train_many`` with K
   seeds). Equal learning: each seed's parameters after ``--check-iterations`` iterations,
   vmapped vs solo (max |d|), and each seed's per-iteration episode returns vs its sequential run.
3. ``mps``: K processes (``algos.sweep.ProcessSweep``, one seed each) under one MPS daemon with
   SM quotas (K identical runs: the even split, which is the slack-aware search's optimum for
   identical branches, so no probes are run). Aggregate env-steps/s over the window in which all
   K ran their timed iterations (each run's record has the unix time of every iteration).
4. ``kill``: K processes under the same daemon; once all are mid-run one is SIGKILLed; the
   others must finish, the daemon must still answer, and afterwards no child process, no sweep
   process, no MPS process of ours and no new /dev/shm entry may be left (listed in the results).
5. ``mps_no_quota`` (if the budget allows): phase 3 without quotas (each process may use every SM).

Without MPS (a CPU machine, ``--smoke``) phases 3-5 run plain processes, the reason is recorded.
Results: ``benchmarks/results/multiprocess/sweep.{json,md,png}`` (machine, versions, command, date),
written atomically after every phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common

DEFAULT_OUT = os.path.join(common.RESULTS_DIR, "multiprocess")
SMOKE_OVERRIDES = dict(num_envs=4, unroll_length=4, num_minibatches=1, num_epochs=1,
                       policy_hidden_sizes=(8,), value_hidden_sizes=(8,))


def workload(args) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(env name, env kwargs, PPO config overrides without num_timesteps) of this run."""
    if args.smoke:
        return "pendulum", {}, dict(SMOKE_OVERRIDES)
    from benchmarks.suite import workloads as S

    overrides = dict(S.PPO_HP, reward_scaling=S.REWARD_SCALING["ant"], num_envs=args.num_envs,
                     policy_hidden_sizes=(32,) * 4, value_hidden_sizes=(256,) * 5)
    return "ant", {"backend": "mjx"}, overrides


def steps_per_iteration(overrides: dict) -> int:
    return overrides["num_envs"] * overrides["unroll_length"]


# ----------------------------------------------------------------------------------------------
# Phases that run in one child process (sequential, vmapped)


def _phase_main(job_path: str) -> int:
    """Child: run the sequential or vmapped phase described by ``job_path``; write its JSON."""
    import jax
    import numpy as np

    from algos import driver, sweep

    job = json.loads(Path(job_path).read_text())
    if job.get("compile_cache"):
        common.enable_compile_cache(job["compile_cache"], 0.5)
    import algos

    config = algos.make_config("ppo", **_tuplify(job["overrides"]))
    env = sweep.make_env(job["env"], job["env_kwargs"])
    seeds, root, out = tuple(job["seeds"]), job["root"], {"backend": jax.default_backend()}
    t0 = time.perf_counter()
    if job["phase"] == "sequential":
        runs = []
        for s in seeds:
            t = time.perf_counter()
            sweep.train_many(config, env, (s,), run_dirs=[os.path.join(root, f"seed-{s}")], checkpoints=False)
            runs.append({"seed": s, "wall_s": time.perf_counter() - t})
        out["runs"] = runs
    else:
        t = time.perf_counter()  # the timed run first: its wall time includes the compile
        sweep.train_many(config, env, seeds, run_dirs=sweep.seed_dirs(root, seeds), checkpoints=False)
        out["runs"] = [{"seeds": list(seeds), "wall_s": time.perf_counter() - t}]
        check = int(job["check_iterations"])

        def stop_after(n):
            def progress(env_steps, rows):
                if env_steps >= n * steps_per_iteration(job["overrides"]):
                    raise driver.StopTraining
            return progress

        t = time.perf_counter()
        short = sweep.train_many(config, env, seeds, progress_fn=stop_after(check))
        out["short_run_s"] = time.perf_counter() - t
        diffs = []
        for i, s in enumerate(seeds):
            solo = sweep.train_many(config, env, (s,), progress_fn=stop_after(check))
            a = jax.tree.leaves(jax.device_get(short.seed_state(i).params))
            b = jax.tree.leaves(jax.device_get(solo.seed_state(0).params))
            done = (int(short.metrics[i][-1]["iteration"]), int(solo.metrics[0][-1]["iteration"]))
            if done[0] != done[1]:
                raise RuntimeError(f"param check: vmapped ran {done[0]} iterations, solo {done[1]}")
            diffs.append({"seed": s, "iterations": done[0],
                          "max_abs_dparams": max(float(np.max(np.abs(np.asarray(x, np.float64) - y)))
                                                 for x, y in zip(a, b, strict=True)),
                          "max_abs_params": max(float(np.max(np.abs(y))) for y in b),
                          "bitwise": all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))})
        out["param_check"] = diffs
    out["wall_s"] = time.perf_counter() - t0
    atomic_write_json(job["out"], out)
    return 0


def _tuplify(d: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def run_phase_process(phase: str, args, root: str, timeout: float, **extra) -> dict:
    """Run a one-process phase in a fresh plain (non-MPS) child; its JSON result."""
    env_name, env_kwargs, overrides = workload(args)
    overrides["num_timesteps"] = args.iterations * steps_per_iteration(overrides)
    os.makedirs(root, exist_ok=True)
    job = os.path.join(root, f"{phase}.job.json")
    out = os.path.join(root, f"{phase}.out.json")
    atomic_write_json(job, {"phase": phase, "env": env_name, "env_kwargs": env_kwargs, "overrides": overrides,
                            "seeds": list(range(args.seeds)), "root": root, "out": out,
                            "compile_cache": args.compile_cache, **extra})
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    with open(os.path.join(root, f"{phase}.log"), "wb") as log:
        r = subprocess.run([sys.executable, "-m", "benchmarks.experiments.sweep", "--phase-job", job],
                           cwd=common.REPO_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
                           timeout=timeout)
    if r.returncode != 0:
        tail = Path(root, f"{phase}.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{phase} process exited {r.returncode}: {' | '.join(tail)}")
    return json.loads(Path(out).read_text())


# ----------------------------------------------------------------------------------------------
# Reading the runs' records


def timed_rate(rows: list[dict], warmup: int) -> dict:
    """Env-steps/s of one run from its record, after its first ``warmup`` rows (compilation)."""
    if len(rows) <= warmup + 1:
        return {"rate": None, "t0": None, "t1": None, "steps": 0}
    a, b = rows[warmup], rows[-1]
    steps = b["env_steps"] - a["env_steps"]
    rate = steps / max(b["time"] - a["time"], 1e-9)
    return {"rate": rate, "t0": a["time"], "t1": b["time"], "steps": steps}


def concurrent_rate(records: list[list[dict]], warmup: int) -> dict:
    """Aggregate env-steps/s of runs that ran at the same time: the env steps each made inside the
    window where all were past their warm-up and none had ended, over that window's length."""
    spans = [timed_rate(r, warmup) for r in records]
    if any(s["rate"] is None for s in spans):
        return {"rate": None, "window_s": 0.0, "note": "a run has no timed iterations"}
    lo, hi = max(s["t0"] for s in spans), min(s["t1"] for s in spans)
    if hi - lo <= 0:  # no common window: all timed steps over the span from the first start to the last end
        lo, hi = min(s["t0"] for s in spans), max(s["t1"] for s in spans)
        return {"rate": sum(s["steps"] for s in spans) / max(hi - lo, 1e-9), "window_s": 0.0,
                "note": "timed parts did not all overlap: timed steps / first start to last end"}

    def steps_at(rows, t):  # linear between the two rows around t
        for r0, r1 in zip(rows, rows[1:], strict=False):
            if r0["time"] <= t <= r1["time"]:
                w = (t - r0["time"]) / max(r1["time"] - r0["time"], 1e-9)
                return r0["env_steps"] + w * (r1["env_steps"] - r0["env_steps"])
        return rows[-1]["env_steps"] if t >= rows[-1]["time"] else rows[0]["env_steps"]

    total = sum(steps_at(r, hi) - steps_at(r, lo) for r in records)
    return {"rate": total / (hi - lo), "window_s": hi - lo,
            "note": f"window in which all {len(records)} ran: {hi - lo:.1f}s"}


def compare_records(a: list[dict], b: list[dict]) -> dict:
    """Two runs of one seed, row by row: every metric identical (times aside)? The largest episode
    return difference and the final returns."""
    def metrics(r):
        return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
                for k, v in r.items() if k not in ("wall_s", "time")}

    ra = [r.get("episode_return") for r in a]
    rb = [r.get("episode_return") for r in b]
    pairs = [(x, y) for x, y in zip(ra, rb, strict=False)
             if isinstance(x, float) and isinstance(y, float) and math.isfinite(x) and math.isfinite(y)]
    identical = len(a) == len(b) and all(metrics(x) == metrics(y) for x, y in zip(a, b, strict=True))
    return {"rows": [len(a), len(b)], "identical": identical,
            "max_abs_dreturn": max((abs(x - y) for x, y in pairs), default=None),
            "final_return": [ra[-1] if ra else None, rb[-1] if rb else None]}


# ----------------------------------------------------------------------------------------------
# Process phases (mps, kill)


def _runspecs(args, tag: str, iterations: int):
    from algos import sweep

    env_name, env_kwargs, overrides = workload(args)
    overrides["num_timesteps"] = iterations * steps_per_iteration(overrides)
    return [sweep.RunSpec(f"{tag}-seed-{s}", "ppo", env_name, overrides, (s,), env_kwargs, checkpoints=False)
            for s in range(args.seeds)]


def _our_leftovers(
    children_before: set[int],
    shm_before: set[str],
    pids: Sequence[int] = (),
    root: str | os.PathLike | None = None,
) -> dict:
    """What of ours is alive: new child processes, sweep children, MPS processes; new /dev/shm
    entries (all, and those named after one of ``pids``: other programs on the machine make some).
    Sweep children are ours when one of ``pids`` or started under ``root`` (their job file's
    directory; another sweep on the machine, e.g. a test beside this one, has its own)."""
    import psutil

    me = psutil.Process()
    children = [p for p in me.children(recursive=True) if p.pid not in children_before]
    new_shm = sorted(set(os.listdir("/dev/shm")) - shm_before) if os.path.isdir("/dev/shm") else []
    sweep_procs, mps_procs = [], []
    pid_set = set(pids)
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "algos.sweep --child" in cmd and (p.pid in pid_set or root is None or str(root) in cmd):
            sweep_procs.append(f"{p.pid} {cmd[:120]}")
        if (p.info["name"] or "").startswith("nvidia-cuda-mps"):
            mps_procs.append(f"{p.pid} {p.info['name']}")
    return {"children": [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in children if p.is_running()],
            "sweep_processes": sweep_procs, "mps_processes": mps_procs,
            "new_shm": new_shm, "new_shm_ours": [n for n in new_shm if any(str(p) in n for p in pids)]}


def run_mps_phase(args, root: str, daemon, quotas, tag: str, timeout: float) -> dict:
    from algos import sweep

    runs = _runspecs(args, tag, args.iterations)
    t0 = time.monotonic()
    result = sweep.run_processes(runs, os.path.join(root, tag), daemon=daemon, quotas=quotas,
                                 mps=daemon is not None, compile_cache_dir=args.compile_cache or "",
                                 log=common.log, timeout=timeout)
    records = [sweep.read_metrics(o.run_dirs[0]) for o in result.outcomes]
    wall = time.monotonic() - t0
    return {"wall_s": wall, "sweep": result.to_json(), "records": records,
            "aggregate": concurrent_rate(records, args.warmup),
            "end_to_end_rate": sum(r[-1]["env_steps"] for r in records if r) / wall}


def run_kill_phase(args, root: str, daemon, timeout: float) -> dict:
    import psutil

    from algos import sweep

    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    runs = _runspecs(args, "kill", args.kill_iterations)
    victim = runs[len(runs) // 2].name
    t0 = time.monotonic()
    with sweep.ProcessSweep(runs, os.path.join(root, "kill"), daemon=daemon, quotas="auto",
                            mps=daemon is not None, compile_cache_dir=args.compile_cache or "",
                            log=common.log) as s:
        deadline = time.monotonic() + timeout
        dirs = [d for r in runs for d in r.run_dirs(s.root)]
        while not all(len(sweep.read_metrics(d)) >= args.warmup + 1 for d in dirs):
            if time.monotonic() > deadline or len(s.poll()) == len(runs):
                break
            time.sleep(0.2)
        running_at_kill = [r.name for r in runs if sweep.read_summary(r.run_dirs(s.root)[0]) is None]
        processes_at_kill = {n: pid for n, pid in s.pids.items()}
        common.log(f"kill: SIGKILL {victim} (pid {s.pids[victim]}); running: {running_at_kill}")
        kill_time = time.time()
        try:
            os.kill(s.pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            common.log(f"kill: {victim} had already ended")
        result = s.wait(max(10.0, deadline - time.monotonic()))
    daemon_alive = daemon.healthy() if daemon is not None else None
    time.sleep(0.5)
    left = _our_leftovers(children_before, shm_before, processes_at_kill.values(), s.root)
    outcomes = {o.name: o for o in result.outcomes}
    survivors_ok = all(o.status == "finished" and o.end_time > kill_time
                       for n, o in outcomes.items() if n != victim)
    ok = (outcomes[victim].status == "killed" and survivors_ok and daemon_alive is not False
          and not left["children"] and not left["sweep_processes"] and not left["new_shm_ours"])
    return {"wall_s": time.monotonic() - t0, "victim": victim, "processes_at_kill": processes_at_kill,
            "running_at_kill": running_at_kill, "sweep": result.to_json(),
            "daemon_answers_after": daemon_alive,
            "left_after_sweep": left, "ok": ok}


# ----------------------------------------------------------------------------------------------
# The driver


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=4, help="K seeds (default: %(default)s)")
    p.add_argument("--num-envs", type=int, default=2048)
    p.add_argument("--iterations", type=int, default=150, help="PPO iterations per run")
    p.add_argument("--warmup", type=int, default=3, help="first iterations of a run not timed (compilation)")
    p.add_argument("--check-iterations", type=int, default=5, help="iterations of the vmapped-vs-solo check")
    p.add_argument("--kill-iterations", type=int, default=100, help="iterations per run of the kill phase")
    p.add_argument("--budget-s", type=float, default=400.0, help="skip phases that would end after this")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check: pendulum, tiny config, 2 seeds")
    p.add_argument("--out", default=None,
                   help=f"results directory (default {DEFAULT_OUT}; --smoke: a temp dir)")
    p.add_argument("--compile-cache", default=None,
                   help="JAX persistent compilation cache of all processes (default: a temp dir; '' none)")
    p.add_argument("--phase-job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase_job:
        return _phase_main(args.phase_job)
    if args.smoke:
        args.seeds, args.iterations, args.warmup, args.check_iterations = 2, 12, 2, 2
        args.kill_iterations = 3000  # tiny iterations take ~ms: the survivors must outlive the kill
    out_dir = args.out or (tempfile.mkdtemp(prefix="rose-sweep-smoke-") if args.smoke else DEFAULT_OUT)
    os.makedirs(out_dir, exist_ok=True)
    common.log(f"results -> {out_dir}")
    tmp_cache = None
    if args.compile_cache is None:
        tmp_cache = args.compile_cache = tempfile.mkdtemp(prefix="rose-sweep-bench-xla-")
    work = tempfile.mkdtemp(prefix="rose-sweep-bench-")
    try:
        return _run(args, out_dir, work)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        if tmp_cache:
            shutil.rmtree(tmp_cache, ignore_errors=True)


def _run(args, out_dir: str, work: str) -> int:
    from rose_jax.mps import MPSDaemon, mps_status

    env_name, env_kwargs, overrides = workload(args)
    spi = steps_per_iteration(overrides)
    results: dict[str, Any] = {
        "machine": common.machine_info(jax_devices=False),
        "workload": {"algo": "ppo", "env": env_name, "env_kwargs": env_kwargs, "config": overrides,
                     "seeds": args.seeds, "iterations_per_run": args.iterations,
                     "env_steps_per_iteration": spi,
                     "warmup_iterations_untimed": args.warmup, "smoke": args.smoke},
        "phases": {},
    }
    phases = results["phases"]

    def save():
        write_results(out_dir, results)

    def remaining() -> float:
        return args.budget_s - common.elapsed()

    def phase(name: str, fn, estimate_s: float):
        if estimate_s > remaining():
            phases[name] = {"skipped": f"time budget: needs ~{estimate_s:.0f}s, {remaining():.0f}s left"}
            common.log(f"{name}: skipped ({phases[name]['skipped']})")
        else:
            common.log(f"{name}: start (~{estimate_s:.0f}s estimated, {remaining():.0f}s left)")
            try:
                phases[name] = fn()
            except Exception as e:  # noqa: BLE001 - one failing phase is reported, the next ones run
                phases[name] = {"failed": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
                common.log(f"{name}: FAILED {phases[name]['failed']}")
            common.log(f"{name}: done")
        save()

    # 1. sequential: the baseline (it also tells how long compiles and iterations take)
    phase("sequential", lambda: _sequential(args, work, spi, remaining()), 0.0)
    seq = phases["sequential"]
    iter_s = seq.get("solo_iteration_s") or 0.05
    compile_s = seq.get("compile_s") or 60.0
    run_s = args.iterations * iter_s
    # 2. vmapped: one compile of the vmapped program, K x solo iterations at worst
    phase("vmapped", lambda: _vmapped(args, work, spi, remaining()),
          20 + 1.5 * compile_s + args.seeds * (run_s + args.check_iterations * iter_s))

    ok, reason = mps_status()
    results["mps"] = {"available": ok, "reason": reason}
    common.log(f"MPS: {reason}")
    daemon = None
    try:
        if ok:
            daemon = MPSDaemon(tempfile.mkdtemp(prefix="rsb", dir="/tmp")).start()
        process_cost = 30 + compile_s * 0.5 + args.seeds * run_s
        kill_cost = 30 + compile_s * 0.5 + args.seeds * args.kill_iterations * iter_s
        phase("mps", lambda: _mps(args, work, daemon, "even", "mps", spi, remaining()), process_cost)
        phase("kill", lambda: run_kill_phase(args, work, daemon, remaining()), kill_cost)
        if daemon is not None:
            phase("mps_no_quota", lambda: _mps(args, work, daemon, None, "noquota", spi, remaining()),
                  process_cost)
    finally:
        if daemon is not None:
            report = daemon.stop()
            import shutil

            shutil.rmtree(daemon.run_dir, ignore_errors=True)
            results["mps"]["daemon_shutdown"] = dataclasses.asdict(report) if report else None
            results["mps"]["mps_processes_after_stop"] = _our_leftovers(set(), set())["mps_processes"]
    results["summary"] = summarize(results, args)
    results["machine"]["total_s"] = common.elapsed()
    save()
    print(format_table(results))
    return 0


def _sequential(args, work, spi, timeout) -> dict:
    from algos import sweep

    root = os.path.join(work, "sequential")
    out = run_phase_process("sequential", args, root, timeout)
    records = [sweep.read_metrics(os.path.join(root, f"seed-{s}")) for s in range(args.seeds)]
    spans = [timed_rate(r, args.warmup) for r in records]
    timed_steps = sum(s["steps"] for s in spans)
    timed_s = sum(s["t1"] - s["t0"] for s in spans if s["rate"])
    first = records[0]
    compile_s = first[0]["wall_s"] if first else None  # the first row arrives after compile + 2 iterations
    total = sum(r[-1]["env_steps"] for r in records if r)
    return {"process": out, "records": records, "per_run_rate": [s["rate"] for s in spans],
            "end_to_end_rate": total / sum(r["wall_s"] for r in out["runs"]),
            "aggregate": {"rate": timed_steps / timed_s if timed_s else None,
                          "note": "timed env steps of the runs one after another / their timed seconds"},
            "solo_iteration_s": (timed_s / (timed_steps / spi)) if timed_steps else None,
            "compile_s": compile_s}


def _vmapped(args, work, spi, timeout) -> dict:
    from algos import sweep

    root = os.path.join(work, "vmapped")
    out = run_phase_process("vmapped", args, root, timeout, check_iterations=args.check_iterations)
    records = [sweep.read_metrics(d) for d in sweep.seed_dirs(root, range(args.seeds))]
    span = timed_rate(records[0], args.warmup)
    total = sum(r[-1]["env_steps"] for r in records if r)
    return {"process": out, "records": records, "param_check": out.get("param_check"),
            "end_to_end_rate": total / out["runs"][0]["wall_s"],
            "aggregate": {"rate": None if span["rate"] is None else span["rate"] * args.seeds,
                          "note": f"{args.seeds} seeds a step: {args.seeds} x one seed's timed env-steps/s"}}


def _mps(args, work, daemon, quotas, tag, spi, timeout) -> dict:
    return run_mps_phase(args, work, daemon, quotas, tag, timeout)


def summarize(results: dict, args) -> dict:
    ph = results["phases"]
    base = (ph.get("sequential") or {}).get("aggregate", {}).get("rate")
    out: dict[str, Any] = {"sequential_rate": base}
    seq_records = (ph.get("sequential") or {}).get("records") or []
    for name in ("vmapped", "mps", "mps_no_quota"):
        rate = (ph.get(name) or {}).get("aggregate", {}).get("rate")
        out[f"{name}_rate"] = rate
        out[f"{name}_speedup"] = rate / base if rate and base else None
        records = (ph.get(name) or {}).get("records") or []
        if records and seq_records:
            out[f"{name}_vs_sequential_learning"] = [compare_records(a, b)
                                                     for a, b in zip(records, seq_records, strict=False)]
    out["target_2x_met"] = {n: (out.get(f"{n}_speedup") or 0) >= 2.0 for n in ("vmapped", "mps")}
    out["kill_ok"] = (ph.get("kill") or {}).get("ok")
    return out


# ----------------------------------------------------------------------------------------------
# Output


def format_table(results: dict) -> str:
    ph, s = results["phases"], results.get("summary", {})
    w = results["workload"]
    lines = [f"{w['seeds']} seeds of PPO on {w['env']} ({w['config']['num_envs']} envs), "
             f"{w['iterations_per_run']} iterations per run",
             f"{'mode':<28} {'env-steps/s timed':>18} {'vs sequential':>14} {'end to end':>11}  note"]
    for name, label in (("sequential", "one after another"), ("vmapped", "vmapped (one program)"),
                        ("mps", "MPS processes, even quotas"), ("mps_no_quota", "MPS processes, no quotas")):
        row = ph.get(name)
        if row is None:
            continue
        if "skipped" in row or "failed" in row:
            why = row.get("skipped") or row.get("failed")
            lines.append(f"{label:<28} {'-':>18} {'-':>14} {'-':>11}  {why}")
            continue
        rate, speed = row["aggregate"]["rate"], s.get(f"{name}_speedup")
        speed_text = common.fmt(speed, ".2f") + ("x" if speed else "")
        e2e = common.fmt(row.get("end_to_end_rate"), ",.0f")
        lines.append(f"{label:<28} {common.fmt(rate, ',.0f'):>18} {speed_text:>14} {e2e:>11}  "
                     f"{row['aggregate'].get('note', '')}")
    lines.append("(timed: compilation and process start excluded; end to end: all env steps / the whole "
                 "phase's wall time, process start and compilation included)")
    pc = (ph.get("vmapped") or {}).get("param_check") or []
    if pc:
        worst = max(c["max_abs_dparams"] for c in pc)
        lines.append(f"equal learning: vmapped vs solo params after {pc[0]['iterations']} iterations, "
                     f"max |d| {worst:.3g} (bitwise: {all(c['bitwise'] for c in pc)})")
    for name in ("vmapped", "mps"):
        cmp = s.get(f"{name}_vs_sequential_learning")
        if cmp:
            finals = ", ".join(f"{common.fmt(c['final_return'][0])}/{common.fmt(c['final_return'][1])}"
                               for c in cmp)
            lines.append(f"{name} vs sequential per-seed final return (this/sequential): {finals}; "
                         f"identical records: {sum(c['identical'] for c in cmp)}/{len(cmp)}")
    kill = ph.get("kill")
    if kill and "ok" in kill:
        outcomes = ", ".join(f"{o['name']}={o['status']}" for o in kill["sweep"]["outcomes"])
        left = kill["left_after_sweep"]
        lines.append(f"kill: {outcomes}; daemon answers after: {kill['daemon_answers_after']}; left behind: "
                     f"{len(left['children'])} children, {len(left['sweep_processes'])} sweep processes, "
                     f"{len(left['new_shm_ours'])} /dev/shm entries of theirs "
                     f"({len(left['new_shm'])} new in all) "
                     f"-> {'OK' if kill['ok'] else 'NOT OK'}")
    elif kill:
        lines.append(f"kill: {kill.get('skipped') or kill.get('failed')}")
    lines.append(f"MPS: {results.get('mps', {}).get('reason', '?')}")
    return "\n".join(lines)


def write_results(out_dir: str, results: dict) -> None:
    """sweep.json (everything), sweep.md (the table and the facts), sweep.png (rates and returns)."""
    atomic_write_json(os.path.join(out_dir, "sweep.json"), results)
    m = results["machine"]
    md = ["# Many runs on one GPU: seeds as one vmapped program, as MPS processes, or one after another", "",
          f"Date {m.get('date')}; GPU {m.get('gpu', '-')}; jax {m.get('jax')}; command `{m.get('command')}`"
          f"; git {m.get('git_commit', '-')[:12]}", "", "```", format_table(results), "```", ""]
    mps = results.get("mps", {})
    md.append(f"MPS: {mps.get('reason', '-')}")
    for name in ("mps", "kill", "mps_no_quota"):
        sw = (results["phases"].get(name) or {}).get("sweep")
        if sw:
            md.append(f"- {name}: {sw['mps_reason']}; quotas {sw['quotas']} ({sw['quota_reason']})")
    atomic_write_text(os.path.join(out_dir, "sweep.md"), "\n".join(md) + "\n")
    try:
        _plot(results, os.path.join(out_dir, "sweep.png"))
    except Exception as e:  # noqa: BLE001 - the picture is optional, the numbers are in the JSON
        common.log(f"plot failed: {type(e).__name__}: {e}")


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ph = results["phases"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [n for n in ("sequential", "vmapped", "mps", "mps_no_quota")
             if (ph.get(n) or {}).get("aggregate", {}).get("rate")]
    a1.bar(names, [ph[n]["aggregate"]["rate"] for n in names], color="tab:blue")
    a1.set_ylabel("aggregate env steps / s")
    a1.set_title(f"{results['workload']['seeds']} seeds, {results['workload']['env']}")
    for n, color in (("sequential", "black"), ("vmapped", "tab:red"), ("mps", "tab:green")):
        for i, rows in enumerate((ph.get(n) or {}).get("records") or []):
            pts = [(r["env_steps"], r["episode_return"]) for r in rows
                   if isinstance(r.get("episode_return"), float) and math.isfinite(r["episode_return"])]
            if pts:
                xs, ys = zip(*pts, strict=True)
                a2.plot(xs, ys, color=color, alpha=0.6, label=n if i == 0 else None)
    a2.set_xlabel("env steps (per seed)")
    a2.set_ylabel("mean episode return")
    a2.set_title("learning per seed")
    if a2.get_legend_handles_labels()[0]:
        a2.legend(fontsize=8)
    common.save_plot(fig, path)


if __name__ == "__main__":
    sys.exit(main())
