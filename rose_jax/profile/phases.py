"""Phase timing of the real program: split a jitted function into component segments and time them.

:func:`time_phases` takes ``jax.make_jaxpr(fn)(*args)``, splits its top-level equations into
consecutive segments by outermost component (``rose:<name>`` scopes; equations outside every
component form ``"(glue)"`` segments, tiny glue is merged into its neighbour), jits every segment
as a function of its live inputs (the sub-jaxpr evaluated with ``jax.extend.core.jaxpr_as_fun``)
and runs them in order with ``block_until_ready`` fences, recording ``perf_counter_ns`` bounds.

Level 2 goes one component deeper inside each top-level segment (in ``repeats`` separate passes):
  * straight-line sub-components (SAC's ``collect`` -> ``collect/policy``, ``collect/sim``) are
    split and timed like level 1;
  * a ``scan``/``while`` whose body holds deeper components (``rollout`` -> ``rollout/policy``,
    ``rollout/sim``) has its body split the same way and run one iteration at a time (fenced),
    for at most ``max_loop_iterations`` iterations; such phases carry
    ``weight = trip_count / measured_iterations`` (the extrapolation factor, also listed in
    ``timeline.metadata['loops']``);
  * a loop whose body has no component of its own at that depth (PPO's epoch loop around the
    minibatch loop) is "transparent": one iteration of it is measured and its inner loops timed;
  * a loop whose whole body is one component (``advantage/gae``) is timed whole, as that component.
Calls (``jit``) are inlined wherever they hide components, at every depth.

What the numbers mean: segments are compiled separately, so XLA cannot fuse across their
boundaries, and the fences add one host round trip per segment (tens of microseconds on a GPU).
The fused program's own time is recorded too (level 0, path ``"(iteration)"``); the segmented
times say *where* the time goes, the fused time how long an iteration really takes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rose_jax.compare import compare_trees
from rose_jax.jaxpr import compat, dataflow
from rose_jax.jaxpr import cut as J
from rose_jax.profile.timeline import ActivitySeries, Phase, Timeline

GLUE = "(glue)"
# A fused call at least this long (its warm-up, seconds) is timed without a second untimed call
# first: the dispatch path that call warms is a negligible share of it, and on an epoch of tens of
# seconds (PPO halfcheetah, H100 2026-12-06) the extra call was one more epoch of the profile.
WARM_CALL_NEGLIGIBLE_S = 0.5
ITERATION = "(iteration)"


def _label(key: tuple[str, ...], context: tuple[str, ...]) -> str:
    if key == context:  # code of the enclosing component outside its children
        return J.path_string(context) if context else GLUE
    return J.path_string(key)


@dataclasses.dataclass
class _Segment:
    key: tuple[str, ...]
    eqns: list
    label: str = ""
    in_vars: list = dataclasses.field(default_factory=list)
    out_vars: list = dataclasses.field(default_factory=list)
    _fn: Any = None

    @property
    def fn(self):
        if self._fn is None:
            self._fn = J.jit_eqns(self.in_vars, self.out_vars, self.eqns)
        return self._fn


def _split(eqns: list, context: tuple[str, ...], glue_max_eqns: int) -> list[_Segment]:
    """Consecutive segments by component one level below ``context``; tiny glue merged."""
    depth = len(context) + 1
    segs: list[_Segment] = []
    for e in eqns:
        path, _ = J.effective(e)
        key = path[:depth] if len(path) >= depth else context
        if segs and segs[-1].key == key:
            segs[-1].eqns.append(e)
        else:
            segs.append(_Segment(key, [e]))

    def tiny(s: _Segment) -> bool:
        return s.key == context and not J.contains_loop(s.eqns) and J.count_eqns(s.eqns) <= glue_max_eqns

    merged: list[_Segment] = []
    for s in segs:
        if merged and tiny(s):
            merged[-1].eqns.extend(s.eqns)
        else:
            merged.append(s)
    if len(merged) > 1 and tiny(merged[0]):
        merged[1].eqns[:0] = merged[0].eqns
        merged.pop(0)
    out: list[_Segment] = []
    for s in merged:
        if out and out[-1].key == s.key:
            out[-1].eqns.extend(s.eqns)
        else:
            out.append(s)
    for s in out:
        s.label = _label(s.key, context)
    return out


def _wire(segs: list, final_outvars: list) -> None:
    """Set each segment's live inputs and the outputs later segments (or the result) need."""
    for s, (reads, outs) in zip(segs, dataflow.liveness([s.eqns for s in segs], final_outvars), strict=True):
        s.in_vars, s.out_vars = reads, outs


