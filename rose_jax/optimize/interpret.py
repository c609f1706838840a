"""A rewriting jaxpr interpreter: re-run a function's jaxpr, rebuilding chosen scans.

``rewrite(fn, select, on_scan)`` returns a function that traces ``fn`` to a jaxpr
(``jax.make_jaxpr``) and evaluates it equation by equation (the custom-interpreter pattern of
``jax.core.eval_jaxpr``): equations are re-bound unchanged, except

* scan equations chosen by ``select(site)``: evaluated by ``on_scan(site, scan, invals, interp)``,
  which usually calls ``jax.lax.scan`` with a new body / new ``unroll``;
* scan / while / cond / jit equations that contain a chosen scan somewhere below: rebuilt
  with ``jax.lax.scan`` / ``while_loop`` / ``switch`` or inlined, so that the interpreter reaches
  the chosen scan inside them.

Everything else (custom_jvp / custom_vjp / checkpoint bodies included) is re-bound as it was,
so a chosen scan inside a custom-derivative function or ``jax.checkpoint`` is NOT reached.

Because it only traces and re-binds through public JAX, the result composes with ``jax.jit``,
``jax.vmap`` and ``jax.grad`` (call it under ``jax.jit``: outside jit it runs op by op). Named
scopes (``rose:<component>``) are re-entered for every re-bound equation, so a transformed
function traces to the same component tree as the original.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Sequence

import jax

from rose_jax.jaxpr import compat as C
from rose_jax.program import COMPONENT_PREFIX


class Site(NamedTuple):
    """Where a control-flow equation sits in the program.

    ``address``: structural position from the root (``(eqn_index, sub_jaxpr_index), ...``),
    unique and stable for one trace; ``component_path``: the ``rose_jax.component`` names that
    enclose the equation, outermost first (the equation's own scopes included); ``loop_depth``:
    how many scan/while loops enclose it; ``length``: the scan's trip count (None for while).
    """

    address: tuple[tuple[int, int], ...]
    primitive: str
    component_path: tuple[str, ...]
    scope_path: tuple[str, ...]
    loop_depth: int
    length: int | None
    eqn: Any
    body_ctx: Any = None  # interpreter context of the body (for ``Interpreter.rebuild_scan``)
    name: str = ""  # the loop body's Python function name (``'minibatch_step'``), else the primitive

    def path_str(self) -> str:
        return "/".join(self.component_path + (self.name,))

    def __repr__(self) -> str:
        return f"Site({self.primitive} {self.path_str()!r} x{self.length} depth={self.loop_depth})"


def body_name(jaxpr: Any, default: str) -> str:
    """The Python function a (sub-)jaxpr was traced from (e.g. ``'minibatch_step'``), else
    ``default`` (also for ``<lambda>``: a rebuilt loop body keeps a meaningful name)."""
    return C.func_name(jaxpr, default, lambda_is_anonymous=True)


class Ctx(NamedTuple):
    """Where the interpreter is: the structural address, enclosing components, scopes and loops."""

    address: tuple[tuple[int, int], ...]
    component_path: tuple[str, ...]
    scope_path: tuple[str, ...]
    loop_depth: int


ROOT = Ctx((), (), (), 0)


def _child_ctx(ctx: Ctx, eqn_index: int, sub: int, eqn: Any, loop: bool) -> Ctx:
    scopes = tuple(C.scope_names(eqn))
    comps = tuple(s[len(COMPONENT_PREFIX) :] for s in scopes if s.startswith(COMPONENT_PREFIX))
    return Ctx(
        ctx.address + ((eqn_index, sub),),
        ctx.component_path + comps,
        ctx.scope_path + scopes,
        ctx.loop_depth + (1 if loop else 0),
    )


def site_of(ctx: Ctx, eqn_index: int, eqn: Any) -> Site:
    c = _child_ctx(ctx, eqn_index, 0, eqn, loop=True)
    if eqn.primitive.name == C.SCAN:
        scan = C.scan_params(eqn.params)
        length, name = scan.length, body_name(scan.body, C.SCAN)
    else:
        length, name = None, body_name(C.while_params(eqn.params).body, eqn.primitive.name)
    return Site(
        c.address, eqn.primitive.name, c.component_path, c.scope_path, ctx.loop_depth, length, eqn, c, name
    )


def subs_with_ctx(ctx: Ctx, i: int, eqn: Any) -> list[tuple[Any, Ctx]]:
    """Sub-jaxprs the interpreter can enter, each with its context."""
    name = eqn.primitive.name
    if name == C.SCAN:
        return [(C.scan_params(eqn.params).body, _child_ctx(ctx, i, 0, eqn, True))]
    if name == C.WHILE:
        w = C.while_params(eqn.params)
        return [(w.cond, _child_ctx(ctx, i, 0, eqn, True)), (w.body, _child_ctx(ctx, i, 1, eqn, True))]
    if name == C.COND:
        return [
            (b, _child_ctx(ctx, i, k, eqn, False)) for k, (b, _) in enumerate(C.cond_branches(eqn.params))
        ]
    if name in C.PLAIN_CALL_PRIMITIVES:
        return [(C.call_jaxpr(eqn.params)[0], _child_ctx(ctx, i, 0, eqn, False))]
    return []


def sites(jaxpr: Any, kinds: Sequence[str] = (C.SCAN, C.WHILE)) -> list[Site]:
    """All scan (and while) equations reachable by the interpreter, in pre-order."""
    out: list[Site] = []

    def walk(jx, ctx):
        for i, eqn in enumerate(jx.eqns):
            if eqn.primitive.name in kinds:
                out.append(site_of(ctx, i, eqn))
            for sub, sub_ctx in subs_with_ctx(ctx, i, eqn):
                walk(sub, sub_ctx)

    walk(C.open_and_consts(jaxpr)[0], ROOT)
    return out


ScanRule = Callable[[Site, C.ScanParams, list, "Interpreter"], list]


class WhileParts(NamedTuple):
    """A while equation as functions of its carry (a list of arrays), for ``on_while`` rules.

    ``cond(carry)`` is the predicate, of shape ``pred_shape``: ``()``, or (a while vmapped with a
    batched predicate) a prefix of every carry leaf's shape, each element its own loop, which
    the ``while`` primitive runs as ``carry = select(pred, body(carry), carry)`` while any
    element holds (see :func:`guarded`). ``body(carry)`` is the next carry; ``init`` the first.
    """

    cond: Callable[[list], Any]
    body: Callable[[list], list]
    init: list
    pred_shape: tuple[int, ...]


WhileRule = Callable[[Site, WhileParts, "Interpreter"], list]


def select_carry(pred: Any, new: Sequence[Any], old: Sequence[Any]) -> list:
    """``new`` where ``pred`` holds, else ``old``, leaf by leaf (``pred``: scalar or a prefix of
    every leaf's shape, broadcast over the trailing dimensions)."""
    out = []
    for n, o in zip(new, old, strict=True):
        p = pred
        if jax.numpy.ndim(pred) and jax.numpy.shape(pred) != jax.numpy.shape(o):
            p = jax.lax.broadcast_in_dim(pred, jax.numpy.shape(o), tuple(range(jax.numpy.ndim(pred))))
        out.append(jax.lax.select(p, n, o))
    return out


def guarded(parts: WhileParts) -> Callable[[list], list]:
    """One iteration of the ``while`` primitive as it runs: for a batched predicate, the body's
    result only where the predicate holds (the primitive's own rule); else the body."""
    if not parts.pred_shape:
        return parts.body

    def step(carry):
        return select_carry(parts.cond(carry), parts.body(carry), carry)

    return named(step, getattr(parts.body, "__name__", C.WHILE))


class Interpreter:
    """Evaluates a jaxpr, handing chosen scans to ``on_scan``; see the module docstring."""

    def __init__(self, select: Callable[[Site], bool], on_scan: ScanRule, on_while: WhileRule | None = None):
        self.select = select
        self.on_scan = on_scan
        self.on_while = on_while  # when given, ``select`` also sees while sites
        self._targets = (C.SCAN,) if on_while is None else (C.SCAN, C.WHILE)
        self._contains: dict[tuple[int, tuple], bool] = {}

    # -- structure ----------------------------------------------------------------------------
    def contains_target(self, jaxpr: Any, ctx: Ctx) -> bool:
        key = (id(jaxpr), ctx.address)
        if key not in self._contains:
            found = False
            for i, eqn in enumerate(jaxpr.eqns):
                if eqn.primitive.name in self._targets and self.select(site_of(ctx, i, eqn)):
                    found = True
                    break
                if any(self.contains_target(s, c) for s, c in subs_with_ctx(ctx, i, eqn)):
                    found = True
                    break
            self._contains[key] = found
        return self._contains[key]

    # -- evaluation ---------------------------------------------------------------------------
    def eval(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        ctx: Ctx = ROOT,
        known: dict | None = None,
        skip: frozenset = frozenset(),
    ) -> list:
        """Evaluate an open jaxpr; ``known`` pre-binds variables whose equations (``skip``) are not run."""
        env: dict = dict(known or {})
        constvars, invars = C.in_vars(jaxpr)
        if len(constvars) != len(consts) or len(invars) != len(args):
            raise ValueError(
                f"jaxpr expects {len(constvars)} consts and {len(invars)} args, "
                f"got {len(consts)} and {len(args)}"
            )
        env.update(zip(constvars, consts, strict=True))
        env.update(zip(invars, args, strict=True))
        self.run(jaxpr, [item for item in self.schedule(jaxpr, ctx) if item not in skip], env, ctx)
        return [C.read_atom(env, a) for a in jaxpr.outvars]

    def schedule(self, jaxpr: Any, ctx: Ctx) -> Sequence[Any]:
        """The order in which :meth:`eval` runs the equations: their indices, in program order."""
        return range(len(jaxpr.eqns))

    def run(self, jaxpr: Any, order: Sequence[Any], env: dict, ctx: Ctx) -> None:
        """Evaluate the items of ``order`` (equation indices of ``jaxpr``) into ``env``."""
        for item in order:
            self.eval_item(jaxpr, item, env, ctx)

    def eval_item(self, jaxpr: Any, item: Any, env: dict, ctx: Ctx) -> None:
        """Evaluate one item of a :meth:`schedule` (here: one equation index) into ``env``."""
        eqn = jaxpr.eqns[item]
        outs = self.eval_eqn(item, eqn, [C.read_atom(env, a) for a in eqn.invars], ctx)
        bind_results(env, eqn.outvars, outs)

    def eval_eqn(self, i: int, eqn: Any, invals: list, ctx: Ctx) -> list:
        with scopes_of(eqn), C.eqn_context(eqn):
            name = eqn.primitive.name
            if name == C.SCAN:
                site = site_of(ctx, i, eqn)
                scan = C.scan_params(eqn.params)
                if self.select(site):
                    return self.on_scan(site, scan, invals, self)
                if self.contains_target(scan.body, site.body_ctx):
                    return self.rebuild_scan(scan, invals, site.body_ctx)
            elif name == C.WHILE:
                if self.on_while is not None and self.select(site := site_of(ctx, i, eqn)):
                    return self.on_while(site, self.while_parts(i, eqn, invals, ctx), self)
                if any(self.contains_target(s, c) for s, c in subs_with_ctx(ctx, i, eqn)):
                    return self._rebuild_while(i, eqn, invals, ctx)
            elif name == C.COND and any(self.contains_target(s, c) for s, c in subs_with_ctx(ctx, i, eqn)):
                return self._rebuild_cond(i, eqn, invals, ctx)
            elif name in C.PLAIN_CALL_PRIMITIVES:
                sub, sub_ctx = subs_with_ctx(ctx, i, eqn)[0]
                if self.contains_target(sub, sub_ctx):
                    jx, consts = C.call_jaxpr(eqn.params)
                    return self.eval(jx, consts, invals, sub_ctx)  # inlined: the outer jit compiles it
            return C.bind_eqn(eqn, invals)

    def rebuild_scan(
        self,
        scan: C.ScanParams,
        invals: list,
        body_ctx: Ctx,
        *,
        unroll: int | bool | None = None,
        hoisted: dict | None = None,
        skip: frozenset = frozenset(),
    ) -> list:
        """``jax.lax.scan`` over the scan's body; targets inside the body are rewritten too.

        ``hoisted`` maps body variables to values computed outside the loop and ``skip`` lists
        the body equation indices that produced them: the body reads those values from its
        closure (they become loop constants) instead of recomputing them every iteration.
        """
        consts = invals[: scan.num_consts]
        init = invals[scan.num_consts : scan.num_consts + scan.num_carry]
        xs = invals[scan.num_consts + scan.num_carry :]
        hoisted = dict(hoisted or {})

        def step(carry, x):
            outs = self.eval(scan.body, scan.body_consts, [*consts, *carry, *x], body_ctx, hoisted, skip)
            return outs[: scan.num_carry], outs[scan.num_carry :]

        named(step, body_name(scan.body, C.SCAN))  # the name Site.name reads back

        carry, ys = jax.lax.scan(
            step,
            list(init),
            list(xs),
            length=scan.length,
            reverse=scan.reverse,
            unroll=scan.unroll if unroll is None else unroll,
        )
        return [*carry, *ys]

    def while_parts(self, i: int, eqn: Any, invals: list, ctx: Ctx) -> WhileParts:
        """The while equation ``i`` of the level at ``ctx`` as :class:`WhileParts`; its cond and
        body are evaluated by this interpreter (targets inside them are rewritten too)."""
        w = C.while_params(eqn.params)
        cond_ctx = _child_ctx(ctx, i, 0, eqn, True)
        body_ctx = _child_ctx(ctx, i, 1, eqn, True)
        cconsts = invals[: w.cond_nconsts]
        bconsts = invals[w.cond_nconsts : w.cond_nconsts + w.body_nconsts]
        init = invals[w.cond_nconsts + w.body_nconsts :]

        def cond_fn(carry):
            return self.eval(w.cond, w.cond_consts, [*cconsts, *carry], cond_ctx)[0]

        def body_fn(carry):
            return self.eval(w.body, w.body_consts, [*bconsts, *carry], body_ctx)

        named(cond_fn, body_name(w.cond, "cond_fn"))
        named(body_fn, body_name(w.body, C.WHILE))
        pred_shape = tuple(getattr(getattr(w.cond.outvars[0], "aval", None), "shape", ()))
        return WhileParts(cond_fn, body_fn, list(init), pred_shape)

    def _rebuild_while(self, i, eqn, invals, ctx):
        parts = self.while_parts(i, eqn, invals, ctx)
        cond = parts.cond
        if parts.pred_shape:
            def cond(carry):
                return jax.numpy.any(parts.cond(carry))

        return list(jax.lax.while_loop(cond, guarded(parts), parts.init))

    def _rebuild_cond(self, i, eqn, invals, ctx):
        branches = C.cond_branches(eqn.params)
        index, ops = invals[0], invals[1:]

        def make(k, jx, consts):
            bctx = _child_ctx(ctx, i, k, eqn, False)

            def branch(*a):
                return self.eval(jx, consts, list(a), bctx)

            return named(branch, body_name(jx, f"branch{k}"))

        fns = [make(k, jx, consts) for k, (jx, consts) in enumerate(branches)]
        return list(jax.lax.switch(index, fns, *ops))


def bind_results(env: dict, outvars: Sequence[Any], outs: Sequence[Any]) -> None:
    """Record an equation's results in ``env`` (dropped results are not kept)."""
    env.update((v, o) for v, o in zip(outvars, outs, strict=True) if not C.is_dropvar(v))


def named(fn: Callable, name: str) -> Callable:
    """Give a rebuilt loop body the original body's name (the tracer and ``where`` specs read it)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


def scopes_of(eqn: Any):
    """Re-enter the equation's named scopes so re-bound equations keep their component names."""
    stack = contextlib.ExitStack()
    for name in C.scope_names(eqn):
        stack.enter_context(jax.named_scope(name))
    return stack


def trace(fn: Callable, *args, **kwargs):
    """``(closed jaxpr, output pytree of ShapeDtypeStructs)`` of ``fn(*args, **kwargs)``."""
    return jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)


def rewriting(fn: Callable, make_interpreter: Callable[[], "Interpreter"], check: Callable | None = None):
    """``fn`` evaluated by a fresh ``make_interpreter()`` at every call (``check(interp)`` after).

    ``fn`` takes and returns pytrees of arrays. The result traces ``fn`` anew at every call
    (cheap under ``jax.jit``, where tracing happens once per input signature).
    """

    def rewritten(*args, **kwargs):
        closed, out_shape = trace(fn, *args, **kwargs)
        jx, consts = C.open_and_consts(closed)
        interp = make_interpreter()
        outs = interp.eval(jx, consts, jax.tree.leaves((args, kwargs)))
        if check is not None:
            check(interp)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    rewritten.__name__ = getattr(fn, "__name__", "rewritten")
    rewritten.__wrapped__ = fn
    return rewritten


def rewrite(fn: Callable, select: Callable[[Site], bool], on_scan: ScanRule) -> Callable:
    """``fn`` with the chosen scans evaluated by ``on_scan`` (see the module docstring)."""
    return rewriting(fn, lambda: Interpreter(select, on_scan))


def _eval_inlined(jaxpr: Any, env: dict) -> None:
    for eqn in jaxpr.eqns:
        invals = [C.read_atom(env, a) for a in eqn.invars]
        with scopes_of(eqn), C.eqn_context(eqn):
            if eqn.primitive.name in C.PLAIN_CALL_PRIMITIVES and not C.has_effects(eqn):
                sub, consts = C.call_jaxpr(eqn.params)
                inner = dict(zip(sub.constvars, consts, strict=True))
                inner.update(zip(sub.invars, invals, strict=True))
                _eval_inlined(sub, inner)
                outs = [C.read_atom(inner, v) for v in sub.outvars]
            else:
                outs = C.bind_eqn(eqn, invals)
        bind_results(env, eqn.outvars, outs)


def inline_calls(scan: C.ScanParams) -> C.ScanParams:
    """``scan`` with the jit calls of its body inlined (re-traced): optax's jitted tree functions
    (``tree_bias_correction``) take both networks' leaves in one call, and the outer jit inlines
    the calls anyway. Returned unchanged when the body has none."""
    body = scan.body
    if not any(e.primitive.name in C.PLAIN_CALL_PRIMITIVES for e in body.eqns):
        return scan

    def flat(*args):
        env = dict(zip(body.constvars, scan.body_consts, strict=True))
        env.update(zip(body.invars, args, strict=True))
        _eval_inlined(body, env)
        return [C.read_atom(env, v) for v in body.outvars]

    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
        for v in body.invars
    ]
    try:
        closed = jax.make_jaxpr(flat)(*avals)
    except Exception:  # noqa: BLE001 - e.g. a collective's axis name unbound outside its shard_map
        return scan  # matched as it is: its jit calls stay whole
    return scan._replace(body=closed.jaxpr, body_consts=tuple(closed.consts))
