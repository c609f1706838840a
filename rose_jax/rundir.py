"""A training run's directory: a durable record of the run, and the files derived from it.

Layout of ``<run dir>/``:

- ``run.json``: what was run (algorithm, environment, the full config), written once at the start.
- ``metrics.jsonl``: the record. One JSON object per reported iteration (or epoch), appended and
  flushed as the run goes, so a crash loses at most the line being written (a torn last line
  is ignored when read). A resumed run first cuts the record back to its checkpoint, then keeps
  appending: the record always covers the run from its first iteration, without holes.
- ``metrics.json`` (the record as one JSON list), ``learning_curve.png`` and ``summary.json``
  (``status`` ``"finished"`` or ``"interrupted"``, last row, counts): derived from the record
  when the run ends or stops, written atomically, ``summary.json`` last.
- ``checkpoints/``: the algorithm's checkpoints (``algos.checkpoint``).
- ``.lock``: held (``flock``) by the process writing the run, with its pid, host and start time;
  a second process is refused (:meth:`RunDir.lock`). The kernel drops the lock when the holder
  exits, however it exits, so a stale ``.lock`` file never blocks anyone.

The record is strict JSON: a non-finite number (NaN before any episode has finished, an
infinity) is written as ``null``.

Every rewrite is atomic (temporary file, then rename); leftovers of an interrupted write are
named ``.tmp-*`` and :meth:`RunDir.clean` removes them when the next run starts.

This is host-side, impure code for drivers and the CLI; it knows nothing about algorithms.
"""

from __future__ import annotations

import io
import json
import math
import os
import socket
import time
import uuid
from typing import Any, Iterable

from rose_jax.io import atomic_write_bytes, atomic_write_json, atomic_write_text

RUN = "run.json"
RECORD = "metrics.jsonl"
METRICS = "metrics.json"
CURVE = "learning_curve.png"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
LOCK = ".lock"
_TMP = ".tmp-"


class RunDirBusy(ValueError):
    """Another live process holds the run directory's lock (one-line message naming it)."""


