"""rose_jax.optimize as a set of transformation families: a new family is one module plus one
line of the registry. Checked on the source (with ``ast``, nothing imported but the registry):
every registered family module defines its transforms and ``candidates``, imports no other
family and not the search; the search and the quota step ask no transform by name (they branch on
what each Transform declares). And a family registered at run time is generated, searched and
rebuilt from its name like the built-in ones."""

from __future__ import annotations

import ast
import os
import sys
import types

import jax
import jax.numpy as jnp

from rose_jax.optimize import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a family may not import: another family, or the search and what only the search uses
SEARCH_SIDE = ("rose_jax.optimize.search", "rose_jax.optimize.candidates", "rose_jax.optimize.quotas")


def _path(module: str) -> str:
    return os.path.join(ROOT, *module.split(".")) + ".py"


def _parse(module: str) -> ast.Module:
    with open(_path(module), encoding="utf-8") as f:
        return ast.parse(f.read())


def _imported_modules(tree: ast.Module) -> set[str]:
    """Dotted modules an ``import`` / ``from ... import`` names, module-level or local
    (``from rose_jax.optimize import fuse`` counts as ``rose_jax.optimize.fuse``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _strings_outside_docstrings(tree: ast.Module) -> list[str]:
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def _top_level_defs(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_every_family_is_a_module_with_its_transforms_and_candidates():
    families = registry.families()
    assert len(families) >= 7 and "rose_jax.optimize.stream_overlap" in families
    for module, names in families.items():
        assert os.path.isfile(_path(module)), module
        defs = _top_level_defs(_parse(module))
        assert "candidates" in defs, f"{module} has no candidates(ctx)"
        missing = [n for n in names if n not in defs]
        assert not missing, f"{module} does not define {missing}"
        for name in names:  # the registry rebuilds each from its name
            assert name in registry.known_transforms()


def test_families_import_no_other_family_nor_the_search():
    families = registry.families()
    bad = []
    for module in families:
        imported = _imported_modules(_parse(module))
        for other in [*families, *SEARCH_SIDE]:
            if other != module and other in imported:
                bad.append(f"{module} imports {other}")
    assert not bad, "\n".join(bad)


def test_search_and_quotas_ask_no_transform_by_name():
    names = [n for ns in registry.families().values() for n in ns]
    for module in ("rose_jax.optimize.search", "rose_jax.optimize.quotas"):
        tree = _parse(module)
        named = sorted({n for s in _strings_outside_docstrings(tree) for n in names if n in s})
        assert not named, f"{module} names transforms in its code: {named}"
        families = sorted(set(registry.families()) & _imported_modules(tree))
        assert not families, f"{module} imports family modules {families}"


# -------------------------------------------------------------------- one file, one line

_FAMILY_SOURCE = '''
import jax.numpy as jnp

from rose_jax.optimize.base import FUSION_TOLERANCE, Transform
from rose_jax.optimize.interpret import rewrite
from rose_jax.optimize.predict import Candidate


def double_then_halve(where=None):
    """A fn-level rewrite that changes nothing: every scan rebuilt as it was."""

    def legal(tree):
        return True, "rebuilds every scan as it was"

    def apply(fn):
        return rewrite(fn, lambda site: True, lambda site, scan, invals, interp: interp.rebuild_scan(
            scan, invals, site.body_ctx))

    return Transform("double_then_halve", (("where", where),), FUSION_TOLERANCE, "fn", legal, apply)


def candidates(ctx):
    return [Candidate(double_then_halve(), "iteration", 1.0, "a test's model: one second")]
'''


def test_a_family_registered_at_run_time_is_generated_searched_and_rebuilt(monkeypatch):
    from rose_jax import optimize as O
    from rose_jax import trace as rtrace
    from rose_jax.optimize import candidates

    module = types.ModuleType("rose_test_family")
    exec(compile(_FAMILY_SOURCE, "rose_test_family.py", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "rose_test_family", module)
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    registry.register_family("rose_test_family", ("double_then_halve",))  # the one registry line

    def iteration(x):
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c), None), x, None, length=3)
        return y, {"s": y.sum()}

    x = jnp.linspace(-1.0, 1.0, 4)
    tree = rtrace.trace(iteration, x, arg_names=["state"])
    cands = candidates.generate_candidates(tree, None, 1e-3, families=("double_then_halve",))
    assert [c.transform.label for c in cands] == ["double_then_halve(where=None)"]
    assert registry.transform_by_name("double_then_halve", {"where": None}) == cands[0].transform
    _, report = O.optimize(iteration, x, families=("double_then_halve",), n_iters=1, repeats=1)
    (rec,) = report.candidates
    assert rec.legal and rec.equal is True and rec.prediction == "a test's model: one second"


def test_a_family_that_raises_is_reported_and_the_others_still_generate(monkeypatch):
    import pytest

    from rose_jax import trace as rtrace
    from rose_jax.optimize import candidates

    module = types.ModuleType("rose_broken_family")
    exec(compile(_FAMILY_SOURCE, "rose_broken_family.py", "exec"), module.__dict__)

    def broken(ctx):
        raise RuntimeError("cannot read this body")

    module.candidates = broken
    monkeypatch.setitem(sys.modules, "rose_broken_family", module)
    monkeypatch.setattr(registry, "_FAMILIES", {"rose_broken_family": ("double_then_halve",),
                                                **registry._FAMILIES})  # fmt: skip
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    registry.register_family("rose_broken_family", ("double_then_halve",))

    def iteration(x):
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c), None), x, None, length=3)
        return y, {"s": y.sum()}

    tree = rtrace.trace(iteration, jnp.linspace(-1.0, 1.0, 4), arg_names=["state"])
    with pytest.warns(UserWarning, match="rose_broken_family generated no candidates: RuntimeError"):
        wanted = ("double_then_halve", "unroll_scans")
        cands = candidates.generate_candidates(tree, None, 1e-3, families=wanted)
    assert cands and {c.transform.name for c in cands} == {"unroll_scans"}
