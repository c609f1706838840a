"""MPS orchestration: the daemon's lifecycle, worker plans (frozen data) and the quota search."""

from rose_jax.mps.client import InheritedDaemon, inherited_daemon, run_as_client, stop_own, worker_daemon
from rose_jax.mps.daemon import MPSDaemon, MPSError, ShutdownReport, mps_status
from rose_jax.mps.plan import SMQuota, WorkerSpec, validate_specs, worker_environment
from rose_jax.mps.search import (
    BranchModel,
    QuotaPoint,
    QuotaSearchResult,
    choose_quotas,
    even_quotas,
    fit_branch,
    join_time,
    measure_each,
    quotas_from_tables,
    search_quotas,
)

__all__ = [
    "BranchModel",
    "InheritedDaemon",
    "MPSDaemon",
    "MPSError",
    "QuotaPoint",
    "QuotaSearchResult",
    "SMQuota",
    "ShutdownReport",
    "WorkerSpec",
    "choose_quotas",
    "even_quotas",
    "fit_branch",
    "inherited_daemon",
    "join_time",
    "measure_each",
    "mps_status",
    "quotas_from_tables",
    "run_as_client",
    "stop_own",
    "worker_daemon",
    "search_quotas",
    "validate_specs",
    "worker_environment",
]
