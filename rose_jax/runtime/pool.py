"""The driver side of the runtime: a pool of spawned JAX worker processes.

    specs = [WorkerSpec("sim", quota=70, mem_fraction=0.4), WorkerSpec("learn", quota=30, mem_fraction=0.4)]
    with ManagedPool(specs, mps=True) as pool:   # rose_jax.runtime.managed: MPS daemon + this pool
        outs = pool.call_all("my_pkg.branches:step", state)           # concurrent, joined
        h1 = pool.submit("sim", "my_pkg.sim:rollout", params)         # or submit + wait
        h2 = pool.submit("learn", "my_pkg.learn:update", batch)
        rollout, update = pool.wait([h1, h2], timeout=60)
        pool.relaunch([s.with_quota(q) for s, q in zip(specs, (80, 20))])   # new quotas = new processes

Each worker is started with the "spawn" method and an explicit environment
(``rose_jax.mps.plan.worker_environment``), handed to the exec of the child interpreter
(``rose_jax.runtime.process.EnvProcess``); the driver's own environment is never changed
(doing so while XLA threads read it is not thread-safe). A call names a function by import path
("pkg.module:function") and passes positional pytrees of arrays; ``static`` keyword arguments
are bound before jit.

Array exchange (``transport``): "shm" moves arrays through host shared memory (portable);
"cuda_ipc" moves single-device jax GPU arrays through CUDA IPC on the same GPU (numpy inputs
still use shared memory); "auto" picks cuda_ipc when the driver and every worker have cupy and
the same GPU, else shm, and ``pool.transport.reason`` says why. Outputs come back as numpy
arrays (host path) or jax.Arrays on the driver's GPU (cuda_ipc).

Resident values: ``put_resident(worker, name, pytree)`` keeps a pytree on that worker's device
between calls (``get_resident`` fetches it back, ``drop_resident`` deletes it, ``resident``
lists names and bytes); a call with ``reads=(name, ...)`` gets those values as its first
positional arguments, and one with ``writes=(name, ...)`` returns ``(written, outputs)``: the
worker stores ``written`` under those names and only ``outputs`` travel back. So a loop can keep
its big state (e.g. an env batch) in the worker and exchange only what changes hands.
Resident values live as long as the worker process: a relaunch or a death loses them.

Failures: a function that raises gives ``RemoteError`` (the pool stays usable). A worker that
dies (e.g. SIGKILL) gives ``WorkerDied`` naming it and the signal; a wait that exceeds its
timeout gives ``WorkerTimeout``. In both cases the pool first terminates every other worker,
unlinks every shared-memory segment it named, and leaves no child process behind;
``relaunch`` starts a fresh group. Workers also die with the driver (PR_SET_PDEATHSIG, so create
the pool from a long-lived thread) and exit when the driver's pipe closes.

Workers do not re-import the driver's ``__main__`` (multiprocessing's spawn would, re-running a
script without an ``if __name__ == "__main__":`` guard in every worker; ``EnvProcess`` drops it
from the spawn preparation): the worker entry point lives in this package and every call names
its function by import path, so a script needs no guard. The price: pytree classes defined in
the script itself cannot travel to a worker (define them in a module).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import queue
import secrets
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from rose_jax.mps.plan import WorkerSpec, validate_specs, worker_environment
from rose_jax.runtime import cuda_ipc, exchange, shm, worker
from rose_jax.runtime.process import SPAWN, EnvProcess
from rose_jax.runtime.errors import ExchangeError, RemoteError, WorkerDied, WorkerError, WorkerTimeout

TRANSPORTS = ("auto", "shm", "cuda_ipc")


@dataclasses.dataclass(frozen=True)
class Transport:
    """The exchange path in use ("shm" or "cuda_ipc") and why it was chosen."""

    kind: str
    reason: str


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What a worker reported at start: pid, JAX backend and devices, CUDA-IPC support, env.

    env: the CUDA_MPS_* / XLA_* variables in the worker's os.environ; birth_env: the same names
    as read from /proc/self/environ, i.e. present when the process was exec'd (before any import).
    """

    name: str
    pid: int
    backend: str
    devices: tuple[str, ...]
    jax_version: str
    ipc: cuda_ipc.IpcSupport
    env: Mapping[str, str | None]
    birth_env: Mapping[str, str | None]
    quota: int | None
    mps: bool
    compile_cache: str | None = None  # the persistent compilation cache the worker's JAX uses


