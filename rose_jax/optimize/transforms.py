"""Transformations of an RL iteration that keep its results: ``Transform`` and the factories.

A :class:`Transform` is frozen data (``name``, ``params``, ``tolerance``, ``level``) plus two
pure functions:

* ``legal(tree) -> (ok, reason)``: decided from the :class:`rose_jax.trace.LoopTree` of the
  program (loop structure, read/write sets; the tree's jaxpr where equations matter);
* ``apply(fn) -> fn``: the transformed function. ``level="fn"`` transforms are jaxpr rewrites
  (``rose_jax.optimize.interpret``) and compose with ``jax.jit`` / ``vmap`` / ``grad``; given a
  :class:`rose_jax.optimize.program.Program` they rewrite its ``collect`` and ``learn``.
  ``level="program"`` transforms take and return a ``Program``; ``level="host"`` ones return a
  host-level callable (several processes), which cannot be jitted.

``tolerance`` says how close the transformed program's results must be to the original's:
``Tolerance(0, 0)`` means bitwise equality is expected; otherwise ``rtol``/``atol`` and why.

Factories: :func:`unroll_scans`, :func:`hoist_invariants`, :func:`overlap_independent`, and
:func:`group_rollout` (in :mod:`rose_jax.optimize.program`, re-exported here).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from rose_jax.optimize import _compat as C
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import EXACT, FUSION_TOLERANCE, Tolerance, Transform, compose, short  # noqa: F401

# ------------------------------------------------------------------------------ where specs

Where = str | Sequence[str] | Callable[[Any], bool] | None


def _keys(where: str | Sequence[str]) -> tuple[str, ...]:
    keys = tuple(k for k in (where.split("/") if isinstance(where, str) else where) if k)
    if not keys:
        raise ValueError(f"where={where!r} names no component or loop")
    return keys


def _is_subsequence(keys: Sequence[str], seq: Sequence[str]) -> bool:
    it = iter(seq)
    return all(any(k == s for s in it) for k in keys)


def matcher(where: Where) -> Callable[[Sequence[str], str], bool]:
    """``match(component_path, loop_name)`` for a where spec.

    ``None``: every loop. ``"a/b"`` (or ``("a", "b")``): the loop's enclosing components followed
    by its body function name contain ``a`` then ``b`` (intermediate levels may be skipped), so
    ``"rollout"`` is every loop inside the rollout and ``"update/minibatch_step"`` the inner
    update loop. A callable gets the :class:`rose_jax.optimize.interpret.Site` (or LoopTree
    node) and returns a bool.
    """
    if where is None:
        return lambda path, name, obj=None: True
    if callable(where):
        return lambda path, name, obj=None: bool(where(obj))
    keys = _keys(where)
    return lambda path, name, obj=None: _is_subsequence(keys, tuple(path) + (name,))


def _site_select(where: Where, primitive: str = C.SCAN) -> Callable[[I.Site], bool]:
    match = matcher(where)
    return lambda site: site.primitive == primitive and match(site.component_path, site.name, site)


def tree_loops(tree: Any, where: Where, kind: str = "scan") -> list:
    """LoopTree nodes of ``kind`` matching ``where`` (same rules as :func:`matcher`)."""
    match = matcher(where)
    return [n for n in tree.walk() if n.kind == kind and match(n.component_path, n.name, n)]


def _where_label(where: Where) -> str:
    return "every scan" if where is None else f"where={short(where)}"


# ------------------------------------------------------------------------------ unroll_scans


def unroll_scans(factor: int | bool, where: Where = None) -> Transform:
    """Rebuild the chosen scans with ``unroll=factor`` (``True``: fully unrolled).

    Cross-loop-level restructuring: ``factor`` steps of the loop run in one iteration of the
    compiled while loop, so XLA pays the per-iteration loop overhead (on GPU: a device-to-host
    copy of the loop predicate per iteration unless XLA converts the loop) ``factor`` times less
    often and can fuse across those steps. Legal for every scan (unrolling keeps the order of
    operations); results equal up to :data:`FUSION_TOLERANCE`.
    """
    if isinstance(factor, bool):
        if not factor:
            raise ValueError("unroll_scans: factor=False unrolls nothing; use an int >= 2 or True")
    elif not isinstance(factor, int) or factor < 2:
        raise ValueError(f"unroll_scans: factor must be an int >= 2 or True, got {factor!r}")
    select = _site_select(where)

    def legal(tree):
        loops = tree_loops(tree, where)
        if not loops:
            return False, f"no scan matches {_where_label(where)}"
        longer = [n for n in loops if n.trip_count is None or factor is True or n.trip_count > 1]
        if not longer:
            return False, "every matching scan has a single iteration: nothing to unroll"
        names = ", ".join(sorted({"/".join(n.component_path + (n.name,)) for n in loops}))
        return True, f"unrolling keeps the order of operations; {len(loops)} scan(s): {names}"

    def on_scan(site, scan, invals, interp):
        unroll = factor if factor is True else min(int(factor), max(scan.length, 1))
        return interp.rebuild_scan(scan, invals, site.body_ctx, unroll=unroll)

    def apply(fn):
        return I.rewrite(fn, select, on_scan)

    return Transform(
        "unroll_scans",
        (("factor", factor), ("where", where)),
        FUSION_TOLERANCE,
        "fn",
        legal,
        apply,
        summary=f"unroll the scan(s) at {_where_label(where)} by {factor}",
    )


# -------------------------------------------------------------------------- hoist_invariants

# Shape-only equations: hoisting them would only materialise (e.g. broadcast) arrays that XLA
# fuses into their consumers anyway, so they stay in the loop unless a hoisted equation needs them.
_CHEAP = frozenset(
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
        "rev",
        "slice",
        "pjit_identity",
    }
)


def invariant_eqns(scan: C.ScanParams) -> frozenset[int]:
    """Indices of body equations that depend only on the loop's constants (and are worth hoisting).

    An equation is invariant when it has no effects and every operand is a literal, a body
    const, one of the scan's ``num_consts`` constant operands, or an invariant equation's
    result. Invariant shape-only equations (:data:`_CHEAP`) whose results feed only the loop
    stay in it.
    """
    body = scan.body
    inv = set(body.constvars) | set(body.invars[: scan.num_consts])
    hoist: list[int] = []
    for i, eqn in enumerate(body.eqns):
        if C.has_effects(eqn):
            continue
        if all(C.is_literal(a) or a in inv for a in eqn.invars):
            hoist.append(i)
            inv.update(v for v in eqn.outvars if not C.is_dropvar(v))
    chosen = set(hoist)
    readers: dict[Any, set[int]] = {}
    for i, eqn in enumerate(body.eqns):
        for a in eqn.invars:
            if not C.is_literal(a):
                readers.setdefault(a, set()).add(i)
    for i in reversed(hoist):
        eqn = body.eqns[i]
        if eqn.primitive.name not in _CHEAP:
            continue
        needed_outside = any(r in chosen for v in eqn.outvars for r in readers.get(v, ()))
        if not needed_outside:
            chosen.discard(i)
    return frozenset(chosen)


def hoist_invariants(where: Where = None) -> Transform:
    """Move loop-invariant equations (pure, reading only the scan's constants) out of scans.

    Cross-loop-level move: the equations run once before the loop instead of every iteration;
    the loop reads their results as constants. Legal when such equations exist (they are pure
    and read no carry and no per-iteration input, by construction). Note that XLA's own
    while-loop invariant code motion already hoists much of this at compile time, so the gain is
    often zero: measured numbers decide.
    """
    select = _site_select(where)

    def legal(tree):
        loops = tree_loops(tree, where)
        if not loops:
            return False, f"no scan matches {_where_label(where)}"
        counts = []
        for node in loops:
            eqns = node.eqns()
            if len(eqns) != 1 or eqns[0].primitive.name != C.SCAN:
                continue
            n = len(invariant_eqns(C.scan_params(eqns[0].params)))
            if n:
                counts.append(f"{'/'.join(node.component_path + (node.name,))}: {n}")
        if not counts:
            return False, "no loop-invariant equations in the matching scans: nothing to hoist"
        return True, "pure equations reading only loop constants; " + ", ".join(counts)

    def on_scan(site, scan, invals, interp):
        chosen = invariant_eqns(scan)
        if not chosen:
            return interp.rebuild_scan(scan, invals, site.body_ctx)
        body = scan.body
        env = dict(zip(body.constvars, scan.body_consts, strict=True))
        env.update(zip(body.invars[: scan.num_consts], invals[: scan.num_consts], strict=True))
        for i in sorted(chosen):  # evaluated here, outside the loop
            eqn = body.eqns[i]
            outs = interp.eval_eqn(i, eqn, [C.read_atom(env, a) for a in eqn.invars], site.body_ctx)
            env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if not C.is_dropvar(v))
        hoisted = {v: env[v] for i in chosen for v in body.eqns[i].outvars if not C.is_dropvar(v)}
        return interp.rebuild_scan(scan, invals, site.body_ctx, hoisted=hoisted, skip=chosen)

    def apply(fn):
        return I.rewrite(fn, select, on_scan)

    return Transform(
        "hoist_invariants",
        (("where", where),),
        FUSION_TOLERANCE,
        "fn",
        legal,
        apply,
        summary=f"hoist loop-invariant equations out of the scan(s) at {_where_label(where)}",
    )


# ---------------------------------------------------------------------- overlap_independent


def _independent(a, b, tree) -> tuple[bool, str]:
    """``rose_jax.trace.deps``: dataflow, read/write sets and loop-carried dependencies."""
    from rose_jax.trace import deps  # noqa: PLC0415

    why = deps.dependency(a, b, tree)
    if why is None:
        return True, "no dataflow, disjoint read/write sets, no loop-carried dependency"
    return False, why


def _one(tree, spec, kinds):
    match = matcher(spec)
    found = [n for n in tree.walk() if n.kind in kinds and match(n.component_path, n.name, n)]
    if not found:
        raise ValueError(f"no node matches {spec!r}")
    if len(found) > 1:
        # prefer the outermost matches; still ambiguous if several remain at that depth
        depth = min(len(n.index) for n in found)
        found = [n for n in found if len(n.index) == depth]
        if len(found) > 1:
            raise ValueError(f"{spec!r} matches {len(found)} nodes; name one (e.g. 'component/loop_fn')")
    return found[0]


def overlap_independent(a: str | Sequence[str], b: str | Sequence[str], mode: str = "fused") -> Transform:
    """Run two independent sibling nodes ``a`` and ``b`` side by side.

    ``mode="fused"``: ``a`` and ``b`` are sibling scans with equal trip counts; they become ONE
    scan whose body runs both bodies (loop fusion across components): one loop instead of two,
    and XLA sees both bodies' work in one kernel schedule. Equations that ``b`` needs and that
    sit between the two loops move before the fused loop. ``mode="processes"``: ``b`` runs in a
    worker process under MPS while ``a`` runs here (see :mod:`rose_jax.optimize.processes`).

    Legal only when ``rose_jax.trace.deps.independent(a, b)`` (no path from one's writes to the
    other's reads, transitively through the siblings between them) and, for ``fused``, both
    are scans of the same length and direction under the same parent.
    """
    if mode not in ("fused", "processes"):
        raise ValueError(f"overlap_independent: mode must be 'fused' or 'processes', got {mode!r}")
    kinds = ("scan",) if mode == "fused" else ("scan", "while", "component", "call", "cond")

    def legal(tree):
        na, nb = _one(tree, a, kinds), _one(tree, b, kinds)
        if na is nb:
            return False, f"{a!r} and {b!r} are the same node"
        same_level = na.level is not None and na.level is nb.level
        if not same_level and (mode == "fused" or na.index[:-1] != nb.index[:-1]):
            return (
                False,
                f"{a!r} and {b!r} are not at the same loop level (not siblings): move one level first",
            )
        ok, why = _independent(na, nb, tree)
        if not ok:
            return False, f"{a!r} and {b!r} are dependent: {why}"
        if mode == "fused":
            if na.trip_count is None or na.trip_count != nb.trip_count:
                return (
                    False,
                    f"trip counts differ ({na.trip_count} vs {nb.trip_count}): fusing needs equal lengths",
                )
            ea, eb = na.eqns(), nb.eqns()
            if len(ea) != 1 or len(eb) != 1:
                return False, "fused mode needs each node to be a single scan equation"
            ra, rb = C.scan_params(ea[0].params).reverse, C.scan_params(eb[0].params).reverse
            if ra != rb:
                return False, "one scan runs in reverse and the other does not"
        return True, f"independent ({why})"

    if mode == "processes":
        from rose_jax.optimize import processes  # noqa: PLC0415 - host-level machinery

        def apply(fn):
            return processes.overlap_in_processes(fn, a, b)

        return Transform(
            "overlap_independent",
            (("a", a), ("b", b), ("mode", mode)),
            EXACT,
            "host",
            legal,
            apply,
            summary=f"run {b!r} in a worker process while {a!r} runs here",
        )

    def apply(fn):
        return fuse_scans(fn, a, b)

    return Transform(
        "overlap_independent",
        (("a", a), ("b", b), ("mode", mode)),
        FUSION_TOLERANCE,
        "fn",
        legal,
        apply,
        summary=f"fuse the independent scans {a!r} and {b!r} into one loop",
    )


class _FusingInterpreter(I.Interpreter):
    """An interpreter that fuses two sibling scans (chosen by ``pick_a`` / ``pick_b``)."""

    def __init__(self, pick_a, pick_b):
        super().__init__(lambda site: False, None)
        self.pick_a, self.pick_b = pick_a, pick_b
        self.fused = 0

    def contains_target(self, jaxpr, ctx):
        key = (id(jaxpr), ctx.address)
        if key not in self._contains:
            self._contains[key] = self._pair_at(jaxpr, ctx) is not None or any(
                self.contains_target(s, c)
                for i, eqn in enumerate(jaxpr.eqns)
                for s, c in I._subs_with_ctx(ctx, i, eqn)
            )
        return self._contains[key]

    def _pair_at(self, jaxpr, ctx):
        ia = ib = None
        for i, eqn in enumerate(jaxpr.eqns):
            if eqn.primitive.name != C.SCAN:
                continue
            site = I._site(ctx, i, eqn)
            if ia is None and self.pick_a(site):
                ia = i
            elif ib is None and self.pick_b(site):
                ib = i
        if ia is None or ib is None:
            return None
        return (ia, ib) if ia < ib else (ib, ia)

    def eval(self, jaxpr, consts, args, ctx=I.ROOT, known=None, skip=frozenset()):
        pair = self._pair_at(jaxpr, ctx)
        if pair is None:
            return super().eval(jaxpr, consts, args, ctx, known, skip)
        first, second = pair
        eqns = jaxpr.eqns
        produced_by = {v: i for i, e in enumerate(eqns) for v in e.outvars}
        needed, stack = set(), [a for a in eqns[second].invars if not C.is_literal(a)]
        while stack:  # equations between the loops that the second loop depends on
            var = stack.pop()
            i = produced_by.get(var)
            if i is None or i < first or i in needed:
                continue
            if i == first:
                raise ValueError("the second scan depends on the first: they cannot be fused")
            needed.add(i)
            stack.extend(a for a in eqns[i].invars if not C.is_literal(a))
        order = (
            list(range(first))
            + sorted(needed)
            + [("fused", first, second)]
            + [i for i in range(first + 1, second) if i not in needed]
            + list(range(second + 1, len(eqns)))
        )
        env: dict = dict(known or {})
        constvars, invars = C.in_vars(jaxpr)
        env.update(zip(constvars, consts, strict=True))
        env.update(zip(invars, args, strict=True))
        for item in order:
            if isinstance(item, tuple):
                ea, eb = eqns[item[1]], eqns[item[2]]
                outs_a, outs_b = self._fused_scan(item[1], ea, item[2], eb, env, ctx)
                for eqn, outs in ((ea, outs_a), (eb, outs_b)):
                    env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if not C.is_dropvar(v))
                continue
            if item in skip:
                continue
            eqn = eqns[item]
            outs = self.eval_eqn(item, eqn, [C.read_atom(env, a) for a in eqn.invars], ctx)
            env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if not C.is_dropvar(v))
        return [C.read_atom(env, a) for a in jaxpr.outvars]

    def _fused_scan(self, ia, ea, ib, eb, env, ctx):
        sa, sb = C.scan_params(ea.params), C.scan_params(eb.params)
        if sa.length != sb.length or sa.reverse != sb.reverse:
            raise ValueError("fused scans need equal lengths and directions")
        site_a, site_b = I._site(ctx, ia, ea), I._site(ctx, ib, eb)
        va = [C.read_atom(env, a) for a in ea.invars]
        vb = [C.read_atom(env, a) for a in eb.invars]

        def parts(s, vals):
            return (
                vals[: s.num_consts],
                vals[s.num_consts : s.num_consts + s.num_carry],
                vals[s.num_consts + s.num_carry :],
            )

        ca, ia_, xa = parts(sa, va)
        cb, ib_, xb = parts(sb, vb)

        def step(carry, x):
            carry_a, carry_b = carry
            x_a, x_b = x
            with I.scopes_of(ea):
                out_a = self.eval(sa.body, sa.body_consts, [*ca, *carry_a, *x_a], site_a.body_ctx)
            with I.scopes_of(eb):
                out_b = self.eval(sb.body, sb.body_consts, [*cb, *carry_b, *x_b], site_b.body_ctx)
            return (out_a[: sa.num_carry], out_b[: sb.num_carry]), (
                out_a[sa.num_carry :],
                out_b[sb.num_carry :],
            )

        I.named(step, f"{site_a.name}+{site_b.name}")
        unroll = max(int(sa.unroll), int(sb.unroll))
        (fa, fb), (ya, yb) = jax.lax.scan(
            step,
            (list(ia_), list(ib_)),
            (list(xa), list(xb)),
            length=sa.length,
            reverse=sa.reverse,
            unroll=unroll,
        )
        self.fused += 1
        return [*fa, *ya], [*fb, *yb]


def fuse_scans(fn: Callable, a: Where, b: Where) -> Callable:
    """``fn`` with the sibling scans matching ``a`` and ``b`` fused into one loop.

    See :func:`overlap_independent` (``mode="fused"``)."""
    pick_a, pick_b = _site_select(a), _site_select(b)

    def fused(*args, **kwargs):
        closed, out_shape = I.trace(fn, *args, **kwargs)
        jx, consts = C.open_and_consts(closed)
        interp = _FusingInterpreter(pick_a, pick_b)
        outs = interp.eval(jx, consts, jax.tree.leaves((args, kwargs)))
        if interp.fused == 0:
            raise ValueError(f"overlap_independent: found no sibling scans matching {a!r} and {b!r} to fuse")
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    fused.__wrapped__ = fn
    return fused


def group_rollout(groups: int, mode: str = "sequential") -> Transform:
    """Env-group pipelining of a Program's rollout (see :func:`rose_jax.optimize.program.group_rollout`)."""
    from rose_jax.optimize import program  # noqa: PLC0415 - program imports this module

    return program.group_rollout(groups, mode)
