"""MPS daemon + worker runtime on one GPU: exchange, SM quotas, a killed worker, quota search.

Run on the GPU machine from the repository root (about 2-3 minutes on an H200):

    python benchmarks/mps_gpu.py                 # results in benchmarks/results/mps/mps_gpu.{json,md}
    python benchmarks/mps_gpu.py --dry-run       # CPU plumbing check: no MPS, tiny sizes, ~1 min

Phases (run in the order 2, 4, 3, 1 so that this driver process creates no CUDA context while an
MPS daemon is up; the driver is not an MPS client):

1. transfer: driver -> worker -> driver round trip of a float32 array of 1 MB, 64 MB, 1 GB
   (``identity`` in the worker), host shared memory vs same-GPU CUDA IPC; median of repeats,
   the array starts and ends on the driver's GPU. No MPS.
2. rates: two workers under MPS at 30% and 70% SMs run a bf16 matmul loop concurrently (synced
   by the pool barrier): TFLOP/s each; the ratio should follow the quotas.
3. kill: two workers under a fresh MPS daemon run the matmul loop; one is SIGKILLed mid-loop.
   Expect ``WorkerDied`` naming it and SIGKILL, the other worker terminated, the daemon quitting
   cleanly, and afterwards no nvidia-cuda-mps-control / nvidia-cuda-mps-server process (ps),
   no child process and no shared-memory segment of ours.
4. search: a matmul-heavy branch and a memory-bound branch (reduction + axpy over 1 GiB) are
   each timed alone at quotas 10..90 (one worker per quota), then refined around the choice;
   ``rose_jax.mps.search_quotas`` picks the quotas; both branches then run concurrently at the
   chosen quotas and at 50/50 (interleaved repeats, median join time). Target: >= 15% shorter.

Every progress line starts with the elapsed time. The results JSON and Markdown (machine,
versions, command, every measured point) are written atomically (temp file + rename).
"""

from __future__ import annotations

import argparse
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

from rose_jax.mps import MPSDaemon, WorkerSpec, mps_status, search_quotas  # noqa: E402
from rose_jax.runtime import WorkerDied, start_workers  # noqa: E402
from rose_jax.runtime import shm as _shm  # noqa: E402

P = "rose_jax.runtime.probes:"
T0 = time.monotonic()


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
    rate_seconds: float = 8.0
    a_n: int = 8192  # matmul-heavy branch: a_iters matmuls of [a_n, a_n]
    a_iters: int = 64
    b_size: int = 1 << 28  # memory-bound branch: float32 [b_size] (1 GiB), b_iters passes
    b_iters: int = 40
    branch_reps: int = 3
    coarse: tuple[int, ...] = tuple(range(10, 100, 10))
    refine_step: int = 5
    join_reps: int = 5
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
    join_reps=3,
    kill_loop_seconds=30.0,
    worker_env=(("JAX_PLATFORMS", "cpu"),),
)


def median(xs):
    return statistics.median(xs) if xs else None


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


# ------------------------------------------------------------------- 2: rates
def phase_rates(daemon, sizes: Sizes) -> dict:
    st = dict(n=sizes.rate_n, iters=sizes.rate_iters, seconds=sizes.rate_seconds, dtype=sizes.dtype)
    log(
        f"rates: 2 workers at 30% / 70% SMs, {sizes.dtype} [{sizes.rate_n}]^2 matmul loop, "
        f"{sizes.rate_seconds:.0f} s each, started together by the pool barrier"
    )
    with start_workers(specs(sizes, [("q30", 30), ("q70", 70)], 0.3), daemon=daemon, transport="shm") as pool:
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


