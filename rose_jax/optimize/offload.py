"""Cross-component overlap: run an independent component in a worker process, behind the next call.

    step = offload_component("evaluate").apply(epoch_fn)   # host level: not jittable
    state, metrics = step(state)          # returns once the rest is dispatched; eval runs elsewhere
    float(metrics["eval_episode_return"])  # a Deferred: waits for the worker's result
    step.close()                           # stops the worker (and the MPS daemon it started)

An RL epoch is ``state -> (state, metrics)``. Some of its components produce only metrics: the
evaluation rollout of Brax's train loop (hundreds of sequential env steps on a few envs, a long
latency-bound chain of small kernels) reads the policy parameters and writes nothing the next
epoch reads. :func:`rose_jax.jaxpr.cut.split_component` cuts the epoch's jaxpr in two:

* ``kept``: every equation outside the component; outputs: the original outputs the component
  does not produce, plus the values the component reads (its *cut inputs*: e.g. the actor
  parameters, the normalizer, the PRNG key and the iteration counter);
* ``part``: the component's equations, from the cut inputs to its outputs, with the arrays it
  closes over baked in as constants.

:class:`OffloadedStep` jits ``kept`` here and ships ``part`` to a ``rose_jax.runtime`` worker
once, serialized with ``jax.export`` (StableHLO). Each call dispatches ``kept``, hands the cut
inputs to a background thread that sends them to the worker, and returns at once with
:class:`Deferred` leaves where the component's outputs were. The next call's ``kept`` then runs
here while the worker runs ``part``: on a GPU both processes are clients of one MPS daemon, so
their kernels run concurrently (without MPS, kernels of different processes are time-sliced).
Every value is computed by the same equations from the same inputs as in the untransformed
function: the transform's tolerance is :data:`~rose_jax.optimize.base.EXACT` (on a GPU,
compare under ``xla_gpu_deterministic_ops``: XLA's atomics make the untransformed program itself
differ from run to run).

Legality (from the jaxpr of the traced function; ``split_component`` raises ``ValueError``
with the reason): the component's equations sit at the top level of the function (not inside a
loop or a jit); none has side effects; no equation outside the component reads a value it
produces; its outputs reach only the metrics, never the carried state (which the next call
reads); and at least one output is used.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax import export as jax_export

from rose_jax import runtime
from rose_jax.jaxpr import compat
from rose_jax.jaxpr.cut import Split, split_component
from rose_jax.mps import plan as mps_plan
from rose_jax.optimize import isolate
from rose_jax.optimize.base import EXACT, HostStep, Transform
from rose_jax.optimize.predict import TIME_SLICED_OVERLAP, Candidate, CandidateContext
from rose_jax.optimize.process_worker import RUN_EXPORTED
from rose_jax.program import Program

WORKER = "offload"
# top-level components that produce only metrics by convention (what :func:`candidates` offloads)
OFFLOAD_COMPONENTS = ("evaluate",)
_BLOB = "rose.offload."


# ------------------------------------------------------------------------------ the split


def state_output_count(out_shape: Any) -> int:
    """Flat outputs that are the carried state of ``state -> (state, metrics)`` (``out_shape[0]``)."""
    if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
        raise ValueError("offload_component needs a function returning (state, metrics)")
    return len(jax.tree.leaves(out_shape[0]))


# ------------------------------------------------------------------------------ driver side


class Deferred:
    """A value a worker is still computing: ``result()``, ``np.asarray`` or ``float`` wait for it.

    ``jax.device_get`` and ``jax.block_until_ready`` wait too (they call ``__array__`` /
    ``block_until_ready``), so metrics dicts holding Deferred leaves go through the usual host code.
    """

    __slots__ = ("_future", "_index")

    def __init__(self, future: concurrent.futures.Future, index: int):
        self._future, self._index = future, index

    def result(self, timeout: float | None = None) -> np.ndarray:
        return np.asarray(self._future.result(timeout)[self._index])

    def done(self) -> bool:
        return self._future.done()

    def block_until_ready(self) -> "Deferred":
        self.result()
        return self

    def __array__(self, dtype=None, copy=None):
        out = self.result()
        return out if dtype is None else out.astype(dtype)

    def __float__(self) -> float:
        return float(self.result())

    def __repr__(self) -> str:
        return f"Deferred({'done' if self.done() else 'pending'})"


def resolve(tree: Any) -> Any:
    """``tree`` with every :class:`Deferred` leaf replaced by its (waited-for) value."""
    return jax.tree.map(lambda x: x.result() if isinstance(x, Deferred) else x, tree)


class _Prepared(NamedTuple):
    split: Split
    kept: Callable
    out_tree: Any
    blob: bytes
    digest: str


class OffloadedStep(HostStep):
    """``state -> (state, metrics)`` with ``component`` run in a worker process (module docstring).

    daemon: an MPS daemon (``rose_jax.mps.MPSDaemon`` or ``rose_jax.mps.inherited_daemon()``) whose
      client the worker becomes; None on a GPU: a daemon of our own is started, and if this process
      is not an MPS client itself a warning says that its kernels and the worker's will be
      time-sliced, not concurrent. On a CPU the worker is a CPU JAX process.
    quota: the worker's SM percent under MPS (None: no limit).
    compiler_options: XLA options for both halves (e.g. ``{"xla_gpu_deterministic_ops": True}``).
    """

    def __init__(
        self,
        fn: Callable,
        component: str = "evaluate",
        *,
        daemon: Any = None,
        use_mps: bool | None = None,
        quota: int | None = None,
        compiler_options: dict | None = None,
        timeout: float | None = 900.0,
    ):
        self.fn, self.component = fn, component
        self.quota, self.timeout = quota, timeout
        self.compiler_options = dict(compiler_options or {})
        self._daemon, self._use_mps = daemon, use_mps
        self._managed: runtime.ManagedPool | None = None  # the worker and a daemon of our own
        self._prepared: dict[Any, _Prepared] = {}
        self._jobs = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rose-offload")
        self._pending: list[concurrent.futures.Future] = []
        self._pool = None  # started, used and closed only in the job thread (PR_SET_PDEATHSIG)
        self._sent: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._stats = {"calls": 0, "cut_bytes": 0, "worker_s": 0.0, "blob_bytes": 0}

    # -- the call -------------------------------------------------------------------------
    def __call__(self, state: Any) -> tuple[Any, Any]:
        if self._closed:
            raise RuntimeError("OffloadedStep is closed")
        prep = self._prepare(state)
        outs = prep.kept(*jax.tree.leaves(state))
        n_kept = prep.split.n_outputs - len(prep.split.positions)
        kept, cut = list(outs[:n_kept]), list(outs[n_kept:])
        future = self._jobs.submit(self._run_part, prep, cut)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]
        full, it = [], iter(kept)
        where = {p: j for j, p in enumerate(prep.split.positions)}
        for k in range(prep.split.n_outputs):
            full.append(Deferred(future, where[k]) if k in where else next(it))
        self._stats["calls"] += 1
        return jax.tree.unflatten(prep.out_tree, full)

    # its metrics are finished by the worker behind the next call (base.HostStep.pipelined)
    pipelined = True

    def drain(self, keep_last: int = 0) -> None:
        """Wait until every offloaded computation has finished, all but those of the newest
        ``keep_last`` calls (re-raises a worker's error)."""
        with self._lock:
            cut = max(len(self._pending) - keep_last, 0)
            pending, self._pending = self._pending[:cut], self._pending[cut:]
        for f in pending:
            f.result()

    def with_compiler_options(self, compiler_options: dict | None) -> "OffloadedStep":
        """A new step for the same function with other XLA options (its own worker)."""
        return OffloadedStep(
            self.fn,
            self.component,
            daemon=self._daemon,
            use_mps=self._use_mps,
            quota=self.quota,
            compiler_options=compiler_options,
            timeout=self.timeout,
        )

    def stats(self) -> dict:
        return dict(self._stats, mode="offload", component=self.component)

    def close(self) -> None:
        """Finish pending work, stop the worker and the MPS daemon this step started."""
        if self._closed:
            return
        try:
            self.drain()
        finally:
            self._closed = True
            try:
                self._jobs.submit(self._close_pool).result()
            finally:
                self._jobs.shutdown(wait=True)
                if self._managed is not None:
                    self._managed.close()  # idempotent: the daemon goes even if the job thread failed

    @property
    def _own_daemon(self):
        """The MPS daemon this step started (None: none, or the caller's/inherited one)."""
        return None if self._managed is None else self._managed.own_daemon

    def __enter__(self) -> "OffloadedStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- preparation (trace, split, compile, export) --------------------------------------
    def _prepare(self, state: Any) -> _Prepared:
        leaves, treedef = jax.tree.flatten(state)
        key = (treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves))
        prep = self._prepared.get(key)
        if prep is not None:
            return prep
        closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(state)
        split = split_component(closed, self.component, state_output_count(out_shape))
        opts = self.compiler_options or None
        kept = jax.jit(compat.as_fun(split.kept), compiler_options=opts)
        cut_avals = split.part.in_avals
        part_fn = jax.jit(compat.as_fun(split.part))
        exported = jax_export.export(part_fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cut_avals])
        blob = bytes(exported.serialize())
        digest = hashlib.sha256(blob).hexdigest()[:16]
        self._stats["blob_bytes"] = len(blob)
        prep = _Prepared(split, kept, jax.tree.structure(out_shape), blob, digest)
        self._prepared[key] = prep
        return prep

    # -- the job thread -------------------------------------------------------------------
    def _run_part(self, prep: _Prepared, cut: list) -> tuple:
        pool = self._ensure_pool()
        name = _BLOB + prep.digest
        if name not in self._sent:
            pool.put_resident(WORKER, name, np.frombuffer(prep.blob, dtype=np.uint8), timeout=self.timeout)
            self._sent.add(name)
        host = [np.asarray(x) for x in jax.device_get(cut)]  # waits for this call's kept half
        self._stats["cut_bytes"] = sum(x.nbytes for x in host)
        t0 = time.perf_counter()
        outs = pool.call(
            WORKER,
            RUN_EXPORTED,
            *host,
            static={"digest": prep.digest, "compiler_options": tuple(sorted(self.compiler_options.items()))},
            jit=False,
            transport="shm",
            timeout=self.timeout,
            reads=(name,),
        )
        self._stats["worker_s"] += time.perf_counter() - t0
        return tuple(outs)

    def _ensure_pool(self):
        """The running worker pool; after a worker died, a new one (ManagedPool.ensure: a daemon of
        our own starts over too), so every blob is sent again."""
        if self._managed is None:
            gpu = jax.default_backend() == "gpu"
            use_mps = gpu if self._use_mps is None else self._use_mps
            # the driver's persistent compile cache (when on): a later run's worker (a cached plan,
            # a restarted pool) loads the component's executable instead of compiling it again
            env = tuple(isolate.shared_cache_environment().items())
            env += () if gpu else (("JAX_PLATFORMS", "cpu"),)
            spec = mps_plan.WorkerSpec(WORKER, quota=self.quota if use_mps else None, env=env)
            self._managed = runtime.ManagedPool(
                [spec],
                mps=use_mps,
                daemon=self._daemon if use_mps else None,
                driver_computes=True,
                prefix="rmps",
                transport="shm",
            )
        pool = self._managed.ensure()
        if pool is not self._pool:
            self._pool, self._sent = pool, set()
        return pool

    def _close_pool(self) -> None:
        self._pool = None
        if self._managed is not None:
            self._managed.close()


