"""The architecture's rules, checked on the source: no import circle, the runtime library does not
import the algorithms or environments, no private name is used across modules outside tests; and
each algorithm's key schedule exists once (its program adapter follows a change to it).

The import walk reads every module of rose_jax/, algos/, envs/ and benchmarks/ with ``ast``
(nothing is imported); module-level and function-local imports both count as edges.
"""

from __future__ import annotations

import ast
import os
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rose_jax.compare import compare_trees

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("rose_jax", "algos", "envs", "benchmarks")
# the CLI is the composition root: it wires algorithms and environments into the library
LAYERING_EXEMPT = ("rose_jax.cli",)


class Module(NamedTuple):
    name: str  # dotted, e.g. "rose_jax.optimize.base" (a package: its __init__)
    path: str
    is_package: bool


class Import(NamedTuple):
    target: str  # the internal module imported
    line: int
    local: bool  # inside a function (or class) body


def _modules() -> dict[str, Module]:
    out = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[: -len(".py")]
                parts = rel.split(os.sep)
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts = parts[:-1]
                name = ".".join(parts)
                out[name] = Module(name, os.path.join(dirpath, f), is_package)
    return out


MODULES = _modules()


def _internal(name: str) -> str | None:
    """The longest internal module that ``name`` (a dotted import) refers to, else None."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in MODULES:
            return candidate
    return None


def _parse(module: Module) -> ast.Module:
    with open(module.path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=module.path)


def _walk_with_scope(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node, with whether it sits inside a function or class body."""

    def walk(node, local):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield child, local
            yield from walk(child, inner)

    yield from walk(tree, False)


