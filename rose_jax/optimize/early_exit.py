"""exit_idle_loops: a fixed-length scan that idles once a carried flag is all false, run as a while
loop that stops there.

Why: MuJoCo MJX's constraint-solver line search (``mujoco.mjx._src.solver._while_loop_scan``) is a
``lax.scan`` of ``opt.ls_iterations`` steps (50) whose step is ``lax.cond(flag, iterate, no-op)``,
so that it traces under ``jit`` and differentiates. Under ``vmap`` (one flag per environment) JAX
turns that ``cond`` into a ``select``: every one of the 50 steps computes the line-search iteration
for every environment, converged or not, and XLA cannot know that the tail does nothing. In the
published SAC hopper iteration this scan runs inside the solver's while loop of every physics
frame (``collect/sim``: 4 frames x up to 4 solver iterations x 50 steps), and it holds most of the
physics' kernels; PPO's MJX rollouts run the same.

What: a scan whose body, with one of its boolean carries known to be all ``False``, returns every
carry unchanged (and that flag still all ``False``) is *idle* from the first step at which the flag
is all false: every later step is the identity. :func:`idle_flag` proves this on the body's jaxpr
by a small symbolic evaluation (constants, ``select_n`` with a known predicate, values that are a
carry passed through), never by running it. The rewrite runs the body, ``check_every`` steps at a
time (an inner scan), in a ``while_loop`` that continues while the flag has a true entry and steps
remain; ``check_every`` divides the length, so no step beyond it ever runs.

Legality: the scan has no ``xs`` and no ``ys`` (a carry-only loop), its body has no effects, and
:func:`idle_flag` finds the flag; candidates that are not are refused with the reason.
Tolerance: the steps that run are the same operations on the same values in the same order, and
the skipped ones are the identity, so results are equal; XLA compiles the body inside a different
loop and may fuse it differently, hence :data:`~rose_jax.optimize.base.FUSION_TOLERANCE` (the
equality check shows bitwise per program). On a GPU the while loop copies its predicate to the host
once per ``check_every`` steps, where the scan had none: it pays when most steps are idle.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rose_jax.jaxpr import compat as C
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import FUSION_TOLERANCE, Transform
from rose_jax.optimize.predict import (
    Candidate,
    CandidateContext,
    candidate_scans,
    outer_trips,
    scan_of,
    scans_legal,
)
from rose_jax.optimize.where import Where, scan_transform, where_label

# steps run between two checks of the flag (the largest divisor of the length not above it is used)
DEFAULT_CHECK_EVERY = 5
# the share of a matched loop's steps assumed idle by the candidate model (a model, not a
# measurement: MJX's line search usually converges in a few of its 50 steps)
ASSUMED_IDLE_STEPS = 0.5
# GPU seconds per equation of a matched loop's body, per step: such a body is a chain of small
# latency-bound kernels over all environments, whose time its flops do not tell. Calibrated on the
# one measurement there is (H200, PPO ant's iteration, 2026-12-05 12:21,
# benchmarks/results/beyond_flags): 54 ms saved per iteration with 800 of the line search's 1,600
# steps (a 361-equation body) assumed skipped, 0.19 us per equation. CPU: the flops model alone.
BODY_EQN_S = {"gpu": 0.19e-6, "cpu": 0.0}

# symbolic values: ("const", python scalar) (every element equal), ("carry", k) (carry k unchanged)
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})
_COMPARE = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
}


def _const(atom: Any, env: dict) -> Any:
    if C.is_literal(atom):
        v = np.asarray(atom.val)
        return ("const", v.reshape(-1)[0].item()) if v.size >= 1 and np.all(v == v.reshape(-1)[0]) else None
    return env.get(atom)


def _stacked(eqn: Any, ins: list) -> tuple | None:
    """The symbolic value of an equation that takes a carried array apart along its leading axis or
    puts its rows back in order (what :func:`~rose_jax.optimize.stack_carries` writes around a
    body): ``("row", k, j, n)`` is row ``j`` of carry ``k`` (``n`` rows), ``("rows", k, j, n)`` the
    same with its leading axis of 1 kept; all ``n`` rows stacked in order are carry ``k`` again."""
    name = eqn.primitive.name
    x = ins[0] if ins else None
    shape_in = tuple(eqn.invars[0].aval.shape) if eqn.invars and hasattr(eqn.invars[0], "aval") else ()
    shape_out = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
    if name == "slice" and x is not None and x[0] == "carry" and shape_in:
        st, lim, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params.get("strides")
        if (not strides or all(d == 1 for d in strides)) and lim[0] == st[0] + 1 and all(
                a == 0 and b == n for a, b, n in zip(st[1:], lim[1:], shape_in[1:], strict=True)):
            return ("rows", x[1], int(st[0]), shape_in[0])
        return None
    if name in ("squeeze", "reshape") and x is not None and x[0] == "rows" and shape_out == shape_in[1:]:
        return ("row", *x[1:])
    if name in ("broadcast_in_dim", "reshape", "expand_dims") and x is not None and x[0] == "row" \
            and shape_out == (1, *shape_in) and (name != "broadcast_in_dim" or tuple(
                eqn.params["broadcast_dimensions"]) == tuple(range(1, len(shape_out)))):
        return ("rows", *x[1:])
    kind = {"stack": "row", "concatenate": "rows"}.get(name)
    axis = eqn.params.get("axis", eqn.params.get("dimension")) if kind else None
    if kind and axis == 0 and ins and all(v is not None and v[0] == kind for v in ins):
        k, n = ins[0][1], ins[0][3]
        if len(ins) == n and all(v[1] == k and v[2] == j and v[3] == n for j, v in enumerate(ins)):
            return ("carry", k)
    return None


def _symbolic(jaxpr: Any, env: dict) -> list:
    """Symbolic values of ``jaxpr``'s outputs given ``env`` (invars -> symbolic value or absent)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [_const(a, env) for a in eqn.invars]
        outs: list = [None] * len(eqn.outvars)
        if name in C.PLAIN_CALL_PRIMITIVES and not C.has_effects(eqn):
            sub, _ = C.call_jaxpr(eqn.params)  # its consts: unknown values
            inner = {v: ins[i] for i, v in enumerate(sub.invars) if ins[i] is not None}
            outs = _symbolic(sub, inner)
        elif name == "select_n":
            pred, cases = ins[0], ins[1:]
            if pred is not None and pred[0] == "const":
                outs = [cases[int(pred[1])]]
            elif cases and all(c is not None and c == cases[0] for c in cases):
                outs = [cases[0]]
        elif (part := _stacked(eqn, ins)) is not None:  # a stacked carry taken apart and put back
            outs = [part]
        elif name in _SHAPE_ONLY and ins[0] is not None and ins[0][0] == "const":
            outs = [ins[0]]
        elif name == "convert_element_type" and ins[0] is not None:
            if ins[0][0] == "const":
                outs = [("const", np.asarray(ins[0][1]).astype(eqn.outvars[0].aval.dtype).item())]
            elif eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
                outs = [ins[0]]
        elif name in ("copy", "copy_p", "optimization_barrier") and len(ins) == len(outs):
            outs = list(ins)
        elif name in _COMPARE and all(x is not None and x[0] == "const" for x in ins):
            outs = [("const", bool(_COMPARE[name](ins[0][1], ins[1][1])))]
        elif name in ("and", "or") and eqn.outvars[0].aval.dtype == np.bool_:
            known = [x[1] for x in ins if x is not None and x[0] == "const"]
            absorb = name == "and"  # False absorbs an and, True an or
            if any(bool(k) != absorb for k in known):
                outs = [("const", not absorb)]
            elif len(known) == len(ins):
                outs = [("const", absorb)]
        elif name == "not" and ins[0] is not None and ins[0][0] == "const" and isinstance(ins[0][1], bool):
            outs = [("const", not ins[0][1])]
        for v, s in zip(eqn.outvars, outs, strict=True):
            if s is not None and not C.is_dropvar(v):
                env[v] = s
    return [_const(a, env) for a in jaxpr.outvars]


