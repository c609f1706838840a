"""Loop fission: work of a scan that does not read what the loop writes, moved out of the loop and
batched (:func:`hoist_independent`, and its :func:`candidates`).

A scan body is a chain of small kernels run ``length`` times. Some of them read only the loop's
constants, its per-iteration inputs (``xs``) and carried values that evolve on their own (a PRNG
key split every step, a step counter): for SAC's gradient steps, the key chain, every Gaussian
draw of the alpha / critic / actor losses, the observation normalisation of the sampled batch,
the reward and discount arithmetic; for PPO's epochs, the permutation of the batch and the
minibatch gathers. None of it depends on the gradient updates, yet every iteration waits for it.

:func:`split_scan` partitions the body:

* **R, the independent recurrences**: the carried values whose update reads only themselves,
  constants and ``xs``, and whose update contains no matmul, convolution or nested loop (light:
  the key chain, counters). R runs first as its own scan, emitting per iteration the values the
  rest of the body reads.
* **B, the batched work**: every other pure equation that reads only constants, ``xs`` and R's
  values (and varies per iteration; loop invariants are left to XLA's own invariant code motion
  and to ``hoist_invariants``). B runs once, ``jax.vmap`` ped over all iterations: one launch per
  kernel for the whole loop instead of one per iteration.
* **M, the main loop**: the rest (everything that reads the updated carry, and anything with
  effects), as a scan whose per-iteration inputs also carry R's and B's values.

Legality: B and R read nothing the loop writes, by construction; the candidate is refused with
the reason when nothing in the body is independent of the carry, when what would move is only
loop-invariant or shape-only, or when B's and R's stacked values would need more than
:data:`MAX_HOIST_BYTES` (the cost of batching: every iteration's values live at once).
Tolerance: R and the main loop run the same operations in the same order; B's matmuls and
reductions gain a batch dimension, which XLA may accumulate in another order, so results are
equal up to :data:`HOIST_TOLERANCE` (bitwise where B holds only elementwise work, RNG and gathers,
which the equality check shows per program).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from rose_jax.jaxpr import compat as C
from rose_jax.jaxpr.dataflow import producers
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import Tolerance, Transform
from rose_jax.optimize.predict import (
    Candidate,
    CandidateContext,
    candidate_scans,
    moved_out_gain,
    outer_trips,
    scan_of,
    split_scan_transform,
)
from rose_jax.optimize.where import Where, where_label

# The largest total size of the values batched out of one loop (every iteration's at once).
MAX_HOIST_BYTES = 2 << 30

HOIST_TOLERANCE = Tolerance(
    rtol=1e-4,
    atol=0.0,
    reason="the batched work's matmuls and reductions gain a batch dimension (jax.vmap), which XLA "
    "may accumulate in another order; elementwise work, RNG and gathers stay bitwise",
)

# Primitives that make a carried recurrence "heavy": computing it ahead of the loop would be the
# loop itself (the updates), not bookkeeping.
_HEAVY = frozenset({"dot_general", "conv_general_dilated", C.SCAN, C.WHILE, C.COND})
# Shape-only primitives: batching nothing but these would only materialise arrays XLA fuses away.
_SHAPE_ONLY = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "convert_element_type",
        "squeeze",
        "expand_dims",
        "iota",
        "copy",
        "copy_p",
        "transpose",
        "slice",
        "pjit_identity",
    }
)


def _heavy(eqn: Any) -> bool:
    if eqn.primitive.name in _HEAVY:
        return True
    return any(_heavy(e) for sub in C.sub_jaxprs(eqn.params) for e in sub.eqns)


@dataclasses.dataclass(frozen=True)
class ScanSplit:
    """How :func:`split_scan` partitions one scan body (indices into ``scan.body.eqns``).

    ``recur``: carry positions computed by R; ``r_eqns`` / ``b_eqns`` / ``m_eqns``: the equations
    of R, B and the main loop (invariant equations R or B need are also run there: ``r_inv``,
    ``b_inv``); ``r_out`` / ``b_out``: body variables R / B hand on (per iteration, stacked);
    ``hoisted_bytes``: their stacked size; ``why``: a sentence when nothing worth moving was found.
    """

    recur: tuple[int, ...]
    r_eqns: tuple[int, ...]
    r_inv: tuple[int, ...]
    b_eqns: tuple[int, ...]
    b_inv: tuple[int, ...]
    m_eqns: tuple[int, ...]
    r_out: tuple[Any, ...]
    b_out: tuple[Any, ...]
    hoisted_bytes: int
    why: str = ""

    @property
    def moves(self) -> bool:
        return not self.why


def _backward(body: Any, roots: list[Any], allowed: set[int], producer: dict[Any, int]) -> set[int]:
    """Equations among ``allowed`` on which ``roots`` depend (within the body)."""
    seen: set[int] = set()
    stack = [producer[v] for v in roots if C.is_var(v) and v in producer]
    while stack:
        i = stack.pop()
        if i in seen or i not in allowed:
            continue
        seen.add(i)
        stack.extend(producer[a] for a in body.eqns[i].invars if C.is_var(a) and a in producer)
    return seen


def split_scan(scan: C.ScanParams) -> ScanSplit:
    """Partition ``scan``'s body into R, B and the main loop (see the module docstring)."""
    body = scan.body
    nc, nk = scan.num_consts, scan.num_carry
    carry_in = list(body.invars[nc : nc + nk])
    xs_in = list(body.invars[nc + nk :])
    carry_out = list(body.outvars[:nk])
    producer = producers(body.eqns)

    # forward: which carried inputs each value reads, whether it varies per iteration, effects
    reads: dict[Any, frozenset[int]] = {v: frozenset({k}) for k, v in enumerate(carry_in)}
    varies: dict[Any, bool] = {v: True for v in carry_in + xs_in}
    eff: set[int] = set()
    for i, eqn in enumerate(body.eqns):
        r: frozenset[int] = frozenset()
        vary = False
        for a in eqn.invars:
            if C.is_var(a):
                r |= reads.get(a, frozenset())
                vary = vary or varies.get(a, False)
        if C.has_effects(eqn):
            eff.add(i)
        for v in eqn.outvars:
            if C.is_var(v):
                reads[v] = r
                varies[v] = vary

    def reads_of(atom) -> frozenset[int]:
        return reads.get(atom, frozenset()) if C.is_var(atom) else frozenset()

    # R: the largest set of carries closed under "reads", each update light and pure
    everything = set(range(len(body.eqns)))
    slices = {k: _backward(body, [carry_out[k]], everything, producer) for k in range(nk)}
    bad = {k for k in range(nk) if any(i in eff or _heavy(body.eqns[i]) for i in slices[k])}
    recur = set(range(nk)) - bad
    changed = True
    while changed:
        changed = False
        for k in sorted(recur):
            if not reads_of(carry_out[k]) <= recur:
                recur.discard(k)
                changed = True
    if recur == set(range(nk)) and nk:
        # the whole loop would be R: nothing to gain from splitting it off
        recur = set()

    indep = {
        i
        for i, eqn in enumerate(body.eqns)
        if i not in eff
        and all(reads_of(v) <= recur for v in eqn.outvars if C.is_var(v))
        and all(reads_of(a) <= recur for a in eqn.invars)
    }
    varying = {i for i in indep if any(varies.get(v, False) for v in body.eqns[i].outvars if C.is_var(v))}
    invariant = indep - varying
    r_all = set().union(*(slices[k] for k in recur)) if recur else set()
    r_eqns = r_all & varying
    r_inv = r_all & invariant
    b_eqns = varying - r_eqns
    if b_eqns and all(body.eqns[i].primitive.name in _SHAPE_ONLY for i in b_eqns):
        b_eqns = set()
    b_inv = _backward(body, [a for i in b_eqns for a in body.eqns[i].invars], invariant, producer)
    moved = r_eqns | b_eqns
    m_eqns = [i for i in range(len(body.eqns)) if i not in moved]

    # what R and B hand on: their values read by the main loop, by B (R's), or returned by the body
    needed: set[Any] = set()
    for i in m_eqns:
        needed.update(a for a in body.eqns[i].invars if C.is_var(a))
    rest_out = [carry_out[k] for k in range(nk) if k not in recur] + list(body.outvars[nk:])
    needed.update(v for v in rest_out if C.is_var(v))
    b_reads = {a for i in b_eqns for a in body.eqns[i].invars if C.is_var(a)}
    carry_pos = {v: k for k, v in enumerate(carry_in)}
    r_defined = {v for i in r_eqns for v in body.eqns[i].outvars if C.is_var(v)} | {
        carry_in[k] for k in recur
    }
    b_defined = {v for i in b_eqns for v in body.eqns[i].outvars if C.is_var(v)}
    r_out = tuple(v for v in _ordered(body, r_defined, carry_pos) if v in needed or v in b_reads)
    b_out = tuple(v for v in _ordered(body, b_defined, carry_pos) if v in needed)
    nbytes = scan.length * sum(C.aval_bytes(C.aval_of(v)) for v in r_out + b_out)

    why = ""
    if not indep - invariant:
        why = (
            "every per-iteration equation reads what the loop writes (its carried state): "
            "nothing independent to hoist"
        )
    elif not r_eqns and not b_eqns:
        why = "only shape-only or loop-invariant work is independent of the carry: nothing worth batching"
    elif nbytes > MAX_HOIST_BYTES:
        why = (
            f"batching would hold every iteration's values at once: {nbytes / 2**20:,.0f} MiB "
            f"> the {MAX_HOIST_BYTES / 2**20:,.0f} MiB limit"
        )
    return ScanSplit(
        recur=tuple(sorted(recur)),
        r_eqns=tuple(sorted(r_eqns)),
        r_inv=tuple(sorted(r_inv)),
        b_eqns=tuple(sorted(b_eqns)),
        b_inv=tuple(sorted(b_inv)),
        m_eqns=tuple(m_eqns),
        r_out=r_out,
        b_out=b_out,
        hoisted_bytes=int(nbytes),
        why=why,
    )