def _read(env: dict, atom, device=None):
    return env[atom] if compat.is_var(atom) else _committed(atom.val, device)  # as _sds declares a literal


def _interesting(eqn) -> bool:
    """A loop with components deeper than its own path somewhere inside."""
    if eqn.primitive.name not in compat.LOOP_PRIMITIVES:
        return False
    return J.effective(eqn)[1] > len(compat.component_path(eqn))


def _deeper(eqns: list, key: tuple[str, ...]) -> bool:
    """Do ``eqns`` hold components below ``key`` (straight-line or inside loops)?"""
    return any(J.effective(e)[1] > len(key) for e in eqns)


class _Recorder:
    def __init__(self):
        self.phases: list[Phase] = []
        self.loops: dict[int, dict] = {}
        self.clock = time.perf_counter_ns


class _Options(NamedTuple):
    levels: int
    max_loop_iterations: int
    glue_max_eqns: int
    device: Any = None  # where every value the pieces read is committed (None: left as given)


# -- level >= 2 ---------------------------------------------------------------------------------
class _Step(NamedTuple):
    """One segment of a level-L plan.

    timed: the segment is timed as a level-L phase; ``inner`` then optionally holds its level-L+1
    :class:`_Detail`. Not timed: glue holding loops with deeper components, run as a
    :class:`_Block` whose loop bodies are timed at level L ("transparent").
    """

    segment: _Segment
    timed: bool
    inner: Any


def _make_steps(eqns: list, context: tuple[str, ...], outs: list, level: int, opts: _Options) -> list[_Step]:
    segs = _split(eqns, context, opts.glue_max_eqns)
    _wire(segs, outs)
    steps = []
    for s in segs:
        if s.key == context and any(_interesting(e) for e in s.eqns):
            steps.append(_Step(s, False, _Block(s.eqns, s.out_vars, level, opts)))
        elif s.key != context and level < opts.levels and _deeper(s.eqns, s.key):
            steps.append(_Step(s, True, _Detail(s.eqns, s.key, level + 1, opts)))
        else:
            steps.append(_Step(s, True, None))
    return steps


def _run_steps(
    steps: list[_Step],
    env: dict,
    level: int,
    weight: float,
    record: bool,
    iteration: int,
    rec: _Recorder,
    device=None,
) -> None:
    """Run a plan's steps in order on ``env`` (updated with their outputs), timing the timed ones."""
    for st in steps:
        seg = st.segment
        if not st.timed:
            st.inner.run(env, weight, record, rec)
            continue
        ins = [env[v] for v in seg.in_vars]
        if st.inner is not None and iteration == 0:  # the deeper level, once per plan run
            st.inner.run(dict(zip(seg.in_vars, ins, strict=True)), weight, record, rec)
        t0 = rec.clock()
        outs = seg.fn(*ins)
        jax.block_until_ready(outs)
        t1 = rec.clock()
        if record:
            rec.phases.append(Phase(seg.label, t0, t1, level, iteration, weight))
        env.update(zip(seg.out_vars, _outputs(seg, outs, device), strict=True))


def _target_device(args) -> Any:
    """The one device the profile commits its values to: that of the committed arguments, else
    JAX's default device; None (values left as given) when an argument is sharded over several
    devices or the committed ones disagree."""
    leaves = [x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)]
    if any(len(x.sharding.device_set) > 1 for x in leaves):
        return None
    placed = {d for x in leaves if x.committed for d in x.sharding.device_set}
    if placed:
        return next(iter(placed)) if len(placed) == 1 else None
    default = jax.config.jax_default_device
    return default if default is not None and not isinstance(default, str) else jax.local_devices()[0]


def _committed(x, device):
    """``x`` as an array committed to ``device`` (None: ``x`` as is). Every value the pieces read
    is committed (the arguments, constants and literals here, the outputs of a piece with no
    inputs by :func:`_outputs`, everything else as an output of committed inputs) and :func:`_sds`
    declares them so: a jit call keys committed and uncommitted arguments apart, and pieces
    compiled from plain shapes were compiled again at their first call (6 of 22 programs on a
    CPU PPO ant epoch)."""
    if device is None:
        return x
    if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool, complex)):
        return jax.device_put(x, device)
    return x


def _committed_env(device, *tables: dict) -> dict:
    """Const tables (var -> value) merged in order, their values committed to ``device``."""
    return {k: _committed(v, device) for table in tables for k, v in table.items()}


def _outputs(seg, outs, device):
    """A piece's outputs; those of a piece with no inputs committed (jit leaves them uncommitted)."""
    return outs if seg.in_vars else [_committed(o, device) for o in outs]


