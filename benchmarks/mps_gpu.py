"""MPS daemon + worker runtime on one GPU: a killed worker, SM quotas, exchange, quota search.

Run on the GPU machine from the repository root (about 1.5-3 minutes on an H200; ``--budget-s``
caps it, 220 s by default):

    python benchmarks/mps_gpu.py                 # results in benchmarks/results/mps/mps_gpu.{json,md}
    python benchmarks/mps_gpu.py --dry-run       # CPU plumbing check: no MPS, tiny sizes, ~30 s

Phases, cheapest and most decisive first; each MPS phase owns a fresh MPS daemon and this driver
process never creates a CUDA context (the transfer phase runs its driver side in a child
process), so no non-MPS context of ours lives next to an MPS server:

1. kill: two workers under MPS run a bf16 matmul loop; one is SIGKILLed mid-loop. Expect
   ``WorkerDied`` naming it and SIGKILL, the other worker terminated, the daemon quitting
   cleanly, and afterwards no nvidia-cuda-mps-control / nvidia-cuda-mps-server process (ps),
   no child process and no shared-memory segment of ours.
2. rates: two workers under MPS at 30% and 70% SMs run the matmul loop concurrently (synced by
   the pool barrier): TFLOP/s each; the ratio should follow the quotas.
3. transfer: driver -> worker -> driver round trip of a float32 array of 1 MB, 64 MB, 1 GB
   (``identity`` in the worker), host shared memory vs same-GPU CUDA IPC; median of repeats,
   the array starts and ends on the driver's GPU. No MPS. The driver side is a child process.
4. search: a matmul-heavy branch A and a memory-bound branch B (reduction + axpy over 1 GiB).
   MPS reads the SM quota when a process creates its CUDA context, so every quota needs its
   own worker process; the workers of one round start together (one parallel start per round)
   and each runs every branch asked at its quota. Round 1: quotas 20/35/50/65/80, both branches
   on each worker, plus a second worker at 50 for the even-split validation. Each point is
   timed ALONE: the driver sends one timing call at a time and every other worker is idle
   (an idle MPS client holds memory, no SMs). ``rose_jax.mps.search_quotas`` (step 5) picks
   the quotas; round 2 refines by +-5 around them (new workers only for quotas not yet
   running; skipped if the budget would not leave room for the validation). Validation,
   always run: A and B concurrently, each in its own worker, at 50/50 and at the chosen quotas
   (interleaved repeats after one warm-up pair, median join time); target >= 15% shorter.
   Every pool of the search stays open until the validation is done, so the validation reuses
   the workers already at the right quotas (a new one starts only where none is).

Budget (``--budget-s``): a phase starts only if its estimated cost (from the pool start times
measured earlier in this run) fits in what is left after reserving the more important phases
still to come. Importance, most first: kill, rates, search (round 1 + validation), transfer,
search refinement; so what a tight budget cuts is the refinement, then the transfer.

Every progress line starts with the elapsed time; every pool start / close and every search
round (start, prepare, timed) is timed. The results JSON and Markdown (machine, versions,
command, every measured point, the per-phase times and budget decisions) are written
atomically (temp file + rename).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The driver shares the GPU with its workers: never let its own JAX grab 75% of the memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from rose_jax.mps import MPSDaemon, WorkerSpec, join_time, mps_status, search_quotas  # noqa: E402
from rose_jax.runtime import WorkerDied, start_workers  # noqa: E402
from rose_jax.runtime import shm as _shm  # noqa: E402

P = "rose_jax.runtime.probes:"
T0_VAR = "ROSE_MPS_BENCH_T0"  # the parent's start (time.monotonic, system-wide) for a child's log
T0 = float(os.environ.get(T0_VAR) or time.monotonic())
DEFAULT_START_S = 10.0  # estimate of one round of parallel worker starts before any was measured
SEARCH_MEM_FRACTION = 0.07  # per search worker: ~10 GB cap on an H200; a branch needs < 3 GB


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes: bytes for transfers, [n, n] matmuls, float32 vector lengths, seconds."""

    transfer_bytes: tuple[int, ...] = (1 << 20, 64 << 20, 1 << 30)
    transfer_reps: tuple[int, ...] = (7, 5, 3)
    dtype: str = "bfloat16"
    rate_n: int = 8192
    rate_iters: int = 10
    rate_seconds: float = 5.0
    # Branch A (matmul-heavy): a_iters matmuls of [a_n, a_n]; ~80 ms at 90% SMs, ~120 ms at 50%,
    # ~290 ms at 20% on an H200 (0.75 x the 64-iteration times of the partial run).
    a_n: int = 8192
    a_iters: int = 48
    # Branch B (memory-bound): b_iters passes over float32 [b_size] (1 GiB); ~31 ms on its
    # bandwidth plateau (>= 40% SMs), ~63 ms at 20%, ~110 ms at 12%.
    b_size: int = 1 << 28
    b_iters: int = 40
    branch_reps: int = 3
    coarse: tuple[int, ...] = (20, 35, 50, 65, 80)
    refine_step: int = 5
    step: int = 5
    join_reps: int = 7
    kill_loop_seconds: float = 60.0
    worker_env: tuple[tuple[str, str], ...] = ()


