"""The plan cache: a JSON file of chosen plans, keyed by what the plan was measured for.

Key = (program fingerprint: SHA-256 of the jaxpr text with memory addresses removed, env name,
batch size, device name (GPU name or ``"cpu"``), jax version). A hit means the same program on
the same kind of machine: the search is skipped and the cached transforms are applied. The file
is rewritten atomically (temporary file + ``os.replace``), so a crash never leaves half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Callable

import jax

from rose_jax.io import atomic_write_text

CACHE_FILE = "plans.json"
ENV_DIR = "ROSE_JAX_PLAN_CACHE"


def default_dir() -> str:
    """Where plans (and XLA option decisions) are cached: ``$ROSE_JAX_PLAN_CACHE`` or
    ``~/.cache/rose-jax/plans``."""
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "rose-jax", "plans")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def fingerprint(fn: Callable, *args) -> str:
    """SHA-256 (hex, 16 chars) of ``fn``'s jaxpr text on ``args`` (addresses stripped)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return hashlib.sha256(_ADDRESS.sub("0x", text).encode()).hexdigest()[:16]


def device_name() -> str:
    """The accelerator's name (e.g. ``"NVIDIA H200"``) or ``"cpu"``."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return "cpu"
    return str(getattr(dev, "device_kind", dev.platform))


def cache_key(fingerprint_hex: str, env_name: str, batch_size: int | None, device: str | None = None) -> str:
    parts = [
        fingerprint_hex,
        env_name or "-",
        str(batch_size if batch_size is not None else "-"),
        device or device_name(),
        jax.__version__,
    ]
    return "|".join(parts)


def load(cache_dir: str) -> dict[str, Any]:
    """All cached entries (``{}`` when the file does not exist)."""
    path = os.path.join(cache_dir, CACHE_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"plan cache {path} is not valid JSON ({e}); delete it to start afresh"
            ) from None
    if not isinstance(data, dict):
        raise ValueError(f"plan cache {path} must hold a JSON object")
    return data


def _alike(cache_dir: str | None, key: str, differ: int) -> dict[str, dict]:
    """The entries (with a report) whose key differs from ``key`` in part ``differ`` (0: the program
    fingerprint, 3: the device name) and agrees in every other part but the device name, which may
    differ in either case."""
    if not cache_dir:
        return {}
    mine = key.split("|")
    free = {differ, 3}
    out = {}
    for k, entry in load(cache_dir).items():
        theirs = k.split("|")
        if len(theirs) != len(mine) or len(mine) < 5 or theirs[differ] == mine[differ]:
            continue
        same = all(a == b for i, (a, b) in enumerate(zip(theirs, mine, strict=True)) if i not in free)
        if same and isinstance(entry, dict) and "report" in entry:
            out[k] = entry
    return out


def siblings(cache_dir: str | None, key: str) -> dict[str, dict]:
    """The entries of ``key``'s program on other devices: every part of the key the same (program
    fingerprint, env, batch size, jax version, option sets) but the device name. A search on a new
    kind of GPU measures first what was kept on another (``search._sibling_first``); their plans
    are never used as they are."""
    return _alike(cache_dir, key, differ=3)


def relatives(cache_dir: str | None, key: str) -> dict[str, dict]:
    """The entries of other programs on ``key``'s env and batch size (the same jax version and option
    sets, any device): the same algorithm at another run length (PPO's epoch of 7 or 17 training
    steps), or another algorithm on the env; none where the key names no env or batch size (``-``).
    A search measures first, after :func:`siblings`, the candidates of its own list that these kept
    (``search._sibling_first``): a kept measurement on a program like this one ranks above a
    prediction. Their plans are never used as they are."""
    if "-" in key.split("|")[1:3]:  # no env or batch size named (optimize(fn) alone): none alike
        return {}
    return _alike(cache_dir, key, differ=0)


def remove(cache_dir: str, key: str) -> None:
    """Drop the entry under ``key`` (if any) and rewrite the file atomically."""
    if os.path.exists(os.path.join(cache_dir, CACHE_FILE)):
        _rewrite(cache_dir, lambda data: data.pop(key, None) is not None)


def lookup(cache_dir: str | None, key: str) -> dict | None:
    if not cache_dir:
        return None
    return load(cache_dir).get(key)


def _rewrite(cache_dir: str, edit: Callable[[dict[str, Any]], bool]) -> str:
    """``edit`` the cache's entries under its lock (processes writing at once lose nothing) and
    rewrite the file atomically where ``edit`` returns True; returns the file's path."""
    import fcntl

    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, CACHE_FILE)
    with open(os.path.join(cache_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = load(cache_dir)
        if edit(data):
            atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))
    return path


def store(cache_dir: str, key: str, entry: dict) -> str:
    """Add ``entry`` under ``key`` and rewrite the file atomically; returns its path."""
    def put(data: dict[str, Any]) -> bool:
        data[key] = entry
        return True

    return _rewrite(cache_dir, put)