@dataclasses.dataclass(frozen=True)
class CallHandle:
    """A submitted call: worker name, call id, function path."""

    worker: str
    call_id: int
    fn: str


@dataclasses.dataclass
class _Pending:
    worker: str
    fn: str
    outbound: exchange.Outbound
    out_shm: str | exchange.Staged | None


@dataclasses.dataclass
class _Worker:
    spec: WorkerSpec
    index: int
    process: Any
    conn: Any
    reader: threading.Thread
    info: WorkerInfo | None = None


def choose_transport(
    requested: str, driver: cuda_ipc.IpcSupport | None, workers: Mapping[str, cuda_ipc.IpcSupport]
) -> Transport:
    """Pick the exchange path. driver None means it was not probed (some worker cannot use IPC)."""
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {requested!r}")
    if requested == "shm":
        return Transport("shm", "host shared memory requested")
    problem = None
    for name, s in workers.items():
        if not s.available:
            problem = f"worker {name!r}: {s.reason}"
            break
    if problem is None and (driver is None or not driver.available):
        problem = f"driver: {driver.reason if driver else 'not probed'}"
    if problem is None:
        devs = {s.device for s in workers.values()} | {driver.device}
        if len(devs) != 1:
            problem = f"not all on one GPU (PCI bus ids {sorted(map(str, devs))})"
    if problem is None:
        return Transport("cuda_ipc", f"same-GPU CUDA IPC: {driver.reason}, {len(workers)} worker(s)")
    if requested == "cuda_ipc":
        raise WorkerError(f"transport='cuda_ipc' is not available: {problem}")
    return Transport("shm", f"host shared memory (CUDA IPC unavailable: {problem})")


def fn_path(fn: str | Callable) -> str:
    """'pkg.module:function' for a string or an importable module-level function."""
    if isinstance(fn, str):
        mod, sep, attr = fn.partition(":")
        if (
            not sep
            or not mod
            or not attr
            or any(not p.isidentifier() for p in mod.split(".") + attr.split("."))
        ):
            raise ValueError(f"function must be given as 'package.module:function', got {fn!r}")
        return fn
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or not qual or "<" in qual or mod == "__main__":
        raise ValueError(
            f"{fn!r} is not importable by path (use a module-level function, not a lambda or "
            "a function defined in __main__)"
        )
    return f"{mod}:{qual}"