FULL = Sizes()
DRY = Sizes(
    transfer_bytes=(1 << 10, 1 << 20, 8 << 20),
    transfer_reps=(5, 3, 3),
    dtype="float32",
    rate_n=128,
    rate_iters=4,
    rate_seconds=1.0,
    a_n=192,
    a_iters=16,
    b_size=1 << 18,
    b_iters=8,
    branch_reps=2,
    coarse=(30, 50, 70),
    refine_step=10,
    step=10,
    join_reps=3,
    kill_loop_seconds=30.0,
    worker_env=(("JAX_PLATFORMS", "cpu"),),
)


def median(xs):
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------- time accounting
@dataclasses.dataclass
class Timing:
    """Running record of this run's process costs (seconds), used for the budget's estimates.

    Mutable on purpose: the phases append to it as they go.
    """

    starts: list = dataclasses.field(default_factory=list)  # [(label, n_workers, seconds)]
    closes: list = dataclasses.field(default_factory=list)  # [(label, n_workers, seconds)]
    phases: dict = dataclasses.field(default_factory=dict)  # name -> seconds
    decisions: list = dataclasses.field(default_factory=list)  # budget decisions, in order

    def start_estimate(self) -> float:
        """Seconds for one round of parallel worker starts: the slowest seen so far."""
        return max((s for _, _, s in self.starts), default=DEFAULT_START_S)

    def close_estimate(self) -> float:
        return max((s for _, _, s in self.closes), default=2.0)

    def decide(self, what: str, run: bool, need_s: float, left_s: float, why: str = "") -> bool:
        d = {"what": what, "run": run, "need_s": round(need_s, 1), "left_s": round(left_s, 1)}
        if why:
            d["why"] = why
        self.decisions.append(d)
        log(
            f"budget: {what}: {'run' if run else 'SKIP'} (needs ~{need_s:.0f} s incl. reserve, "
            f"{left_s:.0f} s left{'; ' + why if why else ''})"
        )
        return run

    def to_dict(self) -> dict:
        return {
            "pool_starts": [{"label": a, "workers": n, "seconds": s} for a, n, s in self.starts],
            "pool_closes": [{"label": a, "workers": n, "seconds": s} for a, n, s in self.closes],
            "phases_s": dict(self.phases),
            "budget_decisions": list(self.decisions),
        }


@dataclasses.dataclass(frozen=True)
class Budget:
    """Wall-clock budget of the whole run, counted from T0 (seconds)."""

    seconds: float

    def left(self) -> float:
        return self.seconds - (time.monotonic() - T0)


@contextlib.contextmanager
def timed_pool(tm: Timing, label: str, worker_specs, daemon, transport: str = "shm"):
    """start_workers(...) as a context manager that logs and records its start and close times."""
    t0 = time.monotonic()
    pool = start_workers(worker_specs, daemon=daemon, transport=transport)
    dt = time.monotonic() - t0
    tm.starts.append((label, len(worker_specs), dt))
    log(f"{label}: {len(worker_specs)} worker(s) started in {dt:.1f} s (spawn + import jax + CUDA context)")
    try:
        yield pool
    except BaseException:
        pool.close(force=True)
        raise
    t1 = time.monotonic()
    pool.close()
    dc = time.monotonic() - t1
    tm.closes.append((label, len(worker_specs), dc))
    log(f"{label}: {len(worker_specs)} worker(s) closed in {dc:.1f} s")


# ---------------------------------------------------------------- process checks
def mps_processes() -> list[str]:
    """'pid comm' of every nvidia-cuda-mps-control / -server process on the machine (ps)."""
    try:
        out = subprocess.run(
            ["ps", "-eo", "pid=,stat=,comm="], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ["<ps failed>"]
    rows = []
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[2].startswith("nvidia-cuda-mps") and not parts[1].startswith("Z"):
            rows.append(f"{parts[0]} {parts[2]}")
    return rows


def our_children() -> list[int]:
    kids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.Error:
            pass
        kids.append(p.pid)
    return kids


def our_segments() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("rose"))
    except OSError:
        return []


def specs(sizes: Sizes, named_quotas, mem_fraction: float) -> list[WorkerSpec]:
    return [
        WorkerSpec(n, quota=q, mem_fraction=mem_fraction, env=dict(sizes.worker_env)) for n, q in named_quotas
    ]


def _daemon(run_root: Path, name: str, use_mps: bool):
    return MPSDaemon(run_root / name) if use_mps else _NoDaemon()


class _NoDaemon:
    """Stands in for MPSDaemon when MPS is unavailable (dry run): workers run without MPS."""

    last_shutdown = None

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


@contextlib.contextmanager
def mps_session(run_root: Path, name: str, use_mps: bool, tm: Timing):
    """A fresh MPS daemon for one phase (or None without MPS); logs its start and quit times."""
    t0 = time.monotonic()
    cm = _daemon(run_root, name, use_mps)
    with cm as daemon:
        if use_mps:
            log(f"{name}: MPS daemon up in {time.monotonic() - t0:.1f} s at {daemon.pipe_dir}")
        yield daemon
        t1 = time.monotonic()
    rep = getattr(cm, "last_shutdown", None)
    if rep is not None:
        log(f"{name}: MPS daemon quit in {time.monotonic() - t1:.1f} s (clean={rep.clean})")


