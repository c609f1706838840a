"""Where SAC high-update's iteration goes, counted on the program: issue 32's SAC floor (no GPU).

    python -m benchmarks.experiments.sac_floor                      # sac-hopper-5ep, sac-ant-5ep
    python -m benchmarks.experiments.sac_floor --workloads sac-hopper-5ep
    python -m benchmarks.experiments.sac_floor --smoke              # a tiny SAC: plumbing only

Issue 32 asks that a missed target's row "names the floor". The kernel trace of the SAC hopper
miss (``beyond_flags --profile-missed``) counts kernels per iteration by component; this script
counts, on the same program, what those kernels are, on the machine it runs on (a CPU is enough:
jaxprs do not depend on the backend, and XLA's copy insertion is one pass of every backend):

- **chains**: each loop of one training iteration (Brax's published config through
  ``rose-jax train``'s config path) with its body's longest dependency chain
  (:mod:`rose_jax.trace.depth`: operations, matrix products and kernels in series; a while loop
  whose trip count depends on the data counted once), and per iteration (trips x chain);
- **physics copies**: ``vmap(env.step)`` over the workload's environments compiled by XLA, and the
  ``copy`` instructions in each loop body of it (the carry copies XLA's copy insertion adds where
  a body reads a carried value that it also overwrites); with the trip counts, the copies per
  environment step for each number of the constraint solver's iterations (a while loop that stops
  when every environment has converged, at most ``opt.iterations``);
- **measured**: the newest acceptance row of the workload in
  ``benchmarks/results/beyond_flags/results.json`` with a kernel profile (GPU, date, kernels per
  iteration by component, ``memcpy32_post`` milliseconds), and what issue 32's target asks of it:
  the milliseconds per iteration at 1.5x the informed peer's rate.

Results: ``benchmarks/results/sac_floor/`` (``results.json``, ``results.md``, ``results.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from benchmarks import common

OUT_DIR = os.path.join(os.path.dirname(__file__), "..", "results", "sac_floor")
BEYOND = os.path.join(os.path.dirname(__file__), "..", "results", "beyond_flags", "results.json")
TARGET = 1.5  # issue 32: SAC high-update rows >= 1.5x over the informed peer

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CONTROL = re.compile(r"\s(while|call|conditional|async-start)\(")
_REF = re.compile(r"\b(body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_COPY = re.compile(r"=\s*\S+\s+copy\(")


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """``({computation name: its instruction lines}, the entry computation's name)`` of an HLO
    module's text (the entry None where it has none)."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
        elif cur is not None:
            comps[cur].append(line)
    return comps, entry


def loop_copies(hlo: str) -> dict[str, Any]:
    """The ``copy`` instructions of an optimized HLO module that run as instructions of their own
    (in the entry computation, while bodies, called computations and conditional branches; not the
    copies inside a fusion, which are part of its kernel): ``{"entry": copies, "loops": [{"body",
    "copies" (per trip, with those of the computations it calls), "trips" (None: data-dependent),
    "parent" (the loop body it runs in, None: the entry)}]}``."""
    comps, entry = _computations(hlo)
    if entry is None:
        raise ValueError("not an HLO module: no ENTRY computation")
    loops: dict[str, dict[str, Any]] = {}
    calls: dict[str, list[str]] = {}  # computation -> the non-loop computations it runs (call, branches)
    for name, lines in comps.items():
        for line in lines:
            if not _CONTROL.search(line):
                continue
            refs = dict((k, v) for k, v in _REF.findall(line))
            if " while(" in line and "body" in refs:
                t = _TRIPS.search(line)
                trips = int(t.group(1)) if t else None
                loops[refs["body"]] = {"body": refs["body"], "trips": trips, "in": name}
                continue
            targets = [v for k, v in refs.items() if k != "body"]
            b = _BRANCHES.search(line)
            if b:
                targets += [x.strip().lstrip("%") for x in b.group(1).split(",") if x.strip()]
            calls.setdefault(name, []).extend(t for t in targets if t in comps)

    def own(name: str, seen: frozenset = frozenset()) -> int:  # its copies and those of what it calls
        if name in seen:
            return 0
        return (sum(bool(_COPY.search(x)) for x in comps.get(name, []))
                + sum(own(c, seen | {name}) for c in calls.get(name, [])))

    def loop_of(name: str) -> str | None:  # the loop body a computation runs in (None: the entry)
        while name != entry:
            if name in loops:
                return name
            callers = [c for c, cs in calls.items() if name in cs] + [lp["in"] for lp in loops.values()
                                                                     if lp["body"] == name]
            if not callers:
                return None
            name = callers[0]
        return None

    out = [{"body": b, "copies": own(b), "trips": lp["trips"], "parent": loop_of(lp["in"])}
           for b, lp in loops.items()]
    return {"entry": own(entry), "loops": out}


def copies_per_call(copies: dict[str, Any], data_trips: int) -> int:
    """Copies executed by one call of the module: the entry's, plus each loop's body copies times
    its trips (``data_trips`` for a loop whose trip count depends on the data), nested loops
    multiplied through their parents."""
    by_body = {lp["body"]: lp for lp in copies["loops"]}

    def runs(lp: dict[str, Any]) -> int:
        trips = lp["trips"] if lp["trips"] is not None else data_trips
        parent = by_body.get(lp["parent"]) if lp["parent"] else None
        return trips * (runs(parent) if parent else 1)

    return copies["entry"] + sum(lp["copies"] * runs(lp) for lp in copies["loops"])


_NO_WORK = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")


def body_instructions(hlo: str, trips: int) -> dict[str, int]:
    """``{opcode: count}`` of the instructions of the while body with ``trips`` known trips (the
    first such), leaving out those that are no work (parameters, tuples, constants, bitcasts)."""
    comps, _ = _computations(hlo)
    for line in hlo.splitlines():
        t = _TRIPS.search(line)
        if " while(" in line and t and int(t.group(1)) == trips:
            body = dict(_REF.findall(line)).get("body")
            counts: dict[str, int] = {}
            for x in comps.get(body, []):
                op = re.search(r"=\s*(?:\([^)]*\)|\S+)\s+([\w\-]+)\(", x)
                if op and op.group(1) not in _NO_WORK:
                    counts[op.group(1)] = counts.get(op.group(1), 0) + 1
            return counts
    return {}


def physics_copies(job, num_envs: int, ls_iterations: int | None = None, steps: int = 3) -> dict[str, Any]:
    """``vmap(env.step)`` over ``num_envs`` environments as XLA compiles it here, as written and
    with :func:`~rose_jax.optimize.stack_carries` (its line search's scalars per environment carried
    stacked): each one's :func:`loop_copies` and the line-search body's instructions, and whether
    ``steps`` environment steps from the same state under random actions are bitwise equal. The
    line search: the loop of ``ls_iterations`` known trips (None: the longest fixed-length loop)."""
    import jax
    import numpy as np

    from rose_jax.optimize import stack_carries

    env = job.env
    fn = jax.vmap(env.step)
    state = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(0), num_envs))
    out: dict[str, Any] = {}
    finals = {}
    variants = (("as_written", fn), ("stack_carries", stack_carries().apply(fn)),
                ("stack_carries_any_rank", stack_carries(max_rank=8).apply(fn)))
    for name, f in variants:
        compiled = jax.jit(f).lower(state, np.zeros((num_envs, env.action_size), np.float32)).compile()
        hlo = compiled.as_text()
        trips = ls_iterations or ls_trips(hlo)
        out[name] = {**loop_copies(hlo), "line_search_body": body_instructions(hlo, trips)}
        s, key = state, jax.random.PRNGKey(1)
        for _ in range(steps):
            key, k = jax.random.split(key)
            s = compiled(s, jax.random.uniform(k, (num_envs, env.action_size), minval=-1.0, maxval=1.0))
        finals[name] = s
    for name in ("stack_carries", "stack_carries_any_rank"):
        eq = common.equality_fields(finals[name], finals["as_written"])
        out[name]["bitwise_equal"], out[name]["max_abs_diff"] = eq["equal"], eq["max_abs_diff"]
    out["equal_after_steps"] = steps
    return out