def _sds(atom, device=None):
    aval = atom.aval
    return jax.ShapeDtypeStruct(
        aval.shape,
        aval.dtype,
        weak_type=getattr(aval, "weak_type", False),
        sharding=None if device is None else compat.single_device_sharding(device),
    )


def _segment_job(seg: _Segment, device=None):
    return seg.fn, [_sds(v, device) for v in seg.in_vars]


def _step_jobs(st: _Step, device=None):
    yield _segment_job(st.segment, device)
    if st.inner is not None:
        yield from st.inner.compile_jobs()


class _Detail:
    """Straight-line code of one component split into its sub-components (timed at ``level``)."""

    def __init__(self, eqns: list, key: tuple[str, ...], level: int, opts: _Options):
        self.level, self.device = level, opts.device
        eqns, _, consts = J.flatten_calls(eqns, len(key) + 1)
        self.const_env = _committed_env(opts.device, consts)
        self.steps = _make_steps(eqns, key, [], level, opts)
        self.warm = False

    def compile_jobs(self):
        for st in self.steps:
            yield from _step_jobs(st, self.device)

    def run(self, env: dict, weight: float, record: bool, rec: _Recorder) -> None:
        env = {**self.const_env, **env}
        if not self.warm:  # compile untimed first
            _run_steps(self.steps, dict(env), self.level, weight, False, 0, rec, self.device)
            self.warm = True
        if record:
            _run_steps(self.steps, env, self.level, weight, True, 0, rec, self.device)


class _Block:
    """Runs ``eqns`` (from an env of their inputs), timing the bodies of the interesting loops.

    Pieces between loops are jitted and run untimed; a loop's real outputs are computed (one
    jitted call of the loop equation) only where later equations or ``outs_needed`` use them.
    """

    def __init__(self, eqns: list, outs_needed: list, level: int, opts: _Options):
        self.device = opts.device
        items: list = []
        pos = 0
        for i, e in enumerate(eqns):
            if _interesting(e):
                if eqns[pos:i]:
                    items.append(_Segment((), eqns[pos:i]))
                items.append(_Loop(e, level, opts))
                pos = i + 1
        if eqns[pos:]:
            items.append(_Segment((), eqns[pos:]))
        segment = [isinstance(it, _Segment) for it in items]
        wiring = dataflow.liveness(
            [it.eqns if seg else [it.eqn] for it, seg in zip(items, segment, strict=True)],
            outs_needed,
            droppable=segment,  # a segment nothing needs is dead for our purpose
        )
        self.items = []
        for it, seg, io in zip(items, segment, wiring, strict=True):
            if io is None:
                continue
            if seg:
                it.in_vars, it.out_vars = io
            else:
                it.need_outputs = bool(io[1])
            self.items.append(it)

    def compile_jobs(self):
        for it in self.items:
            if isinstance(it, _Segment):
                yield _segment_job(it, self.device)
            else:
                yield from it.compile_jobs()

    def run(self, env: dict, weight: float, record: bool, rec: _Recorder) -> None:
        for it in self.items:
            if isinstance(it, _Segment):
                outs = it.fn(*[env[v] for v in it.in_vars])
                env.update(zip(it.out_vars, _outputs(it, outs, self.device), strict=True))
            else:
                it.run(env, weight, record, rec)