# -------------------------------------------------------------------- 1: kill
def phase_kill(run_root: Path, use_mps: bool, sizes: Sizes, tm: Timing) -> dict:
    before = mps_processes()
    log(f"kill: MPS processes before: {before or 'none'}")
    marker = Path(tempfile.mkdtemp(prefix="rose-kill-")) / "started"
    st = dict(n=sizes.rate_n, iters=sizes.rate_iters, seconds=sizes.kill_loop_seconds, dtype=sizes.dtype)
    died = None
    daemon_cm = _daemon(run_root, "kill", use_mps)
    t_kill = None
    victim_pid = None
    try:
        with daemon_cm as daemon:
            with timed_pool(
                tm, "kill", specs(sizes, [("victim", 50), ("bystander", 50)], 0.3), daemon
            ) as pool:
                victim_pid = pool.pids["victim"]
                hs = [
                    pool.submit("victim", P + "matmul_rate", static=dict(st, marker=str(marker)), jit=False),
                    pool.submit("bystander", P + "matmul_rate", static=st, jit=False),
                ]
                t_wait = time.monotonic()
                while not marker.exists():
                    if time.monotonic() - t_wait > 300:
                        raise RuntimeError("the victim never started its loop")
                    time.sleep(0.05)
                time.sleep(0.5)
                log(f"kill: SIGKILL to worker 'victim' (pid {victim_pid}) mid-loop")
                t_kill = time.monotonic()
                os.kill(victim_pid, signal.SIGKILL)
                pool.wait(hs, timeout=120)
    except WorkerDied as e:
        died = {
            "message": str(e),
            "name": e.name,
            "signal": e.signal.name if e.signal else None,
            "exitcode": e.exitcode,
            "others_dead": list(e.others_dead),
            "detect_and_cleanup_s": time.monotonic() - t_kill if t_kill else None,
        }
        log(f"kill: WorkerDied: {e}")
    finally:
        shutil.rmtree(marker.parent, ignore_errors=True)
    report = getattr(daemon_cm, "last_shutdown", None)
    time.sleep(0.5)
    after = mps_processes()
    leftover = [r for r in after if r not in before]
    res = {
        "worker_died": died,
        "daemon": dataclasses.asdict(report) if report else None,
        "mps_processes_before": before,
        "mps_processes_after": after,
        "leftover_mps_processes": leftover,
        "leftover_children": our_children(),
        "leftover_segments": our_segments(),
        "victim_alive": bool(
            victim_pid
            and psutil.pid_exists(victim_pid)
            and psutil.Process(victim_pid).status() != psutil.STATUS_ZOMBIE
        ),
    }
    res["ok"] = bool(
        died
        and died["name"] == "victim"
        and died["signal"] == "SIGKILL"
        and not leftover
        and not res["leftover_children"]
        and not res["leftover_segments"]
        and (report is None or (report.quit_ok and not report.remaining))
    )
    q = (
        f"quit {'clean' if report.clean else 'NOT clean'} in {report.seconds:.1f}s, forced {report.forced}"
        if report
        else "no daemon (dry run)"
    )
    log(
        f"kill: daemon {q}; MPS processes after: {after or 'none'}; "
        f"children left: {res['leftover_children']}; segments left: {res['leftover_segments']} "
        f"-> {'OK' if res['ok'] else 'FAILED'}"
    )
    return res


# ------------------------------------------------------------------- 2: rates
def phase_rates(daemon, sizes: Sizes, tm: Timing) -> dict:
    st = dict(n=sizes.rate_n, iters=sizes.rate_iters, seconds=sizes.rate_seconds, dtype=sizes.dtype)
    log(
        f"rates: 2 workers at 30% / 70% SMs, {sizes.dtype} [{sizes.rate_n}]^2 matmul loop, "
        f"{sizes.rate_seconds:.0f} s each, started together by the pool barrier"
    )
    with timed_pool(tm, "rates", specs(sizes, [("q30", 30), ("q70", 70)], 0.3), daemon) as pool:
        outs = pool.call_all(P + "matmul_rate", static=st, jit=False, timeout=300)
        info = {n: _info(i) for n, i in pool.info.items()}
    r30, r70 = outs["q30"]["tflops"], outs["q70"]["tflops"]
    overlap = min(o["end"] for o in outs.values()) - max(o["start"] for o in outs.values())
    res = {
        "tflops": {"q30": r30, "q70": r70},
        "ratio_70_over_30": r70 / r30,
        "quota_ratio": 70 / 30,
        "overlap_s": overlap,
        "runs": outs,
        "workers": info,
    }
    log(
        f"rates: q30 {r30:.4g} TFLOP/s, q70 {r70:.4g} TFLOP/s, ratio {r70 / r30:.2f} (quota ratio 2.33), "
        f"concurrent for {overlap:.1f} s"
    )
    return res


# ------------------------------------------------------------------ 4: search
def _branch_static(sizes: Sizes, b: int) -> dict:
    if b == 0:
        return dict(kind="matmul", size=sizes.a_n, iters=sizes.a_iters, dtype=sizes.dtype)
    return dict(kind="memory", size=sizes.b_size, iters=sizes.b_iters)


@dataclasses.dataclass(eq=False)
class _Live:
    """One running search worker: its pool, name, SM quota and the branches it has built."""

    pool: object
    name: str
    quota: int
    prepared: set = dataclasses.field(default_factory=set)


