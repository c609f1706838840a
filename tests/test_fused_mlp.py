"""benchmarks/experiments/fused_mlp.py: the probe times the transform's own kernel
(``fuse_dense_chains``) against XLA's chain; on the CPU the kernel runs in Pallas interpret mode
(the GPU timing is the probe's run, not a test)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks.experiments import fused_mlp as F


@pytest.mark.parametrize("seed, block_rows, chunk", [(0, 16, 16), (1, 32, 32)])
def test_the_fused_chain_is_the_chained_mlp_on_random_inputs(seed, block_rows, chunk):
    """Random weights and inputs: the chained passes with the transform applied equal the chained
    MLP up to the order of sums, for the forward pass and the input gradient alike."""
    params = F.init_params(jax.random.PRNGKey(seed), [16, 96, 96, 16])
    x = jax.random.normal(jax.random.PRNGKey(seed + 10), (64, 16))
    pre = F.pre_activations(params, x)
    for fwd in (F.mlp_xla, lambda p, g: F.dgrad_xla(p, pre, g)):
        run = F.chained(fwd, 3)
        got = F.fused(run, block_rows, chunk, 4)(params, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(run(params, x)), rtol=1e-5, atol=1e-5)


def test_the_xla_input_gradient_is_the_backward_pass():
    params = F.init_params(jax.random.PRNGKey(3), [16, 64, 64, 16])
    x = jax.random.normal(jax.random.PRNGKey(20), (64, 16))
    g = jax.random.normal(jax.random.PRNGKey(30), (64, 16))
    want = jax.vjp(lambda x: F.mlp_xla(params, x), x)[1](g)[0]
    got = F.dgrad_xla(params, F.pre_activations(params, x), g)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_no_chain_is_a_one_line_error():
    """Layers too narrow for the transform (wide means more than 64): it finds no chain and says so."""
    params = F.init_params(jax.random.PRNGKey(0), [16, 32, 32, 16])
    x = jax.numpy.ones((32, 16))
    with pytest.raises(ValueError, match="found no chain of products"):
        F.fused(F.chained(F.mlp_xla, 2), 16, 16, 4)(params, x)


def test_the_probe_writes_its_table_on_the_cpu(tmp_path):
    assert F.main(["--smoke", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| fused | forward |" in md and "| fused_dgrad | input gradient |" in md and "interpret mode" in md
    assert (tmp_path / "results.png").exists()


def test_several_kernel_configurations_in_one_run_and_a_failed_one_is_a_row(tmp_path):
    """--configs ROWSxWARPS,...: each configuration its own row; one the transform refuses (8 rows
    per block: Triton's dot needs 16) is reported in its row and the others are still measured."""
    import argparse

    assert F._configs("16x4,32x8") == [(16, 4), (32, 8)]
    for bad in ("16", "16x", "x4", "16x0", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="ROWSxWARPS"):
            F._configs(bad)
    assert F.main(["--smoke", "--configs", "16x4,8x4", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| fused[16x4] | forward |" in md and "| fused_dgrad[16x4] | input gradient |" in md
    assert "| fused[8x4] | forward | failed: ValueError: fuse_dense_chains: block_rows and chunk" in md
    assert "best kernel configuration vs xla: forward" in md
