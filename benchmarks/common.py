"""Helpers shared by the suite and the experiments: machine facts, tables, plots, algorithm flags.

Result files are written with :mod:`rose_jax.io`'s atomic writers (the whole file or nothing).
"""

from __future__ import annotations

import datetime as _dt
import io
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Sequence

from rose_jax.io import atomic_write_bytes

BENCHMARKS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCHMARKS_DIR)
RESULTS_DIR = os.path.join(BENCHMARKS_DIR, "results")
PACKAGES = ("jaxlib", "flax", "optax", "brax", "mujoco", "mujoco_mjx", "numpy", "psutil")
T0 = time.perf_counter()  # this process's start, near enough: benchmarks.common is imported first


def merge_records(
    old: Sequence[dict], new: Sequence[dict], key: Callable[[dict], Any], measured: Callable[[dict], bool]
) -> list[dict]:
    """An earlier run's records (``--merge``) updated by this run's: a new record replaces the old
    one with its ``key`` unless the new one was not ``measured`` (skipped, failed) and the old one
    was: a skip or a failure never replaces a measurement. Old records keep their order; records
    with new keys follow in theirs."""
    fresh: dict[Any, dict] = {}
    for r in new:
        fresh[key(r)] = r
    out = []
    for r in old:
        n = fresh.get(key(r))
        out.append(n if n is not None and (measured(n) or not measured(r)) else r)
    seen = {key(r) for r in old}
    return out + [r for r in new if key(r) not in seen]


def previous_records(path: str, field: str) -> list[dict]:
    """The records under ``field`` of an earlier results file written with :func:`machine_info` as
    its ``"machine"`` (``[]`` if there is none), each stamped with the command and date of that run
    unless it carries its own (records merged before keep the run that measured them)."""
    if not os.path.exists(path):
        return []
    import json

    with open(path) as f:
        doc = json.load(f)
    machine = doc.get("machine") or {}
    stamp = {"command": machine.get("command"), "date": machine.get("date")}
    return [{**stamp, **r} for r in doc.get(field, [])]


def elapsed() -> float:
    """Seconds since this process started (:data:`T0`)."""
    return time.perf_counter() - T0


def log(msg: str) -> None:
    """A progress line that starts with the seconds elapsed."""
    print(f"[{elapsed():7.1f}s] {msg}", flush=True)


