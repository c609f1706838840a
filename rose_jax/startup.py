"""Fast, reproducible starts for the CLI and drivers: JAX's persistent compilation cache, the
matmul precision, and Playground-style "time to jit / time to train" reporting.

    path = startup.enable_compile_cache()          # per-user directory, returns it
    startup.set_matmul_precision("highest")        # or "tf32" / "bf16" / "default"
    clock = startup.PhaseClock()                   # compile time = until the first progress report

The cache keeps compiled XLA executables on disk, keyed by the program and the backend, so a
second run of the same training program skips most of its compile time. It is on by default in
the ``rose-jax`` CLI (``--no-compile-cache`` turns it off). Library code never turns it on.
"""

from __future__ import annotations

import os
import time

ENV_CACHE_DIR = "ROSE_JAX_COMPILE_CACHE"
PRECISIONS = {"default": None, "tf32": "tensorfloat32", "highest": "highest", "bf16": "bfloat16"}


def default_cache_dir() -> str:
    """``$ROSE_JAX_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/rose-jax/jax`` (``~/.cache/rose-jax/jax``)."""
    if os.environ.get(ENV_CACHE_DIR):
        return os.path.expanduser(os.environ[ENV_CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rose-jax", "jax")


def enable_compile_cache(path: str | None = None, min_compile_time_s: float = 1.0) -> str:
    """Turn on JAX's persistent compilation cache in ``path`` (default :func:`default_cache_dir`).

    Programs that took at least ``min_compile_time_s`` seconds to compile are cached. Returns
    the directory. Raises a one-line ValueError if it cannot be created.
    """
    path = os.path.abspath(path or default_cache_dir())
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile cache: cannot create {path!r}: {e.strerror or e}") from None
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def set_matmul_precision(name: str) -> None:
    """JAX's default matmul precision: ``"tf32"`` (TensorFloat-32 on Ampere/Hopper: fast, ~1e-3
    relative error), ``"highest"`` (full float32: reproducible across GPUs), ``"bf16"``, or
    ``"default"`` (the backend's choice: TF32 on recent NVIDIA GPUs)."""
    if name not in PRECISIONS:
        raise ValueError(f"matmul precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    import jax

    jax.config.update("jax_default_matmul_precision", PRECISIONS[name])


class PhaseClock:
    """Wall-clock split of a training call as Playground's script reports it.

    ``time to jit`` is from construction to the first progress report (compiling and running
    the first unit), ``time to train`` from then to :meth:`stop`.
    """

    def __init__(self):
        self.start = time.perf_counter()
        self.first: float | None = None
        self.end: float | None = None

    def progress(self) -> None:
        """Call from the progress callback."""
        if self.first is None:
            self.first = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        """``(time_to_jit_s, time_to_train_s)`` (the first call fixes the end time)."""
        if self.end is None:
            self.end = time.perf_counter()
        first = self.first if self.first is not None else self.end
        return first - self.start, self.end - first

    def line(self) -> str:
        """``"time to jit: 12.3s, time to train: 45.6s"``."""
        jit_s, train_s = self.stop()
        return f"time to jit: {jit_s:.1f}s, time to train: {train_s:.1f}s"


__all__ = ["PRECISIONS", "PhaseClock", "default_cache_dir", "enable_compile_cache", "set_matmul_precision"]
