"""Every read of ``eqn.params`` and of jaxpr internals lives here, so a JAX upgrade touches one file.

The tracer (``rose_jax.trace``), the phase timer (``rose_jax.profile``) and the optimizer
(``rose_jax.optimize``) all see jaxprs through this module (and :mod:`rose_jax.jaxpr.dataflow`,
:mod:`rose_jax.jaxpr.cut`, which build on it): higher-order equations only
through the records below (:class:`ScanParams`, :class:`WhileParams`, :class:`CondInfo`,
:class:`CallInfo`), which say which sub-jaxprs an equation runs and how its operands and
results map onto each sub-jaxpr's inputs and outputs.

Version notes (checked on JAX 0.11.2 and 0.12):
  * scan: ``jaxpr``, ``length``, ``reverse``, ``unroll`` and ``ft_in``/``ft_out`` flat-trees whose
    three input groups are (consts, carry, xs) and two output groups (carry, ys); JAX 0.10 had
    ``num_consts``/``num_carry`` (plus ``linear``, ``_split_transpose``). Both are accepted.
  * ``ClosedJaxpr`` is an alias of ``Jaxpr`` (a ``Jaxpr`` carries its ``consts`` and its
    ``.jaxpr`` is itself); older JAX wrapped an open ``Jaxpr`` (no ``.jaxpr``) and its consts in
    a ``ClosedJaxpr``. :func:`open_jaxpr` / :func:`open_and_consts` unwrap either.
  * the jit primitive is ``jit`` (``pjit`` in older JAX); custom_vjp is ``custom_vjp_call``
    (``custom_vjp_call_jaxpr`` with ``fun_jaxpr`` in older JAX); remat is ``remat2``
    (``checkpoint`` in older JAX); ``closed_call`` is now the ``eval_jaxpr`` primitive.
  * ``Primitive.get_bind_params`` returns the params dict (``(subfuns, params)`` in older JAX).
  * name stacks: equations inside a scan/while/cond/jit body carry a name stack relative to the
    equation that holds the body (the enclosing scopes are on that equation).
  * ``jax.sharding.SingleDeviceSharding`` is deprecated in JAX 0.12.1 for
    ``jax.sharding.make_single_device_sharding`` (absent in 0.11.2): :func:`single_device_sharding`.

Never imports ``jax._src``.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, NamedTuple, Sequence

import jax.extend.core as jex
import jax.extend.core.primitives as prims
import jax.lax
import jax.lax.linalg
import jax.sharding

from rose_jax.program import COMPONENT_PREFIX

SCAN, WHILE, COND = "scan", "while", "cond"
LOOP_PRIMITIVES = frozenset({SCAN, WHILE})
JIT_PRIMITIVES = frozenset({"jit", "pjit"})
# Calls whose body runs as is, operands onto invars (what the optimizer and profiler inline).
PLAIN_CALL_PRIMITIVES = JIT_PRIMITIVES | {"closed_call", "core_call"}
# Call-like primitives the tracer shows as "call" nodes (besides jit).
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
    """The object whose ``eqns``/``constvars``/``invars``/``outvars`` to walk.

    A closed jaxpr is a ``Jaxpr`` whose ``.jaxpr`` is itself (returned as is); older JAX wrapped
    an open ``Jaxpr`` (which has no ``.jaxpr``) in a ``ClosedJaxpr`` (unwrapped).
    """
    for _ in range(4):
        inner = getattr(j, "jaxpr", None)
        if inner is None or inner is j:
            return j
        j = inner
    return j


def open_and_consts(j: Any) -> tuple[Any, tuple[Any, ...]]:
    """``(open jaxpr, values of its constvars)`` of a closed or open jaxpr (no consts: ``()``)."""
    return open_jaxpr(j), tuple(getattr(j, "consts", ()) or ())


def in_vars(jaxpr: Any) -> tuple[list[Any], list[Any]]:
    """``(constvars, invars)`` of an open jaxpr."""
    return list(jaxpr.constvars), list(jaxpr.invars)


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


_ANONYMOUS = ("<unknown>", "unknown")


def func_name(j: Any, default: str, *, lambda_is_anonymous: bool = False) -> str:
    """The Python function name a (sub-)jaxpr was traced from, e.g. ``'minibatch_step'``.

    ``default`` when the jaxpr has no debug info or an unknown name (also for ``<lambda>`` when
    ``lambda_is_anonymous``).
    """
    info = getattr(open_jaxpr(j), "debug_info", None) or getattr(j, "debug_info", None)
    if info is None:
        return default
    try:
        name = info.func_name
    except Exception:  # noqa: BLE001 - older DebugInfo without func_name
        name = None
    if not name:
        src = getattr(info, "func_src_info", None)
        name = src.split(" ")[0] if isinstance(src, str) and src else None
    if not name or name in _ANONYMOUS or (lambda_is_anonymous and name == "<lambda>"):
        return default
    return str(name)


def _effects(eqns: Sequence) -> frozenset:
    eff: set = set()
    for e in eqns:
        eff |= set(e.effects)
    return frozenset(eff)


def make_closed(
    invars: Sequence, outvars: Sequence, eqns: Sequence, constvars: Sequence = (), consts: Sequence = ()
):
    """A closed jaxpr of ``eqns`` taking ``invars`` and returning ``outvars``; ``constvars`` are
    bound to ``consts`` (e.g. the arrays a sub-computation closes over)."""
    invars, outvars, eqns = list(invars), list(outvars), list(eqns)
    constvars, consts = list(constvars), list(consts)
    if len(constvars) != len(consts):
        raise ValueError(f"make_closed: {len(constvars)} constvars but {len(consts)} consts")
    try:
        dbg = jex.DebugInfo(
            "rose_jax.profile",
            "segment",
            tuple(f"in{i}" for i in range(len(invars))),
            tuple(f"out{i}" for i in range(len(outvars))),
        )
    except Exception:  # noqa: BLE001 - DebugInfo's signature moved between versions
        dbg = None
    try:
        j = jex.Jaxpr(constvars, invars, outvars, eqns, _effects(eqns), dbg)
    except (TypeError, AssertionError):
        j = jex.Jaxpr(constvars, invars, outvars, eqns, _effects(eqns), None)
    return jex.ClosedJaxpr(j, consts)


def as_fun(j: Any, consts: Sequence[Any] = ()):
    """A Python callable evaluating a jaxpr (name stacks propagate into lowering).

    ``j`` is a closed jaxpr, or an old-style open ``Jaxpr`` closed here over ``consts``.
    """
    if getattr(j, "jaxpr", None) is None:  # old-style open Jaxpr
        j = jex.ClosedJaxpr(j, list(consts))
    return jex.jaxpr_as_fun(j)


# ----------------------------------------------------------------------------- atoms, eqns


def is_literal(atom: Any) -> bool:
    return isinstance(atom, jex.Literal)


def is_dropvar(atom: Any) -> bool:
    return isinstance(atom, jex.DropVar)


def is_var(atom: Any) -> bool:
    """A real variable (not a Literal, not a dropped output)."""
    return isinstance(atom, jex.Var) and not is_dropvar(atom)


def read_atom(env: dict, atom: Any) -> Any:
    """The value of ``atom``: a Literal's value, else ``env[atom]``."""
    return atom.val if is_literal(atom) else env[atom]


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


