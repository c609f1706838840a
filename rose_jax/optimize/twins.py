"""Twin computations batched: two same-shaped, independent chains of a scan body run as one
``jax.vmap`` over a stacked pair (:func:`batch_twins`, and its :func:`candidates`).

SAC's critic is two Q-networks of the same shape (Brax's ``n_critics=2``; ``algos.networks.TwinQ``),
and its gradient step runs each of them several times: the critic loss's forward and backward
pass, the target networks, the actor loss through the critic, Adam's updates of both parameter
sets and the Polyak average of both targets. Each network's matrix products are separate small
kernels; on a GPU where one kernel of a 512 x 256 x 256 product is mostly launch latency, two of
them cost about twice one batched kernel of both (cuBLAS batched GEMM).

:func:`find_twins` pairs the equations of one body, its jit calls inlined first (optax's jitted
tree functions take both networks' leaves in one call; the outer jit inlines them anyway) and two
values computed the same way from the same values read as one (value numbering):

* **seeds**: two ``dot_general`` s with the same shapes, types and dimension numbers that read
  one operand in common (the same activations into both networks' first layer) and depend on
  neither the other;
* **growth**: from a pair, their readers at the same operand position, their producers, and the
  other readers of two values just paired are paired when they are the same operation (primitive,
  parameters, shapes; a jit call's body the same object) on operands that are each the same
  value, the values already paired with each other, or two values paired now (the two networks'
  weights), and neither depends on the other;
* **regions**: pairs join the region of the pairs that produce their operands while no member of
  one side comes to depend on the other side; a region is kept when some other equation of the
  body can run entirely before or after it (convex) and the regions can be ordered with the rest.

The rebuilt body runs each region once as ``jax.vmap`` of its first side's equations over the
stacked operands (an operand both sides share is not stacked), so every pair of matrix products
is one batched product. Stacked results stay stacked for the next region that reads them in the
same orientation, and a pair of carried values that the body reads and writes as such a pair
(both networks' weights, Adam's moments, the targets) is carried stacked from step to step, so
the weights are stacked once before the loop, not once per step. Every variable the body had
keeps its value (each side is the stacked value's row), so equations outside the regions are
unchanged.

Legality: the two sides of a region are independent (checked on the body's dependency graph), the
region is convex and the contracted graph acyclic, so the order is one the data allow; ``vmap``
of an equation over two rows computes each row as the equation did. Effectful equations depend on
the previous effectful one, so the schedule keeps their order. Never paired: control flow, host
callbacks (their functions are opaque), ``rng_bit_generator`` / ``rng_uniform`` (XLA's own
generator state) and random bits of keys other than threefry's (their batching rules are not per
key); literals and constants compare by their bits. A custom_jvp/vjp call pairs by its primal
body: side b would take side a's derivative rule if the rewritten iteration were differentiated (it
is not), and runs under side a's named scopes.
Refused with the reason when a body has no twin matrix products.

Tolerance: a batched GEMM may be computed by a different algorithm (tile shapes, split-K) than the
single one, which reorders each dot's sum:
:data:`rose_jax.optimize.base.REASSOCIATION_TOLERANCE` (the plan is kept only with the learning
check). On the CPU, batched reductions and products sum in another order: after one iteration the
tiny real SAC (pendulum, Brax hopper) and PPO (cartpole) iterations move by ~1e-7 relative, Brax
ant PPO by 3.5e-3 (its rollout's contact physics amplifies the last bits, then the update).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rose_jax.jaxpr import compat as C
from rose_jax.jaxpr.dataflow import ancestors, bits_of, convex, producers, region_order
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import REASSOCIATION_TOLERANCE, Transform
from rose_jax.optimize.predict import (
    Candidate,
    CandidateContext,
    split_scan_transform,
    split_scans,
)
from rose_jax.optimize.where import Where, where_label

# Equations that launch a kernel of their own on a GPU (XLA fuses elementwise work into them or
# around them): a pair of these run batched is one kernel fewer.
KERNEL_PRIMITIVES = frozenset(
    {"dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min", "argmax",
     "argmin", "cumsum", "cumlogsumexp", "cummax", "gather", "scatter", "scatter-add", "scatter_add",
     "sort"}
)  # fmt: skip
# Equations never paired: control flow (vmap would turn a cond into both branches and a loop's
# trip count into the longer one) and anything with effects.
NOT_PAIRED = frozenset({C.SCAN, C.WHILE, C.COND, "cond", "while", "scan"})
# Random numbers from XLA's own generator state (no key operand, no effect in the jaxpr): two calls
# with the same operands differ, so they are never one value, and a vmapped pair would not draw
# each call's own numbers.
STATEFUL_RANDOM = frozenset({"rng_uniform", "rng_bit_generator"})
# Seconds a batched pair of kernels saves (one launch and its latency-bound tail on a GPU) and
# one stacking copy costs; CPU runs kernels back to back and gains little.
KERNEL_S = {"gpu": 6e-6, "cpu": 0.5e-6}
STACK_S = {"gpu": 3e-6, "cpu": 0.5e-6}


# Parameters that hold a custom_jvp / custom_vjp call's derivative rules: read only when the program
# is differentiated (the rewritten iteration is not), so two calls of the same primal body pair
# even though each call has its own rule object. Any other callable pairs only with itself.
RULE_PARAMS = frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd", "fwd"})


def _literal_key(atom: Any) -> Any:
    """A literal by its exact bits (``repr`` rounds: 0.000123451 and 0.000123453 print alike)."""
    value = np.asarray(atom.val)
    return ("lit", str(value.dtype), value.shape, value.tobytes())


def _const_key(value: Any) -> Any:
    """A closed jaxpr's constant by its bits (by identity if it has none to read)."""
    try:
        arr = np.asarray(value)
        return ("const", str(arr.dtype), arr.shape, arr.tobytes())
    except Exception:  # noqa: BLE001 - a tracer or an opaque object
        return ("const", id(value))