def _reader(name: str, conn, q: queue.Queue) -> None:
    """Move every message from one worker's pipe into the pool's queue; None marks EOF."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            q.put((name, None))
            return
        except Exception as e:  # a message that cannot be unpickled here
            msg = ("corrupt", f"{type(e).__name__}: {e}")
        q.put((name, msg))


class WorkerPool:
    """A group of worker processes, one per ``WorkerSpec`` (see the module docstring).

    daemon: an ``MPSDaemon`` (or anything with ``running`` and ``client_env()``); None runs the
      workers without MPS (quotas are then not applied, ``info[name].mps`` is False).
    transport: "auto" | "shm" | "cuda_ipc" (default for every call; a call may override).
    startup_timeout: seconds for all workers to import JAX and report ready.
    inline_limit: arrays up to this many bytes travel inside the pickled message.
    staging: use each worker's persistent staging buffers when nothing else is in flight on it
      (see ``rose_jax.runtime.exchange``); False: a new segment / IPC buffer for every message.
    """

    def __init__(
        self,
        specs: Iterable[WorkerSpec],
        daemon=None,
        *,
        transport: str = "auto",
        startup_timeout: float = 300.0,
        inline_limit: int = exchange.DEFAULT_INLINE_LIMIT,
        staging: bool = True,
    ):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self._specs = validate_specs(specs)
        self._daemon = daemon
        self._requested_transport = transport
        self.startup_timeout = float(startup_timeout)
        self.inline_limit = int(inline_limit)
        self.staging = bool(staging)
        self.transport: Transport | None = None
        self.last_stats: dict[str, dict] = {}
        self._workers: dict[str, _Worker] = {}
        self._queue: queue.Queue = queue.Queue()
        self._pending: dict[int, _Pending] = {}
        self._done: dict[int, tuple[str, Any]] = {}
        self._channels: dict[str, exchange.Channel] = {}  # persistent staging, one per worker
        self._ids = itertools.count()
        self._prefix = ""
        self._barrier = None
        self._state = "new"  # new -> running -> closed | broken
        self.failure: WorkerError | None = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._specs)

    @property
    def specs(self) -> tuple[WorkerSpec, ...]:
        return self._specs

    @property
    def info(self) -> dict[str, WorkerInfo]:
        return {n: w.info for n, w in self._workers.items() if w.info is not None}

    @property
    def pids(self) -> dict[str, int]:
        return {n: w.process.pid for n, w in self._workers.items()}

    def channel_stats(self) -> dict[str, dict]:
        """Per worker, the driver side's staging counters (segments created / opened, device
        buffers allocated / opened): constant once the messages' sizes are steady."""
        return {n: ch.stats() for n, ch in self._channels.items()}

    @property
    def running(self) -> bool:
        return self._state == "running"

    def __enter__(self) -> "WorkerPool":
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(force=exc_type is not None)

    def start(self) -> "WorkerPool":
        """Spawn every worker and wait until all report ready (or raise, leaving nothing behind)."""
        if self._state not in ("new", "closed", "broken"):
            raise WorkerError(f"pool is {self._state}")
        mps_env = None
        if self._daemon is not None:
            if not getattr(self._daemon, "running", False):
                raise ValueError(
                    "the MPS daemon given to the pool is not running (use it inside its with-block)"
                )
            mps_env = self._daemon.client_env()
        self._prefix = f"rose{os.getpid()}_{secrets.token_hex(3)}_"
        self._queue = queue.Queue()
        self._pending, self._done, self._workers, self.failure = {}, {}, {}, None
        self._channels = {s.name: exchange.Channel() for s in self._specs}
        self._barrier = SPAWN.Barrier(len(self._specs))
        self._state = "starting"
        atexit.register(self.close, force=True)
        try:
            for i, spec in enumerate(self._specs):
                env = worker_environment(spec, mps_env=mps_env)
                parent_conn, child_conn = SPAWN.Pipe(duplex=True)
                boot = worker.WorkerBoot(spec.name, i, len(self._specs), os.getpid())
                proc = EnvProcess(
                    target=worker.main,
                    args=(boot, child_conn, self._barrier),
                    name=f"rose-worker-{spec.name}",
                    daemon=True,
                    env=env,
                )
                proc.start()
                child_conn.close()
                reader = threading.Thread(
                    target=_reader,
                    args=(spec.name, parent_conn, self._queue),
                    name=f"rose-reader-{spec.name}",
                    daemon=True,
                )
                reader.start()
                self._workers[spec.name] = _Worker(spec, i, proc, parent_conn, reader)
            self._await_ready(mps_env is not None)
            self._state = "running"
            ipcs = {n: w.info.ipc for n, w in self._workers.items()}
            driver = None
            if self._requested_transport != "shm" and all(s.available for s in ipcs.values()):
                driver = cuda_ipc.probe()
            self.transport = choose_transport(self._requested_transport, driver, ipcs)
        except BaseException:
            self._shutdown()
            raise
        return self

    def _await_ready(self, mps: bool) -> None:
        deadline = time.monotonic() + self.startup_timeout
        waiting = set(self._workers)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout(
                    f"workers {sorted(waiting)} did not start within {self.startup_timeout:.0f}s"
                )
            try:
                name, msg = self._queue.get(timeout=min(left, 0.25))
            except queue.Empty:
                continue
            w = self._workers[name]
            if msg is None:
                w.process.join(5)
                raise WorkerDied(name, w.process.pid, w.process.exitcode, "while starting (importing JAX)")
            if msg[0] == "fatal":
                raise WorkerError(f"worker {name!r} failed to start:\n{msg[1]}")
            if msg[0] == "ready":
                d = msg[1]
                quota = w.spec.quota.percent if (w.spec.quota is not None and mps) else None
                w.info = WorkerInfo(
                    name,
                    d["pid"],
                    d["backend"],
                    tuple(d["devices"]),
                    d["jax_version"],
                    d["ipc"],
                    d["env"],
                    d["birth_env"],
                    quota,
                    mps,
                    d.get("compile_cache"),
                )
                waiting.discard(name)

    def relaunch(self, new_specs: Iterable[WorkerSpec] | None = None) -> "WorkerPool":
        """Close the current workers and start new ones (new quotas need new processes)."""
        specs = validate_specs(self._specs if new_specs is None else new_specs)
        self.close()
        self._specs = specs
        return self.start()

    def close(self, timeout: float = 15.0, *, force: bool = False) -> None:
        """Stop the workers (graceful unless force or calls are in flight); idempotent."""
        if self._state in ("new", "closed", "broken"):
            return
        if not force and not self._pending:
            for w in self._workers.values():
                try:
                    w.conn.send(("exit",))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + timeout
            for w in self._workers.values():
                w.process.join(max(0.0, deadline - time.monotonic()))
        self._shutdown()
        self._state = "closed"

    def _shutdown(self) -> None:
        """Terminate every worker, release every resource, unlink every segment of this pool."""
        if self._barrier is not None:
            try:
                self._barrier.abort()
            except Exception:
                pass
        alive = [w for w in self._workers.values() if w.process.is_alive()]
        for w in alive:
            w.process.terminate()
        deadline = time.monotonic() + 5.0
        for w in alive:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self._workers.values():
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5.0)
        for w in self._workers.values():
            w.reader.join(2.0)
            with contextlib.suppress(Exception):
                w.conn.close()
        for p in self._pending.values():
            self._release(p)
        self._pending.clear()
        for ch in self._channels.values():
            ch.close()
        if self._prefix:
            shm.unlink_prefix(self._prefix)
        self._barrier = None
        self._state = "broken" if self.failure is not None else "closed"
        atexit.unregister(self.close)

    # -------------------------------------------------------------------- calls
    def submit(
        self,
        worker_name: str,
        fn: str | Callable,
        *args: Any,
        static: Mapping[str, Any] | None = None,
        jit: bool = True,
        transport: str | None = None,
        reads: Sequence[str] = (),
        writes: Sequence[str] = (),
    ) -> CallHandle:
        """Send a call to one worker without waiting; see ``wait``.

        fn: "package.module:function" (or an importable function). args: positional pytrees of
        arrays (numpy, jax, Python scalars). static: keyword arguments bound with
        functools.partial before jit (hashable when jit). jit=False calls the function as is (for
        host-level functions that time or loop themselves). transport: override for this call.
        reads: names of resident values passed before ``args``; writes: names the function's
        ``written`` values are stored under (it returns ``(written, outputs)``; see the module
        docstring).
        """
        self._check_running()
        self._check_worker(worker_name)
        reads, writes = _names(reads, "reads"), _names(writes, "writes")
        path = fn_path(fn)
        static_items = tuple(sorted((static or {}).items()))
        if jit:
            try:
                hash(static_items)
            except TypeError:
                raise ValueError(
                    f"static arguments of a jitted call must be hashable, got {static!r}"
                ) from None
        use_ipc = self._use_ipc(transport)
        cid = next(self._ids)
        in_name, out_name = self._names(worker_name, cid)
        packet, outbound = exchange.encode(
            tuple(args),
            shm_name=in_name,
            use_ipc=use_ipc,
            inline_limit=self.inline_limit,
            channel=self._channels[worker_name],
        )
        self._pending[cid] = _Pending(worker_name, path, outbound, out_name)
        self._send(
            worker_name, ("call", cid, path, packet, static_items, jit, out_name, use_ipc, reads, writes)
        )
        return CallHandle(worker_name, cid, path)

    # ---------------------------------------------------------- resident values
    def submit_put(
        self, worker_name: str, name: str, value: Any, *, transport: str | None = None
    ) -> CallHandle:
        """Start storing the pytree ``value`` as resident ``name`` on one worker (see ``put_resident``)."""
        self._check_running()
        self._check_worker(worker_name)
        (name,) = _names((name,), "name")
        cid = next(self._ids)
        packet, outbound = exchange.encode(
            value,
            shm_name=self._names(worker_name, cid)[0],
            use_ipc=self._use_ipc(transport),
            inline_limit=self.inline_limit,
            channel=self._channels[worker_name],
        )
        fn = f"put_resident:{name}"
        self._pending[cid] = _Pending(worker_name, fn, outbound, None)
        self._send(worker_name, ("put", cid, name, packet))
        return CallHandle(worker_name, cid, fn)

    def put_resident(
        self,
        worker_name: str,
        name: str,
        value: Any,
        *,
        transport: str | None = None,
        timeout: float | None = None,
    ) -> None:
        """Store the pytree ``value`` on worker ``worker_name``'s device as resident ``name``.

        It replaces any value of that name; calls read it with ``reads=(name,)``."""
        self.wait([self.submit_put(worker_name, name, value, transport=transport)], timeout)

    def submit_get(self, worker_name: str, name: str, *, transport: str | None = None) -> CallHandle:
        """Start fetching resident ``name`` from one worker (see ``get_resident``)."""
        self._check_running()
        self._check_worker(worker_name)
        (name,) = _names((name,), "name")
        cid = next(self._ids)
        out_name = self._names(worker_name, cid)[1]
        fn = f"get_resident:{name}"
        self._pending[cid] = _Pending(worker_name, fn, exchange.Outbound(), out_name)
        self._send(worker_name, ("get", cid, name, out_name, self._use_ipc(transport)))
        return CallHandle(worker_name, cid, fn)

    def get_resident(
        self, worker_name: str, name: str, *, transport: str | None = None, timeout: float | None = None
    ) -> Any:
        """A copy of resident ``name`` of one worker (numpy arrays, or jax.Arrays over CUDA IPC);
        the worker keeps its value. A missing name is a ``RemoteError``."""
        return self.wait([self.submit_get(worker_name, name, transport=transport)], timeout)[0]

    def drop_resident(self, worker_name: str, *names: str, timeout: float | None = None) -> None:
        """Delete resident values of one worker (names it does not have are ignored)."""
        self._check_running()
        self._check_worker(worker_name)
        names = _names(names, "names")
        cid = next(self._ids)
        self._pending[cid] = _Pending(worker_name, "drop_resident", exchange.Outbound(), None)
        self._send(worker_name, ("drop", cid, names))
        self.wait([CallHandle(worker_name, cid, "drop_resident")], timeout)

    def resident(self, worker_name: str, *, timeout: float | None = None) -> dict[str, int]:
        """``{name: bytes}`` of the values resident on one worker."""
        self._check_running()
        self._check_worker(worker_name)
        cid = next(self._ids)
        self._pending[cid] = _Pending(worker_name, "resident", exchange.Outbound(), None)
        self._send(worker_name, ("list", cid))
        return self.wait([CallHandle(worker_name, cid, "resident")], timeout)[0]

    def in_flight(self) -> list[tuple[str, str]]:
        """``(worker, function)`` of every call (or resident-value operation) sent and not yet answered."""
        return [(p.worker, p.fn) for p in list(self._pending.values())]

    def wait(self, handles: Sequence[CallHandle], timeout: float | None = None) -> list[Any]:
        """Outputs of the given calls, in order; raises the first RemoteError after all finished."""
        ids = [h.call_id for h in handles]
        missing = [i for i in ids if i not in self._pending and i not in self._done]
        if missing:
            raise ValueError(f"unknown or already collected call ids {missing}")
        what = ", ".join(sorted({f"{h.fn} on {h.worker!r}" for h in handles}))
        self._pump(lambda: all(i in self._done for i in ids), timeout, what)
        results = [self._done.pop(i) for i in ids]
        for status, value in results:
            if status == "err":
                raise value
        return [value for _, value in results]

    def call(
        self, worker_name: str, fn: str | Callable, *args: Any, timeout: float | None = None, **options: Any
    ) -> Any:
        """Run fn(*args) on one worker and return its outputs: ``submit`` (whose keyword options,
        ``static``, ``jit``, ``transport``, ``reads``, ``writes``, it takes) then ``wait``."""
        return self.wait([self.submit(worker_name, fn, *args, **options)], timeout)[0]

    def call_all(
        self,
        fn: str | Callable,
        *args: Any,
        per_worker: Mapping[str, Sequence[Any]] | None = None,
        static: Mapping[str, Any] | None = None,
        jit: bool = True,
        transport: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Run fn on every worker concurrently (same args, or per_worker[name] args) and join."""
        if per_worker is not None:
            unknown = set(per_worker) - set(self._workers)
            if unknown or set(per_worker) != set(self._workers):
                raise ValueError(
                    f"per_worker must have exactly the workers {list(self._workers)}, got {list(per_worker)}"
                )
        handles = [
            self.submit(
                n,
                fn,
                *(per_worker[n] if per_worker is not None else args),
                static=static,
                jit=jit,
                transport=transport,
            )
            for n in self._workers
        ]
        return dict(zip(self._workers, self.wait(handles, timeout), strict=True))

    def map(
        self,
        fn: str | Callable,
        items: Sequence[Sequence[Any]],
        *,
        static: Mapping[str, Any] | None = None,
        jit: bool = True,
        transport: str | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """fn(*items[i]) for every i, item i on worker i % n (each worker in order), joined."""
        names = list(self._workers)
        handles = [
            self.submit(names[i % len(names)], fn, *item, static=static, jit=jit, transport=transport)
            for i, item in enumerate(items)
        ]
        return self.wait(handles, timeout)

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every worker has finished everything submitted before (results stay collectable)."""
        self._check_running()
        pings = []
        for name, w in self._workers.items():
            cid = next(self._ids)
            self._pending[cid] = _Pending(name, "ping", exchange.Outbound(), None)
            pings.append(cid)
            try:
                w.conn.send(("ping", cid))
            except (OSError, ValueError):
                self._on_death(name)
        self._pump(lambda: not self._pending, timeout, "barrier")
        for cid in pings:
            self._done.pop(cid, None)

    # ----------------------------------------------------------------- internals
    def _names(self, worker_name: str, cid: int) -> tuple[str | exchange.Staged, str | exchange.Staged]:
        """Where call ``cid``'s inputs and outputs go: the worker's persistent staging buffers when
        nothing else is in flight on it (everything sent before was read and answered), else
        one-off segments."""
        if not self.staging or any(p.worker == worker_name for p in self._pending.values()):
            return f"{self._prefix}{cid}i", f"{self._prefix}{cid}o"
        i = self._workers[worker_name].index
        return exchange.Staged(f"{self._prefix}w{i}i"), exchange.Staged(f"{self._prefix}w{i}o")

    def _check_worker(self, worker_name: str) -> None:
        if worker_name not in self._workers:
            raise ValueError(f"no worker named {worker_name!r}; workers are {list(self._workers)}")

    def _send(self, worker_name: str, msg: tuple) -> None:
        try:
            self._workers[worker_name].conn.send(msg)
        except (OSError, ValueError):
            self._on_death(worker_name)

    def _check_running(self) -> None:
        if self._state != "running":
            if self.failure is not None:
                raise WorkerError(f"the pool is down after: {self.failure}; call relaunch()")
            raise WorkerError(f"the pool is {self._state}; start() it or use it as a context manager")

    def _use_ipc(self, transport: str | None) -> bool:
        kind = self._requested_transport if transport is None else transport
        if kind not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")
        if kind == "shm":
            return False
        if kind == "auto":
            return self.transport is not None and self.transport.kind == "cuda_ipc"
        if self.transport is not None and self.transport.kind == "cuda_ipc":
            return True
        ipcs = {n: w.info.ipc for n, w in self._workers.items()}
        return choose_transport("cuda_ipc", cuda_ipc.probe(), ipcs).kind == "cuda_ipc"

    def _pump(self, done: Callable[[], bool], timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._on_timeout(timeout, what)
            try:
                name, msg = self._queue.get(timeout=0.25 if left is None else min(left, 0.25))
            except queue.Empty:
                dead = [n for n, w in self._workers.items() if w.process.exitcode is not None]
                if dead:
                    self._drain()
                    self._on_death(dead[0])
                continue
            if msg is None:
                self._drain()
                self._on_death(name)
            self._handle(name, msg)

    def _drain(self) -> None:
        """Handle every message already queued (replies sent just before a death)."""
        while True:
            try:
                name, msg = self._queue.get_nowait()
            except queue.Empty:
                return
            if msg is not None:
                self._handle(name, msg)

    def _handle(self, name: str, msg: tuple) -> None:
        kind = msg[0]
        if kind == "corrupt":
            self.failure = WorkerError(f"message from worker {name!r} could not be read: {msg[1]}")
            self._shutdown()
            raise self.failure
        cid = msg[1]
        p = self._pending.pop(cid, None)
        if p is None:
            return
        if kind == "pong":
            self._done[cid] = ("ok", None)
            return
        try:
            if kind == "ok":
                packet, stats = msg[2], msg[3]
                try:
                    value = exchange.decode(packet, to="numpy", channel=self._channels.get(name))
                    self._done[cid] = ("ok", value)
                except Exception as e:
                    self._done[cid] = ("err", ExchangeError(f"outputs of {p.fn} from worker {name!r}: {e}"))
                finally:
                    if packet.ipc is not None and not packet.staged:
                        with contextlib.suppress(OSError, ValueError):
                            self._workers[name].conn.send(("release", cid))
                self.last_stats[name] = stats
            elif kind == "err":
                self._done[cid] = ("err", RemoteError(name, p.fn, msg[2], msg[3], msg[4]))
        finally:
            self._release(p)

    def _release(self, p: _Pending) -> None:
        with contextlib.suppress(Exception):
            p.outbound.release()
        if isinstance(p.out_shm, str):
            with contextlib.suppress(Exception):
                shm.unlink(p.out_shm)

    def _on_death(self, name: str) -> None:
        w = self._workers[name]
        w.process.join(2.0)
        exitcode = w.process.exitcode
        calls = sorted({p.fn for p in self._pending.values() if p.worker == name and p.fn != "ping"})
        during = f"during call {', '.join(calls)}" if calls else "while idle"
        others = [n for n, o in self._workers.items() if n != name and o.process.exitcode is not None]
        exc = WorkerDied(name, w.process.pid, exitcode, during, others)
        self.failure = exc
        self._shutdown()
        raise exc

    def _on_timeout(self, timeout: float | None, what: str) -> None:
        busy = sorted({p.worker for p in self._pending.values()})
        exc = WorkerTimeout(
            f"{what} did not finish within {timeout}s (busy workers: {busy}); the pool terminated all workers"
        )
        self.failure = exc
        self._shutdown()
        raise exc

    def __repr__(self) -> str:
        t = self.transport.kind if self.transport else None
        return f"WorkerPool({list(self.names)}, state={self._state}, transport={t})"


def _names(names: Sequence[str], what: str) -> tuple[str, ...]:
    """Resident-value names as a tuple of non-empty strings (a clear ValueError otherwise)."""
    if isinstance(names, str):
        names = (names,)
    out = tuple(names)
    bad = [n for n in out if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"resident {what} must be non-empty strings, got {bad[0]!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"resident {what} repeat a name: {list(out)}")
    return out


def start_workers(specs: Iterable[WorkerSpec], daemon=None, **kw) -> WorkerPool:
    """Create and start a ``WorkerPool`` (use it as a context manager to close it)."""
    return WorkerPool(specs, daemon, **kw).start()