def phase_search(daemon, sizes: Sizes) -> dict:
    log(
        f"search: branch A = {sizes.a_iters} x {sizes.dtype} [{sizes.a_n}]^2 matmuls, "
        f"branch B = {sizes.b_iters} x (mean + axpy) over float32 [{sizes.b_size}] "
        f"({sizes.b_size * 4 / 2**30:.2f} GiB)"
    )
    rounds = []

    def measure(points):
        quotas = sorted({q for _, q in points})
        mem = min(0.9 / len(quotas), 0.2)
        t0 = time.monotonic()
        log(
            f"search: round {len(rounds) + 1}: {len(points)} points, {len(quotas)} workers at quotas {quotas}"
        )
        with start_workers(
            specs(sizes, [(f"q{q}", q) for q in quotas], mem), daemon=daemon, transport="shm"
        ) as pool:
            prep = [
                pool.submit(f"q{q}", P + "prepare_branch", static=_branch_static(sizes, b), jit=False)
                for b, q in points
            ]
            pool.wait(prep, timeout=600)
            times = []
            for b, q in points:  # one at a time: each branch alone on the GPU
                t = pool.call(
                    f"q{q}",
                    P + "time_branch",
                    static=dict(_branch_static(sizes, b), reps=sizes.branch_reps),
                    jit=False,
                    timeout=300,
                )
                times.append(float(t))
        rounds.append({"points": len(points), "workers": len(quotas), "seconds": time.monotonic() - t0})
        for (b, q), t in zip(points, times, strict=True):
            log(f"search:   branch {'AB'[b]} at {q:3d}%: {t * 1e3:8.2f} ms")
        return times

    result = search_quotas(measure, 2, coarse=sizes.coarse, refine_step=sizes.refine_step)
    qa, qb = result.quotas
    log(
        f"search: chosen {qa}/{qb} (predicted join {result.predicted_join_s * 1e3:.2f} ms) vs even 50/50 "
        f"(predicted {result.predicted_even_join_s * 1e3:.2f} ms)"
    )

    log("search: validating concurrently: A and B at 50/50 and at the chosen quotas, interleaved")
    plan = [("evenA", 50), ("evenB", 50), ("optA", qa), ("optB", qb)]
    with start_workers(specs(sizes, plan, 0.2), daemon=daemon, transport="shm") as pool:
        stA, stB = _branch_static(sizes, 0), _branch_static(sizes, 1)
        pool.wait(
            [
                pool.submit(n, P + "prepare_branch", static=stA if n.endswith("A") else stB, jit=False)
                for n, _ in plan
            ],
            timeout=600,
        )
        joins = {"even": [], "chosen": []}
        for _ in range(sizes.join_reps):
            for key, (na, nb) in (("even", ("evenA", "evenB")), ("chosen", ("optA", "optB"))):
                # both branches start together (warm, no warm-up run) and the iteration waits for both
                t0 = time.perf_counter()
                ha = pool.submit(na, P + "time_branch", static=dict(stA, reps=1, warmup=False), jit=False)
                hb = pool.submit(nb, P + "time_branch", static=dict(stB, reps=1, warmup=False), jit=False)
                ta, tb = pool.wait([ha, hb], timeout=300)
                joins[key].append({"join_s": time.perf_counter() - t0, "a_s": float(ta), "b_s": float(tb)})
    even = median([j["join_s"] for j in joins["even"]])
    chosen = median([j["join_s"] for j in joins["chosen"]])
    gain = 1 - chosen / even
    log(
        f"search: measured join {chosen * 1e3:.2f} ms at {qa}/{qb} vs {even * 1e3:.2f} ms at 50/50: "
        f"{gain * 100:.1f}% shorter (target >= 15%)"
    )
    return {
        "result": result.to_dict(),
        "rounds": rounds,
        "measured_join_s": {"even": even, "chosen": chosen},
        "measured_gain": gain,
        "joins": joins,
    }


