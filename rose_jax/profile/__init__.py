"""rose_jax.profile: where the GPU time of a training iteration goes.

* :func:`time_phases` / :func:`profile` -- run the real program split into component segments
  (and, level 2, the component segments of its loop bodies), fenced and timed; ``profile`` adds
  the NVML SM-activity series (GPM ``SM_UTIL``/``SM_OCCUPANCY`` where supported).
* :func:`find_windows` / :func:`phase_idle_summary` -- low-activity windows per component path,
  ranked by idle SM-seconds per iteration.
* :class:`Sampler` -- the NVML sampler thread; :func:`available` says whether there is a GPU.
* :func:`plot_timeline` -- PNG of activity over one iteration with phase bands and windows.
* :func:`kernel_trace` -- per-kernel GPU trace (``jax.profiler``) mapped to component paths.
* :func:`iteration_activity` -- mean SM activity per iteration and the sampler's overhead.
"""

from rose_jax.profile.phases import (
    IterationActivity,
    SegmentedProgram,
    compare_outputs,
    iteration_activity,
    profile,
    time_phases,
)
from rose_jax.profile.sampler import NoGPUError, Sampler, available
from rose_jax.profile.timeline import ActivitySeries, Phase, Timeline, load, make_series, step_bounds
from rose_jax.profile.windows import (
    PhaseSummary,
    Window,
    find_windows,
    format_windows,
    mean_activity,
    phase_idle_summary,
    summary_table,
    windows_table,
)


def plot_timeline(*args, **kwargs):
    """See :func:`rose_jax.profile.plot.plot_timeline` (matplotlib is imported on first use)."""
    from rose_jax.profile.plot import plot_timeline as _plot

    return _plot(*args, **kwargs)


def kernel_trace(*args, **kwargs):
    """See :func:`rose_jax.profile.xplane.kernel_trace`."""
    from rose_jax.profile.xplane import kernel_trace as _trace

    return _trace(*args, **kwargs)


__all__ = [
    "ActivitySeries",
    "IterationActivity",
    "NoGPUError",
    "Phase",
    "PhaseSummary",
    "Sampler",
    "SegmentedProgram",
    "Timeline",
    "Window",
    "available",
    "compare_outputs",
    "find_windows",
    "format_windows",
    "iteration_activity",
    "kernel_trace",
    "load",
    "make_series",
    "mean_activity",
    "phase_idle_summary",
    "plot_timeline",
    "profile",
    "step_bounds",
    "summary_table",
    "time_phases",
    "windows_table",
]
