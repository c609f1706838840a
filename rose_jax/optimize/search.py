"""The window-guided search: candidates -> legality -> local timing -> end-to-end validation.

    fast_step, report = optimize(program_or_iteration, state, windows="profile")
    print(format_report(report))

For every low-activity window (from :mod:`rose_jax.profile`; without windows, every loop of the
LoopTree, most expensive first) the search generates candidate transformations, checks their
legality on the LoopTree, predicts their gain, times the affected piece alone (``collect`` or
``learn`` of a :class:`~rose_jax.program.Program`), then runs the whole iteration
``n_iters`` times against the untransformed program. A candidate is kept only if it is faster
by more than the run-to-run spread of the baseline (measured twice) AND it is equal to the
baseline within the transform's tolerance. Kept candidates are combined greedily (each addition
re-validated). Every candidate, kept or not, is logged in the :class:`PlanReport` with the reason.

The baseline is our program under its best global XLA options, not under XLA's defaults
(``option_sets=``): before any candidate, the untransformed iteration is timed in turns under
XLA's defaults and each option set (on a GPU the ``CONCURRENT`` command-buffer sets ``rose-jax
train`` tries without ``--optimize``); the fastest is kept where it beats the default build by
a margin, and every candidate is compiled and timed under it (split_compile, which measures its
own options per stage, excepted). A plan is kept only for what it adds beyond those flags, and
the step returned runs under them (``report.base_options`` says which set, with its timings).

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

Under ``equality_options`` (on a GPU :data:`DETERMINISTIC` by default) both sides are recompiled
with them for the check. If that fails for the baseline or for a candidate, the candidate is
refused with that reason (``"refused: equality options ... failed ..."``); it is never checked
without the options. With no plan kept the report's ``equal`` is None: nothing was compared.

A host-level candidate whose env state stays in its worker processes is compared after its
``sync_state`` (the full state).

Crash safety (``isolate=``, on by default on a GPU): before a candidate is compiled here, its
first compile and one call run in a child process (:func:`rose_jax.optimize.isolate.check`); a
child that aborts (an XLA ``CHECK`` failure, e.g. MJX physics inside a stream region) refuses the
candidate with ``"XLA aborted: ..."`` and the search goes on; the refusal is remembered in the
plan cache per program, device and JAX version. With JAX's persistent compilation cache on
(``rose-jax train`` turns it on), the child writes its executable there and the trial loads it
(:func:`rose_jax.optimize.isolate.loaded_step`) instead of compiling the candidate a second time
(a plan whose transform chooses its own XLA options is compiled here).

The plan is cached (see :mod:`rose_jax.optimize.cache`): a later call for the same program on
the same kind of machine applies the cached plan without measuring anything.

Parts: candidate generation in :mod:`rose_jax.optimize.candidates`, the report in
:mod:`rose_jax.optimize.report`, the settings in :class:`OptimizeOptions`; every candidate and
every combination goes through one trial (:meth:`_Search.trial`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax

from rose_jax import profile as rp
from rose_jax import trace as rtrace
from rose_jax.compare import Comparison, compare_each, compare_trees
from rose_jax.optimize import base, isolate, measure, quotas, xla_options
from rose_jax.optimize import cache as plan_cache
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import HostStep, Tolerance, Transform
from rose_jax.optimize.candidates import Candidate, generate_candidates
from rose_jax.optimize.env_groups import trace_program
from rose_jax.optimize.registry import known_transforms, transform_by_name
from rose_jax.optimize.report import CandidateRecord, PlanReport, fmt_turns
from rose_jax.optimize.where import site_select
from rose_jax.program import Program

EQUALITY_MODES = ("stepwise", "trajectory")
# XLA options under which equality is checked on a GPU: XLA's GPU reductions and scatters use
# atomics, so even the untransformed program differs from run to run (measured on the H200:
# one SAC iteration from the same state, max |diff| 1.75); deterministic ops make it repeatable.
DETERMINISTIC = {"xla_gpu_deterministic_ops": True}


# ------------------------------------------------------------------------------- options


# Seconds from which one iteration is timed alone (``n_iters`` becomes 1 for the search).
LONG_ITERATION_S = 0.5
# The shortest isolated compile a search with a budget allows a candidate when little of the budget
# is left (see _Search.isolated): a compile cut sooner would say nothing.
MIN_ISOLATE_S = 30.0

# A candidate's reason when the budget ended the search before it (a resumed search measures
# these: ``OptimizeOptions.resume``), and the report's note then.
BUDGET_SPENT = "not measured: the search budget is spent (stopped early)"
STOPPED_EARLY = "search stopped early: its budget was spent; the best plan measured so far is kept"


@dataclasses.dataclass(frozen=True)
class OptimizeOptions:
    """How :func:`optimize` searches (every field has the keyword of ``optimize(...)``).

    windows: ``rose_jax.profile`` Windows (``path``, ``idle_sm_seconds_per_iteration``);
      ``"profile"``: profile the untransformed iteration first (``rose_jax.profile.profile``, NVML
      SM activity) and search its low-activity windows (without a GPU / NVML: said in the report,
      and the LoopTree-only search); None: candidates for every loop of the LoopTree by cost.
    candidates: explicit Transforms to try instead of generated ones.
    families: transform names (:func:`rose_jax.optimize.registry.known_transforms`) the generated
      candidates are restricted to, e.g. ``("stream_overlap", "split_compile")``; None: all.
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
      :data:`DETERMINISTIC` on a GPU, None elsewhere. Where compiling or running the baseline or
      a candidate with them fails, every candidate whose check needs it is refused with the
      reason (never checked without them).
    equality_iters: states (stepwise) or iterations (trajectory) of the equality check
      (default ``n_iters``).
    check_slower: also check the equality of candidates that were not faster (the report then
      says how far each one is from the baseline). False: a candidate is timed first and only
      one faster than the spread is checked; the equality reference (the baseline's states, its
      recompile under ``equality_options`` and its reproducibility) is built when the first
      such candidate needs it, so a search where nothing wins runs no equality check (the
      baseline's build under ``equality_options`` is compiled beside the option trial's builds,
      in parallel before anything is timed, where the baseline is a plain jit: no added wall
      time there, and none when the reference is built later). Kept plans are checked either
      way. Env groups in worker processes that are not faster are refused on their measured
      time without an equality check in both settings when the check runs under
      ``equality_options`` (it would recompile every worker's rollout).
    quotas: SM quotas for the kept plan's worker processes (:mod:`rose_jax.optimize.quotas`, inside
      the search time, cached with the plan): ``"auto"`` where MPS is available (elsewhere skipped,
      with the reason in the report), ``"search"`` also without (e.g. a mock daemon), ``"off"``.
    quota_grid / quota_refine_rounds: the quotas each branch is first timed alone at, and the
      refinement rounds of the slack-aware search around its choice.
    isolate: run each candidate's first compile and one call in a child process first
      (:func:`rose_jax.optimize.isolate.check`), so that an XLA abort refuses the candidate
      ("XLA aborted: ...") instead of ending this process; refusals are remembered in the plan
      cache (``cache_dir``) per program, device and JAX version. None (default): on a GPU
      backend, off on a CPU. Host-level candidates (several programs or processes) are not
      isolated as a whole (split_compile isolates each stage itself on a GPU).
    isolate_timeout: seconds an isolated compile may take before the candidate is refused.
    budget_s: stop early: the search (from its start, baseline included) starts no candidate or
      combination that a trial as long as its longest so far would carry past this many seconds,
      cuts an isolated compile at the budget's end, and keeps the best plan so far (the report says
      which were not measured and why; each kept candidate is cached as it is kept, so a run cut
      later keeps it). None: no limit.
    run_units: the units (iterations, epochs) of the run the plan serves; with it the budget is
      also at most ``budget_share`` of that run at the baseline's speed (a search that costs more
      than a small share of its run cannot pay for itself; ``rose-jax train --optimize`` passes it).
      Where that share is under :data:`MIN_SEARCH_UNITS` units (and no smaller ``budget_s`` was
      given), no search runs: after the baseline's compile and one run, the untransformed step is
      returned, nothing is cached and ``report.skipped`` says why.
    budget_share: see ``run_units``.
    option_sets: XLA option sets (``{name: compiler options}``, names as in
      :data:`rose_jax.optimize.xla_options.SETS`) the untransformed iteration is timed under, in
      turns with XLA's defaults, before any candidate. The fastest, kept only when it beats the
      default build by :data:`~rose_jax.optimize.xla_options.DEFAULT_MARGIN`, becomes the
      baseline: every candidate is compiled and timed under it (except one that chooses its own
      options, ``Transform.chooses_options``: split_compile) and the returned step runs under it.
      So a plan is measured against our program with its best global options, the informed
      baseline, not against XLA's defaults. ``"auto"``:
      :func:`rose_jax.optimize.xla_options.candidate_sets` (on a GPU the sets ``rose-jax train``
      tries without ``--optimize``; none on a CPU); None or ``{}``: XLA's defaults only. A set
      that fails to compile or run is refused with the reason (``report.base_options``).
    resume: on a cache hit whose search its budget stopped early (candidates recorded as
      :data:`BUDGET_SPENT`), with a finite budget here (``budget_s``, or ``run_units`` whose share
      pays for :data:`MIN_SEARCH_UNITS` units), go on with those candidates instead of returning
      the cached plan as is: the cached option decision and candidate list are reused (no profile,
      no option trial), the baseline is timed again, the pending candidates are measured as in a
      first search (at least one per resume, whatever the budget: each resume makes progress),
      the kept ones are combined with the cached plan (its earlier measurement as its time) and
      with kept candidates the budget left uncombined, and the cache entry is rewritten, so
      repeated runs (seeds) finish a search that no single run could pay for. A resume that fails
      returns the cached plan with a note. False, a zero budget or none: the cached plan as is.
    learning_check: ``transform -> rose_jax.optimize.learning.LearningCheck`` (e.g.
      ``algos.equivalence.checker(config, env)``: both programs trained on the same >= 5 seeds).
      A faster candidate kept under a tolerance (``level="fn"``, results not bitwise equal) is
      kept only if this check passes; its verdict is in the candidate's record. None: not run
      (the record says so), the stepwise tolerance alone decides.
    """

    windows: Sequence[Any] | str | None = None
    candidates: Sequence[Transform] | None = None
    families: Sequence[str] | None = None
    n_iters: int = 3
    repeats: int = 3
    cache_dir: str | None = None
    env_name: str | None = None
    batch_size: int | None = None
    max_candidates: int = 8
    local: bool = True
    combine: bool = True
    log: Callable[[str], None] | None = None
    equality: str = "stepwise"
    equality_options: dict | str | None = "auto"
    equality_iters: int | None = None
    check_slower: bool = True
    quotas: str = "auto"
    quota_grid: tuple[int, ...] = (30, 50, 70)
    quota_refine_rounds: int = 1
    isolate: bool | None = None
    isolate_timeout: float = 900.0
    budget_s: float | None = None
    run_units: int | None = None
    budget_share: float = 0.1
    learning_check: Callable[[Transform], Any] | None = None
    option_sets: dict | str | None = "auto"
    resume: bool = True

    def __post_init__(self):
        if self.n_iters < 1 or self.repeats < 1:
            raise ValueError(
                f"optimize: n_iters and repeats must be >= 1, got {self.n_iters}, {self.repeats}"
            )
        if self.equality not in EQUALITY_MODES:
            raise ValueError(f"optimize: equality must be one of {EQUALITY_MODES}, got {self.equality!r}")
        if self.equality_iters is not None and int(self.equality_iters) < 1:
            raise ValueError(f"optimize: equality_iters must be >= 1, got {self.equality_iters}")
        w = self.windows
        if w is not None and w != "profile" and (isinstance(w, str) or not isinstance(w, (list, tuple))):
            raise ValueError(f"optimize: windows must be None, 'profile' or a list of Windows, got {w!r}")
        if self.quotas not in quotas.QUOTA_MODES:
            raise ValueError(f"optimize: quotas must be one of {quotas.QUOTA_MODES}, got {self.quotas!r}")
        if not self.quota_grid or any(
            isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= 100 for q in self.quota_grid
        ):
            raise ValueError(f"optimize: quota_grid must be ints in 1..100, got {self.quota_grid!r}")
        if self.families is not None:
            unknown = sorted(set(self.families) - set(known_transforms()))
            if isinstance(self.families, str) or unknown or not self.families:
                known = known_transforms()
                raise ValueError(
                    f"optimize: families must be a non-empty list of {known}, got {self.families!r}"
                )
        if self.isolate not in (None, True, False):
            raise ValueError(f"optimize: isolate must be None, True or False, got {self.isolate!r}")
        if not self.isolate_timeout > 0:
            raise ValueError(f"optimize: isolate_timeout must be > 0 s, got {self.isolate_timeout!r}")
        if self.budget_s is not None and not self.budget_s >= 0:
            raise ValueError(f"optimize: budget_s must be >= 0 s or None, got {self.budget_s!r}")
        units = self.run_units
        if units is not None and (isinstance(units, bool) or not isinstance(units, int) or units < 1):
            raise ValueError(f"optimize: run_units must be a positive int or None, got {self.run_units!r}")
        if not 0 < self.budget_share <= 1:
            raise ValueError(f"optimize: budget_share must be in (0, 1], got {self.budget_share!r}")
        sets = self.option_sets
        named = isinstance(sets, dict) and all(
            isinstance(k, str) and isinstance(v, dict) for k, v in sets.items()
        )
        if not (sets is None or sets == "auto" or named):
            raise ValueError(
                f"optimize: option_sets must be 'auto', None or {{name: {{XLA option: value}}}}, got {sets!r}"
            )
        if not isinstance(self.resume, bool):
            raise ValueError(f"optimize: resume must be True or False, got {self.resume!r}")
        if isinstance(sets, dict) and "default" in sets:
            raise ValueError(
                "optimize: option_sets must not name 'default' (XLA's defaults are always timed)"
            )

    def budget(self, baseline_s: float) -> float | None:
        """Seconds the search may take: ``budget_s`` and ``budget_share`` of the run (None: no limit)."""
        share = None if self.run_units is None else self.budget_share * baseline_s * self.run_units
        limits = [b for b in (self.budget_s, share) if b is not None]
        return min(limits) if limits else None

    @property
    def eq_iters(self) -> int:
        """States (stepwise) or iterations (trajectory) of the equality check."""
        return self.n_iters if self.equality_iters is None else int(self.equality_iters)

    @property
    def isolating(self) -> bool:
        """Whether candidates are first compiled in a child process (``isolate`` resolved)."""
        return jax.default_backend() == "gpu" if self.isolate is None else self.isolate

    def resolved_option_sets(self) -> dict[str, dict]:
        """``option_sets`` with ``"auto"`` resolved for this process's backend (``{}``: none)."""
        if self.option_sets == "auto":
            return xla_options.candidate_sets()
        return dict(self.option_sets or {})

    def resolved_equality_options(self) -> dict | None:
        """``equality_options`` with ``"auto"`` resolved for this process's backend."""
        if self.equality_options == "auto":
            return DETERMINISTIC if jax.default_backend() == "gpu" else None
        return self.equality_options