class _Loop:
    """A scan/while whose body segments are timed one iteration at a time."""

    def __init__(self, eqn, level: int, opts: _Options):
        self.eqn, self.level, self.opts = eqn, level, opts
        self.kind = eqn.primitive.name
        self.context = compat.component_path(eqn)
        self.need_outputs = False
        self.warm = False
        self._full = None
        self._count = None
        if self.kind == "scan":
            scan = compat.scan_params(eqn.params)
            bj, body_consts = scan.body, scan.body_consts
            self.length, self.reverse = scan.length, scan.reverse
            self.consts_i, self.carry_i, self.xs_i, self.carry_o, _ = compat.scan_partition(eqn)
        else:
            loop = compat.while_params(eqn.params)
            bj, body_consts = loop.body, loop.body_consts
            self.cond_n, self.body_n = loop.cond_nconsts, loop.body_nconsts
            self._cond_f = compat.as_fun(loop.cond, loop.cond_consts)
            self._body_f = compat.as_fun(loop.body, loop.body_consts)
        body_eqns = [compat.prefixed(q, eqn) for q in bj.eqns]
        body_eqns, alias, consts = J.flatten_calls(body_eqns, len(self.context) + 1)
        self.body_invars = list(bj.invars)
        self.body_outvars = [J.resolve(v, alias) for v in bj.outvars]
        own = dict(zip(bj.constvars, body_consts, strict=True))
        self.const_env = _committed_env(opts.device, own, consts)
        self.steps = _make_steps(body_eqns, self.context, self.body_outvars, level, opts)
        # Transparent: nothing at this depth but loops with deeper components (PPO's epoch loop).
        self.transparent = all(st.segment.key == self.context for st in self.steps) and any(
            not st.timed for st in self.steps
        )
        self.label = J.path_string(self.context) if self.context else GLUE

    def _iterate(self, body_in: list, weight: float, record: bool, iteration: int, rec: _Recorder) -> list:
        env = dict(self.const_env)
        env.update(zip(self.body_invars, body_in, strict=True))
        _run_steps(self.steps, env, self.level, weight, record, iteration, rec, self.opts.device)
        return [_read(env, v, self.opts.device) for v in self.body_outvars]

    def _count_fn(self):
        """jit of (cond consts, body consts, carry) -> trip count of the while loop."""
        if self._count is None:
            cond_f, body_f = self._cond_f, self._body_f

            def count(cc, bc, carry):
                def c(s):
                    return cond_f(*cc, *s[1])[0]

                def b(s):
                    return s[0] + 1, tuple(body_f(*bc, *s[1]))

                return jax.lax.while_loop(c, b, (jnp.zeros((), jnp.int32), tuple(carry)))[0]

            self._count = jax.jit(count)
        return self._count

    def compile_jobs(self):
        """(jitted fn, abstract args) of everything this loop will call."""
        for st in self.steps:
            yield from _step_jobs(st, self.opts.device)
        if self.need_outputs:
            ins, fn = self._full_fn()
            yield fn, [_sds(v, self.opts.device) for v in ins]
        if self.kind == "while":
            avals = [_sds(a, self.opts.device) for a in self.eqn.invars]
            cn, bn = self.cond_n, self.body_n
            yield self._count_fn(), [avals[:cn], avals[cn : cn + bn], avals[cn + bn :]]

    def _full_fn(self):
        if self._full is None:
            e = self.eqn
            ins = list(dict.fromkeys(a for a in e.invars if compat.is_var(a)))
            self._full = (ins, J.jit_eqns(ins, [v for v in e.outvars if compat.is_var(v)], [e]))
        return self._full

    def run(self, env: dict, weight: float, record: bool, rec: _Recorder) -> None:
        vals = [_read(env, a, self.opts.device) for a in self.eqn.invars]
        if self.kind == "scan":
            self._run_scan(vals, weight, record, rec)
        else:
            self._run_while(vals, weight, record, rec)
        if self.need_outputs:
            ins, fn = self._full_fn()
            outs = fn(*[env[v] for v in ins])
            env.update(zip([v for v in self.eqn.outvars if compat.is_var(v)], outs, strict=True))

    def _measure_count(self, trips: int) -> int:
        return min(trips, 1 if self.transparent else self.opts.max_loop_iterations)

    def _note(self, rec: _Recorder, trips: int, measured: int, weight: float) -> None:
        rec.loops.setdefault(
            id(self),
            {
                "path": self.label,
                "kind": self.kind,
                "level": self.level,
                "trip_count": int(trips),
                "measured_iterations": int(measured),
                "transparent": bool(self.transparent),
                "weight": float(weight),
            },
        )

    def _run_scan(self, vals: list, weight: float, record: bool, rec: _Recorder) -> None:
        length, reverse = self.length, self.reverse
        if length == 0:
            return

        def body_in(i: int, carry: list) -> list:
            idx = length - 1 - i if reverse else i
            ins = list(vals)
            for j in self.xs_i:
                ins[j] = vals[j][idx]
            for j, c in zip(self.carry_i, carry, strict=True):
                ins[j] = c
            jax.block_until_ready(ins)
            return ins

        carry0 = [vals[j] for j in self.carry_i]
        if not self.warm:
            # Compile every body segment (and inner loops), untimed. Two iterations: the second
            # sees carries produced by the segments themselves, whose dispatch signature can
            # differ from the loop's inputs (committed arrays), which costs a slow-path call once.
            carry = carry0
            for i in range(min(2, length)):
                outs = self._iterate(body_in(i, carry), weight, False, 0, rec)
                carry = [outs[j] for j in self.carry_o]
            self.warm = True
        if not record:
            return
        m = self._measure_count(length)
        w = weight * length / m
        self._note(rec, length, m, w)
        carry = carry0
        for i in range(m):
            outs = self._iterate(body_in(i, carry), w, True, i, rec)
            carry = [outs[j] for j in self.carry_o]

    def _run_while(self, vals: list, weight: float, record: bool, rec: _Recorder) -> None:
        cn, bn = self.cond_n, self.body_n
        cond_consts, body_consts, carry0 = vals[:cn], vals[cn : cn + bn], vals[cn + bn :]
        trips = int(self._count_fn()(cond_consts, body_consts, carry0))
        if trips == 0:
            return
        if not self.warm:  # as for scan: two untimed iterations
            carry = list(carry0)
            for _ in range(min(2, trips)):
                carry = self._iterate(body_consts + carry, weight, False, 0, rec)
            self.warm = True
        if not record:
            return
        m = self._measure_count(trips)
        w = weight * trips / m
        self._note(rec, trips, m, w)
        carry = list(carry0)
        for i in range(m):
            carry = self._iterate(body_consts + carry, w, True, i, rec)


