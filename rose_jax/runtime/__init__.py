"""Worker processes and the exchange of arrays between them.

Driver side: ``WorkerPool`` / ``start_workers`` (spawned JAX workers, calls by import path,
barriers, relaunch) and ``ManagedPool`` (a pool together with the MPS daemon its workers are
clients of: one owner that starts and stops both); inside a worker: ``barrier()`` and
``worker_context()``.
"""

from rose_jax.runtime.errors import ExchangeError, RemoteError, WorkerDied, WorkerError, WorkerTimeout
from rose_jax.runtime.managed import ManagedPool
from rose_jax.runtime.pool import (
    CallHandle,
    Transport,
    WorkerInfo,
    WorkerPool,
    choose_transport,
    start_workers,
)
from rose_jax.runtime.worker import WorkerContext, barrier, worker_context

__all__ = [
    "CallHandle",
    "ExchangeError",
    "ManagedPool",
    "RemoteError",
    "Transport",
    "WorkerContext",
    "WorkerDied",
    "WorkerError",
    "WorkerInfo",
    "WorkerPool",
    "WorkerTimeout",
    "barrier",
    "choose_transport",
    "start_workers",
    "worker_context",
]