def _stdout(cmd: Sequence[str], timeout_s: float = 10.0) -> str | None:
    """``cmd``'s stripped stdout, or None when it cannot run or fails."""
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine_info(jax_devices: bool = True) -> dict[str, Any]:
    """Date, host, versions, GPU, git commit and command line to store beside every result.

    ``jax_devices=False`` leaves out JAX's backend and devices: looking them up creates a CUDA
    context in this process (the MPS experiment's driver must never hold one).
    """
    import jax

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "command": " ".join(["python", *sys.orig_argv[1:]]),
    }
    if jax_devices:
        info["backend"] = jax.default_backend()
        info["devices"] = [d.device_kind for d in jax.devices()]
    for pkg in PACKAGES:
        try:
            info[pkg] = version(pkg.replace("_", "-"))
        except PackageNotFoundError:  # a package that is not installed is simply not listed
            pass
    gpu = _stdout(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if gpu:
        info["gpu"] = gpu
        # the physical GPU: rows of separate calls on one warm machine can then be shown to share it
        uuid = _stdout(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"])
        if uuid:
            info["gpu_uuid"] = uuid
    commit = _stdout(["git", "-C", REPO_DIR, "rev-parse", "HEAD"])
    if commit:
        info["git_commit"] = commit
    return info


def state_after(step: Callable, state: Any, calls: int) -> Any:
    """``state`` after ``calls`` calls of a compiled ``step(state) -> (state, metrics)``, on the
    host (what the equality checks compare)."""
    import jax

    for _ in range(calls):
        state, _ = step(state)
    return jax.device_get(state)


def equality_fields(out: Any, ref: Any, tolerance: Any = None) -> dict[str, Any]:
    """How ``out`` compares with ``ref`` (:func:`rose_jax.compare.compare_trees`): ``equal``
    (bitwise), ``max_abs_diff``, ``worst_leaf``; with a :class:`rose_jax.optimize.Tolerance`
    also ``within_tolerance``, ``tolerance`` and ``tolerance_verdict``."""
    from rose_jax.compare import compare_trees

    exact = compare_trees(out, ref)
    rec: dict[str, Any] = {
        "equal": bool(exact.equal),
        "max_abs_diff": float(exact.max_abs),
        "worst_leaf": exact.worst,
    }
    if tolerance is not None:
        tol = compare_trees(out, ref, rtol=tolerance.rtol, atol=tolerance.atol)
        rec.update(
            within_tolerance=bool(tol.equal), tolerance=tolerance.to_json(), tolerance_verdict=tol.reason
        )
    return rec


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def config_table(columns: Sequence[tuple[str, str]], rows: Sequence[dict], cells) -> str:
    """Markdown table of an experiment's per-config rows.

    columns: ``(header, align)`` pairs, align ``"l"`` or ``"r"``; the first column is the row's
    ``name``. cells(row) -> the other columns' texts. A row with a ``"skipped"`` reason is
    written as ``skipped: <reason>`` after its name, the rest of its cells empty.
    """
    out = [
        "| " + " | ".join(h for h, _ in columns) + " |",
        "|" + "".join("---:|" if a == "r" else "---|" for _, a in columns),
    ]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['name']} | skipped: {r['skipped']} |" + " |" * (len(columns) - 2))
        else:
            out.append("| " + " | ".join([r["name"], *cells(r)]) + " |")
    return "\n".join(out)


def fmt(x: Any, spec: str = ".1f", none: str = "-") -> str:
    """``format(x, spec)``, or ``none`` for None and non-finite floats."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


NOT_CHECKED = "not checked"


def fmt_equal(x: Any) -> str:
    """An ``equal`` field for a table: ``"not checked"`` for None (a row or candidate whose
    equality was never checked, e.g. no plan was kept), else ``str(x)``."""
    return NOT_CHECKED if x is None else str(x)


def save_plot(fig, path: str) -> None:
    """Save a matplotlib figure atomically as PNG, then close it (pyplot keeps every open figure:
    a process writing results after each run would otherwise hold them all)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def write_markdown_and_plot(out: str, lines: Sequence[str], plot: Callable[..., None], *args: Any) -> None:
    """``<out>/results.md`` from ``lines`` (atomically), then ``plot(*args, <out>/results.png)``; a
    failing plot is logged in one line and never loses the measurements already written."""
    from rose_jax.io import atomic_write_text

    atomic_write_text(os.path.join(out, "results.md"), "\n".join(lines) + "\n")
    try:
        plot(*args, os.path.join(out, "results.png"))
    except Exception as e:  # noqa: BLE001 - a plot must never lose the measurements
        log(f"plot failed: {type(e).__name__}: {e}")


def enable_compile_cache(path: str, min_compile_time_s: float = 1.0) -> None:
    """Turn on JAX's persistent compilation cache at ``path`` ('' leaves it off).

    Programs that compile for at least ``min_compile_time_s`` are stored; an identical program
    compiled again in this run (or a later one) loads instead of compiling.
    """
    if path:
        from rose_jax import startup

        startup.enable_compile_cache(path, min_compile_time_s)


# ------------------------------------------------------------------------------ per-config experiments


def add_env_args(p, num_envs: int) -> None:
    """``--env`` (default ant), ``--backend`` (default mjx) and one ``--num-envs``."""
    p.add_argument("--env", default="ant")
    p.add_argument("--backend", default="mjx", help="env backend keyword ('none' for pure-JAX envs)")
    p.add_argument("--num-envs", type=int, default=num_envs)


def add_config_args(p, num_envs: Sequence[int], budget_s: float, default_out: str) -> None:
    """Flags of an experiment over (algorithm, env count) configs: which configs, where, how long."""
    p.add_argument("--algos", nargs="+", default=["ppo", "sac"], choices=["ppo", "sac"])
    p.add_argument("--num-envs", nargs="+", type=int, default=list(num_envs))
    p.add_argument("--env", default="ant")
    p.add_argument("--backend", default="mjx", help="env backend keyword ('none' for pure-JAX envs)")
    p.add_argument("--tiny", action="store_true", help="CPU plumbing check: pendulum, 8 envs, tiny configs")
    p.add_argument("--out", default=None, help=f"output dir (default {default_out}; --tiny: a temp dir)")
    p.add_argument("--budget-s", type=float, default=budget_s, help="skip configs starting after this")
    p.add_argument(
        "--compile-cache",
        default=os.path.join(tempfile.gettempdir(), "rose_jax_jit_cache"),
        help="JAX persistent compilation cache dir ('' to disable)",
    )


def make_tiny(args, ppo_epochs: int = 1) -> None:
    """``--tiny``: pendulum (pure JAX), 8 envs, tiny algorithm shapes, no time budget."""
    args.env, args.backend, args.num_envs = "pendulum", "none", [8]
    if hasattr(args, "hidden"):
        args.hidden = [16]
    shrink_algo_args(args, ppo_epochs)
    args.budget_s = max(args.budget_s, 1e9)


def output_dir(args, default: str, tiny_prefix: str) -> str:
    """``--out``, else a new temp dir for ``--tiny``, else ``default``; created."""
    out = args.out or (tempfile.mkdtemp(prefix=tiny_prefix) if args.tiny else default)
    os.makedirs(out, exist_ok=True)
    return out


def algo_configs(args, run: Callable[[str, int], dict]) -> list[tuple[str, Callable[[], dict]]]:
    """``(name, thunk)`` of ``run(algo, num_envs)`` for every env count x algorithm of the flags."""
    return [
        (f"{a}_{args.env}_{n}", lambda a=a, n=n: run(a, n)) for n in args.num_envs for a in args.algos
    ]


def run_configs(configs: Sequence[tuple[str, Callable[[], dict]]], budget_s: float,
                after_each: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """``run()`` of each ``(name, run)`` in turn; returns the rows.

    A config that would start more than ``budget_s`` seconds after this call becomes the row
    ``{"name", "skipped": "time budget"}``; one that raises, ``{"name", "skipped": "failed: ..."}``
    (the others still run). ``after_each(rows)`` runs after every config (e.g. to write files).
    """
    start = time.perf_counter()
    rows: list[dict] = []
    for name, run in configs:
        if time.perf_counter() - start > budget_s:
            log(f"{name}: skipped (time budget {budget_s:.0f}s spent)")
            rows.append({"name": name, "skipped": "time budget"})
        else:
            try:
                rows.append(run())
            except Exception as e:  # noqa: BLE001 - report and go on with the next config
                log(f"{name}: FAILED: {type(e).__name__}: {e}")
                rows.append({"name": name, "skipped": f"failed: {type(e).__name__}: {str(e)[:160]}"})
        if after_each is not None:
            after_each(rows)
    return rows


# ------------------------------------------------------------------------------ algorithm flags


def add_algo_args(p, hidden: Sequence[int] | None = None) -> None:
    """The experiments' shared algorithm flags (read by :func:`algo_config`): seed, PPO and SAC shape.

    ``hidden``: also a ``--hidden`` flag (MLP widths of every network) with this default.
    """
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppo-unroll", type=int, default=10)
    p.add_argument("--ppo-minibatches", type=int, default=16)
    p.add_argument("--ppo-epochs", type=int, default=4)
    p.add_argument("--sac-batch", type=int, default=256)
    p.add_argument("--sac-grad-updates", type=int, default=4)
    p.add_argument("--sac-replay", type=int, default=1 << 20)
    if hidden is not None:
        p.add_argument("--hidden", type=int, nargs="+", default=list(hidden))


def shrink_algo_args(args, ppo_epochs: int = 1) -> None:
    """Tiny algorithm shapes for a CPU smoke run: PPO unroll 4 x 2 minibatches, SAC batch 16."""
    args.ppo_unroll, args.ppo_minibatches, args.ppo_epochs = 4, 2, ppo_epochs
    args.sac_batch, args.sac_grad_updates, args.sac_replay = 16, 2, 1024


def algo_config(algo: str, num_envs: int, args, hidden: Sequence[int] | None = None, **overrides):
    """PPOConfig / SACConfig from the shared flags (--ppo-unroll, --sac-batch, ..., --seed).

    ``hidden``: MLP widths of every network (PPO policy and value, SAC policy and Q), None: the
    config's defaults. ``overrides`` are extra config fields; an unknown ``algo`` is a ValueError.
    """
    if algo == "ppo":
        from algos import ppo

        if hidden is not None:
            overrides = dict(policy_hidden_sizes=tuple(hidden), value_hidden_sizes=tuple(hidden), **overrides)
        return ppo.PPOConfig(num_envs=num_envs, unroll_length=args.ppo_unroll,
                             num_minibatches=args.ppo_minibatches, num_epochs=args.ppo_epochs,
                             seed=args.seed, **overrides)
    if algo == "sac":
        from algos import sac

        if hidden is not None:
            overrides = dict(policy_hidden_sizes=tuple(hidden), q_hidden_sizes=tuple(hidden), **overrides)
        capacity = max(args.sac_replay, 4 * num_envs, 4 * args.sac_batch)
        return sac.SACConfig(num_envs=num_envs, batch_size=args.sac_batch,
                             grad_updates_per_step=args.sac_grad_updates, num_timesteps=10**9,
                             min_replay_size=max(num_envs, args.sac_batch), max_replay_size=capacity,
                             seed=args.seed, **overrides)
    raise ValueError(f"unknown algorithm {algo!r}; use ppo or sac")


def make_env(args):
    """``envs.make(args.env)`` with ``backend=args.backend`` unless that is '' or 'none' (pure-JAX envs)."""
    import envs

    return envs.make(args.env, **({} if args.backend in ("", "none") else {"backend": args.backend}))


def algo_setup(algo: str, num_envs: int, args, hidden: Sequence[int] | None = None, **overrides):
    """``(env, config, initial state)`` of ``algo`` on ``args.env``, state from ``PRNGKey(args.seed)``."""
    import jax

    import algos

    env = make_env(args)
    config = algo_config(algo, num_envs, args, hidden, **overrides)
    return env, config, algos.get(algo).init(config, env, jax.random.PRNGKey(args.seed))
