"""Candidate transformations for a traced iteration, each with a predicted gain and its model.

For every low-activity window (without windows: every scan of the LoopTree, most expensive
first): unrolling and hoisting per scan, fusion of equal-length sibling scans, offloading a
metrics-only top-level component, env-group rollouts of a Program, independent work of a loop
body on its own GPU streams and per-component compilation (:func:`rose_jax.optimize.streams.candidates`),
and while loops with a static bound run as bounded masked scans
(:func:`rose_jax.optimize.loops.loop_candidates`). Predictions are models (stated in each
candidate), not measurements: the search measures every candidate it keeps. A generated
candidate may be illegal (e.g. two stream regions coupled by a global-norm clip, a while loop
without a bound): the search refuses it with the reason in the report.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rose_jax.jaxpr import compat as C
from rose_jax.optimize import loops, streams
from rose_jax.optimize.base import Transform
from rose_jax.optimize.fuse import overlap_independent
from rose_jax.optimize.group_rollout import group_rollout
from rose_jax.optimize.offload import offload_component
from rose_jax.optimize.scans import hoist_invariants, invariant_eqns, unroll_scans
from rose_jax.optimize.where import tree_loops
from rose_jax.program import Program

# Per-iteration cost of a compiled loop (s) used to predict unrolling gains: on GPU a while loop
# copies its predicate to the host every iteration (~10 us with the launch gaps around it);
# on CPU it is a branch and a few buffer assignments. A model, not a measurement.
LOOP_OVERHEAD_S = {"gpu": 10e-6, "cpu": 1e-6}
# Largest while-loop bound the search turns into a masked scan (bound_while_loops' own default,
# loops.MAX_BOUND, is wider for direct use). A masked scan runs its body ``bound`` times where a
# loop with a tolerance exit may stop after a few: on the H200 (benchmarks/results/loops/,
# 2026-12-04) the MJX swimmer's solver loop (bound 100, MuJoCo's default iterations) ran 0.036x as
# a masked scan and took ~80 s per variant to compile and time, while bound 4 (hopper, walker2d,
# halfcheetah) ran 1.01-1.05x and bound 8 (humanoidstandup) 0.96x. Above this bound the candidate
# is refused with the reason, without compiling it.
SEARCH_MAX_BOUND = 16
# Assumed idle SM share of a phase when no profiler window says otherwise.
ASSUMED_IDLE_SHARE = 0.5
# top-level components that produce only metrics by convention (candidates for offload_component)
OFFLOAD_COMPONENTS = ("evaluate",)
# Share of the iteration that separately compiled stages with their own XLA options save: on the
# H200 (benchmarks/results/overlap/, 2026-12-04) PPO ant's iteration ran 1.16-1.20x faster split
# (14-17% saved; the learn 25.9 -> 13.5 ms under CONCURRENT command buffers) and SAC's whole
# iteration 1.45-1.6x faster under its measured option set (31-37%); the lower figure is the model.
# On a CPU every stage is compiled with XLA's defaults (nothing to gain but the split itself).
SPLIT_COMPILE_SHARE = {"gpu": 0.15, "cpu": 0.0}


def where_of(node) -> str:
    """A LoopTree node as a where spec: its component path and name, ``"rollout/step"``."""
    return "/".join(tuple(node.component_path) + (node.name,))


def outer_trips(tree, node) -> int:
    """How often ``node`` runs per iteration because of the loops around it."""
    trips = 1
    for anc in tree.ancestors(node):
        if anc.is_loop and anc.trip_count:
            trips *= anc.trip_count
    return trips


def time_share(tree, node) -> float:
    """A node's share of the iteration's work (flops + bytes/4, a crude roofline-free weight)."""

    def w(n):
        return float(n.cost.flops) + float(n.cost.bytes) / 4.0

    total = w(tree.root)
    return 0.0 if total <= 0 else min(1.0, w(node) * outer_trips(tree, node) / total)


@dataclasses.dataclass
class Candidate:
    """A transformation to try, the window it targets and its predicted gain (s/iter) with the model."""

    transform: Transform
    window: str
    predicted: float | None
    model: str


def _windows_by_path(windows) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in windows or ():
        path = w.path if isinstance(w.path, str) else "/".join(w.path)
        out[path] = out.get(path, 0.0) + float(w.idle_sm_seconds_per_iteration)
    return out


def _idle_for(node, windows: dict[str, float]) -> float | None:
    """Idle SM-seconds per iteration of the windows that lie in ``node`` (None: no window)."""
    comps = set(node.component_path) | {node.name}
    found = [v for path, v in windows.items() if set(path.split("/")) & comps]
    return sum(found) if found else None


def generate_candidates(
    tree: Any,
    program: Program | None,
    baseline_s: float,
    windows=None,
    platform: str = "cpu",
    unroll_factors: Sequence[int] = (2, 4, 8),
    group_sizes: Sequence[int] = (2, 4),
    group_modes: Sequence[str] = ("interleaved", "processes"),
) -> list[Candidate]:
    """Candidates for the windows (or, without windows, every scan by cost), with predicted gains.

    Prediction models (seconds per iteration, stated in each record): unrolling saves
    ``trips * (1 - 1/f) * LOOP_OVERHEAD_S``; hoisting saves the invariant share of the loop's
    time; env groups in processes reclaim ``(1 - 1/G)`` of the rollout window's idle SM-seconds
    (interleaving in one process: a tenth of that, one stream only changes scheduling).
    """
    by_path = _windows_by_path(windows)
    overhead = LOOP_OVERHEAD_S.get(platform, LOOP_OVERHEAD_S["gpu"])
    scans = [n for n in tree.walk() if n.kind == "scan" and (n.trip_count or 0) >= 2]
    if by_path:
        scans = [n for n in scans if _idle_for(n, by_path) is not None] or scans
    scans.sort(key=lambda n: -time_share(tree, n))
    out: list[Candidate] = []
    seen: set[str] = set()
    for node in scans:
        where = where_of(node)
        if where in seen:
            continue
        seen.add(where)
        trips = node.trip_count * outer_trips(tree, node)
        for f in unroll_factors:
            if f >= 2 and f <= node.trip_count:
                gain = trips * (1.0 - 1.0 / f) * overhead
                out.append(
                    Candidate(
                        unroll_scans(f, where),
                        where,
                        gain,
                        f"{trips} loop iterations x (1-1/{f}) x {overhead * 1e6:.0f}us loop overhead",
                    )
                )
        eqns = node.eqns()
        if len(eqns) == 1 and eqns[0].primitive.name == "scan":
            scan = C.scan_params(eqns[0].params)
            n_inv = len(invariant_eqns(scan))
            if n_inv:
                share = n_inv / max(len(scan.body.eqns), 1)
                gain = baseline_s * time_share(tree, node) * share * (1.0 - 1.0 / node.trip_count)
                out.append(
                    Candidate(
                        hoist_invariants(where),
                        where,
                        gain,
                        f"{n_inv}/{len(scan.body.eqns)} body equations invariant x loop time",
                    )
                )
    # scans of equal length at the same jaxpr level (legality then checks independence): fuse
    by_level: dict[int, list] = {}
    for n in tree.walk():
        if n.kind == "scan" and n.level is not None and (n.trip_count or 0) >= 2:
            by_level.setdefault(id(n.level), []).append(n)
    for kids in by_level.values():
        for i, a in enumerate(kids):
            for b in kids[i + 1 :]:
                if a.trip_count == b.trip_count and where_of(a) != where_of(b):
                    gain = a.trip_count * outer_trips(tree, a) * overhead
                    label = f"{where_of(a)}+{where_of(b)}"
                    fuse = overlap_independent(where_of(a), where_of(b))
                    out.append(Candidate(fuse, label, gain, "one loop's overhead per iteration"))
    # components whose results reach only the metrics (e.g. an evaluation): run them in a worker
    # behind the next call; the whole component's time is the predicted gain (it leaves the path)
    for node in tree.root.children:
        if node.kind == "component" and node.name in OFFLOAD_COMPONENTS:
            share = time_share(tree, node)
            out.append(
                Candidate(
                    offload_component(node.name),
                    node.name,
                    baseline_s * share,
                    f"{node.name}'s share of the work ({share:.0%}) leaves the critical path",
                )
            )
    if program is not None and program.groups == 1:
        rollout = [n for n in tree.walk() if n.kind == "component" and n.name in ("rollout", "collect")]
        if rollout:
            node = rollout[0]
            idle = _idle_for(node, by_path)
            rollout_s = baseline_s * time_share(tree, node)
            assumed = idle is None
            idle = rollout_s * ASSUMED_IDLE_SHARE if idle is None else idle
            src = f"assumed {ASSUMED_IDLE_SHARE:.0%} idle SMs" if assumed else "profiled idle SM-seconds"
            for g in group_sizes:
                if program.num_envs % g:
                    continue
                for mode in group_modes:
                    factor = (1.0 - 1.0 / g) * (1.0 if mode == "processes" else 0.1)
                    out.append(
                        Candidate(
                            group_rollout(g, mode),
                            node.name,
                            idle * factor,
                            f"{src} of {node.name} x {factor:.2f}",
                        )
                    )
    out.extend(stream_candidates(tree, baseline_s, by_path, windows, platform))
    out.extend(bounded_loop_candidates(tree, baseline_s, by_path, platform))
    out.sort(key=lambda c: -(c.predicted or 0.0))
    return out


def _loop_time(tree, where, baseline_s: float, by_path: dict[str, float], kind: str = "scan"):
    """``(seconds per iteration, idle SM-seconds or None)`` of the loops matching ``where``."""
    nodes = tree_loops(tree, where, kind)
    ids = {id(n) for n in nodes}
    share = sum(time_share(tree, n) for n in nodes if not any(id(a) in ids for a in tree.ancestors(n)))
    idle = [v for v in (_idle_for(n, by_path) for n in nodes) if v is not None]
    return baseline_s * min(share, 1.0), (max(idle) if idle else None)


def stream_candidates(
    tree, baseline_s: float, by_path: dict[str, float], windows, platform: str
) -> list[Candidate]:
    """:func:`rose_jax.optimize.streams.candidates` with predicted gains.

    Models: regions of a loop body on ``n`` streams hide ``(1 - 1/n)`` of the loop's idle
    SM-seconds (profiled, else :data:`ASSUMED_IDLE_SHARE` of its time); two zipped loops hide the
    shorter one. Separately compiled stages save :data:`SPLIT_COMPILE_SHARE` of the iteration. On
    a CPU stream annotations are inert: predicted 0 (the search still measures and checks them).
    """
    inert = platform == "cpu"
    out: list[Candidate] = []
    for t in streams.candidates(tree, None, windows):
        p = dict(t.params)
        if t.name == "split_compile":
            share = SPLIT_COMPILE_SHARE.get(platform, SPLIT_COMPILE_SHARE["gpu"])
            stages = "one stage" if p["boundaries"] == () else "stages at top-level components"
            out.append(
                Candidate(
                    t,
                    "iteration",
                    baseline_s * share,
                    f"{stages} with measured XLA options save {share:.0%} of the iteration (H200 model)",
                )
            )
            continue
        groups = tuple(p["groups"])
        if p["mode"] == "loops":
            times = [_loop_time(tree, g, baseline_s, by_path) for g in groups]
            idle = [i for _, i in times if i is not None]
            hidden = min(s for s, _ in times) if not idle else min(idle)
            window = "+".join(groups)
            src = "profiled" if idle else "LoopTree cost"
            model = f"the shorter of two zipped loops hides behind the other ({src})"
        else:
            loop_s, idle = _loop_time(tree, p["where"], baseline_s, by_path)
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
        out.append(Candidate(t, window, hidden, model))
    return out


def bounded_loop_candidates(
    tree, baseline_s: float, by_path: dict[str, float], platform: str
) -> list[Candidate]:
    """:func:`rose_jax.optimize.loops.loop_candidates` (while loops with a static bound as masked
    scans) with predicted gains; where the tree holds while loops but none has a bound (or every
    bound exceeds :data:`SEARCH_MAX_BOUND`), the ``"where"`` variant is still returned, so the search
    logs why it is refused.

    Model: each iteration of a while loop on a GPU waits for its predicate on the host
    (:data:`LOOP_OVERHEAD_S`); a masked scan of ``bound`` steps saves that wait per iteration run
    (at most ``bound`` per execution, times the loops around it).
    """
    whiles = [n for n in tree.walk() if n.kind == "while"]
    if not whiles:
        return []
    made = loops.loop_candidates(tree, max_bound=SEARCH_MAX_BOUND) or [
        loops.bound_while_loops("where", max_bound=SEARCH_MAX_BOUND)
    ]
    overhead = LOOP_OVERHEAD_S.get(platform, LOOP_OVERHEAD_S["gpu"])
    trips = sum((n.bound or n.trip_count or 0) * outer_trips(tree, n) for n in whiles)
    by_idle = [v for v in (_idle_for(n, by_path) for n in whiles) if v is not None]
    window = "/".join(sorted({where_of(n) for n in whiles}))
    out = []
    for t in made:
        gain = trips * overhead
        model = f"{trips} while-loop iterations x {overhead * 1e6:.0f}us host round trip"
        if by_idle:
            gain, model = min(gain, sum(by_idle)), f"{model}, at most the profiled idle SM-seconds"
        out.append(Candidate(t, window, gain, model))
    return out
