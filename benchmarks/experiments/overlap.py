"""Overlap inside one program: stream regions and per-component compilation on the H200.

Rows (``--rows`` picks some by name prefix; in this order, a ``--budget-s`` guard skips what
would not fit):

* ``components on streams (two MLP chains)``: two independent chains of 400 steps of
  ``tanh(x @ W)`` (512x256 @ 256x256); baseline: the better of the two loops one after the other
  and the two zipped into one loop without annotation; rose: the library's generated candidate,
  zipped, each step of each chain on its own stream (``stream_overlap(mode="loops")``). The issue
  measured 7.69 -> 3.87 ms (1.99x). Its "env steps" are chain steps.
* ``sac-ant-128`` / ``sac-hopper-128``: SAC on MJX with Brax's published high-update config
  (128 envs, batch 512, 64 gradient updates per env step, replay 1M, min replay 8192, 256x256).
* ``ppo-ant-4096`` / ``ppo-ant-2048`` (policy 4x32, value 5x256) and ``ppo-ant-4096-3x512``
  (policy 3x512), the suite's PPO hyperparameters (Brax's ant config, no gradient clipping).

Per row: baseline = our single-jit loop (K iterations in one jitted ``lax.scan``, state donated)
and, when ``--brax`` allows and time remains, Brax's own trainer (its ``training/sps`` after the
compile epoch); the better one is ``baseline_env_steps_per_s``. Candidates are the library's
own: ``rose_jax.optimize.candidates.generate_candidates`` for the families of this question
(:data:`FAMILIES`: ``split_compile``, the iteration as separately compiled stages with measured XLA
options, ``boundaries=()`` being the whole iteration under its measured option set; and
``stream_overlap``, regions of a loop body on their own streams), highest predicted gain first, the
first ``--max-candidates`` legal ones timed (the illegal ones are listed with the generator's
reason); no list of this experiment's own. A fn-level candidate runs as its transformed iteration
in the K-loop; a ``split_compile`` step is called K times per block (state donated on a GPU, as in
the single-jit loop). Every fn candidate's compile (its K-loop, and its single iteration under
deterministic ops) first runs in a child process (``rose_jax.optimize.isolate``; a split step
isolates its stages itself), so an XLA abort is a refused candidate, not a dead run. A candidate
is kept only if it is faster than the single-jit loop AND equal to it: one iteration from the
same state compiled with ``xla_gpu_deterministic_ops`` on both sides, its output state compared
within the candidate's stated tolerance (``bitwise`` says whether it is bitwise equal). A candidate
whose compile under deterministic ops fails is refused with that reason, never checked without
them. A row with no plan kept has ``equal``/``bitwise``/``max_abs_diff`` null: not checked.
``search_s``: the row's candidate time (isolation, compiles, timing, equality).

    python -m benchmarks.experiments.overlap                          # H200, all rows that fit --budget-s 450
    python -m benchmarks.experiments.overlap --rows micro sac --brax off                 # ~7 min on the H200
    python -m benchmarks.experiments.overlap --rows ppo-ant-4096 ppo-ant-2048 --merge --brax off   # ~7 min
    python -m benchmarks.experiments.overlap --rows ppo-ant-4096-3x512 --merge           # + Brax if time
    python -m benchmarks.experiments.overlap --rows sac-ant --brax-only --brax on   # Brax for measured rows
    python -m benchmarks.experiments.overlap --smoke                  # CPU plumbing check, tiny sizes

Writes ``results.json``, ``results.md`` and ``results.png`` (atomically) into ``--out``
(default ``benchmarks/results/overlap``; ``--smoke``: a temporary directory unless given).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Any, Callable

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common
from benchmarks.common import fmt, log
from benchmarks.suite import workloads

DEFAULT_OUT = os.path.join(common.RESULTS_DIR, "overlap")
MICRO = "components on streams (two MLP chains)"
DETERMINISTIC = {"xla_gpu_deterministic_ops": True}


@dataclasses.dataclass(frozen=True)
class Row:
    """One workload. ``hp``: config fields; ``k``: iterations per timed block."""

    name: str
    kind: str  # "micro" | "ppo" | "sac"
    env: str = ""
    env_kwargs: tuple = ()
    hp: tuple = ()
    k: int = 10
    blocks: int = 3
    brax_env: str | None = None
    width: int = 256  # micro: hidden width
    batch: int = 512  # micro: rows
    steps: int = 400  # micro: chain steps


SAC_HIGH_UPDATE = (
    ("num_timesteps", 10_000_000),
    ("num_envs", 128),
    ("batch_size", 512),
    ("grad_updates_per_step", 64),
    ("max_replay_size", 1_048_576),
    ("min_replay_size", 8192),
    ("learning_rate", 6e-4),
    ("discounting", 0.997),
    ("reward_scaling", 30.0),
    ("normalize_observations", True),
    ("policy_hidden_sizes", (256, 256)),
    ("q_hidden_sizes", (256, 256)),
    ("activation", "relu"),
)
# The suite's PPO hyperparameters (Brax's locomotion defaults) with ant's reward scaling and the
# 4x32 policy; value_cost 0.5 there is PPOConfig's default.
PPO_ANT = workloads.PPO_HP + (
    ("num_timesteps", 50_000_000),
    ("reward_scaling", workloads.REWARD_SCALING["ant"]),
    ("policy_hidden_sizes", (32,) * 4),
)


def _with(base: tuple, **kw) -> tuple:
    d = dict(base)
    d.update(kw)
    return tuple(d.items())


def rows_for(smoke: bool) -> list[Row]:
    if smoke:
        sac_tiny = _with(
            SAC_HIGH_UPDATE,
            num_envs=4,
            batch_size=16,
            grad_updates_per_step=2,
            max_replay_size=2048,
            min_replay_size=64,
            policy_hidden_sizes=(16, 16),
            q_hidden_sizes=(16, 16),
            num_timesteps=100_000,
        )
        ppo_tiny = _with(
            PPO_ANT,
            num_envs=16,
            unroll_length=4,
            num_minibatches=2,
            num_epochs=1,
            policy_hidden_sizes=(8, 8),
            value_hidden_sizes=(16, 16),
            num_timesteps=100_000,
        )
        return [
            Row(MICRO, "micro", width=8, batch=16, steps=20, blocks=2),
            Row("sac-pendulum-4", "sac", "pendulum", hp=sac_tiny, k=1, blocks=2),
            Row("ppo-pendulum-16", "ppo", "pendulum", hp=ppo_tiny, k=1, blocks=2),
        ]
    mjx = (("backend", "mjx"),)
    return [
        Row(MICRO, "micro"),
        Row("sac-ant-128", "sac", "ant", mjx, SAC_HIGH_UPDATE, k=20, brax_env="ant"),
        Row("sac-hopper-128", "sac", "hopper", mjx, SAC_HIGH_UPDATE, k=20, brax_env="hopper"),
        Row("ppo-ant-4096", "ppo", "ant", mjx, _with(PPO_ANT, num_envs=4096), k=5, brax_env="ant"),
        Row("ppo-ant-2048", "ppo", "ant", mjx, _with(PPO_ANT, num_envs=2048), k=5, brax_env="ant"),
        Row(
            "ppo-ant-4096-3x512",
            "ppo",
            "ant",
            mjx,
            _with(PPO_ANT, num_envs=4096, policy_hidden_sizes=(512,) * 3),
            k=5,
            brax_env="ant",
        ),
    ]


# ------------------------------------------------------------------------------ helpers


def _gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _copy(tree, commit: bool = False):
    """A copy of ``tree`` (donation consumes its argument). ``commit``: placed on the device
    explicitly: a program with stream regions returns committed arrays (JAX commits the outputs of
    any program holding a ``compute_on``), so committed inputs keep it at one compile."""
    import jax
    import jax.numpy as jnp

    out = jax.tree.map(jnp.copy, tree)
    return jax.device_put(out, jax.devices()[0]) if commit else out


def kloop(fn: Callable, k: int, options: dict | None = None, donate: bool = False) -> Callable:
    """``jax.jit`` of ``k`` iterations of ``fn`` in one ``lax.scan`` (last iteration's metrics)."""
    import jax

    def loop(state):
        state, ms = jax.lax.scan(lambda s, _: fn(s), state, None, length=k)
        return state, jax.tree.map(lambda m: m[-1], ms)

    return jax.jit(loop, donate_argnums=(0,) if donate else (), compiler_options=options or None)


def time_blocks(call: Callable, state: Any, blocks: int) -> tuple[float, float, list[float], Any]:
    """``(compile + first call s, median block s, block times, last state)``; ``call(state) -> state``.

    Two untimed calls first: a jit whose outputs are committed while its first inputs were not
    (any program with stream regions, see :func:`_copy`) compiles once more on its second call.
    """
    import jax

    t0 = time.perf_counter()
    state = jax.block_until_ready(call(state))
    first = time.perf_counter() - t0
    state = jax.block_until_ready(call(state))
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        state = jax.block_until_ready(call(state))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), times, state