def has_effects(eqn: Any) -> bool:
    return bool(getattr(eqn, "effects", None))


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Re-bind an equation unchanged on ``invals`` (what ``jax.core.eval_jaxpr`` does)."""
    got = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
        subfuns, bind_params = got  # older JAX
    else:
        subfuns, bind_params = (), got
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def eqn_context(eqn: Any):
    """The equation's context manager (compute type, xla metadata), or a null context."""
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


# ------------------------------------------------------------------------------ name stacks


_COMPONENT_RE = re.compile(r"(?:^|[/(])" + re.escape(COMPONENT_PREFIX) + r"([^/()]+)")


def _name_stack(eqn: Any):
    return getattr(getattr(eqn, "source_info", None), "name_stack", None)


def component_path(eqn: Any) -> tuple[str, ...]:
    """Component names (``rose:<name>`` scopes) on an equation's name stack, outermost first,
    as written (repeats kept), e.g. ``('rollout', 'sim')``."""
    ns = _name_stack(eqn)
    return () if ns is None else tuple(_COMPONENT_RE.findall(str(ns)))


def name_stack_components(eqn: Any, cache: dict) -> tuple[str, ...]:
    """Component names on an equation's name stack, outermost first, repeats collapsed.

    ``cache`` maps name-stack objects to results (name stacks are shared by many equations).
    """
    ns = _name_stack(eqn)
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


def scope_names(eqn: Any) -> list[str]:
    """The named scopes on an equation's name stack (transform markers like ``jvp`` dropped)."""
    stack = getattr(eqn.source_info.name_stack, "stack", None)
    if stack is None:
        text = str(eqn.source_info.name_stack)
        return [s for s in text.split("/") if s and "(" not in s and ")" not in s]
    return [s.name for s in stack if type(s).__name__ == "Scope"]


def prefixed(eqn: Any, outer_eqn: Any):
    """``eqn`` with ``outer_eqn``'s name stack prepended (so paths and HLO metadata stay full)."""
    outer = outer_eqn.source_info.name_stack
    if not str(outer):
        return eqn
    si = eqn.source_info.replace(name_stack=outer + eqn.source_info.name_stack)
    return eqn.replace(source_info=si)


# ------------------------------------------------------------------------ higher-order params


class ScanParams(NamedTuple):
    """A scan: operands are ``consts + carry + xs``; results are ``carry + ys``.

    ``body`` is open (its ``invars`` align with the equation's operands); ``body_consts`` are the
    values of its ``constvars`` (closed-over constants). ``unroll`` is as bound (int or bool).
    """

    length: int
    reverse: bool
    unroll: int | bool
    num_consts: int
    num_carry: int
    body: Any
    body_consts: tuple[Any, ...]


def _group_sizes(ft: Any) -> list[int] | None:
    """Sizes (leaf counts) of the top-level groups of a scan ``ft_in``/``ft_out`` flat-tree."""
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