# ------------------------------------------------------------------------------- targets


class HostIteration(HostStep):
    """``state -> (state, metrics)`` of a Program whose collect runs in worker processes:
    the host-level collect, then the jitted ``learn`` (both compiled with ``compiler_options``
    when given: the collect through its ``with_compiler_options``)."""

    def __init__(self, program: Program, compiler_options: dict | None = None):
        self.program = program
        collect = program.collect
        if compiler_options and isinstance(collect, HostStep):
            collect = collect.with_compiler_options(compiler_options)
        self.collect = collect
        self.learn = jax.jit(program.learn, compiler_options=compiler_options or None)

    def __call__(self, state):
        state, data = self.collect(state)
        return self.learn(state, data)

    def close(self) -> None:  # stops the worker processes
        base.close(self.collect)

    def sync_state(self, state):  # the env state may live in the workers: the full state
        return base.synced(self.collect, state)

    def stats(self) -> dict:
        return self.collect.stats() if isinstance(self.collect, HostStep) else {}

    def with_compiler_options(self, compiler_options: dict | None) -> "HostIteration":
        return HostIteration(self.program, compiler_options)


def _apply_order(t: Transform) -> int:
    """Program-level transforms (and host-level ones whose result is still a Program, e.g. its
    collect in worker processes) first, then fn-level rewrites, then those that wrap the whole
    iteration in a host step of their own (``Transform.wraps_iteration``)."""
    if t.level == "fn":
        return 1
    return 2 if t.wraps_iteration else 0


def apply_plan(target: Any, transforms: Sequence[Transform]) -> Any:
    """Apply ``transforms`` to a function or Program: program-level ones (and env groups in
    processes) first, then fn-level ones, then those that wrap the iteration in a host step."""
    ordered = sorted(transforms, key=_apply_order)
    for t in ordered:
        if t.needs_program_tree and not isinstance(target, Program):
            raise ValueError(f"{t.label} needs a Program, got a plain function")
        target = t.apply(target)
    return target


def compile_step(target: Any, host: bool = False, compiler_options: dict | None = None) -> Callable:
    """A callable ``state -> (state, metrics)``: jitted unless it runs host-level code.

    ``compiler_options``: XLA options for every compiled part (e.g. :data:`DETERMINISTIC`); a
    host-level step takes them through its ``with_compiler_options`` (one that has none cannot).
    """
    is_program = isinstance(target, Program)
    if compiler_options:
        if is_program:
            if target.host:  # the workers' rollouts and the driver's learn, all with the options
                return HostIteration(target, compiler_options)
            return jax.jit(target.iteration(), compiler_options=compiler_options)
        if not host:
            return jax.jit(target, compiler_options=compiler_options)
        if not isinstance(target, HostStep):
            raise ValueError(f"{type(target).__name__} cannot be compiled with compiler options")
        return target.with_compiler_options(compiler_options)
    if is_program:
        return HostIteration(target) if target.host else jax.jit(target.iteration())
    return target if host else jax.jit(target)


def plan_step(transformed: Any, transforms: Sequence[Transform], options: dict | None = None) -> Callable:
    """``compile_step`` of ``apply_plan(target, transforms)`` under the search's base XLA
    ``options`` (see ``OptimizeOptions.option_sets``): none where a transform of the plan chooses
    its own (``Transform.chooses_options``: split_compile), and a host step that cannot take
    compiler options runs under XLA's defaults."""
    host = _is_host(transforms)
    if not options or any(t.chooses_options for t in transforms):
        return compile_step(transformed, host=host)
    try:
        return compile_step(transformed, host=host, compiler_options=options)
    except ValueError:  # HostStep.with_compiler_options: this step cannot be recompiled
        return compile_step(transformed, host=host)


def plan_of(target: Any, report: PlanReport) -> Callable:
    """The step of ``report``'s plan (its transforms and base XLA options, as :func:`optimize`
    returned or cached them) applied to ``target``: e.g. a plan searched on a shorter unit with the
    same loops and components (``algos.registry.SearchUnit``) applied to the whole unit. Nothing is
    measured or checked here: the report's equality was checked on the program it searched."""
    transforms = [_rebuild(t) for t in report.plan or []]
    options = (report.base_options or {}).get("options")
    return plan_step(apply_plan(target, transforms), transforms, options)


# compile_sets' name for the baseline's build under the equality options (not an option set)
EQUALITY_BUILD = "(equality reference)"


def compile_sets(
    target: Any, state: Any, sets: dict[str, dict]
) -> tuple[dict[str, Callable], dict[str, str]]:
    """``target`` compiled under each of ``sets`` (``{name: XLA options}``) and run once from
    ``state``, the builds in parallel threads (XLA compiles without the GIL; a build the profile
    already compiled is JAX's cached one). Returns ``(builds, refused)``: a set whose compile or
    run fails is refused with the reason, never raised."""
    from concurrent.futures import ThreadPoolExecutor

    def build(item):
        name, options = item
        try:
            step = compile_step(target, compiler_options=options)
            jax.block_until_ready(step(state))
            return name, step, None
        except Exception as e:  # noqa: BLE001 - e.g. an option this jaxlib does not know
            return name, None, xla_options.reason(e)

    with ThreadPoolExecutor(max(1, len(sets))) as pool:
        done = list(pool.map(build, sets.items()))
    builds = {name: step for name, step, why in done if why is None}
    return builds, {name: why for name, _, why in done if why is not None}


def _is_host(transforms: Sequence[Transform]) -> bool:
    return any(t.level == "host" for t in transforms)


def _env_groups_in_processes(transforms: Sequence[Transform]) -> bool:
    return any(t.regroups_envs and t.level == "host" for t in transforms)


# ---------------------------------------------------------------------------- equality


class _Reference(NamedTuple):
    """What candidates are compared with (see the module docstring).

    stepwise: ``starts`` = the baseline's states s_0 .. s_{N-1}, ``outputs`` = the baseline's
    state after one iteration from each; trajectory: ``outputs`` = [the final state]."""

    mode: str
    starts: list
    outputs: list
    reproducibility: Comparison  # the baseline against itself, bitwise
    what: str  # for reasons: "after 3 iterations" / "stepwise (one iteration from ...)"
    start: Any = None  # trajectory mode: the state the reference started from
    n_iters: int = 0
    reuse_final: bool = True  # trajectory mode: the candidate's timed final state is comparable


def _reference(mode, base_step, state, n_iters, final, final_again, reuse_final=True) -> _Reference:
    if mode == "trajectory":
        repro = compare_trees(final_again, final)
        what = f"after {n_iters} iterations"
        return _Reference(mode, [], [final], repro, what, state, n_iters, reuse_final)
    states = measure.trajectory(base_step, state, n_iters)
    starts = states[:-1]
    outputs = measure.step_outputs(base_step, starts)  # the baseline from s_k a second time
    repro = compare_each(outputs, states[1:])
    what = f"stepwise (one iteration from each of the baseline's states s_0..s_{n_iters - 1})"
    return _Reference(mode, starts, outputs, repro, what)