def ls_trips(hlo: str) -> int:
    """The known trip count of the longest fixed-length loop (MJX's line search: ``ls_iterations``)."""
    return max((int(t) for t in _TRIPS.findall(hlo)), default=0)


def solver_options(env_name: str) -> dict[str, Any] | None:
    """``opt.iterations`` / ``opt.ls_iterations`` / ``n_frames`` of Brax's MJX environment
    ``env_name`` (None where Brax or the environment is not there)."""
    try:
        import brax.envs

        e = brax.envs.get_environment(env_name, backend="mjx")
        return {"iterations": int(e.sys.opt.iterations), "ls_iterations": int(e.sys.opt.ls_iterations),
                "n_frames": int(getattr(e, "_n_frames", 0) or 0) or None}
    except Exception:  # noqa: BLE001 - a missing environment leaves the column empty
        return None


def chains(fn, state) -> list[dict[str, Any]]:
    """Every loop of one iteration with its body's chain and, per iteration, trips x chain."""
    from rose_jax import trace as rtrace
    from rose_jax.trace import depth

    tree = rtrace.trace(fn, state, arg_names=["state"])
    out = []
    for path, trips, c in depth.loop_chains(tree):
        k = trips or 1
        out.append({"loop": path, "trips": trips, **c._asdict(),
                    "kernels_in_series_per_run": c.longest_kernels * k, "describe": c.describe()})
    return out


