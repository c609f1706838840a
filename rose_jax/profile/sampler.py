"""A background NVML sampler of GPU SM activity.

``with Sampler(period_ms=10) as s: ...`` starts a daemon thread that reads NVML every
``period_ms`` and stops it on exit; ``s.series()`` then returns an :class:`ActivitySeries`.

Sources, picked per device:
  * ``'gpm'`` (Hopper and newer, where ``nvmlGpmQueryDeviceSupport`` says so): GPM metrics
    ``SM_UTIL`` (share of SMs busy, %) and ``SM_OCCUPANCY`` (active warps / max warps, %). A GPM
    metric is computed from two samples (``nvmlGpmMetricsGet`` over ``sample1``/``sample2``):
    the value is the average between the two ``nvmlGpmSampleGet`` calls.
  * ``'utilization'`` otherwise: ``nvmlDeviceGetUtilizationRates().gpu``, the share of time any
    kernel ran during the driver's own window (1/6 s to 1 s); it says nothing about how many SMs
    were busy. ``sm_occupancy`` is None.

Real resolution (what to expect; measure it on the H200 with ``benchmarks.experiments.activity_profile``):
NVIDIA documents that the two ``nvmlGpmSampleGet`` calls of a metric should be more than 100 ms
apart "due to the internal sample refresh rate": the GPU refreshes the counters about every
100 ms, so two samples 10 ms apart mostly see the same snapshot. The sampler therefore reads a
GPM sample every ``period_ms`` (default 10 ms) but computes each value over a sliding window of
``window_ms`` (default 100 ms): one value per period, each an average over the last ~100 ms.
That is a moving average; its resolution is ~100 ms (``series.resolution_ns``), not the period.
Phases shorter than that get blurred activity; finer structure (gaps between kernels) comes from
:mod:`rose_jax.profile.xplane` traces. ``window_ms=period_ms`` gives raw consecutive pairs.

Overhead: one NVML sample call + one metrics call per period. By default (``mode="process"``)
the sampling loop runs in a spawned child process (``rose_jax.runtime.process.EnvProcess``: it
does not re-import the user's ``__main__``, so an unguarded script does not run twice), so it
never competes with the measured program's Python thread for the GIL (measured on the H200
with the in-process thread: SAC ant at 1024 envs, whose host loop dispatches an 8 ms iteration,
ran 4 % slower with the sampler on);
the child sends the series back when stopped. Timestamps are ``time.perf_counter_ns`` (the
system-wide monotonic clock on Linux), so they line up with the parent's phase timers.
``mode="thread"`` keeps the loop in a thread of this process (ctypes releases the GIL during NVML
calls; results go into preallocated numpy arrays). On a machine without NVML or GPU, :class:`Sampler` raises
:class:`NoGPUError` and :func:`available` returns ``(False, reason)``: no numbers are invented.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np

from rose_jax.profile.timeline import ActivitySeries, make_series
from rose_jax.runtime.process import SPAWN, EnvProcess


class NoGPUError(RuntimeError):
    """No NVIDIA GPU / NVML on this machine (the message says which step failed)."""


def _import_nvml():
    try:
        import pynvml  # package nvidia-ml-py
    except ImportError as e:  # pragma: no cover - the package is a dependency
        raise NoGPUError(f"no NVIDIA GPU/NVML: cannot import pynvml (package nvidia-ml-py): {e}") from None
    return pynvml


def _nvml_error_types(nvml) -> tuple[type, ...]:
    err = getattr(nvml, "NVMLError", None)
    return (err,) if isinstance(err, type) else (RuntimeError,)


def _open_device(nvml, device_index: int):
    """nvmlInit + device handle, or NoGPUError naming the failed step (NVML left shut down)."""
    errors = _nvml_error_types(nvml) + (OSError,)
    try:
        nvml.nvmlInit()
    except errors as e:
        raise NoGPUError(f"no NVIDIA GPU/NVML: nvmlInit failed: {e}") from None
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            raise NoGPUError("no NVIDIA GPU/NVML: NVML reports 0 devices")
        if not 0 <= device_index < count:
            raise NoGPUError(
                f"no NVIDIA GPU/NVML: device index {device_index} out of range (NVML sees {count})"
            )
        return nvml.nvmlDeviceGetHandleByIndex(device_index)
    except errors as e:
        nvml.nvmlShutdown()
        raise NoGPUError(f"no NVIDIA GPU/NVML: cannot open device {device_index}: {e}") from None
    except NoGPUError:
        nvml.nvmlShutdown()
        raise


def _gpm_supported(nvml, handle) -> bool:
    try:
        return bool(nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except (*_nvml_error_types(nvml), AttributeError, OSError):
        return False


def available(device_index: int = 0, _nvml: Any = None) -> tuple[bool, str]:
    """``(True, description)`` when NVML can sample device ``device_index``, else ``(False, reason)``."""
    try:
        nvml = _nvml if _nvml is not None else _import_nvml()
        handle = _open_device(nvml, device_index)
    except NoGPUError as e:
        return False, str(e)
    try:
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        gpm = _gpm_supported(nvml, handle)
        return True, f"device {device_index}: {name}; source {'gpm' if gpm else 'utilization'}"
    finally:
        nvml.nvmlShutdown()


class Sampler:
    """Context manager owning a thread that samples SM activity of one GPU through NVML.

    Args:
      period_ms: time between samples (ms, > 0; default 10).
      window_ms: GPM averaging window (ms, >= period; default 100, see the module docstring);
        rounded to a whole number of periods. Ignored for the utilization source.
      device_index: NVML device index (NVML order, which is PCI order, not ``CUDA_VISIBLE_DEVICES``).
      source: ``'auto'`` (GPM where supported), ``'gpm'`` (fail if unsupported) or ``'utilization'``.
      max_samples: capacity of the preallocated arrays; sampling stops (``truncated``) when full.
      mode: ``"process"`` (default: the loop in a child process, see the module docstring) or
        ``"thread"`` (always used with an injected ``_nvml``, which cannot cross processes).

    Raises NoGPUError on entry when there is no NVML/GPU (or GPM was demanded and is missing).
    """

    def __init__(
        self,
        period_ms: float = 10.0,
        window_ms: float = 100.0,
        device_index: int = 0,
        source: str = "auto",
        max_samples: int = 400_000,
        mode: str = "process",
        _nvml: Any = None,
    ):
        if not (isinstance(period_ms, (int, float)) and period_ms > 0 and math.isfinite(period_ms)):
            raise ValueError(f"Sampler: period_ms must be a positive number, got {period_ms!r}")
        if not (isinstance(window_ms, (int, float)) and window_ms > 0):
            raise ValueError(f"Sampler: window_ms must be a positive number, got {window_ms!r}")
        if source not in ("auto", "gpm", "utilization"):
            raise ValueError(f"Sampler: source must be 'auto', 'gpm' or 'utilization', got {source!r}")
        if not (isinstance(max_samples, int) and max_samples >= 2):
            raise ValueError(f"Sampler: max_samples must be an int >= 2, got {max_samples!r}")
        if mode not in ("process", "thread"):
            raise ValueError(f"Sampler: mode must be 'process' or 'thread', got {mode!r}")
        self.mode = "thread" if _nvml is not None else mode
        self._kwargs = dict(
            period_ms=period_ms, window_ms=window_ms, device_index=device_index, source=source,
            max_samples=max_samples,
        )
        self._child = None
        self.period_ns = int(round(period_ms * 1e6))
        self.lag = max(1, int(round(window_ms / period_ms)))  # window in periods
        self.device_index = device_index
        self.requested_source = source
        self.max_samples = max_samples
        self._nvml_override = _nvml
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._series: ActivitySeries | None = None
        self.source: str | None = None
        self.truncated = False
        self.errors = 0  # samples whose metric NVML refused (stored as nan)
        self.thread_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "Sampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Sampler":
        if self._thread is not None or self._child is not None:
            raise RuntimeError("Sampler already started")
        if self.mode == "process":
            return self._start_child()
        nvml = self._nvml_override if self._nvml_override is not None else _import_nvml()
        self._nvml = nvml
        self._handle = _open_device(nvml, self.device_index)
        gpm = _gpm_supported(nvml, self._handle)
        if self.requested_source == "gpm" and not gpm:
            nvml.nvmlShutdown()
            raise NoGPUError(f"no NVIDIA GPU/NVML: device {self.device_index} does not support GPM metrics")
        self.source = "gpm" if gpm and self.requested_source != "utilization" else "utilization"
        cap = self.max_samples
        self._t0 = np.zeros(cap, np.int64)
        self._t1 = np.zeros(cap, np.int64)
        self._util = np.full(cap, np.nan)
        self._occ = np.full(cap, np.nan)
        self._n = 0
        self._ring = []
        if self.source == "gpm":
            try:
                for _ in range(self.lag + 1):  # a ring: the metric pairs sample k with sample k - lag
                    self._ring.append(nvml.nvmlGpmSampleAlloc())
                mg = nvml.c_nvmlGpmMetricsGet_t()
                mg.version = nvml.NVML_GPM_METRICS_GET_VERSION
                mg.numMetrics = 2
                mg.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
                mg.metrics[1].metricId = nvml.NVML_GPM_METRIC_SM_OCCUPANCY
                self._mg = mg
            except _nvml_error_types(nvml) as e:
                self._release()
                raise NoGPUError(f"no NVIDIA GPU/NVML: GPM sample allocation failed: {e}") from None
        self._stop.clear()
        target = self._run_gpm if self.source == "gpm" else self._run_utilization
        self._thread = threading.Thread(target=target, name="rose-sm-sampler", daemon=True)
        self._t_begin = time.perf_counter_ns()
        self._thread.start()
        return self

    def stop(self) -> ActivitySeries:
        if self._child is not None:
            return self._stop_child()
        if self._thread is None:
            raise RuntimeError("Sampler was not started")
        if self._series is None:
            self._stop.set()
            self._thread.join()
            try:
                self._series = self._finish()
            finally:
                if self._ring is not None:
                    self._release()
                    self._ring = None
        return self._series

    # -- process mode: the same loop in a spawned child --------------------------------------
    def _start_child(self) -> "Sampler":
        # spawned like the worker pool's workers: the child does not re-import the user's
        # __main__ (a script without a main guard would run again in it); env None: ours as is
        here, there = SPAWN.Pipe()
        proc = EnvProcess(target=_child_main, args=(there, self._kwargs), name="rose-sm-sampler", daemon=True)
        proc.start()
        there.close()
        self._child, self._conn = proc, here
        try:
            if not here.poll(60.0):
                raise EOFError("no answer within 60 s")
            status, value = here.recv()
        except (EOFError, OSError) as e:
            status, value = "err", f"the sampler process did not start ({e})"
        if status != "ok":
            self._reap()
            raise NoGPUError(value if str(value).startswith("no NVIDIA") else f"no NVIDIA GPU/NVML: {value}")
        self.source = value
        return self

    def _stop_child(self) -> ActivitySeries:
        if self._series is None:
            try:
                self._conn.send("stop")
                status, *rest = self._conn.recv()
            except (EOFError, OSError) as e:
                status, rest = "err", [f"the sampler process died ({e})"]
            finally:
                self._reap()
            if status != "series":
                raise RuntimeError(f"Sampler process failed: {rest[0]}")
            self._series, self.truncated, self.errors, self.thread_error = rest
        return self._series

    def _reap(self) -> None:
        """Close the pipe and wait for (or kill) the child; the sampler cannot be restarted."""
        proc = self._child
        try:
            self._conn.close()
        finally:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)

    def _release(self) -> None:
        nvml = self._nvml
        for s in self._ring or ():
            try:
                nvml.nvmlGpmSampleFree(s)
            except _nvml_error_types(nvml):
                pass
        self._ring = []
        try:
            nvml.nvmlShutdown()
        except _nvml_error_types(nvml):
            pass

    def series(self) -> ActivitySeries:
        """The recorded :class:`ActivitySeries` (stops the sampler if it is still running)."""
        return self.stop()

    # -- the sampling threads: only NVML calls and array stores per sample ---------------------
    def _pace(self, next_t: int) -> tuple[int, bool]:
        next_t += self.period_ns
        delay = next_t - time.perf_counter_ns()
        if delay < 0:  # fell behind (GIL, slow call): do not burst to catch up
            next_t -= delay
            delay = 0
        return next_t, self._stop.wait(delay * 1e-9)

    def _run_gpm(self) -> None:
        nvml, handle, ring, lag, mg = self._nvml, self._handle, self._ring, self.lag, self._mg
        sample_get, metrics_get, clock = nvml.nvmlGpmSampleGet, nvml.nvmlGpmMetricsGet, time.perf_counter_ns
        errors = _nvml_error_types(nvml)
        size = len(ring)
        stamps = np.zeros(size, np.int64)
        m_util, m_occ = mg.metrics[0], mg.metrics[1]
        t0, t1, util, occ, cap = self._t0, self._t1, self._util, self._occ, self.max_samples
        n = k = 0
        next_t = clock()
        try:
            while True:
                slot = k % size
                sample_get(handle, ring[slot])
                now = clock()
                stamps[slot] = now
                if k >= lag:
                    old = (k - lag) % size
                    mg.sample1, mg.sample2 = ring[old], ring[slot]
                    try:
                        metrics_get(mg)
                        if m_util.nvmlReturn == 0:
                            util[n] = m_util.value
                        else:
                            self.errors += 1
                        if m_occ.nvmlReturn == 0:
                            occ[n] = m_occ.value
                    except errors:
                        self.errors += 1
                    t0[n], t1[n] = stamps[old], now
                    n += 1
                    self._n = n
                    if n == cap:
                        self.truncated = True
                        return
                k += 1
                next_t, stopped = self._pace(next_t)
                if stopped:
                    return
        except Exception as e:  # noqa: BLE001 - reported by series(), never swallowed silently
            self.thread_error = f"{type(e).__name__}: {e}"

    def _run_utilization(self) -> None:
        nvml, handle, clock = self._nvml, self._handle, time.perf_counter_ns
        get = nvml.nvmlDeviceGetUtilizationRates
        t0, t1, util, cap = self._t0, self._t1, self._util, self.max_samples
        n = 0
        prev = clock()
        next_t = prev
        try:
            while True:
                value = get(handle).gpu
                now = clock()
                t0[n], t1[n], util[n] = prev, now, value
                prev = now
                n += 1
                self._n = n
                if n == cap:
                    self.truncated = True
                    return
                next_t, stopped = self._pace(next_t)
                if stopped:
                    return
        except Exception as e:  # noqa: BLE001
            self.thread_error = f"{type(e).__name__}: {e}"

    def _finish(self) -> ActivitySeries:
        n = self._n
        if self.thread_error is not None:
            raise RuntimeError(f"Sampler thread failed after {n} samples: {self.thread_error}")
        a0, a1 = self._t0[:n], self._t1[:n]
        t = (a0 + a1) // 2  # centre of the averaging window
        if n == 0:
            start = end = t
        else:
            # Non-overlapping steps around the centres: boundaries at midpoints between centres.
            mid = (t[:-1] + t[1:]) // 2
            half = self.period_ns // 2
            start = np.concatenate([[t[0] - half], mid])
            end = np.concatenate([mid, [t[-1] + half]])
        if self.source == "gpm":
            resolution = int(np.median(a1 - a0)) if n else self.lag * self.period_ns
            occ = self._occ[:n].copy()
        else:
            resolution = 166_666_667  # the driver's utilization window: 1/6 s to 1 s
            occ = None
        return make_series(t, self._util[:n].copy(), occ, self.source, start, end, resolution)


def _child_main(conn, kwargs: dict) -> None:
    """The sampler process: a thread-mode Sampler until the parent says stop (or goes away)."""
    try:
        s = Sampler(mode="thread", **kwargs).start()
    except Exception as e:  # noqa: BLE001 - NoGPUError or anything else: told to the parent
        conn.send(("err", f"{e}"))
        return
    conn.send(("ok", s.source))
    try:
        conn.recv()
    except (EOFError, OSError):  # the parent died: stop sampling and exit
        s.stop()
        return
    try:
        series = s.stop()
        conn.send(("series", series, s.truncated, s.errors, s.thread_error))
    except Exception as e:  # noqa: BLE001
        conn.send(("err", f"{type(e).__name__}: {e}"))


def sample_for(seconds: float, period_ms: float = 10.0, **kwargs) -> ActivitySeries:
    """Sample for ``seconds`` and return the series (handy for checking idle GPU activity)."""
    with Sampler(period_ms=period_ms, **kwargs) as s:
        time.sleep(seconds)
    return s.series()