# -- the segmented program ----------------------------------------------------------------------
class SegmentedProgram:
    """``fn`` split into top-level component segments, each jitted on its live inputs.

    ``run(*args)`` evaluates them in order (fenced) and returns fn's outputs (same pytree).
    """

    def __init__(
        self, fn: Callable, *args, levels: int = 2, max_loop_iterations: int = 4, glue_max_eqns: int = 64
    ):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        self.out_tree = jax.tree.structure(out_shape)
        self.in_tree = jax.tree.structure(args)
        j, j_consts = compat.open_and_consts(closed)
        eqns, alias, consts = J.flatten_calls(j.eqns, 1)
        self.invars = list(j.invars)
        self.outvars = [J.resolve(v, alias) for v in j.outvars]
        self.opts = _Options(levels, max_loop_iterations, glue_max_eqns, _target_device(args))
        own = dict(zip(j.constvars, j_consts, strict=True))
        self.const_env = _committed_env(self.opts.device, own, consts)
        self.segments = _split(eqns, (), glue_max_eqns)
        _wire(self.segments, self.outvars)
        self._details: dict[int, Any] = {}

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.segments]

    def _env(self, args) -> dict:
        if jax.tree.structure(args) != self.in_tree:
            raise ValueError(
                f"SegmentedProgram: arguments have structure {jax.tree.structure(args)}, "
                f"expected {self.in_tree}"
            )
        env = dict(self.const_env)
        leaves = [_committed(x, self.opts.device) for x in jax.tree.leaves(args)]
        env.update(zip(self.invars, leaves, strict=True))
        return env

    def run(
        self,
        *args,
        record: _Recorder | None = None,
        iteration: int = 0,
        weight: float = 1.0,
        detail: bool = False,
    ):
        """Run every segment in order (each fenced); returns fn's outputs.

        With ``record``, each segment's bounds become a level-1 Phase; with ``detail`` (needs
        ``record``), each segment's sub-components and loop bodies are timed first (level >= 2)
        and the segments themselves are not recorded.
        """
        if detail and record is None:
            raise ValueError("SegmentedProgram.run: detail=True needs a recorder")
        env = self._env(args)
        clock = time.perf_counter_ns
        for i, s in enumerate(self.segments):
            ins = [env[v] for v in s.in_vars]
            if detail and self.opts.levels >= 2:
                plan = self._detail(i)
                if plan is not None:
                    plan.run(dict(zip(s.in_vars, ins, strict=True)), weight, True, record)
            t0 = clock()
            outs = s.fn(*ins)
            jax.block_until_ready(outs)
            t1 = clock()
            if record is not None and not detail:
                record.phases.append(Phase(s.label, t0, t1, 1, iteration, weight))
            env.update(zip(s.out_vars, _outputs(s, outs, self.opts.device), strict=True))
        return jax.tree.unflatten(self.out_tree, [_read(env, v, self.opts.device) for v in self.outvars])

    def precompile(self, extra: Sequence = (), threads: int | None = None, also: Sequence = ()) -> dict:
        """Compile every segment (and, with levels >= 2, every level >= 2 piece) up front.

        ``extra``: ``(jitted fn, args)`` pairs compiled first, alone (the fused program: on a GPU,
        XLA autotunes kernels by timing them, which concurrent compiles would disturb). The
        pieces are then compiled in parallel threads (XLA compiles without the GIL; lowering
        is sequential). ``also``: more ``(jitted fn, args)`` pairs compiled in that pool for the
        caller (JAX keeps the executables: a later call of the same function with the same
        options compiles nothing); one that fails is recorded in ``also_errors``, never
        raised. Returns counts and seconds.
        """
        t0 = time.perf_counter()
        for fn, args in extra:
            fn.lower(*args).compile()
        t1 = time.perf_counter()
        jobs = [_segment_job(s, self.opts.device) for s in self.segments]
        if self.opts.levels >= 2:
            for i in range(len(self.segments)):
                plan = self._detail(i)
                if plan is not None:
                    jobs.extend(plan.compile_jobs())
        errors: list[str] = []

        def guarded(step):  # the caller's (also) jobs: a failure is recorded, the caller reports it again
            try:
                return step()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                return None

        # a failing piece of the profile itself raises: its failure is the profile's
        tasks = [low.compile for low in (fn.lower(*args) for fn, args in jobs)]
        for fn, args in also:
            low = guarded(lambda fn=fn, args=args: fn.lower(*args))
            if low is not None:
                tasks.append(lambda low=low: guarded(low.compile))
        t2 = time.perf_counter()
        workers = max(1, min(len(tasks), threads or os.cpu_count() or 1))
        if workers == 1:
            for task in tasks:
                task()
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda task: task(), tasks))
        return {
            "programs": len(tasks) + len(extra),
            "extra_compile_s": t1 - t0,
            "lower_s": t2 - t1,
            "compile_s": time.perf_counter() - t2,
            "threads": workers,
            "also": len(also),
            "also_errors": errors,
        }

    def _detail(self, i: int):
        if i not in self._details:
            s = self.segments[i]
            self._details[i] = _Detail(s.eqns, s.key, 2, self.opts) if _deeper(s.eqns, s.key) else None
        return self._details[i]

    __call__ = run