class _Fleet:
    """The search's running workers across its pools (one pool per round of parallel starts).

    Every pool stays open (in ``stack``) until the search is done, so a later step reuses a
    worker already at the quota it needs instead of starting a process.
    """

    def __init__(self, daemon, sizes: Sizes, tm: Timing, stack: contextlib.ExitStack):
        self.daemon, self.sizes, self.tm, self.stack = daemon, sizes, tm, stack
        self.workers: list[_Live] = []

    def at(self, quota: int, exclude=()) -> _Live | None:
        for w in self.workers:
            if w.quota == quota and w not in exclude:
                return w
        return None

    def start(self, quotas, label: str) -> list[_Live]:
        """Start one worker per entry of quotas (repeats allowed), all at once; returns them."""
        used = {w.name for w in self.workers}
        named = []
        for q in quotas:
            name, k = f"q{q}", 1
            while name in used:
                k += 1
                name = f"q{q}n{k}"
            used.add(name)
            named.append((name, q))
        pool = self.stack.enter_context(
            timed_pool(self.tm, label, specs(self.sizes, named, SEARCH_MEM_FRACTION), self.daemon)
        )
        new = [_Live(pool, n, q) for n, q in named]
        self.workers += new
        return new

    def prepare(self, pairs) -> float:
        """Build + compile + run once each (worker, branch) not yet built, workers in parallel
        (a worker builds its branches one after the other); returns seconds."""
        t0 = time.monotonic()
        by_pool: dict = {}
        todo = []
        for w, b in dict.fromkeys(pairs):
            if b in w.prepared:
                continue
            h = w.pool.submit(w.name, P + "prepare_branch", static=_branch_static(self.sizes, b), jit=False)
            by_pool.setdefault(id(w.pool), (w.pool, []))[1].append(h)
            todo.append((w, b))
        for pool, hs in by_pool.values():
            pool.wait(hs, timeout=600)
        for w, b in todo:
            w.prepared.add(b)
        return time.monotonic() - t0

    def time_alone(self, w: _Live, b: int) -> float:
        """Median seconds of branch b on worker w; nothing else runs on the GPU meanwhile."""
        st = dict(_branch_static(self.sizes, b), reps=self.sizes.branch_reps)
        return float(w.pool.call(w.name, P + "time_branch", static=st, jit=False, timeout=300))

    def concurrent(self, wa: _Live, wb: _Live) -> dict:
        """Branch A on wa and branch B on wb started together; the join waits for both."""
        stA = dict(_branch_static(self.sizes, 0), reps=1, warmup=False)
        stB = dict(_branch_static(self.sizes, 1), reps=1, warmup=False)
        t0 = time.perf_counter()
        ha = wa.pool.submit(wa.name, P + "time_branch", static=stA, jit=False)
        hb = wb.pool.submit(wb.name, P + "time_branch", static=stB, jit=False)
        if wa.pool is wb.pool:
            ta, tb = wa.pool.wait([ha, hb], timeout=300)
        else:
            (ta,) = wa.pool.wait([ha], timeout=300)
            (tb,) = wb.pool.wait([hb], timeout=300)
        return {"join_s": time.perf_counter() - t0, "a_s": float(ta), "b_s": float(tb)}


