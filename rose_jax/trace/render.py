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


def _line(head: str, node: Node, cost: Cost, reads, writes, show_paths: int) -> str:
    """``head`` with ``node``'s loop note, branch part and components, then cost and paths."""
    if node.loop_note():
        head += f" ({node.loop_note()})"
    if node.part:
        head += f" <{node.part}>"
    if node.component_path and node.kind != "component":
        head += f" [{'/'.join(node.component_path)}]"
    line = f"{head}  ({format_cost(cost)})"
    if show_paths:
        line += f"  reads: {_paths(reads, show_paths)}  writes: {_paths(writes, show_paths)}"
    return line


def format_node(node: Node, show_paths: int = 3) -> str:
    """One line: kind, name, trips, part, components, cost, reads/writes summaries."""
    return _line(node.label(), node, node.cost, node.reads, node.writes, show_paths)


# Runs of at least this many sibling leaves of one kind and name (e.g. MJX's dozens of opaque
# scatter-adds in a physics step) are printed as one line.
COLLAPSE_RUN = 3


def _run_key(node: Node) -> tuple:
    """What must agree for two sibling leaves to share a line: label (kind, name, trips), loop
    note, branch part and component path. Loops are never merged (their trips and notes matter)."""
    return (node.label(), node.loop_note(), node.part, tuple(node.component_path))


def _runs(children) -> list[list[Node]]:
    """Consecutive sibling leaves (not loops) with the same :func:`_run_key`, grouped."""
    runs: list[list[Node]] = []
    for c in children:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and not c.children
            and not last.children
            and not c.is_loop
            and _run_key(last) == _run_key(c)
        ):
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


def _format_run(run: list[Node], show_paths: int) -> str:
    """One line for ``len(run)`` equal-named sibling leaves: summed cost, united reads/writes."""
    cost = Cost(*(sum(getattr(n.cost, f) for n in run) for f in Cost._fields))
    reads = frozenset().union(*(n.reads for n in run))
    writes = frozenset().union(*(n.writes for n in run))
    return _line(f"{len(run)} x {run[0].label()}", run[0], cost, reads, writes, show_paths)


def format_tree(
    tree: LoopTree | Node, max_depth: int | None = None, show_paths: int = 3, collapse: bool = True
) -> str:
    """The tree as indented lines (``max_depth`` = 0 shows only the root). ``collapse``: runs of
    :data:`COLLAPSE_RUN` or more equal-named sibling leaves are one line (``33 x opaque
    scatter-add``); ``collapse=False``: one line per node."""
    root = tree.root if isinstance(tree, LoopTree) else tree
    lines: list[str] = []

    def visit(node: Node, depth: int) -> None:
        lines.append("  " * depth + format_node(node, show_paths))
        if max_depth is not None and depth >= max_depth:
            if node.children:
                lines.append("  " * (depth + 1) + f"... {sum(1 for _ in node.walk()) - 1} nodes")
            return
        for run in _runs(node.children) if collapse else [[c] for c in node.children]:
            if len(run) >= COLLAPSE_RUN:
                lines.append("  " * (depth + 1) + _format_run(run, show_paths))
            else:
                for child in run:
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
        "bound": node.bound,
        "note": node.loop_note(),
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


SMALL_SHARE = 0.015  # children under this share of their parent's cost are drawn as one box
MAX_FIG_WIDTH_IN = 20.0  # inches; at the saved dpi (110) at most 2,200 px wide


def _node_label(node: Node) -> tuple[str, str]:
    """``(long, short)`` box labels: kind, name and trips (+ FLOPs), or the name alone."""
    trips = ""
    if node.is_loop:
        trips = f" x{node.trip_count}" if node.trip_count is not None else " x?"
        if node.trip_count is None and node.bound is not None:
            trips = f" x<={node.bound}"
    note = "\nhost sync/iter" if node.loop_note() else ""
    return f"{node.kind}\n{node.name}{trips}{note}\n{human(node.cost.flops)}FLOP", f"{node.name}{trips}"


