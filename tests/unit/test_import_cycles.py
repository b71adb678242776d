"""No import cycle in the package, at a module's top or inside a function.

A function-level import that closes a cycle works only because Python finds the other module
half-initialised or already loaded by then; it hides which module depends on which, and the day one
of them gains a top-level import of the other, importing either fails. The walk below reads every
module of ``megatron_pg_agg/`` and of ``patches/`` (shipped as ``megatron_pg_agg.patches``) as
text, so it sees every import, whatever stack is installed."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = {"megatron_pg_agg": ROOT / "megatron_pg_agg", "megatron_pg_agg.patches": ROOT / "patches"}
"""Dotted package -> the folder it is shipped from (setup.py's package_dir)."""


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__.py``)."""
    found = {}
    for package, folder in TREES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """The package's modules ``module`` imports anywhere in its text. ``from P import n`` is an
    import of ``P.n`` where that is a module, else of ``P`` (a name its ``__init__`` defines)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join((*parts, *([base] if base else [])))
            for alias in node.names:
                inner = f"{base}.{alias.name}"
                names.add(inner if inner in MODULES else base)
    return {name for name in names if name in MODULES and name != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_function_level_imports_and_the_shipped_patches():
    """The walk is not vacuous: it knows the patches folder under its shipped name, resolves relative
    imports there, and reads imports made inside a function (the HF opener applies Megatron-Bridge's
    CPU stand-ins in one; the main job's command line loads the online job in one)."""
    def imported(module):
        return _imported(module, MODULES[module])

    assert "megatron_pg_agg.patches._machinery" in imported("megatron_pg_agg.patches.cpu.cpu_gloo")
    assert "megatron_pg_agg.integrations.bridge.cpu" in imported("megatron_pg_agg.integrations.bridge.hf_model")
    assert "megatron_pg_agg.online.main_job" in imported("megatron_pg_agg.online.cli")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back_through_another():
    graph = {module: _imported(module, path) for module, path in MODULES.items()}
    cycles = _cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "\n".join(described)
