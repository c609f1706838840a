"""Slack-aware SM-quota search for k concurrent branches that join.

k branches run at the same time, each in its own MPS worker with an SM quota q_i (percent), and
the iteration waits for all of them: its time is the *join time* max_i t_i(q_i). Equal quotas
waste SMs on a branch that finishes early (slack) while the critical branch waits for SMs. The
search measures each branch alone at a few quotas, models t_i(q) by interpolation, and picks

    q* = argmin_q  max_i t_i(q_i)   subject to  sum_i q_i <= budget,  q_i in {step, 2 step, .., 100}

(coarse grid first, then a refinement around the chosen point). Every measured point is kept in
a log of frozen, JSON-able ``QuotaPoint`` records.

The model of one branch (``BranchModel``): measured points sorted by quota; repeated points at
one quota are reduced to their median; a running minimum over increasing quota removes noise
that says more SMs made a branch slower (an MPS quota is a limit, so a branch given more SMs can
always behave as with fewer); between points t is linear in 1/q (exact for compute-bound
t = a + c/q); below the smallest measured quota q0, t(q) = t(q0) q0 / q (as if compute-bound);
above the largest, t is flat (no gain assumed where nothing was measured).

The choice (``choose_quotas``) is exact for non-increasing models: the smallest feasible join
time T* is found by bisection over the candidate values t_i(q), each branch gets the smallest
quota with t_i(q_i) <= T*, and the leftover is handed out one step at a time to the slowest
branch whose time still drops (so a memory-bound branch on its plateau gets no more SMs).

Oversubscription: MPS quotas are limits, not reservations, so the sum of the quotas of clients
running at once may exceed 100, and ``budget`` allows up to 100 k. The default is 100 because
the model is built from branches measured *alone*: once the quotas of concurrent branches sum
to more than 100 they compete for the same SMs and t_i(q_i) no longer predicts the join time.
Use budget > 100 only together with a concurrent end-to-end measurement.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import statistics
from typing import Callable, Iterable, Mapping, Sequence

# A batched measurement: given (branch index, quota percent) pairs, return seconds for each.
Measure = Callable[[Sequence[tuple[int, int]]], Sequence[float]]

_REL_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class QuotaPoint:
    """One measurement: branch index, quota (percent), time (seconds), search round."""

    branch: int
    quota: int
    seconds: float
    round: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BranchModel:
    """t(q) of one branch from measured points (see the module docstring for the rules).

    quotas: measured quotas, increasing (percent). seconds: modelled time at each, after the
    median over repeats and the running minimum (non-increasing).
    """

    quotas: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, q: float) -> float:
        qs, ts = self.quotas, self.seconds
        if q <= 0:
            raise ValueError(f"quota must be > 0, got {q}")
        if q <= qs[0]:
            return ts[0] * qs[0] / q
        if q >= qs[-1]:
            return ts[-1]
        j = bisect.bisect_left(qs, q)
        if qs[j] == q:
            return ts[j]
        qa, qb, ta, tb = qs[j - 1], qs[j], ts[j - 1], ts[j]
        w = (1.0 / q - 1.0 / qa) / (1.0 / qb - 1.0 / qa)
        return ta + w * (tb - ta)


def fit_branch(points: Iterable[tuple[int, float]], *, monotone: bool = True) -> BranchModel:
    """Model one branch from (quota, seconds) pairs; at least one point, all times > 0."""
    by_q: dict[int, list[float]] = {}
    for q, t in points:
        _check_quota(q)
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(
                f"measured time at quota {q} must be a finite positive number of seconds, got {t!r}"
            )
        by_q.setdefault(int(q), []).append(float(t))
    if not by_q:
        raise ValueError("fit_branch needs at least one (quota, seconds) point")
    qs = tuple(sorted(by_q))
    ts = [statistics.median(by_q[q]) for q in qs]
    if monotone:
        for j in range(1, len(ts)):
            ts[j] = min(ts[j], ts[j - 1])
    return BranchModel(qs, tuple(ts))


def quota_grid(step: int = 1) -> tuple[int, ...]:
    """Allowed quotas: multiples of step up to 100."""
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= 100:
        raise ValueError(f"quota step must be an int in 1..100, got {step!r}")
    return tuple(range(step, 101, step))


def even_quotas(k: int, budget: int = 100, step: int = 1) -> tuple[int, ...]:
    """The equal split: budget // k per branch, rounded down to the step (capped at 100)."""
    _check_k_budget(k, budget, step)
    q = min(100, (budget // k) // step * step)
    return (q,) * k


def default_coarse_grid(k: int, budget: int = 100) -> tuple[int, ...]:
    """Coarse quotas for k branches: 10, 20, ... up to what leaves 10 for every other branch."""
    _check_k_budget(k, budget, 1)
    top = min(100, budget - 10 * (k - 1))
    grid = tuple(range(10, top + 1, 10))
    return grid or (max(1, budget // k),)


def join_time(models: Sequence[BranchModel], quotas: Sequence[int]) -> float:
    """Modelled join time max_i t_i(q_i), seconds."""
    if len(models) != len(quotas):
        raise ValueError(f"{len(models)} models but {len(quotas)} quotas")
    return max(m(q) for m, q in zip(models, quotas, strict=True))


def choose_quotas(models: Sequence[BranchModel], *, budget: int = 100, step: int = 1) -> tuple[int, ...]:
    """Quotas minimising the modelled join time with sum <= budget (exact; see module docstring)."""
    k = len(models)
    _check_k_budget(k, budget, step)
    grid = quota_grid(step)
    tables = [[m(q) for q in grid] for m in models]

    def min_index(i: int, target: float) -> int | None:
        row = tables[i]
        for j, t in enumerate(row):
            if t <= target * (1 + _REL_TOL):
                return j
        return None

    def quotas_for(target: float) -> list[int] | None:
        idx = [min_index(i, target) for i in range(k)]
        if any(j is None for j in idx):
            return None
        qs = [grid[j] for j in idx]
        return qs if sum(qs) <= budget else None

    candidates = sorted({t for row in tables for t in row})
    lo, hi = 0, len(candidates) - 1
    if quotas_for(candidates[hi]) is None:  # cannot happen: every branch at `step` fits
        raise ValueError("no feasible quota assignment")
    while lo < hi:
        mid = (lo + hi) // 2
        if quotas_for(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    qs = quotas_for(candidates[lo])
    assert qs is not None
    # Hand out the leftover: slowest branch first, only where the time still drops.
    while sum(qs) + step <= budget:
        order = sorted(range(k), key=lambda i: -models[i](qs[i]))
        for i in order:
            if qs[i] + step <= 100 and models[i](qs[i] + step) < models[i](qs[i]) * (1 - _REL_TOL):
                qs[i] += step
                break
        else:
            break
    return tuple(qs)


@dataclasses.dataclass(frozen=True)
class QuotaSearchResult:
    """Outcome of a quota search (times in seconds, quotas in percent).

    quotas / predicted_join_s: the choice and its modelled join time.
    even_quotas / predicted_even_join_s: the equal split and its modelled join time.
    points: every measured point, in measurement order.
    """

    quotas: tuple[int, ...]
    predicted_join_s: float
    even_quotas: tuple[int, ...]
    predicted_even_join_s: float
    budget: int
    step: int
    points: tuple[QuotaPoint, ...]

    @property
    def predicted_gain(self) -> float:
        """1 - join(chosen) / join(even): the modelled fraction of time saved."""
        return 1.0 - self.predicted_join_s / self.predicted_even_join_s

    def models(self) -> tuple[BranchModel, ...]:
        return _fit_all(self.points, len(self.quotas))

    def to_dict(self) -> dict:
        return {
            "quotas": list(self.quotas),
            "predicted_join_s": self.predicted_join_s,
            "even_quotas": list(self.even_quotas),
            "predicted_even_join_s": self.predicted_even_join_s,
            "predicted_gain": self.predicted_gain,
            "budget": self.budget,
            "step": self.step,
            "points": [p.to_dict() for p in self.points],
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)


def measure_each(fns: Sequence[Callable[[int], float]]) -> Measure:
    """A batched Measure from one callable per branch: fns[i](quota) -> seconds."""
    fns = tuple(fns)

    def measure(points: Sequence[tuple[int, int]]) -> list[float]:
        return [float(fns[b](q)) for b, q in points]

    return measure


def search_quotas(
    measure: Measure,
    n_branches: int,
    *,
    budget: int = 100,
    coarse: Sequence[int] | None = None,
    refine_step: int = 5,
    refine_rounds: int = 1,
    step: int = 1,
) -> QuotaSearchResult:
    """Measure, model and choose quotas for n_branches concurrent branches.

    measure: batched measurement ``measure([(branch, quota), ...]) -> [seconds, ...]`` (each
      branch alone in a worker at that quota; ``measure_each`` adapts per-branch callables). Each
      round is one call, so an implementation may start one worker per distinct quota at once.
    coarse: quotas measured for every branch first (default ``default_coarse_grid``); the equal
      split is always added so that the reported even-split time is measured, not modelled.
    refine_step / refine_rounds: after each choice, measure each branch at q_i and q_i +- r
      (r = refine_step, halved each further round, never below step).
    """
    _check_k_budget(n_branches, budget, step)
    grid = tuple(sorted(set(default_coarse_grid(n_branches, budget) if coarse is None else coarse)))
    for q in grid:
        _check_quota(q)
    even = even_quotas(n_branches, budget, step)
    points: list[QuotaPoint] = []

    def run(round_name: str, wanted: Iterable[tuple[int, int]]) -> None:
        have = {(p.branch, p.quota) for p in points}
        todo = sorted({(b, q) for b, q in wanted if (b, q) not in have})
        if not todo:
            return
        times = list(measure(todo))
        if len(times) != len(todo):
            raise ValueError(f"measure returned {len(times)} times for {len(todo)} points")
        for (b, q), t in zip(todo, times, strict=True):
            points.append(QuotaPoint(b, q, float(t), round_name))

    run("coarse", [(b, q) for b in range(n_branches) for q in set(grid) | {even[b]}])
    models = _fit_all(points, n_branches)
    quotas = choose_quotas(models, budget=budget, step=step)
    r = refine_step
    for i in range(refine_rounds):
        r = max(step, r)
        wanted = []
        for b, q in enumerate(quotas):
            for dq in (-r, 0, r):
                qq = min(100, max(step, (q + dq) // step * step))
                wanted.append((b, qq))
        run(f"refine{i + 1}", wanted)
        models = _fit_all(points, n_branches)
        quotas = choose_quotas(models, budget=budget, step=step)
        r //= 2
    return QuotaSearchResult(
        quotas=quotas,
        predicted_join_s=join_time(models, quotas),
        even_quotas=even,
        predicted_even_join_s=join_time(models, even),
        budget=budget,
        step=step,
        points=tuple(points),
    )


def quotas_from_tables(
    tables: Sequence[Mapping[int, float]], *, budget: int = 100, step: int = 1
) -> QuotaSearchResult:
    """Choose quotas from given measurement tables ({quota: seconds} per branch), no measuring."""
    points = tuple(
        QuotaPoint(b, int(q), float(t), "table")
        for b, table in enumerate(tables)
        for q, t in sorted(table.items())
    )
    k = len(tables)
    _check_k_budget(k, budget, step)
    models = _fit_all(points, k)
    quotas = choose_quotas(models, budget=budget, step=step)
    even = even_quotas(k, budget, step)
    return QuotaSearchResult(
        quotas, join_time(models, quotas), even, join_time(models, even), budget, step, points
    )


def _fit_all(points: Sequence[QuotaPoint], k: int) -> tuple[BranchModel, ...]:
    models = []
    for b in range(k):
        pts = [(p.quota, p.seconds) for p in points if p.branch == b]
        if not pts:
            raise ValueError(f"no measurement for branch {b}")
        models.append(fit_branch(pts))
    return tuple(models)


def _check_quota(q) -> None:
    if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= 100:
        raise ValueError(f"quota must be an int percent in 1..100, got {q!r}")


def _check_k_budget(k: int, budget: int, step: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"number of branches must be an int >= 1, got {k!r}")
    quota_grid(step)
    if isinstance(budget, bool) or not isinstance(budget, int) or not k * step <= budget <= 100 * k:
        raise ValueError(f"budget must be an int in [{k * step}, {100 * k}] for {k} branches, got {budget!r}")
