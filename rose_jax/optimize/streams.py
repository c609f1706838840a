"""Independent work of one XLA program on its own GPU streams, and per-component compilation.

One JAX process runs a jitted program's kernels on one compute stream. Inside ONE program,
``jax.experimental.compute_on`` with ``compute_type="gpu_stream:N"`` lowers a function to a
non-inlined ``call`` whose ``mhlo.frontend_attributes`` carry ``_xla_stream_annotation="N"``;
XLA's GPU backend turns it into an asynchronous ``call-start``/``call-done`` pair on stream N,
so two annotated regions with no dataflow between them run side by side. On a CPU the call is
compiled and run in place (the annotation is inert) and the function is unchanged. The function
form is ``compute_on(f, compute_type=..., out_memory_spaces=...)`` in JAX 0.12 and
``compute_on2`` in JAX 0.10-0.11 (where ``compute_on`` is a context manager): :func:`on_stream`
picks whichever exists.

What XLA accepts (measured on an H200, JAX 0.11.2): regions that are straight-line code inside
a loop body compile and overlap (two zipped MLP chains, 1.99x); a region that holds a whole
loop does not compile ("No ExecutionStreamId found for call-start ... while/cond"), so regions
here never hold a loop (two loops are zipped step by step instead); a region holding MJX physics
made XLA abort the process, which is why every GPU compile of a candidate is first tried in a
child process (:mod:`rose_jax.optimize.isolate`).

JAX commits the outputs of any program holding a ``compute_on`` (``pxla`` counts its memory
spaces as transfers), so a jitted stream program fed its own output compiles a second time
unless its first inputs were committed too (``jax.device_put(state, device)``).

Transformations (:class:`~rose_jax.optimize.base.Transform`):

* :func:`stream_overlap` (``level="fn"``): regions of one loop body, each on its own stream:
  ``mode="components"``: named ``rose_jax.component`` scopes (SAC's ``alpha_update``,
  ``critic_update``, ``actor_update``); ``mode="state"``: the work that produces each group of
  carried state (PPO's ``policy`` and ``value`` parameters and their optimizer moments);
  ``mode="loops"``: two independent sibling loops zipped into one, each step of each on its own
  stream. Legality from dataflow and read/write sets; a refusal names what couples the regions
  (e.g. "optax clip_by_global_norm ... a global norm over both gradient trees").
* :func:`split_compile` (``level="host"``): the iteration cut at top-level component boundaries
  into separately compiled programs chained on the device (no host sync between them), each
  compiled with its own XLA options, chosen by measurement from :data:`OPTION_SETS`.

:func:`candidates` generates both from a :class:`rose_jax.trace.LoopTree`.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import re
import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax

from rose_jax.jaxpr import compat as C
from rose_jax.jaxpr import cut
from rose_jax.jaxpr import dataflow as D
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import FUSION_TOLERANCE, HostStep, Transform
from rose_jax.program import Program

MODES = ("components", "state", "loops")

# Each region is compiled as its own (non-inlined) call: XLA cannot fuse across its boundary,
# so an a*b+c split by it is not contracted into an FMA on a GPU; last-bit differences, which
# RL training amplifies over iterations. The operations and their order are unchanged: the
# fusion tolerance (rtol 1e-4) with the reason of each transformation.
STREAM_TOLERANCE = dataclasses.replace(
    FUSION_TOLERANCE,
    reason="the same operations in the same order, but each region is a separate (non-inlined) call: "
    "XLA cannot fuse across its boundary (FMA contraction may differ in the last bit on a GPU)",
)
SPLIT_TOLERANCE = dataclasses.replace(
    FUSION_TOLERANCE,
    reason="the same operations in the same order, compiled as separate programs: XLA cannot fuse "
    "across a stage boundary (FMA contraction may differ in the last bit on a GPU); the XLA options "
    "change scheduling and kernel launch, not arithmetic",
)

_COMMAND_BUFFER_ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
_COMMAND_BUFFER_NO_LOOPS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"

# The documented option sets a stage of :func:`split_compile` is measured under (GPU only; on a
# CPU every stage is compiled with XLA's defaults). "concurrent": CUDA-graph command buffers for
# every command type, loops (WHILE/CONDITIONAL) captured too, scheduled CONCURRENT (independent
# kernels of a graph may run side by side): PPO ant 4096's learn 19.35 -> 16.00 ms on the H200.
# "concurrent_no_loops": the same without capturing loops (each loop iteration launches its
# graph from the host). "no_command_buffers": every kernel launched by the runtime (29.6 ms).
OPTION_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "concurrent": {
        "xla_gpu_enable_command_buffer": _COMMAND_BUFFER_ALL,
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    },
    "concurrent_no_loops": {
        "xla_gpu_enable_command_buffer": _COMMAND_BUFFER_NO_LOOPS,
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    },
    "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
}


# ---------------------------------------------------------------------------- compute_on


def _compute_on_function() -> Callable:
    from jax.experimental import compute_on as co  # noqa: PLC0415 - experimental, loaded on use

    fn = getattr(co, "compute_on2", None)  # JAX 0.10 / 0.11: compute_on is a context manager
    if fn is None:
        fn = co.compute_on
        if "out_memory_spaces" not in inspect.signature(fn).parameters:
            raise ValueError("this JAX has no function form of jax.experimental.compute_on")
    return fn


def on_stream(fn: Callable, stream: int) -> Callable:
    """``fn`` (positional array arguments) as one region on XLA GPU stream ``stream`` (>= 1).

    Lowered as a non-inlined call with ``_xla_stream_annotation``; inert on a CPU. Outputs stay
    in device memory.
    """
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 1:
        raise ValueError(f"on_stream: stream must be an int >= 1, got {stream!r}")
    return _compute_on_function()(
        fn, compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device
    )


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


def _is_val(a: Any) -> bool:
    return not (C.is_literal(a) or isinstance(a, Const) or C.is_dropvar(a))


def _read(env: dict, a: Any) -> Any:
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


def _reads(ops: Sequence[Op]) -> list:
    defined, seen, order = set(), set(), []
    for op in ops:
        for a in op.invars:
            if _is_val(a) and a not in defined and a not in seen:
                seen.add(a)
                order.append(a)
        defined.update(v for v in op.outvars if _is_val(v))
    return order


def _defined(ops: Sequence[Op]) -> list:
    return [v for op in ops for v in op.outvars if _is_val(v)]


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


def _check_contents(ops: Sequence[Op], idxs: Sequence[int], name: str) -> None:
    sub = [ops[i].eqn for i in idxs]
    if cut.contains_loop(sub):
        raise ValueError(
            f"{name} holds a loop: XLA does not compile an annotated region holding a loop "
            "('No ExecutionStreamId found for call-start ... while/cond'); zip loops step by step instead"
        )
    effects = sorted({e.primitive.name for e in sub if C.has_effects(e)})
    if effects:
        raise ValueError(f"{name} has side effects ({', '.join(effects)}): it cannot become a stream region")
    if any(e.primitive.name == "compute_on" for e in sub):
        raise ValueError(f"{name} already holds a compute_on region: XLA does not nest them")


def plan_regions(body: FlatBody, regions: dict[str, Sequence[int]], shared: str = "") -> RegionPlan:
    """A :class:`RegionPlan` for ``regions`` (name -> op indices of ``body``).

    Raises ``ValueError`` with the reason when the regions cannot run side by side: a region
    is empty, overlaps another, holds a loop / side effect / compute_on, a region reads a value
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
        _check_contents(ops, idxs, name)
    all_regions = set(owner)
    reach: dict[str, set] = {}
    for name in names:
        mine = set(regions[name])
        produced = _defined([ops[i] for i in mine])
        reach[name] = D.forward(ops, produced, skip=mine)
        produced_set = set(produced)
        for i in sorted(mine):
            back = [a for a in ops[i].invars if _is_val(a) and a in reach[name] and a not in produced_set]
            if back:
                raise ValueError(
                    f"{name} is not contiguous in dataflow: its equation {i} ({ops[i].eqn.primitive.name}) "
                    f"reads {_var_str(back[0])}, computed outside {name} from {name}'s own results"
                )
    for a in names:
        produced_a = set(_defined([ops[i] for i in regions[a]]))
        for b in names:
            if a == b:
                continue
            for i in sorted(regions[b]):
                hit = [x for x in ops[i].invars if _is_val(x) and x in reach[a]]
                if hit:
                    how = "the result" if hit[0] in produced_a else "a value computed from the results"
                    raise ValueError(
                        f"{b} reads {how} of {a} ({_var_str(hit[0])} at {ops[i].eqn.primitive.name}, "
                        f"{_where_computed(ops[i].eqn)}): they are dependent"
                    )
    everything = D.forward(ops, _defined([ops[i] for i in all_regions]), skip=all_regions)
    epilogue, prelude = [], []
    for i, op in enumerate(ops):
        if i in all_regions:
            continue
        (epilogue if any(_is_val(a) and a in everything for a in op.invars) else prelude).append(i)
    return RegionPlan(
        body,
        tuple(names),
        tuple(tuple(sorted(set(regions[n]))) for n in names),
        tuple(prelude),
        tuple(epilogue),
        shared,
    )


