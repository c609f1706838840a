"""Shared host-side helpers for benchmark scripts: machine facts, atomic result files, tables, plots."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from typing import Any, Sequence

from rose_jax.io import atomic_write_bytes, atomic_write_json

BENCHMARKS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCHMARKS_DIR)
RESULTS_DIR = os.path.join(BENCHMARKS_DIR, "results")


def machine_info() -> dict[str, Any]:
    """Versions and device facts to store beside every result."""
    import jax

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "command": " ".join(["python", *sys.orig_argv[1:]]),
    }
    for pkg in ("jaxlib", "flax", "optax", "brax", "mujoco", "mujoco_mjx"):
        try:
            from importlib.metadata import version

            info[pkg] = version(pkg.replace("_", "-"))
        except Exception:  # noqa: BLE001 - a missing package is simply not listed
            pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0:
            info["gpu"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def atomic_write(path: str, text: str | bytes) -> None:
    """Write a whole result file or nothing (see :mod:`rose_jax.io`)."""
    atomic_write_bytes(path, text if isinstance(text, bytes) else text.encode())


def write_json(path: str, obj: Any) -> None:
    atomic_write_json(path, obj)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def config_table(columns: Sequence[tuple[str, str]], rows: Sequence[dict], cells) -> str:
    """Markdown table of a GPU script's per-config rows.

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


def save_plot(fig, path: str) -> None:
    """Save a matplotlib figure atomically as PNG."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    atomic_write(path, buf.getvalue())


def enable_compile_cache(path: str) -> None:
    """Turn on JAX's persistent compilation cache at ``path`` ('' leaves it off)."""
    if path:
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def add_algo_args(p) -> None:
    """The GPU scripts' shared algorithm flags (read by :func:`algo_config`): seed, PPO and SAC shape."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppo-unroll", type=int, default=10)
    p.add_argument("--ppo-minibatches", type=int, default=16)
    p.add_argument("--ppo-epochs", type=int, default=4)
    p.add_argument("--sac-batch", type=int, default=256)
    p.add_argument("--sac-grad-updates", type=int, default=4)
    p.add_argument("--sac-replay", type=int, default=1 << 20)


def algo_config(algo: str, num_envs: int, args, **overrides):
    """PPOConfig / SACConfig from the GPU scripts' shared flags (--ppo-unroll, --sac-batch, ..., --seed).

    ``overrides`` are extra config fields (e.g. hidden sizes); an unknown ``algo`` is a ValueError.
    """
    if algo == "ppo":
        from algos import ppo

        return ppo.PPOConfig(num_envs=num_envs, unroll_length=args.ppo_unroll,
                             num_minibatches=args.ppo_minibatches, num_epochs=args.ppo_epochs,
                             seed=args.seed, **overrides)
    if algo == "sac":
        from algos import sac

        capacity = max(args.sac_replay, 4 * num_envs, 4 * args.sac_batch)
        return sac.SACConfig(num_envs=num_envs, batch_size=args.sac_batch,
                             grad_updates_per_step=args.sac_grad_updates, num_timesteps=10**9,
                             min_replay_size=max(num_envs, args.sac_batch), max_replay_size=capacity,
                             seed=args.seed, **overrides)
    raise ValueError(f"unknown algorithm {algo!r}; use ppo or sac")