def compare(actual, expected, tol) -> dict:
    from rose_jax.compare import compare_trees

    within = compare_trees(actual, expected, rtol=tol.rtol, atol=tol.atol)
    bitwise = compare_trees(actual, expected)
    return {
        "equal": bool(within.equal),
        "bitwise": bool(bitwise.equal),
        "max_abs_diff": float(bitwise.max_abs),
        "worst_leaf": bitwise.worst or within.worst,
    }


def det_failed(whose: str, e: BaseException) -> str:
    """The refusal reason when compiling (or running) ``whose`` under deterministic ops failed."""
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return f"compile under {DETERMINISTIC} for the equality check failed for {whose} ({msg})"


# The targets: speedup over the best baseline (rows not named have none).
TARGETS = {"sac-ant-128": 1.4, "sac-hopper-128": 1.4, "ppo-ant-4096": 1.15}


def time_split(row: Row, config, env, state, options: dict, calls: int = 5, label: str = "") -> dict:
    """Where an iteration's time goes: the program's ``collect`` and ``learn`` each compiled alone
    with the plan's XLA ``options`` and timed from ``state`` (median of ``calls`` calls, each
    synchronised), beside the whole iteration compiled the same way. The collect holds the
    policy's inference and the physics; the learn the gradient steps (SAC: replay sampling and the
    64 updates; PPO: GAE and the epochs of minibatches). ``sum / whole`` near 1 means the two
    halves run back to back with nothing left to overlap between them inside one iteration."""
    import jax

    import algos
    from rose_jax.optimize.measure import time_call

    prog = algos.get(row.kind).program(config, env)
    opts = options or None
    collect = jax.jit(prog.collect, compiler_options=opts)
    learn = jax.jit(prog.learn, compiler_options=opts)
    whole = jax.jit(prog.iteration(), compiler_options=opts)

    def median_ms(f, *a):
        jax.block_until_ready(f(*a))  # the compile; time_call warms up once more
        return time_call(f, a, calls).median * 1e3

    s = _copy(state)
    c_ms = median_ms(collect, s)
    s2, data = collect(s)
    l_ms = median_ms(learn, s2, data)
    w_ms = median_ms(whole, s)
    return {
        "options": label or ("default" if not options else sorted(options)),
        "collect_ms": c_ms,
        "learn_ms": l_ms,
        "iteration_ms": w_ms,
        "collect_share": c_ms / (c_ms + l_ms),
        "sum_over_whole": (c_ms + l_ms) / w_ms,
        "calls": calls,
    }


