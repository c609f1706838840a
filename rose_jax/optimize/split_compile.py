"""Per-component compilation: :func:`split_compile`, the iteration as separately compiled stages.

``split_compile`` (``level="host"``) cuts the iteration's jaxpr at top-level component boundaries
(:func:`build_chain`, on :func:`rose_jax.jaxpr.cut.flatten_calls` and
:func:`rose_jax.jaxpr.dataflow.liveness`) into programs chained on the device (no host sync
between them, :class:`ChainedStep`), each compiled with its own XLA options: named sets of
:data:`rose_jax.optimize.xla_options.SETS`, chosen per stage by measurement (on its first call)
from :data:`MEASURED_SETS`. ``boundaries=()`` is one stage: the whole iteration under its
measured options (on the H200 the largest gain of any candidate: CONCURRENT command buffers).
On a GPU each stage's compile under each set first runs in a child process
(:func:`rose_jax.optimize.isolate.check`), so an XLA abort refuses that set instead of ending
the process. :func:`candidates` generates the family for the search.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax

from rose_jax.jaxpr import compat as C
from rose_jax.jaxpr import cut
from rose_jax.jaxpr import dataflow as D
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import FUSION_TOLERANCE, HostStep, Transform
from rose_jax.optimize.predict import Candidate, CandidateContext
from rose_jax.optimize.xla_options import SETS
from rose_jax.program import Program

SPLIT_TOLERANCE = dataclasses.replace(
    FUSION_TOLERANCE,
    reason="the same operations in the same order, compiled as separate programs: XLA cannot fuse "
    "across a stage boundary (FMA contraction may differ in the last bit on a GPU); the XLA options "
    "change scheduling and kernel launch, not arithmetic",
)
# The sets of :data:`rose_jax.optimize.xla_options.SETS` that ``options="measure"`` times each stage
# under by default (GPU only; on a CPU every stage is compiled with XLA's defaults).
MEASURED_SETS = ("default", "concurrent", "concurrent_no_loops", "no_command_buffers", "concurrent_regions",
                 "lhs_scheduling")
# Share of the iteration that separately compiled stages with their own XLA options save: on the
# H200 (benchmarks/results/overlap/, 2026-12-04) PPO ant's iteration ran 1.16-1.20x faster split
# (14-17% saved; the learn 25.9 -> 13.5 ms under CONCURRENT command buffers) and SAC's whole
# iteration 1.45-1.6x faster under its measured option set (31-37%); the lower figure is the model.
# On a CPU every stage is compiled with XLA's defaults (nothing to gain but the split itself).
SPLIT_COMPILE_SHARE = {"gpu": 0.15, "cpu": 0.0}


class Stage(NamedTuple):
    """One separately compiled piece: flat ``inputs`` (positions in the chain's value list) ->
    ``outputs`` (appended to it); ``fn`` evaluates its closed jaxpr."""

    name: str
    fn: Callable
    inputs: tuple[int, ...]
    n_outputs: int
    in_specs: tuple[jax.ShapeDtypeStruct, ...] = ()


@dataclasses.dataclass
class Chain:
    """A function cut into :class:`Stage` s (:func:`build_chain`): flat inputs, then each stage's
    outputs appended to one value list; ``result`` says where each flat output comes from."""

    stages: list[Stage]
    n_inputs: int
    result: list  # per flat output: ("value", index) or ("literal", value)
    out_tree: Any
    donatable: list[tuple[int, ...]]  # per stage: its input positions (into stage args) no later stage reads


def _stage_starts(eqns: Sequence[Any], boundaries: Sequence[str] | None) -> tuple[list[int], list[str]]:
    """First equation index of each stage and stage names (top-level components)."""
    tops = [cut.effective(e)[0][:1] for e in eqns]
    order: list[str] = []
    for t in tops:
        if t and t[0] not in order:
            order.append(t[0])
    if boundaries is None:  # before the second top-level component
        if len(order) < 2:
            raise ValueError(f"split_compile: the function has {len(order)} top-level component(s); need 2")
        boundaries = (order[1],)
    starts = []
    for b in boundaries:
        idx = [i for i, t in enumerate(tops) if t == (b,)]
        if not idx:
            raise ValueError(
                f"split_compile: {b!r} is not a top-level component of the function "
                f"(top level: {', '.join(order) or 'none'})"
            )
        starts.append(idx[0])
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        raise ValueError(f"split_compile: boundaries {tuple(boundaries)} are not in program order")
    if starts and starts[0] == 0:
        raise ValueError(f"split_compile: {boundaries[0]!r} starts the function: no stage before it")
    starts = [0] + starts
    names = []
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(eqns)
        comps = [t[0] for t in tops[s:end] if t]
        names.append("+".join(dict.fromkeys(comps)) or f"stage{k}")
    return starts, names


def build_chain(fn: Callable, args: Sequence[Any], boundaries: Sequence[str] | None) -> Chain:
    """Cut ``fn``'s jaxpr on ``args`` into stages at ``boundaries`` (top-level component names;
    None: before the second top-level component)."""
    closed, out_shape = I.trace(fn, *args)
    jx, consts = C.open_and_consts(closed)
    const_of = dict(zip(jx.constvars, consts, strict=True))
    eqns, alias, inlined = cut.flatten_calls(jx.eqns, 1)
    const_of.update(inlined)
    outvars = [cut.resolve(v, alias) for v in jx.outvars]
    starts, names = _stage_starts(eqns, boundaries)
    pieces = [eqns[s : (starts[k + 1] if k + 1 < len(starts) else len(eqns))] for k, s in enumerate(starts)]
    live = D.liveness(pieces, outvars)
    position = {v: k for k, v in enumerate(jx.invars)}
    n = len(jx.invars)
    stages, reads_per_stage, stage_invars = [], [], []
    for name, piece, lv in zip(names, pieces, live, strict=True):
        reads, outs = lv if lv is not None else ([], [])
        ins = [v for v in reads if v not in const_of]
        cvars = [v for v in reads if v in const_of]
        missing = [v for v in ins if v not in position]
        if missing:
            raise ValueError(f"split_compile: stage {name!r} reads a value no earlier stage produces")
        closed_stage = C.make_closed(ins, outs, piece, cvars, [const_of[v] for v in cvars])
        specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (C.aval_of(v) for v in ins))
        stages.append(Stage(name, C.as_fun(closed_stage), tuple(position[v] for v in ins), len(outs), specs))
        reads_per_stage.append([position[v] for v in ins])
        stage_invars.append(ins)
        for v in outs:
            position[v] = n
            n += 1
    result = [("literal", v.val) if C.is_literal(v) else ("value", position[v]) for v in outvars]
    final = {p for kind, p in result if kind == "value"}
    donatable = []
    for k, reads in enumerate(reads_per_stage):
        later = {p for r in reads_per_stage[k + 1 :] for p in r} | final
        # only buffers an output of the same shape and dtype can reuse (XLA warns about others)
        free = collections.Counter(_sig(v) for v in (live[k][1] if live[k] is not None else []))
        mine = []
        for j, p in enumerate(reads):
            sig = _sig(stage_invars[k][j])
            if p not in later and free[sig] > 0:
                free[sig] -= 1
                mine.append(j)
        donatable.append(tuple(mine))
    return Chain(stages, len(jx.invars), result, jax.tree.structure(out_shape), donatable)


def _sig(v: Any) -> tuple:
    aval = C.aval_of(v)
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", "")))


def _platform() -> str:
    return jax.default_backend()


def _device_set(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    return frozenset(sharding.device_set) if sharding is not None else None


class ChainedStep(HostStep):
    """``state -> (state, metrics)`` as separately compiled stages chained on the device.

    Each call dispatches the stages one after the other; their values stay on the device and
    nothing waits for the host between them (JAX dispatch is asynchronous). Each stage is
    compiled with its own XLA options: named sets of :data:`~rose_jax.optimize.xla_options.SETS`,
    or ``"measure"`` (the fastest of ``option_sets``, default :data:`MEASURED_SETS`):
    on the first call each stage is timed alone under every set (on a GPU each candidate's
    compile and first run go through :func:`rose_jax.optimize.isolate.check` first, so an XLA
    abort refuses that set instead of ending the process) and the fastest is kept. On a CPU
    every stage uses XLA's defaults. ``donate``: the stages donate the input buffers no later
    stage reads (like ``jax.jit(..., donate_argnums=0)`` for the whole step).
    """

    def __init__(
        self,
        fn: Callable,
        boundaries: Sequence[str] | None = None,
        options: str | Sequence[str] = "measure",
        *,
        donate: bool = False,
        repeats: int = 5,
        extra_options: dict | None = None,
        isolate: bool | None = None,
        cache_dir: str | None = None,
        option_sets: Sequence[str] | None = None,
    ):
        self.fn = fn
        self.boundaries = None if boundaries is None else tuple(boundaries)
        self.options = options if isinstance(options, str) else tuple(options)
        if isinstance(self.options, str) and self.options != "measure":
            raise ValueError(f"ChainedStep: options must be 'measure' or a tuple of {sorted(SETS)}")
        if not isinstance(self.options, str):
            bad = [o for o in self.options if o not in SETS]
            if bad:
                raise ValueError(f"ChainedStep: unknown option set(s) {bad}; known: {', '.join(SETS)}")
        self.donate, self.repeats = donate, repeats
        self.extra_options = dict(extra_options or {})
        self.isolate, self.cache_dir = isolate, cache_dir
        self.option_sets = tuple(option_sets) if option_sets is not None else MEASURED_SETS
        unknown = [o for o in self.option_sets if o not in SETS]
        if unknown or not self.option_sets:
            raise ValueError(
                f"ChainedStep: option_sets must name some of {', '.join(SETS)}, got {option_sets!r}"
            )
        self.refusals: dict[str, str] = {}
        self._chain: Chain | None = None
        self._compiled: list[Callable] | None = None
        self._key = None
        self.chosen: tuple[str, ...] | None = None
        self.timings: dict[str, dict[str, float | str]] = {}
        # "stage:set" executables built from the isolated child's exported program (a load from the
        # persistent cache when the child's compile was long enough to be cached there)
        self.from_children: list[str] = []

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, *args):
        flat = jax.tree.leaves(args)
        key = (  # placement too: an executable loaded from a child is fixed to its device
            jax.tree.structure(args),
            tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", "")), _device_set(x)) for x in flat),
        )
        if self._compiled is None or key != self._key:
            self._prepare(args, flat)
            self._key = key
        values = list(flat)
        for stage, run in zip(self._chain.stages, self._compiled, strict=True):
            values.extend(run(*[values[p] for p in stage.inputs]))
        outs = [values[p] if kind == "value" else p for kind, p in self._chain.result]
        return jax.tree.unflatten(self._chain.out_tree, outs)

    def with_compiler_options(self, compiler_options: dict | None) -> "ChainedStep":
        step = ChainedStep(
            self.fn,
            self.boundaries,
            self.chosen if self.chosen is not None else self.options,
            donate=self.donate,
            repeats=self.repeats,
            extra_options={**self.extra_options, **dict(compiler_options or {})},
            isolate=self.isolate,
            cache_dir=self.cache_dir,
            option_sets=self.option_sets,
        )
        return step

    def measured_params(self) -> dict:
        """``{"options": (set per stage, ...)}`` once ``"measure"`` has chosen them (first call)."""
        if isinstance(self.options, str) and self.chosen is not None:
            return {"options": tuple(self.chosen)}
        return {}

    def stats(self) -> dict:
        stages = [s.name for s in self._chain.stages] if self._chain else []
        return {
            "mode": "split_compile",
            "stages": stages,
            "options": list(self.chosen) if self.chosen else self.options,
            "timings_ms": self.timings,
            "refused": dict(self.refusals),
        }

    # -- preparation --------------------------------------------------------------------------
    def _jit(self, k: int, option: str, donate: bool) -> Callable:
        stage = self._chain.stages[k]
        opts = {**(SETS[option] if _platform() == "gpu" else {}), **self.extra_options}
        donate_argnums = self._chain.donatable[k] if donate else ()
        return jax.jit(stage.fn, compiler_options=opts or None, donate_argnums=donate_argnums)

    def _prepare(self, args, flat) -> None:
        self._chain = build_chain(self.fn, args, self.boundaries)
        n = len(self._chain.stages)
        self.from_children = []
        measured = None
        if isinstance(self.options, str):
            self.chosen, measured = self._measure(flat)
        else:
            if len(self.options) != n:
                raise ValueError(f"ChainedStep: {len(self.options)} option set(s) for {n} stages")
            self.chosen = tuple(self.options)
        if measured is not None and not self.donate:  # the measured executables, not compiled again
            self._compiled = measured
        else:
            self._compiled = [self._jit(k, self.chosen[k], self.donate) for k in range(n)]

    def isolation_checks(self, stage_sets: Sequence[tuple[int, str]] | None = None, workers: int = 4) -> dict:
        """``(stage index, option set) -> isolate.Outcome`` of each stage's compile and first call in
        a child process (all at once, ``workers`` children at a time); built chain needed."""
        import concurrent.futures  # noqa: PLC0415
        from rose_jax.optimize import isolate as iso  # noqa: PLC0415 - child processes, loaded on use

        gpu = _platform() == "gpu"
        todo = stage_sets or [(k, n) for k in range(len(self._chain.stages)) for n in self.option_sets]

        def one(item):
            k, name = item
            stage = self._chain.stages[k]
            opts = {**(SETS[name] if gpu else {}), **self.extra_options}
            return iso.check(
                stage.fn,
                stage.in_specs,
                compiler_options=opts,
                label=f"{stage.name}:{name}",
                cache_dir=self.cache_dir,
                share_cache=True,  # _measure loads the child's executable (isolate.compile_exported)
            )

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return dict(zip(todo, pool.map(one, todo), strict=True))

    def _measure(self, flat) -> tuple[tuple[str, ...], list[Callable]]:
        """Each stage timed under each option set: ``(chosen set per stage, its executables)``."""
        from rose_jax.optimize import isolate as iso  # noqa: PLC0415 - child processes, loaded on use

        gpu = _platform() == "gpu"
        sets = list(self.option_sets) if gpu else ["default"]
        use_child = gpu if self.isolate is None else self.isolate
        checks = (
            self.isolation_checks([(k, n) for k in range(len(self._chain.stages)) for n in sets])
            if use_child
            else {}
        )
        values = list(flat)
        chosen, runs = [], []
        for k, stage in enumerate(self._chain.stages):
            stage_args = [values[p] for p in stage.inputs]
            best, best_t, best_run, times = None, float("inf"), None, {}
            for name in sets:
                outcome = checks.get((k, name))
                if outcome is not None and not outcome.ok:
                    times[name] = f"refused: {outcome.reason}"
                    self.refusals[f"{stage.name}:{name}"] = outcome.reason
                    continue
                # the child's executable from the shared persistent cache when there is one (the
                # same program: compiling it here again cost as much as the child's compile)
                run = None
                if outcome is not None and iso.on_default_device(stage_args):
                    opts = {**(SETS[name] if gpu else {}), **self.extra_options}
                    try:
                        run = iso.compile_exported(outcome, stage.in_specs, opts)
                    except Exception:  # noqa: BLE001 - an optimisation only: compile it here instead
                        run = None
                    if run is not None:
                        self.from_children.append(f"{stage.name}:{name}")
                run = run or self._jit(k, name, donate=False)
                jax.block_until_ready(run(*stage_args))
                ts = []
                for _ in range(max(1, self.repeats)):
                    t0 = time.perf_counter()
                    jax.block_until_ready(run(*stage_args))
                    ts.append(time.perf_counter() - t0)
                t = statistics.median(ts)
                times[name] = round(t * 1e3, 4)
                if t < best_t:
                    best, best_t, best_run = name, t, run
            if best is None:
                raise ValueError(
                    f"split_compile: every option set was refused for stage {stage.name!r}: {times}"
                )
            chosen.append(best)
            runs.append(best_run)
            self.timings[stage.name] = times
            values.extend(best_run(*stage_args))
        return tuple(chosen), runs


def split_compile(
    boundaries: Sequence[str] | None = None,
    options: str | Sequence[str] = "measure",
    donate: bool = False,
    option_sets: Sequence[str] | None = None,
) -> Transform:
    """Transform: the iteration as separately compiled stages chained on the device.

    ``boundaries``: top-level component names where a new stage starts (None: before the
    second top-level component, e.g. PPO's rollout | normalizer + advantage + update, SAC's
    collect | train_steps). ``options``: ``"measure"`` (each stage's fastest of
    :data:`MEASURED_SETS` (or ``option_sets``), measured on the first call) or one name of
    :data:`rose_jax.optimize.xla_options.SETS` per stage.
    ``boundaries=()``: one stage (the whole iteration with its measured options).
    ``option_sets``: the sets ``"measure"`` tries (default: :data:`MEASURED_SETS`).
    Legal when the boundaries are top-level components (not inside a loop or a jit).
    """
    bounds = None if boundaries is None else tuple(boundaries)
    opts = options if isinstance(options, str) else tuple(options)
    sets = None if option_sets is None else tuple(option_sets)

    def legal(tree) -> tuple[bool, str]:
        jx, _ = C.open_and_consts(tree.jaxpr)
        eqns, _, _ = cut.flatten_calls(jx.eqns, 1)
        try:
            _, names = _stage_starts(eqns, bounds)
        except ValueError as e:
            return False, str(e)
        how = "measured per stage" if opts == "measure" else ", ".join(opts)
        if len(names) == 1:
            return True, f"the whole iteration ({names[0]}) as one program with its own XLA options ({how})"
        return (
            True,
            f"stages {' | '.join(names)} compiled separately (XLA options: {how}), chained on the device",
        )

    def apply(target):
        if isinstance(target, Program):
            if target.host:
                raise ValueError("split_compile: the program's collect already runs in worker processes")
            target = target.iteration()
        if isinstance(target, HostStep):
            raise ValueError("split_compile: the step is already host-level")
        return ChainedStep(target, bounds, opts, donate=donate, option_sets=sets)

    where = "the second top-level component" if bounds is None else ", ".join(bounds) or "nothing (one stage)"
    return Transform(
        "split_compile",
        (("boundaries", bounds), ("options", opts), ("donate", donate), ("option_sets", sets)),
        SPLIT_TOLERANCE,
        "host",
        legal,
        apply,
        summary=f"the iteration split before {where} into separately compiled programs chained on the "
        f"device, XLA options {'measured per stage' if opts == 'measure' else opts}",
        wraps_iteration=True,
        chooses_options=True,
    )


def transforms(tree: Any) -> list[Transform]:
    """``split_compile(())`` (the whole iteration as one stage with its measured XLA options: on
    the H200 CONCURRENT command buffers alone gave SAC ant (high-update) 1.48x and PPO ant 4096
    1.31x, bitwise equal) and, with >= 2 top-level components, ``split_compile()`` (options
    measured per stage), for the program traced as ``tree``."""
    out = [split_compile(())]
    tops = [n for n in tree.root.children if n.kind == "component"]
    if len({n.name for n in tops}) >= 2:
        out.append(split_compile())
    return out


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """:func:`transforms` with predicted gains. Model: separately compiled stages with measured
    XLA options save :data:`SPLIT_COMPILE_SHARE` of the iteration under XLA's defaults (an H200
    figure; 0 on a CPU). Where the baseline already runs under a measured set
    (``ctx.base_options``), ``split_compile(())`` (the whole iteration under one measured set) is
    that baseline and is not generated, and per-stage sets are predicted to save what the model
    leaves beyond the set's measured saving (``ctx.options_saved_s``)."""
    share = SPLIT_COMPILE_SHARE.get(ctx.platform, SPLIT_COMPILE_SHARE["gpu"])
    out = []
    for t in transforms(ctx.tree):
        whole = dict(t.params)["boundaries"] == ()
        stages = "one stage" if whole else "stages at top-level components"
        why = f"{stages} with measured XLA options save {share:.0%} of the iteration (H200 model)"
        gain = ctx.baseline_s * share
        if ctx.base_options is not None:
            if whole:
                continue  # the baseline is this: the whole iteration under its measured set
            default_s = ctx.baseline_s + ctx.options_saved_s
            gain = max(0.0, default_s * share - ctx.options_saved_s)
            why += (
                f" under XLA's defaults, less the {ctx.options_saved_s * 1e3:.1f} ms the baseline's "
                f"set {ctx.base_options} already saves"
            )
        out.append(Candidate(t, "iteration", gain, why))
    return out