def idle_flag(scan: C.ScanParams) -> tuple[int | None, str]:
    """``(k, why)``: carry ``k`` is a boolean flag such that, with it all ``False``, the body
    returns every carry unchanged and the flag all ``False`` (``k`` None: why not)."""
    n_xs = len(scan.body.invars) - scan.num_consts - scan.num_carry
    n_ys = len(scan.body.outvars) - scan.num_carry
    if n_xs or n_ys:
        return None, f"the scan has {n_xs} xs and {n_ys} ys (only a carry-only loop can stop early)"
    if any(C.has_effects(e) for e in scan.body.eqns):
        return None, "its body has effects"
    carry_vars = scan.body.invars[scan.num_consts :]
    flags = [k for k, v in enumerate(carry_vars) if v.aval.dtype == np.bool_]
    if not flags:
        return None, "no boolean carry to stop on"
    for k in flags:
        env = {v: ("carry", j) for j, v in enumerate(carry_vars)}
        env[carry_vars[k]] = ("const", False)
        outs = _symbolic(scan.body, env)
        if all(o == ("carry", j) or (j == k and o == ("const", False)) for j, o in enumerate(outs)):
            return k, f"idle once carry {k} (bool{list(carry_vars[k].aval.shape)}) is all false"
    return None, "no boolean carry makes the body the identity when it is all false"