def _param_key(value: Any, memo: dict, name: str = "") -> Any:
    """A hashable stand-in for one equation parameter; a jaxpr by its printed text and constants
    (the same computation prints the same), memoised in ``memo`` by identity for one body."""
    if C.is_jaxpr(value):
        hit = memo.get(id(value))
        if hit is None or hit[0] is not value:
            consts = tuple(_const_key(c) for c in getattr(value, "consts", ()))
            hit = memo[id(value)] = (value, (str(C.open_jaxpr(value)), consts))
        return ("jaxpr", hit[1])
    if isinstance(value, (tuple, list)):
        return tuple(_param_key(v, memo) for v in value)
    if name in RULE_PARAMS:
        return "rule"
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))  # unhashable: equal only to itself, never by its repr
    return value  # hashable (a callable by identity)


def _aval_key(atom: Any) -> Any:
    aval = C.aval_of(atom)
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", "")), getattr(aval, "weak_type", 0))


def eqn_key(eqn: Any, memo: dict | None = None) -> Any:
    """What two equations must share to be twins: primitive, parameters, operand and result types."""
    memo = {} if memo is None else memo
    ins = tuple((_literal_key(a), _aval_key(a)) if C.is_literal(a) else _aval_key(a) for a in eqn.invars)
    params = tuple(sorted((k, _param_key(v, memo, k)) for k, v in eqn.params.items()))
    return (eqn.primitive.name, params, ins, tuple(_aval_key(v) for v in eqn.outvars))


@dataclasses.dataclass(frozen=True)
class Region:
    """Pairs of body equations run as one vmap: ``pairs`` ``(a, b)`` in body order (``a`` on the
    side the region computes, row 0); ``inputs``: the operand pairs read from outside (``(x, x)``
    for an operand both sides share); ``outputs``: the result pairs read outside the region."""

    pairs: tuple[tuple[int, int], ...]
    inputs: tuple[tuple[Any, Any], ...]
    outputs: tuple[tuple[Any, Any], ...]
    kernels: int  # pairs of kernel-launching equations


