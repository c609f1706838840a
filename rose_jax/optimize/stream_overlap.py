"""Independent work of one loop body on its own GPU streams: :func:`stream_overlap`.

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
here never hold a loop (two loops are zipped step by step instead, :func:`check_region`); a
region holding MJX physics made XLA abort the process, which is why every GPU compile of a
candidate is first tried in a child process (:mod:`rose_jax.optimize.isolate`).

JAX commits the outputs of any program holding a ``compute_on`` (``pxla`` counts its memory
spaces as transfers), so a jitted stream program fed its own output compiles a second time
unless its first inputs were committed too (``jax.device_put(state, device)``).

:func:`stream_overlap` (``level="fn"``): regions of one loop body, each on its own stream:
``mode="components"``: named ``rose_jax.component`` scopes (SAC's ``alpha_update``,
``critic_update``, ``actor_update``); ``mode="state"``: the work that produces each group of
carried state (PPO's ``policy`` and ``value`` parameters and their optimizer moments);
``mode="loops"``: two independent sibling loops zipped into one
(:func:`rose_jax.optimize.fusion.fuse_scans`), each step of each on its own stream. The regions
are planned on the flattened loop body (:mod:`rose_jax.jaxpr.regions`); legality from dataflow
and read/write sets, and a refusal names what couples the regions (e.g. "optax
clip_by_global_norm ... a global norm over both gradient trees"). :func:`candidates` generates
the family for the search.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax

from rose_jax.jaxpr import compat as C
from rose_jax.jaxpr import cut
from rose_jax.jaxpr import dataflow as D
from rose_jax.jaxpr.regions import (
    Op,
    RegionPlan,
    component_region_indices,
    defined,
    flatten_body,
    group_slots,
    is_value,
    loop_pair_plan,
    plan_regions,
    read_atom,
    reads,
    relative_components,
    state_groups,
    state_plan,
)
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import FUSION_TOLERANCE, REASSOCIATION_TOLERANCE, Transform
from rose_jax.optimize.fusion import fuse_scans
from rose_jax.optimize.predict import ASSUMED_IDLE_SHARE, Candidate, CandidateContext, loop_time
from rose_jax.optimize.where import site_select
from rose_jax.optimize.xla_options import schedules_concurrently

MODES = ("components", "state", "loops")

# What regions on their own streams hide when the baseline already runs under an option set that
# schedules command buffers CONCURRENT (``xla_options.schedules_concurrently``): XLA's graphs then
# run the regions' independent kernels side by side themselves, and the streams add their
# synchronisation. Measured over the same option set alone (H200): SAC ant's and hopper's three
# updates 0.75x and 0.81x (2026-12-04, benchmarks/results/overlap/); SAC ant's three updates 0.727x
# and critic/actor 0.806x (2026-12-07, the search of
# benchmarks/results/beyond_flags/plans/sac-ant-5ep-h200-2317.json); PPO ant's policy/value 0.95x at
# 2,048 envs and 1.05x at 4,096, not equal (overlap/). So the model predicts nothing there and the
# search measures these candidates last (they stay in the list: a workload may still gain).
CONCURRENT_STREAM_SHARE = 0.0

# Each region is compiled as its own (non-inlined) call: XLA cannot fuse across its boundary,
# so an a*b+c split by it is not contracted into an FMA on a GPU; last-bit differences, which
# RL training amplifies over iterations. The operations and their order are unchanged: the
# fusion tolerance (rtol 1e-4) with the reason of each transformation.
STREAM_TOLERANCE = dataclasses.replace(
    FUSION_TOLERANCE,
    reason="the same operations in the same order, but each region is a separate (non-inlined) call: "
    "XLA cannot fuse across its boundary (FMA contraction may differ in the last bit on a GPU)",
)


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


# ---------------------------------------------------------------------------- regions


def check_region(ops: Sequence[Op], idxs: Sequence[int], name: str) -> None:
    """What XLA compiles as a stream region (the ``check`` of :func:`rose_jax.jaxpr.regions.plan_regions`):
    ``ValueError`` with the reason when the ops at ``idxs`` hold a loop, a side effect or a
    ``compute_on`` region already."""
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


# ------------------------------------------------------------------------- carry labels


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


# ------------------------------------------------------------------------- the rewrite


def _bind(op: Op, env: dict) -> None:
    with I.scopes_of(op.eqn), C.eqn_context(op.eqn):
        outs = C.bind_eqn(op.eqn, [read_atom(env, a) for a in op.invars])
    env.update((k, o) for k, o in zip(op.outvars, outs, strict=True) if is_value(k))


def _run_region(plan: RegionPlan, k: int, env: dict) -> None:
    ops = plan.body.ops
    idxs = plan.regions[k]
    mine = [ops[i] for i in idxs]
    ins = reads(mine)
    inside = set(idxs)
    later = {a for i, op in enumerate(ops) if i not in inside for a in op.invars if is_value(a)}
    later |= {a for a in plan.body.out_atoms if is_value(a)}
    outs = [v for v in defined(mine) if v in later]
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
            outs = [read_atom(env, a) for a in body.out_atoms]
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


# ------------------------------------------------------------------------- stream_overlap


def stream_overlap(
    *names: str,
    mode: str = "components",
    where: Any = None,
    groups: Sequence[str] | None = None,
    reassociate: bool = False,
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

    ``reassociate=True``: kept under :data:`~rose_jax.optimize.base.REASSOCIATION_TOLERANCE`
    (rtol 1e-2) instead of the fusion tolerance, and then only if a learning check passes
    (issue 32: PPO's policy/value regions were 1.24x faster on the H200 but 2.2e-3 apart after
    one iteration).
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
    select_where = site_select(where)

    def wanted(site: I.Site, scan: C.ScanParams, labels: Sequence[str | None]) -> bool:
        if not select_where(site):
            return False
        if mode == "components":
            found = component_region_indices(flatten_body(scan.body), names, site.component_path)
            return all(found[n] for n in names)
        slots = group_slots(labels, scan, names)
        return all(slots[n] for n in names)

    def plan_for(site, scan, labels) -> RegionPlan:
        if mode == "components":
            body = flatten_body(scan.body)
            return plan_regions(
                body, component_region_indices(body, names, site.component_path), check=check_region
            )
        return state_plan(scan, labels, names, check_region)

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
    params = (("groups", names), ("mode", mode), ("where", where))
    return Transform(
        "stream_overlap",
        params + ((("reassociate", True),) if reassociate else ()),
        REASSOCIATION_TOLERANCE if reassociate else STREAM_TOLERANCE,
        "fn",
        legal,
        apply,
        summary=f"{kind} {', '.join(names)} overlapped in each step of {loop}: {on}",
    )


def _zip_loops(a: str, b: str) -> Transform:
    pick_a, pick_b = site_select(a), site_select(b)

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
            check_region(flat.ops, range(len(flat.ops)), f"the body of {n!r}")
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
        fused = fuse_scans(fn, a, b)

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
                names = (sa.path_str(), sb.path_str())
                return loop_pair_plan(scan.body, n_carry, n_xs, n_ys_first, names, check_region)

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


# ------------------------------------------------------------------------- candidates


def _body_components(site: I.Site) -> list[str]:
    body = flatten_body(C.scan_params(site.eqn.params).body)
    order: list[str] = []
    for op in body.ops:
        rel = relative_components(op.eqn, site.component_path)
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
            check_region(body.ops, idx[c], c)
            if chosen:
                plan_regions(body, {n: idx[n] for n in chosen + [c]}, check=check_region)
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


def _worth_state_regions(scan: C.ScanParams, labels: Sequence[str | None], groups: Sequence[str]) -> bool:
    """A state grouping is a candidate when its regions hold at least half the body's work (a
    coupled grouping stays a candidate: the search logs why it is refused)."""
    try:
        plan = state_plan(scan, labels, groups, check_region)
    except ValueError:
        return True
    return sum(len(r) for r in plan.regions) >= 0.5 * max(len(plan.body.ops), 1)


def transforms(tree: Any, windows: Sequence[Any] | None = None) -> list[Transform]:
    """Stream-overlap candidates for the program traced as ``tree``.

    * every scan whose body holds >= 2 pairwise-independent components: the largest such set
      (and its two largest members) as ``stream_overlap(..., mode="components")``;
    * every scan whose carried state splits into sibling groups (e.g. ``policy``/``value``):
      ``stream_overlap(..., mode="state")`` (legality may refuse it, naming the coupling);
    * sibling scans of equal length with loop-free bodies: ``stream_overlap(a, b, mode="loops")``.

    ``windows`` (``rose_jax.profile`` windows: ``path``, ``idle_sm_seconds_per_iteration``)
    order them, most idle SM-seconds first.
    """
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
        groups = None if cut.contains_loop(scan.body.eqns) else state_groups(lab, scan)
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
    return [t for _, t in scored]


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """:func:`transforms` with predicted gains; on a GPU each also with ``reassociate=True`` (kept
    under the looser tolerance only with a learning check).

    Models: regions of a loop body on ``n`` streams hide ``(1 - 1/n)`` of the loop's idle
    SM-seconds (profiled, else :data:`~rose_jax.optimize.predict.ASSUMED_IDLE_SHARE` of its time);
    two zipped loops hide the shorter one. Under a base option set that schedules command buffers
    concurrently (``ctx.base_options``), that gain x :data:`CONCURRENT_STREAM_SHARE` (0: XLA
    already overlaps the regions). On a CPU stream annotations are inert: predicted 0 (the search
    still measures and checks them).
    """
    tree, baseline_s, by_path = ctx.tree, ctx.baseline_s, ctx.by_path
    inert = ctx.platform == "cpu"
    concurrent = schedules_concurrently(ctx.base_options)
    out: list[Candidate] = []
    for t in transforms(tree, ctx.windows):
        p = dict(t.params)
        groups = tuple(p["groups"])
        if p["mode"] == "loops":
            times = [loop_time(tree, g, baseline_s, by_path) for g in groups]
            idle = [i for _, i in times if i is not None]
            hidden = min(s for s, _ in times) if not idle else min(idle)
            window = "+".join(groups)
            src = "profiled" if idle else "LoopTree cost"
            model = f"the shorter of two zipped loops hides behind the other ({src})"
        else:
            loop_s, idle = loop_time(tree, p["where"], baseline_s, by_path)
            src = (
                "profiled idle SM-seconds"
                if idle is not None
                else f"assumed {ASSUMED_IDLE_SHARE:.0%} idle SMs"
            )
            idle = loop_s * ASSUMED_IDLE_SHARE if idle is None else idle
            hidden = idle * (1.0 - 1.0 / len(groups))
            window = p["where"] or "every loop"
            model = f"{src} of {window} x (1-1/{len(groups)}) regions on their own streams"
        if inert:
            hidden, model = 0.0, f"{model}; 0 on a CPU (stream annotations are inert)"
        elif concurrent:
            hidden *= CONCURRENT_STREAM_SHARE
            model = (f"{model}; x{CONCURRENT_STREAM_SHARE:g} under {ctx.base_options} (XLA's concurrent "
                     "command buffers already overlap the regions: 0.73-0.81x on SAC, 0.95-1.05x on PPO)")
        out.append(Candidate(t, window, hidden, model))
        if not inert:  # the same regions under the reassociation tolerance + a learning check
            loose = stream_overlap(groups=groups, mode=p["mode"], where=p["where"], reassociate=True)
            out.append(Candidate(loose, window, hidden, f"{model}; reassociation tolerance + learning check"))
    return out
