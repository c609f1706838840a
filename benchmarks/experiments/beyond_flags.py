"""Issue 32's question: does a restructuring beat the best XLA flags alone on the same program?

    python -m benchmarks.experiments.beyond_flags --workloads sac-hopper,ppo-ant
    python -m benchmarks.experiments.beyond_flags --smoke          # CPU: tiny PPO, any machine

Per workload (informed_peer's: Brax's published configs through ``rose-jax train``'s own
config path, :func:`benchmarks.experiments.informed_peer.rose_argv`), one process builds the
iteration ``rose-jax train`` runs (``cli.train_job``) and compiles it under the best option set
(``--options``, default ``concurrent_scheduling``: the informed user's flag, per program):

- ``flags_only``: the iteration, jitted, under the options;
- ``hoist``: ``hoist_independent()`` (every scan's carry-independent work ahead of the loop, see
  ``rose_jax/optimize/hoist.py``) under the same options;
- ``hoist:WHERE``: the same, on the loops matching a where spec only (``update``: PPO's update loops);
- ``inplace`` / ``inplace:WHERE``: ``update_in_place()`` (every read of a loop's old carry ordered
  before the elementwise updates that overwrite it, so XLA stops copying the carry every step,
  see ``rose_jax/optimize/inplace.py``), on every scan or the matching ones;
- ``twins`` / ``twins:WHERE``: ``batch_twins()`` (two same-shaped independent networks of a loop
  body, SAC's twin critics, run as one vmap with their carried weights stacked, see
  ``rose_jax/optimize/twins.py``), on every scan or the matching ones;
- ``unroll:N``: the gradient-step (SAC) / minibatch (PPO) loops unrolled by N (``unroll_scans``),
  so that under CONCURRENT scheduling one step's tail may overlap the next one's head;
- ``set:NAME``: the plain iteration under another option set of ``xla_options.SETS`` (e.g. the
  sets for small latency-bound kernels: ``triton_gemm_any``, ``cublaslt``, ``latency_hiding``,
  ``concurrent_regions``).

Steady rates: each variant compiled and warmed, then timed in turns (``--blocks`` blocks of
``--calls`` calls, one variant after another in each turn, so drifts hit all alike), median
seconds per iteration and the blocks' min/max. Equality: ``--equal-iters`` iterations (default 1,
the search's stepwise rule: from the same state, so a rollout after an update that moved the last
bits is not compared) of each variant against ``flags_only`` under deterministic XLA ops (GPU),
compared within the transform's tolerance, with the max abs difference and the worst leaf. Where
the time goes (``--profile``, GPU): each variant's kernels per
iteration, GPU busy share, median kernel and gap (:func:`kernel_profile`). Learning check
(``--learning-check-steps N``): each variant whose transform's tolerance asks for one (e.g.
``twins``: reassociation) trains 5 seeds per side for N env steps with the workload's config
(``algos.equivalence.learning_check``, issue 32's rule: final returns not different at 5 %, means
within 5 %), recorded as the row's ``learning_check``. Writes
``results.json``, ``results.md`` and ``results.png`` into
``--out`` (default ``benchmarks/results/beyond_flags``); ``--merge`` adds to an earlier call's rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from benchmarks import common
from rose_jax.io import atomic_write_json

OUT_DIR = os.path.join(common.RESULTS_DIR, "beyond_flags")
VARIANTS = ("flags_only", "hoist")
# unroll:N variants unroll the gradient-step / minibatch loops (their steps then overlap under
# CONCURRENT scheduling: step i's tail beside step i+1's head)
UNROLL_LOOPS = ("_grad_step", "minibatch_step")


# the parameterised variant forms beside VARIANTS (what both unknown-variant errors list)
VARIANT_FORMS = "hoist:WHERE, inplace, inplace:WHERE, twins, twins:WHERE, unroll:N, set:NAME"


def UNROLL_WHERE(site) -> bool:  # noqa: N802 - a where spec, named like the constants it replaces
    return getattr(site, "name", "") in UNROLL_LOOPS


def build(name: str, smoke: bool):
    """``(job, iteration, state, env steps per iteration)`` of workload ``name``."""
    import jax

    from benchmarks.experiments import informed_peer
    from rose_jax import cli

    w = informed_peer.workloads()[name]
    argv = informed_peer.rose_argv(w, w["steps"], smoke)
    job = cli.train_job(argv)
    fn = job.algo.iteration(job.config, job.algo.train_env(job.config, job.env))
    state = job.algo.init(job.config, job.env, jax.random.PRNGKey(job.config.seed))
    return job, fn, state, int(job.config.env_steps_per_iteration), argv


def transform_of(variant: str):
    """The Transform a variant applies (None: the plain iteration)."""
    from rose_jax.optimize import batch_twins, hoist_independent, unroll_scans, update_in_place

    if variant == "flags_only" or variant.startswith("set:"):
        return None
    if variant == "hoist":
        return hoist_independent()
    if variant.startswith("hoist:"):  # one loop (a where spec: "update", "train_steps/_grad_step")
        return hoist_independent(where=variant[6:])
    if variant == "inplace":
        return update_in_place()
    if variant.startswith("inplace:"):
        return update_in_place(where=variant[8:])
    if variant == "twins":
        return batch_twins()
    if variant.startswith("twins:"):
        return batch_twins(where=variant[6:])
    if variant.startswith("unroll:"):
        return unroll_scans(int(variant[7:]), where=UNROLL_WHERE)
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}, {VARIANT_FORMS}")


def variant_fn(variant: str, fn):
    t = transform_of(variant)
    return fn if t is None else t.apply(fn)


def variant_options(variant: str, options: dict[str, Any], on_gpu: bool) -> dict[str, Any]:
    """``set:NAME`` variants compile the plain iteration under xla_options.SETS[NAME] instead."""
    from rose_jax.optimize import xla_options

    if variant.startswith("set:"):
        return dict(xla_options.SETS[variant[4:]]) if on_gpu else {}
    return options


def _compile(fn, state, options: dict[str, Any]):
    import jax

    t0 = time.perf_counter()
    step = jax.jit(fn).lower(state).compile(compiler_options=options or None)
    return step, time.perf_counter() - t0


def _block(step, state, calls: int):
    import jax

    t0 = time.perf_counter()
    for _ in range(calls):
        state, m = step(state)
    jax.block_until_ready((state, m))
    return state, (time.perf_counter() - t0) / calls


def kernel_profile(step, state, calls: int) -> tuple[Any, dict[str, Any]]:
    """Where an iteration's time goes: ``calls`` calls under ``jax.profiler`` (xplane kernel events,
    :mod:`rose_jax.profile.xplane`), per iteration: kernels launched, GPU busy time (union of kernel
    intervals, all streams), the share of the wall it covers, the median kernel and gap lengths,
    and the longest kernels by total time. ``{"available": False, "reason": ...}`` without a GPU."""
    import tempfile

    import jax

    from rose_jax.profile import xplane

    if jax.default_backend() != "gpu":
        return state, {"available": False, "reason": f"no GPU: JAX backend is {jax.default_backend()!r}"}
    logdir = tempfile.mkdtemp(prefix="beyond-flags-trace-")
    since = time.time()
    t0 = time.perf_counter()
    with jax.profiler.trace(logdir):
        for _ in range(calls):
            state, m = step(state)
        jax.block_until_ready((state, m))
    wall = (time.perf_counter() - t0) / calls
    path = xplane.newest_xplane(logdir, since)
    if path is None:
        return state, {"available": False, "reason": "jax.profiler wrote no trace"}
    trace = xplane.trace_from_file(path, {}, min_gap_us=0.0)
    kern = [e for e in trace.events if e.kind == "kernel"]
    if not kern:
        return state, {"available": False, "reason": trace.reason or "no kernel events"}
    busy_by, gap_list, span = xplane.busy_and_gaps([e._replace(path="all") for e in kern])
    busy = busy_by.get("all", 0.0)  # the union of every kernel's interval, all streams
    durs = sorted(e.duration_ns for e in kern)
    gaps = sorted(g.duration_ns for g in gap_list)
    by_name: dict[str, float] = {}
    for e in kern:
        base = _kernel_kind(e.name)
        by_name[base] = by_name.get(base, 0.0) + e.duration_ns
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    by_component = component_split(kern, calls)
    return state, {
        "available": True,
        "calls": calls,
        "wall_ms_per_iteration_profiled": round(wall * 1e3, 3),
        "kernels_per_iteration": len(kern) / calls,
        "busy_ms_per_iteration": round(busy / calls * 1e-6, 3),
        "busy_share_of_span": round(busy / span, 3) if span else None,
        "median_kernel_us": round(durs[len(durs) // 2] / 1e3, 2),
        "median_gap_us": round(gaps[len(gaps) // 2] / 1e3, 2) if gaps else None,
        "top_kernels_ms_per_iteration": {k: round(v / calls * 1e-6, 3) for k, v in top},
        "by_component": by_component,
    }


def _kernel_kind(name: str) -> str:
    """A kernel's name without XLA's numeric suffix: ``loop_add_fusion_12`` -> ``loop_add_fusion``."""
    return name.rstrip("0123456789_")


def component_split(kernels, calls: int) -> dict[str, dict[str, Any]]:
    """Per top-level component (``collect``, ``train_steps``, ``rollout``, ...; the kernel's
    component path from the trace's HLO, :mod:`rose_jax.profile.xplane`): kernels and kernel
    milliseconds per iteration, and that component's three longest kernel kinds."""
    out: dict[str, dict[str, Any]] = {}
    names: dict[str, dict[str, float]] = {}
    for e in kernels:
        comp = (e.path or "(glue)").split("/")[0] or "(glue)"
        ms = e.duration_ns * 1e-6
        rec = out.setdefault(comp, {"kernels": 0, "kernel_ms": 0.0})
        rec["kernels"] += 1
        rec["kernel_ms"] += ms
        by_kind = names.setdefault(comp, {})
        kind = _kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    for comp, rec in out.items():
        rec["kernels"] = round(rec["kernels"] / calls, 1)
        rec["kernel_ms"] = round(rec["kernel_ms"] / calls, 3)
        top = sorted(names[comp].items(), key=lambda kv: -kv[1])[:3]
        rec["top_ms"] = {k: round(v / calls, 3) for k, v in top}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["kernel_ms"]))


