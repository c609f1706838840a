"""``rose_jax.runtime.process.stop_groups``: a stopped run's whole process group ends, with real
processes (a wrapper and its child, as ``rose-jax train --mps-client`` or a plan's worker)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers_children import gone, wait_gone

from rose_jax.runtime.process import group_alive, stop_groups

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")


def _wrapper(pid_file, child_ignores_term: bool, leader_ignores_term: bool = False) -> subprocess.Popen:
    """A leader in its own session that starts a child writing its pid and sleeping; either may
    ignore SIGTERM (a child busy in a compile, a wrapper that must be killed)."""
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    child = (f"{ignore if child_ignores_term else ''}import os, time; "
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    leader = (f"{ignore if leader_ignores_term else ''}import subprocess, sys; "
              f"subprocess.call([sys.executable, '-c', {child!r}])")
    return subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)


def _pid(pid_file) -> int:
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.05)
    raise AssertionError("the child never started")


@pytest.mark.parametrize("child_ignores, leader_ignores", [(False, False), (True, False), (True, True)])
def test_stop_groups_ends_the_leader_and_its_children(tmp_path, child_ignores, leader_ignores):
    """SIGTERM to each group; a child (or leader) that ignores it is killed once the grace is over,
    also where its leader already exited (terminating only the leader left such a child running:
    algos.sweep's _stop_all before 2026-12-07)."""
    procs = [_wrapper(tmp_path / f"c{i}.pid", child_ignores, leader_ignores) for i in range(2)]
    children = [_pid(tmp_path / f"c{i}.pid") for i in range(2)]
    t0 = time.monotonic()
    stop_groups(procs, grace_s=1.0)
    assert all(p.returncode is not None for p in procs)
    assert time.monotonic() - t0 < 15
    for c in children:
        assert wait_gone(c, within_s=5.0), "a run's child outlived the stop"
    assert not any(group_alive(p.pid) for p in procs)  # no member left but zombies init may not reap


def test_stop_groups_of_finished_runs_returns_at_once():
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait()
    t0 = time.monotonic()
    stop_groups([p], grace_s=5.0)
    assert time.monotonic() - t0 < 1.0 and not group_alive(p.pid)


def test_a_sweep_stop_ends_each_runs_children(tmp_path, monkeypatch):
    """algos.sweep's stop of its runs (Ctrl-C, a failed run with --stop-on-failure, close()) ends
    each run's group: a run's child that ignores SIGTERM does not train on after the sweep (the
    method on the sweep's own run table, with real processes)."""
    import types

    from algos import sweep

    monkeypatch.setattr(sweep, "STOP_GRACE_S", 1.0)
    procs = {f"r{i}": _wrapper(tmp_path / f"c{i}.pid", child_ignores_term=True) for i in range(2)}
    children = [_pid(tmp_path / f"c{i}.pid") for i in range(2)]
    table = types.SimpleNamespace(_procs=procs, _stopping=set())
    sweep.ProcessSweep._stop_all(table)
    assert table._stopping == {"r0", "r1"} and all(p.returncode is not None for p in procs.values())
    for c in children:
        assert wait_gone(c, within_s=5.0), "a run's child outlived the sweep's stop"


def test_a_sweep_run_whose_process_died_has_its_children_stopped(tmp_path, monkeypatch):
    """A run's process that exits while its children go on (killed by the OOM killer, its plan's
    workers left): the sweep's poll stops the rest of its group as it records the run's end."""
    import types

    from algos import sweep

    monkeypatch.setattr(sweep, "STOP_GRACE_S", 1.0)
    pid_file = tmp_path / "orphan.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    leader = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"  # and exit
    p = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    orphan = _pid(pid_file)
    p.wait()
    assert group_alive(p.pid) and not gone(orphan)
    finished = []
    table = types.SimpleNamespace(runs=[types.SimpleNamespace(name="r0")], _procs={"r0": p}, _outcomes={},
                                  _finish=lambda run, rc: finished.append((run.name, rc)))
    sweep.ProcessSweep.poll(table)
    assert finished == [("r0", 0)]
    assert wait_gone(orphan, within_s=5.0) and not group_alive(p.pid)
