"""What the MPS experiments share: problem sizes, the clock and budget, worker pools and daemons.

Every progress line starts with the seconds since the run started (a child process inherits the
parent's start through :data:`T0_VAR`). Pools and daemons are context managers that log and
record their start and close times in a :class:`Timing`, from which the budget's estimates come.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path

from rose_jax.mps import MPSDaemon, WorkerSpec
from rose_jax.runtime import start_workers

P = "rose_jax.runtime.probes:"  # the worker functions' module
T0_VAR = "ROSE_MPS_BENCH_T0"  # the parent's start (time.monotonic, system-wide) for a child's log
T0 = float(os.environ.get(T0_VAR) or time.monotonic())
DEFAULT_START_S = 10.0  # estimate of one round of parallel worker starts before any was measured


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
    # ~290 ms at 20% on an H200 (0.75 x the 64-iteration times in results/mps/logs/mps_gpu_partial.log).
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
    """A wall-clock budget of ``seconds`` from ``start`` (``time.monotonic``; default: the run's T0)."""

    seconds: float
    start: float = T0

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


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



def specs(sizes: Sizes, named_quotas, mem_fraction: float) -> list[WorkerSpec]:
    return [
        WorkerSpec(n, quota=q, mem_fraction=mem_fraction, env=dict(sizes.worker_env)) for n, q in named_quotas
    ]


def new_daemon(run_root: Path, name: str, use_mps: bool):
    """An MPS daemon under ``run_root/name`` (a context manager), or a stand-in without MPS."""
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
    cm = new_daemon(run_root, name, use_mps)
    with cm as daemon:
        if use_mps:
            log(f"{name}: MPS daemon up in {time.monotonic() - t0:.1f} s at {daemon.pipe_dir}")
        yield daemon
        t1 = time.monotonic()
    rep = getattr(cm, "last_shutdown", None)
    if rep is not None:
        log(f"{name}: MPS daemon quit in {time.monotonic() - t1:.1f} s (clean={rep.clean})")



def fmt_bytes(n: int) -> str:
    for unit, k in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


def worker_info(i) -> dict:
    """The facts of a started worker (``pool.info[name]``) worth recording."""
    d = dataclasses.asdict(i)
    return {
        k: d[k] for k in ("name", "pid", "backend", "devices", "jax_version", "quota", "mps", "birth_env")
    }


