"""Errors of the worker runtime: each names the worker, the call and what happened."""

from __future__ import annotations

import signal as _signal


class WorkerError(RuntimeError):
    """Base class: something went wrong with a worker or the pool."""


class WorkerDied(WorkerError):
    """A worker process exited while the driver was waiting on it.

    name / pid: the worker; exitcode: its exit status (negative = killed by a signal);
    signal: the ``signal.Signals`` that killed it, or None; others_dead: names of workers
    found dead at the same moment (under MPS a fatal fault reaches every client).
    The pool has already terminated the other workers and unlinked every shared-memory segment.
    """

    def __init__(self, name: str, pid: int | None, exitcode: int | None, during: str, others_dead=()):
        self.name = name
        self.pid = pid
        self.exitcode = exitcode
        self.signal = _signal.Signals(-exitcode) if exitcode is not None and exitcode < 0 else None
        self.others_dead = tuple(others_dead)
        how = (
            f"killed by {self.signal.name}"
            if self.signal is not None
            else f"exited with status {exitcode}"
            if exitcode is not None
            else "vanished"
        )
        msg = f"worker {name!r} (pid {pid}) {how} {during}"
        if self.others_dead:
            msg += f"; also dead: {list(self.others_dead)} (under MPS a fatal fault reaches every client)"
        msg += (
            "; the pool terminated the other workers and unlinked its shared memory "
            "(pool.relaunch() restarts)"
        )
        super().__init__(msg)


class WorkerTimeout(WorkerError, TimeoutError):
    """Calls did not finish in time; the pool terminated all workers (their state is unknown)."""


class RemoteError(WorkerError):
    """The called function raised inside the worker; the worker and the pool stay usable.

    name: worker; fn: import path; exc_type: the remote exception's class name; remote_traceback.
    """

    def __init__(self, name: str, fn: str, exc_type: str, message: str, remote_traceback: str):
        self.name = name
        self.fn = fn
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        super().__init__(
            f"worker {name!r}: {fn} raised {exc_type}: {message}\n--- remote traceback ---\n"
            f"{remote_traceback}"
        )


class ExchangeError(WorkerError):
    """Arrays could not be moved between processes (e.g. /dev/shm too small, unsupported leaf)."""
