"""Spawned child processes that never re-import the parent's ``__main__``, born with an explicit
environment.

``EnvProcess(target=..., args=..., env=...)`` is multiprocessing's "spawn" ``Process`` with two
differences, both made in :class:`EnvPopen`:

* The child is exec'd with ``env`` (None: this process's environment as it is) instead of an
  environment set by changing ``os.environ`` around ``start()``. Changing ``os.environ`` calls C
  ``setenv``/``unsetenv`` while other threads may be in ``getenv``: XLA's threads read
  environment variables while they compile and run, and glibc may free the environment array they
  are reading (a segfault of the whole driver, seen in the CPU test suite when an offloaded step
  started its worker during an XLA execution).
* The child does not import the parent's ``__main__``: multiprocessing's spawn would, re-running
  a script without an ``if __name__ == "__main__":`` guard in every child. The target must
  therefore be importable from a module (not defined in the script).

The worker pool (``rose_jax.runtime.pool``) and the NVML sampler's child
(``rose_jax.profile.sampler``) start their processes this way.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import subprocess
from multiprocessing import popen_spawn_posix, resource_tracker, spawn, util
from multiprocessing.context import reduction, set_spawning_popen
from typing import Mapping

SPAWN = multiprocessing.get_context("spawn")


class EnvPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn ``Popen``, exec'ing the child with ``env`` and without the parent's
    ``__main__`` (see the module docstring).

    ``_launch`` is CPython 3.12's ``popen_spawn_posix.Popen._launch`` with the main-module entries
    dropped from the preparation data and ``util.spawnv_passfds`` replaced by
    ``subprocess.Popen(..., env=...)`` (same command, same passed fds, nothing else inherited).
    """

    def __init__(self, process_obj, env: Mapping[str, str] | None):
        self._env = None if env is None else dict(env)
        super().__init__(process_obj)

    def _launch(self, process_obj):
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        # not the parent's __main__: importing it again in the child would re-run an unguarded script
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        fp = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            reduction.dump(process_obj, fp)
        finally:
            set_spawning_popen(None)

        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            child = subprocess.Popen(
                cmd,
                executable=spawn.get_executable(),
                env=self._env,
                pass_fds=tuple(sorted(set(self._fds))),
                close_fds=True,
                restore_signals=False,
            )
            # multiprocessing's Popen waits for this pid (os.waitpid); subprocess must never reap
            # it (its __del__ / _cleanup poll only children whose returncode is None)
            child.returncode = 0
            self.pid = child.pid
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            fds_to_close = [fd for fd in (parent_r, parent_w) if fd is not None]
            self.finalizer = util.Finalize(self, util.close_fds, fds_to_close)
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class EnvProcess(SPAWN.Process):
    """A spawn ``Process`` born with ``env`` (None: this process's environment) that does not
    re-import ``__main__`` (see :class:`EnvPopen`); ``env`` is not pickled."""

    def __init__(self, *args, env: Mapping[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._rose_env = None if env is None else dict(env)

    @staticmethod
    def _Popen(process_obj):
        return EnvPopen(process_obj, process_obj.__dict__.pop("_rose_env"))


# ------------------------------------------------------------------------------ stopping groups


def signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid`` (a child started with
    ``start_new_session=True``: its wrapper's children are in it too); False once the group is gone
    (``sig=0`` asks only that)."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


def alive_groups(pgids: "set[int] | list[int]") -> set[int]:
    """Those of the process groups ``pgids`` that have a member that is not a zombie (one scan of
    ``/proc``). A child orphaned by its leader's exit is reparented to the container's init, which
    may never reap it: ``killpg(pgid, 0)`` then succeeds on the zombie for good. Reads ``/proc``
    (Linux); elsewhere asks :func:`signal_group`."""
    wanted = set(pgids)
    if not os.path.isdir("/proc/self"):
        return {g for g in wanted if signal_group(g, 0)}
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ... after "pid (comm)"
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) in wanted:
            found.add(int(fields[2]))
    return found


def group_alive(pgid: int) -> bool:
    """Whether the process group ``pgid`` has a member that is not a zombie (:func:`alive_groups`)."""
    return bool(alive_groups({pgid}))


def stop_groups(procs: "list[subprocess.Popen]", grace_s: float) -> None:
    """Stop each process's whole group (each started in its own session): SIGTERM to every group,
    then, once ``grace_s`` is over, SIGKILL to the groups still there (a leader gone while its
    children go on counts as there); the leaders are reaped. Terminating only the leader would
    leave a wrapper's child running on (``rose-jax train --mps-client``'s trainer, a plan's worker)
    when the leader has to be killed. Output pipes are not read: the callers here write to files
    (``benchmarks.experiments.informed_peer._end_group`` stops one run whose pipes it reads)."""
    import signal
    import time

    # only groups that still have a live member: a group id whose members are all gone may be
    # another session's by now (an exited, reaped leader's pid reused)
    alive = alive_groups({p.pid for p in procs})
    pending = [p for p in procs if p.poll() is None or p.pid in alive]
    for p in pending:
        signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = alive_groups({p.pid for p in pending})
        pending = [p for p in pending if p.poll() is None or p.pid in alive]
    if pending:
        alive = alive_groups({p.pid for p in pending})
        for p in pending:
            if p.poll() is None or p.pid in alive:
                signal_group(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
