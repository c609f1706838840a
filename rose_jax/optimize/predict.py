"""What every family's candidate generator shares: :class:`Candidate`, :class:`CandidateContext`
and the LoopTree cost model behind predicted gains.

Each transformation family (one module, listed in :mod:`rose_jax.optimize.registry`) exports
``candidates(ctx: CandidateContext) -> list[Candidate]``: its transforms for the traced iteration,
each with a predicted gain (seconds per iteration) and the model behind it.
:func:`rose_jax.optimize.candidates.generate_candidates` loops over the families. Predictions are
models, not measurements (the search measures every candidate it keeps); a generated candidate
may be illegal (the search then refuses it with the reason).

The shared model: a node's share of the iteration is its flops + bytes/4 (times the trip counts
of the loops around it) over the root's (:func:`time_share`). Where the profile timed the
components (``phases``: seconds per iteration by component path), the share is measured instead:
its component's measured share of the iteration, times the node's flops-and-bytes share within that
component (:func:`measured_share`; flops say little about latency-bound physics, whose small
kernels set the time). A profiled low-activity window lies
in a node when their component paths meet (:func:`idle_for`); without a window a loop is assumed
:data:`ASSUMED_IDLE_SHARE` idle; a compiled loop costs :data:`LOOP_OVERHEAD_S` per iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from rose_jax.jaxpr import compat as C
from rose_jax.optimize.base import Tolerance, Transform
from rose_jax.optimize.where import Where, scan_transform, tree_loops, where_label
from rose_jax.program import Program

# Per-iteration cost of a compiled loop (s) used to predict unrolling gains: on GPU a while loop
# copies its predicate to the host every iteration (~10 us with the launch gaps around it);
# on CPU it is a branch and a few buffer assignments. A model, not a measurement.
LOOP_OVERHEAD_S = {"gpu": 10e-6, "cpu": 1e-6}
# Seconds one copied carried leaf costs per loop step: on GPU one small D2D copy kernel
# (``memcpy32_post``, ~1.3 us measured on the H200, with its launch gap), on CPU a memcpy. The
# model of the families that remove copies (update_in_place, stack_carries).
COPY_S = {"gpu": 2e-6, "cpu": 0.5e-6}
# Assumed idle SM share of a phase when no profiler window says otherwise.
ASSUMED_IDLE_SHARE = 0.5
# Share of a component's time that leaves the critical path when it runs in a worker process on
# a GPU whose processes are time-sliced (this process is not an MPS client): the worker's kernels
# wait for the driver's time slices, so only launch and host gaps are filled. Calibrated on one
# measurement: PPO ant's evaluation (4,096 envs, 1.42 s of a 2.37 s epoch) offloaded without MPS
# saved 60 ms on an H100 (2026-12-05, benchmarks/results/beyond_flags/); as an MPS client the
# same offload saved 806 ms of a 3.35 s epoch on the H200 (benchmarks/results/optimize_epoch/).
TIME_SLICED_OVERLAP = 0.04


@dataclasses.dataclass
class Candidate:
    """A transformation to try, the window it targets and its predicted gain (s/iter) with the model."""

    transform: Transform
    window: str
    predicted: float | None
    model: str


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


def _weight(tree, node) -> float:
    """A node's work per iteration: flops + bytes/4 (a crude roofline-free weight) times the trip
    counts of the loops around it."""
    return (float(node.cost.flops) + float(node.cost.bytes) / 4.0) * outer_trips(tree, node)


def time_share(tree, node) -> float:
    """A node's share of the iteration's work (:func:`_weight` over the root's)."""
    total = _weight(tree, tree.root)
    return 0.0 if total <= 0 else min(1.0, _weight(tree, node) / total)


def phase_times(phases) -> tuple[dict[str, float], float | None]:
    """Profiled phases (``path``, ``level``, ``time_s``: seconds per iteration; level 0 is the
    whole iteration) as ``({component path: seconds}, iteration seconds or None)``."""
    by_path: dict[str, float] = {}
    total = None
    for p in sorted(phases or (), key=lambda p: p["level"]):
        if p["level"] == 0:
            total = float(p["time_s"])
        elif not p["path"].startswith("("):  # "(glue)": no component
            by_path.setdefault(p["path"], float(p["time_s"]))
    if total is None and phases:
        total = sum(float(p["time_s"]) for p in phases if p["level"] == 1) or None
    return by_path, total


def timed_component(node, by_path: dict[str, float]) -> tuple[str, ...] | None:
    """The deepest component path around ``node`` that the profile timed (None: none)."""
    path = tuple(node.component_path)
    for k in range(len(path), 0, -1):
        if "/".join(path[:k]) in by_path:
            return path[:k]
    return None


def component_share(node, by_path: dict[str, float], total_s: float | None):
    """``(component path, its measured share of the iteration)`` of the deepest component around
    ``node`` that the profile timed (None: none, or no iteration time)."""
    if not by_path or not total_s or total_s <= 0:
        return None
    comp = timed_component(node, by_path)
    return None if comp is None else (comp, by_path["/".join(comp)] / total_s)


def measured_share(tree, node, by_path: dict[str, float], total_s: float | None) -> float | None:
    """``node``'s share of the iteration from profiled component times: the measured share of
    the deepest timed component around it, times its flops-and-bytes share of that component's
    nodes (None: no timed component around it)."""
    found = component_share(node, by_path, total_s)
    if found is None:
        return None
    comp, share = found
    comps = [n for n in tree.walk() if n.kind == "component" and tuple(n.component_path) == comp]
    whole = sum(_weight(tree, n) for n in comps)
    within = 1.0 if whole <= 0 else min(1.0, _weight(tree, node) / whole)
    return min(1.0, share * within)


def windows_by_path(windows) -> dict[str, float]:
    """Profiled windows (``path``, ``idle_sm_seconds_per_iteration``) as ``{path: idle SM-s}``."""
    out: dict[str, float] = {}
    for w in windows or ():
        path = w.path if isinstance(w.path, str) else "/".join(w.path)
        out[path] = out.get(path, 0.0) + float(w.idle_sm_seconds_per_iteration)
    return out


def idle_for(node, windows: dict[str, float]) -> float | None:
    """Idle SM-seconds per iteration of the windows that lie in ``node`` (None: no window)."""
    comps = set(node.component_path) | {node.name}
    found = [v for path, v in windows.items() if set(path.split("/")) & comps]
    return sum(found) if found else None


def loop_time(tree, where, baseline_s: float, by_path: dict[str, float], kind: str = "scan"):
    """``(seconds per iteration, idle SM-seconds or None)`` of the loops matching ``where``."""
    nodes = tree_loops(tree, where, kind)
    ids = {id(n) for n in nodes}
    share = sum(time_share(tree, n) for n in nodes if not any(id(a) in ids for a in tree.ancestors(n)))
    idle = [v for v in (idle_for(n, by_path) for n in nodes) if v is not None]
    return baseline_s * min(share, 1.0), (max(idle) if idle else None)


def scan_of(node) -> Any:
    """The ``ScanParams`` of a LoopTree scan node (its single scan equation), else None."""
    eqns = node.eqns()
    if len(eqns) != 1 or eqns[0].primitive.name != C.SCAN:
        return None
    return C.scan_params(eqns[0].params)


def scans_legal(
    tree, where, split: Callable[[Any], Any], label: Callable[[Any, Any], str], ok_prefix: str
) -> tuple[bool, str]:
    """A loop family's ``legal(tree)``: each scan matching ``where`` split by ``split(scan)``
    (an object with ``moves``, ``why``), legal when at least one moves; the reason names every
    scan, ``label(split, scan)`` for those that move, ``split.why`` for those refused."""
    loops = tree_loops(tree, where)
    if not loops:
        return False, f"no scan matches {where_label(where)}"
    found, refused = [], []
    for node in loops:
        scan = scan_of(node)
        if scan is None:
            continue
        s = split(scan)
        name = "/".join(node.component_path + (node.name,))
        if s.moves:
            found.append(f"{name}: {label(s, scan)}")
        else:
            refused.append(f"{name}: {s.why}")
    if not found:
        return False, "; ".join(refused) or f"no scan body readable at {where_label(where)}"
    return True, ok_prefix + "; ".join(found)


def split_scans(ctx: "CandidateContext", split: Callable[[Any], Any]):
    """``(node, where spec, split(scan), trips)`` for each scan :func:`candidate_scans` offers whose
    body ``split`` moves (``trips``: its steps per iteration, outer loops included): what a loop
    family's ``candidates`` models its gain from."""
    for node, where in candidate_scans(ctx):
        scan = scan_of(node)
        if scan is None:
            continue
        s = split(scan)
        if s.moves:
            yield node, where, s, node.trip_count * outer_trips(ctx.tree, node)


def split_scan_transform(
    name: str,
    params: tuple[tuple[str, Any], ...],
    tolerance: Tolerance,
    where: Where,
    split: Callable[[Any], Any],
    label: Callable[[Any, Any], str],
    ok_prefix: str,
    run: Callable[..., list],
    summary: str,
) -> Transform:
    """The ``Transform`` of a loop family that splits each chosen scan's body: ``split(scan)`` (an
    object with ``moves`` and ``why``) decides legality (:func:`scans_legal`, ``label`` and
    ``ok_prefix`` its reason) and, at apply time, ``run(split, scan, invals, site, interp)``
    rebuilds a scan whose split moves; one whose split does not is rebuilt as it was."""

    def legal(tree):
        return scans_legal(tree, where, split, label, ok_prefix)

    def on_scan(site, scan, invals, interp):
        s = split(scan)
        if not s.moves:
            return interp.rebuild_scan(scan, invals, site.body_ctx)
        return run(s, scan, invals, site, interp)

    return scan_transform(name, params, tolerance, where, legal, on_scan, summary=summary)


def candidate_scans(ctx: "CandidateContext") -> list[tuple[Any, str]]:
    """``(node, where spec)`` of the scans of at least two steps that loop families generate
    candidates for: those in a profiled window (without windows every one), most expensive first,
    each where spec once."""
    scans = [n for n in ctx.tree.walk() if n.kind == "scan" and (n.trip_count or 0) >= 2]
    if ctx.by_path:
        scans = [n for n in scans if ctx.idle_for(n) is not None] or scans
    scans.sort(key=lambda n: -ctx.time_share(n))
    out, seen = [], set()
    for node in scans:
        where = where_of(node)
        if where not in seen:
            seen.add(where)
            out.append((node, where))
    return out


def moved_out_gain(ctx: "CandidateContext", node, moved: int, total: int) -> float:
    """Seconds per iteration saved by running ``moved`` of a loop body's ``total`` equations once
    instead of every step: the loop's time x moved/total x (1 - 1/trips)."""
    share = moved / max(total, 1)
    return ctx.baseline_s * ctx.time_share(node) * share * (1.0 - 1.0 / node.trip_count)


@dataclasses.dataclass(frozen=True)
class CandidateContext:
    """What a family's ``candidates(ctx)`` reads.

    ``tree``: the iteration's :class:`rose_jax.trace.LoopTree`; ``program``: the
    :class:`~rose_jax.program.Program` it traces, or None for a plain function; ``baseline_s``:
    the untransformed iteration's seconds (predictions are in seconds per iteration);
    ``windows``: profiled low-activity windows or None (``by_path``: their idle SM-seconds by
    component path); ``phases``: the profile's timed components (``path``, ``level``,
    ``time_s`` per iteration) or None (then shares are flops-and-bytes shares); ``platform``:
    the JAX backend (``"cpu"``, ``"gpu"``); ``concurrent_processes``: whether worker processes
    run kernels concurrently with this one (True: it is an MPS client; False: time-sliced; None:
    not known, modelled as concurrent); ``base_options``: the XLA option set the baseline runs
    under (``OptimizeOptions.option_sets``; None: XLA's defaults) and ``options_saved_s`` the
    seconds per iteration it saved against XLA's defaults; the rest are the variants the search
    tries (unroll factors, env-group sizes and modes).
    """

    tree: Any
    program: Program | None
    baseline_s: float
    windows: Sequence[Any] | None = None
    platform: str = "cpu"
    unroll_factors: Sequence[int] = (2, 4, 8)
    group_sizes: Sequence[int] = (2, 4)
    group_modes: Sequence[str] = ("interleaved", "processes")
    phases: Sequence[dict] | None = None
    concurrent_processes: bool | None = None
    base_options: str | None = None
    options_saved_s: float = 0.0
    by_path: dict = dataclasses.field(init=False, compare=False, repr=False)
    phase_s: dict = dataclasses.field(init=False, compare=False, repr=False)
    phase_total_s: float | None = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "by_path", windows_by_path(self.windows))
        phase_s, total = phase_times(self.phases)
        object.__setattr__(self, "phase_s", phase_s)
        object.__setattr__(self, "phase_total_s", total)

    @property
    def loop_overhead_s(self) -> float:
        """:data:`LOOP_OVERHEAD_S` of this platform (a GPU's for an unknown one)."""
        return LOOP_OVERHEAD_S.get(self.platform, LOOP_OVERHEAD_S["gpu"])

    def idle_for(self, node) -> float | None:
        """:func:`idle_for` of ``node`` in this context's windows."""
        return idle_for(node, self.by_path)

    def component_s(self, node) -> float | None:
        """Profiled seconds per iteration of the deepest timed component around ``node``, in
        baseline units (None: not timed)."""
        found = component_share(node, self.phase_s, self.phase_total_s)
        return None if found is None else self.baseline_s * found[1]

    def time_share(self, node) -> float:
        """``node``'s share of the iteration: :func:`measured_share` where the profile timed a
        component around it, else :func:`time_share` (flops and bytes)."""
        measured = measured_share(self.tree, node, self.phase_s, self.phase_total_s)
        return time_share(self.tree, node) if measured is None else measured


__all__ = [
    "ASSUMED_IDLE_SHARE",
    "LOOP_OVERHEAD_S",
    "TIME_SLICED_OVERLAP",
    "Candidate",
    "CandidateContext",
    "candidate_scans",
    "component_share",
    "idle_for",
    "loop_time",
    "measured_share",
    "moved_out_gain",
    "outer_trips",
    "phase_times",
    "scan_of",
    "scans_legal",
    "timed_component",
    "time_share",
    "where_of",
    "windows_by_path",
]