class EqualityRefused(Exception):
    """The equality check cannot run as asked: compiling (or running) the baseline or the
    candidate under the equality options failed. The candidate is refused with this reason; it
    is never checked without the options."""


def _options_failed(options: dict, whose: str, e: BaseException) -> str:
    msg = str(e).splitlines()[0][:160] if str(e) else ""
    return f"equality options {options} failed for {whose} ({type(e).__name__}: {msg})"


def _check_equal(
    ref: _Reference, step, final, tol: Tolerance, transformed=None, host=False, options=None
) -> Comparison:
    """The candidate ``step`` against the baseline (``final``: its state after the timed runs).

    With ``options`` the candidate is recompiled with them (``transformed``) for the check and,
    in trajectory mode, run again for as many iterations as the reference; if that recompile (or
    its run) fails, :class:`EqualityRefused` says why (the candidate already ran without them)."""
    if not options:
        return _compare(ref, step, final, tol)
    check = None
    try:
        check = compile_step(transformed, host=host, compiler_options=options)
        return _compare(ref, check, final, tol)  # (trajectory: run again, reuse_final is False)
    except Exception as e:  # noqa: BLE001 - refused with the reason, never checked without them
        raise EqualityRefused(_options_failed(options, "the candidate", e)) from e
    finally:
        if check is not None and check is not step:
            base.close(check)


def _compare(ref: _Reference, check, final, tol: Tolerance) -> Comparison:
    if ref.mode == "trajectory":
        if not ref.reuse_final:
            final = measure.run_iterations(check, ref.start, ref.n_iters)[0]
        return compare_trees(base.synced(check, final), ref.outputs[0], tol.rtol, tol.atol)
    outs = measure.step_outputs(check, ref.starts, sync=lambda s: base.synced(check, s))
    return compare_each(outs, ref.outputs, tol.rtol, tol.atol)


# ------------------------------------------------------------------------------- legality


def _legal(transform: Transform, tree, ptree) -> tuple[bool, str]:
    if transform.needs_program_tree:
        if ptree is None:
            return False, f"{transform.name} needs a Program target"
        return transform.legal(ptree)
    return transform.legal(tree)


def _affected_pieces(transform: Transform, program: Program, state) -> list[str]:
    """Which of collect / learn contain a scan the fn-level transform targets."""
    if transform.level != "fn":
        return ["collect"]
    where = dict(transform.params).get("where", dict(transform.params).get("a"))
    select = site_select(where)
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


def _time_piece(program: Program, piece: str, state, repeats: int):
    """``(Timing, output)`` of ``collect`` or ``learn`` alone (learn's inputs made by collect)."""
    collect = program.collect if program.host else jax.jit(program.collect)
    if piece == "collect":
        return measure.time_call(collect, (state,), repeats), collect(state)
    out_state, data = collect(state)
    return measure.time_call(jax.jit(program.learn), (out_state, data), repeats), None


def _conflict(a: Transform, b: Transform) -> bool:
    """Two transforms that rewrite the same thing (same kind on the same loop, or without a loop
    to tell them apart: e.g. two env regroupings)."""
    if a.wraps_iteration and b.wraps_iteration:
        return True  # each wraps the whole iteration in its own host step
    if a.name != b.name:
        return False
    pa, pb = dict(a.params), dict(b.params)
    return pa.get("where") == pb.get("where") and pa.get("a") == pb.get("a")


def _subsumed(t: Transform, kept: Sequence[Transform]) -> str | None:
    """Why ``t`` need not be measured: a kept transform is the same rewrite with the same
    parameters everywhere (``where=None``) and ``t`` narrows it to a part (e.g. exit_idle_loops on
    the evaluation alone once exit_idle_loops on every matched scan is in the plan: alone it can
    only do less, and with it, it would rewrite the same loops twice). None: measure it."""
    p = dict(t.params)
    if p.get("where") is None:
        return None
    for k in kept:
        q = dict(k.params)
        if k.name == t.name and "where" in q and q["where"] is None and {**p, "where": None} == q:
            return f"not measured: subsumed by the kept {k.label} (the same rewrite everywhere)"
    return None


def _jsonable_params(t: Transform) -> bool:
    try:
        json.dumps(t.to_json()["params"])
    except TypeError:
        return False
    return not any(callable(v) for _, v in t.params) and t.name in known_transforms()


def _failure(e: BaseException) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


# ------------------------------------------------------------------------------- the search


class _Trial(NamedTuple):
    """One end-to-end trial: the baseline and the candidate timed in turns, and its equality."""

    base: measure.Timing
    cand: measure.Timing
    scaled_s: float  # the candidate's median in the units of the search's baseline
    noise: float  # the spread a gain must exceed
    cmp: Comparison | None  # None: equality not checked (check_slower=False, not faster)
    what: str  # how equality was decided, for reasons
    unchecked: str = "check_slower=False"  # why equality was not checked (when cmp is None)
    settled: dict | None = None  # parameters the step chose by measuring (HostStep.measured_params)


