"""MPS daemon + worker runtime on one GPU: SM-quota rates, transfers, the slack-aware quota search.

    python -m benchmarks.experiments.mps --budget-s 200    # H200, 1.5-3 min: results/mps/mps_gpu.{json,md}
    python -m benchmarks.experiments.mps --dry-run         # CPU plumbing check: no MPS, tiny sizes, ~30 s

Phases, in this order (``--phases`` picks some): ``rates``
(:mod:`~benchmarks.experiments.mps.rates`), ``transfer``
(:mod:`~benchmarks.experiments.mps.transfer`), ``search``
(:mod:`~benchmarks.experiments.mps.quota_search`). Each MPS phase owns a fresh MPS daemon and this
driver process never creates a CUDA context (the transfer phase runs its driver side in a child
process), so no non-MPS context of ours lives next to an MPS server. That a SIGKILLed worker
leaves nothing behind is a GPU test: ``tests/test_mps_gpu.py``.

Budget (``--budget-s``): a phase starts only if its estimated cost (from the pool start times
measured earlier in this run) fits in what is left after reserving the more important phases
still to come. Importance, most first: rates, search (round 1 + validation), transfer, search
refinement; so what a tight budget cuts is the refinement, then the transfer.

Every progress line starts with the elapsed time; every pool start / close and every search
round (start, prepare, timed) is timed. The results JSON and Markdown (machine, versions,
command, every measured point, the per-phase times and budget decisions) are written atomically.
A phase that fails is recorded under ``errors`` and the others still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rose_jax.io import atomic_write_json, atomic_write_text
from rose_jax.mps import mps_status

from benchmarks import common
from benchmarks.experiments.mps import harness, quota_search, rates, transfer
from benchmarks.experiments.mps.harness import T0, Budget, Sizes, Timing, log, mps_session

# The driver shares the GPU with its workers: never let its own JAX grab 75% of the memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

PHASES = ("rates", "transfer", "search")  # the order they run in
# Lower is more important: what a tight budget cuts first is the highest number.
IMPORTANCE = {"rates": 1, "search": 2, "transfer": 3}
SECTIONS = {"rates": rates, "transfer": transfer, "search": quota_search}  # .markdown / .summary


def estimates(sizes: Sizes, tm: Timing) -> dict:
    """Expected seconds of each phase (H200), from the worker start times measured so far."""
    s, c = tm.start_estimate(), tm.close_estimate()
    return {
        "rates": s + c + sizes.rate_seconds + 4.0,  # + compile and warm-up, daemon up/quit
        "transfer": s + c + 14.0,  # child import jax + CUDA init, ~70 round trips (1 GB: 8)
        "search": s + c + 20.0,  # round 1 (prepare ~5, timed ~5) + validation (~3) + daemons
    }


def machine() -> tuple[dict, dict]:
    """(machine facts, versions) without creating a CUDA context in this process."""
    from rose_jax.runtime import shm

    info = common.machine_info(jax_devices=False)
    info["shm_free_bytes"] = shm.free_bytes()
    keys = ("python", "jax", "jaxlib", "numpy", "psutil", "git_commit")
    versions = {k: info[k] for k in keys if k in info}
    versions["mps_binary"] = shutil.which("nvidia-cuda-mps-control")
    try:
        import cupy

        versions["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001 - cupy is optional (CUDA IPC transport)
        versions["cupy"] = f"unavailable ({type(e).__name__})"
    return info, versions


def markdown(res: dict) -> str:
    m = res["machine"]
    out = [
        f"# MPS + worker runtime benchmark ({'DRY RUN, CPU' if res['dry_run'] else 'GPU'})",
        "",
        f"- command: `{' '.join(res['command'])}`",
        f"- started: {res['started']}, took {res['seconds']:.0f} s (budget {res['budget_s']:.0f} s)",
        f"- machine: {m.get('hostname')}, GPU: {m.get('gpu') or 'none'}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()),
        f"- MPS: {res['mps']['reason']}",
        "",
    ]
    for name in PHASES:
        if name in res and "skipped" not in res[name]:
            out += SECTIONS[name].markdown(res[name])
    tmg = res.get("timing", {})
    if tmg:
        out += ["## Time", "", "| phase | seconds |", "|---|---|"]
        out += [f"| {k} | {v:.1f} |" for k, v in tmg.get("phases_s", {}).items()]
        out += ["", "| pool | workers | start | close |", "|---|---|---|---|"]
        close_by_label: dict = {}
        for c in tmg.get("pool_closes", []):
            close_by_label.setdefault(c["label"], []).append(c["seconds"])
        for st in tmg.get("pool_starts", []):
            cl = close_by_label.get(st["label"], [])
            out.append(
                f"| {st['label']} | {st['workers']} | {st['seconds']:.1f} s | "
                f"{f'{cl.pop(0):.1f} s' if cl else '-'} |"
            )
        out += ["", "budget decisions:", ""]
        out += [
            f"- {d['what']}: {'run' if d['run'] else 'SKIPPED'} (needs ~{d['need_s']} s, {d['left_s']} s left"
            f"{'; ' + d['why'] if d.get('why') else ''})"
            for d in tmg.get("budget_decisions", [])
        ]
        out.append("")
    for name in PHASES:
        if "skipped" in res.get(name, {}):
            out.append(f"- {name}: skipped ({res[name]['skipped']})")
    if res.get("errors"):
        out += ["", "## Errors", ""] + [f"- {k}: `{v}`" for k, v in res["errors"].items()]
    return "\n".join(out) + "\n"


def summary_table(res: dict) -> str:
    rows = []
    for name in ("transfer", "rates", "search"):
        if name in res and "skipped" not in res[name]:
            rows += SECTIONS[name].summary(res[name])
    w = max((len(a) for a, _ in rows), default=10)
    return "\n".join(f"  {a:<{w}}  {b}" for a, b in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing check: no MPS, tiny sizes")
    ap.add_argument("--out", default=os.path.join(common.RESULTS_DIR, "mps"), help="results directory")
    ap.add_argument("--run-dir", default=None, help="MPS run directory (default: a new /tmp/rmps* directory)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=220.0,
        help="wall-clock budget: phases that would not fit are skipped, least important first",
    )
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset to run")
    ap.add_argument("--transfer-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = harness.DRY if args.dry_run else harness.FULL
    if args.transfer_child:  # internal: the transfer phase's driver side, in its own process
        res = transfer.phase_transfer(sizes)
        Path(args.transfer_child).write_text(json.dumps(res, default=str))
        return 0
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)} (known: {', '.join(PHASES)})")

    ok, reason = mps_status()
    use_mps = ok and not args.dry_run
    if args.dry_run:
        reason = f"dry run: MPS not used ({reason})"
    elif not ok:
        reason = f"{reason}; running WITHOUT MPS: quotas have no effect"
    log(f"mps: {reason}")
    info, versions = machine()
    res = {
        "benchmark": "mps",
        "dry_run": args.dry_run,
        "command": [sys.executable, *sys.orig_argv[1:]],
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "versions": versions,
        "mps": {"available": ok, "used": use_mps, "reason": reason},
        "sizes": dataclasses.asdict(sizes),
        "budget_s": args.budget_s,
        "errors": {},
    }
    run_root = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="rmps", dir="/tmp"))
    tm = Timing()
    budget = Budget(args.budget_s)

    def fits(name: str) -> bool:
        """Run `name` only if it fits after reserving the more important phases still to come."""
        est = estimates(sizes, tm)
        later = PHASES[PHASES.index(name) + 1 :]
        reserve = sum(est[p] for p in later if p in phases and IMPORTANCE[p] < IMPORTANCE[name])
        left = budget.left()
        if name == "search":  # the headline number: run it whenever any budget is left
            return tm.decide(name, left > 0, est[name], left, "always run while budget is left")
        why = f"reserving {reserve:.0f} s for {[p for p in later if IMPORTANCE[p] < IMPORTANCE[name]]}"
        return tm.decide(name, est[name] + reserve <= left, est[name] + reserve, left, why if reserve else "")

    def guarded(name, fn):
        t0 = time.monotonic()
        try:
            res[name] = fn()
        except Exception as e:  # record and go on: one broken phase must not hide the others
            res["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"{name}: ERROR {type(e).__name__}: {e}")
        tm.phases[name] = time.monotonic() - t0
        log(f"{name}: phase took {tm.phases[name]:.1f} s")

    def run_rates():
        with mps_session(run_root, "rates", use_mps, tm) as daemon:
            return rates.phase_rates(daemon, sizes, tm)

    def run_search():
        with mps_session(run_root, "search", use_mps, tm) as daemon:
            return quota_search.phase_search(daemon, sizes, tm, budget)

    runners = {
        "rates": run_rates,
        "transfer": lambda: transfer.phase_transfer_child(
            sizes, args.dry_run, max(60.0, min(300.0, budget.left() + 30.0))
        ),
        "search": run_search,
    }
    try:
        for name in PHASES:
            if name not in phases:
                continue
            if fits(name):
                guarded(name, runners[name])
            else:
                res[name] = {"skipped": f"time budget: {budget.left():.0f} s of {args.budget_s:.0f} s left"}
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
    res["seconds"] = time.monotonic() - T0
    res["timing"] = tm.to_dict()
    stem = os.path.join(args.out, "mps_gpu_dry_run" if args.dry_run else "mps_gpu")
    atomic_write_json(stem + ".json", res)
    atomic_write_text(stem + ".md", markdown(res))
    print("\nsummary:\n" + summary_table(res), flush=True)
    log(f"wrote {stem}.json and {stem}.md")
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
