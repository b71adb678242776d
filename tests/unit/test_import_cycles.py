"""No import cycle in the package, at a module's top or inside a function.

A function-level import that closes a cycle works only because Python finds the other module
half-initialised or already loaded by then; it hides which module depends on which, and the day one
of them gains a top-level import of the other, importing either fails. The walk below reads every
module of ``megatron_pg_agg/`` and of ``patches/`` (shipped as ``megatron_pg_agg.patches``) as
text, so it sees every import, whatever stack is installed."""
from __future__ import annotations

from tests.support.package_imports import MODULES, imports


def _imported(module: str) -> set[str]:
    """The package's own modules ``module`` imports (itself left out)."""
    return {name for name in imports(MODULES[module]) if name in MODULES and name != module}


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
    assert "megatron_pg_agg.patches._machinery" in _imported("megatron_pg_agg.patches.cpu.cpu_gloo")
    assert "megatron_pg_agg.integrations.bridge.cpu" in _imported("megatron_pg_agg.integrations.bridge.hf_model")
    assert "megatron_pg_agg.online.main_job" in _imported("megatron_pg_agg.online.cli")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back_through_another():
    graph = {module: _imported(module) for module in MODULES}
    cycles = _cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "\n".join(described)