class _Search:
    """The state of one search (``optimize`` with no cache hit): baseline timings, the lazily
    built equality reference, the untransformed pieces' local timings, and the report."""

    def __init__(
        self, target: Any, state: Any, opts: OptimizeOptions, report: PlanReport, options: dict | None = None,
        *, key: str, t_start: float,
    ):
        """``options``: XLA options the baseline is compiled under from the start (a resumed
        search's cached decision); None: XLA's defaults, the option trial decides later. ``key``:
        the plan cache key (its checkpoints and end are stored there); ``t_start``: ``optimize``'s
        start (the budget and ``search_time_s`` count from it)."""
        self.target, self.state, self.opts, self.report = target, state, opts, report
        self.program = target if isinstance(target, Program) else None
        self.say = opts.log or (lambda s: None)
        self.eq_options = opts.resolved_equality_options()
        self.local_base: dict[str, tuple] = {}
        self.deadline: float | None = None  # perf_counter time after which nothing more is measured
        self.free_trials = 0  # candidates measured whatever the deadline (see spent)
        self.free_trial = False  # whether the trial running now is one of them (see isolated)
        self.trial_walls: list[float] = []  # each trial's wall seconds (see expected_trial_s)
        self.measured = 0  # trials run by measure_candidates, an earlier tier's or resume's included
        # a resumed search's cached plan and kept candidates, (transform(s), time, comparison) as
        # measure_candidates returns them, which the combination tries with the new ones
        self.carried: list[tuple[Any, float, Any]] = []
        self.key, self.t_start = key, t_start
        self.checkpointed = False  # whether checkpoint wrote an entry under key
        self.kept_before: list[Transform] = []  # a resumed search's cached plan (see _subsumed)
        self._ref: _Reference | None = None
        # the baseline under the equality options, compiled and run once beside the option trial's
        # builds (see _choose_options); the reference then starts from it instead of compiling
        self._eq_build: Callable | None = None
        # why the reference could not be built under the equality options (then every candidate
        # whose equality is checked is refused with it)
        self.reference_error: str | None = None
        # XLA options every candidate is compiled under (None: XLA's defaults); see option_sets
        self.base_options: dict | None = dict(options) if options else None
        self.base_step = compile_step(target, compiler_options=self.base_options)
        t0 = time.perf_counter()
        jax.block_until_ready(self.base_step(state))  # compile
        self.compile_s = time.perf_counter() - t0  # its compile and first call (see _profile_estimate_s)
        _, first_s = measure.run_iterations(self.base_step, state, 1)
        if opts.n_iters > 1 and first_s >= LONG_ITERATION_S:
            # a long iteration (e.g. an epoch with its evaluation) is timed one at a time: its
            # timing noise is small against it, and a search of 3-iteration runs of a 2 s epoch
            # spends its budget before its first candidate
            opts = self.opts = dataclasses.replace(opts, n_iters=1)
            report.n_iters = 1
            report.notes.append(
                f"one iteration per timed run: the baseline's iteration takes {first_s:.2f} s "
                f"(>= {LONG_ITERATION_S:g} s)"
            )
        self.first_s = first_s

    def time_baseline(self, trial: bool = True) -> None:
        """The option trial (``option_sets``; ``trial=False``: none, the options chosen at
        construction stay) and the baseline's two timings (``baseline``, ``spread``)."""
        state, opts, report = self.state, self.opts, self.report
        # the baseline, measured twice (the spread decides what "faster" means); with option
        # sets, the first of the two is the kept build's timing in turns with the others
        n, r = opts.n_iters, opts.repeats
        sets = opts.resolved_option_sets() if trial else None
        if sets:
            self.ref_state, t1 = self._choose_options(sets)
        else:
            self.ref_state, t1 = measure.time_repeats(self.base_step, state, n, r, warmup=False)
            report.measurements += r
        self.ref_again, t2 = measure.time_repeats(self.base_step, state, n, r, warmup=False)
        report.measurements += r
        all_base = measure.Timing(t1.per_iter_s + t2.per_iter_s)
        self.baseline = all_base.median
        self.spread = max(abs(t1.median - t2.median), 2.0 * all_base.mad)
        report.baseline_s, report.baseline_spread_s = self.baseline, self.spread

    def _choose_options(self, sets: dict[str, dict]) -> tuple[Any, measure.Timing]:
        """Time the untransformed iteration under XLA's defaults and each of ``sets`` in turns
        and make the fastest the baseline (``base_step``, ``base_options``) when it beats the
        default build by ``xla_options.DEFAULT_MARGIN``; a set whose build fails is refused with
        the reason. Returns the kept build's final state and timing (in turns with the others)."""
        state, report, opts = self.state, self.report, self.opts
        t0 = time.perf_counter()
        eq = self._equality_prebuild()
        builds, refused = compile_sets(self.target, state, {**sets, **eq})
        self._eq_build = builds.pop(EQUALITY_BUILD, None)
        refused.pop(EQUALITY_BUILD, None)  # the reference compiles it again and says why it fails
        for name, why in refused.items():
            self.say(f"[optimize] XLA option set {name} refused: {why}")
        names = ["default", *builds]
        timed = measure.time_alternating(
            [self.base_step, *builds.values()], state, opts.n_iters, opts.repeats, warmup=False
        )
        report.measurements += len(names) * opts.repeats
        medians = {nm: t.median for nm, (_, t) in zip(names, timed, strict=True)}
        best = xla_options.fastest(medians)  # the rule of rose-jax train's own trial
        if best != "default":
            self.base_options, self.base_step = dict(sets[best]), builds[best]
        speedup = medians["default"] / medians[best]
        report.base_options = {
            "name": best,
            "options": dict(sets.get(best, {})),
            "ms_per_iter": {nm: m * 1e3 for nm, m in medians.items()},
            "speedup_vs_default": speedup,
            "refused": refused,
            "seconds": time.perf_counter() - t0,
        }
        times = ", ".join(f"{nm} {m * 1e3:.1f}" for nm, m in medians.items())
        self.say(
            f"[optimize] XLA options of the baseline: {best} kept ({speedup:.3f}x vs XLA's defaults; "
            f"ms/iter in turns: {times}); every candidate is timed under them"
        )
        return timed[names.index(best)]

    def compile(self, transformed: Any, transforms: Sequence[Transform]) -> Callable:
        """:func:`plan_step` under the baseline's XLA options."""
        return plan_step(transformed, transforms, self.base_options)

    # -- equality reference --------------------------------------------------------------
    def _equality_prebuild(self) -> dict[str, dict]:
        """``{EQUALITY_BUILD: equality options}`` for the option trial's pool (see
        :func:`compile_sets`) where the reference will compile the baseline under equality options
        and that build is a plain jit (a host-level target's build under options starts worker
        processes: it is left to the reference); else ``{}``. The option trial compiles its sets
        in parallel threads before it times anything, so this compile adds no time there and
        saves the reference's compile later (44 s of the first ``offload_component`` trial's 131 s
        equality on PPO ant's epoch, H100, 2026-12-07 08:35); its one run beside the others'
        warm-ups is the reference's own warm-up run."""
        target = self.target
        host = isinstance(target, HostStep) or (isinstance(target, Program) and target.host)
        if not self.eq_options or self._ref is not None or self.reference_error is not None or host:
            return {}
        return {EQUALITY_BUILD: dict(self.eq_options)}

    @property
    def reference_built(self) -> bool:
        return self._ref is not None

    def reference(self) -> _Reference:
        """The equality reference, built on first use (see ``check_slower``).

        Raises :class:`EqualityRefused` (now and on every later call) when the baseline cannot be
        compiled or run under the equality options: nothing is checked without them."""
        if self._ref is not None:
            return self._ref
        if self.reference_error is not None:
            raise EqualityRefused(self.reference_error)
        opts, report = self.opts, self.report
        eq_iters, options = opts.eq_iters, self.eq_options
        r_state, r_again, base_eq = self.ref_state, self.ref_again, self.base_step
        t0 = time.perf_counter()
        if options or eq_iters != opts.n_iters:
            if options and self._eq_build is not None:  # compiled and run beside the option trial
                base_eq, self._eq_build = self._eq_build, None
                self.say(f"[optimize] equality reference: the baseline under {options}, compiled "
                         "beside the option trial's builds")
            elif options:
                try:
                    base_eq = compile_step(self.target, compiler_options=options)
                    jax.block_until_ready(base_eq(self.state))
                    self.say(
                        f"[optimize] equality reference: the baseline compiled and run once under "
                        f"{options} in {time.perf_counter() - t0:.0f}s"
                    )
                except Exception as e:  # noqa: BLE001 - e.g. an op without a deterministic GPU kernel
                    why = _options_failed(options, "the baseline", e)
                    report.notes.append(
                        f"{why}: every candidate whose equality was to be checked is refused "
                        "(never checked without them)"
                    )
                    self.say(f"[optimize] {why}; candidates that need the equality check are refused")
                    if base_eq is not self.base_step:
                        base.close(base_eq)
                    self.reference_error = why
                    raise EqualityRefused(why) from e
            report.notes.append(f"equality checked over {eq_iters} iteration(s) under XLA options {options}")
            if opts.equality == "trajectory":
                r_state = measure.run_iterations(base_eq, self.state, eq_iters)[0]
                r_again = measure.run_iterations(base_eq, self.state, eq_iters)[0]
        reuse = not options and eq_iters == opts.n_iters
        ref = _reference(opts.equality, base_eq, self.state, eq_iters, r_state, r_again, reuse)
        rc = ref.reproducibility
        report.baseline_reproducible, report.baseline_repro_reason = rc.equal, rc.reason
        report.baseline_max_abs_diff, report.baseline_max_rel_diff = rc.max_abs, rc.max_rel
        if not rc.equal:
            report.notes.append(f"baseline not bitwise reproducible ({opts.equality}): {rc.reason}")
        self.say(
            f"[optimize] baseline reproducible ({opts.equality}): {rc.equal}, max|d| {rc.max_abs:.2g} "
            f"(reference built in {time.perf_counter() - t0:.0f}s)"
        )
        self._ref = ref
        return ref

    def start_measuring(self, base_fn: Callable) -> tuple[Any, Any]:
        """Before the candidates: the budget's deadline (counted from the search's start
        ``t_start``), the equality reference when every candidate is compared (``check_slower``),
        and the traces candidates are analysed on: ``(tree, program tree or None)``."""
        opts = self.opts
        budget = opts.budget(self.baseline)
        if budget is not None:
            self.deadline = self.t_start + budget
            self.say(f"[optimize] search budget {budget:.1f} s"
                     + (f" ({opts.budget_share:.0%} of a {opts.run_units}-unit run at the baseline's speed)"
                        if opts.run_units is not None and budget < (opts.budget_s or float("inf")) else ""))
        if opts.check_slower:
            try:
                self.reference()
            except EqualityRefused:
                pass  # noted in the report; each candidate is refused with the reason
        t0 = time.perf_counter()
        tree = rtrace.trace(base_fn, self.state, arg_names=["state"])
        ptree = trace_program(self.program, self.state) if self.program is not None else None
        self.say(f"[optimize] traced the unit for the candidates' analyses in "
                 f"{time.perf_counter() - t0:.0f} s")
        return tree, ptree

    # -- one trial -----------------------------------------------------------------------
    def trial(
        self, rec: CandidateRecord, transforms: list[Transform], *, always_check: bool
    ) -> _Trial | None:
        """Apply ``transforms``, (with ``isolate``) compile and call it once in a child process,
        (for a single candidate of a Program) time the affected piece,
        time the whole iteration in turns with the baseline and check equality; fills ``rec``.

        Returns None when the candidate failed or was dropped locally (``rec.reason`` says why).
        Equality is checked when ``always_check`` or the candidate is faster than the spread.
        """
        opts, report = self.opts, self.report
        host = _is_host(transforms)
        tolerance = (
            base.loosest([t.tolerance for t in transforms])
            if len(transforms) > 1
            else transforms[0].tolerance
        )
        transformed = None
        clock = [time.perf_counter()]
        started = clock[0]

        def lap(phase: str) -> None:  # rec.phase_s: where a trial's wall time goes
            now = time.perf_counter()
            rec.phase_s[phase] = round(now - clock[0], 2)
            clock[0] = now

        try:
            transformed = apply_plan(self.target, transforms)
            outcome = None  # the isolated child's compile, where there is one
            if opts.isolating:
                outcome = self.isolated(rec, transformed, host)
                lap("isolate")
                if outcome is not None and not outcome.ok:
                    return None
            if len(transforms) == 1 and opts.local and isinstance(transformed, Program):
                rec.stage = "local"
                ok, why = self._local_check(rec, transforms[0], transformed)
                lap("local")
                if not ok:
                    rec.reason = why
                    self.say(f"[optimize] {rec.label}: {why}")
                    return None
            if rec.stage != "combine":
                rec.stage = "e2e"
            step = self.loaded(rec, outcome, transforms) or self.compile(transformed, transforms)
            # compiled and warmed here; the baseline ran before the search's first timing (its
            # construction, or the option trial's build), so it is not run again untimed: one unit
            # less per candidate (on a long unit, seconds: 6 s on PPO reacher's epoch)
            jax.block_until_ready(step(self.state))
            (_, tb), (state_c, tc) = measure.time_alternating(
                [self.base_step, step], self.state, opts.n_iters, opts.repeats, warmup=False
            )
            lap("time")
            settled = step.measured_params() if isinstance(step, HostStep) and len(transforms) == 1 else {}
            report.measurements += 2 * opts.repeats
            gain = tb.median - tc.median  # against the baseline timed in turns with it
            noise = max(self.spread, 2.0 * max(tb.mad, tc.mad))
            cmp, what = None, ""
            # a slower env-groups-in-processes candidate is refused on its measured time when
            # checking its equality would recompile its workers' rollouts under the equality options
            recompile = _env_groups_in_processes(transforms) and bool(self.eq_options)
            if (always_check and not recompile) or gain > noise:
                rec.equality = opts.equality
                try:
                    ref = self.reference()
                    cmp = _check_equal(ref, step, state_c, tolerance, transformed, host, self.eq_options)
                    lap("equality")
                except EqualityRefused as e:  # not checked without the options: refused
                    rec.e2e_time_s, rec.e2e_baseline_s = tc.median, tb.median
                    rec.speedup = tb.median / tc.median if tc.median > 0 else None
                    rec.reason = f"refused: {e}"
                    self.say(f"[optimize] {rec.label}: {rec.reason}")
                    return None
                what = ref.what
        except Exception as e:  # noqa: BLE001 - a failing candidate is logged, not fatal
            rec.reason = _failure(e)
            self.say(f"[optimize] {rec.label}: {rec.reason}")
            return None
        finally:
            base.close(transformed)
            self.trial_walls.append(time.perf_counter() - started)
            if rec.phase_s:
                phases = ", ".join(f"{k} {v:.0f} s" for k, v in rec.phase_s.items())
                self.say(f"[optimize] {rec.label}: {phases}")
        rec.e2e_time_s, rec.e2e_baseline_s = tc.median, tb.median
        rec.speedup = tb.median / tc.median if tc.median > 0 else None
        if cmp is not None:
            rec.equal, rec.max_abs_diff, rec.max_rel_diff = cmp.equal, cmp.max_abs, cmp.max_rel
        unchecked = (
            "not faster; env groups in processes are checked under the equality options only if faster"
            if always_check
            else "check_slower=False"
        )
        return _Trial(tb, tc, tc.median * self.baseline / tb.median, noise, cmp, what, unchecked, settled)

    def loaded(self, rec: CandidateRecord, outcome: Any, transforms: Sequence[Transform]) -> Callable | None:
        """The candidate's step as its isolated child compiled it (``isolate.loaded_step``: loaded
        from the shared persistent compilation cache instead of compiled here a second time; the
        same program under the same options, so the same executable), or None (compile it here):
        no child, no persistent cache, or a plan whose options are not the search's base set. A
        load that fails is no failure of the candidate: it is compiled here instead."""
        if outcome is None or any(t.chooses_options for t in transforms):
            return None
        try:
            step = isolate.loaded_step(outcome, (self.state,), self.base_options)
        except Exception:  # noqa: BLE001 - an optimisation only: compile it here instead
            return None
        if step is not None:
            rec.isolation += "; its executable loaded here from the shared compilation cache"
        return step

    def isolated(self, rec: CandidateRecord, transformed: Any, host: bool) -> Any:
        """The candidate's first compile and one call in a child process (see ``isolate``): its
        ``isolate.Outcome`` (None for a host-level candidate, not isolated); not ``ok`` (with
        ``rec.reason``) when the child aborted or failed; the refusal is remembered in the plan
        cache for this program, device and JAX version. The child writes its executable into the
        driver's persistent compilation cache (where there is one), so the trial loads it
        (:meth:`loaded`) instead of compiling again."""
        if host or (isinstance(transformed, Program) and transformed.host):
            rec.isolation = "not isolated: host-level (its programs compile in their own stages/workers)"
            return None
        fn = transformed.iteration() if isinstance(transformed, Program) else transformed
        rec.stage = "isolate"
        # a compile may not run past the budget (PPO reacher, H100 2026-12-06 17:25: a candidate
        # started 46 s before a 300 s budget's end ran 320 s more, and the run's limit cut the
        # search before it cached its kept candidate); a free trial is not capped
        timeout, capped = self.opts.isolate_timeout, False
        if self.deadline is not None and not self.free_trial:
            left = max(self.deadline - time.perf_counter(), MIN_ISOLATE_S)
            timeout, capped = min(timeout, left), left < timeout
        out = isolate.check(
            fn,
            (self.state,),
            compiler_options=self.base_options,  # as it will be compiled here
            label=rec.label,
            cache_dir=self.opts.cache_dir,
            fingerprint=self.report.fingerprint,
            timeout=timeout,
            share_cache=True,  # the trial loads the child's executable (self.loaded)
        )
        rec.isolation = out.reason + (" (remembered in the plan cache)" if out.cached else "")
        if out.ok:
            return out
        if capped and not out.cached and out.reason.startswith("timed out"):
            # the budget's end, not isolate_timeout, stopped it: pending for a later resume
            rec.reason = BUDGET_SPENT
            rec.isolation += " (the search budget's end)"
            self.say(f"[optimize] {rec.label}: {rec.isolation}; left for a later search")
            return out
        rec.reason = f"refused: {rec.isolation}"
        self.say(f"[optimize] {rec.label}: {rec.reason}")
        return out

    def verdict(self, rec: CandidateRecord, res: _Trial, gain: float, *, versus_plan: bool) -> bool:
        """Keep or reject (and why), given the ``gain`` that must exceed the spread."""
        not_faster = (
            f"not faster by more than the spread: gain {gain * 1e3:.3f} ms <= {res.noise * 1e3:.3f} ms"
        )
        # with the turns themselves, so that a median moved by one outlier turn shows as such
        turns = f"; turns: baseline {fmt_turns(res.base)}, candidate {fmt_turns(res.cand)} ms/iter"
        if res.cmp is None:
            rec.reason = f"{not_faster} (equality not checked: {res.unchecked}){turns}"
        elif not res.cmp.equal:
            rec.reason = f"unequal {res.what}: {res.cmp.reason}"
        elif gain <= res.noise:
            rec.reason = (
                "no gain over the current plan beyond the spread" if versus_plan else f"{not_faster}{turns}"
            )
        elif versus_plan:
            rec.kept, rec.reason = True, "faster than the current plan by more than the spread, and equal"
        else:
            rec.kept = True
            rec.reason = f"faster by {gain * 1e3:.3f} ms/iter (> spread {res.noise * 1e3:.3f} ms) and equal"
        max_d = "not checked" if res.cmp is None else f"{res.cmp.max_abs:.2g}"
        speedup = "-" if rec.speedup is None else f"{rec.speedup:.3f}x"
        self.say(
            f"[optimize] {rec.label}: {res.cand.median * 1e3:.3f} ms/iter vs baseline "
            f"{res.base.median * 1e3:.3f} (timed in turns), speedup {speedup}, max|d| {max_d} -> "
            f"{'KEPT' if rec.kept else 'rejected'}"
        )
        return rec.kept

    def _local_check(self, rec: CandidateRecord, t: Transform, transformed: Any) -> tuple[bool, str]:
        """Time the affected piece alone; for env groups also compare the collected data.

        ``self.local_base`` caches the untransformed pieces' ``(Timing, output)`` across candidates.
        """
        program, state, repeats, report = self.program, self.state, self.opts.repeats, self.report
        pieces = _affected_pieces(t, program, state)
        if not pieces:
            return False, "the transform matches nothing in collect or learn"
        base_total = new_total = 0.0
        for piece in pieces:
            if piece not in self.local_base:
                self.local_base[piece] = _time_piece(program, piece, state, repeats)
                report.measurements += repeats
            new_timing, out = _time_piece(transformed, piece, state, repeats)
            report.measurements += repeats
            base_total += self.local_base[piece][0].median
            new_total += new_timing.median
            if piece == "collect" and t.regroups_envs:
                collect = transformed.collect

                def norm(o, collect=collect):  # env state in workers: synced and pruned alike
                    return collect.comparable(o) if isinstance(collect, HostStep) else o

                cmp = compare_trees(
                    norm(out), norm(self.local_base[piece][1]), t.tolerance.rtol, t.tolerance.atol
                )
                if not cmp.equal:
                    rec.local_baseline_s, rec.local_time_s = base_total, new_total
                    return (
                        False,
                        f"grouped collect differs from the full batch (collect mixes envs?): {cmp.reason}",
                    )
        rec.local_baseline_s, rec.local_time_s = base_total, new_total
        noise = 3.0 * max(self.local_base[p][0].mad for p in pieces) + 0.05 * base_total
        if new_total > base_total + noise:
            return (
                False,
                f"slower locally ({', '.join(pieces)}): "
                f"{new_total * 1e3:.3f} ms vs {base_total * 1e3:.3f} ms",
            )
        return True, "local ok"

    # -- quotas ----------------------------------------------------------------------------
    def time_plans(self, plan_a: list[Transform], plan_b: list[Transform]):
        """Two plans timed end to end in turns (each with its own worker processes)."""
        steps = []
        try:
            for plan in (plan_a, plan_b):
                steps.append(self.compile(apply_plan(self.target, plan), plan))
            (_, ta), (_, tb) = measure.time_alternating(
                steps, self.state, self.opts.n_iters, self.opts.repeats
            )
            self.report.measurements += 2 * self.opts.repeats
            return ta, tb
        finally:
            for step in steps:
                base.close(step)

    def plan_quotas(self, plan: list[Transform]) -> list[Transform]:
        """The kept plan with SM quotas for its worker processes (see :mod:`~.quotas`)."""
        opts = self.opts
        plan, records = quotas.choose_plan_quotas(
            plan,
            self.target,
            self.state,
            mode=opts.quotas,
            timed=self.time_plans,
            noise=self.spread,
            grid=opts.quota_grid,
            refine_rounds=opts.quota_refine_rounds,
            say=self.say,
            deadline=self.deadline,
        )
        self.report.quotas = [dataclasses.asdict(r) for r in records]
        return plan

    # -- the two loops -------------------------------------------------------------------
    def measure_candidates(
        self, cands: list[Candidate], tree, ptree, measured: int = 0, *,
        kept: Sequence[tuple[Transform, float, Any]] = (), pending: Sequence[Candidate] = (),
    ) -> list[tuple[Transform, float, Any]]:
        """Each legal candidate (up to ``max_candidates``, ``measured`` of them already measured
        by an earlier search this one resumes or an earlier tier of this one) alone; returns the kept
        ones (after ``kept``, an earlier tier's) with their time in baseline units and their
        comparison. ``pending``: candidates a later tier measures, recorded as pending in the
        checkpoints. ``self.measured`` is the count of trials run, ``measured`` included."""
        opts, report = self.opts, self.report
        kept = list(kept)
        self.measured = measured
        for i, cand in enumerate(cands):
            t = cand.transform
            rec = CandidateRecord(t.label, t.to_json(), cand.window, cand.predicted, cand.model)
            report.candidates.append(rec)
            # what is not measured anyway first: each legality analysis walks the whole jaxpr (on PPO
            # humanoid's epoch, H100 2026-12-06, the ~40 candidates left after the budget took 56 s)
            if measured >= opts.max_candidates:
                rec.legal, rec.legal_reason = None, "not analysed: max_candidates reached"
                rec.reason = f"not measured: max_candidates={opts.max_candidates} reached"
                continue
            covered = _subsumed(t, [*self.kept_before, *(k for k, _, _ in kept)])
            if covered:
                rec.legal, rec.legal_reason, rec.reason = None, "not analysed: subsumed", covered
                self.say(f"[optimize] {t.label}: {covered}")
                continue
            # with one kept already (a resumed search's plan counts), a candidate kept now pays only
            # in its combination with it: room is kept for that trial too
            combining = opts.combine and len(kept) + len(self.carried) >= 1
            if self.spent(rec, reserve_combination=combining):
                rec.legal, rec.legal_reason = None, "not analysed: the search budget is spent"
                continue
            rec.legal, rec.legal_reason = _legal(t, tree, ptree)
            if not rec.legal:
                rec.reason = f"illegal: {rec.legal_reason}"
                self.say(f"[optimize] {t.label}: {rec.reason}")
                continue
            if t.tolerance.learning_check and opts.learning_check is None:
                rec.reason = (
                    "not measured: kept only with a learning check (its tolerance says so) and none was "
                    "given (OptimizeOptions.learning_check; rose-jax train --learning-check-steps N)"
                )
                continue
            measured += 1
            self.measured = measured
            self.use_free_trial()
            res = self.trial(rec, [t], always_check=opts.check_slower)
            if res is not None and self.verdict(
                rec, res, res.base.median - res.cand.median, versus_plan=False
            ):
                if not self.learns_alike(rec, t, res):
                    continue
                if res.settled:  # what the step chose by measuring goes into the plan
                    t = transform_by_name(t.name, {**dict(t.params), **res.settled})
                    self.say(
                        f"[optimize] {rec.label}: measured {res.settled} recorded in the plan as {t.label}"
                    )
                kept.append((t, res.scaled_s, res.cmp))
                self.checkpoint(kept, [*cands[i + 1:], *pending])
        return kept

    def checkpoint(self, kept: list, rest: list[Candidate]) -> None:
        """The search so far into the plan cache, as if its budget ended here: the fastest kept
        (uncombined; a later resume combines them), the candidates not reached yet pending
        (:data:`BUDGET_SPENT`). A run cut later (a device call's limit, ^C, a crash) keeps what was
        measured: on PPO reacher (H100, 2026-12-06 17:25) a kept 1.73x candidate was lost when the
        run's limit cut the search before its end wrote the cache. ``_finish`` overwrites it."""
        opts = self.opts
        if not opts.cache_dir:
            return
        try:
            best, best_s, cmp = min([*kept, *self.carried], key=lambda k: k[1])
            plan = list(best) if isinstance(best, list) else [best]
            if not all(_jsonable_params(t) for t in plan):
                return
            snap = PlanReport.from_json(self.report.to_json())
            for cand in rest:
                t = cand.transform
                rec = CandidateRecord(t.label, t.to_json(), cand.window, cand.predicted, cand.model)
                rec.reason = BUDGET_SPENT
                snap.candidates.append(rec)
            self.record_plan(snap, plan, best_s, cmp)
            snap.search_time_s = time.perf_counter() - self.t_start
            snap.notes.append(
                f"checkpoint: written while the search ran ({len(self.report.candidates)} candidate(s) "
                "reached); the ones after are pending and a later search with a budget resumes them"
            )
            if not any(best is t for t, _, _ in self.carried):
                # a new plan replaces the cached one: the earlier combinations are tried again with
                # it (left pending), so every part of the cached plan comes back (_left's retry)
                for rec in snap.candidates:
                    if not _single(rec) and rec.reason != BUDGET_SPENT:
                        rec.reason, rec.kept = BUDGET_SPENT, False
            plan_cache.store(opts.cache_dir, self.key, {"plan": snap.plan, "report": snap.to_json()})
            self.checkpointed = True
        except Exception as e:  # noqa: BLE001 - a checkpoint that fails costs the search nothing
            self.say(f"[optimize] checkpoint not written: {_failure(e)}")

    def learns_alike(self, rec: CandidateRecord, t: Transform, res: _Trial) -> bool:
        """For a candidate kept under a tolerance with results not bitwise equal: the learning
        check (``learning_check``), recorded in ``rec``; False (not kept) when it fails."""
        if t.tolerance.exact or res.cmp is None or res.cmp.max_abs == 0.0:
            return True
        check = self.opts.learning_check
        # (a candidate whose tolerance needs a check is not measured without one: see the caller)
        if check is None or t.level != "fn":
            rec.learning_check = {"passed": None, "reason": "not run (no learning_check given)"}
            return True
        try:
            verdict = check(t)
            rec.learning_check = verdict.to_json()
            ok, why = bool(verdict.passed), verdict.reason
        except Exception as e:  # noqa: BLE001 - a failing check refuses the candidate, never the search
            ok, why = False, f"could not run: {_failure(e)}"
            rec.learning_check = {"passed": False, "reason": why}
        if not ok:
            rec.kept = False
            rec.reason = f"faster and within {t.tolerance.rtol:g} rtol, but the learning check failed: {why}"
        else:
            rec.reason += f"; learning check: {why}"
        self.say(f"[optimize] {rec.label}: learning check: {why}")
        return ok

    def record_plan(self, report: PlanReport, plan: list[Transform], best_s: float, cmp: Any) -> None:
        """``plan`` into ``report``: its transforms, time in baseline units, speedup over the
        baseline and comparison (``cmp`` None: nothing compared)."""
        report.plan = [t.to_json() for t in plan]
        report.optimized_s = best_s
        report.speedup = self.baseline / best_s if best_s else None
        report.equal = None if not plan else cmp.equal  # None: nothing kept, nothing compared
        if cmp is not None:
            report.max_abs_diff, report.max_rel_diff = cmp.max_abs, cmp.max_rel

    def expected_trial_s(self) -> float:
        """What the next trial is expected to take: the longest trial of this search so far (0 before
        the first; the first one that checks equality also builds the reference)."""
        return max(self.trial_walls, default=0.0)

    def spent(self, rec: CandidateRecord, reserve_combination: bool = False) -> bool:
        """Whether the search's budget is spent: a trial expected to take
        :meth:`expected_trial_s` (twice that with ``reserve_combination``: room left for the
        combination of what is kept) would not end before the deadline. Then ``rec`` is not
        measured and says why (a start gate alone let a reacher candidate begin 46 s before the
        budget's end and run 320 s past it, H100 2026-12-06 17:25). Never
        while ``free_trials`` are left (a resumed search's progress: one is used by a trial that
        runs, see :meth:`use_free_trial`, not by a candidate refused as illegal or subsumed, which
        costs no measurement: a resume on PPO reacher, H100 2026-12-06 17:29, spent its one free
        trial on an illegal bound_while_loops and measured nothing)."""
        if self.free_trials > 0:
            return False
        need = self.expected_trial_s() * (2 if reserve_combination else 1)
        if self.deadline is None or time.perf_counter() + need < self.deadline:
            return False
        rec.reason = BUDGET_SPENT
        note = STOPPED_EARLY
        if note not in self.report.notes:
            self.report.notes.append(note)
            self.say(f"[optimize] {note}")
        return True

    def use_free_trial(self) -> None:
        """A trial is about to run: one of the ``free_trials`` (if any) is used."""
        self.free_trial = self.free_trials > 0
        self.free_trials = max(0, self.free_trials - 1)

    def combine(self, kept: list) -> tuple[list[Transform], float, Any]:
        """Greedy combination of the kept candidates, fastest first (each trial re-validated)."""
        if not kept:
            return [], self.baseline, None
        kept = sorted(kept, key=lambda k: k[1])

        def parts(t):  # a kept item is a transform, or a resumed search's cached plan
            return list(t) if isinstance(t, list) else [t]

        plan, best_time, best_cmp = parts(kept[0][0]), kept[0][1], kept[0][2]
        for t, _, _ in kept[1:] if self.opts.combine else []:
            if any(_conflict(x, p) for x in parts(t) for p in plan):
                continue
            trial = plan + parts(t)
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
            self.report.candidates.append(rec)
            if self.spent(rec):
                break
            self.use_free_trial()
            res = self.trial(rec, trial, always_check=True)
            if res is not None and self.verdict(rec, res, best_time - res.scaled_s, versus_plan=True):
                plan, best_time, best_cmp = trial, res.scaled_s, res.cmp
        return plan, best_time, best_cmp


