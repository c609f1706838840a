"""Tests of algos.replay: ring-buffer exactness, uniform sampling of filled slots, jit, errors."""

from collections import deque

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from algos import replay


def _example():
    return {"obs": jnp.zeros((3,), jnp.float32), "id": jnp.zeros((), jnp.int32)}


def _batch(ids):
    ids = np.asarray(ids, np.int32)
    return {"obs": np.stack([ids * 10.0 + k for k in range(3)], axis=-1).astype(np.float32), "id": ids}


@pytest.mark.parametrize("batch_sizes", [(3, 3, 3, 3), (4, 1, 6, 2), (12,), (5, 5, 5)])
def test_insert_wraps_around_like_a_fifo(batch_sizes):
    capacity = 5
    buf = replay.uniform(capacity, _example())
    state = buf.init()
    model = deque(maxlen=capacity)  # the reference: the newest `capacity` ids, in insertion order
    slots = [None] * capacity  # and where each one lands: slot i gets the i-th insert mod capacity
    next_id, count = 0, 0
    for n in batch_sizes:
        ids = list(range(next_id, next_id + n))
        next_id += n
        state = buf.insert(state, _batch(ids))
        for i in ids:
            model.append(i)
            slots[count % capacity] = i
            count += 1
        assert int(state.size) == len(model)
        assert int(state.position) == count % capacity
        filled = np.asarray(state.data["id"])[: int(state.size)]
        assert sorted(filled.tolist()) == sorted(model)
        for slot, i in enumerate(slots):
            if i is not None:
                assert int(state.data["id"][slot]) == i
                np.testing.assert_array_equal(state.data["obs"][slot], [i * 10.0, i * 10.0 + 1, i * 10.0 + 2])


def test_sample_draws_only_filled_slots_and_all_of_them():
    buf = replay.uniform(100, _example())
    state = buf.insert(buf.init(), _batch(np.arange(1, 8)))
    batch = buf.sample(state, jax.random.PRNGKey(0), 2000)
    ids = np.asarray(batch["id"])
    assert batch["obs"].shape == (2000, 3) and ids.shape == (2000,)
    assert set(ids.tolist()) == set(range(1, 8))  # never an empty (zero) slot, every filled one
    counts = np.bincount(ids, minlength=8)[1:]
    assert counts.min() > 2000 / 7 * 0.7  # roughly uniform
    np.testing.assert_array_equal(np.asarray(batch["obs"])[:, 0], ids * 10.0)  # rows stay together


def test_jitted_equals_eager_and_traces_once():
    buf = replay.uniform(8, _example())

    @jax.jit
    @chex.assert_max_traces(n=1)
    def insert_and_sample(state, batch, key):
        state = buf.insert(state, batch)
        return state, buf.sample(state, key, 4)

    state_j = state_e = buf.init()
    for i in range(4):  # 4 x 3 = 12 > capacity: wraps
        batch, key = _batch(np.arange(3 * i, 3 * i + 3)), jax.random.PRNGKey(i)
        state_j, sample_j = insert_and_sample(state_j, batch, key)
        state_e = buf.insert(state_e, batch)
        chex.assert_trees_all_equal(state_j, state_e)
        chex.assert_trees_all_equal(sample_j, buf.sample(state_e, key, 4))


def test_dtypes_and_scalars_are_kept():
    buf = replay.uniform(4, {"x": jnp.zeros((2,), jnp.bfloat16), "done": 0.0, "n": jnp.zeros((), jnp.int32)})
    state = buf.insert(buf.init(), {"x": np.ones((3, 2), np.float32), "done": np.ones(3), "n": np.arange(3)})
    assert state.data["x"].dtype == jnp.bfloat16 and state.data["x"].shape == (4, 2)
    assert state.data["done"].dtype == jnp.float32 and state.data["done"].shape == (4,)
    assert state.data["n"].dtype == jnp.int32


@pytest.mark.parametrize(
    "batch, match",
    [
        ({"obs": np.zeros((2, 4), np.float32), "id": np.zeros(2, np.int32)}, r"leaf \['obs'\] has shape"),
        ({"obs": np.zeros((2, 3), np.float32), "id": np.zeros(3, np.int32)}, "same leading batch axis"),
        ({"obs": np.zeros((2, 3), np.float32)}, "structure"),
        ({"obs": np.zeros((3,), np.float32), "id": np.zeros((), np.int32)}, "leading batch axis"),
        ({"obs": np.zeros((2, 3), np.int32), "id": np.zeros(2, np.int32)}, "dtype"),
    ],
)
def test_mismatched_batch_is_a_clear_error(batch, match):
    buf = replay.uniform(4, _example())
    with pytest.raises(ValueError, match=match):
        buf.insert(buf.init(), batch)


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match="capacity"):
        replay.uniform(capacity, _example())


def test_bad_sample_size():
    buf = replay.uniform(4, _example())
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(buf.init(), jax.random.PRNGKey(0), 0)
