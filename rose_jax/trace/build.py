"""jaxpr -> :class:`~rose_jax.trace.tree.LoopTree`: a custom jaxpr interpreter that builds a tree.

:func:`trace` runs ``jax.make_jaxpr`` (nothing executes) and walks the equations the way
``eval_jaxpr`` does, with a ``{primitive name: handler}`` registry (:data:`HANDLERS`) for the
higher-order primitives; every other primitive is a plain array operation, or an ``opaque`` node
when the tracer does not know it (callbacks, custom primitives, unknown higher-order primitives).

Per jaxpr level the walk keeps three variable maps:
  * ``labels``: var -> argument path, for variables that ARE an argument leaf (the jaxpr input,
    or a call/loop operand that forwards it; a loop carry slot takes its initial value's path);
  * ``outs``: var -> output paths the variable's value becomes (tracked back from the outputs
    through call/loop results that forward their operands);
  * ``slots``: var -> argument paths whose value this variable replaces (an output returned at an
    argument's own path, or the next value of a carry slot initialised from an argument).
A node reads the labels of the variables its equations consume, and writes the ``slots``
(``writes``) / ``outs`` (``out_writes``) of the variables its equations produce.

Everything expensive is memoised per jaxpr / equation object, so the walk is linear in the total
number of equations of the distinct jaxprs that contain structure.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Sequence

import jax

from rose_jax.jaxpr import bounds, compat
from rose_jax.trace.tree import ZERO_COST, Cost, Level, LoopTree, Node

# ------------------------------------------------------------------------------ plain costs

_TRANSCENDENTAL = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "pow", "sqrt", "rsqrt",
    "cbrt", "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a",
    "bessel_i0e", "bessel_i1e", "polygamma", "zeta", "regularized_incomplete_beta", "random_gamma",
    "cumlogsumexp",
})
_NO_FLOPS = frozenset({
    "broadcast_in_dim", "reshape", "transpose", "slice", "dynamic_slice", "dynamic_update_slice",
    "gather", "scatter", "concatenate", "pad", "squeeze", "expand_dims", "convert_element_type",
    "bitcast_convert_type", "iota", "copy", "copy_p", "rev", "select_and_gather_add", "device_put",
    "stop_gradient", "sharding_constraint", "random_wrap", "random_unwrap", "random_seed",
    "random_key_data", "optimization_barrier", "split", "tile", "stack", "unstack", "mesh_cast",
    "reshard", "pvary", "empty", "name", "create_token", "after_all", "axis_index", "platform_index",
    "real", "imag", "conj", "reduce_precision",
})
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "reduce", "reduce_window_sum",
    "reduce_window_max", "reduce_window_min", "reduce_window", "scatter-add", "scatter-mul",
    "scatter-min", "scatter-max", "scatter-sub", "psum", "pmax", "pmin",
})


def _io_bytes(eqn) -> int:
    total = 0
    for v in eqn.invars:
        total += compat.aval_bytes(compat.aval_of(v))
    for v in eqn.outvars:
        total += compat.aval_bytes(compat.aval_of(v))
    return total


def plain_cost(eqn) -> Cost:
    """Cost of one first-order equation (see :class:`Cost` for the counting rules)."""
    name = eqn.primitive.name
    out = max((compat.aval_size(compat.aval_of(v)) for v in eqn.outvars), default=0)
    nbytes = float(_io_bytes(eqn))
    if name == "dot_general":
        try:
            return Cost(2.0 * out * compat.dot_contracting_size(eqn), nbytes, 0.0)
        except Exception:  # noqa: BLE001 - unexpected params: count as elementwise
            return Cost(float(out), nbytes, 0.0)
    if name == "conv_general_dilated":
        try:
            return Cost(2.0 * out * compat.conv_window_size(eqn), nbytes, 0.0)
        except Exception:  # noqa: BLE001
            return Cost(float(out), nbytes, 0.0)
    if name in _TRANSCENDENTAL:
        return Cost(0.0, nbytes, float(out))
    if name in _NO_FLOPS:
        return Cost(0.0, nbytes, 0.0)
    if name in _REDUCTIONS:
        inp = max((compat.aval_size(compat.aval_of(v)) for v in eqn.invars), default=0)
        if name.startswith("scatter"):
            inp = compat.aval_size(compat.aval_of(eqn.invars[-1])) if eqn.invars else 0
        return Cost(float(inp), nbytes, 0.0)
    if name == "sort":
        inp = max((compat.aval_size(compat.aval_of(v)) for v in eqn.invars), default=0)
        return Cost(float(inp) * max(math.log2(max(inp, 2)), 1.0), nbytes, 0.0)
    return Cost(float(out), nbytes, 0.0)


# ------------------------------------------------------------------------------- the walker


def _is_var(atom) -> bool:
    return not compat.is_literal(atom) and not compat.is_dropvar(atom)


def _union(*sets) -> frozenset:
    out: set = set()
    for s in sets:
        if s:
            out.update(s)
    return frozenset(out)


class _Stats:
    """Accumulates what a set of equations reads, writes and costs at one level."""

    __slots__ = ("reads", "writes", "out_writes", "cost", "consumed", "produced", "eqns")

    def __init__(self):
        self.reads: set = set()
        self.writes: set = set()
        self.out_writes: set = set()
        self.cost = ZERO_COST
        self.consumed: set = set()
        self.produced: set = set()
        self.eqns: list[int] = []

    def add(self, i: int, eqn, reads, writes, out_writes, cost: Cost) -> None:
        self.eqns.append(i)
        self.reads.update(reads)
        self.writes.update(writes)
        self.out_writes.update(out_writes)
        self.cost = self.cost.plus(cost)
        for v in eqn.invars:
            if _is_var(v) and v not in self.produced:
                self.consumed.add(v)
        for v in eqn.outvars:
            if _is_var(v):
                self.produced.add(v)


class _Group:
    """An open component scope at one level while its equations are being walked."""

    __slots__ = ("name", "path", "items", "stats")

    def __init__(self, name: str, path: tuple[str, ...]):
        self.name, self.path, self.items, self.stats = name, path, [], _Stats()


class Tracer:
    """One tracing run: memo tables keyed by jaxpr / equation object (ids stay valid because the
    traced closed jaxpr, which owns them all, lives as long as the tracer)."""

    def __init__(self, keep_trivial_calls: bool = False):
        self.keep_trivial_calls = keep_trivial_calls
        self.known = compat.known_primitive_names()
        self.ns_cache: dict = {}
        self._hop: dict[str, bool] = {}
        self._kind: dict[int, tuple] = {}
        self._cost_eqn: dict[int, Cost] = {}
        self._cost_jaxpr: dict[int, Cost] = {}
        self._structure: dict[int, bool] = {}
        self._used: dict[int, tuple] = {}
        self._fwd_jaxpr: dict[int, tuple] = {}
        self._fwd_eqn: dict[int, tuple] = {}
        self.loop_bounds: dict[int, bounds.LoopBound] = {}  # id(while eqn) -> bound (set by trace)

    # -- classification ----------------------------------------------------------------

    def classify(self, eqn) -> tuple[str, Any]:
        """``(kind, info)`` with kind in scan/while/cond/call/custom/opaque/plain."""
        key = id(eqn)
        hit = self._kind.get(key)
        if hit is not None:
            return hit
        name = eqn.primitive.name
        handler = HANDLERS.get(name)
        if handler is not None:
            kind, decode = handler
            try:
                result = (kind, decode(eqn))
            except Exception as e:  # noqa: BLE001 - params we do not understand: opaque
                result = ("opaque", f"{name}: {e}")
        elif name in compat.CALLBACK_PRIMITIVES or name not in self.known:
            result = ("opaque", None)
        else:
            hop = self._hop.get(name)
            if hop is None:
                hop = self._hop[name] = bool(compat.sub_jaxprs(eqn.params))
            result = ("opaque", None) if hop else ("plain", None)
        self._kind[key] = result
        return result

    # -- memoised per-jaxpr facts ---------------------------------------------------------

    def jaxpr_cost(self, jaxpr) -> Cost:
        key = id(jaxpr)
        hit = self._cost_jaxpr.get(key)
        if hit is None:
            hit = ZERO_COST
            for eqn in jaxpr.eqns:
                hit = hit.plus(self.eqn_cost(eqn))
            self._cost_jaxpr[key] = hit
        return hit

    def eqn_cost(self, eqn) -> Cost:
        key = id(eqn)
        hit = self._cost_eqn.get(key)
        if hit is not None:
            return hit
        kind, info = self.classify(eqn)
        if kind == "plain":
            cost = plain_cost(eqn)
        elif kind == "scan":
            cost = self.jaxpr_cost(info.body).times(info.length)
        elif kind == "while":
            body = self.jaxpr_cost(info.body).plus(self.jaxpr_cost(info.cond))
            trips = while_trip_count(eqn, info, self)
            cost = body.times(trips).plus(self.jaxpr_cost(info.cond)) if trips is not None else body
        elif kind == "cond":
            cost = ZERO_COST
            for b in info.branches:
                cost = cost.maximum(self.jaxpr_cost(b))
        elif kind in ("call", "custom"):
            cost = self.jaxpr_cost(info.body)
        else:  # opaque: its own operands/results, plus one pass over any sub-jaxprs
            cost = Cost(0.0, float(_io_bytes(eqn)), 0.0)
            for sub in compat.sub_jaxprs(eqn.params):
                cost = cost.plus(self.jaxpr_cost(sub))
        self._cost_eqn[key] = cost
        return cost

    def has_structure(self, jaxpr) -> bool:
        """True if the jaxpr holds anything that becomes a node (loops, conds, components, ...)."""
        key = id(jaxpr)
        hit = self._structure.get(key)
        if hit is not None:
            return hit
        self._structure[key] = False  # recursion guard
        found = False
        for eqn in jaxpr.eqns:
            if compat.name_stack_components(eqn, self.ns_cache):
                found = True
                break
            kind, info = self.classify(eqn)
            if kind in ("scan", "while", "cond", "opaque"):
                found = True
                break
            if kind in ("call", "custom") and (self.keep_trivial_calls or self.has_structure(info.body)):
                found = True
                break
        self._structure[key] = found
        return found

    def used_invars(self, jaxpr) -> tuple[bool, ...]:
        """Per invar: is it consumed by some equation (recursively; pure forwarding excluded)."""
        key = id(jaxpr)
        hit = self._used.get(key)
        if hit is not None:
            return hit
        used: set = set()
        for eqn in jaxpr.eqns:
            for v, u in zip(eqn.invars, self.eqn_used_operands(eqn), strict=False):
                if u and _is_var(v):
                    used.add(v)
        hit = tuple(v in used for v in jaxpr.invars)
        self._used[key] = hit
        return hit

    def eqn_used_operands(self, eqn) -> tuple[bool, ...]:
        kind, info = self.classify(eqn)
        n = len(eqn.invars)
        if kind in ("call", "custom", "scan"):
            return self.used_invars(info.body)
        if kind == "while":
            cn, bn = info.cond_nconsts, info.body_nconsts
            cu, bu = self.used_invars(info.cond), self.used_invars(info.body)
            ncarry = n - cn - bn
            return tuple(cu[:cn]) + tuple(bu[:bn]) + tuple(cu[cn + k] or bu[bn + k] for k in range(ncarry))
        if kind == "cond":
            per = [self.used_invars(b) for b in info.branches]
            return (True,) + tuple(any(u[i] for u in per) for i in range(n - 1))
        return (True,) * n

    def jaxpr_forwarding(self, jaxpr) -> tuple:
        """Per outvar: index of the invar it is (through nested forwarding), else None."""
        key = id(jaxpr)
        hit = self._fwd_jaxpr.get(key)
        if hit is not None:
            return hit
        src = {v: i for i, v in enumerate(jaxpr.invars)}
        for eqn in jaxpr.eqns:
            kind, _ = self.classify(eqn)
            if kind in ("plain", "opaque"):
                continue
            for k, j in enumerate(self.eqn_forwarding(eqn)):
                if j is not None:
                    operand = eqn.invars[j]
                    if _is_var(operand) and operand in src and _is_var(eqn.outvars[k]):
                        src[eqn.outvars[k]] = src[operand]
        hit = tuple(src.get(v) if _is_var(v) else None for v in jaxpr.outvars)
        self._fwd_jaxpr[key] = hit
        return hit

    def eqn_forwarding(self, eqn) -> tuple:
        """Per result of a higher-order equation: the operand index it forwards, else None."""
        key = id(eqn)
        hit = self._fwd_eqn.get(key)
        if hit is not None:
            return hit
        kind, info = self.classify(eqn)
        nout = len(eqn.outvars)
        fwd: list = [None] * nout
        if kind in ("call", "custom"):
            fwd = list(self.jaxpr_forwarding(info.body))
        elif kind == "scan":
            body_fwd = self.jaxpr_forwarding(info.body)
            for k in range(info.num_carry):
                if body_fwd[k] == info.num_consts + k:
                    fwd[k] = info.num_consts + k
        elif kind == "while":
            body_fwd = self.jaxpr_forwarding(info.body)
            base = info.cond_nconsts + info.body_nconsts
            for k in range(nout):
                if body_fwd[k] == info.body_nconsts + k:
                    fwd[k] = base + k
        elif kind == "cond":
            per = [self.jaxpr_forwarding(b) for b in info.branches]
            for k in range(nout):
                first = per[0][k]
                if first is not None and all(p[k] == first for p in per):
                    fwd[k] = first + 1
        hit = tuple(fwd)
        self._fwd_eqn[key] = hit
        return hit

    def rel_components(self, eqn, ctx_path: tuple[str, ...]) -> tuple[str, ...]:
        comps = compat.name_stack_components(eqn, self.ns_cache)
        n = len(ctx_path)
        # Relative name stacks are the norm inside bodies; strip an absolute one's prefix.
        if n and len(comps) >= n and comps[:n] == ctx_path:
            comps = comps[n:]
        return comps

    # -- the level walk ---------------------------------------------------------------------

    def walk_level(self, jaxpr, level: Level, ctx_path, labels: dict, outs: dict, slots: dict):
        """Walk one jaxpr level. ``labels`` must hold the invars' argument paths, ``outs`` /
        ``slots`` the outvars' output / overwritten paths. Returns ``(items, stats)``."""
        eqns = jaxpr.eqns
        outs = dict(outs)
        slots = dict(slots)
        labels = dict(labels)
        # Backward: operands forwarded to results inherit the results' output/slot paths.
        for eqn in reversed(eqns):
            kind, _ = self.classify(eqn)
            if kind in ("plain", "opaque"):
                continue
            for k, j in enumerate(self.eqn_forwarding(eqn)):
                if j is None:
                    continue
                res, operand = eqn.outvars[k], eqn.invars[j]
                if not _is_var(operand) or not _is_var(res):
                    continue
                if res in outs:
                    outs[operand] = _union(outs.get(operand), outs[res])
                if res in slots:
                    slots[operand] = _union(slots.get(operand), slots[res])

        items: list = []
        stack: list[_Group] = []
        stats = _Stats()
        for i, eqn in enumerate(eqns):
            rel = self.rel_components(eqn, ctx_path)
            k = 0
            while k < len(stack) and k < len(rel) and stack[k].name == rel[k]:
                k += 1
            del stack[k:]
            for name in rel[k:]:
                group = _Group(name, ctx_path + rel[: len(stack) + 1])
                (stack[-1].items if stack else items).append(group)
                stack.append(group)
            path = ctx_path + rel
            node, reads, writes, out_writes, cost = self.eqn_node(eqn, level, i, path, labels, outs, slots)
            stats.add(i, eqn, reads, writes, out_writes, cost)
            for group in stack:
                group.stats.add(i, eqn, reads, writes, out_writes, cost)
            if node is not None:
                (stack[-1].items if stack else items).append(node)
        return [self._finish(x, level) for x in items], stats

    def _finish(self, item, level: Level) -> Node:
        if isinstance(item, Node):
            return item
        s = item.stats
        return Node(
            kind="component", name=item.name, component_path=item.path, trip_count=1,
            reads=frozenset(s.reads), writes=frozenset(s.writes), out_writes=frozenset(s.out_writes),
            cost=s.cost, children=tuple(self._finish(x, level) for x in item.items),
            level=level, eqn_indices=tuple(s.eqns), in_vars=frozenset(s.consumed),
            out_vars=frozenset(s.produced),
        )

    def eqn_node(self, eqn, level, i, path, labels, outs, slots):
        """Walk one equation: ``(node or None, reads, writes, out_writes, cost)``; also records
        the labels of results that forward an argument."""
        kind, info = self.classify(eqn)
        if kind == "plain":
            reads = [labels[v] for v in eqn.invars if _is_var(v) and v in labels]
            produced = [v for v in eqn.outvars if _is_var(v)]
            return (None, reads, _gather(slots, produced), _gather(outs, produced), self.eqn_cost(eqn))

        fwd = self.eqn_forwarding(eqn) if kind != "opaque" else (None,) * len(eqn.outvars)
        for k, j in enumerate(fwd):
            if j is None:
                continue
            operand, res = eqn.invars[j], eqn.outvars[k]
            if _is_var(operand) and operand in labels and _is_var(res):
                labels[res] = labels[operand]
        produced = [v for k, v in enumerate(eqn.outvars) if _is_var(v) and fwd[k] is None]

        if kind in ("call", "custom") and not self.keep_trivial_calls and not self.has_structure(info.body):
            used = self.used_invars(info.body)
            reads = [labels[v] for v, u in zip(eqn.invars, used, strict=True)
                     if u and _is_var(v) and v in labels]
            return (None, reads, _gather(slots, produced), _gather(outs, produced), self.eqn_cost(eqn))

        in_vars = frozenset(v for v in eqn.invars if _is_var(v))
        out_vars = frozenset(v for v in eqn.outvars if _is_var(v))
        common = dict(level=level, eqn_indices=(i,), in_vars=in_vars, out_vars=out_vars,
                      primitive=eqn.primitive.name, component_path=path, cost=self.eqn_cost(eqn))
        if kind == "opaque":
            reads = [labels[v] for v in eqn.invars if _is_var(v) and v in labels]
            writes, out_writes = _gather(slots, produced), _gather(outs, produced)
            node = Node(kind="opaque", name=eqn.primitive.name, trip_count=1, reads=frozenset(reads),
                        writes=writes, out_writes=out_writes, **common)
            return node, reads, writes, out_writes, node.cost

        bodies = []  # (jaxpr, Level, part, labels, outs, slots)
        bound = None
        if kind in ("call", "custom"):
            body = info.body
            bodies.append((body, Level(body, kind), None,
                           _map_in(eqn.invars, body.invars, labels),
                           _map_out(eqn.outvars, body.outvars, outs),
                           _map_out(eqn.outvars, body.outvars, slots)))
            name, trips = info.name, 1
        elif kind == "scan":
            body, nc, ncarry = info.body, info.num_consts, info.num_carry
            body_slots = _map_out(eqn.outvars, body.outvars, slots)
            for kk in range(ncarry):
                init, new = eqn.invars[nc + kk], body.outvars[kk]
                if _is_var(init) and init in labels and _is_var(new):
                    body_slots[new] = _union(body_slots.get(new), (labels[init],))
            carry = tuple((body.invars[nc + kk], body.outvars[kk]) for kk in range(ncarry))
            bodies.append((body, Level(body, "scan", carry), None,
                           _map_in(eqn.invars, body.invars, labels),
                           _map_out(eqn.outvars, body.outvars, outs), body_slots))
            name, trips = compat.func_name(body, "scan"), info.length
        elif kind == "while":
            cn, bn = info.cond_nconsts, info.body_nconsts
            ops = list(eqn.invars)
            carry_ops = ops[cn + bn:]
            cond, body = info.cond, info.body
            bodies.append((cond, Level(cond, "while_cond"), "cond",
                           _map_in(ops[:cn] + carry_ops, cond.invars, labels), {}, {}))
            body_slots = _map_out(eqn.outvars, body.outvars, slots)
            for kk, init in enumerate(carry_ops):
                new = body.outvars[kk]
                if _is_var(init) and init in labels and _is_var(new):
                    body_slots[new] = _union(body_slots.get(new), (labels[init],))
            carry = tuple((body.invars[bn + kk], body.outvars[kk]) for kk in range(len(carry_ops)))
            bodies.append((body, Level(body, "while_body", carry), None,
                           _map_in(ops[cn:cn + bn] + carry_ops, body.invars, labels),
                           _map_out(eqn.outvars, body.outvars, outs), body_slots))
            name, trips = compat.func_name(body, "while"), while_trip_count(eqn, info, self)
            bound = bounds.bound_of(eqn, self.loop_bounds).bound
        else:  # cond
            for b_i, branch in enumerate(info.branches):
                bodies.append((branch, Level(branch, "cond_branch"), f"branch{b_i}",
                               _map_in(eqn.invars[1:], branch.invars, labels),
                               _map_out(eqn.outvars, branch.outvars, outs),
                               _map_out(eqn.outvars, branch.outvars, slots)))
            name, trips = "cond", 1

        children: list[Node] = []
        reads: set = set()
        writes: set = set()
        out_writes: set = set()
        if kind == "cond":  # the predicate / index is read by the cond itself
            if _is_var(eqn.invars[0]) and eqn.invars[0] in labels:
                reads.add(labels[eqn.invars[0]])
        for body, body_level, part, b_labels, b_outs, b_slots in bodies:
            sub_items, sub_stats = self.walk_level(body, body_level, path, b_labels, b_outs, b_slots)
            if part is not None:
                sub_items = [dataclasses.replace(x, part=part) for x in sub_items]
            children.extend(sub_items)
            reads |= sub_stats.reads
            writes |= sub_stats.writes
            out_writes |= sub_stats.out_writes
        node = Node(kind=kind, name=name, trip_count=trips, reads=frozenset(reads),
                    writes=frozenset(writes), out_writes=frozenset(out_writes), children=tuple(children),
                    bodies=tuple(b[1] for b in bodies), bound=bound, **common)
        return node, reads, writes, out_writes, node.cost