# ------------------------------------------------------------------------------ branches


class Branch(NamedTuple):
    """One of the two concurrent halves of an offloaded step, serialized for a probe worker:
    ``name``, the ``jax.export`` blob and its digest, and example inputs (host arrays)."""

    name: str
    blob: bytes
    digest: str
    args: tuple


def branches(fn: Callable, component: str, state: Any) -> list[Branch]:
    """The two branches that run at the same time once ``component`` is offloaded: the rest of
    the step (in the driver) and the component (in the worker), each exported with its inputs
    at ``state`` (the component's inputs computed by running the rest once here). For the
    slack-aware quota search, which times each alone in a worker at a few SM quotas."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(state)
    split = split_component(closed, component, state_output_count(out_shape))
    leaves = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(state))]
    kept = jax.jit(compat.as_fun(split.kept))
    outs = kept(*leaves)
    n_kept = split.n_outputs - len(split.positions)
    cut = tuple(np.asarray(x) for x in jax.device_get(list(outs[n_kept:])))
    out = []
    for name, half, args in (
        (f"driver: the step without {component!r}", split.kept, tuple(leaves)),
        (f"worker: {component!r}", split.part, cut),
    ):
        shapes = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args]
        blob = bytes(jax_export.export(jax.jit(compat.as_fun(half)))(*shapes).serialize())
        out.append(Branch(name, blob, hashlib.sha256(blob).hexdigest()[:16], args))
    return out


# ------------------------------------------------------------------------------ the transform


def offload_component(component: str = "evaluate", quota: int | None = None):
    """Transform: run ``component`` of ``state -> (state, metrics)`` in a worker process,
    overlapped with the caller's next call (see the module docstring). Host level, EXACT."""
    if not isinstance(component, str) or not component:
        raise ValueError(f"offload_component: component must be a non-empty name, got {component!r}")

    def legal(tree):
        # a step maps the state to (the same state structure, metrics): its first len(inputs) flat
        # outputs are the carried state (what OffloadedStep counts from the output at run time)
        n_state = len(tree.input_paths)
        try:
            split = split_component(tree.jaxpr, component, n_state)
        except ValueError as e:
            return False, str(e)
        return True, split.reason

    def apply(fn):
        if isinstance(fn, Program):
            fn = fn.iteration()
        return OffloadedStep(fn, component, quota=quota)

    summary = f"run component {component!r} in a worker process behind the next call"
    params = (("component", component), ("quota", quota))
    return Transform(
        "offload_component",
        params,
        EXACT,
        "host",
        legal,
        apply,
        summary=summary,
        wraps_iteration=True,
        worker_quotas="probe",
        quota_branches=lambda fn, state: branches(fn, component, state),
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Each top-level component named in :data:`OFFLOAD_COMPONENTS` (results that reach only
    the metrics, e.g. an evaluation) in a worker behind the next call. Model: the component's
    whole share of the iteration leaves the critical path where processes run concurrently (an
    MPS client); on a GPU whose processes are time-sliced, :data:`~rose_jax.optimize.predict.
    TIME_SLICED_OVERLAP` of it (the worker's kernels wait for this process's time slices)."""
    out = []
    sliced = ctx.platform == "gpu" and ctx.concurrent_processes is False
    for node in ctx.tree.root.children:
        if node.kind == "component" and node.name in OFFLOAD_COMPONENTS:
            share = ctx.time_share(node)
            model = f"{node.name}'s share of the work ({share:.0%}) leaves the critical path"
            if sliced:
                share *= TIME_SLICED_OVERLAP
                model += (
                    f", {TIME_SLICED_OVERLAP:.0%} of it while processes are time-sliced (not an MPS "
                    "client: rose-jax train --mps-client)"
                )
            out.append(Candidate(offload_component(node.name), node.name, ctx.baseline_s * share, model))
    return out
