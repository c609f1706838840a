"""SM quotas for a multi-process plan: the slack-aware search over its concurrent branches.

A plan the search kept may run parts of an iteration in worker processes at the same time as
each other or as the driver (an offloaded component beside the driver's training; env groups
side by side). Under MPS each worker can be given an SM quota (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
read once when the worker starts). :func:`choose_plan_quotas` decides them, after the search
chose the plan and inside its time:

Which transforms run such processes, and how, each declares (``Transform.worker_quotas``):

* ``"probe"`` (``offload_component``): two branches, the driver's rest of the step and the
  worker's part, from the transform's ``quota_branches(fn, state)`` (e.g.
  :func:`rose_jax.optimize.offload.branches`, each exported with its inputs), each timed ALONE in
  a probe worker at a few quotas (one worker per quota, a client of the plan's MPS daemon);
  :func:`rose_jax.mps.search.search_quotas` models ``t_i(q)`` and picks the split that minimises
  the join ``max_i t_i(q_i)`` with ``sum q_i <= 100``. Only the worker's quota can be applied
  (the driver's share is fixed when the driver starts): the driver is left unlimited and takes
  at least the rest while the worker runs, so the join is no longer than modelled.
* ``"even"`` (``group_rollout(G, "processes")``): G identical branches (same program, N/G envs
  each): the even split is the slack-aware optimum by symmetry, nothing to probe.

Then the plan with the quotas is timed end to end in turns with the plan without them; the quotas
stay in the plan (and so in the plan cache) unless they are measurably slower. Every step is a
:class:`QuotaRecord` in the report: the branches' times at the tried quotas, the chosen split,
the end-to-end times, or why the step was skipped (no MPS on this machine: quotas mean nothing).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rose_jax import runtime
from rose_jax.mps import mps_status, search_quotas
from rose_jax.mps import plan as mps_plan
from rose_jax.optimize import measure
from rose_jax.optimize.base import Transform
from rose_jax.optimize.process_worker import TIME_EXPORTED
from rose_jax.optimize.registry import transform_by_name
from rose_jax.program import Program

QUOTA_MODES = ("auto", "search", "off")
PROBE = "probe"


@dataclasses.dataclass
class QuotaRecord:
    """The quota step for one multi-process transform of the plan (JSON-able).

    status: ``"applied"`` (the quotas are in the plan), ``"not applied"`` (measured slower end to
    end), ``"skipped"`` (no MPS, quotas off, nothing to decide), ``"given"`` (the transform came
    with its quotas: given, or a resumed search's cached plan) or ``"failed"`` (an error, reason
    says which); branches: names; quotas: the chosen percent per branch; applied: the transform
    parameter set from them; points: every probe ``{branch, quota, seconds, round}``;
    e2e_without_s / e2e_with_s: seconds per iteration of the plan without / with the quotas, timed
    in turns; seconds: wall time of this step (inside the search's time).
    """

    transform: str
    status: str
    reason: str
    branches: list[str] = dataclasses.field(default_factory=list)
    quotas: list[int] | None = None
    even_quotas: list[int] | None = None
    applied: dict = dataclasses.field(default_factory=dict)
    predicted_join_s: float | None = None
    predicted_even_join_s: float | None = None
    points: list[dict] = dataclasses.field(default_factory=list)
    e2e_without_s: float | None = None
    e2e_with_s: float | None = None
    seconds: float = 0.0


def mps_available() -> tuple[bool, str]:
    """Whether quotas can mean anything here: a GPU backend and an MPS daemon that can start."""
    if jax.default_backend() != "gpu":
        return False, f"no GPU (JAX backend {jax.default_backend()!r}): SM quotas need MPS on a GPU"
    return mps_status()


def multi_process(t: Transform) -> bool:
    """A transform whose plan runs concurrent worker processes that quotas apply to."""
    return bool(t.worker_quotas)


def probe_branches(
    branches: Sequence[Any], *, daemon: Any = None, repeats: int = 2, timeout: float = 900.0
) -> Callable[[Sequence[tuple[int, int]]], list[float]]:
    """A batched measure for :func:`rose_jax.mps.search.search_quotas`: for each distinct quota,
    one probe worker started at that quota times every branch asked for there, alone, in turn.
    A branch (e.g. :class:`rose_jax.optimize.offload.Branch`) has a ``name``, a ``jax.export``
    ``blob``, its ``digest`` and example ``args``."""

    def measure_points(points: Sequence[tuple[int, int]]) -> list[float]:
        by_quota: dict[int, list[int]] = {}
        for b, q in points:
            by_quota.setdefault(q, []).append(b)
        if not by_quota:
            return []
        seconds: dict[tuple[int, int], float] = {}
        env = () if jax.default_backend() == "gpu" else (("JAX_PLATFORMS", "cpu"),)
        quotas = sorted(by_quota)
        specs = [[mps_plan.WorkerSpec(PROBE, quota=q, env=env)] for q in quotas]
        # one daemon (the caller's, the inherited one, or our own) and a new worker per quota
        with runtime.ManagedPool(specs[0], mps=True, daemon=daemon, prefix="rq", transport="auto") as managed:
            for i, q in enumerate(quotas):
                pool = managed.pool if i == 0 else managed.relaunch(specs[i])
                for b in sorted(set(by_quota[q])):
                    br = branches[b]
                    name = f"rose.probe.{br.digest}"
                    pool.put_resident(PROBE, name, np.frombuffer(br.blob, np.uint8), timeout=timeout)
                    # device arrays travel over CUDA IPC where the pool has it (an env batch can
                    # be larger than /dev/shm)
                    args = tuple(jax.device_put(a) for a in br.args)
                    t = pool.call(
                        PROBE,
                        TIME_EXPORTED,
                        *args,
                        static={"digest": br.digest, "repeats": repeats},
                        jit=False,
                        reads=(name,),
                        timeout=timeout,
                    )
                    pool.drop_resident(PROBE, name)
                    seconds[(b, q)] = float(t)
        return [seconds[(b, q)] for b, q in points]

    return measure_points


def choose_plan_quotas(
    plan: list[Transform],
    target: Any,
    state: Any,
    *,
    mode: str,
    timed: Callable[[list[Transform], list[Transform]], tuple[measure.Timing, measure.Timing]],
    noise: float,
    grid: Sequence[int] = (30, 50, 70),
    refine_rounds: int = 1,
    say: Callable[[str], None] = lambda s: None,
    deadline: float | None = None,
) -> tuple[list[Transform], list[QuotaRecord]]:
    """The plan with quotas where they are measured to help, and one record per multi-process transform.

    ``timed(plan_a, plan_b)`` times two plans end to end in turns (seconds per iteration);
    ``noise`` is the spread a difference must exceed. ``mode``: ``"auto"`` (only where MPS is
    available), ``"search"`` (also without: e.g. a mock daemon in a test), ``"off"``.
    ``deadline``: ``time.perf_counter()`` after which no quota step starts (the search's budget;
    each skipped step says so and its transform stays without quotas).
    """
    if mode not in QUOTA_MODES:
        raise ValueError(f"optimize: quotas must be one of {QUOTA_MODES}, got {mode!r}")
    records: list[QuotaRecord] = []
    plan = list(plan)
    for i, t in enumerate(plan):
        if not multi_process(t):
            continue
        t0 = time.perf_counter()
        rec = QuotaRecord(t.label, "skipped", "")
        records.append(rec)
        params = dict(t.params)
        if params.get("quota") is not None or params.get("quotas") is not None:
            rec.status = "given"
            rec.reason = "the transform already has its quotas (given, or a resumed search's cached plan)"
            continue
        if mode == "off":
            rec.reason = "quotas='off'"
            continue
        if deadline is not None and time.perf_counter() >= deadline:
            rec.reason = "quota step skipped: the search budget is spent (plan kept without quotas)"
            say(f"[optimize] quotas for {t.label}: {rec.reason}")
            continue
        if mode == "auto":
            ok, why = mps_available()
            if not ok:
                rec.reason = f"quota step skipped: {why}"
                say(f"[optimize] quotas for {t.label}: {rec.reason}")
                continue
        try:
            with_quota = _decide(t, target, state, rec, grid, refine_rounds, say)
            trial = plan[:i] + [with_quota] + plan[i + 1 :]
            without, with_ = timed(plan, trial)
            rec.e2e_without_s, rec.e2e_with_s = without.median, with_.median
            if with_.median > without.median + noise:
                rec.status = "not applied"
                rec.reason += (
                    f"; measured slower end to end: {with_.median * 1e3:.3f} vs "
                    f"{without.median * 1e3:.3f} ms/iter without quotas (spread {noise * 1e3:.3f} ms)"
                )
            else:
                rec.status = "applied"
                rec.reason += (
                    f"; end to end {with_.median * 1e3:.3f} ms/iter with, {without.median * 1e3:.3f} "
                    "without quotas"
                )
                plan[i] = with_quota
        except Exception as e:  # noqa: BLE001 - a failed quota step leaves the plan as it was
            rec.status = "failed"
            first = str(e).splitlines()[0][:200] if str(e) else ""
            rec.reason = f"quota step failed ({type(e).__name__}: {first}); plan kept without quotas"
        finally:
            rec.seconds = time.perf_counter() - t0
        say(f"[optimize] quotas for {t.label}: {rec.status}: {rec.reason}")
    return plan, records


def _decide(t: Transform, target, state, rec: QuotaRecord, grid, refine_rounds, say) -> Transform:
    """Fill ``rec`` with the branches' search; the transform with the chosen quotas."""
    params = dict(t.params)
    if t.worker_quotas == "even":
        g = int(params["groups"])
        quotas = [100 // g] * g
        rec.branches = [f"worker: env group {k}" for k in range(g)]
        rec.quotas = rec.even_quotas = quotas
        rec.applied = {"quotas": quotas}
        rec.reason = (
            f"{g} identical branches (the same program on {g} equal env groups): the even split "
            f"{quotas} is the slack-aware optimum, nothing to probe"
        )
        return transform_by_name(t.name, {**params, "quotas": tuple(quotas)})
    fn = target.iteration() if isinstance(target, Program) else target
    branches = t.quota_branches(fn, state)  # worker_quotas == "probe"
    rec.branches = [b.name for b in branches]
    say(f"[optimize] quotas for {t.label}: timing {len(branches)} branches alone at quotas {list(grid)}")
    result = search_quotas(
        probe_branches(branches),
        len(branches),
        coarse=tuple(grid),
        refine_step=10,
        refine_rounds=refine_rounds,
    )
    rec.quotas, rec.even_quotas = list(result.quotas), list(result.even_quotas)
    rec.predicted_join_s, rec.predicted_even_join_s = result.predicted_join_s, result.predicted_even_join_s
    rec.points = [p.to_dict() for p in result.points]
    worker_q = int(result.quotas[1])
    rec.applied = {"quota": worker_q}
    rec.reason = (
        f"slack-aware split {list(result.quotas)} (driver, worker): modelled join "
        f"{result.predicted_join_s * 1e3:.1f} ms vs {result.predicted_even_join_s * 1e3:.1f} ms at the "
        "even split "
        f"{list(result.even_quotas)}; the worker gets {worker_q}%, the driver (its share fixed at its "
        "start) is not limited"
    )
    return transform_by_name(t.name, {**params, "quota": worker_q})