def _base_of(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports_of(module: Module) -> list[Import]:
    """The internal modules ``module`` imports (``from pkg import sub`` names the submodule)."""
    out = []
    for node, local in _walk_with_scope(_parse(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _internal(alias.name)
                if target:
                    out.append(Import(target, node.lineno, local))
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(module, node)
            for alias in node.names:
                target = _internal(f"{base}.{alias.name}") or _internal(base)
                if target and target != module.name:
                    out.append(Import(target, node.lineno, local))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component with a cycle."""
    index, low, stack, on_stack, sccs, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v):  # Tarjan, iterative over an explicit work stack
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == node:
                        break
                if len(scc) > 1 or node in graph.get(node, ()):
                    sccs.append(set(scc))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for scc in sccs:
        start = min(scc)
        path, seen = [start], {start}
        while True:  # follow edges inside the component until a node repeats
            nxt = min(w for w in graph[path[-1]] if w in scc)
            if nxt in seen:
                cycles.append(path[path.index(nxt) :] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


GRAPH = {name: {i.target for i in imports_of(m)} for name, m in MODULES.items()}


def test_the_walk_sees_the_packages_and_their_imports():
    assert {"rose_jax.program", "rose_jax.optimize.base", "algos.ppo", "envs.core"} <= set(MODULES)
    assert "rose_jax.program" in GRAPH["rose_jax.optimize.base"]
    assert "rose_jax.program" in GRAPH["algos.ppo"]
    # a cycle in a made-up graph is found and reported as a path
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    cycles = _cycles(GRAPH)
    assert not cycles, "import circle(s): " + "; ".join(" -> ".join(c) for c in cycles)


def test_ppo_layouts_share_a_core_instead_of_importing_each_other():
    # algos.ppo dispatches to algos.ppo_brax (Brax's layout when PPOConfig.batch_size is set);
    # what both need lives in algos.ppo_core, which imports neither
    assert "algos.ppo_brax" in GRAPH["algos.ppo"]
    assert "algos.ppo" not in GRAPH["algos.ppo_brax"]
    assert {"algos.ppo", "algos.ppo_brax"} & GRAPH["algos.ppo_core"] == set()
    assert "algos.ppo_core" in GRAPH["algos.ppo"] and "algos.ppo_core" in GRAPH["algos.ppo_brax"]


def test_library_does_not_import_algorithms_or_environments():
    bad = []
    for name, module in MODULES.items():
        if not name.startswith("rose_jax") or name in LAYERING_EXEMPT:
            continue
        for imp in imports_of(module):
            if imp.target.split(".")[0] in ("algos", "envs"):
                bad.append(f"{module.path}:{imp.line} imports {imp.target}")
    assert not bad, "the runtime library imports algorithms/environments:\n" + "\n".join(bad)


def test_profiler_does_not_import_the_optimizer():
    # the profiler and the optimizer share the jaxpr layer and rose_jax.compare; the optimizer uses
    # the profiler (windows="profile"), never the other way round
    bad = [
        f"{module.path}:{imp.line} imports {imp.target}"
        for name, module in MODULES.items()
        if name == "rose_jax.profile" or name.startswith("rose_jax.profile.")
        for imp in imports_of(module)
        if imp.target == "rose_jax.optimize" or imp.target.startswith("rose_jax.optimize.")
    ]
    assert not bad, "rose_jax/profile imports rose_jax/optimize:\n" + "\n".join(bad)


def private_uses(module: Module) -> list[str]:
    """``module._name`` / ``from m import _name`` on another internal module (dunders excepted)."""
    tree = _parse(module)
    aliases: dict[str, str] = {}  # local name -> internal module it is bound to
    found = []
    for node, _ in _walk_with_scope(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _internal(alias.name):
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(module, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
                elif _internal(base) and _is_private(alias.name):
                    found.append(f"{module.path}:{node.lineno}: from {base} import {alias.name}")

    for node, _ in _walk_with_scope(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = _dotted(node.value, aliases)
            if owner is not None and owner in MODULES and owner != module.name:
                found.append(f"{module.path}:{node.lineno}: {owner}.{node.attr}")
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The internal module an expression like ``sac`` or ``rose_jax.optimize.search`` names."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value, aliases)
        return f"{owner}.{node.attr}" if owner is not None else None
    return None


def test_private_uses_are_detected():
    fake = Module("rose_jax.fake", os.path.join(ROOT, "tests", "_arch_fake.py"), False)
    src = (
        "from algos import sac\nfrom rose_jax.optimize.search import _close\nsac._collect(1)\nsac.iteration\n"
    )
    os.makedirs(os.path.dirname(fake.path), exist_ok=True)
    try:
        with open(fake.path, "w", encoding="utf-8") as f:
            f.write(src)
        found = private_uses(fake)
    finally:
        os.remove(fake.path)
    assert len(found) == 2 and "import _close" in found[0] and "algos.sac._collect" in found[1]


def test_no_private_name_used_across_modules():
    bad = [line for module in MODULES.values() for line in private_uses(module)]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------ key schedules


def _swap(split_keys):
    """The same keys in reverse order: a different schedule, as a change in the algorithm would be."""

    def swapped(key):
        return tuple(reversed(split_keys(key)))

    return swapped


def _bitwise_equal(a, b) -> bool:
    """Two iterations' (state, metrics), every leaf bitwise (rtol = atol = 0). A NaN equals nothing in
    compare_trees: the metrics' episode_return (NaN while no episode has finished) must be NaN at
    the same places on both sides, and is then compared as 0."""
    (sa, ma), (sb, mb) = a, b
    if not np.array_equal(np.isnan(ma.episode_return), np.isnan(mb.episode_return)):
        return False

    def fill(m):
        return m._replace(episode_return=jnp.where(jnp.isnan(m.episode_return), 0.0, m.episode_return))

    cmp = compare_trees((sa, fill(ma)), (sb, fill(mb)))
    return cmp.equal and cmp.max_abs == 0.0


def _two(step, state):
    for _ in range(2):
        state, metrics = step(state)
    return state, metrics


@pytest.fixture(scope="module")
def pendulum():
    import envs

    return envs.make("pendulum")


def _tiny(algo: str):
    """(algorithm module, a tiny config) for a 2-iteration run on pendulum."""
    from algos import ppo, sac

    module = {"ppo": ppo, "sac": sac}[algo]
    if algo == "ppo":
        return module, module.PPOConfig(num_envs=4, unroll_length=4, num_minibatches=2, num_epochs=1,
                                        policy_hidden_sizes=(8,), value_hidden_sizes=(8,))
    return module, module.SACConfig(num_timesteps=1000, num_envs=4, batch_size=8, grad_updates_per_step=2,
                                    min_replay_size=16, max_replay_size=256, policy_hidden_sizes=(8,),
                                    q_hidden_sizes=(8,), num_eval_envs=0)


@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_program_adapter_follows_the_algorithm_key_schedule(algo, pendulum, monkeypatch):
    """Change ONLY the algorithm's key schedule: its own iteration changes, and its program
    adapter still equals it bitwise (the adapter has no copy of the schedule)."""
    module, config = _tiny(algo)
    state = module.init(config, pendulum, jax.random.PRNGKey(0))
    before = _two(jax.jit(module.iteration(config, pendulum)), state)
    monkeypatch.setattr(module, "split_keys", _swap(module.split_keys))  # the only change
    own = _two(jax.jit(module.iteration(config, pendulum)), state)
    adapter = _two(jax.jit(module.program(config, pendulum).iteration()), state)
    assert not _bitwise_equal(own, before), f"the swapped schedule must change {algo}'s results"
    assert _bitwise_equal(adapter, own)