def _also_builds(program, fn: Callable, state: Any, opts: OptimizeOptions) -> list:
    """The builds of ``fn`` under each option set (``option_sets``) and the equality reference's
    (``fn`` under the equality options), for the profile to compile beside its pieces: the
    search then finds them in JAX's cache instead of compiling them after the profile. Only when
    profiled, and for a Program only with JAX's persistent compilation cache on (a Program's
    iteration is a new function per call: its build is found by its HLO in the persistent cache,
    not in the in-memory one; ``rose-jax train`` turns the persistent cache on)."""
    if opts.windows != "profile" or (program is not None and isolate.persistent_cache_dir() is None):
        return []
    eq = opts.resolved_equality_options()
    sets = [o for o in opts.resolved_option_sets().values() if o] + ([eq] if eq else [])
    return [(jax.jit(fn, compiler_options=o), (state,)) for o in sets]


# A search's least cost in iterations of the unit it optimizes, from PPO ant's 4.2 s epoch on the
# H100 (benchmarks/results/beyond_flags/, 2026-12-05 21:27): its profile took 109 s (26 units),
# the baseline's timings and the option trial about 12 units, one candidate 14-18 units (two
# compiles and its timed turns). A run whose share (``budget_share`` of ``run_units``) is
# smaller gets no search.
MIN_SEARCH_UNITS = 40


