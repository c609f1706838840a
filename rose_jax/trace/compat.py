"""Every read of ``eqn.params`` and of jaxpr internals lives here, so a JAX upgrade touches one file.

The tracer sees a higher-order equation only through the small records below (:class:`ScanInfo`,
:class:`WhileInfo`, :class:`CondInfo`, :class:`CallInfo`): which sub-jaxprs it runs, and how the
equation's operands and results map onto each sub-jaxpr's inputs and outputs.

Version notes (checked on JAX 0.11.2 and 0.12):
  * scan: ``jaxpr``, ``length``, ``reverse``, ``unroll`` and ``ft_in``/``ft_out`` flat-trees whose
    three input groups are (consts, carry, xs); older JAX had ``num_consts``/``num_carry``. Both
    are accepted.
  * sub-jaxprs are ``Jaxpr`` objects with attached consts (``ClosedJaxpr`` is an alias of
    ``Jaxpr``); older JAX wrapped an open jaxpr in a ``ClosedJaxpr``. :func:`open_jaxpr` unwraps.
  * the jit primitive is ``jit`` (``pjit`` in older JAX); custom_vjp is ``custom_vjp_call``
    (``custom_vjp_call_jaxpr`` with ``fun_jaxpr`` in older JAX); remat is ``remat2``
    (``checkpoint`` in older JAX).
  * name stacks: equations inside a scan/while/cond/jit body carry a name stack relative to the
    equation that holds the body (the enclosing scopes are on that equation).

Never imports ``jax._src``.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax.extend.core as jex

from rose_jax.program import COMPONENT_PREFIX

JIT_PRIMITIVES = frozenset({"jit", "pjit"})
CALL_PRIMITIVES = frozenset({"closed_call", "core_call", "remat2", "remat", "checkpoint", "shard_map"})
CUSTOM_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
CALLBACK_PRIMITIVES = frozenset({"pure_callback", "io_callback", "debug_callback", "ffi_call", "custom_call"})

# First-order primitives that are not in jax.extend.core.primitives / jax.lax but are ordinary
# array operations (the tracer treats any other unknown primitive as opaque).
_EXTRA_PLAIN = frozenset({
    "random_wrap", "random_unwrap", "random_clone", "random_key_data", "random_impl",
    "platform_index", "mesh_cast", "reshard", "pvary", "axis_size", "sharding_constraint",
    "optimization_barrier", "copy_p", "square", "erf_inv", "iota", "split", "tile", "stack",
    "unstack", "mulhi", "scatter-sub", "lu_pivots_to_permutation", "argsort", "cholesky_update",
    "symmetric_product", "ormqr", "dot_general", "ragged_dot_general", "clamp", "nextafter",
    "with_memory_kind", "device_put", "name", "stop_gradient", "pbroadcast", "psum_invariant",
    "composite", "unreduced_psum", "preduced", "empty", "zeros_like", "cast",
})


def known_primitive_names() -> frozenset[str]:
    """Names of the primitives JAX ships (jax.extend.core.primitives, jax.lax, jax.lax.linalg)."""
    import jax.extend.core.primitives as prims
    import jax.lax
    import jax.lax.linalg

    names = set(_EXTRA_PLAIN)
    for module in (prims, jax.lax, jax.lax.linalg):
        for value in vars(module).values():
            if isinstance(value, jex.Primitive):
                names.add(value.name)
    return frozenset(names)


# ---------------------------------------------------------------------------------- jaxprs


def is_jaxpr(x: Any) -> bool:
    """True for a jaxpr object (a ``Jaxpr``, or an old-style ``ClosedJaxpr`` wrapping one)."""
    if isinstance(x, jex.Jaxpr) or isinstance(x, jex.ClosedJaxpr):
        return True
    inner = getattr(x, "jaxpr", None)
    return hasattr(inner, "eqns") and hasattr(inner, "invars")


def open_jaxpr(j: Any):
    """The object whose ``eqns``/``invars``/``outvars`` to walk (unwraps an old ClosedJaxpr).

    In JAX >= 0.11 a closed jaxpr is a ``Jaxpr`` whose ``.jaxpr`` is itself; older JAX wrapped
    an open ``Jaxpr`` (which has no ``.jaxpr``) in a ``ClosedJaxpr``.
    """
    for _ in range(4):
        inner = getattr(j, "jaxpr", None)
        if inner is None or inner is j:
            return j
        j = inner
    return j


def sub_jaxprs(params: dict) -> list:
    """All sub-jaxprs found in an equation's params (open jaxprs), in params order."""
    found = []
    try:
        found = [open_jaxpr(j) for j in jex.jaxprs_in_params(params)]
    except Exception:  # noqa: BLE001 - fall back to a manual scan below
        found = []
    if found:
        return found
    for value in params.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if is_jaxpr(v):
                found.append(open_jaxpr(v))
    return found