def phase_search(daemon, sizes: Sizes, tm: Timing, budget: Budget) -> dict:
    log(
        f"search: branch A = {sizes.a_iters} x {sizes.dtype} [{sizes.a_n}]^2 matmuls, "
        f"branch B = {sizes.b_iters} x (mean + axpy) over float32 [{sizes.b_size}] "
        f"({sizes.b_size * 4 / 2**30:.2f} GiB)"
    )
    rounds: list[dict] = []
    cache: dict[tuple[int, int], float] = {}
    even_q = 100 // 2 // sizes.step * sizes.step
    with contextlib.ExitStack() as stack:
        fleet = _Fleet(daemon, sizes, tm, stack)

        def measure(points):
            todo = [p for p in dict.fromkeys(points) if p not in cache]
            if todo:
                n = len(rounds) + 1
                t0 = time.monotonic()
                need = sorted({q for _, q in todo if fleet.at(q) is None})
                if n == 1:  # a second worker at the even quota, for the concurrent 50/50 run
                    need = sorted(need + [even_q])
                log(
                    f"search: round {n}: {len(todo)} points at quotas {sorted({q for _, q in todo})}; "
                    f"starting {len(need)} worker(s) at {need}"
                )
                new = fleet.start(need, f"search round {n}") if need else []
                t_start = time.monotonic() - t0
                assigned = [(fleet.at(q), b) for b, q in todo]
                extra = []
                if n == 1:
                    second = fleet.at(even_q, exclude={fleet.at(even_q)})
                    extra = [(second, 1)] if second is not None else []
                t_prep = fleet.prepare(assigned + extra)
                t1 = time.monotonic()
                for (b, q), (w, _) in zip(todo, assigned, strict=True):  # one at a time
                    cache[(b, q)] = fleet.time_alone(w, b)
                    log(f"search:   branch {'AB'[b]} at {q:3d}%: {cache[(b, q)] * 1e3:8.2f} ms")
                t_timed = time.monotonic() - t1
                rounds.append(
                    {
                        "round": n,
                        "points": len(todo),
                        "new_workers": len(new),
                        "start_s": t_start,
                        "prepare_s": t_prep,
                        "timed_s": t_timed,
                        "seconds": time.monotonic() - t0,
                    }
                )
                log(
                    f"search: round {n} took {rounds[-1]['seconds']:.1f} s: start {t_start:.1f} s, "
                    f"prepare {t_prep:.1f} s, timed {t_timed:.1f} s"
                )
            return [cache[p] for p in points]

        kw = dict(coarse=sizes.coarse, refine_step=sizes.refine_step, step=sizes.step)
        result = search_quotas(measure, 2, refine_rounds=0, **kw)
        log(
            f"search: coarse choice {result.quotas[0]}/{result.quotas[1]} (predicted join "
            f"{result.predicted_join_s * 1e3:.2f} ms) vs even "
            f"(predicted {result.predicted_even_join_s * 1e3:.2f} ms)"
        )
        r1 = rounds[0]
        est_val = 2.0 + (sizes.join_reps + 1) * 2 * 1.5 * result.predicted_even_join_s + tm.close_estimate()
        est_ref = tm.start_estimate() + r1["prepare_s"] + r1["timed_s"] * 4 / r1["points"] + 1.0
        left = budget.left()
        if tm.decide("search refinement", est_ref + est_val <= left, est_ref + est_val, left):
            result = search_quotas(measure, 2, refine_rounds=1, **kw)
        qa, qb = result.quotas
        log(
            f"search: chosen {qa}/{qb} (predicted join {result.predicted_join_s * 1e3:.2f} ms) vs even "
            f"{even_q}/{even_q} (predicted {result.predicted_even_join_s * 1e3:.2f} ms)"
        )

        # ---- validation: workers at the chosen quotas (reuse where running)
        models = result.models()
        ea = fleet.at(even_q)
        eb = fleet.at(even_q, exclude={ea})
        wa = fleet.at(qa)
        wb = fleet.at(qb, exclude={wa})
        note = ""
        vq = (qa, qb)
        if wa is None or wb is None:
            alt = _best_running_pair(fleet, models)
            if alt is not None and (
                alt[0] <= result.predicted_join_s * 1.02 or tm.start_estimate() + est_val > budget.left()
            ):
                _, wa, wb = alt
                vq = (wa.quota, wb.quota)
                note = (
                    f"no worker at {qa}/{qb}; validated the best running pair {vq[0]}/{vq[1]} "
                    f"(predicted {alt[0] * 1e3:.2f} ms)"
                )
            else:
                missing = ([qa] if wa is None else []) + ([qb] if wb is None else [])
                fleet.start(missing, "search validation")
                wa = wa or fleet.at(qa, exclude={wb})
                wb = wb or fleet.at(qb, exclude={wa})
                note = f"started worker(s) at {missing} for the validation"
            log(f"search: {note}")
        if eb is None:  # only if round 1 could not start its second even worker
            fleet.start([even_q], "search validation (even)")
            eb = fleet.at(even_q, exclude={ea})
        t_prep = fleet.prepare([(ea, 0), (eb, 1), (wa, 0), (wb, 1)])
        log(
            f"search: validating concurrently: A on {ea.name} + B on {eb.name} (even) vs "
            f"A on {wa.name} + B on {wb.name} (chosen), 1 warm-up + {sizes.join_reps} interleaved "
            f"repeats (prepare {t_prep:.1f} s)"
        )
        t_val = time.monotonic()
        joins = {"even": [], "chosen": []}
        order = [("even", ea, eb), ("chosen", wa, wb)]
        for rep in range(sizes.join_reps + 1):
            for key, x, y in order if rep % 2 == 0 else order[::-1]:
                j = fleet.concurrent(x, y)
                if rep > 0:  # rep 0 warms both pairs up together
                    joins[key].append(j)
        t_val = time.monotonic() - t_val
        workers = [{"name": w.name, "quota": w.quota, "branches": sorted(w.prepared)} for w in fleet.workers]
    even = median([j["join_s"] for j in joins["even"]])
    chosen = median([j["join_s"] for j in joins["chosen"]])
    gain = 1 - chosen / even
    log(
        f"search: measured join {chosen * 1e3:.2f} ms at {vq[0]}/{vq[1]} vs {even * 1e3:.2f} ms at "
        f"{even_q}/{even_q}: {gain * 100:.1f}% shorter (target >= 15%); validation took {t_val:.1f} s"
    )
    return {
        "result": result.to_dict(),
        "predicted_gain": result.predicted_gain,
        "validated_quotas": list(vq),
        "validated_predicted_join_s": join_time(models, vq),
        "validation_note": note,
        "rounds": rounds,
        "workers": workers,
        "isolation": (
            "each point timed alone: one timing call at a time, every other worker idle; "
            "workers built their branches concurrently before timing"
        ),
        "measured_join_s": {"even": even, "chosen": chosen},
        "measured_gain": gain,
        "joins": joins,
        "validation_s": t_val,
    }


def _best_running_pair(fleet: _Fleet, models):
    """(modelled join, worker for A, worker for B) over running workers with quotas summing
    to <= 100, or None."""
    best = None
    for x in fleet.workers:
        for y in fleet.workers:
            if x is y or x.quota + y.quota > 100:
                continue
            t = join_time(models, (x.quota, y.quota))
            if best is None or t < best[0]:
                best = (t, x, y)
    return best