def _relative_components(eqn: Any, outer: Sequence[str]) -> tuple[str, ...]:
    path = C.component_path(eqn)
    k = 0
    while k < len(path) and k < len(outer) and path[k] == outer[k]:
        k += 1
    return path[k:]


def component_region_indices(body: FlatBody, names: Sequence[str], outer: Sequence[str] = ()) -> dict:
    """name -> op indices of ``body`` inside ``rose_jax.component(name)`` (``outer``: the
    components enclosing the level, which the equations' name stacks may repeat)."""
    return {
        n: [i for i, op in enumerate(body.ops) if n in _relative_components(op.eqn, outer)] for n in names
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
    slices = {g: set(D.needed_eqns(ops, [t for t in targets[g] if _is_val(t)])) for g in names}
    taint = {g: D.forward(ops, [v for v in owned[g] if _is_val(v)]) for g in names}
    count: collections.Counter = collections.Counter(i for g in names for i in slices[g])
    shared = sorted(i for i, k in count.items() if k >= 2)
    sources = {
        i: [g for g in names if any(v in taint[g] for v in ops[i].outvars if _is_val(v))] for i in shared
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


# ------------------------------------------------------------------------- carry labels

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tokens(path: str | None) -> frozenset[str]:
    """The names in a pytree path string (``"state.params.policy[0]"`` -> policy, params, state)."""
    return frozenset(_TOKEN.findall(path or ""))


def leaf_paths(tree: Any) -> list[str]:
    """Path strings of ``tree``'s leaves, in flatten order."""
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def scan_labels(closed: Any, input_labels: Sequence[str | None]) -> dict[tuple, tuple[I.Site, list]]:
    """For every scan the interpreter reaches: ``site.address -> (site, labels of its body's
    invars)``; a label is the input path whose value reaches that invar unchanged (forwarded
    through calls and loop operands), else None."""
    jx, _ = C.open_and_consts(closed)
    out: dict[tuple, tuple[I.Site, list]] = {}

    def walk(j, labels: dict, ctx):
        for i, eqn in enumerate(j.eqns):
            ins = [labels.get(a) if C.is_var(a) else None for a in eqn.invars]
            name = eqn.primitive.name
            subs = I.subs_with_ctx(ctx, i, eqn)
            if name == C.SCAN:
                site = I.site_of(ctx, i, eqn)
                body = subs[0][0]
                out[site.address] = (site, ins)
                walk(body, dict(zip(body.invars, ins, strict=False)), subs[0][1])
            elif name == C.WHILE:
                w = C.while_params(eqn.params)
                cc, bc = w.cond_nconsts, w.body_nconsts
                carry = ins[cc + bc :]
                (cj, cctx), (bj, bctx) = subs
                walk(cj, dict(zip(cj.invars, ins[:cc] + carry, strict=False)), cctx)
                walk(bj, dict(zip(bj.invars, ins[cc : cc + bc] + carry, strict=False)), bctx)
            elif name == C.COND:
                for bj, bctx in subs:
                    walk(bj, dict(zip(bj.invars, ins[1:], strict=False)), bctx)
            elif subs:
                sj, sctx = subs[0]
                walk(sj, dict(zip(sj.invars, ins, strict=False)), sctx)

    walk(jx, dict(zip(jx.invars, input_labels, strict=False)), I.ROOT)
    return out


def _group_slots(
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


def state_plan(scan: C.ScanParams, labels: Sequence[str | None], groups: Sequence[str]) -> RegionPlan:
    """The :class:`RegionPlan` of a scan body whose regions produce each group's carried state."""
    slots = _group_slots(labels, scan, groups)
    empty = [g for g in groups if not slots[g]]
    if empty:
        raise ValueError(f"no carried state of this loop is named {', '.join(map(repr, empty))}")
    body, nc = flatten_body(scan.body), scan.num_consts
    targets = {g: [body.out_atoms[k] for k in slots[g]] for g in groups}
    owned = {g: [body.in_keys[nc + k] for k in slots[g]] for g in groups}
    regions, note = slice_regions(body, targets, owned)
    return plan_regions(body, regions, note)


def loop_pair_plan(
    jaxpr: Any, n_carry: tuple[int, int], n_xs: tuple[int, int], n_ys_first: int, names: tuple[str, str]
) -> RegionPlan:
    """The plan of a zipped loop body (operands ``consts + carry_a + carry_b + xs_a + xs_b``,
    results ``carry_a + carry_b + ys_a + ys_b``, ``n_ys_first`` = len(ys_a)): each original
    body becomes a region."""
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
    return plan_regions(body, regions, note)


# ------------------------------------------------------------------------- the rewrite


def _bind(op: Op, env: dict) -> None:
    with I.scopes_of(op.eqn), C.eqn_context(op.eqn):
        outs = C.bind_eqn(op.eqn, [_read(env, a) for a in op.invars])
    env.update((k, o) for k, o in zip(op.outvars, outs, strict=True) if _is_val(k))


def _run_region(plan: RegionPlan, k: int, env: dict) -> None:
    ops = plan.body.ops
    idxs = plan.regions[k]
    mine = [ops[i] for i in idxs]
    ins = _reads(mine)
    inside = set(idxs)
    later = {a for i, op in enumerate(ops) if i not in inside for a in op.invars if _is_val(a)}
    later |= {a for a in plan.body.out_atoms if _is_val(a)}
    outs = [v for v in _defined(mine) if v in later]
    if not outs:
        return

    def region(*vals):
        local = dict(zip(ins, vals, strict=True))
        for op in mine:
            _bind(op, local)
        return [local[v] for v in outs]

    I.named(region, f"{plan.names[k]}_on_stream{k + 1}".replace("/", "_"))
    results = on_stream(region, k + 1)(*[env[v] for v in ins])
    env.update(zip(outs, results, strict=True))


class StreamInterpreter(I.Interpreter):
    """Rebuilds the chosen scans with their body's regions on their own streams."""

    def __init__(
        self, select: Callable[[I.Site], bool], plan_for: Callable[[I.Site, C.ScanParams], RegionPlan]
    ):
        super().__init__(select, self._on_scan)
        self.plan_for = plan_for
        self.plans: list[tuple[str, RegionPlan]] = []

    def _on_scan(self, site, scan, invals, interp):
        plan = self.plan_for(site, scan)
        self.plans.append((site.path_str(), plan))
        consts = invals[: scan.num_consts]
        init = invals[scan.num_consts : scan.num_consts + scan.num_carry]
        xs = invals[scan.num_consts + scan.num_carry :]
        body = plan.body

        def step(carry, x):
            env: dict = dict(zip(body.const_keys, scan.body_consts, strict=True))
            env.update(zip(body.in_keys, [*consts, *carry, *x], strict=True))
            for item in plan.schedule():
                if isinstance(item, tuple):
                    _run_region(plan, item[1], env)
                else:
                    _bind(body.ops[item], env)
            outs = [_read(env, a) for a in body.out_atoms]
            return outs[: scan.num_carry], outs[scan.num_carry :]

        I.named(step, site.name)
        carry, ys = jax.lax.scan(
            step, list(init), list(xs), length=scan.length, reverse=scan.reverse, unroll=scan.unroll
        )
        return [*carry, *ys]


def _evaluate(closed: Any, out_shape: Any, labels: dict, flat: list, select, plan_for_labels) -> Any:
    """``closed`` evaluated by a :class:`StreamInterpreter` (its scans' body ``labels`` from
    :func:`scan_labels`), results in ``out_shape``'s structure."""
    jx, consts = C.open_and_consts(closed)
    interp = StreamInterpreter(
        select, lambda site, scan: plan_for_labels(site, scan, labels[site.address][1])
    )
    outs = interp.eval(jx, consts, flat)
    if not interp.plans:
        raise ValueError("stream_overlap: no loop of this function matches")
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _rewrite_with_labels(fn: Callable, select, plan_for_labels) -> Callable:
    """``fn`` traced at every call, its scans' body labels computed, then :func:`_evaluate`."""

    def rewritten(*args, **kwargs):
        closed, out_shape = I.trace(fn, *args, **kwargs)
        labels = scan_labels(closed, leaf_paths((args, kwargs)))
        return _evaluate(closed, out_shape, labels, jax.tree.leaves((args, kwargs)), select, plan_for_labels)

    rewritten.__name__ = getattr(fn, "__name__", "rewritten")
    rewritten.__wrapped__ = fn
    return rewritten


# ------------------------------------------------------------------------- where specs


def _matches(where: Any) -> Callable[[I.Site], bool]:
    from rose_jax.optimize import where as W  # noqa: PLC0415 - shared where-spec rules

    return W.site_select(where)


# ------------------------------------------------------------------------- stream_overlap


def stream_overlap(
    *names: str, mode: str = "components", where: Any = None, groups: Sequence[str] | None = None
) -> Transform:
    """Run independent parts of a loop body side by side, each on its own GPU stream.

    ``names`` (or ``groups``, as the plan cache stores them): what becomes a region.
    ``mode="components"``: component names (``rose_jax.component``) inside the body of the loop
    ``where`` (default: every scan whose body holds them all), e.g.
    ``stream_overlap("alpha_update", "critic_update", "actor_update")`` for SAC's gradient step.
    ``mode="state"``: names in the paths of the loop's carried state (``"policy"``, ``"value"``):
    each region is everything that computes that group's next state and nothing else needs.
    ``mode="loops"``: two where specs of sibling scans of equal length, zipped into one loop
    whose step runs one step of each, each on its own stream.

    Legal when no region reads what another computes within the step, no region holds a loop
    or side effect, and (state mode) no shared computation depends on a group's state; the
    refusal says what couples them. Reading another's *pre-step* state is no conflict: every
    region reads the step's inputs, and a region's writes become the next step's inputs.
    """
    if groups is not None:
        if names:
            raise ValueError("stream_overlap: give the region names positionally or as groups=, not both")
        names = tuple(groups)
    names = tuple(names)
    if mode not in MODES:
        raise ValueError(f"stream_overlap: mode must be one of {MODES}, got {mode!r}")
    if len(names) < 2 or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"stream_overlap: need at least two non-empty names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"stream_overlap: names must differ, got {names!r}")
    if mode == "loops":
        if len(names) != 2:
            raise ValueError(f"stream_overlap(mode='loops') zips exactly two loops, got {names!r}")
        return _zip_loops(names[0], names[1])
    select_where = _matches(where)

    def wanted(site: I.Site, scan: C.ScanParams, labels: Sequence[str | None]) -> bool:
        if not select_where(site):
            return False
        if mode == "components":
            found = component_region_indices(flatten_body(scan.body), names, site.component_path)
            return all(found[n] for n in names)
        slots = _group_slots(labels, scan, names)
        return all(slots[n] for n in names)

    def plan_for(site, scan, labels) -> RegionPlan:
        if mode == "components":
            body = flatten_body(scan.body)
            return plan_regions(body, component_region_indices(body, names, site.component_path))
        return state_plan(scan, labels, names)

    def legal(tree) -> tuple[bool, str]:
        labels = scan_labels(tree.jaxpr, list(tree.input_paths))
        hits = [(s, lab) for s, lab in labels.values() if wanted(s, C.scan_params(s.eqn.params), lab)]
        if not hits:
            what = "components" if mode == "components" else "carried state named"
            return (
                False,
                f"no loop{'' if where is None else f' at where={where!r}'} holds {what} {', '.join(names)}",
            )
        texts = []
        for site, lab in hits:
            scan = C.scan_params(site.eqn.params)
            try:
                plan = plan_for(site, scan, lab)
            except ValueError as e:
                return False, f"{site.path_str()}: {e}"
            texts.append(plan.describe(site.path_str()))
        return True, "; ".join(texts)

    def apply(fn):
        def run(*args, **kwargs):
            closed, out_shape = I.trace(fn, *args, **kwargs)
            labels = scan_labels(closed, leaf_paths((args, kwargs)))
            chosen = {
                addr for addr, (s, lab) in labels.items() if wanted(s, C.scan_params(s.eqn.params), lab)
            }
            if not chosen:
                return fn(*args, **kwargs)  # e.g. the collect half of a Program: nothing to do here
            flat = jax.tree.leaves((args, kwargs))
            return _evaluate(closed, out_shape, labels, flat, lambda s: s.address in chosen, plan_for)

        run.__name__ = getattr(fn, "__name__", "stream_overlap")
        run.__wrapped__ = fn
        return run

    loop = "every loop holding them" if where is None else f"loop {where!r}"
    on = ", ".join(f"{n} on stream {k + 1}" for k, n in enumerate(names))
    kind = "components" if mode == "components" else "the work producing the carried state of"
    return Transform(
        "stream_overlap",
        (("groups", names), ("mode", mode), ("where", where)),
        STREAM_TOLERANCE,
        "fn",
        legal,
        apply,
        summary=f"{kind} {', '.join(names)} overlapped in each step of {loop}: {on}",
    )


def _zip_loops(a: str, b: str) -> Transform:
    from rose_jax.optimize import fuse  # noqa: PLC0415 - fuse_scans does the zipping

    pick_a, pick_b = _matches(a), _matches(b)

    def find_pair(closed) -> tuple[I.Site, I.Site]:
        sites = I.sites(closed, kinds=(C.SCAN,))
        sa = [s for s in sites if pick_a(s)]
        sb = [s for s in sites if pick_b(s) and all(s is not x for x in sa[:1])]
        if not sa or not sb:
            raise ValueError(f"no pair of scans matches {a!r} and {b!r}")
        sa0 = sa[0]
        sb0 = next((s for s in sb if s.address[:-1] == sa0.address[:-1] and s.address != sa0.address), None)
        if sb0 is None:
            raise ValueError(f"{a!r} and {b!r} are not sibling loops (not in the same jaxpr)")
        return sa0, sb0

    def check(closed) -> tuple[I.Site, I.Site, str]:
        sa, sb = find_pair(closed)
        pa, pb = C.scan_params(sa.eqn.params), C.scan_params(sb.eqn.params)
        if pa.length != pb.length or pa.reverse != pb.reverse:
            raise ValueError(
                f"trip counts/directions differ ({pa.length}{' rev' if pa.reverse else ''} vs "
                f"{pb.length}{' rev' if pb.reverse else ''}): zipping needs equal lengths"
            )
        for p, n in ((pa, a), (pb, b)):
            flat = flatten_body(p.body)
            _check_contents(flat.ops, range(len(flat.ops)), f"the body of {n!r}")
        parent = _level_of(closed, sa.address[:-1])
        ia, ib = sorted((sa.address[-1][0], sb.address[-1][0]))
        needed = D.needed_eqns(parent.eqns, parent.eqns[ib].invars, ib, start=ia)
        if ia in needed:
            first, second = (a, b) if sa.address[-1][0] == ia else (b, a)
            raise ValueError(f"{second!r} reads what {first!r} computes: they are dependent")
        return (
            sa,
            sb,
            f"{sa.path_str()} on stream 1 and {sb.path_str()} on stream 2, zipped step by step "
            f"({pa.length} steps)",
        )

    def legal(tree):
        try:
            return True, check(tree.jaxpr)[2]
        except ValueError as e:
            return False, str(e)

    def apply(fn):
        fused = fuse.fuse_scans(fn, a, b)

        def run(*args, **kwargs):
            closed, _ = I.trace(fn, *args, **kwargs)
            sa, sb, _ = check(closed)
            pa, pb = C.scan_params(sa.eqn.params), C.scan_params(sb.eqn.params)
            if sa.address > sb.address:
                sa, sb, pa, pb = sb, sa, pb, pa
            name = f"{sa.name}+{sb.name}"
            n_carry = (pa.num_carry, pb.num_carry)
            n_xs = tuple(len(p.body.invars) - p.num_consts - p.num_carry for p in (pa, pb))
            n_ys_first = len(sa.eqn.outvars) - pa.num_carry

            def plan(site, scan, labels):
                return loop_pair_plan(scan.body, n_carry, n_xs, n_ys_first, (sa.path_str(), sb.path_str()))

            select = lambda s: s.name == name and s.primitive == C.SCAN  # noqa: E731
            return _rewrite_with_labels(fused, select, plan)(*args, **kwargs)

        run.__name__ = getattr(fn, "__name__", "zipped")
        run.__wrapped__ = fn
        return run

    return Transform(
        "stream_overlap",
        (("groups", (a, b)), ("mode", "loops"), ("where", None)),
        STREAM_TOLERANCE,
        "fn",
        legal,
        apply,
        summary=f"loops {a!r} and {b!r} zipped into one, each step of {a!r} on stream 1 and of {b!r} "
        "on stream 2",
    )


def _level_of(closed: Any, address: tuple) -> Any:
    """The jaxpr level at ``address`` (a Site address prefix)."""
    jx, _ = C.open_and_consts(closed)
    ctx = I.ROOT
    for eqn_index, sub in address:
        eqn = jx.eqns[eqn_index]
        subs = I.subs_with_ctx(ctx, eqn_index, eqn)
        jx, ctx = subs[sub]
    return jx


# ------------------------------------------------------------------------- split_compile


class Stage(NamedTuple):
    """One separately compiled piece: flat ``inputs`` (positions in the chain's value list) ->
    ``outputs`` (appended to it); ``fn`` evaluates its closed jaxpr."""

    name: str
    fn: Callable
    inputs: tuple[int, ...]
    n_outputs: int
    in_specs: tuple[jax.ShapeDtypeStruct, ...] = ()


@dataclasses.dataclass
class _Chain:
    stages: list[Stage]
    n_inputs: int
    result: list  # per flat output: ("value", index) or ("literal", value)
    out_tree: Any
    donatable: list[tuple[int, ...]]  # per stage: its input positions (into stage args) no later stage reads


def _stage_starts(eqns: Sequence[Any], boundaries: Sequence[str] | None) -> tuple[list[int], list[str]]:
    """First equation index of each stage and stage names (top-level components)."""
    tops = [cut.effective(e)[0][:1] for e in eqns]
    order: list[str] = []
    for t in tops:
        if t and t[0] not in order:
            order.append(t[0])
    if boundaries is None:  # before the second top-level component
        if len(order) < 2:
            raise ValueError(f"split_compile: the function has {len(order)} top-level component(s); need 2")
        boundaries = (order[1],)
    starts = []
    for b in boundaries:
        idx = [i for i, t in enumerate(tops) if t == (b,)]
        if not idx:
            raise ValueError(
                f"split_compile: {b!r} is not a top-level component of the function "
                f"(top level: {', '.join(order) or 'none'})"
            )
        starts.append(idx[0])
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        raise ValueError(f"split_compile: boundaries {tuple(boundaries)} are not in program order")
    if starts and starts[0] == 0:
        raise ValueError(f"split_compile: {boundaries[0]!r} starts the function: no stage before it")
    starts = [0] + starts
    names = []
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(eqns)
        comps = [t[0] for t in tops[s:end] if t]
        names.append("+".join(dict.fromkeys(comps)) or f"stage{k}")
    return starts, names


def build_chain(fn: Callable, args: Sequence[Any], boundaries: Sequence[str] | None) -> _Chain:
    """Cut ``fn``'s jaxpr on ``args`` into stages at ``boundaries`` (top-level component names;
    None: before the second top-level component)."""
    closed, out_shape = I.trace(fn, *args)
    jx, consts = C.open_and_consts(closed)
    const_of = dict(zip(jx.constvars, consts, strict=True))
    eqns, alias, inlined = cut.flatten_calls(jx.eqns, 1)
    const_of.update(inlined)
    outvars = [cut.resolve(v, alias) for v in jx.outvars]
    starts, names = _stage_starts(eqns, boundaries)
    pieces = [eqns[s : (starts[k + 1] if k + 1 < len(starts) else len(eqns))] for k, s in enumerate(starts)]
    live = D.liveness(pieces, outvars)
    position = {v: k for k, v in enumerate(jx.invars)}
    n = len(jx.invars)
    stages, reads_per_stage, stage_invars = [], [], []
    for name, piece, lv in zip(names, pieces, live, strict=True):
        reads, outs = lv if lv is not None else ([], [])
        ins = [v for v in reads if v not in const_of]
        cvars = [v for v in reads if v in const_of]
        missing = [v for v in ins if v not in position]
        if missing:
            raise ValueError(f"split_compile: stage {name!r} reads a value no earlier stage produces")
        closed_stage = C.make_closed(ins, outs, piece, cvars, [const_of[v] for v in cvars])
        specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (C.aval_of(v) for v in ins))
        stages.append(Stage(name, C.as_fun(closed_stage), tuple(position[v] for v in ins), len(outs), specs))
        reads_per_stage.append([position[v] for v in ins])
        stage_invars.append(ins)
        for v in outs:
            position[v] = n
            n += 1
    result = [("literal", v.val) if C.is_literal(v) else ("value", position[v]) for v in outvars]
    final = {p for kind, p in result if kind == "value"}
    donatable = []
    for k, reads in enumerate(reads_per_stage):
        later = {p for r in reads_per_stage[k + 1 :] for p in r} | final
        # only buffers an output of the same shape and dtype can reuse (XLA warns about others)
        free = collections.Counter(_sig(v) for v in (live[k][1] if live[k] is not None else []))
        mine = []
        for j, p in enumerate(reads):
            sig = _sig(stage_invars[k][j])
            if p not in later and free[sig] > 0:
                free[sig] -= 1
                mine.append(j)
        donatable.append(tuple(mine))
    return _Chain(stages, len(jx.invars), result, jax.tree.structure(out_shape), donatable)


def _sig(v: Any) -> tuple:
    aval = C.aval_of(v)
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", "")))


def _platform() -> str:
    return jax.default_backend()


def _device_set(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    return frozenset(sharding.device_set) if sharding is not None else None


def _on_default_device(args: Sequence[Any]) -> bool:
    """Every array on the default device (or uncommitted): what a loaded executable accepts."""
    default = jax.devices()[0]
    return all(_device_set(a) in (None, frozenset({default})) for a in args)


class ChainedStep(HostStep):
    """``state -> (state, metrics)`` as separately compiled stages chained on the device.

    Each call dispatches the stages one after the other; their values stay on the device and
    nothing waits for the host between them (JAX dispatch is asynchronous). Each stage is
    compiled with its own XLA options: named sets of :data:`OPTION_SETS`, or ``"measure"``:
    on the first call each stage is timed alone under every set (on a GPU each candidate's
    compile and first run go through :func:`rose_jax.optimize.isolate.check` first, so an XLA
    abort refuses that set instead of ending the process) and the fastest is kept. On a CPU
    every stage uses XLA's defaults. ``donate``: the stages donate the input buffers no later
    stage reads (like ``jax.jit(..., donate_argnums=0)`` for the whole step).
    """

    def __init__(
        self,
        fn: Callable,
        boundaries: Sequence[str] | None = None,
        options: str | Sequence[str] = "measure",
        *,
        donate: bool = False,
        repeats: int = 5,
        extra_options: dict | None = None,
        isolate: bool | None = None,
        cache_dir: str | None = None,
        option_sets: Sequence[str] | None = None,
    ):
        self.fn = fn
        self.boundaries = None if boundaries is None else tuple(boundaries)
        self.options = options if isinstance(options, str) else tuple(options)
        if isinstance(self.options, str) and self.options != "measure":
            raise ValueError(f"ChainedStep: options must be 'measure' or a tuple of {sorted(OPTION_SETS)}")
        if not isinstance(self.options, str):
            bad = [o for o in self.options if o not in OPTION_SETS]
            if bad:
                raise ValueError(f"ChainedStep: unknown option set(s) {bad}; known: {', '.join(OPTION_SETS)}")
        self.donate, self.repeats = donate, repeats
        self.extra_options = dict(extra_options or {})
        self.isolate, self.cache_dir = isolate, cache_dir
        self.option_sets = tuple(option_sets) if option_sets is not None else tuple(OPTION_SETS)
        unknown = [o for o in self.option_sets if o not in OPTION_SETS]
        if unknown or not self.option_sets:
            raise ValueError(
                f"ChainedStep: option_sets must name some of {', '.join(OPTION_SETS)}, got {option_sets!r}"
            )
        self.refusals: dict[str, str] = {}
        self._chain: _Chain | None = None
        self._compiled: list[Callable] | None = None
        self._key = None
        self.chosen: tuple[str, ...] | None = None
        self.timings: dict[str, dict[str, float | str]] = {}
        # "stage:set" executables built from the isolated child's exported program (a load from the
        # persistent cache when the child's compile was long enough to be cached there)
        self.from_children: list[str] = []

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, *args):
        flat = jax.tree.leaves(args)
        key = (  # placement too: an executable loaded from a child is fixed to its device
            jax.tree.structure(args),
            tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", "")), _device_set(x)) for x in flat),
        )
        if self._compiled is None or key != self._key:
            self._prepare(args, flat)
            self._key = key
        values = list(flat)
        for stage, run in zip(self._chain.stages, self._compiled, strict=True):
            values.extend(run(*[values[p] for p in stage.inputs]))
        outs = [values[p] if kind == "value" else p for kind, p in self._chain.result]
        return jax.tree.unflatten(self._chain.out_tree, outs)

    def with_compiler_options(self, compiler_options: dict | None) -> "ChainedStep":
        step = ChainedStep(
            self.fn,
            self.boundaries,
            self.chosen if self.chosen is not None else self.options,
            donate=self.donate,
            repeats=self.repeats,
            extra_options={**self.extra_options, **dict(compiler_options or {})},
            isolate=self.isolate,
            cache_dir=self.cache_dir,
            option_sets=self.option_sets,
        )
        return step

    def measured_params(self) -> dict:
        """``{"options": (set per stage, ...)}`` once ``"measure"`` has chosen them (first call)."""
        if isinstance(self.options, str) and self.chosen is not None:
            return {"options": tuple(self.chosen)}
        return {}

    def stats(self) -> dict:
        stages = [s.name for s in self._chain.stages] if self._chain else []
        return {
            "mode": "split_compile",
            "stages": stages,
            "options": list(self.chosen) if self.chosen else self.options,
            "timings_ms": self.timings,
            "refused": dict(self.refusals),
        }

    # -- preparation --------------------------------------------------------------------------
    def _jit(self, k: int, option: str, donate: bool) -> Callable:
        stage = self._chain.stages[k]
        opts = {**(OPTION_SETS[option] if _platform() == "gpu" else {}), **self.extra_options}
        donate_argnums = self._chain.donatable[k] if donate else ()
        return jax.jit(stage.fn, compiler_options=opts or None, donate_argnums=donate_argnums)

    def _prepare(self, args, flat) -> None:
        self._chain = build_chain(self.fn, args, self.boundaries)
        n = len(self._chain.stages)
        self.from_children = []
        measured = None
        if isinstance(self.options, str):
            self.chosen, measured = self._measure(flat)
        else:
            if len(self.options) != n:
                raise ValueError(f"ChainedStep: {len(self.options)} option set(s) for {n} stages")
            self.chosen = tuple(self.options)
        if measured is not None and not self.donate:  # the measured executables, not compiled again
            self._compiled = measured
        else:
            self._compiled = [self._jit(k, self.chosen[k], self.donate) for k in range(n)]

    def isolation_checks(self, stage_sets: Sequence[tuple[int, str]] | None = None, workers: int = 4) -> dict:
        """``(stage index, option set) -> isolate.Outcome`` of each stage's compile and first call in
        a child process (all at once, ``workers`` children at a time); built chain needed."""
        import concurrent.futures  # noqa: PLC0415
        from rose_jax.optimize import isolate as iso  # noqa: PLC0415 - child processes, loaded on use

        gpu = _platform() == "gpu"
        todo = stage_sets or [(k, n) for k in range(len(self._chain.stages)) for n in self.option_sets]

        def one(item):
            k, name = item
            stage = self._chain.stages[k]
            opts = {**(OPTION_SETS[name] if gpu else {}), **self.extra_options}
            return iso.check(
                stage.fn,
                stage.in_specs,
                compiler_options=opts,
                label=f"{stage.name}:{name}",
                cache_dir=self.cache_dir,
                share_cache=True,  # _measure loads the child's executable (isolate.compile_exported)
            )

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return dict(zip(todo, pool.map(one, todo), strict=True))

    def _measure(self, flat) -> tuple[tuple[str, ...], list[Callable]]:
        """Each stage timed under each option set: ``(chosen set per stage, its executables)``."""
        from rose_jax.optimize import isolate as iso  # noqa: PLC0415 - child processes, loaded on use

        gpu = _platform() == "gpu"
        sets = list(self.option_sets) if gpu else ["default"]
        use_child = gpu if self.isolate is None else self.isolate
        checks = (
            self.isolation_checks([(k, n) for k in range(len(self._chain.stages)) for n in sets])
            if use_child
            else {}
        )
        values = list(flat)
        chosen, runs = [], []
        for k, stage in enumerate(self._chain.stages):
            stage_args = [values[p] for p in stage.inputs]
            best, best_t, best_run, times = None, float("inf"), None, {}
            for name in sets:
                outcome = checks.get((k, name))
                if outcome is not None and not outcome.ok:
                    times[name] = f"refused: {outcome.reason}"
                    self.refusals[f"{stage.name}:{name}"] = outcome.reason
                    continue
                # the child's executable from the shared persistent cache when there is one (the
                # same program: compiling it here again cost as much as the child's compile)
                run = None
                if outcome is not None and _on_default_device(stage_args):
                    opts = {**(OPTION_SETS[name] if gpu else {}), **self.extra_options}
                    try:
                        run = iso.compile_exported(outcome, stage.in_specs, opts)
                    except Exception:  # noqa: BLE001 - an optimisation only: compile it here instead
                        run = None
                    if run is not None:
                        self.from_children.append(f"{stage.name}:{name}")
                run = run or self._jit(k, name, donate=False)
                jax.block_until_ready(run(*stage_args))
                ts = []
                for _ in range(max(1, self.repeats)):
                    t0 = time.perf_counter()
                    jax.block_until_ready(run(*stage_args))
                    ts.append(time.perf_counter() - t0)
                t = statistics.median(ts)
                times[name] = round(t * 1e3, 4)
                if t < best_t:
                    best, best_t, best_run = name, t, run
            if best is None:
                raise ValueError(
                    f"split_compile: every option set was refused for stage {stage.name!r}: {times}"
                )
            chosen.append(best)
            runs.append(best_run)
            self.timings[stage.name] = times
            values.extend(best_run(*stage_args))
        return tuple(chosen), runs


def split_compile(
    boundaries: Sequence[str] | None = None,
    options: str | Sequence[str] = "measure",
    donate: bool = False,
    option_sets: Sequence[str] | None = None,
) -> Transform:
    """Transform: the iteration as separately compiled stages chained on the device.

    ``boundaries``: top-level component names where a new stage starts (None: before the
    second top-level component, e.g. PPO's rollout | normalizer + advantage + update, SAC's
    collect | train_steps). ``options``: ``"measure"`` (each stage's fastest of
    :data:`OPTION_SETS`, measured on the first call) or one option-set name per stage.
    ``boundaries=()``: one stage (the whole iteration with its measured options).
    ``option_sets``: the sets ``"measure"`` tries (default: all of :data:`OPTION_SETS`).
    Legal when the boundaries are top-level components (not inside a loop or a jit).
    """
    bounds = None if boundaries is None else tuple(boundaries)
    opts = options if isinstance(options, str) else tuple(options)
    sets = None if option_sets is None else tuple(option_sets)

    def legal(tree) -> tuple[bool, str]:
        jx, _ = C.open_and_consts(tree.jaxpr)
        eqns, _, _ = cut.flatten_calls(jx.eqns, 1)
        try:
            _, names = _stage_starts(eqns, bounds)
        except ValueError as e:
            return False, str(e)
        how = "measured per stage" if opts == "measure" else ", ".join(opts)
        if len(names) == 1:
            return True, f"the whole iteration ({names[0]}) as one program with its own XLA options ({how})"
        return (
            True,
            f"stages {' | '.join(names)} compiled separately (XLA options: {how}), chained on the device",
        )

    def apply(target):
        if isinstance(target, Program):
            if target.host:
                raise ValueError("split_compile: the program's collect already runs in worker processes")
            target = target.iteration()
        if isinstance(target, HostStep):
            raise ValueError("split_compile: the step is already host-level")
        return ChainedStep(target, bounds, opts, donate=donate, option_sets=sets)

    where = "the second top-level component" if bounds is None else ", ".join(bounds) or "nothing (one stage)"
    return Transform(
        "split_compile",
        (("boundaries", bounds), ("options", opts), ("donate", donate), ("option_sets", sets)),
        SPLIT_TOLERANCE,
        "host",
        legal,
        apply,
        summary=f"the iteration split before {where} into separately compiled programs chained on the "
        f"device, XLA options {'measured per stage' if opts == 'measure' else opts}",
    )


# ------------------------------------------------------------------------- candidates


def _body_components(site: I.Site) -> list[str]:
    body = flatten_body(C.scan_params(site.eqn.params).body)
    order: list[str] = []
    for op in body.ops:
        rel = _relative_components(op.eqn, site.component_path)
        if rel and rel[0] not in order:
            order.append(rel[0])
    return order


def _independent_sets(site: I.Site, comps: list[str]) -> list[tuple[str, ...]]:
    """Greedy maximal set of pairwise-independent components, and its two largest members."""
    body = flatten_body(C.scan_params(site.eqn.params).body)
    idx = component_region_indices(body, comps, site.component_path)
    chosen: list[str] = []
    for c in comps:
        try:
            _check_contents(body.ops, idx[c], c)
            if chosen:
                plan_regions(body, {n: idx[n] for n in chosen + [c]})
        except ValueError:
            continue
        chosen.append(c)
    out = []
    if len(chosen) >= 2:
        out.append(tuple(chosen))
    if len(chosen) > 2:
        big = sorted(chosen, key=lambda c: -cut.count_eqns([body.ops[i].eqn for i in idx[c]]))[:2]
        out.append(tuple(c for c in chosen if c in big))
    return out


def _state_groups(labels: Sequence[str | None], scan: C.ScanParams) -> tuple[str, ...] | None:
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


def _worth_state_regions(scan: C.ScanParams, labels: Sequence[str | None], groups: Sequence[str]) -> bool:
    """A state grouping is a candidate when its regions hold at least half the body's work (a
    coupled grouping stays a candidate: the search logs why it is refused)."""
    try:
        plan = state_plan(scan, labels, groups)
    except ValueError:
        return True
    return sum(len(r) for r in plan.regions) >= 0.5 * max(len(plan.body.ops), 1)


def candidates(tree: Any, program: Any = None, windows: Sequence[Any] | None = None) -> list[Transform]:
    """Stream-overlap and split-compile candidates for the program traced as ``tree``.

    * every scan whose body holds >= 2 pairwise-independent components: the largest such set
      (and its two largest members) as ``stream_overlap(..., mode="components")``;
    * every scan whose carried state splits into sibling groups (e.g. ``policy``/``value``):
      ``stream_overlap(..., mode="state")`` (legality may refuse it, naming the coupling);
    * sibling scans of equal length with loop-free bodies: ``stream_overlap(a, b, mode="loops")``;
    * ``split_compile(())``: the whole iteration as one stage with its measured XLA options
      (first: the largest gain measured on the H200), and with >= 2 top-level components
      ``split_compile()`` (options measured per stage).

    ``windows`` (``rose_jax.profile`` windows: ``path``, ``idle_sm_seconds_per_iteration``)
    order the loop candidates, most idle SM-seconds first. ``program`` is accepted for the
    search's signature; a Program's iteration is what ``tree`` traces.
    """
    del program
    labels = scan_labels(tree.jaxpr, list(tree.input_paths))
    idle = collections.defaultdict(float)
    for w in windows or ():
        path = w.path if isinstance(w.path, str) else "/".join(w.path)
        idle[path] += float(getattr(w, "idle_sm_seconds_per_iteration", 0.0))

    def score(site: I.Site) -> float:
        parts = set(site.component_path) | {site.name}
        return sum(v for p, v in idle.items() if parts & set(p.split("/")))

    scored: list[tuple[float, Transform]] = []
    seen: set = set()
    for site, lab in labels.values():
        scan = C.scan_params(site.eqn.params)
        where = site.path_str()
        for group in _independent_sets(site, _body_components(site)):
            key = ("components", group, where)
            if key not in seen:
                seen.add(key)
                scored.append((score(site), stream_overlap(*group, mode="components", where=where)))
        groups = None if cut.contains_loop(scan.body.eqns) else _state_groups(lab, scan)
        if groups and ("state", groups, where) not in seen and _worth_state_regions(scan, lab, groups):
            seen.add(("state", groups, where))
            scored.append((score(site), stream_overlap(*groups, mode="state", where=where)))
    by_parent: dict[tuple, list[I.Site]] = collections.defaultdict(list)
    for site, _ in labels.values():
        by_parent[site.address[:-1]].append(site)
    for sites in by_parent.values():
        for i, sa in enumerate(sites):
            for sb in sites[i + 1 :]:
                pa, pb = C.scan_params(sa.eqn.params), C.scan_params(sb.eqn.params)
                if pa.length != pb.length or pa.length < 2 or sa.path_str() == sb.path_str():
                    continue
                if cut.contains_loop(pa.body.eqns) or cut.contains_loop(pb.body.eqns):
                    continue
                scored.append(
                    (score(sa) + score(sb), stream_overlap(sa.path_str(), sb.path_str(), mode="loops"))
                )
    scored.sort(key=lambda st: -st[0])
    # the whole iteration with its measured XLA options first: on the H200 CONCURRENT command
    # buffers alone gave SAC ant (high-update) 1.48x and PPO ant 4096 1.31x, bitwise equal
    out = [split_compile(())]
    tops = [n for n in tree.root.children if n.kind == "component"]
    if len({n.name for n in tops}) >= 2:
        out.append(split_compile())
    return out + [t for _, t in scored]