def func_name(j: Any, default: str) -> str:
    """The Python function name a (sub-)jaxpr was traced from, e.g. ``'minibatch_step'``."""
    info = getattr(open_jaxpr(j), "debug_info", None) or getattr(j, "debug_info", None)
    if info is None:
        return default
    name = None
    try:
        name = info.func_name
    except Exception:  # noqa: BLE001 - older DebugInfo without func_name
        src = getattr(info, "func_src_info", None)
        if isinstance(src, str) and src:
            name = src.split(" ")[0]
    if not name or name in ("<unknown>", "unknown"):
        return default
    return str(name)


def is_literal(atom: Any) -> bool:
    return isinstance(atom, jex.Literal)


def is_dropvar(atom: Any) -> bool:
    return isinstance(atom, jex.DropVar)


def literal_int(atom: Any) -> int | None:
    """The Python int a Literal holds, else None."""
    if not is_literal(atom):
        return None
    try:
        value = atom.val
        shape = getattr(value, "shape", ())
        if shape not in ((), None):
            return None
        f = float(value)
        return int(f) if f == int(f) else None
    except Exception:  # noqa: BLE001 - non-numeric literal
        return None


def aval_of(atom: Any):
    return getattr(atom, "aval", None)


def aval_size(aval: Any) -> int:
    """Number of elements of an abstract value (0 for tokens and other shapeless values)."""
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    n = 1
    for d in shape:
        try:
            n *= int(d)
        except TypeError:  # symbolic dimension
            return 0
    return n


def aval_bytes(aval: Any) -> int:
    """Bytes of an abstract value (PRNG key arrays use their key data size)."""
    size = aval_size(aval)
    if size == 0:
        return 0
    dtype = getattr(aval, "dtype", None)
    try:
        itemsize = int(dtype.itemsize)
    except Exception:  # noqa: BLE001 - extended dtype without itemsize
        itemsize = 4
    return size * itemsize


# ------------------------------------------------------------------------------ name stacks


_COMPONENT_RE = re.compile(r"(?:^|[/(])" + re.escape(COMPONENT_PREFIX) + r"([^/()]+)")


def name_stack_components(eqn: Any, cache: dict) -> tuple[str, ...]:
    """Component names (``rose:<name>`` scopes) on an equation's name stack, outermost first.

    ``cache`` maps name-stack objects to results (name stacks are shared by many equations).
    """
    ns = getattr(getattr(eqn, "source_info", None), "name_stack", None)
    if ns is None:
        return ()
    try:
        return cache[ns]
    except KeyError:
        pass
    except TypeError:  # unhashable name stack in some version
        return collapse_repeats(_COMPONENT_RE.findall(str(ns)))
    text = str(ns)
    comps = collapse_repeats(_COMPONENT_RE.findall(text)) if COMPONENT_PREFIX in text else ()
    cache[ns] = comps
    return comps


