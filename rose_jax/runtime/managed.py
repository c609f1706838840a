"""One owner for a worker pool and the MPS daemon its workers are clients of.

    with ManagedPool(specs, mps="auto") as pool:     # daemon (if any) up, then the workers
        pool.pool.call_all("my_pkg.branches:step", state)
    # on exit, also on an exception or KeyboardInterrupt: the workers stop, then the daemon quits

``mps`` decides whether the workers run under MPS:

* ``False``: plain processes; quotas in the specs are not applied (``WorkerInfo.mps`` False).
* ``True``: they must: the daemon is, in order, ``daemon`` (the caller's, never stopped here), the
  one this process is a client of (``rose_jax.mps.inherited_daemon``), or a new
  :class:`~rose_jax.mps.MPSDaemon` this object starts and stops. Where MPS cannot start (e.g. a
  machine without a GPU or without ``nvidia-cuda-mps-control``), ``start`` raises ``MPSError``
  in one line and leaves nothing behind.
* ``"auto"`` (default): as ``True`` where a daemon is given or inherited or ``mps_status()`` says
  MPS is available; otherwise the workers run as plain processes and ``mps_reason`` says why.

``ensure()`` is for long-lived owners (an offloaded step, env groups in processes): it returns
the running pool, and after a worker died it starts over, a daemon of its own included (a fatal
fault of one MPS client reaches every client of the daemon). ``close()`` is idempotent and
stops the pool before the daemon (MPS's ``quit`` waits for its clients).
"""

from __future__ import annotations

from typing import Any, Iterable

from rose_jax.mps.client import inherited_daemon, stop_own, worker_daemon
from rose_jax.mps.daemon import MPSDaemon, MPSError, mps_status
from rose_jax.mps.plan import WorkerSpec, validate_specs
from rose_jax.runtime.pool import WorkerPool

class ManagedPool:
    """A ``WorkerPool`` and, where asked, the MPS daemon it runs under (see the module docstring).

    specs: one ``WorkerSpec`` per worker.
    mps: ``True`` | ``False`` | ``"auto"``.
    daemon: an MPS daemon the caller owns (anything with ``running`` and ``client_env()``); it
      implies MPS and is never stopped here.
    driver_computes: this process runs kernels of its own beside the workers; if it is not a
      client of the daemon the workers join, warn (they are time-sliced, not concurrent).
    prefix: prefix of the temporary directory of a daemon started here.
    pool_options: keyword arguments of ``WorkerPool`` (``transport``, ``startup_timeout``, ...).
    """

    def __init__(
        self,
        specs: Iterable[WorkerSpec],
        *,
        mps: bool | str = "auto",
        daemon: Any = None,
        driver_computes: bool = False,
        prefix: str = "rose-mps-",
        **pool_options: Any,
    ):
        if not (isinstance(mps, bool) or mps == "auto"):
            raise ValueError(f"ManagedPool: mps must be True, False or 'auto', got {mps!r}")
        if daemon is not None and mps is False:
            raise ValueError("ManagedPool: a daemon was given with mps=False; give one or the other")
        self.specs = validate_specs(specs)
        self.mps = mps
        self.driver_computes = bool(driver_computes)
        self.prefix = prefix
        self.pool_options = dict(pool_options)
        self.mps_reason: str | None = None  # why the workers run without MPS (None: with it, or not started)
        self._given = daemon
        self._own: MPSDaemon | None = None
        self._daemon: Any = None
        self._pool: WorkerPool | None = None

    # ------------------------------------------------------------------ state
    @property
    def pool(self) -> WorkerPool:
        """The started pool (a one-line error before ``start``)."""
        if self._pool is None:
            raise RuntimeError("ManagedPool is not started: use it as a context manager or call start()")
        return self._pool

    @property
    def daemon(self) -> Any:
        """The daemon the workers are clients of (None: they run without MPS)."""
        return self._daemon

    @property
    def owns_daemon(self) -> bool:
        """True while a daemon started by this object runs (it stops it on close)."""
        return self._own is not None and self._own.running

    @property
    def own_daemon(self) -> MPSDaemon | None:
        """The daemon this object started and will stop (None: none, or the caller's/inherited one)."""
        return self._own

    @property
    def running(self) -> bool:
        return self._pool is not None and self._pool.running

    # -------------------------------------------------------------- lifecycle
    def __enter__(self) -> "ManagedPool":
        self.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(force=exc_type is not None)

    def start(self) -> "ManagedPool":
        """Find or start the daemon (per ``mps``), then start the workers as its clients; on any
        failure stop what was started here and raise."""
        if self._pool is not None:
            raise RuntimeError("ManagedPool is already started; close() it first")
        try:
            self._daemon = self._find_daemon()
            pool = WorkerPool(self.specs, self._daemon, **self.pool_options)
            self._pool = pool.start()
        except BaseException:
            self._stop_own()
            raise
        return self

    def ensure(self) -> WorkerPool:
        """The running pool: started if need be; after a worker died, started over (the pool and a
        daemon of our own: a fatal MPS fault reaches every client)."""
        if self._pool is not None and not self._pool.running:
            self.close(force=True)
        if self._pool is None:
            self.start()
        return self._pool

    def relaunch(self, new_specs: Iterable[WorkerSpec] | None = None) -> WorkerPool:
        """New worker processes (e.g. new quotas) under the same daemon."""
        if new_specs is not None:
            self.specs = validate_specs(new_specs)
        return self.pool.relaunch(self.specs)

    def close(self, *, force: bool = False) -> None:
        """Stop the workers, then a daemon started here (also when stopping the workers raises);
        idempotent."""
        pool, self._pool = self._pool, None
        try:
            if pool is not None:
                pool.close(force=force)
        finally:
            self._daemon = None
            self._stop_own()

    # -------------------------------------------------------------- internals
    def _find_daemon(self) -> Any:
        if self.mps is False:
            self.mps_reason = "MPS not asked for (mps=False)"
            return None
        if self.mps == "auto" and self._given is None and inherited_daemon() is None:
            ok, reason = mps_status()
            if not ok:
                self.mps_reason = reason
                return None
        try:
            daemon, self._own = worker_daemon(
                self._given, self._own, driver_computes=self.driver_computes, prefix=self.prefix
            )
        except MPSError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MPSError(f"ManagedPool(mps={self.mps!r}): the MPS daemon did not start: {first}") from None
        self.mps_reason = None
        return daemon

    def _stop_own(self) -> None:
        own, self._own = self._own, None
        stop_own(own)

    def __repr__(self) -> str:
        names = [s.name for s in self.specs]
        return f"ManagedPool({names}, mps={self.mps!r}, daemon={self._daemon!r}, running={self.running})"