class Isolation:
    """Every candidate compile goes through a child first (``mode``: all / first / none)."""

    def __init__(self, mode: str, workers: int = 6):
        self.mode, self.used = mode, 0
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="isolate")

    def wanted(self) -> bool:
        if self.mode == "all":
            return True
        return self.mode == "first" and self.used == 0

    def submit(self, fn, args, options, label):
        from rose_jax.optimize import isolate

        self.used += 1
        return self.pool.submit(isolate.check, fn, args, compiler_options=options, label=label)


# ------------------------------------------------------------------------------ the micro row


def run_micro(row: Row, args, iso: Isolation) -> dict:
    import jax
    import jax.numpy as jnp

    import rose_jax
    import rose_jax.trace as rtrace
    from rose_jax.optimize.candidates import generate_candidates
    from rose_jax.optimize.fusion import fuse_scans

    n, w, steps = row.batch, row.width, row.steps

    def chains(state):
        a, b, wa, wb = state
        with rose_jax.component("chain_a"):
            a, _ = jax.lax.scan(lambda x, _: (jnp.tanh(x @ wa), None), a, None, length=steps)
        with rose_jax.component("chain_b"):
            b, _ = jax.lax.scan(lambda x, _: (jnp.tanh(x @ wb), None), b, None, length=steps)
        return a, b, wa, wb

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    scale = 1.0 / w**0.5
    state = (
        jax.random.normal(keys[0], (n, w)),
        jax.random.normal(keys[1], (n, w)),
        scale * jax.random.normal(keys[2], (w, w)),
        scale * jax.random.normal(keys[3], (w, w)),
    )
    tree = rtrace.trace(chains, state, arg_names=["state"])
    t0 = time.perf_counter()
    # the library's candidate for the two loops: zipped, each step of each on its own stream
    gen = generate_candidates(tree, None, 1.0, platform=jax.default_backend(), families=("stream_overlap",))
    legal = [(c.transform, c.transform.legal(tree)) for c in gen]
    legal = [(t, why) for t, (ok, why) in legal if ok]
    if not legal:
        raise RuntimeError(f"no legal stream_overlap candidate generated for the two chains: {gen}")
    zipped, why = legal[0]
    fast = zipped.apply(chains)
    check = iso.submit(fast, (state,), {}, "micro:streams").result() if iso.wanted() else None
    if check is not None and not check.ok:
        return {"plan": "none", "refused": check.reason, "search_s": time.perf_counter() - t0}
    one_loop = fuse_scans(chains, "chain_a", "chain_b")  # a baseline: one loop, no streams
    variants = {
        "two loops": jax.jit(chains),
        "one loop, no streams": jax.jit(one_loop),
        "streams": jax.jit(fast),
    }
    times = {}
    for name, f in variants.items():
        _, med, _, _ = time_blocks(
            lambda s, f=f: f(s), _copy(state, commit=name == "streams"), max(row.blocks, 5)
        )
        times[name] = med
    base_name = min(("two loops", "one loop, no streams"), key=times.get)
    eq, refused = {}, None  # a failing compile under deterministic ops refuses the candidate
    for whose, f in (("the baseline (two loops)", chains), ("the candidate", fast)):
        try:
            eq[whose] = jax.jit(f, compiler_options=DETERMINISTIC)(state)
        except Exception as e:  # noqa: BLE001 - refused with the reason, never checked without them
            refused = det_failed(whose, e)
            log(f"{row.name}: {zipped.label} refused: {refused}")
            break
    if refused is None:
        eq = compare(eq["the candidate"], eq["the baseline (two loops)"], zipped.tolerance)
    chain_steps = 2 * steps
    # kept only where faster and equal
    kept = refused is None and times["streams"] < times[base_name] and eq["equal"]
    # the row's equal / bitwise / max_abs_diff are the plan's: with no plan kept nothing was compared
    # (None, "not checked"); the candidate's own comparison (or refusal) stays as candidate_*
    row_eq = eq if kept else {
        "equal": None,
        "bitwise": None,
        "max_abs_diff": None,
        **({"candidate_refused": refused} if refused else {f"candidate_{k}": v for k, v in eq.items()}),
    }
    return {
        "baseline_env_steps_per_s": chain_steps / times[base_name],
        "single_jit_env_steps_per_s": chain_steps / times[base_name],
        "rose_env_steps_per_s": chain_steps / (times["streams"] if kept else times[base_name]),
        "candidate": zipped.label,
        "candidate_speedup": times[base_name] / times["streams"],
        "baseline": base_name,
        "times_ms": {k: v * 1e3 for k, v in times.items()},
        "speedup_vs_two_loops": times["two loops"] / times["streams"],
        "plan": zipped.label if kept else "none",
        "plan_detail": why if refused is None else f"refused: {refused}",
        "isolation": None if check is None else check.reason,
        "search_s": time.perf_counter() - t0,
        **row_eq,
    }