def measure(name: str, args, options: dict[str, Any]) -> dict[str, Any]:
    import jax

    job, fn, state0, env_steps, argv = build(name, args.smoke)
    machine = common.machine_info(jax_devices=True)
    call = machine.get("date")
    device = machine.get("gpu") or machine.get("platform")
    on_gpu = jax.default_backend() == "gpu"
    steps, states, compile_s, legal = {}, {}, {}, {}
    for v in args.variants:
        try:
            f = variant_fn(v, fn)
            t = transform_of(v)
            if t is not None:
                from rose_jax import trace as rtrace

                legal[v] = t.legal(rtrace.trace(fn, state0))[1]
            steps[v], compile_s[v] = _compile(f, state0, variant_options(v, options, on_gpu))
            states[v], _ = _block(steps[v], state0, 2)  # warm
            common.log(f"{name} {v}: compiled in {compile_s[v]:.1f}s")
        except Exception as e:  # noqa: BLE001 - one variant's failure is reported, the rest go on
            common.log(f"{name} {v}: failed: {type(e).__name__}: {e}")
            legal[v] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    per: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(args.blocks):
        for v in steps:
            states[v], s = _block(steps[v], states[v], args.calls)
            per[v].append(s)
    profiles = {}
    if args.profile:
        for v in steps:
            try:
                states[v], profiles[v] = kernel_profile(steps[v], states[v], args.profile_calls)
            except Exception as e:  # noqa: BLE001 - a failed trace is a note, never lost timings
                profiles[v] = {"available": False, "reason": f"{type(e).__name__}: {e}"[:300]}
    rows = []
    base = statistics.median(per["flags_only"]) if per.get("flags_only") else None
    for v in args.variants:
        rec: dict[str, Any] = {
            "workload": name,
            "variant": v,
            "options": variant_options(v, options, on_gpu),
            "legal": legal.get(v),
        }
        if v in per and per[v]:
            med = statistics.median(per[v])
            rec.update(
                seconds_per_iteration=med,
                env_steps_per_s=env_steps / med,
                spread_env_steps_per_s=[env_steps / max(per[v]), env_steps / min(per[v])],
                blocks=len(per[v]),
                calls_per_block=args.calls,
                compile_s=round(compile_s[v], 2),
                speedup_vs_flags_only=(base / med) if base else None,
            )
        if v in profiles:
            rec["profile"] = profiles[v]
        rows.append(rec)
    # equality under deterministic ops: --equal-iters iterations of each variant from the same state
    det = {**options, "xla_gpu_deterministic_ops": True} if on_gpu else dict(options)
    try:
        ref_step, _ = _compile(fn, state0, det)
        ref = common.state_after(ref_step, state0, args.equal_iters)
        for rec in rows:
            v = rec["variant"]
            if v == "flags_only" or v not in steps or v.split(":")[0] not in args.check_equal:
                continue
            v_det = {
                **variant_options(v, options, on_gpu),
                **({"xla_gpu_deterministic_ops": True} if on_gpu else {}),
            }
            from rose_jax.optimize.base import EXACT

            t = transform_of(v)  # option sets change launches, not arithmetic: bitwise
            st, _ = _compile(variant_fn(v, fn), state0, v_det)
            out = common.state_after(st, state0, args.equal_iters)
            rec.update(
                common.equality_fields(out, ref, EXACT if t is None else t.tolerance),
                equality_deterministic_ops=on_gpu,
                equality_iterations=args.equal_iters,
            )
    except Exception as e:  # noqa: BLE001
        common.log(f"{name} equality failed: {type(e).__name__}: {e}")
    if args.learning_check_steps:
        for rec in rows:
            rec.update(learning_check_fields(job, transform_of(rec["variant"]), args.learning_check_steps))
    for rec in rows:
        rec["command"] = "python -m rose_jax.cli train " + " ".join(argv)
        rec["env_steps_per_iteration"] = env_steps
        rec["call"] = call
        rec["device"] = device
    return {"rows": rows}


