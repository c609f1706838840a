"""Host-level execution of a plan in several JAX processes (``rose_jax.runtime`` workers under MPS).

``ProcessCollect(program, G)`` is a host-level ``collect(state) -> (state, data)``: worker ``g``
rebuilds the program from its :class:`~rose_jax.program.ProgramSpec` and runs the
rollout of env group ``g`` (:func:`rose_jax.optimize.env_groups.collect_group`, in
:mod:`rose_jax.optimize.process_worker`) with the current parameters; the driver
gathers the groups' data and runs ``learn`` itself. Each worker is its own process with its own
compute stream, so the G rollouts really run concurrently on the GPU (under MPS, each with an SM
quota), unlike G jitted calls in one process.

Resident env state (the default, ``resident=True``). Worker ``g`` keeps ITS slice of the env
batch (``program.env``: for MJX an ``mjx.Data`` per env, tens of MB for thousands of envs) in
its own device memory between iterations. Per iteration the driver sends only the non-env state
leaves the rollout reads (policy params, normalizer, PRNG key: found by a liveness walk over the
jaxpr of the group's collect) and gets back only the data leaves ``learn`` reads (and any
non-env state leaf the collect writes); the new env slice stays in the worker. The set is
derived once from the jaxprs (see :func:`plan_resident`); when a program does not allow it
(``learn`` reads or writes the state's env part, ...) the collect falls back to shipping whole
states (``resident=False``; ``stats()['reason']`` says why).

The driver's state while the env state is resident: its env part (``program.env``) is a
:class:`ResidentEnv` marker (a version number, no env data), and the data's leaves that
``learn`` does not read are ``None``. Any code that looks into them fails loudly instead of
reading stale values. :meth:`ProcessCollect.sync_state` fetches the env slices back and
returns the exact state the single-process program would have (for checkpoints and equality
checks). The rules (identity and version):

* a state whose env part is real arrays is the truth: it is uploaded (``put_resident``) before
  the rollout, on the first call and whenever the driver's env state changed behind the
  workers' back (a restore, a new start, a synced state passed back). Re-uploading the env
  state of the last upload (the same array objects, e.g. every timed run from one example
  state) costs no transfer: the workers kept a copy (``keep_origin``).
* a state whose env part is a marker continues from the workers' env state, which must be the
  version the marker names: a state from an earlier iteration (or a checkpoint of a marker)
  cannot continue (its env state is gone) and is a clear ``ValueError``, never stale results.
  :meth:`put_env` uploads explicitly.
* a worker that dies loses the resident env state: the next call needs a state with a real
  env part (it starts fresh workers).

The executor is pluggable: :class:`InlineExecutor` runs the same worker functions in this
process, one group after the other (for tests of the data path on a CPU);
:class:`RuntimeExecutor` uses ``rose_jax.runtime``'s worker pool (same-GPU CUDA IPC or host
shared memory, as the runtime chooses).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import time
import warnings
import weakref
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rose_jax import runtime
from rose_jax.jaxpr import compat, dataflow
from rose_jax.mps import plan as mps_plan
from rose_jax.optimize.base import HostStep
from rose_jax.optimize import env_groups
from rose_jax.optimize.process_worker import (
    ENV,
    ORIGIN,
    WORKER_COLLECT,
    WORKER_RESTORE,
    WORKER_ROLLOUT,
    ResidentLayout,
    worker_collect,
    worker_rollout,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ the marker


@struct.dataclass
class ResidentEnv:
    """Stands in for a state's env-batch part while that part is resident in the workers.

    ``version``: () int32, the version of the workers' env state this state goes with;
    ``owner``: which :class:`ProcessCollect` holds it (static).
    """

    version: Any
    owner: str = struct.field(pytree_node=False)


class _Hole:
    """A placeholder leaf for the env part while the driver works on the other leaves."""

    def __repr__(self):
        return "<env leaf>"


_HOLE = _Hole()


# ---------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class ResidentPlan:
    """What one iteration moves, derived from the program's jaxprs for one state structure.

    ``resident``: whether the env state can stay in the workers (``reason`` says why not);
    ``layout``: the worker's view; ``signature``: the state's structure and leaf shapes (a
    state that differs gets a new plan); ``env_treedef`` / ``data_treedef``: structures of the
    env part and of the data; ``data_axes``: env axis of each used data leaf (None: not per env);
    ``paths``: names of the state leaves (for messages); ``env_bytes`` / ``sent_bytes_per_worker``:
    bytes of the whole env state and of one worker's per-iteration inputs.
    """

    resident: bool
    reason: str
    layout: ResidentLayout | None = None
    signature: Any = None
    env_treedef: Any = None
    data_treedef: Any = None
    data_axes: tuple = ()
    paths: tuple[str, ...] = ()
    env_bytes: int = 0
    state_bytes: int = 0
    sent_bytes_per_worker: int = 0


def _signature(state) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(state)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


def _nbytes(x) -> int:
    return int(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)))


def plan_resident(program: Any, state: Any, groups: int, owner: str = "plan") -> ResidentPlan:
    """Derive what a resident iteration sends and receives (tracing only, nothing runs).

    1. ``learn`` (traced on the full batch) must pass the state's env leaves through unchanged
       and not read them (the driver's state holds a marker instead); the data leaves it reads
       are the only data that travels back.
    2. The group's collect (traced for group 0) must keep the state's structure; its non-env
       output leaves that are not its inputs passed through travel back; the non-env inputs
       that those outputs, the new env leaves or the used data depend on are sent every
       iteration; the others become zeros in the worker.
    3. ``learn`` must trace on the driver's form (marker env part, ``None`` for unread data).
    """

    leaves, treedef = jax.tree_util.tree_flatten(state)
    paths = tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0])
    mask = jax.tree.leaves(env_groups.env_mask(program, state))
    env_pos = tuple(i for i, m in enumerate(mask) if m)
    other = tuple(i for i, m in enumerate(mask) if not m)
    n = len(leaves)
    common = dict(
        signature=_signature(state),
        paths=paths,
        env_bytes=sum(_nbytes(leaves[i]) for i in env_pos),
        state_bytes=sum(_nbytes(x) for x in leaves),
    )

    def no(reason):
        return ResidentPlan(False, reason, **common)

    if not env_pos:
        return no("the program's env lens selects no state leaves")

    # 1. learn, on the full batch (tracing only: the arrays' shapes and dtypes)
    out_state, data = jax.eval_shape(program.collect, state)
    if jax.tree.structure(out_state) != treedef:
        return no("collect changes the state's structure")
    closed_l, (new_state, _) = jax.make_jaxpr(program.learn, return_shape=True)(out_state, data)
    if jax.tree.structure(new_state) != treedef:
        return no("learn changes the state's structure")
    jl = closed_l.jaxpr
    written = [i for i in env_pos if jl.outvars[i] is not jl.invars[i]]
    if written:
        return no(f"learn writes the env state ({paths[written[0]]}): it must pass it through")
    live_l = dataflow.live_inputs(closed_l, [i for i in range(len(jl.outvars)) if i not in set(env_pos)])
    read = [i for i in env_pos if live_l[i]]
    if read:
        return no(f"learn reads the state's env part ({paths[read[0]]}): read it from the data instead")
    data_leaves, data_treedef = jax.tree_util.tree_flatten(data)
    data_used = tuple(j for j in range(len(data_leaves)) if live_l[n + j])
    all_axes = env_groups.data_axes(program, data)
    used_axes = tuple(all_axes[j] for j in data_used)

    # 2. the group's collect
    state_g = jax.eval_shape(lambda s: env_groups.split_envs(program, s, groups)[0], state)
    closed_c, (out_g, _) = jax.make_jaxpr(
        lambda s: env_groups.collect_group(program, s, 0, groups), return_shape=True
    )(state_g)
    if jax.tree.structure(out_g) != treedef:
        return no("the group's collect changes the state's structure")
    jc = closed_c.jaxpr
    changed = tuple(i for i in other if jc.outvars[i] is not jc.invars[i])
    live_c = dataflow.live_inputs(closed_c, list(env_pos) + list(changed) + [n + j for j in data_used])
    sent = tuple(i for i in other if live_c[i])
    zeros = tuple(
        (i, tuple(np.shape(leaves[i])), str(jnp.result_type(leaves[i]))) for i in other if not live_c[i]
    )

    # 3. learn on the driver's form of the state and data
    marker = ResidentEnv(jax.ShapeDtypeStruct((), jnp.int32), owner)
    pruned = jax.tree_util.tree_unflatten(
        data_treedef, [x if j in set(data_used) else None for j, x in enumerate(data_leaves)]
    )
    try:
        out = jax.eval_shape(program.learn, program.env.set(out_state, marker), pruned)
    except Exception as e:  # noqa: BLE001 - any failure means the resident form is not usable
        first = str(e).splitlines()[0][:160] if str(e) else ""
        return no(f"learn does not trace on a marker env part / pruned data: {type(e).__name__}: {first}")
    if not isinstance(program.env.get(out[0]), ResidentEnv):
        return no("learn does not pass the state's env part through")

    layout = ResidentLayout(treedef, env_pos, sent, zeros, changed, data_used)
    sent_bytes = sum(_nbytes(leaves[i]) for i in sent)
    names = ", ".join(paths[i] for i in sent[:6]) + (f" +{len(sent) - 6} more" if len(sent) > 6 else "")
    return ResidentPlan(
        True,
        f"env state resident; per iteration each worker gets {len(sent)} leaves ({names}), "
        f"{len(data_used)}/{len(data_leaves)} data leaves come back",
        layout,
        env_treedef=jax.tree.structure(program.env.get(state)),
        data_treedef=data_treedef,
        data_axes=used_axes,
        sent_bytes_per_worker=sent_bytes,
        **common,
    )


# ------------------------------------------------------------------------------- executors


class Executor(Protocol):
    """Runs the groups' worker functions; resident values are kept per group under a name.

    ``options``: XLA compiler options of the group's rollout, as sorted ``(name, value)`` pairs
    (``()``: none); each distinct value compiles once per group and is reused afterwards."""

    def run_groups(self, spec: Any, states: list, groups: int, options: tuple = ()) -> list: ...

    def put(self, name: str, values: list) -> None: ...

    def restore(self, src: str, dst: str) -> None: ...

    def run_resident(
        self, spec: Any, sent: tuple, groups: int, layout: ResidentLayout, options: tuple = ()
    ) -> list: ...

    def fetch(self, name: str) -> list: ...

    def close(self) -> None: ...


class InlineExecutor:
    """Runs every group's worker function here, one after the other (no concurrency; for tests).

    The worker functions are called as a worker calls them (``jit=False``: they build the program
    from its spec eagerly and jit the rollout themselves, once per process); resident values are
    kept in a dict per group, as a worker process keeps them."""

    def __init__(self):
        self._store: dict[int, dict[str, Any]] = collections.defaultdict(dict)

    def run_groups(self, spec, states, groups, options=()):
        return [
            worker_collect(s, spec=spec, g=g, groups=groups, compiler_options=options)
            for g, s in enumerate(states)
        ]

    def put(self, name, values):
        for g, v in enumerate(values):
            self._store[g][name] = v

    def restore(self, src, dst):
        for store in self._store.values():
            store[dst] = store[src]

    def run_resident(self, spec, sent, groups, layout, options=()):
        outs = []
        for g in range(groups):
            (env_g,), out = worker_rollout(
                self._store[g][ENV],
                sent,
                spec=spec,
                g=g,
                groups=groups,
                layout=layout,
                compiler_options=options,
            )
            self._store[g][ENV] = env_g
            outs.append(out)
        return outs

    def fetch(self, name):
        return [self._store[g][name] for g in sorted(self._store)]

    def close(self):
        self._store.clear()


def available() -> tuple[bool, str]:
    """Whether worker processes can be started (the ``rose_jax.runtime`` pool is part of the package)."""
    return True, "rose_jax.runtime worker pool available"


class RuntimeExecutor:
    """One ``rose_jax.runtime`` worker process per env group.

    On a GPU the workers run under an MPS daemon (``daemon``, or one this executor starts in a
    temporary directory and stops on ``close``), so their kernels run concurrently; ``quotas``
    gives each worker an SM percent (None: no limit). On a CPU the workers are CPU JAX
    processes (``JAX_PLATFORMS=cpu``): the data path is the same, the speed says nothing.
    The pool starts at the first call (spawn + ``import jax`` + compile: seconds); after a
    worker died (``WorkerDied``), the next call starts a fresh pool.
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
        self._daemon, self._use_mps = daemon, use_mps
        self._managed: runtime.ManagedPool | None = None  # the workers and a daemon of our own
        self._pool = None
        self._last_stats: list[dict] = []

    @property
    def pool(self):
        """The running worker pool (None before the first call and after ``close``)."""
        return self._pool

    def _ensure(self):
        """The running pool; after a worker died, a new one (ManagedPool.ensure: a fatal MPS fault
        reaches every client, so a daemon of our own starts over too)."""
        if self._managed is not None and self._managed.running:
            self._pool = self._managed.pool
            return self._pool
        gpu = jax.default_backend() == "gpu"
        if gpu and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() not in ("false", "0"):
            warnings.warn(
                "this driver process preallocated GPU memory (XLA_PYTHON_CLIENT_PREALLOCATE is not 'false'): "
                "worker processes may run out of memory; set it before importing jax",
                stacklevel=2,
            )
        if self._managed is None:
            use_mps = gpu if self._use_mps is None else self._use_mps
            env = () if gpu else (("JAX_PLATFORMS", "cpu"),)
            quotas = self.quotas or (None,) * self.groups
            specs = [
                mps_plan.WorkerSpec(f"group{g}", quota=q if use_mps else None, env=env)
                for g, q in enumerate(quotas)
            ]
            # the driver only orchestrates here: a daemon of its own serves its workers
            self._managed = runtime.ManagedPool(
                specs,
                mps=use_mps,
                daemon=self._daemon if use_mps else None,
                prefix="rose-mps-",
                transport=self.transport,
            )
        self._pool = self._managed.ensure()
        return self._pool

    def _all(self, submit: Callable[[Any, str, int], Any]) -> list:
        pool = self._ensure()
        handles = [submit(pool, f"group{g}", g) for g in range(self.groups)]
        out = pool.wait(handles, self.timeout)
        self._last_stats = [pool.last_stats.get(f"group{g}") or {} for g in range(self.groups)]
        return out

    def worker_stats(self) -> dict:
        """The last call's ``run_s`` / ``decode_s`` / ``encode_s`` of its slowest group (the one
        whose three took longest together; keys without a value left out)."""
        keys = ("run_s", "decode_s", "encode_s")
        stats = [s for s in self._last_stats if any(s.get(k) is not None for k in keys)]
        if not stats:
            return {}
        slowest = max(stats, key=lambda s: sum(s.get(k) or 0.0 for k in keys))
        return {k: slowest[k] for k in keys if slowest.get(k) is not None}

    # the worker functions build their program eagerly and jit the rollout themselves (jit=False)
    def run_groups(self, spec, states, groups, options=()):
        static = {"spec": spec, "groups": groups, "compiler_options": options}
        return self._all(
            lambda pool, w, g: pool.submit(w, WORKER_COLLECT, states[g], static={**static, "g": g}, jit=False)
        )

    def put(self, name, values):
        self._all(lambda pool, w, g: pool.submit_put(w, name, values[g]))

    def restore(self, src, dst):
        self._all(lambda pool, w, g: pool.submit(w, WORKER_RESTORE, jit=False, reads=(src,), writes=(dst,)))

    def run_resident(self, spec, sent, groups, layout, options=()):
        static = {"spec": spec, "groups": groups, "layout": layout, "compiler_options": options}
        return self._all(
            lambda pool, w, g: pool.submit(
                w,
                WORKER_ROLLOUT,
                sent,
                static={**static, "g": g},
                jit=False,
                reads=(ENV,),
                writes=(ENV,),
            )
        )

    def fetch(self, name):
        return self._all(lambda pool, w, g: pool.submit_get(w, name))

    def close(self):
        """Stop the workers, then a daemon this executor started; idempotent."""
        self._pool = None
        if self._managed is not None:
            self._managed.close()


# ------------------------------------------------------------------------------ the collect


def _tree_bytes(tree) -> int:
    return sum(_nbytes(x) for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and hasattr(x, "shape"))


class ProcessCollect(HostStep):
    """A host-level collect that runs env groups in worker processes (see the module docstring).

    Args:
      program: the single-process :class:`~rose_jax.program.Program` (with a spec).
      groups: number of env groups = worker processes.
      quotas: SM percent per worker (MPS), for the default :class:`RuntimeExecutor`.
      executor: where the groups run (default: a :class:`RuntimeExecutor`).
      resident: keep each group's env slice in its worker between iterations (if the program
        allows it, see :func:`plan_resident`); False ships whole states every iteration.
      keep_origin: workers keep the env slice as last uploaded, so re-uploading the same env
        arrays (a new run from the same start state) moves no bytes (costs one env state of
        worker memory).
    """

    def __init__(
        self,
        program: Any,
        groups: int,
        *,
        quotas: tuple[int, ...] | None = None,
        executor: Executor | None = None,
        resident: bool = True,
        keep_origin: bool = True,
    ):

        if program.spec is None:
            raise ValueError(f"program {program.name!r} has no ProgramSpec: workers cannot rebuild it")
        self.program, self.groups = program, groups
        self.resident, self.keep_origin = bool(resident), bool(keep_origin)
        self.executor = executor if executor is not None else RuntimeExecutor(groups, quotas)
        self.owner = f"pc{os.getpid()}-{secrets.token_hex(4)}"
        self._split = jax.jit(lambda s: env_groups.split_envs(program, s, groups))
        self._merge = jax.jit(
            lambda outs: (
                env_groups.merge_states(program, [o[0] for o in outs]),
                env_groups.merge_data(program, [o[1] for o in outs]),
            )
        )
        self._plans: dict[Any, tuple[ResidentPlan, dict]] = {}
        self._plan: ResidentPlan | None = None  # the plan of the env state in the workers
        self._fns: dict = {}
        self._version = 0  # bumped by every upload and every resident iteration
        self._valid = False  # the workers hold the env state of version self._version
        self._origin: list | None = None  # weakrefs to the env leaves of the last upload
        self._counts = collections.Counter()
        self._history: collections.deque = collections.deque(maxlen=1000)

    # ------------------------------------------------------------------ public
    def __call__(self, state):
        """``(state, data)`` after the groups' rollouts (see the module docstring for the forms)."""
        return self._collect(state, ())

    def with_compiler_options(self, compiler_options: dict | None) -> "HostStep":
        """This collect with the groups' rollouts compiled under ``compiler_options`` (e.g. the
        search's deterministic ops): the same workers, resident env state and version, so a state
        from either form continues in the other; closing the view leaves the workers running."""
        return _CompiledCollect(self, tuple(sorted((compiler_options or {}).items())))

    def _collect(self, state, options: tuple):
        t0 = time.perf_counter()
        part = self.program.env.get(state)
        upload, upload_bytes = None, 0
        if isinstance(part, ResidentEnv):
            self._check_marker(part)
            plan, fns = self._plan, self._fns
        else:
            if not self.resident:
                return self._call_full(state, t0, "resident=False", options)
            plan, fns = self._plan_for(state)
            if not plan.resident:
                return self._call_full(state, t0, plan.reason, options)
            upload, upload_bytes = self._upload(state, plan, fns, force=False)
        leaves = _commit(self._leaves(state, plan))
        sent = tuple(leaves[i] for i in plan.layout.sent)
        # the sent leaves (the policy's parameters) come out of the previous iteration's learn,
        # dispatched asynchronously: wait for them here, where sending them would wait anyway, so
        # that time is recorded as the input's wait, not as the exchange's
        t_wait = time.perf_counter()
        jax.block_until_ready(sent)
        t1 = time.perf_counter()
        try:
            outs = self.executor.run_resident(self.program.spec, sent, self.groups, plan.layout, options)
        except BaseException:
            self._lost()  # some workers may have stepped their envs, others not
            raise
        t2 = time.perf_counter()
        # waited for: the merge's device time is the driver's (the learn reads its outputs next)
        changed, used = jax.block_until_ready(_commit(fns["merge"](outs)))
        for i, x in zip(plan.layout.changed, changed, strict=True):
            leaves[i] = x
        used_at = dict(zip(plan.layout.data_used, used, strict=True))
        data = jax.tree_util.tree_unflatten(
            plan.data_treedef, [used_at.get(j) for j in range(plan.data_treedef.num_leaves)]
        )
        self._version += 1
        new_state = self._with_marker(jax.tree_util.tree_unflatten(plan.layout.treedef, leaves))
        self._record(
            "iteration",
            sent_bytes=self.groups * _tree_bytes(sent),
            received_bytes=sum(_tree_bytes(o) for o in outs),
            upload=upload,
            upload_bytes=upload_bytes,
            **self._time_split(t0, t_wait, t1, t2),
        )
        return new_state, data

    def sync_state(self, state):
        """``state`` with its env part fetched from the workers: the single-process program's state.

        A state with a real env part is returned as is. The workers keep their env state: go on
        iterating with ``state`` (the marker form) to avoid a re-upload."""
        part = self.program.env.get(state)
        if not isinstance(part, ResidentEnv):
            return state
        self._check_marker(part)
        t0 = time.perf_counter()
        try:
            slices = self.executor.fetch(ENV)
        except BaseException:
            self._lost()
            raise
        env = jax.tree_util.tree_unflatten(self._plan.env_treedef, list(self._fns["concat"](slices)))
        self._record(
            "sync", received_bytes=sum(_tree_bytes(s) for s in slices), wall_s=time.perf_counter() - t0
        )
        return self.program.env.set(state, env)

    def put_env(self, state, *, force: bool = True):
        """Upload ``state``'s env part (real arrays) to the workers; returns ``state`` in marker form.

        Explicit (re-)initialisation, e.g. after restoring a checkpoint (a call with a real env
        part does the same implicitly). ``force=False`` lets a re-upload of the last uploaded
        arrays restore the workers' copy instead of transferring."""
        part = self.program.env.get(state)
        if isinstance(part, ResidentEnv):
            raise ValueError("put_env needs a state with its real env part, got a ResidentEnv marker")
        plan, fns = self._plan_for(state)
        if not plan.resident:
            raise ValueError(f"the env state cannot be resident for this program: {plan.reason}")
        t0 = time.perf_counter()
        kind, nbytes = self._upload(state, plan, fns, force=force)
        self._record(kind, upload=kind, upload_bytes=nbytes, wall_s=time.perf_counter() - t0)
        return self._with_marker(state)

    def comparable(self, out):
        """``(state, data)`` from this collect or from the single-process collect, in one form:
        env part synced from the workers, data leaves ``learn`` does not read set to ``None``."""
        state, data = out
        state = self.sync_state(state)
        plan = self._plan
        if plan is None or not plan.resident:
            return state, data
        leaves, treedef = jax.tree_util.tree_flatten(data)
        if treedef == plan.data_treedef:  # full data (the single-process collect's)
            keep = set(plan.layout.data_used)
            data = jax.tree_util.tree_unflatten(
                treedef, [x if j in keep else None for j, x in enumerate(leaves)]
            )
        return state, data

    def stats(self) -> dict:
        """Counts and bytes (array payload, driver <-> all workers together) of what moved.

        ``per_iteration``: the last (up to 1000) records ``{kind ("iteration" | "sync" | "put" |
        "restore": the last two from :meth:`put_env`), mode ("resident" | "full"), version,
        sent_bytes (driver -> workers, per-iteration inputs), received_bytes (workers -> driver),
        upload ("put" | "restore" | None: the env state uploaded in this call), upload_bytes,
        total_bytes (their sum), wall_s (the whole call), input_wait_s (waiting for the sent inputs,
        e.g. the previous iteration's learn still running on the device), driver_before_s /
        driver_after_s (the driver's own work before sending (an upload included) and after the
        outputs came back: merging them into the state, waited for), workers_s (the groups' round
        trip), worker_run_s / worker_decode_s / worker_encode_s (the slowest group's function, input
        decoding and output encoding inside its worker; None in process)}``;
        summing ``total_bytes`` over records counts every byte once. ``last_iteration``: the newest
        "iteration" record; ``counts``: calls per kind (uploads inside iterations included).
        """
        records = list(self._history)
        iters = [r for r in records if r["kind"] == "iteration"]
        last = iters[-1] if iters else None
        plan = self._plan if last is None or last["mode"] == "resident" else None
        if plan is None and self._plans:
            plan = list(self._plans.values())[-1][0]
        return {
            "mode": last["mode"] if last else None,
            "reason": last.get("reason", plan.reason if plan else "") if last else "not run yet",
            "groups": self.groups,
            "owner": self.owner,
            "version": self._version,
            "counts": dict(self._counts),
            "env_state_bytes": plan.env_bytes if plan else (last or {}).get("env_bytes"),
            "state_bytes": plan.state_bytes if plan else (last or {}).get("state_bytes"),
            "sent_bytes_per_worker": plan.sent_bytes_per_worker if plan else None,
            "transport": self._transport(),
            "per_iteration": records,
            "last_iteration": last,
        }

    def close(self):
        self._lost()
        self.executor.close()

    # --------------------------------------------------------------- internals
    def _plan_for(self, state) -> tuple[ResidentPlan, dict]:
        sig = _signature(state)
        if sig not in self._plans:
            plan = plan_resident(self.program, state, self.groups, self.owner)
            log.info("ProcessCollect(%s, G=%d): %s", self.program.name, self.groups, plan.reason)
            self._plans[sig] = (plan, self._jitted(plan) if plan.resident else {})
        return self._plans[sig]

    def _jitted(self, plan: ResidentPlan) -> dict:
        n = self.program.num_envs // self.groups
        axes = plan.data_axes

        def split(env_leaves):
            return [tuple(x[g * n : (g + 1) * n] for x in env_leaves) for g in range(self.groups)]

        def concat(slices):
            return tuple(jnp.concatenate(xs, axis=0) for xs in zip(*slices, strict=True))

        def merge(outs):
            used = tuple(
                outs[0][1][k] if ax is None else jnp.concatenate([o[1][k] for o in outs], axis=ax)
                for k, ax in enumerate(axes)
            )
            return tuple(outs[0][0]), used

        return {"split": jax.jit(split), "concat": jax.jit(concat), "merge": jax.jit(merge)}

    def _leaves(self, state, plan: ResidentPlan) -> list:
        """The state's flat leaves in the plan's order, env leaves replaced by placeholders."""
        holes = jax.tree_util.tree_unflatten(plan.env_treedef, [_HOLE] * plan.env_treedef.num_leaves)
        leaves, treedef = jax.tree_util.tree_flatten(self.program.env.set(state, holes))
        if treedef != plan.layout.treedef:
            raise ValueError(
                "ProcessCollect: the state's structure differs from the one its env state was uploaded "
                "with; pass a state with its real env part to start over"
            )
        return leaves

    def _with_marker(self, state):
        return self.program.env.set(state, ResidentEnv(np.asarray(self._version, np.int32), self.owner))

    def _check_marker(self, m: ResidentEnv) -> None:
        if m.owner != self.owner:
            raise ValueError(
                f"this state's env part is resident in another ProcessCollect ({m.owner}, not {self.owner}): "
                "pass a state with its real env part (sync_state it with the collect that made it)"
            )
        if not self._valid:
            raise ValueError(
                "the workers no longer hold this state's env state (closed, or a worker failed): pass a "
                "state with its real env part, e.g. a checkpoint saved after sync_state"
            )
        v = int(np.asarray(m.version))
        if v != self._version:
            raise ValueError(
                f"this state goes with env state version {v}, but the workers hold version {self._version}: "
                "a state from an earlier iteration cannot continue (its env state is gone); sync_state "
                "the state you want to keep right after the iteration that made it"
            )

    def _lost(self) -> None:
        """The workers' env state is unknown or gone: the next call needs a real env part."""
        self._valid = False
        self._origin = None

    def _upload(self, state, plan: ResidentPlan, fns: dict, *, force: bool) -> tuple[str, int]:
        """Put (or restore) the env slices in the workers; ``(kind, bytes moved)``."""
        env_leaves = jax.tree.leaves(self.program.env.get(state))
        same = (
            not force
            and self.keep_origin
            and self._origin is not None
            and self._plan is plan
            and len(self._origin) == len(env_leaves)
            and all(r() is x for r, x in zip(self._origin, env_leaves, strict=True))
        )
        self._valid = False
        try:
            if same:
                self.executor.restore(ORIGIN, ENV)
                kind, nbytes = "restore", 0
            else:
                self._origin = None
                slices = fns["split"](tuple(_commit(env_leaves)))
                self.executor.put(ORIGIN if self.keep_origin else ENV, slices)
                if self.keep_origin:
                    self.executor.restore(ORIGIN, ENV)
                    self._origin = _weakrefs(env_leaves)
                kind, nbytes = "put", plan.env_bytes
        except BaseException:
            self._lost()
            raise
        self._plan, self._fns = plan, fns
        self._version += 1
        self._valid = True
        self._counts[kind] += 1
        if kind == "put":
            log.info("ProcessCollect: uploaded the env state (%d bytes) to %d workers", nbytes, self.groups)
        return kind, nbytes

    def _call_full(self, state, t0: float, why: str, options: tuple = ()):
        """Whole states both ways (the resident plan is off: ``why``)."""
        t_wait = time.perf_counter()
        states = self._split(_commit(jax.block_until_ready(state)))
        t1 = time.perf_counter()
        outs = self.executor.run_groups(self.program.spec, states, self.groups, options)
        t2 = time.perf_counter()
        result = jax.block_until_ready(_commit(self._merge(outs)))
        self._record(
            "iteration",
            sent_bytes=sum(_tree_bytes(s) for s in states),
            received_bytes=sum(_tree_bytes(o) for o in outs),
            **self._time_split(t0, t_wait, t1, t2),
            mode="full",
            reason=why,
            env_bytes=_tree_bytes(self.program.env.get(state)),
            state_bytes=_tree_bytes(state),
        )
        return result

    def _time_split(self, t0: float, t_wait: float, t1: float, t2: float) -> dict:
        """An iteration record's timings: called at its end; ``t0`` its start, ``t_wait`` when it
        began waiting for its inputs, ``t1`` when it sent them, ``t2`` when the outputs were back
        (see :meth:`stats`), and the slowest worker's own split."""
        end = time.perf_counter()
        worker = getattr(self.executor, "worker_stats", lambda: {})()
        return {
            "wall_s": end - t0,
            "input_wait_s": t1 - t_wait,
            "driver_before_s": t_wait - t0,
            "driver_after_s": end - t2,
            "workers_s": t2 - t1,
            "worker_run_s": worker.get("run_s"),
            "worker_decode_s": worker.get("decode_s"),
            "worker_encode_s": worker.get("encode_s"),
        }

    def _record(self, kind: str, **kw) -> None:
        rec = {
            "kind": kind,
            "version": self._version,
            "sent_bytes": 0,
            "received_bytes": 0,
            "upload": None,
            "upload_bytes": 0,
            "mode": "resident",
            **kw,
        }
        rec["total_bytes"] = rec["sent_bytes"] + rec["received_bytes"] + rec["upload_bytes"]
        if kind in ("iteration", "sync"):
            self._counts[kind] += 1
        self._history.append(rec)
        if kind == "iteration":
            log.debug(
                "ProcessCollect iteration %d: sent %d B, received %d B, upload %s (%d B)",
                self._counts["iteration"],
                rec["sent_bytes"],
                rec["received_bytes"],
                rec["upload"],
                rec["upload_bytes"],
            )

    def _transport(self) -> str | None:
        pool = getattr(self.executor, "pool", None)
        t = getattr(pool, "transport", None)
        return f"{t.kind}: {t.reason}" if t is not None else None


class _CompiledCollect(HostStep):
    """A :class:`ProcessCollect` whose group rollouts are compiled with XLA options (a view: it
    shares the collect's workers and resident env state; ``close`` leaves them to the collect)."""

    def __init__(self, collect: ProcessCollect, options: tuple):
        self.collect, self.options = collect, options

    def __call__(self, state):
        return self.collect._collect(state, self.options)

    def sync_state(self, state):
        return self.collect.sync_state(state)

    def comparable(self, out):
        return self.collect.comparable(out)

    def stats(self) -> dict:
        return self.collect.stats()

    def with_compiler_options(self, compiler_options: dict | None) -> HostStep:
        return self.collect.with_compiler_options(compiler_options)


def _commit(tree):
    """``tree`` with its array leaves committed to the default device (no copy for those that are).

    What reaches a jitted function (the workers' rollouts, the driver's learn) must be placed the
    same way every iteration: the user's first state is typically uncommitted, later states and
    the workers' outputs (CUDA IPC) are committed, and jit compiles once per placement."""
    device = jax.devices()[0]
    target = compat.single_device_sharding(device)

    def commit(x):
        # an array already committed with exactly this placement (one device, its default memory;
        # not e.g. a 1-device NamedSharding or pinned host memory, which jit keys apart) is returned
        # as is: jax.device_put costs ~18 us a leaf even then, ~4 ms per iteration over a PPO
        # state's ~220 leaves (measured on a CPU)
        if isinstance(x, jax.Array) and x.committed and x.sharding == target:
            return x
        return jax.device_put(x, device) if isinstance(x, (jax.Array, np.ndarray)) else x

    return jax.tree.map(commit, tree)


def _weakrefs(xs) -> list | None:
    try:
        return [weakref.ref(x) for x in xs]
    except TypeError:  # a leaf type without weak references (e.g. a numpy scalar): no restart
        return None
