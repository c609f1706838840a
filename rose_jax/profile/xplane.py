"""Kernel-level GPU traces of a jitted program, mapped to component paths.

:func:`kernel_trace` runs ``jax.jit(fn)(*args)`` under ``jax.profiler.trace(logdir)``, reads the
written ``*.xplane.pb`` and extracts the GPU kernel events (``/device:GPU:<i>`` planes, one line
per CUDA stream): name, start, duration, stream. :func:`trace_from_file` does the same for a trace
recorded elsewhere.

What a kernel event carries (jax 0.11, H200): ``hlo_module``, ``program_id``, ``hlo_op``,
``correlation_id``, ``kernel_details``; kernels launched as part of a CUDA graph also carry
``cuda_graph_id`` and their ``hlo_op`` is only the graph's thunk (``command_buffer_<n>``), while
the few ops run outside a graph carry a ``name`` stat with the op's name stack. The kernel's own
*name* is the fused HLO instruction's name sanitized (``loop_add_fusion.33`` ->
``loop_add_fusion_33``). The op names live in the trace itself: the ``/host:metadata`` plane has
one event metadata per XLA module (``jit_iterate(<program_id>)``) whose ``Hlo Proto`` stat is the
serialized optimized ``xla.HloProto``; each instruction's ``metadata.op_name`` holds the jax name
stack (``jit(iterate)/rose:rollout/while/body/rose:sim/...``). So a kernel is mapped (see
:func:`events_from_profile`) through a ``rose:`` stat, else its ``hlo_op``, else its name, to an
instruction of its module (by ``program_id``), whose path is its ``op_name``'s ``rose:`` scopes
or, for a fusion without its own, the common path of the instructions it fuses; graph-added
kernels that name no instruction (``memcpy32_post``, gemm kernels) get the common path of the
resolved kernels of their command buffer. The protos are read with a small protobuf wire-format
reader (no generated classes needed); the compiled HLO text fills in modules a trace lacks.

The result gives per-component kernel busy time (union of kernel intervals, all streams) and the
gaps between consecutive kernels -- the idle windows *inside* phases that NVML's ~100 ms GPM
resolution cannot see.

Opening the trace yourself: the ``logdir`` holds ``plugins/profile/<run>/<host>.xplane.pb``.
  * TensorBoard / XProf: ``pip install tensorboard-plugin-profile`` (or ``xprof``), then
    ``tensorboard --logdir <logdir>`` (or ``xprof --port 8791 <logdir>``) and open the Profile
    tab's trace viewer.
  * Perfetto: ``jax.profiler.trace(logdir, create_perfetto_trace=True)`` also writes
    ``perfetto_trace.json.gz`` next to it; load that file at https://ui.perfetto.dev.
Note: kernel timings under the profiler (CUPTI) differ a little from an unprofiled run.
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
from rose_jax.jaxpr.compat import collapse_repeats
from rose_jax.jaxpr.cut import lcp

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
    (typically a fusion or a command buffer) gets the longest common path of the instructions in
    the computations it calls.
    """
    own: dict[str, tuple | None] = {}
    calls: dict[str, list[str]] = {}
    comp_members: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _INSTR_RE.match(line)
        if m and "=" in line and not line.rstrip().endswith("{"):
            name, rest = m.group(1), m.group(2)
            op = _OPNAME_RE.search(rest)
            own[name] = _scopes(op.group(1)) if op else None
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
    return _resolve_paths(own, calls, comp_members)


def _scopes(op_name: str) -> tuple:
    """``rose:`` scopes of an ``op_name``, repeats collapsed like the tracer does (a backward pass
    reads ``rose:a/transpose(rose:a)/...``); XLA joins the names of merged ops with ';', which
    gives their longest common path."""
    parts = [collapse_repeats(_ROSE_RE.findall(p)) for p in op_name.split(";") if p.strip()]
    return lcp(parts) if parts else ()