# -- output comparison --------------------------------------------------------------------------
def compare_outputs(a, b, rtol: float = 1e-5, atol: float = 1e-6) -> dict:
    """``{'match', 'bitwise_equal', 'max_abs_diff', 'num_leaves'}`` of two output pytrees.

    :func:`rose_jax.compare.compare_trees` (each float leaf within ``atol + rtol * max|b|``
    for ``match``; every leaf bitwise for ``bitwise_equal``; int, bool and key leaves exactly).
    """
    # a NaN equals nothing in compare_trees; here a NaN at the same place on both sides (e.g. an RL
    # iteration's episode_return while no episode has finished) is the same output, compared as 0
    # (a NaN on one side only stays unequal); nan_pairs says how many such elements there were
    def both_nan(x, y):
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or jnp.shape(x) != jnp.shape(y):
            return None
        return np.isnan(np.asarray(x)) & np.isnan(np.asarray(y))

    def fill(x, y):
        m = both_nan(x, y)
        return x if m is None or not m.any() else np.where(m, 0.0, np.asarray(x)).astype(x.dtype)

    nan_pairs = 0
    if jax.tree.structure(a) == jax.tree.structure(b):
        masks = [both_nan(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
        nan_pairs = sum(int(m.sum()) for m in masks if m is not None)
        if nan_pairs:
            a, b = jax.tree.map(fill, a, b), jax.tree.map(fill, b, a)
    exact = compare_trees(a, b)
    close = exact if exact.equal else compare_trees(a, b, rtol, atol)
    return {
        "match": close.equal,
        "bitwise_equal": exact.equal,
        "max_abs_diff": exact.max_abs,
        "num_leaves": len(jax.tree.leaves(a)),
        "nan_pairs": nan_pairs,
    }


# -- the public entry points ------------------------------------------------------------------
def _check_int(name: str, v, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def time_phases(
    fn: Callable,
    *args,
    levels: int = 2,
    repeats: int = 3,
    max_loop_iterations: int = 4,
    glue_max_eqns: int = 64,
    time_fused: bool = True,
    check_outputs: bool = True,
    precompile: bool = True,
    also_compile: Sequence = (),
) -> Timeline:
    """Time ``fn(*args)`` per component segment; returns a :class:`Timeline` (no activity).

    Args:
      fn: the program (e.g. one training iteration ``state -> (state, metrics)``), jitted or not.
      args: its arguments (pytrees of arrays); they are not donated and may be reused.
      levels: 1 = top-level segments only; 2 = also the component segments inside loops.
      repeats: timed calls of the segmented (and of the fused) program, after a warm-up call;
        also the number of level >= 2 passes (each loop then times ``max_loop_iterations``
        iterations per pass).
      max_loop_iterations: loop iterations timed per loop at level >= 2 (then extrapolated).
      glue_max_eqns: glue (outside components, no loops) up to this many equations is merged.
      time_fused: also time ``jax.jit(fn)`` (level-0 phases ``"(iteration)"``).
      check_outputs: compare the segmented outputs with ``jax.jit(fn)``'s (metadata).
      precompile: compile all pieces up front in parallel threads (much faster on many cores).
      also_compile: ``(jitted fn, args)`` pairs the caller will run later, compiled in the same
        parallel pool before anything is timed (with ``precompile``; failures are recorded in
        ``metadata["precompile"]["also_errors"]``, not raised).
    """
    _check_int("time_phases: levels", levels, 1)
    _check_int("time_phases: repeats", repeats, 1)
    _check_int("time_phases: max_loop_iterations", max_loop_iterations, 1)
    if not callable(fn):
        raise ValueError(f"time_phases: fn must be callable, got {type(fn).__name__}")
    t_start = time.perf_counter()
    prog = SegmentedProgram(
        fn, *args, levels=levels, max_loop_iterations=max_loop_iterations, glue_max_eqns=glue_max_eqns
    )
    rec = _Recorder()
    meta: dict = {
        "repeats": repeats,
        "levels": levels,
        "max_loop_iterations": max_loop_iterations,
        "segments": prog.labels,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "jax_version": jax.__version__,
    }
    fused = jax.jit(fn)
    if precompile:
        meta["precompile"] = prog.precompile(
            extra=[(fused, args)] if (check_outputs or time_fused) else [], also=also_compile
        )
    seg_out = prog.run(*args)  # warm-up (compiles every segment unless precompiled)
    first_call_s = None
    if check_outputs or time_fused:
        t0 = time.perf_counter()
        ref = jax.block_until_ready(fused(*args))
        first_call_s = time.perf_counter() - t0
        if check_outputs:
            cmp = compare_outputs(seg_out, ref)
            meta.update(
                outputs_match=cmp["match"],
                outputs_bitwise_equal=cmp["bitwise_equal"],
                outputs_max_abs_diff=cmp["max_abs_diff"],
            )
        del ref
    del seg_out
    meta["compile_s"] = time.perf_counter() - t_start
    w = 1.0 / repeats
    if time_fused:
        if first_call_s < WARM_CALL_NEGLIGIBLE_S:  # one more untimed call: the dispatch fast path
            jax.block_until_ready(fused(*args))
        for r in range(repeats):
            t0 = rec.clock()
            jax.block_until_ready(fused(*args))
            rec.phases.append(Phase(ITERATION, t0, rec.clock(), 0, r, w))
    for r in range(repeats):
        prog.run(*args, record=rec, iteration=r, weight=w)
    if levels >= 2:
        passes = []
        for _ in range(repeats):  # each pass stands for 1/repeats of an iteration, like level 1
            t0 = rec.clock()
            prog.run(*args, record=rec, detail=True, weight=w)
            passes.append([t0, rec.clock()])
        meta["detail_passes_ns"] = passes
        loops = list(rec.loops.values())
        meta["loops"] = loops
        if loops:
            meta["extrapolation"] = (
                "level>=2 phases were timed for measured_iterations of trip_count loop iterations; "
                "each carries weight = trip_count/measured_iterations (per training iteration)"
            )
    it = [p.duration_ns for p in rec.phases if p.level == 0]
    seg = {}
    for p in rec.phases:
        if p.level == 1:
            seg[p.iteration] = seg.get(p.iteration, 0) + p.duration_ns
    if it:
        meta["fused_iteration_s"] = float(np.median(it)) * 1e-9
    if seg:
        meta["segmented_iteration_s"] = float(np.median(list(seg.values()))) * 1e-9
    meta["wall_s"] = time.perf_counter() - t_start
    return Timeline(tuple(rec.phases), None, meta)


def profile(
    fn: Callable,
    *args,
    sample_period_ms: float = 10.0,
    levels: int = 2,
    repeats: int = 3,
    window_ms: float = 100.0,
    device_index: int = 0,
    **time_kwargs,
) -> Timeline:
    """:func:`time_phases` under the NVML :class:`~rose_jax.profile.sampler.Sampler` (when a GPU is
    present); the activity series is attached to the returned Timeline. Without a GPU the
    Timeline has ``activity=None`` and ``metadata['activity']`` says why."""
    from rose_jax.profile import sampler as S

    ok, reason = S.available(device_index)
    if not ok:
        tl = time_phases(fn, *args, levels=levels, repeats=repeats, **time_kwargs)
        return tl.replace(metadata={**tl.metadata, "activity": f"unavailable: {reason}"})
    with S.Sampler(period_ms=sample_period_ms, window_ms=window_ms, device_index=device_index) as s:
        time.sleep((window_ms + 2 * sample_period_ms) * 1e-3)  # first GPM value needs a full window
        tl = time_phases(fn, *args, levels=levels, repeats=repeats, **time_kwargs)
        time.sleep((window_ms / 2 + 2 * sample_period_ms) * 1e-3)  # cover the last phase's centre
    series = s.series()
    meta = {
        **tl.metadata,
        "activity": f"sampled: {reason}",
        "sample_period_ms": sample_period_ms,
        "window_ms": window_ms if series.source == "gpm" else None,
        "resolution_ms": series.resolution_ns * 1e-6,
        "num_samples": series.num_samples,
        "sampler_errors": s.errors,
        "sampler_truncated": s.truncated,
    }
    if jax.default_backend() != "gpu":
        meta["activity_warning"] = f"JAX ran on {jax.default_backend()}, not the sampled GPU"
    return tl.replace(activity=series, metadata=meta)


class IterationActivity(NamedTuple):
    """Whole-iteration SM activity and the sampler's overhead.

    mean_sm_util / mean_sm_occupancy: time-weighted mean % over the sampled iterations (None
    without GPU); iteration_time_s / iteration_time_off_s: median seconds per iteration with the
    sampler running / stopped; overhead: on/off - 1 (fraction); reason: why activity is missing.
    """

    mean_sm_util: float | None
    mean_sm_occupancy: float | None
    source: str | None
    iteration_time_s: float | None
    iteration_time_off_s: float
    overhead: float | None
    iters: int
    rounds: int
    times_on_s: tuple
    times_off_s: tuple
    series: ActivitySeries | None
    reason: str


def _chainable(args: tuple, out) -> bool:
    if len(args) != 1 or not isinstance(out, tuple) or not out:
        return False
    spec = lambda t: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), t)  # noqa: E731
    try:
        return jax.tree.structure(out[0]) == jax.tree.structure(args[0]) and spec(out[0]) == spec(args[0])
    except (TypeError, ValueError):
        return False


def iteration_activity(
    fn: Callable,
    *args,
    iters: int = 20,
    rounds: int = 2,
    sample_period_ms: float = 10.0,
    window_ms: float = 100.0,
    device_index: int = 0,
    chain: bool = True,
) -> IterationActivity:
    """Run ``jax.jit(fn)`` for ``iters`` iterations per block, alternating blocks with the sampler
    off and on (``rounds`` of each); report mean SM activity and median iteration times.

    With ``chain`` and ``fn: state -> (state, ...)`` the state is fed back (a real training loop);
    each iteration is fenced with ``block_until_ready``.
    """
    from rose_jax.profile import sampler as S
    from rose_jax.profile.windows import mean_activity

    _check_int("iteration_activity: iters", iters, 1)
    _check_int("iteration_activity: rounds", rounds, 1)
    jitted = jax.jit(fn)
    out = jax.block_until_ready(jitted(*args))
    chain = chain and _chainable(args, out)
    state = [tuple(args)]
    clock = time.perf_counter_ns

    def block(n: int, spans: list) -> list:
        times = []
        a = state[0]
        for _ in range(n):
            t0 = clock()
            o = jax.block_until_ready(jitted(*a))
            t1 = clock()
            times.append((t1 - t0) * 1e-9)
            spans.append((t0, t1))
            if chain:
                a = (o[0],)
        state[0] = a
        return times

    block(2, [])  # warm-up beyond compile
    ok, reason = S.available(device_index)
    on, off, spans, parts = [], [], [], []
    errors = 0
    for r in range(rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for mode in order:
            if mode == "off":
                off += block(iters, [])
            elif ok:
                with S.Sampler(
                    period_ms=sample_period_ms, window_ms=window_ms, device_index=device_index
                ) as s:
                    time.sleep((window_ms + 2 * sample_period_ms) * 1e-3)
                    on += block(iters, spans)
                    time.sleep((window_ms / 2 + 2 * sample_period_ms) * 1e-3)
                parts.append(s.series())
                errors += s.errors
    series = None
    util = occ = None
    if parts:
        series = _concat_series(parts)
        util = mean_activity(series, spans, "sm_util")
        if series.sm_occupancy is not None:
            occ = mean_activity(series, spans, "sm_occupancy")
    t_off = float(np.median(off))
    t_on = float(np.median(on)) if on else None
    return IterationActivity(
        util,
        occ,
        None if series is None else series.source,
        t_on,
        t_off,
        None if t_on is None else t_on / t_off - 1.0,
        iters,
        rounds,
        tuple(on),
        tuple(off),
        series,
        "" if ok else reason,
    )


def _concat_series(parts: list) -> ActivitySeries:
    from rose_jax.profile.timeline import make_series, step_bounds

    bounds = [step_bounds(p) for p in parts]
    occ = (
        None
        if any(p.sm_occupancy is None for p in parts)
        else np.concatenate([p.sm_occupancy for p in parts])
    )
    return make_series(
        np.concatenate([p.t_ns for p in parts]),
        np.concatenate([p.sm_util for p in parts]),
        occ,
        parts[0].source,
        np.concatenate([b[0] for b in bounds]),
        np.concatenate([b[1] for b in bounds]),
        max(p.resolution_ns for p in parts),
    )
