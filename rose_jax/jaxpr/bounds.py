"""Static bounds on the trip count of ``while`` loops, read from the jaxpr (nothing runs).

A while loop has a static bound when its condition implies a counter test: ``i < n`` (or
``<=``, ``>``, ``>=``, ``!=``, ``==``) where ``i`` is a carry slot that the body moves by a
constant step every iteration, starting from a statically known value, and ``n`` is a constant.
The test may be one term of the condition (``(i < n) & (err > tol)``, or MJX's solver,
``~((i >= iterations) | (improvement < tol) | (gradient < tol))``): every iteration still needs
the counter test to hold, so the loop runs at most the counter's count; it then stops early on
the data-dependent terms. ``fori_loop`` with traced bounds is the exact case (the test alone).

A ``while`` vmapped with a batched predicate keeps the per-element predicate in its condition
(shape ``(B, ...)``, a prefix of every carry leaf's shape) and runs ``carry = select(pred,
body(carry), carry)`` while any element holds: each element is its own loop, frozen once its
predicate fails, so the per-element bound bounds the whole loop.

Counter starts: a literal, or a value whose range the enclosing levels make static
(:func:`while_loop_bounds` propagates integer ranges through literals, broadcasts, conversions,
``max``/``min``, calls, loop constants and loop-invariant carries). Only integer comparisons
count (a float test may be NaN-false both ways).

Used by the tracer (``while`` nodes' ``trip_count`` / ``bound``) and by
:mod:`rose_jax.optimize.loops` (the masked-scan rewrite), so both see the same bounds.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from rose_jax.jaxpr import compat

Range = tuple[int, int]  # inclusive integer range [lo, hi]

_CMP = frozenset({"lt", "le", "gt", "ge", "ne", "eq"})
_NEGATE = {"lt": "ge", "ge": "lt", "le": "gt", "gt": "le", "eq": "ne", "ne": "eq"}
_FLIP = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "eq": "eq", "ne": "ne"}
_SAME_VALUE = frozenset({"copy", "copy_p", "reshape", "squeeze", "expand_dims"})


class LoopBound(NamedTuple):
    """What the jaxpr says about one while loop's iterations.

    ``bound``: at most this many iterations (``None``: no static bound). ``exact``: the
    condition is the counter test alone, so ``bound`` is the trip count itself (otherwise the
    loop is data-dependent and may stop earlier). ``counter``: the carry slot of the counter.
    ``batched``: the predicate has a batch shape (a vmapped loop: one loop per element).
    ``reason``: how the bound was found, or why there is none.
    """

    bound: int | None
    exact: bool
    counter: int | None
    batched: bool
    reason: str

    @property
    def data_dependent(self) -> bool:
        return not self.exact


def _dtype(atom: Any):
    return getattr(compat.aval_of(atom), "dtype", None)


def _shape(atom: Any) -> tuple:
    return tuple(getattr(compat.aval_of(atom), "shape", ()) or ())


def _is_int(dtype: Any) -> bool:
    try:
        return np.issubdtype(np.dtype(dtype), np.integer)
    except TypeError:
        return False


def _is_bool(dtype: Any) -> bool:
    try:
        return np.dtype(dtype) == np.bool_
    except TypeError:
        return False


def _holds(src: Any, dst: Any) -> bool:
    """Every value of integer dtype ``src`` is representable in integer dtype ``dst``."""
    if not (_is_int(src) and _is_int(dst)):
        return False
    a, b = np.iinfo(np.dtype(src)), np.iinfo(np.dtype(dst))
    return b.min <= a.min and a.max <= b.max


def _elementwise(eqn: Any) -> bool:
    """One operand, one result, the same shape (or a scalar broadcast): element ``e`` of the result
    is element ``e`` of the operand (or the scalar)."""
    if len(eqn.invars) < 1 or len(eqn.outvars) != 1:
        return False
    src = _shape(eqn.invars[0])
    return src == _shape(eqn.outvars[0]) or (eqn.primitive.name == "broadcast_in_dim" and not src)


def value_range(value: Any) -> Range | None:
    """Range of a concrete integer value (a literal's value, a closed-over constant), else None.

    Traced values (no concrete value) and non-integer or large arrays give None.
    """
    if value is None or type(value).__name__.endswith("Tracer"):
        return None
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - a tracer or an extended dtype
        return None
    if arr.size == 0 or arr.size > 4096 or not (_is_int(arr.dtype) or _is_bool(arr.dtype)):
        return None
    return int(arr.min()), int(arr.max())


def _atom_range(atom: Any, env: dict) -> Range | None:
    if compat.is_literal(atom):
        return value_range(atom.val)
    return env.get(atom)


# ------------------------------------------------------------------ one level, symbolically


class _Frame:
    """One jaxpr seen from the while's condition (or body): its producers, and where its invars
    come from (``parent``: inner invar -> (outer atom, outer frame); root invars map to their index)."""

    def __init__(self, jaxpr: Any, parent: dict | None = None):
        self.jaxpr = jaxpr
        self.producer = {v: e for e in jaxpr.eqns for v in e.outvars if compat.is_var(v)}
        self.root_index = {v: i for i, v in enumerate(jaxpr.invars)} if parent is None else {}
        self.parent = parent or {}


def _origin(atom: Any, frame: _Frame, depth: int = 0):
    """Follow ``atom`` out of call bodies and into calls' results: ``('literal', value)``,
    ``('invar', index)`` (an invar of the root jaxpr) or ``('eqn', eqn, frame)``; None if lost."""
    if depth > 64:
        return None
    if compat.is_literal(atom):
        return ("literal", atom.val)
    if atom in frame.root_index:
        return ("invar", frame.root_index[atom])
    if atom in frame.parent:
        outer, outer_frame = frame.parent[atom]
        return _origin(outer, outer_frame, depth + 1)
    eqn = frame.producer.get(atom)
    if eqn is None:
        return None
    if eqn.primitive.name in compat.PLAIN_CALL_PRIMITIVES:
        try:
            body, _ = compat.call_jaxpr(eqn.params)
        except ValueError:
            return ("eqn", eqn, frame)
        if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
            return ("eqn", eqn, frame)
        inner = _Frame(body, {v: (a, frame) for v, a in zip(body.invars, eqn.invars, strict=True)})
        return _origin(body.outvars[list(eqn.outvars).index(atom)], inner, depth + 1)
    return ("eqn", eqn, frame)


class _Term(NamedTuple):
    kind: str  # "carry" | "range"
    slot: int = -1
    lo: int = 0
    hi: int = 0


class _Fact(NamedTuple):
    op: str
    a: _Term
    b: _Term


class _Loop:
    """The while equation under analysis: its operand ranges and sub-jaxprs."""

    def __init__(self, eqn: Any, ranges: Sequence[Range | None]):
        self.info = compat.while_info(eqn)
        self.cn, self.bn = self.info.cond_nconsts, self.info.body_nconsts
        self.ranges = list(ranges)
        self.ncarry = len(eqn.invars) - self.cn - self.bn
        self.body_frame = _Frame(self.info.body)

    def init_range(self, k: int) -> Range | None:
        return self.ranges[self.cn + self.bn + k]

    def forwarded(self, k: int) -> bool:
        """The body returns carry slot ``k`` unchanged (a loop invariant)."""
        o = _origin(self.info.body.outvars[k], self.body_frame)
        return o is not None and o[0] == "invar" and o[1] == self.bn + k

    # -- terms of the condition -------------------------------------------------------------
    def term(self, atom: Any, frame: _Frame, depth: int = 0) -> _Term | None:
        o = _origin(atom, frame)
        if o is None or depth > 16:
            return None
        if o[0] == "literal":
            r = value_range(o[1])
            return _Term("range", lo=r[0], hi=r[1]) if r else None
        if o[0] == "invar":
            i = o[1]
            if i < self.cn:
                r = self.ranges[i]
                return _Term("range", lo=r[0], hi=r[1]) if r else None
            return _Term("carry", slot=i - self.cn)
        eqn, fr = o[1], o[2]
        name = eqn.primitive.name
        if (name in _SAME_VALUE or name == "broadcast_in_dim") and _elementwise(eqn):
            return self.term(eqn.invars[0], fr, depth + 1)
        if name == "convert_element_type" and _holds(_dtype(eqn.invars[0]), _dtype(eqn.outvars[0])):
            return self.term(eqn.invars[0], fr, depth + 1)
        return None

    def facts(self, atom: Any, frame: _Frame, positive: bool, depth: int = 0) -> set[_Fact]:
        """Integer comparisons that hold (elementwise) whenever ``atom`` is ``positive``."""
        o = _origin(atom, frame)
        if o is None or o[0] != "eqn" or depth > 64:
            return set()
        eqn, fr = o[1], o[2]
        name = eqn.primitive.name
        if name == "not" and _is_bool(_dtype(eqn.invars[0])):
            return self.facts(eqn.invars[0], fr, not positive, depth + 1)
        if name in ("and", "or") and _is_bool(_dtype(eqn.outvars[0])):
            a = self.facts(eqn.invars[0], fr, positive, depth + 1)
            b = self.facts(eqn.invars[1], fr, positive, depth + 1)
            # a & b true: both hold; a | b false: both are false. Otherwise only what both imply.
            return a | b if (name == "and") == positive else a & b
        if name == "convert_element_type" and _is_bool(_dtype(eqn.invars[0])) and _elementwise(eqn):
            return self.facts(eqn.invars[0], fr, positive, depth + 1)
        if (name in _SAME_VALUE or name == "broadcast_in_dim") and _elementwise(eqn):
            return self.facts(eqn.invars[0], fr, positive, depth + 1)
        if name in _CMP and len(eqn.invars) == 2 and all(_is_int(_dtype(v)) for v in eqn.invars):
            a, b = self.term(eqn.invars[0], fr), self.term(eqn.invars[1], fr)
            if a is None or b is None:
                return set()
            return {_Fact(name if positive else _NEGATE[name], a, b)}
        return set()

    def exact_test(self, atom: Any, frame: _Frame) -> bool:
        """The predicate is one comparison (through conversions and calls): no other terms."""
        o = _origin(atom, frame)
        if o is None or o[0] != "eqn":
            return False
        eqn, fr = o[1], o[2]
        name = eqn.primitive.name
        if name == "convert_element_type" and _is_bool(_dtype(eqn.invars[0])):
            return self.exact_test(eqn.invars[0], fr)
        return name in _CMP

    # -- the counter ------------------------------------------------------------------------
    def step(self, k: int) -> int | None:
        """The constant ``c`` when the body returns ``carry[k] + c`` (``c != 0``), else None."""
        o = _origin(self.info.body.outvars[k], self.body_frame)
        for _ in range(8):
            if o is None or o[0] != "eqn":
                return None
            eqn, fr = o[1], o[2]
            name = eqn.primitive.name
            if name == "convert_element_type" and _dtype(eqn.invars[0]) == _dtype(eqn.outvars[0]):
                o = _origin(eqn.invars[0], fr)
                continue
            if name not in ("add", "sub") or len(eqn.invars) != 2:
                return None
            x, y = eqn.invars
            ox, oy = _origin(x, fr), _origin(y, fr)
            me = ("invar", self.bn + k)
            if ox == me:
                c = self._body_const(oy)
                return None if c is None or c == 0 else (c if name == "add" else -c)
            if oy == me and name == "add":
                c = self._body_const(ox)
                return None if c is None or c == 0 else c
            return None
        return None

    def _body_const(self, o) -> int | None:
        if o is None:
            return None
        r = None
        if o[0] == "literal":
            r = value_range(o[1])
        elif o[0] == "invar" and o[1] < self.bn:
            r = self.ranges[self.cn + o[1]]
        return r[0] if r is not None and r[0] == r[1] else None


def _count(op: str, start: Range, limit: Range, step: int, dtype: Range) -> tuple[int | None, bool]:
    """``(at most this many iterations, exact)`` of ``i = start; while i <op> limit: i += step``
    for a counter of integer range ``dtype`` (None where the counter could wrap around)."""
    a_lo, a_hi = start
    n_lo, n_hi = limit
    exact = a_lo == a_hi and n_lo == n_hi
    if (op in ("lt", "le") and step > 0 and n_hi + step > dtype[1]) or (
        op in ("gt", "ge") and step < 0 and n_lo + step < dtype[0]
    ):
        return None, False  # the last increment could overflow and wrap into the loop again
    if op == "lt" and step > 0:
        return max(0, -(-(n_hi - a_lo) // step)), exact
    if op == "le" and step > 0:
        return max(0, (n_hi - a_lo) // step + 1), exact
    if op == "gt" and step < 0:
        return max(0, -(-(a_hi - n_lo) // -step)), exact
    if op == "ge" and step < 0:
        return max(0, (a_hi - n_lo) // -step + 1), exact
    if op == "eq":
        return (1, False) if not exact else ((1 if a_lo == n_lo else 0), True)
    if op == "ne" and exact:
        d = n_lo - a_lo
        if d % step == 0 and d * step >= 0:
            return d // step, True
    return None, False


_OP_TEXT = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "ne": "!=", "eq": "=="}


def _range_text(r: Range) -> str:
    return str(r[0]) if r[0] == r[1] else f"[{r[0]}, {r[1]}]"


def while_bound(eqn: Any, ranges: Sequence[Range | None] | None = None) -> LoopBound:
    """The :class:`LoopBound` of one while equation.

    ``ranges``: per operand of the equation (cond consts, body consts, initial carry), its
    statically known integer range or None; default: the literals' values only.
    """
    if ranges is None:
        ranges = [value_range(a.val) if compat.is_literal(a) else None for a in eqn.invars]
    try:
        loop = _Loop(eqn, ranges)
    except ValueError as e:
        return LoopBound(None, False, None, False, f"while params not understood: {e}")
    cond = loop.info.cond
    pred = cond.outvars[0]
    pred_shape = _shape(pred)
    batched = bool(pred_shape)
    frame = _Frame(cond)
    facts = loop.facts(pred, frame, True)
    # Carry slots on the right-hand side that the body never changes are constants too.
    best: tuple | None = None
    why_not: list[str] = []
    for f in facts:
        op, a, b = f
        if a.kind != "carry":
            a, b, op = b, a, _FLIP[op]
        if a.kind != "carry":
            continue
        k = a.slot
        limit: Range | None = (b.lo, b.hi) if b.kind == "range" else None
        if b.kind == "carry":
            if b.slot == k or not loop.forwarded(b.slot):
                why_not.append(f"carry[{k}] is compared with carry[{b.slot}], which the body changes")
                continue
            limit = loop.init_range(b.slot)
            if limit is None:
                why_not.append(f"carry[{k}] is compared with carry[{b.slot}], whose value is not static")
                continue
        k_shape = tuple(getattr(loop.info.cond.invars[loop.cn + k].aval, "shape", ()))
        if k_shape != pred_shape:
            why_not.append(f"carry[{k}] has shape {k_shape}, not the predicate's {pred_shape}")
            continue
        step = loop.step(k)
        if step is None:
            why_not.append(
                f"carry[{k}] is tested ({_OP_TEXT[op]} {_range_text(limit)}) but the body "
                "does not add a constant to it"
            )
            continue
        start = loop.init_range(k)
        if start is None:
            why_not.append(
                f"carry[{k}] is tested ({_OP_TEXT[op]} {_range_text(limit)}) but its initial "
                "value is not statically known"
            )
            continue
        n, exact = _count(op, start, limit, step, _full(loop.info.cond.invars[loop.cn + k]) or start)
        if n is None:
            why_not.append(
                f"carry[{k}] {_OP_TEXT[op]} {_range_text(limit)} with step {step:+d} from "
                f"{_range_text(start)} gives no bound"
            )
            continue
        text = (
            f"counter carry[{k}] starts at {_range_text(start)}, steps {step:+d}, and the condition "
            f"requires carry[{k}] {_OP_TEXT[op]} {_range_text(limit)}"
        )
        if best is None or n < best[0]:
            best = (n, exact, k, text)
    if best is None:
        reason = "; ".join(sorted(set(why_not))) or (
            "the condition implies no integer counter test (carry <op> constant)"
        )
        return LoopBound(None, False, None, batched, "no static bound: " + reason)
    n, exact, k, text = best
    exact = exact and loop.exact_test(pred, frame)
    if exact:
        return LoopBound(n, True, k, batched, f"{text}: exactly {n} iterations")
    return LoopBound(
        n, False, k, batched, f"{text}: at most {n} iterations (data-dependent: it may stop earlier)"
    )


# -------------------------------------------------------------- ranges across the program


def _full(atom: Any) -> Range | None:
    """The range of an integer atom's dtype (what an unknown value may be)."""
    dtype = _dtype(atom)
    if _is_bool(dtype):
        return 0, 1
    if not _is_int(dtype):
        return None
    info = np.iinfo(np.dtype(dtype))
    return int(info.min), int(info.max)


def _eqn_out_ranges(eqn: Any, ins: list) -> list:
    """Output ranges of a first-order equation from its operand ranges (unknown: None)."""
    name = eqn.primitive.name
    n = len(eqn.outvars)
    out_dtype = _dtype(eqn.outvars[0]) if n else None
    if n != 1 or not (_is_int(out_dtype) or _is_bool(out_dtype)):
        return [None] * n
    r0 = ins[0] if ins else None
    if name in _SAME_VALUE or name == "broadcast_in_dim":
        return [r0]
    if name == "convert_element_type":
        if r0 is not None and _is_int(out_dtype):
            info = np.iinfo(np.dtype(out_dtype))
            return [r0] if info.min <= r0[0] and r0[1] <= info.max else [None]
        return [r0 if _is_bool(out_dtype) and r0 is not None and 0 <= r0[0] and r0[1] <= 1 else None]
    if not ins or all(r is None for r in ins):
        return [None]
    full = [r if r is not None else _full(a) for r, a in zip(ins, eqn.invars, strict=True)]
    if any(r is None for r in full):
        return [None]
    lo = hi = None
    if name == "max" and len(full) == 2:
        lo, hi = max(full[0][0], full[1][0]), max(full[0][1], full[1][1])
    elif name == "min" and len(full) == 2:
        lo, hi = min(full[0][0], full[1][0]), min(full[0][1], full[1][1])
    elif name == "add" and len(full) == 2:
        lo, hi = full[0][0] + full[1][0], full[0][1] + full[1][1]
    elif name == "sub" and len(full) == 2:
        lo, hi = full[0][0] - full[1][1], full[0][1] - full[1][0]
    elif name == "neg":
        lo, hi = -full[0][1], -full[0][0]
    elif name == "clamp" and len(full) == 3:  # clamp(lo, x, hi)
        lo = min(max(full[1][0], full[0][0]), full[2][1])
        hi = max(min(full[1][1], full[2][1]), full[0][0])
    elif name == "select_n" and len(full) >= 2:
        lo, hi = min(r[0] for r in full[1:]), max(r[1] for r in full[1:])
    out = _full(eqn.outvars[0])
    if lo is None or out is None or lo < out[0] or hi > out[1] or (lo, hi) == out:
        return [None]  # overflow may wrap; the whole dtype range says nothing
    return [(lo, hi)]


def _join(a: Range | None, b: Range | None) -> Range | None:
    if a is None or b is None:
        return None
    return min(a[0], b[0]), max(a[1], b[1])


def while_loop_bounds(closed_jaxpr: Any) -> dict[int, LoopBound]:
    """:class:`LoopBound` of every while equation in a traced program, keyed by ``id(eqn)``.

    Integer ranges flow from literals and closed-over constants through first-order equations
    (broadcast, conversion, max/min/add/sub/clamp/select), into calls, cond branches, loop
    constants and loop-invariant carries, and out of calls. A while equation reached in several
    contexts (a shared sub-jaxpr) gets the weakest of its bounds.
    """
    seen: dict[int, list] = {}
    eqns_by_id: dict[int, Any] = {}

    def level(jaxpr: Any, consts: Sequence[Any], in_ranges: Sequence[Range | None], depth: int) -> list:
        env: dict = {}
        for v, c in zip(jaxpr.constvars, consts, strict=False):
            r = value_range(c)
            if r is not None:
                env[v] = r
        for v, r in zip(jaxpr.invars, in_ranges, strict=False):
            if r is not None:
                env[v] = r
        for eqn in jaxpr.eqns:
            ins = [_atom_range(a, env) for a in eqn.invars]
            outs = visit(eqn, ins, depth) if depth < 64 else [None] * len(eqn.outvars)
            for v, r in zip(eqn.outvars, outs, strict=False):
                if r is not None and compat.is_var(v):
                    env[v] = r
        return [_atom_range(a, env) for a in jaxpr.outvars]

    def visit(eqn: Any, ins: list, depth: int) -> list:
        name = eqn.primitive.name
        nout = len(eqn.outvars)
        try:
            if name == compat.WHILE:
                info = compat.while_info(eqn)
                cn, bn = info.cond_nconsts, info.body_nconsts
                seen.setdefault(id(eqn), []).append(while_bound(eqn, ins))
                eqns_by_id[id(eqn)] = eqn
                carry = ins[cn + bn :]
                fwd = _forwarded(info.body, bn, len(carry))
                inv = [r if f else None for r, f in zip(carry, fwd, strict=True)]
                level(info.cond, info.cond_consts, ins[:cn] + inv, depth + 1)
                level(info.body, info.body_consts, ins[cn : cn + bn] + inv, depth + 1)
                return inv
            if name == compat.SCAN:
                s = compat.scan_info(eqn)
                nc, nk = s.num_consts, s.num_carry
                fwd = _forwarded(s.body, nc, nk)
                inv = [r if f else None for r, f in zip(ins[nc : nc + nk], fwd, strict=True)]
                xs = [None] * (len(ins) - nc - nk)
                level(s.body, s.body_consts, ins[:nc] + inv + xs, depth + 1)
                return inv + [None] * (nout - nk)
            if name == compat.COND:
                outs = None
                for branch, consts in compat.cond_branches(eqn.params):
                    got = level(branch, consts, ins[1:], depth + 1)
                    outs = got if outs is None else [_join(a, b) for a, b in zip(outs, got, strict=False)]
                return outs or [None] * nout
            if name in compat.PLAIN_CALL_PRIMITIVES or name in compat.CUSTOM_PRIMITIVES:
                body, consts = compat.call_jaxpr(eqn.params)
                if len(body.invars) == len(eqn.invars):
                    outs = level(body, consts, ins, depth + 1)
                    return outs if len(outs) == nout else [None] * nout
        except ValueError:
            pass
        subs = compat.sub_jaxprs(eqn.params)
        if subs:
            for sub in subs:
                level(sub, (), [None] * len(sub.invars), depth + 1)
            return [None] * nout
        return _eqn_out_ranges(eqn, ins)

    jx, consts = compat.open_and_consts(closed_jaxpr)
    level(jx, consts, [None] * len(jx.invars), 0)
    out: dict[int, LoopBound] = {}
    for key, found in seen.items():
        unbounded = [b for b in found if b.bound is None]
        if unbounded:
            out[key] = unbounded[0]
            continue
        worst = max(found, key=lambda b: b.bound)
        same = all(b.exact and b.bound == worst.bound for b in found)
        out[key] = worst if same or not worst.exact else worst._replace(exact=False)
    return out


def _forwarded(body: Any, offset: int, n: int) -> list[bool]:
    """Per carry slot ``k < n``: the body returns its invar ``offset + k`` unchanged."""
    frame = _Frame(body)
    out = []
    for k in range(n):
        o = _origin(body.outvars[k], frame)
        out.append(o is not None and o[0] == "invar" and o[1] == offset + k)
    return out


def bound_of(eqn: Any, bounds: dict[int, LoopBound] | None = None) -> LoopBound:
    """``bounds[id(eqn)]`` when the program-wide analysis reached ``eqn``, else :func:`while_bound`
    from its literals alone."""
    if bounds is not None and id(eqn) in bounds:
        return bounds[id(eqn)]
    return while_bound(eqn)


__all__ = ["LoopBound", "Range", "bound_of", "value_range", "while_bound", "while_loop_bounds"]
