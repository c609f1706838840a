"""The immutable output of the tracer: a :class:`LoopTree` of :class:`Node` s.

A node is one piece of an iteration's structure: a loop (``scan``/``while``), a ``cond``, a
call (``jit``, ``closed_call``, ``remat``, ``shard_map``), a ``custom`` derivative call
(``custom_jvp``/``custom_vjp``), a ``component`` (consecutive equations under one
``rose_jax.component`` scope), an ``opaque`` primitive the tracer cannot see into (callbacks,
custom primitives, unknown higher-order primitives), or the ``root``.

Compared fields (equality, hashing) describe the structure; the references a profiler or
:mod:`rose_jax.trace.deps` needs to go back to the jaxpr (``level``, ``body``, ``eqn_indices``,
``in_vars``, ``out_vars``, ``index``) are excluded from comparison and repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

KINDS = ("root", "scan", "while", "cond", "call", "component", "custom", "opaque")
LOOP_KINDS = ("scan", "while")


class Cost(NamedTuple):
    """Work of one execution of a node, counted from its jaxpr equations (not from XLA).

    ``flops``: floating/integer arithmetic operations (dot_general = 2*M*N*K per batch element,
    elementwise = one per output element, reductions = one per input element, data movement = 0,
    transcendental functions count in ``transcendentals`` instead). ``bytes``: sum over
    equations of operand + result sizes (an upper bound: XLA fusion removes most of it).
    Loops count their body times their trip count (XLA's ``cost_analysis`` counts it once).
    """

    flops: float = 0.0
    bytes: float = 0.0
    transcendentals: float = 0.0

    def plus(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes,
                    self.transcendentals + other.transcendentals)

    def times(self, k: float) -> "Cost":
        return Cost(self.flops * k, self.bytes * k, self.transcendentals * k)

    def maximum(self, other: "Cost") -> "Cost":
        return Cost(max(self.flops, other.flops), max(self.bytes, other.bytes),
                    max(self.transcendentals, other.transcendentals))


ZERO_COST = Cost()


@dataclass(frozen=True, eq=False)
class Level:
    """One jaxpr level: the (open) jaxpr whose equations a set of sibling nodes live in.

    ``carry`` lists ``(invar, outvar)`` pairs of a loop body's carried slots (empty elsewhere):
    the value produced at ``outvar`` in one iteration is read at ``invar`` in the next.
    """

    jaxpr: Any
    kind: str  # "root" | "scan" | "while_body" | "while_cond" | "cond_branch" | "call" | ...
    carry: tuple = ()

    @property
    def eqns(self) -> list:
        return self.jaxpr.eqns


@dataclass(frozen=True)
class Node:
    """One node of a :class:`LoopTree`.

    Attributes:
      kind: one of :data:`KINDS`.
      name: component name, loop body function name, jit name, or primitive name.
      component_path: the ``rose:<name>`` components enclosing the node, outermost first (a
        component node's path ends with its own name).
      trip_count: loops: iterations per execution (``None`` when not static); other nodes: 1.
      reads: pytree paths of the traced function's arguments that the node's equations use
        (directly, or through call/loop operands that forward them; a loop's carry slot counts
        as the path of its initial value).
      writes: argument paths whose value the node overwrites: the function returns the node's
        result at that same path, or the node produces the next value of a loop carry slot that
        was initialised from that path.
      out_writes: output paths (``out`` naming, see :func:`rose_jax.trace.trace`) that the
        node's results become.
      cost: one execution, children times their trip counts included.
      children: sub-nodes in program order.
      primitive: the equation's primitive name (``None`` for component and root nodes).
      part: which sub-jaxpr of the parent the node lives in: ``None`` for the only body,
        ``"cond"`` for a while's condition, ``"branch<i>"`` for cond branch i (0 = false).
      bound: while loops: a static upper bound on the iterations read from the jaxpr (a counter
        tested in the condition, :mod:`rose_jax.jaxpr.bounds`), else ``None``; equals
        ``trip_count`` when the condition is that test alone.
    """

    kind: str
    name: str
    component_path: tuple[str, ...] = ()
    trip_count: int | None = 1
    reads: frozenset = frozenset()
    writes: frozenset = frozenset()
    out_writes: frozenset = frozenset()
    cost: Cost = ZERO_COST
    children: tuple["Node", ...] = ()
    primitive: str | None = None
    part: str | None = None
    bound: int | None = None
    # --- references back into the jaxpr (not compared) ---
    index: tuple[int, ...] = field(default=(), compare=False)
    level: Level | None = field(default=None, compare=False, repr=False)
    eqn_indices: tuple[int, ...] = field(default=(), compare=False, repr=False)
    in_vars: frozenset = field(default=frozenset(), compare=False, repr=False)
    out_vars: frozenset = field(default=frozenset(), compare=False, repr=False)
    bodies: tuple[Level, ...] = field(default=(), compare=False, repr=False)

    @property
    def is_loop(self) -> bool:
        return self.kind in LOOP_KINDS

    def walk(self) -> Iterator["Node"]:
        """This node and all its descendants, pre-order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def eqns(self) -> list:
        """The node's own equations at its level (e.g. to build a runnable sub-program)."""
        if self.level is None:
            return []
        eqns = self.level.eqns
        return [eqns[i] for i in self.eqn_indices]

    def label(self) -> str:
        trips = ""
        if self.is_loop:
            trips = f" x{self.trip_count}" if self.trip_count is not None else " x?"
            if self.trip_count is None and self.bound is not None:
                trips = f" x<={self.bound}"
        return f"{self.kind} {self.name}{trips}"

    def loop_note(self) -> str:
        """For a while loop whose trip count is not static: ``'data-dependent, bound 4: host round
        trip per iteration on GPU'`` (XLA copies the predicate to the host every iteration of such
        a loop); empty otherwise."""
        if self.kind != "while" or self.trip_count is not None:
            return ""
        bound = f"bound {self.bound}" if self.bound is not None else "no static bound"
        return f"data-dependent, {bound}: host round trip per iteration on GPU"


def _matches(node: Node, key: str) -> bool:
    return key in (node.name, node.kind, f"{node.kind}:{node.name}")


@dataclass(frozen=True)
class LoopTree:
    """The structure of one traced function.

    ``input_paths``/``output_paths`` list the flattened argument / result leaves' path strings in
    jaxpr order; ``jaxpr`` is the traced closed jaxpr (not compared).
    """

    root: Node
    input_paths: tuple[str, ...] = ()
    output_paths: tuple[str, ...] = ()
    jaxpr: Any = field(default=None, compare=False, repr=False)

    def walk(self) -> Iterator[Node]:
        return self.root.walk()

    def nodes(self, kind: str | None = None) -> list[Node]:
        return [n for n in self.walk() if kind is None or n.kind == kind]

    def node_at(self, index: Sequence[int]) -> Node:
        node = self.root
        for i in index:
            node = node.children[i]
        return node

    def ancestors(self, node: Node) -> list[Node]:
        """The nodes from the root down to ``node``'s parent."""
        out, cur = [], self.root
        for i in node.index:
            out.append(cur)
            cur = cur.children[i]
        return out

    def parent(self, node: Node) -> Node | None:
        return self.ancestors(node)[-1] if node.index else None

    def find_all(self, path: str | Sequence[str]) -> list[Node]:
        """All nodes reached by ``path`` (see :meth:`find`)."""
        keys = [k for k in (path.split("/") if isinstance(path, str) else list(path)) if k]
        if not keys:
            return [self.root]
        frontier = [self.root]
        for key in keys:
            found, seen = [], set()
            for start in frontier:
                for node in start.walk():
                    if node is not start and _matches(node, key) and id(node) not in seen:
                        seen.add(id(node))
                        found.append(node)
            frontier = found
        return frontier

    def find(self, path: str | Sequence[str]) -> Node:
        """The first node (pre-order) reached by ``path``.

        ``path`` is ``"a/b/c"`` or ``("a", "b", "c")``; each element matches a node's name, kind
        or ``"kind:name"`` anywhere below the previous match (intermediate nodes may be skipped),
        e.g. ``find(tree, "update/scan/scan/loss")``.
        """
        found = self.find_all(path)
        if not found:
            names = sorted({n.name for n in self.walk()})
            raise KeyError(f"no node at {path!r}; node names: {', '.join(names)}")
        return found[0]


def find(tree: LoopTree, path: str | Sequence[str]) -> Node:
    """``tree.find(path)``: the first node reached by a name/kind path such as ``"rollout/sim"``."""
    return tree.find(path)


def find_all(tree: LoopTree, path: str | Sequence[str]) -> list[Node]:
    return tree.find_all(path)
