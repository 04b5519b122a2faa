"""forkjax's modules import each other without circles: every import statement, at module level or
inside a function, is an edge of a graph that must be acyclic (a package's __init__ is the node
of the package's name; a module is not taken to import its parent packages). Its packages are
layered too: models use lora's layers, lora never imports models, and no two packages import
each other."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "forkjax"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _edges(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, `level` up
                package = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert "forkjax.pallas_kernels.paged_attention.api" in graph  # the walk found the modules
    assert cycles(graph) == []


def test_only_the_api_modules_pick_kernel_backends():
    """The engine imports no kernel backend itself: only the ops' api modules."""
    graph = import_graph()
    backends = {m for m in graph if m.startswith("forkjax.pallas_kernels.")
                and m.rsplit(".", 1)[-1] in ("mosaic", "mosaic_operands", "triton", "reference")}
    for module, deps in graph.items():
        if not module.startswith("forkjax.pallas_kernels"):
            assert not deps & backends, (module, deps & backends)


def test_packages_are_layered():
    """The graph of forkjax's subpackages (forkjax.X.* collapsed to X) is acyclic."""
    packages: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        unit = module.split(".")[1] if module.count(".") else module
        packages.setdefault(unit, set()).update(d.split(".")[1] for d in deps if d.count("."))
    packages = {u: deps - {u} for u, deps in packages.items()}
    for u in list(packages):
        for d in packages[u]:
            packages.setdefault(d, set())
    assert "models" not in packages["lora"]
    assert cycles(packages) == []


def test_the_front_end_reaches_the_engine_through_the_protocol_only():
    """`python -m forkjax.serve` and the HTTP server import no module of the engine package,
    directly or not: the engine core process (server/core_proc.py) is reached through
    server/messages.py alone."""
    graph = import_graph()
    front = ["forkjax.serve"] + [m for m in graph if m.startswith("forkjax.server.")
                                 and m != "forkjax.server.core_proc"]
    seen, todo = set(), list(front)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            if module != "forkjax":  # the package imports Engine only when asked for it (lazily)
                todo.extend(graph[module])
    assert "forkjax.server.messages" in seen
    assert sorted(m for m in seen if m.startswith("forkjax.engine") or m == "forkjax.server.core_proc") == []


def test_the_cache_is_host_bookkeeping():
    """`import forkjax.cache` loads no jax: pools, trees and the host tier are host data, and the
    runtime (forkjax.runtime) owns everything on the device."""
    code = "import sys, forkjax.cache; print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax'}))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