def _resolve_paths(
    own: dict[str, tuple | None], calls: dict[str, list], comp_members: dict[str, list[str]]
) -> dict[str, str]:
    """Instruction -> '/'-joined component path: its own ``op_name`` scopes when it has any, else
    the longest common path of the (non-empty) paths in the computations it calls."""
    memo: dict[str, tuple] = {}

    def path_of(name: str, depth: int = 0) -> tuple:
        if name in memo:
            return memo[name]
        memo[name] = own.get(name) or ()
        if not own.get(name) and calls.get(name) and depth < 12:
            inner = [path_of(m, depth + 1) for comp in calls[name] for m in comp_members.get(comp, [])]
            inner = [p for p in inner if p]
            if inner:
                memo[name] = lcp(inner)
        return memo[name]

    return {name: "/".join(path_of(name)) for name in own}


# -- protobuf wire format (XSpace / HloProto) without generated classes ------------------------
def _varint(b, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def _pb_fields(b):
    """Yield ``(field_number, value)`` of a serialized protobuf message: ints for varints,
    memoryview slices for length-delimited fields (fixed-width fields are skipped)."""
    i, n = 0, len(b)
    while i < n:
        key, i = _varint(b, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 2:
            ln, i = _varint(b, i)
            v, i = b[i : i + ln], i + ln
        elif wire == 1:
            i += 8
            continue
        elif wire == 5:
            i += 4
            continue
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {field})")
        yield field, v


def _pb_str(v) -> str:
    return bytes(v).decode("utf-8", "replace")


# xla/service/hlo.proto field numbers (stable): HloProto.hlo_module=1; HloModuleProto
# .computations=3; HloComputationProto .name=1 .instructions=2 .id=5; HloInstructionProto .name=1
# .metadata=7 .called_computation_ids=38; OpMetadata.op_name=2.
def hlo_proto_component_paths(hlo_proto: bytes) -> dict[str, str]:
    """Like :func:`hlo_component_paths` for a serialized ``xla.HloProto`` (or
    ``HloModuleProto``), e.g. the ``Hlo Proto`` stat of a trace's ``/host:metadata`` plane."""
    b = memoryview(hlo_proto)
    module = b
    top = list(_pb_fields(b))
    if top and top[0][0] == 1 and not isinstance(top[0][1], int):
        try:  # HloProto.hlo_module (a message), or HloModuleProto.name (a string)
            first = next(_pb_fields(top[0][1]), None)
        except (ValueError, IndexError):
            first = None
        if first is not None and first[0] == 1 and not isinstance(first[1], int):
            module = top[0][1]
    own: dict[str, tuple | None] = {}
    calls_ids: dict[str, list[int]] = {}
    comp_members: dict[str, list[str]] = {}
    comp_name: dict[int, str] = {}
    for f, comp in _pb_fields(module):
        if f != 3 or isinstance(comp, int):
            continue
        cname, cid, members = "", None, []
        for g, v in _pb_fields(comp):
            if g == 1 and not isinstance(v, int):
                cname = _pb_str(v)
            elif g == 5 and isinstance(v, int):
                cid = v
            elif g == 2 and not isinstance(v, int):
                name, op_name, called = "", None, []
                for h, w in _pb_fields(v):
                    if h == 1 and not isinstance(w, int):
                        name = _pb_str(w)
                    elif h == 7 and not isinstance(w, int):
                        for k, x in _pb_fields(w):
                            if k == 2 and not isinstance(x, int):
                                op_name = _pb_str(x)
                    elif h == 38:
                        if isinstance(w, int):
                            called.append(w)
                        else:  # packed
                            j = 0
                            while j < len(w):
                                x, j = _varint(w, j)
                                called.append(x)
                own[name] = _scopes(op_name) if op_name else None
                calls_ids[name] = called
                members.append(name)
        comp_members[cname] = members
        if cid is not None:
            comp_name[cid] = cname
    calls = {n: [comp_name[c] for c in ids if c in comp_name] for n, ids in calls_ids.items()}
    return _resolve_paths(own, calls, comp_members)


_PROGRAM_ID_RE = re.compile(r"^(.*)\((\d+)\)$")


def xspace_module_paths(xspace: bytes) -> dict[str, dict[str, str]]:
    """HLO instruction -> component path for every XLA module in a serialized XSpace (the
    ``*.xplane.pb`` file), from the ``Hlo Proto`` stats of its ``/host:metadata`` plane.

    Keyed by program id (the ``program_id`` stat of kernel events) and by module name (the
    ``hlo_module`` stat; a name recorded with several ids keeps the last). Empty when the trace
    holds no HLO protos.
    """
    out: dict[str, dict[str, str]] = {}
    b = memoryview(xspace)
    for f, plane in _pb_fields(b):  # XSpace.planes = 1
        if f != 1 or isinstance(plane, int):
            continue
        name, metas, stat_names = "", [], {}
        for g, v in _pb_fields(plane):  # XPlane: name=2, event_metadata=4, stat_metadata=5
            if g == 2 and not isinstance(v, int):
                name = _pb_str(v)
                if name != "/host:metadata":
                    break
            elif g == 4 and not isinstance(v, int):
                metas.append(v)
            elif g == 5 and not isinstance(v, int):
                for h, entry in _pb_fields(v):  # map entry: key=1, value=2 (XStatMetadata)
                    if h == 2 and not isinstance(entry, int):
                        d = {k: x for k, x in _pb_fields(entry)}
                        if not isinstance(d.get(2, 0), int):
                            stat_names[d.get(1, 0)] = _pb_str(d[2])
        if name != "/host:metadata":
            continue
        hlo_ids = {i for i, s in stat_names.items() if s.replace(" ", "_").lower() == "hlo_proto"}
        for entry in metas:
            for h, em in _pb_fields(entry):
                if h != 2 or isinstance(em, int):
                    continue
                mname, proto = "", None
                for k, x in _pb_fields(em):  # XEventMetadata: name=2, stats=5
                    if k == 2 and not isinstance(x, int):
                        mname = _pb_str(x)
                    elif k == 5 and not isinstance(x, int):
                        st = {j: y for j, y in _pb_fields(x)}  # XStat: metadata_id=1, bytes_value=6
                        if st.get(1) in hlo_ids and not isinstance(st.get(6, 0), int):
                            proto = st[6]
                if proto is None:
                    continue
                paths = hlo_proto_component_paths(proto)
                m = _PROGRAM_ID_RE.match(mname)
                if m:
                    out[m.group(2)] = paths
                    out[m.group(1)] = paths
                else:
                    out[mname] = paths
    return out


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


_SANITIZE_RE = re.compile(r"[^A-Za-z0-9_]")


def _kernel_index(paths: dict[str, str]) -> dict[str, str]:
    """HLO instruction paths keyed by the CUDA kernel name XLA gives them ('.' and '-' -> '_')."""
    return {_SANITIZE_RE.sub("_", k): v for k, v in paths.items()}


def _path_of_kernel(name: str, kernels: dict[str, str]) -> str | None:
    """A kernel's instruction path: exact sanitized name, else the longest '_'-prefix naming an
    instruction (``sort_48_1__2`` is a stage of ``sort.48``)."""
    key = _SANITIZE_RE.sub("_", name)
    if key in kernels:
        return kernels[key]
    parts = key.split("_")
    for n in range(len(parts) - 1, 1, -1):
        p = kernels.get("_".join(parts[:n]))
        if p is not None:
            return p
    return None


def events_from_profile(
    profile_data,
    hlo_paths: dict[str, str] | None = None,
    plane_prefix: str = "/device:GPU:",
    module: str | None = None,
    module_paths: dict[str, dict[str, str]] | None = None,
) -> list[KernelEvent]:
    """Kernel/memcpy events of planes named ``plane_prefix*`` in a ``jax.profiler.ProfileData``.

    Events need an ``hlo_op`` or ``kernel_details`` stat (XLA ops / CUDA kernels); with
    ``module``, only events whose ``hlo_module`` stat starts with it are kept.

    Paths (first that applies): a stat holding ``rose:`` scopes (the ``name`` stat of ops run
    outside a CUDA graph); the ``hlo_op`` instruction; the instruction named by the kernel
    (inside a CUDA graph ``hlo_op`` is only ``command_buffer_<n>``, the kernel name is the fused
    instruction's); else the common path of the resolved kernels of the same command buffer
    (memcpy/gemm kernels a graph adds). Instruction paths come from ``module_paths`` (per program
    id / module name, see :func:`xspace_module_paths`), else from ``hlo_paths``. '' -> '(glue)'.
    """
    module_paths = module_paths or {}
    fallback = hlo_paths or {}
    indexes: dict[int, dict[str, str]] = {}
    rows: list[list] = []
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
                paths = module_paths.get(str(st.get("program_id", ""))) or module_paths.get(mod) or fallback
                kernels = indexes.get(id(paths))
                if kernels is None:
                    kernels = indexes[id(paths)] = _kernel_index(paths)
                name = str(ev.name)
                path = None
                for v in st.values():
                    if isinstance(v, str) and COMPONENT_PREFIX in v:
                        path = "/".join(_scopes(v))
                        break
                ops = [o.strip() for o in hlo_op.split(",") if o.strip()]
                if path is None:
                    found = [paths[o] for o in ops if o in paths]
                    path = found[0] if found else _path_of_kernel(name, kernels)
                # a copy engine transfer; XLA's own copy kernels (``memcpy32_post``) run on SMs
                kind = (
                    "memcpy"
                    if "memcpy_details" in st
                    or (name.lower().startswith(("memcpy", "memset")) and "kernel_details" not in st)
                    else "kernel"
                )
                group = (str(st.get("program_id", mod)), ops[0]) if ops else None
                rows.append(
                    [name, float(ev.start_ns), float(ev.duration_ns), lname, path, hlo_op, kind, group]
                )
    # A command buffer's path: the common path of its kernels that were resolved to a component.
    members: dict[tuple, list[tuple]] = {}
    for r in rows:
        if r[4] and r[7] is not None:
            members.setdefault(r[7], []).append(tuple(r[4].split("/")))
    group_path = {g: "/".join(lcp(ps)) for g, ps in members.items()}
    out: list[KernelEvent] = []
    for name, start, dur, lname, path, hlo_op, kind, group in rows:
        if path is None:
            path = group_path.get(group, UNKNOWN) if group is not None else UNKNOWN
        out.append(KernelEvent(name, start, dur, lname, path or "(glue)", hlo_op, kind))
    out.sort(key=lambda e: e.start_ns)
    return out


def events_from_file(path: str, hlo_paths: dict[str, str] | None = None, **kw) -> list[KernelEvent]:
    """:func:`events_from_profile` of a ``*.xplane.pb`` file, with the instruction paths of the
    HLO protos the trace holds (``hlo_paths`` fills in modules it lacks)."""
    with open(path, "rb") as f:
        raw = f.read()
    data = jax.profiler.ProfileData.from_file(path)
    return events_from_profile(data, hlo_paths, module_paths=xspace_module_paths(raw), **kw)


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


def newest_xplane(logdir: str, since: float) -> str | None:
    """The newest ``*.xplane.pb`` under ``logdir`` written since ``since`` (unix seconds), or None."""
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
    path = newest_xplane(logdir, since)
    if path is None:
        return KernelTrace(
            False, f"jax.profiler wrote no .xplane.pb under {logdir}", (), {}, (), 0.0, None, logdir
        )
    prefix = "/device:GPU:" if backend == "gpu" else "/host:CPU"
    return trace_from_file(path, hlo_paths, plane_prefix=prefix, min_gap_us=min_gap_us, logdir=logdir)


def trace_from_file(
    path: str,
    hlo_paths: dict[str, str] | None = None,
    plane_prefix: str = "/device:GPU:",
    min_gap_us: float = 2.0,
    logdir: str | None = None,
) -> KernelTrace:
    """:class:`KernelTrace` of an existing ``*.xplane.pb`` (e.g. one recorded on another machine):
    events mapped by :func:`events_from_file`, gaps longer than ``min_gap_us`` microseconds."""
    if not os.path.isfile(path):
        raise ValueError(f"no such trace file: {path!r}")
    events = events_from_file(path, hlo_paths, plane_prefix=plane_prefix)
    busy, gaps, span = busy_and_gaps(events, min_gap_us * 1e3)
    reason = "" if events else f"no kernel events on {plane_prefix}* planes"
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


def kernels_markdown(name: str, trace: KernelTrace, trace_label: str | None = None, gaps: int = 20) -> str:
    """The ``<config>.kernels.md`` report: busy table and the ``gaps`` longest kernel gaps."""
    label = trace.trace_file if trace_label is None else trace_label
    return (
        f"# {name}: kernel busy time per component\n\ntrace: {label}\n\n"
        + busy_table(trace)
        + "\n\n## longest gaps between kernels\n\n| path | gap us |\n|---|---:|\n"
        + "\n".join(f"| {g.path} | {g.duration_ns / 1e3:.1f} |" for g in trace.gaps[:gaps])
        + "\n"
    )
