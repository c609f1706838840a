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


def run_as_client(argv: Sequence[str], run_dir: str | None = None, log=print) -> int:
    """Run ``argv`` as a child process under a new MPS daemon; returns the child's exit code.

    The daemon (own pipe and log directories under ``run_dir`` or a new temp dir) is stopped
    when the child exits, on every path. Raises ``MPSError`` if MPS cannot start.
    """
    run_dir = run_dir or tempfile.mkdtemp(prefix="rmps")
    with MPSDaemon(run_dir) as daemon:
        env = dict(os.environ, **daemon.client_env(), **{CLIENT_MARK: "1"})
        log(f"[mps] daemon up ({daemon.pipe_dir}); running the job as its client")
        return subprocess.call(list(argv), env=env)
