"""rose_jax.optimize: window-guided, result-preserving transformations of an RL iteration.

    from algos import ppo
    from rose_jax import optimize
    program = ppo.program(config, env)                       # or any state -> (state, metrics)
    step, report = optimize.optimize(program, state, windows=windows, cache_dir="plans/")
    print(optimize.format_report(report))

The contract is :mod:`rose_jax.optimize.base` (``Transform``: ``legal(tree)``, ``apply(fn)``,
``tolerance`` and what the search needs to know about it; ``HostStep``); one module per
transformation family, each with its own ``candidates(ctx)``: :mod:`~.scans` (``unroll_scans``,
``hoist_invariants``), :mod:`~.hoist` (``hoist_independent``: a loop's carry-independent work
as its own recurrence and one batched pass ahead of it), :mod:`~.inplace` (``update_in_place``:
a loop's reads of its old carry ordered before the updates that overwrite it, so XLA stops
copying the carry every step), :mod:`~.twins` (``batch_twins``: two same-shaped independent
networks of a loop body, SAC's twin critics, run as one vmap with their weights carried
stacked), :mod:`~.dense_chains` (``fuse_dense_chains``: a chain of dense layers of a loop body, an
MLP's forward pass or its input gradient, as one Pallas kernel per block of rows),
:mod:`~.early_exit` (``exit_idle_loops``: a fixed-length scan that idles once a carried flag is
all false, MJX's line search, stopped there), :mod:`~.stack_carry` (``stack_carries``: a scan's
small written carried values of one dtype and shape carried as one stacked array, so XLA copies a
group once where it copied each member every step), :mod:`~.fuse` (``overlap_independent``), :mod:`~.offload`
(``offload_component``: a metrics-only component, e.g. the evaluation, in a worker process
behind the next call), :mod:`~.group_rollout` (env groups, in one process or in worker
processes via :mod:`~.processes`), :mod:`~.split_compile` (per-component compilation with
measured XLA options), :mod:`~.stream_overlap` (regions of a loop body on their own GPU
streams), :mod:`~.loops` (``bound_while_loops``). :mod:`~.registry` lists the families and
names their transforms for cached plans and workers; :mod:`~.candidates` asks every family;
:mod:`~.search` measures the candidates and logs them (:mod:`~.report`).
"""

from rose_jax.compare import Comparison, compare_trees
from rose_jax.optimize.base import EXACT, FUSION_TOLERANCE, HostStep, Tolerance, Transform, compose
from rose_jax.optimize.dense_chains import find_chains, fuse_dense_chains
from rose_jax.optimize.early_exit import exit_idle_loops, idle_flag
from rose_jax.optimize.fuse import overlap_independent
from rose_jax.optimize.env_groups import ProgramTree, trace_program
from rose_jax.optimize.group_rollout import check_collect, group_rollout
from rose_jax.optimize.hoist import hoist_independent, split_scan
from rose_jax.optimize.inplace import split_tail, update_in_place
from rose_jax.optimize.offload import Deferred, OffloadedStep, offload_component, resolve
from rose_jax.optimize.registry import known_transforms, register_transform, transform_by_name
from rose_jax.optimize.report import CandidateRecord, PlanReport, format_report
from rose_jax.optimize.scans import hoist_invariants, invariant_eqns, unroll_scans
from rose_jax.optimize.search import OptimizeOptions, apply_plan, compile_step, optimize, plan_of
from rose_jax.optimize.stack_carry import carry_groups, stack_carries
from rose_jax.optimize.twins import batch_twins, find_twins

__all__ = [
    "EXACT",
    "FUSION_TOLERANCE",
    "CandidateRecord",
    "Comparison",
    "Deferred",
    "HostStep",
    "OffloadedStep",
    "OptimizeOptions",
    "PlanReport",
    "ProgramTree",
    "Tolerance",
    "Transform",
    "apply_plan",
    "batch_twins",
    "carry_groups",
    "check_collect",
    "compare_trees",
    "compile_step",
    "compose",
    "exit_idle_loops",
    "find_chains",
    "find_twins",
    "format_report",
    "fuse_dense_chains",
    "group_rollout",
    "hoist_independent",
    "hoist_invariants",
    "idle_flag",
    "invariant_eqns",
    "known_transforms",
    "offload_component",
    "optimize",
    "overlap_independent",
    "plan_of",
    "register_transform",
    "resolve",
    "split_scan",
    "split_tail",
    "stack_carries",
    "trace_program",
    "transform_by_name",
    "unroll_scans",
    "update_in_place",
]
