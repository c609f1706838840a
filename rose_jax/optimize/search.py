"""The window-guided search: candidates -> legality -> local timing -> end-to-end validation.

    fast_step, report = optimize(program_or_iteration, state, windows=profile_windows)
    print(format_report(report))

For every low-activity window (from :mod:`rose_jax.profile`; without windows, every loop of the
LoopTree, most expensive first) the search generates candidate transformations, checks their
legality on the LoopTree, predicts their gain, times the affected piece alone (``collect`` or
``learn`` of a :class:`~rose_jax.optimize.program.Program`), then runs the whole iteration
``n_iters`` times against the untransformed program. A candidate is kept only if it is faster
by more than the run-to-run spread of the baseline (measured twice) AND it is equal to the
baseline within the transform's tolerance. Kept candidates are combined greedily (each addition
re-validated). Every candidate, kept or not, is logged in the :class:`PlanReport` with the reason.

Equality (``equality=``, recorded in the report and in every candidate record):

* ``"stepwise"`` (default): the baseline's own states ``s_0 .. s_{N-1}`` (N = ``n_iters``) are
  collected once; for each ``s_k`` ONE iteration of the candidate and ONE of the baseline are
  run and their full output states compared (float leaves within the tolerance, integer, bool
  and key leaves exactly). It checks that the transformed iteration computes the same function
  at N real states without comparing chaotic trajectories (MJX's constraint solver turns
  last-bit differences of another XLA fusion into other episode terminations within two
  iterations). The baseline from ``s_k`` is also compared with its own trajectory's
  ``s_{k+1}``: ``baseline_reproducible`` / ``baseline_max_abs_diff`` say whether the baseline
  itself is bitwise run-to-run reproducible.
* ``"trajectory"``: the final states after ``n_iters`` iterations from the same start are
  compared (the baseline's reproducibility: its two timed runs' final states).

A host-level candidate whose env state stays in its worker processes is compared after its
``sync_state`` (the full state).

The plan is cached (see :mod:`rose_jax.optimize.cache`): a later call for the same program on
the same kind of machine applies the cached plan without measuring anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax

from rose_jax.optimize import cache as plan_cache
from rose_jax.optimize import interpret as I
from rose_jax.optimize import measure
from rose_jax.optimize import program as P
from rose_jax.optimize import transforms as T

# Per-iteration cost of a compiled loop (s) used to predict unrolling gains: on GPU a while loop
# copies its predicate to the host every iteration (~10 us with the launch gaps around it);
# on CPU it is a branch and a few buffer assignments. A model, not a measurement.
LOOP_OVERHEAD_S = {"gpu": 10e-6, "cpu": 1e-6}
# Assumed idle SM share of a phase when no profiler window says otherwise.
ASSUMED_IDLE_SHARE = 0.5
EQUALITY_MODES = ("stepwise", "trajectory")
# XLA options under which equality is checked on a GPU: XLA's GPU reductions and scatters use
# atomics, so even the untransformed program differs from run to run (measured on the H200:
# one SAC iteration from the same state, max |diff| 1.75); deterministic ops make it repeatable.
DETERMINISTIC = {"xla_gpu_deterministic_ops": True}
# top-level components that produce only metrics by convention (candidates for offload_component)
OFFLOAD_COMPONENTS = ("evaluate",)


# ------------------------------------------------------------------------------- the report


@dataclasses.dataclass
class CandidateRecord:
    """One candidate's log line (all times in seconds per iteration)."""

    label: str
    transform: dict
    window: str
    predicted_gain_s: float | None = None
    prediction: str = ""
    legal: bool = False
    legal_reason: str = ""
    stage: str = "legality"  # the last stage reached: legality | local | e2e | combine
    local_baseline_s: float | None = None
    local_time_s: float | None = None
    e2e_time_s: float | None = None
    speedup: float | None = None
    equal: bool | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    kept: bool = False
    reason: str = ""
    equality: str = ""  # how ``equal`` was decided: "stepwise" | "trajectory" ("" not reached)
    e2e_baseline_s: float | None = None  # the baseline timed in turns with this candidate