# ------------------------------------------------------------------------------ algorithm rows


def build(row: Row):
    import jax

    import algos
    import envs

    env = envs.make(row.env, **dict(row.env_kwargs))
    algo = algos.get(row.kind)
    config = algo.Config(**dict(row.hp))
    state = algo.init(config, env, jax.random.PRNGKey(0))
    env_steps = config.num_envs * (config.unroll_length if row.kind == "ppo" else 1)
    return config, env, algo.iteration(config, env), state, env_steps


# The library's families whose candidates this experiment times: overlap inside one program.
FAMILIES = ("split_compile", "stream_overlap")


@dataclasses.dataclass
class Candidate:
    label: str
    kind: str  # "fn" (a jittable iteration, timed in a K-loop) | "host" (a ChainedStep, K calls)
    tolerance: Any
    summary: str
    fn: Callable | None = None  # fn kind: the transformed iteration
    options: dict = dataclasses.field(default_factory=dict)
    split: Any = None  # host kind: the split_compile Transform
    record: dict = dataclasses.field(default_factory=dict)


def make_candidates(fn, tree, max_candidates: int, baseline_s: float) -> tuple[list[Candidate], list[dict]]:
    """The row's candidates, the library's default generation for :data:`FAMILIES` on ``tree``
    (highest predicted gain first, each with its model in its record), and the generator's
    candidates refused by legality. ``baseline_s``: the untransformed iteration's seconds (the
    predictions' scale). A host-level candidate (``split_compile``) donates its state on a GPU,
    like the single-jit loop it is timed against."""
    import jax

    from rose_jax.optimize.candidates import generate_candidates
    from rose_jax.optimize.registry import transform_by_name

    gen = generate_candidates(tree, None, baseline_s, platform=jax.default_backend(), families=FAMILIES)
    refused: list[dict] = []
    out: list[Candidate] = []
    for c in gen:
        t = c.transform
        ok, why = t.legal(tree)
        if not ok:
            refused.append({"label": t.label, "reason": why})
            continue
        if len(out) >= max_candidates:
            continue
        if t.level == "fn":
            cand = Candidate(t.label, "fn", t.tolerance, why, fn=t.apply(fn))
        else:
            params = dict(t.params)
            if "donate" in params:
                t = transform_by_name(t.name, {**params, "donate": _gpu()})
            cand = Candidate(t.label, "host", t.tolerance, f"{t.summary} ({why})", split=t)
        cand.record.update(predicted_gain_s=c.predicted, prediction=c.model)
        out.append(cand)
    return out, refused


