"""Probe: is a small MLP's forward pass faster as one Pallas kernel than as XLA's chain of matrix
products, at SAC's sizes, where it is latency-bound?

    python -m benchmarks.experiments.fused_mlp            # GPU: batch 512, 16 -> 256 -> 256 -> 16
    python -m benchmarks.experiments.fused_mlp --smoke    # CPU: Pallas interpret mode, plumbing only

Why (issue 32): Brax's SAC hopper gradient step runs 12 of its 48 matrix products in series
(``rose_jax.trace.depth``), about 18 us each on an H100 with the elementwise work between them, and
no candidate of the search shortens that path: XLA fuses elementwise work into a matrix product,
never two matrix products. Each row of a batch goes through a layer stack independently, so the
whole stack can run as one kernel per block of rows, the hidden activations staying on chip. This
probe measures that on its own before any transform is built: ``steps`` forward passes chained one
after another in a ``lax.scan`` (each input the last output, as the gradient steps are chained), so
the time per step is the chain's latency, for

- ``xla``: ``relu(x @ W1 + b1)``, ``relu(. @ W2 + b2)``, ``. @ W3 + b3`` under XLA (its best
  option set where given: ``--options``);
- ``fused``: the same function as one ``pallas_call`` (Triton on the GPU): each program takes
  ``--block-rows`` rows through all three layers; the second layer is computed in column chunks of
  ``--chunk``, each chunk's ReLU output multiplied into the third layer at once, so no 256 x 256
  weight tile has to fit on chip;
- ``xla_dgrad`` / ``fused_dgrad``: the input gradient back through the same layers (the
  transposed products and ReLU masks of a backward pass), under XLA and as one kernel alike.

Both compute the same function up to the order of floating-point sums (the third layer sums over
chunks); the results file gives the largest difference from a float64 reference for each.
Results: ``benchmarks/results/fused_mlp/`` (``results.json``, ``results.md``, ``results.png``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any

from benchmarks import common


def mlp_xla(params: list[tuple[Any, Any]], x):
    """The reference: a ReLU MLP as JAX writes it (XLA compiles one matrix product per layer)."""
    import jax
    import jax.numpy as jnp

    for w, b in params[:-1]:
        x = jax.nn.relu(jnp.dot(x, w) + b)
    w, b = params[-1]
    return jnp.dot(x, w) + b


def mlp_fused(params: list[tuple[Any, Any]], x, *, block_rows: int = 32, chunk: int = 64,
              num_warps: int = 4, interpret: bool = False):
    """A 3-layer ReLU MLP (``x @ W1 -> W2 -> W3``, biases added) as one Pallas kernel over blocks
    of ``block_rows`` rows. Every dimension must be a power of two of at least 16 (Triton's dot),
    the rows a multiple of ``block_rows`` and the hidden width a multiple of ``chunk``: this is a
    probe of the kernel, the padding a real transform would add is left out."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    (w1, b1), (w2, b2), (w3, b3) = params
    rows, d_in = x.shape
    hidden, d_out = w2.shape[1], w3.shape[1]
    if w1.shape[1] != hidden:
        raise ValueError(f"mlp_fused: both hidden layers must be {hidden} wide, got {w1.shape[1]}")
    _check_sizes("mlp_fused", rows, d_in, hidden, d_out, block_rows, chunk)

    def kernel(x_ref, w1_ref, b1_ref, w2_ref, b2_ref, w3_ref, b3_ref, o_ref):
        h1 = jnp.maximum(jnp.dot(x_ref[...], w1_ref[...], preferred_element_type=jnp.float32)
                         + b1_ref[...], 0.0)
        acc = jnp.zeros((block_rows, d_out), jnp.float32)
        for c in range(hidden // chunk):  # static: one chunk of layer 2's columns at a time
            cols = pl.dslice(c * chunk, chunk)
            w2c = plgpu.load(w2_ref.at[:, cols])
            b2c = plgpu.load(b2_ref.at[:, cols])
            h2c = jnp.maximum(jnp.dot(h1, w2c, preferred_element_type=jnp.float32) + b2c, 0.0)
            w3c = plgpu.load(w3_ref.at[cols, :])
            acc = acc + jnp.dot(h2c, w3c, preferred_element_type=jnp.float32)
        o_ref[...] = (acc + b3_ref[...]).astype(o_ref.dtype)

    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0, 0))  # noqa: E731 - every program reads it
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, d_out), x.dtype),
        grid=(rows // block_rows,),
        in_specs=[pl.BlockSpec((block_rows, d_in), lambda i: (i, 0)),
                  whole((d_in, hidden)), whole((1, hidden)),
                  whole((hidden, hidden)), whole((1, hidden)),
                  whole((hidden, d_out)), whole((1, d_out))],
        out_specs=pl.BlockSpec((block_rows, d_out), lambda i: (i, 0)),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )
    return call(x, w1, b1[None, :], w2, b2[None, :], w3, b3[None, :])


