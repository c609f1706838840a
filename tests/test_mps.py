"""rose_jax.mps: plans, mps_status, the daemon's lifecycle, and the slack-aware quota search.

The daemon-lifecycle tests on CPU run against a MOCK ``nvidia-cuda-mps-control`` (a small
Python script written by the ``fake_mps`` fixture: it daemonizes, writes the pid file and a
``control`` file, spawns a mock ``nvidia-cuda-mps-server`` and answers ``get_server_list`` /
``quit``). It is not NVIDIA's program; it exercises our start / health / quit / cleanup code
paths. The same path against the real daemon is ``test_real_daemon_starts_and_quits`` (gpu).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from rose_jax.mps import (
    BranchModel,
    MPSDaemon,
    MPSError,
    SMQuota,
    WorkerSpec,
    choose_quotas,
    even_quotas,
    fit_branch,
    join_time,
    measure_each,
    mps_status,
    quotas_from_tables,
    search_quotas,
    validate_specs,
    worker_environment,
)
from rose_jax.mps import plan

# ---------------------------------------------------------------------------- plans


@pytest.mark.parametrize("bad", [0, 101, -5, 50.0, True, "50", None])
def test_smquota_rejects_bad_percent(bad):
    with pytest.raises(ValueError, match="SMQuota.percent"):
        SMQuota(bad)


def test_smquota_and_spec_are_frozen_and_normalised():
    s = WorkerSpec("sim", quota=30, mem_fraction=0.25, env={"B": "2", "A": "1"})
    assert s.quota == SMQuota(30) and str(s.quota) == "30%"
    assert s.env == (("A", "1"), ("B", "2")) and s.env_dict == {"A": "1", "B": "2"}
    assert s.with_quota(70).quota.percent == 70 and s.quota.percent == 30
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.name = "other"
    assert hash(s) == hash(WorkerSpec("sim", quota=SMQuota(30), mem_fraction=0.25, env={"A": "1", "B": "2"}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name=""), "name must match"),
        (dict(name="a b"), "name must match"),
        (dict(name="w", mem_fraction=0.0), "mem_fraction must be in"),
        (dict(name="w", mem_fraction=0.96), "mem_fraction must be in"),
        (dict(name="w", mem_fraction="0.5"), "mem_fraction must be a float"),
        (dict(name="w", quota=0), "SMQuota.percent"),
        (dict(name="w", env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}), "may not set"),
        (dict(name="w", env={"XLA_CLIENT_MEM_FRACTION": "0.5"}), "may not set"),
        (dict(name="w", env={"A": 1}), "str -> str"),
    ],
)
def test_worker_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkerSpec(**kwargs)


def test_validate_specs():
    ok = validate_specs([WorkerSpec("a", 30, 0.45), WorkerSpec("b", 70, 0.5)])
    assert [s.name for s in ok] == ["a", "b"]
    with pytest.raises(ValueError, match=r"sum of mem_fraction is 0\.960 > 0\.95"):
        validate_specs([WorkerSpec("a", 30, 0.5), WorkerSpec("b", 70, 0.46)])
    with pytest.raises(ValueError, match="repeated"):
        validate_specs([WorkerSpec("a"), WorkerSpec("a")])
    with pytest.raises(ValueError, match="at least one"):
        validate_specs([])
    with pytest.raises(ValueError, match="expected WorkerSpec"):
        validate_specs(["a"])


def test_worker_environment_is_explicit():
    base = {
        "PATH": "/bin",
        "CUDA_MPS_PIPE_DIRECTORY": "/foreign",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "5",
        "XLA_CLIENT_MEM_FRACTION": "0.9",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
    }
    spec = WorkerSpec("learn", quota=30, mem_fraction=0.4, env={"JAX_PLATFORMS": "cuda"})
    mps_env = {"CUDA_MPS_PIPE_DIRECTORY": "/run/p", "CUDA_MPS_LOG_DIRECTORY": "/run/l"}
    env = worker_environment(spec, mps_env=mps_env, base=base)
    assert env == {
        "PATH": "/bin",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/p",
        "CUDA_MPS_LOG_DIRECTORY": "/run/l",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "JAX_PLATFORMS": "cuda",
        "ROSE_WORKER_NAME": "learn",
    }
    # Without a daemon nothing of MPS is inherited or set, and no memory fraction either.
    env = worker_environment(WorkerSpec("w", quota=30), base=base)
    assert not any(k.startswith("CUDA_MPS_") for k in env)
    assert "XLA_CLIENT_MEM_FRACTION" not in env and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    # A spec may opt back into preallocation (it is not a managed variable).
    env = worker_environment(WorkerSpec("w", env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}), base=base)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    with pytest.raises(ValueError, match="lacks"):
        worker_environment(spec, mps_env={"CUDA_MPS_LOG_DIRECTORY": "/x"}, base=base)


# ------------------------------------------------------------------------ mps_status


def test_mps_status_on_this_machine_gives_a_reason():
    ok, reason = mps_status()
    assert isinstance(ok, bool) and reason
    if shutil.which("nvidia-cuda-mps-control") is None:
        assert not ok
        assert reason.startswith("MPS unavailable") and "nvidia-cuda-mps-control not found on PATH" in reason
    else:
        assert ("MPS available" in reason) == ok


def test_mps_status_names_a_missing_binary():
    ok, reason = mps_status("rose-no-such-mps-control")
    assert not ok and "rose-no-such-mps-control not found on PATH" in reason


def test_mps_status_not_permitted(tmp_path):
    b = tmp_path / "nvidia-cuda-mps-control"
    b.write_text("#!/bin/sh\n")
    b.chmod(0o644)
    ok, reason = mps_status(str(b))  # no x bit: not even root may execute it
    assert not ok and "not permitted to execute" in reason


# ------------------------------------------------------------- daemon (mock binary)

FAKE_CONTROL = '''#!{python}
"""MOCK of nvidia-cuda-mps-control, written by tests/test_mps.py. Not NVIDIA's program."""
import os, signal, subprocess, sys, time
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
log = os.environ["CUDA_MPS_LOG_DIRECTORY"]
mode = os.environ.get("FAKE_MPS_MODE", "ok")
pidfile = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
server_file = os.path.join(pipe, "server.pid")
here = os.path.dirname(os.path.abspath(__file__))

