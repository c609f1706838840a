"""benchmarks/experiments/fused_mlp.py: the one-kernel MLP computes the MLP (Pallas interpret mode
on the CPU; the GPU timing is the probe's run, not a test)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks.experiments import fused_mlp as F


@pytest.mark.parametrize("seed, block_rows, chunk", [(0, 16, 16), (1, 32, 32), (2, 16, 64)])
def test_the_fused_kernel_is_the_mlp_on_random_inputs(seed, block_rows, chunk):
    """Random weights and inputs: the fused kernel (blocks of rows, layer 2 in column chunks summed
    into layer 3) equals the layer-by-layer MLP up to the order of sums."""
    params = F.init_params(jax.random.PRNGKey(seed), [16, 64, 64, 16])
    x = jax.random.normal(jax.random.PRNGKey(seed + 10), (64, 16))
    got = F.mlp_fused(params, x, block_rows=block_rows, chunk=chunk, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(F.mlp_xla(params, x)), rtol=1e-5, atol=1e-5)
    # and it is not the identity of something simpler: a changed last layer changes the output
    (w1, b1), (w2, b2), (w3, b3) = params
    other = F.mlp_fused([(w1, b1), (w2, b2), (w3 * 2.0, b3)], x, block_rows=block_rows, chunk=chunk,
                        interpret=True)
    assert not np.allclose(np.asarray(other), np.asarray(got))


@pytest.mark.parametrize("seed, block_rows, chunk", [(0, 16, 16), (3, 32, 64)])
def test_the_fused_input_gradient_is_the_backward_pass_on_random_inputs(seed, block_rows, chunk):
    """The one-kernel input gradient equals jax.vjp of the MLP with respect to its input (masks of
    the same forward pass), up to the order of sums; and the XLA reference is that vjp too."""
    params = F.init_params(jax.random.PRNGKey(seed), [16, 64, 64, 16])
    x = jax.random.normal(jax.random.PRNGKey(seed + 20), (64, 16))
    g = jax.random.normal(jax.random.PRNGKey(seed + 30), (64, 16))
    want = jax.vjp(lambda x: F.mlp_xla(params, x), x)[1](g)[0]
    masks = F.relu_masks(params, x)
    ref = F.dgrad_xla(params, masks, g)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), rtol=1e-5, atol=1e-5)
    got = F.dgrad_fused(params, masks, g, block_rows=block_rows, chunk=chunk, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_sizes_the_kernel_cannot_take_are_refused_in_one_line():
    params = F.init_params(jax.random.PRNGKey(0), [12, 64, 64, 16])
    with pytest.raises(ValueError, match="input size must be a power of two >= 16, got 12"):
        F.mlp_fused(params, jax.numpy.ones((64, 12)), interpret=True)
    params = F.init_params(jax.random.PRNGKey(0), [16, 64, 64, 16])
    with pytest.raises(ValueError, match="rows 48 must divide by block_rows 32"):
        F.mlp_fused(params, jax.numpy.ones((48, 16)), block_rows=32, interpret=True)


def test_the_probe_writes_its_table_on_the_cpu(tmp_path):
    assert F.main(["--smoke", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| fused | forward |" in md and "| fused_dgrad | input gradient |" in md and "interpret mode" in md
    assert (tmp_path / "results.png").exists()


def test_several_kernel_configurations_in_one_run_and_a_failed_one_is_a_row(tmp_path):
    """--configs ROWSxWARPS,...: each configuration its own row; one the kernel cannot take (8 rows
    per block: Triton's dot needs 16) is reported in its row and the others are still measured."""
    import argparse

    assert F._configs("16x4,32x8") == [(16, 4), (32, 8)]
    for bad in ("16", "16x", "x4", "16x0", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="ROWSxWARPS"):
            F._configs(bad)
    assert F.main(["--smoke", "--configs", "16x4,8x4", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| fused[16x4] | forward |" in md and "| fused_dgrad[16x4] | input gradient |" in md
    assert "| fused[8x4] | forward | failed: ValueError: mlp_fused: block_rows size must be" in md
    assert "best kernel configuration vs xla: forward" in md