def _ordered(body: Any, defined: set[Any], carry_pos: dict[Any, int]) -> list[Any]:
    """``defined`` in a deterministic order: carried inputs by position, then by equation order."""
    out = sorted((v for v in defined if v in carry_pos), key=carry_pos.__getitem__)
    for eqn in body.eqns:
        out.extend(v for v in eqn.outvars if C.is_var(v) and v in defined)
    return out


def _run_split(
    scan: C.ScanParams, split: ScanSplit, invals: list, site: I.Site, interp: I.Interpreter
) -> list:
    """The scan evaluated as R (a scan), B (one vmap) and the main loop (a scan)."""
    body, ctx = scan.body, site.body_ctx
    nc, nk = scan.num_consts, scan.num_carry
    consts = invals[:nc]
    init = invals[nc : nc + nk]
    xs = invals[nc + nk :]
    carry_in = body.invars[nc : nc + nk]
    xs_in = body.invars[nc + nk :]
    carry_out = body.outvars[:nk]
    rest = [k for k in range(nk) if k not in split.recur]

    def base_env() -> dict:
        env = dict(zip(body.constvars, scan.body_consts, strict=True))
        env.update(zip(body.invars[:nc], consts, strict=True))
        return env

    # R: the independent recurrences, one light scan
    r_final: list[Any] = []
    r_stacked: list[Any] = []
    if split.recur:

        def r_step(carry, x):
            env = base_env()
            env.update(zip(xs_in, x, strict=True))
            env.update(zip((carry_in[k] for k in split.recur), carry, strict=True))
            interp.run(body, sorted(split.r_inv + split.r_eqns), env, ctx)
            return [C.read_atom(env, carry_out[k]) for k in split.recur], [env[v] for v in split.r_out]

        I.named(r_step, I.body_name(body, C.SCAN) + "_recurrence")
        r_final, r_stacked = jax.lax.scan(
            r_step, [init[k] for k in split.recur], list(xs), length=scan.length, reverse=scan.reverse
        )

    # B: everything else independent, all iterations at once
    b_stacked: list[Any] = []
    if split.b_eqns:

        def b_fn(x, r):
            env = base_env()
            env.update(zip(xs_in, x, strict=True))
            env.update(zip(split.r_out, r, strict=True))
            interp.run(body, sorted(split.b_inv + split.b_eqns), env, ctx)
            return [env[v] for v in split.b_out]

        b_stacked = jax.vmap(b_fn)(list(xs), list(r_stacked))

    # the main loop: the rest, reading R's and B's values per iteration
    hand_on = list(split.r_out) + list(split.b_out)
    stacked = list(r_stacked) + list(b_stacked)
    ys_vars = body.outvars[nk:]
    from_hoisted = {v: j for j, v in enumerate(hand_on)}
    main_ys = [j for j, v in enumerate(ys_vars) if not (C.is_var(v) and v in from_hoisted)]

    def m_step(carry, inp):
        x, h = inp
        env = base_env()
        env.update(zip(xs_in, x, strict=True))
        env.update(zip((carry_in[k] for k in rest), carry, strict=True))
        env.update(zip(hand_on, h, strict=True))
        interp.run(body, split.m_eqns, env, ctx)
        return [C.read_atom(env, carry_out[k]) for k in rest], [C.read_atom(env, ys_vars[j]) for j in main_ys]

    I.named(m_step, I.body_name(body, C.SCAN))
    m_final, m_ys = jax.lax.scan(
        m_step,
        [init[k] for k in rest],
        (list(xs), stacked),
        length=scan.length,
        reverse=scan.reverse,
        unroll=scan.unroll,
    )
    carry = [None] * nk
    for k, v in zip(split.recur, r_final, strict=True):
        carry[k] = v
    for k, v in zip(rest, m_final, strict=True):
        carry[k] = v
    ys: list[Any] = [None] * len(ys_vars)
    for j, v in zip(main_ys, m_ys, strict=True):
        ys[j] = v
    for j, v in enumerate(ys_vars):
        if ys[j] is None:
            ys[j] = stacked[from_hoisted[v]]
    return [*carry, *ys]


