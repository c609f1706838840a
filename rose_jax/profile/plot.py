"""PNG of a Timeline: SM activity over one iteration, phases as coloured bands, windows shaded.

Uses matplotlib's object API with the Agg canvas (no pyplot global state, no display needed).
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Sequence

import numpy as np

from rose_jax.profile.timeline import Phase, Timeline, step_bounds
from rose_jax.profile.windows import Window, find_windows


def _panels(timeline: Timeline, iteration: int | None) -> list[tuple[str, list[Phase]]]:
    """(title, phases) per panel: one segmented iteration (level 1, with the fused run when
    present) and, if any, the level >= 2 pass over loop bodies."""
    out = []
    lvl1 = [p for p in timeline.phases if p.level == 1]
    if lvl1:
        its = sorted({p.iteration for p in lvl1})
        it = its[-1] if iteration is None or iteration not in its else iteration
        out.append((f"segmented iteration {it} (level 1)", [p for p in lvl1 if p.iteration == it]))
    deep = [p for p in timeline.phases if p.level >= 2]
    passes = timeline.metadata.get("detail_passes_ns") or []
    if deep and passes:  # the last level >= 2 pass (the first ones also hold warm-up work)
        a, b = passes[-1]
        last = [p for p in deep if a <= p.start_ns and p.end_ns <= b]
        deep = last or deep
    if deep:
        out.append(("sub-components and loop bodies, per iteration (level >= 2, last pass)", deep))
    fused = [p for p in timeline.phases if p.level == 0]
    if fused and not out:
        out.append(("fused iterations (level 0)", fused))
    return out


def plot_timeline(
    timeline: Timeline,
    path: str | os.PathLike,
    title: str = "",
    *,
    windows: Sequence[Window] | None = None,
    threshold: float | None = 50.0,
    iteration: int | None = None,
    dpi: int = 120,
) -> str:
    """Write a PNG to ``path`` and return it.

    Top panel: the last (or ``iteration``-th) segmented iteration; bottom panel (when present):
    the per-iteration pass over loop bodies. x in ms from the panel's first phase; y: activity %.
    ``windows`` default to :func:`find_windows` with ``threshold`` when there is activity data.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = _panels(timeline, iteration)
    if not panels:
        raise ValueError("plot_timeline: the timeline has no phases")
    act = timeline.activity
    if windows is None and act is not None and threshold is not None:
        windows = find_windows(timeline, threshold=threshold)
    windows = list(windows or [])
    paths = list(dict.fromkeys(p.path for _, ps in panels for p in ps))
    cmap = _colors(len(paths))
    color = {p: cmap[i] for i, p in enumerate(paths)}

    fig = Figure(figsize=(12, 3.2 * len(panels) + 0.8), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (sub, phases) in zip(axes, panels, strict=True):
        t0 = min(p.start_ns for p in phases)
        t1 = max(p.end_ns for p in phases)
        ms = functools.partial(_to_ms, origin=t0)
        for p in phases:
            ax.axvspan(ms(p.start_ns), ms(p.end_ns), color=color[p.path], alpha=0.35, lw=0)
        for w in windows:
            if w.end_ns > t0 and w.start_ns < t1:
                ax.axvspan(
                    ms(max(w.start_ns, t0)),
                    ms(min(w.end_ns, t1)),
                    ymin=0,
                    ymax=0.08,
                    color="black",
                    alpha=0.6,
                    lw=0,
                )
        if act is not None and act.num_samples:
            s, e = step_bounds(act)
            sel = (e > t0) & (s < t1)
            if sel.any():
                xs = np.repeat(ms(np.stack([s[sel], e[sel]], 1).reshape(-1)), 1)
                ax.plot(
                    xs,
                    np.repeat(act.sm_util[sel], 2),
                    color="tab:blue",
                    lw=1.4,
                    label="SM util %" if act.source == "gpm" else "GPU util % (time share)",
                )
                if act.sm_occupancy is not None:
                    ax.plot(
                        xs,
                        np.repeat(act.sm_occupancy[sel], 2),
                        color="tab:orange",
                        lw=1.0,
                        ls="--",
                        label="SM occupancy %",
                    )
            if threshold is not None:
                ax.axhline(threshold, color="gray", lw=0.8, ls=":")
        else:
            ax.text(
                0.5,
                0.5,
                "no GPU activity data" + _why(timeline),
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=11,
                color="dimgray",
            )
        ax.set_xlim(0, max(ms(t1), 1e-3))
        ax.set_ylim(0, 105)
        ax.set_ylabel("activity %")
        ax.set_xlabel("ms")
        ax.set_title(sub, fontsize=10)
    handles = [Patch(color=color[p], alpha=0.5, label=p) for p in paths]
    if windows:
        handles.append(Patch(color="black", alpha=0.6, label="low-activity window"))
    line_handles, line_labels = axes[0].get_legend_handles_labels()
    ncol = min(5, len(handles) + len(line_handles))
    rows = -(-(len(handles) + len(line_handles)) // ncol)
    fig.legend(
        handles + line_handles,
        [h.get_label() for h in handles] + line_labels,
        loc="lower center",
        ncol=ncol,
        fontsize=8,
        frameon=False,
    )
    if title:
        fig.suptitle(title, fontsize=11)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, min(0.45, (0.25 * rows + 0.1) / height), 1, 1))
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _to_ms(t, origin: int):
    return (np.asarray(t, np.float64) - origin) * 1e-6


def _why(timeline: Timeline) -> str:
    why = timeline.metadata.get("activity")
    return f"\n({why})" if why else ""


def _colors(n: int) -> list:
    from matplotlib import colormaps

    base = colormaps["tab20"].colors
    return [base[i % len(base)] for i in range(n)]
