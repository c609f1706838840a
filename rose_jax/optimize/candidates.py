"""Candidate transformations for a traced iteration: every registered family's, by predicted gain.

:func:`generate_candidates` builds one :class:`~rose_jax.optimize.predict.CandidateContext`
(the LoopTree, the Program if any, the baseline's time, the profiled windows, the platform) and
calls each family's ``candidates(ctx)`` in the registry's order
(:func:`rose_jax.optimize.registry.families`): unrolling and hoisting per scan
(:mod:`~rose_jax.optimize.scans`), fusion of equal-length sibling scans
(:mod:`~rose_jax.optimize.fuse`), offloading a metrics-only top-level component
(:mod:`~rose_jax.optimize.offload`), env-group rollouts of a Program
(:mod:`~rose_jax.optimize.group_rollout`), per-component compilation
(:mod:`~rose_jax.optimize.split_compile`), independent work of a loop body on its own GPU
streams (:mod:`~rose_jax.optimize.stream_overlap`) and while loops with a static bound as bounded
masked scans (:mod:`~rose_jax.optimize.loops`). A family whose ``candidates`` raises is reported
(a warning naming it and the error) and contributes none; the others still do. Each family
states its prediction model in its ``candidates``; predictions are models, not measurements: the
search measures every candidate it keeps. A generated candidate may be illegal (e.g. two stream
regions coupled by a global-norm clip, a while loop without a bound): the search refuses it with
the reason.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from rose_jax.optimize import registry
from rose_jax.optimize.predict import Candidate, CandidateContext
from rose_jax.program import Program

__all__ = ["Candidate", "CandidateContext", "generate_candidates"]


def generate_candidates(
    tree: Any,
    program: Program | None,
    baseline_s: float,
    windows=None,
    platform: str = "cpu",
    unroll_factors: Sequence[int] = (2, 4, 8),
    group_sizes: Sequence[int] = (2, 4),
    group_modes: Sequence[str] = ("interleaved", "processes"),
    families: Sequence[str] | None = None,
    phases: Sequence[dict] | None = None,
    concurrent_processes: bool | None = None,
    base_options: str | None = None,
    options_saved_s: float = 0.0,
) -> list[Candidate]:
    """Every family's candidates for the windows (or, without windows, every loop by cost), with
    predicted gains, highest first (ties in family order).

    ``families``: transform names to generate (e.g. ``("stream_overlap", "split_compile")``);
    None: all. Families that make none of them are not asked. ``phases``: the profile's timed
    components (``path``, ``level``, ``time_s``), so that predictions rest on measured component
    times (:func:`rose_jax.optimize.predict.measured_share`). ``concurrent_processes``: whether
    worker processes run concurrently with this one (an MPS client) or time-sliced (False).
    ``base_options`` / ``options_saved_s``: the XLA option set the baseline already runs under
    and what it saved per iteration against XLA's defaults (see ``CandidateContext``).
    """
    ctx = CandidateContext(
        tree,
        program,
        baseline_s,
        windows,
        platform,
        tuple(unroll_factors),
        tuple(group_sizes),
        tuple(group_modes),
        phases,
        concurrent_processes,
        base_options,
        options_saved_s,
    )
    wanted = None if families is None else set(families)
    out: list[Candidate] = []
    for module, names in registry.families().items():
        if wanted is not None and not wanted & set(names):
            continue
        try:
            out.extend(registry.family_candidates(module)(ctx))
        except Exception as e:  # noqa: BLE001 - one family's failure must not end the search
            warnings.warn(
                f"rose_jax.optimize: family {module} generated no candidates: {type(e).__name__}: {e}",
                stacklevel=2,
            )
    if wanted is not None:
        out = [c for c in out if c.transform.name in wanted]
    out.sort(key=lambda c: -(c.predicted or 0.0))
    return out
