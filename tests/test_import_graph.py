"""Dependencies run one way: the product imports neither the harness nor the baselines, and no
two project files import each other in a circle (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = "vllm_omni_edge"
TREES = (PRODUCT, "vllm_omni_edge_bench")


def project_modules() -> dict[str, Path]:
    modules = {}
    for tree in TREES:
        for path in (REPO / tree).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> project modules it imports anywhere in its body (the longest module prefix
    of each imported name: ``from a.b import c`` is ``a.b.c`` when that is a module)."""
    def resolve(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {resolve(f"{node.module}.{a.name}") or resolve(node.module) for a in node.names}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def is_product(module: str) -> bool:
    return module == PRODUCT or module.startswith(PRODUCT + ".")


def test_the_product_imports_neither_the_harness_nor_the_baselines():
    graph = import_graph(project_modules())
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() if is_product(m)
                   for t in targets if not is_product(t))
    assert not wrong, wrong


def test_no_import_circles():
    assert cycles(import_graph(project_modules())) == []


def test_the_checker_finds_a_circle_and_a_function_local_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from vllm_omni_edge.cli import serve\n")
    assert import_graph({"m": module, "vllm_omni_edge.cli.serve": module})["m"] == {"vllm_omni_edge.cli.serve"}