def learning_check_fields(job, t, steps: int) -> dict[str, Any]:
    """``{"learning_check": ...}`` for a transform whose tolerance asks for one (trained here: 5
    seeds per side of ``steps`` env steps), ``{}`` for one that does not; a failed check's error is
    recorded, never raised."""
    if t is None or not t.tolerance.learning_check:
        return {}
    import dataclasses

    from algos import equivalence

    try:
        config = dataclasses.replace(job.config, num_timesteps=int(steps))
        verdict = equivalence.checker(config, job.env)(t)
        common.log(f"learning check {t.label}: {verdict.reason}")
        return {"learning_check": verdict.to_json()}
    except Exception as e:  # noqa: BLE001 - one check's failure is a row's note, not the run's end
        return {"learning_check": {"passed": None, "reason": f"failed: {type(e).__name__}: {e}"[:300]}}


def _learning_cell(check: dict | None) -> str:
    if not check:
        return "-"
    if check.get("passed") is None:
        return f"not run ({check.get('reason')})"
    word = "passed" if check["passed"] else "failed"
    means = f"{check['mean_reference']:.1f} vs {check['mean_candidate']:.1f}"
    return f"{word}: p={check['p_value']:.2f}, means {means}"


def write(out: str, rows: list[dict[str, Any]], command: str) -> None:
    os.makedirs(out, exist_ok=True)
    info = common.machine_info(jax_devices=True)
    atomic_write_json(os.path.join(out, "results.json"), {"machine": info, "command": command, "rows": rows})
    lines = [
        "# Beyond the flag: restructurings vs the best XLA options alone (issue 32)",
        "",
        f"{info.get('date')} on {info.get('gpu') or info.get('platform')}; command: `{command}`.",
        "Same process, same option set for every variant; steady seconds per iteration = median of "
        "the timed blocks (taken in turns); equality: `equality_iterations` iterations from the same "
        "state under deterministic ops vs flags_only. Generated by `benchmarks/experiments/beyond_flags.py`.",
        "",
        common.markdown_table(
            [
                "workload",
                "call",
                "variant",
                "env-steps/s (median, min-max)",
                "vs flags_only",
                "compile s",
                "equal",
                "max abs diff",
                "learning check",
                "kernels/iter, busy share, median kernel us",
                "what moved",
            ],
            [
                [
                    r["workload"],
                    (r.get("call") or "-") + (f" ({_short_device(r['device'])})" if r.get("device") else ""),
                    r["variant"],
                    f"{common.fmt(r.get('env_steps_per_s'), ',.0f')} ("
                    + "-".join(
                        common.fmt(x, ",.0f") for x in (r.get("spread_env_steps_per_s") or [None, None])
                    )
                    + ")",
                    common.fmt(r.get("speedup_vs_flags_only"), ".3f"),
                    common.fmt(r.get("compile_s")),
                    common.fmt_equal(r.get("equal")),
                    common.fmt(r.get("max_abs_diff"), ".2e"),
                    _learning_cell(r.get("learning_check")),
                    _profile_cell(r.get("profile")),
                    (r.get("legal") or "-")[:160],
                ]
                for r in rows
            ],
        ),
    ]
    common.write_markdown_and_plot(out, lines, _plot, rows)


