"""The optimizer's contract: :class:`Tolerance`, :class:`Transform`, :func:`compose`, :class:`HostStep`.

Every transformation family (``scans``, ``group_rollout``, ``offload``, ...) builds on this
module and the optimizer's shared layers (``interpret``, ``where``, ``predict``, ...), never on
another family or on the search, the way optax's transformations build on its ``base``.

A :class:`Transform` is frozen data (``name``, ``params``, ``tolerance``, ``level``) plus two
pure functions:

* ``legal(tree) -> (ok, reason)``: decided from the :class:`rose_jax.trace.LoopTree` of the
  program (loop structure, read/write sets; the tree's jaxpr where equations matter);
* ``apply(fn) -> fn``: the transformed function. ``level="fn"`` transforms are jaxpr rewrites
  (``rose_jax.optimize.interpret``) and compose with ``jax.jit`` / ``vmap`` / ``grad``; given a
  :class:`rose_jax.program.Program` they rewrite its ``collect`` and ``learn``.
  ``level="program"`` transforms take and return a ``Program``; ``level="host"`` ones return a
  :class:`HostStep` (several processes), which cannot be jitted.

``tolerance`` says how close the transformed program's results must be to the original's:
``Tolerance(0, 0)`` means bitwise equality is expected; otherwise ``rtol``/``atol`` and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from rose_jax.program import Program

LEVELS = ("fn", "program", "host")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far results may move: ``|a - b| <= atol + rtol * max|b|`` in every float leaf (scaled by
    the leaf's largest magnitude, see :func:`rose_jax.compare.compare_trees`); int, bool
    and key leaves must be identical. ``reason`` says why the transform needs it."""

    rtol: float = 0.0
    atol: float = 0.0
    reason: str = "bitwise equal: the same operations on the same inputs in the same order"
    # the stepwise tolerance alone does not decide: a plan whose results are not bitwise equal is
    # kept only if it also learns alike (``OptimizeOptions.learning_check``)
    learning_check: bool = False

    @property
    def exact(self) -> bool:
        return self.rtol == 0.0 and self.atol == 0.0

    def to_json(self) -> dict:
        out = {"rtol": self.rtol, "atol": self.atol, "reason": self.reason}
        if self.learning_check:
            out["learning_check"] = True
        return out


EXACT = Tolerance()

# Same operations, but XLA compiles a differently shaped program: it may fuse across unrolled
# steps / hoisted values differently, and a different fusion can contract a*b+c into an FMA or
# not (GPU), changing the last bit; RL training amplifies last-bit changes over iterations.
FUSION_TOLERANCE = Tolerance(
    rtol=1e-4,
    atol=0.0,
    reason="same operations in the same order, but XLA may fuse the rewritten loop differently "
    "(FMA contraction, fusion boundaries): last-bit differences, amplified over training iterations",
)


# Issue 32's reassociation tolerance: only the order of floating-point operations changes (regions
# on their own streams, batched reductions), but RL training amplifies the last-bit differences
# over a whole iteration of updates (PPO's policy/value regions: max |diff| 2.2e-3 after one
# iteration on the H200). Per-leaf rtol 1e-2 of the leaf's largest magnitude, AND a learning check.
REASSOCIATION_TOLERANCE = Tolerance(
    rtol=1e-2,
    atol=0.0,
    reason="only the order of floating-point operations changes; training amplifies the last-bit "
    "differences over an iteration's updates, so the plan is kept only if it also learns alike "
    "(>= 5 seeds per side: final returns not different at 5 %, means within 5 %)",
    learning_check=True,
)


def loosest(tolerances: Sequence[Tolerance], reason: str = "loosest of the combined") -> Tolerance:
    """The tolerance that admits every one of ``tolerances`` (largest ``rtol`` and ``atol``; a
    learning check when any needs one)."""
    return Tolerance(
        max(t.rtol for t in tolerances),
        max(t.atol for t in tolerances),
        reason,
        any(t.learning_check for t in tolerances),
    )


WORKER_QUOTAS = ("", "even", "probe")