def dgrad_xla(params: list[tuple[Any, Any]], masks, g):
    """The MLP's input gradient, back through it as the backward pass computes it (the twin
    critics' and the actor's input-gradient products are on SAC's critical path): ``g @ W3^T``,
    times layer 2's ReLU mask, ``@ W2^T``, times layer 1's mask, ``@ W1^T``."""
    import jax.numpy as jnp

    (w1, _), (w2, _), (w3, _) = params
    m1, m2 = masks
    t = jnp.dot(g, w3.T) * m2
    t = jnp.dot(t, w2.T) * m1
    return jnp.dot(t, w1.T)


def dgrad_fused(params: list[tuple[Any, Any]], masks, g, *, block_rows: int = 32, chunk: int = 64,
                num_warps: int = 4, interpret: bool = False):
    """:func:`dgrad_xla` as one Pallas kernel over blocks of rows (each row's gradient is its own):
    layer 2's transposed product in chunks of its output columns, each chunk masked and multiplied
    into layer 1's at once. The sizes as :func:`mlp_fused` takes them."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    (w1, _), (w2, _), (w3, _) = params
    m1, m2 = masks
    rows, d_out = g.shape
    d_in, hidden = w1.shape
    _check_sizes("dgrad_fused", rows, d_in, hidden, d_out, block_rows, chunk)

    def kernel(g_ref, w1_ref, w2_ref, w3_ref, m1_ref, m2_ref, o_ref):
        t2 = jnp.dot(g_ref[...], w3_ref[...].T, preferred_element_type=jnp.float32) * m2_ref[...]
        acc = jnp.zeros((block_rows, d_in), jnp.float32)
        for c in range(hidden // chunk):  # static: one chunk of layer 1's outputs at a time
            cols = pl.dslice(c * chunk, chunk)
            w2c = plgpu.load(w2_ref.at[cols, :])
            t1c = jnp.dot(t2, w2c.T, preferred_element_type=jnp.float32) * plgpu.load(m1_ref.at[:, cols])
            w1c = plgpu.load(w1_ref.at[:, cols])
            acc = acc + jnp.dot(t1c, w1c.T, preferred_element_type=jnp.float32)
        o_ref[...] = acc.astype(o_ref.dtype)

    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0, 0))  # noqa: E731 - every program reads it
    by_rows = lambda width: pl.BlockSpec((block_rows, width), lambda i: (i, 0))  # noqa: E731
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, d_in), g.dtype),
        grid=(rows // block_rows,),
        in_specs=[by_rows(d_out), whole((d_in, hidden)), whole((hidden, hidden)), whole((hidden, d_out)),
                  by_rows(hidden), by_rows(hidden)],
        out_specs=by_rows(d_in),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )
    return call(g, w1, w2, w3, m1, m2)


def _check_sizes(what: str, rows: int, d_in: int, hidden: int, d_out: int, block_rows: int, chunk: int):
    for name, d in (("input", d_in), ("hidden", hidden), ("output", d_out), ("block_rows", block_rows)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{what}: {name} size must be a power of two >= 16, got {d}")
    if rows % block_rows or hidden % chunk:
        raise ValueError(f"{what}: rows {rows} must divide by block_rows {block_rows}, hidden {hidden} "
                         f"by chunk {chunk}")


def _with_masks(fn, masks, params, g, **kw):
    """``fn(params, masks, g, **kw)``: an input-gradient function with one forward pass's masks
    fixed, in the probe's ``(params, x)`` shape."""
    return fn(params, masks, g, **kw)


def relu_masks(params: list[tuple[Any, Any]], x):
    """The two hidden layers' ReLU masks (1 where the pre-activation is positive) of a forward pass."""
    import jax.numpy as jnp

    (w1, b1), (w2, b2), _ = params
    a1 = jnp.dot(x, w1) + b1
    a2 = jnp.dot(jnp.maximum(a1, 0.0), w2) + b2
    return (a1 > 0).astype(x.dtype), (a2 > 0).astype(x.dtype)


