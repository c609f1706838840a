"""Kernel-level GPU traces of a jitted program, mapped to component paths.

:func:`kernel_trace` runs ``jax.jit(fn)(*args)`` under ``jax.profiler.trace(logdir)``, reads the
written ``*.xplane.pb`` with ``jax.profiler.ProfileData.from_file`` and extracts the GPU kernel
events (``/device:GPU:<i>`` planes, one line per CUDA stream): name, start, duration, stream.
Each kernel is mapped to a component path through the strings of its stats (XLA annotates
kernels with ``hlo_op``/``hlo_module``, sometimes the op's ``op_name`` that holds the
``rose:<name>`` scopes) or, failing that, through the compiled HLO text: the HLO instruction
named by ``hlo_op`` carries ``metadata={op_name="jit(f)/rose:rollout/.../rose:sim/..."}``
(for a fusion: the common path of the instructions it fuses).

The result gives per-component kernel busy time (union of kernel intervals, all streams) and the
gaps between consecutive kernels -- the idle windows *inside* phases that NVML's ~100 ms GPM
resolution cannot see.

Opening the trace yourself: the ``logdir`` holds ``plugins/profile/<run>/<host>.xplane.pb``.
  * TensorBoard / XProf: ``pip install tensorboard-plugin-profile`` (or ``xprof``), then
    ``tensorboard --logdir <logdir>`` (or ``xprof --port 8791 <logdir>``) and open the Profile
    tab's trace viewer.
  * Perfetto: ``jax.profiler.trace(logdir, create_perfetto_trace=True)`` also writes
    ``perfetto_trace.json.gz`` next to it; load that file at https://ui.perfetto.dev.
Note: while profiling, XLA runs without CUDA graphs by default, so timings differ a little from
an unprofiled run.
"""

from __future__ import annotations

import glob
import os
import re
import time
import warnings
from typing import Callable, NamedTuple, Sequence

import jax

from rose_jax.program import COMPONENT_PREFIX

_ROSE_RE = re.compile(re.escape(COMPONENT_PREFIX) + r"([^/():\"]+)")
UNKNOWN = "(unknown)"
_DERIVED_LINES = (
    "XLA Modules",
    "XLA Ops",
    "XLA TraceMe",
    "Steps",
    "Launch Stats",
    "Source code",
    "Framework Name Scope",
    "Framework Ops",
    "TensorFlow Name Scope",
    "TensorFlow Ops",
)


class KernelEvent(NamedTuple):
    """One GPU activity: ``kind`` is 'kernel' or 'memcpy'; times in ns on the trace's clock."""

    name: str
    start_ns: float
    duration_ns: float
    stream: str
    path: str
    hlo_op: str
    kind: str = "kernel"


class Gap(NamedTuple):
    """Idle time between two consecutive kernels (all streams merged): ``path`` is the component
    of both neighbours when they agree, else ``'<before> -> <after>'``."""

    start_ns: float
    duration_ns: float
    path: str
    before: str
    after: str


class KernelTrace(NamedTuple):
    """Result of :func:`kernel_trace`. ``available`` False (with ``reason``) on a machine without a
    GPU; then the other fields are empty."""

    available: bool
    reason: str
    events: tuple
    busy_ns: dict  # path -> ns with at least one kernel of that path running
    gaps: tuple  # Gap, sorted by duration, longest first
    span_ns: float  # first kernel start -> last kernel end
    trace_file: str | None
    logdir: str | None


# -- HLO text -> component paths ----------------------------------------------------------------
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP_RE = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')
_CALLS_RE = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")


