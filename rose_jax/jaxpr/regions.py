"""A loop body as straight-line operations, cut into regions that can run side by side.

A scan body (or any open jaxpr) is flattened into :class:`Op` s (:func:`flatten_body`: every
plain call without effects inlined, each inlined instance's vars keyed apart), so that dataflow
is per primitive. A :class:`RegionPlan` cuts the flat body into a prelude, regions with no
dataflow between them, and an epilogue; the regions come from named components
(:func:`component_region_indices`), from the work that produces each group of carried state
(:func:`state_plan`: a backward slice per group, :func:`slice_regions`), or from two zipped loop
bodies (:func:`loop_pair_plan`). :func:`plan_regions` checks that regions are independent and
contiguous in dataflow and says, when they are not, what couples them and where it is computed
(source frames and components of the equations, e.g. an optax global-norm clip).

Built on :mod:`rose_jax.jaxpr.dataflow` (forward reachability, backward slices, read and defined
sets, over these ops as over equations); every read of ``eqn.params`` is in
:mod:`rose_jax.jaxpr.compat`. Unlike :func:`rose_jax.jaxpr.cut.flatten_calls` (which inlines only
the calls a component cut must see into, reusing the callee's vars), :func:`flatten_body` inlines
every pure call and keys each inlined instance's vars apart (a function jitted once and called
twice in a body inlines the same callee vars twice). What a region may
contain is the caller's rule (``check``): the stream family (:mod:`rose_jax.optimize.stream_overlap`)
refuses loops, side effects and nested ``compute_on`` regions, which XLA does not compile in an
annotated region.
"""

from __future__ import annotations

import collections
import re
from typing import Any, Callable, NamedTuple, Sequence

from rose_jax.jaxpr import compat as C
from rose_jax.jaxpr import dataflow as D

# what a region may hold, decided by the caller: check(ops, indices, region name) raises
# ValueError with the reason
RegionCheck = Callable[[Sequence[Any], Sequence[int], str], None]

# ---------------------------------------------------------------------------- descriptions

_JAX_FILE = re.compile(r"/(jax|jaxlib)/")


def _user_frames(eqn: Any, n: int = 2) -> list[str]:
    """The innermost ``n`` source frames of ``eqn`` outside JAX, as ``file:function``."""
    tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
    frames = getattr(tb, "frames", None) or []
    out = []
    for f in frames:
        name = getattr(f, "file_name", "")
        if _JAX_FILE.search(name) or not name:
            continue
        short = name.split("site-packages/")[-1].split("/work/main/")[-1]
        out.append(f"{short}:{getattr(f, 'function_name', '?')}")
        if len(out) >= n:
            break
    return out


def _where_computed(eqn: Any) -> str:
    comps = C.component_path(eqn)
    frames = _user_frames(eqn)
    parts = []
    if frames:
        parts.append(" <- ".join(frames))
    if comps:
        parts.append(f"component {comps[-1]!r}")
    return ", ".join(parts) or eqn.primitive.name


def _why_phrase(eqns: Sequence[Any]) -> str:
    text = " ".join(" ".join(_user_frames(e, 4)) for e in eqns)
    if "global_norm" in text or "tree_norm" in text:
        return " (a global norm over both gradient trees, e.g. optax.clip_by_global_norm)"
    if "count" in text.lower():
        return " (a shared optimizer step count)"
    return ""


def _var_str(v: Any) -> str:
    if isinstance(v, tuple) and len(v) == 2:  # a flattened body's (instance, var) key
        v = v[1]
    aval = C.aval_of(v)
    return str(getattr(aval, "str_short", lambda: aval)()) if aval is not None else str(v)


# ---------------------------------------------------------------------------- flat bodies


class Const(NamedTuple):
    """A value a call closes over (an atom without dataflow, like a Literal)."""

    value: Any


class Op(NamedTuple):
    """One primitive equation of a flattened level: plain jit calls are inlined, so dataflow is
    per primitive (optax jits e.g. its bias correction over every leaf at once). ``invars`` /
    ``outvars`` are keys ``(instance, var)`` (unique per inlined call instance), Literals,
    :class:`Const` or DropVars; ``eqn`` carries the full name stack."""

    eqn: Any
    invars: tuple
    outvars: tuple


class FlatBody(NamedTuple):
    """A jaxpr level as :class:`Op` s: ``const_keys``/``in_keys`` bind its constvars/invars,
    ``out_atoms`` are its results (keys, Literals or Consts)."""

    ops: tuple[Op, ...]
    const_keys: tuple
    in_keys: tuple
    out_atoms: tuple