def _too_short(opts: OptimizeOptions, first_s: float) -> str | None:
    """Why the search is skipped (None: it runs): the budget is the run's share
    (``budget_share`` x ``run_units`` units, not an explicit ``budget_s``) and under
    :data:`MIN_SEARCH_UNITS` units."""
    if opts.run_units is None:
        return None
    share = opts.budget_share * opts.run_units
    if share >= MIN_SEARCH_UNITS or (opts.budget_s is not None and opts.budget_s < share * first_s):
        return None
    return (
        f"search skipped: the run's share for it ({opts.budget_share:.0%} of {opts.run_units} units, "
        f"{share * first_s:.3g} s at {first_s:.3g} s per unit) is under the {MIN_SEARCH_UNITS} units a "
        "profile, the option trial and one candidate take; the untransformed iteration is returned"
    )


def _options_context(base_options: dict | None) -> dict:
    """``generate_candidates``' ``base_options`` / ``options_saved_s`` from the report's record
    (nothing where no set was kept)."""
    if not base_options or base_options["name"] == "default":
        return {}
    name, ms = base_options["name"], base_options["ms_per_iter"]
    return {"base_options": name, "options_saved_s": (ms["default"] - ms[name]) / 1e3}


def concurrent_processes() -> bool | None:
    """Whether worker processes would run kernels concurrently with this one: on a GPU, True when
    this process is an MPS client (``CUDA_MPS_PIPE_DIRECTORY`` set), else False (time-sliced);
    None off the GPU."""
    if jax.default_backend() != "gpu":
        return None
    from rose_jax.mps.client import inherited_daemon

    return inherited_daemon() is not None


def resolve_windows(
    windows: Any,
    fn: Callable,
    state: Any,
    say: Callable[[str], None],
    also_compile: Sequence = (),
    repeats: int = 2,
) -> tuple[Any, dict]:
    """The windows the candidates follow and a JSON record of where they came from.

    ``"profile"`` profiles ``fn`` on ``state`` (component segments, 2 levels, NVML SM activity)
    and returns its low-activity windows; where no GPU / NVML can be sampled it says so and
    returns None (the LoopTree-only search) without profiling. The profile compiles
    ``jax.jit(fn)`` itself (so the search's baseline build afterwards is JAX's cached one) and
    ``also_compile`` (``(jitted fn, args)``, e.g. the equality reference's build) in its parallel
    compile pool. ``repeats``: the profile's timed passes (the search gives a long iteration 1)."""
    if windows is None:
        return None, {"source": "looptree", "reason": "no windows given: candidates for every loop by cost"}
    if windows != "profile":
        return windows, {"source": "given", "reason": f"{len(windows)} window(s) given"}
    ok, why = rp.available()
    if not ok:
        reason = f"windows='profile' but no SM activity can be sampled ({why}): LoopTree-only search"
        say(f"[optimize] {reason}")
        return None, {"source": "looptree", "reason": reason}
    t0 = time.perf_counter()
    say("[optimize] profiling the baseline (component segments, NVML SM activity) for its windows")
    # fn itself, not jax.jit(fn): the profile's fused build is then the one the search's
    # compile_step(fn) finds in JAX's cache (a jit of a jit is another program)
    tl = rp.profile(fn, state, levels=2, repeats=repeats, also_compile=also_compile)
    if tl.activity is None:
        reason = f"profile has no activity series ({tl.metadata.get('activity')}): LoopTree-only search"
        return None, {"source": "looptree", "reason": reason, "profile_s": time.perf_counter() - t0}
    found = rp.find_windows(tl)
    took = time.perf_counter() - t0
    compiled = tl.metadata.get("compile_s")
    if compiled is not None:  # where the profile's time goes (its compiles are most of it)
        pre = tl.metadata.get("precompile") or {}
        say(
            f"[optimize] profile took {took:.0f}s: compiling {pre.get('programs', '?')} programs on "
            f"{pre.get('threads', '?')} threads and a warm-up run {compiled:.0f}s, "
            f"timed runs {took - compiled:.0f}s"
        )
    # the timed components, so that predicted gains rest on measured shares of the iteration
    phases = [
        {"path": p.path, "level": p.level, "time_s": p.time_per_iteration_s}
        for p in rp.phase_idle_summary(tl)
    ]
    top = [
        {
            "path": w.path,
            "duration_s": w.duration_s,
            "idle_sm_seconds_per_iteration": w.idle_sm_seconds_per_iteration,
        }
        for w in found[:8]
    ]
    reason = f"{len(found)} low-activity window(s) from the profile ({why})"
    say(f"[optimize] {reason}")
    record = {"source": "profile", "reason": reason, "profile_s": took, "top": top}
    return found, {**record, "phases": phases}