def run_algo(row: Row, args, iso: Isolation, deadline: float) -> dict:
    import jax

    import rose_jax.trace as rtrace
    from rose_jax.optimize.stream_overlap import STREAM_TOLERANCE

    log(f"{row.name}: building env, config, initial state")
    config, env, fn, state0, env_steps = build(row)
    jax.block_until_ready(state0)
    gpu = _gpu()
    donate = gpu
    k = row.k
    log(f"{row.name}: baseline single-jit loop ({k} iterations per call)")
    base_loop = kloop(fn, k, donate=donate)
    compile_s, base_s, base_times, s_ref = time_blocks(lambda s: base_loop(s)[0], _copy(state0), row.blocks)
    single = k * env_steps / base_s
    log(
        f"{row.name}: baseline {base_s * 1e3:.1f} ms / {k} iterations = {single:,.0f} env-steps/s "
        f"(compile {compile_s:.1f} s)"
    )
    t_search = time.perf_counter()
    tree = rtrace.trace(fn, state0, arg_names=["state"])
    cands, refused = make_candidates(fn, tree, args.max_candidates, base_s / k)
    # isolation of every fn candidate's two compiles, in parallel, before any compiles here
    checks: dict[str, list] = {}
    for c in cands:
        if c.kind == "fn" and iso.wanted():
            checks[c.label] = [
                iso.submit(
                    lambda s, f=c.fn: kloop(f, k)(s), (state0,), c.options, f"{row.name}:{c.label}:loop"
                ),
                iso.submit(c.fn, (state0,), {**c.options, **DETERMINISTIC}, f"{row.name}:{c.label}:det"),
            ]
    base_det = jax.jit(fn, compiler_options=DETERMINISTIC)
    # 1) each candidate's compile here only after its isolated compiles passed; ahead of time, so
    #    that no child runs on the GPU while anything is timed below
    ready: list[tuple[Candidate, Callable]] = []
    for c in cands:
        rec = c.record
        rec.update(label=c.label, summary=c.summary, tolerance=c.tolerance.to_json())
        left = deadline - time.perf_counter()
        if left < 3.0 * compile_s + 10.0:
            rec["skipped"] = f"budget ({left:.0f} s left, about {3 * compile_s:.0f} s needed)"
            continue
        try:
            outcomes = [f.result() for f in checks.get(c.label, [])]
            bad = [o for o in outcomes if not o.ok]
            if bad:
                rec["refused"] = bad[0].reason
                log(f"{row.name}: {c.label} refused: {bad[0].reason}")
                continue
            if outcomes:
                rec["isolation"] = "; ".join(o.reason for o in outcomes)
            if c.kind == "fn":
                t0 = time.perf_counter()
                compiled = (
                    kloop(c.fn, k, c.options, donate=donate).lower(_copy(state0, commit=True)).compile()
                )
                rec["compile_s"] = time.perf_counter() - t0
                ready.append((c, lambda s, compiled=compiled: compiled(s)[0]))
            else:
                ready.append((c, None))
        except Exception as e:  # noqa: BLE001 - one failing candidate is recorded, the row goes on
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
            log(f"{row.name}: {c.label} failed: {rec['error']}")
    # 2) timing, one candidate at a time (a split step isolates, measures and compiles its stages
    #    on its first call, before its timed blocks)
    timed: list[Candidate] = []
    for c, call in ready:
        rec = c.record
        try:
            if call is None:
                step = c.split.apply(fn)
                step.isolate = iso.wanted()  # its stages x option sets, each in a child first

                def call(s, step=step):
                    for _ in range(k):
                        s = step(s)[0]
                    return s

                c.record["step"] = step
            first, med, times, _ = time_blocks(call, _copy(state0, commit=c.kind == "fn"), row.blocks)
            rec.setdefault("compile_s", first)
            rec.update(
                block_ms=[t * 1e3 for t in times], env_steps_per_s=k * env_steps / med, speedup=base_s / med
            )
            if c.kind == "host":
                rec["split"] = {key: v for key, v in c.record["step"].stats().items() if key != "mode"}
            log(f"{row.name}: {c.label}: {k * env_steps / med:,.0f} env-steps/s ({base_s / med:.3f}x)")
            timed.append(c)
        except Exception as e:  # noqa: BLE001 - one failing candidate is recorded, the row goes on
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
            log(f"{row.name}: {c.label} failed: {rec['error']}")
    # equality of the fastest faster candidates: one iteration from the same state, deterministic ops;
    # where compiling (or running) either side under them fails, the candidate is refused with that
    # reason (never checked without them)
    kept = None
    ref = ref2 = ref_error = None
    for c in sorted(timed, key=lambda c: -c.record["speedup"]):
        if c.record["speedup"] <= 1.0:
            c.record["reason"] = "not faster than the single-jit loop"
            continue
        if deadline - time.perf_counter() < 2.0 * compile_s:
            c.record["reason"] = "faster, but no time left to check equality"
            continue
        if ref is None and ref_error is None:
            try:  # the iteration's state ([0]), what the optimizer's check compares too (its
                # metrics are not state; their episode_return is NaN while no episode has finished)
                ref = jax.block_until_ready(base_det(_copy(s_ref))[0])
                ref2 = base_det(_copy(s_ref))[0]
            except Exception as e:  # noqa: BLE001 - every candidate to check is refused with it
                ref, ref_error = None, det_failed("the single-jit baseline", e)
                log(f"{row.name}: {ref_error}")
        why = ref_error
        if why is None:
            try:
                if c.kind == "fn":
                    det = jax.jit(c.fn, compiler_options={**c.options, **DETERMINISTIC})
                    got = det(_copy(s_ref, commit=True))[0]
                else:
                    got = c.record["step"].with_compiler_options(DETERMINISTIC)(_copy(s_ref))[0]
            except Exception as e:  # noqa: BLE001 - refused with the reason
                why = det_failed("the candidate", e)
        if why is not None:
            c.record.update(refused=why, reason=f"refused: {why}")
            log(f"{row.name}: {c.label} refused: {why}")
            continue
        c.record.update(compare(got, ref, c.tolerance))
        if c.record["equal"]:
            c.record["reason"] = "kept: faster and equal"
            kept = c
            break
        c.record["reason"] = f"faster but not equal (max |diff| {c.record['max_abs_diff']:.3g})"
    for c in timed:
        if "reason" not in c.record:
            c.record["reason"] = (
                "not faster than the single-jit loop"
                if c.record["speedup"] <= 1.0
                else "faster, not checked: a faster candidate was kept"
            )
    for c in cands:
        c.record.pop("step", None)
    repro = compare(ref2, ref, STREAM_TOLERANCE) if ref is not None else None
    split_rec = None
    if deadline - time.perf_counter() > 3.0 * compile_s + 10.0:
        try:
            log(f"{row.name}: where the time goes (collect / learn, plan's options)")
            if kept is not None and kept.kind == "host":
                # a split plan compiles each stage with its own measured option set (its candidate
                # record lists them); the halves here are timed with XLA's defaults
                opts, label = {}, "default (the split plan's per-stage options: see its stage timings)"
            else:
                opts = kept.options if kept else {}
                label = kept.label if kept and opts else "default"
            split_rec = time_split(row, config, env, state0, opts, label=label)
            log(
                f"{row.name}: collect {split_rec['collect_ms']:.2f} ms, "
                f"learn {split_rec['learn_ms']:.2f} ms, iteration {split_rec['iteration_ms']:.2f} ms"
            )
        except Exception as e:  # noqa: BLE001 - a diagnostic; the row stands without it
            split_rec = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    row_out = {
        "single_jit_env_steps_per_s": single,
        "baseline_env_steps_per_s": single,
        "baseline": "single-jit loop",
        "baseline_block_ms": [t * 1e3 for t in base_times],
        "baseline_compile_s": compile_s,
        "rose_env_steps_per_s": kept.record["env_steps_per_s"] if kept else single,
        "plan": kept.label if kept else "none",
        "plan_detail": kept.summary if kept else "no candidate was faster and equal",
        "candidates": [c.record for c in cands],
        "generator_refused": refused,
        "baseline_reproducible_deterministic": None if repro is None else repro["bitwise"],
        "search_s": time.perf_counter() - t_search,
        "env_steps_per_iteration": env_steps,
        "iterations_per_block": k,
        "config": {key: (list(v) if isinstance(v, tuple) else v) for key, v in row.hp},
        "time_split": split_rec,
    }
    if kept:
        row_out.update({key: kept.record[key] for key in ("equal", "bitwise", "max_abs_diff")})
    else:  # the plan is the baseline itself: nothing was compared ("not checked")
        row_out.update(equal=None, bitwise=None, max_abs_diff=None)
    row_out["_config_env"] = (config, env)
    return row_out


