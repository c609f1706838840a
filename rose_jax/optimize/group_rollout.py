"""Env-group pipelining of a Program's rollout: :func:`group_rollout`.

:func:`group_rollout` splits the env batch into ``G`` groups ("sequential": one rollout loop per
group, one after the other; "interleaved": one loop whose body steps every group, so XLA sees G
independent policy/sim chains side by side; "processes": each group's rollout runs in its own
worker process under MPS, :mod:`rose_jax.optimize.processes`). The results equal the single-batch
program's because per-env computations are independent and the randomness is drawn exactly as
the full batch draws it (:mod:`rose_jax.optimize.env_groups`); legality is checked on the
collect's jaxpr (:func:`check_collect`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from rose_jax.jaxpr import dataflow
from rose_jax.optimize import processes
from rose_jax.optimize.base import FUSION_TOLERANCE, Transform
from rose_jax.optimize.env_groups import (  # noqa: F401 - ProgramTree, trace_program: re-exported
    ProgramTree,
    collect_group,
    merge_data,
    merge_states,
    split_envs,
    take_group,
    trace_program,
)
from rose_jax.optimize.predict import ASSUMED_IDLE_SHARE, Candidate, CandidateContext
from rose_jax.program import Program

# ------------------------------------------------------------------------------ collects


def sequential_collect(program: Program, groups: int) -> Callable:
    """One rollout loop per env group, one after the other, in one program."""

    def collect(state):
        outs = [
            collect_group(program, s, g, groups) for g, s in enumerate(split_envs(program, state, groups))
        ]
        return merge_states(program, [o[0] for o in outs]), merge_data(program, [o[1] for o in outs])

    return collect


def interleaved_collect(program: Program, groups: int) -> Callable:
    """One rollout loop whose body steps all env groups: G independent policy/sim chains per step.

    In a step, group g's policy and group g-1's sim are independent equations in one loop body,
    so XLA may schedule and fuse them side by side (software pipelining across groups). On one
    GPU stream this changes scheduling and fusion, not concurrency.
    """
    parts = program.rollout
    if parts is None:
        raise ValueError(f"program {program.name!r} has no RolloutParts: interleaving needs a per-step body")
    n = program.num_envs // groups

    def collect(state):
        consts, carry, xs = parts.start(state)
        carries = [jax.tree.map(lambda x, g=g: take_group(x, 0, g, n), carry) for g in range(groups)]

        def body(cs, x):
            outs = [parts.step(consts, c, x, g, groups) for g, c in enumerate(cs)]
            return [o[0] for o in outs], jax.tree.map(
                lambda *ys: jnp.concatenate(ys, axis=0), *[o[1] for o in outs]
            )

        carries, ys = jax.lax.scan(body, carries, xs, length=parts.length)
        carry = jax.tree.map(lambda *cs: jnp.concatenate(cs, axis=0), *carries)
        return parts.finish(state, carry, ys)

    return collect


# ------------------------------------------------------------------------------- legality


def check_collect(ptree: ProgramTree) -> tuple[bool, str]:
    """Is ``collect`` per-env independent? (structure only; the search also compares results).

    1. Every output that is not env-batched (a state leaf outside the env lens, a data leaf with
       env axis None) must not depend on the env batch: otherwise collect reduces over envs (an
       obs normalizer or a metric updated inside the rollout) and must move that to ``learn``.
    2. The ``sim`` component writes only env-batch leaves.
    """
    tree = ptree.tree
    dep = dataflow.tainted_outputs(tree.jaxpr, ptree.env_inputs)
    paths = list(tree.output_paths) or [f"out[{i}]" for i in range(len(dep))]
    bad = [p for p, d, e in zip(paths, dep, ptree.env_outputs, strict=True) if d and not e]
    if bad:
        shown = ", ".join(bad[:4]) + (f" +{len(bad) - 4} more" if len(bad) > 4 else "")
        return False, (
            f"collect reduces over envs into {shown} (not per-env): move that reduction "
            "(e.g. the obs normalizer or a metric) from collect to learn"
        )
    env_paths = {p for p, e in zip(tree.input_paths, ptree.env_inputs, strict=True) if e}
    for node in tree.walk():
        if node.kind == "component" and node.name == "sim":
            outside = sorted(w for w in node.writes if w not in env_paths)
            if outside:
                return False, f"component sim writes {', '.join(outside[:4])}, which are not env-batch leaves"
    return True, "collect's shared outputs do not depend on the env batch; sim writes only env leaves"


# --------------------------------------------------------------------------- group_rollout

GROUP_MODES = ("sequential", "interleaved", "processes")

# Each group's policy network runs on N/G rows instead of N: the matmul library may pick another
# kernel (blocking, split-K) for another row count and round the last bit differently; RL training
# amplifies last-bit differences over iterations. Everything else is per env and bitwise equal.
GROUP_TOLERANCE = dataclasses.replace(
    FUSION_TOLERANCE,
    reason="per-group matmuls over N/G rows may use other GEMM kernels (reduction blocking): "
    "last-bit differences, amplified over training iterations; per-env physics is unchanged",
)


def group_rollout(
    groups: int, mode: str = "sequential", *, quotas: tuple[int, ...] | None = None
) -> Transform:
    """Split the env batch into ``groups`` groups for the rollout (see the module docstring).

    ``apply(program) -> program``. ``quotas`` (processes mode): SM percent per worker.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 2:
        raise ValueError(f"group_rollout: groups must be an int >= 2, got {groups!r}")
    if mode not in GROUP_MODES:
        raise ValueError(f"group_rollout: mode must be one of {GROUP_MODES}, got {mode!r}")

    def legal(ptree):
        if not isinstance(ptree, ProgramTree):
            return (
                False,
                "group_rollout needs a Program (trace it with rose_jax.optimize.group_rollout.trace_program)",
            )
        program = ptree.program
        if program.host:
            return False, "the program's collect already runs in worker processes"
        if program.groups > 1:
            return False, f"the program's rollout is already split into {program.groups} groups"
        if program.num_envs % groups:
            return False, f"num_envs={program.num_envs} is not divisible by groups={groups}"
        ok, why = check_collect(ptree)
        if not ok:
            return False, why
        if mode == "interleaved" and program.rollout is None:
            return False, "interleaved mode needs the program's RolloutParts (a per-step body)"
        if mode == "processes":
            if program.spec is None:
                return False, "processes mode needs a ProgramSpec so that workers can rebuild the program"
            ok, reason = processes.available()
            if not ok:
                return False, reason
        return True, why

    def apply(program: Program) -> Program:
        if not isinstance(program, Program):
            raise ValueError(
                f"group_rollout applies to a rose_jax.program.Program, got {type(program).__name__}"
            )
        if program.num_envs % groups:
            raise ValueError(
                f"group_rollout: num_envs={program.num_envs} is not divisible by groups={groups}"
            )
        if mode == "sequential":
            collect = sequential_collect(program, groups)
        elif mode == "interleaved":
            collect = interleaved_collect(program, groups)
        else:
            collect = processes.ProcessCollect(program, groups, quotas=quotas)
            return program._replace(collect=collect, host=True, groups=groups, mode=mode)
        return program._replace(collect=collect, groups=groups, mode=mode)

    params = (("groups", groups), ("mode", mode)) + ((("quotas", quotas),) if quotas else ())
    return Transform(
        "group_rollout",
        params,
        GROUP_TOLERANCE,
        "program" if mode != "processes" else "host",
        legal,
        apply,
        summary=f"rollout in {groups} env groups ({mode})",
        needs_program_tree=True,
        regroups_envs=True,
        worker_quotas="even" if mode == "processes" else "",
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """For a single-process Program with one env group: its rollout (the ``rollout`` or
    ``collect`` component) in each of ``ctx.group_sizes`` groups that divide ``num_envs``, in each
    of ``ctx.group_modes``. Model: env groups in processes reclaim ``(1 - 1/G)`` of the rollout
    window's idle SM-seconds (profiled, else :data:`~rose_jax.optimize.predict.ASSUMED_IDLE_SHARE`
    of its time); interleaving in one process a tenth of that (one stream only changes scheduling).
    """
    program, tree = ctx.program, ctx.tree
    if program is None or program.groups != 1:
        return []
    rollout = [n for n in tree.walk() if n.kind == "component" and n.name in ("rollout", "collect")]
    if not rollout:
        return []
    node = rollout[0]
    idle = ctx.idle_for(node)
    rollout_s = ctx.baseline_s * ctx.time_share(node)
    assumed = idle is None
    idle = rollout_s * ASSUMED_IDLE_SHARE if idle is None else idle
    src = f"assumed {ASSUMED_IDLE_SHARE:.0%} idle SMs" if assumed else "profiled idle SM-seconds"
    out = []
    for g in ctx.group_sizes:
        if program.num_envs % g:
            continue
        for mode in ctx.group_modes:
            factor = (1.0 - 1.0 / g) * (1.0 if mode == "processes" else 0.1)
            out.append(
                Candidate(
                    group_rollout(g, mode),
                    node.name,
                    idle * factor,
                    f"{src} of {node.name} x {factor:.2f}",
                )
            )
    return out
