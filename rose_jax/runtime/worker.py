"""The worker side of the runtime: a spawned JAX process that runs functions by import path.

A worker is born (``multiprocessing`` "spawn") with an explicit environment, so the MPS and XLA
memory variables are in place before its interpreter starts and long before ``import jax``
creates a CUDA context. ``main`` then reports ``ready`` and serves messages from the driver, one
at a time, in order:

- ``("call", id, "pkg.mod:fn", packet, static, jit, out_shm_name, out_ipc, reads, writes)``:
  decode the inputs (a tuple of pytrees) onto the device, import ``fn``
  (``jax.jit(partial(fn, **static))`` is cached per (path, static)), run it, wait for the
  result, encode the outputs and reply ``("ok", id, packet, stats)`` or
  ``("err", id, type, message, traceback)``. ``reads``/``writes`` name values of the worker's
  resident store (below): the call is ``fn(*[store[n] for n in reads], *inputs)``, and with
  ``writes`` it must return ``(written, outputs)``, ``written`` a tuple with one value per name
  in ``writes``; those are stored and only ``outputs`` go back.
- the resident store (pytrees of device arrays kept between calls, by name):
  ``("put", id, name, packet)`` stores the decoded pytree; ``("get", id, name, out_shm_name,
  out_ipc)`` sends it back; ``("drop", id, names)`` deletes them (missing names are ignored);
  ``("list", id)`` replies ``{name: bytes}``. Each replies like a call.
- ``("ping", id)`` -> ``("pong", id)``; ``("release", id)`` frees the IPC buffer of a reply;
  ``("exit",)`` or a closed pipe ends the worker.

Inside a called function, ``barrier()`` waits for every worker of the pool (in-step sync) and
``worker_context()`` says who this worker is.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable

from rose_jax.mps import plan

_CONTEXT: "WorkerContext | None" = None


@dataclasses.dataclass(frozen=True)
class WorkerBoot:
    """What a worker is told at spawn: its name, index among n_workers, the driver's pid."""

    name: str
    index: int
    n_workers: int
    parent_pid: int


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """This worker process: name, index, pool size, and the pool's barrier."""

    name: str
    index: int
    n_workers: int
    barrier: Any


def worker_context() -> WorkerContext:
    """The current worker's context; RuntimeError outside a worker process."""
    if _CONTEXT is None:
        raise RuntimeError("worker_context() is only available inside a rose_jax runtime worker")
    return _CONTEXT


def barrier(timeout: float | None = 120.0) -> int:
    """Wait until every worker of the pool reaches this point; returns this worker's arrival index.

    Raises ``threading.BrokenBarrierError`` if the barrier is broken (a worker died, the driver
    aborted it) or the timeout (seconds) passes.
    """
    return worker_context().barrier.wait(timeout)


def resolve(path: str) -> Callable:
    """Import "package.module:function" (the function part may be dotted: Class.method)."""
    mod_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path} is not callable")
    return obj