def is_value(a: Any) -> bool:
    """An operand that carries dataflow (not a Literal, a :class:`Const` or a DropVar)."""
    return not (C.is_literal(a) or isinstance(a, Const) or C.is_dropvar(a))


def read_atom(env: dict, a: Any) -> Any:
    """The value of operand ``a``: a Literal's or Const's own, else ``env[a]``."""
    if C.is_literal(a):
        return a.val
    if isinstance(a, Const):
        return a.value
    return env[a]


def flatten_body(jaxpr: Any) -> FlatBody:
    """``jaxpr`` (open) as a :class:`FlatBody`, every plain call without effects inlined."""
    ops: list[Op] = []

    def walk(eqns, instance: tuple, local: dict) -> None:
        def key(a):
            if C.is_literal(a):
                return a
            return local.get(a, (instance, a))

        for idx, e in enumerate(eqns):
            if e.primitive.name in C.PLAIN_CALL_PRIMITIVES and not C.has_effects(e):
                inner, inner_consts = C.call_jaxpr(e.params)
                sub = {v: key(a) for v, a in zip(inner.invars, e.invars, strict=True)}
                sub.update({v: Const(c) for v, c in zip(inner.constvars, inner_consts, strict=True)})
                walk([C.prefixed(q, e) for q in inner.eqns], instance + (idx,), sub)
                inner_key = {
                    v: (sub[v] if v in sub else (instance + (idx,), v))
                    for v in inner.outvars
                    if not C.is_literal(v)
                }
                for ov, iv in zip(e.outvars, inner.outvars, strict=True):
                    if not C.is_dropvar(ov):
                        local[ov] = iv if C.is_literal(iv) else inner_key[iv]
                continue
            outs = tuple(v if C.is_dropvar(v) else (instance, v) for v in e.outvars)
            ops.append(Op(e, tuple(key(a) for a in e.invars), outs))

    top: dict = {}
    walk(list(jaxpr.eqns), (), top)
    constvars, invars = C.in_vars(jaxpr)

    def out_key(a):
        return a if C.is_literal(a) else top.get(a, ((), a))

    return FlatBody(
        tuple(ops),
        tuple(((), v) for v in constvars),
        tuple(((), v) for v in invars),
        tuple(out_key(a) for a in jaxpr.outvars),
    )


def reads(ops: Sequence[Op]) -> list:
    """Keys ``ops`` read that they do not define, in first-use order."""
    return D.read_set(ops, is_value)


def defined(ops: Sequence[Op]) -> list:
    """Keys ``ops`` define, in order."""
    return D.defined_vars(ops, is_value)


# ---------------------------------------------------------------------------- region plans


class RegionPlan(NamedTuple):
    """How one flattened loop body runs: ``prelude`` (main stream), then each of ``regions``
    (op indices of ``body``) on stream ``k + 1``, then ``epilogue`` (main stream).

    ``names``: one per region; ``shared``: what the prelude computes that several regions read.
    """

    body: FlatBody
    names: tuple[str, ...]
    regions: tuple[tuple[int, ...], ...]
    prelude: tuple[int, ...]
    epilogue: tuple[int, ...]
    shared: str = ""

    def schedule(self) -> list:
        return list(self.prelude) + [("stream", k) for k in range(len(self.regions))] + list(self.epilogue)

    def describe(self, loop: str) -> str:
        on = ", ".join(f"{n} on stream {k + 1}" for k, n in enumerate(self.names))
        sizes = "/".join(str(len(r)) for r in self.regions)
        shared = f"; shared prelude: {self.shared}" if self.shared else ""
        return (
            f"in each step of {loop}: {on} ({sizes} equations), overlapped; {len(self.prelude)} "
            f"equation(s) before and {len(self.epilogue)} after on the main stream{shared}"
        )


