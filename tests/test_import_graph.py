"""The package's import graph (every `import` statement, read with ast, lazy ones included):
no cycles, and the layers only import downwards: kernels/ and models/ never import runtime/,
kernels/ never imports models/, selector/, options or config (kernels take implementation names
and plain numbers)."""

from __future__ import annotations

import ast
import pathlib

import sfi_jax

ROOT = pathlib.Path(sfi_jax.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = ("sfi_jax",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the sfi_jax modules it imports}, for every module of the package."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, stack)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def _package_inits(graph):
    """Edges through a package's __init__ are re-exports; count each package's own modules."""
    return {m for m in graph if any(o.startswith(m + ".") for o in graph)}


def test_no_import_cycles():
    graph = import_graph()
    inits = _package_inits(graph)
    # a package __init__ re-exporting its own modules is not a cycle through them
    graph = {m: {d for d in deps if not (m in inits and d.startswith(m + "."))}
             for m, deps in graph.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_layers_import_downwards():
    graph = import_graph()
    forbidden = {"sfi_jax.kernels": ("sfi_jax.runtime", "sfi_jax.models", "sfi_jax.selector",
                                     "sfi_jax.options", "sfi_jax.config"),
                 "sfi_jax.models": ("sfi_jax.runtime", "sfi_jax.selector"),
                 "sfi_jax.selector": ("sfi_jax.runtime", "sfi_jax.models")}
    bad = [(m, d) for m, deps in graph.items() for d in deps
           for layer, below in forbidden.items()
           if (m == layer or m.startswith(layer + ".")) and d.startswith(below)]
    assert bad == []


def test_graph_sees_the_imports():
    """The checks above can fail: the graph holds known edges."""
    graph = import_graph()
    assert "sfi_jax.kernels.common" in graph["sfi_jax.options"]
    assert "sfi_jax.kernels.common" in graph["sfi_jax.selector.select"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
