"""Two MPS workers at 30 % and 70 % of the SMs run a bf16 matmul loop concurrently: TFLOP/s each.

Both start together (the pool barrier); the ratio of their rates should follow the quotas (7/3).
Part of ``python -m benchmarks.experiments.mps`` (phase ``rates``).
"""

from __future__ import annotations

from benchmarks.experiments.mps.harness import P, Sizes, Timing, log, specs, timed_pool, worker_info


def phase_rates(daemon, sizes: Sizes, tm: Timing) -> dict:
    """The two workers' TFLOP/s, their ratio and how long they ran concurrently."""
    st = dict(n=sizes.rate_n, iters=sizes.rate_iters, seconds=sizes.rate_seconds, dtype=sizes.dtype)
    log(
        f"rates: 2 workers at 30% / 70% SMs, {sizes.dtype} [{sizes.rate_n}]^2 matmul loop, "
        f"{sizes.rate_seconds:.0f} s each, started together by the pool barrier"
    )
    with timed_pool(tm, "rates", specs(sizes, [("q30", 30), ("q70", 70)], 0.3), daemon) as pool:
        outs = pool.call_all(P + "matmul_rate", static=st, jit=False, timeout=300)
        info = {n: worker_info(i) for n, i in pool.info.items()}
    r30, r70 = outs["q30"]["tflops"], outs["q70"]["tflops"]
    overlap = min(o["end"] for o in outs.values()) - max(o["start"] for o in outs.values())
    res = {
        "tflops": {"q30": r30, "q70": r70},
        "ratio_70_over_30": r70 / r30,
        "quota_ratio": 70 / 30,
        "overlap_s": overlap,
        "runs": outs,
        "workers": info,
    }
    log(
        f"rates: q30 {r30:.4g} TFLOP/s, q70 {r70:.4g} TFLOP/s, ratio {r70 / r30:.2f} (quota ratio 2.33), "
        f"concurrent for {overlap:.1f} s"
    )
    return res


def markdown(r: dict) -> list[str]:
    """The phase's section of the results Markdown."""
    return [
        "## Two workers under MPS, concurrent matmul loops",
        "",
        "| worker | quota | TFLOP/s |",
        "|---|---|---|",
        f"| q30 | 30% | {r['tflops']['q30']:.4g} |",
        f"| q70 | 70% | {r['tflops']['q70']:.4g} |",
        "",
        f"ratio {r['ratio_70_over_30']:.2f} (quota ratio 2.33), concurrent for {r['overlap_s']:.1f} s",
        "",
    ]


def summary(r: dict) -> list[tuple[str, str]]:
    """(what, value) lines of the printed summary."""
    return [(
        "TFLOP/s at 30% / 70%",
        f"{r['tflops']['q30']:.4g} / {r['tflops']['q70']:.4g} (ratio {r['ratio_70_over_30']:.2f})",
    )]
