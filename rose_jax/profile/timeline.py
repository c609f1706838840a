"""Profile data: an SM-activity series, timed phases, and the :class:`Timeline` holding both.

Pure data (numpy + json): no JAX, no NVML. All times are ``time.perf_counter_ns()`` values of
the process that measured them (int nanoseconds, arbitrary origin), so phases and activity
samples share one clock.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, NamedTuple, Sequence

import numpy as np

from rose_jax.io import atomic_write_text

SOURCES = ("gpm", "utilization")


class ActivitySeries(NamedTuple):
    """GPU SM activity over time, as a step function.

    Sample ``k`` stands for the half-open interval ``[t_start_ns[k], t_end_ns[k])`` (steps are
    sorted and do not overlap); ``t_ns[k]`` is its representative time (the centre of the interval
    NVML averaged over). Shapes: every array is ``(n,)``.

    Attributes:
      t_ns: int64 ns, representative time of each sample.
      sm_util: float64 percent (0-100): GPM ``SM_UTIL`` (share of SMs busy) for ``source='gpm'``;
        for ``source='utilization'`` it is NVML's ``utilization.gpu`` (share of *time* any kernel
        ran), which overstates SM activity. ``nan`` where NVML returned no value.
      sm_occupancy: float64 percent, GPM ``SM_OCCUPANCY`` (active warps / max warps), or None.
      source: ``'gpm'`` or ``'utilization'``.
      t_start_ns, t_end_ns: int64 ns step bounds; None means "derive from ``t_ns``" (midpoints
        between neighbouring samples, see :func:`step_bounds`).
      resolution_ns: the averaging window behind one value (int ns): what the series can resolve,
        whatever its sampling period.
    """

    t_ns: np.ndarray
    sm_util: np.ndarray
    sm_occupancy: np.ndarray | None
    source: str
    t_start_ns: np.ndarray | None = None
    t_end_ns: np.ndarray | None = None
    resolution_ns: int = 0

    def __len__(self) -> int:  # number of samples (NamedTuple's len would be the field count)
        return int(np.shape(self.t_ns)[0])

    @property
    def num_samples(self) -> int:
        return int(np.shape(self.t_ns)[0])


def make_series(
    t_ns: Sequence[int],
    sm_util: Sequence[float],
    sm_occupancy: Sequence[float] | None = None,
    source: str = "gpm",
    t_start_ns: Sequence[int] | None = None,
    t_end_ns: Sequence[int] | None = None,
    resolution_ns: int = 0,
) -> ActivitySeries:
    """Build a validated :class:`ActivitySeries` from sequences (raises ValueError on bad input)."""
    t = np.asarray(t_ns, dtype=np.int64).reshape(-1)
    u = np.asarray(sm_util, dtype=np.float64).reshape(-1)
    if u.shape != t.shape:
        raise ValueError(f"ActivitySeries: sm_util has {u.shape[0]} samples, t_ns has {t.shape[0]}")
    o = None
    if sm_occupancy is not None:
        o = np.asarray(sm_occupancy, dtype=np.float64).reshape(-1)
        if o.shape != t.shape:
            raise ValueError(f"ActivitySeries: sm_occupancy has {o.shape[0]} samples, t_ns has {t.shape[0]}")
    if source not in SOURCES:
        raise ValueError(f"ActivitySeries: source must be one of {SOURCES}, got {source!r}")
    if np.any(np.diff(t) < 0):
        raise ValueError("ActivitySeries: t_ns must be sorted ascending")
    s = e = None
    if (t_start_ns is None) != (t_end_ns is None):
        raise ValueError("ActivitySeries: give both t_start_ns and t_end_ns, or neither")
    if t_start_ns is not None:
        s = np.asarray(t_start_ns, dtype=np.int64).reshape(-1)
        e = np.asarray(t_end_ns, dtype=np.int64).reshape(-1)
        if s.shape != t.shape or e.shape != t.shape:
            raise ValueError("ActivitySeries: t_start_ns/t_end_ns must have one entry per sample")
        if np.any(e < s):
            raise ValueError("ActivitySeries: t_end_ns < t_start_ns for some sample")
        if np.any(s[1:] < e[:-1]):
            raise ValueError("ActivitySeries: steps overlap (t_start_ns[k+1] < t_end_ns[k])")
    return ActivitySeries(t, u, o, source, s, e, int(resolution_ns))


def step_bounds(series: ActivitySeries) -> tuple[np.ndarray, np.ndarray]:
    """``(start_ns, end_ns)`` int64 arrays of the step each sample covers.

    Explicit bounds are returned as they are; otherwise the boundary between two samples is the
    midpoint of their times, and the first/last step extend half a neighbour gap outwards (a single
    sample without bounds covers nothing).
    """
    if series.t_start_ns is not None:
        return np.asarray(series.t_start_ns, np.int64), np.asarray(series.t_end_ns, np.int64)
    t = np.asarray(series.t_ns, np.int64)
    if t.shape[0] < 2:
        return t.copy(), t.copy()
    mid = (t[:-1] + t[1:]) // 2
    start = np.concatenate([[t[0] - (mid[0] - t[0])], mid])
    end = np.concatenate([mid, [t[-1] + (t[-1] - mid[-1])]])
    return start, end


@dataclasses.dataclass(frozen=True)
class Phase:
    """One timed execution of a piece of the program.

    Attributes:
      path: component path string, e.g. ``"rollout/sim"`` (the ``rose:<name>`` scopes of its
        equations joined by ``/``, as ``node.component_path`` of the tracer); ``"(glue)"`` for
        top-level code outside any component, ``"(iteration)"`` for the whole fused program.
      start_ns, end_ns: perf_counter_ns bounds (the end is after ``block_until_ready``).
      level: 0 = the whole jitted program, 1 = a top-level segment, 2 = a component segment of a
        loop body timed per loop iteration (deeper levels likewise).
      iteration: level 0/1: which call of the program (repeat index); level >= 2: the loop
        iteration index within the innermost timed loop.
      weight: how many occurrences per training iteration this instance stands for: ``1/repeats``
        at levels 0/1; at level >= 2 ``trip_count / measured_iterations`` (times the weight of
        enclosing loops measured for fewer iterations than they run): the extrapolation factor.
    """

    path: str
    start_ns: int
    end_ns: int
    level: int
    iteration: int
    weight: float = 1.0

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _jsonable(x: Any) -> Any:
    """Recursively turn numpy scalars/arrays and non-finite floats into plain JSON values."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return str(x)


