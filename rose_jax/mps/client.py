"""This process as an MPS client: the daemon it inherited, or a child run under a new daemon.

MPS reads ``CUDA_MPS_PIPE_DIRECTORY`` when a process creates its CUDA context, i.e. at JAX's
first GPU use: a driver that should share the GPU concurrently with its worker processes must be
born with it. ``run_as_client(argv)`` starts an :class:`~rose_jax.mps.MPSDaemon`, runs ``argv``
as a child with the daemon's client variables, and stops the daemon when the child exits (the
parent itself never touches the GPU). Inside that child, :func:`inherited_daemon` describes the
daemon for ``rose_jax.runtime.start_workers(..., daemon=...)``, so the workers join the same one.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

from rose_jax.mps.daemon import MPSDaemon
from rose_jax.mps.plan import MPS_LOG_VAR, MPS_PIPE_VAR

CLIENT_MARK = "ROSE_MPS_CLIENT"  # set in the child of run_as_client


class InheritedDaemon:
    """The MPS daemon named by this process's environment (it is not ours: we never stop it)."""

    def __init__(self, pipe_dir: str, log_dir: str | None):
        self.pipe_dir, self.log_dir = Path(pipe_dir), Path(log_dir) if log_dir else None

    @property
    def running(self) -> bool:
        return self.pipe_dir.is_dir() and any(self.pipe_dir.iterdir())

    def client_env(self) -> dict[str, str]:
        env = {MPS_PIPE_VAR: str(self.pipe_dir)}
        if self.log_dir is not None:
            env[MPS_LOG_VAR] = str(self.log_dir)
        return env

    def __repr__(self) -> str:
        return f"InheritedDaemon({self.pipe_dir})"


def inherited_daemon() -> InheritedDaemon | None:
    """The daemon this process is a client of (``CUDA_MPS_PIPE_DIRECTORY`` set), else None."""
    pipe = os.environ.get(MPS_PIPE_VAR)
    return InheritedDaemon(pipe, os.environ.get(MPS_LOG_VAR)) if pipe else None


def worker_daemon(
    given=None, own: MPSDaemon | None = None, *, driver_computes: bool = False, prefix: str = "rmps"
) -> tuple[object, MPSDaemon | None]:
    """The MPS daemon a driver's worker processes should join, as ``(daemon, own)``.

    In order: ``given`` (the caller's); the daemon this process is a client of
    (:func:`inherited_daemon`: workers and driver then share the GPU concurrently); ``own`` (a
    daemon this driver started before, reused while it runs); else a new :class:`MPSDaemon`,
    started here and returned as ``own``: the caller must stop it (a driver keeps it in one
    attribute and stops it on close and after a fatal worker fault). ``driver_computes``: the
    driver runs kernels of its own beside the workers (e.g. an offloaded component), so a daemon
    it is not a client of time-slices it against them: warn.
    """
    if given is not None:
        return given, own
    inherited = inherited_daemon()
    if inherited is not None:
        return inherited, own
    if own is not None and own.running:
        return own, own
    if driver_computes:
        warnings.warn(
            "this process is not an MPS client (start it under an MPS daemon, e.g. "
            "rose_jax.mps.run_as_client): its kernels and its workers' are time-sliced, not concurrent",
            stacklevel=3,
        )
    own = MPSDaemon(tempfile.mkdtemp(prefix=prefix), remove_run_dir=True).start()
    return own, own


def stop_own(own: MPSDaemon | None) -> None:
    """Stop a daemon :func:`worker_daemon` started (None: nothing to do)."""
    if own is not None:
        own.stop()


def run_as_client(argv: Sequence[str], run_dir: str | None = None, log=print) -> int:
    """Run ``argv`` as a child process under a new MPS daemon; returns the child's exit code.

    The daemon (own pipe and log directories under ``run_dir`` or a new temp dir) is stopped
    when the child exits, on every path. Raises ``MPSError`` if MPS cannot start.
    """
    own_dir = run_dir is None
    run_dir = run_dir or tempfile.mkdtemp(prefix="rmps")
    with MPSDaemon(run_dir, remove_run_dir=own_dir) as daemon:
        env = dict(os.environ, **daemon.client_env(), **{CLIENT_MARK: "1"})
        log(f"[mps] daemon up ({daemon.pipe_dir}); running the job as its client")
        return subprocess.call(list(argv), env=env)
