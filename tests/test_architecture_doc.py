"""docs/ARCHITECTURE.md names only what exists: every path in backticks (``envs/core.py``,
``rose_jax/optimize/``) is a file or folder of the repository, and every dotted name under one of
the packages (``rose_jax.trace.trace``, ``algos.ppo``) is a module or a name defined in one."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "ARCHITECTURE.md")
PACKAGES = ("rose_jax", "algos", "envs", "benchmarks")

_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]*)+$|^[A-Za-z0-9_\-]+\.(py|md|sh|toml)$")
_DOTTED = re.compile(r"^(%s)(\.[A-Za-z_][A-Za-z0-9_]*)+$" % "|".join(PACKAGES))


def _doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def _code_spans(text: str) -> list[str]:
    return _CODE.findall(text)


def paths_in(text: str) -> list[str]:
    """Backticked spans that look like repository paths (a slash, or a file name with a suffix)."""
    return [s for s in _code_spans(text) if _PATH.match(s)]


def dotted_in(text: str) -> list[str]:
    """Backticked dotted names under the project's packages, e.g. ``rose_jax.trace.trace``."""
    out = []
    for s in _code_spans(text):
        name = s.split("(", 1)[0]  # ``envs.make(name, **kw)`` -> envs.make
        if _DOTTED.match(name):
            out.append(name)
    return out


def _module_file(dotted: str) -> str | None:
    base = os.path.join(ROOT, *dotted.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def dotted_exists(dotted: str) -> bool:
    """A module, or a top-level name (def, class, assignment, import) of the longest module prefix."""
    if _module_file(dotted):
        return True
    parts = dotted.split(".")
    for k in range(len(parts) - 1, 0, -1):
        path = _module_file(".".join(parts[:k]))
        if path is None:
            continue
        if k != len(parts) - 1:
            return False  # attribute of an attribute: not checked, so not allowed in the doc
        with open(path, encoding="utf-8") as f:
            src = f.read()
        name = re.escape(parts[-1])
        defined = rf"^(def|class)\s+{name}\b|^{name}\s*[:=]"
        imported = rf"^\s*(from\s+\S+\s+)?import\b.*\b{name}\b"
        return bool(re.search(defined, src, re.M) or re.search(imported, src, re.M))
    return False


def test_every_backticked_path_exists():
    paths = paths_in(_doc())
    assert len(paths) > 40, f"expected the document to name the packages and modules, found {paths}"
    missing = [p for p in dict.fromkeys(paths) if not os.path.exists(os.path.join(ROOT, p.rstrip("/")))]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_templated_paths_name_existing_folders():
    """``envs/<name>.py``: the part before the placeholder is a folder of the repository."""
    templates = [s for s in _code_spans(_doc()) if "/" in s and "<" in s and " " not in s]
    assert templates, "expected the how-to sections to name where new files go"
    missing = [t for t in templates if not os.path.isdir(os.path.join(ROOT, t.split("<", 1)[0]))]
    assert not missing, f"docs/ARCHITECTURE.md puts new files in folders that do not exist: {missing}"


def test_every_dotted_name_exists():
    names = dotted_in(_doc())
    assert names, "expected dotted names such as rose_jax.trace.trace in the document"
    missing = [n for n in dict.fromkeys(names) if not dotted_exists(n)]
    assert not missing, f"docs/ARCHITECTURE.md names modules or functions that do not exist: {missing}"


@pytest.mark.parametrize(
    "text, paths, dotted",
    [
        (
            "see `envs/core.py` and `rose_jax/optimize/` and `README.md`",
            ["envs/core.py", "rose_jax/optimize/", "README.md"],
            [],
        ),
        ('`rose_jax.trace.trace(fn, *args)`, `algos.get("ppo")`', [], ["rose_jax.trace.trace", "algos.get"]),
        ("`state -> (state, metrics)` and `\"module:factory\"`", [], []),
    ],
)
def test_the_extraction_finds_paths_and_names(text, paths, dotted):
    assert paths_in(text) == paths
    assert dotted_in(text) == dotted


def test_the_checks_refuse_what_does_not_exist():
    assert not os.path.exists(os.path.join(ROOT, "rose_jax/optimize/no_such_module.py"))
    assert paths_in("`rose_jax/optimize/no_such_module.py`") == ["rose_jax/optimize/no_such_module.py"]
    assert dotted_exists("rose_jax.trace.trace") and dotted_exists("rose_jax.optimize.search")
    assert dotted_exists("algos.get") and dotted_exists("envs.make")
    assert not dotted_exists("rose_jax.trace.no_such_function")
    assert not dotted_exists("rose_jax.no_such_package.thing")
