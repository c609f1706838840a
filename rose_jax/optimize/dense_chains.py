"""Row-parallel chains of dense layers as one kernel each: :func:`fuse_dense_chains`, and its
:func:`candidates`.

Why (issue 32): SAC's high-update gradient step is a chain of small kernels each waiting for the
one before. Brax's published hopper step runs 12 of its 48 matrix products in series
(:mod:`rose_jax.trace.depth`), about 18 us each on an H100 with the elementwise work between them;
batching or overlapping the work beside that path (twins, stream regions, hoists) leaves it as it
is, and XLA fuses elementwise work into a matrix product but never two matrix products. Each row
of the batch goes through a layer stack independently (the forward pass, and the input gradient
back through it), so a stack can run as ONE kernel per block of rows, its hidden activations kept
on chip.

**What is matched** (:func:`find_chains`, on the scan body with its jit calls inlined): a chain of
two or three ``dot_general`` s, each contracting the last axis of a ``(rows, k)`` operand with one
axis of a 2-D one (the weight, or its transpose), joined by column-local epilogues:

* ``add`` / ``mul`` of a scalar, of a ``(n,)`` / ``(1, n)`` row (a bias) or of a ``(rows, n)``
  value computed outside the chain;
* ``relu`` (``jax.nn.relu``'s custom_jvp call, or ``max(v, 0)``);
* ``select_n(p, 0, v)`` / ``select_n(p, v, 0)`` with a ``(rows, n)`` predicate computed outside
  (the ReLU derivative of a backward pass; a predicate ``z > 0`` is compared in the kernel from z).

The shape is the one of a two-hidden-layer MLP and of its input gradient: layer A narrow -> wide
(its weight fits on chip), layer B wide -> wide (its weight does not: computed in column chunks),
and optionally layer C wide -> narrow, which each chunk of B's output is multiplied into at once.
Every value of the chain used outside it (pre-activations for the backward pass's masks,
activations for the weight gradients) is also written by the kernel. Everything is padded to
powers of two of at least 16 (Triton's ``dot``), and the results sliced back.

**Legality**: the chain is convex in its body (no equation outside it both reads one of its
values and feeds one of its equations, checked on the body's dependency graph), so the body can
run with the chain as one item (the order :func:`rose_jax.jaxpr.dataflow.region_order` finds); each
equation of the chain computes each row of its output from the same row of its operands (checked
per equation above), so one kernel per block of rows computes what the equations did. Only
float32 chains.

**Tolerance**: the kernel sums each product's terms in another order than XLA's GEMM (chunked;
each product at the precision the equation asked for, TF32 at the default on both), so
:data:`rose_jax.optimize.base.REASSOCIATION_TOLERANCE` with the learning check, as ``batch_twins``.
On the CPU the kernel runs in Pallas's interpret mode (for tests; no candidate is offered there).

Probe of the kernel alone: ``benchmarks/experiments/fused_mlp.py``.

**Measured** (H100, 2026-12-07): slower than XLA's chain. The probe's best configuration runs a
three-layer pass at SAC's sizes in 34.8 us where XLA's GEMMs take 13.3 us, and Brax's SAC hopper
and ant iterations with their 14 chains fused run 0.28x of the same program under the flag alone.
Why is not profiled; a likely part: 512 rows make 8-16 programs, so most SMs idle while each
program multiplies its whole 256 x 256 layer in series, where XLA's GEMM spreads it over more. So
:func:`candidates` offers none at the measured :data:`FUSED_S`; the transform stays for explicit
use and for a faster kernel (e.g. one splitting the wide layer's columns over programs), which
would show in the probe first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rose_jax.jaxpr import compat as C
from rose_jax.jaxpr.dataflow import ancestors, convex, producers, region_order
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import REASSOCIATION_TOLERANCE, Transform
from rose_jax.optimize.predict import (
    Candidate,
    CandidateContext,
    split_scan_transform,
    split_scans,
)
from rose_jax.optimize.where import Where, where_label

# The widest operand a chain may start from and end in (padded): layer A's weight (k x wide) is
# loaded whole by every program, and so is layer C's (wide x n) chunk by chunk.
NARROW_MAX = 64
# Kernel configuration: the fastest the probe measured at SAC's sizes, for the forward pass and
# the input gradient alike (benchmarks/results/fused_mlp/, H100, 2026-12-07: 64 rows x 8 warps
# 34.8 / 34.5 us per pass; 32 x 4 42.7 / 286 us: the input gradient's accumulator likely spills).
BLOCK_ROWS = 64
CHUNK = 64
NUM_WARPS = 8
# Seconds a kernel of the chain costs XLA on a GPU (a latency-bound small GEMM or elementwise
# fusion in a command buffer, as twins.KERNEL_S) and what one fused kernel costs: measured, the
# probe's best three-layer pass (the module docstring's **Measured**). At it no chain of two or
# three layers gains, so none is offered; a faster kernel's measured time here brings them back.
KERNEL_S = 6e-6
FUSED_S = 35e-6


@dataclasses.dataclass(frozen=True)
class Op:
    """One column-local epilogue operation: ``kind`` ``"add"`` / ``"mul"`` (``operand``: a
    literal's value, or a variable of shape ``()``, ``(n,)``, ``(1, n)`` or ``(rows, n)``),
    ``"relu"``, ``"mask"`` (``operand``: the ``(rows, n)`` predicate; ``keep_true``: the value
    is kept where it is true, else where it is false) or ``"positive"`` (the same with the
    predicate ``operand > 0`` of a float32 ``(rows, n)`` operand). ``out``: the variable it
    produces."""

    kind: str
    eqn: int
    out: Any
    operand: Any = None
    keep_true: bool = True


@dataclasses.dataclass(frozen=True)
class Layer:
    """``x @ W`` (``transposed``: ``x @ W.T``) at equation ``eqn``, then its epilogue ``ops``;
    ``precision``: the product's (the kernel's product takes it: DEFAULT is TF32 in Triton's
    ``dot`` and in XLA's GEMMs alike, HIGHEST full float32 in both)."""

    eqn: int
    weight: Any
    transposed: bool
    out: Any  # the product's variable
    ops: tuple[Op, ...]
    precision: Any = None

    @property
    def value(self) -> Any:
        """The layer's last value (after its epilogue)."""
        return self.ops[-1].out if self.ops else self.out


@dataclasses.dataclass(frozen=True)
class Chain:
    """A chain read from ``x`` through ``layers`` (2 or 3); ``escapes``: its values used outside
    it (written by the kernel), each with the index of its layer."""

    x: Any
    layers: tuple[Layer, ...]
    escapes: tuple[tuple[Any, int], ...]

    @property
    def eqns(self) -> frozenset[int]:
        return _members(self.layers)

    @property
    def widths(self) -> tuple[int, ...]:
        return (int(self.x.aval.shape[1]), *(int(L.out.aval.shape[1]) for L in self.layers))

    def describe(self) -> str:
        w = " -> ".join(str(n) for n in self.widths)
        eps = "/".join("+".join(o.kind for o in L.ops) or "-" for L in self.layers)
        return f"{int(self.x.aval.shape[0])} rows {w} ({eps}; {len(self.escapes)} value(s) out)"


@dataclasses.dataclass(frozen=True)
class Chains:
    """The chains of one scan body (its jit calls inlined: ``scan``); ``why`` when none moves."""

    scan: Any
    chains: tuple[Chain, ...]
    schedule: tuple | None
    why: str = ""

    @property
    def moves(self) -> bool:
        return bool(self.chains)

    @property
    def kernels_saved(self) -> int:
        """Per step: the kernels XLA would launch on each chain's path (a product and its
        epilogue's fusion per layer) less the fused kernel."""
        return sum(2 * len(c.layers) - 1 for c in self.chains)


def _members(layers) -> frozenset[int]:
    """The equations of ``layers``: each product and its epilogue's operations."""
    return frozenset(i for L in layers for i in (L.eqn, *(o.eqn for o in L.ops)))


def _pow2(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def _is_zero(atom: Any, prod: dict, eqns: list) -> bool:
    """``atom`` is a literal 0 or a broadcast of one."""
    if C.is_literal(atom):
        try:
            return float(atom.val) == 0.0
        except (TypeError, ValueError):
            return False
    i = prod.get(atom)
    if i is None:
        return False
    e = eqns[i]
    return (
        e.primitive.name == "broadcast_in_dim" and C.is_literal(e.invars[0]) and float(e.invars[0].val) == 0.0
    )


def _relu_body(jaxpr: Any) -> bool:
    """A jaxpr computing ``max(x, 0)`` (through nested jit calls)."""
    jx = C.open_jaxpr(jaxpr)
    if len(jx.eqns) != 1 or len(jx.invars) != 1:
        return False
    e = jx.eqns[0]
    if e.primitive.name in C.PLAIN_CALL_PRIMITIVES:
        return _relu_body(C.call_jaxpr(e.params)[0])
    if e.primitive.name != "max":
        return False
    a, b = e.invars
    other = b if a is jx.invars[0] else a if b is jx.invars[0] else None
    return other is not None and C.is_literal(other) and _is_zero(other, {}, [])


def _row_dot(e: Any, rows: int | None = None) -> tuple[Any, bool] | None:
    """``(weight, transposed)`` when ``e`` is ``x @ W`` / ``x @ W.T`` over a ``(rows, k)`` x."""
    if e.primitive.name != "dot_general" or len(e.invars) != 2:
        return None
    x, w = e.invars
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    xs, ws = getattr(x.aval, "shape", ()), getattr(w.aval, "shape", ())
    if (
        len(xs) != 2
        or len(ws) != 2
        or tuple(lb)
        or tuple(rb)
        or tuple(lc) != (1,)
        or tuple(rc) not in ((0,), (1,))
    ):
        return None
    if rows is not None and xs[0] != rows:
        return None
    if any(getattr(v.aval, "dtype", None) != jnp.float32 for v in (x, w, e.outvars[0])):
        return None
    if not C.is_var(w):
        return None
    return w, tuple(rc) == (1,)


def _epilogue_op(e: Any, i: int, v: Any, prod: dict, eqns: list) -> Op | None:
    """The :class:`Op` equation ``e`` (index ``i``) applies to the chain's value ``v``, if any."""
    name = e.primitive.name
    out = e.outvars[0] if len(e.outvars) == 1 else None
    if out is None or getattr(out.aval, "shape", None) != v.aval.shape or out.aval.dtype != v.aval.dtype:
        return None
    rows, n = v.aval.shape
    if name in ("add", "add_any", "mul") and len(e.invars) == 2:
        a, b = e.invars
        other = b if a is v else a if b is v else None
        if other is None or other is v:
            return None
        if C.is_literal(other):
            return Op("mul" if name == "mul" else "add", i, out, float(other.val))
        shape = tuple(other.aval.shape)
        if other.aval.dtype != jnp.float32 or shape not in ((), (n,), (1, n), (rows, n)):
            return None
        return Op("mul" if name == "mul" else "add", i, out, other)
    if name == "max" and len(e.invars) == 2:
        a, b = e.invars
        other = b if a is v else a if b is v else None
        if other is not None and other is not v and _is_zero(other, prod, eqns):
            return Op("relu", i, out)
        return None
    if name == "custom_jvp_call" and len(e.invars) == 1 and e.invars[0] is v:
        return Op("relu", i, out) if _relu_body(C.call_jaxpr(e.params)[0]) else None
    if name == "select_n" and len(e.invars) == 3:
        p, f, t = e.invars
        if not C.is_var(p) or tuple(p.aval.shape) != (rows, n) or p.aval.dtype != jnp.bool_:
            return None
        keep = (
            True
            if t is v and f is not v and _is_zero(f, prod, eqns)
            else (False if f is v and t is not v and _is_zero(t, prod, eqns) else None)
        )
        if keep is None:
            return None
        # a ReLU's derivative: the predicate is ``z > 0`` of a float32 value; the kernel reads z
        # and compares (one kernel fewer than converting the predicate for it to load)
        j = prod.get(p)
        g = eqns[j] if j is not None else None
        if (
            g is not None
            and g.primitive.name == "gt"
            and C.is_var(g.invars[0])
            and tuple(g.invars[0].aval.shape) == (rows, n)
            and g.invars[0].aval.dtype == jnp.float32
            and _is_zero(g.invars[1], prod, eqns)
        ):
            return Op("positive", i, out, g.invars[0], keep)
        return Op("mask", i, out, p, keep)
    return None


def _follow(v: Any, users: dict, eqns: list, prod: dict, taken: set[int], rows: int):
    """From the chain's value ``v``: its epilogue ops, then the next row dot reading the result
    (None at the chain's end). A value read by two candidate continuations ends the chain."""
    ops: list[Op] = []
    while True:
        nexts = []
        for i in users.get(v, ()):
            if i in taken:
                continue
            e = eqns[i]
            op = _epilogue_op(e, i, v, prod, eqns)
            if op is not None:
                nexts.append(("op", op))
            elif _row_dot(e, rows) is not None and e.invars[0] is v and e.invars[1] is not v:
                nexts.append(("dot", i))
        if len(nexts) != 1:
            return ops, None
        kind, what = nexts[0]
        if kind == "dot":
            return ops, what
        ops.append(what)
        v = what.out


def _escapes(chain_eqns: set[int], values: list[tuple[Any, int]], users: dict, outvars: set) -> tuple:
    return tuple(
        (v, k) for v, k in values if v in outvars or any(i not in chain_eqns for i in users.get(v, ()))
    )


def find_chains(scan: Any) -> Chains:
    """The dense chains of ``scan``'s body (see the module docstring), its jit calls inlined."""
    scan = I.inline_calls(scan)
    eqns = list(scan.body.eqns)
    prod = producers(eqns)
    users: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if C.is_var(a):
                users.setdefault(a, []).append(i)
    outvars = {v for v in scan.body.outvars if C.is_var(v)}
    taken: set[int] = set()
    chains: list[Chain] = []
    refused: list[str] = []
    anc = None
    for i, e in enumerate(eqns):
        if i in taken or (rd := _row_dot(e)) is None:
            continue
        x = e.invars[0]
        rows, k0 = x.aval.shape
        if rows < 16 or k0 > NARROW_MAX:
            continue
        layers: list[Layer] = []
        j, w, tr = i, *rd
        local = set(taken)
        while j is not None and len(layers) < 3:
            out = eqns[j].outvars[0]
            local.add(j)
            ops, nxt = _follow(out, users, eqns, prod, local, rows)
            local.update(o.eqn for o in ops)
            layers.append(Layer(j, w, tr, out, tuple(ops), eqns[j].params.get("precision")))
            if nxt is None:
                break
            j = nxt
            w, tr = _row_dot(eqns[j], rows)
        widths = [k0, *(int(L.out.aval.shape[1]) for L in layers)]
        if len(layers) < 2 or widths[1] <= NARROW_MAX or widths[2] <= NARROW_MAX:
            continue  # not the narrow -> wide -> wide (-> narrow) shape: left to XLA
        if len(layers) == 3 and widths[3] > NARROW_MAX:
            layers = layers[:2]
        members = _members(layers)
        # (no operand of the chain is one of its own values: such a value would have had two
        # continuations where _follow reached it, which ends a chain there)
        if anc is None:
            anc = ancestors(eqns)
        if not convex(members, anc):
            refused.append(f"a chain of {len(layers)} products at equation {i} reads what depends on it")
            continue
        values = [(v, n) for n, L in enumerate(layers) for v in (L.out, *(o.out for o in L.ops))]
        chain = Chain(x, tuple(layers), _escapes(members, values, users, outvars))
        if not chain.escapes:
            continue  # nothing reads it: dead code XLA drops anyway
        chains.append(chain)
        taken |= members
    if not chains:
        why = (
            "; ".join(refused) or "no chain of two or three dense layers (narrow -> wide -> wide) in the body"
        )
        return Chains(scan, (), None, why)
    schedule = region_order(eqns, [(set(c.eqns), set()) for c in chains], prod)
    if schedule is None:
        return Chains(scan, (), None, "the chains cannot be ordered with the rest of the body")
    return Chains(scan, tuple(chains), tuple(schedule))


def describe(found: Chains, scan: Any) -> str:
    return f"{len(found.chains)} chain(s) as one kernel each: " + "; ".join(
        c.describe() for c in found.chains
    )


# -- the kernel -----------------------------------------------------------------------------------

_SCALAR, _ROW, _BLOCK = "scalar", "row", "block"


def _operand_kind(op: Op) -> str | None:
    if not C.is_var(op.operand):  # ReLU, or a literal's value baked into the kernel
        return None
    shape = tuple(op.operand.aval.shape)
    if op.kind in ("mask", "positive") or len(shape) == 2 and shape[0] > 1:
        return _BLOCK
    return _SCALAR if shape == () else _ROW


def fused_chain(
    chain: Chain,
    env: dict,
    *,
    interpret: bool | None = None,
    block_rows: int = BLOCK_ROWS,
    chunk: int = CHUNK,
    num_warps: int = NUM_WARPS,
) -> dict[Any, Any]:
    """Run ``chain`` on the values of ``env`` as one Pallas kernel; returns its escaping values."""
    from jax.experimental import pallas as pl

    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    rows = int(chain.x.aval.shape[0])
    widths = chain.widths
    pw = [_pow2(n) for n in widths]
    rp = -(-rows // block_rows) * block_rows
    chunk = min(chunk, pw[2])
    n_chunks = pw[2] // chunk

    def pad2(a, r, c):
        if a.shape == (r, c):
            return a
        return jnp.pad(a, ((0, r - a.shape[0]), (0, c - a.shape[1])))

    # the kernel's operands: each one's slot (by "x", ("w", layer), or its Op's id) and kind
    inputs: list[Any] = []
    kinds: list[str] = []
    slot: dict[Any, int] = {}

    def operand_in(key, kind, value):
        slot[key] = len(inputs)
        inputs.append(value)
        kinds.append(kind)

    operand_in("x", _BLOCK, pad2(env[chain.x], rp, pw[0]))
    for n, L in enumerate(chain.layers):
        shape = (pw[n + 1], pw[n]) if L.transposed else (pw[n], pw[n + 1])
        operand_in(("w", n), _ROW, pad2(env[L.weight], *shape))
        width = pw[n + 1]
        for o in L.ops:
            kind = _operand_kind(o)
            if kind is None:
                continue
            val = env[o.operand]
            if o.kind == "mask":
                val = val.astype(jnp.float32)
            if kind == _SCALAR:
                val = jnp.reshape(val, (1, 1))
            elif kind == _ROW:
                val = pad2(jnp.reshape(val, (1, -1)), 1, width)
            else:
                val = pad2(val, rp, width)
            operand_in(id(o), kind, val)
    esc_index = {v: k for k, (v, _) in enumerate(chain.escapes)}

    def block_spec(kind, shape):  # a block of rows, or the whole operand for every program
        if kind == _BLOCK:
            return pl.BlockSpec((block_rows, shape[1]), lambda i: (i, 0))
        return pl.BlockSpec(shape, lambda i: (0, 0))

    in_specs = [block_spec(k, a.shape) for k, a in zip(kinds, inputs, strict=True)]
    out_shapes = [jax.ShapeDtypeStruct((rp, pw[n + 1]), jnp.float32) for _, n in chain.escapes]
    out_specs = [pl.BlockSpec((block_rows, s.shape[1]), lambda i: (i, 0)) for s in out_shapes]

    def kernel(*refs):
        ins, outs = refs[: len(inputs)], refs[len(inputs) :]

        def operand(o: Op, cols=None):
            if not C.is_var(o.operand):  # a literal's value
                return o.operand
            ref = ins[slot[id(o)]]
            return ref[...] if cols is None or _operand_kind(o) == _SCALAR else _load(ref, cols)

        def epilogue(v, L: Layer, cols=None):
            for o in L.ops:
                if o.kind == "relu":
                    v = jnp.maximum(v, 0.0)
                elif o.kind == "add":
                    v = v + operand(o, cols)
                elif o.kind == "mul":
                    v = v * operand(o, cols)
                else:  # mask, positive
                    m = operand(o, cols) > 0.0 if o.kind == "positive" else operand(o, cols) != 0.0
                    v = jnp.where(m, v, 0.0) if o.keep_true else jnp.where(m, 0.0, v)
                _store(o.out, v, cols)
            return v

        def _store(var, v, cols):
            k = esc_index.get(var)
            if k is None:
                return
            if cols is None:
                outs[k][...] = v
            else:
                _store_cols(outs[k], cols, v)

        def dot(a, w_ref, L: Layer, cols=None, contract_cols=None):
            """``a @ W`` with W's output (``cols``) or input (``contract_cols``) axis in a chunk;
            W is stored (in, out), or (out, in) where the layer reads it transposed."""
            chunk_of = cols if cols is not None else contract_cols
            if chunk_of is None:
                w = w_ref[...]
            elif (cols is not None) == L.transposed:  # the chunked axis is the stored rows
                w = _load_rows(w_ref, chunk_of)
            else:
                w = _load(w_ref, chunk_of)
            w = w.T if L.transposed else w
            return jnp.dot(a, w, preferred_element_type=jnp.float32, precision=L.precision)

        A, B = chain.layers[0], chain.layers[1]
        Cl = chain.layers[2] if len(chain.layers) == 3 else None
        h = dot(ins[slot["x"]][...], ins[slot[("w", 0)]], A)
        _store(A.out, h, None)
        h = epilogue(h, A)
        acc = jnp.zeros((block_rows, pw[3]), jnp.float32) if Cl is not None else None
        for c in range(n_chunks):  # static: one chunk of layer B's output columns at a time
            cols = pl.dslice(c * chunk, chunk)
            hb = dot(h, ins[slot[("w", 1)]], B, cols=cols)
            _store(B.out, hb, cols)
            hb = epilogue(hb, B, cols)
            if Cl is not None:
                acc = acc + dot(hb, ins[slot[("w", 2)]], Cl, contract_cols=cols)
        if Cl is not None:
            _store(Cl.out, acc, None)
            epilogue(acc, Cl)

    call = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid=(rp // block_rows,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=None if interpret else _triton_params(num_warps),
        interpret=interpret,
    )
    results = call(*inputs)
    return {v: r[:rows, : widths[n + 1]] for (v, n), r in zip(chain.escapes, results, strict=True)}


def _triton_params(num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _load(ref, cols):
    """``ref[:, cols]`` (a column chunk of a row block or a weight)."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref.at[:, cols])


def _load_rows(ref, rows):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref.at[rows, :])


def _store_cols(ref, cols, v):
    from jax.experimental.pallas import triton as plgpu

    plgpu.store(ref.at[:, cols], v)


# -- the rewrite ------------------------------------------------------------------------------------


def _run_fused(found: Chains, invals: list, site: I.Site, interp: I.Interpreter, kernel_kw: dict):
    scan = found.scan
    body, ctx = scan.body, site.body_ctx
    nc, nk = scan.num_consts, scan.num_carry
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]

    def step(carry, x):
        env = dict(zip(body.constvars, scan.body_consts, strict=True))
        env.update(zip(body.invars, [*consts, *carry, *x], strict=True))
        for item in found.schedule:
            if isinstance(item, tuple):
                env.update(fused_chain(found.chains[item[1]], env, **kernel_kw))
            else:
                interp.eval_item(body, item, env, ctx)
        outs = [C.read_atom(env, v) for v in body.outvars]
        return outs[:nk], outs[nk:]

    I.named(step, site.name or I.body_name(body, C.SCAN))
    carry, ys = jax.lax.scan(
        step, list(init), list(xs), length=scan.length, reverse=scan.reverse, unroll=scan.unroll
    )
    return [*carry, *ys]


def fuse_dense_chains(
    where: Where = None, block_rows: int = BLOCK_ROWS, chunk: int = CHUNK, num_warps: int = NUM_WARPS
) -> Transform:
    """Run each dense chain of the chosen scans' bodies (an MLP's forward pass, its input
    gradient) as one Pallas kernel per block of rows. See the module docstring."""
    for name, v in (("block_rows", block_rows), ("chunk", chunk), ("num_warps", num_warps)):
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"fuse_dense_chains: {name} must be a power of two, got {v!r}")
    if block_rows < 16 or chunk < 16:
        raise ValueError(
            f"fuse_dense_chains: block_rows and chunk must be at least 16 (Triton's dot), got "
            f"{block_rows}, {chunk}"
        )
    kw = dict(block_rows=block_rows, chunk=chunk, num_warps=num_warps)

    params: tuple = (("where", where),)
    if (block_rows, chunk, num_warps) != (BLOCK_ROWS, CHUNK, NUM_WARPS):
        params += (("block_rows", block_rows), ("chunk", chunk), ("num_warps", num_warps))
    return split_scan_transform(
        "fuse_dense_chains",
        params,
        REASSOCIATION_TOLERANCE,
        where,
        find_chains,
        describe,
        "each chain convex in its body and row-parallel equation by equation; ",
        lambda found, scan, invals, site, interp: _run_fused(found, invals, site, interp, kw),
        f"run the dense-layer chains of the scan(s) at {where_label(where)} as one kernel each",
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Per scan of at least two steps with dense chains, on a GPU only (the CPU runs the kernel
    interpreted). Model: ``trips x (kernels saved x`` :data:`KERNEL_S` ``- chains x``
    :data:`FUSED_S` ``)``."""
    if ctx.platform != "gpu":
        return []
    out: list[Candidate] = []
    for _, where, found, trips in split_scans(ctx, find_chains):
        gain = trips * (found.kernels_saved * KERNEL_S - len(found.chains) * FUSED_S)
        if gain > 0:
            out.append(
                Candidate(
                    fuse_dense_chains(where),
                    where,
                    gain,
                    f"{trips} steps x ({found.kernels_saved} kernels x {KERNEL_S * 1e6:.0f}us - "
                    f"{len(found.chains)} fused x {FUSED_S * 1e6:.0f}us)",
                )
            )
    return out
