"""Learning equivalence: does a plan kept under a tolerance still learn like the original?

A transform that only reorders floating-point operations (a batched matmul, a reduction in
another order, kernels on other streams) cannot be checked bitwise; its per-step differences are
last-bit, but RL training amplifies them, so a stepwise tolerance alone does not show that the
trained agents are as good. Issue 32's rule: keep such a plan only when, over at least
:data:`MIN_SEEDS` seeds per side, the final returns are not different at the 5 % level (Welch's
t-test, ``scipy.stats.ttest_ind(equal_var=False)``) AND their means are within 5 % of each other
(relative to the reference's mean magnitude, or to the returns' spread when that mean is near
zero, so a near-zero mean cannot make every difference look large).

:func:`compare_returns` is the rule, pure (numbers in, a :class:`LearningCheck` out); the
training that produces the returns is the caller's (``algos.equivalence.learning_check`` trains
both sides with ``algos.sweep.train_many``, one vmapped program per side).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

MIN_SEEDS = 5
ALPHA = 0.05
MEAN_TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class LearningCheck:
    """The verdict with its numbers: the final returns of each side, Welch's p-value, the means
    and their relative difference, and ``passed`` with the ``reason`` in one line."""

    reference: tuple[float, ...]
    candidate: tuple[float, ...]
    p_value: float | None
    mean_reference: float
    mean_candidate: float
    relative_difference: float
    passed: bool
    reason: str
    alpha: float = ALPHA
    mean_tolerance: float = MEAN_TOLERANCE

    def to_json(self) -> dict:
        return {
            "seeds": len(self.reference),
            "reference": list(self.reference),
            "candidate": list(self.candidate),
            "p_value": self.p_value,
            "mean_reference": self.mean_reference,
            "mean_candidate": self.mean_candidate,
            "relative_difference": self.relative_difference,
            "alpha": self.alpha,
            "mean_tolerance": self.mean_tolerance,
            "passed": self.passed,
            "reason": self.reason,
        }


def _finite(name: str, xs: Sequence[float]) -> tuple[float, ...]:
    out = tuple(float(x) for x in xs)
    bad = [x for x in out if not math.isfinite(x)]
    if bad:
        raise ValueError(f"compare_returns: {name} returns must be finite, got {bad[:3]}")
    return out


def compare_returns(
    reference: Sequence[float],
    candidate: Sequence[float],
    *,
    alpha: float = ALPHA,
    mean_tolerance: float = MEAN_TOLERANCE,
    min_seeds: int = MIN_SEEDS,
) -> LearningCheck:
    """Issue 32's learning-equivalence rule on the final returns of two sets of seeds."""
    from scipy import stats

    ref, cand = _finite("reference", reference), _finite("candidate", candidate)
    if len(ref) < min_seeds or len(cand) < min_seeds:
        raise ValueError(
            f"compare_returns: need at least {min_seeds} seeds per side, got {len(ref)} and {len(cand)}"
        )
    if not (0.0 < alpha < 1.0) or mean_tolerance < 0:
        raise ValueError(
            f"compare_returns: alpha in (0, 1) and mean_tolerance >= 0, got {alpha}, {mean_tolerance}"
        )
    m_ref, m_cand = sum(ref) / len(ref), sum(cand) / len(cand)
    spread = max(
        stats.tstd(ref) if len(set(ref)) > 1 else 0.0, stats.tstd(cand) if len(set(cand)) > 1 else 0.0
    )
    scale = max(abs(m_ref), spread, 1e-12)
    rel = abs(m_cand - m_ref) / scale
    if len(set(ref)) == 1 and len(set(cand)) == 1:
        p = 1.0 if ref[0] == cand[0] else 0.0  # no spread on either side: equal or not
    else:
        p = float(stats.ttest_ind(cand, ref, equal_var=False).pvalue)
    different = p < alpha
    far = rel > mean_tolerance
    passed = not different and not far
    if passed:
        reason = (
            f"learns alike: p={p:.3f} >= {alpha} and means {m_cand:.4g} vs {m_ref:.4g} "
            f"within {100 * mean_tolerance:.0f}% ({100 * rel:.1f}%), {len(ref)}+{len(cand)} seeds"
        )
    else:
        why = []
        if different:
            why.append(f"final returns differ (Welch p={p:.3g} < {alpha})")
        if far:
            why.append(
                f"means {m_cand:.4g} vs {m_ref:.4g} differ by {100 * rel:.1f}% > {100 * mean_tolerance:.0f}%"
            )
        reason = "; ".join(why) + f", {len(ref)}+{len(cand)} seeds"
    return LearningCheck(ref, cand, p, m_ref, m_cand, rel, passed, reason, alpha, mean_tolerance)