def optimize(
    target: Callable | Program, example_state: Any, options: OptimizeOptions | None = None, /, **kwargs
):
    """Search for a faster, equal version of an iteration; see the module docstring.

    Args:
      target: an iteration ``state -> (state, metrics)`` (pure, jittable) or a ``Program``.
      example_state: the state to measure from (every timed run starts from it; not donated).
      options: an :class:`OptimizeOptions`; keyword arguments (its field names: ``windows``,
        ``candidates``, ``n_iters``, ``repeats``, ``cache_dir``, ...) build it or override its fields.

    Returns:
      ``(step, report)``: ``step`` is the optimized iteration, compiled (jitted unless it runs
      worker processes: then ``step.close()`` stops them); the untransformed one when nothing
      was kept. ``report`` is the :class:`~rose_jax.optimize.report.PlanReport`.
    """
    fields = {f.name for f in dataclasses.fields(OptimizeOptions)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"optimize: unknown option(s) {unknown}; known: {sorted(fields)}")
    opts = OptimizeOptions(**kwargs) if options is None else dataclasses.replace(options, **kwargs)
    t_start = time.perf_counter()
    if opts.log is not None:  # each line says when in the search it was written
        user_log = opts.log

        def log(line: str) -> None:
            user_log(line.replace("[optimize]", f"[optimize +{time.perf_counter() - t_start:.0f}s]", 1))

        opts = dataclasses.replace(opts, log=log)
    say = opts.log or (lambda s: None)
    program = target if isinstance(target, Program) else None
    base_fn = target.iteration() if program is not None else target
    if program is not None and program.host:
        raise ValueError(
            "optimize: the target already runs host-level processes; pass the single-process Program"
        )
    fp = plan_cache.fingerprint(base_fn, example_state)
    env_name = opts.env_name if opts.env_name is not None else (program.env_name if program else "")
    batch_size = opts.batch_size if opts.batch_size is not None else (program.num_envs if program else None)
    device = plan_cache.device_name()
    key = plan_cache.cache_key(fp, env_name, batch_size, device)
    sets = opts.resolved_option_sets()
    if sets:  # a plan searched over other option sets is another plan
        tried = json.dumps(sets, sort_keys=True, default=str).encode()
        key += "|options=" + hashlib.sha1(tried).hexdigest()[:12]
    name = program.name if program else getattr(base_fn, "__name__", "fn")
    report = PlanReport(name, fp, key, device, jax.__version__, opts.n_iters, opts.repeats, opts.equality)

    cached = plan_cache.lookup(opts.cache_dir, key)
    resume_failed = None
    left = _resumable(opts, cached) if cached is not None else None
    if left is not None:
        try:
            return _resume(target, example_state, opts, report, left, t_start)
        except Exception as e:  # noqa: BLE001 - a resume that fails leaves the cached plan, never the run
            resume_failed = f"resuming the cached search failed ({_failure(e)}); the cached plan as is"
            say(f"[optimize] {resume_failed}")
    if cached is not None:
        old = PlanReport.from_json(cached["report"])
        old.plan = cached["plan"]
        step = plan_of(target, old)
        old.cache_hit, old.measurements, old.search_time_s = True, 0, time.perf_counter() - t_start
        if not old.plan:
            old.equal = None  # (a report cached before empty plans said "not checked")
        old.cache_path = opts.cache_dir
        if resume_failed:
            old.notes.append(resume_failed)
        labels = [t.get("label") or t["name"] for t in old.plan]
        say(f"[optimize] cache hit for {name}: plan {labels or 'baseline'}")
        return step, old

    say(f"[optimize] {name}: compiling the baseline")
    search = _Search(target, example_state, opts, report, key=key, t_start=t_start)
    skip = _too_short(opts, search.first_s)
    if skip:  # the run cannot pay for a search: the untransformed step, nothing measured or cached
        report.skipped = skip
        report.notes.append(skip)
        report.search_time_s = time.perf_counter() - t_start
        say(f"[optimize] {skip}")
        return search.base_step, report
    # a long iteration is profiled in one pass, as it is timed one at a time (LONG_ITERATION_S):
    # on PPO ant's 3.9 s epoch (H200) the second pass cost about 35 of the profile's 73 timed seconds
    passes = 1 if search.first_s >= LONG_ITERATION_S else 2
    entries = None  # the plan cache's sibling and relative entries, where read already
    if opts.candidates is None and opts.windows == "profile" and rp.available()[0]:
        entries = siblings, relatives = _sibling_entries(opts, key, say)
        if _kept_single(siblings) or _kept_single(relatives):
            return _finish(search, _priors_first(search, base_fn, siblings, relatives, passes))
    also = _also_builds(program, base_fn, example_state, opts)
    windows, report.windows = resolve_windows(
        opts.windows, base_fn, example_state, say, also_compile=also, repeats=passes
    )
    say(f"[optimize] {name}: timing the baseline")
    search.time_baseline()
    n = search.opts.n_iters
    say(f"[optimize] {name}: baseline timed x2 ({opts.repeats} repeats of {n} iteration(s))")
    say(f"[optimize] baseline {search.baseline * 1e3:.3f} ms/iter, spread {search.spread * 1e3:.3f} ms")
    tree, ptree = search.start_measuring(base_fn)
    if opts.candidates is None:
        cands = _generate(search, tree, windows)
        cands = _order_by_siblings(cands, opts, key, report, say, entries)
    else:
        cands = [Candidate(t, "given", None, "given") for t in opts.candidates]
    return _finish(search, search.measure_candidates(cands, tree, ptree))


# What a profile costs, from the baseline's compile (and first call) and its unit: the profile
# compiles its pieces in a pool and runs them once (about 2.5x the baseline's compile), then times
# about 21 units per pass. Measured: PPO ant epoch, H200 2026-12-06 04:04 (compile 33 s, unit
# 3.4 s: 82 s + 73 s); PPO humanoid epoch, H100 06:53 (62 s, 4.7 s: 164 s + 94 s).
PROFILE_COMPILES = 2.5
PROFILE_UNITS_PER_PASS = 21


def _profile_estimate_s(compile_s: float, unit_s: float, passes: int) -> float:
    """The profile's expected wall seconds (see :data:`PROFILE_COMPILES`)."""
    return PROFILE_COMPILES * compile_s + PROFILE_UNITS_PER_PASS * passes * unit_s


def _generate(search: "_Search", tree: Any, windows: Any) -> list[Candidate]:
    """:func:`generate_candidates` for the search's unit: its baseline, families, the profile's
    phases (where the report has them), the baseline's option decision and the process mode."""
    report = search.report
    return generate_candidates(tree, search.program, search.baseline, windows, jax.default_backend(),
                               families=search.opts.families, phases=report.windows.get("phases"),
                               concurrent_processes=concurrent_processes(),
                               **_options_context(report.base_options))


def _priors_first(search: "_Search", base_fn: Callable, siblings: dict[str, dict],
                  relatives: dict[str, dict], passes: int) -> list:
    """A profiled search whose plan cache holds candidates kept by this program's search on another
    device or by a search of a like program (:func:`_sibling_first`'s tiers): those are measured
    first, before the profile, among the LoopTree's candidates (no windows: every loop by cost);
    the profile runs after them only where the budget left holds its estimate
    (:func:`_profile_estimate_s`) and one more trial, and its candidates not measured yet follow,
    as in a search without priors. Else the rest of the LoopTree's candidates follow in the budget
    left, and the report's ``windows`` says the profile was skipped and why. A first run of PPO ant
    on the H200 (2026-12-06 04:04) spent 156 s of its 402 s search on the profile before the
    evaluation's offload, which its relatives had kept; measured first, a budget that holds that
    trial no longer has to hold the profile too. Returns what :meth:`_Search.measure_candidates`
    returns."""
    opts, report, say = search.opts, search.report, search.say
    say(f"[optimize] {report.program}: timing the baseline (candidates kept on sibling devices or by "
        "like programs are measured before the profile)")
    search.time_baseline()
    say(f"[optimize] baseline {search.baseline * 1e3:.3f} ms/iter, spread {search.spread * 1e3:.3f} ms")
    tree, ptree = search.start_measuring(base_fn)
    loop = _generate(search, tree, None)
    first, rest, note = _sibling_tiers(loop, siblings, relatives)
    if note:  # (none where the labels they kept are not among this program's candidates)
        report.notes.append(f"{note}, before the profile")
        say(f"[optimize] {note}, before the profile")
    kept = search.measure_candidates(first, tree, ptree, pending=rest)
    estimate = _profile_estimate_s(search.compile_s, search.baseline, passes)
    left = None if search.deadline is None else search.deadline - time.perf_counter()
    if left is not None and left < estimate + search.expected_trial_s():
        why = (f"profile skipped: the budget left after the candidates measured first ({max(left, 0):.0f} s) "
               f"is under the profile's estimate ({estimate:.0f} s) and one more trial "
               f"({search.expected_trial_s():.0f} s); candidates for every loop by cost")
        report.windows = {"source": "looptree", "reason": why, "profile_estimate_s": estimate}
        say(f"[optimize] {why}")
        cands = rest
    else:
        also = [] if search.reference_built else _also_builds(search.program, base_fn, search.state, opts)
        windows, report.windows = resolve_windows(
            opts.windows, base_fn, search.state, say, also_compile=also, repeats=passes
        )
        report.windows["profile_estimate_s"] = estimate
        tried = {c.transform.label for c in first}
        cands = [c for c in _generate(search, tree, windows) if c.transform.label not in tried]
    return search.measure_candidates(cands, tree, ptree, search.measured, kept=kept)


def _sibling_entries(opts: OptimizeOptions, key: str,
                     say: Callable[[str], None]) -> tuple[dict[str, dict], dict[str, dict]]:
    """The plan cache's entries of this program on other devices and of other programs on this env
    and batch (either empty where the cache cannot be read: the order they give is a preference,
    never a reason to fail)."""
    def read(entries: Callable[[str | None, str], dict], whose: str) -> dict[str, dict]:
        try:
            return entries(opts.cache_dir, key)
        except Exception as e:  # noqa: BLE001 - one unreadable tier leaves the other
            say(f"[optimize] {whose} plans not read: {_failure(e)}")
            return {}

    return read(plan_cache.siblings, "sibling devices'"), read(plan_cache.relatives, "like programs'")


def _order_by_siblings(cands: list[Candidate], opts: OptimizeOptions, key: str, report: PlanReport,
                       say: Callable[[str], None],
                       entries: tuple[dict[str, dict], dict[str, dict]] | None = None) -> list[Candidate]:
    """:func:`_sibling_first` on :func:`_sibling_entries` (or ``entries``, where the caller read
    them already), with its note in the report and the log; ``cands`` as they are when there are
    none."""
    ordered, note = _sibling_first(cands, *(entries or _sibling_entries(opts, key, say)))
    if note:
        report.notes.append(note)
        say(f"[optimize] {note}")
    return ordered