def hlo_component_paths(hlo_text: str) -> dict[str, str]:
    """Map HLO instruction names to component path strings ('' when outside any component).

    An instruction's path is read from its ``op_name`` metadata; an instruction without one
    (typically a fusion) gets the longest common path of the instructions in the computations it
    calls.
    """
    own: dict[str, tuple] = {}
    has_meta: dict[str, bool] = {}
    calls: dict[str, list[str]] = {}
    comp_members: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _INSTR_RE.match(line)
        if m and "=" in line and not line.rstrip().endswith("{"):
            name, rest = m.group(1), m.group(2)
            op = _OPNAME_RE.search(rest)
            own[name] = tuple(_ROSE_RE.findall(op.group(1))) if op else ()
            has_meta[name] = op is not None
            called = []
            for c in _CALLS_RE.findall(rest):
                called += [x.strip().lstrip("%") for x in c.split(",") if x.strip()]
            calls[name] = called
            if current is not None:
                comp_members.setdefault(current, []).append(name)
            continue
        c = _COMP_RE.match(line)
        if c and line.rstrip().endswith("{"):
            current = c.group(1)
        elif line.strip() == "}":
            current = None

    memo: dict[str, tuple] = {}

    def path_of(name: str, depth: int = 0) -> tuple:
        if name in memo:
            return memo[name]
        memo[name] = own.get(name, ())
        if (not has_meta.get(name) or not own.get(name)) and calls.get(name) and depth < 8:
            inner = [path_of(m, depth + 1) for comp in calls[name] for m in comp_members.get(comp, [])]
            inner = [p for p in inner if p]
            if inner:
                memo[name] = _lcp(inner)
        return memo[name]

    return {name: "/".join(path_of(name)) for name in own}


def _lcp(paths: list[tuple]) -> tuple:
    first = paths[0]
    n = len(first)
    for p in paths[1:]:
        n = min(n, len(p))
        for i in range(n):
            if p[i] != first[i]:
                n = i
                break
    return first[:n]


# -- XSpace -> kernel events --------------------------------------------------------------------
def _stats(ev) -> dict:
    out = {}
    with warnings.catch_warnings():  # jaxlib's stats iterator type warns about its __module__
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            for k, v in ev.stats:
                out[str(k)] = v
        except (TypeError, ValueError):
            pass
    return out


def events_from_profile(
    profile_data,
    hlo_paths: dict[str, str] | None = None,
    plane_prefix: str = "/device:GPU:",
    module: str | None = None,
) -> list[KernelEvent]:
    """Kernel/memcpy events of planes named ``plane_prefix*`` in a ``jax.profiler.ProfileData``.

    Events need an ``hlo_op`` or ``kernel_details`` stat (XLA ops / CUDA kernels); with
    ``module``, only events whose ``hlo_module`` stat starts with it are kept.
    """
    hlo_paths = hlo_paths or {}
    out: list[KernelEvent] = []
    for plane in profile_data.planes:
        if not str(plane.name).startswith(plane_prefix):
            continue
        for line in plane.lines:
            lname = str(line.name)
            if lname.startswith(_DERIVED_LINES):
                continue
            for ev in line.events:
                st = _stats(ev)
                hlo_op = str(st.get("hlo_op", ""))
                if not hlo_op and "kernel_details" not in st and "memcpy_details" not in st:
                    continue
                mod = str(st.get("hlo_module", ""))
                if module is not None and mod and not mod.startswith(module):
                    continue
                path = None
                for v in st.values():
                    if isinstance(v, str) and COMPONENT_PREFIX in v:
                        path = "/".join(_ROSE_RE.findall(v))
                        break
                if path is None:
                    ops = [o.strip() for o in hlo_op.split(",") if o.strip()]
                    found = [hlo_paths[o] for o in ops if o in hlo_paths]
                    path = found[0] if found else (UNKNOWN if ops or not hlo_paths else UNKNOWN)
                if path == "":
                    path = "(glue)"
                name = str(ev.name)
                kind = (
                    "memcpy"
                    if ("memcpy_details" in st or name.lower().startswith(("memcpy", "memset")))
                    else "kernel"
                )
                out.append(
                    KernelEvent(name, float(ev.start_ns), float(ev.duration_ns), lname, path, hlo_op, kind)
                )
    out.sort(key=lambda e: e.start_ns)
    return out