def _birth_environment() -> dict[str, str]:
    """The environment this process was exec'd with (Linux /proc), or {} where unavailable."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans if the driver is killed)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(boot: WorkerBoot, conn, pool_barrier) -> None:
    """Entry point of a spawned worker process."""
    global _CONTEXT
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    _die_with_parent()
    if os.getppid() != boot.parent_pid:
        return
    _CONTEXT = WorkerContext(boot.name, boot.index, boot.n_workers, pool_barrier)
    try:
        import jax

        from rose_jax.runtime import cuda_ipc

        backend = jax.default_backend()  # creates the device client (CUDA context) now
        born = _birth_environment()
        watched = sorted(
            k
            for k in set(born) | set(os.environ)
            if k.startswith("CUDA_MPS_") or k.startswith("XLA_") or k == plan.WORKER_NAME_VAR
        )
        info = {
            "name": boot.name,
            "pid": os.getpid(),
            "backend": backend,
            "devices": [str(d) for d in jax.devices()],
            "jax_version": jax.__version__,
            "python": sys.version.split()[0],
            "ipc": cuda_ipc.probe(backend),
            "env": {k: os.environ.get(k) for k in watched},
            "birth_env": {k: born.get(k) for k in watched},
            "compile_cache": getattr(jax.config, "jax_compilation_cache_dir", None) or None,
        }
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready", info))
    _serve(conn)


def _serve(conn) -> None:
    import jax

    from rose_jax.runtime import exchange

    cache: dict[Any, Callable] = {}
    exported: dict[int, exchange.Outbound] = {}
    store: dict[str, Any] = {}  # the resident values, by name
    channel = exchange.Channel()  # persistent staging buffers to and from the driver
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "call":
                reply = _run_call(msg, cache, exported, store, jax, exchange, channel)
                conn.send(reply)
            elif kind in _STORE_OPS:
                conn.send(_STORE_OPS[kind](msg, exported, store, jax, exchange, channel))
            elif kind == "ping":
                conn.send(("pong", msg[1]))
            elif kind == "release":
                ob = exported.pop(msg[1], None)
                if ob is not None:
                    ob.release()
            elif kind == "exit":
                break
    finally:
        store.clear()
        channel.close()
        for ob in exported.values():
            try:
                ob.release()
            except Exception:
                pass


def _read_store(store: dict, names) -> list:
    missing = [n for n in names if n not in store]
    if missing:
        have = ", ".join(sorted(store)) or "none"
        raise LookupError(
            f"no resident value named {missing[0]!r} on this worker (resident: {have}); put it first"
        )
    return [store[n] for n in names]


def _store_bytes(store: dict, exchange) -> int:
    """Bytes of the resident arrays (an array stored under two names counts once)."""
    import jax

    unique = {id(x): x for v in store.values() for x in jax.tree_util.tree_leaves(v)}
    return exchange.nbytes(list(unique.values()))


def _run_call(msg, cache, exported, store, jax, exchange, channel):
    _, cid, path, packet, static, jit, out_shm_name, out_ipc, reads, writes = msg
    t0 = time.perf_counter()
    try:
        args = tuple(_read_store(store, reads)) + tuple(exchange.decode(packet, to="jax", channel=channel))
        t1 = time.perf_counter()
        key = (path, static, jit)
        fn = cache.get(key)
        if fn is None:
            fn = resolve(path)
            if static:
                fn = functools.partial(fn, **dict(static))
            if jit:
                fn = jax.jit(fn)
            cache[key] = fn
        result = jax.block_until_ready(fn(*args))
        if writes:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError(
                    f"{path} writes resident values {list(writes)}: it must return (written, outputs), "
                    f"got {type(result).__name__}"
                )
            written, result = result
            if not isinstance(written, (tuple, list)) or len(written) != len(writes):
                raise TypeError(
                    f"{path} writes resident values {list(writes)}: written must be a tuple of "
                    f"{len(writes)} value(s), got {type(written).__name__}"
                )
            store.update(zip(writes, written, strict=True))
        t2 = time.perf_counter()
        out, ob = exchange.encode(result, shm_name=out_shm_name, use_ipc=out_ipc, channel=channel)
        if ob.ipc_ptr is not None:
            exported[cid] = exchange.Outbound(ipc_ptr=ob.ipc_ptr)
        t3 = time.perf_counter()
        stats = {
            "decode_s": t1 - t0,
            "run_s": t2 - t1,
            "encode_s": t3 - t2,
            **_packet_bytes("in", packet),
            **_packet_bytes("out", out),
            "resident_bytes": _store_bytes(store, exchange),
            "channel": channel.stats(),
        }
        return ("ok", cid, out, stats)
    except BaseException as e:  # reported to the driver; the worker keeps serving
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return ("err", cid, type(e).__name__, str(e), traceback.format_exc())


def _store_op(op):
    """Wrap a resident-store operation ``op(msg, exported, store, jax, exchange, channel) -> (value,
    stats)`` into a reply like a call's (errors are reported, the worker keeps serving)."""

    @functools.wraps(op)
    def run(msg, exported, store, jax, exchange, channel):
        cid = msg[1]
        try:
            packet, stats = op(msg, exported, store, jax, exchange, channel)
            for way in ("in", "out"):
                for path in ("shm", "ipc", "inline"):
                    stats.setdefault(f"{way}_{path}_bytes", 0)
            stats["resident_bytes"] = _store_bytes(store, exchange)
            return ("ok", cid, packet, stats)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            return ("err", cid, type(e).__name__, str(e), traceback.format_exc())

    return run


def _packet_bytes(direction: str, packet) -> dict[str, int]:
    """``{direction}_shm_bytes`` / ``_ipc_bytes`` / ``_inline_bytes``: how one packet travelled."""
    paths = ("shm", "ipc", "inline")
    return {f"{direction}_{path}_bytes": getattr(packet, f"{path}_bytes") for path in paths}


def _empty(exchange, value=None):
    return exchange.Packet(value)


@_store_op
def _put(msg, exported, store, jax, exchange, channel):
    _, cid, name, packet = msg
    t0 = time.perf_counter()
    store[name] = jax.block_until_ready(exchange.decode(packet, to="jax", channel=channel))
    return _empty(exchange), {"decode_s": time.perf_counter() - t0, **_packet_bytes("in", packet)}


@_store_op
def _get(msg, exported, store, jax, exchange, channel):
    _, cid, name, out_shm_name, out_ipc = msg
    t0 = time.perf_counter()
    (value,) = _read_store(store, (name,))
    out, ob = exchange.encode(value, shm_name=out_shm_name, use_ipc=out_ipc, channel=channel)
    if ob.ipc_ptr is not None:
        exported[cid] = exchange.Outbound(ipc_ptr=ob.ipc_ptr)
    return out, {"encode_s": time.perf_counter() - t0, **_packet_bytes("out", out)}


@_store_op
def _drop(msg, exported, store, jax, exchange, channel):
    for name in msg[2]:
        store.pop(name, None)
    return _empty(exchange), {}


@_store_op
def _list(msg, exported, store, jax, exchange, channel):
    return _empty(exchange, {n: exchange.nbytes(v) for n, v in store.items()}), {}


_STORE_OPS = {"put": _put, "get": _get, "drop": _drop, "list": _list}