def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False

if sys.argv[1:] == ["-d"]:
    if mode == "nostart":
        print("mock: cannot start the daemon")
        sys.exit(3)
    if os.fork():
        sys.exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    fd = os.open(os.devnull, os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(fd, i)
    server = subprocess.Popen([os.path.join(here, "nvidia-cuda-mps-server")])
    with open(server_file, "w") as f:
        f.write(str(server.pid))
    with open(os.path.join(log, "control.log"), "a") as f:
        f.write("mock control daemon started\\n")
    def stop(*_):
        if mode == "stubborn":
            return
        server.terminate()
        server.wait()
        with open(os.path.join(log, "control.log"), "a") as f:
            f.write("mock control daemon quit\\n")
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    with open(pidfile, "w") as f:
        f.write(str(os.getpid()))
    open(os.path.join(pipe, "control"), "w").close()
    while True:
        time.sleep(0.05)
else:
    cmd = sys.stdin.read().strip()
    try:
        pid = int(open(pidfile).read())
    except (OSError, ValueError):
        print("cannot connect to the mock daemon")
        sys.exit(1)
    if not alive(pid):
        sys.exit(1)
    if cmd == "get_server_list":
        if mode == "unhealthy":
            sys.exit(1)
        print(open(server_file).read())
    elif cmd == "quit":
        os.kill(pid, signal.SIGTERM)
    sys.exit(0)
'''

FAKE_SERVER = '''#!{python}
"""MOCK of nvidia-cuda-mps-server, written by tests/test_mps.py."""
import os, signal, time
if os.environ.get("FAKE_MPS_MODE") == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(0.05)
'''


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """Path of a MOCK nvidia-cuda-mps-control (see the module docstring); mode via FAKE_MPS_MODE."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("nvidia-cuda-mps-control", FAKE_CONTROL), ("nvidia-cuda-mps-server", FAKE_SERVER)):
        p = bindir / name
        p.write_text(text.format(python=sys.executable))
        p.chmod(0o755)
    monkeypatch.setenv("FAKE_MPS_MODE", "ok")
    return str(bindir / "nvidia-cuda-mps-control")


@pytest.fixture
def run_dir():
    """A short run directory (unix sockets limit the pipe directory's length); removed afterwards."""
    parent = tempfile.mkdtemp(prefix="rmps", dir="/tmp")
    yield Path(parent) / "run"
    shutil.rmtree(parent, ignore_errors=True)


def _mock_processes(run_dir) -> list[int]:
    """Live processes of the mock binaries serving a pipe directory under run_dir (so that other
    test runs on the same machine are not counted)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if not any(os.path.basename(a).startswith("nvidia-cuda-mps") for a in cmd[:2]):
                continue
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(str(run_dir)):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def test_daemon_lifecycle_with_mock(fake_mps, run_dir):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    d = MPSDaemon(run_dir, binary=fake_mps, quit_timeout=10)
    with d:
        assert d.running and d.healthy()
        assert d.pipe_dir.is_dir() and d.log_dir.is_dir()
        assert d.client_env() == {
            "CUDA_MPS_PIPE_DIRECTORY": str(d.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(d.log_dir),
        }
        servers = d.server_pids()
        assert len(servers) == 1 and psutil.pid_exists(servers[0])
        assert d.control_pid is not None and psutil.Process(d.control_pid).status() != psutil.STATUS_ZOMBIE
        assert signal.getsignal(signal.SIGTERM) == d._on_signal
        pids = [d.control_pid, *servers]
    report = d.last_shutdown
    assert report.clean and report.quit_ok and report.forced == () and report.remaining == ()
    assert "mock control daemon quit" in report.log_tail
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not os.path.exists(run_dir)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert d.stop() is report  # idempotent
    with pytest.raises(MPSError, match="already stopped"):
        d.start()


def test_daemon_cleans_up_on_exception(fake_mps, run_dir):
    with pytest.raises(RuntimeError, match="boom"):
        with MPSDaemon(run_dir, binary=fake_mps) as d:
            pids = [d.control_pid, *d.server_pids()]
            raise RuntimeError("boom")
    assert d.last_shutdown.clean
    assert not [p for p in pids if p in _mock_processes(run_dir)]
    assert not os.path.exists(run_dir)


def test_daemon_refuses_a_pipe_dir_in_use(fake_mps, run_dir):
    with MPSDaemon(run_dir, binary=fake_mps) as first:
        with pytest.raises(MPSError, match="already in use"):
            MPSDaemon(run_dir, binary=fake_mps).start()
        assert first.healthy()  # untouched by the refused second one
    assert not os.path.exists(run_dir)


def test_daemon_start_failure_cleans_up(fake_mps, run_dir, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_MODE", "unhealthy")
    d = MPSDaemon(run_dir, binary=fake_mps, start_timeout=1.5)
    with pytest.raises(MPSError, match="did not answer get_server_list"):
        d.start()
    assert not d.running and not _mock_processes(run_dir)
    assert not os.path.exists(run_dir)


def test_daemon_that_fails_to_start_is_a_clear_error(fake_mps, run_dir, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_MODE", "nostart")
    with pytest.raises(MPSError, match="-d exited with 3: mock: cannot start the daemon"):
        MPSDaemon(run_dir, binary=fake_mps).start()
    assert not os.path.exists(run_dir)


def test_daemon_missing_binary_is_a_clear_error(run_dir):
    with pytest.raises(MPSError, match="not found"):
        MPSDaemon(run_dir, binary="rose-no-such-mps-control").start()
    with pytest.raises(ValueError, match="unix sockets"):
        MPSDaemon("/tmp/" + "x" * 90)


def test_daemon_that_ignores_quit_is_killed(fake_mps, run_dir, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_MODE", "stubborn")
    with MPSDaemon(run_dir, binary=fake_mps, quit_timeout=0.5) as d:
        pids = {d.control_pid, *d.server_pids()}
    r = d.last_shutdown
    assert not r.clean and set(r.forced) == pids and r.remaining == ()
    assert not _mock_processes(run_dir)
    assert not os.path.exists(run_dir)


SIGNAL_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from rose_jax.mps import MPSDaemon
    # a test run started in the background of a non-interactive shell hands SIGINT down ignored,
    # and the daemon leaves an ignored signal ignored: start from Python's default handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    d = MPSDaemon(sys.argv[1], binary=sys.argv[2], quit_timeout=10)
    with d:
        print(d.control_pid, *d.server_pids(), flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("sig, codes", [(signal.SIGTERM, (143,)), (signal.SIGINT, (-signal.SIGINT, 1, 130))])
def test_daemon_cleans_up_on_signal(fake_mps, run_dir, sig, codes):
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNAL_SCRIPT, str(run_dir), fake_mps],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        pids = [int(t) for t in line.split()]
        assert len(pids) == 2, (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)  # stop(): quit_timeout 10 s + SIGTERM/SIGKILL graces of 3 s each
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc in codes
    assert not [p for p in pids if p in _mock_processes(run_dir)]
    assert not os.path.exists(run_dir)


def test_daemon_cleanup_after_a_worker_crash(fake_mps, run_dir):
    """A worker (real CPU JAX process, MPS env pointing at the mock daemon) is SIGKILLed mid-call:
    WorkerDied propagates out of both with-blocks and the daemon still quits and cleans up."""
    from rose_jax.runtime import WorkerDied, start_workers

    spec = WorkerSpec("w", quota=40, env={"JAX_PLATFORMS": "cpu"})
    with pytest.raises(WorkerDied, match="SIGKILL"):
        with MPSDaemon(run_dir, binary=fake_mps) as d:
            with start_workers([spec], daemon=d, transport="shm") as pool:
                born = pool.info["w"].birth_env
                assert born["CUDA_MPS_PIPE_DIRECTORY"] == str(d.pipe_dir)
                assert born["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
                assert pool.info["w"].mps and pool.info["w"].quota == 40
                h = pool.submit(
                    "w",
                    "rose_jax.runtime.probes:hold",
                    np.ones(4),
                    jit=False,
                    static=dict(marker=str(d.log_dir / "m"), seconds=60),
                )
                _wait_for(lambda: (d.log_dir / "m").exists())
                os.kill(pool.pids["w"], signal.SIGKILL)
                pool.wait([h], timeout=30)
    assert d.last_shutdown.clean
    assert not _mock_processes(run_dir)
    assert not os.path.exists(run_dir)


def _wait_for(pred, timeout=30.0):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.02)


@pytest.mark.gpu
def test_real_daemon_starts_and_quits():
    ok, reason = mps_status()
    if not ok:
        pytest.skip(reason)
    from rose_jax.runtime import start_workers

    run_dir = os.path.join(tempfile.mkdtemp(prefix="rmps", dir="/tmp"), "run")
    with MPSDaemon(run_dir) as d:
        assert d.healthy()
        with start_workers([WorkerSpec("w", quota=50, mem_fraction=0.2)], daemon=d, transport="shm") as pool:
            assert pool.info["w"].backend == "gpu"
            x = np.ones((64, 64), np.float32)
            out = pool.call("w", "rose_jax.runtime.probes:affine", x, x, np.zeros(64, np.float32))
            np.testing.assert_allclose(out, x @ x)
            assert d.server_pids()
    assert d.last_shutdown.clean, d.last_shutdown
    left = [
        p.pid
        for p in psutil.process_iter(["name"])
        if (p.info["name"] or "").startswith("nvidia-cuda-mps")
        and p.status() != psutil.STATUS_ZOMBIE
        and _pipe_dir(p) == str(d.pipe_dir)
    ]
    assert left == []
    assert not os.path.exists(run_dir)


def _pipe_dir(p):
    try:
        return p.environ().get("CUDA_MPS_PIPE_DIRECTORY")
    except psutil.Error:
        return None


# ---------------------------------------------------------------------- quota search


def test_search_moves_sms_to_the_compute_bound_branch():
    """A: compute-bound t = 1000/q; B: memory-bound t = max(10, 100/q) (its knee at 10%).
    Even split: max(20, 10) = 20. Optimum: B gets ~its knee, A the rest: max(1000/91, 100/9) = 11.11."""
    a = lambda q: 1000.0 / q  # noqa: E731
    b = lambda q: max(10.0, 100.0 / q)  # noqa: E731
    r = search_quotas(measure_each([a, b]), 2)
    brute = min(max(a(q), b(100 - q)) for q in range(1, 100))
    assert r.even_quotas == (50, 50) and r.predicted_even_join_s == pytest.approx(20.0)
    assert r.predicted_join_s == pytest.approx(brute, rel=1e-6) == pytest.approx(100 / 9, rel=1e-6)
    assert r.quotas[0] in (90, 91) and r.quotas[1] in (9, 10) and sum(r.quotas) <= 100
    assert r.predicted_gain == pytest.approx(1 - (100 / 9) / 20, rel=1e-6)  # 44% shorter join


def test_search_on_the_briefs_example_gives_b_only_its_knee():
    """A = 100/q, B = max(20, 200/q): B needs 10% to reach its floor of 20, which bounds the join
    whatever A gets; the search gives B exactly 10 (not 50) and reports no gain over 50/50."""
    r = search_quotas(measure_each([lambda q: 100.0 / q, lambda q: max(20.0, 200.0 / q)]), 2)
    assert r.quotas == (90, 10)
    assert r.predicted_join_s == pytest.approx(20.0) and r.predicted_even_join_s == pytest.approx(20.0)
    assert r.predicted_gain == pytest.approx(0.0)


def test_search_log_is_complete_and_json():
    calls = []

    def measure(points):
        calls.append(list(points))
        return [(1000.0 if b == 0 else 300.0) / q + 1.0 for b, q in points]

    r = search_quotas(measure, 2, refine_step=5)
    assert len(calls) == 2  # one batch per round: coarse, refine1
    coarse = [(p.branch, p.quota) for p in r.points if p.round == "coarse"]
    assert sorted(coarse) == [(b, q) for b in (0, 1) for q in range(10, 100, 10)]
    refine = [p for p in r.points if p.round == "refine1"]
    assert refine and all(len({p.quota for p in refine if p.branch == b}) <= 3 for b in (0, 1))
    assert len({(p.branch, p.quota) for p in r.points}) == len(r.points)  # nothing measured twice
    assert [(p.branch, p.quota) for p in r.points] == [pt for c in calls for pt in c]
    d = json.loads(r.to_json())
    assert d["quotas"] == list(r.quotas) and len(d["points"]) == len(r.points)
    assert d["points"][0] == {"branch": 0, "quota": 10, "seconds": 101.0, "round": "coarse"}
    # the choice equalises the two (continuous optimum of 1000/x = 300/(100-x): x = 76.9)
    assert r.quotas == (77, 23)


def test_choose_quotas_is_exact_against_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        k = 2 if trial < 20 else 3
        models = []
        for _ in range(k):
            qs = sorted(rng.sample(range(5, 101, 5), 6))
            ts = sorted((rng.uniform(1, 50) for _ in qs), reverse=True)
            models.append(fit_branch(zip(qs, ts, strict=True)))
        step = 5
        got = choose_quotas(models, budget=100, step=step)
        assert sum(got) <= 100 and all(q % step == 0 for q in got)
        grid = range(step, 101, step)
        best = min(join_time(models, qs) for qs in itertools.product(grid, repeat=k) if sum(qs) <= 100)
        assert join_time(models, got) == pytest.approx(best, rel=1e-9)


def test_branch_model_rules():
    m = fit_branch([(10, 10.0), (20, 6.0), (20, 4.0), (20, 5.0), (40, 7.0), (80, 2.0)])
    assert m.quotas == (10, 20, 40, 80)
    assert m.seconds == (10.0, 5.0, 5.0, 2.0)  # median of repeats; running minimum removes 7.0
    assert m(5) == pytest.approx(20.0)  # below the grid: as if compute-bound
    assert m(100) == 2.0  # above the grid: flat
    # linear in 1/q: exact for a + c/q
    m2 = fit_branch([(10, 1 + 100 / 10), (50, 1 + 100 / 50)])
    assert m2(20) == pytest.approx(1 + 100 / 20)
    assert isinstance(m2, BranchModel)
    with pytest.raises(ValueError, match="finite positive"):
        fit_branch([(10, float("nan"))])
    with pytest.raises(ValueError, match="at least one"):
        fit_branch([])
    with pytest.raises(ValueError, match="quota must be an int"):
        fit_branch([(0, 1.0)])


def test_tables_budget_and_oversubscription():
    tables = [{q: 600.0 / q for q in range(10, 100, 10)}, {q: 200.0 / q for q in range(10, 100, 10)}]
    r = quotas_from_tables(tables)
    assert r.quotas == (75, 25) and all(p.round == "table" for p in r.points)
    assert even_quotas(3) == (33, 33, 33) and even_quotas(2, step=10) == (50, 50)
    # budget > 100 (oversubscription) is allowed explicitly; with it both branches saturate
    r = quotas_from_tables(tables, budget=200)
    assert r.quotas == (90, 90) and r.budget == 200
    for bad in (1, 201, 100.0):
        with pytest.raises(ValueError, match="budget"):
            quotas_from_tables(tables, budget=bad)
    with pytest.raises(ValueError, match="quota step"):
        choose_quotas(r.models(), step=0)
    assert math.isclose(r.predicted_gain, 1 - r.predicted_join_s / r.predicted_even_join_s)


def test_plan_constants_are_what_jax_reads():
    # the deprecated name is the one every supported jaxlib reads; setting both is an error in jaxlib
    assert plan.MEM_FRACTION_VAR == "XLA_PYTHON_CLIENT_MEM_FRACTION"
    assert plan.MEM_FRACTION_VARS == ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")


def test_worker_daemon_prefers_given_then_inherited_then_own(fake_mps, monkeypatch):
    """rose_jax.mps.worker_daemon with the MOCK control binary on PATH (the real daemon path runs
    on the GPU: tests/test_offload.py's and tests/test_mps_gpu.py's GPU tests)."""
    from rose_jax.mps import InheritedDaemon, stop_own, worker_daemon
    from rose_jax.mps.plan import MPS_PIPE_VAR

    monkeypatch.setenv("PATH", os.path.dirname(fake_mps) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv(MPS_PIPE_VAR, raising=False)
    given = object()
    assert worker_daemon(given, None) == (given, None)
    monkeypatch.setenv(MPS_PIPE_VAR, "/tmp/some-pipe")
    d, own = worker_daemon(None, None)
    assert isinstance(d, InheritedDaemon) and str(d.pipe_dir) == "/tmp/some-pipe" and own is None
    monkeypatch.delenv(MPS_PIPE_VAR)
    with pytest.warns(UserWarning, match="not an MPS client"):
        d, own = worker_daemon(None, None, driver_computes=True)
    try:
        assert d is own and own.running and own.server_pids() is not None
        assert worker_daemon(None, own) == (own, own)  # reused while it runs
        first = own
        first.stop()
        d2, own2 = worker_daemon(None, first)  # a stopped one is replaced, not reused
        assert own2 is not first and own2.running and d2 is own2
        stop_own(own2)
        assert not own2.running
    finally:
        stop_own(own)
        stop_own(own2 if "own2" in locals() else None)


# ------------------------------------------------- ManagedPool: one owner of workers + daemon


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _worker_children() -> list[int]:
    return [c.pid for c in psutil.Process().children() if "multiprocessing" in " ".join(c.cmdline())
            and not _gone(c.pid)]


@pytest.mark.skipif(mps_status()[0], reason="MPS is available here (this test is for machines without it)")
def test_managed_pool_without_mps_fails_in_one_line_or_runs_plainly(monkeypatch):
    """Real behaviour on a machine without MPS (no mock): mps=True refuses in one line and leaves
    no process behind; mps="auto" runs plain workers and says why; bad arguments are one line."""
    from rose_jax.mps.plan import MPS_PIPE_VAR
    from rose_jax.runtime import ManagedPool

    monkeypatch.delenv(MPS_PIPE_VAR, raising=False)
    spec = WorkerSpec("w", quota=40, env={"JAX_PLATFORMS": "cpu"})
    before = set(_worker_children())
    with pytest.raises(MPSError, match=r"^ManagedPool\(mps=True\): the MPS daemon did not start: ") as e:
        with ManagedPool([spec], mps=True):
            raise AssertionError("the block must not run without MPS")
    assert "\n" not in str(e.value)
    assert set(_worker_children()) <= before
    with ManagedPool([spec], mps="auto", transport="shm") as m:
        assert m.daemon is None and not m.owns_daemon
        assert m.mps_reason == mps_status()[1] and m.mps_reason.startswith("MPS unavailable")
        info = m.pool.info["w"]
        assert not info.mps and info.quota is None
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in info.birth_env
        assert float(m.pool.call("w", "rose_jax.runtime.probes:tree_summary", np.ones(3))["sum"]) == 3.0
        pid = m.pool.pids["w"]
    assert _gone(pid) and not m.running
    with pytest.raises(ValueError, match="mps must be True, False or 'auto', got 'yes'"):
        ManagedPool([spec], mps="yes")
    with pytest.raises(ValueError, match="daemon was given with mps=False"):
        ManagedPool([spec], mps=False, daemon=object())
    with pytest.raises(RuntimeError, match="not started"):
        _ = ManagedPool([spec]).pool


def test_managed_pool_stops_workers_then_its_daemon_on_interrupt(fake_mps, monkeypatch):
    """With the MOCK control binary on PATH (see the module docstring): the pool starts its own
    daemon, its workers are born as its clients with their quota; a KeyboardInterrupt in the
    block stops the workers first, then the daemon, and leaves no process or directory behind."""
    from rose_jax.mps.plan import MPS_PIPE_VAR
    from rose_jax.runtime import ManagedPool

    monkeypatch.setenv("PATH", os.path.dirname(fake_mps) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv(MPS_PIPE_VAR, raising=False)
    order = []
    real_stop = MPSDaemon.stop

    def recording_stop(self):
        if self.running:
            order.append(("daemon stops; workers alive", [p for p in worker_pids if not _gone(p)]))
        return real_stop(self)

    monkeypatch.setattr(MPSDaemon, "stop", recording_stop)
    worker_pids: list[int] = []
    spec = WorkerSpec("w", quota=40, env={"JAX_PLATFORMS": "cpu"})
    with pytest.raises(KeyboardInterrupt):
        with ManagedPool([spec], mps=True, transport="shm") as m:
            d = m.daemon
            assert m.owns_daemon and isinstance(d, MPSDaemon) and d.running and m.mps_reason is None
            born = m.pool.info["w"].birth_env
            assert born["CUDA_MPS_PIPE_DIRECTORY"] == str(d.pipe_dir)
            assert born["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
            worker_pids.append(m.pool.pids["w"])
            daemon_pids = [d.control_pid, *d.server_pids()]
            raise KeyboardInterrupt
    assert order == [("daemon stops; workers alive", [])]
    assert _gone(worker_pids[0]) and not m.running and not m.owns_daemon and m.daemon is None
    assert d.last_shutdown.clean and all(_gone(p) for p in daemon_pids)
    assert not d.run_dir.exists()


def test_managed_pool_ensure_starts_over_after_a_death_keeps_a_given_daemon(fake_mps, run_dir, monkeypatch):
    """MOCK control binary (see the module docstring). ensure() after a SIGKILLed worker: a new
    pool under a new daemon of its own (the old one stopped); a daemon the caller gave is never
    stopped by the pool's owner."""
    from rose_jax.mps.plan import MPS_PIPE_VAR
    from rose_jax.runtime import ManagedPool, WorkerDied

    monkeypatch.setenv("PATH", os.path.dirname(fake_mps) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv(MPS_PIPE_VAR, raising=False)
    spec = WorkerSpec("w", env={"JAX_PLATFORMS": "cpu"})
    m = ManagedPool([spec], mps=True, transport="shm")  # "auto" would ask mps_status (no GPU here)
    try:
        first_pool = m.ensure()
        first_daemon = m.daemon
        assert m.ensure() is first_pool  # running: the same pool
        os.kill(first_pool.pids["w"], signal.SIGKILL)
        with pytest.raises(WorkerDied, match="SIGKILL"):
            first_pool.call("w", "rose_jax.runtime.probes:tree_summary", np.ones(2), timeout=30)
        second_pool = m.ensure()
        assert second_pool is not first_pool and second_pool.running
        assert not first_daemon.running and not first_daemon.run_dir.exists()
        assert m.daemon is not first_daemon and m.daemon.running
    finally:
        m.close()
    assert not m.running and m.daemon is None
    with MPSDaemon(run_dir, binary=fake_mps) as given:
        with ManagedPool([spec], daemon=given, transport="shm") as m2:
            assert m2.daemon is given and not m2.owns_daemon and m2.pool.info["w"].mps
        assert given.running  # the caller's: left running
    assert not _mock_processes(run_dir)
