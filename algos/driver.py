"""The impure host layer shared by the algorithms' ``train`` drivers: loop, progress, checkpoints.

``run`` calls a ``step_fn`` until the run's last iteration (or until ``progress_fn`` raises
:class:`StopTraining`, e.g. after a Ctrl-C), reports each iteration's metrics, and saves
checkpoints (periodically, at the end and when stopped early) with retention: the ``keep``
newest plus the best-scored one.

The device side is one jitted ``step_fn: state -> (state, metrics)`` per iteration. The loop
dispatches iteration ``i + 1`` before it reads iteration ``i``'s metrics back (one
``jax.device_get`` per iteration), so the host never stalls the device between iterations
except when it writes a checkpoint.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np

from algos import checkpoint

ProgressFn = Callable[[int, dict[str, float]], None]
DEFAULT_KEEP = 3  # checkpoints kept by default (the newest ones), plus the best-scored one
SCORE_KEYS = ("eval_episode_return", "episode_return")  # a checkpoint's score: the first finite one


class StopTraining(Exception):
    """Raise it from a ``progress_fn`` to end :func:`run` early and cleanly: the iteration in
    flight is finished and reported, a checkpoint is saved (with ``checkpoint_dir``), and ``run``
    returns normally, so a later ``resume`` continues exactly there."""


def score_of(metrics: dict[str, Any]) -> float | None:
    """A checkpoint's retention score: its iteration's evaluation return, else its episode return."""
    for key in SCORE_KEYS:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and np.isfinite(value):
            return float(value)
    return None


def metrics_to_host(metrics: Any) -> dict[str, float]:
    """A NamedTuple / dict of device scalars -> ``{name: python float or int}`` (one transfer)."""
    if hasattr(metrics, "_asdict"):
        metrics = metrics._asdict()
    host = jax.device_get(dict(metrics))
    out: dict[str, float] = {}
    for name, value in host.items():
        value = np.asarray(value)
        out[name] = value.item() if value.ndim == 0 else value.tolist()
    return out


def maybe_resume(checkpoint_dir: str | os.PathLike | None, like: Any, resume: bool) -> tuple[Any, int | None]:
    """``(restored, step)`` if ``resume`` and ``checkpoint_dir`` has a checkpoint, else ``(like, None)``.

    Starting afresh (``resume=False``) in a directory that already has checkpoints is an error:
    the new run's checkpoints would mix with the old run's.
    """
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs a checkpoint_dir")
    latest = None if checkpoint_dir is None else checkpoint.latest_step(checkpoint_dir)
    if latest is not None and not resume:
        raise ValueError(
            f"checkpoint_dir {str(checkpoint_dir)!r} already holds checkpoints (latest step {latest}); "
            f"pass resume=True to continue that run, or use an empty directory"
        )
    if latest is None:
        return like, None
    return checkpoint.restore(checkpoint_dir, like)


def check_loop_args(checkpoint_dir: Any, checkpoint_every: int | None, keep: int | None = None) -> None:
    """One-line ValueErrors for bad ``checkpoint_every`` / ``keep`` values."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep_checkpoints must be None (keep all) or a positive int, got {keep!r}")
    if checkpoint_every is not None:
        if (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every <= 0
        ):
            raise ValueError(
                f"checkpoint_every must be None or a positive int (iterations), got {checkpoint_every!r}"
            )
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every is set but checkpoint_dir is None")


def run(
    step_fn: Callable[[Any], tuple[Any, Any]],
    state: Any,
    *,
    num_iterations: int,
    iteration_of: Callable[[Any], Any],
    env_steps_of: Callable[[Any], Any],
    progress_fn: ProgressFn | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    keep: int | None = DEFAULT_KEEP,
) -> tuple[Any, list[dict[str, float]]]:
    """Call ``step_fn`` until ``iteration_of(state) == num_iterations``; returns ``(state, metrics)``.

    Args:
      step_fn: the jitted iteration (it may donate its argument).
      state: the starting state (fresh or restored); its iteration counter says where to start.
      num_iterations: total iterations of the whole run (not of this call).
      iteration_of / env_steps_of: read the counters of a state (device scalars).
      progress_fn: called as ``progress_fn(env_steps, metrics_dict)`` after every iteration,
        in order, with the metrics of that iteration; it may raise :class:`StopTraining`.
      checkpoint_dir / checkpoint_every: save every ``checkpoint_every`` iterations and after
        the last one (if ``checkpoint_dir`` is set); checkpoints are named by env steps.
      keep: keep only the newest ``keep`` checkpoints and the best-scored one (None: all);
        a checkpoint's score is :func:`score_of` its iteration's metrics.

    Returns:
      the final state and the host metrics (dicts of floats) of the iterations run in this call.
    """
    check_loop_args(checkpoint_dir, checkpoint_every, keep)
    start = int(jax.device_get(iteration_of(state)))
    history: list[dict[str, float]] = []
    pending = None  # device metrics of the previous iteration, read after the next dispatch
    stop = False  # set when progress_fn raised StopTraining

    def flush():
        nonlocal stop
        host = metrics_to_host(pending)
        history.append(host)
        if progress_fn is not None:
            try:
                progress_fn(int(host["env_steps"]), host)
            except StopTraining:
                stop = True

    for i in range(start, num_iterations):
        state, metrics = step_fn(state)
        if pending is not None:
            flush()
        pending = metrics
        last = i + 1 == num_iterations
        due = last or bool(checkpoint_every and (i + 1) % checkpoint_every == 0)
        if stop or (checkpoint_dir is not None and due):
            flush()
            pending = None
            if checkpoint_dir is not None:
                step = int(jax.device_get(env_steps_of(state)))
                checkpoint.save(checkpoint_dir, state, step, keep=keep, score=score_of(history[-1]))
            if stop and not last:
                break
    if pending is not None:
        flush()
    return state, history