def _gather(table: dict, vars_) -> frozenset:
    out: set = set()
    for v in vars_:
        hit = table.get(v)
        if hit:
            out.update(hit)
    return frozenset(out)


def _map_in(operands, invars, labels: dict) -> dict:
    return {inner: labels[outer] for outer, inner in zip(operands, invars, strict=False)
            if _is_var(outer) and outer in labels and _is_var(inner)}


def _map_out(results, outvars, table: dict) -> dict:
    mapped: dict = {}
    for outer, inner in zip(results, outvars, strict=False):
        if _is_var(outer) and _is_var(inner) and outer in table:
            mapped[inner] = _union(mapped.get(inner), table[outer])
    return mapped


# ----------------------------------------------------------------------- while trip counts


def while_trip_count(eqn, info=None, tracer: Tracer | None = None) -> int | None:
    """Iterations of a while loop when its condition is a counter test alone (``fori_loop`` with
    traced bounds), else None; see :mod:`rose_jax.jaxpr.bounds` (also for the static upper bound
    of data-dependent loops, a while node's ``bound``)."""
    b = bounds.bound_of(eqn, tracer.loop_bounds if tracer is not None else None)
    return b.bound if b.exact else None


# --------------------------------------------------------------------------------- handlers

# primitive name -> (node kind, params decoder). Add an entry to teach the tracer a new
# higher-order primitive; the decoder returns a compat record (ScanParams, WhileParams, CondInfo, CallInfo).
HANDLERS: dict[str, tuple[str, Callable]] = {
    "scan": ("scan", compat.scan_info),
    "while": ("while", compat.while_info),
    "cond": ("cond", compat.cond_info),
    **{p: ("call", compat.call_info) for p in compat.JIT_PRIMITIVES | compat.CALL_PRIMITIVES},
    **{p: ("custom", compat.call_info) for p in compat.CUSTOM_PRIMITIVES},
}


