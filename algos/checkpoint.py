"""Atomic pytree checkpoints with orbax: ``save``, ``restore``, ``latest_step``, retention.

Layout: ``<directory>/<step>/`` holds one orbax checkpoint of a whole train state (any pytree
of arrays: flax.struct dataclasses, NamedTuples, dicts). A checkpoint becomes visible only
complete: orbax writes it into ``<directory>/.tmp-<step>-<id>/`` and only after orbax has
finished (and its own write-then-rename has committed) is that folder renamed to ``<step>``,
one atomic ``rename(2)`` on a POSIX file system. A crash at any moment therefore leaves either
the previous set of checkpoints or the previous set plus the new one; half-written folders
are named ``.tmp-*`` and are ignored by :func:`latest_step` (and removed by the next ``save``
of the same step, or all at once by :func:`clean`).

Zero-size arrays (MJX's ``Data`` holds some, e.g. ``act`` of a model without actuator
activations) are saved as a one-element placeholder and their true shape and dtype are kept in
``rose_jax_meta.json``: orbax (0.12.8 here) refuses to write zero-size arrays ("Cannot save
arrays with zero size"), and an empty array carries nothing but its shape, so :func:`restore` and
:func:`read` rebuild it exactly.

Retention: ``save(..., keep=K, score=s)`` keeps the ``K`` newest checkpoints plus the one with
the best (largest finite) score, e.g. the episode return when it was written. A checkpoint's
score is stored inside its folder (``rose_jax_meta.json``), so it is written, renamed and deleted
with it.

This is host-side, impure code: call it between jitted iterations, never inside one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np

_TMP_PREFIX = ".tmp-"
_META = "rose_jax_meta.json"


def _checkpointer():
    import orbax.checkpoint as ocp  # lazy: orbax pulls in tensorstore

    return ocp.PyTreeCheckpointer()


def _steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def latest_step(directory: str | os.PathLike) -> int | None:
    """The largest step with a complete checkpoint in ``directory``, or None if there is none."""
    steps = _steps(Path(directory))
    return steps[-1] if steps else None


def all_steps(directory: str | os.PathLike) -> list[int]:
    """Every step with a complete checkpoint in ``directory``, ascending."""
    return _steps(Path(directory))


def score(directory: str | os.PathLike, step: int) -> float | None:
    """The score stored with checkpoint ``step`` (None if it has none or it is not finite)."""
    value = _read_meta(Path(directory) / str(int(step))).get("score")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def best_step(directory: str | os.PathLike) -> int | None:
    """The step of the checkpoint with the largest score (the newest among equals), or None."""
    scored = [(s, step) for step in all_steps(directory) if (s := score(directory, step)) is not None]
    return max(scored)[1] if scored else None


def prune(directory: str | os.PathLike, keep: int) -> list[int]:
    """Delete all but the ``keep`` newest checkpoints and the best-scored one; returns the deleted steps."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"checkpoint.prune: keep must be a positive int, got {keep!r}")
    directory = Path(directory)
    steps = _steps(directory)
    kept = set(steps[-keep:])
    best = best_step(directory)
    if best is not None:
        kept.add(best)
    deleted = [s for s in steps if s not in kept]
    for step in deleted:  # rename first: a crash mid-delete never leaves a partial numbered folder
        doomed = directory / f"{_TMP_PREFIX}{step}-del-{uuid.uuid4().hex}"
        try:
            os.rename(directory / str(step), doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
    return deleted


def clean(directory: str | os.PathLike) -> list[str]:
    """Remove the ``.tmp-*`` leftovers of interrupted saves and deletes; returns their names.

    Call it only when no other process is saving into ``directory`` (e.g. when a run starts).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for stale in directory.glob(f"{_TMP_PREFIX}*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale.name)
    return sorted(removed)


def _write(path: Path, state: Any) -> None:
    """Write ``state`` as one orbax checkpoint at ``path`` (synchronously)."""
    _checkpointer().save(path, state)


def _placeholder(dtype: Any) -> np.ndarray:
    """What a zero-size leaf is written as (orbax refuses zero-size arrays)."""
    return np.zeros((1,), dtype)


def _split_empty(host_state: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """``host_state`` with its zero-size leaves replaced by placeholders, and
    ``{keypath: {"shape", "dtype"}}`` of those leaves (the keypaths of ``jax.tree_util.keystr``)."""
    empty: dict[str, dict[str, Any]] = {}

    def swap(path, leaf):
        if np.size(leaf) != 0:
            return leaf
        dtype = np.asarray(leaf).dtype
        empty[jax.tree_util.keystr(path)] = {"shape": list(np.shape(leaf)), "dtype": dtype.str}
        return _placeholder(dtype)

    return jax.tree_util.tree_map_with_path(swap, host_state), empty


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        value = json.loads((path / _META).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def save(
    directory: str | os.PathLike,
    state: Any,
    step: int,
    *,
    keep: int | None = None,
    score: float | None = None,
) -> Path:
    """Write ``state`` as checkpoint ``step`` of ``directory``, atomically; returns its path.

    Args:
      directory: checkpoint folder (created if missing).
      state: a pytree of arrays (e.g. a TrainState); it is fetched to host memory first.
      step: a non-negative int, e.g. the number of environment steps so far. An existing
        checkpoint of the same step is replaced (atomically: the old one stays visible until
        the new one is complete).
      keep: if given, keep only the ``keep`` newest checkpoints (and the best-scored one) after
        this one is written.
      score: stored with the checkpoint for retention (larger is better; None or NaN: unscored).
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"checkpoint.save: step must be a non-negative int, got {step!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"checkpoint.save: keep must be None or a positive int, got {keep!r}")
    step = int(step)
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{_TMP_PREFIX}{step}-*"):  # leftovers of a crashed save
        shutil.rmtree(stale, ignore_errors=True)

    host_state, empty = _split_empty(jax.device_get(state))
    tmp = directory / f"{_TMP_PREFIX}{step}-{uuid.uuid4().hex}"
    final = directory / str(step)
    try:
        _write(tmp, host_state)
        meta = {"step": step, "score": _finite_or_none(score), "empty": empty}
        (tmp / _META).write_text(json.dumps(meta) + "\n")
        if final.exists():  # replace: move the old one aside first, so `final` is never partial
            old = directory / f"{_TMP_PREFIX}{step}-old-{uuid.uuid4().hex}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(directory)

    if keep is not None:
        prune(directory, keep)
    return final


def _finite_or_none(x: Any) -> float | None:
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _checkpoint_path(directory: str | os.PathLike, step: int | None, who: str) -> tuple[Path, int]:
    """The folder of checkpoint ``step`` (None: the latest) and its step; one-line ValueErrors."""
    directory = Path(directory).absolute()
    if step is None:
        step = latest_step(directory)
        if step is None:
            raise ValueError(f"{who}: no checkpoint in {str(directory)!r}")
    path = directory / str(int(step))
    if not path.is_dir():
        raise ValueError(
            f"{who}: no checkpoint for step {step} in {str(directory)!r} (available: {all_steps(directory)})"
        )
    return path, int(step)


def restore(directory: str | os.PathLike, like: Any, step: int | None = None) -> tuple[Any, int]:
    """Read checkpoint ``step`` (default: the latest) of ``directory`` into the structure of ``like``.

    Args:
      directory: checkpoint folder written by :func:`save`.
      like: a pytree with the same structure, shapes and dtypes as the saved state (e.g. a
        freshly initialised TrainState); its values are not used.
      step: which checkpoint; None means :func:`latest_step`.

    Returns:
      ``(state, step)``: the restored pytree (jax arrays, same treedef as ``like``) and its step.
    """
    path, step = _checkpoint_path(directory, step, "checkpoint.restore")
    import orbax.checkpoint as ocp

    like_leaves, treedef = jax.tree.flatten(like)
    # the target only gives orbax the structure (restore_type=np.ndarray reads each saved array
    # as it is), so its leaves need not hold data: ``like`` may be jax.ShapeDtypeStructs
    shapes = [tuple(np.shape(x)) for x in like_leaves]
    dtypes = [np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype for x in like_leaves]
    empty = [math.prod(shape) == 0 for shape in shapes]
    target = jax.tree.unflatten(
        treedef, [np.zeros((1,) if e else (), d) for e, d in zip(empty, dtypes, strict=True)]
    )
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    restored = _checkpointer().restore(path, item=target, restore_args=restore_args)
    leaves = jax.tree.leaves(restored)
    if len(leaves) != len(like_leaves):
        raise ValueError(
            f"checkpoint.restore: checkpoint {path} has {len(leaves)} arrays, `like` has {len(like_leaves)}"
        )
    out = []
    for i, (got, want_shape, want_dtype, is_empty) in enumerate(
        zip(leaves, shapes, dtypes, empty, strict=True)
    ):
        if is_empty and got.size == 1:  # saved as a placeholder (see the module docstring)
            got = np.zeros(want_shape, got.dtype)
        if got.shape != want_shape or got.dtype != want_dtype:
            raise ValueError(
                f"checkpoint.restore: array {i} of {path} is {got.dtype}{list(got.shape)}, "
                f"`like` expects {want_dtype}{list(want_shape)}"
            )
        out.append(jax.numpy.asarray(got))
    return jax.tree.unflatten(treedef, out), step


def read(directory: str | os.PathLike, step: int | None = None) -> tuple[Any, int]:
    """Read checkpoint ``step`` (default: the latest) as orbax stores it: nested dicts and lists of
    numpy arrays, without a ``like`` tree (e.g. a saved policy, whose structure is plain dicts).
    Zero-size arrays come back with their saved shapes. Returns ``(tree, step)``."""
    path, step = _checkpoint_path(directory, step, "checkpoint.read")
    tree = _checkpointer().restore(path)
    empty = _read_meta(path).get("empty") or {}
    if empty:

        def fill(keypath, leaf):
            spec = empty.get(jax.tree_util.keystr(keypath))
            return leaf if spec is None else np.zeros(tuple(spec["shape"]), np.dtype(spec["dtype"]))

        tree = jax.tree_util.tree_map_with_path(fill, tree)
    return tree, step


def newest_restorable(
    directory: str | os.PathLike, like: Any, log: Any = None
) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest checkpoint of ``directory`` that :func:`restore` reads into ``like``.

    Each newer checkpoint that fails to restore (truncated or corrupted files, another
    structure) is moved aside as ``.corrupt-<step>-<id>/`` (kept for inspection, no longer a
    checkpoint) and reported through ``log(line)``. Returns ``(step or None, [(step, reason)])``.
    """
    directory = Path(directory).absolute()
    skipped: list[tuple[int, str]] = []
    for step in reversed(_steps(directory)):
        try:
            restore(directory, like, step)
        except Exception as e:  # any failure of orbax or ours means: not this one
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            aside = directory / f".corrupt-{step}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(directory / str(step), aside)
            except OSError:
                aside = directory / str(step)
            skipped.append((step, reason))
            if log is not None:
                log(f"checkpoint {step} does not restore ({reason}); moved aside to {aside.name}, "
                    f"trying the previous one")
            continue
        return step, skipped
    return None, skipped


__all__ = [
    "all_steps", "best_step", "clean", "latest_step", "newest_restorable", "prune", "read", "restore", "save",
    "score",
]
