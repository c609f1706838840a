"""Crash isolation: a candidate's first compile and one call run in a child process.

Some candidate programs make XLA abort the whole process (an annotated stream region holding
MJX physics: ``RET_CHECK failure ... ExplicitStreamAnnotationAsyncWrapper``, then
``F... Check failed``). A ``CHECK`` failure is ``abort()``: no Python ``try`` survives it. So
before a candidate is compiled in the driver, :func:`check` serializes it with ``jax.export``
(StableHLO, no compile in the driver), starts a child interpreter with an explicit environment
(:func:`rose_jax.mps.plan.worker_environment`: preallocation off; the driver's own environment
is never changed) and lets the child deserialize, compile it with the candidate's XLA options
and call it once on zeros of the right shapes. The outcome:

* the child exits cleanly: the candidate is safe to compile here;
* the child dies by a signal (abort, segfault): refused, ``"XLA aborted: <last stderr line>"``
  (the glog ``F``/``Check failed``/``RET_CHECK`` line when there is one);
* the child reports a Python exception (e.g. an ``XlaRuntimeError`` compile error): refused,
  ``"XLA compile failed: <message>"``;
* it runs past ``timeout``: refused for now (not remembered).

Aborts and compile failures are deterministic for a program, a device and a JAX version, so
they are remembered in the plan cache (:mod:`rose_jax.optimize.cache`) under
``refused|<program fingerprint>|...|<device>|<jax version>`` with one reason per candidate
label; a later :func:`check` with the same key answers from the cache without a child.

Run as ``python -m rose_jax.optimize.isolate <dir>`` (what the driver does); ``<dir>`` holds
``program.bin`` (the serialized export) and ``spec.json`` (argument shapes and XLA options).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

# Test hook: a child started with this variable set to "1" (or to a text its candidate's label
# contains) aborts on purpose right before it compiles (a deliberate crash standing in for an XLA
# abort, used by the tests only).
DELIBERATE_ABORT_VAR = "ROSE_ISOLATE_DELIBERATE_ABORT"
_FATAL_LINE = re.compile(r"(^[FE]\d{4} )|Check failed|RET_CHECK|Fatal Python error|Aborted")
_REFUSED_PREFIX = "refused|"


class Outcome(NamedTuple):
    """What the isolated compile said: ``ok``; ``reason`` (why refused, or what ran);
    ``seconds`` spent (0 for a cached answer); ``cached``: answered from the plan cache;
    ``exported``: the ``jax.export.Exported`` the child compiled (``ok`` only). With JAX's
    persistent compilation cache on, the child wrote its executable there, so
    ``jax.jit(exported.call, compiler_options=<the same>)`` in the driver loads it instead of
    compiling again (:func:`compile_exported`)."""

    ok: bool
    reason: str
    seconds: float = 0.0
    cached: bool = False
    exported: Any = None
    out_tree: Any = None  # the treedef of what ``fn`` returned (its exported program returns the leaves)


# ------------------------------------------------------------------------------ the driver


def _refusal_key(fingerprint: str) -> str:
    from rose_jax.optimize import cache  # noqa: PLC0415

    return _REFUSED_PREFIX + cache.cache_key(fingerprint, "-", None)


def remembered(cache_dir: str | None, fingerprint: str | None) -> dict[str, str]:
    """Candidate label -> refusal reason recorded for this program on this device and JAX."""
    if not cache_dir or not fingerprint:
        return {}
    from rose_jax.optimize import cache  # noqa: PLC0415

    entry = cache.lookup(cache_dir, _refusal_key(fingerprint)) or {}
    return dict(entry.get("refused", {}))


def remember(cache_dir: str, fingerprint: str, label: str, reason: str) -> str:
    """Record ``label`` as refused with ``reason`` (atomic rewrite of the cache file)."""
    from rose_jax.optimize import cache  # noqa: PLC0415

    key = _refusal_key(fingerprint)
    entry = cache.lookup(cache_dir, key) or {}
    refused = dict(entry.get("refused", {}))
    refused[label] = reason
    return cache.store(cache_dir, key, {"refused": refused, "jax_version": jax.__version__})


def _arg_specs(args: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    out = []
    for x in args:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            out.append(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype))
        else:
            a = np.asarray(x)
            out.append(jax.ShapeDtypeStruct(a.shape, a.dtype))
    return out


# JAX's persistent-cache settings the child takes from the driver (set with jax.config.update in
# the driver, e.g. by rose_jax.startup, they are not in its environment)
_CACHE_CONFIG = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


def persistent_cache_dir() -> str | None:
    """The driver's persistent compilation cache directory, or None when it has none."""
    return getattr(jax.config, "jax_compilation_cache_dir", None) or None