# ------------------------------------------------------------------------------ pytree paths


def _key_str(key) -> str:
    tu = jax.tree_util
    if isinstance(key, tu.GetAttrKey):
        return "." + str(key.name)
    if isinstance(key, tu.DictKey):
        return "." + str(key.key)
    if isinstance(key, tu.SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, tu.FlattenedIndexKey):
        return f"[{key.key}]"
    return tu.keystr((key,))


def path_str(prefix: str, keys: Sequence) -> str:
    """``prefix`` + keys formatted as ``.attr``, ``.dict_key``, ``[i]``."""
    return prefix + "".join(_key_str(k) for k in keys)


def _arg_names(fn: Callable, nargs: int, arg_names) -> list[str]:
    if arg_names is not None:
        names = list(arg_names)
        if len(names) != nargs or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"trace: arg_names must be {nargs} non-empty strings, got {arg_names!r}")
        return names
    names: list[str] = []
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            break
    names = names[:nargs]
    names += [f"arg{i}" for i in range(len(names), nargs)]
    return names


def _check_leaf(path: str, leaf) -> None:
    if isinstance(leaf, (bool, int, float, complex)):
        return
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return
    raise ValueError(
        f"trace: argument leaf {path} is a {type(leaf).__name__}, not an array; "
        "close over static values with functools.partial"
    )


