"""Low-activity windows and per-phase idle summaries of a :class:`Timeline` (pure numpy).

The activity series is a step function: sample ``k`` holds on ``[t_start_ns[k], t_end_ns[k])``
(see :func:`rose_jax.profile.timeline.step_bounds`); samples whose value is ``nan`` count as
not covered. Activity is in percent, "idle SM share" is ``1 - activity/100``.

Definition of a window (exact, so it can be unit-tested):
  1. L = the union of the steps with activity < ``threshold``, intersected with the union of the
     selected phases' intervals (time outside every phase is not part of the program);
  2. windows = the connected pieces of L, then neighbours whose gap is < ``merge_gap_ms`` are
     merged (the merged window includes the gap);
  3. windows shorter than ``min_duration_ms`` are dropped;
  4. each window gets the path of the phase it overlaps most (ties: the earliest phase), its
     time-weighted mean idle share over the covered part of ``[start, end)``, and that phase's
     ``weight`` as ``occurrences_per_iteration``;
  5. ``idle_sm_seconds_per_iteration = duration_s * mean_idle_sm_share * occurrences_per_iteration``
     (seconds of the whole GPU's SMs idle, per training iteration; multiply by the SM count for
     SM-seconds), and windows are ranked by it, largest first.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from rose_jax.profile.timeline import ActivitySeries, Phase, Timeline, step_bounds

METRICS = ("sm_util", "sm_occupancy")


class Window(NamedTuple):
    """A low-SM-activity interval inside the measured phases.

    path: component path of the phase with most overlap; start_ns/end_ns: perf_counter_ns bounds;
    duration_s: seconds; mean_idle_sm_share: 0..1; occurrences_per_iteration: the phase's weight;
    idle_sm_seconds_per_iteration: duration_s * mean_idle_sm_share * occurrences_per_iteration;
    level: the phase's level; phases: every (path) the window overlaps, in time order.
    """

    path: str
    start_ns: int
    end_ns: int
    duration_s: float
    mean_idle_sm_share: float
    occurrences_per_iteration: float
    idle_sm_seconds_per_iteration: float
    level: int = 1
    phases: tuple = ()


class PhaseSummary(NamedTuple):
    """Per (level, path): time per training iteration (s), mean SM activity (%, nan if not
    sampled), idle SM-seconds per iteration (time * (1 - activity/100)), occurrences per
    iteration (sum of weights), and the share of its time covered by activity samples."""

    path: str
    level: int
    time_per_iteration_s: float
    mean_sm_activity: float
    idle_sm_seconds_per_iteration: float
    occurrences_per_iteration: float
    covered_fraction: float


class _Integrator:
    """Exact integrals of a step function over intervals (cumulative sums + binary search)."""

    def __init__(self, series: ActivitySeries | None, metric: str = "sm_util"):
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        if series is None or series.num_samples == 0:
            self.s = self.e = np.zeros(0, np.int64)
            self.v = np.zeros(0)
        else:
            values = series.sm_util if metric == "sm_util" else series.sm_occupancy
            if values is None:
                raise ValueError(f"the activity series ({series.source}) has no {metric}")
            s, e = step_bounds(series)
            v = np.clip(np.asarray(values, np.float64), 0.0, 100.0)
            keep = np.isfinite(v) & (e > s)
            self.s, self.e, self.v = s[keep], e[keep], v[keep]
        dur = (self.e - self.s).astype(np.float64)
        self.cum_t = np.concatenate([[0.0], np.cumsum(dur)])
        self.cum_a = np.concatenate([[0.0], np.cumsum(dur * self.v)])

    def integrate(self, a: int, b: int) -> tuple[float, float]:
        """(covered ns, integral of activity in %·ns) over ``[a, b)``."""
        if b <= a or self.s.size == 0:
            return 0.0, 0.0
        i0 = int(np.searchsorted(self.e, a, side="right"))
        i1 = int(np.searchsorted(self.s, b, side="left")) - 1
        if i1 < i0:
            return 0.0, 0.0
        t = self.cum_t[i1 + 1] - self.cum_t[i0]
        x = self.cum_a[i1 + 1] - self.cum_a[i0]
        cut0 = max(0, a - int(self.s[i0]))
        t -= cut0
        x -= cut0 * self.v[i0]
        cut1 = max(0, int(self.e[i1]) - b)
        t -= cut1
        x -= cut1 * self.v[i1]
        return float(t), float(x)

    def low_steps(self, threshold: float) -> list[tuple[int, int]]:
        """Union of the steps below ``threshold`` as sorted disjoint [start, end) intervals."""
        low = self.v < threshold
        return _union(list(zip(self.s[low].tolist(), self.e[low].tolist(), strict=True)))


def _union(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted disjoint union (touching intervals join)."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersect(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _select(timeline: Timeline, levels) -> list[Phase]:
    if levels is None:
        return list(timeline.phases)
    levels = {levels} if isinstance(levels, int) else set(levels)
    return [p for p in timeline.phases if p.level in levels]


def _check_nonneg(name: str, v) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise ValueError(f"find_windows: {name} must be a finite number >= 0, got {v!r}")
    return float(v)


def find_windows(
    timeline: Timeline,
    threshold: float = 50.0,
    min_duration_ms: float = 0.0,
    merge_gap_ms: float = 0.0,
    levels: int | Sequence[int] | None = None,
    metric: str = "sm_util",
) -> list[Window]:
    """Low-activity windows of ``timeline`` ranked by idle SM-seconds per iteration (module doc).

    Args:
      threshold: activity (%) below which a sample counts as low.
      min_duration_ms: drop windows shorter than this (after merging).
      merge_gap_ms: merge neighbouring windows whose gap is shorter than this.
      levels: only phases of these levels (int or sequence); None = every phase. Levels measure
        different runs, so ranking across levels counts the same idle time once per level.
      metric: ``'sm_util'`` or ``'sm_occupancy'``.
    Raises ValueError when the timeline has no activity series.
    """
    if timeline.activity is None:
        raise ValueError("find_windows: the timeline has no activity series (profiled without a GPU/NVML?)")
    threshold = _check_nonneg("threshold", threshold)
    min_ns = _check_nonneg("min_duration_ms", min_duration_ms) * 1e6
    gap_ns = _check_nonneg("merge_gap_ms", merge_gap_ms) * 1e6
    phases = [p for p in _select(timeline, levels) if p.end_ns > p.start_ns]
    integ = _Integrator(timeline.activity, metric)
    if not phases or integ.s.size == 0:
        return []
    pieces = _intersect(integ.low_steps(threshold), _union([(p.start_ns, p.end_ns) for p in phases]))
    merged: list[list[int]] = []
    for a, b in pieces:
        if merged and a - merged[-1][1] < gap_ns:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    order = sorted(range(len(phases)), key=lambda i: (phases[i].start_ns, i))
    starts = np.array([phases[i].start_ns for i in order], np.int64)
    windows: list[Window] = []
    for a, b in merged:
        if b - a < min_ns:
            continue
        # phases overlapping [a, b): those starting before b (sorted) and ending after a
        hi = int(np.searchsorted(starts, b, side="left"))
        best, best_ov, touched = None, -1, []
        for i in order[:hi]:
            p = phases[i]
            ov = min(p.end_ns, b) - max(p.start_ns, a)
            if ov > 0:
                touched.append(p.path)
                if ov > best_ov:
                    best, best_ov = p, ov
        if best is None:
            continue
        covered, area = integ.integrate(a, b)
        idle = 1.0 - (area / covered) / 100.0 if covered > 0 else float("nan")
        dur = (b - a) * 1e-9
        windows.append(
            Window(
                best.path,
                int(a),
                int(b),
                dur,
                idle,
                best.weight,
                dur * idle * best.weight,
                best.level,
                tuple(dict.fromkeys(touched)),
            )
        )
    windows.sort(key=lambda w: (-_key(w.idle_sm_seconds_per_iteration), w.start_ns))
    return windows


def _key(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


def phase_idle_summary(
    timeline: Timeline, levels: int | Sequence[int] | None = None, metric: str = "sm_util"
) -> list[PhaseSummary]:
    """Per (level, path) totals per training iteration, sorted by idle SM-seconds per iteration
    (largest first; phases without activity data last, by time)."""
    integ = _Integrator(timeline.activity, metric) if timeline.activity is not None else _Integrator(None)
    acc: dict[tuple[int, str], list[float]] = {}
    for p in _select(timeline, levels):
        covered, area = integ.integrate(p.start_ns, p.end_ns)
        a = acc.setdefault((p.level, p.path), [0.0, 0.0, 0.0, 0.0])
        a[0] += p.weight * p.duration_ns
        a[1] += p.weight * covered
        a[2] += p.weight * area
        a[3] += p.weight
    out = []
    for (level, path), (t, cov, area, occ) in acc.items():
        mean = area / cov if cov > 0 else float("nan")
        idle = t * 1e-9 * (1.0 - mean / 100.0) if cov > 0 else float("nan")
        out.append(PhaseSummary(path, level, t * 1e-9, mean, idle, occ, cov / t if t > 0 else 0.0))
    out.sort(key=lambda s: (-_key(s.idle_sm_seconds_per_iteration), -s.time_per_iteration_s, s.level, s.path))
    return out


def mean_activity(
    series: ActivitySeries, intervals: Sequence[tuple[int, int]], metric: str = "sm_util"
) -> float:
    """Time-weighted mean activity (%) of ``series`` over the union of ``intervals`` (nan if none covered)."""
    integ = _Integrator(series, metric)
    t = x = 0.0
    for a, b in _union(intervals):
        dt, dx = integ.integrate(a, b)
        t += dt
        x += dx
    return x / t if t > 0 else float("nan")


def windows_table(windows: Sequence[Window], limit: int = 20) -> str:
    """A Markdown table of the top ``limit`` windows."""
    lines = [
        "| rank | path | level | duration ms | idle SM share | per iter | idle SM-s / iter |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for i, w in enumerate(windows[:limit]):
        lines.append(
            f"| {i + 1} | {w.path} | {w.level} | {w.duration_s * 1e3:.3f} | {w.mean_idle_sm_share:.3f} | "
            f"{w.occurrences_per_iteration:.3g} | {w.idle_sm_seconds_per_iteration:.4g} |"
        )
    return "\n".join(lines)


def summary_table(summary: Sequence[PhaseSummary], limit: int = 20) -> str:
    """A Markdown table of per-phase idle summaries."""
    lines = [
        "| path | level | time / iter ms | mean SM % | idle SM-s / iter | occurrences / iter |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary[:limit]:
        lines.append(
            f"| {s.path} | {s.level} | {s.time_per_iteration_s * 1e3:.3f} | {s.mean_sm_activity:.1f} | "
            f"{s.idle_sm_seconds_per_iteration:.4g} | {s.occurrences_per_iteration:.3g} |"
        )
    return "\n".join(lines)


def format_windows(windows: Sequence[Window], limit: int = 20) -> str:
    """Same as :func:`windows_table` (the name ``rose-jax profile`` prints with)."""
    return windows_table(windows, limit)
