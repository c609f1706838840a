"""rose_jax.startup: the persistent compilation cache fills a per-user directory, precision names,
and the jit/train clock. (That a second run is faster is reported by the CLI, not timed here.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rose_jax import startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compile_cache_writes_compiled_programs_to_its_directory(tmp_path):
    cache = tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        from rose_jax import startup
        startup.enable_compile_cache({str(cache)!r}, min_compile_time_s=0)
        import jax, jax.numpy as jnp
        jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=300)
    entries = os.listdir(cache)
    assert any(name.startswith("jit_") for name in entries), entries


def test_default_cache_dir_is_per_user_and_overridable(monkeypatch, tmp_path):
    monkeypatch.delenv(startup.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert startup.default_cache_dir() == os.path.join(str(tmp_path), "rose-jax", "jax")
    monkeypatch.setenv(startup.ENV_CACHE_DIR, str(tmp_path / "mine"))
    assert startup.default_cache_dir() == str(tmp_path / "mine")


def test_matmul_precision_names():
    import jax

    before = jax.config.jax_default_matmul_precision
    try:
        startup.set_matmul_precision("highest")
        assert jax.config.jax_default_matmul_precision == "highest"
        startup.set_matmul_precision("tf32")
        assert jax.config.jax_default_matmul_precision == "tensorfloat32"
    finally:
        jax.config.update("jax_default_matmul_precision", before)
    with pytest.raises(ValueError, match="tf32") as e:
        startup.set_matmul_precision("fast")
    assert "\n" not in str(e.value)


def test_phase_clock_splits_at_the_first_progress_report():
    clock = startup.PhaseClock()
    clock.start -= 2.0  # as if compiling took 2 s
    clock.progress()
    jit_s, train_s = clock.stop()
    assert jit_s >= 2.0 and 0.0 <= train_s < 1.0
    assert clock.line().startswith("time to jit: 2.")