def _series_to_dict(s: ActivitySeries) -> dict:
    return {
        "t_ns": [int(v) for v in s.t_ns],
        "sm_util": _jsonable(np.asarray(s.sm_util)),
        "sm_occupancy": None if s.sm_occupancy is None else _jsonable(np.asarray(s.sm_occupancy)),
        "source": s.source,
        "t_start_ns": None if s.t_start_ns is None else [int(v) for v in s.t_start_ns],
        "t_end_ns": None if s.t_end_ns is None else [int(v) for v in s.t_end_ns],
        "resolution_ns": int(s.resolution_ns),
    }


def _nan_list(v):
    return None if v is None else [np.nan if x is None else x for x in v]


def _series_from_dict(d: dict) -> ActivitySeries:
    return make_series(
        d["t_ns"],
        _nan_list(d["sm_util"]),
        _nan_list(d.get("sm_occupancy")),
        d["source"],
        d.get("t_start_ns"),
        d.get("t_end_ns"),
        d.get("resolution_ns", 0),
    )


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Timed phases of a program, optionally with the SM activity sampled while they ran.

    Attributes:
      phases: tuple of :class:`Phase`, in execution order.
      activity: the :class:`ActivitySeries` recorded around the phases, or None (no GPU/NVML).
      metadata: JSON-able dict: how it was measured (repeats, levels, extrapolated loops, output
        check, backend, why activity is missing ...).
    """

    phases: tuple[Phase, ...]
    activity: ActivitySeries | None = None
    metadata: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "phases", tuple(self.phases))

    def replace(self, **changes) -> "Timeline":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            "format": "rose_jax.profile.Timeline/1",
            "phases": [dataclasses.asdict(p) for p in self.phases],
            "activity": None if self.activity is None else _series_to_dict(self.activity),
            "metadata": _jsonable(self.metadata),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        if not isinstance(d, dict) or "phases" not in d:
            raise ValueError("Timeline.from_dict: not a Timeline dict (no 'phases')")
        phases = tuple(
            Phase(
                str(p["path"]),
                int(p["start_ns"]),
                int(p["end_ns"]),
                int(p["level"]),
                int(p["iteration"]),
                float(p.get("weight", 1.0)),
            )
            for p in d["phases"]
        )
        act = d.get("activity")
        return cls(phases, None if act is None else _series_from_dict(act), dict(d.get("metadata") or {}))

    @classmethod
    def from_json(cls, text: str) -> "Timeline":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> str:
        """Write JSON atomically (temporary file in the same directory, then ``os.replace``)."""
        path = os.fspath(path)
        atomic_write_text(path, self.to_json(indent=1))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Timeline":
        with open(os.fspath(path)) as f:
            return cls.from_json(f.read())

    # -- small conveniences -------------------------------------------------------------------
    def levels(self) -> list[int]:
        return sorted({p.level for p in self.phases})

    def paths(self, level: int | None = None) -> list[str]:
        """Distinct phase paths in first-seen order (optionally of one level)."""
        seen: dict[str, None] = {}
        for p in self.phases:
            if level is None or p.level == level:
                seen.setdefault(p.path, None)
        return list(seen)


def load(path: str | os.PathLike) -> Timeline:
    """Read a Timeline written by :meth:`Timeline.save`."""
    return Timeline.load(path)