@dataclasses.dataclass
class PlanReport:
    """The search's log and result; ``to_json()`` is plain JSON."""

    program: str
    fingerprint: str
    cache_key: str
    device: str
    jax_version: str
    n_iters: int
    repeats: int
    equality: str = "stepwise"  # "stepwise" | "trajectory" (see the module docstring)
    baseline_s: float | None = None
    baseline_spread_s: float | None = None
    # the baseline against itself, in the equality mode's way (bitwise: rtol = atol = 0)
    baseline_reproducible: bool | None = None
    baseline_max_abs_diff: float | None = None
    baseline_max_rel_diff: float | None = None
    baseline_repro_reason: str = ""
    candidates: list[CandidateRecord] = dataclasses.field(default_factory=list)
    plan: list[dict] = dataclasses.field(default_factory=list)
    optimized_s: float | None = None
    speedup: float | None = None
    equal: bool | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    cache_hit: bool = False
    cache_path: str | None = None
    search_time_s: float = 0.0
    measurements: int = 0  # timed runs done by this call (0 on a cache hit)
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: dict) -> "PlanReport":
        data = dict(data)
        data["candidates"] = [CandidateRecord(**c) for c in data.get("candidates", [])]
        return cls(**data)


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _fmt_turns(t: measure.Timing) -> str:
    """Per-iteration ms of each timed turn, e.g. ``45.1, 291.8``."""
    return ", ".join(f"{x * 1e3:.1f}" for x in t.per_iter_s)


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x * 1e3:.3f}ms" if abs(x) < 1 else f"{x:.3f}s"