def run_brax(row: Row, config) -> float:
    """Brax's own trainer on ``row``: env steps / s of its best epoch after the compile epoch."""
    from benchmarks.suite import baselines
    from benchmarks.suite.workloads import Workload

    w = Workload(
        algo=row.kind,
        env=row.env,
        num_envs=config.num_envs,
        policy_hidden_sizes=config.policy_hidden_sizes,
        backend=dict(row.env_kwargs).get("backend"),
        brax_env=row.brax_env,
        iterations_per_block=row.k * (4 if row.kind == "ppo" else 10),
        variants=("single_jit", "rose_jax", "brax"),
    )
    train = baselines.brax_sac_train if row.kind == "sac" else baselines.brax_ppo_train
    run = train(w, config, epochs=3)
    return max(run.sps[1:])


# ------------------------------------------------------------------------------ reports

MD_HEADERS = (
    "workload",
    "baseline env-steps/s",
    "rose env-steps/s",
    "speedup",
    "equal",
    "max abs diff",
    "plan",
    "search s",
)


def _table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("error") or r.get("skipped"):
            out.append(
                [r["workload"], "-", "-", "-", "-", "-", r.get("error") or f"skipped: {r['skipped']}", "-"]
            )
            continue
        out.append(
            [
                r["workload"],
                fmt(r["baseline_env_steps_per_s"], ",.0f"),
                fmt(r["rose_env_steps_per_s"], ",.0f"),
                fmt(r["speedup"], ".3f") + "x",
                common.fmt_equal(r.get("equal")) + (" (bitwise)" if r.get("bitwise") else ""),
                fmt(r["max_abs_diff"], ".3g"),
                r["plan"],
                fmt(r["search_s"], ".0f"),
            ]
        )
    return out


def markdown(rows: list[dict], machine: dict, args) -> str:
    head = (
        f"# Overlap inside one program\n\n{machine['date']} on {machine.get('gpu', machine.get('backend'))}; "
        f"jax {machine['jax']}; `{machine['command']}`\n\n"
    )
    lines = [head, common.markdown_table(MD_HEADERS, _table_rows(rows)), ""]
    lines.append(
        "baseline = the better of our single-jit loop and Brax's own trainer (when it ran: "
        "`brax_env_steps_per_s`); rose = the fastest candidate that is faster than the single-jit loop and "
        "equal to it (one iteration from the same state under `xla_gpu_deterministic_ops`, within the "
        "candidate's tolerance; a candidate whose compile under them fails is refused); plan `none` = no "
        "candidate qualified (rose = single-jit loop; equal: not checked, nothing was kept). The micro "
        "row counts chain steps.\n"
    )
    for r in rows:
        lines.append(f"## {r['workload']}\n")
        if r.get("error"):
            lines.append(f"error: {r['error']}\n")
            continue
        if r.get("skipped"):
            lines.append(f"skipped: {r['skipped']}\n")
            continue
        lines.append(f"plan: `{r['plan']}`: {r.get('plan_detail', '')}\n")
        if r.get("brax_env_steps_per_s") is not None:
            lines.append(
                f"Brax: {r['brax_env_steps_per_s']:,.0f} env-steps/s; single-jit loop: "
                f"{r['single_jit_env_steps_per_s']:,.0f}\n"
            )
        if r.get("measured"):
            lines.append(f"measured {r['measured']['date']}: `{r['measured']['command']}`\n")
        target = TARGETS.get(r["workload"])
        if target is not None and r.get("speedup") is not None:
            verdict = "met" if r["speedup"] >= target else "missed"
            lines.append(f"target >= {target:.2f}x over the best baseline: {verdict} ({r['speedup']:.3f}x)\n")
        ts = r.get("time_split")
        if ts and not ts.get("error"):
            lines.append(
                f"where the time goes (each half compiled alone with {ts['options']} options, median of "
                f"{ts['calls']} synchronised calls): collect (policy + physics) {ts['collect_ms']:.2f} ms, "
                f"learn (gradient steps) {ts['learn_ms']:.2f} ms = {100 * ts['collect_share']:.0f}% / "
                f"{100 * (1 - ts['collect_share']):.0f}%; the whole iteration {ts['iteration_ms']:.2f} ms "
                f"(sum of halves / whole = {ts['sum_over_whole']:.2f}).\n"
            )
        elif ts:
            lines.append(f"time split failed: {ts['error']}\n")
        if r.get("times_ms"):
            lines.append(
                "times per call: "
                + ", ".join(f"{k} {v:.2f} ms" for k, v in r["times_ms"].items())
                + f" (streams vs the two loops one after the other: {r['speedup_vs_two_loops']:.2f}x)\n"
            )
        cands = r.get("candidates") or []
        if cands:
            lines.append("| candidate | env-steps/s | speedup | outcome |\n|---|---:|---:|---|")
            for c in cands:
                outcome = c.get("reason") or c.get("refused") or c.get("error") or c.get("skipped") or "timed"
                if c.get("refused"):
                    outcome = "refused: " + c["refused"]
                lines.append(
                    f"| {c['label']} | {fmt(c.get('env_steps_per_s'), ',.0f')} | "
                    f"{fmt(c.get('speedup'), '.3f')} | {outcome} |"
                )
            lines.append("")
            for c in cands:
                lines.append(f"- `{c['label']}`: {c['summary']}")
                if c.get("split"):
                    lines.append(
                        f"  - stages {c['split'].get('stages')}, options {c['split'].get('options')}, "
                        f"stage timings (ms) {c['split'].get('timings_ms')}"
                    )
            lines.append("")
        for g in r.get("generator_refused") or []:
            lines.append(f"- refused by legality: `{g['label']}`: {g['reason']}")
        lines.append("")
    lines.append(f"budget {args.budget_s:.0f} s; wall {common.elapsed():.0f} s\n")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error") and not r.get("skipped")]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(ok) + 2), 4))
    xs = range(len(ok))
    ax.bar([x - 0.2 for x in xs], [1.0] * len(ok), width=0.4, label="baseline (best)")
    ax.bar([x + 0.2 for x in xs], [r["speedup"] for r in ok], width=0.4, label="rose-jax")
    for x, r in zip(xs, ok, strict=True):
        ax.text(x + 0.2, r["speedup"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["workload"].replace(" (", "\n(") for r in ok], fontsize=8)
    ax.set_ylabel("env steps / s relative to the best baseline")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    ax.set_title("Overlap inside one program (stream regions, per-component compilation)")
    common.save_plot(fig, path)