# -------------------------------------------------------------------- 3: kill
def phase_kill(run_root: Path, use_mps: bool, sizes: Sizes) -> dict:
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
            with start_workers(
                specs(sizes, [("victim", 50), ("bystander", 50)], 0.3), daemon=daemon, transport="shm"
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


# ---------------------------------------------------------------- 1: transfer
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
        f"- started: {res['started']}, took {res['seconds']:.0f} s",
        f"- machine: {res['machine']['hostname']}, GPUs: {res['machine'].get('gpus') or 'none'}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()),
        f"- MPS: {res['mps']['reason']}",
        "",
    ]
    if "transfer" in res and "sizes" in res["transfer"]:
        tr = res["transfer"]
        L += [
            "## 1. Round trip driver -> worker -> driver (median)",
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
    if "kill" in res and "ok" in res["kill"]:
        k = res["kill"]
        d = k["daemon"]
        L += [
            "## 3. Worker SIGKILLed mid-loop",
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
    if "search" in res and "result" in res["search"]:
        s = res["search"]
        r = s["result"]
        L += [
            "## 4. Slack-aware quota search (A matmul-heavy, B memory-bound)",
            "",
            "| split | predicted join | measured join |",
            "|---|---|---|",
            f"| even {r['even_quotas']} | {r['predicted_even_join_s'] * 1e3:.2f} ms | "
            f"{s['measured_join_s']['even'] * 1e3:.2f} ms |",
            f"| chosen {r['quotas']} | {r['predicted_join_s'] * 1e3:.2f} ms | "
            f"{s['measured_join_s']['chosen'] * 1e3:.2f} ms |",
            "",
            f"measured gain {s['measured_gain'] * 100:.1f}% (target >= 15%)",
            "",
            "tried points (ms):",
            "",
            "| round | branch | quota | time |",
            "|---|---|---|---|",
        ]
        L += [
            f"| {p['round']} | {'AB'[p['branch']]} | {p['quota']} | {p['seconds'] * 1e3:.2f} |"
            for p in r["points"]
        ]
        L.append("")
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
                f"join at {tuple(s['result']['quotas'])} vs (50, 50)",
                f"{s['measured_join_s']['chosen'] * 1e3:.2f} vs {s['measured_join_s']['even'] * 1e3:.2f} ms "
                f"({s['measured_gain'] * 100:.1f}% shorter)",
            )
        )
    w = max((len(a) for a, _ in rows), default=10)
    return "\n".join(f"  {a:<{w}}  {b}" for a, b in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing check: no MPS, tiny sizes")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mps"), help="results directory")
    ap.add_argument("--run-dir", default=None, help="MPS run directory (default: a new /tmp/rmps* directory)")
    ap.add_argument(
        "--budget-s", type=float, default=230.0, help="skip remaining phases after this many seconds"
    )
    ap.add_argument("--phases", default="rates,search,kill,transfer", help="comma-separated subset to run")
    args = ap.parse_args(argv)
    sizes = DRY if args.dry_run else FULL
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - {"rates", "search", "kill", "transfer"}
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
        "errors": {},
    }
    run_root = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="rmps", dir="/tmp"))

    def over_budget(name):
        if time.monotonic() - T0 > args.budget_s:
            res[name] = {"skipped": f"time budget of {args.budget_s:.0f} s used up"}
            log(f"{name}: skipped (time budget)")
            return True
        return False

    def guarded(name, fn):
        try:
            res[name] = fn()
        except Exception as e:  # record and go on: one broken phase must not hide the others
            res["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"{name}: ERROR {type(e).__name__}: {e}")

    try:
        mps_phases = [p for p in ("rates", "search") if p in phases]
        if mps_phases:
            try:
                with _daemon(run_root, "main", use_mps) as daemon:
                    if use_mps:
                        log(f"mps: daemon up at {daemon.pipe_dir} (control pid {daemon.control_pid})")
                    for name in mps_phases:
                        if not over_budget(name):
                            guarded(
                                name,
                                lambda name=name: {"rates": phase_rates, "search": phase_search}[name](
                                    daemon, sizes
                                ),
                            )
            except Exception as e:
                res["errors"]["daemon"] = f"{type(e).__name__}: {e}"
                log(f"mps: ERROR {type(e).__name__}: {e}")
        if "kill" in phases and not over_budget("kill"):
            guarded("kill", lambda: phase_kill(run_root, use_mps, sizes))
        if "transfer" in phases and not over_budget("transfer"):
            guarded("transfer", lambda: phase_transfer(sizes))
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
    res["seconds"] = time.monotonic() - T0
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
