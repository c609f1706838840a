"""rose_jax.optimize: window-guided, result-preserving transformations of an RL iteration.

    from rose_jax import optimize
    program = optimize.ppo_program(config, env)              # or any state -> (state, metrics)
    step, report = optimize.optimize(program, state, windows=windows, cache_dir="plans/")
    print(optimize.format_report(report))

Transformations (``Transform``: ``legal(tree)``, ``apply(fn)``, ``tolerance``):
``unroll_scans``, ``hoist_invariants``, ``overlap_independent``, ``group_rollout`` and
``offload_component`` (a metrics-only component, e.g. the evaluation, in a worker process
behind the next call).
"""

from rose_jax.optimize.measure import Comparison, compare_trees
from rose_jax.optimize.offload import Deferred, OffloadedStep, offload_component, resolve, split_component
from rose_jax.optimize.program import (
    Lens,
    Program,
    ProgramSpec,
    ProgramTree,
    RolloutParts,
    attr_lens,
    check_collect,
    group_rollout,
    known_transforms,
    ppo_program,
    register_transform,
    sac_program,
    trace_program,
    transform_by_name,
)
from rose_jax.optimize.search import CandidateRecord, PlanReport, apply_plan, format_report, optimize
from rose_jax.optimize.transforms import (
    EXACT,
    FUSION_TOLERANCE,
    Tolerance,
    Transform,
    compose,
    hoist_invariants,
    invariant_eqns,
    overlap_independent,
    unroll_scans,
)

__all__ = [
    "EXACT",
    "FUSION_TOLERANCE",
    "CandidateRecord",
    "Deferred",
    "OffloadedStep",
    "Comparison",
    "Lens",
    "PlanReport",
    "Program",
    "ProgramSpec",
    "ProgramTree",
    "RolloutParts",
    "Tolerance",
    "Transform",
    "apply_plan",
    "attr_lens",
    "check_collect",
    "compare_trees",
    "compose",
    "format_report",
    "group_rollout",
    "hoist_invariants",
    "invariant_eqns",
    "known_transforms",
    "offload_component",
    "optimize",
    "overlap_independent",
    "ppo_program",
    "register_transform",
    "resolve",
    "sac_program",
    "split_component",
    "trace_program",
    "transform_by_name",
    "unroll_scans",
]