# ------------------------------------------------------------------------------ main


def select_rows(rows: list[Row], patterns: list[str] | None) -> list[Row]:
    """Rows named by ``patterns``: an exact name, else every name starting with it (``micro``:
    the micro row), in the rows' own order; None or empty: all."""
    if not patterns:
        return rows
    chosen = set()
    for p in patterns:
        exact = [r.name for r in rows if r.name == p]
        chosen.update(
            exact or [r.name for r in rows if r.name.startswith(p) or (p == "micro" and r.kind == "micro")]
        )
    unknown = [
        p
        for p in patterns
        if not any(r.name.startswith(p) or (p == "micro" and r.kind == "micro") for r in rows)
    ]
    if unknown:
        raise SystemExit(f"overlap: no row matches {unknown}; rows: {', '.join(r.name for r in rows)}")
    return [r for r in rows if r.name in chosen]


def _measured_rows(selected: list[Row], out_dir: str) -> list[dict]:
    """``--brax-only``: the selected rows as an earlier results.json has them (measured, no error),
    each with the config Brax's trainer needs; a row not there is reported and left out."""
    import algos

    path = os.path.join(out_dir, "results.json")
    if not os.path.exists(path):
        raise SystemExit(f"overlap --brax-only: no {path}; run the rows first")
    with open(path) as f:
        old = {r["workload"]: r for r in json.load(f).get("rows", [])}
    rows = []
    for row in selected:
        rec = old.get(row.name)
        if row.kind == "micro" or row.brax_env is None:
            continue  # no Brax trainer runs this row
        needed = ("single_jit_env_steps_per_s", "rose_env_steps_per_s")
        if rec is None or rec.get("error") or rec.get("skipped") or any(k not in rec for k in needed):
            log(f"{row.name}: --brax-only: no measured row in {path}; left out")
            continue
        rec = dict(rec)
        rec["_config_env"] = (algos.get(row.kind).Config(**dict(row.hp)), None)
        rows.append(rec)
    return rows