def _kept_single(entries: dict[str, dict]) -> dict[str, tuple[float, str]]:
    """label -> (the best speedup, its device) of the single candidates ``entries`` (plan-cache
    entries) kept."""
    best: dict[str, tuple[float, str]] = {}
    for key, entry in entries.items():
        device = key.split("|")[3]
        report = entry.get("report") if isinstance(entry, dict) else None
        records = report.get("candidates") if isinstance(report, dict) else None
        for c in records if isinstance(records, list) else []:
            # a record not of this shape (hand-edited, another version's) is skipped, never fatal
            if not isinstance(c, dict) or not isinstance(c.get("label"), str):
                continue
            speedup = c.get("speedup")
            numeric = isinstance(speedup, (int, float)) and not isinstance(speedup, bool)
            single = isinstance(c.get("transform"), dict) and "name" in c["transform"]
            if c.get("kept") and single and numeric and speedup > best.get(c["label"], (0.0,))[0]:
                best[c["label"]] = (float(speedup), device)
    return best


def _sibling_first(cands: list[Candidate], siblings: dict[str, dict],
                   relatives: dict[str, dict] | None = None) -> tuple[list[Candidate], str | None]:
    """``cands`` with those kept by a search of the same program on another device
    (:func:`rose_jax.optimize.cache.siblings`) first, then those kept by a search of another program
    on the same env and batch (:func:`~rose_jax.optimize.cache.relatives`: e.g. the same PPO at
    another run length, whose epochs hold more or fewer training steps), each group fastest there
    first, the rest in their order; and a note naming them (None: no such candidate). Measured gains
    on a sibling GPU or a like program rank above this device's predictions: on PPO reacher (H100)
    the evaluation's offload, kept at 1.63-1.73x, was ranked third by its prediction, behind a 1.22x
    rewrite and a refused one. Each is still measured and checked here."""
    first, rest, note = _sibling_tiers(cands, siblings, relatives)
    return (first + rest, note) if first else (cands, None)


def _sibling_tiers(cands: list[Candidate], siblings: dict[str, dict], relatives: dict[str, dict] | None
                   ) -> tuple[list[Candidate], list[Candidate], str | None]:
    """:func:`_sibling_first`'s order in two parts: (the tiers' candidates, the rest in their order,
    the note; None where the tiers hold none)."""
    tiers = [(_kept_single(siblings), "as kept by this program's search on another device"),
             (_kept_single(relatives or {}), "as kept by a search of another program on this env and "
              "batch size (another run length or algorithm)")]
    first: list[Candidate] = []
    taken: set[int] = set()  # ids: a candidate moves once, with the first tier that kept it
    said: list[str] = []
    for best, why in tiers:
        mine = sorted((c for c in cands if c.transform.label in best and id(c) not in taken),
                      key=lambda c: -best[c.transform.label][0])
        if mine:
            first += mine
            taken.update(id(c) for c in mine)
            said.append(f"{why}: " + ", ".join(f"{c.transform.label} ({best[c.transform.label][0]:.3f}x "
                                                f"on {best[c.transform.label][1]})" for c in mine))
    rest = [c for c in cands if id(c) not in taken]
    return first, rest, ("measured first, " + "; then, ".join(said)) if first else None


def _single(c: CandidateRecord) -> bool:
    return "name" in c.transform  # a combination's record holds {"combination": [...]}


def _rebuild(t: dict) -> Transform:
    """A transform from its JSON (``Transform.to_json``: a cached plan's entry, a record's)."""
    return transform_by_name(t["name"], t.get("params", {}))


class _Left(NamedTuple):
    """What a cached search left undone (``OptimizeOptions.resume``): its report, its plan, the
    indexes of single candidates its budget left unmeasured (:data:`BUDGET_SPENT`), and the kept
    candidates outside its plan that no measured combination tried (record, transform)."""

    old: PlanReport
    plan: list[Transform]
    pending: list[int]
    retry: list[tuple[CandidateRecord, Transform]]


def _left(cached: dict, combine: bool) -> _Left:
    old = PlanReport.from_json(cached["report"])
    plan = [_rebuild(t) for t in cached["plan"]]
    pending = [i for i, c in enumerate(old.candidates) if c.reason == BUDGET_SPENT and _single(c)]
    retry = []
    if combine:  # kept ones the budget ended the combination phase before
        tried = {
            c.transform["combination"][-1].get("label")
            for c in old.candidates
            if not _single(c) and c.reason != BUDGET_SPENT and c.transform.get("combination")
        }
        for c in old.candidates:
            if c.kept and _single(c) and c.speedup and c.label not in tried:
                t = _rebuild(c.transform)
                if not any(_conflict(t, p) for p in plan):
                    retry.append((c, t))
    return _Left(old, plan, pending, retry)


def _resumable(opts: OptimizeOptions, cached: dict) -> _Left | None:
    """What a cache hit resumes (``OptimizeOptions.resume``; None: the cached plan as is): work its
    budget left, generated candidates, room under ``max_candidates``, and a budget here that is
    finite, above zero and pays for a search."""
    if not opts.resume or opts.candidates is not None:
        return None
    baseline = (cached.get("report") or {}).get("baseline_s")
    if baseline is None or opts.budget_s is None and opts.run_units is None:
        return None  # no limit asked for: the cached plan as is, never an open-ended search
    if not (opts.budget(baseline) or 0.0) > 0 or _too_short(opts, baseline) is not None:
        return None
    try:
        left = _left(cached, opts.combine)
    except Exception:  # noqa: BLE001 - an entry this version cannot read is used as it is
        return None
    # (a candidate whose isolated compile the budget's end cut is pending, not measured)
    measured = sum(1 for c in left.old.candidates
                   if _single(c) and c.stage != "legality" and c.reason != BUDGET_SPENT)
    return left if left.retry or (left.pending and measured < opts.max_candidates) else None


def _resume(target: Any, example_state: Any, opts: OptimizeOptions, report: PlanReport, left: _Left,
            t_start: float):
    """Go on with the search a cache entry's budget stopped (``OptimizeOptions.resume``): its
    pending candidates measured under its option decision (at least one, whatever the budget, so
    each resume makes progress), the kept ones combined with its plan and with its kept candidates
    no combination tried, the entry rewritten; ``(step, report)`` as :func:`optimize` returns."""
    say = opts.log or (lambda s: None)
    base_fn = target.iteration() if isinstance(target, Program) else target
    old, prior, pending, retry = left
    cands, earlier = [], []
    for i, c in enumerate(old.candidates):
        if i in pending:
            try:
                t = _rebuild(c.transform)
                cands.append(Candidate(t, c.window, c.predicted_gain_s, c.prediction))
                continue
            except Exception as e:  # noqa: BLE001 - a record this version cannot rebuild stays as it was
                c.reason = f"{BUDGET_SPENT}; not resumed: {_failure(e)}"
        if _single(c) or c.reason != BUDGET_SPENT:  # a combination the budget cut is tried again
            earlier.append(c)
    measured_before = sum(1 for c in earlier if _single(c) and c.stage != "legality")
    report.base_options, report.windows, report.candidates = old.base_options, dict(old.windows), earlier
    # the earlier baseline's reproducibility stands until this search's reference replaces it
    for f in ("reproducible", "repro_reason", "max_abs_diff", "max_rel_diff"):
        setattr(report, f"baseline_{f}", getattr(old, f"baseline_{f}"))
    report.notes = [
        f"search resumed on a cache hit: {len(cands)} candidate(s) its earlier budget left unmeasured and "
        f"{len(retry)} kept one(s) no combination tried (after {measured_before} measured in "
        f"{old.search_time_s:.0f} s then); the windows, candidate list and XLA option decision are the "
        "earlier search's"
    ]
    say(f"[optimize] {report.program}: resuming the cached search ({len(cands)} candidate(s) its budget "
        f"left unmeasured; plan so far {[t.label for t in prior] or 'baseline'})")
    options = (old.base_options or {}).get("options") or None
    search = _Search(target, example_state, opts, report, options=options, key=report.cache_key,
                     t_start=t_start)
    search.kept_before = [*prior, *(t for _, t in retry)]
    search.time_baseline(trial=False)
    say(f"[optimize] baseline {search.baseline * 1e3:.3f} ms/iter, spread {search.spread * 1e3:.3f} ms")
    for c, t in retry:  # kept earlier, never combined: at their earlier speedup over the baseline
        cmp = Comparison(c.equal is not False, c.max_abs_diff or 0.0, c.max_rel_diff or 0.0, "",
                         "its earlier search's comparison")
        search.carried.append((t, search.baseline / c.speedup, cmp))
    if prior and old.speedup:  # the cached plan, at its earlier measured speedup over the baseline
        cmp = Comparison(old.equal is not False, old.max_abs_diff or 0.0, old.max_rel_diff or 0.0, "",
                         "the cached plan's comparison (its earlier search)")
        search.carried.append((prior, search.baseline / old.speedup, cmp))
    tree, ptree = search.start_measuring(base_fn)
    search.free_trials = 1
    cands = _order_by_siblings(cands, opts, report.cache_key, report, say)
    kept = search.measure_candidates(cands, tree, ptree, measured=measured_before)
    return _finish(search, [*kept, *search.carried])


def _finish(search: _Search, kept: list):
    """A search's end: ``kept`` combined, the plan's quotas, the report filled in and the plan
    cached under the search's key; returns ``(step, report)`` as :func:`optimize` does."""
    target, opts, report, say, key = search.target, search.opts, search.report, search.say, search.key
    plan, best_time, best_cmp = search.combine(kept)
    plan = search.plan_quotas(plan)
    for q in report.quotas:  # the plan's time with the quotas applied, in baseline units
        if q["status"] == "applied" and q["e2e_without_s"]:
            best_time *= q["e2e_with_s"] / q["e2e_without_s"]

    if not search.reference_built and search.reference_error is None and best_cmp is None:
        report.notes.append(
            "equality not checked: no candidate was faster than the spread (check_slower=False)"
        )
    search.record_plan(report, plan, best_time, best_cmp)
    result = apply_plan(target, plan)
    report.search_time_s = time.perf_counter() - search.t_start
    if opts.cache_dir:
        if all(_jsonable_params(t) for t in plan):
            report.cache_path = plan_cache.store(
                opts.cache_dir, key, {"plan": report.plan, "report": report.to_json()}
            )
        else:
            report.notes.append("plan not cached: a transform has a callable parameter")
            if search.checkpointed:  # a checkpoint of a part of it is not the plan: gone
                plan_cache.remove(opts.cache_dir, key)
    say(
        f"[optimize] plan: {[t.label for t in plan] or 'baseline'}; speedup {report.speedup:.3f}x; "
        f"search {report.search_time_s:.1f}s"
    )
    return search.compile(result, plan), report
