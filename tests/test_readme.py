"""The README's ```python blocks run as written, as a user's script (no ``__main__`` guard).

The blocks of one ``## section`` run in order in one fresh interpreter (a later block may use the
names of an earlier one, as a reader pasting them into one file would), in a temporary working
directory. Only sizes change, by the text substitutions in :data:`CPU_SIZES` (each one must
still match the README, so an edit there cannot silently disable it); a block that truly needs a
GPU would be listed in :data:`GPU_ONLY` and skipped on a CPU with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# README text -> the same call at CPU-test size (a 2-core CPU; the README's sizes are for a GPU or
# for a minute of training).
CPU_SIZES = {
    "ppo.train(env, num_timesteps=400_000, num_envs=64, progress_fn=print)":
        "ppo.train(env, num_timesteps=4_096, num_envs=64, progress_fn=print)",
    "ppo.train(env, config, num_timesteps=400_000)": "ppo.train(env, config, num_timesteps=4_096)",
    "ppo.epoch(config, env, iterations=50, num_eval_envs=128)":
        "ppo.epoch(config, env, iterations=2, num_eval_envs=8)",
    # one candidate (the evaluation offloaded into a worker process), timed once
    "optimize.optimize(epoch, state)":
        'optimize.optimize(epoch, state, candidates=[optimize.offload_component("evaluate")], n_iters=1, '
        "repeats=1, check_slower=False)",
    "ppo.PPOConfig(num_timesteps=20_000, num_envs=16, unroll_length=16)":
        "ppo.PPOConfig(num_timesteps=1_024, num_envs=16, unroll_length=16)",
}
GPU_ONLY: dict[str, str] = {}  # a snippet of a block -> why it needs a GPU


def sections() -> dict[str, list[str]]:
    """``{section title: [python block, ...]}`` in README order (sections with python blocks)."""
    out: dict[str, list[str]] = {}
    title = "(top)"
    for part in re.split(r"(^## .*$)", README.read_text(), flags=re.M):
        if part.startswith("## "):
            title = part[3:].strip()
            continue
        blocks = re.findall(r"^```python\n(.*?)^```", part, flags=re.S | re.M)
        if blocks:
            out.setdefault(title, []).extend(blocks)
    return out


def test_every_size_substitution_still_matches_the_readme():
    text = "\n".join(b for blocks in sections().values() for b in blocks)
    stale = [k for k in CPU_SIZES if k not in text]
    assert not stale, f"README no longer has {stale}: update CPU_SIZES in {__file__}"


@pytest.mark.parametrize("title", list(sections()))
def test_readme_section_runs_as_written(title, tmp_path):
    blocks = sections()[title]
    source = "\n".join(blocks)
    if jax.default_backend() != "gpu":
        for snippet, reason in GPU_ONLY.items():
            if snippet in source:
                pytest.skip(f"needs a GPU: {reason}")
    for before, after in CPU_SIZES.items():
        source = source.replace(before, after)
    script = tmp_path / "readme_example.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"README section {title!r} failed:\n{proc.stderr[-4000:]}"