def check_path(path: str) -> None:
    """A one-line ValueError when ``path`` cannot be a run directory: it is a file, or a folder
    above it is a file. Creates nothing."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"run directory {path!r} is a file, not a directory; choose another --run-dir")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(
            f"run directory {path!r}: {parent!r} is a file, not a directory; choose another --run-dir"
        )


def check_writable(path: str) -> None:
    """Create ``path`` (with parents) if needed and prove it writable with a probe file.

    Raises a one-line ValueError: ``path`` is a file, cannot be created, or is not writable.
    """
    check_path(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create run directory {path!r}: {e.strerror or e}") from None
    probe = os.path.join(path, f"{_TMP}probe-{uuid.uuid4().hex}")
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"run directory {path!r} is not writable: {e.strerror or e}") from None


class RunDir:
    """One run directory (see the module docstring). Nothing is created until a write."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self._record = None  # the open append handle of metrics.jsonl
        self._lock_fd: int | None = None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def checkpoint_dir(self) -> str:
        return self.file(CHECKPOINTS)

    # ---------------------------------------------------------------- reading
    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def read_run(self) -> dict[str, Any] | None:
        """``run.json`` as a dict, or None if there is none (or it cannot be read)."""
        return _read_json(self.file(RUN))

    def read_summary(self) -> dict[str, Any] | None:
        return _read_json(self.file(SUMMARY))

    def finished(self) -> bool:
        summary = self.read_summary()
        return bool(summary) and summary.get("status") == "finished"

    def rows(self) -> list[dict[str, Any]]:
        """The record's rows, in order; a torn or unreadable line ends it (a crash mid-append)."""
        try:
            with open(self.file(RECORD), "rb") as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return []
        rows = []
        for line in data.split(b"\n")[:-1]:  # the part after the last newline is never complete
            try:
                row = json.loads(line)
            except ValueError:
                break
            if not isinstance(row, dict):
                break
            rows.append(row)
        return rows

    # ---------------------------------------------------------------- writing
    def lock(self) -> None:
        """Take the run directory's lock (the directory must exist) for this process's lifetime
        or until :meth:`unlock`; a second process gets :class:`RunDirBusy` naming the holder.

        ``flock`` on ``.lock``: released by the kernel when the process exits, even on SIGKILL.
        """
        import fcntl

        if self._lock_fd is not None:
            return
        fd = os.open(self.file(LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            who = holder or "another process"
            raise RunDirBusy(
                f"run directory {self.path!r} is in use by {who}; wait for that run to end "
                "(or stop it), or choose another --run-dir"
            ) from None
        text = (f"pid {os.getpid()} on {socket.gethostname()} "
                f"(since {time.strftime('%Y-%m-%d %H:%M:%S')})").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, text, 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def clean(self) -> list[str]:
        """Remove ``.tmp-*`` leftovers of interrupted writes (in the run dir itself); returns names."""
        if not self.exists():
            return []
        removed = []
        for name in sorted(os.listdir(self.path)):
            if name.startswith(_TMP):
                try:
                    os.unlink(self.file(name))
                    removed.append(name)
                except (IsADirectoryError, PermissionError, FileNotFoundError):
                    pass
        return removed

    def write_run(self, info: dict[str, Any]) -> None:
        atomic_write_json(self.file(RUN), info)

    def restart_record(self, rows: Iterable[dict[str, Any]]) -> None:
        """Replace the record by ``rows`` (atomically) and open it for appending.

        A fresh run passes ``[]``; a resumed one the rows up to its checkpoint.
        """
        self.close()
        atomic_write_text(self.file(RECORD), "".join(_line(r) for r in rows))
        self.clear_derived()
        self._record = open(self.file(RECORD), "a", encoding="utf-8")

    def clear_derived(self) -> None:
        """Remove ``summary.json``, so a run that goes on is not taken for a finished one."""
        try:
            os.unlink(self.file(SUMMARY))
        except FileNotFoundError:
            pass

    def append(self, row: dict[str, Any]) -> None:
        """Append one row to the record and flush it to the OS (it survives the process's death)."""
        if self._record is None:
            raise ValueError("RunDir.append: call restart_record first")
        self._record.write(_line(row))
        self._record.flush()

    def close(self) -> None:
        if self._record is not None:
            try:
                self._record.flush()
                os.fsync(self._record.fileno())
            except OSError:
                pass
            self._record.close()
            self._record = None

    def finish(self, status: str, title: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write ``metrics.json``, ``learning_curve.png`` and (last) ``summary.json`` from the record.

        ``status`` is ``"finished"`` or ``"interrupted"``. Returns the summary.
        """
        self.close()
        rows = self.rows()
        atomic_write_text(self.file(METRICS), json.dumps(strict_json(rows), indent=1, allow_nan=False) + "\n")
        plot_curve(rows, self.file(CURVE), title)
        last = rows[-1] if rows else {}
        summary = {
            "status": status,
            "rows": len(rows),
            "env_steps": int(last.get("env_steps", 0)),
            "wall_s": last.get("wall_s"),
            "last": last,
            **(extra or {}),
        }
        atomic_write_json(self.file(SUMMARY), strict_json(summary))
        return summary


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) replaced by None: JSON has no NaN
    token (``json.dumps`` writes a bare ``NaN`` that strict parsers reject)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _line(row: dict[str, Any]) -> str:
    return json.dumps(strict_json(row), separators=(",", ":"), allow_nan=False) + "\n"


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def format_return(x: Any, fmt: str = ".1f") -> str:
    """A mean episode return for people: ``'—'`` while no episode has finished (NaN or missing)."""
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "—"
    return format(x, fmt)


def plot_curve(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """The learning curve (mean episode return, and the evaluation return where there is one)
    over env steps, written atomically as a PNG. Ticks use engineering notation (400k, 2M)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label, color in (
        ("episode_return", "training episodes", "tab:red"),
        ("eval_episode_return", "evaluation", "tab:blue"),
    ):
        points = [
            (r["env_steps"], r[key])
            for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, color=color, label=label, marker="." if len(points) < 20 else None)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=6, integer=True))
    ax.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
    ax.set_xlabel("env steps")
    ax.set_ylabel("mean episode return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


__all__ = [
    "RunDir", "RunDirBusy", "check_path", "check_writable", "format_return", "plot_curve", "strict_json",
]
