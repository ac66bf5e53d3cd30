"""Modules of a package import one another one way: no cycle, counting the imports inside functions too.

A lazy import inside a function hides a cycle from Python but not from a reader: runtime.bench and runtime.graph
imported each other (the decode loop timed its calls with the bench's timer), runtime.load and
runtime.routed_experts did (the routed experts allocated through the loader that builds them), and ten planner
modules were one cycle (planner.plan.bounds imported the modules whose config checks read its config.json table, and
planner.model.experts and planner.model.model_config each other). Imports for type annotations only (``if
TYPE_CHECKING:``)
run nowhere and are not counted.
"""

import ast

import pytest

from tests.conftest import REPO_ROOT


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body (``from a import b`` counts a.b where
    that is a module)."""
    modules = {".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): path
               for path in sorted((REPO_ROOT / package).rglob("*.py"))}
    graph = {}
    for name, path in modules.items():
        found = set()
        tree = ast.parse(path.read_text())
        for block in ast.walk(tree):  # annotation-only imports: emptied before the walk
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
                block.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {module for module in found if module in modules and module != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_are_found_through_imports_inside_functions():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["planner", "runtime", "offload_plan"])
def test_package_imports_have_no_cycle(package):
    assert cycles(import_graph(package)) == []


def test_benchmark_timing_and_generation_live_outside_the_bench():
    graph = import_graph("runtime")
    assert "runtime.bench" not in graph["runtime.graph"]
    assert "runtime.load" not in graph["runtime.routed_experts"]
    assert "runtime.bench" not in graph["runtime.generate"]


def test_annotation_only_imports_are_not_counted():
    assert "planner.model.layout" in import_graph("planner")["planner.model.cost"]
    assert "planner.model.layout" not in import_graph("planner")["planner.model.experts"]  # under TYPE_CHECKING only