# ---------------------------------------------------------------- 3: transfer
def phase_transfer_child(sizes: Sizes, dry_run: bool, timeout_s: float) -> dict:
    """phase_transfer in a child process (its CUDA context dies with it); returns its result."""
    with tempfile.TemporaryDirectory(prefix="rose-transfer-") as td:
        out = Path(td) / "transfer.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--transfer-child", str(out)]
        cmd += ["--dry-run"] if dry_run else []
        env = dict(os.environ, **{T0_VAR: repr(T0)})
        try:
            r = subprocess.run(cmd, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"transfer child did not finish within {timeout_s:.0f} s") from e
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(f"transfer child exited with {r.returncode} and no result")
        return json.loads(out.read_text())


def phase_transfer(sizes: Sizes) -> dict:
    import jax
    import jax.numpy as jnp

    backend = jax.default_backend()
    log(f"transfer: driver JAX backend {backend}, devices {[str(d) for d in jax.devices()]}")
    out: dict = {"backend": backend, "sizes": {}}
    with start_workers(specs(sizes, [("echo", None)], 0.3), transport="auto") as pool:
        out["transport_auto"] = dataclasses.asdict(pool.transport)
        out["worker"] = _info(pool.info["echo"])
        log(f"transfer: auto transport = {pool.transport.kind} ({pool.transport.reason})")
        kinds = ["shm"] + (["cuda_ipc"] if pool.transport.kind == "cuda_ipc" else [])
        for nbytes, reps in zip(sizes.transfer_bytes, sizes.transfer_reps, strict=True):
            x = jnp.arange(nbytes // 4, dtype=jnp.float32)
            x.block_until_ready()
            row = {}
            for kind in kinds:
                free = _shm.free_bytes()
                if kind == "shm" and free is not None and free < 2.2 * nbytes:
                    row[kind] = {
                        "skipped": f"/dev/shm has {free / 2**20:.0f} MiB free, "
                        f"needs ~{2 * nbytes / 2**20:.0f}"
                    }
                    log(f"transfer: {_fmt_bytes(nbytes)} {kind}: skipped ({row[kind]['skipped']})")
                    continue
                times, ok = [], True
                for i in range(reps + 1):  # first one warms up (compile, first-touch)
                    t0 = time.perf_counter()
                    y = pool.call("echo", P + "identity", x, transport=kind, timeout=300)
                    y = jax.device_put(y)
                    y.block_until_ready()
                    dt = time.perf_counter() - t0
                    if i == 0:
                        ok = bool(jnp.array_equal(y, x))
                    else:
                        times.append(dt)
                    del y
                m = median(times)
                row[kind] = {
                    "median_s": m,
                    "times_s": times,
                    "equal": ok,
                    "round_trip_GBps": 2 * nbytes / m / 1e9,
                    "worker_stats": pool.last_stats.get("echo"),
                }
                log(
                    f"transfer: {_fmt_bytes(nbytes):>7} {kind:8s}: median {m * 1e3:9.3f} ms "
                    f"({2 * nbytes / m / 1e9:6.2f} GB/s moved), equal={ok}"
                )
            if "cuda_ipc" not in kinds:
                row["cuda_ipc"] = {"skipped": pool.transport.reason}
            out["sizes"][str(nbytes)] = row
            del x
    return out


def _fmt_bytes(n: int) -> str:
    for unit, k in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


def _info(i) -> dict:
    d = dataclasses.asdict(i)
    return {
        k: d[k] for k in ("name", "pid", "backend", "devices", "jax_version", "quota", "mps", "birth_env")
    }


# --------------------------------------------------------------------- report
def machine_info() -> dict:
    info = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "shm_free_bytes": _shm.free_bytes(),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run(
                [smi, "--query-gpu=name,driver_version,memory.total,compute_mode", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["gpus"] = [line.strip() for line in r.stdout.strip().splitlines()]
        except (OSError, subprocess.TimeoutExpired) as e:
            info["gpus"] = [f"nvidia-smi failed: {e}"]
    else:
        info["gpus"] = []
    return info


def versions() -> dict:
    import jax
    import jaxlib
    import numpy

    v = {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": numpy.__version__,
        "psutil": psutil.__version__,
        "mps_binary": shutil.which("nvidia-cuda-mps-control"),
    }
    try:
        import cupy

        v["cupy"] = cupy.__version__
    except Exception as e:
        v["cupy"] = f"unavailable ({type(e).__name__})"
    try:
        v["git_commit"] = (
            subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        v["git_commit"] = None
    return v


def atomic_write(path: Path, text: str) -> None:
    from rose_jax.io import atomic_write_text

    atomic_write_text(str(path), text)


def checks(res: dict) -> dict:
    c = {}
    t = res.get("transfer", {}).get("sizes", {})
    big = t.get(str(max((int(k) for k in t), default=0)), {})
    if "median_s" in big.get("shm", {}) and "median_s" in big.get("cuda_ipc", {}):
        c["ipc_faster_than_host_at_largest"] = big["cuda_ipc"]["median_s"] < big["shm"]["median_s"]
    c["transfers_equal"] = all(v.get("equal", True) for row in t.values() for v in row.values())
    if "rates" in res and "ratio_70_over_30" in res["rates"]:
        c["rates_follow_quota"] = 1.5 <= res["rates"]["ratio_70_over_30"] <= 3.5
    if "kill" in res and "ok" in res["kill"]:
        c["kill_cleanup"] = res["kill"]["ok"]
    if "search" in res and "measured_gain" in res["search"]:
        c["search_gain_ge_15pct"] = res["search"]["measured_gain"] >= 0.15
    return c


def markdown(res: dict) -> str:
    L = [
        f"# MPS + worker runtime benchmark ({'DRY RUN, CPU' if res['dry_run'] else 'GPU'})",
        "",
        f"- command: `{' '.join(res['command'])}`",
        f"- started: {res['started']}, took {res['seconds']:.0f} s (budget {res['budget_s']:.0f} s)",
        f"- machine: {res['machine']['hostname']}, GPUs: {res['machine'].get('gpus') or 'none'}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()),
        f"- MPS: {res['mps']['reason']}",
        "",
    ]
    if "kill" in res and "ok" in res["kill"]:
        k = res["kill"]
        d = k["daemon"]
        L += [
            "## 1. Worker SIGKILLed mid-loop",
            "",
            f"- error: `{(k['worker_died'] or {}).get('message')}`",
            "- daemon: "
            + (
                f"quit_ok={d['quit_ok']}, clean={d['clean']}, forced={d['forced']}, {d['seconds']:.1f} s"
                if d
                else "none (dry run)"
            ),
            f"- MPS processes after: {k['mps_processes_after'] or 'none'}; leftover children: "
            f"{k['leftover_children'] or 'none'}; leftover segments: {k['leftover_segments'] or 'none'}",
            f"- result: {'OK' if k['ok'] else 'FAILED'}",
            "",
        ]
    if "rates" in res and "tflops" in res["rates"]:
        r = res["rates"]
        L += [
            "## 2. Two workers under MPS, concurrent matmul loops",
            "",
            "| worker | quota | TFLOP/s |",
            "|---|---|---|",
            f"| q30 | 30% | {r['tflops']['q30']:.4g} |",
            f"| q70 | 70% | {r['tflops']['q70']:.4g} |",
            "",
            f"ratio {r['ratio_70_over_30']:.2f} (quota ratio 2.33), concurrent for {r['overlap_s']:.1f} s",
            "",
        ]
    if "transfer" in res and "sizes" in res["transfer"]:
        tr = res["transfer"]
        L += [
            "## 3. Round trip driver -> worker -> driver (median)",
            "",
            f"auto transport: {tr['transport_auto']['kind']} ({tr['transport_auto']['reason']})",
            "",
            "| size | host shm | CUDA IPC | speed-up |",
            "|---|---|---|---|",
        ]
        for k, row in tr["sizes"].items():
            cells = []
            for kind in ("shm", "cuda_ipc"):
                v = row.get(kind, {})
                cells.append(
                    f"{v['median_s'] * 1e3:.3f} ms"
                    if "median_s" in v
                    else f"skipped: {v.get('skipped', '-')}"
                )
            s = row.get("shm", {}).get("median_s"), row.get("cuda_ipc", {}).get("median_s")
            sp = f"{s[0] / s[1]:.1f}x" if all(s) else "-"
            L.append(f"| {_fmt_bytes(int(k))} | {cells[0]} | {cells[1]} | {sp} |")
        L.append("")
    if "search" in res and "result" in res["search"]:
        s = res["search"]
        r = s["result"]
        vq = tuple(s["validated_quotas"])
        L += [
            "## 4. Slack-aware quota search (A matmul-heavy, B memory-bound)",
            "",
            "| split | predicted join | measured join (concurrent) |",
            "|---|---|---|",
            f"| even {tuple(r['even_quotas'])} | {r['predicted_even_join_s'] * 1e3:.2f} ms | "
            f"{s['measured_join_s']['even'] * 1e3:.2f} ms |",
            f"| chosen {vq} | {s['validated_predicted_join_s'] * 1e3:.2f} ms | "
            f"{s['measured_join_s']['chosen'] * 1e3:.2f} ms |",
            "",
            f"measured gain {s['measured_gain'] * 100:.1f}% (target >= 15%); predicted "
            f"{s['predicted_gain'] * 100:.1f}%. {s['validation_note']}",
            "",
            f"Isolation: {s['isolation']}.",
            "",
            "| round | points | new workers | start | prepare | timed | total |",
            "|---|---|---|---|---|---|---|",
        ]
        L += [
            f"| {x['round']} | {x['points']} | {x['new_workers']} | {x['start_s']:.1f} s | "
            f"{x['prepare_s']:.1f} s | {x['timed_s']:.1f} s | {x['seconds']:.1f} s |"
            for x in s["rounds"]
        ]
        L += ["", "tried points (ms, each branch alone):", "", "| round | branch | quota | time |"]
        L += ["|---|---|---|---|"]
        L += [
            f"| {p['round']} | {'AB'[p['branch']]} | {p['quota']} | {p['seconds'] * 1e3:.2f} |"
            for p in r["points"]
        ]
        L.append("")
    tmg = res.get("timing", {})
    if tmg:
        L += ["## Time", "", "| phase | seconds |", "|---|---|"]
        L += [f"| {k} | {v:.1f} |" for k, v in tmg.get("phases_s", {}).items()]
        L += ["", "| pool | workers | start | close |", "|---|---|---|---|"]
        closes = {(c["label"], i): c for i, c in enumerate(tmg.get("pool_closes", []))}
        close_by_label = {}
        for (label, _), c in closes.items():
            close_by_label.setdefault(label, []).append(c["seconds"])
        for st in tmg.get("pool_starts", []):
            cl = close_by_label.get(st["label"], [])
            L.append(
                f"| {st['label']} | {st['workers']} | {st['seconds']:.1f} s | "
                f"{f'{cl.pop(0):.1f} s' if cl else '-'} |"
            )
        L += ["", "budget decisions:", ""]
        L += [
            f"- {d['what']}: {'run' if d['run'] else 'SKIPPED'} (needs ~{d['need_s']} s, {d['left_s']} s left"
            f"{'; ' + d['why'] if d.get('why') else ''})"
            for d in tmg.get("budget_decisions", [])
        ]
        L.append("")
    for name in PHASES:
        if "skipped" in res.get(name, {}):
            L.append(f"- {name}: skipped ({res[name]['skipped']})")
    L += ["## Checks" + (" (dry run: informational only, no MPS)" if res["dry_run"] else ""), ""] + [
        f"- {k}: {'PASS' if v else 'FAIL'}" for k, v in res["checks"].items()
    ]
    if res.get("errors"):
        L += ["", "## Errors", ""] + [f"- {k}: `{v}`" for k, v in res["errors"].items()]
    return "\n".join(L) + "\n"


def summary_table(res: dict) -> str:
    rows = []
    for k, row in res.get("transfer", {}).get("sizes", {}).items():
        for kind in ("shm", "cuda_ipc"):
            v = row.get(kind, {})
            rows.append(
                (
                    f"round trip {_fmt_bytes(int(k))} {kind}",
                    f"{v['median_s'] * 1e3:.3f} ms" if "median_s" in v else "skipped",
                )
            )
    if "tflops" in res.get("rates", {}):
        r = res["rates"]
        rows.append(
            (
                "TFLOP/s at 30% / 70%",
                f"{r['tflops']['q30']:.4g} / {r['tflops']['q70']:.4g} (ratio {r['ratio_70_over_30']:.2f})",
            )
        )
    if "ok" in res.get("kill", {}):
        rows.append(("SIGKILL cleanup", "OK" if res["kill"]["ok"] else "FAILED"))
    if "measured_gain" in res.get("search", {}):
        s = res["search"]
        rows.append(
            (
                f"join at {tuple(s['validated_quotas'])} vs {tuple(s['result']['even_quotas'])}",
                f"{s['measured_join_s']['chosen'] * 1e3:.2f} vs {s['measured_join_s']['even'] * 1e3:.2f} ms "
                f"({s['measured_gain'] * 100:.1f}% shorter)",
            )
        )
    w = max((len(a) for a, _ in rows), default=10)
    return "\n".join(f"  {a:<{w}}  {b}" for a, b in rows)


PHASES = ("kill", "rates", "transfer", "search")  # the order they run in
# Lower is more important: what a tight budget cuts first is the highest number.
IMPORTANCE = {"kill": 0, "rates": 1, "search": 2, "transfer": 3}


def estimates(sizes: Sizes, tm: Timing) -> dict:
    """Expected seconds of each phase (H200), from the worker start times measured so far."""
    s, c = tm.start_estimate(), tm.close_estimate()
    return {
        "kill": s + c + 6.0,  # daemon up, 2 workers, one loop, kill, detection, daemon quit
        "rates": s + c + sizes.rate_seconds + 4.0,  # + compile and warm-up, daemon up/quit
        "transfer": s + c + 14.0,  # child import jax + CUDA init, ~70 round trips (1 GB: 8)
        "search": s + c + 20.0,  # round 1 (prepare ~5, timed ~5) + validation (~3) + daemons
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing check: no MPS, tiny sizes")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mps"), help="results directory")
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
    sizes = DRY if args.dry_run else FULL
    if args.transfer_child:  # internal: the transfer phase's driver side, in its own process
        res = phase_transfer(sizes)
        Path(args.transfer_child).write_text(json.dumps(res, default=str))
        return 0
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}")

    ok, reason = mps_status()
    use_mps = ok and not args.dry_run
    if args.dry_run:
        reason = f"dry run: MPS not used ({reason})"
    elif not ok:
        reason = f"{reason}; running WITHOUT MPS: quotas have no effect"
    log(f"mps: {reason}")
    res = {
        "benchmark": "mps_gpu",
        "dry_run": args.dry_run,
        "command": [sys.executable, *sys.argv],
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": versions(),
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
        if name == "search":  # the number: run it whenever any budget is left
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
            return phase_rates(daemon, sizes, tm)

    def run_search():
        with mps_session(run_root, "search", use_mps, tm) as daemon:
            return phase_search(daemon, sizes, tm, budget)

    runners = {
        "kill": lambda: phase_kill(run_root, use_mps, sizes, tm),
        "rates": run_rates,
        "transfer": lambda: phase_transfer_child(
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
    res["checks"] = checks(res)
    out = Path(args.out)
    stem = "mps_gpu_dry_run" if args.dry_run else "mps_gpu"
    atomic_write(out / f"{stem}.json", json.dumps(res, indent=2, default=str) + "\n")
    atomic_write(out / f"{stem}.md", markdown(res))
    print("\nsummary:\n" + summary_table(res), flush=True)
    print(
        "checks: " + ", ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in res["checks"].items()), flush=True
    )
    log(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