@dataclasses.dataclass(frozen=True)
class Twins:
    """How :func:`find_twins` batches one scan body.

    ``regions`` in the order they run; ``schedule``: the body run as items, each an equation index
    or ``("region", r)``; ``stacked_carry``: carry position pairs ``(k1, k2)`` carried as one
    stacked value; ``stacks``: operand pairs stacked (or reversed) per step; ``why``: a sentence
    when nothing is batched."""

    regions: tuple[Region, ...]
    schedule: tuple[Any, ...]
    stacked_carry: tuple[tuple[int, int], ...]
    stacks: int
    why: str = ""
    scan: Any = None  # the scan whose body the indices refer to (its jit calls inlined)
    reverses: int = 0  # of ``stacks``: operands read in the opposite orientation (``x[::-1]``)

    @property
    def moves(self) -> bool:
        return not self.why

    @property
    def kernels(self) -> int:
        return sum(r.kernels for r in self.regions)


def _pairable(eqn: Any) -> bool:
    """Pure, not control flow, not a host callback (its function is opaque), and no random bits
    whose batching rule is not per key (``rng_bit_generator``; keys other than threefry's)."""
    name = eqn.primitive.name
    if name in NOT_PAIRED or name in C.CALLBACK_PRIMITIVES or name in STATEFUL_RANDOM:
        return False
    if C.has_effects(eqn):
        return False
    if name.startswith("random_"):
        return all("fry" in str(getattr(C.aval_of(a), "dtype", "fry")) for a in eqn.invars)
    return True


def _same_values(eqns: list, keys: list) -> dict[Any, Any]:
    """Value numbering: ``{var: the first var computed the same way}`` (the same pure operation on
    the same values: a network's bias reshaped once per call reads as one value)."""
    canon: dict[Any, Any] = {}
    seen: dict[Any, Any] = {}
    for e, key in zip(eqns, keys, strict=True):
        if key is None:
            continue
        ins = tuple(_literal_key(a) if C.is_literal(a) else id(canon.get(a, a)) for a in e.invars)
        first = seen.setdefault((key, ins), e)
        if first is not e:
            for v, w in zip(e.outvars, first.outvars, strict=True):
                if C.is_var(v) and not C.is_dropvar(v) and C.is_var(w) and not C.is_dropvar(w):
                    canon[v] = canon.get(w, w)
    return canon