@dataclasses.dataclass(frozen=True)
class Transform:
    """One candidate transformation (see the module docstring).

    ``params`` is a tuple of ``(name, value)`` pairs (JSON-able values); ``level`` is
    ``"fn"``, ``"program"`` or ``"host"``.

    What the search and the quota step need to know about a transform, declared by its family
    (so that they never ask for a transform by name):

    * ``wraps_iteration``: ``apply`` wraps the whole iteration in a host step of its own
      (offload_component, split_compile): applied after every other transform of a plan, and two
      such transforms never share a plan;
    * ``needs_program_tree``: ``legal`` is decided on the Program's ProgramTree
      (:func:`rose_jax.optimize.env_groups.trace_program`: its collect's LoopTree with env masks)
      instead of the iteration's LoopTree, and ``apply`` needs a Program;
    * ``regroups_envs``: ``apply`` splits the Program's env batch into groups: the search compares
      its collected data with the full batch's when it times the collect alone, and env groups in
      worker processes (``level="host"``) are checked for equality only when faster (the check
      would recompile every worker's rollout under the equality options);
    * ``worker_quotas``: how the SM quotas of its concurrent worker processes are chosen
      (:mod:`rose_jax.optimize.quotas`): ``""`` none run; ``"even"``: param ``groups`` identical
      workers, the even split, written as param ``quotas``; ``"probe"``: ``quota_branches(fn,
      state)`` gives the driver's and the worker's branches, each timed alone at a few quotas,
      the worker's chosen quota written as param ``quota``;
    * ``chooses_options``: ``apply``'s step compiles its programs with XLA options it chooses
      itself (split_compile measures them per stage): the search's base option set
      (``OptimizeOptions.option_sets``) is not imposed on a plan that holds it.
    """

    name: str
    params: tuple[tuple[str, Any], ...]
    tolerance: Tolerance
    level: str
    legal_fn: Callable[[Any], tuple[bool, str]] = dataclasses.field(compare=False, repr=False)
    apply_fn: Callable[[Any], Any] = dataclasses.field(compare=False, repr=False)
    summary: str = dataclasses.field(default="", compare=False)
    wraps_iteration: bool = dataclasses.field(default=False, compare=False)
    needs_program_tree: bool = dataclasses.field(default=False, compare=False)
    regroups_envs: bool = dataclasses.field(default=False, compare=False)
    worker_quotas: str = dataclasses.field(default="", compare=False)
    chooses_options: bool = dataclasses.field(default=False, compare=False)
    quota_branches: Callable[[Any, Any], Sequence[Any]] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"Transform {self.name!r}: level must be one of {LEVELS}, got {self.level!r}")
        if self.worker_quotas not in WORKER_QUOTAS:
            raise ValueError(
                f"Transform {self.name!r}: worker_quotas must be one of {WORKER_QUOTAS}, "
                f"got {self.worker_quotas!r}"
            )
        if (self.worker_quotas == "probe") != (self.quota_branches is not None):
            raise ValueError(f"Transform {self.name!r}: worker_quotas='probe' goes with quota_branches")

    def legal(self, tree: Any) -> tuple[bool, str]:
        """``(True, why it is safe)`` or ``(False, why not)`` for the program traced as ``tree``."""
        try:
            ok, reason = self.legal_fn(tree)
        except ValueError as e:
            return False, f"{self.name}: {e}"
        return bool(ok), str(reason)

    def apply(self, fn: Any) -> Any:
        """The transformed function (``level='fn'``: also accepts a :class:`Program`)."""
        if self.level == "fn" and isinstance(fn, Program):
            return fn.map_pieces(self.apply_fn)
        return self.apply_fn(fn)

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={short(v)}" for k, v in self.params)
        return f"{self.name}({args})"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "label": self.label,
            "params": {k: jsonable(v) for k, v in self.params},
            "level": self.level,
            "tolerance": self.tolerance.to_json(),
            "summary": self.summary,
        }


def short(v: Any) -> str:
    """A parameter value for a label: a callable's name, else its ``repr``."""
    if callable(v):
        return getattr(v, "__name__", "fn")
    return repr(v)


def jsonable(v: Any) -> Any:
    """A parameter value as JSON (tuples become lists, callables their names)."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [jsonable(x) for x in v]
    return short(v)


def compose(transforms: Sequence[Transform]) -> Callable[[Any], Any]:
    """``fn -> t_n(...t_1(fn))``: apply ``transforms`` in order."""

    def apply(fn):
        for t in transforms:
            fn = t.apply(fn)
        return fn

    return apply


# ------------------------------------------------------------------------- host-level steps


class HostStep:
    """A host-level piece of an iteration: jitted parts plus worker processes (not jittable).

    What the search, the benchmarks and the CLI call on a host-level step (an offloaded epoch,
    a multi-process collect or the iteration built around one). The defaults describe a step
    with nothing in flight and nothing resident: subclasses override what they hold.

    * ``drain(keep_last=0)``: wait for work still running in workers (its time counts in a timed
      run), all but that of the newest ``keep_last`` calls;
    * ``pipelined``: True when a call returns some metrics before they are computed (a worker
      finishes them behind the next call): a caller that reads call k's metrics after dispatching
      call k+1, as ``algos.driver`` does, overlaps that work with the next call, and the search
      times such a step that way (:func:`rose_jax.optimize.measure.time_repeats`);
    * ``sync_state(state)``: the full state (an env state resident in workers fetched back);
    * ``stats()``: what moved between processes (JSON-able dict);
    * ``close()``: stop the worker processes (and an MPS daemon the step started);
    * ``with_compiler_options(options)``: the same step compiled with other XLA options;
    * ``measured_params()``: parameters of the transform that built it which the step settled by
      measuring on its first call (e.g. split_compile's per-stage XLA options): the search writes
      them into the plan, so that applying the plan again (or from the plan cache) measures nothing;
    * ``comparable(out)``: an output of this step, or of the untransformed piece it replaces, in
      one form the two can be compared in (a collect whose env state stays in its workers: synced,
      and data leaves the learn does not read dropped alike).
    """

    host = True
    pipelined = False

    def __call__(self, state: Any) -> Any:
        raise NotImplementedError

    def drain(self, keep_last: int = 0) -> None:
        return None

    def sync_state(self, state: Any) -> Any:
        return state

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        return None

    def with_compiler_options(self, compiler_options: dict | None) -> "HostStep":
        raise ValueError(f"{type(self).__name__} cannot be compiled with compiler options")

    def measured_params(self) -> dict:
        return {}

    def comparable(self, out: Any) -> Any:
        return out

    def __enter__(self) -> "HostStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def drain(step: Any, keep_last: int = 0) -> None:
    """Wait for a host step's work in flight, all but that of its newest ``keep_last`` calls (no-op
    for a jitted step)."""
    if isinstance(step, HostStep):
        step.drain(keep_last)


def synced(step: Any, state: Any) -> Any:
    """``state`` in full: a host step's resident env state fetched back (as is for anything else)."""
    return step.sync_state(state) if isinstance(step, HostStep) else state


def close(target: Any) -> None:
    """Stop the worker processes of a host step or of a Program whose collect is one (else no-op)."""
    if isinstance(target, Program):
        target = target.collect
    if isinstance(target, HostStep):
        target.close()