def format_report(report: PlanReport) -> str:
    """A human-readable table of the report."""
    head = (
        f"plan for {report.program} on {report.device} (jax {report.jax_version}); "
        f"{'CACHE HIT' if report.cache_hit else f'search {report.search_time_s:.1f}s'}\n"
        f"baseline {_fmt_s(report.baseline_s)}/iter (spread {_fmt_s(report.baseline_spread_s)}), "
        f"optimized {_fmt_s(report.optimized_s)}/iter, speedup "
        f"{'-' if report.speedup is None else f'{report.speedup:.3f}x'}, equal={report.equal} "
        f"({report.equality}; baseline reproducible={report.baseline_reproducible}, max|d| "
        f"{'-' if report.baseline_max_abs_diff is None else f'{report.baseline_max_abs_diff:.2g}'})\n"
        f"plan: {', '.join(t['label'] for t in report.plan) or '(none: baseline kept)'}"
    )
    rows = [("candidate", "window", "pred", "local", "e2e", "speedup", "max|d|", "kept", "reason")]
    for c in report.candidates:
        rows.append(
            (
                c.label,
                c.window,
                _fmt_s(c.predicted_gain_s),
                f"{_fmt_s(c.local_baseline_s)}->{_fmt_s(c.local_time_s)}"
                if c.local_time_s is not None
                else "-",
                _fmt_s(c.e2e_time_s),
                "-" if c.speedup is None else f"{c.speedup:.3f}x",
                "-" if c.max_abs_diff is None else f"{c.max_abs_diff:.2g}",
                "yes" if c.kept else "no",
                c.reason if c.kept or not c.legal else c.reason,
            )
        )
    widths = [min(max(len(str(r[i])) for r in rows), 48) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        cells = [str(r[i])[:48].ljust(widths[i]) for i in range(len(widths))]
        lines.append("  ".join(cells) + "  " + str(r[-1]))
    return head + "\n" + "\n".join(lines) + ("\nnotes: " + "; ".join(report.notes) if report.notes else "")


# ------------------------------------------------------------------------------- targets


def _is_program(x) -> bool:
    return isinstance(x, P.Program)


def apply_plan(target: Any, transforms: Sequence[T.Transform]) -> Any:
    """Apply ``transforms`` to a function or Program: program/host-level ones first, then fn-level."""
    ordered = [t for t in transforms if t.level != "fn"] + [t for t in transforms if t.level == "fn"]
    for t in ordered:
        if t.level != "fn" and not _is_program(target) and t.name == "group_rollout":
            raise ValueError(f"{t.label} needs a Program, got a plain function")
        target = t.apply(target)
    return target


def compile_step(target: Any, host: bool = False, compiler_options: dict | None = None) -> Callable:
    """A callable ``state -> (state, metrics)``: jitted unless it runs host-level code.

    ``compiler_options``: XLA options for every compiled part (e.g. :data:`DETERMINISTIC`); a
    host-level step takes them through its ``with_compiler_options`` (one that has none cannot).
    """
    if compiler_options:
        if _is_program(target) and not target.host:
            return jax.jit(target.iteration(), compiler_options=compiler_options)
        if not _is_program(target) and not host:
            return jax.jit(target, compiler_options=compiler_options)
        rebuild = getattr(target, "with_compiler_options", None)
        if rebuild is None:
            raise ValueError(f"{type(target).__name__} cannot be compiled with compiler options")
        return rebuild(compiler_options)
    if _is_program(target):
        if target.host:
            learn = jax.jit(target.learn)
            collect = target.collect

            def host_iteration(state):
                state, data = collect(state)
                return learn(state, data)

            host_iteration.close = getattr(collect, "close", lambda: None)  # stops the worker processes
            # the env state may live in the workers: sync_state gives the full state (for comparing)
            host_iteration.sync_state = getattr(collect, "sync_state", lambda s: s)
            host_iteration.stats = getattr(collect, "stats", dict)
            return host_iteration
        return jax.jit(target.iteration())
    return target if host else jax.jit(target)


def _base_fn(target: Any) -> Callable:
    return target.iteration() if _is_program(target) else target


def _where_of(node) -> str:
    return "/".join(tuple(node.component_path) + (node.name,))


def _outer_trips(tree, node) -> int:
    trips = 1
    for anc in tree.ancestors(node):
        if anc.is_loop and anc.trip_count:
            trips *= anc.trip_count
    return trips


def _time_share(tree, node) -> float:
    """A node's share of the iteration's work (flops + bytes/4, a crude roofline-free weight)."""

    def w(n):
        return float(n.cost.flops) + float(n.cost.bytes) / 4.0

    total = w(tree.root)
    return 0.0 if total <= 0 else min(1.0, w(node) * _outer_trips(tree, node) / total)


# ---------------------------------------------------------------------------- candidates


@dataclasses.dataclass
class _Candidate:
    transform: T.Transform
    window: str
    predicted: float | None
    model: str


def _windows_by_path(windows) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in windows or ():
        path = w.path if isinstance(w.path, str) else "/".join(w.path)
        out[path] = out.get(path, 0.0) + float(w.idle_sm_seconds_per_iteration)
    return out


def _idle_for(node, windows: dict[str, float]) -> float | None:
    """Idle SM-seconds per iteration of the windows that lie in ``node`` (None: no window)."""
    comps = set(node.component_path) | {node.name}
    found = [v for path, v in windows.items() if set(path.split("/")) & comps]
    return sum(found) if found else None


def generate_candidates(
    tree: Any,
    program: P.Program | None,
    baseline_s: float,
    windows=None,
    platform: str = "cpu",
    unroll_factors: Sequence[int] = (2, 4, 8),
    group_sizes: Sequence[int] = (2, 4),
    group_modes: Sequence[str] = ("interleaved", "processes"),
) -> list[_Candidate]:
    """Candidates for the windows (or, without windows, every scan by cost), with predicted gains.

    Prediction models (seconds per iteration, stated in each record): unrolling saves
    ``trips * (1 - 1/f) * LOOP_OVERHEAD_S``; hoisting saves the invariant share of the loop's
    time; env groups in processes reclaim ``(1 - 1/G)`` of the rollout window's idle SM-seconds
    (interleaving in one process: a tenth of that, one stream only changes scheduling).
    """
    by_path = _windows_by_path(windows)
    overhead = LOOP_OVERHEAD_S.get(platform, LOOP_OVERHEAD_S["gpu"])
    scans = [n for n in tree.walk() if n.kind == "scan" and (n.trip_count or 0) >= 2]
    if by_path:
        scans = [n for n in scans if _idle_for(n, by_path) is not None] or scans
    scans.sort(key=lambda n: -_time_share(tree, n))
    out: list[_Candidate] = []
    seen: set[str] = set()
    for node in scans:
        where = _where_of(node)
        if where in seen:
            continue
        seen.add(where)
        trips = node.trip_count * _outer_trips(tree, node)
        for f in unroll_factors:
            if f >= 2 and f <= node.trip_count:
                gain = trips * (1.0 - 1.0 / f) * overhead
                out.append(
                    _Candidate(
                        T.unroll_scans(f, where),
                        where,
                        gain,
                        f"{trips} loop iterations x (1-1/{f}) x {overhead * 1e6:.0f}us loop overhead",
                    )
                )
        eqns = node.eqns()
        if len(eqns) == 1 and eqns[0].primitive.name == "scan":
            scan = T.C.scan_params(eqns[0].params)
            n_inv = len(T.invariant_eqns(scan))
            if n_inv:
                share = n_inv / max(len(scan.body.eqns), 1)
                gain = baseline_s * _time_share(tree, node) * share * (1.0 - 1.0 / node.trip_count)
                out.append(
                    _Candidate(
                        T.hoist_invariants(where),
                        where,
                        gain,
                        f"{n_inv}/{len(scan.body.eqns)} body equations invariant x loop time",
                    )
                )
    # scans of equal length at the same jaxpr level (legality then checks independence): fuse
    by_level: dict[int, list] = {}
    for n in tree.walk():
        if n.kind == "scan" and n.level is not None and (n.trip_count or 0) >= 2:
            by_level.setdefault(id(n.level), []).append(n)
    for kids in by_level.values():
        for i, a in enumerate(kids):
            for b in kids[i + 1 :]:
                if a.trip_count == b.trip_count and _where_of(a) != _where_of(b):
                    gain = a.trip_count * _outer_trips(tree, a) * overhead
                    label = f"{_where_of(a)}+{_where_of(b)}"
                    fuse = T.overlap_independent(_where_of(a), _where_of(b))
                    out.append(_Candidate(fuse, label, gain, "one loop's overhead per iteration"))
    # components whose results reach only the metrics (e.g. an evaluation): run them in a worker
    # behind the next call; the whole component's time is the predicted gain (it leaves the path)
    from rose_jax.optimize import offload  # noqa: PLC0415

    for node in tree.root.children:
        if node.kind == "component" and node.name in OFFLOAD_COMPONENTS:
            share = _time_share(tree, node)
            out.append(
                _Candidate(
                    offload.offload_component(node.name),
                    node.name,
                    baseline_s * share,
                    f"{node.name}'s share of the work ({share:.0%}) leaves the critical path",
                )
            )
    if program is not None and program.groups == 1:
        rollout = [n for n in tree.walk() if n.kind == "component" and n.name in ("rollout", "collect")]
        if rollout:
            node = rollout[0]
            idle = _idle_for(node, by_path)
            rollout_s = baseline_s * _time_share(tree, node)
            assumed = idle is None
            idle = rollout_s * ASSUMED_IDLE_SHARE if idle is None else idle
            src = f"assumed {ASSUMED_IDLE_SHARE:.0%} idle SMs" if assumed else "profiled idle SM-seconds"
            for g in group_sizes:
                if program.num_envs % g:
                    continue
                for mode in group_modes:
                    factor = (1.0 - 1.0 / g) * (1.0 if mode == "processes" else 0.1)
                    out.append(
                        _Candidate(
                            P.group_rollout(g, mode),
                            node.name,
                            idle * factor,
                            f"{src} of {node.name} x {factor:.2f}",
                        )
                    )
    out.sort(key=lambda c: -(c.predicted or 0.0))
    return out


# ------------------------------------------------------------------------------- the search


def _legal(transform: T.Transform, tree, ptree) -> tuple[bool, str]:
    use = ptree if (transform.name == "group_rollout" and ptree is not None) else tree
    if transform.name == "group_rollout" and ptree is None:
        return False, "group_rollout needs a Program target"
    return transform.legal(use)


def _affected_pieces(transform: T.Transform, program: P.Program, state) -> list[str]:
    """Which of collect / learn contain a scan the fn-level transform targets."""
    if transform.level != "fn":
        return ["collect"]
    where = dict(transform.params).get("where", dict(transform.params).get("a"))
    select = T._site_select(where)
    pieces = []
    out_state, data = jax.eval_shape(program.collect, state)
    for name, fn, args in (
        ("collect", program.collect, (state,)),
        ("learn", program.learn, (out_state, data)),
    ):
        closed = jax.make_jaxpr(fn)(*args)
        if any(select(s) for s in I.sites(closed)):
            pieces.append(name)
    return pieces


def _time_piece(program: P.Program, piece: str, state, repeats: int):
    """``(Timing, output)`` of ``collect`` or ``learn`` alone (learn's inputs made by collect)."""
    collect = program.collect if program.host else jax.jit(program.collect)
    if piece == "collect":
        return measure.time_call(collect, (state,), repeats), collect(state)
    out_state, data = collect(state)
    return measure.time_call(jax.jit(program.learn), (out_state, data), repeats), None


def optimize(
    target: Callable | P.Program,
    example_state: Any,
    *,
    windows: Sequence[Any] | None = None,
    candidates: Sequence[T.Transform] | None = None,
    n_iters: int = 3,
    repeats: int = 3,
    cache_dir: str | None = None,
    env_name: str | None = None,
    batch_size: int | None = None,
    max_candidates: int = 8,
    local: bool = True,
    combine: bool = True,
    log: Callable[[str], None] | None = None,
    equality: str = "stepwise",
    equality_options: dict | str | None = "auto",
    equality_iters: int | None = None,
    check_slower: bool = True,
) -> tuple[Callable, PlanReport]:
    """Search for a faster, equal version of an iteration; see the module docstring.

    Args:
      target: an iteration ``state -> (state, metrics)`` (pure, jittable) or a ``Program``.
      example_state: the state to measure from (every timed run starts from it; not donated).
      windows: ``rose_jax.profile`` Windows (``path``, ``idle_sm_seconds_per_iteration``); None:
        candidates for every loop of the LoopTree by cost.
      candidates: explicit Transforms to try instead of generated ones.
      n_iters: iterations per timed run (and before the equality check); repeats: timed runs.
      cache_dir: directory of the plan cache (None: no cache).
      env_name / batch_size: cache key parts (default: the Program's env name and num_envs).
      max_candidates: at most this many legal candidates are measured (highest predicted gain).
      local: time the affected piece of a Program first and drop candidates that are slower.
      combine: greedily combine kept candidates.
      log: progress lines (e.g. ``print``).
      equality: ``"stepwise"`` (one iteration from each of the baseline's first ``n_iters``
        states) or ``"trajectory"`` (the states after ``n_iters`` iterations); see the module
        docstring.
      equality_options: XLA compiler options under which equality is checked (baseline and
        candidates recompiled with them; timing always uses the plain programs). ``"auto"``:
        :data:`DETERMINISTIC` on a GPU, None elsewhere.
      equality_iters: states (stepwise) or iterations (trajectory) of the equality check
        (default ``n_iters``).
      check_slower: also check the equality of candidates that were not faster (the report
        then says how far each one is from the baseline). False: a candidate is timed first and
        only one faster than the spread is checked; the equality reference (the baseline's
        states, its recompile under ``equality_options`` and its reproducibility) is built when
        the first such candidate needs it, so a search where nothing wins costs no equality
        compiles. Kept plans are checked either way.

    Returns:
      ``(step, report)``: ``step`` is the optimized iteration, compiled (jitted unless it runs
      worker processes: then ``step.close()`` stops them); the untransformed one when nothing
      was kept.
    """
    if n_iters < 1 or repeats < 1:
        raise ValueError(f"optimize: n_iters and repeats must be >= 1, got {n_iters}, {repeats}")
    if equality not in EQUALITY_MODES:
        raise ValueError(f"optimize: equality must be one of {EQUALITY_MODES}, got {equality!r}")
    say = log or (lambda s: None)
    t_start = time.perf_counter()
    if equality_options == "auto":
        equality_options = DETERMINISTIC if jax.default_backend() == "gpu" else None
    eq_iters = n_iters if equality_iters is None else int(equality_iters)
    if eq_iters < 1:
        raise ValueError(f"optimize: equality_iters must be >= 1, got {equality_iters}")
    program = target if _is_program(target) else None
    base_fn = _base_fn(target)
    if program is not None and program.host:
        raise ValueError(
            "optimize: the target already runs host-level processes; pass the single-process Program"
        )
    fp = plan_cache.fingerprint(base_fn, example_state)
    env_name = env_name if env_name is not None else (program.env_name if program else "")
    batch_size = batch_size if batch_size is not None else (program.num_envs if program else None)
    device = plan_cache.device_name()
    key = plan_cache.cache_key(fp, env_name, batch_size, device)
    name = program.name if program else getattr(base_fn, "__name__", "fn")
    report = PlanReport(name, fp, key, device, jax.__version__, n_iters, repeats, equality)

    cached = plan_cache.lookup(cache_dir, key)
    if cached is not None:
        transforms = [P.transform_by_name(t["name"], t["params"]) for t in cached["plan"]]
        result = apply_plan(target, transforms)
        old = PlanReport.from_json(cached["report"])
        old.cache_hit, old.measurements, old.search_time_s = True, 0, time.perf_counter() - t_start
        old.cache_path = cache_dir
        say(f"[optimize] cache hit for {name}: plan {[t.label for t in transforms] or 'baseline'}")
        return compile_step(result, host=any(t.level == "host" for t in transforms)), old

    # --- baseline, measured twice (the spread decides what "faster" means)
    say(f"[optimize] {name}: baseline x2 ({repeats} repeats of {n_iters} iterations)")
    base_step = compile_step(target)
    ref_state, t1 = measure.time_repeats(base_step, example_state, n_iters, repeats)
    ref_again, t2 = measure.time_repeats(base_step, example_state, n_iters, repeats, warmup=False)
    report.measurements += 2 * repeats
    all_base = measure.Timing(t1.per_iter_s + t2.per_iter_s)
    baseline = all_base.median
    spread = max(abs(t1.median - t2.median), 2.0 * all_base.mad)
    report.baseline_s, report.baseline_spread_s = baseline, spread
    say(f"[optimize] baseline {baseline * 1e3:.3f} ms/iter, spread {spread * 1e3:.3f} ms")
    eq = {"options": equality_options}  # the options actually used (dropped if they fail)
    built: list[_Reference] = []

    def reference() -> _Reference:
        """The equality reference, built on first use (see ``check_slower``)."""
        if built:
            return built[0]
        options, r_state, r_again = eq["options"], ref_state, ref_again
        base_eq = base_step
        if options or eq_iters != n_iters:
            if options:
                try:
                    base_eq = compile_step(target, compiler_options=options)
                    jax.block_until_ready(base_eq(example_state))
                except Exception as e:  # noqa: BLE001 - e.g. an op without a deterministic GPU kernel
                    why = f"equality options {options} failed ({type(e).__name__}: {str(e)[:160]})"
                    report.notes.append(f"{why}: not used")
                    say(f"[optimize] {why}; checking without them")
                    base_eq, options = base_step, None
                    eq["options"] = None
            report.notes.append(f"equality checked over {eq_iters} iteration(s) under XLA options {options}")
            if equality == "trajectory":
                r_state = measure.run_iterations(base_eq, example_state, eq_iters)[0]
                r_again = measure.run_iterations(base_eq, example_state, eq_iters)[0]
        reuse = not options and eq_iters == n_iters
        ref = _reference(equality, base_eq, example_state, eq_iters, r_state, r_again, reuse)
        rc = ref.reproducibility
        report.baseline_reproducible, report.baseline_repro_reason = rc.equal, rc.reason
        report.baseline_max_abs_diff, report.baseline_max_rel_diff = rc.max_abs, rc.max_rel
        if not rc.equal:
            report.notes.append(f"baseline not bitwise reproducible ({equality}): {rc.reason}")
        say(f"[optimize] baseline reproducible ({equality}): {rc.equal}, max|d| {rc.max_abs:.2g}")
        built.append(ref)
        return ref

    if check_slower:
        reference()

    from rose_jax import trace as rtrace  # noqa: PLC0415

    tree = rtrace.trace(base_fn, example_state, arg_names=["state"])
    ptree = P.trace_program(program, example_state) if program is not None else None
    platform = jax.default_backend()
    if candidates is None:
        cands = generate_candidates(tree, program, baseline, windows, platform)
    else:
        cands = [_Candidate(t, "given", None, "given") for t in candidates]

    local_base: dict[str, tuple] = {}
    kept: list[tuple[T.Transform, float, measure.Comparison]] = []
    measured = 0
    for cand in cands:
        t = cand.transform
        rec = CandidateRecord(t.label, t.to_json(), cand.window, cand.predicted, cand.model)
        report.candidates.append(rec)
        rec.legal, rec.legal_reason = _legal(t, tree, ptree)
        if not rec.legal:
            rec.reason = f"illegal: {rec.legal_reason}"
            say(f"[optimize] {t.label}: {rec.reason}")
            continue
        if measured >= max_candidates:
            rec.reason = f"not measured: max_candidates={max_candidates} reached"
            continue
        measured += 1
        transformed = None
        try:
            transformed = apply_plan(target, [t])
            host = t.level == "host"
            if local and program is not None:
                rec.stage = "local"
                ok, why = _local_check(
                    rec, t, program, transformed, example_state, repeats, local_base, report
                )
                if not ok:
                    rec.reason = why
                    say(f"[optimize] {t.label}: {why}")
                    continue
            rec.stage = "e2e"
            step = compile_step(transformed, host=host)
            (_, tb), (state_c, tc) = measure.time_alternating(
                [base_step, step], example_state, n_iters, repeats
            )
            report.measurements += 2 * repeats
            gain = tb.median - tc.median  # against the baseline timed in turns with it
            noise = max(spread, 2.0 * max(tb.mad, tc.mad))
            cmp = None
            if check_slower or gain > noise:
                rec.equality = equality
                ref = reference()
                cmp = _check_equal(ref, step, state_c, t.tolerance, transformed, host, eq["options"])
        except Exception as e:  # noqa: BLE001 - a failing candidate is logged, not fatal
            rec.reason = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            say(f"[optimize] {t.label}: {rec.reason}")
            continue
        finally:
            _close(transformed)
        rec.e2e_time_s, rec.e2e_baseline_s = tc.median, tb.median
        rec.speedup = tb.median / tc.median if tc.median > 0 else None
        if cmp is not None:
            rec.equal, rec.max_abs_diff, rec.max_rel_diff = cmp.equal, cmp.max_abs, cmp.max_rel
        # with the turns themselves, so that a median moved by one outlier turn shows as such
        not_faster = f"not faster by more than the spread: gain {gain * 1e3:.3f} ms <= {noise * 1e3:.3f} ms"
        turns = f"; turns: baseline {_fmt_turns(tb)}, candidate {_fmt_turns(tc)} ms/iter"
        if cmp is None:
            rec.reason = f"{not_faster} (equality not checked: check_slower=False){turns}"
        elif not cmp.equal:
            rec.reason = f"unequal {ref.what}: {cmp.reason}"
        elif gain <= noise:
            rec.reason = f"{not_faster}{turns}"
        else:
            rec.kept = True
            rec.reason = f"faster by {gain * 1e3:.3f} ms/iter (> spread {noise * 1e3:.3f} ms) and equal"
            kept.append((t, tc.median * baseline / tb.median, cmp))  # in the units of `baseline`
        say(
            f"[optimize] {t.label}: {tc.median * 1e3:.3f} ms/iter vs baseline {tb.median * 1e3:.3f} "
            "(timed in turns), "
            f"speedup {rec.speedup:.3f}x, max|d| {'not checked' if cmp is None else f'{cmp.max_abs:.2g}'} -> "
            f"{'KEPT' if rec.kept else 'rejected'}"
        )

    # --- greedy combination (each trial timed in turns with the baseline, scaled to its units)
    plan: list[T.Transform] = []
    best_time, best_cmp = baseline, None
    if kept:
        kept.sort(key=lambda k: k[1])
        plan, best_time, best_cmp = [kept[0][0]], kept[0][1], kept[0][2]
        for t, _, _ in kept[1:] if combine else []:
            if any(_conflict(t, p) for p in plan):
                continue
            trial = plan + [t]
            label = " + ".join(x.label for x in trial)
            rec = CandidateRecord(
                label,
                {"combination": [x.to_json() for x in trial]},
                "combined",
                None,
                "greedy",
                True,
                "each part legal",
                "combine",
            )
            report.candidates.append(rec)
            combined = None
            try:
                combined = apply_plan(target, trial)
                step = compile_step(combined, host=any(x.level == "host" for x in trial))
                (_, tb), (state_c, tc) = measure.time_alternating(
                    [base_step, step], example_state, n_iters, repeats
                )
                report.measurements += 2 * repeats
                rec.equality = equality
                host = any(x.level == "host" for x in trial)
                ref = reference()
                cmp = _check_equal(ref, step, state_c, _loosest(trial), combined, host, eq["options"])
            except Exception as e:  # noqa: BLE001
                rec.reason = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                continue
            finally:
                _close(combined)
            scaled = tc.median * baseline / tb.median
            rec.e2e_time_s, rec.e2e_baseline_s, rec.speedup = tc.median, tb.median, tb.median / tc.median
            rec.equal, rec.max_abs_diff, rec.max_rel_diff = cmp.equal, cmp.max_abs, cmp.max_rel
            noise = max(spread, 2.0 * max(tb.mad, tc.mad))
            if cmp.equal and best_time - scaled > noise:
                rec.kept, rec.reason = True, "faster than the current plan by more than the spread, and equal"
                plan, best_time, best_cmp = trial, scaled, cmp
            else:
                rec.reason = (
                    f"unequal {ref.what}: {cmp.reason}"
                    if not cmp.equal
                    else "no gain over the current plan beyond the spread"
                )
            say(
                f"[optimize] combine {label}: speedup {rec.speedup:.3f}x -> "
                f"{'KEPT' if rec.kept else 'rejected'}"
            )

    if not built:
        report.notes.append(
            "equality not checked: no candidate was faster than the spread (check_slower=False)"
        )
    report.plan = [t.to_json() for t in plan]
    report.optimized_s = best_time
    report.speedup = baseline / best_time if best_time else None
    report.equal = True if not plan else best_cmp.equal
    if best_cmp is not None:
        report.max_abs_diff, report.max_rel_diff = best_cmp.max_abs, best_cmp.max_rel
    result = apply_plan(target, plan)
    report.search_time_s = time.perf_counter() - t_start
    if cache_dir:
        if all(_jsonable_params(t) for t in plan):
            report.cache_path = plan_cache.store(
                cache_dir, key, {"plan": report.plan, "report": report.to_json()}
            )
        else:
            report.notes.append("plan not cached: a transform has a callable parameter")
    say(
        f"[optimize] plan: {[t.label for t in plan] or 'baseline'}; speedup {report.speedup:.3f}x; "
        f"search {report.search_time_s:.1f}s"
    )
    return compile_step(result, host=any(t.level == "host" for t in plan)), report


def _local_check(rec, t, program, transformed, state, repeats, local_base, report) -> tuple[bool, str]:
    """Time the affected piece alone; for env groups also compare the collected data.

    ``local_base`` caches the untransformed pieces' ``(Timing, output)`` across candidates.
    """
    pieces = _affected_pieces(t, program, state)
    if not pieces:
        return False, "the transform matches nothing in collect or learn"
    base_total = new_total = 0.0
    for piece in pieces:
        if piece not in local_base:
            local_base[piece] = _time_piece(program, piece, state, repeats)
            report.measurements += repeats
        new_timing, out = _time_piece(transformed, piece, state, repeats)
        report.measurements += repeats
        base_total += local_base[piece][0].median
        new_total += new_timing.median
        if piece == "collect" and t.name == "group_rollout":
            norm = getattr(transformed.collect, "comparable", lambda o: o)  # env state in workers: sync
            cmp = measure.compare_trees(
                norm(out), norm(local_base[piece][1]), t.tolerance.rtol, t.tolerance.atol
            )
            if not cmp.equal:
                rec.local_baseline_s, rec.local_time_s = base_total, new_total
                return (
                    False,
                    f"grouped collect differs from the full batch (collect mixes envs?): {cmp.reason}",
                )
    rec.local_baseline_s, rec.local_time_s = base_total, new_total
    noise = 3.0 * max(local_base[p][0].mad for p in pieces) + 0.05 * base_total
    if new_total > base_total + noise:
        return (
            False,
            f"slower locally ({', '.join(pieces)}): {new_total * 1e3:.3f} ms vs {base_total * 1e3:.3f} ms",
        )
    return True, "local ok"


class _Reference(NamedTuple):
    """What candidates are compared with (see the module docstring).

    stepwise: ``starts`` = the baseline's states s_0 .. s_{N-1}, ``outputs`` = the baseline's
    state after one iteration from each; trajectory: ``outputs`` = [the final state]."""

    mode: str
    starts: list
    outputs: list
    reproducibility: measure.Comparison  # the baseline against itself, bitwise
    what: str  # for reasons: "after 3 iterations" / "stepwise (one iteration from ...)"
    start: Any = None  # trajectory mode: the state the reference started from
    n_iters: int = 0
    reuse_final: bool = True  # trajectory mode: the candidate's timed final state is comparable


def _reference(mode, base_step, state, n_iters, final, final_again, reuse_final=True) -> _Reference:
    if mode == "trajectory":
        repro = measure.compare_trees(final_again, final)
        what = f"after {n_iters} iterations"
        return _Reference(mode, [], [final], repro, what, state, n_iters, reuse_final)
    states = measure.trajectory(base_step, state, n_iters)
    starts = states[:-1]
    outputs = measure.step_outputs(base_step, starts)  # the baseline from s_k a second time
    repro = measure.compare_each(outputs, states[1:])
    what = f"stepwise (one iteration from each of the baseline's states s_0..s_{n_iters - 1})"
    return _Reference(mode, starts, outputs, repro, what)


def _check_equal(
    ref: _Reference, step, final, tol: T.Tolerance, transformed=None, host=False, options=None
) -> measure.Comparison:
    """The candidate ``step`` against the baseline (``final``: its state after the timed runs).

    With ``options`` the candidate is recompiled with them (``transformed``) for the check and,
    in trajectory mode, run again for as many iterations as the reference."""
    check = step
    if options:
        check = compile_step(transformed, host=host, compiler_options=options)
    try:
        if ref.mode == "trajectory":
            if not ref.reuse_final:
                final = measure.run_iterations(check, ref.start, ref.n_iters)[0]
            return measure.compare_trees(_synced(check, final), ref.outputs[0], tol.rtol, tol.atol)
        outs = measure.step_outputs(check, ref.starts, sync=lambda s: _synced(check, s))
        return measure.compare_each(outs, ref.outputs, tol.rtol, tol.atol)
    finally:
        if check is not step:
            _close(check)


def _synced(step, state):
    """``state`` in full (a host step's env state may be resident in its workers)."""
    sync = getattr(step, "sync_state", None)
    return sync(state) if callable(sync) else state


def _close(target) -> None:
    """Stop the worker processes of a host-level candidate (no-op for anything else)."""
    close = getattr(target, "close", None) if getattr(target, "host", False) is True else None
    close = close or getattr(getattr(target, "collect", None), "close", None)
    if callable(close):
        close()


def _conflict(a: T.Transform, b: T.Transform) -> bool:
    """Two transforms that rewrite the same thing (same kind on the same loop / both regroup)."""
    if a.name != b.name:
        return False
    pa, pb = dict(a.params), dict(b.params)
    if a.name == "group_rollout":
        return True
    return pa.get("where") == pb.get("where") and pa.get("a") == pb.get("a")


def _loosest(ts: Sequence[T.Transform]) -> T.Tolerance:
    return T.Tolerance(
        max(t.tolerance.rtol for t in ts), max(t.tolerance.atol for t in ts), "loosest of the combined"
    )


def _jsonable_params(t: T.Transform) -> bool:
    try:
        json.dumps(t.to_json()["params"])
    except TypeError:
        return False
    return not any(callable(v) for _, v in t.params) and t.name in P.known_transforms()