def _pair_equations(eqns: list, anc: list[int]) -> tuple[dict[int, int], dict[Any, Any], dict[Any, Any]]:
    """Greedy twin matching (module docstring): ``{eqn: twin eqn}`` and ``{var: twin var}``,
    both symmetric, and :func:`_same_values`. Each seed is first grown alone and scored by the
    kernel pairs it brings; seeds are then committed best first (the two critics' own pairing,
    which reaches their backward passes, optimizer updates and targets, wins over a pairing of one
    network on two inputs)."""
    n = len(eqns)
    memo: dict = {}
    keys = [eqn_key(e, memo) if _pairable(e) else None for e in eqns]
    canon = _same_values(eqns, keys)
    prod: dict[Any, tuple[int, int]] = {}
    readers: dict[Any, list[tuple[int, int]]] = {}
    for i, e in enumerate(eqns):
        for k, v in enumerate(e.outvars):
            if C.is_var(v) and not C.is_dropvar(v):
                prod[v] = (i, k)
        for pos, a in enumerate(e.invars):
            if C.is_var(a):
                readers.setdefault(a, []).append((i, pos))

    def related(a: int, b: int) -> bool:
        return bool((anc[a] >> b) & 1 or (anc[b] >> a) & 1)

    def match(peq: dict, pvar: dict, a: int, b: int) -> list[tuple[Any, Any]] | None:
        fresh, differs = [], False
        for x, y in zip(eqns[a].invars, eqns[b].invars, strict=True):
            if C.is_literal(x) or C.is_literal(y):
                if not (C.is_literal(x) and C.is_literal(y) and _literal_key(x) == _literal_key(y)):
                    return None
                continue
            if canon.get(x, x) is canon.get(y, y):
                continue
            differs = True
            if pvar.get(x) is y:
                continue
            if x in pvar or y in pvar or _aval_key(x) != _aval_key(y):
                return None
            if (x, y) not in fresh:
                fresh.append((x, y))
        for x, y in zip(eqns[a].outvars, eqns[b].outvars, strict=True):
            if C.is_dropvar(x) != C.is_dropvar(y):
                return None  # one side's result unread: its twin would be left unpaired
            if C.is_dropvar(x):
                continue
            if pvar.get(x, y) is not y or pvar.get(y, x) is not x:
                return None
        return fresh if differs else None

    def grow(peq: dict, pvar: dict, a0: int, b0: int) -> int:
        """Pair ``(a0, b0)`` and everything it reaches; the kernel pairs added."""
        queue: list[tuple[int, int]] = []
        new_vars: list[tuple[Any, Any]] = []
        kernels = 0

        def pair(a: int, b: int) -> bool:
            nonlocal kernels
            if a == b or a in peq or b in peq or keys[a] is None or keys[a] != keys[b] or related(a, b):
                return False
            fresh = match(peq, pvar, a, b)
            if fresh is None:
                return False
            for x, y in fresh:
                pvar[x], pvar[y] = y, x
                new_vars.append((x, y))
            peq[a], peq[b] = b, a
            for x, y in zip(eqns[a].outvars, eqns[b].outvars, strict=True):
                if not (C.is_dropvar(x) or C.is_dropvar(y)):
                    pvar[x], pvar[y] = y, x
            queue.append((a, b))
            kernels += eqns[a].primitive.name in KERNEL_PRIMITIVES
            return True

        def pair_readers(x: Any, y: Any) -> None:
            """Pair each reader of ``x`` with a reader of ``y`` at the same operand position."""
            for ra, pa in readers.get(x, ()):
                for rb, pb in readers.get(y, ()):
                    if pa == pb and ra not in peq and rb not in peq and pair(ra, rb):
                        break

        if not pair(a0, b0):
            return 0
        while queue or new_vars:
            while new_vars:
                pair_readers(*new_vars.pop())
            if not queue:
                continue
            a, b = queue.pop(0)
            for x, y in zip(eqns[a].outvars, eqns[b].outvars, strict=True):
                pair_readers(x, y)
            for x, y in zip(eqns[a].invars, eqns[b].invars, strict=True):
                if (
                    C.is_var(x)
                    and C.is_var(y)
                    and canon.get(x, x) is not canon.get(y, y)
                    and x in prod
                    and y in prod
                ):
                    (i, k), (j, m) = prod[x], prod[y]
                    if k == m:
                        pair(i, j)
        return kernels

    # seeds: same-shaped matrix products that read one operand in common
    by_key: dict[Any, list[int]] = {}
    for i in range(n):
        if eqns[i].primitive.name == "dot_general" and keys[i] is not None:
            by_key.setdefault(keys[i], []).append(i)
    seeds = []
    for group in by_key.values():
        for ai, a in enumerate(group):
            shared = {id(v) for v in eqns[a].invars if C.is_var(v)}
            for b in group[ai + 1 :]:
                if shared & {id(v) for v in eqns[b].invars if C.is_var(v)}:
                    seeds.append((a, b))
    scored = sorted(((-grow({}, {}, a, b), a, b) for a, b in seeds))
    peq: dict[int, int] = {}
    pvar: dict[Any, Any] = {}
    for neg, a, b in scored:
        if neg < 0:
            grow(peq, pvar, a, b)
    return peq, pvar, canon


