"""Show a LoopTree: indented text, JSON, and a matplotlib icicle diagram (PNG)."""

from __future__ import annotations

import json
import os
from typing import Any

from rose_jax.io import atomic_write_text
from rose_jax.trace.tree import Cost, LoopTree, Node


def human(x: float, unit: str = "", base: float = 1000.0) -> str:
    """``1234567 -> '1.23M'`` (``base=1024`` gives Ki/Mi/Gi)."""
    prefixes = ["", "k", "M", "G", "T", "P"] if base == 1000.0 else ["", "Ki", "Mi", "Gi", "Ti", "Pi"]
    x = float(x)
    i = 0
    while abs(x) >= base and i < len(prefixes) - 1:
        x /= base
        i += 1
    text = f"{x:.0f}" if i == 0 else (f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}")
    return f"{text}{prefixes[i]}{unit}"


def format_cost(cost: Cost) -> str:
    parts = [f"{human(cost.flops)}FLOP", human(cost.bytes, "B", 1024.0)]
    if cost.transcendentals:
        parts.append(f"{human(cost.transcendentals)} transc")
    return " ".join(parts)


def _paths(paths, n: int) -> str:
    paths = sorted(paths)
    if not paths:
        return "-"
    more = f" +{len(paths) - n} more" if len(paths) > n else ""
    return ", ".join(paths[:n]) + more


def format_node(node: Node, show_paths: int = 3) -> str:
    """One line: kind, name, trips, part, components, cost, reads/writes summaries."""
    head = node.label()
    if node.part:
        head += f" <{node.part}>"
    if node.component_path and node.kind != "component":
        head += f" [{'/'.join(node.component_path)}]"
    line = f"{head}  ({format_cost(node.cost)})"
    if show_paths:
        line += f"  reads: {_paths(node.reads, show_paths)}  writes: {_paths(node.writes, show_paths)}"
    return line


def format_tree(tree: LoopTree | Node, max_depth: int | None = None, show_paths: int = 3) -> str:
    """The tree as indented lines (``max_depth`` = 0 shows only the root)."""
    root = tree.root if isinstance(tree, LoopTree) else tree
    lines: list[str] = []

    def visit(node: Node, depth: int) -> None:
        lines.append("  " * depth + format_node(node, show_paths))
        if max_depth is not None and depth >= max_depth:
            if node.children:
                lines.append("  " * (depth + 1) + f"... {sum(1 for _ in node.walk()) - 1} nodes")
            return
        for child in node.children:
            visit(child, depth + 1)

    visit(root, 0)
    return "\n".join(lines)


def node_to_json(node: Node) -> dict[str, Any]:
    return {
        "kind": node.kind,
        "name": node.name,
        "primitive": node.primitive,
        "part": node.part,
        "component_path": list(node.component_path),
        "trip_count": node.trip_count,
        "index": list(node.index),
        "cost": node.cost._asdict(),
        "reads": sorted(node.reads),
        "writes": sorted(node.writes),
        "out_writes": sorted(node.out_writes),
        "children": [node_to_json(c) for c in node.children],
    }


def to_json(tree: LoopTree) -> dict[str, Any]:
    """A JSON-ready dict: ``{"input_paths", "output_paths", "root": {...nested nodes...}}``."""
    return {
        "input_paths": list(tree.input_paths),
        "output_paths": list(tree.output_paths),
        "root": node_to_json(tree.root),
    }


def save_json(tree: LoopTree, path: str | os.PathLike) -> str:
    """Write :func:`to_json` to ``path`` atomically (temporary file, then rename)."""
    path = os.fspath(path)
    atomic_write_text(path, json.dumps(to_json(tree), indent=1))
    return path


def plot_tree(tree: LoopTree, path: str | os.PathLike, max_depth: int | None = None,
              title: str | None = None) -> str:
    """An icicle diagram (PNG): one row per depth, each node a box as wide as its subtree's leaf
    count, labelled with kind, name, trip count and FLOPs; colour = log10 FLOPs."""
    import matplotlib

    matplotlib.use("Agg")
    import math

    import matplotlib.pyplot as plt

    root = tree.root
    boxes: list[tuple[Node, int, float, float]] = []

    def width(node: Node, depth: int) -> float:
        if not node.children or (max_depth is not None and depth >= max_depth):
            return 1.0
        return sum(width(c, depth + 1) for c in node.children)

    def place(node: Node, depth: int, x0: float) -> None:
        w = width(node, depth)
        boxes.append((node, depth, x0, w))
        if max_depth is not None and depth >= max_depth:
            return
        x = x0
        for c in node.children:
            place(c, depth + 1, x)
            x += width(c, depth + 1)

    place(root, 0, 0.0)
    total = width(root, 0)
    depth_max = max(d for _, d, _, _ in boxes)
    flops = [max(n.cost.flops, 1.0) for n, _, _, _ in boxes]
    lo, hi = math.log10(min(flops)), math.log10(max(flops))
    cmap = plt.get_cmap("viridis")
    fig_w = min(max(8.0, total * 1.2), 40.0)
    fig, ax = plt.subplots(figsize=(fig_w, 1.0 + 0.9 * (depth_max + 1)))
    for (node, depth, x0, w), f in zip(boxes, flops, strict=False):
        shade = 0.5 if hi == lo else (math.log10(f) - lo) / (hi - lo)
        ax.add_patch(plt.Rectangle((x0, -depth - 1), w, 0.95, facecolor=cmap(0.15 + 0.7 * shade),
                                   edgecolor="white"))
        trips = ""
        if node.is_loop:
            trips = f" x{node.trip_count}" if node.trip_count is not None else " x?"
        label = f"{node.kind}\n{node.name}{trips}\n{human(node.cost.flops)}FLOP"
        ax.text(x0 + w / 2, -depth - 0.52, label, ha="center", va="center", fontsize=7,
                color="white", clip_on=True)
    ax.set_xlim(0, total)
    ax.set_ylim(-depth_max - 1.05, 0.05)
    ax.axis("off")
    ax.set_title(title or f"LoopTree of {root.name}")
    fig.tight_layout()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