def _every(length: int, check_every: int) -> int:
    return max(d for d in range(1, max(1, min(check_every, length)) + 1) if length % d == 0)


class _Split:
    """``scans_legal``'s view of one scan: moves when a flag is found."""

    def __init__(self, scan: C.ScanParams):
        self.flag, self.why = idle_flag(scan)
        self.moves = self.flag is not None


def exit_idle_loops(where: Where = None, check_every: int = DEFAULT_CHECK_EVERY) -> Transform:
    """Transform: each scan at ``where`` that :func:`idle_flag` proves idle once a carried flag is
    all false runs as a ``while_loop`` that stops there, checking every ``check_every`` steps.
    See the module docstring for legality and tolerance."""
    if not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"exit_idle_loops: check_every must be an int >= 1, got {check_every!r}")

    def legal(tree) -> tuple[bool, str]:
        return scans_legal(
            tree,
            where,
            _Split,
            lambda s, scan: f"{s.why}; a while loop checking it every {_every(scan.length, check_every)} "
            f"of {scan.length} steps",
            "the steps skipped are the identity (the flag is all false from then on); ",
        )

    def on_scan(site, scan, invals, interp):
        flag, _ = idle_flag(scan)
        if flag is None:
            return interp.rebuild_scan(scan, invals, site.body_ctx)
        consts = list(invals[: scan.num_consts])
        init = list(invals[scan.num_consts :])
        every = _every(scan.length, check_every)

        def step(carry, _):
            return interp.eval(scan.body, scan.body_consts, [*consts, *carry], site.body_ctx), None

        I.named(step, I.body_name(scan.body, C.SCAN))

        def cond(state):
            i, carry = state
            return (i < scan.length) & jnp.any(carry[flag])

        def body(state):
            i, carry = state
            carry, _ = jax.lax.scan(step, carry, None, length=every)
            return i + every, carry

        _, carry = jax.lax.while_loop(cond, body, (jnp.int32(0), init))
        return list(carry)

    return scan_transform(
        "exit_idle_loops",
        (("where", where), ("check_every", check_every)),
        FUSION_TOLERANCE,
        where,
        legal,
        on_scan,
        summary=f"stop the scan(s) at {where_label(where)} once their flag is all false",
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Per scan that :func:`idle_flag` matches (most expensive first): :func:`exit_idle_loops` there,
    and, where several match (MJX's line search in the rollout and in the evaluation), one for
    all of them (``where=None``, what the H200 measurement applied).

    Model, per matched scan: :data:`ASSUMED_IDLE_STEPS` of its steps skipped, each saving the
    loop's time per step (the larger of its share of the iteration and, on a GPU, its body's
    equations x :data:`BODY_EQN_S`, at most the iteration or its profiled component) and a loop
    step's overhead (:data:`rose_jax.optimize.predict.LOOP_OVERHEAD_S`, the unrolling model's
    basis), less a predicate round trip per check of the steps that run."""
    out: list[Candidate] = []
    overhead = ctx.loop_overhead_s
    per_eqn = BODY_EQN_S.get(ctx.platform, BODY_EQN_S["gpu"])
    gains: list[float] = []
    for node, where in candidate_scans(ctx):
        scan = scan_of(node)
        if scan is None or idle_flag(scan)[0] is None:
            continue
        every = _every(scan.length, DEFAULT_CHECK_EVERY)
        loops = outer_trips(ctx.tree, node)
        steps = loops * scan.length
        checks = loops * (scan.length / every) * (1.0 - ASSUMED_IDLE_STEPS)
        eqns = len(scan.body.eqns)
        cap = ctx.component_s(node)
        body_s = min(steps * eqns * per_eqn, ctx.baseline_s if cap is None else cap)
        loop_s = max(ctx.baseline_s * ctx.time_share(node), body_s)
        saved = ASSUMED_IDLE_STEPS * (loop_s + steps * overhead)
        gain = saved - checks * overhead
        gains.append(gain)
        out.append(
            Candidate(
                exit_idle_loops(where),
                where,
                gain,
                f"{ASSUMED_IDLE_STEPS:.0%} of {steps} steps assumed idle x (loop time {loop_s * 1e3:.1f} ms: "
                f"max(its share, {eqns} body eqns x {per_eqn * 1e6:.2f}us per step) + "
                f"{overhead * 1e6:.0f}us per step) - {checks:.0f} predicate checks x {overhead * 1e6:.0f}us",
            )
        )
    if len(out) > 1:
        out.insert(
            0,
            Candidate(
                exit_idle_loops(),
                "every matched scan",
                sum(gains),
                f"the {len(out)} matched scans' models summed",
            ),
        )
    return out
