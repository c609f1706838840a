"""Probe: is a small MLP's forward pass faster as one Pallas kernel than as XLA's chain of matrix
products, at SAC's sizes, where it is latency-bound?

    python -m benchmarks.experiments.fused_mlp            # GPU: batch 512, 16 -> 256 -> 256 -> 16
    python -m benchmarks.experiments.fused_mlp --smoke    # CPU: Pallas interpret mode, plumbing only

Why (issue 32): Brax's SAC hopper gradient step runs 12 of its 48 matrix products in series
(``rose_jax.trace.depth``), about 18 us each on an H100 with the elementwise work between them, and
no candidate of the search shortens that path: XLA fuses elementwise work into a matrix product,
never two matrix products. Each row of a batch goes through a layer stack independently, so the
whole stack can run as one kernel per block of rows, the hidden activations staying on chip
(``rose_jax.optimize.fuse_dense_chains``). This probe measures that kernel on its own: ``steps``
passes chained one after another in a ``lax.scan`` (each input the last output through tanh, as the
gradient steps are chained), so the time per step is the chain's latency, for

- ``xla``: ``relu(x @ W1 + b1)``, ``relu(. @ W2 + b2)``, ``. @ W3 + b3`` under XLA (its best
  option set where given: ``--options``);
- ``fused``: the same scan with ``fuse_dense_chains`` applied (the transform the search measures,
  its kernel configured by ``--block-rows``, ``--chunk``, ``--num-warps`` or ``--configs``): each
  pass as one ``pallas_call`` (Triton on the GPU) whose programs take a block of rows through all
  three layers, the second layer in column chunks each multiplied into the third at once, so no
  256 x 256 weight tile has to fit on chip;
- ``xla_dgrad`` / ``fused_dgrad``: the input gradient back through the same layers (the
  transposed products and ReLU masks of a backward pass), under XLA and as the transform's kernel.

Both compute the same function up to the order of floating-point sums (the third layer sums over
chunks); the results file gives the largest difference of one pass from a float64 reference.
Results: ``benchmarks/results/fused_mlp/`` (``results.json``, ``results.md``, ``results.png``).
"""

from __future__ import annotations

import argparse
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


def dgrad_xla(params: list[tuple[Any, Any]], pre, g):
    """The MLP's input gradient, back through it as the backward pass computes it (the twin
    critics' and the actor's input-gradient products are on SAC's critical path): ``g @ W3^T``,
    kept where layer 2's pre-activation is positive (ReLU's derivative, as JAX's backward pass
    writes it: ``select_n(z > 0, 0, t)``), ``@ W2^T``, the same with layer 1's, ``@ W1^T``."""
    import jax.numpy as jnp

    (w1, _), (w2, _), (w3, _) = params
    a1, a2 = pre
    t = jnp.where(a2 > 0, jnp.dot(g, w3.T), 0.0)
    t = jnp.where(a1 > 0, jnp.dot(t, w2.T), 0.0)
    return jnp.dot(t, w1.T)


def fused(run, block_rows: int, chunk: int, num_warps: int):
    """``run`` (a chained scan) with ``fuse_dense_chains`` applied: each pass's chain of products
    as the transform's kernel (the one the search measures), configured as given. Raises
    ``ValueError`` when the transform finds no chain in it."""
    import jax

    from rose_jax.optimize import fuse_dense_chains

    t = fuse_dense_chains(block_rows=block_rows, chunk=chunk, num_warps=num_warps)
    out = t.apply(run)

    def checked(params, x):
        if "pallas_call" not in str(jax.make_jaxpr(out)(params, x)):
            raise ValueError("fuse_dense_chains found no chain of products in the chained passes")
        return out(params, x)

    return checked


