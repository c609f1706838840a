"""Host-level execution of a plan in several JAX processes (``rose_jax.runtime`` workers under MPS).

``ProcessCollect(program, G)`` is a host-level ``collect(state) -> (state, data)``: worker ``g``
rebuilds the program from its :class:`~rose_jax.optimize.program.ProgramSpec` and runs the
rollout of env group ``g`` (``program.collect_group``) with the current parameters; the driver
gathers the groups' data and runs ``learn`` itself. Each worker is its own process with its own
compute stream, so the G rollouts really run concurrently on the GPU (under MPS, each with an SM
quota), unlike G jitted calls in one process.

The executor is pluggable: :class:`InlineExecutor` runs the same worker function in this process,
one group after the other (for tests of the data path on a CPU); :class:`RuntimeExecutor` uses
``rose_jax.runtime``'s worker pool.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Protocol

import jax

WORKER_COLLECT = "rose_jax.optimize.processes:worker_collect"


def worker_collect(state_g: Any, *, spec: Any, g: int, groups: int) -> tuple[Any, Any]:
    """Run in a worker: the rollout of env group ``g`` of ``groups`` (jit this with static kwargs)."""
    from rose_jax.optimize import program as P  # noqa: PLC0415

    return P.collect_group(spec.build(), state_g, g, groups)


class Executor(Protocol):
    def run_groups(self, spec: Any, states: list, groups: int) -> list: ...

    def close(self) -> None: ...


class InlineExecutor:
    """Runs every group's worker function here, one after the other (no concurrency; for tests)."""

    def __init__(self):
        self._fns: dict = {}

    def run_groups(self, spec, states, groups):
        out = []
        for g, s in enumerate(states):
            key = (spec, g, groups)
            if key not in self._fns:
                self._fns[key] = jax.jit(lambda st, g=g: worker_collect(st, spec=spec, g=g, groups=groups))
            out.append(self._fns[key](s))
        return out

    def close(self):
        self._fns.clear()


def available() -> tuple[bool, str]:
    """Whether worker processes can be started (``rose_jax.runtime`` importable)."""
    try:
        from rose_jax import runtime  # noqa: F401, PLC0415
    except ImportError as e:  # pragma: no cover - the runtime ships with rose_jax
        return False, f"rose_jax.runtime unavailable: {e}"
    return True, "rose_jax.runtime worker pool available"


class RuntimeExecutor:
    """One ``rose_jax.runtime`` worker process per env group.

    On a GPU the workers run under an MPS daemon (``daemon``, or one this executor starts in a
    temporary directory and stops on ``close``), so their kernels run concurrently; ``quotas``
    gives each worker an SM percent (None: no limit). On a CPU the workers are CPU JAX
    processes (``JAX_PLATFORMS=cpu``): the data path is the same, the speed says nothing.
    The pool starts at the first call (spawn + ``import jax`` + compile: seconds).
    """

    def __init__(
        self,
        groups: int,
        quotas: tuple[int, ...] | None = None,
        *,
        daemon: Any = None,
        use_mps: bool | None = None,
        transport: str = "auto",
        timeout: float | None = 600.0,
    ):
        if quotas is not None and len(quotas) != groups:
            raise ValueError(f"RuntimeExecutor: {len(quotas)} quotas for {groups} groups")
        self.groups, self.quotas, self.transport, self.timeout = groups, quotas, transport, timeout
        self._daemon, self._own_daemon, self._use_mps = daemon, None, use_mps
        self._pool = None

    def _ensure(self):
        if self._pool is not None:
            return self._pool
        import tempfile  # noqa: PLC0415

        from rose_jax import runtime  # noqa: PLC0415
        from rose_jax.mps import plan as mps_plan  # noqa: PLC0415

        gpu = jax.default_backend() == "gpu"
        if gpu and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() not in ("false", "0"):
            warnings.warn(
                "this driver process preallocated GPU memory (XLA_PYTHON_CLIENT_PREALLOCATE is not 'false'): "
                "worker processes may run out of memory; set it before importing jax",
                stacklevel=2,
            )
        use_mps = gpu if self._use_mps is None else self._use_mps
        daemon = self._daemon
        if use_mps and daemon is None:
            from rose_jax.mps import MPSDaemon  # noqa: PLC0415

            self._own_daemon = daemon = MPSDaemon(tempfile.mkdtemp(prefix="rose-mps-")).start()
        env = () if gpu else (("JAX_PLATFORMS", "cpu"),)
        quotas = self.quotas or (None,) * self.groups
        specs = [
            mps_plan.WorkerSpec(f"group{g}", quota=q if use_mps else None, env=env)
            for g, q in enumerate(quotas)
        ]
        try:
            self._pool = runtime.start_workers(
                specs, daemon=daemon if use_mps else None, transport=self.transport
            )
        except BaseException:
            self._stop_daemon()
            raise
        return self._pool

    def run_groups(self, spec, states, groups):
        pool = self._ensure()
        handles = [
            pool.submit(f"group{g}", WORKER_COLLECT, s, static={"spec": spec, "g": g, "groups": groups})
            for g, s in enumerate(states)
        ]
        return pool.wait(handles, self.timeout)

    def close(self):
        if self._pool is not None:
            try:
                self._pool.close()
            finally:
                self._pool = None
        self._stop_daemon()

    def _stop_daemon(self):
        if self._own_daemon is not None:
            try:
                self._own_daemon.stop()
            finally:
                self._own_daemon = None


class ProcessCollect:
    """A host-level collect that runs env groups in worker processes (see the module docstring)."""

    def __init__(
        self,
        program: Any,
        groups: int,
        *,
        quotas: tuple[int, ...] | None = None,
        executor: Executor | None = None,
    ):
        from rose_jax.optimize import program as P  # noqa: PLC0415

        if program.spec is None:
            raise ValueError(f"program {program.name!r} has no ProgramSpec: workers cannot rebuild it")
        self.program, self.groups, self._P = program, groups, P
        self.executor = executor if executor is not None else RuntimeExecutor(groups, quotas)
        self._split = jax.jit(lambda s: P.split_envs(program, s, groups))
        self._merge = jax.jit(
            lambda outs: (
                P.merge_states(program, [o[0] for o in outs]),
                P.merge_data(program, [o[1] for o in outs]),
            )
        )

    def __call__(self, state):
        outs = self.executor.run_groups(self.program.spec, self._split(state), self.groups)
        return self._merge(jax.tree.map(jax.numpy.asarray, outs))

    def close(self):
        self.executor.close()


def overlap_in_processes(fn: Callable, a: Any, b: Any) -> Callable:
    """Run node ``b`` of ``fn`` in a worker while ``a`` runs here: NOT IMPLEMENTED.

    It needs ``fn`` cut at the two nodes (the equations ``b`` depends on, ``b`` itself, the
    equations independent of ``b`` (``a`` among them), the rest) with ``b``'s part shipped to the
    worker. Shipping a compiled cut needs ``jax.export`` serialization (the ``flatbuffers``
    package, absent from this environment) or a worker that re-traces ``fn`` from an import path.
    The multi-process transformation that exists is env-group rollouts (:class:`ProcessCollect`).
    """
    raise ValueError(
        "overlap_independent(mode='processes') is not implemented (legality is): use mode='fused', "
        "or group_rollout(G, 'processes') for multi-process rollouts"
    )
