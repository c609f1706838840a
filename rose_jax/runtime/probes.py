"""Small worker functions, importable by path, for tests and benchmarks of the runtime.

Pure (jit-able) ones: ``affine``, ``identity``, ``scale``, ``scale_resident``, ``tree_summary``.
Host-level ones (call with ``jit=False``; they time, sleep, sync or read the environment): ``getenv``,
``whoami``, ``barrier_probe``, ``hold``, ``fail``, ``matmul_rate``, ``prepare_branch``,
``time_branch``. Benchmark kernels are built once per worker process and cached
(``functools.lru_cache``), so repeated calls measure steady state, not compilation.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from rose_jax.runtime import worker


def affine(x, w, b):
    """x: [n, d], w: [d, k], b: [k] -> x @ w + b: [n, k]."""
    return x @ w + b


def identity(x):
    return x


def scale(x, *, factor: float):
    """x * factor (factor is a static keyword argument)."""
    return jax.tree_util.tree_map(lambda a: a * factor, x)


def tree_summary(tree):
    """{"sum": sum of all leaves (float32), "count": number of elements (int32)} of a pytree."""
    leaves = jax.tree_util.tree_leaves(tree)
    total = sum(jnp.sum(a.astype(jnp.float32)) for a in leaves)
    count = sum(a.size for a in leaves)
    return {"sum": total, "count": jnp.asarray(count, jnp.int32)}


def scale_resident(tree, factor):
    """For resident-store tests: ``((tree * factor, tree * factor), sum of tree * factor)``."""
    scaled = jax.tree_util.tree_map(lambda a: a * factor, tree)
    return (scaled, scaled), tree_summary(scaled)["sum"]


def getenv(*, names: tuple[str, ...]):
    """{name: value or ""} from this worker's os.environ (host function)."""
    return {n: os.environ.get(n, "") for n in names}


def whoami():
    """(name, index, n_workers, pid) of this worker (host function)."""
    ctx = worker.worker_context()
    return ctx.name, ctx.index, ctx.n_workers, os.getpid()


def barrier_probe(*, delay_s: float, timeout: float = 60.0):
    """Sleep delay_s, then pass the pool barrier: (time before, time after) in seconds (time.time)."""
    time.sleep(delay_s)
    before = time.time()
    worker.barrier(timeout)
    return before, time.time()


def hold(x, *, marker: str, seconds: float):
    """Touch the file `marker`, sleep `seconds`, return sum(x) (host function: a long call)."""
    Path(marker).write_text(str(os.getpid()))
    time.sleep(seconds)
    return jnp.sum(x)


def fail(*, message: str):
    raise ValueError(message)


# ----------------------------------------------------------------- GPU kernels
@functools.lru_cache(maxsize=4)
def _matmul_loop(n: int, iters: int, dtype: str):
    """Jitted loop of `iters` [n, n] matmuls (2 n^3 iters FLOP) and its inputs."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = (jax.random.normal(kb, (n, n), jnp.float32) / jnp.sqrt(n)).astype(dtype)

    @jax.jit
    def run(a, b):
        return jax.lax.fori_loop(0, iters, lambda i, c: c @ b, a)

    return run, (a, b), 2.0 * n**3 * iters


@functools.lru_cache(maxsize=4)
def _memory_loop(size: int, iters: int):
    """Jitted memory-bound loop over a float32 [size] vector: a reduction and an axpy per
    iteration (about 12 size bytes of DRAM traffic per iteration) and its input."""
    x = jnp.ones((size,), jnp.float32)

    @jax.jit
    def run(x):
        def body(i, x):
            return x * 0.999 + jnp.mean(x) * 0.001

        return jax.lax.fori_loop(0, iters, body, x)

    return run, (x,), 12.0 * size * iters


def _branch(kind: str, size: int, iters: int, dtype: str = "bfloat16"):
    if kind == "matmul":
        return _matmul_loop(size, iters, dtype)
    if kind == "memory":
        return _memory_loop(size, iters)
    raise ValueError(f"branch kind must be 'matmul' or 'memory', got {kind!r}")


def prepare_branch(*, kind: str, size: int, iters: int, dtype: str = "bfloat16") -> float:
    """Build, compile and run once; returns seconds taken (host function)."""
    t0 = time.perf_counter()
    run, args, _ = _branch(kind, size, iters, dtype)
    jax.block_until_ready(run(*args))
    return time.perf_counter() - t0


def time_branch(
    *, kind: str, size: int, iters: int, reps: int = 3, dtype: str = "bfloat16", warmup: bool = True
) -> float:
    """Median wall seconds of one branch run in this worker (after a warm-up run if warmup)."""
    run, args, _ = _branch(kind, size, iters, dtype)
    if warmup:
        jax.block_until_ready(run(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(
    *, n: int, iters: int, seconds: float, dtype: str = "bfloat16", sync: bool = True, marker: str = ""
):
    """Run the matmul loop for about `seconds` after the pool barrier (if sync): achieved rate.

    marker: if given, a file touched once the timed loop has started.

    Returns {"tflops": TFLOP/s, "loops": completed loops, "seconds": elapsed, "start": time.time()
    at start, "end": time.time() at end} (host function).
    """
    run, args, flop = _matmul_loop(n, iters, dtype)
    jax.block_until_ready(run(*args))
    if sync:
        worker.barrier(300.0)
    start = time.time()
    t0 = time.perf_counter()
    loops = 0
    while True:
        jax.block_until_ready(run(*args))
        loops += 1
        if marker and loops == 1:
            Path(marker).write_text(str(os.getpid()))
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    return {
        "tflops": flop * loops / elapsed / 1e12,
        "loops": loops,
        "seconds": elapsed,
        "start": start,
        "end": time.time(),
    }