def plan_regions(
    body: FlatBody, regions: dict[str, Sequence[int]], shared: str = "", check: RegionCheck | None = None
) -> RegionPlan:
    """A :class:`RegionPlan` for ``regions`` (name -> op indices of ``body``).

    Raises ``ValueError`` with the reason when the regions cannot run side by side: a region
    is empty, overlaps another, fails ``check`` (the caller's rule for what a region may hold,
    e.g. no loop / side effect / compute_on for a stream region), a region reads a value
    computed from another's results (directly or through other equations), or a region is not
    contiguous in dataflow (an equation outside it reads its result and feeds it back).
    """
    ops = body.ops
    names = list(regions)
    if len(names) < 2:
        raise ValueError(f"need at least two regions, got {names}")
    owner: dict[int, str] = {}
    for name in names:
        idxs = sorted(set(regions[name]))
        if not idxs:
            raise ValueError(f"{name} has no equations in this loop body")
        for i in idxs:
            if i in owner:
                raise ValueError(f"{name} and {owner[i]} share equation {i} ({ops[i].eqn.primitive.name})")
            owner[i] = name
        if check is not None:
            check(ops, idxs, name)
    all_regions = set(owner)
    reach: dict[str, set] = {}
    for name in names:
        mine = set(regions[name])
        produced = defined([ops[i] for i in mine])
        reach[name] = D.forward(ops, produced, skip=mine)
        produced_set = set(produced)
        for i in sorted(mine):
            back = [a for a in ops[i].invars if is_value(a) and a in reach[name] and a not in produced_set]
            if back:
                raise ValueError(
                    f"{name} is not contiguous in dataflow: its equation {i} ({ops[i].eqn.primitive.name}) "
                    f"reads {_var_str(back[0])}, computed outside {name} from {name}'s own results"
                )
    for a in names:
        produced_a = set(defined([ops[i] for i in regions[a]]))
        for b in names:
            if a == b:
                continue
            for i in sorted(regions[b]):
                hit = [x for x in ops[i].invars if is_value(x) and x in reach[a]]
                if hit:
                    how = "the result" if hit[0] in produced_a else "a value computed from the results"
                    raise ValueError(
                        f"{b} reads {how} of {a} ({_var_str(hit[0])} at {ops[i].eqn.primitive.name}, "
                        f"{_where_computed(ops[i].eqn)}): they are dependent"
                    )
    everything = D.forward(ops, defined([ops[i] for i in all_regions]), skip=all_regions)
    epilogue, prelude = [], []
    for i, op in enumerate(ops):
        if i in all_regions:
            continue
        (epilogue if any(is_value(a) and a in everything for a in op.invars) else prelude).append(i)
    return RegionPlan(
        body,
        tuple(names),
        tuple(tuple(sorted(set(regions[n]))) for n in names),
        tuple(prelude),
        tuple(epilogue),
        shared,
    )


def relative_components(eqn: Any, outer: Sequence[str]) -> tuple[str, ...]:
    """``eqn``'s component path below the components ``outer`` that enclose its level."""
    path = C.component_path(eqn)
    k = 0
    while k < len(path) and k < len(outer) and path[k] == outer[k]:
        k += 1
    return path[k:]


def component_region_indices(body: FlatBody, names: Sequence[str], outer: Sequence[str] = ()) -> dict:
    """name -> op indices of ``body`` inside ``rose_jax.component(name)`` (``outer``: the
    components enclosing the level, which the equations' name stacks may repeat)."""
    return {
        n: [i for i, op in enumerate(body.ops) if n in relative_components(op.eqn, outer)] for n in names
    }


def slice_regions(
    body: FlatBody, targets: dict[str, Sequence[Any]], owned: dict[str, Sequence[Any]]
) -> tuple[dict[str, list[int]], str]:
    """Regions that produce each group's ``targets`` (keys), and what the groups share.

    A group's region is the backward slice of its targets minus what other groups' slices
    also need. Shared equations that depend on no group's ``owned`` inputs (e.g. Adam's step
    count) run once before the regions. A shared equation that depends on a group's owned
    inputs couples the groups (e.g. a global-norm clip over both gradient trees):
    ``ValueError`` names where it is computed.
    """
    ops = body.ops
    names = list(targets)
    slices = {g: set(D.needed_eqns(ops, [t for t in targets[g] if is_value(t)])) for g in names}
    taint = {g: D.forward(ops, [v for v in owned[g] if is_value(v)]) for g in names}
    count: collections.Counter = collections.Counter(i for g in names for i in slices[g])
    shared = sorted(i for i, k in count.items() if k >= 2)
    sources = {
        i: [g for g in names if any(v in taint[g] for v in ops[i].outvars if is_value(v))] for i in shared
    }
    coupled = [i for i in shared if sources[i]]
    if coupled:
        # where values of several groups' states meet (e.g. a norm over both gradient trees);
        # else where one group's values enter what another group's update needs
        joins = [i for i in coupled if len(sources[i]) >= 2] or coupled
        src = sorted({g for i in coupled for g in sources[i]})
        where = collections.Counter(_where_computed(ops[j].eqn) for j in joins).most_common(2)
        feed = "both updates" if len(src) > 1 else "the other updates"
        raise ValueError(
            f"{' and '.join(names)} are coupled: {len(joins)} equation(s) combine values computed from "
            f"{' and '.join(src)}'s state and feed {feed}, at "
            f"{'; '.join(w for w, _ in where)}{_why_phrase([ops[j].eqn for j in joins])}"
        )
    regions = {g: sorted(slices[g] - set(shared)) for g in names}
    note = ""
    if shared:
        top = collections.Counter(_where_computed(ops[j].eqn) for j in shared).most_common(2)
        note = (
            f"{len(shared)} equation(s) read by several groups and computed from no group's state, once "
            + ("(" + "; ".join(w for w, _ in top) + ")")
        )
    return regions, note