def init_params(key, sizes: list[int]):
    import jax

    keys = jax.random.split(key, len(sizes) - 1)
    return [(jax.random.normal(k, (a, b)) / a ** 0.5, 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (b,)))
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def chained(forward, steps: int):
    """``steps`` forward passes one after another (each input the last output through tanh, the
    shape kept), as one jitted scan: its time per step is the chain's latency."""
    import jax
    import jax.numpy as jnp

    def run(params, x):
        return jax.lax.scan(lambda x, _: (jnp.tanh(forward(params, x)), None), x, None, length=steps)[0]

    return run


def measure(args) -> dict[str, Any]:
    import jax
    import numpy as np

    from rose_jax.optimize import xla_options

    interpret = args.smoke or jax.default_backend() != "gpu"
    sizes = [args.width_in, args.hidden, args.hidden, args.width_in]
    params = init_params(jax.random.PRNGKey(0), sizes)
    x = jax.random.normal(jax.random.PRNGKey(1), (args.rows, args.width_in))
    options = xla_options.SETS.get(args.options) if not interpret else None
    masks = relu_masks(params, x)
    # one pass each against float64 on the host (the order of sums differs: a tolerance, not bitwise)
    p64 = [(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in params]
    h = np.asarray(x, np.float64)
    for w, b in p64[:-1]:
        h = np.maximum(h @ w + b, 0.0)
    m1, m2 = (np.asarray(m, np.float64) for m in masks)
    g64 = np.asarray(x, np.float64)  # the gradient probe's input: any (rows, output) array
    want = {"forward": h @ p64[-1][0] + p64[-1][1],
            "input gradient": ((g64 @ p64[2][0].T) * m2 @ p64[1][0].T) * m1 @ p64[0][0].T}
    configs = args.configs or [(args.block_rows, args.num_warps)]
    variants: dict[str, tuple[str, Any]] = {}  # name: (what it computes, fn(params, x))
    for what, ref, ref_fn, kernel in (
        ("forward", "xla", mlp_xla, mlp_fused),
        ("input gradient", "xla_dgrad", functools.partial(_with_masks, dgrad_xla, masks),
         functools.partial(_with_masks, dgrad_fused, masks)),
    ):
        variants[ref] = (what, ref_fn)
        for rows_per, warps in configs:  # each kernel configuration: its own name where there are several
            tag = "" if len(configs) == 1 else f"[{rows_per}x{warps}]"
            kw = dict(block_rows=rows_per, chunk=args.chunk, num_warps=warps, interpret=interpret)
            variants[f"{ref.replace('xla', 'fused')}{tag}"] = (what, functools.partial(kernel, **kw))
    out: dict[str, Any] = {"sizes": sizes, "rows": args.rows, "steps": args.steps, "interpret": interpret,
                           "options": args.options if options else None, "variants": {}}
    for name, (what, fwd) in variants.items():
        try:  # a kernel configuration Triton cannot build is a row, not a crash
            got = np.asarray(jax.jit(fwd, compiler_options=options)(params, x), np.float64)
        except Exception as e:  # noqa: BLE001 - reported in its row
            if name.startswith("xla"):
                raise
            out["variants"][name] = {"computes": what, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            common.log(f"{name}: failed to build: {type(e).__name__}: {str(e)[:200]}")
            continue
        run = jax.jit(chained(fwd, args.steps), compiler_options=options)
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, x))
        compile_s = time.perf_counter() - t0
        per_step = []
        for _ in range(args.blocks):
            t0 = time.perf_counter()
            jax.block_until_ready(run(params, x))
            per_step.append((time.perf_counter() - t0) / args.steps * 1e6)
        out["variants"][name] = {
            "computes": what,
            "us_per_step": statistics.median(per_step), "spread_us": [min(per_step), max(per_step)],
            "compile_s": round(compile_s, 2), "max_abs_diff_vs_f64": float(np.max(np.abs(got - want[what]))),
        }
        common.log(f"{name}: {out['variants'][name]['us_per_step']:.1f} us per step "
                   f"(max |diff| vs float64 {out['variants'][name]['max_abs_diff_vs_f64']:.2e})")
    us = {n: v["us_per_step"] for n, v in out["variants"].items() if "us_per_step" in v}
    best = {what: min((us[n] for n, (w, _) in variants.items() if w == what and n in us and
                       not n.startswith("xla")), default=None) for what in ("forward", "input gradient")}
    ratio = {what: round(us[ref] / best[what], 3) if best[what] else None
             for what, ref in (("forward", "xla"), ("input gradient", "xla_dgrad"))}
    out["fused_speedup"], out["dgrad_speedup"] = ratio["forward"], ratio["input gradient"]
    return out


