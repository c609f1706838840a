"""Timing and result comparison for the search (host side, impure: clocks and device syncs).

``run_iterations`` times ``n_iters`` calls of an iteration function from one start state,
``time_repeats`` does that several times (after one untimed warm-up call that compiles); a
host step whose metrics are finished behind the next call is timed as a run calls it
(``run_pipelined``).
``compare_trees`` / ``compare_each`` / ``Comparison`` (a chex-style leaf-wise comparison that also
reports the largest absolute and relative differences) live in :mod:`rose_jax.compare`, which the
profiler uses too; they are importable from here as well.

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

from rose_jax.compare import Comparison, compare_each, compare_trees  # noqa: F401 - re-exported
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


def run_pipelined(step: Callable, state: Any, n_iters: int) -> tuple[Any, float]:
    """:func:`run_iterations` of a step whose metrics a worker finishes behind the next call
    (``HostStep.pipelined``, e.g. an offloaded evaluation), timed as a long run calls it
    (``algos.driver`` reads call k's metrics after dispatching call k+1).

    One untimed call from ``state`` first, so that the first timed call runs beside that call's
    deferred work (under MPS the two contend as they do in a run); each timed call then waits for
    the call before it. The clock stops when the state is ready and only the last call's deferred
    work is left; that work is then timed alone (``tail``). Returns the final state (after
    ``n_iters`` calls from ``state``) and ``max(clock, n_iters * tail)``: the run's cadence, whether
    the main program or the deferred work is the longer of the two.
    """
    jax.block_until_ready(state)
    ahead, _ = step(state)
    jax.block_until_ready(ahead)
    del ahead
    t0 = time.perf_counter()
    for _ in range(n_iters):
        state, _ = step(state)
        base.drain(step, keep_last=1)  # the call before this one's deferred work
    jax.block_until_ready(state)
    clock = time.perf_counter() - t0
    t1 = time.perf_counter()
    base.drain(step)
    tail = time.perf_counter() - t1
    return state, max(clock, n_iters * tail)


def _timed_run(step: Callable, state: Any, n_iters: int) -> tuple[Any, float]:
    if getattr(step, "pipelined", False):
        return run_pipelined(step, state, n_iters)
    return run_iterations(step, state, n_iters)


def time_repeats(
    step: Callable, state: Any, n_iters: int, repeats: int, warmup: bool = True
) -> tuple[Any, Timing]:
    """Warm up (compile) once, then ``repeats`` timed runs of ``n_iters`` iterations from ``state``
    (:func:`run_pipelined` for a pipelined host step, else :func:`run_iterations`).

    Returns the final state of the last run (every run starts from the same ``state``, so every
    run of a deterministic program ends in the same state) and the per-iteration times.
    """
    if n_iters < 1 or repeats < 1:
        raise ValueError(f"n_iters and repeats must be >= 1, got {n_iters}, {repeats}")
    if warmup:
        jax.block_until_ready(step(state))
    times, final = [], state
    for _ in range(repeats):
        final, dt = _timed_run(step, state, n_iters)
        times.append(dt / n_iters)
    return final, Timing(tuple(times))


def time_alternating(
    steps: list[Callable], state: Any, n_iters: int, repeats: int, warmup: bool = True
) -> list[tuple[Any, Timing]]:
    """Time several iteration functions in turns (A B A B ...) so that drift hits all alike.

    Each is warmed up (compiled) first unless ``warmup=False`` (every one already ran); every run
    starts from ``state``. Returns, per function, the final state of its last run and its
    per-iteration times.
    """
    if n_iters < 1 or repeats < 1:
        raise ValueError(f"n_iters and repeats must be >= 1, got {n_iters}, {repeats}")
    for step in steps if warmup else ():
        jax.block_until_ready(step(state))
    finals: list[Any] = [state] * len(steps)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            finals[i], dt = _timed_run(step, state, n_iters)
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