# ------------------------------------------------------------------------- carried state

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tokens(path: str | None) -> frozenset[str]:
    """The names in a pytree path string (``"state.params.policy[0]"`` -> policy, params, state)."""
    return frozenset(_TOKEN.findall(path or ""))



def group_slots(
    labels: Sequence[str | None], scan: C.ScanParams, groups: Sequence[str]
) -> dict[str, list[int]]:
    """group -> carry slot indices whose path names the group (a slot naming two is an error)."""
    nc = scan.num_consts
    slots: dict[str, list[int]] = {g: [] for g in groups}
    for k in range(scan.num_carry):
        toks = tokens(labels[nc + k] if nc + k < len(labels) else None)
        hit = [g for g in groups if g in toks]
        if len(hit) > 1:
            raise ValueError(f"carry slot {labels[nc + k]} names several groups ({', '.join(hit)})")
        if hit:
            slots[hit[0]].append(k)
    return slots


def state_plan(
    scan: C.ScanParams, labels: Sequence[str | None], groups: Sequence[str], check: RegionCheck | None = None
) -> RegionPlan:
    """The :class:`RegionPlan` of a scan body whose regions produce each group's carried state
    (``labels``: the input path of each body operand or None; ``check`` as in :func:`plan_regions`)."""
    slots = group_slots(labels, scan, groups)
    empty = [g for g in groups if not slots[g]]
    if empty:
        raise ValueError(f"no carried state of this loop is named {', '.join(map(repr, empty))}")
    body, nc = flatten_body(scan.body), scan.num_consts
    targets = {g: [body.out_atoms[k] for k in slots[g]] for g in groups}
    owned = {g: [body.in_keys[nc + k] for k in slots[g]] for g in groups}
    regions, note = slice_regions(body, targets, owned)
    return plan_regions(body, regions, note, check)


def loop_pair_plan(
    jaxpr: Any,
    n_carry: tuple[int, int],
    n_xs: tuple[int, int],
    n_ys_first: int,
    names: tuple[str, str],
    check: RegionCheck | None = None,
) -> RegionPlan:
    """The plan of a zipped loop body (operands ``consts + carry_a + carry_b + xs_a + xs_b``,
    results ``carry_a + carry_b + ys_a + ys_b``, ``n_ys_first`` = len(ys_a)): each original
    body becomes a region (``check`` as in :func:`plan_regions`)."""
    body = flatten_body(jaxpr)
    ca, cb = n_carry
    xa, xb = n_xs
    outs, ins = list(body.out_atoms), list(body.in_keys)
    nconst = len(ins) - ca - cb - xa - xb
    ya = n_ys_first
    targets = {
        names[0]: outs[:ca] + outs[ca + cb : ca + cb + ya],
        names[1]: outs[ca : ca + cb] + outs[ca + cb + ya :],
    }
    carry_in, xs_in = ins[nconst : nconst + ca + cb], ins[nconst + ca + cb :]
    owned = {names[0]: carry_in[:ca] + xs_in[:xa], names[1]: carry_in[ca:] + xs_in[xa:]}
    regions, note = slice_regions(body, targets, owned)
    return plan_regions(body, regions, note, check)


def state_groups(labels: Sequence[str | None], scan: C.ScanParams) -> tuple[str, ...] | None:
    """Names that split the carried state into sibling subtrees under at least two prefixes
    (PPO: ``params.{policy,value}`` and Adam's ``mu.{policy,value}``, ``nu.{...}``)."""
    nc = scan.num_consts
    children: dict[tuple[str, ...], set[str]] = collections.defaultdict(set)
    for k in range(scan.num_carry):
        path = labels[nc + k] if nc + k < len(labels) else None
        toks = _TOKEN.findall(path or "")
        for d in range(len(toks) - 1):
            children[tuple(toks[:d])].add(toks[d])
    found: dict[tuple[str, ...], list[int]] = {}
    for prefix, kids in children.items():
        if 2 <= len(kids) <= 4:
            found.setdefault(tuple(sorted(kids)), []).append(len(prefix))
    # repeated under >= 2 prefixes (parameters and their optimizer moments), shallowest first
    ranked = sorted((min(d), -len(d), g) for g, d in found.items() if len(d) >= 2)
    return ranked[0][2] if ranked else None

