"""Where a transformation applies: ``where`` specs matched against loops, sites and tree nodes.

A spec is ``None`` (every loop), a path ``"a/b"`` (or ``("a", "b")``) of enclosing component
names followed by the loop body's function name (intermediate levels may be skipped), or a
callable that gets the :class:`rose_jax.optimize.interpret.Site` (or LoopTree node) and returns
a bool. Every fn-level transformation reads its targets through this module.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rose_jax.jaxpr import compat as C
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import Tolerance, Transform, short

Where = str | Sequence[str] | Callable[[Any], bool] | None


def _keys(where: str | Sequence[str]) -> tuple[str, ...]:
    keys = tuple(k for k in (where.split("/") if isinstance(where, str) else where) if k)
    if not keys:
        raise ValueError(f"where={where!r} names no component or loop")
    return keys


def _is_subsequence(keys: Sequence[str], seq: Sequence[str]) -> bool:
    it = iter(seq)
    return all(any(k == s for s in it) for k in keys)


def matcher(where: Where) -> Callable[[Sequence[str], str], bool]:
    """``match(component_path, loop_name)`` for a where spec.

    ``None``: every loop. ``"a/b"`` (or ``("a", "b")``): the loop's enclosing components followed
    by its body function name contain ``a`` then ``b`` (intermediate levels may be skipped), so
    ``"rollout"`` is every loop inside the rollout and ``"update/minibatch_step"`` the inner
    update loop. A callable gets the :class:`rose_jax.optimize.interpret.Site` (or LoopTree
    node) and returns a bool.
    """
    if where is None:
        return lambda path, name, obj=None: True
    if callable(where):
        return lambda path, name, obj=None: bool(where(obj))
    keys = _keys(where)
    return lambda path, name, obj=None: _is_subsequence(keys, tuple(path) + (name,))


def site_select(where: Where, primitive: str = C.SCAN) -> Callable[[I.Site], bool]:
    """``select(site)`` for :func:`rose_jax.optimize.interpret.rewrite`: the ``primitive`` sites
    (scans by default) matching ``where``."""
    match = matcher(where)
    return lambda site: site.primitive == primitive and match(site.component_path, site.name, site)


def scan_transform(
    name: str,
    params: tuple[tuple[str, Any], ...],
    tolerance: Tolerance,
    where: Where,
    legal: Callable[[Any], tuple[bool, str]],
    on_scan: I.ScanRule,
    summary: str,
) -> Transform:
    """The ``Transform`` of a jaxpr-level scan family (``level="fn"``): ``apply(fn)`` rewrites
    ``fn`` with ``on_scan`` at each scan matching ``where``
    (:func:`rose_jax.optimize.interpret.rewrite`)."""
    select = site_select(where)

    def apply(fn):
        return I.rewrite(fn, select, on_scan)

    return Transform(name, params, tolerance, "fn", legal, apply, summary=summary)


def tree_loops(tree: Any, where: Where, kind: str = "scan") -> list:
    """LoopTree nodes of ``kind`` matching ``where`` (same rules as :func:`matcher`)."""
    match = matcher(where)
    return [n for n in tree.walk() if n.kind == kind and match(n.component_path, n.name, n)]


def where_label(where: Where) -> str:
    """``where`` for summaries and reasons (``"every scan"`` for None)."""
    return "every scan" if where is None else f"where={short(where)}"


def find_one(tree: Any, spec: Where, kinds: Sequence[str]) -> Any:
    """The one LoopTree node of ``kinds`` matching ``spec`` (the outermost, if unambiguous).

    Raises ``ValueError`` when nothing or several nodes at the outermost depth match."""
    match = matcher(spec)
    found = [n for n in tree.walk() if n.kind in kinds and match(n.component_path, n.name, n)]
    if not found:
        raise ValueError(f"no node matches {spec!r}")
    if len(found) > 1:
        # prefer the outermost matches; still ambiguous if several remain at that depth
        depth = min(len(n.index) for n in found)
        found = [n for n in found if len(n.index) == depth]
        if len(found) > 1:
            raise ValueError(f"{spec!r} matches {len(found)} nodes; name one (e.g. 'component/loop_fn')")
    return found[0]