def write_results(rows: list[dict], out_dir: str, args) -> list[dict]:
    """Write results.json / .md / .png (atomically) for ``rows`` (plus, with ``--merge``, the rows
    of an earlier results.json not run now); returns the rows written. Called after every row."""
    rows = [{k: v for k, v in r.items() if k != "_config_env"} for r in rows]
    if args.merge and os.path.exists(os.path.join(out_dir, "results.json")):
        with open(os.path.join(out_dir, "results.json")) as f:
            old = json.load(f).get("rows", [])
        names = {r["workload"] for r in rows}
        order = [r.name for r in rows_for(args.smoke)]
        rows = sorted(
            [r for r in old if r["workload"] not in names] + rows,
            key=lambda r: order.index(r["workload"]) if r["workload"] in order else len(order),
        )
    machine = common.machine_info()
    doc = {
        "rows": rows,
        "machine": machine,
        "command": machine["command"],
        "date": machine["date"],
        "budget_s": args.budget_s,
        "wall_s": common.elapsed(),
        "smoke": args.smoke,
    }
    atomic_write_json(os.path.join(out_dir, "results.json"), doc)
    atomic_write_text(os.path.join(out_dir, "results.md"), markdown(rows, machine, args))
    plot(rows, os.path.join(out_dir, "results.png"))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check with tiny sizes (pendulum)")
    p.add_argument("--rows", nargs="*", default=None, help="row name prefixes to run (micro, sac, ppo, ...)")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting work after this many seconds")
    p.add_argument(
        "--max-candidates",
        type=int,
        default=None,
        help="legal library candidates timed per row, highest predicted gain first (default 3)",
    )
    p.add_argument(
        "--brax",
        choices=("auto", "on", "off"),
        default="auto",
        help="Brax's trainer as a baseline: auto = when time remains after all rows",
    )
    p.add_argument(
        "--isolate",
        choices=("all", "first", "none"),
        default=None,
        help="candidate compiles in a child first: all (GPU default), first (CPU default), none",
    )
    p.add_argument("--merge", action="store_true", help="keep rows of an earlier results.json not run now")
    p.add_argument(
        "--brax-only",
        action="store_true",
        help="only Brax's trainer for the selected rows of an earlier results.json (implies --merge)",
    )
    p.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT}; smoke: a temp dir)")
    p.add_argument(
        "--compile-cache", default="", help="JAX persistent compilation cache directory ('' = off)"
    )
    args = p.parse_args(argv)
    if args.brax_only:
        args.merge = True
        if args.brax == "off":
            p.error("--brax-only needs --brax on or auto")
    if args.max_candidates is None:
        # smoke too: on a CPU the split_compile candidates come first (every prediction is 0 there),
        # the third is a stream region (a fn candidate, timed in the K-loop)
        args.max_candidates = 3
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import jax

    common.enable_compile_cache(args.compile_cache)
    gpu = _gpu()
    out_dir = args.out or (tempfile.mkdtemp(prefix="rose_overlap_smoke_") if args.smoke else DEFAULT_OUT)
    os.makedirs(out_dir, exist_ok=True)
    iso = Isolation(args.isolate or ("all" if gpu else "first"))
    log(f"JAX {jax.__version__} backend={jax.default_backend()}; isolation {iso.mode}; out {out_dir}")
    deadline = time.perf_counter() - common.elapsed() + args.budget_s
    selected = select_rows(rows_for(args.smoke), args.rows)
    machine_now = common.machine_info()
    rows: list[dict] = []
    if args.brax_only:
        rows = _measured_rows(selected, out_dir)
        selected = [row for row in selected if any(r["workload"] == row.name for r in rows)]
    for row in [] if args.brax_only else selected:
        rec: dict[str, Any] = {"workload": row.name}
        left = deadline - time.perf_counter()
        if left < (20.0 if row.kind == "micro" or args.smoke else 90.0):
            rec["skipped"] = f"budget ({left:.0f} s left)"
            rows.append(rec)
            log(f"{row.name}: skipped ({rec['skipped']})")
            continue
        t0 = time.perf_counter()
        try:
            rec.update(
                run_micro(row, args, iso) if row.kind == "micro" else run_algo(row, args, iso, deadline)
            )
            rec["speedup"] = rec["rose_env_steps_per_s"] / rec["baseline_env_steps_per_s"]
        except Exception as e:  # noqa: BLE001 - one failing row is reported, the script goes on
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
            rec["traceback"] = traceback.format_exc()[-3000:]
            log(f"{row.name}: failed: {rec['error']}")
        rec["row_s"] = time.perf_counter() - t0
        rec["measured"] = {"date": machine_now["date"], "command": machine_now["command"]}
        rows.append(rec)
        write_results(rows, out_dir, args)  # after every row: a killed call keeps what it measured
    # Brax's trainer last, in row order, while time remains
    for rec, row in zip(rows, selected, strict=True):
        cfg = rec.pop("_config_env", None)
        if cfg is None or row.brax_env is None or args.brax == "off" or args.smoke:
            continue
        left = deadline - time.perf_counter()
        if left < 150.0 if args.brax == "auto" else left < 60.0:
            rec["brax"] = f"skipped: budget ({left:.0f} s left)"
            continue
        try:
            log(f"{row.name}: Brax's own trainer")
            rec["brax_env_steps_per_s"] = run_brax(row, cfg[0])
            rec.pop("brax", None)  # an earlier run's skip/failure note no longer holds
            rec["baseline_env_steps_per_s"] = max(
                rec["single_jit_env_steps_per_s"], rec["brax_env_steps_per_s"]
            )
            brax_wins = rec["brax_env_steps_per_s"] > rec["single_jit_env_steps_per_s"]
            rec["baseline"] = "Brax train" if brax_wins else "single-jit loop"
            rec["speedup"] = rec["rose_env_steps_per_s"] / rec["baseline_env_steps_per_s"]
            rec["brax_measured"] = {"date": machine_now["date"], "command": machine_now["command"]}
        except Exception as e:  # noqa: BLE001
            rec["brax"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        write_results(rows, out_dir, args)
    rows = write_results(rows, out_dir, args)
    table = common.markdown_table(MD_HEADERS, _table_rows(rows))
    log(f"done in {common.elapsed():.0f} s; {out_dir}/results.md")
    print("\n" + table, flush=True)
    return rows


if __name__ == "__main__":
    main()