def describe(split: ScanSplit, body: Any) -> str:
    """One line: what moves out of the loop and what it costs."""
    parts = []
    if split.recur:
        parts.append(
            f"{len(split.recur)} independent carried value(s) as their own scan ({len(split.r_eqns)} eqns)"
        )
    if split.b_eqns:
        parts.append(f"{len(split.b_eqns)} of {len(body.eqns)} equations batched over the iterations")
    return "; ".join(parts) + f"; {split.hoisted_bytes / 2**20:,.1f} MiB held at once"


def hoist_independent(where: Where = None) -> Transform:
    """Move the work of the chosen scans that reads nothing the loop writes out of the loop:
    independent carried recurrences (key chains, counters) as their own scan first, the rest of
    the carry-independent work batched over all iterations at once (``jax.vmap``), then the
    remaining loop. See the module docstring for legality and tolerance."""

    return split_scan_transform(
        "hoist_independent",
        (("where", where),),
        HOIST_TOLERANCE,
        where,
        split_scan,
        lambda split, scan: describe(split, scan.body),
        "reads nothing the loop writes; ",
        lambda split, scan, invals, site, interp: _run_split(scan, split, invals, site, interp),
        f"hoist and batch the carry-independent work of the scan(s) at {where_label(where)}",
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Per scan of at least two steps whose body has carry-independent work worth moving (those
    in a profiled window; without windows every one), most expensive first.

    Model (seconds per iteration): the moved equations' share of the body, of the loop's time,
    run once instead of ``trips`` times, less nothing for the extra recurrence scan (it is
    light by construction): ``loop time x moved/body x (1 - 1/trips)``.
    """
    out: list[Candidate] = []
    for node, where in candidate_scans(ctx):
        scan = scan_of(node)
        if scan is None:
            continue
        split = split_scan(scan)
        if not split.moves or not split.b_eqns:
            continue
        gain = moved_out_gain(ctx, node, len(split.b_eqns), len(scan.body.eqns))
        trips = node.trip_count * outer_trips(ctx.tree, node)
        out.append(
            Candidate(
                hoist_independent(where),
                where,
                gain,
                f"{len(split.b_eqns)}/{len(scan.body.eqns)} body equations carry-independent, "
                f"batched once instead of {trips} times x loop time",
            )
        )
    return out