def _grow_regions(
    eqns: list, anc: list[int], peq: dict[int, int], prod: dict
) -> list[tuple[set[int], set[int]]]:
    """Pairs in body order join the region (and side) of the pairs producing their operands,
    merging those regions, while neither side comes to depend on the other: ``[(side a, side b)]``."""
    region_of: dict[int, int] = {}  # eqn -> region id
    sides: list[tuple[set[int], set[int]] | None] = []  # region id -> (side a, side b); None: merged
    masks: list[list[int]] = []  # region id -> [members a, members b, ancestors of a, ancestors of b]

    def fits(r: int, first, second) -> bool:
        ma, mb, ua, ub = masks[r]
        fa, fb = bits_of(first), bits_of(second)
        up_a = up_b = 0
        for i in first:
            up_a |= anc[i]
        for i in second:
            up_b |= anc[i]
        return not (up_a & mb or up_b & ma or ua & fb or ub & fa)

    def add(r: int, first, second) -> None:
        sides[r][0].update(first)
        sides[r][1].update(second)
        m = masks[r]
        for i in first:
            m[0] |= 1 << i
            m[2] |= anc[i]
            region_of[i] = r
        for i in second:
            m[1] |= 1 << i
            m[3] |= anc[i]
            region_of[i] = r

    for a in sorted(peq):
        if a in region_of:
            continue
        b = peq[a]
        r = None
        for x in eqns[a].invars:
            if not (C.is_var(x) and x in prod and prod[x] in region_of):
                continue
            r2 = region_of[prod[x]]
            first, second = ([a], [b]) if prod[x] in sides[r2][0] else ([b], [a])
            if r is None:
                if fits(r2, first, second):
                    add(r2, first, second)
                    r = r2
            elif r2 != r:  # another producing region: merge it in the orientation this pair reads it
                sa2, sb2 = sides[r2]
                flip = (prod[x] in sa2) != (a in sides[r][0])
                first2, second2 = (sb2, sa2) if flip else (sa2, sb2)
                if fits(r, first2, second2):
                    sides[r2] = None
                    add(r, list(first2), list(second2))
        if r is None:
            sides.append((set(), set()))
            masks.append([0, 0, 0, 0])
            add(len(sides) - 1, [a], [b])
    return [side for side in sides if side is not None]


def _reads_its_own_value(eqns: list, sa: set[int], sb: set[int], peq: dict, prod: dict, canon: dict) -> bool:
    """Whether a pair of the region reads, as one value both sides share, a value the region makes
    (side b reading a recomputed copy of a side-a result): one vmap cannot give row 1 row 0's value."""
    members = sa | sb
    for a in sa:
        for x, y in zip(eqns[a].invars, eqns[peq[a]].invars, strict=True):
            if C.is_var(x) and C.is_var(y) and canon.get(x, x) is canon.get(y, y):
                if prod.get(x) in members or prod.get(y) in members:
                    return True
    return False


def _regions_io(eqns: list, body: Any, keep: list, peq: dict, prod: dict, canon: dict) -> list[Region]:
    """Each kept region's pairs, the operand pairs it reads from outside and the result pairs read
    outside it, in the orientation built (side a computed, row 0)."""
    readers_outside: dict[Any, bool] = {}
    outvars = {v for v in body.outvars if C.is_var(v)}
    member_of = {i: r for r, (sa, sb) in enumerate(keep) for i in sa | sb}
    for i, e in enumerate(eqns):
        for x in e.invars:
            if C.is_var(x) and x in prod and member_of.get(prod[x]) is not None:
                if member_of.get(i) != member_of[prod[x]]:
                    readers_outside[x] = True
    regions = []
    for sa, _ in keep:
        pairs = tuple((a, peq[a]) for a in sorted(sa))
        made = {v for a, _ in pairs for v in eqns[a].outvars}
        inputs: list[tuple[Any, Any]] = []
        outputs: list[tuple[Any, Any]] = []
        for a, b in pairs:
            for x, y in zip(eqns[a].invars, eqns[b].invars, strict=True):
                if C.is_var(x) and canon.get(x, x) is canon.get(y, y):
                    y = x  # the same value: read once, not stacked
                if C.is_var(x) and x not in made and (x, y) not in inputs:
                    inputs.append((x, y))
            for x, y in zip(eqns[a].outvars, eqns[b].outvars, strict=True):
                if C.is_dropvar(x) and C.is_dropvar(y):
                    continue
                if readers_outside.get(x) or readers_outside.get(y) or x in outvars or y in outvars:
                    outputs.append((x, y))
        kernels = sum(eqns[a].primitive.name in KERNEL_PRIMITIVES for a, _ in pairs)
        regions.append(Region(pairs, tuple(inputs), tuple(outputs), kernels))
    return regions


