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

from rose_jax.program import COMPONENT_PREFIX
from rose_jax.optimize import _compat as C


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


class _Ctx(NamedTuple):
    address: tuple[tuple[int, int], ...]
    component_path: tuple[str, ...]
    scope_path: tuple[str, ...]
    loop_depth: int


ROOT = _Ctx((), (), (), 0)


def _child_ctx(ctx: _Ctx, eqn_index: int, sub: int, eqn: Any, loop: bool) -> _Ctx:
    scopes = tuple(C.scope_names(eqn))
    comps = tuple(s[len(COMPONENT_PREFIX) :] for s in scopes if s.startswith(COMPONENT_PREFIX))
    return _Ctx(
        ctx.address + ((eqn_index, sub),),
        ctx.component_path + comps,
        ctx.scope_path + scopes,
        ctx.loop_depth + (1 if loop else 0),
    )


def _site(ctx: _Ctx, eqn_index: int, eqn: Any) -> Site:
    c = _child_ctx(ctx, eqn_index, 0, eqn, loop=True)
    if eqn.primitive.name == C.SCAN:
        scan = C.scan_params(eqn.params)
        length, name = scan.length, C.func_name(scan.body, C.SCAN)
    else:
        length, name = None, C.func_name(C.while_params(eqn.params).body, eqn.primitive.name)
    return Site(
        c.address, eqn.primitive.name, c.component_path, c.scope_path, ctx.loop_depth, length, eqn, c, name
    )


def _subs_with_ctx(ctx: _Ctx, i: int, eqn: Any) -> list[tuple[Any, _Ctx]]:
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
    if name in C.CALL_PRIMITIVES:
        return [(C.call_jaxpr(eqn.params)[0], _child_ctx(ctx, i, 0, eqn, False))]
    return []


def sites(jaxpr: Any, kinds: Sequence[str] = (C.SCAN, C.WHILE)) -> list[Site]:
    """All scan (and while) equations reachable by the interpreter, in pre-order."""
    out: list[Site] = []

    def walk(jx, ctx):
        for i, eqn in enumerate(jx.eqns):
            if eqn.primitive.name in kinds:
                out.append(_site(ctx, i, eqn))
            for sub, sub_ctx in _subs_with_ctx(ctx, i, eqn):
                walk(sub, sub_ctx)

    walk(C.open_and_consts(jaxpr)[0], ROOT)
    return out


ScanRule = Callable[[Site, C.ScanParams, list, "Interpreter"], list]


class Interpreter:
    """Evaluates a jaxpr, handing chosen scans to ``on_scan``; see the module docstring."""

    def __init__(self, select: Callable[[Site], bool], on_scan: ScanRule):
        self.select = select
        self.on_scan = on_scan
        self._contains: dict[tuple[int, tuple], bool] = {}

    # -- structure ----------------------------------------------------------------------------
    def contains_target(self, jaxpr: Any, ctx: _Ctx) -> bool:
        key = (id(jaxpr), ctx.address)
        if key not in self._contains:
            found = False
            for i, eqn in enumerate(jaxpr.eqns):
                if eqn.primitive.name == C.SCAN and self.select(_site(ctx, i, eqn)):
                    found = True
                    break
                if any(self.contains_target(s, c) for s, c in _subs_with_ctx(ctx, i, eqn)):
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
        ctx: _Ctx = ROOT,
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
        for i, eqn in enumerate(jaxpr.eqns):
            if i in skip:
                continue
            invals = [C.read_atom(env, a) for a in eqn.invars]
            outs = self.eval_eqn(i, eqn, invals, ctx)
            for var, val in zip(eqn.outvars, outs, strict=True):
                if not C.is_dropvar(var):
                    env[var] = val
        return [C.read_atom(env, a) for a in jaxpr.outvars]

    def eval_eqn(self, i: int, eqn: Any, invals: list, ctx: _Ctx) -> list:
        with scopes_of(eqn), C.eqn_context(eqn):
            name = eqn.primitive.name
            if name == C.SCAN:
                site = _site(ctx, i, eqn)
                scan = C.scan_params(eqn.params)
                if self.select(site):
                    return self.on_scan(site, scan, invals, self)
                if self.contains_target(scan.body, site.body_ctx):
                    return self.rebuild_scan(scan, invals, site.body_ctx)
            elif name == C.WHILE and any(self.contains_target(s, c) for s, c in _subs_with_ctx(ctx, i, eqn)):
                return self._rebuild_while(i, eqn, invals, ctx)
            elif name == C.COND and any(self.contains_target(s, c) for s, c in _subs_with_ctx(ctx, i, eqn)):
                return self._rebuild_cond(i, eqn, invals, ctx)
            elif name in C.CALL_PRIMITIVES:
                sub, sub_ctx = _subs_with_ctx(ctx, i, eqn)[0]
                if self.contains_target(sub, sub_ctx):
                    jx, consts = C.call_jaxpr(eqn.params)
                    return self.eval(jx, consts, invals, sub_ctx)  # inlined: the outer jit compiles it
            return C.bind_eqn(eqn, invals)

    def rebuild_scan(
        self,
        scan: C.ScanParams,
        invals: list,
        body_ctx: _Ctx,
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

        named(step, C.func_name(scan.body, C.SCAN))  # the name Site.name reads back

        carry, ys = jax.lax.scan(
            step,
            list(init),
            list(xs),
            length=scan.length,
            reverse=scan.reverse,
            unroll=scan.unroll if unroll is None else unroll,
        )
        return [*carry, *ys]

    def _rebuild_while(self, i, eqn, invals, ctx):
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

        named(cond_fn, C.func_name(w.cond, "cond_fn"))
        named(body_fn, C.func_name(w.body, C.WHILE))

        return list(jax.lax.while_loop(cond_fn, body_fn, list(init)))

    def _rebuild_cond(self, i, eqn, invals, ctx):
        branches = C.cond_branches(eqn.params)
        index, ops = invals[0], invals[1:]

        def make(k, jx, consts):
            bctx = _child_ctx(ctx, i, k, eqn, False)

            def branch(*a):
                return self.eval(jx, consts, list(a), bctx)

            return named(branch, C.func_name(jx, f"branch{k}"))

        fns = [make(k, jx, consts) for k, (jx, consts) in enumerate(branches)]
        return list(jax.lax.switch(index, fns, *ops))


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


def rewrite(fn: Callable, select: Callable[[Site], bool], on_scan: ScanRule) -> Callable:
    """``fn`` with the chosen scans evaluated by ``on_scan`` (see the module docstring).

    ``fn`` takes and returns pytrees of arrays. The result traces ``fn`` anew at every call
    (cheap under ``jax.jit``, where tracing happens once per input signature).
    """

    def rewritten(*args, **kwargs):
        closed, out_shape = trace(fn, *args, **kwargs)
        jx, consts = C.open_and_consts(closed)
        flat = jax.tree.leaves((args, kwargs))
        outs = Interpreter(select, on_scan).eval(jx, consts, flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    rewritten.__name__ = getattr(fn, "__name__", "rewritten")
    rewritten.__wrapped__ = fn
    return rewritten
