"""TensorBoard event files for training runs (tensorboardX), with Brax's / Playground's tag names.

    logger = tb.Logger("runs/ant-ppo/tb")
    logger.log(env_steps, metrics)        # the dict a train()'s progress_fn receives
    logger.close()

Tags: keys that already carry a section (``eval/episode_reward``, ``training/sps``, ...) are kept;
rose-jax's own names are mapped: ``eval_episode_return`` -> ``eval/episode_reward`` (Brax's and
Playground's name for the evaluation return), ``episode_return`` -> ``training/episode_reward``,
every other scalar ``x`` -> ``training/x``. Non-finite values and counters (``env_steps``,
``iteration``) are skipped; the step axis is env steps, as in Playground's train script.

Weights & Biases (optional, ``pip install wandb``): :class:`WandbLogger` logs the same tags at the
same steps (``run.log(tags, step=env_steps)``, as Playground's train script does); ``WANDB_MODE``
(e.g. ``offline``) and the other ``WANDB_*`` variables apply as usual. :func:`open_loggers`
opens the ones asked for as one :class:`Loggers`.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

WANDB_FIX = "W&B logging needs wandb: pip install wandb"

TB_DIR = "tb"  # the event files' folder in a run directory
_SKIP = frozenset({"env_steps", "iteration", "wall_s"})
_RENAME = {"eval_episode_return": "eval/episode_reward", "episode_return": "training/episode_reward"}


def tags(metrics: dict[str, Any]) -> dict[str, float]:
    """``metrics`` as ``{tag: float}`` with Brax's / Playground's names (see the module docstring)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in _SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        tag = key if "/" in key else _RENAME.get(key, f"training/{key}")
        out.setdefault(tag, float(value))
    return out


class Logger:
    """Writes scalars to TensorBoard event files in ``logdir`` (created if missing)."""

    def __init__(self, logdir: str | os.PathLike, purge_step: int | None = None):
        """``purge_step``: a resumed run's first step after its checkpoint. TensorBoard then hides
        the events of earlier event files at steps >= it (written between the checkpoint and a
        crash, and written again by the resumed run), so no step appears twice."""
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ValueError("TensorBoard logging needs tensorboardX: pip install tensorboardX") from None
        self.logdir = os.fspath(logdir)
        self._writer = SummaryWriter(self.logdir, flush_secs=10, purge_step=purge_step)
        self._writer._get_file_writer()  # the purge event goes first, before any scalar

    def log(self, env_steps: int, metrics: dict[str, Any]) -> None:
        for tag, value in tags(metrics).items():
            self._writer.add_scalar(tag, value, int(env_steps))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def check_wandb(project: str = "rose-jax") -> None:
    """Raise a one-line ValueError when ``project`` is not a name or wandb is not installed (naming
    the fix); imports nothing, so it is cheap to call before a run directory is made."""
    if not isinstance(project, str) or not project.strip():
        raise ValueError(f"W&B project must be a non-empty name, got {project!r}")
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(WANDB_FIX)


class WandbLogger:
    """Logs :func:`tags` to a Weights & Biases run (``wandb.init(project, name, dir, config)``).

    ``dir`` holds W&B's local files (``<dir>/wandb/``); with ``WANDB_MODE=offline`` nothing leaves
    the machine (``wandb sync`` uploads later).
    """

    def __init__(
        self, project: str, dir: str | os.PathLike, name: str | None = None, config: dict | None = None
    ):
        check_wandb(project)
        import wandb

        self.dir = os.fspath(dir)
        os.makedirs(self.dir, exist_ok=True)
        self._run = wandb.init(project=project, name=name, dir=self.dir, config=dict(config or {}))

    def log(self, env_steps: int, metrics: dict[str, Any]) -> None:
        values = tags(metrics)
        if values:
            self._run.log(values, step=int(env_steps))

    def close(self) -> None:
        self._run.finish()


class Loggers:
    """Several loggers as one: ``log(env_steps, metrics)`` and ``close()`` go to each."""

    def __init__(self, loggers: list[Any]):
        self.loggers = list(loggers)

    def log(self, env_steps: int, metrics: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(env_steps, metrics)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def open_loggers(
    run_dir: str | os.PathLike,
    *,
    tensorboard: bool = True,
    wandb_project: str | None = None,
    config: dict | None = None,
    purge_step: int | None = None,
) -> Loggers:
    """TensorBoard events in ``<run_dir>/tb`` and/or a W&B run named after ``run_dir`` (its local
    files in ``run_dir``), with ``config`` as the W&B run's config. Call :func:`check_wandb`
    before making ``run_dir`` to fail early. ``purge_step``: see :class:`Logger`."""
    run_dir = os.fspath(run_dir)
    out: list[Any] = []
    if wandb_project is not None:
        name = os.path.basename(os.path.abspath(run_dir))
        out.append(WandbLogger(wandb_project, run_dir, name=name, config=config))
    if tensorboard:
        out.append(Logger(os.path.join(run_dir, TB_DIR), purge_step=purge_step))
    return Loggers(out)


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` read back from the event files in ``logdir`` (tensorboardX's
    own record reader and protobufs; no TensorBoard install needed), as TensorBoard shows them:
    a ``SessionLog.START`` event at step ``s`` (a resumed run's ``purge_step``) drops the values
    read so far at steps >= ``s``."""
    from tensorboardX.proto import event_pb2 as pb

    out: dict[str, list[tuple[int, float]]] = {}
    for name in sorted(os.listdir(logdir)):  # event file names start with the creation time
        if "tfevents" not in name:
            continue
        for record in _records(os.path.join(logdir, name)):
            event = pb.Event()
            event.ParseFromString(record)
            if event.HasField("session_log") and event.session_log.status == pb.SessionLog.START:
                purge = int(event.step)
                out = {tag: [(s, v) for s, v in values if s < purge] for tag, values in out.items()}
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
    return out


def _records(path: str):
    """The records of a TFRecord file: [len u64][crc u32][data][crc u32] each."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[i : i + 8])
        start = i + 12
        if start + length + 4 > len(data):
            break
        yield data[start : start + length]
        i = start + length + 4


__all__ = [
    "TB_DIR",
    "WANDB_FIX",
    "Logger",
    "Loggers",
    "WandbLogger",
    "check_wandb",
    "open_loggers",
    "read_scalars",
    "tags",
]
