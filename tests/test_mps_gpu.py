"""The MPS runtime on a real GPU: cleanup after a SIGKILL, SM quotas, transfers, the quota search.

Each test needs an NVIDIA GPU with MPS (``nvidia-cuda-mps-control``) and skips with the reason
otherwise. They use the MPS experiment's phases (:mod:`benchmarks.experiments.mps`), whose
measurements the experiment records; here they are pass/fail. On the H200, about 3 minutes:

    python -m pytest -q -m gpu tests/test_mps_gpu.py
"""

from __future__ import annotations

import dataclasses
import os
import signal
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from rose_jax.mps import MPSDaemon, WorkerSpec, mps_status
from rose_jax.runtime import WorkerDied, start_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `benchmarks` is a top-level directory, not an installed package
    sys.path.insert(0, ROOT)

from benchmarks.experiments.mps import harness, quota_search, rates, transfer  # noqa: E402
from test_runtime import _children, _shm_entries  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def run_root():
    """A fresh MPS run directory under /tmp (short: the pipe path must fit a socket name)."""
    root = Path(tempfile.mkdtemp(prefix="rmps", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _require_mps() -> None:
    ok, reason = mps_status()
    if not ok:
        pytest.skip(f"needs an NVIDIA GPU with MPS: {reason}")


def _mps_processes() -> list[str]:
    """'pid name' of every live nvidia-cuda-mps-control / -server process on the machine."""
    out = []
    for p in psutil.process_iter(["name", "status"]):
        name = p.info["name"] or ""
        if name.startswith("nvidia-cuda-mps") and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(f"{p.pid} {name}")
    return out


def test_sigkilled_worker_under_mps_leaves_nothing_behind(run_root):
    """Two workers under MPS run a bf16 matmul loop; one is SIGKILLed mid-loop. WorkerDied names it
    and SIGKILL, the other worker is terminated, the daemon quits cleanly, and afterwards no MPS
    control/server process, no child process and no shared-memory segment of ours is left."""
    _require_mps()
    before_mps, before_children, before_segments = _mps_processes(), _children(), _shm_entries()
    marker = run_root / "started"
    loop = dict(n=8192, iters=10, seconds=60.0, dtype="bfloat16")
    specs = [WorkerSpec(n, quota=50, mem_fraction=0.3) for n in ("victim", "bystander")]
    daemon = MPSDaemon(run_root / "kill")
    victim = None
    with pytest.raises(WorkerDied) as died:
        with daemon as d, start_workers(specs, daemon=d, transport="shm") as pool:
            victim = pool.pids["victim"]
            fn = harness.P + "matmul_rate"
            calls = [
                pool.submit("victim", fn, static=dict(loop, marker=str(marker)), jit=False),
                pool.submit("bystander", fn, static=loop, jit=False),
            ]
            t0 = time.monotonic()
            while not marker.exists():
                assert time.monotonic() - t0 < 300, "the victim never started its loop"
                time.sleep(0.05)
            time.sleep(0.5)
            os.kill(victim, signal.SIGKILL)
            pool.wait(calls, timeout=120)
    assert died.value.name == "victim" and died.value.signal == signal.SIGKILL, str(died.value)
    report = daemon.last_shutdown
    assert report is not None and report.quit_ok and not report.remaining, report
    time.sleep(0.5)
    assert [p for p in _mps_processes() if p not in before_mps] == []
    assert _children() - before_children == set()
    assert _shm_entries() - before_segments == set()
    assert not (psutil.pid_exists(victim) and psutil.Process(victim).status() != psutil.STATUS_ZOMBIE)


def test_sm_quotas_set_the_matmul_rates(run_root):
    """Workers at 30 % and 70 % of the SMs, concurrently: their TFLOP/s follow the quotas (7/3)."""
    _require_mps()
    tm = harness.Timing()
    with harness.mps_session(run_root, "rates", True, tm) as daemon:
        res = rates.phase_rates(daemon, dataclasses.replace(harness.FULL, rate_seconds=3.0), tm)
    assert res["overlap_s"] > 2.0, res  # they really ran at the same time
    assert 1.5 <= res["ratio_70_over_30"] <= 3.5, res["tflops"]


def test_round_trips_are_exact_and_cuda_ipc_beats_host_memory():
    """Driver -> worker -> driver of 1 MB / 64 MB / 1 GB arrays (the experiment's child process):
    every transport returns the array unchanged; at the largest size both measured, CUDA IPC is
    faster than host shared memory."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (same-GPU CUDA IPC vs host shared memory)")
    res = transfer.phase_transfer_child(harness.FULL, dry_run=False, timeout_s=300.0)
    rows = res["sizes"]
    assert all(v.get("equal", True) for row in rows.values() for v in row.values()), rows
    if res["transport_auto"]["kind"] != "cuda_ipc":
        pytest.skip(f"CUDA IPC unavailable here: {res['transport_auto']['reason']}")
    both = [k for k, row in rows.items() if all("median_s" in row.get(t, {}) for t in ("shm", "cuda_ipc"))]
    assert both, rows
    big = rows[max(both, key=int)]
    assert big["cuda_ipc"]["median_s"] < big["shm"]["median_s"], big


def test_quota_search_shortens_the_join_of_unequal_branches(run_root):
    """A matmul-heavy and a memory-bound branch: the searched quotas' concurrent join is at least
    15 % shorter than at 50/50 (measured, interleaved repeats)."""
    _require_mps()
    tm = harness.Timing()
    with harness.mps_session(run_root, "search", True, tm) as daemon:
        res = quota_search.phase_search(daemon, harness.FULL, tm, harness.Budget(150.0, time.monotonic()))
    assert res["measured_gain"] >= 0.15, (res["validated_quotas"], res["measured_join_s"])
