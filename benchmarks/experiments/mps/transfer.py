"""Driver -> worker -> driver round trip of a float32 array: host shared memory vs same-GPU CUDA IPC.

Sizes 1 MB, 64 MB, 1 GB (``identity`` in the worker), median of repeats; the array starts and
ends on the driver's GPU. No MPS. The driver side runs in a child process, so that its CUDA
context dies with it (the experiment's own process never holds one next to an MPS server).
Part of ``python -m benchmarks.experiments.mps`` (phase ``transfer``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rose_jax.runtime import shm, start_workers

from benchmarks import common
from benchmarks.experiments.mps.harness import (
    P,
    T0,
    T0_VAR,
    Sizes,
    fmt_bytes,
    log,
    median,
    specs,
    worker_info,
)


def phase_transfer_child(sizes: Sizes, dry_run: bool, timeout_s: float) -> dict:
    """phase_transfer in a child process (its CUDA context dies with it); returns its result."""
    with tempfile.TemporaryDirectory(prefix="rose-transfer-") as td:
        out = Path(td) / "transfer.json"
        cmd = [sys.executable, "-m", "benchmarks.experiments.mps", "--transfer-child", str(out)]
        cmd += ["--dry-run"] if dry_run else []
        env = dict(os.environ, **{T0_VAR: repr(T0)})
        try:
            r = subprocess.run(cmd, env=env, cwd=common.REPO_DIR, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"transfer child did not finish within {timeout_s:.0f} s") from e
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(f"transfer child exited with {r.returncode} and no result")
        return json.loads(out.read_text())


def phase_transfer(sizes: Sizes) -> dict:
    """Round trips of ``sizes.transfer_bytes`` arrays through one worker, per transport."""
    import jax
    import jax.numpy as jnp

    backend = jax.default_backend()
    log(f"transfer: driver JAX backend {backend}, devices {[str(d) for d in jax.devices()]}")
    out: dict = {"backend": backend, "sizes": {}}
    with start_workers(specs(sizes, [("echo", None)], 0.3), transport="auto") as pool:
        out["transport_auto"] = dataclasses.asdict(pool.transport)
        out["worker"] = worker_info(pool.info["echo"])
        log(f"transfer: auto transport = {pool.transport.kind} ({pool.transport.reason})")
        kinds = ["shm"] + (["cuda_ipc"] if pool.transport.kind == "cuda_ipc" else [])
        for nbytes, reps in zip(sizes.transfer_bytes, sizes.transfer_reps, strict=True):
            x = jnp.arange(nbytes // 4, dtype=jnp.float32)
            x.block_until_ready()
            row = {}
            for kind in kinds:
                free = shm.free_bytes()
                if kind == "shm" and free is not None and free < 2.2 * nbytes:
                    row[kind] = {
                        "skipped": f"/dev/shm has {free / 2**20:.0f} MiB free, "
                        f"needs ~{2 * nbytes / 2**20:.0f}"
                    }
                    log(f"transfer: {fmt_bytes(nbytes)} {kind}: skipped ({row[kind]['skipped']})")
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
                    f"transfer: {fmt_bytes(nbytes):>7} {kind:8s}: median {m * 1e3:9.3f} ms "
                    f"({2 * nbytes / m / 1e9:6.2f} GB/s moved), equal={ok}"
                )
            if "cuda_ipc" not in kinds:
                row["cuda_ipc"] = {"skipped": pool.transport.reason}
            out["sizes"][str(nbytes)] = row
            del x
    return out



def markdown(tr: dict) -> list[str]:
    """The phase's section of the results Markdown."""
    out = [
        "## Round trip driver -> worker -> driver (median)",
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
            done = "median_s" in v
            cells.append(f"{v['median_s'] * 1e3:.3f} ms" if done else f"skipped: {v.get('skipped', '-')}")
        s = row.get("shm", {}).get("median_s"), row.get("cuda_ipc", {}).get("median_s")
        sp = f"{s[0] / s[1]:.1f}x" if all(s) else "-"
        out.append(f"| {fmt_bytes(int(k))} | {cells[0]} | {cells[1]} | {sp} |")
    return out + [""]


def summary(tr: dict) -> list[tuple[str, str]]:
    """(what, value) lines of the printed summary."""
    rows = []
    for k, row in tr.get("sizes", {}).items():
        for kind in ("shm", "cuda_ipc"):
            v = row.get(kind, {})
            rows.append((
                f"round trip {fmt_bytes(int(k))} {kind}",
                f"{v['median_s'] * 1e3:.3f} ms" if "median_s" in v else "skipped",
            ))
    return rows