def write(out_dir: str, result: dict[str, Any], command: str) -> None:
    from rose_jax.io import atomic_write_json

    os.makedirs(out_dir, exist_ok=True)
    info = common.machine_info()
    atomic_write_json(os.path.join(out_dir, "results.json"), {"machine": info, "command": command, **result})
    rows = [[n, v["computes"], f"{v['us_per_step']:.1f} ({v['spread_us'][0]:.1f}-{v['spread_us'][1]:.1f})",
             f"{v['max_abs_diff_vs_f64']:.2e}", f"{v['compile_s']:.1f}"] if "error" not in v
            else [n, v["computes"], f"failed: {v['error']}", "-", "-"]
            for n, v in result["variants"].items()]
    ratio = lambda x: "-" if x is None else f"{x:.3f}x"  # noqa: E731
    lines = [
        "# Fused small-MLP probe (issue 32: SAC's latency-bound layer chain)",
        "",
        f"{info.get('date')} on {info.get('gpu') or info.get('platform')}; `{command}`. "
        f"Sizes {' -> '.join(map(str, result['sizes']))}, {result['rows']} rows, {result['steps']} forward "
        "passes chained in one scan; median over timed blocks (min-max)."
        + (" Pallas interpret mode (CPU): plumbing only, not a timing." if result["interpret"] else ""),
        "",
        common.markdown_table(["variant", "computes", "us per step", "max abs diff vs float64", "compile s"],
                              rows),
        "",
        f"best kernel configuration vs xla: forward {ratio(result['fused_speedup'])}, "
        f"input gradient {ratio(result['dgrad_speedup'])}. "
        "Generated by `benchmarks/experiments/fused_mlp.py`.",
    ]

    def plot(res, path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        names = [n for n, v in res["variants"].items() if "us_per_step" in v]
        ax.bar(names, [res["variants"][n]["us_per_step"] for n in names],
               color=["#888" if n.startswith("xla") else "#2a7" for n in names])
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_ylabel("us per chained forward pass")
        ax.set_title(f"{' -> '.join(map(str, res['sizes']))}, {res['rows']} rows")
        common.save_plot(fig, path)

    common.write_markdown_and_plot(out_dir, lines, plot, result)


def _configs(text: str) -> list[tuple[int, int]]:
    """``"16x4,32x8"`` -> ``[(16, 4), (32, 8)]`` (block rows x warps)."""
    try:
        pairs = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected ROWSxWARPS[,ROWSxWARPS...], got {text!r}")
    return pairs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512, help="batch rows (SAC's published batch: 512)")
    p.add_argument("--width-in", type=int, default=16, help="input and output width (a power of two)")
    p.add_argument("--hidden", type=int, default=256, help="hidden width (SAC's published: 256)")
    p.add_argument("--steps", type=int, default=64, help="forward passes chained per timed call")
    p.add_argument("--blocks", type=int, default=5, help="timed calls")
    p.add_argument("--block-rows", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--configs", type=_configs, default=None,
                   help="several kernel configurations in one run, ROWSxWARPS comma-separated "
                   "(e.g. 16x4,32x4,32x8,64x8); overrides --block-rows/--num-warps")
    p.add_argument("--options", default="concurrent_scheduling", help="an XLA option set for both (GPU)")
    p.add_argument("--smoke", action="store_true", help="small sizes, Pallas interpret mode (CPU)")
    p.add_argument("--out", default=os.path.join(common.RESULTS_DIR, "fused_mlp"))
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.hidden, args.steps, args.blocks, args.block_rows, args.chunk = 64, 32, 4, 2, 16, 16
        args.configs = [c for c in (args.configs or []) if 64 % c[0] == 0] or None
    try:
        result = measure(args)
    except ValueError as e:
        print(f"fused_mlp: {e}", file=sys.stderr)
        return 2
    write(args.out, result, "python -m benchmarks.experiments.fused_mlp " + " ".join(argv or sys.argv[1:]))
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
