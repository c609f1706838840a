"""Timing and result comparison for the search (host side, impure: clocks and device syncs).

``run_iterations`` times ``n_iters`` calls of an iteration function from one start state,
``time_repeats`` does that several times (after one untimed warm-up call that compiles), and
``compare_trees`` is a chex-style leaf-wise comparison that also reports the largest absolute
and relative differences (``chex.assert_trees_all_close`` says only pass/fail).

Stepwise equality (for chaotic iterations, e.g. MJX physics where last-bit differences become
different episode terminations within a few iterations): ``trajectory`` collects the
reference's own states ``s_0 .. s_N``, ``step_outputs`` runs ONE iteration of a step from each
of ``s_0 .. s_{N-1}``, and ``compare_each`` compares two such lists state by state. Two steps
that agree there compute the same function at N real states, whatever the trajectories do.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from rose_jax.optimize import base


class Timing(NamedTuple):
    """Seconds per iteration of each repeat; ``median`` and a robust ``spread`` of them."""

    per_iter_s: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(np.median(self.per_iter_s)) if self.per_iter_s else float("nan")

    @property
    def mad(self) -> float:
        """Median absolute deviation (s): the run-to-run noise within this set of repeats."""
        if not self.per_iter_s:
            return float("nan")
        x = np.asarray(self.per_iter_s)
        return float(np.median(np.abs(x - np.median(x))))


def run_iterations(step: Callable, state: Any, n_iters: int) -> tuple[Any, float]:
    """``n_iters`` calls ``state, _ = step(state)``; returns the final state and the wall seconds.

    A :class:`~rose_jax.optimize.base.HostStep` that leaves work running in worker processes
    (e.g. an offloaded evaluation) is drained before the clock stops: its time counts.
    """
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(n_iters):
        state, _ = step(state)
    jax.block_until_ready(state)
    base.drain(step)
    return state, time.perf_counter() - t0


def time_repeats(
    step: Callable, state: Any, n_iters: int, repeats: int, warmup: bool = True
) -> tuple[Any, Timing]:
    """Warm up (compile) once, then ``repeats`` timed runs of ``n_iters`` iterations from ``state``.

    Returns the final state of the last run (every run starts from the same ``state``, so every
    run of a deterministic program ends in the same state) and the per-iteration times.
    """
    if n_iters < 1 or repeats < 1:
        raise ValueError(f"n_iters and repeats must be >= 1, got {n_iters}, {repeats}")
    if warmup:
        jax.block_until_ready(step(state))
    times, final = [], state
    for _ in range(repeats):
        final, dt = run_iterations(step, state, n_iters)
        times.append(dt / n_iters)
    return final, Timing(tuple(times))


def time_alternating(
    steps: list[Callable], state: Any, n_iters: int, repeats: int
) -> list[tuple[Any, Timing]]:
    """Time several iteration functions in turns (A B A B ...) so that drift hits all alike.

    Each is warmed up (compiled) first; every run starts from ``state``. Returns, per function,
    the final state of its last run and its per-iteration times.
    """
    if n_iters < 1 or repeats < 1:
        raise ValueError(f"n_iters and repeats must be >= 1, got {n_iters}, {repeats}")
    for step in steps:
        jax.block_until_ready(step(state))
    finals: list[Any] = [state] * len(steps)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            finals[i], dt = run_iterations(step, state, n_iters)
            times[i].append(dt / n_iters)
    return [(f, Timing(tuple(t))) for f, t in zip(finals, times, strict=True)]


def time_call(fn: Callable, args: tuple, repeats: int) -> Timing:
    """Per-call seconds of ``fn(*args)`` (one untimed warm-up call first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return Timing(tuple(times))


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
        a_np, r_np = _host(a), _host(r)
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


def _host(x: Any) -> np.ndarray:
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


# ----------------------------------------------------------------------------- stepwise


def trajectory(step: Callable, state: Any, n_iters: int) -> list:
    """``[s_0 = state, s_1, ..., s_N]``: the states along ``step``'s own trajectory (N = n_iters).

    ``step`` must return full states (a jitted single-process iteration); N + 1 states are held.
    """
    if n_iters < 1:
        raise ValueError(f"trajectory: n_iters must be >= 1, got {n_iters}")
    states = [state]
    for _ in range(n_iters):
        states.append(step(states[-1])[0])
    jax.block_until_ready(states)
    return states


def step_outputs(step: Callable, states: Sequence[Any], sync: Callable | None = None) -> list:
    """The state after ONE call of ``step`` from each of ``states`` (each call starts afresh).

    ``sync`` maps an output to the full state (a host-level step whose env state stays in its
    worker processes: its ``sync_state``); it is applied right after each call.
    """
    outs = []
    for s in states:
        out, _ = step(s)
        outs.append(sync(out) if sync is not None else out)
    return outs


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