def pre_activations(params: list[tuple[Any, Any]], x):
    """The two hidden layers' pre-activations of a forward pass (what the backward pass's ReLU
    derivatives compare with 0)."""
    import jax.numpy as jnp

    (w1, b1), (w2, b2), _ = params
    a1 = jnp.dot(x, w1) + b1
    a2 = jnp.dot(jnp.maximum(a1, 0.0), w2) + b2
    return a1, a2


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

    interpret = jax.default_backend() != "gpu"  # the transform's kernel runs interpreted there
    sizes = [args.width_in, args.hidden, args.hidden, args.width_in]
    params = init_params(jax.random.PRNGKey(0), sizes)
    x = jax.random.normal(jax.random.PRNGKey(1), (args.rows, args.width_in))
    options = xla_options.SETS.get(args.options) if not interpret else None
    pre = pre_activations(params, x)
    # one pass each against float64 on the host (the order of sums differs: a tolerance, not bitwise)
    p64 = [(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in params]
    h = np.asarray(x, np.float64)
    for w, b in p64[:-1]:
        h = np.maximum(h @ w + b, 0.0)
    m1, m2 = (np.asarray(a, np.float64) > 0 for a in pre)
    g64 = np.asarray(x, np.float64)  # the gradient probe's input: any (rows, output) array
    # one chained pass: the function, then tanh (the chain's link)
    want = {"forward": np.tanh(h @ p64[-1][0] + p64[-1][1]),
            "input gradient": np.tanh(((g64 @ p64[2][0].T) * m2 @ p64[1][0].T) * m1 @ p64[0][0].T)}
    configs = args.configs or [(args.block_rows, args.num_warps)]
    # name: (what it computes, one pass fn(params, x), kernel configuration or None for XLA's)
    variants: dict[str, tuple[str, Any, tuple[int, int] | None]] = {}
    for what, ref, ref_fn in (
        ("forward", "xla", mlp_xla),
        ("input gradient", "xla_dgrad", lambda p, g: dgrad_xla(p, pre, g)),
    ):
        variants[ref] = (what, ref_fn, None)
        for config in configs:  # each kernel configuration: its own name where there are several
            tag = "" if len(configs) == 1 else f"[{config[0]}x{config[1]}]"
            variants[f"{ref.replace('xla', 'fused')}{tag}"] = (what, ref_fn, config)
    out: dict[str, Any] = {"sizes": sizes, "rows": args.rows, "steps": args.steps, "interpret": interpret,
                           "options": args.options if options else None, "variants": {}}
    for name, (what, fwd, config) in variants.items():

        def build(steps, fwd=fwd, config=config):
            run = chained(fwd, steps)
            return run if config is None else fused(run, config[0], args.chunk, config[1])

        try:  # a kernel configuration Triton cannot build is a row, not a crash
            got = np.asarray(jax.jit(build(1), compiler_options=options)(params, x), np.float64)
        except Exception as e:  # noqa: BLE001 - reported in its row
            if config is None:
                raise
            out["variants"][name] = {"computes": what, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            common.log(f"{name}: failed to build: {type(e).__name__}: {str(e)[:200]}")
            continue
        run = jax.jit(build(args.steps), compiler_options=options)
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
    best = {what: min((us[n] for n, (w, _, _) in variants.items() if w == what and n in us and
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
    from rose_jax.optimize import dense_chains as dc

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512, help="batch rows (SAC's published batch: 512)")
    p.add_argument("--width-in", type=int, default=16, help="input and output width (a power of two)")
    p.add_argument("--hidden", type=int, default=256, help="hidden width (SAC's published: 256)")
    p.add_argument("--steps", type=int, default=64, help="forward passes chained per timed call")
    p.add_argument("--blocks", type=int, default=5, help="timed calls")
    # by default the transform's own configuration: what the search would run
    p.add_argument("--block-rows", type=int, default=dc.BLOCK_ROWS)
    p.add_argument("--chunk", type=int, default=dc.CHUNK)
    p.add_argument("--num-warps", type=int, default=dc.NUM_WARPS)
    p.add_argument("--configs", type=_configs, default=None,
                   help="several kernel configurations in one run, ROWSxWARPS comma-separated "
                   "(e.g. 16x4,32x4,32x8,64x8); overrides --block-rows/--num-warps")
    p.add_argument("--options", default="concurrent_scheduling", help="an XLA option set for both (GPU)")
    p.add_argument("--smoke", action="store_true", help="small sizes, Pallas interpret mode (CPU)")
    p.add_argument("--out", default=os.path.join(common.RESULTS_DIR, "fused_mlp"))
    args = p.parse_args(argv)
    if args.smoke:
        # wide enough for the transform (more than 64), not a power of two (padded)
        args.rows, args.hidden, args.steps, args.blocks, args.block_rows, args.chunk = 64, 96, 4, 2, 16, 16
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
