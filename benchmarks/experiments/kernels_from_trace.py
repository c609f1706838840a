"""Kernel busy time per component from an existing ``*.xplane.pb`` trace (no GPU needed).

    python -m benchmarks.experiments.kernels_from_trace <xplane.pb> --out <config>.kernels.md \
        [--name <config>] [--trace-label <path written in the report>] [--min-gap-us 2]

The report has the format :mod:`benchmarks.experiments.activity_profile` writes (busy table,
longest gaps); the kernels are mapped to components through the HLO protos stored in the trace
(:func:`rose_jax.profile.xplane.trace_from_file`). ``--name`` defaults to the trace's config
directory (``traces/<config>/plugins/profile/<run>/<host>.xplane.pb``).
"""

from __future__ import annotations

import argparse
import os
import sys

from rose_jax.io import atomic_write_text
from rose_jax.profile import xplane


def config_name(path: str) -> str:
    """``<config>`` of ``.../<config>/plugins/profile/<run>/<host>.xplane.pb`` (else the file stem)."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if len(parts) >= 5 and parts[-4:-2] == ["plugins", "profile"]:
        return parts[-5]
    return os.path.basename(path).split(".")[0]


def main(argv: list[str] | None = None) -> xplane.KernelTrace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="path of a *.xplane.pb")
    ap.add_argument("--out", required=True, help="markdown file to write")
    ap.add_argument("--name", default=None, help="config name in the title")
    ap.add_argument("--trace-label", default=None, help="trace path written in the report")
    ap.add_argument("--min-gap-us", type=float, default=2.0)
    args = ap.parse_args(argv)
    if not args.trace.endswith(".xplane.pb"):
        raise ValueError(f"trace must be a *.xplane.pb file, got {args.trace!r}")
    kt = xplane.trace_from_file(args.trace, min_gap_us=args.min_gap_us)
    name = args.name or config_name(args.trace)
    atomic_write_text(args.out, xplane.kernels_markdown(name, kt, args.trace_label))
    total = sum(kt.busy_ns.values()) or 1.0
    unknown = kt.busy_ns.get(xplane.UNKNOWN, 0.0)
    print(
        f"{name}: {len(kt.events)} events, span {kt.span_ns * 1e-6:.2f} ms, "
        f"unknown {100 * unknown / total:.1f} % of busy time -> {args.out}",
        file=sys.stderr,
    )
    return kt


if __name__ == "__main__":
    main()