def busy_and_gaps(events: Sequence[KernelEvent], min_gap_ns: float = 0.0) -> tuple[dict, list[Gap], float]:
    """Per-path busy ns (union of that path's intervals), gaps between kernels, and the span."""
    kern = sorted((e for e in events if e.kind == "kernel"), key=lambda e: e.start_ns)
    busy: dict[str, float] = {}
    by_path: dict[str, list[tuple[float, float]]] = {}
    for e in kern:
        by_path.setdefault(e.path, []).append((e.start_ns, e.start_ns + e.duration_ns))
    for path, iv in by_path.items():
        total, cur_a, cur_b = 0.0, None, None
        for a, b in sorted(iv):
            if cur_b is None or a > cur_b:
                if cur_b is not None:
                    total += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        if cur_b is not None:
            total += cur_b - cur_a
        busy[path] = total
    gaps: list[Gap] = []
    end, last = None, None
    for e in kern:
        if end is not None and e.start_ns - end > min_gap_ns:
            path = e.path if e.path == last.path else f"{last.path} -> {e.path}"
            gaps.append(Gap(end, e.start_ns - end, path, last.path, e.path))
        if end is None or e.start_ns + e.duration_ns > end:
            end, last = e.start_ns + e.duration_ns, e
    gaps.sort(key=lambda g: -g.duration_ns)
    span = (end - kern[0].start_ns) if kern else 0.0
    return busy, gaps, span


def _newest_xplane(logdir: str, since: float) -> str | None:
    files = [
        f
        for f in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if os.path.getmtime(f) >= since - 1
    ]
    return max(files, key=os.path.getmtime) if files else None


def kernel_trace(
    fn: Callable, *args, logdir: str, repeats: int = 1, min_gap_us: float = 2.0, require_gpu: bool = True
) -> KernelTrace:
    """Trace ``repeats`` calls of ``jax.jit(fn)(*args)`` (after a warm-up) and map kernels to components.

    On a machine whose JAX backend is not GPU this returns ``KernelTrace(available=False,
    reason='no GPU: ...')`` without tracing (``require_gpu=False`` traces the host's XLA ops
    instead, which only exercises the plumbing).
    """
    backend = jax.default_backend()
    if require_gpu and backend != "gpu":
        return KernelTrace(False, f"no GPU: JAX backend is {backend!r}", (), {}, (), 0.0, None, logdir)
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    try:
        hlo_text = jitted.lower(*args).compile().as_text()
    except Exception:  # noqa: BLE001 - mapping falls back to stats only
        hlo_text = ""
    hlo_paths = hlo_component_paths(hlo_text) if hlo_text else {}
    os.makedirs(logdir, exist_ok=True)
    since = time.time()
    with jax.profiler.trace(logdir):
        for _ in range(repeats):
            jax.block_until_ready(jitted(*args))
    path = _newest_xplane(logdir, since)
    if path is None:
        return KernelTrace(
            False, f"jax.profiler wrote no .xplane.pb under {logdir}", (), {}, (), 0.0, None, logdir
        )
    data = jax.profiler.ProfileData.from_file(path)
    prefix = "/device:GPU:" if backend == "gpu" else "/host:CPU"
    events = events_from_profile(data, hlo_paths, prefix)
    busy, gaps, span = busy_and_gaps(events, min_gap_us * 1e3)
    reason = "" if events else f"no kernel events on {prefix}* planes"
    return KernelTrace(bool(events), reason, tuple(events), busy, tuple(gaps), span, path, logdir)


def busy_table(trace: KernelTrace, limit: int = 20) -> str:
    """Markdown: per-component kernel busy time and the share of the traced span."""
    if not trace.available:
        return f"(no kernel trace: {trace.reason})"
    lines = ["| path | busy ms | share of span |", "|---|---:|---:|"]
    for path, ns in sorted(trace.busy_ns.items(), key=lambda kv: -kv[1])[:limit]:
        share = ns / trace.span_ns if trace.span_ns else float("nan")
        lines.append(f"| {path} | {ns * 1e-6:.3f} | {share:.3f} |")
    return "\n".join(lines)