def _short_device(device: str) -> str:
    """``'NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB'`` -> ``'H100'``."""
    for name in ("H200", "H100", "A100", "L4"):
        if name in device:
            return name
    return device.split(",")[0][:24]


def _profile_cell(p: dict | None) -> str:
    if not p:
        return "-"
    if not p.get("available"):
        return f"not traced ({p.get('reason')})"
    cell = (
        f"{p['kernels_per_iteration']:,.0f}, {common.fmt(p.get('busy_share_of_span'), '.2f')}, "
        f"{p['median_kernel_us']}"
    )
    split = p.get("by_component") or {}
    if split:
        cell += "; " + ", ".join(
            f"{c}: {r['kernels']:,.0f} kernels {r['kernel_ms']:.1f} ms" for c, r in list(split.items())[:3]
        )
    return cell


def _plot(rows, path):  # pragma: no cover - drawing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [f"{r['workload']}\n{r['variant']}" for r in rows if r.get("env_steps_per_s")]
    vals = [r["env_steps_per_s"] for r in rows if r.get("env_steps_per_s")]
    ax.bar(range(len(vals)), vals)
    ax.set_xticks(range(len(vals)), names, fontsize=7)
    ax.set_ylabel("env-steps/s")
    ax.set_title("same options, with and without the restructuring")
    fig.tight_layout()
    common.save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="sac-hopper,ppo-ant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--options", default="concurrent_scheduling", help="a name of xla_options.SETS")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="iterations per timed block")
    p.add_argument(
        "--check-equal", default="hoist", help="comma-separated variants whose equality is checked"
    )
    p.add_argument("--profile", action="store_true", help="kernel trace of each variant (GPU)")
    p.add_argument("--profile-calls", type=int, default=3)
    p.add_argument("--equal-iters", type=int, default=1, help="iterations compared (stepwise: 1)")
    p.add_argument(
        "--learning-check-steps",
        type=int,
        default=0,
        metavar="N",
        help="env steps per seed of the learning check for variants whose tolerance asks for one (0: none)",
    )
    p.add_argument("--out", default=OUT_DIR)
    p.add_argument("--merge", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    from benchmarks.experiments import informed_peer
    from rose_jax.optimize import xla_options

    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.check_equal = {v.strip() for v in args.check_equal.split(",") if v.strip()}
    for v in args.variants:
        if (
            v not in VARIANTS
            and not (v.startswith("set:") and v[4:] in xla_options.SETS)
            and not (v.startswith("unroll:") and v[7:].isdigit() and int(v[7:]) >= 2)
            and not (v.startswith("hoist:") and len(v) > 6)
            and not (v == "inplace" or (v.startswith("inplace:") and len(v) > 8))
            and not (v == "twins" or (v.startswith("twins:") and len(v) > 6))
        ):
            p.error(
                f"unknown variant {v!r}; known: {', '.join(VARIANTS)}, {VARIANT_FORMS} "
                f"(NAME of {', '.join(xla_options.SETS)})"
            )
    if "flags_only" not in args.variants:
        args.variants.insert(0, "flags_only")
    if args.options not in xla_options.SETS:
        p.error(f"unknown option set {args.options!r}; known: {', '.join(xla_options.SETS)}")
    if args.learning_check_steps < 0:
        p.error(f"--learning-check-steps must be >= 0, got {args.learning_check_steps}")
    if args.blocks < 3:
        p.error("--blocks must be >= 3 (steady rates over at least 3 timed blocks)")
    names = ["smoke"] if args.smoke else [w.strip() for w in args.workloads.split(",") if w.strip()]
    known = informed_peer.workloads()
    for n in names:
        if n not in known:
            p.error(f"unknown workload {n!r}; known: {', '.join(known)}")
    import jax

    options = xla_options.SETS[args.options] if jax.default_backend() == "gpu" else {}
    rows: list[dict[str, Any]] = []
    if args.merge and os.path.exists(os.path.join(args.out, "results.json")):
        with open(os.path.join(args.out, "results.json")) as f:
            rows = list(json.load(f).get("rows", []))  # every earlier call's rows, each with its call
    command = "python -m benchmarks.experiments.beyond_flags " + " ".join(argv)
    for n in names:
        try:
            rows += measure(n, args, options)["rows"]
        except Exception as e:  # noqa: BLE001 - a workload's failure is a row, the rest go on
            common.log(f"{n}: failed: {type(e).__name__}: {e}")
            rows.append({"workload": n, "variant": "flags_only", "error": f"{type(e).__name__}: {e}"[:300]})
        write(args.out, rows, command)
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
