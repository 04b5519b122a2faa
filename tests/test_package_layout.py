"""The import graph of forkjax's packages has no cycle: models use lora's layers, lora never
imports models, and engine, server sit above both (read from the sources, nothing imported).

`python tests/test_package_layout.py` prints the graph: package -> the packages it imports.
"""

import ast
import os
import sys
from collections import defaultdict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "forkjax")
PACKAGES = ("lora", "models", "cache", "engine", "server")
IGNORED = ("pallas_kernels",)  # kernels: their own layering


def _unit(module: str) -> str | None:
    """'forkjax.lora.slots' -> 'lora'; 'forkjax.config' -> 'config'; 'forkjax' -> 'forkjax'."""
    parts = module.split(".")
    if parts[0] != "forkjax":
        return None
    return parts[1] if len(parts) > 1 else "forkjax"


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{unit: {imported unit: [file:line, ...]}} over every import statement in forkjax/,
    function-level ones included (a lazy import is still a dependency)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            src = _unit(("forkjax." + rel[:-3].replace(os.sep, ".")).removesuffix(".__init__"))
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    # `from forkjax import cache` names a package, `from forkjax.x import y` a member
                    targets = ([f"{node.module}.{a.name}" for a in node.names]
                               if node.module == "forkjax" else [node.module])
                else:
                    continue
                for target in targets:
                    dst = _unit(target)
                    if dst is not None and dst != src:
                        graph[src][dst].append(f"{rel}:{node.lineno}")
    return graph


def find_cycle(graph, nodes) -> list[str] | None:
    """A cycle among `nodes` (edges to other nodes are followed too), or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done

    def visit(n, stack):
        state[n] = 1
        for m in graph.get(n, {}):
            if m in IGNORED:
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m] if m in stack else [n, m]
            if m not in state:
                found = visit(m, stack + [m])
                if found:
                    return found
        state[n] = 2
        return None

    for n in nodes:
        if n not in state:
            found = visit(n, [n])
            if found:
                return found
    return None


def test_no_import_cycle_between_packages():
    graph = import_graph()
    cycle = find_cycle({k: v for k, v in graph.items() if k not in IGNORED}, PACKAGES)
    if cycle:
        edges = [f"{a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle " + " -> ".join(cycle) + "\n" + "\n".join(edges))


def test_lora_does_not_import_models():
    assert "models" not in import_graph().get("lora", {}), import_graph()["lora"]["models"]


if __name__ == "__main__":
    g = import_graph()
    for unit in sorted(g):
        print(f"{unit:15} -> {', '.join(sorted(g[unit]))}")
    print("cycle:", find_cycle({k: v for k, v in g.items() if k not in IGNORED}, PACKAGES))
    sys.exit(0)