def _swapped(reg: Region) -> Region:
    """The region computed from its other side (row 0 and row 1 exchanged)."""
    return Region(
        tuple(sorted((b, a) for a, b in reg.pairs)),
        tuple((y, x) for x, y in reg.inputs),
        tuple((y, x) for x, y in reg.outputs),
        reg.kernels,
    )


def _stacking(
    regions: list[Region], available: set[tuple[Any, Any]], orient: bool
) -> tuple[list[Region], int, int]:
    """Walk the regions in the order they run, as :func:`_run_region` will: ``available`` holds the
    operand pairs already stacked (a reversed read stores nothing). With ``orient``, each region is
    first computed from the side that reads the most operands as they were stacked rather than
    reversed (a reversed operand is a copy per step). The regions, the operands stacked and the
    operands reversed per step."""
    out: list[Region] = []
    stacks = reverses = 0
    for reg in regions:
        if orient:
            pairs = [(x, y) for x, y in reg.inputs if x is not y]
            keep = sum((y, x) in available and (x, y) not in available for x, y in pairs)
            swap = sum((x, y) in available and (y, x) not in available for x, y in pairs)
            reg = _swapped(reg) if swap < keep else reg
        for x, y in reg.inputs:
            if x is y or (x, y) in available:
                continue
            if (y, x) in available:
                reverses += 1
            else:
                stacks += 1
                available.add((x, y))  # stacked once, reused by later regions
        available.update(reg.outputs)
        out.append(reg)
    return out, stacks, reverses


def _carried_pairs(scan: C.ScanParams, regions: list[Region], pvar: dict) -> list[tuple[int, int]]:
    """Carry positions ``(k1, k2)`` read by a region as the pair ``(k1, k2)`` and written by one
    in the same orientation: carried stacked."""
    body, nc, nk = scan.body, scan.num_consts, scan.num_carry
    cin, cout = body.invars[nc : nc + nk], body.outvars[:nk]
    made_pairs = {p for reg in regions for p in reg.outputs}
    read_pairs = {p for reg in regions for p in reg.inputs if p[0] is not p[1]}
    out: list[tuple[int, int]] = []
    used: set[int] = set()
    pos_in = {v: k for k, v in enumerate(cin)}
    for k1 in range(nk):
        if k1 in used or cin[k1] not in pvar:
            continue
        k2 = pos_in.get(pvar[cin[k1]])
        if k2 is None or k2 in used or k2 == k1 or not (C.is_var(cout[k1]) and C.is_var(cout[k2])):
            continue
        for first, second in ((k1, k2), (k2, k1)):
            if (cin[first], cin[second]) in read_pairs and (cout[first], cout[second]) in made_pairs:
                out.append((first, second))
                used.update((k1, k2))
                break
    return out