def shared_cache_environment() -> dict[str, str]:
    """The driver's persistent-cache settings as the environment variables JAX reads at start
    (``JAX_COMPILATION_CACHE_DIR``, ...), for a process of ours to compile into and load from the
    same cache; {} when the driver has none."""
    if persistent_cache_dir() is None:
        return {}
    values = ((name, getattr(jax.config, name, None)) for name in _CACHE_CONFIG)
    return {name.upper(): str(value) for name, value in values if value is not None}


def compile_exported(outcome: Outcome, args: Sequence[Any], compiler_options: Mapping[str, Any] | None):
    """The driver's executable of a candidate its child compiled: ``jax.jit(exported.call)`` with
    the child's XLA options, compiled for the shapes of ``args``. With the persistent cache on (and
    shared with the child, :func:`child_environment`) this loads the child's executable; None when
    there is no exported program or no cache (compiling it again would gain nothing).

    Lowered from shapes, as the child lowers from uncommitted zeros: arrays committed to a device
    (e.g. a previous stage's outputs) would give another module and miss the cache."""
    if not outcome.ok or outcome.exported is None or persistent_cache_dir() is None:
        return None
    opts = {k: v for k, v in dict(compiler_options or {}).items()} or None
    specs = _arg_specs(jax.tree.leaves(tuple(args)))
    return jax.jit(outcome.exported.call, compiler_options=opts).lower(*specs).compile()


def on_default_device(args: Sequence[Any]) -> bool:
    """Every array of ``args`` (pytrees) on the default device, or uncommitted: what an executable
    :func:`compile_exported` loaded (lowered from shapes) accepts."""
    default = frozenset({jax.devices()[0]})
    return all(
        getattr(a, "sharding", None) is None or frozenset(a.sharding.device_set) == default
        for a in jax.tree.leaves(tuple(args))
    )


def loaded_step(outcome: Outcome, args: Sequence[Any], compiler_options: Mapping[str, Any] | None):
    """:func:`compile_exported` as the function the child compiled: called with ``args``' pytrees,
    it returns what ``fn`` returned (``outcome.out_tree``), so a caller that would compile ``fn``
    under ``compiler_options`` again runs the child's executable instead (a load from the shared
    persistent cache, not a second compile). None where that cannot be: no exported program, no
    persistent cache, no output structure, or an argument committed to another device."""
    if outcome.out_tree is None or not on_default_device(args):
        return None
    run = compile_exported(outcome, args, compiler_options)
    if run is None:
        return None
    out_tree = outcome.out_tree

    def step(*a):
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(tuple(a))))

    return step