def _layout(root: Node, max_depth: int | None) -> list[tuple[Any, int, float, float]]:
    """Boxes ``(item, depth, x0, width)`` on [0, 1]; ``item`` is a Node, ``("small", n, flops)``
    for merged small children, or ``("ops", flops)`` for a node's own operations.

    A child's width is its share of one execution of its parent's body (the parent's cost over
    its trip count), in FLOPs (bytes where there are no FLOPs; equal shares where neither); the
    rest of the parent is its own operations (outside any loop or component). Children under
    :data:`SMALL_SHARE` are merged into one box, so hundreds of near-free ops cannot crowd out
    the work; every box is drawn at least 1 % wide.
    """
    boxes: list[tuple[Any, int, float, float]] = []

    def cost(node: Node, attr: str) -> float:
        return float(getattr(node.cost, attr))

    def place(node: Node, depth: int, x0: float, width: float) -> None:
        boxes.append((node, depth, x0, width))
        children = node.children
        if not children or (max_depth is not None and depth >= max_depth):
            return
        trips = node.trip_count if node.is_loop and node.trip_count else (node.bound or 1)
        attr = next((a for a in ("flops", "bytes") if sum(cost(c, a) for c in children) > 0), None)
        if attr is None:
            shares = [1.0 / len(children)] * len(children)
        else:
            body = max(cost(node, attr) / max(trips, 1), sum(cost(c, attr) for c in children))
            shares = [cost(c, attr) / body for c in children]
        parts: list[tuple[Any, float]] = [(c, sh) for c, sh in zip(children, shares, strict=True)
                                          if sh >= SMALL_SHARE]
        small = [(c, sh) for c, sh in zip(children, shares, strict=True) if sh < SMALL_SHARE]
        if len(small) == 1:
            parts.append(small[0])
        elif small:
            merged = ("small", len(small), sum(c.cost.flops for c, _ in small))
            parts.append((merged, sum(sh for _, sh in small)))
        shown = [max(sh, 0.01) for _, sh in parts]
        scale = 1.0 / sum(shown) if sum(shown) > 1.0 else 1.0
        x = x0
        for (item, _), sh in zip(parts, shown, strict=True):
            cw = width * sh * scale
            if isinstance(item, Node):
                place(item, depth + 1, x, cw)
            else:
                boxes.append((item, depth + 1, x, cw))
            x += cw
        rest = x0 + width - x
        if rest > 0.05 * width and attr == "flops":
            own = max(node.cost.flops / max(trips, 1) - sum(c.cost.flops for c in children), 0.0)
            boxes.append((("ops", own), depth + 1, x, rest))

    place(root, 0, 0.0, 1.0)
    return boxes


def plot_tree(tree: LoopTree, path: str | os.PathLike, max_depth: int | None = None,
              title: str | None = None) -> str:
    """An icicle diagram (PNG): one row per depth; a box's width is its share of its parent's
    cost (FLOPs, see :func:`_layout`), its colour log10 FLOPs (colour bar); labels where the box
    is wide enough. Children under 1.5 % of their parent's cost are merged into one "+N small"
    box; the picture is at most 20 inches (2,200 px) wide."""
    import matplotlib

    matplotlib.use("Agg")
    import math

    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize

    boxes = _layout(tree.root, max_depth)
    depth_max = max(d for _, d, _, _ in boxes)
    per_depth = [sum(1 for _, d, _, _ in boxes if d == k) for k in range(depth_max + 1)]
    fig_w = min(max(8.0, 4.0 + 0.45 * max(per_depth)), MAX_FIG_WIDTH_IN)
    fig, ax = plt.subplots(figsize=(fig_w, 1.6 + 0.9 * (depth_max + 1)))

    def flops_of(item) -> float:
        return max(item[-1] if isinstance(item, tuple) else item.cost.flops, 1.0)

    logs = [math.log10(flops_of(item)) for item, _, _, _ in boxes]
    norm = Normalize(vmin=min(logs), vmax=max(max(logs), min(logs) + 1e-9))
    cmap = plt.get_cmap("viridis")
    for (item, depth, x0, w), lf in zip(boxes, logs, strict=True):
        ops = isinstance(item, tuple) and item[0] == "ops"
        face = "0.85" if ops else cmap(norm(lf))
        ax.add_patch(plt.Rectangle((x0, -depth - 1), w, 0.95, facecolor=face, edgecolor="white",
                                   hatch="//" if isinstance(item, tuple) and not ops else None))
        if ops:
            long, short = f"own ops\n{human(item[1])}FLOP", "ops"
        elif isinstance(item, tuple):
            long = short = f"+{item[1]} small\n{human(item[2])}FLOP"
        else:
            long, short = _node_label(item)
        inches = w * fig_w * 0.9
        text = long if inches >= 0.9 else (short if inches >= 0.45 else "")
        if text:
            ax.text(x0 + w / 2, -depth - 0.52, text, ha="center", va="center", fontsize=7,
                    color="0.3" if ops else "white", clip_on=True)
    ax.set_xlim(0, 1)
    ax.set_ylim(-depth_max - 1.05, 0.05)
    ax.axis("off")
    ax.set_title(title or f"LoopTree of {tree.root.name}")
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, orientation="horizontal",
                       fraction=0.05, pad=0.02, aspect=60)
    bar.set_label("colour: log10 FLOPs per execution (children x trips included)\n"
                  "width: share of one execution of the parent's body; grey: the parent's own ops; "
                  "hatched: children under 1.5 % merged", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