def find_twins(scan: C.ScanParams) -> Twins:
    """Pair, group and order the twin computations of ``scan``'s body, its jit calls inlined
    (:func:`rose_jax.optimize.interpret.inline_calls`; module docstring)."""
    scan = I.inline_calls(scan)
    body = scan.body
    eqns = list(body.eqns)
    unchanged = tuple(range(len(eqns)))
    anc = ancestors(eqns)
    peq, pvar, canon = _pair_equations(eqns, anc)
    none = "no two same-shaped, independent matrix products read a common operand: no twins to batch"
    if not peq:
        return Twins((), unchanged, (), 0, none, scan)
    prod = producers(eqns)

    # keep convex regions with a kernel pair or that write a pair of carried values (an optimizer's
    # update of both networks: with it the pair is carried stacked and its reads need no stacking)
    carried_out = {v for v in body.outvars[: scan.num_carry] if C.is_var(v)}
    keep = [
        (sa, sb)
        for sa, sb in _grow_regions(eqns, anc, peq, prod)
        if (
            any(eqns[i].primitive.name in KERNEL_PRIMITIVES for i in sa)
            or any(v in carried_out for i in sa for v in eqns[i].outvars)
        )
        and convex(sa | sb, anc)
        and not _reads_its_own_value(eqns, sa, sb, peq, prod, canon)
    ]
    keep.sort(key=lambda s: min(s[0] | s[1]))
    if not keep:
        return Twins((), unchanged, (), 0, none + " (twin pairs found, but none convex with a kernel)", scan)
    schedule = region_order(eqns, keep, prod)
    while schedule is None:  # a cycle between regions: drop the last one
        keep.pop()
        if not keep:
            return Twins((), unchanged, (), 0, "the twin regions cannot be ordered with the rest", scan)
        schedule = region_order(eqns, keep, prod)

    # regions in the order they run (``_order`` may run a later region first), numbered so
    order = [item[1] for item in schedule if isinstance(item, tuple)]
    keep = [keep[r] for r in order]
    schedule = [("region", order.index(item[1])) if isinstance(item, tuple) else item for item in schedule]
    regions, _, _ = _stacking(_regions_io(eqns, body, keep, peq, prod, canon), set(), orient=True)
    if not any(r.kernels for r in regions):
        return Twins((), unchanged, (), 0, none + " (twin pairs found, but no pair of kernels)", scan)
    stacked_carry = _carried_pairs(scan, regions, pvar)
    nc = scan.num_consts
    carried = {(body.invars[nc + a], body.invars[nc + b]) for a, b in stacked_carry}
    _, stacks, reverses = _stacking(regions, carried, orient=False)
    stacks += reverses  # a reversed operand is a copy per step too
    return Twins(tuple(regions), tuple(schedule), tuple(stacked_carry), stacks, "", scan, reverses)


def describe(twins: Twins, scan: C.ScanParams) -> str:
    return (
        f"{len(twins.regions)} twin region(s) of {sum(len(r.pairs) for r in twins.regions)} equation pairs "
        f"batched ({twins.kernels} kernel pairs, {len(twins.stacked_carry)} carried pairs stacked, "
        f"{twins.stacks} operands stacked per step)"
    )


def _read_pair(local: dict, x: Any, y: Any) -> Any:
    """The value of operand pair ``(x, y)`` in a region's vmap: the pair, or the one value both
    sides read (``Region.inputs`` lists it as ``(x, x)``, or ``(y, y)`` for a region computed from
    its other side)."""
    for key in ((x, y), (x, x), (y, y)):
        if key in local:
            return local[key]
    raise KeyError(f"batch_twins: operand pair {x}, {y} not in the region")


def _run_region(reg: Region, eqns: list, env: dict, stacked: dict, interp: I.Interpreter, ctx: Any) -> None:
    args, axes = [], []
    for x, y in reg.inputs:
        if x is y:
            args.append(env[x])
            axes.append(None)
        elif (x, y) in stacked:
            args.append(stacked[(x, y)])
            axes.append(0)
        elif (y, x) in stacked:
            args.append(stacked[(y, x)][::-1])
            axes.append(0)
        else:
            stacked[(x, y)] = jnp.stack([env[x], env[y]])  # reused by later regions
            args.append(stacked[(x, y)])
            axes.append(0)

    def one_side(*vals):
        local = dict(zip(reg.inputs, vals, strict=True))
        for a, b in reg.pairs:
            ea, eb = eqns[a], eqns[b]
            invals = [
                x.val if C.is_literal(x) else _read_pair(local, x, y)
                for x, y in zip(ea.invars, eb.invars, strict=True)
            ]
            outs = interp.eval_eqn(a, ea, invals, ctx)  # a list, one value per outvar
            for x, y, o in zip(ea.outvars, eb.outvars, outs, strict=True):
                local[(x, y)] = o
        return [local[p] for p in reg.outputs]

    results = jax.vmap(one_side, in_axes=tuple(axes))(*args)
    for (x, y), r in zip(reg.outputs, results, strict=True):
        stacked[(x, y)] = r
        if not C.is_dropvar(x):
            env[x] = r[0]
        if not C.is_dropvar(y):
            env[y] = r[1]