def scan_params(params: dict) -> ScanParams:
    """Decode a scan equation's params (``num_consts``/``num_carry`` or ``ft_in`` layouts)."""
    body, body_consts = open_and_consts(params["jaxpr"])
    if "num_consts" in params and "num_carry" in params:
        nc, ncarry = int(params["num_consts"]), int(params["num_carry"])
    else:
        sizes = _group_sizes(params.get("ft_in"))
        if not sizes or len(sizes) != 3:
            raise ValueError(f"scan params not understood: {sorted(params)}")
        nc, ncarry = sizes[0], sizes[1]
    return ScanParams(
        length=int(params["length"]),
        reverse=bool(params.get("reverse", False)),
        unroll=params.get("unroll", 1),
        num_consts=nc,
        num_carry=ncarry,
        body=body,
        body_consts=body_consts,
    )


def scan_info(eqn: Any) -> ScanParams:
    """:func:`scan_params` of a scan equation, checked against its operands."""
    info = scan_params(eqn.params)
    if info.num_consts + info.num_carry > len(eqn.invars) or len(info.body.invars) != len(eqn.invars):
        raise ValueError("scan operands do not match its body")
    return info


def scan_partition(eqn: Any) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Index lists (consts, carry, xs) into ``eqn.invars`` and (carry, ys) into ``eqn.outvars``."""
    s = scan_params(eqn.params)
    nc, nk, n_in, n_out = s.num_consts, s.num_carry, len(eqn.invars), len(eqn.outvars)
    return (list(range(nc)), list(range(nc, nc + nk)), list(range(nc + nk, n_in)),
            list(range(nk)), list(range(nk, n_out)))


class WhileParams(NamedTuple):
    """A while: operands ``cond_consts + body_consts + carry``; results ``carry``.

    ``cond`` is open over ``cond_consts + carry -> (bool,)``, ``body`` over ``body_consts + carry
    -> carry``; ``cond_consts``/``body_consts`` are the values of their ``constvars``.
    """

    cond_nconsts: int
    body_nconsts: int
    cond: Any
    cond_consts: tuple[Any, ...]
    body: Any
    body_consts: tuple[Any, ...]


def while_params(params: dict) -> WhileParams:
    cond, cond_consts = open_and_consts(params["cond_jaxpr"])
    body, body_consts = open_and_consts(params["body_jaxpr"])
    return WhileParams(
        int(params["cond_nconsts"]), int(params["body_nconsts"]), cond, cond_consts, body, body_consts
    )


def while_info(eqn: Any) -> WhileParams:
    """:func:`while_params` of a while equation, checked against its operands."""
    info = while_params(eqn.params)
    ncarry = len(eqn.invars) - info.cond_nconsts - info.body_nconsts
    if (len(info.body.invars) != info.body_nconsts + ncarry
            or len(info.cond.invars) != info.cond_nconsts + ncarry):
        raise ValueError("while operands do not match its cond/body")
    return info


class CondInfo(NamedTuple):
    """A cond/switch: operand 0 is the branch index; branch i sees operands[1:]; branch 0 = false."""

    branches: tuple  # open jaxprs


def cond_branches(params: dict) -> list[tuple[Any, tuple[Any, ...]]]:
    """``[(open branch jaxpr, consts)]`` of a cond equation; operands are ``[index, *ops]``."""
    return [open_and_consts(b) for b in params["branches"]]


def cond_info(eqn: Any) -> CondInfo:
    """The branches of a cond equation, checked against its operands."""
    branches = tuple(b for b, _ in cond_branches(eqn.params))
    for b in branches:
        if len(b.invars) != len(eqn.invars) - 1 or len(b.outvars) != len(eqn.outvars):
            raise ValueError("cond operands do not match its branches")
    return CondInfo(branches)


class CallInfo(NamedTuple):
    """A call-like equation: the body's invars/outvars align one-to-one with operands/results."""

    body: Any
    name: str


_CALL_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def call_jaxpr(params: dict) -> tuple[Any, tuple[Any, ...]]:
    """``(open body, consts)`` of a jit/pjit, closed_call/core_call, remat, shard_map or
    custom_jvp/vjp call equation."""
    for key in _CALL_BODY_KEYS:
        if key in params and is_jaxpr(params[key]):
            return open_and_consts(params[key])
    raise ValueError(f"no body jaxpr among params {sorted(params)}")


def call_info(eqn: Any) -> CallInfo:
    """The body and name of a call-like equation, checked against its operands."""
    p = eqn.params
    prim = eqn.primitive.name
    try:
        body, _ = call_jaxpr(p)
    except ValueError as e:
        raise ValueError(f"{prim}: {e}") from None
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        raise ValueError(f"{prim}: operands do not match its body")
    name = p.get("name")
    if not isinstance(name, str) or not name:
        name = func_name(body, prim)
    return CallInfo(body, name)


# ------------------------------------------------------------------------- first-order params


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


def single_device_sharding(device: Any):
    """The sharding that places an array whole on ``device``: JAX 0.12.1's
    ``make_single_device_sharding``, else (0.11.2) ``SingleDeviceSharding``, equal either way."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)
