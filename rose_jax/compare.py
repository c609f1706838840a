"""Leaf-wise comparison of two pytrees, in each leaf's own scale: :func:`compare_trees`,
:func:`compare_each` and their :class:`Comparison`.

A chex-style comparison that also reports the largest absolute and relative differences (chex's
``assert_trees_all_close`` says only pass/fail). The optimizer's search (:mod:`rose_jax.optimize`)
decides equality with it and the profiler (:func:`rose_jax.profile.phases.compare_outputs`)
checks its segmented outputs with it; it imports neither, so either can use it without the other.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import numpy as np


class Comparison(NamedTuple):
    """Leaf-wise comparison of two pytrees, in each leaf's own scale.

    ``equal``: same structure and shapes; every other-than-float leaf (ints, bools, keys)
    identical; every float leaf within ``|a - r| <= atol + rtol * max|r|`` elementwise, where
    ``max|r|`` is the largest magnitude in that reference leaf (so an Adam second moment of 1e-5
    and a summed variance of 1e3 are each judged in their own units). A NaN equals nothing, not
    even a NaN: a float leaf with a NaN on either side is unequal (its diff counts as infinite),
    whatever the tolerance.
    ``max_abs``: largest ``|a - r|``; ``max_rel``: largest ``max|a - r| / max|r|`` over leaves;
    ``worst``: the path of the leaf with the largest ``max_rel``.
    """

    equal: bool
    max_abs: float
    max_rel: float
    worst: str
    reason: str

    def to_json(self) -> dict:
        return {
            "equal": self.equal,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "worst": self.worst,
            "reason": self.reason,
        }


def compare_trees(actual: Any, reference: Any, rtol: float = 0.0, atol: float = 0.0) -> Comparison:
    """Compare ``actual`` with ``reference`` (see :class:`Comparison`)."""
    a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual)
    r_leaves, r_def = jax.tree_util.tree_flatten_with_path(reference)
    if a_def != r_def:
        return Comparison(
            False, float("inf"), float("inf"), "", f"tree structures differ: {a_def} vs {r_def}"
        )
    max_abs = max_rel = 0.0
    worst, reason, equal = "", "", True
    for (path, a), (_, r) in zip(a_leaves, r_leaves, strict=True):
        name = jax.tree_util.keystr(path) or "<root>"
        a_np, r_np = host_array(a), host_array(r)
        if a_np.shape != r_np.shape:
            return Comparison(
                False, float("inf"), float("inf"), name, f"{name}: shape {a_np.shape} vs {r_np.shape}"
            )
        if not np.issubdtype(r_np.dtype, np.floating):
            if not np.array_equal(a_np, r_np):
                equal, reason, worst = False, f"{name}: non-float leaf differs", name
                max_abs = max_rel = float("inf")
            continue
        if not r_np.size:
            continue
        a64, r64 = a_np.astype(np.float64), r_np.astype(np.float64)
        nan = np.isnan(a64) | np.isnan(r64)  # NaN equals nothing, not even NaN
        same = (a64 == r64) & ~nan  # equal infinities included
        with np.errstate(invalid="ignore"):  # inf - inf (equal infinities: same, 0)
            diff = np.where(same, 0.0, np.abs(a64 - r64))
        diff = np.where(np.isnan(diff), np.inf, diff)  # a NaN's diff counts as infinite
        finite = np.abs(r64[np.isfinite(r64)])
        scale = float(finite.max()) if finite.size else 0.0
        leaf_abs = float(diff.max())
        leaf_rel = leaf_abs / scale if scale > 0 else (0.0 if leaf_abs == 0 else float("inf"))
        if leaf_rel > max_rel or not worst:
            worst = name if leaf_abs > 0 else worst
        max_abs, max_rel = max(max_abs, leaf_abs), max(max_rel, leaf_rel)
        if equal and nan.any():
            equal = False
            reason = f"{name}: NaN in {int(nan.sum())} element(s) (a NaN equals nothing, not even a NaN)"
        elif equal and leaf_abs > atol + rtol * scale:
            equal = False
            reason = (
                f"{name}: max |diff| {leaf_abs:.3g} > atol {atol:g} + rtol {rtol:g} * max|ref| {scale:.3g}"
            )
    return Comparison(equal, max_abs, max_rel, worst, reason or "within tolerance")


def host_array(x: Any) -> np.ndarray:
    """``x`` as a numpy array on the host (a typed PRNG key as its key data)."""
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def compare_each(
    actual: Sequence[Any], reference: Sequence[Any], rtol: float = 0.0, atol: float = 0.0
) -> Comparison:
    """``compare_trees`` of ``actual[k]`` with ``reference[k]`` for every k, in one Comparison.

    ``equal``: every pair equal; ``max_abs`` / ``max_rel``: the largest over the pairs;
    ``worst``: ``"s_k" + leaf path`` of the largest ``max_rel``; ``reason``: the first unequal
    pair's reason, prefixed ``"from s_k: "``.
    """
    if len(actual) != len(reference) or not reference:
        raise ValueError(
            f"compare_each: need two equally long non-empty lists, got {len(actual)} and {len(reference)}"
        )
    equal, max_abs, max_rel, worst, reason = True, 0.0, 0.0, "", ""
    for k, (a, r) in enumerate(zip(actual, reference, strict=True)):
        c = compare_trees(a, r, rtol, atol)
        if c.max_rel > max_rel or (not worst and c.worst):
            worst = f"s_{k}{c.worst}" if c.worst else worst
        max_abs, max_rel = max(max_abs, c.max_abs), max(max_rel, c.max_rel)
        if equal and not c.equal:
            equal, reason = False, f"from s_{k}: {c.reason}"
    n = len(reference)
    return Comparison(equal, max_abs, max_rel, worst, reason or f"within tolerance from all {n} states")