def _run_batched(twins: Twins, invals: list, site: I.Site, interp: I.Interpreter):
    scan = twins.scan
    body, ctx = scan.body, site.body_ctx
    eqns = list(body.eqns)
    nc, nk = scan.num_consts, scan.num_carry
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    pairs = twins.stacked_carry
    in_pair = {k for p in pairs for k in p}
    singles = [k for k in range(nk) if k not in in_pair]
    cin, cout = body.invars[nc : nc + nk], body.outvars[:nk]

    def step(carry, x):
        single_vals, stacked_vals = carry
        env = dict(zip(body.constvars, scan.body_consts, strict=True))
        env.update(zip(body.invars[:nc], consts, strict=True))
        env.update(zip(body.invars[nc + nk :], x, strict=True))
        env.update(zip([cin[k] for k in singles], single_vals, strict=True))
        stacked: dict = {}
        for (k1, k2), s in zip(pairs, stacked_vals, strict=True):
            env[cin[k1]], env[cin[k2]] = s[0], s[1]
            stacked[(cin[k1], cin[k2])] = s
        for item in twins.schedule:
            if isinstance(item, tuple):
                _run_region(twins.regions[item[1]], eqns, env, stacked, interp, ctx)
            else:
                interp.eval_item(body, item, env, ctx)
        new_single = [C.read_atom(env, cout[k]) for k in singles]
        new_stacked = []
        for k1, k2 in pairs:
            s = stacked.get((cout[k1], cout[k2]))
            new_stacked.append(
                s if s is not None else jnp.stack([C.read_atom(env, cout[k1]), C.read_atom(env, cout[k2])])
            )
        ys = [C.read_atom(env, v) for v in body.outvars[nk:]]
        return (new_single, new_stacked), ys

    I.named(step, site.name or I.body_name(body, C.SCAN))  # the original name, not the inlined trace's
    init_c = ([init[k] for k in singles], [jnp.stack([init[k1], init[k2]]) for k1, k2 in pairs])
    (single_vals, stacked_vals), ys = jax.lax.scan(
        step, init_c, list(xs), length=scan.length, reverse=scan.reverse, unroll=scan.unroll
    )
    final = [None] * nk
    for k, v in zip(singles, single_vals, strict=True):
        final[k] = v
    for (k1, k2), s in zip(pairs, stacked_vals, strict=True):
        final[k1], final[k2] = s[0], s[1]
    return [*final, *ys]


def batch_twins(where: Where = None) -> Transform:
    """Run the twin computations of the chosen scans' bodies (the two critics of SAC) as one vmap
    over stacked pairs, carrying stacked pairs stacked. See the module docstring for legality and
    tolerance."""

    return split_scan_transform(
        "batch_twins",
        (("where", where),),
        REASSOCIATION_TOLERANCE,
        where,
        find_twins,
        describe,
        "each region's two sides are independent and the region convex in its body; ",
        lambda twins, scan, invals, site, interp: _run_batched(twins, invals, site, interp),
        f"batch the twin computations of the scan(s) at {where_label(where)} as one vmap",
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Per scan of at least two steps with twin matrix products (those in a profiled window;
    without windows every one), most expensive first.

    Model (seconds per iteration): ``trips x (kernel pairs x`` :data:`KERNEL_S` ``- operands
    stacked per step x`` :data:`STACK_S` ``)``, offered only where positive.
    """
    out: list[Candidate] = []
    k_s = KERNEL_S.get(ctx.platform, KERNEL_S["gpu"])
    s_s = STACK_S.get(ctx.platform, STACK_S["gpu"])
    for _, where, twins, trips in split_scans(ctx, find_twins):
        gain = trips * (twins.kernels * k_s - twins.stacks * s_s)
        if gain <= 0:
            continue
        out.append(
            Candidate(
                batch_twins(where),
                where,
                gain,
                f"{trips} steps x ({twins.kernels} kernel pairs batched x {k_s * 1e6:.1f}us - "
                f"{twins.stacks} operands stacked x {s_s * 1e6:.1f}us)",
            )
        )
    return out
