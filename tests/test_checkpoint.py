"""algos.checkpoint: atomic orbax save / restore / latest_step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import struct

from algos import checkpoint, normalize


class Inner(NamedTuple):
    w: jax.Array
    b: jax.Array


@struct.dataclass
class State:
    params: Inner
    normalizer: normalize.NormalizerState
    key: jax.Array
    count: jax.Array
    nothing: object = None  # None leaves (like EnvState.first) must survive the round trip


def make_state(seed: int) -> State:
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    norm = normalize.update(normalize.init(3), jax.random.normal(k3, (5, 3)))
    return State(
        params=Inner(jax.random.normal(k1, (4, 3)), jax.random.normal(k2, (3,))),
        normalizer=norm,
        key=k3,
        count=jnp.int32(seed),
    )


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_round_trip_keeps_values_dtypes_and_structure(tmp_path):
    state = make_state(1)
    path = checkpoint.save(tmp_path, state, 7)
    assert path == tmp_path / "7"
    restored, step = checkpoint.restore(tmp_path, make_state(2))
    assert step == 7
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    chex.assert_trees_all_equal(restored, state)
    chex.assert_trees_all_equal_dtypes(restored, state)


def test_latest_step_and_restore_by_step(tmp_path):
    assert checkpoint.latest_step(tmp_path / "missing") is None
    assert checkpoint.latest_step(tmp_path) is None
    for step in (10, 2, 30):
        checkpoint.save(tmp_path, make_state(step), step)
    (tmp_path / ".tmp-99-deadbeef").mkdir()  # a crashed save's leftovers
    (tmp_path / "notes").mkdir()
    assert checkpoint.latest_step(tmp_path) == 30
    assert checkpoint.all_steps(tmp_path) == [2, 10, 30]
    restored, step = checkpoint.restore(tmp_path, make_state(0), step=10)
    assert step == 10
    chex.assert_trees_all_equal(restored, make_state(10))


def test_keep_prunes_old_checkpoints_and_same_step_replaces(tmp_path):
    for step in range(5):
        checkpoint.save(tmp_path, make_state(step), step, keep=2)
    assert checkpoint.all_steps(tmp_path) == [3, 4]
    checkpoint.save(tmp_path, make_state(42), 4)
    restored, _ = checkpoint.restore(tmp_path, make_state(0))
    chex.assert_trees_all_equal(restored, make_state(42))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_bad_arguments_give_one_line_value_errors(tmp_path):
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        checkpoint.save(tmp_path, make_state(0), -1)
    with pytest.raises(ValueError, match="no checkpoint in"):
        checkpoint.restore(tmp_path, make_state(0))
    checkpoint.save(tmp_path, make_state(0), 3)
    with pytest.raises(ValueError, match="no checkpoint for step 4") as e:
        checkpoint.restore(tmp_path, make_state(0), step=4)
    one_line(e)
    wrong = make_state(0).replace(params=Inner(jnp.zeros((5, 3)), jnp.zeros((3,))))
    with pytest.raises(ValueError) as e:
        checkpoint.restore(tmp_path, wrong)
    one_line(e)


def test_failure_mid_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    good = make_state(1)
    checkpoint.save(tmp_path, good, 1)
    real_write = checkpoint._write

    def write_then_fail(path, state):
        real_write(path, state)  # everything written, but the final rename never happens
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint, "_write", write_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(tmp_path, make_state(2), 2)
    assert checkpoint.latest_step(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # the partial folder was removed
    restored, step = checkpoint.restore(tmp_path, make_state(0))
    assert step == 1
    chex.assert_trees_all_equal(restored, good)


def test_process_killed_mid_save_leaves_previous_checkpoint_intact(tmp_path):
    """A hard crash (no cleanup runs) while the new checkpoint is half written."""
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint import make_state
        from algos import checkpoint
        checkpoint.save({str(tmp_path)!r}, make_state(1), 1)
        real_write = checkpoint._write
        def write_then_die(path, state):
            real_write(path, state)
            os._exit(17)  # like SIGKILL: no except/finally blocks run
        checkpoint._write = write_then_die
        checkpoint.save({str(tmp_path)!r}, make_state(2), 2)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-2000:]
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and "1" in names and any(n.startswith(".tmp-2-") for n in names), names
    assert checkpoint.latest_step(tmp_path) == 1
    restored, _ = checkpoint.restore(tmp_path, make_state(0))
    chex.assert_trees_all_equal(restored, make_state(1))
    checkpoint.save(tmp_path, make_state(2), 2)  # the next save of that step cleans the leftovers
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_retention_keeps_the_newest_and_the_best(tmp_path):
    scores = {1: 5.0, 2: 9.0, 3: float("nan"), 4: 1.0, 5: None, 6: 2.0}
    for step, score in scores.items():
        checkpoint.save(tmp_path, make_state(step), step, keep=2, score=score)
    assert checkpoint.all_steps(tmp_path) == [2, 5, 6]  # the 2 newest + the best (9.0 at step 2)
    assert checkpoint.best_step(tmp_path) == 2 and checkpoint.score(tmp_path, 5) is None
    restored, _ = checkpoint.restore(tmp_path, make_state(0), step=2)  # the score file does not disturb orbax
    chex.assert_trees_all_equal(restored, make_state(2))
    (tmp_path / ".tmp-7-dead").mkdir()
    (tmp_path / ".tmp-3-del-beef").mkdir()
    assert checkpoint.clean(tmp_path) == [".tmp-3-del-beef", ".tmp-7-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "5", "6"]
    assert checkpoint.prune(tmp_path, 1) == [5]
    with pytest.raises(ValueError, match="keep must be a positive int"):
        checkpoint.prune(tmp_path, 0)


def test_training_keeps_three_plus_the_best_by_default():
    """Retention is on by default (it was off: 977 checkpoints of one run); the CLI run-dir tests
    check it end to end (tests/test_rundir.py)."""
    import inspect

    from algos import driver, ppo, sac

    assert driver.DEFAULT_KEEP == 3
    for train in (ppo.train, ppo.train_with_config, sac.train, sac.train_with_config):
        assert inspect.signature(train).parameters["keep_checkpoints"].default == driver.DEFAULT_KEEP


def test_zero_size_arrays_round_trip(tmp_path):
    """MJX's Data holds zero-size arrays (``act`` of a model without actuator activations); orbax
    0.12.8 refuses to write them ("Cannot save arrays with zero size"), which failed every MJX run
    at its last checkpoint. They are saved as placeholders and come back with their shapes."""
    state = {
        "act": jnp.zeros((8, 0), jnp.float32),
        "qpos": jnp.arange(6.0).reshape(3, 2),
        "contact": {"dist": jnp.zeros((0,), jnp.float32), "geom": jnp.zeros((0, 2), jnp.int32)},
        "step": jnp.int32(5),
    }
    checkpoint.save(tmp_path, state, 3)
    restored, step = checkpoint.restore(tmp_path, state)
    assert step == 3
    assert jax.tree.map(lambda x: (x.shape, x.dtype), restored) == jax.tree.map(
        lambda x: (x.shape, x.dtype), state
    )
    chex.assert_trees_all_equal(restored, state)
    # into abstract shapes too (what --resume checks a checkpoint against), and without a `like`
    abstract = jax.eval_shape(lambda: state)
    chex.assert_trees_all_equal(checkpoint.restore(tmp_path, abstract)[0], state)
    tree, _ = checkpoint.read(tmp_path)
    assert tree["act"].shape == (8, 0) and tree["contact"]["geom"].dtype == jnp.int32
    chex.assert_trees_all_equal(jax.tree.map(jnp.asarray, tree), state)


def test_newest_restorable_skips_a_truncated_checkpoint(tmp_path):
    state = make_state(1)
    checkpoint.save(tmp_path, state, 1)
    checkpoint.save(tmp_path, make_state(2), 2)
    for f in (tmp_path / "2").rglob("*"):  # truncate every data file of the newest one
        if f.is_file() and f.stat().st_size > 64 and f.name != "rose_jax_meta.json":
            with open(f, "r+b") as fh:
                fh.truncate(16)
    lines = []
    step, skipped = checkpoint.newest_restorable(tmp_path, state, log=lines.append)
    assert step == 1 and [s for s, _ in skipped] == [2]
    assert len(lines) == 1 and "checkpoint 2 does not restore" in lines[0] and "\n" not in lines[0]
    assert checkpoint.all_steps(tmp_path) == [1]  # the bad one moved aside, kept for inspection
    assert any(p.name.startswith(".corrupt-2-") for p in tmp_path.iterdir())
    chex.assert_trees_all_equal(checkpoint.restore(tmp_path, state)[0], state)