def measured(workload: str, path: str = BEYOND) -> dict[str, Any] | None:
    """The newest acceptance row of ``workload`` with a kernel profile, reduced to what the floor
    needs, and the iteration time issue 32's target asks (None where no such row exists)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = json.load(f).get("acceptance", [])
    rows = [r for r in rows if r.get("workload") == workload and (r.get("profile") or {}).get("available")]
    if not rows:
        return None
    r = max(rows, key=lambda r: r.get("date") or "")
    p = r["profile"]
    comp = p.get("by_component") or {}
    peer = max(r.get("peer_flags_env_steps_per_s") or 0, r.get("peer_default_env_steps_per_s") or 0) or None
    steps = (p.get("env_steps_per_s") or 0) * (p.get("ms_per_iteration") or 0) / 1e3 or None
    out = {
        "date": r.get("date"),
        "device": r.get("device"),
        "speedup_vs_informed_peer": r.get("speedup_vs_informed_peer"),
        "rose_env_steps_per_s": r.get("rose_env_steps_per_s"),
        "informed_peer_env_steps_per_s": peer,
        "traced_ms_per_iteration": p.get("ms_per_iteration"),
        "kernels_per_iteration": p.get("kernels_per_iteration"),
        "median_kernel_us": p.get("median_kernel_us"),
        "components": {c: {"kernels": v.get("kernels"), "kernel_ms": v.get("kernel_ms"),
                           "memcpy32_post_ms": (v.get("top_ms") or {}).get("memcpy32_post", 0.0)}
                       for c, v in comp.items()},
        "env_steps_per_iteration": round(steps) if steps else None,
    }
    if peer and steps:
        out["peer_ms_per_iteration"] = steps / peer * 1e3
        out["target_ms_per_iteration"] = steps / (TARGET * peer) * 1e3
        if r.get("rose_env_steps_per_s"):
            out["rose_ms_per_iteration"] = steps / r["rose_env_steps_per_s"] * 1e3
    return out


def analyse(name: str, smoke: bool) -> dict[str, Any]:
    from benchmarks.experiments import beyond_flags

    job, fn, state, env_steps, _ = beyond_flags.build(name, smoke)
    common.log(f"{name}: tracing one iteration")
    loops = chains(fn, state)
    common.log(f"{name}: compiling the physics step of {job.config.num_envs} environments")
    opts = solver_options(job.env.name) if not smoke else None
    phys = physics_copies(job, int(job.config.num_envs), (opts or {}).get("ls_iterations"))
    copies = phys["as_written"]
    data_loop = any(c["trips"] is None for c in copies["loops"])
    iters = range(1, (opts or {}).get("iterations", 1) + 1) if data_loop else [1]
    per_step = {i: copies_per_call(copies, i) for i in iters}
    stacked = {i: copies_per_call(phys["stack_carries"], i) for i in iters}
    return {"workload": name, "env_steps_per_iteration": env_steps, "num_envs": int(job.config.num_envs),
            "solver": opts, "loops": loops, "physics_copies": copies, "physics_copies_per_env_step": per_step,
            "stack_carries": {"physics_copies": phys["stack_carries"], "physics_copies_per_env_step": stacked,
                              "bitwise_equal": phys["stack_carries"]["bitwise_equal"],
                              "max_abs_diff": phys["stack_carries"]["max_abs_diff"],
                              "equal_after_steps": phys["equal_after_steps"]},
            "stack_carries_any_rank": {
                "physics_copies_per_env_step": {
                    i: copies_per_call(phys["stack_carries_any_rank"], i) for i in iters},
                "bitwise_equal": phys["stack_carries_any_rank"]["bitwise_equal"],
                "max_abs_diff": phys["stack_carries_any_rank"]["max_abs_diff"]},
            "line_search_body": {"as_written": copies["line_search_body"],
                                 "stack_carries": phys["stack_carries"]["line_search_body"]},
            "measured": None if smoke else measured(name)}


def _ops(counts: dict[str, int]) -> str:
    return f"{sum(counts.values())} instructions ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))})"


def _fmt(x: Any, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def write(
    out: str, results: list[dict[str, Any]], command: str, machine: dict[str, Any] | None = None
) -> None:
    """``results.json``, ``results.md`` and ``results.png`` under ``out`` (``machine``: the stored
    machine record, when the files are rewritten from a results file)."""
    from rose_jax.io import atomic_write_json

    os.makedirs(out, exist_ok=True)
    info = machine or common.machine_info()
    record = {"machine": info, "command": command, "workloads": results}
    atomic_write_json(os.path.join(out, "results.json"), record)
    lines = ["# SAC high-update: where the iteration goes, counted on the program (issue 32's floor)", "",
             f"{info.get('date')} on {info.get('gpu') or info.get('platform')} (jax {info.get('jax')}); "
             f"`{command}`. Counts are of the program (jaxpr chains; XLA's copy instructions as this "
             "machine's XLA compiles the physics step); the measured columns are read from "
             "`benchmarks/results/beyond_flags/results.json`.", ""]
    for r in results:
        lines += [f"## {r['workload']}", "",
                  f"{r['num_envs']} environments, {r['env_steps_per_iteration']} env steps per iteration; "
                  f"solver: {r['solver'] or '-'}.", "",
                  common.markdown_table(
                      ["loop", "trips", "operations", "matrix products", "kernels",
                       "in series (ops / products / kernels)", "kernels in series per run of the loop"],
                      [[c["loop"], _fmt(c["trips"], "d") if c["trips"] else "data", c["ops"], c["matmuls"],
                        c["kernels"], f"{c['longest_ops']} / {c['longest_matmuls']} / {c['longest_kernels']}",
                        c["kernels_in_series_per_run"]] for c in r["loops"][:8]]),
                  ""]
        cp = r["physics_copies"]
        lines += ["Copies in the physics step (`vmap(env.step)`): "
                  + "; ".join(f"{lp['body']} {lp['copies']} per trip x {lp['trips'] or 'data'}"
                              for lp in cp["loops"])
                  + f"; entry {cp['entry']}. Per environment step, by the solver's iterations: "
                  + ", ".join(f"{i}: {n:,}" for i, n in r["physics_copies_per_env_step"].items()) + ".", ""]
        sc, lsb = r["stack_carries"], r["line_search_body"]
        same = "bitwise equal" if sc["bitwise_equal"] else "NOT bitwise equal"
        lines += ["With `stack_carries` (the line search's scalars per environment carried stacked): "
                  + ", ".join(f"{i}: {n:,}" for i, n in sc["physics_copies_per_env_step"].items())
                  + f" copies per environment step; {same} to the step as written after "
                  f"{sc['equal_after_steps']} steps of random actions. The line search's body: "
                  f"{_ops(lsb['as_written'])} as written, {_ops(lsb['stack_carries'])} stacked.", ""]
        anyr = r["stack_carries_any_rank"]
        lines += ["With `stack_carries(max_rank=8)` (the substep scan's MJX state stacked too): "
                  + ", ".join(f"{i}: {n:,}" for i, n in anyr["physics_copies_per_env_step"].items())
                  + " copies per environment step; "
                  + ("bitwise equal" if anyr["bitwise_equal"] else f"max |diff| {anyr['max_abs_diff']:.2e}")
                  + f" after {sc['equal_after_steps']} steps.", ""]
        m = r.get("measured")
        if m:
            comps = "; ".join(f"{c} {_fmt(v['kernels'])} kernels ({_fmt(v['kernel_ms'], '.1f')} ms, "
                              f"memcpy32_post {_fmt(v['memcpy32_post_ms'], '.1f')} ms)"
                              for c, v in m["components"].items() if v.get("kernels"))
            lines += [f"Measured ({m['date']}, {m['device']}): {_fmt(m['kernels_per_iteration'])} kernels "
                      f"per iteration (median {m['median_kernel_us']} us): {comps}. Informed peer "
                      f"{_fmt(m['informed_peer_env_steps_per_s'])} "
                      f"env-steps/s = {_fmt(m.get('peer_ms_per_iteration'), '.1f')} ms per iteration; ours "
                      f"{_fmt(m['rose_env_steps_per_s'])} = {_fmt(m.get('rose_ms_per_iteration'), '.1f')} ms "
                      f"({_fmt(m['speedup_vs_informed_peer'], '.3f')}x); {TARGET}x asks "
                      f"{_fmt(m.get('target_ms_per_iteration'), '.1f')} ms per iteration.", ""]
    lines.append("Generated by `benchmarks/experiments/sac_floor.py`.")

    def plot(res, path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, len(res), figsize=(4.5 * len(res), 6.0), squeeze=False)
        for col, r in enumerate(res):
            ax = axes[0][col]
            top = [c for c in r["loops"] if c["trips"]][:2]
            names = [c["loop"].split("/")[0] for c in top]
            ax.bar(names, [c["kernels"] * c["trips"] for c in top], color="#888", alpha=0.4,
                   label="kernels (jaxpr)")
            ax.bar(names, [c["kernels_in_series_per_run"] for c in top], color="#2a7",
                   label="of them in series")
            ax.set_title(f"{r['workload']}: per iteration", fontsize=9)
            ax.legend(fontsize=7)
            ax = axes[1][col]
            its = [int(i) for i in r["physics_copies_per_env_step"]]
            ax.plot(its, list(r["physics_copies_per_env_step"].values()), "o-", color="#888",
                    label="as written")
            ax.plot(its, list(r["stack_carries"]["physics_copies_per_env_step"].values()), "o-", color="#2a7",
                    label="stack_carries")
            ax.set_xticks(its)
            ax.set_xlabel("constraint-solver iterations")
            ax.set_ylabel("copies per env step (physics)")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
        common.save_plot(fig, path)

    common.write_markdown_and_plot(out, lines, plot, results)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="sac-hopper-5ep,sac-ant-5ep")
    p.add_argument("--out", default=OUT_DIR)
    p.add_argument("--smoke", action="store_true", help="a tiny SAC on a small environment: plumbing only")
    args = p.parse_args(argv)
    from benchmarks.experiments import informed_peer

    names = ["smoke"] if args.smoke else [w.strip() for w in args.workloads.split(",") if w.strip()]
    known = informed_peer.workloads()
    bad = [n for n in names if n not in known]
    if bad:
        p.error(f"unknown workload(s) {bad}; known: {', '.join(known)}")
    results = []
    for n in names:
        try:
            results.append(analyse(n, args.smoke))
        except Exception as e:  # noqa: BLE001 - one workload's failure is its note, the others go on
            common.log(f"{n}: failed: {type(e).__name__}: {e}")
        if results:
            write(args.out, results, " ".join(["python -m benchmarks.experiments.sac_floor", *argv]))
    return 0 if len(results) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
