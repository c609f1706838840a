"""jaxpr -> LoopTree: the structure, dataflow and cost of one traced iteration, without running it.

    tree = rose_jax.trace.trace(iteration, train_state)
    print(rose_jax.trace.format_tree(tree))
    sim, opt = tree.find("rollout/sim"), tree.find("update/optimizer")
    rose_jax.trace.independent(sim, opt, tree)
"""

from rose_jax.trace.build import HANDLERS, plain_cost, trace, while_trip_count
from rose_jax.trace.deps import dependency, independent
from rose_jax.trace.render import format_tree, plot_tree, save_json, to_json
from rose_jax.trace.tree import KINDS, Cost, Level, LoopTree, Node, find, find_all

__all__ = [
    "HANDLERS",
    "KINDS",
    "Cost",
    "Level",
    "LoopTree",
    "Node",
    "dependency",
    "find",
    "find_all",
    "format_tree",
    "independent",
    "plain_cost",
    "plot_tree",
    "save_json",
    "to_json",
    "trace",
    "while_trip_count",
]