def _leaf_sig(x) -> tuple:
    return (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))


def _output_names(out_shape, args, names, out_names) -> list[tuple[str, Any]]:
    """Split the result into named parts: ``[(name, subtree)]``.

    A tuple/list result is named per element, a single result as a whole. A part named by
    ``out_names`` keeps that name; otherwise a container part (not a bare array) with the
    structure (treedef, shapes, dtypes) of an argument takes that argument's name (the carried
    state: ``train_state``), else ``out[i]`` (or ``out``).
    """
    is_seq = type(out_shape) in (tuple, list)
    parts = list(out_shape) if is_seq else [out_shape]
    if out_names is not None:
        out_names = list(out_names)
        if len(out_names) != len(parts):
            raise ValueError(f"trace: out_names has {len(out_names)} names for {len(parts)} results")
        return list(zip(out_names, parts, strict=False))
    sigs = []
    for a in args:
        leaves, tdef = jax.tree_util.tree_flatten(a)
        sigs.append((tdef, tuple(_leaf_sig(x) for x in leaves)))
    taken: set = set()
    named = []
    for i, part in enumerate(parts):
        leaves, tdef = jax.tree_util.tree_flatten(part)
        sig = (tdef, tuple(_leaf_sig(x) for x in leaves))
        match = None
        if leaves and not jax.tree_util.treedef_is_leaf(tdef):  # a bare array is no evidence
            for j, s in enumerate(sigs):
                if j not in taken and s == sig:
                    match = j
                    break
        if match is not None:
            taken.add(match)
            named.append((names[match], part))
        else:
            named.append((f"out[{i}]" if is_seq else "out", part))
    return named


