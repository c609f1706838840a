"""XLA option sets: the one table of them (:data:`SETS`), and fast by default: the sets tried on
a run's first units, kept only when not slower.

:data:`SETS` names every XLA option set the library uses: ``rose-jax train --xla-options`` takes
its names, and ``split_compile`` (:mod:`rose_jax.optimize.split_compile`) measures each stage
under some of them. What the search keeps on nearly every GPU workload is such a set (command
buffers scheduled ``CONCURRENT``). ``rose-jax train`` applies it without ``--optimize``, through
:class:`TrialStep`:

1. The unit ``train`` runs per report (an iteration or an epoch) is traced and lowered once and
   compiled under the first candidate set, as the plain run compiles its one build; the other
   builds (``"default"`` = XLA's defaults, what the algorithm's own ``jax.jit`` builds, and the
   other candidates) compile in background threads (XLA releases the GIL) while the first build
   already trains, so the trial adds no compile time to the run's start. A set whose compile
   fails is refused, with the reason (the first one failing: the default build is compiled
   instead, at once).
2. The first units of the run go to the ready build with the fewest timed units (each unit timed
   to ``block_until_ready``) until every build has ``rounds``. They are the run's own units, not
   extra work: every build computes the same ``state -> (state, metrics)``, since an option set
   changes how XLA launches the kernels (CUDA-graph capture and its scheduling), not the HLO it
   fuses nor the arithmetic (checked bitwise under deterministic ops by the search on the H200,
   benchmarks/results/overlap/ and loops/).
3. The build with the lowest median time is kept for the rest of the run, unless it is not faster
   than ``default`` by ``margin`` (noise), and one line says what was kept and why.

On a CPU there is nothing to try (the sets are GPU options): the default build runs as before.
:func:`describe` gives the record ``run.json`` keeps (``xla_options``).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax

_COMMAND_BUFFER_ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
_COMMAND_BUFFER_NO_LOOPS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"

# The XLA option sets by name (GPU options; on a CPU nothing uses them). "concurrent_scheduling" is
# what an informed user sets globally (XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT:
# XLA's default command-buffer types, scheduled CONCURRENT); on the H200
# (benchmarks/results/default_options/, 2026-12-04) it ran PPO ant 4096's whole run at 1.11M
# env-steps/s against 1.03M with XLA's defaults, and Brax's SAC hopper high-update at 9,624 vs
# 6,846 (issue 30's measurement). "default": XLA's defaults. "concurrent": CUDA-graph command
# buffers for every command type, loops (WHILE/CONDITIONAL) captured too, scheduled CONCURRENT
# (independent kernels of a graph may run side by side): PPO ant 4096's learn 19.35 -> 16.00 ms on
# the H200. "concurrent_no_loops": the same without capturing loops (each loop iteration launches
# its graph from the host): what the search kept on SAC hopper and every MJX loops row
# (benchmarks/results/overlap/, loops/). "no_command_buffers": every kernel launched by the
# runtime (29.6 ms).
SETS: dict[str, dict[str, Any]] = {
    "concurrent_scheduling": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
    "default": {},
    "concurrent": {
        "xla_gpu_enable_command_buffer": _COMMAND_BUFFER_ALL,
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    },
    "concurrent_no_loops": {
        "xla_gpu_enable_command_buffer": _COMMAND_BUFFER_NO_LOOPS,
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    },
    "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
    # Scheduling modes of the command buffer besides CONCURRENT, for chains of small latency-bound
    # kernels (SAC's high-update learner): "CONCURRENT_REGIONS" and "LHS" (the latency-hiding
    # scheduler's order) are accepted by jaxlib 0.12.0 (checked on a CPU: a wrong name is an
    # "is not a valid enum value" error); a jaxlib without them refuses the set with that reason.
    # Not yet timed on the H200: searched per component by split_compile, not tried by default.
    "concurrent_regions": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT_REGIONS"},
    "lhs_scheduling": {"xla_gpu_command_buffer_scheduling_mode": "LHS"},
    # Fewer, larger kernels for small matmul chains (issue 32), each on top of CONCURRENT: Triton
    # GEMMs for every dot (XLA fuses their elementwise producers and consumers into the GEMM
    # kernel), cuBLASLt GEMMs (bias / activation epilogues fused), and the latency-hiding
    # scheduler. Timed by benchmarks/experiments/beyond_flags.py; not tried by default.
    "triton_gemm_any": {
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
        "xla_gpu_triton_gemm_any": True,
    },
    "cublaslt": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_gpu_enable_cublaslt": True},
    "latency_hiding": {
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
        "xla_gpu_enable_latency_hiding_scheduler": True,
    },
}
# The sets tried by default on a GPU, first to last.
DEFAULT_CANDIDATES = ("concurrent_scheduling", "concurrent_no_loops")
DEFAULT_ROUNDS = 3
# a candidate must beat the default build's median by this share to be kept (timing noise)
DEFAULT_MARGIN = 0.02


def schedules_concurrently(name: str | None) -> bool:
    """Whether the option set ``name`` of :data:`SETS` schedules command buffers ``CONCURRENT``
    (or ``CONCURRENT_REGIONS``): XLA then runs a graph's independent kernels side by side itself
    (False for XLA's defaults, None, or a name not in :data:`SETS`)."""
    mode = SETS.get(name or "", {}).get("xla_gpu_command_buffer_scheduling_mode")
    return mode in ("CONCURRENT", "CONCURRENT_REGIONS")


def candidate_sets(names: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
    """``{name: XLA options}`` to try besides the default build: the named sets of :data:`SETS`
    (default :data:`DEFAULT_CANDIDATES`), none on a CPU backend."""
    if jax.default_backend() != "gpu":
        return {}
    names = DEFAULT_CANDIDATES if names is None else names
    unknown = [n for n in names if n not in SETS]
    if unknown:
        raise ValueError(f"unknown XLA option set(s) {unknown}; known: {', '.join(SETS)}")
    return {n: SETS[n] for n in names if n != "default"}


def fastest(medians: dict[str, float], margin: float = DEFAULT_MARGIN) -> str:
    """The build to keep from per-unit medians by name (``"default"``: XLA's defaults): the
    fastest, unless it does not beat the default build's median by ``margin`` (noise); the
    default where there is nothing to compare. The one rule of the trial and the search."""
    base = medians.get("default")
    best = min(medians, key=medians.get) if medians else "default"
    if base is None or best == "default" or medians[best] > base * (1 - margin):
        return "default"
    return best


def reason(e: BaseException) -> str:
    """A failed build's reason in one line (at most 200 characters)."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


class TrialStep:
    """``state -> (state, metrics)`` that runs ``fn`` under the fastest of several XLA option sets.

    Args:
      fn: the unit, pure (``state -> (state, metrics)``).
      candidates: ``{name: compiler options}`` to try besides XLA's defaults (empty: the default
        build only, no trial). Tests may pass any options, e.g. an unknown flag to see a refusal.
      rounds: units run per build before deciding.
      margin: share by which a candidate must beat the default build's median.
      log: called once with the decision line.
      donate: donate the state argument (as the algorithms' own jit does; not on a CPU).
      cache_dir: the plan cache (``rose_jax.optimize.cache``, ``plans.json``). A decision is stored
        there under (the lowered program's text, the candidates, the GPU model, jax's version);
        a later run of the same program on the same kind of machine compiles only the kept build
        and runs no trial (one line says so; ``describe()["cached"]``). None: no cache.
    """

    def __init__(
        self,
        fn: Callable[[Any], tuple[Any, Any]],
        candidates: dict[str, dict[str, Any]],
        *,
        rounds: int = DEFAULT_ROUNDS,
        margin: float = DEFAULT_MARGIN,
        log: Callable[[str], None] = print,
        donate: bool | None = None,
        cache_dir: str | None = None,
    ):
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"TrialStep: rounds must be a positive int, got {rounds!r}")
        self.fn = fn
        self.candidates = dict(candidates)
        self.rounds = rounds
        self.margin = float(margin)
        self.log = log
        self.donate = (jax.default_backend() != "cpu") if donate is None else bool(donate)
        self.builds: dict[str, Callable] = {}
        self.refused: dict[str, str] = {}
        self.times: dict[str, list[float]] = {}
        self.chosen: str | None = None if self.candidates else "default"
        self.line: str | None = None
        self._order: list[str] = []
        self._pending: dict[str, Any] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.cache_dir = cache_dir
        self.cache_key: str | None = None
        self.cached: dict[str, Any] | None = None  # the stored decision this run reused
        self.trial_units = 0  # units run before the decision (timed or run beside compiles)

    # -------------------------------------------------------------------------- compiling
    def _lower(self, state: Any):
        """Traced and lowered once; each option set compiles this same lowering."""
        return jax.jit(self.fn, donate_argnums=(0,) if self.donate else ()).lower(state)

    def prepare(self, state: Any, wait: bool = False) -> None:
        """Compile the first build now, from ``state``'s shapes, and start the others' compiles
        in the background (the first call does it otherwise); ``wait``: until all are done."""
        if self.builds:
            if wait:
                self._harvest(wait=True)
            return
        lowered = self._lower(state)
        if not self.candidates:
            self.builds["default"] = lowered.compile()
            return
        if self.cache_dir and self._from_cache(lowered):
            return
        names = list(self.candidates)
        first = names[0]
        try:
            self.builds[first] = lowered.compile(compiler_options=self.candidates[first] or None)
        except Exception as e:  # a set this jaxlib or GPU does not take: refused, said why
            self.refused[first] = reason(e)
            self.builds["default"] = lowered.compile()
        rest = {n: self.candidates.get(n, {}) for n in ["default", *names[1:]] if n not in self.builds}
        self._order = ["default", *names]
        self.times = {n: [] for n in self.builds}
        if rest:
            self._pool = ThreadPoolExecutor(max_workers=len(rest), thread_name_prefix="xla-options")
            self._pending = {
                n: self._pool.submit(lowered.compile, compiler_options=opts or None)
                for n, opts in rest.items()
            }
        self._harvest(wait=wait)

    def _key(self, lowered: Any) -> str:
        import hashlib
        import json

        from rose_jax.optimize import cache

        import os

        import jaxlib

        text = lowered.as_text()
        sets = json.dumps(self.candidates, sort_keys=True, default=str)
        # what "default" means (global XLA flags) and the compiler itself are part of a decision
        context = f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}|jaxlib={getattr(jaxlib, '__version__', '?')}"
        digest = hashlib.sha256("\n".join((text, sets, context)).encode()).hexdigest()[:16]
        return "xla_options|" + cache.cache_key(digest, "-", None)

    def _from_cache(self, lowered: Any) -> bool:
        """Compile only the build a stored decision kept; False (run the trial) when there is none
        or its compile fails now."""
        from rose_jax.optimize import cache

        try:
            self.cache_key = self._key(lowered)
            entry = cache.lookup(self.cache_dir, self.cache_key)
        except (OSError, ValueError) as e:  # an unreadable cache: the trial runs, said why
            self.log(f"XLA options: plan cache not used ({reason(e)})")
            return False
        if not entry or entry.get("chosen") not in ("default", *self.candidates):
            return False
        chosen = entry["chosen"]
        try:
            self.builds[chosen] = lowered.compile(compiler_options=self.candidates.get(chosen) or None)
        except Exception:  # noqa: BLE001 - e.g. another jaxlib under the same version string
            return False
        self.chosen, self.cached = chosen, entry
        speed = entry.get("speedup")
        self.line = (
            f"XLA options: {chosen} kept (the decision cached on {entry.get('date', '?')}"
            + (f", {speed:.2f}x over the default build" if speed else "")
            + "; no trial)"
        )
        self.log(self.line)
        return True

    def _store(self, medians: dict[str, float]) -> None:
        from rose_jax.optimize import cache

        if not (self.cache_dir and self.cache_key) or "default" not in medians:
            return
        entry = {
            "chosen": self.chosen,
            "median_ms": {n: round(m * 1e3, 3) for n, m in medians.items()},
            "speedup": (
                round(medians["default"] / medians[self.chosen], 4) if self.chosen in medians else None
            ),
            "refused": dict(self.refused),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        try:
            cache.store(self.cache_dir, self.cache_key, entry)
        except (OSError, ValueError) as e:  # the decision holds for this run; a later one tries again
            self.log(f"XLA options: decision not cached ({reason(e)})")

    def _harvest(self, wait: bool = False) -> None:
        """Take the background compiles that have finished (all of them with ``wait``)."""
        for name, future in list(self._pending.items()):
            if not (wait or future.done()):
                continue
            del self._pending[name]
            try:
                self.builds[name] = future.result()
                self.times[name] = []
            except Exception as e:
                if name == "default":  # the algorithm's own jit would fail the same way
                    raise
                self.refused[name] = reason(e)
        if not self._pending and self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if not self._pending and len(self.builds) == 1:
            self._decide()

    # -------------------------------------------------------------------------- running
    def __call__(self, state: Any) -> tuple[Any, Any]:
        self.prepare(state)
        if self.chosen is not None:
            return self.builds[self.chosen](state)
        self._harvest()
        if self.chosen is not None:
            return self.builds[self.chosen](state)
        ready = [n for n in self._order if n in self.builds]
        name = min(ready, key=lambda n: len(self.times[n]))
        pending = bool(self._pending)
        t0 = time.perf_counter()
        out = jax.block_until_ready(self.builds[name](state))
        self.trial_units += 1
        if not pending:  # a unit run beside background compiles is not timed (it still trains)
            self.times[name].append(time.perf_counter() - t0)
        if not self._pending and all(len(self.times[n]) >= self.rounds for n in self.builds):
            self._decide()
        return out

    def _decide(self) -> None:
        medians = {n: statistics.median(t) for n, t in self.times.items() if t}
        base = medians.get("default")
        best = fastest(medians, self.margin)
        refused = "".join(f"; {n} refused ({why})" for n, why in self.refused.items())
        if best == "default":
            self.chosen = "default"
            if medians and base is not None and len(medians) > 1:
                others = ", ".join(f"{n} {medians[n] * 1e3:.1f} ms" for n in medians if n != "default")
                why = f"the default build {base * 1e3:.1f} ms per unit, {others}: not faster"
            else:
                why = "no option set to compare"
            self.line = f"XLA options: default build kept ({why}{refused})"
        else:
            self.chosen = best
            self.line = (
                f"XLA options: {best} kept ({medians[best] * 1e3:.1f} ms per unit vs "
                f"{base * 1e3:.1f} ms default, {base / medians[best]:.2f}x{refused})"
            )
        for name in list(self.builds):  # free what will not run again
            if name != self.chosen:
                del self.builds[name]
        self.log(self.line)
        self._store(medians)

    def describe(self) -> dict[str, Any]:
        """What ``run.json`` records: the chosen set, its options, the per-unit medians, refusals."""
        return {
            "chosen": self.chosen,
            "options": {} if self.chosen in (None, "default") else dict(self.candidates[self.chosen]),
            "tried": ["default", *self.candidates],
            "median_ms": {n: round(statistics.median(t) * 1e3, 3) for n, t in self.times.items() if t},
            "refused": dict(self.refused),
            "rounds": self.rounds,
            "trial_units": self.trial_units,
            "cached": self.cached is not None,
            **({"cached_decision": dict(self.cached)} if self.cached else {}),
        }


def trial_rounds(units: int, sets: dict[str, dict[str, Any]]) -> int:
    """Timed units per build of a run of ``units`` units trying ``sets``: up to
    :data:`DEFAULT_ROUNDS`, the trial's timed units at most a third of the run; 0 when even one
    round of every build (the default and each set) would exceed that (no trial then)."""
    builds = 1 + len(sets)
    return min(DEFAULT_ROUNDS, units // (3 * builds)) if sets else 0


def trial_maker(
    unit_fn: Callable[[Any], tuple[Any, Any]],
    units: int,
    sets: dict[str, dict[str, Any]],
    *,
    log: Callable[[str], None] = print,
    on_decide: Callable[[dict[str, Any]], None] | None = None,
    cache_dir: str | None = None,
) -> Callable[[Any], TrialStep]:
    """``make_step(state)`` for a training loop (``train_with_config(..., make_step=...)``): a
    :class:`TrialStep` of ``unit_fn`` over ``sets``, prepared on ``state``. ``units``: the units the
    run will take; the trial's timed units are at most a third of them (:func:`trial_rounds`; a
    run too short for one round of every build gets XLA's defaults and no trial).
    ``on_decide(describe())`` after the decision (e.g. to record it in ``run.json``)."""
    rounds = trial_rounds(units, sets)
    if rounds == 0:  # too short a run to decide: XLA's defaults, no background compiles
        sets = {}
        rounds = 1

    def make_step(state: Any) -> TrialStep:
        def decided(line: str) -> None:
            log(line)
            if on_decide is not None:
                on_decide(step.describe())

        step = TrialStep(unit_fn, sets, rounds=rounds, log=decided, cache_dir=cache_dir)
        step.prepare(state)
        return step

    return make_step


ENV_SETS = "ROSE_JAX_XLA_OPTION_SETS"


def sets_from_spec(spec: str) -> dict[str, dict[str, Any]]:
    """The candidate sets of ``rose-jax train --xla-options SPEC``: ``"auto"`` (the default
    candidates on a GPU, none on a CPU; ``$ROSE_JAX_XLA_OPTION_SETS``, a JSON object
    ``{name: {xla option: value}}``, replaces them, e.g. to try other sets), ``"default"`` (none:
    XLA's defaults, no trial) or comma-separated names of :data:`SETS`. One-line
    ValueError for anything else."""
    import json
    import os

    if spec == "default":
        return {}
    if spec == "auto":
        custom = os.environ.get(ENV_SETS)
        if custom:
            try:
                sets = json.loads(custom)
            except ValueError as e:
                raise ValueError(f"${ENV_SETS} is not JSON: {e}") from None
            if not isinstance(sets, dict) or not all(isinstance(v, dict) for v in sets.values()):
                raise ValueError(f"${ENV_SETS} must be a JSON object {{name: {{option: value}}}}")
            return {str(k): dict(v) for k, v in sets.items()}
        return candidate_sets()
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    if not names or any(n not in SETS for n in names):
        raise ValueError(f"--xla-options must be auto, default or names of {', '.join(SETS)}; got {spec!r}")
    return candidate_sets(names)


__all__ = [
    "trial_maker",
    "DEFAULT_CANDIDATES",
    "DEFAULT_MARGIN",
    "DEFAULT_ROUNDS",
    "ENV_SETS",
    "SETS",
    "TrialStep",
    "candidate_sets",
    "sets_from_spec",
]