def collapse_repeats(names) -> tuple[str, ...]:
    """Drop immediately repeated blocks: ``a/a -> a``, ``a/b/a/b -> a/b``.

    Transposed equations (the backward pass of ``grad``) carry their primal's scopes inside
    ``transpose(...)`` after the enclosing scopes, e.g. ``rose:critic_update/transpose(
    rose:critic_update)/jvp(TwinQ)``; collapsing keeps them in one component. (A component
    directly nested in one of the same name is therefore merged with it.)
    """
    out: list[str] = []
    for name in names:
        out.append(name)
        for width in range(1, len(out) // 2 + 1):
            if out[-width:] == out[-2 * width:-width]:
                del out[-width:]
                break
    return tuple(out)


# ------------------------------------------------------------------------ higher-order params


class ScanInfo(NamedTuple):
    """A scan: operands are ``consts + carry + xs``; results are ``carry + ys``."""

    body: Any  # open jaxpr; body.invars align with the equation's operands
    length: int
    num_consts: int
    num_carry: int
    reverse: bool
    unroll: int


class WhileInfo(NamedTuple):
    """A while: operands ``cond_consts + body_consts + carry``; results ``carry``."""

    cond: Any  # open jaxpr over cond_consts + carry -> (bool,)
    body: Any  # open jaxpr over body_consts + carry -> carry
    cond_nconsts: int
    body_nconsts: int


class CondInfo(NamedTuple):
    """A cond/switch: operand 0 is the branch index; branch i sees operands[1:]; branch 0 = false."""

    branches: tuple


class CallInfo(NamedTuple):
    """A call-like equation: the body's invars/outvars align one-to-one with operands/results."""

    body: Any
    name: str


def _group_sizes(ft: Any) -> list[int] | None:
    """Sizes of the top-level groups of a scan ``ft_in``/``ft_out`` flat-tree."""
    for attempt in ("unpack", "elts"):
        try:
            groups = ft.unpack() if attempt == "unpack" else ft.elts
            return [len(g) for g in groups]
        except Exception:  # noqa: BLE001 - try the next representation
            continue
    if isinstance(ft, (tuple, list)):
        try:
            return [len(g) for g in ft]
        except TypeError:
            return None
    return None


def scan_info(eqn: Any) -> ScanInfo:
    """Decode a scan equation's params (JAX 0.10 ``num_consts``/``num_carry`` or 0.11+ ``ft_in``)."""
    p = eqn.params
    body = open_jaxpr(p["jaxpr"])
    if "num_consts" in p and "num_carry" in p:
        nc, ncarry = int(p["num_consts"]), int(p["num_carry"])
    else:
        sizes = _group_sizes(p.get("ft_in"))
        if not sizes or len(sizes) != 3:
            raise ValueError(f"scan params not understood: {sorted(p)}")
        nc, ncarry = sizes[0], sizes[1]
    if nc + ncarry > len(eqn.invars) or len(body.invars) != len(eqn.invars):
        raise ValueError("scan operands do not match its body")
    unroll = p.get("unroll", 1)
    return ScanInfo(body, int(p["length"]), nc, ncarry, bool(p.get("reverse", False)),
                    int(unroll) if not isinstance(unroll, bool) else int(unroll))


def while_info(eqn: Any) -> WhileInfo:
    p = eqn.params
    info = WhileInfo(open_jaxpr(p["cond_jaxpr"]), open_jaxpr(p["body_jaxpr"]),
                     int(p["cond_nconsts"]), int(p["body_nconsts"]))
    ncarry = len(eqn.invars) - info.cond_nconsts - info.body_nconsts
    if (len(info.body.invars) != info.body_nconsts + ncarry
            or len(info.cond.invars) != info.cond_nconsts + ncarry):
        raise ValueError("while operands do not match its cond/body")
    return info


def cond_info(eqn: Any) -> CondInfo:
    branches = tuple(open_jaxpr(b) for b in eqn.params["branches"])
    for b in branches:
        if len(b.invars) != len(eqn.invars) - 1 or len(b.outvars) != len(eqn.outvars):
            raise ValueError("cond operands do not match its branches")
    return CondInfo(branches)


_CALL_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def call_info(eqn: Any) -> CallInfo:
    """Decode jit/pjit, closed_call/core_call, remat, shard_map, custom_jvp/vjp call params."""
    p = eqn.params
    prim = eqn.primitive.name
    body = None
    for key in _CALL_BODY_KEYS:
        if key in p and is_jaxpr(p[key]):
            body = open_jaxpr(p[key])
            break
    if body is None:
        raise ValueError(f"{prim}: no body jaxpr among params {sorted(p)}")
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        raise ValueError(f"{prim}: operands do not match its body")
    name = p.get("name")
    if not isinstance(name, str) or not name:
        name = func_name(body, prim)
    return CallInfo(body, name)


def dot_contracting_size(eqn: Any) -> int:
    """Product of the lhs contracting dimensions of a dot_general."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    shape = getattr(aval_of(eqn.invars[0]), "shape", ())
    k = 1
    for d in lhs_contract:
        k *= int(shape[d])
    return k


def conv_window_size(eqn: Any) -> int:
    """Multiply-adds per output element of a conv_general_dilated (kernel size / out features)."""
    rhs = getattr(aval_of(eqn.invars[1]), "shape", ())
    out_dim = 0
    dn = eqn.params.get("dimension_numbers")
    spec = getattr(dn, "rhs_spec", None)
    if spec:
        out_dim = spec[0]
    total = 1
    for d in rhs:
        total *= int(d)
    return total // max(int(rhs[out_dim]), 1) if rhs else 1