def child_environment(extra: Mapping[str, str] | None = None, share_cache: bool = False) -> dict[str, str]:
    """The child's complete environment: the driver's, minus MPS / memory-fraction variables,
    preallocation off (:func:`rose_jax.mps.plan.worker_environment`), JAX on the driver's
    platform, with ``share_cache`` the driver's persistent compilation cache (so the driver can
    load what the child compiled), plus ``extra``."""
    from rose_jax.mps import plan  # noqa: PLC0415

    env = plan.worker_environment(plan.WorkerSpec("isolate"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    if jax.default_backend() == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    if share_cache:
        env.update(shared_cache_environment())
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    return env


def _last_fatal_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if not lines:
        return "(no output)"
    fatal = [ln for ln in lines if _FATAL_LINE.search(ln)]
    line = (fatal or lines)[-1]
    return line if len(line) <= 400 else line[:397] + "..."


def check(
    fn: Callable,
    args: Sequence[Any],
    *,
    compiler_options: Mapping[str, Any] | None = None,
    label: str = "candidate",
    cache_dir: str | None = None,
    fingerprint: str | None = None,
    timeout: float = 900.0,
    env: Mapping[str, str] | None = None,
    share_cache: bool = False,
) -> Outcome:
    """Compile ``jax.jit(fn)`` for ``args`` (pytrees of arrays or ShapeDtypeStructs) and call it
    once, in a child process; see the module docstring.

    ``label`` names the candidate in the refusal cache; ``cache_dir`` + ``fingerprint`` (the
    program's, :func:`rose_jax.optimize.cache.fingerprint`) turn the cache on. ``env``: extra
    environment variables for the child. ``share_cache``: the child writes its executable into
    the driver's persistent compilation cache, for a caller that loads it
    (:func:`compile_exported`); off by default, so as not to fill the cache with entries nobody reads.
    """
    known = remembered(cache_dir, fingerprint)
    if label in known:
        return Outcome(False, known[label], 0.0, True)
    leaves, treedef = jax.tree.flatten(tuple(args))
    specs = _arg_specs(leaves)

    out_tree: list = []  # filled while jax.export traces flat_fn

    def flat_fn(*flat):  # flat arrays in and out: any pytree classes stay in this process
        out = fn(*jax.tree.unflatten(treedef, flat))
        out_tree[:] = [jax.tree.structure(out)]
        return jax.tree.leaves(out)

    t0 = time.perf_counter()
    try:
        exported = jax.export.export(jax.jit(flat_fn))(*specs)
        blob = exported.serialize()
    except Exception as e:  # noqa: BLE001 - any export failure refuses the candidate, with its text
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Outcome(
            False, f"not isolated: jax.export failed ({type(e).__name__}: {msg})", time.perf_counter() - t0
        )
    with tempfile.TemporaryDirectory(prefix="rose-isolate-") as tmp:
        with open(os.path.join(tmp, "program.bin"), "wb") as f:
            f.write(bytes(blob))
        spec = {
            "args": [[list(s.shape), str(s.dtype)] for s in specs],
            "compiler_options": {k: v for k, v in dict(compiler_options or {}).items()},
            "label": label,
        }
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump(spec, f)
        err_path = os.path.join(tmp, "stderr.txt")
        with open(err_path, "wb") as err:
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "rose_jax.optimize.isolate", tmp],
                    env=child_environment(env, share_cache=share_cache),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    timeout=timeout,
                    check=False,
                )
                code = proc.returncode
            except subprocess.TimeoutExpired:
                return Outcome(
                    False,
                    f"timed out: the isolated compile ran past {timeout:.0f} s",
                    time.perf_counter() - t0,
                )
        with open(err_path, errors="replace") as f:
            stderr = f.read()
        result_path = os.path.join(tmp, "result.json")
        result = None
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
    seconds = time.perf_counter() - t0
    if code == 0 and result is not None and result.get("ok"):
        return Outcome(
            True,
            f"compiled and ran in a child process ({result.get('compile_s', 0):.1f} s compile)",
            seconds,
            exported=exported,
            out_tree=out_tree[0] if out_tree else None,
        )
    if result is not None and not result.get("ok"):
        reason = f"XLA compile failed: {result.get('error', '?')}"
    elif code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = f"signal {-code}"
        reason = f"XLA aborted: {_last_fatal_line(stderr)} ({sig})"
    else:
        reason = f"XLA aborted: {_last_fatal_line(stderr)} (exit code {code})"
    if cache_dir and fingerprint:
        remember(cache_dir, fingerprint, label, reason)
    return Outcome(False, reason, seconds)


# ------------------------------------------------------------------------------ the child


def _zeros(shape: Sequence[int], dtype: str):
    import jax.numpy as jnp  # noqa: PLC0415

    try:
        return jnp.zeros(tuple(shape), dtype=np.dtype(dtype))
    except TypeError:  # a typed PRNG key array: zeros of its key data
        impl = jax.random.key_impl(jax.random.key(0))
        data = jnp.zeros(tuple(shape) + tuple(jax.random.key_data(jax.random.key(0)).shape), jnp.uint32)
        return jax.random.wrap_key_data(data, impl=impl)


def _child(directory: str) -> int:
    from jax import export as jax_export  # noqa: PLC0415

    with open(os.path.join(directory, "spec.json")) as f:
        spec = json.load(f)
    with open(os.path.join(directory, "program.bin"), "rb") as f:
        exported = jax_export.deserialize(bytearray(f.read()))
    result_path = os.path.join(directory, "result.json")
    deliberate = os.environ.get(DELIBERATE_ABORT_VAR, "")
    if deliberate == "1" or (deliberate and deliberate in str(spec.get("label", ""))):
        print(
            f"F0000 00:00:00 rose_jax.optimize.isolate: deliberate abort ({DELIBERATE_ABORT_VAR}=1, a test)",
            file=sys.stderr,
            flush=True,
        )
        os.abort()
    try:
        args = [_zeros(shape, dtype) for shape, dtype in spec["args"]]
        t0 = time.perf_counter()
        compiled = (
            jax.jit(exported.call, compiler_options=spec["compiler_options"] or None).lower(*args).compile()
        )
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(compiled(*args))
        result = {"ok": True, "compile_s": compile_s, "run_s": time.perf_counter() - t0 - compile_s}
    except Exception as e:  # noqa: BLE001 - reported to the driver as a refusal reason
        text = str(e).strip().splitlines()
        result = {"ok": False, "error": f"{type(e).__name__}: {text[0] if text else ''}"[:400]}
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        print(
            "usage: python -m rose_jax.optimize.isolate <dir with program.bin and spec.json>", file=sys.stderr
        )
        sys.exit(2)
    sys.exit(_child(sys.argv[1]))