# ------------------------------------------------------------------------------------- trace


def trace(fn: Callable, *args, arg_names: Sequence[str] | None = None,
          out_names: Sequence[str] | None = None, keep_trivial_calls: bool = False,
          unwrap_jit: bool = True, **kwargs) -> LoopTree:
    """Trace ``fn(*args, **kwargs)`` with ``jax.make_jaxpr`` (nothing runs) into a LoopTree.

    Args:
      fn: a function of pytrees of arrays (close over static values with functools.partial).
      *args, **kwargs: example arguments (arrays or ``jax.ShapeDtypeStruct``), as for make_jaxpr.
      arg_names: names of the positional arguments (default: ``fn``'s parameter names, else
        ``arg<i>``); keyword arguments are named by their keyword. Paths look like
        ``train_state.params.policy.hidden_0.kernel`` / ``env_state.obs`` / ``xs[0]``.
      out_names: names of the result's parts (see ``_output_names``): by default a result part
        shaped like an argument gets that argument's name, so ``writes`` finds carried state.
      keep_trivial_calls: also make nodes of jit/custom_jvp/remat calls that contain no loop,
        cond, component or opaque equation (default: fold them into their parent).
      unwrap_jit: when ``fn`` is one jitted call, describe its body as the root.

    Returns:
      a :class:`LoopTree` whose root has kind ``"root"`` and ``fn``'s name.
    """
    if not callable(fn):
        raise ValueError(f"trace: fn must be callable, got {type(fn).__name__}")
    names = _arg_names(fn, len(args), arg_names)
    tree_in = (tuple(args), dict(kwargs))
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree_in)
    input_paths = []
    for keys, leaf in leaves_with_paths:
        if keys[0].idx == 0:
            p = path_str(names[keys[1].idx], keys[2:])
        else:
            p = path_str(str(keys[1].key), keys[2:])
        _check_leaf(p, leaf)
        input_paths.append(p)
    flat = [leaf for _, leaf in leaves_with_paths]

    def flat_fn(*leaves):
        a, kw = jax.tree_util.tree_unflatten(treedef, leaves)
        return fn(*a, **kw)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat)
    named_parts = _output_names(out_shape, list(args), names, out_names)
    output_paths = []
    for name, part in named_parts:
        for keys, _ in jax.tree_util.tree_flatten_with_path(part)[0]:
            output_paths.append(path_str(name, keys))

    jaxpr = compat.open_jaxpr(closed)
    if len(output_paths) != len(jaxpr.outvars) or len(input_paths) != len(jaxpr.invars):
        raise ValueError("trace: jaxpr inputs/outputs do not match the flattened arguments/results")
    tracer = Tracer(keep_trivial_calls=keep_trivial_calls)
    tracer.loop_bounds = bounds.while_loop_bounds(closed)
    root_name = getattr(fn, "__name__", None) or compat.func_name(jaxpr, "fn")

    input_set = frozenset(input_paths)
    labels = {v: p for v, p in zip(jaxpr.invars, input_paths, strict=False)}
    outs: dict = {}
    slots: dict = {}
    for v, p in zip(jaxpr.outvars, output_paths, strict=False):
        if _is_var(v):
            outs[v] = _union(outs.get(v), (p,))
            if p in input_set:
                slots[v] = _union(slots.get(v), (p,))

    level_jaxpr = jaxpr
    while unwrap_jit and len(level_jaxpr.eqns) == 1:
        eqn = level_jaxpr.eqns[0]
        kind, info = tracer.classify(eqn)
        if kind != "call" or eqn.primitive.name not in compat.JIT_PRIMITIVES:
            break
        if list(eqn.outvars) != list(level_jaxpr.outvars):
            break
        body = info.body
        labels = _map_in(eqn.invars, body.invars, labels)
        outs = _map_out(eqn.outvars, body.outvars, outs)
        slots = _map_out(eqn.outvars, body.outvars, slots)
        root_name = info.name
        level_jaxpr = body

    level = Level(level_jaxpr, "root")
    items, stats = tracer.walk_level(level_jaxpr, level, (), labels, outs, slots)
    root = Node(
        kind="root", name=root_name, component_path=(), trip_count=1,
        reads=frozenset(stats.reads), writes=frozenset(stats.writes),
        out_writes=frozenset(stats.out_writes), cost=stats.cost, children=tuple(items),
        level=level, eqn_indices=tuple(range(len(level_jaxpr.eqns))),
        in_vars=frozenset(v for v in level_jaxpr.invars), out_vars=frozenset(
            v for v in level_jaxpr.outvars if _is_var(v)), bodies=(level,),
    )
    return LoopTree(root=_reindex(root, ()), input_paths=tuple(input_paths),
                    output_paths=tuple(output_paths), jaxpr=closed)


def _reindex(node: Node, index: tuple[int, ...]) -> Node:
    children = tuple(_reindex(c, index + (i,)) for i, c in enumerate(node.children))
    return dataclasses.replace(node, index=index, children=children)
