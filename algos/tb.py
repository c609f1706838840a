"""TensorBoard event files for training runs (tensorboardX), with Brax's / Playground's tag names.

    logger = tb.Logger("runs/ant-ppo/tb")
    logger.log(env_steps, metrics)        # the dict a train()'s progress_fn receives
    logger.close()

Tags: keys that already carry a section (``eval/episode_reward``, ``training/sps``, ...) are kept;
rose-jax's own names are mapped: ``eval_episode_return`` -> ``eval/episode_reward`` (Brax's and
Playground's name for the evaluation return), ``episode_return`` -> ``training/episode_reward``,
every other scalar ``x`` -> ``training/x``. Non-finite values and counters (``env_steps``,
``iteration``) are skipped; the step axis is env steps, as in Playground's train script.
"""

from __future__ import annotations

import math
import os
from typing import Any

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

    def __init__(self, logdir: str | os.PathLike):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ValueError("TensorBoard logging needs tensorboardX: pip install tensorboardX") from None
        self.logdir = os.fspath(logdir)
        self._writer = SummaryWriter(self.logdir, flush_secs=10)

    def log(self, env_steps: int, metrics: dict[str, Any]) -> None:
        for tag, value in tags(metrics).items():
            self._writer.add_scalar(tag, value, int(env_steps))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` read back from the event files in ``logdir`` (tensorboardX's
    own record reader and protobufs; no TensorBoard install needed)."""
    from tensorboardX.proto import event_pb2 as pb

    out: dict[str, list[tuple[int, float]]] = {}
    for name in sorted(os.listdir(logdir)):
        if "tfevents" not in name:
            continue
        for record in _records(os.path.join(logdir, name)):
            event = pb.Event()
            event.ParseFromString(record)
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


__all__ = ["Logger", "read_scalars", "tags"]
