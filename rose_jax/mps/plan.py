"""Plans for worker processes under MPS: frozen data, validated, testable without a GPU.

An ``SMQuota`` is the share of the GPU's SMs a worker may use (MPS
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read once when the worker creates its CUDA context).
A ``WorkerSpec`` names one worker process: its quota, the fraction of GPU memory its XLA client
may use, and extra environment variables. ``worker_environment`` turns a spec into the explicit
environment the worker process is born with (set before ``import jax``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Iterable, Mapping

# Total GPU memory fraction all workers of one plan may claim together. The rest is headroom for
# CUDA contexts, the MPS server and CUDA-IPC staging buffers, which live outside XLA's pool.
MAX_TOTAL_MEM_FRACTION = 0.95

MPS_PIPE_VAR = "CUDA_MPS_PIPE_DIRECTORY"
MPS_LOG_VAR = "CUDA_MPS_LOG_DIRECTORY"
MPS_THREAD_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# jaxlib reads XLA_CLIENT_MEM_FRACTION (new) or XLA_PYTHON_CLIENT_MEM_FRACTION (deprecated) and
# refuses both at once; only the deprecated name is read by every jaxlib we support (0.11 .. 0.12).
MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
MEM_FRACTION_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
WORKER_NAME_VAR = "ROSE_WORKER_NAME"

# Variables a spec's ``env`` may not set: the plan owns them.
MANAGED_VARS = frozenset({MPS_PIPE_VAR, MPS_LOG_VAR, MPS_THREAD_VAR, WORKER_NAME_VAR, *MEM_FRACTION_VARS})

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class SMQuota:
    """A worker's SM share in percent of the GPU (integer, 1..100)."""

    percent: int

    def __post_init__(self):
        p = self.percent
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"SMQuota.percent must be an int in 1..100, got {p!r}")
        if not 1 <= p <= 100:
            raise ValueError(f"SMQuota.percent must be in 1..100, got {p}")

    def __str__(self) -> str:
        return f"{self.percent}%"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker process.

    name: unique in a plan, ``[A-Za-z0-9_.-]{1,64}``.
    quota: SM share (``SMQuota`` or an int percent; None = no MPS limit, 100%).
    mem_fraction: fraction of GPU memory for this worker's XLA client, in (0, 0.95]; None = no
      cap (XLA grows on demand: preallocation is always off, several processes share the GPU).
    env: extra environment variables (str -> str), e.g. ``{"JAX_PLATFORMS": "cpu"}``; may not
      set the variables the plan owns (``MANAGED_VARS``). Stored as a sorted tuple of pairs.
    """

    name: str
    quota: SMQuota | None = None
    mem_fraction: float | None = None
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"WorkerSpec.name must match [A-Za-z0-9_.-]{{1,64}}, got {self.name!r}")
        quota = self.quota
        if quota is not None and not isinstance(quota, SMQuota):
            quota = SMQuota(quota)
        object.__setattr__(self, "quota", quota)
        mf = self.mem_fraction
        if mf is not None:
            if isinstance(mf, bool) or not isinstance(mf, (int, float)) or not math.isfinite(mf):
                raise ValueError(f"WorkerSpec {self.name!r}: mem_fraction must be a float, got {mf!r}")
            if not 0.0 < mf <= MAX_TOTAL_MEM_FRACTION:
                raise ValueError(
                    f"WorkerSpec {self.name!r}: mem_fraction must be in (0, {MAX_TOTAL_MEM_FRACTION}], "
                    f"got {mf}"
                )
            object.__setattr__(self, "mem_fraction", float(mf))
        env = self.env
        items = env.items() if isinstance(env, Mapping) else env
        pairs = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"WorkerSpec {self.name!r}: env must be a mapping str -> str, got {env!r}")
            k, v = item
            if not isinstance(k, str) or not isinstance(v, str) or not k:
                raise ValueError(
                    f"WorkerSpec {self.name!r}: env entries must be str -> str, got {k!r}: {v!r}"
                )
            if k in MANAGED_VARS:
                raise ValueError(
                    f"WorkerSpec {self.name!r}: env may not set {k} "
                    "(the plan sets it from quota/mem_fraction/daemon)"
                )
            pairs.append((k, v))
        object.__setattr__(self, "env", tuple(sorted(pairs)))

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def with_quota(self, quota: SMQuota | int | None) -> "WorkerSpec":
        """The same worker with another SM quota (a new quota means a new worker process)."""
        return dataclasses.replace(self, quota=quota)


def validate_specs(specs: Iterable[WorkerSpec]) -> tuple[WorkerSpec, ...]:
    """Check a plan: at least one worker, unique names, total mem_fraction <= 0.95."""
    specs = tuple(specs)
    if not specs:
        raise ValueError("a worker plan needs at least one WorkerSpec")
    for s in specs:
        if not isinstance(s, WorkerSpec):
            raise ValueError(f"expected WorkerSpec, got {type(s).__name__}: {s!r}")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"worker names must be unique, repeated: {dupes}")
    total = sum(s.mem_fraction or 0.0 for s in specs)
    if total > MAX_TOTAL_MEM_FRACTION + 1e-9:
        parts = ", ".join(f"{s.name}={s.mem_fraction}" for s in specs if s.mem_fraction)
        raise ValueError(f"sum of mem_fraction is {total:.3f} > {MAX_TOTAL_MEM_FRACTION} ({parts})")
    return specs


def worker_environment(
    spec: WorkerSpec, *, mps_env: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The complete environment a worker process is born with.

    base: the environment to start from (default ``os.environ``); inherited ``CUDA_MPS_*`` and
      XLA memory-fraction variables are dropped so that only the plan decides them.
    mps_env: the daemon's client variables (``MPSDaemon.client_env()``); when given, the spec's
      quota becomes ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``. Without a daemon the quota is not set
      (it would mean nothing outside MPS).
    Always sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (several JAX processes share one GPU;
    a spec's env may override it) and ``ROSE_WORKER_NAME``.
    """
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith("CUDA_MPS_") or k in MEM_FRACTION_VARS:
            del env[k]
    env[PREALLOCATE_VAR] = "false"
    if spec.mem_fraction is not None:
        env[MEM_FRACTION_VAR] = f"{spec.mem_fraction:.6g}"
    if mps_env is not None:
        missing = {MPS_PIPE_VAR} - set(mps_env)
        if missing:
            raise ValueError(f"mps_env lacks {sorted(missing)}")
        env.update({k: str(v) for k, v in mps_env.items()})
        if spec.quota is not None:
            env[MPS_THREAD_VAR] = str(spec.quota.percent)
    env.update(spec.env)
    env[WORKER_NAME_VAR] = spec.name
    return env
